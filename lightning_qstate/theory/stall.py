"""Stall model of low-precision EMA states (arXiv 2603.16731; see ``docs/algorithms.md``, "Stall model and resets").

An EMA state ``s`` is updated in fp32 and rounded when it is written back. An entry *stalls* when the
update moved it but its stored code stayed put (see :func:`lightning_qstate.formats.count_stalls`). With
round-to-nearest (RN) that happens when the update is under half the gap to the next code in its
direction; with stochastic rounding (SR) it happens with probability ``1 - |update| / gap``.

**Second moment** (``exp_avg_sq``, the paper's model). ``g/σ ~ N(0, 1)``, ``v ≈ a·σ²`` with ``a = 1``
in the steady state and ``a_k = 1 - β^k`` ``k`` steps after ``v`` was zeroed, or ``a = E[v]/E[g²]`` measured
(``center=``: a state lags gradients whose scale changes); ``z = g²/σ² ~ χ²₁``. With
relative gaps ``δ`` above and below the stored value, ``ρ = δ / (2(1 - β))``:

- RN: ``P = F(a(1 + ρ_up)) - F(a(1 - ρ_down))`` (``F``: CDF of ``z``);
- SR: ``P = E_z[max(0, 1 - |z - a| / (2ρa))]`` (``ρ`` on the side ``z`` falls), in closed form.

**First moment** (``exp_avg``, SGD's ``momentum_buffer``; our extension of the same mechanism,
documented as such). Zero-mean gradients ``g/σ ~ N(0, 1)``; the state ``m/σ ~ N(0, s²)`` with
``s² = (1 - β)(1 - β^{2k}) / (1 + β)`` (``k = ∞``: steady state), independent of ``g``. The update
``(1 - β)(g - m)`` stalls when ``g`` lies in ``(m(1 - ρ_down), m(1 + ρ_up))`` (RN), and the same SR tent;
the result is averaged over ``|m|`` numerically. Momentum ``μ·b + g`` is an EMA with ``β = μ`` up to a
factor, which relative gaps do not see.

**Gaps per format.**

- Float formats (``bf16``/``fp16``/``fp32`` casts, FP8 and any ``eXmY``, block-scaled or not): the gap at
  ``x = mant·2^e`` is ``ε·x/mant`` with ``ε = 2^-p`` (``p`` fraction bits); as in the paper, ``1/mant`` is
  replaced by its mean over a binade, ``ln 2``, so ``ρ = ε·ln2 / (2(1 - β))`` on both sides. The largest entry
  of a block (stored exactly as the block's scale) is ignored, and so are subnormals unless ``values=`` shows
  them: a cast's stored value ``k`` steps of its subnormal spacing above zero has the gap ``1/k`` on both
  sides (fp16: a ``v`` under 6.1e-5, i.e. gradients under about 8e-3, has fewer than 10 fraction bits).
- Block-scaled codebooks (``int8``, ``int4``, ``*_linear``): the gaps are those between neighbouring codes,
  ``δ_up = (c_{i+1} - c_i)/c_i`` and ``δ_down = (c_i - c_{i-1})/c_i``. **Assumption** (ours): a block's
  entries are spread log-uniformly over its top binade (``(absmax/2, absmax]``), as a float's mantissa is,
  so each positive code there is weighted by the log-width of its rounding cell; the top code's upper gap
  is taken equal to its lower one (above it the entry becomes the block maximum and is stored exactly).
  Pass ``values=`` (the stored state, or values in units of their block's absmax) to weight the codes by
  their actual occupancy instead.

**Block-scale drift** (block-scaled formats, second moment; ours). A block's fp32 scale is its absmax, stored
exactly, so it moves every step with the update of the block's largest entry, and every code of the block
is read against the new scale. An entry keeps its code when its own relative update minus the scale's
stays inside the window: ``z`` is compared with ``z'``, an independent ``χ²₁`` draw standing for the largest
entry's, instead of with ``a``; the largest entry itself (a fraction ``1/block_size``) never stalls. This
lowers the SR stall rate of FP8 at ``β = 0.99`` from 0.889 to 0.853 (measured: 0.85). A bf16 scale (the
absmax rounded up; not the default for second moments, see :mod:`lightning_qstate.formats.block`) moves
only in steps of its grid: the largest entry's update, rounded stochastically to that grid (the absmax sits
uniformly in its grid cell), and the largest entry stays on its top code, so it always stalls. Against a
simulation this model is within 3 points for FP8 and off by up to 5.2 for int8 (``β`` 0.99 and 0.999, RN and
SR). ``block_drift=False`` gives the paper's closed forms for every format.

**Measured ratios** (ours). Only the ratio ``r`` of an entry's input to its state matters: ``r = g²/v`` (second
moment, the window ``|r - 1| < ρ``) or ``r = g/m`` (first moment, the same window). The noise model draws ``r`` from
``χ²₁/a`` or from ``g/m`` with Gaussian ``g`` and ``m``. Given the measured ``r`` of every moving entry of a layer on
one step (``ratios=``), their empirical distribution replaces the model's and the rest (the gaps, RN's window, SR's
tent, the block-scale drift with ``z'`` another draw of the same distribution) is unchanged. Real layers need this:
entries whose gradient is zero on a step (``r = 0``: an embedding's rows) or much smaller than usual (a tied
embedding's output rows of rare tokens) only decay and stall far more than a Gaussian gradient says. A state
written from zero (``r = ∞``) stalls only where its code stays the one zero is stored as: never in a cast; in a
block format, modelled with fresh i.i.d. blocks (``_fresh_stall``). The first moment's block-scale drift is not
modelled (as without ``ratios``).

The model ignores the correlation of ``v`` with past ``g`` and the drift of ``v`` under RN ratcheting;
``benchmarks/stall_simulation.py`` measures how far that matters.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch

from ..arguments import check_flags, finite_real, whole_number
from ..formats import (
    BlockFormat,
    CastFormat,
    MinifloatFormat,
    QuantizedTensor,
    Rounding,
    StorageFormat,
    check_rounding,
    get_format,
    local_tensor,
)
from ..optim import NONNEGATIVE_STATES

Moment = Literal["first", "second"]
MOMENTS: tuple[str, ...] = ("first", "second")
_HALF_NORMAL_POINTS = 4001  # quadrature over |m| for the first moment
_HALF_NORMAL_RANGE = 9.0  # in standard deviations
_CAST_FRACTION_BITS = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}
_SCALE_MANTISSAS = 8  # quadrature over a bf16 scale's mantissa (its grid step)
_RATIO_QUANTILES = 256  # draws of a block scale's ratio from measured ratios
_FRESH_QUANTILES = 512  # quadrature over a fresh block's largest entry


RUNNING_MAXIMA = ("max_exp_avg_sq",)  # states that keep the running maximum of an EMA (AMSGrad's): no stall model


def moment_of(state_name: str) -> Moment:
    """``"second"`` for squared-gradient EMAs (``exp_avg_sq``, ...), ``"first"`` for the others (``exp_avg``, ``momentum_buffer``)."""
    return "second" if state_name in NONNEGATIVE_STATES else "first"


def state_decay(group: dict, state_name: str) -> float | None:
    """The EMA decay of state ``state_name`` under a param group's options (``None`` if not an EMA we know).

    ``exp_avg``: ``β1``; ``exp_avg_sq``/``max_exp_avg_sq``: ``β2`` (Adam's ``betas``); ``momentum_buffer``: ``momentum``
    (SGD, Muon); ``square_avg``: ``alpha`` (RMSprop).
    """
    betas = group.get("betas")
    if betas is not None and state_name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        return float(betas[0] if state_name == "exp_avg" else betas[1])
    if state_name == "momentum_buffer" and group.get("momentum"):
        return float(group["momentum"])
    if state_name == "square_avg" and "alpha" in group:
        return float(group["alpha"])
    return None


def state_input(
    group: dict, state_name: str, grad: torch.Tensor, param: torch.Tensor, state: Mapping[str, Any] | None = None
) -> torch.Tensor | None:
    """The input ``x`` of state ``state_name`` written as the EMA ``s ← β·s + (1 - β)·x`` (``β``: :func:`state_decay`),
    from a parameter's gradient as torch's optimizers compute it (``None`` if not an EMA we know, or where the input
    needs the parameter's other states and ``state`` is not given; AMSGrad's ``max_exp_avg_sq``, a running maximum of
    ``exp_avg_sq``, is not an EMA of its own).

    ``d = ±g`` (``maximize``) ``+ weight_decay·p`` unless the decay is decoupled (AdamW, Muon). Adam's ``exp_avg``: ``d``;
    ``exp_avg_sq`` and RMSprop's ``square_avg``: ``d²``; SGD's ``momentum_buffer``
    (``b ← μ·b + (1 - dampening)·d``): ``(1 - dampening)·d / (1 - μ)``; Muon's (``b.lerp_(g, 1 - μ)``): ``g``;
    RMSprop's (``b ← μ·b + d / (sqrt(v) + eps)``, ``v`` its ``square_avg`` after this step, less ``grad_avg²`` where
    ``centered``): ``d / ((sqrt(v) + eps)·(1 - μ))``, from the states before the step (``state``: the parameter's,
    quantized or plain, flat or of the parameter's shape; a DTensor's local shard is read).
    """
    beta = state_decay(group, state_name)
    if beta is None or state_name in RUNNING_MAXIMA:
        return None
    direction = -grad if group.get("maximize") else grad
    coupled = group.get("weight_decay") and not group.get("decoupled_weight_decay") and "ns_steps" not in group
    direction = direction + group["weight_decay"] * param if coupled else direction
    if state_name == "momentum_buffer" and "dampening" in group:
        return direction * ((1 - group["dampening"]) / (1 - beta))
    if state_name == "momentum_buffer" and "centered" in group and "alpha" in group:
        return None if state is None else direction / (_rmsprop_denominator(group, direction, state) * (1 - beta))
    return direction.square() if moment_of(state_name) == "second" else direction


def _rmsprop_denominator(group: dict, direction: torch.Tensor, state: Mapping[str, Any]) -> torch.Tensor:
    """RMSprop's ``sqrt(v) + eps`` of this step from its states before it (``square_avg``, ``grad_avg``) and ``direction``."""

    def before(name: str) -> torch.Tensor:
        value = state[name]
        return (value.dequantize() if isinstance(value, QuantizedTensor) else local_tensor(value)).float().reshape(direction.shape)

    alpha = float(group["alpha"])
    square_avg = before("square_avg") * alpha + direction.square() * (1 - alpha)
    if group["centered"]:
        grad_avg = torch.lerp(before("grad_avg"), direction, 1 - alpha)
        square_avg = square_avg - grad_avg.square()
    return square_avg.sqrt() + float(group["eps"])


