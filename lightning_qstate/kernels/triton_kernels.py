"""The Triton kernels of the block and cast formats, and the specializations they compile to.

Kernels (each built from the device functions of :mod:`.triton_formats`):

* :func:`quantize_blocks_kernel`: one program per block of ``BLOCK_SIZE`` values:
  absmax scale, encode (codebook or minifloat, RN or SR), pack, store.
* :func:`dequantize_blocks_kernel`: one program per block: unpack, decode, scale.
* :func:`stochastic_cast_kernel`: SR cast of fp32/bf16/fp16 values to bf16 or fp16.
* :func:`~.triton_adam.adam_step_kernel` (defined in :mod:`.triton_adam`): one fused
  Adam(W) step per block of a parameter with block-quantized moments.

:class:`KernelVariant` describes one specialization (argument types, constexprs,
``num_warps``). The ``*_variant`` functions give the one a launch uses, so the
launchers in :mod:`.launch` and the ahead-of-time compile check
(``tests/test_kernels_compile.py``, via :func:`aot_variants`) build the same code.
:data:`KERNELS` lists every kernel of this module; a new kernel must be added there
and to :func:`aot_variants`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl
from triton.runtime.jit import KernelInterface

from ..formats import BlockFormat, CastFormat, CodebookFormat, MinifloatFormat, Rounding, StorageFormat, get_format
from ..formats.packing import container_dtype
from .triton_adam import adam_step_kernel
from .triton_formats import (
    BF16_GRID,
    FP16_GRID,
    FP32_GRID,
    NO_GRID,
    bf16_stochastic,
    decode_block,
    float32_to,
    fp16_stochastic,
    lift_flushed,
    load_block_codes,
    store_moment,
    to_float32,
)

CAST_BLOCK_SIZE = 1024
CAST_NUM_WARPS = 4


@triton.jit
def quantize_blocks_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    seed_ptr,
    numel,
    bucket_floor_ptr,
    values_ptr,
    key_shift,
    half,
    last,
    max_value,
    BLOCK_SIZE: tl.constexpr,
    BITS: tl.constexpr,
    IS_MINIFLOAT: tl.constexpr,
    SIGNED: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr,
    MIN_CODE: tl.constexpr,
    SCALE_BF16: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """Quantize block ``program_id(0)`` of ``x`` (``numel`` values): packed codes and its scale (NaN if non-finite),
    fp32 or, with ``SCALE_BF16``, bf16.

    ``seed_ptr``: one int64 seed, read only when ``STOCHASTIC``; the uniform draw of
    element ``i`` is ``tl.rand(seed, i)``. The encoder arguments are those of
    :func:`~.triton_formats.encode_block`.
    """
    block = tl.program_id(0)
    offsets = block.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    x = to_float32(tl.load(x_ptr + offsets, mask=offsets < numel, other=0.0))
    if STOCHASTIC:
        uniform = tl.rand(tl.load(seed_ptr), offsets)
    else:
        uniform = x  # not read by RN
    # one block scale; the decode table (values_ptr here) is not read without DECODE_STORED
    store_moment(
        x, uniform, codes_ptr, scales_ptr, values_ptr, bucket_floor_ptr, values_ptr, key_shift, half, last, max_value, block,
        numel, BLOCK_SIZE, 1, BITS, IS_MINIFLOAT, SIGNED, MANTISSA_BITS, BIAS, MAX_CODE, MIN_CODE, STOCHASTIC, False, SCALE_BF16,
    )  # fmt: skip


@triton.jit
def dequantize_blocks_kernel(codes_ptr, scales_ptr, decode_lut_ptr, out_ptr, numel, BLOCK_SIZE: tl.constexpr, BITS: tl.constexpr):
    """Dequantize block ``program_id(0)``: ``decode[code] * scale``, stored in ``out_ptr``'s dtype (RN cast)."""
    block = tl.program_id(0)
    packed = load_block_codes(codes_ptr, block, numel, BITS, BLOCK_SIZE)
    values = decode_block(packed, decode_lut_ptr, to_float32(tl.load(scales_ptr + block)), BITS)
    offsets = block.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    tl.store(out_ptr + offsets, float32_to(values, out_ptr.dtype.element_ty), mask=offsets < numel)


