"""Block-scaled formats: per-block absmax scale, codes from a codebook or a minifloat.

A tensor of ``n`` values is split, flat, into ``ceil(n / block_size)`` blocks.
Each block stores one scale and each value as a code of ``bits`` bits, packed
two per byte at 4 bits or fewer and eight to ``bits`` bytes at 5 to 7 bits
(:mod:`lightning_qstate.formats.packing`). The scale is the block's absmax, either in fp32
(``scale_dtype="fp32"``: 4 bytes per block, as torchao and bitsandbytes store
it) or rounded *up* to a bf16 value (``scale_dtype="bf16"``: 2 bytes per block;
every normalized value stays in ``[-1, 1]``, and the code grid stretches by less
than ``2**-7``; by up to one bf16 subnormal step, ``2**-133``, where the absmax is below fp32's
smallest normal value ``2**-126``: up to 1.38 times at an absmax of 2e-40).

The default follows the state (``scale_dtype=None``): **formats for signed states
get bf16 scales, those for non-negative states (``signed=False`` in ``get_format``)
fp32.** Signed states are first moments (Adam's ``m``, momentum), whose block
absmax moves by ~10 % a step at ``β1 = 0.9``, far more than bf16's grid of
0.4-0.8 %: the rounded scale follows it, and measured stall rates do not change.
Non-negative states are second moments (``v``), whose absmax moves by ~0.1 % a
step at ``β2 = 0.999``, below that grid: a bf16 scale would itself stall, hold
the block's largest entry on its top code, and ratchet ``v`` upwards (measured:
int8 ``v`` of unit-variance noise settles at 1.25 with bf16 scales against 1.06
with fp32). Adam's two int8 states at the default block of 256 take 2.0234 bytes
per parameter (2.0313 with fp32 scales throughout).

**Zero-free formats** (``zero_free``: every format ``get_format`` makes for a non-negative state, ``signed=False``)
never store a value ``>= 0`` as a code that reads 0: the encoder clamps its code up to ``min_code``, the code of the
smallest positive value, after rounding (RN and SR alike; the codebooks and the meaning of every code are unchanged).
Adam's ``v`` flushed to 0 next to a nonzero ``m`` would make the step ``m / eps`` (issue #15: ``w = -4.21`` where
torch's AdamW gives ``-0.00167``). A value below the smallest positive code is stored as that code: ``v`` may read too
large by the format's own resolution (a smaller step), never 0; SR stays unbiased above that code and rounds up below
it. Exact zeros take ``min_code`` too: one clamp, the same in every implementation. It changes no step: ``v`` is
exactly 0 only where every gradient so far was 0, so ``m`` is exactly 0 there as well and the step is 0 whatever
``v`` reads; once a gradient arrives, ``v`` carries at most ``decode[min_code] * scale`` of it, the floor every tiny
positive ``v`` of the block gets anyway. A block whose absmax is 0 still reads back as zeros (its scale is 0), so
zero-initialised states stay exactly zero. :meth:`BlockFormat.lift_zero_codes` rewrites codes written by older
versions (which stored code 0 there) as this one writes them.

Non-finite input: the block's absmax is inf or NaN. By default ``quantize``
raises :class:`NonFiniteError` (policy ``nonfinite="raise"``). With
``nonfinite="nan_block"`` that block's scale is stored as NaN so the whole block
dequantizes to NaN: a non-finite value never becomes a finite code.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Literal

import torch

from .base import NonFiniteError, QuantizedTensor, StorageFormat, kernel_backend, narrows_range, saturating_cast, uniform_like
from .codebooks import CodebookIndex, MinifloatSpec
from .packing import GROUP, as_blocks, container_dtype, is_dense, num_blocks, pack, packed_numel, unpack
from .rounding import Rounding, encode_codebook, encode_minifloat, lookup

NonFinitePolicy = Literal["raise", "nan_block"]
NONFINITE_POLICIES: tuple[str, ...] = ("raise", "nan_block")
ScaleDtype = Literal["bf16", "fp32"]
SCALE_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp32": torch.float32}
SCALE_DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in SCALE_DTYPES.items()}
BF16_MAX = torch.finfo(torch.bfloat16).max


def round_up_to_bf16(magnitude: torch.Tensor) -> torch.Tensor:
    """fp32 ``magnitude`` (>= 0) rounded up to a bf16 value, still fp32; saturates at bf16's largest; inf/NaN unchanged.

    The same as adding ``0xFFFF`` to the fp32 bit pattern and clearing the low 16 bits (what the kernels do), in
    float operations that ``torch.compile`` vectorizes: round to nearest bf16, and where that fell below, step up
    one bf16 spacing (``2^-8 + 2^-10`` of the value rounds to exactly one; a fixed ``2^-133`` among subnormals).
    Compiled, it needs inductor's ``emulate_precision_casts`` (see ``kernels.compiled.compiled_adam_step``).
    """
    nearest = magnitude.to(torch.bfloat16).float()
    step = torch.where(nearest < 2.0**-126, 2.0**-133, nearest * (2.0**-8 + 2.0**-10))
    rounded = torch.where(nearest < magnitude, (nearest + step).to(torch.bfloat16).float(), nearest)
    return torch.where(torch.isfinite(magnitude), rounded.clamp(max=BF16_MAX), magnitude)


def check_block_options(nonfinite: str, scale_dtype: str | None) -> None:
    """Raise ``ValueError`` for a ``nonfinite`` policy or ``scale_dtype`` that is not one (``None``: the default scale)."""
    if not isinstance(nonfinite, str) or nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite={nonfinite!r} is not a policy; use one of {NONFINITE_POLICIES}")
    if scale_dtype is not None and (not isinstance(scale_dtype, str) or scale_dtype not in SCALE_DTYPES):
        raise ValueError(
            f"scale_dtype={scale_dtype!r} is not a scale type; use one of {tuple(SCALE_DTYPES)} or None (bf16 if signed, else fp32)"
        )


def is_block_size(value: object) -> bool:
    """Whether ``value`` is a block size: an int power of two >= 2 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 2 and not value & (value - 1)