def as_format(fmt: str | StorageFormat | None, *, signed: bool) -> StorageFormat:
    """A format object: a name resolved with ``signed`` (a dynamic map's sign convention), ``None`` as fp32."""
    if fmt is None:
        fmt = "fp32"
    if isinstance(fmt, str):
        return get_format(fmt, signed=signed)
    if not isinstance(fmt, StorageFormat):
        raise TypeError(f"fmt must be a format name, a StorageFormat or None, got {type(fmt).__name__}")
    return fmt


def moment_format(fmt: str | StorageFormat | None, moment: Moment = "second") -> StorageFormat:
    """:func:`as_format` with the sign convention of ``moment`` (unsigned maps for the second moment)."""
    if moment not in MOMENTS:
        raise ValueError(f"moment={moment!r} is not valid; use one of {MOMENTS}")
    return as_format(fmt, signed=moment == "first")


def fraction_bits(fmt: StorageFormat) -> int | None:
    """Fraction (mantissa) bits ``p`` of a float format; ``None`` for codebook formats."""
    if isinstance(fmt, CastFormat):
        return _CAST_FRACTION_BITS[fmt.dtype]
    if isinstance(fmt, MinifloatFormat):
        return fmt.spec.mantissa_bits
    return None


def relative_gaps(
    fmt: StorageFormat, values: torch.Tensor | QuantizedTensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weights, gap_up, gap_down)`` float64 vectors: relative code gaps and how often each occurs (weights sum to 1).

    Float formats without ``values``: one entry, ``ε·ln2`` on both sides. Codebooks (and floats given
    ``values``): one entry per positive code, weighted by the log-uniform top-binade assumption or by the
    occupancy of ``values`` (magnitudes in units of the block absmax, or a stored state); a cast's subnormal
    ``values`` add one entry per occupied subnormal ``k·s`` (``s`` its spacing), ``1/k`` on both sides.
    """
    p = fraction_bits(fmt)
    if p is not None and values is None:
        gap = torch.tensor([2.0**-p * math.log(2.0)], dtype=torch.float64)
        return torch.ones(1, dtype=torch.float64), gap, gap.clone()
    codes, up, down = _code_steps(fmt)
    subnormal_steps = torch.zeros(0, dtype=torch.float64)
    if values is None:
        edges = torch.cat([codes[:1] * 0, (codes[1:] + codes[:-1]) / 2, codes[-1:]])
        lower, upper = edges[:-1].clamp(min=0.5), edges[1:].clamp(min=0.5)
        weights = torch.log(upper / lower)
    else:
        magnitude = _magnitudes(values)
        if isinstance(fmt, CastFormat):
            smallest_normal = torch.finfo(fmt.dtype).smallest_normal
            subnormal_steps = torch.round(magnitude[magnitude < smallest_normal] / fmt.smallest_positive)  # its spacing
            magnitude = magnitude[magnitude >= smallest_normal]
        weights = _occupancy(fmt, codes, magnitude)
    keep = weights > 0
    steps, counts = torch.unique(subnormal_steps, return_counts=True)
    if not keep.any() and not steps.numel():
        raise ValueError("values= has no positive value to take the code occupancy from (empty, or all zero); pass a state that has moved")
    weights = torch.cat([weights[keep], counts.to(torch.float64)])
    gap_up, gap_down = torch.cat([up[keep] / codes[keep], 1 / steps]), torch.cat([down[keep] / codes[keep], 1 / steps])
    return weights / weights.sum(), gap_up, gap_down


@functools.lru_cache(maxsize=256)
def _code_steps(fmt: StorageFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes, up, down)``: the format's sorted positive codes (``_positive_codes``) and the steps to the next code up
    and down from each (float64, not to be written: cached per format object, as a monitor asks for every layer's
    state at every measurement)."""
    codes = _positive_codes(fmt)
    up = torch.empty_like(codes)
    up[:-1] = codes[1:] - codes[:-1]
    down = torch.empty_like(codes)
    down[1:] = codes[1:] - codes[:-1]
    down[0] = codes[0] if isinstance(fmt, BlockFormat) else 2.0 ** -(fraction_bits(fmt) + 1)  # to zero; a cast: into the binade below
    up[-1] = down[-1]
    return codes, up, down


