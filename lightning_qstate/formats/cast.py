"""Cast formats: fp32 passthrough, bf16 and fp16, one value per element, no scales."""

from __future__ import annotations

import torch

from .base import QuantizedTensor, StorageFormat, kernel_backend, uniform_like
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
    16 bits; the fp16 SR cast uses the minifloat rounding of ``rounding.py``.
    """

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype
        self.bits = torch.finfo(dtype).bits

    @property
    def is_float(self) -> bool:
        return True

    def nbytes(self, numel: int) -> int:
        return numel * self.bits // 8

    def quantize(self, x: torch.Tensor, rounding: Rounding = "nearest", generator: torch.Generator | None = None) -> QuantizedTensor:
        flat = self._check_input(x, rounding)
        if rounding == "nearest" or self.dtype == torch.float32 or flat.dtype == self.dtype:
            codes = flat.to(self.dtype, copy=True)
        elif (backend := kernel_backend(flat.device)) is not None:
            codes = backend.stochastic_cast(self, flat, generator)
        else:
            codes, _ = self.quantize_reference(flat, rounding, generator)
        return QuantizedTensor(self, codes, None, x.shape, x.dtype)

    def quantize_reference(self, flat: torch.Tensor, rounding: Rounding, generator: torch.Generator | None) -> tuple[torch.Tensor, None]:
        """Torch reference, same interface as the block formats': ``(n,)`` -> (values in ``dtype``, no scales)."""
        if rounding == "nearest" or self.dtype == torch.float32:
            return flat.to(self.dtype), None
        return self.stochastic_reference(flat.float(), generator), None

    def dequantize_reference(self, codes: torch.Tensor, scales: None, numel: int) -> torch.Tensor:
        """Torch reference: stored values -> ``(numel,)`` fp32."""
        return codes.float()

    unit_values_reference = dequantize_reference  # no scales: a value is its own unit

    def stochastic_reference(self, flat: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """Torch reference of the SR cast of fp32 ``flat``."""
        if self.dtype == torch.bfloat16:
            if generator is None:  # randint_like also traces under torch.compile with dynamic shapes
                random_bits = torch.randint_like(flat, 0, 1 << 16, dtype=torch.int32)
            else:
                random_bits = torch.randint(0, 1 << 16, flat.shape, generator=generator, device=flat.device, dtype=torch.int32)
            return bf16_stochastic(flat, random_bits)
        return fp16_stochastic(flat, uniform_like(flat, generator))

    def dequantize(self, q: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return q.codes.to(dtype or q.dtype, copy=True).view(q.shape)
