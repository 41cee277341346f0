"""The C++ CPU steps over a whole param group (``kernels/csrc/``): Adam(W), and SGD's and Muon's momentum; per-format
tables, the build and the calls.

The kernel (``adam_steps_u8`` in ``csrc/adam_cpu.cpp``) is Adam(W) for coded states on the CPU, with optional
stall counts. It steps every parameter of a param group in one call, threaded with ``at::parallel_for`` over all
their blocks: first a check of every gradient (a parameter with an inf/NaN gradient is left untouched), then one pass
per block (data prefetched a few blocks ahead): decode both moments (table lookup times the block scale), torch's
Adam(W) update, per-block absmax, and round-to-nearest encoding with ``code_index.NearestCodeIndex`` (one table
lookup and integer compares; the table of a zero-free ``v`` format also clamps codes up to its ``min_code``, so ``v``
is never stored as 0), writing param, codes and scales (bf16 or fp32, per state) in place. The group's parameters
with fp32 moments (those ``min_quant_size`` keeps fp32) step in the same call, and the kernel increments every step
counter, so a whole group costs one call and no per-parameter torch ops.

That pass, with the decode in registers, is for two block states of one block size (codebook or minifloat codes of
1 to 8 bits, packed as ``formats.packing`` packs them: two per byte up to 4 bits, dense groups of 8 for 5 to 7; a
chunk of at least 1024 values, whole blocks, per call; either rounding; with stall counts, 8-bit codes only). Every
other pair of moment formats the kernel takes (``native_formats``: bf16/fp16/fp32 casts; ``m`` and ``v`` of different
block sizes; sub-byte codes with stall counts) is stepped a chunk at a time (the larger block): both moments
decoded into scratch (a 256-entry table per state: a minifloat's ``decode_values`` too; casts converted), the same
update, then each moment encoded block by block. Either way a codebook encodes with its ``NearestCodeIndex``, a minifloat with
``formats.rounding.encode_minifloat``'s own fp32 and integer operations, a cast as torch's casts (with
``CastFormat.lift_flushed`` for a zero-free ``v``); the quotient by the block scale is a true division, as the
reference's. Under round to nearest its codes are the reference's bit for bit. Stochastic rounding
(``group["rounding"] == "stochastic"``, any of these formats, on either pass, with the same codes on both) follows the
reference's rules (``encode_codebook``'s floor code and gap, ``encode_minifloat``'s floor mantissa, ``bf16_stochastic``,
``fp16_stochastic``) with counter-based draws from that moment's seed, which the optimizer derives per step
(``QuantizedStates._kernel_seeds(param, "moments", 2)``; reproducible, independent of the thread count, and resumed
exactly from a checkpoint): element ``i`` of a codebook or minifloat moment draws half of splitmix64 output
``i // 2 + 1`` (the upper half for an even ``i``, the lower for an odd one: ``random_bits``), its U[0, 1) the upper 24
bits times 2^-24, as an fp32 uniform of torch; element ``i`` of a bf16/fp16 cast draws 16 bits, quarter ``i % 4`` of
output ``i // 4 + 1`` (bits ``16 * (i % 4)`` up: ``cast_bits``; one output per four elements, half the draws' work),
which bf16 adds as the reference adds its 16 random bits, and fp16 as 13 (8191 less their upper 13) added below its
mantissa (``fp16_stochastic``: exactly unbiased where fp16 is normal, where it drops 13 bits; below 2^-14 the bits of
the fp32 sum ``|x| + 2^-14``, unbiased within 2^-14 of an ulp). Unbiased as the reference, not its bits (another
generator).

Without master weights (``optim/weights.py``) a coded parameter may be kept on a weight grid (a cast format's:
fp32, bf16 or fp16 values); the parameter and its gradient are then fp32, bf16 or fp16 (read as fp32, the math is
fp32). Its new values are computed as ``adam_reference.adam_math`` computes them, operation for operation (true
divisions), rounded to the grid (round to nearest even, as torch's casts: fp16 with its subnormals and overflow to
inf; or stochastic: bf16 as ``formats.rounding.bf16_stochastic``, 16 random bits added to the fp32 pattern; fp16
as the moments' casts, 13 bits added below its mantissa) and written in the parameter's dtype (round to nearest, as ``copy_``);
with ``error_feedback="eco"`` the rounding error goes into ``m`` before ``m`` is encoded
(``adam_reference.eco_feedback``: ``fma(eco_coefficient * denom, updated - rounded, m)``). The random bits of
element ``i`` are a cast's (``cast_bits``: 16 bits of splitmix64's output ``i // 4 + 1``) from a per-parameter seed
that Python derives for each step (``optimizer._kernel_seeds(param, "weights")``): counter-based, so they do not
depend on the thread count.
For these parameters the update, the rounding and the feedback run 16 values at a time with AVX-512
(``Update16::advance``: true divisions, the grid's rounding by the cast stores' vector forms), 8 at a time with AVX2
(``Update8::advance``, the same operations); the scalar loop that runs the rest (the whole update on other CPUs) is
written without branches (selects, ``-fno-math-errno``) and compiled once per parameter dtype, rounding and feedback,
so that the compiler vectorizes it for the CPU it builds for (each lane's IEEE operations are the scalar code's, so
the bits do not depend on it).

The codes and scales are those of the torch reference ``adam_reference.adam_step_quantized`` bit for bit: the
hyperparameters are rounded to fp32 from double as ``adam_reference.adam_hyper`` (and torch's AdamW) round them, the
moments use the float operations of torch's vectorized CPU kernels in the same order (explicit FMAs where torch's
``add(alpha=)``/``lerp_``/``addcmul_`` use them, no other contraction: ``-ffp-contract=off``), the division by the
block's stored scale is a true division, as the reference's, and the encoder reproduces the
format's ``encode`` (``encode_codebook`` clamped up to ``min_code``) exactly; the param update divides as the reference
does, so params are the reference's bit for bit too, also on a weight grid (round to nearest), ECO's too. With
AVX-512 the body of each block runs 16 lanes at a time (table lookups by register permutes, not gathers; with VBMI,
64 codes at a time from byte planes of the table, also the three table lookups of an 8-bit codebook's stochastic
rounding, and moments of one block size decoded, updated and their block absmaxes taken in one pass, nibbles and dense
codes unpacked 64 at a time by a byte permute and a multishift, a chunk of at least 1024 values per call; a codebook
of at most 128 codes encoded by a branch-free binary search of its thresholds, ``NearestCodeIndex.search_levels``, one
register permute per level, and an 8-bit one by its bucket table, a gather);
with AVX2 (and FMA, F16C; no AVX-512) the update runs 8 lanes at a time (``Update8``, the same operations as
``Update16``) where the parameter is fp32: for two bf16/fp16 casts decoded, updated and stored in one pass
(``cast_lanes``), for two block states of one block size decoded (``Decode8``: 4-bit codes by register permutes of
their 16 values, 8-bit minifloat codes by those permutes and exponent arithmetic where the table allows it
(``exponent_decode``), other 8-bit and dense 5-7-bit ones by table reads lane by lane (``gather8``: on an AMD Zen 3
about twice the rate of a gather instruction), a dense group's codes by a byte shuffle and lane shifts),
updated and their absmaxes taken in one pass; codebooks of at most 16 codes (int4's) are encoded 8 at a time by a
register search of their thresholds, larger ones (int8's, the dense codes') by their bucket table read the same way
(``bucket_codes8``; stochastic rounding's floor and both its values from one 16-byte read per lane of the bucket's
floor window, ``NearestCodeIndex.floor_windows``, ``bucket_stochastic8``) and
minifloats by arithmetic (``encode_minifloat8``), splitmix64 draws four outputs at a time (``splitmix64x4``, its
64-bit multiplies from 32-bit ones), and the gradient check reads eight far-apart parts of a gradient side by side.
The scalar code runs the rest and is the whole kernel on other CPUs (Arm, x86 without AVX2). There it is written as loops over
branch-free lanes, one per kind of state and rounding (``code_lanes``: the encoders, one bucket-table read per value;
the cast stores; block absmaxes; the finite checks; the nibble and byte decoders; Adam's update with its hold of
``m``), which the compiler vectorizes for the CPU it builds for (stochastic rounding's draws one splitmix64 output per two
elements, or four of a cast, into a buffer): the same IEEE operations per lane, so the same bits.

``momentum_steps`` (``native_momentum_steps``) is the same machinery for QSGD's and QMuon's ``momentum_buffer`` (any
format above, either rounding, and a plain fp32 buffer on a weight grid as an fp32 cast; fp32 parameters, and QSGD's
on a weight grid as above: fp32/bf16/fp16 values, the new
ones rounded to the grid as ``grid_lanes`` rounds them, ECO's ``buf + coefficient * (updated - rounded)``, the
product rounded first, as ``QSGD._feed_back_error``): the group's gradients checked, then each
buffer a chunk at a time (whole blocks, at least 1024 values) decoded, updated and encoded back block by block, as the
chunked Adam pass does a moment. The update is torch's single-tensor ``sgd`` with its buffer present (``add(alpha=)``
as an FMA; weight decay, dampening, nesterov, maximize; the param updated in the same pass) or ``muon``'s momentum
(``buf.lerp_(grad, 1 - momentum)`` and the update ``grad.lerp(buf, momentum)`` or ``buf``, as torch's lerp kernel
rounds them, into an fp32 tensor that QMuon orthogonalizes with torch's own Newton–Schulz and applies as ``muon``
does). Round to nearest, codes, scales and params are the reference path's bit for bit; stochastic rounding draws
as the moments' (``random_bits``; a bf16/fp16 buffer ``cast_bits``) from a seed per buffer and step
(``_kernel_seeds(param, "momentum_buffer")``). The
loop over the values is branch-free scalar code that the compiler vectorizes.

It is built on first use with ``torch.utils.cpp_extension.load`` (needs a C++ compiler and ninja; said on stderr):
the kernel (``adam_cpu.cpp``, with ATen's tensor headers only) and its Python bindings (``bindings.cpp``, the only
file with torch's Python headers, whose parsing alone took 30 s) compile in parallel, about 45 s on 2 cores, under a
name that hashes the sources and flags, and cached in torch's extension directory; where the build fails,
``native_kernel_available()`` is ``False`` and the optimizer takes another path.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from ..formats import CastFormat, CodebookFormat, MinifloatFormat, QuantizedTensor, StorageFormat
from ..formats.weights import WeightGrid
from .adam_reference import decoupled_decay, eco_coefficient
from .bounds import MOMENT_BOUND_STATE, held_moment_bound
from .code_index import nearest_index

CSRC = Path(__file__).with_name("csrc")
# The compiled files (the kernel, which alone depends on the CPU, first; the Python bindings, the only file with torch's
# Python headers: the two compile in parallel), then the headers they include.
SOURCES = (CSRC / "adam_cpu.cpp", CSRC / "bindings.cpp", CSRC / "adam_cpu.h", CSRC / "steps.h", CSRC / "simde_avx512.h")
# -fno-math-errno: sqrt without a branch to set errno (never read), so that loops over it vectorize; results unchanged
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
# A development check (``make kernel-emulate``): with the environment's LIGHTNING_QSTATE_KERNEL_EMULATE set to one of
# these, the kernel is built with the SIMD branches of another CPU than this one, so that the native tests check them
# here: the AVX-512 ones (with VBMI, and AVX512DQ's draws) emulated by SIMDe, whose headers LIGHTNING_QSTATE_SIMDE
# names (csrc/simde_avx512.h; a build takes ~4 min), or none (the portable loops alone, as on Arm). Its flags in place
# of -march=native.
EMULATIONS = {
    "avx512": ["-march=native", "-DQSTATE_EMULATE_AVX512"],
    "avx512-vbmi": ["-march=native", "-DQSTATE_EMULATE_AVX512", "-DQSTATE_EMULATE_VBMI"],
    "avx512-vbmi-dq": ["-march=native", "-DQSTATE_EMULATE_AVX512", "-DQSTATE_EMULATE_VBMI", "-DQSTATE_EMULATE_DQ"],
    "portable": ["-march=x86-64"],
}


def build_flags() -> list[str]:
    """The compiler flags of this process's build: ``CFLAGS``, or with LIGHTNING_QSTATE_KERNEL_EMULATE an
    ``EMULATIONS`` entry's in place of ``-march=native`` (and SIMDe's include directory). Raises ``ValueError``
    for an unknown emulation or one without SIMDe's headers."""
    emulation = os.environ.get("LIGHTNING_QSTATE_KERNEL_EMULATE", "")
    if not emulation:
        return list(CFLAGS)
    if emulation not in EMULATIONS:
        raise ValueError(f"LIGHTNING_QSTATE_KERNEL_EMULATE={emulation!r}: valid values are {', '.join(EMULATIONS)} (or unset)")
    flags = [flag for flag in CFLAGS if not flag.startswith("-march=")] + EMULATIONS[emulation]
    if "-DQSTATE_EMULATE_AVX512" in flags:
        simde = os.environ.get("LIGHTNING_QSTATE_SIMDE", "")
        if not (Path(simde) / "simde" / "x86" / "avx512.h").is_file():
            raise ValueError(
                f"LIGHTNING_QSTATE_KERNEL_EMULATE={emulation!r} needs SIMDe's headers: set LIGHTNING_QSTATE_SIMDE to the "
                f"directory holding simde/x86/avx512.h (make kernel-emulate fetches them); got {simde!r}"
            )
        flags.append(f"-I{simde}")
    return flags


