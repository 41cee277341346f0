"""The Adam(W) step as plain torch: the reference every fast path (C++, Triton, compiled) matches bit for bit.

``adam_math`` is torch's single-tensor Adam(W) update on flat fp32 tensors; ``adam_step_quantized`` wraps it in
decode -> update -> requantize with the formats' torch references; ``adam_hyper`` makes the 0-d coefficients they take.

Rounding contract: ``adam_math`` rounds every operation once (IEEE fp32, round to nearest even), in the order of
torch's vectorized CPU kernels: ``fma`` where they fuse (``add(alpha=)``, ``lerp_``, ``addcmul_``), a correctly
rounded square root (``sqrt_rn``), true divisions. None of these depends on the CPU, on ATen's CPU capability or on
inductor (whose ``ops.fma`` the compiled step uses), so the eager step, the compiled step (``kernels/compiled.py``),
the Triton kernel (``tl.fma``, ``sqrt_rn``, ``div_rn``; ``kernels/triton_adam.py``) and the C++ kernel's codes
(``kernels/native.py``) agree bit for bit. torch's eager CPU ``sqrt`` does not round once: it is MKL's ``v?Sqrt`` (a
reciprocal-square-root estimate and Newton steps, within 1 ulp), whose code path and results depend on the CPU.
The derivations are in ``docs/algorithms.md`` (bit-exact reference; Adam's moment bound).
"""

from __future__ import annotations

import math

import torch

from ..formats import CastFormat, Rounding, StorageFormat, count_stalls
from .bounds import moment_bound


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


ROOT_FLOOR = 2.0**-63
"""The least root ``hold_moment`` holds ``m`` by: ``sqrt`` of fp32's least normal value. Below it ``v`` (``g²``) has
underflowed in fp32, or lost bits, and its root no longer bounds exact Adam's ``|m|`` (a gradient of 1e-21 with betas
``(0, 0)``: ``v = 0``, ``m = g``); such an ``m`` is held to ``K · 2^-63`` instead, a step of at most ``7.3e-11 ·
step_size / eps``."""