@triton.jit
def stochastic_cast_kernel(x_ptr, out_ptr, seed_ptr, numel, TO_BF16: tl.constexpr, ZERO_FREE: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """SR cast of ``BLOCK_SIZE`` values to bf16 (``TO_BF16``) or fp16; element ``i`` draws from ``(seed, i)``.
    ``ZERO_FREE``: a positive value is never stored as 0 (``CastFormat.zero_free``)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    in_range = offsets < numel
    x = to_float32(tl.load(x_ptr + offsets, mask=in_range, other=0.0))
    seed = tl.load(seed_ptr)
    if TO_BF16:
        y = bf16_stochastic(x, (tl.randint(seed, offsets) & 0xFFFF).to(tl.int32))
    else:
        y = fp16_stochastic(x, tl.rand(seed, offsets))
    if ZERO_FREE:
        y = lift_flushed(x, y)
    tl.store(out_ptr + offsets, y, mask=in_range)


KERNELS = {
    "quantize_blocks_kernel": quantize_blocks_kernel,
    "dequantize_blocks_kernel": dequantize_blocks_kernel,
    "stochastic_cast_kernel": stochastic_cast_kernel,
    "adam_step_kernel": adam_step_kernel,
}
"""Every ``@triton.jit`` kernel of this module and of :mod:`.triton_adam`, by name."""


def defined_kernels() -> set[str]:
    """Names of the ``@triton.jit`` kernels defined in this module and in :mod:`.triton_adam` (the tests check that
    :data:`KERNELS` has them all)."""
    modules = {__name__, adam_step_kernel.fn.__module__}
    return {
        name
        for module in modules
        for name, obj in vars(sys.modules[module]).items()
        if isinstance(obj, KernelInterface) and getattr(getattr(obj, "fn", None), "__module__", None) == module
    }


# --------------------------------------------------------------------------- specializations

_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.uint8: "*u8",
    torch.int16: "*i16",
    torch.int32: "*i32",
    torch.int64: "*i64",
}


def pointer_type(dtype: torch.dtype) -> str:
    """Triton signature type of a pointer to ``dtype`` (``"*fp32"``, ``"*u8"``, ...)."""
    return _POINTER_TYPES[dtype]


def block_num_warps(block_size: int) -> int:
    """Warps per block program: about 128 values per warp, 1 to 8."""
    return max(1, min(8, block_size // 128))


@dataclass(frozen=True)
class KernelVariant:
    """One specialization of a kernel in :data:`KERNELS`: what ``triton.compile`` needs and the launch uses.

    ``signature`` maps every argument, in order, to its Triton type (``"constexpr"``
    for the constexprs, whose values are in ``constexprs``). ``options``: further
    compile options the launch passes (e.g. ``enable_fp_fusion``).
    """

    kernel: str
    signature: dict[str, str]
    constexprs: dict[str, object]
    num_warps: int
    label: str = field(default="", compare=False)
    options: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def launch_options(self) -> dict[str, object]:
        """Keyword arguments of the launch besides the kernel's own: ``num_warps``, ``options`` and the constexprs."""
        return {"num_warps": self.num_warps, **self.options, **self.constexprs}

    @property
    def fn(self) -> KernelInterface:
        return KERNELS[self.kernel]


def _with_constexprs(types: dict[str, str], constexprs: dict[str, object]) -> dict[str, str]:
    return {**types, **{name: "constexpr" for name in constexprs}}


def encoder_constexprs(fmt: BlockFormat, prefix: str = "") -> dict[str, object]:
    """The constexprs of :func:`~.triton_formats.encode_block` for ``fmt`` (and ``BITS``, ``SCALE_BF16``), names prefixed by ``prefix``."""
    if isinstance(fmt, MinifloatFormat):
        spec = fmt.spec
        minifloat = {
            "IS_MINIFLOAT": True,
            "SIGNED": spec.signed,
            "MANTISSA_BITS": spec.mantissa_bits,
            "BIAS": spec.bias,
            "MAX_CODE": spec.max_code,
            "MIN_CODE": fmt.min_code,
        }
    elif isinstance(fmt, CodebookFormat):
        minifloat = {"IS_MINIFLOAT": False, "SIGNED": fmt.signed, "MANTISSA_BITS": 0, "BIAS": 0, "MAX_CODE": 0, "MIN_CODE": fmt.min_code}
    else:
        raise TypeError(f"no Triton encoder for block format {fmt!r}")
    constexprs = {"BITS": fmt.bits, **minifloat, "SCALE_BF16": fmt.scale_dtype == torch.bfloat16}
    return {f"{prefix}{name}": value for name, value in constexprs.items()}


def quantize_blocks_variant(fmt: BlockFormat, rounding: Rounding, input_dtype: torch.dtype) -> KernelVariant:
    """The :func:`quantize_blocks_kernel` specialization for ``fmt``, ``rounding`` and input ``input_dtype``."""
    if not isinstance(fmt, BlockFormat):
        raise TypeError(f"quantize_blocks_kernel stores block formats, got {fmt!r}")
    constexprs = {"BLOCK_SIZE": fmt.block_size, **encoder_constexprs(fmt), "STOCHASTIC": rounding == "stochastic"}
    types = {
        "x_ptr": pointer_type(input_dtype),
        "codes_ptr": pointer_type(container_dtype(fmt.bits)),
        "scales_ptr": pointer_type(fmt.scale_dtype),
        "seed_ptr": "*i64",
        "numel": "i32",
        "bucket_floor_ptr": "*i32",
        "values_ptr": "*fp32",
        "key_shift": "i32",
        "half": "i32",
        "last": "i32",
        "max_value": "fp32",
    }
    label = f"quantize[{fmt.name},bits={fmt.bits},block={fmt.block_size},scale={fmt.scale_dtype},{rounding},{input_dtype}]"
    num_warps = block_num_warps(fmt.block_size)
    return KernelVariant("quantize_blocks_kernel", _with_constexprs(types, constexprs), constexprs, num_warps, label)


def dequantize_blocks_variant(fmt: BlockFormat, output_dtype: torch.dtype) -> KernelVariant:
    """The :func:`dequantize_blocks_kernel` specialization for ``fmt`` and output ``output_dtype``."""
    if not isinstance(fmt, BlockFormat):
        raise TypeError(f"dequantize_blocks_kernel reads block formats, got {fmt!r}")
    constexprs = {"BLOCK_SIZE": fmt.block_size, "BITS": fmt.bits}
    types = {
        "codes_ptr": pointer_type(container_dtype(fmt.bits)),
        "scales_ptr": pointer_type(fmt.scale_dtype),
        "decode_lut_ptr": "*fp32",
        "out_ptr": pointer_type(output_dtype),
        "numel": "i32",
    }
    label = f"dequantize[{fmt.name},bits={fmt.bits},block={fmt.block_size},scale={fmt.scale_dtype},{output_dtype}]"
    num_warps = block_num_warps(fmt.block_size)
    return KernelVariant("dequantize_blocks_kernel", _with_constexprs(types, constexprs), constexprs, num_warps, label)


def stochastic_cast_variant(fmt: CastFormat, input_dtype: torch.dtype) -> KernelVariant:
    """The :func:`stochastic_cast_kernel` specialization for cast format ``fmt`` (bf16 or fp16) and ``input_dtype``."""
    if not isinstance(fmt, CastFormat) or fmt.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"stochastic_cast_kernel casts to bf16 or fp16, got {fmt!r}")
    constexprs = {"TO_BF16": fmt.dtype == torch.bfloat16, "ZERO_FREE": fmt.zero_free, "BLOCK_SIZE": CAST_BLOCK_SIZE}
    types = {"x_ptr": pointer_type(input_dtype), "out_ptr": pointer_type(fmt.dtype), "seed_ptr": "*i64", "numel": "i32"}
    label = f"stochastic_cast[{fmt.name}{',zero_free' if fmt.zero_free else ''},{input_dtype}]"
    return KernelVariant("stochastic_cast_kernel", _with_constexprs(types, constexprs), constexprs, CAST_NUM_WARPS, label)