# The kernel's codes of a weight grid's dtype (index; 0: no grid) and the dtypes it reads parameters and gradients in.
GRID_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)
VALUE_DTYPES = GRID_DTYPES[1:]


def extension_name(csrc: Path = CSRC) -> str:
    """``lightning_qstate_cpu_adam_<12 hex>``: a sha256 of ``SOURCES`` (their namesakes in ``csrc``) and the compiler
    flags (``build_flags``), so an edit to either builds a new extension; and of where ``csrc`` is, so that the builds
    of two installs or checkouts (another revision's copy: benchmarks/kernel_ab.py) never replace each other (ninja's
    build file names the sources by path: two installs of equal sources sharing a name rebuilt it whenever the other had
    loaded it last, ~75 s each time)."""
    digest = hashlib.sha256(str(csrc.resolve()).encode())
    for path in SOURCES:
        digest.update(path.name.encode() + b"\0" + (csrc / path.name).read_bytes() + b"\0")
    digest.update(" ".join(build_flags() + ["--"] + LDFLAGS).encode())
    return f"lightning_qstate_cpu_adam_{digest.hexdigest()[:12]}"


def build_extension(csrc: Path = CSRC):
    """The compiled extension module of the sources in ``csrc`` (this package's, or another revision's copy of them:
    ``benchmarks/kernel_ab.py``), built first where torch's extension directory has no copy (said on stderr)."""
    from torch.utils import cpp_extension

    csrc = csrc.resolve()  # the path the name hashes: two paths to one install (a symlink) build alike
    name = extension_name(csrc)
    build_directory = cpp_extension._get_build_directory(name, verbose=False)
    if not os.path.exists(os.path.join(build_directory, name + cpp_extension.LIB_EXT)):
        message = f"lightning_qstate: building the C++ CPU Adam kernel once for this install (~45 s; cached in {build_directory})"
        print(message, file=sys.stderr, flush=True)
    return cpp_extension.load(
        name=name,
        sources=[str(csrc / path.name) for path in SOURCES if path.suffix == ".cpp"],
        extra_cflags=build_flags(),  # a new list: load appends torch's libraries to the list it is given
        extra_ldflags=list(LDFLAGS),
        extra_include_paths=[str(csrc)],
        build_directory=build_directory,
        verbose=False,
    )


