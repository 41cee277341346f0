"""One-pass Adam step over quantized states: decode -> Adam update -> requantize.

CUDA parameters (and those of any device type in ``TRITON_DEVICE_TYPES``) take
the Triton kernel of ``kernels/triton_adam.py``: one pass per block reads the
gradient, parameter and packed moments and writes the parameter and packed
moments, following ``adam_step_quantized`` below operation by operation. The
rest of this docstring is about the CPU fast path.

``adam_step_quantized`` is plain torch built from the formats' torch references.
On the CPU, ``torch.compile`` turns it into one C++ loop nest per parameter
(per-block absmax reduction fused with the elementwise work, codes written in
place), which is where the speed comes from: eager torch would make a dozen
full-size temporaries. The learning rate and every hyperparameter enter as 0-d
tensors, so LR schedulers and changing betas never trigger a recompile, and
shapes are dynamic, so one compile serves every parameter of a model.

The same function runs eagerly on the partial last block of a parameter, so
the compiled and eager paths share one definition of the step.

Rounding contract: ``adam_math`` rounds every operation once (IEEE fp32, round to
nearest even), in the order of torch's vectorized CPU kernels: ``fma`` where
they fuse (``add(alpha=)``, ``lerp_``, ``addcmul_``), a correctly rounded square
root (``sqrt_rn``), true divisions. None of these depends on the CPU, on ATen's
CPU capability or on inductor (whose ``ops.fma`` the compiled step uses), so the
eager step, the compiled step and the Triton kernel (``tl.fma``, ``sqrt_rn``,
``div_rn``) agree bit for bit. torch's eager CPU ``sqrt`` does not round once:
it is MKL's ``v?Sqrt`` (a reciprocal-square-root estimate and Newton steps,
within 1 ulp), whose code path and results depend on the CPU.

CPU parameters whose moments are both byte-coded codebook formats (the int8
family) under round-to-nearest skip all that: ``native_adam_steps`` steps every
such parameter of a param group in one call of the C++ kernel in
``cpu_kernel.py`` (gradient check included), with no per-parameter Python.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable

import torch

from ..formats import BlockFormat, CastFormat, CodebookFormat, QuantizedTensor, Rounding, StorageFormat, count_stalls
from ..kernels import TRITON_AVAILABLE
from ..kernels.bounds import moment_bound
from . import cpu_kernel

if TRITON_AVAILABLE:
    from ..kernels import adam_step_supported, draw_seed, triton_adam_step

# Parameters smaller than this take the plain per-parameter path (compiling would not pay off).
FUSED_MIN_NUMEL = 1 << 16
# Device types whose parameters step with the Triton kernel (tests add "cpu" under TRITON_INTERPRET=1).
TRITON_DEVICE_TYPES: tuple[str, ...] = ("cuda",)
# Row length of the 2-D view of cast-format (unblocked) states on the compiled path.
CAST_ROW = 256


@torch.library.custom_op("lightning_qstate::fma", mutates_args=())
def fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` of fp32 tensors (broadcast) rounded once to fp32, as a hardware FMA, on any CPU.

    Eager: the product is exact in float64 (24 + 24 bits); the sum is rounded to odd in float64 (rounded to nearest,
    its exact error from TwoSum, then toward zero and the last bit set if inexact); rounding that to fp32 rounds the
    exact ``a * b + c``, since 53 >= 24 + 2 (Boldo & Melquiond, IEEE Trans. Comput. 57(4), 2008). Compiled: inductor's
    ``ops.fma`` (``std::fma``, ``at::vec::fmadd``), once ``compiled_adam_step`` has registered the lowering.
    """
    product, addend = a.double() * b.double(), c.double()
    total = product + addend
    virtual = total - product
    error = (product - (total - virtual)) + (addend - virtual)
    inexact = (error != 0) & error.isfinite()  # inf/NaN operands: nothing to adjust
    rounded_up = inexact & ((error < 0) == (total > 0))  # |total| > |exact|
    return ((total.view(torch.int64) - rounded_up.long()) | inexact.long()).view(torch.float64).float()


