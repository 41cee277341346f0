"""Gradient statistics and zones of the adaptive bit-width policy: ``(N, R)`` per layer, EMAs, the four zones, the
annealed threshold, hysteresis, and the zone -> format maps (pure torch)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..arguments import ConfigurationError
from ..formats import get_format

# Zones from the highest priority (most bits) to the lowest; budget demotions start from the end.
ZONES: tuple[str, ...] = ("critical", "magnitude", "structural", "redundant")
# What a layer's statistics are compared with (see model_statistics).
REFERENCES: tuple[str, ...] = ("layers", "model")


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
        raise ConfigurationError(f"reference={reference!r} is not valid; use one of {REFERENCES}")
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
            raise ConfigurationError(f"AnnealedThreshold: start={self.start!r} and end={self.end!r} must be > 0")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ConfigurationError(f"AnnealedThreshold: steps={self.steps!r} must be an int >= 1")

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
        raise ConfigurationError(f"{option} must name exactly the zones {list(ZONES)}; got {sorted(formats)}")
    for zone, name in formats.items():
        check_candidate(name, f"{option}[{zone!r}]")
    return {zone: formats[zone] for zone in ZONES}


def check_candidate(name: str, option: str) -> str:
    """``name``, checked as a candidate format of an adapted state: a known format other than ``fp32``. Errors name ``option``."""
    if name == "fp32":
        raise ConfigurationError(f"{option}='fp32' is not a candidate; use a stored format such as 'bf16', 'int8' or 'int4'")
    try:
        get_format(name)
    except (ValueError, TypeError) as error:
        raise ConfigurationError(f"{option}: {error}") from None
    return name
