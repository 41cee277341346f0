"""How many mantissa bits each component of a training run needs, and an advisor that checks a planned run (no Lightning).

**The T-scaling rule** (arXiv 2510.21314; ``docs/algorithms.md``, "Precision advisor"). A component stored with ``M`` mantissa
bits carries a relative error ``q = Θ(2^-M)``. Adam keeps its full-precision rate over ``T`` steps when
``q = O(1/T)`` for the gradients and ``m`` and ``O(1/T²)`` for the weights and ``v``; Muon when ``q = O(T^-1/2)``
for all. In bits: ``M ≳ slope·log2(T) + c`` with slopes 1 (Adam grads/``m``), 2 (Adam weights/``v``) and ½ (Muon).
The paper's theorem constants are unknown, so ``c`` (:data:`DEFAULT_CONSTANTS`) is calibrated on experiments
(``benchmarks/mantissa_sweep.py``: an MLP on sklearn's digits at ``T = 1000``). That sweep did not find the law's slopes
at its scale (0 to 1.2 bits per doubling of ``T`` instead of 1 and 2): the rule is accurate near ``T = 1000`` and
conservative (it asks for more bits) for much longer runs.

**SGD with momentum** (reconstructed; the paper covers Adam and Muon only): Muon's slopes, ½ for every component.
SGD's update is linear in its momentum, with none of the ``1/sqrt(v)`` amplification that gives Adam's ``v`` its
slope 2, so a relative error ``q`` in ``g`` or the momentum perturbs the descent direction by ``O(q)``, as it does
Muon's orthogonalized update; both take steps ``η = Θ(1/√T)``, so the weights' error budget is Muon's too.

**Effective mantissa bits of block-scaled codebooks** (``int8``, ``int4``, ``*_linear``; ours). A float with ``p``
fraction bits has, in the stall model's convention (:func:`~lightning_qstate.theory.relative_gaps`), the mean
relative code gap ``2^-p·ln 2``. A codebook gets ``M = log2(ln 2 / mean relative gap)``, the mean taken over both
sides of each positive code of the top binade of a block, weighted log-uniformly, so that a float comes out exactly
``p``. Format names resolve signed (as gradients, weights and ``m`` are stored) unless ``signed=False`` (``v``):

=============  ======  ========
format         signed  unsigned
=============  ======  ========
int8           5.10    6.10
int4           1.20    2.94
int8_linear    5.93    6.94
int4_linear    1.76    2.85
=============  ======  ========

Casts and minifloats: fp32 23, fp16 10, bf16 7, fp8_e4m3 3, fp8_e5m2 2, ``eXmY`` ``Y`` (block-scaled or not).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..arguments import finite_real, short_list, whole_number
from ..formats import ROUNDINGS, BlockFormat, CastFormat, StorageFormat, check_rounding, get_format
from ..optim import QuantizedOptimizerWrapper, QuantizedStates
from ..optim.base import local_tensor
from .stall import as_format, fraction_bits, moment_of, relative_gaps, reset_period, stall_probability, state_decay

COMPONENTS: tuple[str, ...] = ("grads", "weights", "exp_avg", "exp_avg_sq")  # Muon's and SGD's momentum is "exp_avg"
OPTIMIZERS: tuple[str, ...] = ("adam", "muon", "sgd")
Verdict = Literal["ok", "marginal", "insufficient"]
VERDICTS: tuple[str, ...] = ("ok", "marginal", "insufficient")  # in order of severity

# Slope of the needed mantissa bits in log2(T), per (optimizer, component); Muon and SGD have no second moment.
SLOPES: dict[tuple[str, str], float] = {
    ("adam", "grads"): 1.0, ("adam", "exp_avg"): 1.0, ("adam", "weights"): 2.0, ("adam", "exp_avg_sq"): 2.0,
    ("muon", "grads"): 0.5, ("muon", "exp_avg"): 0.5, ("muon", "weights"): 0.5,
    ("sgd", "grads"): 0.5, ("sgd", "exp_avg"): 0.5, ("sgd", "weights"): 0.5,
}  # fmt: skip

# The constants c of M = slope·log2(T) + c, per (optimizer, component, rounding), calibrated by
# benchmarks/mantissa_sweep.py (benchmarks/results/mantissa_sweep.md): the smallest M within tolerance of fp32 for an
# MLP on sklearn's digits at T = 1000 (the paper's regime: η ∝ 1/sqrt(T), 1 - β2 = 10/T; 3 seeds), minus slope·log2(1000).
# "≤": the threshold was the lowest M swept (1), so c is an upper bound. SGD: Muon's (not swept; slopes reconstructed).
# What the sweep found about the law itself: the measured growth in log2 T was 0 to 1.2 bits per doubling, not the law's
# 1 and 2 (Adam's weights ~0.3, RN v 1.2), so the rule predicts within ±1 bit near T = 1000 and over-predicts far
# beyond it; the numbers for long runs are conservative (the paper's theorem is a sufficient condition).
_MUON_CONSTANTS = {"grads": (-3.98, -3.98), "exp_avg": (-1.98, -3.98), "weights": (1.02, -0.98)}  # (nearest, stochastic)
DEFAULT_CONSTANTS: dict[tuple[str, str, str], float] = {
    ("adam", "grads", "nearest"): -8.97, ("adam", "grads", "stochastic"): -8.97,  # both ≤
    ("adam", "weights", "nearest"): -9.93, ("adam", "weights", "stochastic"): -14.93,
    ("adam", "exp_avg", "nearest"): -7.97, ("adam", "exp_avg", "stochastic"): -8.97,  # SR ≤
    ("adam", "exp_avg_sq", "nearest"): -13.93, ("adam", "exp_avg_sq", "stochastic"): -18.93,  # SR ≤
    **{
        (optimizer, component, rounding): constant
        for optimizer in ("muon", "sgd")
        for component, pair in _MUON_CONSTANTS.items()
        for rounding, constant in zip(("nearest", "stochastic"), pair, strict=True)
    },  # Muon: grads ≤ (both), exp_avg SR ≤
}  # fmt: skip

FP32_BITS = 23.0
_DTYPE_BITS = {
    torch.float64: 52, torch.float32: 23, torch.float16: 10, torch.bfloat16: 7,
    torch.float8_e4m3fn: 3, torch.float8_e4m3fnuz: 3, torch.float8_e5m2: 2, torch.float8_e5m2fnuz: 2,
}  # fmt: skip
_DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
# Formats suggested for a component that needs more bits, coarsest first.
_SUGGESTIONS = (("fp8_e4m3", 3.0), ("bf16", 7.0), ("fp16", 10.0), ("fp32", 23.0))
_PAPER = "(arXiv 2510.21314)"
_STALL_PAPER = "(arXiv 2603.16731, section 1)"
_LR_SOURCE = "(FlashOptim's check, package flashoptim)"
_ECO = "(ECO, arXiv 2601.22101)"


def mantissa_bits(fmt: str | StorageFormat | torch.dtype | None, *, signed: bool = True) -> float:
    """Mantissa (fraction) bits ``M`` of a storage format or dtype; effective ``M`` for codebooks (module docstring).

    Args:
        fmt: a format name (``"bf16"``, ``"fp8_e4m3"``, ``"e2m2"``, ``"int8"``...), a format, a floating torch dtype,
            or ``None`` (fp32: 23).
        signed: the sign convention a name resolves with: ``True`` (gradients, weights, ``m``) or ``False`` (``v``:
            the unsigned maps, which differ for ``int8`` and ``int4``).

    Raises:
        ValueError: an unknown format name or a dtype that is not floating. TypeError: anything else.
    """
    if fmt is None:
        return FP32_BITS
    if isinstance(fmt, torch.dtype):
        if fmt not in _DTYPE_BITS:
            raise ValueError(f"no mantissa bits for dtype {fmt}; valid dtypes: {', '.join(str(d) for d in _DTYPE_BITS)}")
        return float(_DTYPE_BITS[fmt])
    try:
        fmt = as_format(fmt, signed=signed)
    except TypeError:
        raise TypeError(f"fmt must be a format name, a StorageFormat, a torch dtype or None, got {type(fmt).__name__}") from None
    bits = fraction_bits(fmt)
    if bits is not None:
        return float(bits)
    weights, gap_up, gap_down = relative_gaps(fmt)
    return math.log2(math.log(2.0) / float((weights * (gap_up + gap_down) / 2).sum()))


def required_mantissa_bits(
    component: str, steps: int, optimizer: str = "adam", rounding: str = "nearest", constant: float | None = None
) -> float:
    """Mantissa bits ``component`` needs over a run of ``steps`` steps: ``max(0, slope·log2(steps) + constant)``.

    Args:
        component: one of :data:`COMPONENTS` (``"exp_avg"`` is Muon's and SGD's momentum; they have no ``"exp_avg_sq"``).
        steps: the run's length ``T`` (optimizer steps), ``>= 1``.
        optimizer: ``"adam"`` (Adam, AdamW), ``"muon"`` or ``"sgd"`` (with momentum; its slopes are reconstructed).
        rounding: ``"nearest"`` or ``"stochastic"``: how the component is written.
        constant: ``c``; default :data:`DEFAULT_CONSTANTS` ``[(optimizer, component, rounding)]``.

    Example: Adam's ``v`` written RN needs ``2·log2(2048) - 13.93 ≈ 8.1`` bits over 2048 steps, 10.1 over 4096.
    """
    if component not in COMPONENTS:
        raise ValueError(f"component={component!r} is not valid; use one of {COMPONENTS}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not valid; use one of {OPTIMIZERS}")
    check_rounding(rounding)
    steps = _run_length(steps)
    if (optimizer, component) not in SLOPES:
        valid = tuple(c for o, c in SLOPES if o == optimizer)
        raise ValueError(f"{optimizer} has no second moment: component={component!r} is not valid for it; use one of {valid}")
    if constant is None:
        constant = DEFAULT_CONSTANTS[optimizer, component, rounding]
    elif not finite_real(constant):
        raise ValueError(f"constant={constant!r} must be a finite real number (the c of slope·log2(steps) + c), or None for the default")
    return max(0.0, SLOPES[optimizer, component] * math.log2(steps) + float(constant))


def _run_length(steps: object) -> int:
    """``steps`` as a Python int >= 1: any integer (``int``, numpy's, a 0-d integer tensor), not a bool."""
    value = whole_number(steps)
    if value is None or value < 1:
        raise ValueError(f"steps={steps!r} must be an integer >= 1 (the run's optimizer steps)")
    return value


@dataclass(frozen=True)
class AdviceRow:
    """One component of one param group: its storage, the bits it has and needs, and the verdict.

    ``margin = mantissa_bits - required_bits``; ``reasons`` each end with their source.
    """

    group: int
    component: str
    format: str
    mantissa_bits: float
    required_bits: float
    margin: float
    verdict: Verdict
    reasons: tuple[str, ...] = ()
    rounding: str = "nearest"


@dataclass
class PrecisionReport:
    """:func:`advise`'s answer: one :class:`AdviceRow` per param group and component. ``str()`` is a text table."""

    steps: int
    rows: list[AdviceRow] = field(default_factory=list)
    optimizer: str = "adam"

    @property
    def risky(self) -> list[AdviceRow]:
        """The rows whose verdict is not ``"ok"``."""
        return [row for row in self.rows if row.verdict != "ok"]

    def _table(self) -> tuple[list[str], list[list[str]], list[str]]:
        header = ["group", "component", "format", "M", "needed", "margin", "verdict", "notes"]
        cells, notes = [], []
        for row in self.rows:
            numbers = []
            for reason in row.reasons:
                notes.append(f"group {row.group} {row.component}: {reason}")
                numbers.append(str(len(notes)))
            storage = row.format if row.mantissa_bits >= FP32_BITS else f"{row.format} {'SR' if row.rounding == 'stochastic' else 'RN'}"
            cells.append(
                [str(row.group), row.component, storage, f"{row.mantissa_bits:.1f}", f"{row.required_bits:.1f}", f"{row.margin:+.1f}"]
                + [row.verdict, ",".join(numbers)]
            )
        return header, cells, notes

    def _title(self) -> str:
        risky = len(self.risky)
        summary = f"{risky} component(s) at risk" if risky else "every component ok"
        return f"Precision advice ({self.optimizer}, T = {self.steps} steps; M: mantissa bits, RN/SR: rounding): {summary}"

    def __str__(self) -> str:
        header, cells, notes = self._table()
        widths = [max(len(line[i]) for line in [header, *cells]) for i in range(len(header))]
        lines = [self._title(), *("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip() for line in [header, *cells])]
        return "\n".join(lines + [f"[{i}] {note}" for i, note in enumerate(notes, 1)])

    def to_markdown(self) -> str:
        """The same table and numbered notes as markdown (for TensorBoard text)."""
        header, cells, notes = self._table()
        lines = [f"**{self._title()}**", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(line) + " |" for line in cells]
        return "\n".join(lines + [""] + [f"{i}. {note}" for i, note in enumerate(notes, 1)])


@dataclass(frozen=True)
class _Storage:
    """How one component of one parameter is stored: ``fmt`` is ``None`` for dtypes without a format (fp64, fp8 dtypes)."""

    name: str
    bits: float
    rounding: str
    fmt: StorageFormat | None = None


def check_constants(constants: Mapping[tuple[str, str, str], float] | None, owner: str) -> dict[tuple[str, str, str], float] | None:
    """``constants`` (``{(optimizer, component, rounding): c}`` replacing entries of :data:`DEFAULT_CONSTANTS`) as a dict of
    floats, every key one of those entries and every value a finite real number (numpy's too); errors start with
    ``owner`` and name the key."""
    if constants is None:
        return None
    if not isinstance(constants, Mapping):
        raise ValueError(f"{owner}: constants={constants!r} must be a dict {{(optimizer, component, rounding): c}}, or None")
    checked = {}
    for key, value in constants.items():
        if key not in DEFAULT_CONSTANTS:
            raise ValueError(
                f"{owner}: constants key {key!r} is not valid; use (optimizer, component, rounding) with optimizer in "
                f"{OPTIMIZERS}, component in {COMPONENTS} (no 'exp_avg_sq' for muon and sgd) and rounding in {ROUNDINGS}"
            )
        if not finite_real(value):
            raise ValueError(f"{owner}: constants[{key!r}]={value!r} must be a finite number (bits)")
        checked[key] = float(value)
    return checked


def advise(
    optimizer: torch.optim.Optimizer,
    steps: int,
    *,
    grads: str | torch.dtype | None = None,
    names: Mapping[torch.Tensor, str] | None = None,
    constants: Mapping[tuple[str, str, str], float] | None = None,
) -> PrecisionReport:
    """Check every param group and component of ``optimizer`` for a run of ``steps`` steps.

    Args:
        optimizer: ``torch.optim.Adam``/``AdamW``/``NAdam``/``RAdam`` (``"adam"``), ``SGD`` (``"sgd"``), ``Muon``
            (``"muon"``), their quantized forms (``QAdam``... or ``quantize_optimizer``'s), or a
            ``QuantizedOptimizerWrapper`` around one of them. Plain states are stored in the parameter's dtype
            (fp32 under a weight grid), quantized ones in the optimizer's policy format (or their current one).
        steps: the run's length ``T`` in optimizer steps.
        grads: the gradient format (a name or dtype, written RN: a cast); ``None``: the group's ``grads`` option (with
            the group's ``rounding``), else the parameter's dtype.
        names: ``{parameter: name}`` for the notes; default the optimizer's names (``param_names``) or ``param{i}``.
        constants: ``{(optimizer, component, rounding): c}`` overriding entries of :data:`DEFAULT_CONSTANTS`.

    Checks, per group and component (the coarsest storage among the group's parameters, noted when they differ):

    - the T-scaling rule: ``margin = M - needed``; ``ok`` (``margin >= 0``), ``marginal`` (``-1 <= margin < 0``, within
      the rule's accuracy) or ``insufficient``; fp32 is the reference the rule is calibrated on, always ``ok``;
    - Adam: ``v`` or the weights stored with fewer mantissa bits than ``m`` (at least ``marginal``);
    - the stall ratchet of Adam's ``v`` written RN: its largest downward step, ``(1 - β2)·v`` (its input ``g²`` is
      never negative), under half the gap to the code below, everywhere (floats: ``1 - β2 < 2^-(p+2)``, e.g. bf16
      ``β2 > 1 - 2^-9``; codebooks: their smallest downward gap below the top code). A cast can then never decrease:
      ``insufficient``. (A first moment's step ``(1 - β1)(g - m)`` grows with a gradient of the other sign: no
      ratchet; its stalls are the T-rule's and ``StallMonitor``'s.) A block-scaled
      entry still follows its block's scale down (the block's largest entry, stored exactly): ``marginal`` with an
      fp32 scale, ``insufficient`` with a bf16 scale that ratchets itself. Remedies: stochastic rounding, or resets
      every :func:`~lightning_qstate.theory.reset_period` steps. fp16's normals pass, but below ``2^-14`` its grid is
      subnormal (a fixed spacing ``2^-24``): a ``v`` under ``2^-25 / (1 - β2)`` never decreases (``marginal``: the
      gradients' scale decides; under ~5e-3 at ``β2 = 0.999``, most models');
    - weights written RN (no ``error_feedback``) too coarse for the learning rate: the smallest change to a weight
      of magnitude ``max|W|`` is about ``2^(floor(log2 max|W|) - M - 1)``; Adam's largest update is about ``lr``
      (``|m̂|/sqrt(v̂) <= 1`` for steady gradients; a spike can reach ``(1-β1)/sqrt(1-β2)`` times it, ignored),
      Muon's typical one ``lr'/sqrt(max(A, B))`` (the RMS entry of an orthogonal ``A×B`` update, ``lr'`` torch's
      adjusted lr). ``insufficient`` when the update is below it for some parameter (``max|W|`` of the local
      tensor). ``lr`` is the group's largest of its current lr, the ``initial_lr`` a torch scheduler keeps (a
      warm-up from 0 starts below it) and ``OneCycleLR``'s ``max_lr`` (CyclicLR keeps its peak on the scheduler, not
      the group: not seen); a group at lr 0 is frozen: not checked. SGD's update scales with the
      gradient, unknown here: not checked.

    Raises:
        TypeError: an optimizer of another kind (the message names the supported ones).
        ValueError: ``steps`` below 1, an unknown key in ``constants``, or an unknown ``grads`` format.
    """
    kind = _optimizer_kind(optimizer)
    steps = _run_length(steps)
    table = {**DEFAULT_CONSTANTS, **(check_constants(constants, "advise") or {})}
    if grads is not None:
        try:
            mantissa_bits(grads)
        except (TypeError, ValueError) as error:
            raise type(error)(f"advise: grads={grads!r}: {error}") from None
    names = dict(names) if names is not None else _default_names(optimizer)
    report = PrecisionReport(steps=steps, optimizer=kind)
    for index, group in enumerate(optimizer.param_groups):
        params = list(group["params"])
        if not params:
            continue
        storages = {component: [_storage(optimizer, group, param, component, kind, grads) for param in params] for component in COMPONENTS}
        storages = {component: found for component, found in storages.items() if all(s is not None for s in found)}
        coarsest = {component: min(found, key=lambda s: s.bits) for component, found in storages.items()}
        for component, found in storages.items():
            report.rows.append(_advise_component(index, group, params, component, found, coarsest, kind, steps, table, names))
    return report


def _advise_component(
    index: int,
    group: dict,
    params: list[torch.Tensor],
    component: str,
    found: list[_Storage],
    coarsest: dict[str, _Storage],
    kind: str,
    steps: int,
    table: Mapping[tuple[str, str, str], float],
    names: Mapping[torch.Tensor, str],
) -> AdviceRow:
    """The row of one component of one group: the T-rule, then each other check that applies, the worst verdict."""
    storage = coarsest[component]
    needed = required_mantissa_bits(component, steps, kind, storage.rounding, table[kind, component, storage.rounding])
    margin = storage.bits - needed
    findings: list[tuple[str, str]] = []  # (verdict, reason)
    kinds = sorted({s.name for s in found})
    if len(kinds) > 1:
        counts = ", ".join(f"{name} ×{sum(s.name == name for s in found)}" for name in kinds)
        note = f"its parameters differ ({counts}; min_quant_size or overrides): the coarsest is reported (QuantizationPolicy)"
        findings.append(("ok", note))
    slope = SLOPES[kind, component]
    constant = table[kind, component, storage.rounding]
    rule = f"{slope:g}·log2(T) {'-' if constant < 0 else '+'} {abs(constant):g}"
    if storage.bits >= FP32_BITS:
        if needed > storage.bits:
            findings.append(("ok", f"the rule asks for {needed:.1f} bits, beyond fp32, the reference it is calibrated on {_PAPER}"))
    elif margin < 0:
        remedy = f"store it with at least {math.ceil(needed)} mantissa bits ({_suggestion(needed)})"
        if storage.rounding == "nearest":
            with_sr = required_mantissa_bits(component, steps, kind, "stochastic", table[kind, component, "stochastic"])
            remedy += f", or write it with stochastic rounding (needs {with_sr:.1f})" if with_sr < needed else ""
        verdict = "marginal" if margin >= -1 else "insufficient"
        findings.append((verdict, f"M = {storage.bits:.1f} < {rule} = {needed:.1f} needed over {steps} steps: {remedy} {_PAPER}"))
    if kind == "adam" and component in ("exp_avg_sq", "weights") and "exp_avg" in coarsest:
        first = coarsest["exp_avg"]
        if storage.bits < first.bits:
            what = "v" if component == "exp_avg_sq" else "the weights"
            note = (
                f"{what} ({storage.name}, M = {storage.bits:.1f}) get fewer mantissa bits than m ({first.name}, M = {first.bits:.1f}); "
                f"Adam needs about twice as many for {what} (2·log2 T vs log2 T): give {what} at least m's {_PAPER}"
            )
            findings.append(("marginal", note))
    if component == "exp_avg_sq":
        findings += _ratchet_findings(group, storage)
    if component == "weights":
        findings += _learning_rate_findings(group, params, found, kind, names)
    verdict = max((v for v, _ in findings), key=VERDICTS.index, default="ok")
    reasons = tuple(reason for _, reason in findings)
    return AdviceRow(index, component, storage.name, storage.bits, needed, margin, verdict, reasons, storage.rounding)


def _ratchet_findings(group: dict, storage: _Storage) -> list[tuple[str, str]]:
    """The stall ratchet of Adam's ``v`` written RN (see :func:`advise`), with its remedies."""
    state_name = "exp_avg_sq"
    beta = state_decay(group, state_name)
    fmt = storage.fmt
    if storage.rounding != "nearest" or fmt is None or beta is None or not 0.0 < beta < 1.0 or storage.bits >= FP32_BITS:
        return []
    subnormal = _fp16_subnormal_findings(beta) if isinstance(fmt, CastFormat) and fmt.dtype == torch.float16 else []
    block = isinstance(fmt, BlockFormat)
    bits = fraction_bits(fmt)
    if bits is not None:
        half_gap = 2.0 ** -(bits + 2)  # half the smallest relative gap below a value: 2^-(p+1) at a mantissa of 1 or near 2
    else:
        _, _, gap_down = relative_gaps(fmt)
        half_gap = float(gap_down[:-1].min()) / 2 if block else float(gap_down.min()) / 2  # a block's top code is its scale
    if 1.0 - beta >= half_gap:
        return subnormal
    moment = moment_of(state_name)
    scale_ratchets = block and fmt.scale_dtype == torch.bfloat16 and 1.0 - beta < 2.0**-9
    if not block:
        verdict, how = "insufficient", "it can never decrease"
    elif scale_ratchets:
        verdict, how = "insufficient", "it moves down only with its block's bf16 scale, which ratchets too"
    else:
        verdict, how = "marginal", "it moves down only with its block's scale (its largest entry, stored exactly)"
    stall_rn = stall_probability(fmt, beta, "nearest", moment=moment)
    stall_sr = stall_probability(fmt, beta, "stochastic", moment=moment)
    period = reset_period(fmt, beta, "nearest", moment=moment)
    remedies = f"rounding='stochastic' (stalls per step {stall_rn:.2f} -> {stall_sr:.2f})"
    remedies += f", or reset it every {period} steps (StateResetScheduler; theory.reset_period)" if period is not None else ""
    reason = (
        f"stall ratchet: 1-β = {1 - beta:.3g} is under half the relative gap below each code of {storage.name} ({half_gap:.3g}), "
        f"so written RN {how}; remedies: {remedies} {_STALL_PAPER}"
    )
    return [(verdict, reason), *subnormal]


def _fp16_subnormal_findings(beta: float) -> list[tuple[str, str]]:
    """fp16's ``v`` written RN: its normals have the bits (``1 - β2`` over half their gap), but below ``2^-14`` its grid is
    subnormal, a fixed spacing of ``2^-24``: a ``v`` under ``2^-25 / (1 - β2)`` (gradients under its root) can never
    decrease, and with it most of a model's ``v`` (gradients of 1e-4 to 1e-3 put all of it there)."""
    below = 2.0**-25 / (1.0 - beta)
    reason = (
        f"fp16 subnormals: below 2^-14 fp16's grid has a fixed spacing of 2^-24, so a v under 2^-25/(1-β) = {below:.3g} "
        f"(gradients under {math.sqrt(below):.2g}, most models') written RN can never decrease and stalls on nearly every "
        f"step; write it with rounding='stochastic' (unbiased there too), or store it in bf16 (fp32's exponent range) "
        f"written stochastically as well {_STALL_PAPER}"
    )
    return [("marginal", reason)]


def _learning_rate_findings(
    group: dict, params: list[torch.Tensor], found: list[_Storage], kind: str, names: Mapping[torch.Tensor, str]
) -> list[tuple[str, str]]:
    """FlashOptim's check (see :func:`advise`): parameters whose largest update is below the smallest change of their largest weight."""
    if kind == "sgd" or "lr" not in group or group.get("error_feedback"):  # error feedback keeps what rounding loses
        return []
    # the run's lr, not a warm-up's first one: torch's schedulers keep the group's base lr as initial_lr, and OneCycleLR
    # its peak as max_lr (its initial_lr is the low start)
    current = float(group["lr"])
    lr = max(current, float(group.get("initial_lr", current)), float(group.get("max_lr", current)))
    if lr == 0.0:  # a frozen group: nothing to lose
        return []
    frozen = []
    for param, storage in zip(params, found, strict=True):
        local = local_tensor(param).detach()
        if storage.rounding != "nearest" or storage.bits >= FP32_BITS or local.numel() == 0:
            continue
        largest = float(local.abs().max())
        if largest == 0.0 or not math.isfinite(largest):
            continue
        smallest_change = 2.0 ** (math.floor(math.log2(largest)) - storage.bits - 1)
        update = lr if kind == "adam" else _muon_update(group, param, lr)
        if update < smallest_change:
            frozen.append((names.get(param, "?"), smallest_change, largest, update))
    if not frozen:
        return []
    shown = short_list([f"{name} (max|W| = {largest:.3g}: {change:.3g})" for name, change, largest, _ in frozen], 3)
    lr_text = f"lr = {lr:.3g}" + (f" (its scheduler's peak; now {current:.3g})" if f"{lr:.3g}" != f"{current:.3g}" else "")
    update_text = lr_text if kind == "adam" else f"Muon's typical update ({lr_text}, adjusted, over sqrt(max(A, B)))"
    fixes = f"weights=<format> with weight_rounding='stochastic', error_feedback='eco' or 'eco_exact' {_ECO}, or fp32 master weights"
    reason = (
        f"{update_text} is below the smallest change the weights' format makes to their largest entries in {len(frozen)} of "
        f"{len(params)} parameter(s): {shown}; those updates are lost to rounding; remedies: {fixes} {_LR_SOURCE}"
    )
    return [("insufficient", reason)]


def _muon_update(group: dict, param: torch.Tensor, lr: float) -> float:
    """The RMS entry of Muon's update of a 2-D ``param`` at learning rate ``lr``: torch's adjusted lr over ``sqrt(max(A, B))``."""
    rows, cols = param.shape[0], param.shape[1] if param.ndim > 1 else 1
    adjust = group.get("adjust_lr_fn")
    if adjust in (None, "original"):
        ratio = math.sqrt(max(1.0, rows / cols))
    elif adjust == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = math.sqrt(rows / cols) if adjust == "spectral_unclamped" else 1.0
    return lr * ratio / math.sqrt(max(rows, cols))


def _optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """``"adam"``, ``"sgd"`` or ``"muon"``: what the (inner) optimizer's update is."""
    inner = optimizer.optimizer if isinstance(optimizer, QuantizedOptimizerWrapper) else optimizer
    kinds = (
        ((torch.optim.Adam, torch.optim.AdamW, torch.optim.NAdam, torch.optim.RAdam), "adam"),
        ((torch.optim.SGD,), "sgd"),
        ((torch.optim.Muon,), "muon"),
    )
    for classes, kind in kinds:
        if isinstance(inner, classes):
            return kind
    raise TypeError(
        f"advise: no precision rule for {type(inner).__name__}; supported: torch.optim Adam, AdamW, NAdam, RAdam (adam), "
        "SGD (sgd), Muon (muon), their quantized forms (QAdam, QAdamW, QSGD, QMuon, quantize_optimizer) and the wrapper around them"
    )


def _default_names(optimizer: torch.optim.Optimizer) -> dict[torch.Tensor, str]:
    if isinstance(optimizer, QuantizedStates):
        return optimizer.param_names()
    names, index = {}, 0
    for group in optimizer.param_groups:
        given = group.get("param_names")
        for position, param in enumerate(group["params"]):
            names[param] = given[position] if given else f"param{index}"
            index += 1
    return names


def _storage(
    optimizer: torch.optim.Optimizer, group: dict, param: torch.Tensor, component: str, kind: str, grads: str | torch.dtype | None
) -> _Storage | None:
    """How ``component`` of ``param`` is stored; ``None`` where the optimizer keeps no such state (SGD without momentum)."""
    quantized = isinstance(optimizer, QuantizedStates)
    grid = optimizer.weight_grid(group, param) if quantized else None
    if component == "grads":
        if grads is not None:
            return _named_storage(grads, "nearest", signed=True)
        if group.get("grads") is not None:
            return _named_storage(group["grads"], group.get("rounding", "nearest"), signed=True)
        return _named_storage(param.dtype, "nearest", signed=True)
    if component == "weights":
        if grid is None:
            return _named_storage(param.dtype, "nearest", signed=True)
        if group["error_feedback"] == "eco_exact":  # the update runs on the stored weights plus their fp32 error: exact
            return _Storage(f"{grid.name}+eco_exact", FP32_BITS, group["weight_rounding"])
        stored = _named_storage(grid.format, group["weight_rounding"], signed=True)
        in_dtype = _named_storage(param.dtype, group["weight_rounding"], signed=True)  # grid values kept in the param's dtype
        coarser = min(stored, in_dtype, key=lambda s: s.bits)
        return _Storage(f"{coarser.name}+eco", coarser.bits, coarser.rounding, coarser.fmt) if group["error_feedback"] else coarser
    state_names = _state_names(group, component, kind)
    if not state_names:
        return None
    plain_dtype = torch.float32 if grid is not None else param.dtype
    rounding = group.get("rounding", "nearest") if quantized else "nearest"
    found = []
    for name in state_names:
        value = optimizer.state.get(param, {}).get(name)
        fmt = getattr(value, "format", None)
        if fmt is None and value is None and quantized:
            fmt = optimizer._policy_format(group, param, name)
        if fmt is not None:
            found.append(_named_storage(fmt, rounding, signed=moment_of(name) == "first"))
        else:
            dtype = value.dtype if isinstance(value, torch.Tensor) else plain_dtype
            found.append(_named_storage(dtype, "nearest", signed=moment_of(name) == "first"))
    return min(found, key=lambda s: s.bits)


def _state_names(group: dict, component: str, kind: str) -> tuple[str, ...]:
    """The optimizer state names behind a state component (empty: the optimizer keeps none)."""
    if kind == "adam":
        if component == "exp_avg":
            return ("exp_avg",)
        return ("exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg_sq",)
    if component == "exp_avg_sq" or (kind == "sgd" and not group.get("momentum")):
        return ()
    return ("momentum_buffer",)


def _named_storage(fmt: str | StorageFormat | torch.dtype, rounding: str, signed: bool) -> _Storage:
    """A storage from a format name, a format or a dtype (cast dtypes get their format, for the ratchet check)."""
    if isinstance(fmt, torch.dtype):
        name = _DTYPE_NAMES.get(fmt, str(fmt).removeprefix("torch."))
        resolved = get_format(name, signed=signed) if name in ("fp32", "fp16", "bf16") else None
        return _Storage(name, mantissa_bits(fmt), rounding, resolved)
    resolved = as_format(fmt, signed=signed)
    return _Storage(resolved.name, mantissa_bits(resolved), rounding, resolved)


def _suggestion(needed: float) -> str:
    """The coarsest common format with at least ``needed`` mantissa bits, as text."""
    for name, bits in _SUGGESTIONS:
        if bits >= needed:
            return f"e.g. {name}, M = {bits:g}"
    return "more than fp32 has: the rule is read beyond its calibrated range"
