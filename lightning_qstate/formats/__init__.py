"""Storage formats for optimizer states (pure torch).

``get_format(name, **options)`` returns a :class:`StorageFormat`; its
``quantize(x, rounding="nearest"|"stochastic", generator=None)`` returns a
:class:`QuantizedTensor` with ``dequantize()``, ``nbytes`` and ``bits_per_value``.

Example::

    >>> import torch
    >>> from lightning_qstate.formats import get_format
    >>> q = get_format("int8").quantize(torch.randn(1000))
    >>> round(q.bits_per_value, 3)
    8.064
    >>> round(get_format("int8", signed=False).quantize(torch.rand(1000)).bits_per_value, 3)
    8.128
"""

from __future__ import annotations

import re
from functools import cache

import torch

from .base import (
    FLOAT_INPUT_DTYPES,
    KernelBackend,
    NonFiniteError,
    QuantizedTensor,
    StorageFormat,
    count_stalls,
    kernel_backend,
    local_tensor,
    register_kernel_backend,
)
from .block import (
    NONFINITE_POLICIES,
    SCALE_DTYPE_NAMES,
    SCALE_DTYPES,
    BlockFormat,
    CodebookFormat,
    MinifloatFormat,
    NonFinitePolicy,
    ScaleDtype,
    check_block_options,
    check_block_size,
)
from .cast import CastFormat
from .codebooks import CodebookIndex, MinifloatSpec, dynamic_map, linear_map
from .rounding import ROUNDINGS, Rounding, check_rounding

FORMAT_NAMES: tuple[str, ...] = (
    "fp32", "bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "int8", "int7", "int6", "int5", "int4",
    "int8_linear", "int7_linear", "int6_linear", "int5_linear", "int4_linear", "eXmY",
)  # fmt: skip
_INTEGER = re.compile(r"int([4-8])(_linear)?")
_CAST_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_MINIFLOAT = re.compile(r"e(\d+)m(\d+)")
_FP8_SPECS = {
    "fp8_e4m3": MinifloatSpec(4, 3, signed=True, max_code=0x7E),  # OCP E4M3FN: 0x7F is NaN, max 448
    "fp8_e5m2": MinifloatSpec(5, 2, signed=True, max_code=0x7B),  # OCP E5M2: top exponent is inf/NaN, max 57344
}


def default_block_size(bits: int) -> int:
    """128 for formats of 4 bits or fewer, 256 otherwise (the peers' defaults)."""
    return 128 if bits <= 4 else 256


def minifloat_spec(exponent_bits: int, mantissa_bits: int, signed: bool) -> MinifloatSpec:
    """An all-finite ExMy spec; checks the supported range."""
    bits = exponent_bits + mantissa_bits + int(signed)
    if not 1 <= exponent_bits <= 7 or bits > 16:
        raise ValueError(
            f"format 'e{exponent_bits}m{mantissa_bits}' is not supported: need 1 <= X <= 7 exponent bits "
            f"and at most 16 bits in all (sign included), e.g. 'e2m2', 'e3m0', 'e4m3', 'e5m10'"
        )
    return MinifloatSpec(exponent_bits, mantissa_bits, signed, max_code=2 ** (exponent_bits + mantissa_bits) - 1)