# adam_step_kernel's WEIGHT_GRID constexpr by the dtype of the weight grid (None: no grid).
_WEIGHT_GRIDS = {None: NO_GRID.value, torch.float32: FP32_GRID.value, torch.bfloat16: BF16_GRID.value, torch.float16: FP16_GRID.value}


# A program holds a whole block: past 2048 values (or 32 sub-blocks of the other moment's in one) the compiled kernels
# spill registers (block 4096: the int6 SR Adam step, 120 B on sm_80; m block 32 under v block 2048: 12 B). Larger
# blocks take the torch reference (formats) and the eager or compiled step (optimizers); aot_variants compiles the limits.
MAX_BLOCK = 2048
MAX_SUB_BLOCKS = 32


def block_supported(fmt: StorageFormat) -> bool:
    """Whether the quantize and dequantize kernels take ``fmt``: a block format of at most :data:`MAX_BLOCK` values."""
    return isinstance(fmt, BlockFormat) and fmt.block_size <= MAX_BLOCK


def adam_step_supported(m_format: StorageFormat, v_format: StorageFormat) -> bool:
    """Whether :func:`adam_step_kernel` stores these moment formats: both block formats with a Triton encoder, blocks of
    at most :data:`MAX_BLOCK` values, the larger at most :data:`MAX_SUB_BLOCKS` of the smaller."""
    formats = (m_format, v_format)
    if not all(isinstance(fmt, (CodebookFormat, MinifloatFormat)) and block_supported(fmt) for fmt in formats):
        return False
    smaller, larger = sorted(fmt.block_size for fmt in formats)
    return larger <= MAX_SUB_BLOCKS * smaller


