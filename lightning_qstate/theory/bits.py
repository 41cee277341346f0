"""Adaptive per-layer, per-state bit-widths (STQuant, arXiv 2604.06836): the policy pieces, without Lightning.

**A reconstruction.** The paper's claims are known (per-layer, per-state and per-step bit-widths at an
average of 5.1 bits, statistics all-reduced so every rank agrees, O(N/K) overhead), its method text is not;
``docs/algorithms.md`` ("Adaptive bit-widths") sets out the reconstruction implemented here. Every choice
below is a policy parameter of :class:`~lightning_qstate.callbacks.AdaptiveBitWidth`:

- statistics of a layer's gradient ``g``: ``N = RMS(g)`` and ``R = std(|g|) / mean(|g|)``, from sums
  that can be all-reduced over ranks (:func:`gradient_statistics`), smoothed by an EMA (:func:`ema`);
- four zones by comparing a layer's EMAs with the whole model's (:func:`model_statistics`), each scaled by a
  threshold (:func:`classify_zone`) that rises over training (:class:`AnnealedThreshold`);
- a zone changes only after the new zone was observed at ``persist`` consecutive checks (:class:`ZoneHysteresis`);
- a zone maps to one storage format per state; a memory budget caps the average bits, demoting layers
  deterministically until it fits, then spends what is left under the cap promoting layers to higher zones'
  formats, the least precise first (:func:`zone_ladder`, :func:`budget_ladder`, :func:`fit_budget`).

Bytes are the formats' real stored bytes (codes plus block scales, :func:`format_nbytes`), never nominal bits:
a 6-bit minifloat is stored one code per byte, so it costs what an 8-bit format costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ..formats import StorageFormat, get_format
from ..optim.policy import resolve_format

# Zones from the highest priority (most bits) to the lowest; budget demotions start from the end.
ZONES: tuple[str, ...] = ("critical", "magnitude", "structural", "redundant")
FP32_BYTES = 4


class BudgetError(ValueError):
    """The bit budget cannot be met even with every layer in its cheapest candidate formats."""


def gradient_statistics(abs_sum: float, square_sum: float, count: float) -> tuple[float, float]:
    """``(N, R)`` of a gradient from sums over its values: ``N = sqrt(sum g^2 / count)`` (RMS) and
    ``R = std(|g|) / mean(|g|)`` (dispersion). ``(0, 0)`` for an empty or all-zero gradient.

    Sums of shards add up to the sums of the whole tensor, so they can be all-reduced first.
    """
    if count <= 0 or abs_sum <= 0:
        return 0.0, 0.0
    mean_abs = abs_sum / count
    mean_square = square_sum / count
    return math.sqrt(mean_square), math.sqrt(max(mean_square - mean_abs * mean_abs, 0.0)) / mean_abs


REFERENCES: tuple[str, ...] = ("layers", "model")


def model_statistics(
    abs_sums: Sequence[float], square_sums: Sequence[float], counts: Sequence[float], reference: str = "layers"
) -> tuple[float, float]:
    """The whole model's ``(N, R)`` that layers are compared with, from per-layer sums (as in :func:`gradient_statistics`).

    ``reference="layers"``: the means of the layers' ``N`` and ``R`` weighted by their sizes (the typical value
    of a parameter's layer). ``"model"``: ``N`` and ``R`` of all gradients pooled into one tensor; pooling mixes
    the layers' scales, so its ``R`` exceeds almost every layer's and few layers count as high-R.
    """
    if reference == "model":
        return gradient_statistics(sum(abs_sums), sum(square_sums), sum(counts))
    if reference != "layers":
        raise ValueError(f"reference={reference!r} is not valid; use one of {REFERENCES}")
    total = sum(counts)
    if total <= 0:
        return 0.0, 0.0
    layer_stats = [gradient_statistics(a, s, n) for a, s, n in zip(abs_sums, square_sums, counts, strict=False)]
    mean_rms = sum(n * rms for n, (rms, _) in zip(counts, layer_stats, strict=False)) / total
    mean_r = sum(n * r for n, (_, r) in zip(counts, layer_stats, strict=False)) / total
    return mean_rms, mean_r


def ema(previous: float | None, value: float, decay: float) -> float:
    """Exponential moving average ``decay * previous + (1 - decay) * value``; the first value starts it."""
    return value if previous is None else decay * previous + (1.0 - decay) * value


def classify_zone(rms: float, dispersion: float, global_rms: float, global_dispersion: float, threshold: float) -> str:
    """The zone of a layer: its ``N`` (``rms``) and ``R`` (``dispersion``) are high when above ``threshold``
    times the whole model's. High N and R: ``critical``; high N only: ``magnitude``; high R only:
    ``structural``; neither: ``redundant``."""
    high_rms = rms > threshold * global_rms
    high_dispersion = dispersion > threshold * global_dispersion
    if high_rms:
        return "critical" if high_dispersion else "magnitude"
    return "structural" if high_dispersion else "redundant"


@dataclass(frozen=True)
class AnnealedThreshold:
    """Temporal annealing: the zone threshold rises linearly from ``start`` at step 0 to ``end`` at ``steps``
    and stays there, so fewer layers count as high-N/high-R (and keep many bits) later in training."""

    start: float = 1.0
    end: float = 1.5
    steps: int = 1000

    def __post_init__(self) -> None:
        if not (self.start > 0 and self.end > 0):
            raise ValueError(f"AnnealedThreshold: start={self.start!r} and end={self.end!r} must be > 0")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"AnnealedThreshold: steps={self.steps!r} must be an int >= 1")

    def __call__(self, step: int) -> float:
        return self.start + (self.end - self.start) * min(max(step, 0) / self.steps, 1.0)


@dataclass
class ZoneHysteresis:
    """One layer's zone with hysteresis: a different zone is adopted only once it was observed at
    ``persist`` consecutive checks. The first observation is adopted at once (``zone`` is ``None`` before).

    Attributes:
        zone: the adopted zone (``None`` before the first observation).
        pending: the zone observed at the last checks, if it differs from ``zone``.
        streak: for how many consecutive checks ``pending`` was observed.
    """

    zone: str | None = None
    pending: str | None = None
    streak: int = 0

    def observe(self, observed: str, persist: int) -> bool:
        """Record a check's zone; returns whether the adopted zone changed."""
        if self.zone is None or observed == self.zone:
            changed = self.zone is None
            self.zone, self.pending, self.streak = observed, None, 0
            return changed
        self.streak = self.streak + 1 if observed == self.pending else 1
        self.pending = observed
        if self.streak < persist:
            return False
        self.zone, self.pending, self.streak = observed, None, 0
        return True