def get_format(
    name: str,
    *,
    block_size: int | None = None,
    signed: bool = True,
    nonfinite: NonFinitePolicy = "raise",
    scale_dtype: ScaleDtype | None = None,
) -> StorageFormat:
    """The storage format called ``name``.

    Args:
        name: ``fp32``, ``bf16``, ``fp16`` (casts); ``fp8_e4m3``, ``fp8_e5m2`` (OCP FP8,
            block-scaled); ``int8``, ``int7``, ``int6``, ``int5``, ``int4`` (dynamic-tree maps as
            in bitsandbytes and torchao: ``max_exponent_bits`` 7 at 8 bits, ``bits - 1`` below, as
            torchao's 4-bit map; unsigned ``int4`` is torchao's zero-free linear ``v`` map);
            ``int8_linear`` ... ``int4_linear`` (absmax linear maps); ``eXmY`` (any minifloat,
            e.g. ``e2m2``, ``e3m0``, ``e4m3``). Codes of 5 to 7 bits (``int5`` to ``int7``, their
            linear maps, minifloats such as ``e3m2``) are stored densely, 8 codes in ``bits``
            bytes (:mod:`lightning_qstate.formats.packing`).
        block_size: values per absmax scale, a power of two; default 128 for
            formats of at most 4 bits, else 256; at least 8 for 5- to 7-bit codes (a block is
            then a whole number of bytes). Ignored by casts.
        signed: ``False`` for non-negative states such as Adam's ``v``: the map
            spends no codes on negatives, and the format is zero-free: it never
            stores a positive value as 0 (block formats store values below their
            smallest positive code, 0 included, as that code; casts store positive
            values below their smallest subnormal as it, and keep exact zeros; FP8
            keeps its OCP bit patterns). See :mod:`lightning_qstate.formats.block`.
        nonfinite: block formats only; ``"raise"`` (default) or ``"nan_block"``,
            see :mod:`lightning_qstate.formats.block`.
        scale_dtype: block formats only; ``"bf16"`` (each block's absmax rounded up to
            bf16, 2 bytes) or ``"fp32"`` (the absmax itself, 4 bytes, as torchao and
            bitsandbytes store it); ``None`` (default): bf16 if ``signed`` (first moments),
            else fp32 (second moments; why: :mod:`lightning_qstate.formats.block`).
            Ignored by casts.

    Raises:
        ValueError: unknown name, a block size that is not a power of two, an unknown
            ``nonfinite`` or ``scale_dtype`` (also for casts, which ignore valid ones), or a
            ``signed`` that is not a bool.
        TypeError: a name that is not a string.
    """
    # checked before the cache: it would hand an equal argument of another type (signed=1, block_size=256.0) the format
    # of a valid call made earlier
    if not isinstance(name, str):
        raise TypeError(f"a format name must be a string, got {name!r}; valid formats: {', '.join(FORMAT_NAMES)} (or eXmY)")
    if not isinstance(signed, bool):
        raise ValueError(f"signed={signed!r} must be True or False (False: a non-negative state such as Adam's v)")
    if block_size is not None:
        check_block_size(block_size)
    check_block_options(nonfinite, scale_dtype)  # casts ignore valid ones; a wrong one is never silently accepted
    return _cached_format(name, block_size, signed, nonfinite, scale_dtype)


@cache
def _cached_format(
    name: str, block_size: int | None, signed: bool, nonfinite: NonFinitePolicy, scale_dtype: ScaleDtype | None
) -> StorageFormat:
    """:func:`get_format` of checked argument types, one instance per distinct call."""
    fmt = _build_format(name, block_size, signed, nonfinite, scale_dtype)
    if isinstance(fmt, BlockFormat):
        scale_dtype = SCALE_DTYPE_NAMES[fmt.scale_dtype]  # recorded resolved: checkpoints never follow a changed default
    fmt.config = {"name": name, "block_size": block_size, "signed": signed, "nonfinite": nonfinite, "scale_dtype": scale_dtype}
    return fmt


def _build_format(
    name: str, block_size: int | None, signed: bool, nonfinite: NonFinitePolicy, scale_dtype: ScaleDtype | None
) -> StorageFormat:
    if name in _CAST_DTYPES:
        return CastFormat(name, _CAST_DTYPES[name], zero_free=not signed)
    if name in _FP8_SPECS:
        return MinifloatFormat(
            name, _FP8_SPECS[name], 256 if block_size is None else block_size, nonfinite, zero_free=not signed, scale_dtype=scale_dtype
        )
    match = _INTEGER.fullmatch(name)
    if match:
        bits, linear = int(match.group(1)), match.group(2) is not None
        if linear:
            codebook = linear_map(signed, bits)
        elif bits == 4 and not signed:
            codebook = linear_map(False, 4, zero_free=True)  # torchao's 4-bit v map
        else:
            codebook = dynamic_map(signed, bits)
        block_size = default_block_size(bits) if block_size is None else block_size
        return CodebookFormat(name, codebook, block_size, signed, nonfinite, scale_dtype)
    match = _MINIFLOAT.fullmatch(name)
    if match:
        spec = minifloat_spec(int(match.group(1)), int(match.group(2)), signed)
        return MinifloatFormat(
            name,
            spec,
            default_block_size(spec.bits) if block_size is None else block_size,
            nonfinite,
            zero_free=not signed,
            scale_dtype=scale_dtype,
        )
    raise ValueError(f"unknown format {name!r}; valid formats: {', '.join(FORMAT_NAMES)} (eXmY such as 'e2m2', 'e3m0', 'e4m3')")


__all__ = [
    "FLOAT_INPUT_DTYPES",
    "FORMAT_NAMES",
    "NONFINITE_POLICIES",
    "ROUNDINGS",
    "SCALE_DTYPES",
    "BlockFormat",
    "CastFormat",
    "CodebookFormat",
    "CodebookIndex",
    "KernelBackend",
    "MinifloatFormat",
    "MinifloatSpec",
    "NonFiniteError",
    "NonFinitePolicy",
    "QuantizedTensor",
    "Rounding",
    "ScaleDtype",
    "StorageFormat",
    "check_block_size",
    "check_rounding",
    "count_stalls",
    "default_block_size",
    "dynamic_map",
    "get_format",
    "kernel_backend",
    "linear_map",
    "local_tensor",
    "minifloat_spec",
    "register_kernel_backend",
]
