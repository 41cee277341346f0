"""Codebooks: the sorted value tables behind the block-scaled integer formats.

Every codebook here is a sorted 1-D float64 tensor of normalized values in
``[-1, 1]`` (signed) or ``[0, 1]`` (unsigned). A code is the index of its value,
so ``codebook[code] * block_absmax`` dequantizes.

:class:`CodebookIndex` turns a codebook into a search-free encoder table: a
lookup on the top bits of the fp32 pattern gives the nearest lower code up to
one step, so encoding costs a few gathers instead of a binary search.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch


@cache
def dynamic_map(signed: bool, total_bits: int) -> torch.Tensor:
    """The dynamic-tree map of bitsandbytes and torchao, sorted, ``(2**total_bits,)`` float64.

    8-bit: ``max_exponent_bits=7`` (bitsandbytes' ``create_dynamic_map``). 4-bit:
    ``max_exponent_bits=3`` (torchao's signed 4-bit map). The signed map holds
    ``0`` and ``+1`` but not ``-1``, exactly as the peers do.
    """
    max_exponent_bits = 7 if total_bits == 8 else total_bits - 1
    non_sign_bits = total_bits - 1
    values: list[float] = []
    for i in range(max_exponent_bits):
        exponent = i + non_sign_bits - max_exponent_bits + (0 if signed else 1)
        boundaries = torch.linspace(0.1, 1, 2**exponent + 1, dtype=torch.float64)
        means = ((boundaries[:-1] + boundaries[1:]) / 2 * 10 ** (i - max_exponent_bits + 1)).tolist()
        values += means + ([-m for m in means] if signed else [])
    extra = 2 ** (non_sign_bits - max_exponent_bits) - 1
    if extra > 0:
        boundaries = torch.linspace(0.1, 1, extra + 1, dtype=torch.float64)
        means = ((boundaries[:-1] + boundaries[1:]) / 2 * 10 ** (max_exponent_bits - 1 - max_exponent_bits + 1)).tolist()
        values += means + ([-m for m in means] if signed else [])
    values += [0.0, 1.0]
    table = torch.tensor(sorted(values), dtype=torch.float64)
    assert table.numel() == 2**total_bits, (signed, total_bits, table.numel())
    return table


@cache
def linear_map(signed: bool, total_bits: int, zero_free: bool = False) -> torch.Tensor:
    """A uniform map, sorted, float64.

    Signed: symmetric ``k / L`` for ``k = -L..L`` with ``L = 2**(bits-1) - 1``
    (one code unused, so that ``+1`` and ``-1`` are both exact). Unsigned:
    ``k / (2**bits - 1)``; with ``zero_free`` it is ``k / 2**bits`` for
    ``k = 1..2**bits`` (torchao's and lpmm's 4-bit second-moment map: a zero in
    the ``v`` map makes ``1/sqrt(v)`` explode, see docs/algorithms.md, "Zero-free formats").
    """
    if signed:
        levels = 2 ** (total_bits - 1) - 1
        return torch.arange(-levels, levels + 1, dtype=torch.float64) / levels
    if zero_free:
        return torch.arange(1, 2**total_bits + 1, dtype=torch.float64) / 2**total_bits
    return torch.arange(0, 2**total_bits, dtype=torch.float64) / (2**total_bits - 1)


@dataclass(frozen=True)
class MinifloatSpec:
    """An ExMy minifloat without inf codes: sign-magnitude codes, IEEE-style bias.

    ``max_code`` is the largest finite magnitude code (``2**(E+M) - 1`` when every
    code is finite; OCP FP8 E4M3 reserves its top code, E5M2 its top exponent).
    Subnormals are kept. Codes are the format's real bit patterns.
    """

    exponent_bits: int
    mantissa_bits: int
    signed: bool
    max_code: int

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def bits(self) -> int:
        return self.exponent_bits + self.mantissa_bits + int(self.signed)

    def magnitude(self, code: torch.Tensor) -> torch.Tensor:
        """Value of magnitude codes (any int tensor), float64."""
        code = code.to(torch.int64)
        exponent_field = code >> self.mantissa_bits
        fraction = (code & (2**self.mantissa_bits - 1)).to(torch.float64)
        mantissa = fraction + (exponent_field > 0).to(torch.float64) * 2**self.mantissa_bits
        exponent = exponent_field.clamp(min=1) - self.bias - self.mantissa_bits
        return mantissa * torch.pow(2.0, exponent.to(torch.float64))

    @property
    def max_value(self) -> float:
        return float(self.magnitude(torch.tensor(self.max_code)))

    def values(self) -> torch.Tensor:
        """Value of every code ``0 .. 2**bits - 1``, ``(2**bits,)`` float64; saturated past ``max_code``."""
        codes = torch.arange(2**self.bits, dtype=torch.int64)
        magnitude_bits = self.exponent_bits + self.mantissa_bits
        magnitude = self.magnitude((codes & (2**magnitude_bits - 1)).clamp(max=self.max_code))
        sign = 1.0 - 2.0 * (codes >> magnitude_bits).to(torch.float64) if self.signed else 1.0
        return magnitude * sign


@dataclass(frozen=True)
class CodebookIndex:
    """Search-free nearest-code lookup for a sorted codebook.

    ``bucket_floor[bucket(x)]`` is the largest code whose value is at or below the
    bucket's lower end; at most one codebook value lies inside any bucket, so one
    compare finishes the search. ``bucket(x)`` takes the top ``key_bits``
    fraction bits of ``|x|``'s fp32 pattern, mirrored for negatives so buckets stay
    in value order. Index ``x`` must be normalized to ``[-1, 1]``.
    """

    values: torch.Tensor  # (n,) fp32 sorted codebook, values[code]
    bucket_floor: torch.Tensor  # (2 * half,) int32
    key_shift: int  # 23 - key_bits
    half: int  # buckets per sign: (bits of 1.0 >> key_shift) + 1

    @staticmethod
    def build(codebook: torch.Tensor) -> CodebookIndex:
        values = codebook.to(torch.float32)
        for key_bits in range(4, 20):
            index = CodebookIndex._try_build(values, key_bits)
            if index is not None:
                return index
        raise ValueError("codebook values are too close together for a bucket index")

    @staticmethod
    def _try_build(values: torch.Tensor, key_bits: int) -> CodebookIndex | None:
        shift = 23 - key_bits
        half = (0x3F800000 >> shift) + 1
        starts = (torch.arange(half + 1, dtype=torch.int64) << shift).to(torch.int32).view(torch.float32)
        lower, upper = starts[:-1].double(), starts[1:].double()
        sorted_values = values.double()
        # Positive bucket k holds [lower_k, upper_k); negative bucket holds (-upper_k, -lower_k].
        pos_floor = torch.searchsorted(sorted_values, lower, right=True) - 1
        pos_top = torch.searchsorted(sorted_values, upper, right=False) - 1
        neg_floor = torch.searchsorted(sorted_values, -upper, right=True) - 1
        neg_top = torch.searchsorted(sorted_values, -lower, right=True) - 1
        if (pos_top - pos_floor).max() > 1 or (neg_top - neg_floor).max() > 1:
            return None
        bucket_floor = torch.cat([neg_floor.flip(0), pos_floor]).to(torch.int32)
        return CodebookIndex(values, bucket_floor, shift, half)

    def to(self, device: torch.device) -> CodebookIndex:
        return CodebookIndex(self.values.to(device), self.bucket_floor.to(device), self.key_shift, self.half)


def _order_key(x: torch.Tensor) -> torch.Tensor:
    """int64 keys in the order of the fp32 values ``x`` (adjacent floats get adjacent keys; ``-0.0`` and ``0.0`` share 0)."""
    bits = x.view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, -(bits & 0x7FFFFFFF))


def _from_order_key(key: torch.Tensor) -> torch.Tensor:
    """The fp32 values of ``_order_key`` keys."""
    bits = torch.where(key >= 0, key, (-key) | 0x80000000)
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def nearest_thresholds(values: torch.Tensor) -> torch.Tensor:
    """``(n - 1,)`` fp32: ``thresholds[k]`` is the least fp32 ``x`` that round-to-nearest sends to code ``k + 1`` rather than ``k``.

    "Rounds up" is ``formats.rounding.round_up_mask`` on ``(x - values[k], values[k + 1] - values[k])`` in fp32, which
    is monotone in ``x``, so the exact threshold is found by bisection over the floats between the two values.
    Then ``encode_codebook(x, "nearest") == #{k : thresholds[k] <= x}`` for every fp32 ``x`` (clamping included).
    """
    values = values.to(torch.float32)
    low, high = values[:-1], values[1:]
    gap = high - low
    below, above = _order_key(low), _order_key(high)  # rounds up at ``high`` (2 * gap >= gap), not at ``low``
    while bool((above - below > 1).any()):
        middle = torch.div(below + above, 2, rounding_mode="floor")
        up = (_from_order_key(middle) - low) * 2 >= gap
        above, below = torch.where(up, middle, above), torch.where(up, below, middle)
    return _from_order_key(above)