def adam_step_variant(
    m_format: BlockFormat,
    v_format: BlockFormat,
    rounding: Rounding,
    grad_dtype: torch.dtype,
    decoupled_weight_decay: bool,
    maximize: bool,
    track_stalls: bool,
    param_dtype: torch.dtype = torch.float32,
    weight_dtype: torch.dtype | None = None,
    weight_rounding: Rounding = "nearest",
    eco: bool = False,
) -> KernelVariant:
    """The :func:`adam_step_kernel` specialization for the moment formats, rounding, gradient dtype and Adam flags.

    The program block is the larger of the two block sizes; the other moment is scaled per sub-block. The launch
    disables FMA contraction (``enable_fp_fusion=False``) so that the update rounds as torch's kernels do.

    Without master weights: ``param_dtype`` (fp32, bf16 or fp16), ``weight_dtype`` (the dtype of the cast-format
    weight grid, or ``None``: no grid), ``weight_rounding`` (ignored for an fp32 grid: every value is on it) and
    ``eco`` (ECO's feedback into ``m``; needs a grid).
    """
    if not adam_step_supported(m_format, v_format):
        raise TypeError(f"adam_step_kernel stores block-format moments, got {m_format!r} and {v_format!r}")
    if param_dtype not in (torch.float32, torch.bfloat16, torch.float16) or weight_dtype not in _WEIGHT_GRIDS:
        raise TypeError(f"adam_step_kernel updates fp32/bf16/fp16 parameters on an fp32/bf16/fp16 grid, not {param_dtype}, {weight_dtype}")
    if eco and weight_dtype is None:
        raise ValueError("adam_step_kernel feeds back the rounding error of a weight grid (eco) only with a grid")
    weight_stochastic = weight_rounding == "stochastic" and weight_dtype in (torch.bfloat16, torch.float16)
    block_size = max(m_format.block_size, v_format.block_size)
    constexprs = {
        "BLOCK_SIZE": block_size,
        "M_SUB_BLOCKS": block_size // m_format.block_size,
        **encoder_constexprs(m_format, "M_"),
        "V_SUB_BLOCKS": block_size // v_format.block_size,
        **encoder_constexprs(v_format, "V_"),
        "STOCHASTIC": rounding == "stochastic",
        "DECOUPLED": bool(decoupled_weight_decay),
        "MAXIMIZE": bool(maximize),
        "TRACK_STALLS": bool(track_stalls),
        "WEIGHT_GRID": _WEIGHT_GRIDS[weight_dtype],
        "WEIGHT_STOCHASTIC": weight_stochastic,
        "ECO": bool(eco),
    }
    types = {"param_ptr": pointer_type(param_dtype), "grad_ptr": pointer_type(grad_dtype)}
    for prefix, fmt in (("m_", m_format), ("v_", v_format)):
        types.update(
            {
                f"{prefix}codes_ptr": pointer_type(container_dtype(fmt.bits)),
                f"{prefix}scales_ptr": pointer_type(fmt.scale_dtype),
                f"{prefix}decode_ptr": "*fp32",
                f"{prefix}bucket_floor_ptr": "*i32",
                f"{prefix}values_ptr": "*fp32",
                f"{prefix}key_shift": "i32",
                f"{prefix}half": "i32",
                f"{prefix}last": "i32",
                f"{prefix}max_value": "fp32",
            }
        )
    types.update({"coefficients_ptr": "*fp32", "seed_ptr": "*i64", "counts_ptr": "*i64", "numel": "i32"})
    flags = [name for name, on in (("decoupled", decoupled_weight_decay), ("maximize", maximize), ("stalls", track_stalls)) if on]
    if param_dtype != torch.float32 or weight_dtype is not None:
        grid = "none" if weight_dtype is None else f"{weight_dtype}/{'stochastic' if weight_stochastic else 'nearest'}"
        flags += [f"param={param_dtype}", f"grid={grid}"] + (["eco"] if eco else [])
    label = (
        f"adam_step[m={m_format.name}/{m_format.bits}b/{m_format.block_size}/{m_format.scale_dtype},"
        f"v={v_format.name}/{v_format.bits}b/{v_format.block_size}/{v_format.scale_dtype},"
        f"{rounding},{grad_dtype},{','.join(flags)}]"
    )
    return KernelVariant(
        "adam_step_kernel",
        _with_constexprs(types, constexprs),
        constexprs,
        block_num_warps(block_size),
        label,
        options={"enable_fp_fusion": False},
    )