def check_zone_formats(formats: Mapping[str, str], option: str) -> dict[str, str]:
    """``{zone: format name}`` for all four zones, checked: every zone named, every name a known format other
    than ``fp32`` (plain states are the optimizer's ``min_quant_size`` business). Errors name ``option``."""
    if not isinstance(formats, Mapping):
        raise TypeError(f"{option} must be a mapping of zone -> format name, got {type(formats).__name__}")
    if set(formats) != set(ZONES):
        raise ValueError(f"{option} must name exactly the zones {list(ZONES)}; got {sorted(formats)}")
    for zone, name in formats.items():
        if name == "fp32":
            raise ValueError(f"{option}[{zone!r}]='fp32' is not a candidate; use a stored format such as 'bf16', 'int8' or 'int4'")
        try:
            get_format(name)
        except (ValueError, TypeError) as error:
            raise ValueError(f"{option}[{zone!r}]: {error}") from None
    return {zone: formats[zone] for zone in ZONES}


def format_nbytes(fmt: StorageFormat | None, numel: int) -> int:
    """Bytes a state of ``numel`` values takes in ``fmt`` (codes plus scales), or as a plain fp32 tensor (``None``)."""
    return FP32_BYTES * numel if fmt is None else fmt.nbytes(numel)


def resolved_nbytes(group: Mapping, state_name: str, param: torch.Tensor, numel: int) -> int:
    """Bytes of state ``state_name`` of ``param`` (``numel`` values in full) under ``group``'s policy (its ``states``
    spec, ``min_quant_size`` and block size), resolved as the optimizer resolves new states, FSDP2 row alignment included."""
    return format_nbytes(resolve_format(group, state_name, param, numel), numel)


Choice = tuple[str, ...]  # one format name per adapted state, in the order of the formats mapping


def zone_ladder(zone: str | None, formats: Mapping[str, Mapping[str, str]], nbytes: Callable[[str, str], int]) -> list[tuple[Choice, int]]:
    """A layer's options, from its zone's formats down to the cheapest, as ``[(choice, bytes), ...]`` with
    strictly falling bytes.

    ``formats`` is ``{state name: {zone: format name}}``; ``nbytes(state, format name)`` prices one state of
    this layer. The options are the formats of ``zone`` (``None``: ``critical``), of each lower-priority
    zone, then the floor: the cheapest candidate of each state. Options that save nothing are skipped.
    """
    start = ZONES.index(zone) if zone is not None else 0
    options = [tuple(per_zone[z] for per_zone in formats.values()) for z in ZONES[start:]]
    options.append(
        tuple(min(dict.fromkeys(per_zone.values()), key=lambda name, s=state: nbytes(s, name)) for state, per_zone in formats.items())
    )
    ladder: list[tuple[Choice, int]] = []
    for choice in options:
        cost = sum(nbytes(state, name) for state, name in zip(formats, choice, strict=False))
        if not ladder or cost < ladder[-1][1]:
            ladder.append((choice, cost))
    return ladder


