"""The fused Adam(W) step over block-quantized moments: one Triton program per block, one pass over memory.

:func:`adam_step_kernel` reads a block of the parameter (fp32, bf16 or fp16), its gradient and the
packed codes + scales of both moments, and writes the parameter, codes and scales
back in place: decode (``decode[code] * scale``) -> torch's Adam(W) update (in fp32) ->
weight grid and ECO feedback (optional) -> per-block absmax -> encode (RN or SR) -> pack.
Nothing else touches memory.

It follows ``kernels/adam_reference.py``'s ``adam_step_quantized`` (the torch definition of the
step) operation by operation, bit for bit (``adam_math``'s rounding contract), in the
operation order of torch's kernels:

* L2 decay ``grad.add(param, alpha=weight_decay)`` is ``fma(param, weight_decay, grad)``;
* ``exp_avg.lerp_(grad, w)`` is ``fma(w, grad - exp_avg, exp_avg)`` for ``|w| < 0.5``,
  else ``fma(w - 1, grad - exp_avg, grad)`` (torch's vectorized CPU and CUDA lerp);
* ``exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)`` is
  ``fma((1 - beta2) * grad, grad, exp_avg_sq * beta2)``;
* ``sqrt`` and the two divisions are IEEE (``sqrt_rn``, ``div_rn``), every other
  operation rounds once. Launch with ``enable_fp_fusion=False`` (the launcher does,
  via the kernel variant) so the compiler adds no FMA contraction of its own.

The hyperparameters come from a device vector (:data:`COEFFICIENTS`, the fp32 values
of ``kernels.adam_reference.adam_hyper``), so a new learning rate never recompiles and never
synchronizes. The moments may have different formats and block sizes: a program
covers ``BLOCK_SIZE`` values, the larger of the two block sizes, and the moment
with the smaller block size is scaled per sub-block (``*_SUB_BLOCKS`` of them).

Without master weights (``optim/weights.py``), the constexpr ``WEIGHT_GRID`` (``NO_GRID``, ``FP32_GRID``,
``BF16_GRID`` or ``FP16_GRID`` of :mod:`.triton_formats`: the grid of a cast format) is what the updated fp32
values ``θ̃`` are rounded to, ``θ̂`` (RN, or SR with ``WEIGHT_STOCHASTIC``), as ``CastFormat.round_saturated``
(:func:`~.triton_formats.round_to_weight_grid`); ``θ̂`` is stored in the parameter's dtype (RN; exact when the
grid is that dtype's). ``NO_GRID`` and ``FP32_GRID`` keep ``θ̃``. With ``ECO``, the rounding error is fed into
``m`` before ``m`` is requantized, as ``adam_reference.eco_feedback``: ``m = fma(eco_coefficient * denom, θ̃ - θ̂, m)``
(``denom`` the update's, the product rounded once), so RN matches ``adam_step_quantized`` bit for bit here too.

SR draws ``tl.rand(seed_m, i)`` for ``exp_avg`` and ``tl.rand(seed_v, i)`` for
``exp_avg_sq``, and for the weights ``tl.randint(seed_w, i) & 0xFFFF`` (bf16: 16 random bits, as
``rounding.bf16_stochastic``) or ``tl.rand(seed_w, i)`` (fp16: ``cast.fp16_stochastic``'s unbiased
minifloat rounding); three seeds (``m``, ``v``, weights) at ``seed_ptr``. With ``TRACK_STALLS``, each program
atomically adds its block's ``stalled + (moved << 32)`` of ``exp_avg`` and of
``exp_avg_sq`` into row ``block % STALL_SLOTS`` of an int64 ``(STALL_SLOTS, 2)``
buffer (rows spread the atomics; the launcher sums and unpacks them into
``[stalled_m, moved_m, stalled_v, moved_v]``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .adam_reference import ROOT_FLOOR as _ROOT_FLOOR
from .triton_formats import float32_to, load_moment, round_to_weight_grid, stall_counts, store_moment, to_float32

COEFFICIENTS = (
    "decay",
    "weight_decay",
    "lerp_weight",
    "beta2",
    "square_weight",
    "eps",
    "step_size",
    "bias_correction2_sqrt",
    "moment_bound",
    "eco_coefficient",
)
"""Layout of the fp32 coefficient vector: ``1 - lr * weight_decay``, ``weight_decay``, ``1 - beta1``, ``beta2``,
``1 - beta2``, ``eps``, ``lr / (1 - beta1**t)``, ``sqrt(1 - beta2**t)`` (at step ``t``), each computed as torch's
AdamW does (in float64 for Python floats) and rounded to fp32 once, the bound ``K`` that the updated ``m`` is
held to (``|m| <= K sqrt(v)`` of the updated ``v``, ``kernels.bounds``), and ECO's coefficient of ``denom * (θ̃ - θ̂)`` in ``m``
(``kernels.adam_reference.eco_coefficient``, read only with ``ECO``): the keys of
``kernels.adam_reference.adam_hyper``."""

STALL_SLOTS: tl.constexpr = tl.constexpr(32)
ROOT_FLOOR: tl.constexpr = tl.constexpr(_ROOT_FLOOR)  # adam_reference.hold_moment's least root


@triton.jit
def adam_step_kernel(
    param_ptr,
    grad_ptr,
    m_codes_ptr,
    m_scales_ptr,
    m_decode_ptr,
    m_bucket_floor_ptr,
    m_values_ptr,
    m_key_shift,
    m_half,
    m_last,
    m_max_value,
    v_codes_ptr,
    v_scales_ptr,
    v_decode_ptr,
    v_bucket_floor_ptr,
    v_values_ptr,
    v_key_shift,
    v_half,
    v_last,
    v_max_value,
    coefficients_ptr,
    seed_ptr,
    counts_ptr,
    numel,
    BLOCK_SIZE: tl.constexpr,
    M_SUB_BLOCKS: tl.constexpr,
    M_BITS: tl.constexpr,
    M_IS_MINIFLOAT: tl.constexpr,
    M_SIGNED: tl.constexpr,
    M_MANTISSA_BITS: tl.constexpr,
    M_BIAS: tl.constexpr,
    M_MAX_CODE: tl.constexpr,
    M_MIN_CODE: tl.constexpr,
    M_SCALE_BF16: tl.constexpr,
    V_SUB_BLOCKS: tl.constexpr,
    V_BITS: tl.constexpr,
    V_IS_MINIFLOAT: tl.constexpr,
    V_SIGNED: tl.constexpr,
    V_MANTISSA_BITS: tl.constexpr,
    V_BIAS: tl.constexpr,
    V_MAX_CODE: tl.constexpr,
    V_MIN_CODE: tl.constexpr,
    V_SCALE_BF16: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    DECOUPLED: tl.constexpr,
    MAXIMIZE: tl.constexpr,
    TRACK_STALLS: tl.constexpr,
    WEIGHT_GRID: tl.constexpr,
    WEIGHT_STOCHASTIC: tl.constexpr,
    ECO: tl.constexpr,
):
    """One Adam(W) step of block ``program_id(0)`` (``BLOCK_SIZE`` values) of a parameter with quantized moments.

    ``param_ptr``: fp32, bf16 or fp16 values (the update runs in fp32); ``grad_ptr``: fp32, bf16 or fp16.
    ``m_*`` / ``v_*``: codes, scales (fp32, or bf16 when ``*_SCALE_BF16``) and decode table of ``exp_avg`` /
    ``exp_avg_sq``, then the encoder arguments of :func:`~.triton_formats.encode_block`. ``coefficients_ptr``: fp32 vector laid out as
    :data:`COEFFICIENTS`. ``seed_ptr``: three int64 seeds (``m``, ``v``, weights), the first two read only when
    ``STOCHASTIC``, the third only when ``WEIGHT_STOCHASTIC``. ``counts_ptr``: int64 ``(STALL_SLOTS, 2)`` packed
    counts, written only when ``TRACK_STALLS``. ``WEIGHT_GRID``, ``WEIGHT_STOCHASTIC``, ``ECO``: the weight grid and
    ECO's feedback (module docstring); ``ECO`` needs a grid.
    """
    block = tl.program_id(0)
    offsets = block.to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    in_range = offsets < numel
    param = to_float32(tl.load(param_ptr + offsets, mask=in_range, other=0.0))
    grad = to_float32(tl.load(grad_ptr + offsets, mask=in_range, other=0.0))
    exp_avg, exp_avg_units = load_moment(m_codes_ptr, m_scales_ptr, m_decode_ptr, block, numel, M_BITS, M_SUB_BLOCKS, BLOCK_SIZE)
    exp_avg_sq, exp_avg_sq_units = load_moment(v_codes_ptr, v_scales_ptr, v_decode_ptr, block, numel, V_BITS, V_SUB_BLOCKS, BLOCK_SIZE)

    # adam_reference.adam_math, in torch's rounding order; coefficients in the order of COEFFICIENTS.
    decay, weight_decay = tl.load(coefficients_ptr + 0), tl.load(coefficients_ptr + 1)
    lerp_weight, beta2, square_weight = tl.load(coefficients_ptr + 2), tl.load(coefficients_ptr + 3), tl.load(coefficients_ptr + 4)
    eps, step_size, bias_correction2_sqrt = tl.load(coefficients_ptr + 5), tl.load(coefficients_ptr + 6), tl.load(coefficients_ptr + 7)
    if MAXIMIZE:
        grad = -grad
    if DECOUPLED:
        param = param * decay
    else:
        grad = tl.fma(param, weight_decay, grad)
    small = tl.abs(lerp_weight) < 0.5  # torch's lerp: from the nearer end
    coefficient = tl.where(small, lerp_weight, lerp_weight - 1.0)
    new_exp_avg = tl.fma(coefficient, grad - exp_avg, tl.where(small, exp_avg, grad))
    new_exp_avg_sq = tl.fma(square_weight * grad, grad, exp_avg_sq * beta2)
    root = tl.math.sqrt_rn(new_exp_avg_sq)
    if not ECO:  # adam_reference.hold_moment; ECO's feedback puts m outside the bound by design: not held
        limit = tl.where(root < ROOT_FLOOR, ROOT_FLOOR, root) * tl.load(coefficients_ptr + 8)
        new_exp_avg = tl.where(new_exp_avg > limit, limit, tl.where(new_exp_avg < -limit, -limit, new_exp_avg))
    denom = tl.math.div_rn(root, bias_correction2_sqrt) + eps
    param = param - tl.math.div_rn(step_size * new_exp_avg, denom)
    # adam_reference.adam_step_quantized: θ̂ = q(θ̃) on the weight grid, ECO's feedback of θ̃ - θ̂ into m.
    stored_param = round_to_weight_grid(param, seed_ptr + 2, offsets, WEIGHT_GRID, WEIGHT_STOCHASTIC)
    if ECO:
        new_exp_avg = tl.fma(tl.load(coefficients_ptr + 9) * denom, param - stored_param, new_exp_avg)
    tl.store(param_ptr + offsets, float32_to(stored_param, param_ptr.dtype.element_ty), mask=in_range)

    # Requantize; values past numel are 0 so that they do not enter the block absmax.
    new_exp_avg = tl.where(in_range, new_exp_avg, 0.0)
    new_exp_avg_sq = tl.where(in_range, new_exp_avg_sq, 0.0)
    if STOCHASTIC:
        uniform_m = tl.rand(tl.load(seed_ptr), offsets)
        uniform_v = tl.rand(tl.load(seed_ptr + 1), offsets)
    else:
        uniform_m = new_exp_avg  # not read by RN
        uniform_v = new_exp_avg_sq
    stored_m, stored_m_units = store_moment(
        new_exp_avg, uniform_m, m_codes_ptr, m_scales_ptr, m_decode_ptr, m_bucket_floor_ptr, m_values_ptr,
        m_key_shift, m_half, m_last, m_max_value, block, numel, BLOCK_SIZE, M_SUB_BLOCKS,
        M_BITS, M_IS_MINIFLOAT, M_SIGNED, M_MANTISSA_BITS, M_BIAS, M_MAX_CODE, M_MIN_CODE, STOCHASTIC, TRACK_STALLS,
        M_SCALE_BF16,
    )  # fmt: skip
    stored_v, stored_v_units = store_moment(
        new_exp_avg_sq, uniform_v, v_codes_ptr, v_scales_ptr, v_decode_ptr, v_bucket_floor_ptr, v_values_ptr,
        v_key_shift, v_half, v_last, v_max_value, block, numel, BLOCK_SIZE, V_SUB_BLOCKS,
        V_BITS, V_IS_MINIFLOAT, V_SIGNED, V_MANTISSA_BITS, V_BIAS, V_MAX_CODE, V_MIN_CODE, STOCHASTIC, TRACK_STALLS,
        V_SCALE_BF16,
    )  # fmt: skip

    if TRACK_STALLS:
        row = counts_ptr + (block % STALL_SLOTS) * 2
        tl.atomic_add(row, stall_counts(new_exp_avg, exp_avg, stored_m, exp_avg_units, stored_m_units, in_range), sem="relaxed")
        tl.atomic_add(
            row + 1, stall_counts(new_exp_avg_sq, exp_avg_sq, stored_v, exp_avg_sq_units, stored_v_units, in_range), sem="relaxed"
        )