def check_compiles(march: str) -> None:
    """Compile the kernel's source for the CPU ``march`` names (gcc's ``-march=``, e.g. ``icelake-server``), syntax only,
    with this build's flags otherwise: a build compiles only its own CPU's branches (AVX-512 with or without VBMI,
    AVX2, neither), so ``make kernel-check`` checks the others this way. Raises ``RuntimeError`` with the compiler's output."""
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"], str(CSRC)]
    flags = [flag for flag in CFLAGS if not flag.startswith("-march=")]
    command = [os.environ.get("CXX", "c++"), "-std=c++20", f"-march={march}", *flags, "-fsyntax-only", "-DTORCH_EXTENSION_NAME=check"]
    result = subprocess.run([*command, *(f"-I{path}" for path in includes), str(SOURCES[0])], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"the C++ kernel does not compile for -march={march}:\n{result.stderr[-4000:]}")


@functools.cache
def _kernel():
    """The compiled extension module, or ``None`` when it cannot be built here (warns once; a wrong
    LIGHTNING_QSTATE_KERNEL_EMULATE raises: ``build_flags``)."""
    build_flags()
    try:
        return build_extension()
    except Exception as error:  # no compiler or ninja: another path takes over
        warnings.warn(f"building the C++ CPU Adam kernel failed ({error!r}); using the torch.compile path", RuntimeWarning, stacklevel=2)
        return None