def budget_ladder(
    zone: str | None, formats: Mapping[str, Mapping[str, str]], nbytes: Callable[[str, str], int]
) -> tuple[list[tuple[Choice, int]], int]:
    """A layer's options for the budget, ``(ladder, start)``: :func:`zone_ladder` of ``zone`` (which starts at rung
    ``start``) under the options a budget with room to spare may promote it to: the formats of each higher-priority
    zone, from the next one up to ``critical``, each kept only if it costs more than every option below it.
    The bytes still fall strictly down the ladder; ``start`` is 0 for ``critical`` (and ``None``)."""
    below = zone_ladder(zone, formats, nbytes)
    above: list[tuple[Choice, int]] = []
    for z in reversed(ZONES[: ZONES.index(zone) if zone is not None else 0]):
        choice = tuple(per_zone[z] for per_zone in formats.values())
        cost = sum(nbytes(state, name) for state, name in zip(formats, choice, strict=False))
        if cost > (above[-1][1] if above else below[0][1]):
            above.append((choice, cost))
    return above[::-1] + below, len(above)


def budget_order(zones: Sequence[str | None], numels: Sequence[int], names: Sequence[str]) -> list[int]:
    """Layer indices in the budget's order (:func:`fit_budget`'s ``order``): the lowest-priority zone first (``None``,
    before any check, counts as ``critical``), then the largest, then by name. Demotions start from the first, and so
    do promotions: the least precise layers get the room under the cap first."""
    return sorted(range(len(zones)), key=lambda i: (-ZONES.index(zones[i] or ZONES[0]), -numels[i], names[i]))


def fit_budget(
    ladders: Sequence[Sequence[int]],
    fixed_bytes: int,
    values: int,
    target_bits: float | None,
    order: Sequence[int],
    start: Sequence[int] | None = None,
    fill: bool = True,
) -> list[int]:
    """Which rung of each layer's ladder to use so that the average bits per state value is at most ``target_bits``,
    and with ``fill`` greedily close to it.

    Args:
        ladders: per layer, the bytes of its options, falling.
        fixed_bytes: bytes of states that are not adapted (pinned by a user override).
        values: number of state values over everything counted, adapted or not.
        target_bits: the cap, scales included; ``None`` for none.
        order: layer indices, first to be demoted first and promoted first (lowest priority zone, then largest, then name).
        start: per layer, the rung its zone asks for (default: 0 for every layer); rungs above it are promotions.
        fill: run the promotion pass (2. below); ``False``: demotions only, the plan stays wherever they leave it.

    Two passes, deterministic and linear in layers times rungs:

    1. demotion: each layer in ``order`` is demoted from its ``start`` rung by rung to its floor before the next
       one is touched, until the total fits;
    2. promotion (the cap's slack): in rounds, each layer in ``order`` (the least precise first: the lowest
       priority zone, then the largest) is promoted one rung if the total stays within the cap, until no layer
       can move up (rung 0, or its next rung does not fit: it never will, the total only grows). One rung per
       layer per round spreads the slack over many layers' first upgrades before any layer's second, and the
       order gives it to the layers with the fewest bits first: with the default formats a redundant layer's
       first rung is its ``v`` to 8 bits, a magnitude layer's its ``m``, and on the GPT benchmark a 4-bit ``v``
       costs more than a 4-bit ``m`` (10 seeds against fixed int8: ``m`` int4 + ``v`` int8 +0.07 %, ``m`` int8 +
       ``v`` int4 +1.70 %; ``benchmarks/results/adaptive_bits_gpt_seeds.md``).

    Without a cap every layer stays at its ``start`` rung.

    Raises:
        BudgetError: even every layer at its floor exceeds ``target_bits``.
    """
    chosen = [0] * len(ladders) if start is None else list(start)
    total = fixed_bytes + sum(ladder[rung] for ladder, rung in zip(ladders, chosen, strict=False))
    if target_bits is None:
        return chosen
    cap = target_bits * values / 8
    for index in order:
        ladder = ladders[index]
        while total > cap and chosen[index] + 1 < len(ladder):
            total += ladder[chosen[index] + 1] - ladder[chosen[index]]
            chosen[index] += 1
    if total > cap:
        raise BudgetError(
            f"target_bits={target_bits} cannot be met: the cheapest candidates give {8 * total / values:.3f} bits per state value "
            f"over {values} values (states kept fp32 included)"
        )
    candidates = [index for index in order if chosen[index] > 0] if fill else []
    while candidates:  # one round: each candidate up one rung; the total only grows, so a refused rung stays refused
        kept = []
        for index in candidates:
            step = ladders[index][chosen[index] - 1] - ladders[index][chosen[index]]
            if total + step <= cap:
                total += step
                chosen[index] -= 1
                if chosen[index] > 0:
                    kept.append(index)
        candidates = kept
    return chosen