def aot_variants() -> list[KernelVariant]:
    """Specializations to compile ahead of time: every kernel, encoder, rounding and container, a few block sizes, and
    every weight-grid mode of the Adam kernel (parameter dtypes, grids, SR of the weights, ECO)."""
    fp32, bf16, fp16 = torch.float32, torch.bfloat16, torch.float16
    formats: list[tuple[StorageFormat, Rounding, torch.dtype]] = [
        (get_format("int8"), "nearest", fp32),  # codebook, byte container
        (get_format("int8", signed=False), "stochastic", fp32),  # zero-free codebook (MIN_CODE 1)
        (get_format("int8"), "stochastic", bf16),
        (get_format("int8", scale_dtype="fp32"), "nearest", fp32),  # fp32 scales (version-1 checkpoints)
        (get_format("int4", block_size=32), "nearest", fp32),  # codebook, nibbles, small block
        (get_format("int4", signed=False), "stochastic", fp16),
        (get_format("fp8_e4m3"), "nearest", bf16),  # minifloat, signed, byte container
        (get_format("fp8_e5m2", block_size=MAX_BLOCK), "stochastic", fp32),  # the largest block
        (get_format("fp8_e4m3", block_size=MAX_BLOCK), "stochastic", fp32),
        (get_format("int8", block_size=MAX_BLOCK), "stochastic", bf16),
        (get_format("e2m2", signed=False), "nearest", fp32),  # minifloat, nibbles
        (get_format("int6", signed=False), "nearest", fp32),  # codebook, dense 6-bit container
        (get_format("e3m3"), "stochastic", bf16),  # minifloat, dense 7-bit container
        (get_format("int5_linear", block_size=32), "nearest", fp16),  # dense 5-bit, small block
        (get_format("e5m10"), "stochastic", fp32),  # minifloat, int16 container
    ]
    variants = [quantize_blocks_variant(fmt, rounding, dtype) for fmt, rounding, dtype in formats]
    variants += [
        dequantize_blocks_variant(get_format("int4"), fp32),
        dequantize_blocks_variant(get_format("int6"), fp32),  # dense
        dequantize_blocks_variant(get_format("int8", block_size=2048), bf16),
        dequantize_blocks_variant(get_format("fp8_e4m3", scale_dtype="fp32"), fp32),
        dequantize_blocks_variant(get_format("e5m10", block_size=32), fp16),
    ]
    variants += [stochastic_cast_variant(get_format("bf16"), fp32), stochastic_cast_variant(get_format("fp16", signed=False), bf16)]
    # Adam: (m format, v format, rounding, grad dtype, decoupled, maximize, track_stalls).
    adam: list[tuple[StorageFormat, StorageFormat, Rounding, torch.dtype, bool, bool, bool]] = [
        (get_format("int8"), get_format("int8", signed=False), "nearest", fp32, True, False, False),  # the default states (zero-free v)
        (get_format("int8"), get_format("int8", signed=False), "stochastic", fp32, True, False, True),
        (get_format("int8", scale_dtype="fp32"), get_format("int8", signed=False), "nearest", fp32, True, False, True),  # mixed scales
        (get_format("int4"), get_format("int4", signed=False), "nearest", fp32, False, True, True),  # nibbles, 128 blocks
        (get_format("int4"), get_format("int4", signed=False), "stochastic", bf16, True, False, False),
        (get_format("fp8_e4m3"), get_format("fp8_e4m3"), "nearest", fp32, True, False, True),  # minifloat
        (get_format("fp8_e4m3"), get_format("fp8_e5m2"), "stochastic", fp32, False, False, True),
        (get_format("int8"), get_format("int4", signed=False), "nearest", fp32, True, False, True),  # v in 2 sub-blocks
        (get_format("fp8_e4m3", block_size=32), get_format("int8", signed=False), "stochastic", fp32, True, True, True),  # 8 sub-blocks
        (get_format("int8", block_size=2048), get_format("e5m10", block_size=2048), "nearest", fp16, True, False, True),  # large block
        (get_format("int4"), get_format("int6", signed=False), "nearest", fp32, True, False, True),  # dense v in 2 sub-blocks
        (get_format("int5"), get_format("int7", signed=False), "stochastic", bf16, True, False, False),  # dense m and v
    ]
    variants += [adam_step_variant(*case) for case in adam]
    # Without master weights: (m, v, rounding, decoupled, track_stalls, param dtype (= grad dtype), grid dtype, weight
    # rounding, eco).
    weights: list[tuple[StorageFormat, StorageFormat, Rounding, bool, bool, torch.dtype, torch.dtype | None, Rounding, bool]] = [
        (get_format("int8"), get_format("int8", signed=False), "nearest", True, False, bf16, bf16, "nearest", True),  # ECO's case
        (get_format("int8"), get_format("int8", signed=False), "stochastic", False, False, bf16, bf16, "stochastic", True),
        (get_format("int4"), get_format("int4", signed=False), "nearest", True, True, fp16, fp16, "stochastic", True),  # nibbles
        (get_format("fp8_e4m3"), get_format("fp8_e5m2"), "stochastic", True, False, fp32, fp16, "nearest", False),  # naive
        (get_format("fp8_e4m3", block_size=32), get_format("int8", signed=False), "nearest", True, False, fp32, bf16, "stochastic", False),
        (get_format("int8"), get_format("int4", signed=False), "nearest", False, False, fp16, fp32, "nearest", True),  # fp32 grid
        # the limits: MAX_BLOCK values, MAX_SUB_BLOCKS of m in one, SR everywhere, stall counts
        (
            get_format("int8", block_size=64),
            get_format("int6", signed=False, block_size=MAX_BLOCK),
            "stochastic",
            True,
            True,
            bf16,
            bf16,
            "stochastic",
            True,
        ),
    ]
    variants += [
        adam_step_variant(m, v, rounding, dtype, decoupled, False, stalls, dtype, grid, weight_rounding, eco)
        for m, v, rounding, decoupled, stalls, dtype, grid, weight_rounding, eco in weights
    ]
    return variants