def _function(name: str):
    """The extension's function ``name`` (``adam_steps_u8``, ``momentum_steps``, ``round_to_grid``)."""
    kernel = _kernel()
    if kernel is None:
        raise RuntimeError("the C++ CPU Adam kernel is not built here")
    return getattr(kernel, name)


# A state's kind in the kernel (``Kind`` in ``csrc/adam_cpu.h``).
CODEBOOK, MINIFLOAT, CAST = 0, 1, 2
_NO_ENTRIES = torch.zeros(1, dtype=torch.int32)
_NO_SCALES = torch.zeros(0)  # a cast state's scales
FP32_CAST = CastFormat("fp32", torch.float32)  # the cast an fp32-state parameter on a weight grid joins the coded ones as
_NO_LEVELS = torch.zeros(256)  # a minifloat's or cast's search levels
_NO_SEGMENTS = torch.zeros(0, dtype=torch.int32)  # no segment table (NearestCodeIndex.segments)
_NO_WINDOWS = torch.zeros(0, dtype=torch.int32)  # a minifloat's or cast's floor windows


@functools.cache
def _state_layout(fmt: StorageFormat) -> tuple[list[torch.Tensor], list[int], float]:
    """The kernel's description of one moment format (``State`` in ``csrc/adam_cpu.h``): tables ``[decode, entries,
    planes, levels, segments, windows]`` (decode: ``(256,)`` fp32 values of the codes; entries: the ``NearestCodeIndex`` buckets
    of a codebook, for the scalar encoder and the AVX-512 one of 8-bit codes; planes: ``(4, 256)`` uint8, byte ``j`` of
    every decode value in row ``j``, for the VBMI decoder; levels: a codebook's ``NearestCodeIndex.search_levels``, for
    the AVX-512 encoder of up to 7-bit codes; segments: its ``NearestCodeIndex.segments`` or an empty tensor, for the
    VBMI encoder of 8-bit codes; windows: a codebook's ``NearestCodeIndex.floor_windows``, for the AVX2 stochastic
    encoder of codes of more than 4 bits), the integers
    ``[kind, bits, block, key_base, key_shift, half, mantissa_bits, bias, max_code, min_code, has_sign, zero_free]``
    and a minifloat's largest value (a codebook's ``max_code`` column: its last code; the kernel appends the
    ``stochastic`` column)."""
    decode, entries, levels, segments, windows, ints = torch.zeros(256), _NO_ENTRIES, _NO_LEVELS, _NO_SEGMENTS, _NO_WINDOWS, [0] * 12
    if isinstance(fmt, CodebookFormat):
        index = nearest_index(fmt)
        decode, entries, levels, windows = index.decode, index.bucket_entries, index.search_levels, index.floor_windows.view(-1)
        segments = _NO_SEGMENTS if index.segments is None else index.segments
        ints[:6] = [CODEBOOK, fmt.bits, fmt.block_size, index.key_base, index.key_shift, index.half]
        ints[8:10] = [fmt.codebook.numel() - 1, fmt.min_code]
    elif isinstance(fmt, MinifloatFormat):
        decode[: 2**fmt.bits] = fmt.decode_values()
        spec = fmt.spec
        ints[:3] = [MINIFLOAT, fmt.bits, fmt.block_size]
        ints[6:11] = [spec.mantissa_bits, spec.bias, spec.max_code, fmt.min_code, int(fmt.signed)]
    else:
        ints[:3] = [CAST, fmt.bits, 0]
        ints[11] = int(fmt.zero_free)
    planes = decode.view(torch.uint8).view(256, 4).t().contiguous()
    return [decode, entries, planes, levels, segments, windows], ints, float(getattr(fmt, "max_value", 0.0))


