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
    // (2 * s)])`` built level by level (``search_codes``). For a codebook of at most 128 values the same search over
    its values above the first, from ``FLOOR_LEVELS``, gives stochastic rounding's floor (``search_codes(x, floors=True)``).
    Where the values are ``(c + 1) / 2**depth`` for every code ``c`` and ``min_code`` is 0 (int4's unsigned map), the
    kernel computes both by arithmetic instead (``Codebook::grid``: ``floor(x * 2**depth - 0.5)`` and
    ``floor(x * 2**depth) - 1``, held to the codes), the same counts.

    Stochastic rounding's floor (the code of the largest value ``<= x``, held to ``[0, last - 1]``) comes from the
    same buckets over the values ``codebook[1:last]`` instead of the thresholds (``build`` takes ``key_base`` at or
    below the smallest magnitude of either and key bits at which both tables hold at most one boundary per bucket):
    ``floor = first + (inside and ...)`` as above. ``floor_windows`` holds per bucket that floor entry and the fp32
    patterns of ``decode[first]``, ``decode[first + 1]`` and ``decode[first + 2]`` (the pairs of either floor), so
    that the AVX2 kernel reads the floor and both neighbours' values with one 16-byte load per value
    (``floor_window_reads``).

    An 8-bit codebook made of runs of equally spaced magnitudes (the dynamic maps, the linear ones; ``segments``,
    ``segment_table``) is encoded by arithmetic instead of the bucket gather (``segment_codes``), on magnitudes
    whatever the sign: ``key = |x|``, or the largest float below ``|x|`` for ``x < 0`` (rounding ties go up: towards
    the larger magnitude for ``x >= 0``, the smaller one for ``x < 0``); the run of ``key`` from its binade (at most one
    run boundary per binade), its magnitude code in the run by an affine map and a floor biased down, so that the
    candidate ``c`` is the magnitude code or one below it; then one compare with the signed threshold between the
    codes of magnitudes ``c`` and ``c + 1``.
    """

    decode: torch.Tensor  # (256,) fp32 codebook values, padded with 0
    bucket_entries: torch.Tensor  # (2 * half,) int32
    key_base: int
    key_shift: int
    half: int
    search_levels: torch.Tensor  # (256,) fp32, level L from offset 2**L - 1
    depth: int
    floor_windows: torch.Tensor  # (2 * half, 4) int32: floor entry, patterns of decode[first : first + 3]
    segments: torch.Tensor | None = None  # (SEGMENT_TABLE,) int32: segment_table's layout

    @staticmethod
    def build(codebook: torch.Tensor, min_code: int = 0) -> NearestCodeIndex | None:
        """The index of a sorted codebook of at most 256 values whose codes are clamped up to ``min_code`` (a zero-free
        format's ``BlockFormat.min_code``), or ``None`` if its thresholds are too close together."""
        if codebook.numel() > 256:
            return None
        raw = nearest_thresholds(codebook)
        thresholds = raw.clone()
        thresholds[:min_code] = -torch.inf
        last = codebook.numel() - 1
        floors = codebook[1:last].float()  # the boundaries of stochastic rounding's floors
        boundaries = torch.cat([thresholds, floors]).abs()
        smallest = boundaries[boundaries != 0].min()
        exponent = max(int(torch.floor(torch.log2(smallest.double()))), -126)
        key_base = (exponent + 127) << 23  # fp32 pattern of the binade start at or below the smallest |boundary|
        decode = torch.zeros(256)
        decode[: codebook.numel()] = codebook
        depth = (codebook.numel() - 1).bit_length()
        levels = torch.zeros(256)
        levels[: 2**depth - 1] = _search_levels(thresholds, depth)
        if depth <= 7:  # the floors' search: the values above the first
            levels[FLOOR_LEVELS : FLOOR_LEVELS + 2**depth - 1] = _search_levels(codebook[1:].float(), depth)
        segments = segment_table(codebook, raw)  # its codes are clamped up to min_code after the threshold compare
        for key_bits in range(4, 16):
            entries = NearestCodeIndex._bucket_entries(thresholds, key_base, 23 - key_bits)
            floor_entries = NearestCodeIndex._bucket_entries(floors, key_base, 23 - key_bits)
            if entries is not None and floor_entries is not None:
                first = (floor_entries & 0xFF).to(torch.int64)
                neighbours = decode.view(torch.int32)[(first[:, None] + torch.arange(3)).clamp(max=255)]
                windows = torch.cat([floor_entries[:, None], neighbours], dim=1)
                return NearestCodeIndex(decode, entries, key_base, 23 - key_bits, entries.numel() // 2, levels, depth, windows, segments)
        return None

    def bucket_codes(self, x: torch.Tensor) -> torch.Tensor:
        """The bucket encoder's codes of fp32 ``x`` (int64, same shape), as the scalar and AVX2 kernels read them from
        ``bucket_entries``: the nearest code, clamped up to the format's ``min_code``."""
        entry, up = self._bucket_reads(x, self.bucket_entries)
        return (entry & 0xFF) + up.to(torch.int64)

    def floor_window_reads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the AVX2 stochastic encoder reads from ``floor_windows`` for fp32 ``x`` (same shape each): the code of
        the largest codebook value ``<= x`` held to ``[0, last - 1]`` (int64), and the fp32 values of that code and of
        the next."""
        window, up = self._bucket_reads(x, self.floor_windows)
        values = window[..., 1:].to(torch.int32).view(torch.float32)
        low, high = torch.where(up, values[..., 1], values[..., 0]), torch.where(up, values[..., 2], values[..., 1])
        return (window[..., 0] & 0xFF) + up.to(torch.int64), low, high

    def _bucket_reads(self, x: torch.Tensor, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of ``table`` (``bucket_entries``, or ``floor_windows`` with the entry in column 0) at the buckets
        of fp32 ``x`` (int64), and whether ``x`` is past the threshold inside its bucket (bool, the shape of ``x``):
        ``|x| >= |t|`` for ``x >= 0``, ``|x| <= |t|`` for ``x < 0``, where the entry's ``inside`` bit is set."""
        magnitude = x.abs().view(torch.int32).to(torch.int64)
        key = ((magnitude - self.key_base) >> self.key_shift).clamp(0, self.half - 1)
        negative = x < 0
        rows = table[torch.where(negative, self.half - 1 - key, self.half + key)].to(torch.int64)
        entry = rows if table.dim() == 1 else rows[..., 0]
        threshold = self.key_base + (key << self.key_shift) + (entry >> 9)
        return rows, (entry & 0x100).bool() & torch.where(negative, magnitude <= threshold, magnitude >= threshold)

    def segment_codes(self, x: torch.Tensor, min_code: int = 0) -> torch.Tensor:
        """The AVX-512 encoder's codes of fp32 ``x`` (int64, same shape) from ``segments`` (``segment_table``), computed
        as the kernel computes them (its byte arithmetic: indices wrap, codes saturate), clamped up to ``min_code``."""
        thresholds = self.segments[_THRESHOLDS:_ZERO].contiguous().view(torch.uint8).view(4, 256).t().contiguous().view(torch.float32)
        negative, magnitude = self._segment_magnitudes(x, thresholds.view(-1), floors=False)
        zero = int(self.segments[_ZERO])
        code = torch.where(negative, (zero - magnitude).clamp(min=0), (zero + magnitude).clamp(max=255))
        return code.clamp(min=min_code)

    def segment_floors(self, x: torch.Tensor, last: int) -> torch.Tensor:
        """The AVX-512 stochastic encoder's floor codes of fp32 ``x`` (int64, same shape): the code of the largest
        codebook value ``<= x``, held to ``[0, last - 1]`` (``last``: the last code), as ``encode_codebook`` holds it
        before rounding up; from ``segments`` as the kernel computes it (its byte arithmetic)."""
        negative, magnitude = self._segment_magnitudes(x, self.decode, floors=True)
        zero = int(self.segments[_ZERO])
        return torch.where(negative, (zero - 1 - magnitude).clamp(min=0), (zero + magnitude).clamp(max=min(255, last - 1)))

    def _segment_magnitudes(self, x: torch.Tensor, table: torch.Tensor, floors: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``x < 0`` and the magnitude codes of ``x`` (``floors``: of its floors) as the kernel repairs its candidates:
        one compare with ``table`` (256 fp32: the thresholds, or with ``floors`` the values) at the signed code of the
        next magnitude's entry, ``zero + c`` (``+ 1`` with ``floors``) for ``x >= 0``, ``zero - 1 - c`` for ``x < 0``,
        the index wrapping and the result saturating as the kernel's bytes do (int64)."""
        if floors:
            negative, candidate = self._segment_candidates(x, _FLOOR_FIRST, _FLOOR_SPLIT, 2 * SEGMENT_RUNS)
        else:
            negative, candidate = self._segment_candidates(x, _FIRST, _SPLIT, SEGMENT_RUNS)
        zero = int(self.segments[_ZERO])
        index = torch.where(negative, zero - 1 - candidate, zero + int(floors) + candidate) % 256
        return negative, (candidate + ((x >= table[index]) != negative).to(torch.int64)).clamp(max=255)

    def _segment_candidates(self, x: torch.Tensor, first: int, split: int, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``x < 0`` and the candidate magnitude codes of ``key`` (the class docstring) from the runs and splits at
        ``first``, ``split`` and the run offsets at ``_SCALE + offset`` (int64)."""
        table = self.segments
        negative = x < 0
        key = x.abs().view(torch.int32).to(torch.int64) - negative.to(torch.int64)
        binade = ((key >> 23) - SEGMENT_BINADE0).clamp(0, SEGMENT_BINADES - 1)
        run = table[first + binade].to(torch.int64) + (key >= table[split + binade]).to(torch.int64)
        floats = table[_SCALE:_BASE].view(torch.float32)
        magnitude = key.to(torch.int32).view(torch.float32)
        position = (magnitude.double() * floats[run].double() + floats[offset + run].double()).float()  # fma: one rounding
        step = torch.minimum(position.trunc().to(torch.int64).clamp(min=0), table[_LAST + run].to(torch.int64))
        return negative, table[_BASE + run].to(torch.int64) + step

    def search_codes(self, x: torch.Tensor, floors: bool = False) -> torch.Tensor:
        """The AVX-512 encoder's codes of fp32 ``x`` (int64, same shape), from ``search_levels`` as the kernel searches;
        ``floors``: the count of values ``<= x`` above the first instead (codebooks of at most 128 values), the code of
        the largest value ``<= x`` held up to 0, which stochastic rounding holds down to ``last - 1``."""
        levels = self.search_levels[FLOOR_LEVELS:] if floors else self.search_levels
        code = torch.zeros(x.shape, dtype=torch.int64)
        for level in range(self.depth):
            step = 2 ** (self.depth - 1 - level)
            threshold = levels[2**level - 1 + torch.div(code, 2 * step, rounding_mode="floor")]
            code = code + step * (threshold <= x).to(torch.int64)
        return code

    @staticmethod
    def _bucket_entries(thresholds: torch.Tensor, key_base: int, key_shift: int) -> torch.Tensor | None:
        keys = torch.arange(((0x3F800000 - key_base) >> key_shift) + 2, dtype=torch.int64)  # the last bucket: above 1
        if thresholds.numel() == 0:  # no boundary (the floors of a codebook of two values): every entry 0
            return torch.zeros(2 * keys.numel(), dtype=torch.int32)
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


# Where a codebook of at most 128 values (depth <= 7) keeps the search of its values in ``search_levels``.
FLOOR_LEVELS = 128


def _search_levels(keys: torch.Tensor, depth: int) -> torch.Tensor:
    """``(2**depth - 1,)`` fp32: the sorted ``keys`` (at most ``2**depth - 1``, padded with ``+inf``) in the order a
    branch-free binary search of ``depth`` levels compares them: level ``L`` from offset ``2**L - 1``."""
    padded = torch.full((2**depth - 1,), torch.inf)
    padded[: keys.numel()] = keys
    levels = torch.empty(2**depth - 1)
    for level in range(depth):
        step = 2 ** (depth - 1 - level)
        levels[2**level - 1 : 2 ** (level + 1) - 1] = padded[step - 1 :: 2 * step]
    return levels


# segment_table's layout (int32 entries): SEGMENT_BINADES runs at the binades' lower ends and as many split patterns,
# for the codes (boundaries: thresholds) and for the floors (boundaries: values); per run (SEGMENT_RUNS) its scale and
# offsets (fp32 patterns; codes, floors), first magnitude code and last position; the signed thresholds' byte planes
# (as Codebook::planes); the code of zero.
SEGMENT_BINADES = 32  # binades 2**-31 .. 2**0 (fp32 exponent fields 96 .. 127); the first also holds every smaller |x|
SEGMENT_BINADE0 = 96
SEGMENT_RUNS = 16
# The floor's bias, in codes: far below 1, and far above the position's rounding error, which stays below about
# P * 2**-21 for |x| / h < P: runs whose |x| / h reach SEGMENT_POSITIONS are refused.
SEGMENT_BIAS = 2.0**-8
SEGMENT_POSITIONS = 2.0**12
_FIRST = 0
_SPLIT = SEGMENT_BINADES
_FLOOR_FIRST = 2 * SEGMENT_BINADES
_FLOOR_SPLIT = 3 * SEGMENT_BINADES
_SCALE = 4 * SEGMENT_BINADES
_BASE = _SCALE + 3 * SEGMENT_RUNS
_LAST = _BASE + SEGMENT_RUNS
_THRESHOLDS = _LAST + SEGMENT_RUNS
_ZERO = _THRESHOLDS + 256
SEGMENT_TABLE = _ZERO + 1


def segment_table(codebook: torch.Tensor, thresholds: torch.Tensor) -> torch.Tensor | None:
    """The arithmetic encoder's table of a sorted ``codebook`` of 129 to 256 values (8-bit codes)
    (``nearest_thresholds``: ``thresholds``), or ``None`` where it does not apply: no exact zero, negative magnitudes
    not a mirror of the first positive ones, a negative threshold's magnitude not the positive one's or the float below
    it, values beyond 1, more than ``SEGMENT_RUNS`` runs of equal spacing, a run whose values reach
    ``SEGMENT_POSITIONS`` times its spacing (its positions' rounding would near the bias), or two run boundaries in one
    binade.

    The positive magnitudes ``0 = a_0 < a_1 < ...`` are cut greedily into runs of equal spacing ``h`` from ``a_i``;
    within a run, the magnitude code of ``key`` (``NearestCodeIndex``) is near ``position = key / h + 1/2 - a_i / h``:
    its floor, biased down by ``SEGMENT_BIAS``, is the code or, across a rounding threshold near an integer position,
    one below it, which the compare with the next threshold repairs. The run of ``key`` is exact: the boundaries are the
    positive thresholds themselves, found in the binade of ``key`` by one pattern compare. For ``x < 0`` the magnitude
    code of ``|x|`` counts the thresholds ``t`` between negative values with ``|t| < |x|``, that is ``|t| <= key``; with
    ``|t|`` the positive threshold or the float below it, the positive one's candidate is still the code or one below.
    Stochastic rounding's floors (``segment_floors``) take the same runs with the values as boundaries and
    ``position = key / h - a_i / h``: the largest magnitude ``<= key`` or one below it, repaired by one compare with the
    next value."""
    if not 128 < codebook.numel() <= 256 or float(codebook.abs().max()) > 1.0 or int((codebook == 0).sum()) != 1:
        return None
    zero = int((codebook == 0).nonzero())
    positive, negative = codebook[zero:], -codebook[: zero + 1].flip(0)
    bits = thresholds.view(torch.int32).to(torch.int64)
    below = bits[zero : 2 * zero] - (-thresholds[:zero].flip(0)).view(torch.int32).to(torch.int64)  # positive minus negative
    if not torch.equal(negative, positive[: zero + 1]) or bool(((below < 0) | (below > 1)).any()):
        return None
    runs, start = [], 0
    while start < positive.numel():
        end = start
        if start + 1 < positive.numel():
            step = float(positive[start + 1] - positive[start])
            end = start + 1
            while end + 1 < positive.numel() and abs(float(positive[end + 1] - positive[end]) - step) <= 1e-9 * step:
                end += 1
        runs.append((start, end))
        start = end + 1
    if len(runs) > SEGMENT_RUNS or any(
        end > start and float(positive[end]) >= SEGMENT_POSITIONS * float(positive[start + 1] - positive[start]) for start, end in runs
    ):
        return None
    table = torch.zeros(SEGMENT_TABLE, dtype=torch.int32)
    floats = torch.zeros(3 * SEGMENT_RUNS, dtype=torch.float32)
    for k, (start, end) in enumerate(runs):
        if end > start:
            step = float(positive[start + 1] - positive[start])
            floats[k] = 1.0 / step
            floats[SEGMENT_RUNS + k] = 0.5 - float(positive[start]) / step - SEGMENT_BIAS
            floats[2 * SEGMENT_RUNS + k] = -float(positive[start]) / step - SEGMENT_BIAS
        else:
            floats[SEGMENT_RUNS + k] = floats[2 * SEGMENT_RUNS + k] = -SEGMENT_BIAS
        table[_BASE + k], table[_LAST + k] = start, end - start
    table[_SCALE:_BASE] = floats.view(torch.int32)
    values = positive.float().view(torch.int32).to(torch.int64)
    for first, split, patterns in (
        (_FIRST, _SPLIT, [int(bits[zero + end]) for _, end in runs[:-1]]),  # the least key of the next run's first code
        (_FLOOR_FIRST, _FLOOR_SPLIT, [int(values[end + 1]) for _, end in runs[:-1]]),  # the next run's first value
    ):
        binades = [min(max((pattern >> 23) - SEGMENT_BINADE0, 0), SEGMENT_BINADES - 1) for pattern in patterns]
        if len(set(binades)) < len(binades) or any(pattern <= 0 for pattern in patterns):
            return None
        table[split : split + SEGMENT_BINADES] = 0x7F800000  # no boundary: above every finite |x|
        for binade, pattern in zip(binades, patterns, strict=True):
            table[split + binade] = pattern
        for binade in range(SEGMENT_BINADES):
            table[first + binade] = sum(1 for b in binades if b < binade)
    padded = torch.cat([thresholds.float(), torch.full((256 - thresholds.numel(),), torch.inf)])
    table[_THRESHOLDS:_ZERO] = padded.view(torch.uint8).view(256, 4).t().contiguous().view(torch.int32).view(-1)
    table[_ZERO] = zero
    return table


@functools.cache
def nearest_index(fmt: CodebookFormat) -> NearestCodeIndex | None:
    """``fmt``'s encoder for the C++ CPU kernel (CPU tensors, ``min_code`` built in), built once per format; ``None`` where
    no bucket table fits."""
    return NearestCodeIndex.build(fmt.codebook, fmt.min_code)