def _positive_codes(fmt: StorageFormat) -> torch.Tensor:
    """Sorted positive values of the format's codes, in units of the block absmax (float64)."""
    if isinstance(fmt, BlockFormat):
        values = fmt.decode_values().to(torch.float64)
    elif isinstance(fmt, CastFormat):  # one binade of the cast's grid: relative gaps repeat per binade
        p = _CAST_FRACTION_BITS[fmt.dtype]
        values = 1.0 + torch.arange(2**p + 1, dtype=torch.float64) / 2**p
    else:
        raise TypeError(f"no code gaps for format {fmt!r}")
    return torch.unique(values[values > 0])


def _magnitudes(values: torch.Tensor | QuantizedTensor) -> torch.Tensor:
    """The nonzero magnitudes of ``values`` (a stored state's unit values), float64 on the CPU; refuses inf and NaN."""
    if isinstance(values, QuantizedTensor):
        magnitude = values.unit_values().abs().to(torch.float64)
    else:
        magnitude = values.detach().reshape(-1).abs().to(torch.float64)
    if not bool(torch.isfinite(magnitude).all()):
        raise ValueError("values= holds inf or NaN; pass a stored state (or its values in units of their block's absmax), all finite")
    return magnitude[magnitude > 0].cpu()


def _occupancy(fmt: StorageFormat, codes: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """How many of the positive ``magnitude`` are stored at each of ``codes`` (nearest code)."""
    if isinstance(fmt, CastFormat):  # a float's position within its binade
        magnitude = magnitude / torch.pow(2.0, torch.floor(torch.log2(magnitude)))
    index = torch.bucketize(magnitude, (codes[1:] + codes[:-1]) / 2)
    return torch.bincount(index, minlength=codes.numel()).to(torch.float64)


# --- the noise distributions: CDF F and partial mean T(x) = E[X; X <= x] -------------------------------------
def _chi2_cdf(x: torch.Tensor) -> torch.Tensor:
    return torch.erf(torch.sqrt(x.clamp(min=0) / 2))


def _chi2_partial_mean(x: torch.Tensor) -> torch.Tensor:
    x = x.clamp(min=0)
    return _chi2_cdf(x) - torch.sqrt(2 * x / math.pi) * torch.exp(-x / 2)


def _empirical(ratios: torch.Tensor) -> tuple[Callable, Callable, torch.Tensor]:
    """The CDF and partial mean of the measured ``ratios`` (float64; ``inf`` counts in neither) and their finite values."""
    ordered = torch.sort(ratios.detach().reshape(-1).to(torch.float64).cpu()).values
    finite = ordered[torch.isfinite(ordered)]
    sums = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(finite, 0)])
    count = ordered.numel()

    def cdf(x: torch.Tensor) -> torch.Tensor:
        return torch.searchsorted(finite, x.contiguous(), right=True).to(torch.float64) / count

    def partial_mean(x: torch.Tensor) -> torch.Tensor:
        return sums[torch.searchsorted(finite, x.contiguous(), right=True)] / count

    return cdf, partial_mean, finite


