"""Controlled stall simulation: EMA states stored in each format, measured stall rate next to the theory's.

Usage::

    python benchmarks/stall_simulation.py [--entries N] [--horizons H] [--seed S] [--quick] [--out PATH]

Each case keeps ``N`` independent entries of one EMA state in a storage format and updates it in fp32,
``s <- Q(β·s + (1 - β)·x)`` with ``x = g²`` (second moment, ``exp_avg_sq``) or ``x = g`` (first moment,
``exp_avg``), exactly as the optimizers do, and counts stalls with the optimizers' own definition
(``lightning_qstate.formats.count_stalls``). Inputs:

- ``gaussian``: ``g ~ N(0, 1)``, the model's assumption;
- ``heavy``: ``g = σ_i · t₃ / sqrt(3)`` with per-entry scales ``σ_i = exp(N(0, 1))`` (Student-t noise with
  unit variance, and scales spread over orders of magnitude inside every block).

Protocol **steady**: the state starts in the steady state of an fp32 EMA (``v = σ_i²·Gamma`` with mean 1 and
variance ``2(1-β)/(1+β)``, or ``m ~ N(0, s²σ_i²)`` with ``s² = (1-β)/(1+β)``),
and the stall rate is measured over ``H`` EMA horizons ``1/(1 - β)`` (default one). Under round-to-nearest a
state with no downward moves ratchets up (bf16 at ``β = 0.999``), so its rate drifts above the
steady-state model the longer one measures: the long-run column (five horizons, ``--quick`` skips it)
shows how much. The prediction is ``theory.stall_probability`` (block formats with the block-scale drift
term), from the format alone, and from the codes the state actually occupies (``values=``, at the end of
the window; for floats this replaces the paper's mean-mantissa approximation by the exact gaps). A second
table follows the build-up after a reset (state zeroed, ``theory.stall_probability(..., age=k)``) for
bf16 and FP8 E4M3 at ``β = 0.999``.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as ``python benchmarks/stall_simulation.py``: the checkout's packages (benchmarks, lightning_qstate)
    sys.path.insert(0, str(ROOT))

from benchmarks.arguments import positive_float, positive_int  # noqa: E402
from lightning_qstate.formats import QuantizedTensor, count_stalls, get_format  # noqa: E402
from lightning_qstate.theory import Moment, stall_probability  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "stall_simulation.md"
FORMATS = ("bf16", "fp16", "fp8_e4m3", "fp8_e5m2", "e2m2", "int8", "int4")
QUICK_FORMATS = ("bf16", "fp8_e4m3")
BETAS = (0.99, 0.999)
ROUNDINGS = ("nearest", "stochastic")
INPUTS = ("gaussian", "heavy")
MOMENTS: tuple[Moment, ...] = ("second", "first")
FIRST_MOMENT_BETA = 0.9  # first-moment cases run at Adam's β1
BUILDUP_AGES = (10, 30, 100, 300, 1000)
LONG_RUN_HORIZONS = 5


@dataclass(frozen=True)
class Case:
    fmt: str
    beta: float
    rounding: str
    inputs: str
    moment: Moment
    scale_dtype: str | None = None  # block formats' scales; None: the format's default for the moment

    @property
    def format(self):
        return get_format(self.fmt, signed=self.moment == "first", scale_dtype=self.scale_dtype)


@dataclass
class Result:
    case: Case
    measured: float
    predicted: float
    from_codes: float
    long_run: float | None = None

    @property
    def error(self) -> float:
        """Measured minus predicted, in percentage points."""
        return 100 * (self.measured - self.predicted)


def draw_inputs(kind: str, scales: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One step's gradients ``g`` for entries with scales ``scales``."""
    noise = torch.randn(scales.shape, generator=generator)
    if kind == "heavy":  # Student-t with 3 dof, scaled to unit variance
        chi2 = torch.randn((3, *scales.shape), generator=generator).square().sum(dim=0)
        noise = noise / torch.sqrt(chi2 / 3) / math.sqrt(3.0)
    return scales * noise


def initial_state(case: Case, scales: torch.Tensor, start: str, generator: torch.Generator) -> torch.Tensor:
    """The state before the first step: zero (``start="zero"``) or the model's steady state."""
    if start == "zero":
        return torch.zeros_like(scales)
    if case.moment == "second":  # the EMA of χ²₁ draws: mean 1, variance 2(1-β)/(1+β), as a Gamma
        shape = torch.tensor((1 + case.beta) / (2 * (1 - case.beta)))
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(2**62, (), generator=generator)))
            ratio = torch.distributions.Gamma(shape, shape).sample(scales.shape)
        return scales.square() * ratio
    spread = math.sqrt((1 - case.beta) / (1 + case.beta))
    return scales * spread * torch.randn(scales.shape, generator=generator)


def measure(case: Case, entries: int, windows: list[tuple[int, int]], start: str, seed: int) -> tuple[list[float], QuantizedTensor]:
    """Stall rate (stalled / moved) over each ``(first, last)`` step window (1-based, inclusive) of one run, and the
    state at the end of the first window."""
    generator = torch.Generator().manual_seed(seed)
    fmt = case.format
    scales = torch.ones(entries) if case.inputs == "gaussian" else torch.exp(torch.randn(entries, generator=generator))
    stored = fmt.quantize(initial_state(case, scales, start, generator))
    counts = [torch.zeros(2, dtype=torch.int64) for _ in windows]
    at_first_end = stored
    for step in range(1, max(last for _, last in windows) + 1):
        grad = draw_inputs(case.inputs, scales, generator)
        before = stored.dequantize(torch.float32)
        target = grad.square() if case.moment == "second" else grad
        updated = case.beta * before + (1 - case.beta) * target
        new = fmt.quantize(updated, rounding=case.rounding, generator=generator)
        active = [i for i, (first, last) in enumerate(windows) if first <= step <= last]
        if active:
            step_counts = count_stalls(before, updated, new.dequantize(torch.float32), stored.unit_values(), new.unit_values())
            for i in active:
                counts[i] += step_counts
        stored = new
        if step == windows[0][1]:
            at_first_end = stored
    return [float(c[0]) / max(float(c[1]), 1.0) for c in counts], at_first_end


