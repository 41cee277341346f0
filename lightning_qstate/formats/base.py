"""The storage-format interface, the quantized-tensor type and the kernel-backend hook."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch
from torch.distributed.tensor import DTensor

from .rounding import ROUNDINGS, Rounding

FLOAT_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (FSDP2), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def narrows_range(source: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether a value of ``source`` can lie past floating ``dtype``'s largest one after quantization: fp16 from fp32 or
    bf16. (bf16's largest is just below fp32's, but no stored value exceeds it: a bf16 input's absmax is a bf16 value,
    and bf16 scales saturate there; a check would make every bf16 decode 5-8 times slower.)"""
    return dtype == torch.float16 and source in (torch.float32, torch.bfloat16, torch.float64)


def saturating_cast(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Floating ``values`` in ``dtype``, the finite ones past its largest value saturating there (a plain cast makes them
    inf: a dequantized value may lie a rounding above the input's range); inf and NaN stay."""
    if not narrows_range(values.dtype, dtype):
        return values.to(dtype, copy=True)
    largest = torch.finfo(dtype).max
    wide = values.float()
    return torch.where(torch.isinf(wide), wide, wide.clamp(-largest, largest)).to(dtype)


class NonFiniteError(ValueError):
    """Raised by ``quantize`` of a block-scaled format when its input holds inf or NaN."""


class QuantizedTensor:
    """A tensor stored in a :class:`StorageFormat`.

    Attributes:
        format: the format that wrote it and knows how to read it.
        codes: flat container tensor (uint8/int16 codes, or the bf16/fp16/fp32 values of a cast format).
        scales: ``(num_blocks,)`` per-block scales (bf16 or fp32, the format's ``scale_dtype``), or ``None`` for cast formats.
        shape, dtype: of the tensor that was quantized; ``dequantize()`` restores both.
    """

    __slots__ = ("format", "codes", "scales", "shape", "dtype")

    def __init__(
        self, format: StorageFormat, codes: torch.Tensor, scales: torch.Tensor | None, shape: torch.Size, dtype: torch.dtype
    ) -> None:
        self.format = format
        self.codes = codes
        self.scales = scales
        self.shape = torch.Size(shape)
        self.dtype = dtype

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stored values as a tensor of ``shape``, in ``dtype`` (default: the original dtype)."""
        return self.format.dequantize(self, dtype)

    def unit_values(self) -> torch.Tensor:
        """Flat fp32 stored values in units of their block's scale (the code's value); the values themselves for casts.

        Two states hold the same code at an entry exactly when these agree there (``-0`` and ``+0`` aside).
        """
        return self.format.unit_values_reference(self.codes, self.numel)

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        """Every byte stored: codes plus scales."""
        return self.codes.nbytes + (0 if self.scales is None else self.scales.nbytes)

    @property
    def bits_per_value(self) -> float:
        """``8 * nbytes / numel``, scales included; the format's nominal bits for an empty tensor."""
        return 8 * self.nbytes / self.numel if self.numel else float(self.format.bits)

    def to(
        self,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | None = None,
        *,
        non_blocking: bool = False,
        copy: bool = False,
    ) -> QuantizedTensor:
        """Codes and scales moved to ``device`` (``None``: where they are), as ``Tensor.to``; the values are unchanged.

        This is how Lightning moves optimizer state (``state.to(device)``). There is no cast: the codes are not values.

        Raises:
            TypeError: a ``dtype`` is given (``.to(dtype)``, ``.to(device, dtype)``, ``dtype=``) or a tensor to match;
                dequantize first (``.dequantize(dtype)``) for a tensor of that dtype.
        """
        if isinstance(device, (torch.dtype, torch.Tensor)) or dtype is not None:
            what = f"a tensor ({device.dtype} on {device.device})" if isinstance(device, torch.Tensor) else f"dtype {dtype or device}"
            raise TypeError(
                f"QuantizedTensor.to() takes a device only (a torch.device, str or index), got {what}: its codes (format "
                f"{self.format.name!r}) are not values. Call .dequantize(dtype) for a tensor of another dtype."
            )
        scales = None if self.scales is None else self.scales.to(device, non_blocking=non_blocking, copy=copy)
        return QuantizedTensor(self.format, self.codes.to(device, non_blocking=non_blocking, copy=copy), scales, self.shape, self.dtype)

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(format={self.format.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"bits_per_value={self.bits_per_value:.3f})"
        )


class StorageFormat(ABC):
    """A way to store a float tensor. Subclasses define ``quantize`` and ``dequantize``.

    Attributes:
        name: the name ``get_format`` knows it by.
        bits: bits per stored code, scales excluded.
        config: the ``get_format`` arguments that rebuild this format (set by ``get_format``).
    """

    name: str
    bits: int
    config: dict

    @abstractmethod
    def quantize(self, x: torch.Tensor, rounding: Rounding = "nearest", generator: torch.Generator | None = None) -> QuantizedTensor:
        """Store ``x`` (fp32/bf16/fp16, any shape, contiguous or not) with RN or SR.

        SR draws from ``generator`` (on ``x``'s device) so a seeded run reproduces.
        """

    @abstractmethod
    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Values of ``q`` as a tensor of ``q.shape``."""

    @abstractmethod
    def nbytes(self, numel: int) -> int:
        """Bytes stored for ``numel`` values, scales included."""

    @abstractmethod
    def allocate(
        self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> QuantizedTensor:
        """Storage of a tensor of ``shape`` that reads back as ``dtype``, for a kernel to write every code and scale of:
        zero bytes, laid out as ``quantize`` lays them out (what they decode to before that depends on the format)."""

    @abstractmethod
    def unit_values_reference(self, codes: torch.Tensor, numel: int) -> torch.Tensor:
        """Torch reference of :meth:`QuantizedTensor.unit_values`: ``(numel,)`` fp32."""

    def _check_input(self, x: torch.Tensor, rounding: str) -> torch.Tensor:
        """Validate and flatten ``x`` to a contiguous 1-D tensor."""
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding={rounding!r} is not valid for format {self.name!r}; use one of {ROUNDINGS}")
        if x.dtype not in FLOAT_INPUT_DTYPES:
            raise TypeError(f"format {self.name!r} stores float32, bfloat16 or float16 tensors, got {x.dtype}")
        return x.detach().reshape(-1)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def count_stalls(
    before: torch.Tensor, updated: torch.Tensor, stored: torch.Tensor, before_units: torch.Tensor, stored_units: torch.Tensor
) -> torch.Tensor:
    """int64 ``[stalled, moved]`` of one state write (flat fp32 tensors of equal size).

    ``before``: the stored values before the step; ``updated``: the fp32 update of them; ``stored``: what the
    format stored for ``updated``; ``*_units``: the same two in units of their block's scale (:meth:`QuantizedTensor.unit_values`).
    An entry *moved* when the update changed it, and *stalled* when it moved but kept its code without being
    stored exactly: for casts, its stored value stayed put; for block formats, it changed at most through the
    block's shared scale (which follows the block's largest entry, stored exactly, at every step).
    """
    moved = updated != before
    stalled = moved & (stored_units == before_units) & (stored != updated)
    return torch.stack([stalled.sum(), moved.sum()])


def uniform_like(x: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """U[0, 1) fp32 draws of ``x``'s shape and device."""
    if generator is None:  # rand_like also traces under torch.compile with dynamic shapes
        return torch.rand_like(x, dtype=torch.float32)
    return torch.rand(x.shape, generator=generator, device=x.device, dtype=torch.float32)


class KernelBackend(Protocol):
    """Device kernels that a format hands its work to (``lightning_qstate.kernels`` registers Triton for CUDA).

    Each method must give the same codes as the torch reference for RN, and the
    same distribution for SR.
    """

    def quantize_blocks(
        self, fmt: StorageFormat, flat: torch.Tensor, rounding: Rounding, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``flat`` ``(n,)`` -> (packed codes, ``(num_blocks,)`` scales in ``fmt.scale_dtype``, NaN for non-finite blocks)."""

    def dequantize_blocks(self, fmt: StorageFormat, q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
        """Flat ``(n,)`` values of ``q`` in ``dtype``."""

    def stochastic_cast(self, fmt: StorageFormat, flat: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """SR cast of ``flat`` to a cast format's dtype."""


_KERNEL_BACKENDS: dict[str, KernelBackend] = {}


def register_kernel_backend(device_type: str, backend: KernelBackend) -> None:
    """Route formats' work on ``device_type`` tensors (e.g. ``"cuda"``) to ``backend``."""
    _KERNEL_BACKENDS[device_type] = backend


def kernel_backend(device: torch.device) -> KernelBackend | None:
    """The backend registered for ``device``'s type; ``None`` means the torch reference."""
    return _KERNEL_BACKENDS.get(device.type)