def _half_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return torch.erf(x.clamp(min=0) / math.sqrt(2))


def _half_normal_partial_mean(x: torch.Tensor) -> torch.Tensor:
    return math.sqrt(2 / math.pi) * -torch.expm1(-x.clamp(min=0).square() / 2)


def _normal_cdf(x: torch.Tensor) -> torch.Tensor:
    return torch.special.ndtr(x)


def _normal_partial_mean(x: torch.Tensor) -> torch.Tensor:
    return -torch.exp(-x * x / 2) / math.sqrt(2 * math.pi)


def _window_stall(
    center: torch.Tensor, width_up: torch.Tensor, width_down: torch.Tensor, rounding: Rounding, cdf, partial_mean
) -> torch.Tensor:
    """Stall probability when the noise ``X`` (CDF ``cdf``) must land near ``center``: RN stalls for ``X`` in
    ``(center - width_down, center + width_up)``; SR stalls with probability ``1 - |X - center| / (2·width)``
    (``width`` on the side ``X`` falls)."""
    if rounding == "nearest":
        return cdf(center + width_up) - cdf(center - width_down)
    width_up, width_down = 2 * width_up, 2 * width_down
    lower, upper = center - width_down, center + width_up
    below = (1 - center / width_down) * (cdf(center) - cdf(lower)) + (partial_mean(center) - partial_mean(lower)) / width_down
    above = (1 + center / width_up) * (cdf(upper) - cdf(center)) - (partial_mean(upper) - partial_mean(center)) / width_up
    return below + above


