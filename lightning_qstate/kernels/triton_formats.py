"""Triton device functions that mirror the torch reference of :mod:`lightning_qstate.formats`.

Every function here is an ``@triton.jit`` helper meant to be inlined into a
kernel: the block kernels of :mod:`.triton_kernels` and the fused optimizer
kernel of :mod:`.triton_adam` (dequantize -> update -> requantize, one pass per
block; :func:`load_moment` / :func:`store_moment` handle a state whose block size
divides the program's block as several sub-blocks; :func:`round_to_weight_grid` rounds
updated parameter values to a cast format's grid, for training without master
weights). Each one
follows its torch twin in ``formats/rounding.py``, ``formats/block.py`` or
``formats/cast.py`` operation by operation, so that round-to-nearest (RN) gives
the reference's codes bit for bit:

* ``x / absmax`` uses ``tl.math.div_rn`` (IEEE division; Triton's ``/`` is
  approximate on NVIDIA GPUs).
* Every other float operation is one the reference also rounds once: exact
  power-of-two scalings, the ``+ 2**23 - 2**23`` round-half-even trick, compares.
  LLVM may contract ``a * 2**k + c`` into an FMA; that is harmless because the
  product is exact. Keep that order of operations when editing.
* Bit tricks go through ``x.to(tl.int32, bitcast=True)``.

Stochastic rounding (SR) takes ``uniform`` (U[0, 1) fp32, e.g. ``tl.rand(seed,
offsets)``) or, for the bf16 cast, 16 random bits (``tl.randint(seed, offsets)
& 0xFFFF``). SR matches the reference in distribution, not bits. A kernel that
draws several SR streams per element (e.g. ``m`` and ``v``) must give each its
own seed or counter range.

Code containers follow ``formats/packing.py``: codes of at most 4 bits pack two
per byte (element ``2i`` in the low nibble), 5 to 7 bits pack eight to ``BITS``
bytes (a little-endian bit stream per group of 8), 8 bits take a ``uint8``, 9 to
16 bits an ``int16``. A dense block is handled as ``(BLOCK_SIZE // 8, 8)`` bytes,
of which the first ``BITS`` columns are the group's bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)
BF16_MAX: tl.constexpr = tl.constexpr(3.3895313892515355e38)
RNE_MAGIC: tl.constexpr = tl.constexpr(8388608.0)  # 2**23, as formats.rounding._RNE_MAGIC
FP16_MAX: tl.constexpr = tl.constexpr(65504.0)


# --------------------------------------------------------------------------- rounding primitives


@triton.jit
def pow2(exponent):
    """``2.0 ** exponent`` from the fp32 bit pattern; int32 ``exponent`` in ``[-126, 127]`` (``rounding.pow2``)."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def round_up_mask(lower_distance, gap, STOCHASTIC: tl.constexpr, uniform):
    """Take the upper neighbour? RN: ties up; SR: with probability ``lower_distance / gap`` (``rounding.round_up_mask``)."""
    if STOCHASTIC:
        up = uniform * gap < lower_distance
    else:
        up = lower_distance * 2.0 >= gap
    return up


@triton.jit
def encode_codebook(normalized, bucket_floor_ptr, values_ptr, key_shift, half, last, STOCHASTIC: tl.constexpr, uniform):
    """int32 codes of fp32 ``normalized`` values in ``[-1, 1]`` into a sorted codebook (``rounding.encode_codebook``).

    ``bucket_floor_ptr``, ``values_ptr``, ``key_shift``, ``half``: the format's
    :class:`~lightning_qstate.formats.CodebookIndex`; ``last = values.numel() - 1``.
    ``uniform`` is only read when ``STOCHASTIC``.
    """
    magnitude_key = tl.abs(normalized).to(tl.int32, bitcast=True) >> key_shift
    bucket = tl.where(normalized < 0, half - 1 - magnitude_key, half + magnitude_key)
    floor = tl.load(bucket_floor_ptr + bucket)
    next_value = tl.load(values_ptr + tl.minimum(floor + 1, last))
    floor = floor + (next_value <= normalized).to(tl.int32)
    low = tl.minimum(tl.maximum(floor, 0), last - 1)
    low_value = tl.load(values_ptr + low)
    high_value = tl.load(values_ptr + low + 1)
    up = round_up_mask(normalized - low_value, high_value - low_value, STOCHASTIC, uniform)
    return low + up.to(tl.int32)


