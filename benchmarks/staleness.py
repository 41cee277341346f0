"""Stale low-precision states at CPU scale: the GPT example with fp32, bf16, FP8 E4M3 and E2M2 Adam states,
each with round-to-nearest, stochastic rounding, theory-scheduled resets, and SR + resets (arXiv 2603.16731).

Usage::

    python benchmarks/staleness.py [--steps 3000] [--jobs 2] [--quick] [--formats F ...] [--merge] [--out PATH]

Every run trains the byte-level GPT-2 of ``examples/gpt.py`` (2 layers, width 64, context 64, 0.12 M parameters)
on the ``pydoc_data.topics`` text with AdamW, ``β = (0.9, 0.999)``, lr 3e-3 (100 warmup steps, cosine to 10 %),
batch 16, gradient clipping 1.0, seed 0, one CPU thread. Only the optimizer states change: both moments in the
format (``min_quant_size=0``: every parameter), rounded RN or SR; resets come from
:class:`~lightning_qstate.callbacks.StateResetScheduler` with ``period="auto"`` (bf16 1000, FP8 300, E2M2 200
steps), and for fp32 states, which the theory never resets, every 1000 steps (``include_fp32=True``), as the
paper's fp32 control. :class:`~lightning_qstate.callbacks.StallMonitor` measures the stall rate of ``v`` every 50
steps; the table reports its mean over the second half of training next to the theory's steady-state rate.

A second table measures the monitor's cost: the same int8 and bf16 runs with and without it (interval 50),
interleaved, mean step time over all steps. Results go to ``--out`` (markdown, with the command) and the raw
numbers to the ``.json`` beside it; ``--formats fp8_e4m3 --merge`` reruns one column and keeps the others.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as ``python benchmarks/staleness.py``: the checkout's packages (benchmarks, lightning_qstate)
    sys.path.insert(0, str(ROOT))

from benchmarks.arguments import non_negative_int, positive_int  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "staleness.md"
FORMATS = ("fp32", "bf16", "fp8_e4m3", "e2m2")
VARIANTS = ("RN", "SR", "resets only", "SR + resets")
FP32_RESET_PERIOD = 1000
MONITOR_INTERVAL = 50  # steps between stall measurements (shorter runs: a tenth of the run)


@dataclass(frozen=True)
class RunSpec:
    states: str
    variant: str
    steps: int
    monitor: bool = True
    model: tuple[int, int, int, int] = (64, 2, 2, 64)  # n_embd, n_layer, n_head, context

    @property
    def rounding(self) -> str:
        return "stochastic" if self.variant.startswith("SR") else "nearest"

    @property
    def resets(self) -> bool:
        return "resets" in self.variant


QUICK_FORMATS = ("fp32", "bf16")  # --quick's default --formats


def specs(steps: int, quick: bool, formats: tuple[str, ...] = FORMATS) -> list[RunSpec]:
    """The runs of ``formats``, in table order: fp32 RN and resets only, each other format in every variant; with
    ``quick``, fp32 RN and each other format RN and SR + resets."""
    fp32_variants, variants = (("RN",), ("RN", "SR + resets")) if quick else (("RN", "resets only"), VARIANTS)
    runs = [RunSpec("fp32", variant, steps) for variant in fp32_variants] if "fp32" in formats else []
    return runs + [RunSpec(fmt, variant, steps) for fmt in FORMATS[1:] if fmt in formats for variant in variants]


def monitor_interval(steps: int) -> int:
    """Steps between StallMonitor's measurements in a run of ``steps``: 50, or a tenth of a shorter run."""
    return min(MONITOR_INTERVAL, max(1, steps // 10))


# --- one run, in a worker process ---------------------------------------------------------------------------
def train(spec: RunSpec) -> dict:
    """Fit one configuration; returns its measurements."""
    sys.path.insert(0, str(ROOT))
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.loggers import Logger

    from examples.data import ByteTextDataModule
    from examples.gpt import GPTModule
    from lightning_qstate.callbacks import StallMonitor, StateResetScheduler
    from lightning_qstate.optim import state_summary
    from lightning_qstate.plugins import QStatePrecision

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)

    class Records(Logger):
        name, version = "records", 0

        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int, dict]] = []

        def log_metrics(self, metrics, step=None) -> None:
            self.rows.append((step, {k: float(v) for k, v in metrics.items()}))

        def log_hyperparams(self, *args, **kwargs) -> None:
            pass

    class StepTimes(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            self.times.append(time.perf_counter() - self.start)

    width, layers, heads, context = spec.model
    model = GPTModule(
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        n_positions=context,
        lr=3e-3,
        weight_decay=0.1,
        betas=(0.9, 0.999),
        warmup_steps=min(100, spec.steps // 10),
    )
    data = ByteTextDataModule(seq_len=context, batch_size=16, val_windows=128)
    records, times = Records(), StepTimes()
    interval = monitor_interval(spec.steps)
    callbacks: list = [times]
    if spec.monitor and spec.states != "fp32":
        callbacks.append(StallMonitor(log_every_n_steps=interval, per_layer=False, histograms=False))
    if spec.resets:
        callbacks.append(
            StateResetScheduler(period=FP32_RESET_PERIOD, include_fp32=True)
            if spec.states == "fp32"
            else StateResetScheduler(period="auto")
        )
    validate_every = max(1, spec.steps // 6)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=spec.steps, val_check_interval=validate_every, check_val_every_n_epoch=None,
        log_every_n_steps=interval, gradient_clip_val=1.0, logger=records, callbacks=callbacks, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        plugins=[QStatePrecision(states=spec.states, rounding=spec.rounding, min_quant_size=0)],
    )  # fmt: skip
    start = time.perf_counter()
    trainer.fit(model, data)
    seconds = time.perf_counter() - start
    optimizer = trainer.strategy.optimizers[0]
    summary = state_summary(optimizer)

    def second_half(key: str) -> float | None:
        values = [metrics[key] for step, metrics in records.rows if key in metrics and step is not None and step >= spec.steps // 2]
        return statistics.fmean(values) if values else None

    val = [metrics["val_loss"] for _, metrics in records.rows if "val_loss" in metrics]
    resets = [metrics["qstate/reset/total"] for _, metrics in records.rows if "qstate/reset/total" in metrics]
    return {
        "spec": asdict(spec),
        "val_loss": val[-1],
        "val_curve": val,
        "stall_v": second_half("qstate/stall/exp_avg_sq"),
        "stall_v_predicted": second_half("qstate/stall_predicted/exp_avg_sq"),
        "stall_m": second_half("qstate/stall/exp_avg"),
        "reset_events": int(resets[-1]) if resets else 0,
        "state_bytes": summary["bytes"],
        "fp32_bytes": summary["fp32_bytes"],
        "params": sum(p.numel() for p in model.parameters()),
        "seconds": seconds,
        "mean_step_s": statistics.fmean(times.times),
    }


# --- orchestration --------------------------------------------------------------------------------------------
def launch(spec: RunSpec) -> dict:
    """Run ``train(spec)`` in a fresh process (one thread each, so ``--jobs`` runs share the cores evenly)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(asdict(spec))]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"run {spec} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def overhead(steps: int, rounds: int) -> list[dict]:
    """Mean step time with and without StallMonitor, interleaved runs of int8 (C++ kernel) and bf16 states."""
    rows = []
    for states in ("int8", "bf16"):
        timings: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for monitor in (False, True):
                timings[monitor].append(launch(RunSpec(states, "RN", steps, monitor=monitor, model=(128, 2, 2, 64)))["mean_step_s"])
        without, with_monitor = statistics.fmean(timings[False]), statistics.fmean(timings[True])
        rows.append({"states": states, "without": without, "with": with_monitor, "overhead": with_monitor / without - 1})
    return rows


def fmt_loss(results: dict, states: str, variant: str) -> str:
    run = results.get((states, variant))
    return "–" if run is None else f"{run['val_loss']:.4f}"


def render(results: dict, costs: list[dict], args: argparse.Namespace, argv: list[str]) -> str:
    import torch

    any_run = next(iter(results.values()))
    lines = [
        "# Stale optimizer states at CPU scale (GPT example)",
        "",
        f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} "
        f"by `python benchmarks/staleness.py {shlex.join(argv)}` "
        f"(torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores). "
        f"Byte-level GPT-2, {any_run['params']:,} parameters, "
        f"{args.steps} steps, AdamW β = (0.9, 0.999); see the script's docstring for the set-up.",
        "",
        "Final validation loss (nats/byte), as the paper's table:",
        "",
        "| | " + " | ".join(FORMATS) + " |",
        "|---|" + "---|" * len(FORMATS),
    ]
    for variant in VARIANTS:
        lines.append(f"| {variant} | " + " | ".join(fmt_loss(results, f, variant) for f in FORMATS) + " |")
    fp32 = results.get(("fp32", "RN"))
    lines += [
        "",
        "| states | variant | val loss | Δ vs fp32 RN | v stall measured | v stall predicted | m stall measured "
        "| resets | state bytes | saved vs fp32 | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def stall(run: dict, key: str) -> str:
        return "–" if run[key] is None else f"{run[key]:.3f}"

    for (states, variant), run in results.items():
        delta = "–" if fp32 is None else f"{run['val_loss'] - fp32['val_loss']:+.4f}"
        saved = 1 - run["state_bytes"] / run["fp32_bytes"]
        lines.append(
            f"| {states} | {variant} | {run['val_loss']:.4f} | {delta} "
            f"| {stall(run, 'stall_v')} | {stall(run, 'stall_v_predicted')} | {stall(run, 'stall_m')} | "
            f"{run['reset_events']} | {run['state_bytes']:,} | {100 * saved:.1f}% | {run['seconds']:.0f} |"
        )
    lines += [
        "",
        f"Stall rates: mean of StallMonitor's measurements (one step in {monitor_interval(args.steps)}) over the second half; "
        "with resets they include the build-up after each reset.",
    ]
    if costs:
        lines += [
            "",
            f"## StallMonitor overhead (interval {MONITOR_INTERVAL})",
            "",
            "| states | mean step, without | with | overhead |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| {c['states']} | {1000 * c['without']:.2f} ms | {1000 * c['with']:.2f} ms | {100 * c['overhead']:+.2f}% |" for c in costs
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=None, help="steps of each run (default 3000; --quick: 60)")
    parser.add_argument("--jobs", type=positive_int, default=2, help="runs in parallel (one thread each)")
    parser.add_argument("--overhead-steps", type=non_negative_int, default=600, help="steps of each StallMonitor overhead run (0: skip)")
    parser.add_argument("--overhead-rounds", type=positive_int, default=2)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="short runs of 60 steps (fp32 RN; each other format RN and SR + resets; default formats fp32 bf16), no overhead table",
    )
    formats_help = f"state formats to (re)run (default: all; --quick: {' '.join(QUICK_FORMATS)})"
    parser.add_argument("--formats", nargs="+", default=None, choices=FORMATS, help=formats_help)
    parser.add_argument("--merge", action="store_true", help="keep the other formats' runs from the JSON next to --out")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        print(json.dumps(train(RunSpec(**{**spec, "model": tuple(spec["model"])}))))
        return {}
    if args.steps is None:
        args.steps = 60 if args.quick else 3000
    if args.formats is None:
        args.formats = list(QUICK_FORMATS if args.quick else FORMATS)
    runs = specs(args.steps, args.quick, tuple(args.formats))
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        finished = list(pool.map(launch, runs))
    raw = args.out.with_suffix(".json")
    kept = json.loads(raw.read_text()) if args.merge and raw.is_file() else []
    fresh = {(spec.states, spec.variant) for spec in runs}
    merged = [run for run in kept if (run["spec"]["states"], run["spec"]["variant"]) not in fresh] + finished
    order = {(spec.states, spec.variant): i for i, spec in enumerate(specs(args.steps, args.quick))}
    merged.sort(key=lambda run: order.get((run["spec"]["states"], run["spec"]["variant"]), len(order)))
    results = {(run["spec"]["states"], run["spec"]["variant"]): run for run in merged}
    costs = [] if args.quick or args.overhead_steps <= 0 else overhead(args.overhead_steps, args.overhead_rounds)
    text = render(results, costs, args, argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    raw.write_text(json.dumps(merged, indent=1))
    print(text)
    return results


if __name__ == "__main__":
    main()