def _half_normal_grid(spread: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Quadrature nodes ``t > 0`` and weights (summing to 1) of ``|N(0, spread²)|``."""
    grid = torch.linspace(0.0, _HALF_NORMAL_RANGE * spread, _HALF_NORMAL_POINTS, dtype=torch.float64)[1:]
    density = torch.exp(-0.5 * (grid / spread) ** 2)
    weights = density * (grid[1] - grid[0])
    return grid, weights / weights.sum()


def _check(
    beta: float, rounding: str, age: int | None, center: float | None = None, moment: str = "second", ratios: torch.Tensor | None = None
) -> tuple[float, int | None, float | None]:
    """Validate the arguments of a stall model; returns ``beta`` and ``center`` as floats and ``age`` as an int (numpy's
    numbers too)."""
    if ratios is not None:
        if age is not None or center is not None:
            raise ValueError("ratios= replaces age= and center= (the measured ratios set the state's age and spread): give one of them")
        if not isinstance(ratios, torch.Tensor) or ratios.numel() == 0 or bool(torch.isnan(ratios).any()):
            raise ValueError("ratios= must be a non-empty tensor of the moving entries' g²/v (or g/m) ratios, without NaN")
        if moment == "second" and bool((ratios < 0).any()):
            raise ValueError("ratios= of the second moment are g²/v: >= 0, inf where v is 0; a negative one is not such a ratio")
    if not finite_real(beta) or not 0.0 < beta < 1.0:
        raise ValueError(f"beta={beta!r} must be a number in (0, 1)")
    check_rounding(rounding)
    if age is not None:
        steps = whole_number(age)
        if steps is None or steps < 1:
            raise ValueError(f"age={age!r} must be None (steady state) or an integer >= 1 (steps since the state was zeroed)")
        age = steps
    if center is not None:
        if age is not None or moment != "second":
            raise ValueError("center= is the second moment's E[v]/E[g²]; it replaces age= (give one of them) and needs moment='second'")
        if not finite_real(center) or center <= 0:
            raise ValueError(f"center={center!r} must be a positive finite number (the state's mean over its gradients' mean square)")
    return float(beta), age, None if center is None else float(center)


def stall_probability(
    fmt: str | StorageFormat | None,
    beta: float,
    rounding: Rounding = "nearest",
    age: int | None = None,
    *,
    moment: Moment = "second",
    values: torch.Tensor | QuantizedTensor | None = None,
    block_drift: bool = True,
    center: float | None = None,
    ratios: torch.Tensor | None = None,
) -> float:
    """Probability that one entry of an EMA state stored in ``fmt`` stalls on one step.

    Args:
        fmt: a format name (``"bf16"``, ``"fp8_e4m3"``, ``"e2m2"``, ``"int8"``...), a format, or ``None`` (fp32).
        beta: the EMA decay (``β2`` for ``exp_avg_sq``, ``β1`` for ``exp_avg``, the momentum for SGD).
        rounding: ``"nearest"`` or ``"stochastic"``.
        age: steps since the state was zeroed (initialisation or a reset); ``None`` for the steady state.
        moment: ``"second"`` (the paper's model, squared gradients) or ``"first"`` (zero-mean gradients).
        values: optional stored state (or values in units of their block absmax) whose code occupancy
            weights the gaps, instead of the module's assumption.
        block_drift: for block-scaled formats and the second moment, account for the block's scale moving
            every step (see the module docstring); ``False`` gives the paper's closed forms for every format.
        center: second moment only, instead of ``age``: the measured ``a = E[v] / E[g²]`` (the state's mean over
            the mean square of the gradients it is fed, e.g. over one layer at one step). Under a stationary
            gradient it is ``1 - β^age``; where the gradients shrink or grow (early training, schedules) the state
            lags them and only the measured ratio gives the rate.
        ratios: instead of ``age``/``center``: the measured ratios of the moving entries' inputs to their states on
            one step, ``g²/v`` (second moment) or ``g/m`` (first), ``inf`` where the state is zero; their distribution
            replaces the noise model (see the module docstring; ``StallMonitor`` logs this prediction).

    Returns:
        The probability in ``[0, 1]``; e.g. bf16 at ``β = 0.999``: 0.946 (RN), 0.825 (SR).
    """
    beta, age, center = _check(beta, rounding, age, center, moment, ratios)
    check_flags(None, block_drift=block_drift)
    return _stall_probability(moment_format(fmt, moment), beta, rounding, age, moment, values, block_drift, center, ratios)


def _stall_probability(
    fmt: StorageFormat,
    beta: float,
    rounding: Rounding,
    age: float | None,
    moment: Moment,
    values: torch.Tensor | QuantizedTensor | None,
    block_drift: bool,
    center: float | None = None,
    ratios: torch.Tensor | None = None,
) -> float:
    """:func:`stall_probability` for a resolved format and a real-valued ``age`` (or a measured second-moment ``center``,
    or measured ``ratios``)."""
    weights, gap_up, gap_down = relative_gaps(fmt, values)
    rho_up, rho_down = gap_up / (2 * (1 - beta)), gap_down / (2 * (1 - beta))
    drift = block_drift and isinstance(fmt, BlockFormat)
    share, finite = 1.0, None  # share: of the entries that the window model covers (the others: written from zero)
    if ratios is not None or moment == "second":  # the window around the state's centre, by the noise's CDF
        if ratios is not None:  # r under its measured distribution: the window |r - 1| < ρ
            cdf, partial_mean, finite = _empirical(ratios)
            share, center = finite.numel() / ratios.numel(), 1.0
        else:
            cdf, partial_mean = _chi2_cdf, _chi2_partial_mean
            if center is None:
                center = 1.0 if age is None else -math.expm1(age * math.log(beta))
        center = torch.tensor(center, dtype=torch.float64)
        if drift and moment == "second":  # the largest entry's own draw z' moves the scale, and the window follows it
            draws, draw_weights = _scale_draws(finite)
            per_gap = torch.zeros_like(rho_up)
            for window_center, center_weights in _drifted_centers(fmt, draws, center, beta):
                stalls = _window_stall(window_center[:, None], center * rho_up, center * rho_down, rounding, cdf, partial_mean)
                per_gap = per_gap + (stalls * (draw_weights * center_weights)[:, None]).sum(dim=0)
        else:
            per_gap = _window_stall(center, center * rho_up, center * rho_down, rounding, cdf, partial_mean)
    else:
        decay = 1.0 if age is None else -math.expm1(2 * age * math.log(beta))
        spread = math.sqrt((1 - beta) * decay / (1 + beta))
        m, m_weights = _half_normal_grid(spread)
        stalls = _window_stall(m[:, None], m[:, None] * rho_up, m[:, None] * rho_down, rounding, _normal_cdf, _normal_partial_mean)
        per_gap = (stalls * m_weights[:, None]).sum(dim=0)
    probability = (weights * per_gap).sum()  # already weighted by ``share``
    if drift and fmt.scale_dtype == torch.float32:
        probability = probability * (1 - 1 / fmt.block_size)  # a block's largest entry is its scale, stored exactly
    elif drift and moment == "second":  # a bf16 scale: the slow largest entry stays on the top code as it moves
        probability = probability * (1 - 1 / fmt.block_size) + share / fmt.block_size
    if share < 1:
        probability = probability + (1 - share) * _fresh_stall(fmt, moment, rounding)
    return float(probability.clamp(0.0, 1.0))


def _scale_draws(finite: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's largest entry's draws ``z'`` and their weights: ``t²``, ``t ~ |N(0, 1)|`` by quadrature, or
    ``_RATIO_QUANTILES`` quantiles of the measured finite ratios ``finite`` (none where it is empty)."""
    if finite is None:
        t, weights = _half_normal_grid(1.0)
        return t * t, weights
    index = ((torch.arange(_RATIO_QUANTILES) + 0.5) * finite.numel() / _RATIO_QUANTILES).long()
    draws = finite[index] if finite.numel() else finite
    return draws, torch.full_like(draws, 1 / _RATIO_QUANTILES)


def _fresh_stall(fmt: StorageFormat, moment: Moment, rounding: Rounding) -> float:
    """Stall probability of an entry written from zero (``r = ∞``): it stalls where its code stays the one of zero.

    Casts never do (underflow aside). Block formats: the block holds ``B`` fresh i.i.d. entries (``|N(0, 1)|`` for the
    first moment, ``χ²₁`` for the second), and an entry keeps the code of zero, ``k₀`` (0, or the smallest code of a
    codebook without one, such as int4's ``v``), when it is written there: under RN below the midpoint to the next
    code ``k₁``, under SR with probability 1 below ``k₀`` and ``(k₁ - u)/(k₁ - k₀)`` between (``u``: in units of the
    block's absmax ``M``, which is then the maximum of the ``B - 1`` others: over its quantiles).
    """
    if not isinstance(fmt, BlockFormat):
        return 0.0
    codes = torch.unique(fmt.decode_values().to(torch.float64).abs())  # sorted; codes[0] is what zero is written as
    others = ((torch.arange(_FRESH_QUANTILES, dtype=torch.float64) + 0.5) / _FRESH_QUANTILES) ** (1 / (fmt.block_size - 1))
    if moment == "second":
        cdf, partial_mean, maxima = _chi2_cdf, _chi2_partial_mean, 2 * torch.special.erfinv(others).square()
    else:
        cdf, partial_mean, maxima = _half_normal_cdf, _half_normal_partial_mean, math.sqrt(2) * torch.special.erfinv(others)
    lower, upper = float(codes[0]) * maxima, float(codes[1]) * maxima
    if rounding == "nearest":
        kept = cdf((lower + upper) / 2)
    else:
        kept = cdf(lower) + (upper * (cdf(upper) - cdf(lower)) - (partial_mean(upper) - partial_mean(lower))) / (upper - lower)
    return float(kept.mean())  # below a fraction of the others' maximum: never the largest entry itself


def _drifted_centers(fmt: BlockFormat, draws: torch.Tensor, center: torch.Tensor, beta: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Where the stall window of the second moment centres, given the largest entry's draws ``z'`` (``draws``).

    The largest entry moves by ``d = (1 - β)(z'/c - 1)`` (``c``: ``center``, the state's mean in units of the
    gradient's variance). An fp32 scale follows it exactly: the window centres at ``z'``. A bf16 scale is the
    absmax rounded up to a grid of relative step ``w = 2^-7 / mantissa``: with the absmax uniformly placed in
    its grid cell, the scale moves by ``d`` rounded stochastically to a multiple ``k·w``, and the window
    centres at ``c·(1 + k·w / (1 - β))``. The scale's mantissa is taken log-uniform over ``[1, 2)`` (eight
    nodes). Returns ``(centres, weights)`` pairs; over all pairs the weights sum to 1 for each draw.
    """
    if fmt.scale_dtype != torch.bfloat16:
        return [(draws, torch.ones_like(draws))]
    change = (1 - beta) * (draws / center - 1)
    pairs = []
    for mantissa in 2.0 ** ((torch.arange(_SCALE_MANTISSAS, dtype=torch.float64) + 0.5) / _SCALE_MANTISSAS):
        step = 2.0**-7 / float(mantissa)
        low = torch.floor(change / step)
        up = change / step - low  # the probability of rounding up to the next multiple
        for jumps, probability in ((low, 1 - up), (low + 1, up)):
            pairs.append((center * (1 + jumps * step / (1 - beta)), probability / _SCALE_MANTISSAS))
    return pairs


# --- reset periods ------------------------------------------------------------------------------------------
# Calibration of reset_period (see its docstring): the geometric mean of these many EMA horizons 1/(1-β)
# and the half-staleness age gives the paper's periods at β2 = 0.999.
RESET_HORIZONS = 8.4
# A format whose steady-state stall probability stays below this gets no resets (fp32, fp16 at β2 = 0.999).
MIN_STALL_FOR_RESETS = 0.5
_ROUND_SERIES = (1.0, 2.0, 3.0, 5.0)  # the paper's periods are 1-2-3-5 round numbers


def half_staleness_age(fmt: str | StorageFormat | None, beta: float, *, moment: Moment = "second") -> float:
    """Steps after a reset at which the round-to-nearest stall probability reaches half its steady state (real-valued).

    bf16 at ``β = 0.999``: 114 steps; FP8 E4M3: 10.3; E2M2: 5.2.
    """
    beta, _, _ = _check(beta, "nearest", None)
    fmt = moment_format(fmt, moment)
    target = 0.5 * _stall_probability(fmt, beta, "nearest", None, moment, None, False)
    low, high = 0.0, 1.0
    while _stall_probability(fmt, beta, "nearest", high, moment, None, False) < target:
        low, high = high, 2 * high
    for _ in range(60):  # bisection on the age; P(age) increases with age
        middle = (low + high) / 2
        low, high = (middle, high) if _stall_probability(fmt, beta, "nearest", middle, moment, None, False) < target else (low, middle)
    return high


def reset_period(
    fmt: str | StorageFormat | None,
    beta2: float,
    rounding: Rounding = "nearest",
    *,
    moment: Moment = "second",
    horizons: float = RESET_HORIZONS,
    min_stall: float = MIN_STALL_FOR_RESETS,
    round_period: bool = True,
) -> int | None:
    """Steps between resets of a state stored in ``fmt`` with EMA decay ``beta2``; ``None``: resets do not pay.

    **Rule** (the paper's rule could not be recovered; this one is ours, calibrated). Let ``k½`` be the
    half-staleness age (:func:`half_staleness_age`: how fast stalling builds up after a reset; it shrinks as
    the format's gaps grow) and ``H = 1/(1 - β2)`` the EMA horizon. The period is the geometric mean
    ``sqrt(k½ · horizons · H)``, rounded to the nearest 1-2-3-5 round number (``round_period``). With
    ``horizons = 8.4`` (the log-mean of the three calibration points) it gives the paper's periods at
    ``β2 = 0.999``: bf16 1000, FP8 E4M3 300, E2M2 (FP4) 200; before rounding 980, 295, 210. Formats whose
    steady-state stall probability under ``rounding`` is below ``min_stall`` get ``None`` (no resets): fp32,
    and fp16 at ``β2 = 0.999`` (0.17).

    Args:
        fmt: a format name, a format, or ``None`` (fp32).
        beta2: the state's EMA decay.
        rounding: the state's rounding; it decides only whether resets pay (``min_stall``).
        moment: ``"second"`` (``exp_avg_sq``) or ``"first"`` (``exp_avg``, momentum).
    """
    beta2, _, _ = _check(beta2, rounding, None)
    if not finite_real(horizons) or horizons <= 0:
        raise ValueError(f"horizons={horizons!r} must be a finite number > 0 (EMA horizons 1/(1 - beta2) in a period's rule)")
    if not finite_real(min_stall) or not 0.0 <= min_stall <= 1.0:
        raise ValueError(f"min_stall={min_stall!r} must be a number in [0, 1] (the stall probability below which resets do not pay)")
    check_flags(None, round_period=round_period)
    if stall_probability(fmt, beta2, rounding, moment=moment) < min_stall:
        return None
    period = math.sqrt(half_staleness_age(fmt, beta2, moment=moment) * horizons / (1 - beta2))
    if not round_period:
        return max(1, math.ceil(period))
    decade = 10 ** math.floor(math.log10(period))
    candidates = [step * decade * scale for scale in (1, 10) for step in _ROUND_SERIES]
    return max(1, int(min(candidates, key=lambda candidate: abs(math.log(candidate / period)))))  # under 1: 0.5 is no period
