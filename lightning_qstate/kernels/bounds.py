"""What Adam's own math allows: the bound on ``|m| / sqrt(v)`` that every quantized step enforces on its decoded moments.

With both moments starting at zero, ``m_n = (1 - β1) Σ_k β1^(n-k) g_k`` and ``v_n = (1 - β2) Σ_k β2^(n-k) g_k²``, so by
Cauchy-Schwarz ``|m_n| <= K_n sqrt(v_n)`` with

    K_n² = (1 - β1)² / (1 - β2) · Σ_{j<n} r^j,   r = β1² / β2,

for every gradient sequence (weight decay folded into ``g`` included). Stored moments can break it: a tiny ``m`` that
stochastic rounding sends up to a coarse format's smallest code, beside a ``v`` stored at its format's floor, would
make a step many times Adam's largest. Clamping the decoded ``m`` to ``K_n sqrt(v)`` before the update restores the
invariant (the recursion ``K_{n+1}² = r K_n² + (1 - β1)² / (1 - β2)`` carries it through the update), so no step is
larger than exact Adam could take; in exact arithmetic the clamp never acts. See docs/algorithms.md, "Zero-free formats".
"""

from __future__ import annotations

import functools
import math

import numpy


@functools.lru_cache(maxsize=256)  # every step asks once per quantized parameter, mostly with one step count
def moment_bound(beta1: float, beta2: float, steps_done: float) -> float:
    """``K_n (1 + 2^-8)`` for ``n = steps_done`` (the moments after ``n`` updates); ``inf`` where ``v`` does not accumulate
    (β2 = 1).

    The margin keeps the clamp off moments that meet the bound exactly up to float rounding (after one update
    ``|m| = K_1 sqrt(v)``), so exact moments are never changed; it is returned as the fp32 value at or above it.
    """
    n = float(steps_done)
    if beta2 >= 1.0:
        return math.inf
    if beta2 <= 0.0:  # v holds the last gradient only: m is bounded by it after one update, or with no memory (β1 = 0)
        if n > 1 and beta1 != 0.0:
            return math.inf
        terms = min(n, 1.0)
        return _fp32_at_or_above((1.0 - beta1) * math.sqrt(terms) * (1.0 + 2.0**-8))
    ratio = beta1 * beta1 / beta2
    if ratio == 0.0:
        terms = 1.0 if n > 0 else 0.0
    elif ratio == 1.0:
        terms = n
    else:
        terms = -math.expm1(n * math.log(ratio)) / (1.0 - ratio)  # Σ_{j<n} r^j, also for r > 1
    return _fp32_at_or_above((1.0 - beta1) * math.sqrt(terms / (1.0 - beta2)) * (1.0 + 2.0**-8))


def _fp32_at_or_above(value: float) -> float:
    """The least fp32 value ``>= value``."""
    single = numpy.float32(value)
    return float(single) if float(single) >= value else float(numpy.nextafter(single, numpy.float32(numpy.inf)))