def check_block_size(block_size: int) -> int:
    if not is_block_size(block_size):
        raise ValueError(f"block_size={block_size!r} must be a power of two >= 2 (e.g. 64, 128, 256)")
    return block_size


class BlockFormat(StorageFormat):
    """Common machinery of block-scaled formats; subclasses define ``decode_values`` and ``encode``, and set ``min_code``.

    Attributes:
        zero_free: the encoder never writes a code that reads 0 for a value ``>= 0`` (see the module docstring).
        min_code: the code a value ``>= 0`` is clamped up to after rounding (its magnitude code, for minifloats):
            that of the smallest positive value when ``zero_free``, else 0 (no clamp). Every encoder (torch,
            Triton, C++) applies it.
    """

    min_code: int

    def __init__(
        self,
        name: str,
        bits: int,
        block_size: int,
        signed: bool,
        nonfinite: NonFinitePolicy,
        scale_dtype: ScaleDtype | None,
        nonnegative: bool,
        zero_free: bool,
    ) -> None:
        """``nonnegative``: the format is made for a non-negative (second-moment) state; it picks the default ``scale_dtype``."""
        check_block_options(nonfinite, scale_dtype)
        if scale_dtype is None:
            scale_dtype = "fp32" if nonnegative else "bf16"  # see the module docstring
        self.name = name
        self.bits = bits
        self.block_size = check_block_size(block_size)
        if is_dense(bits) and block_size < GROUP:
            raise ValueError(
                f"format {name!r}: block_size={block_size} is too small for {bits}-bit codes, which pack {GROUP} to {bits} bytes; "
                f"use a power of two >= {GROUP}"
            )
        self.signed = signed
        self.nonfinite = nonfinite
        self.scale_dtype: torch.dtype = SCALE_DTYPES[scale_dtype]
        self.zero_free = zero_free
        self._device_tables: dict[torch.device, dict[str, torch.Tensor | CodebookIndex]] = {}

    @abstractmethod
    def decode_values(self) -> torch.Tensor:
        """``(2**bits,)`` fp32 normalized value of every code, in ``[-1, 1]``."""

    @abstractmethod
    def encode(self, normalized: torch.Tensor, rounding: Rounding, uniform: torch.Tensor | None) -> torch.Tensor:
        """int32 codes of ``normalized`` values in ``[-1, 1]`` (torch reference)."""

    def lift_zero_codes(self, codes: torch.Tensor, numel: int) -> torch.Tensor:
        """Codes written by an older version (checkpoint state version < 3) as this one writes them.

        ``codes``: the packed container of ``numel`` values. In a ``zero_free`` format, every code that reads 0 becomes
        ``min_code``, which the encoder now writes for those values (blocks whose scale is 0 still read 0); the
        padding nibble of an odd count of 4-bit codes stays 0. Returns new packed codes of the same dtype and size,
        or ``codes`` itself when the format is not zero-free.
        """
        if not self.zero_free:
            return codes
        unpacked = unpack(codes, self.bits, numel)
        reads_zero = lookup(self.tables(codes.device)["decode"], unpacked) == 0
        return pack(torch.where(reads_zero, self.min_code, unpacked), self.bits)

    def tables(self, device: torch.device) -> dict:
        """Lookup tables on ``device`` (cached): ``decode`` plus whatever the encoder needs."""
        if device not in self._device_tables:
            self._device_tables[device] = {key: value.to(device) for key, value in self._make_tables().items()}
        return self._device_tables[device]

    def _make_tables(self) -> dict:
        return {"decode": self.decode_values()}

    def nbytes(self, numel: int) -> int:
        code_bytes = packed_numel(numel, self.bits) * (1 if self.bits <= 8 else 2)
        return code_bytes + self.scale_dtype.itemsize * num_blocks(numel, self.block_size)

    def allocate(
        self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> QuantizedTensor:
        numel = math.prod(shape)
        codes = torch.zeros(packed_numel(numel, self.bits), dtype=container_dtype(self.bits), device=device)
        return QuantizedTensor(
            self, codes, torch.zeros(num_blocks(numel, self.block_size), dtype=self.scale_dtype, device=device), shape, dtype
        )

    def stored_scale(self, absmax: torch.Tensor) -> torch.Tensor:
        """The fp32 value of the scale stored for blocks of (finite, >= 0) ``absmax``: it, or it rounded up to bf16."""
        return round_up_to_bf16(absmax) if self.scale_dtype == torch.bfloat16 else absmax

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

    def quantize_reference(
        self, flat: torch.Tensor, rounding: Rounding, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Torch reference: ``(n,)`` -> (packed codes, ``(num_blocks,)`` scales in ``scale_dtype``, NaN for non-finite blocks)."""
        blocks = as_blocks(flat.float(), self.block_size)
        scale = self.stored_scale(blocks.abs()).amax(dim=1)  # = stored_scale(absmax): it is monotone
        finite = torch.isfinite(scale)
        blocks = torch.where(finite[:, None], blocks, 0.0)  # branch-free, so torch.compile keeps one graph
        divisor = torch.where(finite & (scale > 0), scale, 1.0)
        normalized = blocks / divisor[:, None]
        uniform = uniform_like(normalized, generator) if rounding == "stochastic" else None
        codes = self.encode(normalized, rounding, uniform).view(-1)[: flat.numel()]
        scales = torch.where(finite, scale, float("nan")).to(self.scale_dtype)  # exact: scale is a scale_dtype value
        return pack(codes, self.bits), scales

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The values of ``q`` in ``dtype`` (default: the quantized tensor's). In fp16 they saturate at its largest value:
        a block's scale is rounded up (a bf16 scale), so its top code can decode past the input's range (an fp16 65504
        under the scale 65536), which the cast would make inf."""
        dtype = dtype or q.dtype
        decoded = torch.float32 if narrows_range(torch.float32, dtype) else dtype
        backend = kernel_backend(q.device)
        if backend is not None:
            flat = backend.dequantize_blocks(self, q, decoded)
        else:
            flat = self.dequantize_reference(q.codes, q.scales, q.numel).to(decoded)
        return saturating_cast(flat, dtype).view(q.shape) if decoded != dtype else flat.view(q.shape)

    def dequantize_reference(self, codes: torch.Tensor, scales: torch.Tensor, numel: int) -> torch.Tensor:
        """Torch reference: packed codes + scales -> ``(numel,)`` fp32."""
        values = self.unit_values_reference(codes, numel)
        return (as_blocks(values, self.block_size) * scales.float()[:, None]).view(-1)[:numel]

    def unit_values_reference(self, codes: torch.Tensor, numel: int) -> torch.Tensor:
        """``(numel,)`` fp32 ``decode[code]`` in ``[-1, 1]``: each value in units of its block's scale."""
        return lookup(self.tables(codes.device)["decode"], unpack(codes, self.bits, numel))


class CodebookFormat(BlockFormat):
    """Block absmax scaling into a sorted codebook (dynamic-tree or linear map); code = index in the codebook.

    Unsigned formats (``signed=False``: for non-negative states) are ``zero_free``: a value below the smallest
    positive codebook value, 0 included, is stored as it (``min_code``; 1 for the unsigned ``int8``, ``int8_linear``
    and ``int4_linear`` maps, whose code 0 reads 0; 0 for unsigned ``int4``, whose linear map has no zero).
    """

    def __init__(
        self,
        name: str,
        codebook: torch.Tensor,
        block_size: int,
        signed: bool,
        nonfinite: NonFinitePolicy = "raise",
        scale_dtype: ScaleDtype | None = None,
    ) -> None:
        bits = max(1, (codebook.numel() - 1).bit_length())
        super().__init__(name, bits, block_size, signed, nonfinite, scale_dtype, nonnegative=not signed, zero_free=not signed)
        self.codebook = codebook
        self.index = CodebookIndex.build(codebook)
        self.min_code = int((codebook <= 0).sum()) if self.zero_free else 0  # the index of the smallest positive value

    def decode_values(self) -> torch.Tensor:
        return self.codebook.to(torch.float32)

    def _make_tables(self) -> dict:
        return {"decode": self.decode_values(), "index": self.index}

    def encode(self, normalized: torch.Tensor, rounding: Rounding, uniform: torch.Tensor | None) -> torch.Tensor:
        return encode_codebook(normalized, self.tables(normalized.device)["index"], rounding, uniform).clamp(min=self.min_code)


class MinifloatFormat(BlockFormat):
    """Block absmax scaling into an ExMy minifloat (FP8 E4M3/E5M2, e2m2, e3m0, ...).

    The block scale maps to the format's largest finite value; codes are the
    minifloat's sign-magnitude bit patterns (for FP8, the OCP bit patterns).

    ``zero_free`` formats (those ``get_format`` makes for non-negative states such as Adam's
    ``v``: unsigned ExMy, and FP8 with ``signed=False``, which keeps the OCP bit patterns) are
    like torchao's 4-bit ``v`` map: magnitudes below the smallest positive value, 0 included,
    are stored as it (magnitude code ``min_code = 1``; see the module docstring). e2m2's smallest
    positive value is only 1/28 of the block's absmax, and SR sends tiny FP8 values to 0 often.
    """

    def __init__(
        self,
        name: str,
        spec: MinifloatSpec,
        block_size: int,
        nonfinite: NonFinitePolicy = "raise",
        zero_free: bool = False,
        scale_dtype: ScaleDtype | None = None,
    ) -> None:
        nonnegative = zero_free or not spec.signed
        super().__init__(name, spec.bits, block_size, spec.signed, nonfinite, scale_dtype, nonnegative=nonnegative, zero_free=zero_free)
        self.spec = spec
        self.max_value = spec.max_value
        self.min_code = int(zero_free)  # the magnitude code of the smallest subnormal

    def decode_values(self) -> torch.Tensor:
        return (self.spec.values() / self.max_value).to(torch.float32)

    def encode(self, normalized: torch.Tensor, rounding: Rounding, uniform: torch.Tensor | None) -> torch.Tensor:
        magnitude = normalized.abs() if self.signed else normalized.clamp(min=0)
        code = encode_minifloat(magnitude * self.max_value, self.spec, rounding, uniform).clamp(min=self.min_code)
        if self.signed:
            code = code | ((normalized < 0).to(torch.int32) << (self.bits - 1))
        return code