def run_case(case: Case, entries: int, horizons: float, long_run: bool, seed: int) -> Result:
    horizon = round(horizons / (1 - case.beta))
    windows = [(1, horizon)] + ([(1, LONG_RUN_HORIZONS * round(1 / (1 - case.beta)))] if long_run else [])
    rates, state = measure(case, entries, windows, "steady", seed)
    predicted = stall_probability(case.format, case.beta, case.rounding, moment=case.moment)
    from_codes = stall_probability(state.format, case.beta, case.rounding, moment=case.moment, values=state)
    return Result(case, rates[0], predicted, from_codes, rates[1] if long_run else None)


def buildup(fmt: str, rounding: str, entries: int, seed: int, beta: float = 0.999) -> list[tuple[int, float, float]]:
    """``(age, measured, predicted)``: the stall rate over ages ``[0.8k, 1.2k]`` after zeroing, against ``P(k)``."""
    case = Case(fmt, beta, rounding, "gaussian", "second")
    windows = [(max(1, round(0.8 * age)), round(1.2 * age)) for age in BUILDUP_AGES]
    rates, _ = measure(case, entries, windows, "zero", seed)
    return [(age, rate, stall_probability(fmt, beta, rounding, age=age)) for age, rate in zip(BUILDUP_AGES, rates, strict=False)]


def cases(quick: bool) -> list[Case]:
    if quick:
        return [Case(f, b, r, "gaussian", "second") for f in QUICK_FORMATS for b in BETAS for r in ROUNDINGS]
    out = []
    for moment in MOMENTS:
        betas = BETAS if moment == "second" else (FIRST_MOMENT_BETA,)
        out += [Case(f, b, r, i, moment) for f in FORMATS for b in betas for r in ROUNDINGS for i in INPUTS]
    return out


def render(results: list[Result], buildups: dict[tuple[str, str], list], args: argparse.Namespace, argv: list[str]) -> str:
    lines = [
        "# Stall rates of EMA states: simulation against the theory",
        "",
        f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} by "
        f"`python benchmarks/stall_simulation.py {shlex.join(argv)}` (torch {torch.__version__}, {platform.machine()}).",
        f"{args.entries} entries per case; steady state, measured over {args.horizons} EMA horizon(s) 1/(1-β); "
        "second moment `v` (β2) and first moment `m` (β1 = 0.9). Rates are stalled / moved entries.",
        "",
        "| state | format | β | rounding | inputs | measured | predicted | measured − predicted (pp) | predicted from the state's codes |"
        + (f" measured over {LONG_RUN_HORIZONS} horizons |" if results and results[0].long_run is not None else ""),
        "|---|---|---|---|---|---|---|---|---|" + ("---|" if results and results[0].long_run is not None else ""),
    ]
    for r in results:
        c = r.case
        row = (
            f"| {'v' if c.moment == 'second' else 'm'} | {c.fmt} | {c.beta} | {c.rounding} | {c.inputs} "
            f"| {r.measured:.3f} | {r.predicted:.3f} | {r.error:+.1f} | {r.from_codes:.3f} |"
        )
        lines.append(row + (f" {r.long_run:.3f} |" if r.long_run is not None else ""))
    gaussian = [r for r in results if r.case.inputs == "gaussian" and r.case.moment == "second"]
    if gaussian:
        worst = max(gaussian, key=lambda r: abs(r.error))
        lines += [
            "",
            f"Gaussian `v` cases: largest |measured − predicted| = {abs(worst.error):.1f} pp "
            f"({worst.case.fmt}, β={worst.case.beta}, {worst.case.rounding}).",
        ]
    for (fmt, rounding), rows in buildups.items():
        lines += [
            "",
            f"## Build-up after a reset: {fmt}, {rounding}, β2 = 0.999",
            "",
            "| age k | measured (ages 0.8k..1.2k) | predicted P(k) |",
            "|---|---|---|",
        ]
        lines += [f"| {age} | {measured:.3f} | {predicted:.3f} |" for age, measured, predicted in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=positive_int, default=16384)
    parser.add_argument("--horizons", type=positive_float, default=1.0, help="measurement window, in EMA horizons 1/(1-β)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="bf16 and FP8 E4M3 second moments, Gaussian inputs, no long run, no build-up")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--quiet", action="store_true")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for case in cases(args.quick):
        results.append(run_case(case, args.entries, args.horizons, not args.quick, args.seed))
        if not args.quiet:
            r = results[-1]
            print(f"{case}: measured {r.measured:.4f} predicted {r.predicted:.4f}", flush=True)
    buildups = {} if args.quick else {(f, r): buildup(f, r, args.entries, args.seed) for f in QUICK_FORMATS for r in ROUNDINGS}
    text = render(results, buildups, args, argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    if not args.quiet:
        print(text)
    return results


if __name__ == "__main__":
    main()
