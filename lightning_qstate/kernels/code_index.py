"""The C++ CPU kernel's round-to-nearest encoder table (:class:`NearestCodeIndex`) and its per-format cache."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..formats import CodebookFormat
from ..formats.codebooks import nearest_thresholds


@dataclass(frozen=True)
class NearestCodeIndex:
    """Round-to-nearest codebook codes from one 32-bit table lookup and integer compares (the C++ CPU kernel's encoder).

    The bucket of ``x`` is ``half + key`` for ``x >= 0`` and ``half - 1 - key`` for ``x < 0``, with
    ``key = clamp((bits(|x|) - key_base) >> key_shift, 0, half - 1)`` from the fp32 pattern. A bucket holds at most one
    of the ``nearest_thresholds``. Its entry packs ``first`` (bits 0-7: the thresholds at or below ``x`` for every
    ``x`` in the bucket), ``inside`` (bit 8: a threshold lies in the bucket) and ``offset`` (bits 9+: that
    threshold's magnitude pattern minus ``key_base + (key << key_shift)``). Then
    ``code = first + (inside and (|x| >= |t| if x >= 0 else |x| <= |t|))``, which equals
    ``encode_codebook(x, index, "nearest")`` clamped up to ``min_code`` for every fp32 ``x`` (tested exhaustively at
    the thresholds): the first ``min_code`` thresholds are taken as ``-inf``, so every bucket counts them.

    The same code is the count of thresholds ``<= x``, which the AVX-512 encoder finds without the bucket table by a
    branch-free binary search over the thresholds padded with ``+inf`` to ``2**depth - 1`` (``depth``: the bits of
    the last code): ``search_levels`` holds, from offset ``2**L - 1``, the ``2**L`` thresholds level ``L`` may compare
    with, ``t[j * 2 * s + s - 1]`` for ``s = 2**(depth - 1 - L)``, and the code is ``sum over L of s * (x >= levels_L[code
    // (2 * s)])`` built level by level (``search_codes``).
    """

    decode: torch.Tensor  # (256,) fp32 codebook values, padded with 0
    bucket_entries: torch.Tensor  # (2 * half,) int32
    key_base: int
    key_shift: int
    half: int
    search_levels: torch.Tensor  # (256,) fp32, level L from offset 2**L - 1
    depth: int

    @staticmethod
    def build(codebook: torch.Tensor, min_code: int = 0) -> NearestCodeIndex | None:
        """The index of a sorted codebook of at most 256 values whose codes are clamped up to ``min_code`` (a zero-free
        format's ``BlockFormat.min_code``), or ``None`` if its thresholds are too close together."""
        if codebook.numel() > 256:
            return None
        thresholds = nearest_thresholds(codebook)
        thresholds[:min_code] = -torch.inf
        smallest = thresholds.abs()[thresholds != 0].min()
        exponent = max(int(torch.floor(torch.log2(smallest.double()))), -126)
        key_base = (exponent + 127) << 23  # fp32 pattern of the binade start at or below the smallest |threshold|
        decode = torch.zeros(256)
        decode[: codebook.numel()] = codebook
        depth = (codebook.numel() - 1).bit_length()
        padded = torch.full((2**depth - 1,), torch.inf)
        padded[: thresholds.numel()] = thresholds
        levels = torch.zeros(256)
        for level in range(depth):
            step = 2 ** (depth - 1 - level)
            levels[2**level - 1 : 2 ** (level + 1) - 1] = padded[step - 1 :: 2 * step]
        for key_bits in range(4, 16):
            entries = NearestCodeIndex._bucket_entries(thresholds, key_base, 23 - key_bits)
            if entries is not None:
                return NearestCodeIndex(decode, entries, key_base, 23 - key_bits, entries.numel() // 2, levels, depth)
        return None

    def search_codes(self, x: torch.Tensor) -> torch.Tensor:
        """The AVX-512 encoder's codes of fp32 ``x`` (int64, same shape), from ``search_levels`` as the kernel searches."""
        code = torch.zeros(x.shape, dtype=torch.int64)
        for level in range(self.depth):
            step = 2 ** (self.depth - 1 - level)
            threshold = self.search_levels[2**level - 1 + torch.div(code, 2 * step, rounding_mode="floor")]
            code = code + step * (threshold <= x).to(torch.int64)
        return code

    @staticmethod
    def _bucket_entries(thresholds: torch.Tensor, key_base: int, key_shift: int) -> torch.Tensor | None:
        keys = torch.arange(((0x3F800000 - key_base) >> key_shift) + 2, dtype=torch.int64)  # the last bucket: above 1
        start_bits = key_base + (keys << key_shift)
        starts = start_bits[1:].to(torch.int32).view(torch.float32).double()
        lower = torch.cat([torch.zeros(1, dtype=torch.float64), starts])  # |x| in [lower, upper)
        upper = torch.cat([starts, torch.full((1,), float("inf"), dtype=torch.float64)])
        sorted_thresholds = thresholds.double()
        magnitude_bits = thresholds.abs().view(torch.int32).to(torch.int64)
        negative_top = torch.where(lower > 0, -lower, -torch.finfo(torch.float64).tiny)  # a threshold at 0 is above every x < 0
        sides = []
        for first, beyond in (
            (torch.searchsorted(sorted_thresholds, -upper, right=True), torch.searchsorted(sorted_thresholds, negative_top, right=True)),
            (torch.searchsorted(sorted_thresholds, lower, right=True), torch.searchsorted(sorted_thresholds, upper, right=False)),
        ):  # x < 0: thresholds in (-upper, -lower]; x >= 0: in (lower, upper)
            if (beyond - first).max() > 1:
                return None
            inside = beyond > first
            offset = torch.where(inside, magnitude_bits[first.clamp(max=thresholds.numel() - 1)] - start_bits, 0)
            sides.append(first + (inside.to(torch.int64) << 8) + (offset << 9))
        return torch.cat([sides[0].flip(0), sides[1]]).to(torch.int32)


@functools.cache
def nearest_index(fmt: CodebookFormat) -> NearestCodeIndex | None:
    """``fmt``'s encoder for the C++ CPU kernel (CPU tensors, ``min_code`` built in), built once per format; ``None`` where
    no bucket table fits."""
    return NearestCodeIndex.build(fmt.codebook, fmt.min_code)