@triton.jit
def encode_minifloat(magnitude, MANTISSA_BITS: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, STOCHASTIC: tl.constexpr, uniform):
    """int32 magnitude codes of fp32 ``magnitude >= 0`` (format units), saturating at ``MAX_CODE`` (``rounding.encode_minifloat``)."""
    exponent = ((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, 1 - BIAS)
    mantissa = magnitude * pow2(MANTISSA_BITS - exponent)
    if STOCHASTIC:
        rounded = tl.floor(mantissa)
        rounded = rounded + (uniform < mantissa - rounded).to(tl.float32)
    else:
        rounded = (mantissa + RNE_MAGIC) - RNE_MAGIC
    code = ((exponent + (BIAS - 1)) << MANTISSA_BITS) + rounded.to(tl.int32)
    return tl.minimum(code, MAX_CODE)


# --------------------------------------------------------------------------- block scaling


@triton.jit
def quiet_nan_like(x):
    """fp32 quiet NaNs (``0x7FC00000``) of ``x``'s shape.

    Built from a bit pattern, not a global ``nan`` constexpr: Triton checks that every function of a kernel
    sees the same value of a global, and ``nan != nan`` fails that check once two inlined calls read it.
    """
    return (x.to(tl.int32, bitcast=True) * 0 + 0x7FC00000).to(tl.float32, bitcast=True)


@triton.jit
def stored_scale(absmax, SCALE_BF16: tl.constexpr):
    """``BlockFormat.stored_scale``: fp32 value of the scale stored for a finite ``absmax >= 0`` (any shape).

    ``SCALE_BF16``: rounded up to a bf16 value (through its bit pattern), saturating at bf16's largest; else ``absmax``.
    """
    if SCALE_BF16:
        rounded = ((absmax.to(tl.int32, bitcast=True) + 0xFFFF) & -65536).to(tl.float32, bitcast=True)
        scale = tl.minimum(rounded, BF16_MAX)
    else:
        scale = absmax
    return scale


@triton.jit
def store_scales(pointer, scale, mask, SCALE_BF16: tl.constexpr):
    """Store fp32 ``scale`` (a ``stored_scale`` value or NaN) as fp32, or as bf16 through its bit pattern (exact)."""
    if SCALE_BF16:
        value = (scale.to(tl.int32, bitcast=True) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        value = scale
    tl.store(pointer, value, mask=mask)


@triton.jit
def normalize_block(x, SCALE_BF16: tl.constexpr):
    """Normalize one fp32 block (padding must be 0) by its stored scale, as ``BlockFormat.quantize_reference``.

    Returns ``(normalized, scale)``: ``normalized`` in ``[-1, 1]`` and the fp32 value of the stored
    ``scale`` (:func:`stored_scale` of the absmax). A block holding inf or NaN gets a NaN scale and is
    normalized as if it were all zeros, so its codes are the codes of 0.
    """
    magnitude = tl.abs(x)
    finite = magnitude <= FLT_MAX  # False for inf and NaN
    all_finite = tl.min(finite.to(tl.int32), axis=0) > 0
    # Max over finite magnitudes only: tl.max does not promise to propagate NaN.
    scale = stored_scale(tl.max(tl.where(finite, magnitude, 0.0), axis=0), SCALE_BF16)
    values = tl.where(all_finite, x, 0.0)
    divisor = tl.where(all_finite & (scale > 0), scale, 1.0)
    normalized = tl.math.div_rn(values, tl.broadcast_to(divisor, values.shape))
    scale = tl.where(all_finite, scale, quiet_nan_like(scale))
    return normalized, scale


@triton.jit
def encode_block(
    normalized,
    uniform,
    bucket_floor_ptr,
    values_ptr,
    key_shift,
    half,
    last,
    max_value,
    IS_MINIFLOAT: tl.constexpr,
    SIGNED: tl.constexpr,
    BITS: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr,
    MIN_CODE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """int32 codes of a normalized block: ``CodebookFormat.encode`` or ``MinifloatFormat.encode``.

    Codebook formats use ``bucket_floor_ptr, values_ptr, key_shift, half, last``;
    minifloat formats use ``max_value`` (fp32, the format's largest finite value)
    and the constexprs ``SIGNED, BITS, MANTISSA_BITS, BIAS, MAX_CODE``. Both clamp
    the code (the magnitude code, for minifloats) up to ``MIN_CODE``, the format's
    ``BlockFormat.min_code`` (nonzero: zero-free).
    """
    if IS_MINIFLOAT:
        if SIGNED:
            magnitude = tl.abs(normalized)
        else:
            magnitude = tl.maximum(normalized, 0.0)
        code = tl.maximum(encode_minifloat(magnitude * max_value, MANTISSA_BITS, BIAS, MAX_CODE, STOCHASTIC, uniform), MIN_CODE)
        if SIGNED:
            code = code | ((normalized < 0).to(tl.int32) << (BITS - 1))
    else:
        code = tl.maximum(encode_codebook(normalized, bucket_floor_ptr, values_ptr, key_shift, half, last, STOCHASTIC, uniform), MIN_CODE)
    return code


# --------------------------------------------------------------------------- containers


@triton.jit
def pack_nibbles(codes, BLOCK_SIZE: tl.constexpr):
    """``(BLOCK_SIZE,)`` int32 codes < 16 -> ``(BLOCK_SIZE // 2,)`` uint8, element ``2i`` in the low nibble."""
    low, high = tl.split(tl.reshape(codes, (BLOCK_SIZE // 2, 2)))
    return (low | (high << 4)).to(tl.uint8)


@triton.jit
def unpack_nibbles(packed):
    """``(n,)`` uint8 -> ``(2n,)`` int32 codes, the inverse of :func:`pack_nibbles`."""
    byte = packed.to(tl.int32)
    return tl.interleave(byte & 0xF, byte >> 4)


@triton.jit
def pack_dense(codes, BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """``(BLOCK_SIZE,)`` int32 codes < ``2**BITS`` (5 to 7 bits) -> ``(BLOCK_SIZE // 8, 8)`` uint8: row ``g`` holds group
    ``g``'s ``BITS`` bytes in its first columns (code ``j`` at bits ``[j * BITS, (j + 1) * BITS)``), zeros after."""
    groups = tl.reshape(codes.to(tl.int64), (BLOCK_SIZE // 8, 8))
    column = tl.arange(0, 8).to(tl.int64)
    words = tl.sum(groups << (column * BITS)[None, :], axis=1)  # disjoint bit fields: the sum is their OR
    return ((words[:, None] >> (column * 8)[None, :]) & 0xFF).to(tl.uint8)


@triton.jit
def unpack_dense(packed, BITS: tl.constexpr):
    """``(G, 8)`` uint8 (columns past ``BITS`` read as 0) -> ``(8 G,)`` int32 codes, the inverse of :func:`pack_dense`."""
    column = tl.arange(0, 8).to(tl.int64)
    words = tl.sum(packed.to(tl.int64) << (column * 8)[None, :], axis=1)
    codes = (words[:, None] >> (column * BITS)[None, :]) & ((1 << BITS) - 1)
    return tl.ravel(codes.to(tl.int32))


@triton.jit
def block_code_offsets(block_index, numel, BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """int64 container offsets of block ``block_index``'s codes and the mask of those that exist (``BLOCK_SIZE // 2``
    bytes when ``BITS <= 4``; ``(BLOCK_SIZE // 8, 8)`` offsets, ``BITS`` columns valid, when dense)."""
    if BITS <= 4:
        offsets = block_index.to(tl.int64) * (BLOCK_SIZE // 2) + tl.arange(0, BLOCK_SIZE // 2)
        mask = offsets < container_numel(numel, BITS)
    elif BITS < 8:
        column = tl.arange(0, 8)
        group = block_index.to(tl.int64) * (BLOCK_SIZE // 8) + tl.arange(0, BLOCK_SIZE // 8)
        offsets = group[:, None] * BITS + column[None, :]
        mask = (column < BITS)[None, :] & (offsets < container_numel(numel, BITS))
    else:
        offsets = block_index.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
        mask = offsets < container_numel(numel, BITS)
    return offsets, mask


@triton.jit
def container_numel(numel, BITS: tl.constexpr):
    """Container elements holding ``numel`` codes (``packing.packed_numel``), in int64: ``numel + 7`` of an int32
    ``numel`` near ``2**31`` would wrap, masking every code of the parameter off."""
    numel = tl.cast(numel, tl.int64)  # a launch with numel == 1 passes it as a constexpr (an int: no .to)
    if BITS <= 4:
        count = (numel + 1) // 2
    elif BITS < 8:
        count = (numel + 7) // 8 * BITS
    else:
        count = numel
    return count


@triton.jit
def store_block_codes(codes_ptr, codes, block_index, numel, BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Pack and store one block's int32 codes; codes past ``numel`` are stored as 0, as ``packing.pack`` pads."""
    element = block_index.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    codes = tl.where(element < numel, codes, 0)
    offsets, mask = block_code_offsets(block_index, numel, BITS, BLOCK_SIZE)
    if BITS <= 4:
        container = pack_nibbles(codes, BLOCK_SIZE)
    elif BITS < 8:
        container = pack_dense(codes, BITS, BLOCK_SIZE)
    else:
        container = codes.to(codes_ptr.dtype.element_ty)
    tl.store(codes_ptr + offsets, container, mask=mask)


@triton.jit
def load_block_codes(codes_ptr, block_index, numel, BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One block's container elements (0 past the end): the ``packed`` argument of :func:`decode_block`."""
    offsets, mask = block_code_offsets(block_index, numel, BITS, BLOCK_SIZE)
    return tl.load(codes_ptr + offsets, mask=mask, other=0)


@triton.jit
def decode_block(packed, decode_lut_ptr, scale, BITS: tl.constexpr):
    """fp32 values of one block: ``decode[code] * scale`` (``BlockFormat.dequantize_reference``).

    ``packed``: the block's container elements (uint8 nibble pairs, dense ``(G, 8)``
    bytes, uint8 or int16 codes); ``decode_lut_ptr``: the format's ``tables(device)["decode"]``.
    """
    if BITS <= 4:
        codes = unpack_nibbles(packed)
    elif BITS < 8:
        codes = unpack_dense(packed, BITS)
    elif BITS == 8:
        codes = packed.to(tl.int32)
    else:
        codes = packed.to(tl.int32) & 0xFFFF
    return tl.load(decode_lut_ptr + codes) * scale


# --------------------------------------------------------------------------- moments of fused optimizer kernels


@triton.jit
def sub_block_scale(values, scale, SUB_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """``values * scale``: one scalar ``scale``, or ``(SUB_BLOCKS,)`` scales over equal runs of ``values``."""
    if SUB_BLOCKS == 1:
        scaled = values * scale
    else:
        rows = tl.reshape(values, (SUB_BLOCKS, BLOCK_SIZE // SUB_BLOCKS))
        scaled = tl.reshape(rows * scale[:, None], (BLOCK_SIZE,))
    return scaled


@triton.jit
def normalize_sub_blocks(x, SUB_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr, SCALE_BF16: tl.constexpr):
    """:func:`~.triton_formats.normalize_block` of each of ``SUB_BLOCKS`` equal runs of ``x`` (padding 0).

    Returns ``(normalized, scale)``; ``scale`` is a scalar when ``SUB_BLOCKS == 1``, else ``(SUB_BLOCKS,)``.
    """
    if SUB_BLOCKS == 1:
        normalized, scale = normalize_block(x, SCALE_BF16)
    else:
        rows = tl.reshape(x, (SUB_BLOCKS, BLOCK_SIZE // SUB_BLOCKS))
        magnitude = tl.abs(rows)
        finite = magnitude <= FLT_MAX  # False for inf and NaN
        all_finite = tl.min(finite.to(tl.int32), axis=1) > 0
        scale = stored_scale(tl.max(tl.where(finite, magnitude, 0.0), axis=1), SCALE_BF16)
        values = tl.where(all_finite[:, None], rows, 0.0)
        divisor = tl.where(all_finite & (scale > 0), scale, 1.0)
        normalized = tl.reshape(tl.math.div_rn(values, tl.broadcast_to(divisor[:, None], values.shape)), (BLOCK_SIZE,))
        scale = tl.where(all_finite, scale, quiet_nan_like(scale))
    return normalized, scale


@triton.jit
def load_moment(codes_ptr, scales_ptr, decode_ptr, block, numel, BITS: tl.constexpr, SUB_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """fp32 values of block ``block`` of a stored moment (``BlockFormat.dequantize_reference``), and the same in units
    of their scale (``unit_values_reference``; unused results cost nothing)."""
    units = decode_block(load_block_codes(codes_ptr, block, numel, BITS, BLOCK_SIZE), decode_ptr, 1.0, BITS)
    if SUB_BLOCKS == 1:
        values = units * to_float32(tl.load(scales_ptr + block))
    else:
        index = block.to(tl.int64) * SUB_BLOCKS + tl.arange(0, SUB_BLOCKS)
        scales = to_float32(tl.load(scales_ptr + index, mask=index * (BLOCK_SIZE // SUB_BLOCKS) < numel, other=0.0))
        values = sub_block_scale(units, scales, SUB_BLOCKS, BLOCK_SIZE)
    return values, units


@triton.jit
def store_moment(
    x,
    uniform,
    codes_ptr,
    scales_ptr,
    decode_ptr,
    bucket_floor_ptr,
    values_ptr,
    key_shift,
    half,
    last,
    max_value,
    block,
    numel,
    BLOCK_SIZE: tl.constexpr,
    SUB_BLOCKS: tl.constexpr,
    BITS: tl.constexpr,
    IS_MINIFLOAT: tl.constexpr,
    SIGNED: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr,
    MIN_CODE: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    DECODE_STORED: tl.constexpr,
    SCALE_BF16: tl.constexpr,
):
    """Quantize and store block ``block`` of a moment (``x``: fp32, 0 past ``numel``), as ``BlockFormat.quantize_reference``.

    Returns the stored values (``decode[code] * scale``) and their units (``decode[code]``) when ``DECODE_STORED``,
    else ``x`` twice.
    """
    normalized, scale = normalize_sub_blocks(x, SUB_BLOCKS, BLOCK_SIZE, SCALE_BF16)
    codes = encode_block(
        normalized, uniform, bucket_floor_ptr, values_ptr, key_shift, half, last, max_value,
        IS_MINIFLOAT, SIGNED, BITS, MANTISSA_BITS, BIAS, MAX_CODE, MIN_CODE, STOCHASTIC,
    )  # fmt: skip
    store_block_codes(codes_ptr, codes, block, numel, BITS, BLOCK_SIZE)
    if SUB_BLOCKS == 1:
        store_scales(scales_ptr + block, scale, None, SCALE_BF16)
    else:
        index = block.to(tl.int64) * SUB_BLOCKS + tl.arange(0, SUB_BLOCKS)
        store_scales(scales_ptr + index, scale, index * (BLOCK_SIZE // SUB_BLOCKS) < numel, SCALE_BF16)
    if DECODE_STORED:
        units = tl.load(decode_ptr + codes)
        stored = sub_block_scale(units, scale, SUB_BLOCKS, BLOCK_SIZE)
    else:
        units = x
        stored = x
    return stored, units


@triton.jit
def stall_counts(new, old, stored, old_units, stored_units, in_range):
    """``stalled + (moved << 32)`` (int64) of one block: ``moved`` entries the update changed, ``stalled`` those of
    them that kept their code without being stored exactly (``formats.count_stalls``).

    One packed sum instead of two, and no sum of booleans (LLVM turns that into a bit mask built on the stack).
    A slot's sum of packed counts stays exact while its ``stalled`` is below ``2**32`` and its ``moved`` below ``2**31``
    (parameters under ``2**32`` values); the launcher unpacks each slot before adding them.
    """
    moved = (new != old) & in_range
    stalled = moved & (stored_units == old_units) & (stored != new)
    packed = tl.where(moved, 1 << 32, 0).to(tl.int64) + tl.where(stalled, 1, 0).to(tl.int64)
    return tl.sum(packed, axis=0)


# --------------------------------------------------------------------------- casts


@triton.jit
def to_float32(x):
    """Exact widening of fp32, bf16 or fp16 values to fp32.

    bf16 goes through its bit pattern (``bits << 16``): the same result as the
    hardware conversion, and also right under ``TRITON_INTERPRET=1``, whose bf16
    conversions mishandle subnormals.
    """
    if tl.constexpr(x.dtype == tl.bfloat16):
        wide = (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        wide = x.to(tl.float32)
    return wide


@triton.jit
def float32_to(x, DTYPE: tl.constexpr):
    """Round-to-nearest-even cast of fp32 ``x`` to ``DTYPE`` (fp32, bf16 or fp16), as torch's ``.to(dtype)``.

    bf16 rounds on the bit pattern like torch (``+ 0x7FFF + lsb``; NaN stays NaN),
    because the interpreter's fp32->bf16 conversion truncates.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        rounded = tl.where(x != x, (bits >> 16) | 0x40, rounded)  # NaN: keep it a (quiet) NaN
        narrow = rounded.to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        narrow = x.to(DTYPE)
    return narrow


@triton.jit
def bf16_stochastic(x, random_bits):
    """SR cast of fp32 ``x`` to bf16: add ``random_bits`` (int32 in ``[0, 2**16)``), clear the low 16 bits; past bf16's
    range the RN cast; inf/NaN pass through.

    Same as ``rounding.bf16_stochastic``; the result is built from the bit pattern (no float conversion).
    """
    bits = x.to(tl.int32, bitcast=True)
    # past bf16's largest value the RN cast (rounding.bf16_stochastic): + 0x8000 rounds bf16's last binade to nearest
    # (its last mantissa is odd: a tie goes up, to inf); inf/NaN take nothing
    addend = tl.where(tl.abs(x) <= BF16_MAX, random_bits, tl.where(tl.abs(x) <= FLT_MAX, 0x8000, 0))
    high = (bits + addend) >> 16
    high = tl.where(x != x, high | 0x40, high)  # NaN: keep it a (quiet) NaN
    return high.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def lift_flushed(x, y):
    """``CastFormat.lift_flushed`` of a zero-free cast: ``y`` (bf16 or fp16, the cast of fp32 ``x``) with every positive
    ``x`` cast to 0 stored as the smallest subnormal (bit pattern 1)."""
    bits = y.to(tl.int16, bitcast=True)
    return tl.where((x > 0) & (bits == 0), bits + 1, bits).to(y.dtype, bitcast=True)


@triton.jit
def fp16_stochastic(x, uniform):
    """SR cast of fp32 ``x`` to fp16 via the E5M10 minifloat rounding; ``|x| > 65504`` or non-finite: RN cast (``cast.fp16_stochastic``)."""
    magnitude = tl.abs(x)
    in_range = magnitude <= FP16_MAX
    # Out-of-range lanes are replaced by the RN cast below; encode 0 there to keep every conversion defined.
    # E5M10: 10 mantissa bits, bias 15, largest finite code 0x7BFF (cast.FP16_SPEC); literals, not globals,
    # because the interpreter would pass a global constexpr through un-unwrapped.
    code = encode_minifloat(tl.where(in_range, magnitude, 0.0), 10, 15, 0x7BFF, True, uniform)
    sign = (x.to(tl.int32, bitcast=True) < 0).to(tl.int32) << 15
    pattern = (code | sign).to(tl.int16).to(tl.float16, bitcast=True)
    return tl.where(in_range, pattern, x.to(tl.float16))


# The grids a fused optimizer kernel may round updated parameter values to (``WEIGHT_GRID`` of ``triton_adam``).
NO_GRID: tl.constexpr = tl.constexpr(0)
FP32_GRID: tl.constexpr = tl.constexpr(1)
BF16_GRID: tl.constexpr = tl.constexpr(2)
FP16_GRID: tl.constexpr = tl.constexpr(3)


@triton.jit
def round_to_weight_grid(x, seed_ptr, offsets, WEIGHT_GRID: tl.constexpr, WEIGHT_STOCHASTIC: tl.constexpr):
    """fp32 ``x`` rounded to a weight grid, as fp32 values (``CastFormat.round_saturated`` of a bf16, fp16 or fp32
    cast format, then ``.float()``: past the dtype's range, inf included, its largest value; NaN kept): RN, or SR
    (``WEIGHT_STOCHASTIC``) drawing from the int64 seed at ``seed_ptr`` (read only then), element ``offsets[i]`` from
    ``(seed, offsets[i])``: 16 random bits for bf16 (:func:`bf16_stochastic`), a uniform for fp16 (:func:`fp16_stochastic`)."""
    if WEIGHT_GRID == BF16_GRID:
        x = tl.where(x > BF16_MAX, BF16_MAX, tl.where(x < -BF16_MAX, -BF16_MAX, x))
        if WEIGHT_STOCHASTIC:
            grid = to_float32(bf16_stochastic(x, (tl.randint(tl.load(seed_ptr), offsets) & 0xFFFF).to(tl.int32)))
        else:
            grid = to_float32(float32_to(x, tl.bfloat16))
    elif WEIGHT_GRID == FP16_GRID:
        x = tl.where(x > FP16_MAX, FP16_MAX, tl.where(x < -FP16_MAX, -FP16_MAX, x))
        if WEIGHT_STOCHASTIC:
            grid = fp16_stochastic(x, tl.rand(tl.load(seed_ptr), offsets)).to(tl.float32)
        else:
            grid = x.to(tl.float16).to(tl.float32)
    else:  # NO_GRID, FP32_GRID: every fp32 value
        grid = x
    return grid