@functools.lru_cache(maxsize=64)
def _state_rows(formats: tuple[StorageFormat, ...], stochastic: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The kernel's ``tables`` (six per state), ``ints`` (``(len(formats), 13)`` int64: ``_state_layout``'s row, then
    the ``stochastic`` column) and ``floats`` (``(len(formats),)`` fp32) of states in ``formats``, in order. Built once
    per tuple of formats (formats hash by identity; the kernel only reads these): a model's parameters keep theirs from
    step to step."""
    layouts = [_state_layout(fmt) for fmt in formats]
    tables = [table for layout in layouts for table in layout[0]]
    ints = torch.tensor([[*layout[1], int(stochastic)] for layout in layouts], dtype=torch.int64).view(-1, 13)
    return tables, ints, torch.tensor([layout[2] for layout in layouts], dtype=torch.float32)


def _scales(q: QuantizedTensor) -> torch.Tensor:
    """A state's block scales (an empty tensor for a cast)."""
    return _NO_SCALES if q.scales is None else q.scales


@functools.lru_cache(maxsize=64)
def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor the kernel only reads, made once per shape: its option rows where no parameter of a call has
    that option (no weight grid, no seed, no ECO coefficient), so a plain step builds none of them."""
    return torch.zeros(shape, dtype=dtype)


def _rows(values: list, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``values`` (numbers, or lists of them) as a tensor of ``shape``; the shared ``_zeros`` where all are zero."""
    if not any(map(any, values) if shape[1:] else values):
        return _zeros(shape, dtype)
    return torch.tensor(values, dtype=dtype).view(shape)


def _grid_rows(weights: list[WeightGrid | None], group: dict) -> torch.Tensor:
    """The kernel's ``grids``: ``(n, 3)`` int64, per parameter ``[grid dtype code (GRID_DTYPES; 0: none), stochastic,
    eco]`` from its weight grid and ``group``'s ``weight_rounding`` and ``error_feedback``."""
    stochastic, eco = group.get("weight_rounding") == "stochastic", group.get("error_feedback") == "eco"
    rows = [(GRID_DTYPES.index(grid.cast_dtype), stochastic, eco) if grid is not None else (0, 0, 0) for grid in weights]
    return _rows(rows, (len(weights), 3), torch.int64)