@fma.register_fake
def _(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return c.new_empty(torch.broadcast_shapes(a.shape, b.shape, c.shape), dtype=torch.float32)


def _lower_fma() -> None:
    """Compile ``fma`` to inductor's ``ops.fma`` (fused into the loop nest) rather than calling its eager implementation
    from the compiled code (same result, a few times slower). ``register_pointwise`` is inductor-internal: without it,
    the call stays."""
    try:
        from torch._inductor.lowering import register_pointwise
    except ImportError:
        return
    register_pointwise(torch.ops.lightning_qstate.fma.default, name="fma")


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """The square root of fp32 ``x`` rounded once to fp32 (torch's CPU ``sqrt`` is not: module docstring).

    Scaled by a power of 4 to ``x`` in ``[1, 4)`` (``sqrt(x)`` in ``[1, 2)``, float64 ulp ``2**-52``): ``x * 2**48``
    is an even integer and a rounding boundary ``m = (2k + 1) 2**-24`` has ``(2k + 1)**2`` odd, so
    ``|sqrt(x) - m| = |x - m**2| / (sqrt(x) + m) >= 2**-48 / 4 = 2**-50``: 4 float64 ulps. The float64 root is
    within 1 ulp (MKL's HA mode; correctly rounded elsewhere), so on the same side of every boundary: it rounds to
    the fp32 value the exact root rounds to.
    """
    return torch.sqrt(x.double()).float()


def hold_moment(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """The decoded ``exp_avg`` held to ``|m| <= bound * sqrt(v)`` (``kernels.bounds.moment_bound``), which exact Adam
    never exceeds: values inside are kept as they are (signed zeros too), so every path that compares the same way
    (the C++ and Triton kernels) gets the same bits."""
    limit = sqrt_rn(exp_avg_sq) * bound
    return torch.where(exp_avg > limit, limit, torch.where(exp_avg < -limit, -limit, exp_avg)).to(exp_avg.dtype)


def adam_math(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    hyper: dict[str, torch.Tensor],
    decoupled_weight_decay: bool,
    maximize: bool,
) -> torch.Tensor:
    """torch's single-tensor Adam(W) update on flat fp32 tensors, every operation rounded once (module docstring);
    returns the new ``param`` values and updates ``exp_avg`` and ``exp_avg_sq`` in place.

    ``hyper``: the 0-d fp32 tensors of ``adam_hyper``. ``exp_avg`` and ``exp_avg_sq`` come out bit for bit as
    torch's AdamW computes them on CPUs where its kernels fuse ``a * b + c`` (ATen capability AVX2 or AVX512), the
    parameter too where its ``sqrt`` is correctly rounded.
    """
    if maximize:
        grad = -grad
    if decoupled_weight_decay:
        param = param * hyper["decay"]
    else:
        grad = fma(param, hyper["weight_decay"], grad)  # grad.add(param, alpha=weight_decay)
    stored = hold_moment(exp_avg, exp_avg_sq, hyper["moment_bound"])
    weight = hyper["lerp_weight"]
    small = weight.abs() < 0.5  # exp_avg.lerp_(grad, weight), from the nearer end
    exp_avg.copy_(fma(torch.where(small, weight, weight - 1), grad - stored, torch.where(small, stored, grad)))
    # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    exp_avg_sq.copy_(fma(hyper["square_weight"] * grad, grad, exp_avg_sq * hyper["beta2"]))
    denom = sqrt_rn(exp_avg_sq) / hyper["bias_correction2_sqrt"] + hyper["eps"]
    return param - hyper["step_size"] * exp_avg / denom


def adam_step_quantized(
    param: torch.Tensor,
    grad: torch.Tensor,
    m_codes: torch.Tensor,
    m_scales: torch.Tensor | None,
    v_codes: torch.Tensor,
    v_scales: torch.Tensor | None,
    hyper: dict[str, torch.Tensor],
    m_format: StorageFormat,
    v_format: StorageFormat,
    rounding: Rounding,
    decoupled_weight_decay: bool,
    maximize: bool,
    track_stalls: bool,
) -> torch.Tensor:
    """Adam step of ``param`` (updated in place) whose moments are stored as codes/scales (updated in place).

    Tensors may come as ``(blocks, block_size)`` views (the compiled path: a static block size, a dynamic
    block count) or flat. Returns ``int64 [stalled_m, moved_m, stalled_v, moved_v]`` (zeros unless ``track_stalls``).
    """
    param, grad, m_codes, v_codes = param.view(-1), grad.reshape(-1), m_codes.view(-1), v_codes.view(-1)
    numel = param.numel()
    exp_avg = m_format.dequantize_reference(m_codes, m_scales, numel)
    exp_avg_sq = v_format.dequantize_reference(v_codes, v_scales, numel)
    old_m, old_v = (exp_avg.clone(), exp_avg_sq.clone()) if track_stalls else (exp_avg, exp_avg_sq)
    param.copy_(adam_math(param, grad, exp_avg, exp_avg_sq, hyper, decoupled_weight_decay, maximize))
    counts = []
    for fmt, codes, scales, value, old in ((m_format, m_codes, m_scales, exp_avg, old_m), (v_format, v_codes, v_scales, exp_avg_sq, old_v)):
        new_codes, new_scales = fmt.quantize_reference(value, rounding, None)
        if track_stalls:
            stored = fmt.dequantize_reference(new_codes, new_scales, numel)
            units = (fmt.unit_values_reference(c, None, numel) for c in (codes, new_codes))
            counts.append(count_stalls(old, value, stored, *units))
        codes.copy_(new_codes)
        if scales is not None:
            scales.copy_(new_scales)
    return torch.cat(counts) if track_stalls else torch.zeros(4, dtype=torch.int64)


@functools.cache
def compiled_adam_step(options: tuple) -> Callable:
    """``adam_step_quantized`` compiled for one ``options`` tuple (formats, rounding, flags); the block count is marked
    dynamic. ``fma`` compiles to inductor's (``_lower_fma``), so the compiled step is the eager one bit for bit.

    Each tuple compiles its own copy of the function (a distinct code object): dynamo keeps its cache, and its limit
    of 8 recompilations, per code object, so one shared function would fail (``fullgraph``) once a process had
    compiled 8 format pairs, and would check every pair's guards at every call.

    ``emulate_precision_casts``: inductor otherwise drops a cast to bf16 and back inside a fused kernel, and the
    bf16 block scales (``formats.block.round_up_to_bf16``) would normalize by the unrounded absmax.
    """
    _lower_fma()
    code = adam_step_quantized.__code__
    copy = types.FunctionType(code.replace(), adam_step_quantized.__globals__, code.co_name, adam_step_quantized.__defaults__)
    return torch.compile(copy, fullgraph=True, options={"emulate_precision_casts": True})


def _plain_options(param: torch.Tensor, group: dict) -> bool:
    """A contiguous fp32 param and plain Adam options (no amsgrad, capturable, differentiable or fused)."""
    return (
        param.dtype == torch.float32
        and param.is_contiguous()
        and not (group["amsgrad"] or group["capturable"] or group["differentiable"] or group["fused"])
    )


def _plain_adam(param: torch.Tensor, group: dict, state: dict) -> bool:
    """``_plain_options`` and both moments quantized."""
    m, v = state.get("exp_avg"), state.get("exp_avg_sq")
    return isinstance(m, QuantizedTensor) and isinstance(v, QuantizedTensor) and m.dtype == torch.float32 and _plain_options(param, group)


def can_fuse(param: torch.Tensor, group: dict, state: dict) -> bool:
    """Whether a one-pass step applies: ``_plain_adam`` with block or cast formats, and either a Triton device (block
    formats) or a large CPU param (compiled)."""
    if not _plain_adam(param, group, state):
        return False
    m, v = state["exp_avg"], state["exp_avg_sq"]
    if not all(isinstance(q.format, (BlockFormat, CastFormat)) for q in (m, v)):
        return False
    if param.device.type in TRITON_DEVICE_TYPES:
        return TRITON_AVAILABLE and adam_step_supported(m.format, v.format)
    return param.device.type == "cpu" and param.numel() >= FUSED_MIN_NUMEL


def native_eligible(param: torch.Tensor, grad: torch.Tensor, group: dict, state: dict) -> bool:
    """Whether ``native_adam_steps`` covers this parameter: a ``_plain_adam`` CPU param with an fp32 grad, byte-coded
    codebook moments (the int8 family) of one block size, round-to-nearest, and a C++ kernel built here."""
    if not (
        param.device.type == "cpu" and grad.dtype == torch.float32 and group["rounding"] == "nearest" and _plain_adam(param, group, state)
    ):
        return False
    formats = (state["exp_avg"].format, state["exp_avg_sq"].format)
    return (
        all(isinstance(f, CodebookFormat) and 4 < f.bits <= 8 and f.nearest_index is not None for f in formats)
        and formats[0].block_size == formats[1].block_size
        and cpu_kernel.kernel() is not None
    )


def native_plain_eligible(param: torch.Tensor, grad: torch.Tensor, group: dict, state: dict) -> bool:
    """Whether ``native_adam_steps`` can also step this parameter with fp32 moments: ``_plain_options`` on the CPU,
    an fp32 gradient, and both moments contiguous fp32 tensors."""
    moments = (state.get("exp_avg"), state.get("exp_avg_sq"))
    return (
        param.device.type == "cpu"
        and grad.dtype == torch.float32
        and _plain_options(param, group)
        and all(
            isinstance(m, torch.Tensor) and not isinstance(m, QuantizedTensor) and m.dtype == torch.float32 and m.is_contiguous()
            for m in moments
        )
        and cpu_kernel.kernel() is not None
    )


@functools.cache
def _native_layout(m_format: CodebookFormat, v_format: CodebookFormat) -> tuple[list[torch.Tensor], list[int]]:
    """The kernel's per-parameter tables ``[m_decode, m_entries, m_planes, v_decode, v_entries, v_planes]`` (planes:
    ``(4, 256)`` uint8, byte ``j`` of every decode value in row ``j``, for the VBMI decoder) and integers
    ``[block, m_base, m_shift, m_half, v_base, v_shift, v_half]`` for a pair of moment formats."""
    m_index, v_index = m_format.nearest_index, v_format.nearest_index
    tables = [
        table
        for index in (m_index, v_index)
        for table in (index.decode, index.bucket_entries, index.decode.view(torch.uint8).view(256, 4).t().contiguous())
    ]
    return tables, [
        m_format.block_size,
        m_index.key_base,
        m_index.key_shift,
        m_index.half,
        v_index.key_base,
        v_index.key_shift,
        v_index.half,
    ]


def native_adam_steps(
    params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict], group: dict, track_stalls: bool
) -> list[list[int]]:
    """The Adam step of every parameter of ``group`` given (each ``native_eligible``, or ``native_plain_eligible``: fp32
    moments) in one C++ call (``cpu_kernel``), in place.

    Each ``step`` counter goes up by one, in the kernel, which also derives the step's bias corrections from it (as
    ``adam_hyper`` does for coded params, as torch's AdamW for fp32 ones); parameters whose gradient holds inf/NaN
    are left untouched (their ``step`` too). Returns per parameter, in order,
    ``[grad_finite, moments_finite, stalled_m, moved_m, stalled_v, moved_v]`` (stalls 0 unless tracked or fp32).
    """
    coded = [k for k, state in enumerate(states) if isinstance(state["exp_avg"], QuantizedTensor)]
    plain = [k for k, state in enumerate(states) if not isinstance(state["exp_avg"], QuantizedTensor)]
    order = coded + plain  # the kernel's parameter order
    beta1, beta2 = group["betas"]
    tables, ints, moments = [], [], [(states[k]["exp_avg"], states[k]["exp_avg_sq"]) for k in coded]
    for m, v in moments:
        layout = _native_layout(m.format, v.format)
        tables += layout[0]
        ints.append(layout[1])
    rows = cpu_kernel.kernel()(
        [params[k] for k in coded], [grads[k].contiguous() for k in coded],
        [m.codes for m, _ in moments], [m.scales for m, _ in moments], [v.codes for _, v in moments], [v.scales for _, v in moments],
        tables, torch.tensor(ints, dtype=torch.int64).view(-1, 7),
        torch.tensor([moment_bound(float(beta1), float(beta2), float(states[k]["step"])) for k in coded], dtype=torch.float32),
        [t for k in plain for t in (params[k], grads[k].contiguous(), states[k]["exp_avg"], states[k]["exp_avg_sq"])],
        [states[k]["step"] for k in order],
        float(group["lr"]), float(group["weight_decay"]), float(beta1), float(beta2), float(group["eps"]),
        group["decoupled_weight_decay"], group["maximize"], track_stalls,
    ).tolist()  # fmt: skip
    if not all(row[1] for row in rows if row[0]):
        raise FloatingPointError("an Adam moment overflowed to inf/NaN during the step; its packed codes were not trusted")
    by_param = [None] * len(states)
    for k, row in zip(order, rows, strict=False):
        by_param[k] = row
    return by_param


def _split(value: QuantizedTensor, count: int, block: int) -> tuple[tuple, tuple]:
    """(codes, scales) of the first ``count`` values as ``(count // block, -1)`` views, and of the rest (flat)."""
    fmt = value.format
    code_split = count // 2 if isinstance(fmt, BlockFormat) and fmt.bits <= 4 else count
    head_codes = _dynamic_rows(value.codes[:code_split].view(count // block, -1))
    if isinstance(fmt, CastFormat):
        return (head_codes, None), (value.codes[count:], None)
    block_split = count // fmt.block_size
    return (head_codes, _dynamic_rows(value.scales[:block_split])), (value.codes[code_split:], value.scales[block_split:])


def _dynamic_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Mark dim 0 dynamic so one compiled kernel serves every parameter size."""
    torch._dynamo.mark_dynamic(tensor, 0)
    return tensor


# Option tuples whose compile failed: they take the eager step without retrying.
_COMPILE_FAILED: set[tuple] = set()


def adam_hyper(group: dict, step: float) -> dict[str, torch.Tensor]:
    """The 0-d fp32 tensors ``adam_math`` takes (names and meaning: ``kernels.triton_adam.COEFFICIENTS``), for
    ``group``'s options at step ``step`` (1 for the first step).

    Each is computed as torch's AdamW computes it (``1 - lr * weight_decay``, ``1 - beta1``, ``1 - beta2``,
    ``lr / (1 - beta1**step)``, ``(1 - beta2**step) ** 0.5``: in Python floats, in float64, or in a tensor
    hyperparameter's dtype) and rounded to fp32 once, where torch's kernels round it; ``moment_bound`` is
    ``kernels.bounds.moment_bound`` after ``step - 1`` updates, which the decoded ``m`` is held to.
    """
    lr, weight_decay = group["lr"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    values = {
        "decay": 1 - lr * weight_decay,
        "weight_decay": weight_decay,
        "lerp_weight": 1 - beta1,
        "beta2": beta2,
        "square_weight": 1 - beta2,
        "eps": group["eps"],
        "step_size": lr / (1 - beta1**step),
        "bias_correction2_sqrt": (1 - beta2**step) ** 0.5,
        "moment_bound": moment_bound(float(beta1), float(beta2), step - 1),
    }
    return {name: torch.as_tensor(value, dtype=torch.float32) for name, value in values.items()}


def fused_adam_step(
    param: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, track_stalls: bool, generator: torch.Generator | None = None
) -> torch.Tensor:
    """One Adam step of ``param`` and its quantized moments in ``state``; returns stall counts.

    Triton devices: one kernel pass (SR seeds drawn from ``generator``, default: the device's). CPU: compiled
    step on the whole blocks of ``param``, eager on the partial last block.
    """
    m, v = state["exp_avg"], state["exp_avg_sq"]
    state["step"] += 1
    hyper = adam_hyper(group, float(state["step"]))
    if param.device.type in TRITON_DEVICE_TYPES:
        seed = None
        if group["rounding"] == "stochastic":  # two seeds (m, v), drawn where the generator lives
            seed = draw_seed(generator, generator.device if generator is not None else param.device, 2).to(param.device, non_blocking=True)
        options = (group["rounding"], group["decoupled_weight_decay"], group["maximize"], track_stalls, seed)
        counts = triton_adam_step(param, grad, m, v, hyper, *options)
    else:
        counts = _compiled_cpu_step(param, grad, m, v, hyper, group, track_stalls)
    scales = [q.scales for q in (m, v) if q.scales is not None]
    if scales and not bool(torch.stack([torch.isfinite(s).all() for s in scales]).all()):  # one host sync
        raise FloatingPointError("an Adam moment overflowed to inf/NaN during the step; its packed codes were not trusted")
    return counts


def _compiled_cpu_step(
    param: torch.Tensor, grad: torch.Tensor, m: QuantizedTensor, v: QuantizedTensor, hyper: dict, group: dict, track_stalls: bool
) -> torch.Tensor:
    """Compiled Adam step on the whole blocks of ``param``, eager on the partial last block; returns stall counts."""
    flat_param, flat_grad = param.view(-1), grad.reshape(-1)
    # Elements per block the fused path splits at: the format's block, CAST_ROW for cast formats (no blocks).
    block = max(state.format.block_size if isinstance(state.format, BlockFormat) else CAST_ROW for state in (m, v))
    whole = flat_param.numel() // block * block
    (m_head, m_tail), (v_head, v_tail) = _split(m, whole, block), _split(v, whole, block)
    options = (m.format, v.format, group["rounding"], group["decoupled_weight_decay"], group["maximize"], track_stalls)
    counts = None
    if options not in _COMPILE_FAILED:
        try:
            head_param, head_grad = _dynamic_rows(flat_param[:whole].view(-1, block)), _dynamic_rows(flat_grad[:whole].view(-1, block))
            counts = compiled_adam_step(options)(head_param, head_grad, *m_head, *v_head, hyper, *options)
        except Exception as error:  # no C++ compiler, an unsupported platform, ...: eager from now on, said once
            _COMPILE_FAILED.add(options)
            message = f"torch.compile of the quantized Adam step failed ({error!r}); using the eager step for these formats"
            warnings.warn(message, RuntimeWarning, stacklevel=4)
    if counts is None:
        counts = adam_step_quantized(flat_param[:whole], flat_grad[:whole], *m_head, *v_head, hyper, *options)
    if whole < flat_param.numel():
        counts = counts + adam_step_quantized(flat_param[whole:], flat_grad[whole:], *m_tail, *v_tail, hyper, *options)
    return counts
