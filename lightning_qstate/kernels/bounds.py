"""What Adam's own math allows: the bound on ``|m| / sqrt(v)`` that every quantized step enforces on its moments.

With both moments starting at zero, ``m_n = (1 - β1) Σ_k β1^(n-k) g_k`` and ``v_n = (1 - β2) Σ_k β2^(n-k) g_k²``, so by
Cauchy-Schwarz ``|m_n| <= K_n sqrt(v_n)`` with

    K_n² = (1 - β1)² / (1 - β2) · Σ_{j<n} r^j,   r = β1² / β2,

for every gradient sequence (weight decay folded into ``g`` included). Stored moments can break it: a tiny ``m`` that
stochastic rounding sends up to a coarse format's smallest code, beside a ``v`` stored at its format's floor, would
make a step many times Adam's largest. Every Adam step clamps the updated ``m_{n+1}`` to ``K_{n+1} sqrt(v_{n+1})``
(``K_{n+1}² = r K_n² + (1 - β1)² / (1 - β2)``) with the root its update takes anyway, before it divides by it, so no
step is larger than exact Adam could take; in exact arithmetic the clamp never acts. See docs/algorithms.md, "Adam's
own bound".

The recursion holds for betas that change between updates too (a warm-up of ``β1``, a schedule of ``β2``), where the
closed form, which assumes this update's betas since the first, can fall below exact moments. So each parameter's
state carries ``K_n²`` under ``MOMENT_BOUND_STATE``, advanced with the betas of each update (``held_moment_bound``); a
state without it (a checkpoint of an earlier version, moments kept in fp32 for a while, a torch optimizer's state)
starts from the larger of the closed form and its moments' own largest ``m² / v`` (``restart_square``), as a reset
restarts it.
"""

from __future__ import annotations

import functools
import math

import numpy
import torch

from ..formats import QuantizedTensor, local_tensor

MOMENT_BOUND_STATE = "moment_bound_sq"  # K_n² of a parameter whose moments are quantized: a 0-d float64 CPU tensor


def held_moment_bound(state: dict, beta1: float, beta2: float, steps_done: float, feedback: bool = False) -> float:
    """The bound this update holds the updated ``m`` to (as ``moment_bound``: ``K_{n+1} (1 + 2^-8)``, fp32) for a
    parameter whose ``state`` has taken ``n = steps_done`` updates; advances ``state[MOMENT_BOUND_STATE]`` to
    ``K_{n+1}²`` with this update's betas. A state without ``K_n²`` starts from the larger of the closed form and its
    moments' own largest ``m² / v`` (``ratio_square``). ``feedback``: ECO feeds the weights' rounding error into this
    parameter's ``m`` (``optim/weights.py``), which puts it outside Adam's bound by design (the hold clipped the
    corrections' large side: a bf16 weight at lr 1e-4 never moved): ``inf``, no hold, ``K²`` advanced all the same."""
    kept = state.get(MOMENT_BOUND_STATE)
    square = restart_square(state, beta1, beta2, steps_done) if kept is None else float(kept)
    advanced = next_bound_square(square, beta1, beta2)
    state[MOMENT_BOUND_STATE] = torch.tensor(advanced, dtype=torch.float64)
    return math.inf if feedback else _with_margin(advanced)


def restart_square(state: dict, beta1: float, beta2: float, steps_done: float) -> float:
    """``K_n²`` of a state that has lost it (or whose moments were just zeroed): the larger of the closed form after
    ``steps_done`` updates and its moments' own largest ``m² / v`` (``ratio_square``)."""
    return max(bound_square(beta1, beta2, steps_done), ratio_square(state))


def ratio_square(state: dict) -> float:
    """The largest ``m² / v`` of ``state``'s moments (``exp_avg``, ``exp_avg_sq``; decoded where quantized; 0 where
    none has taken a step; the values this rank holds), over the values with ``v > 0``: a ``K_n²`` that bounds them. The recursion of
    ``next_bound_square`` carries any such bound through later updates (Cauchy-Schwarz, value by value), so a state
    whose ``K_n²`` was lost (converted from a torch optimizer, a checkpoint of an earlier version, moments kept in fp32
    for a while) never has its exact moments held, where the closed form, which assumes this update's betas since the
    first, fell below them after a warm-up of ``β1`` (m at 0.24 of torch's AdamW's)."""
    moments = [state.get(name) for name in ("exp_avg", "exp_avg_sq")]
    if any(moment is None for moment in moments) or not float(state.get("step", 0)):
        return 0.0
    m, v = (local_tensor(moment.dequantize() if isinstance(moment, QuantizedTensor) else moment).double() for moment in moments)
    positive = v > 0
    return float((m.square()[positive] / v[positive]).max()) if bool(positive.any()) else 0.0


def next_bound_square(square: float, beta1: float, beta2: float) -> float:
    """``K_{n+1}² = (β1² / β2) K_n² + (1 - β1)² / (1 - β2)`` from ``square = K_n²`` (``inf`` where ``v`` does not
    accumulate; with ``β2 = 0``, ``v`` holds the last gradient only: ``m`` is bounded by it while it has no memory)."""
    if beta2 >= 1.0 or math.isinf(square):
        return math.inf
    if beta2 <= 0.0:
        return (1.0 - beta1) ** 2 if square == 0.0 or beta1 == 0.0 else math.inf
    return beta1 * beta1 / beta2 * square + (1.0 - beta1) ** 2 / (1.0 - beta2)


@functools.lru_cache(maxsize=256)  # a state without K_n² asks once per quantized parameter, mostly with one step count
def bound_square(beta1: float, beta2: float, steps_done: float) -> float:
    """``K_n²`` for ``n = steps_done`` updates, all with these betas (the closed form of ``next_bound_square``)."""
    n = float(steps_done)
    if beta2 >= 1.0:
        return math.inf
    if beta2 <= 0.0:
        return (1.0 - beta1) ** 2 * min(n, 1.0) if n <= 1 or beta1 == 0.0 else math.inf
    ratio = beta1 * beta1 / beta2
    if ratio == 0.0:
        terms = 1.0 if n > 0 else 0.0
    elif ratio == 1.0:
        terms = n
    else:
        terms = -math.expm1(n * math.log(ratio)) / (1.0 - ratio)  # Σ_{j<n} r^j, also for r > 1
    return (1.0 - beta1) ** 2 * terms / (1.0 - beta2)


def moment_bound(beta1: float, beta2: float, steps_done: float) -> float:
    """``K_n (1 + 2^-8)`` for ``n = steps_done`` (the moments after ``n`` updates); ``inf`` where ``v`` does not accumulate
    (β2 = 1).

    The margin keeps the clamp off moments that meet the bound exactly up to float rounding (after one update
    ``|m| = K_1 sqrt(v)``), so exact moments are never changed; it is returned as the fp32 value at or above it.
    """
    return _with_margin(bound_square(beta1, beta2, steps_done))


def _with_margin(square: float) -> float:
    """``sqrt(square) (1 + 2^-8)`` as the fp32 value at or above it."""
    return math.inf if math.isinf(square) else _fp32_at_or_above(math.sqrt(square) * (1.0 + 2.0**-8))


def _fp32_at_or_above(value: float) -> float:
    """The least fp32 value ``>= value``."""
    single = numpy.float32(value)
    return float(single) if float(single) >= value else float(numpy.nextafter(single, numpy.float32(numpy.inf)))