class StateOverflowError(FloatingPointError):
    """A state a fused step (C++ here; ``dispatch.fused_adam_step``'s compiled and Triton steps too) wrote in place
    overflowed: fp32 (a block scale that is not finite) or its cast's range (a bf16/fp16 state stored as inf);
    ``overflowed``: the positions, among the parameters given, of those whose codes and scales are not to be trusted (the
    optimizer zeroes them: ``QuantizedStates._fused_call``); ``results``: what the step returns, the other parameters'
    steps being done (their rows, their updates)."""

    def __init__(self, message: str, overflowed: list[int], results: Any) -> None:
        super().__init__(message)
        self.overflowed = overflowed
        self.results = results


def native_adam_steps(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    states: list[dict],
    group: dict,
    track_stalls: bool,
    weights: list[WeightGrid | None] | None = None,
    seeds: list[int] | None = None,
    moment_seeds: list[tuple[int, int]] | None = None,
) -> list[list[int]]:
    """The Adam step of every parameter of ``group`` given (those ``kernels.dispatch`` put on the ``native`` path:
    byte-coded moments, or fp32 ones that join the call) in one C++ call, in place.

    Each ``step`` counter goes up by one, in the kernel, which also derives the step's bias corrections from it (as
    ``adam_hyper`` does for coded params, as torch's AdamW for fp32 ones); parameters whose gradient holds inf/NaN
    are left untouched (their ``step`` too). Returns per parameter, in order,
    ``[grad_finite, moments_finite, stalled_m, moved_m, stalled_v, moved_v]`` (stalls 0 unless tracked or fp32).

    ``weights``: per parameter its weight grid (a cast format's) or ``None``, rounded to with
    ``group["weight_rounding"]`` and with ECO's feedback where ``group["error_feedback"]`` is ``"eco"`` (module
    docstring); an fp32-state parameter on a grid steps as a coded one with fp32 cast moments (in place, the same
    update as the reference path's: ``adam_reference.adam_math``, no hold of ``m``, which fp32 moments do not need);
    ``seeds``: per parameter the seed of its stochastic rounding (used only there).
    ``moment_seeds``: per parameter the seeds of ``m`` and ``v`` where ``group["rounding"]`` is ``"stochastic"``
    (element ``i`` of a moment rounds with splitmix64 draw ``i`` of its seed).

    Raises:
        StateOverflowError: a moment overflowed to inf/NaN (its block scale is not finite, or a cast stored inf: fp16
            past 65504); its ``results`` are this function's (the other parameters stepped).
    """
    weights = weights or [None] * len(states)
    seeds = seeds or [0] * len(states)
    moment_seeds = moment_seeds or [(0, 0)] * len(states)
    names = ("exp_avg", "exp_avg_sq")
    quantized = [any(isinstance(state[name], QuantizedTensor) for name in names) for state in states]  # a plain one: an fp32 cast
    as_coded = [q or grid is not None for q, grid in zip(quantized, weights, strict=True)]
    coded = [k for k, yes in enumerate(as_coded) if yes]
    plain = [k for k, yes in enumerate(as_coded) if not yes]
    order = coded + plain  # the kernel's parameter order
    beta1, beta2 = group["betas"]
    feeds_back = [group.get("error_feedback") == "eco" and weights[k] is not None for k in coded]
    eco_coefficients = [
        eco_coefficient(group, float(states[k]["step"]) + 1) if fed else 0.0 for k, fed in zip(coded, feeds_back, strict=True)
    ]
    moments = [tuple(_coded(states[k][name]) for name in names) for k in coded]
    before = [states[k].get(MOMENT_BOUND_STATE) for k in coded]  # kept where the kernel skips a non-finite gradient
    bounds = [
        held_moment_bound(states[k], float(beta1), float(beta2), float(states[k]["step"]), fed) if quantized[k] else math.inf
        for k, fed in zip(coded, feeds_back, strict=True)
    ]
    tables, ints, floats = _state_rows(tuple(q.format for pair in moments for q in pair), group["rounding"] == "stochastic")
    rows = _function("adam_steps_u8")(
        params=[params[k] for k in coded],
        grads=[grads[k].contiguous() for k in coded],
        m_codes=[m.codes for m, _ in moments],
        m_scales=[_scales(m) for m, _ in moments],
        v_codes=[v.codes for _, v in moments],
        v_scales=[_scales(v) for _, v in moments],
        tables=tables,
        ints=ints.view(-1, 2, 13),
        floats=floats.view(-1, 2),
        bounds=torch.tensor(bounds, dtype=torch.float32),
        grids=_grid_rows([weights[k] for k in coded], group),
        seeds=_rows([[seeds[k], *moment_seeds[k]] for k in coded], (len(coded), 3), torch.int64),
        eco=_rows(eco_coefficients, (len(coded),), torch.float32),
        plain=[t for k in plain for t in (params[k], grads[k].contiguous(), states[k]["exp_avg"], states[k]["exp_avg_sq"])],
        steps=[states[k]["step"] for k in order],
        lr=float(group["lr"]),
        weight_decay=float(group["weight_decay"]),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(group["eps"]),
        decoupled=decoupled_decay(group),
        maximize=group["maximize"],
        track=track_stalls,
        # torch divides an fp32 tensor lr in fp32; passed only then, so builds before it still load (benchmarks/kernel_ab.py)
        **({"lr_fp32": True} if isinstance(group["lr"], torch.Tensor) and group["lr"].dtype == torch.float32 else {}),
    ).tolist()
    _mark_written([params[k] for k in order], rows)
    for k, row, bound in zip(coded, rows, before, strict=False):
        if row[0] or not quantized[k]:  # stepped, or fp32 moments on a weight grid: no bound was advanced
            continue
        if bound is None:  # not stepped (a non-finite gradient): its moments' bound stays as it was
            del states[k][MOMENT_BOUND_STATE]
        else:
            states[k][MOMENT_BOUND_STATE] = bound
    by_param = [None] * len(states)
    for k, row in zip(order, rows, strict=False):
        if not quantized[k]:
            row = [row[0], 1, 0, 0, 0, 0]  # a plain fp32 state overflows as torch's does
        elif row[0] and not row[1] and _coded_moments_finite(states[k]):  # only a plain fp32 moment beside them: as torch's
            row = [row[0], 1, *row[2:]]
        by_param[k] = row
    overflowed = [k for k, row in enumerate(by_param) if row[0] and not row[1]]
    if overflowed:
        raise StateOverflowError("an Adam moment overflowed to inf/NaN during the step", overflowed, by_param)
    return by_param


