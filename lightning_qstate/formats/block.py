"""Block-scaled formats: per-block absmax scale, codes from a codebook or a minifloat.

A tensor of ``n`` values is split, flat, into ``ceil(n / block_size)`` blocks.
Each block stores its absmax as an fp32 scale and each value as a code of
``bits`` bits, packed two per byte at 4 bits or fewer.

Non-finite input: the block's absmax is inf or NaN. By default ``quantize``
raises :class:`NonFiniteError` (policy ``nonfinite="raise"``). With
``nonfinite="nan_block"`` that block's scale is stored as NaN so the whole block
dequantizes to NaN: a non-finite value never becomes a finite code.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from typing import Literal

import torch

from .base import NonFiniteError, QuantizedTensor, StorageFormat, kernel_backend, uniform_like
from .codebooks import CodebookIndex, MinifloatSpec, NearestCodeIndex
from .packing import as_blocks, num_blocks, pack, packed_numel, unpack
from .rounding import Rounding, encode_codebook, encode_minifloat, lookup

NonFinitePolicy = Literal["raise", "nan_block"]
NONFINITE_POLICIES: tuple[str, ...] = ("raise", "nan_block")


def check_block_size(block_size: int) -> int:
    if not isinstance(block_size, int) or block_size < 2 or block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size!r} must be a power of two >= 2 (e.g. 64, 128, 256)")
    return block_size


class BlockFormat(StorageFormat):
    """Common machinery of block-scaled formats; subclasses define ``decode_values`` and ``encode``."""

    def __init__(self, name: str, bits: int, block_size: int, signed: bool, nonfinite: NonFinitePolicy) -> None:
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite={nonfinite!r} is not a policy; use one of {NONFINITE_POLICIES}")
        self.name = name
        self.bits = bits
        self.block_size = check_block_size(block_size)
        self.signed = signed
        self.nonfinite = nonfinite
        self._device_tables: dict[torch.device, dict[str, torch.Tensor | CodebookIndex]] = {}

    @abstractmethod
    def decode_values(self) -> torch.Tensor:
        """``(2**bits,)`` fp32 normalized value of every code, in ``[-1, 1]``."""

    @abstractmethod
    def encode(self, normalized: torch.Tensor, rounding: Rounding, uniform: torch.Tensor | None) -> torch.Tensor:
        """int32 codes of ``normalized`` values in ``[-1, 1]`` (torch reference)."""

    def tables(self, device: torch.device) -> dict:
        """Lookup tables on ``device`` (cached): ``decode`` plus whatever the encoder needs."""
        if device not in self._device_tables:
            self._device_tables[device] = {key: value.to(device) for key, value in self._make_tables().items()}
        return self._device_tables[device]

    def _make_tables(self) -> dict:
        return {"decode": self.decode_values()}

    def nbytes(self, numel: int) -> int:
        code_bytes = packed_numel(numel, self.bits) * (1 if self.bits <= 8 else 2)
        return code_bytes + 4 * num_blocks(numel, self.block_size)

    def quantize(self, x: torch.Tensor, rounding: Rounding = "nearest", generator: torch.Generator | None = None) -> QuantizedTensor:
        flat = self._check_input(x, rounding)
        backend = kernel_backend(flat.device)
        if backend is not None:
            codes, scales = backend.quantize_blocks(self, flat, rounding, generator)
        else:
            codes, scales = self.quantize_reference(flat, rounding, generator)
        if self.nonfinite == "raise" and not torch.isfinite(scales).all():
            bad = int((~torch.isfinite(scales)).sum())
            raise NonFiniteError(
                f"format {self.name!r}: {bad} block(s) of {self.block_size} values hold inf or NaN. "
                "Pass finite values, or get_format(..., nonfinite='nan_block') to store those blocks as NaN."
            )
        return QuantizedTensor(self, codes, scales, x.shape, x.dtype)

    def quantize_reference(self, flat: torch.Tensor, rounding: Rounding, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Torch reference: ``(n,)`` -> (packed codes, ``(num_blocks,)`` scales with NaN for non-finite blocks)."""
        blocks = as_blocks(flat.float(), self.block_size)
        absmax = blocks.abs().amax(dim=1)
        finite = torch.isfinite(absmax)
        blocks = torch.where(finite[:, None], blocks, 0.0)  # branch-free, so torch.compile keeps one graph
        divisor = torch.where(finite & (absmax > 0), absmax, 1.0)
        normalized = blocks / divisor[:, None]
        uniform = uniform_like(normalized, generator) if rounding == "stochastic" else None
        codes = self.encode(normalized, rounding, uniform).view(-1)[: flat.numel()]
        scales = torch.where(finite, absmax, float("nan"))
        return pack(codes, self.bits), scales

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or q.dtype
        backend = kernel_backend(q.device)
        if backend is not None:
            flat = backend.dequantize_blocks(self, q, dtype)
        else:
            flat = self.dequantize_reference(q.codes, q.scales, q.numel).to(dtype)
        return flat.view(q.shape)

    def dequantize_reference(self, codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        """Torch reference: packed codes + scales -> ``(numel,)`` fp32."""
        values = self.unit_values_reference(codes, None, numel)
        return (as_blocks(values, self.block_size) * scales[:, None]).view(-1)[:numel]

    def unit_values_reference(self, codes: torch.Tensor, scales: torch.Tensor | None, numel: int) -> torch.Tensor:
        """``(numel,)`` fp32 ``decode[code]`` in ``[-1, 1]``: each value in units of its block's scale (``scales`` unused)."""
        return lookup(self.tables(codes.device)["decode"], unpack(codes, self.bits, numel))


class CodebookFormat(BlockFormat):
    """Block absmax scaling into a sorted codebook (dynamic-tree or linear map); code = index in the codebook."""

    def __init__(self, name: str, codebook: torch.Tensor, block_size: int, signed: bool, nonfinite: NonFinitePolicy = "raise") -> None:
        bits = max(1, (codebook.numel() - 1).bit_length())
        super().__init__(name, bits, block_size, signed, nonfinite)
        self.codebook = codebook
        self.index = CodebookIndex.build(codebook)

    @functools.cached_property
    def nearest_index(self) -> NearestCodeIndex | None:
        """The C++ CPU kernel's encoder (CPU tensors), built on first use; ``None`` where no bucket table fits."""
        return NearestCodeIndex.build(self.codebook)

    def decode_values(self) -> torch.Tensor:
        return self.codebook.to(torch.float32)

    def _make_tables(self) -> dict:
        return {"decode": self.decode_values(), "index": self.index}

    def encode(self, normalized: torch.Tensor, rounding: Rounding, uniform: torch.Tensor | None) -> torch.Tensor:
        return encode_codebook(normalized, self.tables(normalized.device)["index"], rounding, uniform)


class MinifloatFormat(BlockFormat):
    """Block absmax scaling into an ExMy minifloat (FP8 E4M3/E5M2, e2m2, e3m0, ...).

    The block absmax maps to the format's largest finite value; codes are the
    minifloat's sign-magnitude bit patterns (for FP8, the OCP bit patterns).

    ``zero_free`` formats (those ``get_format`` makes for non-negative states such as Adam's
    ``v``: unsigned ExMy, and FP8 with ``signed=False``, which keeps the OCP bit patterns) are
    like torchao's 4-bit ``v`` map: magnitudes below the smallest positive value are stored
    as it. A ``v`` flushed to 0 next to a nonzero ``m`` would make Adam's step ``m / eps``;
    e2m2's smallest positive value is only 1/28 of the block's absmax, and SR sends tiny FP8
    values to 0 often. A block whose absmax is 0 still reads back as zeros (its scale is 0).
    """

    def __init__(self, name: str, spec: MinifloatSpec, block_size: int, nonfinite: NonFinitePolicy = "raise", zero_free: bool = False) -> None:
        super().__init__(name, spec.bits, block_size, spec.signed, nonfinite)
        self.spec = spec
        self.max_value = spec.max_value
        self.zero_free = zero_free

    @property
    def min_code(self) -> int:
        """Smallest magnitude code the encoder writes: 1 when ``zero_free``, else 0."""
        return int(self.zero_free)

    @property
    def is_float(self) -> bool:
        return True

    def decode_values(self) -> torch.Tensor:
        return (self.spec.values() / self.max_value).to(torch.float32)

    def encode(self, normalized: torch.Tensor, rounding: Rounding, uniform: torch.Tensor | None) -> torch.Tensor:
        magnitude = normalized.abs() if self.signed else normalized.clamp(min=0)
        code = encode_minifloat(magnitude * self.max_value, self.spec, rounding, uniform).clamp(min=self.min_code)
        if self.signed:
            code = code | ((normalized < 0).to(torch.int32) << (self.bits - 1))
        return code