def hold_moment(exp_avg: torch.Tensor, root: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """``exp_avg`` held to ``|m| <= bound * max(root, ROOT_FLOOR)`` (``root``: ``sqrt_rn(v)``, a NaN kept; ``bound``:
    ``kernels.bounds``' ``K (1 + 2^-8)``), which exact Adam never exceeds: values inside are kept as they are (signed
    zeros and NaN too), so every path that compares the same way (the C++ and Triton kernels) gets the same bits; an
    infinite ``bound`` keeps all. Moments of another dtype (the per-parameter step of fp16 parameters) take its own
    floor, the root of its least normal value (fp16: 2^-7, where fp32's would round the limit to 0)."""
    floor = ROOT_FLOOR if exp_avg.dtype == torch.float32 else torch.finfo(exp_avg.dtype).tiny ** 0.5
    limit = torch.where(root < floor, floor, root) * bound
    return torch.where(exp_avg > limit, limit, torch.where(exp_avg < -limit, -limit, exp_avg)).to(exp_avg.dtype)


def decoupled_decay(group: dict) -> bool:
    """Whether the fused steps decay ``group``'s parameters decoupled (AdamW's ``p * (1 - lr * weight_decay)``):
    AdamW's, and an L2 decay of 0, which torch's Adam skips (decoupled, its factor is exactly 1; as L2, ``fma(p, 0,
    g)`` would make the gradient of a parameter holding inf NaN)."""
    return bool(group["decoupled_weight_decay"]) or float(group["weight_decay"]) == 0


def eco_coefficient(group: dict, step: float) -> float:
    """ECO's coefficient of ``denom * e`` in Adam's ``m`` at step ``step`` (``optim/weights.py``):
    ``((1 - beta1**step) / lr) * (1 - 1 / beta1)``, times ``1 - lr * weight_decay`` with decoupled weight decay (the
    published extension); 0 where ``beta1`` is 0 (no momentum to feed: ``error_feedback="eco"`` refuses it) or the
    learning rate is 0 (no step to correct; FSDP2's resume takes such a step before loading)."""
    lr, beta1 = float(group["lr"]), float(group["betas"][0])
    if beta1 == 0 or lr == 0:
        return 0.0
    coefficient = (1 - beta1**step) / lr * (1 - 1 / beta1)
    return coefficient * (1 - lr * group["weight_decay"]) if group["decoupled_weight_decay"] else coefficient


def eco_feedback(exp_avg: torch.Tensor, denom: torch.Tensor, error: torch.Tensor, hyper: dict[str, torch.Tensor]) -> torch.Tensor:
    """``exp_avg + eco_coefficient * denom * error`` as every path rounds it: the product of the two coefficients once,
    then one ``fma``. ``denom``: Adam's ``sqrt(v) / sqrt(1 - beta2**t) + eps`` of this step; ``error``: ``θ̃ - θ̂``."""
    return fma(hyper["eco_coefficient"] * denom, error, exp_avg)


def adam_denominator(exp_avg_sq: torch.Tensor, hyper: dict[str, torch.Tensor], root: torch.Tensor | None = None) -> torch.Tensor:
    """Adam's ``sqrt(v) / sqrt(1 - beta2**t) + eps``, each operation rounded once (``root``: ``sqrt_rn(v)`` if taken)."""
    return (sqrt_rn(exp_avg_sq) if root is None else root) / hyper["bias_correction2_sqrt"] + hyper["eps"]


def adam_hyper(group: dict, step: float, bound: float | None = None) -> dict[str, torch.Tensor]:
    """The 0-d fp32 tensors ``adam_math`` takes (names and meaning: ``kernels.triton_adam.COEFFICIENTS``), for
    ``group``'s options at step ``step`` (1 for the first step).

    Each is computed as torch's AdamW computes it (``1 - lr * weight_decay``, ``1 - beta1``, ``1 - beta2``,
    ``lr / (1 - beta1**step)``, ``(1 - beta2**step) ** 0.5``: in Python floats, in float64, or in a tensor
    hyperparameter's dtype) and rounded to fp32 once, where torch's kernels round it; ``moment_bound`` is ``bound``,
    which the updated ``m`` is held to (an optimizer's ``kernels.bounds.held_moment_bound``; default: the closed form
    ``moment_bound`` after ``step`` updates, all with these betas).
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
        "moment_bound": moment_bound(float(beta1), float(beta2), step) if bound is None else bound,
        "eco_coefficient": eco_coefficient(group, step),
    }
    return {name: torch.as_tensor(value, dtype=torch.float32) for name, value in values.items()}


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

    ``hyper``: the 0-d fp32 tensors of ``adam_hyper``. The updated ``m`` is held to ``|m| <= moment_bound *
    sqrt(v)`` with the updated ``v``'s root, before the update divides by it (``kernels.bounds``; the identity where
    the moments are exact). ``exp_avg`` and ``exp_avg_sq`` come out bit for bit as torch's AdamW computes them on
    CPUs where its kernels fuse ``a * b + c`` (ATen capability AVX2 or AVX512), the parameter too where its ``sqrt``
    is correctly rounded.
    """
    if maximize:
        grad = -grad
    if decoupled_weight_decay:
        param = param * hyper["decay"]
    else:
        grad = fma(param, hyper["weight_decay"], grad)  # grad.add(param, alpha=weight_decay)
    weight = hyper["lerp_weight"]
    small = weight.abs() < 0.5  # exp_avg.lerp_(grad, weight), from the nearer end
    exp_avg.copy_(fma(torch.where(small, weight, weight - 1), grad - exp_avg, torch.where(small, exp_avg, grad)))
    # exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    exp_avg_sq.copy_(fma(hyper["square_weight"] * grad, grad, exp_avg_sq * hyper["beta2"]))
    root = sqrt_rn(exp_avg_sq)
    exp_avg.copy_(hold_moment(exp_avg, root, hyper["moment_bound"]))
    denom = adam_denominator(exp_avg_sq, hyper, root)
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
    weight_format: CastFormat | None = None,
    weight_rounding: Rounding = "nearest",
    eco: bool = False,
) -> torch.Tensor:
    """Adam step of ``param`` (updated in place) whose moments are stored as codes/scales (updated in place).

    Tensors may come as ``(blocks, block_size)`` views (the compiled path: a static block size, a dynamic
    block count) or flat. Returns ``int64 [stalled_m, moved_m, stalled_v, moved_v]`` (zeros unless ``track_stalls``).

    Without master weights (``optim/weights.py``): ``weight_format`` (a cast format: the grid of bf16, fp16 or fp32
    values) is what the new parameter values are rounded to, with ``weight_rounding``; ``param`` may then be of any
    float dtype (the math runs in fp32). ``eco``: the rounding error is fed into ``m`` (``eco_feedback``) before ``m``
    is stored; its ``m`` is not held (``moment_bound`` taken as infinite).
    """
    param, grad, m_codes, v_codes = param.view(-1), grad.reshape(-1).float(), m_codes.view(-1), v_codes.view(-1)
    numel = param.numel()
    if eco:  # ECO's feedback puts m outside Adam's bound by design: not held (kernels.bounds.held_moment_bound)
        hyper = {**hyper, "moment_bound": torch.tensor(math.inf)}
    exp_avg = m_format.dequantize_reference(m_codes, m_scales, numel)
    exp_avg_sq = v_format.dequantize_reference(v_codes, v_scales, numel)
    old_m, old_v = (exp_avg.clone(), exp_avg_sq.clone()) if track_stalls else (exp_avg, exp_avg_sq)
    updated = adam_math(param.float(), grad, exp_avg, exp_avg_sq, hyper, decoupled_weight_decay, maximize)
    if weight_format is not None:
        stored = weight_format.round_saturated(updated, weight_rounding, None).float()
        if eco:
            exp_avg.copy_(eco_feedback(exp_avg, adam_denominator(exp_avg_sq, hyper), updated - stored, hyper))
        updated = stored
    param.copy_(updated)
    counts = []
    for fmt, codes, scales, value, old in ((m_format, m_codes, m_scales, exp_avg, old_m), (v_format, v_codes, v_scales, exp_avg_sq, old_v)):
        new_codes, new_scales = fmt.quantize_reference(value, rounding, None)
        if track_stalls:
            stored = fmt.dequantize_reference(new_codes, new_scales, numel)
            units = (fmt.unit_values_reference(c, numel) for c in (codes, new_codes))
            counts.append(count_stalls(old, value, stored, *units))
        codes.copy_(new_codes)
        if scales is not None:
            scales.copy_(new_scales)
    return torch.cat(counts) if track_stalls else torch.zeros(4, dtype=torch.int64)
