"""Round-to-nearest and stochastic rounding into codes: the torch reference.

These are the exact operations the Triton kernels in ``lightning_qstate.kernels``
reproduce. They avoid searches and transcendental functions: fp32 bit patterns,
power-of-two scaling and one bucket lookup, so that the kernels can give
identical codes for round-to-nearest (RN).

Stochastic rounding (SR) takes ``uniform``, a tensor of U[0, 1) draws of the
input's shape; the value rounds up with probability equal to its distance from
the lower neighbour divided by the gap, so it is unbiased.
"""

from __future__ import annotations

from typing import Literal

import torch

from .codebooks import CodebookIndex, MinifloatSpec

Rounding = Literal["nearest", "stochastic"]
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")


def check_rounding(rounding: str) -> None:
    """Raise ``ValueError`` naming the valid values where ``rounding`` is not one of :data:`ROUNDINGS`."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not valid; use one of {ROUNDINGS}")


_RNE_MAGIC = 8388608.0  # 2**23: adding then subtracting it rounds |q| < 2**22 to the nearest even integer


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """``2.0 ** exponent`` built from the fp32 bit pattern; ``exponent`` int32 in ``[-126, 127]``."""
    return ((exponent + 127) << 23).view(torch.float32)


def lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a 1-D table and an int index of any shape (``index_select``: far faster on CPU)."""
    return table.index_select(0, index.reshape(-1)).view(index.shape)


def round_up_mask(lower_distance: torch.Tensor, gap: torch.Tensor, rounding: Rounding, uniform: torch.Tensor | None) -> torch.Tensor:
    """Whether to take the upper neighbour: RN rounds ties up, SR rounds up with probability ``lower_distance / gap``."""
    if rounding == "nearest":
        return lower_distance * 2 >= gap
    return uniform * gap < lower_distance


def encode_codebook(
    normalized: torch.Tensor, index: CodebookIndex, rounding: Rounding, uniform: torch.Tensor | None = None
) -> torch.Tensor:
    """Nearest (RN) or stochastic (SR) codebook codes of ``normalized`` values in ``[-1, 1]``.

    Values outside the codebook's range clamp to its end codes. Returns int32 codes, same shape.
    """
    magnitude_key = normalized.abs().view(torch.int32) >> index.key_shift
    bucket = torch.where(normalized < 0, index.half - 1 - magnitude_key, index.half + magnitude_key)
    last = index.values.numel() - 1
    floor = lookup(index.bucket_floor, bucket)
    floor = floor + (lookup(index.values, (floor + 1).clamp(max=last)) <= normalized).to(torch.int32)
    low = floor.clamp(0, last - 1)
    low_value = lookup(index.values, low)
    high_value = lookup(index.values, low + 1)
    return low + round_up_mask(normalized - low_value, high_value - low_value, rounding, uniform).to(torch.int32)


def encode_minifloat(magnitude: torch.Tensor, spec: MinifloatSpec, rounding: Rounding, uniform: torch.Tensor | None = None) -> torch.Tensor:
    """Magnitude codes of ``magnitude`` (fp32, >= 0, in format units), saturating at ``spec.max_code``.

    The binade exponent comes from the fp32 pattern (clamped at the subnormal
    binade), the mantissa is scaled to an integer by a power of two, rounded, and
    the code is ``((exponent + bias - 1) << M) + rounded_mantissa``, which also
    carries a round-up into the next binade. Returns int32 codes, same shape.
    """
    exponent = ((magnitude.view(torch.int32) >> 23) & 0xFF) - 127
    exponent = exponent.clamp(min=1 - spec.bias)
    mantissa = magnitude * pow2(spec.mantissa_bits - exponent)
    if rounding == "nearest":
        rounded = (mantissa + _RNE_MAGIC) - _RNE_MAGIC
    else:
        rounded = mantissa.floor()
        rounded = rounded + (uniform < mantissa - rounded).to(torch.float32)
    code = ((exponent + (spec.bias - 1)) << spec.mantissa_bits) + rounded.to(torch.int32)
    return code.clamp(max=spec.max_code)


def bf16_stochastic(x: torch.Tensor, random_bits: torch.Tensor) -> torch.Tensor:
    """SR cast of fp32 ``x`` to bf16: add 16 random bits to the pattern, clear the low 16; past bf16's largest finite
    value (``|x| > 3.39e38``) the RN cast, as ``cast.fp16_stochastic`` past fp16's (SR would round up to inf where RN
    stays finite); inf/NaN pass through.

    ``random_bits``: int32 in ``[0, 2**16)``, same shape.
    """
    rounded = ((x.view(torch.int32) + random_bits) & -65536).view(torch.float32)
    return torch.where(x.abs() <= torch.finfo(torch.bfloat16).max, rounded, x).to(torch.bfloat16)
