"""Paired per-seed statistics of the benchmarks' quality and timing verdicts: the differences of two configurations run
from the same seeds, the standard error of their mean, a Student-t 95 % interval, and verdicts judged on it (a target
is met only where the whole interval meets it; one seed gives no interval)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# Two-sided 95 % quantiles of Student's t by degrees of freedom (1.96 beyond 30): the intervals the verdicts use.
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
       2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def t95(count: int) -> float:
    """Student's t for a two-sided 95 % interval of the mean of ``count`` values."""
    return T95[count - 2] if count - 1 <= len(T95) else 1.96


@dataclass(frozen=True)
class Paired:
    """Per-seed differences ``b − a`` of two configurations run from the same seeds."""

    deltas: list[float]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.deltas) if self.deltas else math.nan

    @property
    def se(self) -> float:
        """Standard error of the mean difference (nan for one seed, or where a run diverged)."""
        finite = all(math.isfinite(delta) for delta in self.deltas)
        return statistics.stdev(self.deltas) / math.sqrt(len(self.deltas)) if len(self.deltas) > 1 and finite else math.nan

    def interval(self) -> tuple[float, float]:
        """95 % interval of the mean difference; where a run diverged (an infinite difference), the per-seed range."""
        if len(self.deltas) < 2 or any(math.isnan(delta) for delta in self.deltas):
            return math.nan, math.nan
        if not all(math.isfinite(delta) for delta in self.deltas):
            return min(self.deltas), max(self.deltas)
        half = t95(len(self.deltas)) * self.se
        return self.mean - half, self.mean + half

    def text(self, digits: int = 4) -> str:
        if not all(math.isfinite(delta) for delta in self.deltas):
            return "diverged: " + ", ".join(f"{delta:+.{digits}f}" for delta in self.deltas)
        return f"{self.mean:+.{digits}f}" + ("" if math.isnan(self.se) else f" ± {self.se:.{digits}f}")


def at_most(difference: Paired, limit: float, percent: bool = False) -> tuple[str, str]:
    """Verdict on ``mean difference <= limit`` from its 95 % interval: PASS (all of it at or under), FAIL (all of it over)
    or NOT RESOLVED (it straddles the limit, or one seed); and why, with the values as percentages where ``percent``."""

    def show(value: float) -> str:
        return f"{100 * value:+.1f} %" if percent else f"{value:+.4f}"

    low, high = difference.interval()
    if high <= limit:
        return "PASS", ""
    if low > limit:
        return "FAIL", ""
    if math.isnan(low):
        side = "under" if difference.mean <= limit else "over"
        return "NOT RESOLVED", f"one seed, or both runs of a pair diverged: no interval; the mean is {side} the limit"
    return "NOT RESOLVED", f"95 % interval [{show(low)}, {show(high)}] straddles {show(limit)}"