def _mark_written(params: list[torch.Tensor], rows: list[list[int]]) -> None:
    """Bump the version counter of each parameter the kernel stepped (``row[0]``: a finite gradient), which it wrote
    through its data pointer, as torch's in-place update does: autograd then refuses a backward through a graph that
    saved the parameter before the step, as with ``torch.optim.AdamW``."""
    written = [param for param, row in zip(params, rows, strict=False) if row[0]]
    if written:
        torch.autograd.graph.increment_version(written)


def _coded_moments_finite(state: dict) -> bool:
    """Whether the coded Adam moments of ``state`` hold finite values (read where the kernel reports an overflow)."""
    moments = (state[name] for name in ("exp_avg", "exp_avg_sq"))
    return all(bool(torch.isfinite(value.dequantize()).all()) for value in moments if isinstance(value, QuantizedTensor))


def _coded(moment: QuantizedTensor | torch.Tensor) -> QuantizedTensor:
    """A moment as the kernel takes it: a ``QuantizedTensor`` as it is, an fp32 tensor as a cast state whose codes are
    its own values (the kernel updates them in place)."""
    if isinstance(moment, QuantizedTensor):
        return moment
    return QuantizedTensor(FP32_CAST, moment.view(-1), None, moment.shape, torch.float32)


def native_round_to_grid(values: torch.Tensor, dtype: torch.dtype, rounding: str, seed: int = 0) -> torch.Tensor:
    """The kernel's rounding of new parameter values on its own: fp32 ``values`` rounded to the grid of ``dtype``
    (fp32, bf16 or fp16) with ``rounding`` (``"stochastic"``: element ``i`` takes random draw ``i`` of ``seed``), in
    ``dtype``, same shape."""
    flat = values.detach().float().contiguous()
    rounded = _function("round_to_grid")(values=flat, grid=GRID_DTYPES.index(dtype), stochastic=rounding == "stochastic", seed=seed)
    return rounded.view(values.shape)


