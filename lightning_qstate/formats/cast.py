"""Cast formats: fp32 passthrough, bf16 and fp16, one value per element, no scales."""

from __future__ import annotations

import math

import torch

from .base import QuantizedTensor, StorageFormat, kernel_backend, saturating_cast, uniform_like
from .codebooks import MinifloatSpec
from .rounding import Rounding, bf16_stochastic, encode_minifloat

FP16_SPEC = MinifloatSpec(exponent_bits=5, mantissa_bits=10, signed=False, max_code=0x7BFF)
FP16_MAX = 65504.0


def fp16_stochastic(x: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """SR cast of fp32 ``x`` to fp16 (subnormals included); outside the finite range it is the RN cast (inf/NaN kept)."""
    magnitude = encode_minifloat(x.abs(), FP16_SPEC, "stochastic", uniform)
    pattern = (magnitude | (torch.signbit(x).to(torch.int32) << 15)).to(torch.int16).view(torch.float16)
    return torch.where(x.abs() <= FP16_MAX, pattern, x.to(torch.float16))


class CastFormat(StorageFormat):
    """``fp32`` (passthrough copy), ``bf16`` or ``fp16``: a plain cast with RN or SR.

    Non-finite values round-trip as themselves (inf stays inf, NaN stays NaN).
    The bf16 SR cast adds 16 random bits to the fp32 pattern and clears the low
    16 bits; the fp16 SR cast uses the minifloat rounding of ``rounding.py``; past
    the dtype's largest finite value both are the RN cast (never inf where RN is finite).

    ``zero_free`` (``get_format(..., signed=False)``, for non-negative states such as Adam's ``v``): a positive value
    that the cast would flush to 0 (RN or SR: below fp16's smallest subnormal ``2**-24 ≈ 6e-8``, bf16's ``2**-133``)
    is stored as that smallest subnormal instead, as the block formats' ``min_code``. Exact zeros stay 0: a cast has
    no block scale, so its smallest value is an absolute floor (fp16's ``6e-8`` is far above typical ``v``), and a
    never-touched ``v`` must not start there.
    """

    def __init__(self, name: str, dtype: torch.dtype, zero_free: bool = False) -> None:
        self.name = name
        self.dtype = dtype
        self.bits = torch.finfo(dtype).bits
        self.zero_free = zero_free
        self.smallest_positive = torch.finfo(dtype).tiny * torch.finfo(dtype).eps  # the smallest subnormal

    def nbytes(self, numel: int) -> int:
        return numel * self.bits // 8

    def allocate(
        self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> QuantizedTensor:
        return QuantizedTensor(self, torch.zeros(math.prod(shape), dtype=self.dtype, device=device), None, shape, dtype)

    def quantize(self, x: torch.Tensor, rounding: Rounding = "nearest", generator: torch.Generator | None = None) -> QuantizedTensor:
        flat = self._check_input(x, rounding)
        rounds = rounding == "stochastic" and self.dtype != torch.float32 and flat.dtype != self.dtype
        if rounds and (backend := kernel_backend(flat.device)) is not None:
            codes = backend.stochastic_cast(self, flat, generator)
        else:
            codes, _ = self.quantize_reference(flat, rounding, generator)
        return QuantizedTensor(self, codes, None, x.shape, x.dtype)

    def quantize_reference(self, flat: torch.Tensor, rounding: Rounding, generator: torch.Generator | None) -> tuple[torch.Tensor, None]:
        """Torch reference, same interface as the block formats': ``(n,)`` -> (values in ``dtype``, a new tensor; no scales)."""
        if rounding == "nearest" or self.dtype == torch.float32 or flat.dtype == self.dtype:
            return self.lift_flushed(flat, flat.to(self.dtype, copy=True)), None
        return self.stochastic_reference(flat.float(), generator), None

    def round_saturated(self, flat: torch.Tensor, rounding: Rounding, generator: torch.Generator | None) -> torch.Tensor:
        """fp32 ``flat`` on this cast's grid, as a weight grid rounds (``formats.weights``): values past the dtype's largest
        finite one (inf included) saturate to it, so that a finite update never makes a weight inf and ECO's error
        ``θ̃ − θ̂`` stays finite; NaN stays NaN; else :meth:`quantize_reference`. Values in ``dtype``; fp32 unchanged."""
        if self.dtype != torch.float32:
            largest = torch.finfo(self.dtype).max
            flat = flat.clamp(-largest, largest)
        return self.quantize_reference(flat, rounding, generator)[0]

    def lift_flushed(self, flat: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """``codes`` (the cast of ``flat``) with every positive value of ``flat`` cast to 0 stored as the smallest subnormal
        when ``zero_free``; unchanged otherwise."""
        if not self.zero_free or codes.dtype == flat.dtype:  # an exact copy flushes nothing
            return codes
        return torch.where((flat > 0) & (codes == 0), self.smallest_positive, codes)

    def dequantize_reference(self, codes: torch.Tensor, scales: None, numel: int) -> torch.Tensor:
        """Torch reference: stored values -> ``(numel,)`` fp32."""
        return codes.float()

    def unit_values_reference(self, codes: torch.Tensor, numel: int) -> torch.Tensor:
        """:meth:`dequantize_reference`: a stored value is its own unit (no scales)."""
        return self.dequantize_reference(codes, None, numel)

    def stochastic_reference(self, flat: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Torch reference of the SR cast of fp32 ``flat`` (with :meth:`lift_flushed`)."""
        if self.dtype == torch.bfloat16:
            if generator is None:  # randint_like also traces under torch.compile with dynamic shapes
                random_bits = torch.randint_like(flat, 0, 1 << 16, dtype=torch.int32)
            else:
                random_bits = torch.randint(0, 1 << 16, flat.shape, generator=generator, device=flat.device, dtype=torch.int32)
            return self.lift_flushed(flat, bf16_stochastic(flat, random_bits))
        return self.lift_flushed(flat, fp16_stochastic(flat, uniform_like(flat, generator)))

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The stored values in ``dtype`` (default: the quantized tensor's), saturating at a narrower dtype's largest
        value (bf16 rounds fp16's 65504 to 65536, which an fp16 cast would make inf); inf and NaN stay."""
        return saturating_cast(q.codes, dtype or q.dtype).view(q.shape)