def native_momentum_steps(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    buffers: list[QuantizedTensor | torch.Tensor],
    group: dict,
    muon: bool,
    track_stalls: bool,
    seeds: list[int] | None = None,
    weights: list[WeightGrid | None] | None = None,
    weight_seeds: list[int] | None = None,
    eco: list[float] | None = None,
    created: list[bool] | None = None,
) -> tuple[list[list[int]], list[torch.Tensor | None]]:
    """The momentum step of every parameter of ``group`` given (each with a coded ``momentum_buffer`` in ``buffers``,
    or a plain contiguous fp32 one, stepped as an fp32 cast: its values updated in place, no stall counts; ``momentum !=
    0``) in one C++ call: torch's single-tensor SGD with ``group``'s options (params
    updated in place), or with ``muon`` Muon's momentum (``buf.lerp_(grad, 1 - momentum)`` and the update
    ``grad.lerp(buf, momentum)`` with nesterov, else ``buf``), the orthogonalization and param update left to the
    caller. Parameters and gradients are fp32, or for SGD on a weight grid fp32, bf16 or fp16 of one dtype.

    A parameter whose gradient holds inf/NaN is left untouched. Returns per parameter ``[grad_finite, buffer_finite,
    stalled, moved]`` (stalls 0 unless tracked) and, with ``muon``, its fp32 update (param's shape; ``None`` for SGD).
    ``seeds``: per parameter the seed of its buffer's stochastic rounding (``group["rounding"] == "stochastic"``;
    element ``i`` rounds with splitmix64 draw ``i``). SGD without master weights (``optim/weights.py``): ``weights``,
    per parameter its weight grid (a cast format's) or ``None``, the new values rounded to it with
    ``group["weight_rounding"]`` as in ``native_adam_steps`` (``weight_seeds``: the seeds of stochastic rounding);
    ``eco``: per parameter ECO's coefficient of the rounding error in the buffer (``buf + eco * (updated - rounded)``,
    as ``QSGD._feed_back_error``) where ``group["error_feedback"]`` is ``"eco"``. ``created``: per parameter whether
    this step creates its SGD buffer (torch's first step: ``buf = d``, a clone, without dampening; the buffer's codes
    and scales are written, not read: ``StorageFormat.allocate``).

    Raises:
        StateOverflowError: a buffer overflowed to inf/NaN (its block scale is not finite, or a cast stored inf: fp16
            past 65504); its ``results`` are this function's (the other parameters stepped).
    """
    count = len(params)
    weights, weight_seeds, eco = weights or [None] * count, weight_seeds or [0] * count, eco or [0.0] * count
    if muon and any(grid is not None for grid in weights):
        raise ValueError("the C++ kernel keeps only SGD's parameters on a weight grid (Muon's update is applied in torch)")
    coded = [isinstance(buffer, QuantizedTensor) for buffer in buffers]
    buffers = [_coded(buffer) for buffer in buffers]
    tables, ints, floats = _state_rows(tuple(q.format for q in buffers), group["rounding"] == "stochastic")
    updates = [torch.empty(param.shape, dtype=torch.float32) for param in params] if muon else []
    rows = _function("momentum_steps")(
        params=params,
        grads=[grad.contiguous() for grad in grads],
        codes=[q.codes for q in buffers],
        scales=[_scales(q) for q in buffers],
        tables=tables,
        ints=ints,
        floats=floats,
        grids=_grid_rows(weights, group),
        seeds=_rows([list(pair) for pair in zip(weight_seeds, seeds or [0] * count, strict=True)], (count, 2), torch.int64),
        eco=_rows(eco, (count,), torch.float32),  # read only where a grid row's eco column is set
        created=_rows(created or [False] * count, (count,), torch.bool),
        updates=updates,
        lr=float(group["lr"]),
        weight_decay=float(group["weight_decay"]),
        momentum=float(group["momentum"]),
        dampening=float(group.get("dampening", 0.0)),
        nesterov=bool(group["nesterov"]),
        maximize=bool(group.get("maximize", False)),
        track=track_stalls,
    ).tolist()
    if not muon:  # Muon's update is applied by the caller, in torch
        _mark_written(params, rows)
    rows = [row if quantized else [row[0], 1, 0, 0] for row, quantized in zip(rows, coded, strict=True)]  # fp32 overflows as torch's
    results = rows, updates or [None] * len(params)
    overflowed = [k for k, row in enumerate(rows) if row[0] and not row[1]]
    if overflowed:
        raise StateOverflowError("a momentum buffer overflowed to inf/NaN during the step", overflowed, results)
    return results


def native_kernel_available() -> bool:
    """Whether the C++ kernel is built here (built on first call; ``False`` without a C++ compiler)."""
    return _kernel() is not None


def native_format(fmt: StorageFormat) -> bool:
    """Whether the kernel stores a moment in ``fmt``: codebook codes (whose round-to-nearest encoder has a
    ``NearestCodeIndex``) or minifloat codes of 1 to 8 bits (``formats.packing``'s containers), or a cast (fp32, bf16,
    fp16)."""
    if isinstance(fmt, CastFormat):
        return fmt.dtype in VALUE_DTYPES
    if not isinstance(fmt, (CodebookFormat, MinifloatFormat)) or fmt.bits > 8:
        return False
    return isinstance(fmt, MinifloatFormat) or nearest_index(fmt) is not None


def native_formats(m_format: StorageFormat, v_format: StorageFormat) -> bool:
    """Whether the kernel codes this pair of moment formats (``native_format``; block sizes may differ)."""
    return native_format(m_format) and native_format(v_format)
