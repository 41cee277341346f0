"""Print a short summary at the end of ``fit``: final metrics, optimizer-state memory against fp32, weights kept without
master copies (``weights=``), where the logs are."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from ..adaptive import ADAPTED_STATES
from ..adaptive.planner import kept_plain
from ..formats import QuantizedTensor
from ..optim import QuantizedStates, state_summary
from ..optim.base import local_tensor, plain_state_name


class RunSummary(Callback):
    """At the end of ``fit``, print (on global rank 0) a few lines such as::

        == lightning_qstate run summary (612.3 s, 1000 steps) ==
        metrics: train_loss=1.532  val_loss=1.498
        optimizer states: 0.85 MB vs 3.37 MB in fp32 (25.3 %, 8.09 bits/value, 74.7 % saved) [QAdamW]
          state formats: exp_avg: fp32 x34, int8 x18 | exp_avg_sq: fp32 x34, int8 x18
          step paths: native x52 (rank 0, last step)
        weights without master copy: fp8_e4m3 x16 (0.786 M values): 3.146 MB held, 0.800 MB packed [error_feedback=eco, stochastic]
        TensorBoard logs: runs/gpt_int8/version_0  ->  tensorboard --logdir runs

    A resumed fit says ``steps 400 -> 1000`` (its seconds are of those steps). Metrics are the scalars in
    ``trainer.callback_metrics`` (the last logged values). State memory is
    :func:`~lightning_qstate.optim.state_summary` over ``trainer.strategy.optimizers``, summed over ranks
    (per-element states only; scalars such as Adam's ``step`` are left out). The logs and the report command name the
    first TensorBoard logger's folder (the report reads its event files), else ``trainer.log_dir`` (no line without a
    logger). The summary is also kept in ``self.summary`` (a dict) for scripts and tests. Step paths are the quantized
    optimizers' ``step_paths()`` (``kernels.dispatch``) on rank 0: how many parameters took each path at the last step.

    Where some parameter has a weight grid (``weights=``, ``error_feedback=``: training without fp32 master weights),
    one more line counts those parameters and their values (full shapes) per weight format, the bytes they take (their
    dtype's; summed over ranks, as the states) against what the packed format would take
    (``WeightGrid.packed_nbytes``: codes and scales), and the ``error_feedback`` and ``weight_rounding`` modes.
    """

    def __init__(self) -> None:
        self.summary: dict[str, Any] = {}
        self._start: float | None = None
        self._first_step: int | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()
        self._first_step = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_step = trainer.global_step  # a resumed fit's: restored after on_fit_start

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        local = [0, 0, 0, 0, 0]
        formats: dict[str, Counter] = {}
        paths: Counter = Counter()
        weights = WeightTally()
        for optimizer in trainer.strategy.optimizers:
            if isinstance(optimizer, QuantizedStates):
                paths.update(optimizer.step_paths().values())
                weights.add(optimizer)
            summary = state_summary(optimizer)
            local[0] += summary["bytes"]
            local[1] += summary["values"]
            local[2] += summary["fp32_bytes"]
            for state in optimizer.state.values():
                for name, value in state.items():
                    if isinstance(value, QuantizedTensor):
                        formats.setdefault(name, Counter())[value.format.name] += 1
                    elif isinstance(value, torch.Tensor) and value.ndim > 0:
                        formats.setdefault(name, Counter())[plain_state_name(value.dtype)] += 1
        local[3:] = [weights.held_bytes, weights.packed_bytes]
        totals = trainer.strategy.reduce(torch.tensor(local, dtype=torch.float64, device=trainer.strategy.root_device), reduce_op="sum")
        stored, values, fp32_bytes, weight_bytes, packed_weight_bytes = (float(t) for t in totals)
        metrics = {
            key: float(value)
            for key, value in sorted(trainer.callback_metrics.items())
            if isinstance(value, torch.Tensor) and value.numel() == 1
        }
        tensorboard = next((logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)), None)
        self.summary = {
            "seconds": time.perf_counter() - self._start if self._start is not None else None,
            "steps": trainer.global_step,
            # a fit resumed at max_steps runs no training (no on_train_start): it starts and ends at the restored step
            "first_step": trainer.global_step if self._first_step is None else self._first_step,
            "metrics": metrics,
            "optimizers": [type(optimizer).__name__ for optimizer in trainer.strategy.optimizers],
            "state_bytes": stored,
            "fp32_state_bytes": fp32_bytes,
            "bits_per_value": 8 * stored / values if values else 0.0,
            "state_formats": {name: dict(counts) for name, counts in formats.items()},
            "step_paths": dict(paths),
            "weight_formats": {name: dict(counts) for name, counts in sorted(weights.formats.items())},
            "weight_bytes": weight_bytes,
            "packed_weight_bytes": packed_weight_bytes,
            "error_feedback": sorted(weights.feedback, key=str),
            "weight_rounding": sorted(weights.rounding),
            # the report reads TensorBoard's event files: its logger's folder, wherever it is among the loggers (trainer.log_dir
            # is the first logger's: a CSVLogger's has none)
            "log_dir": tensorboard.log_dir if tensorboard is not None else trainer.log_dir if trainer.loggers else None,
            "tensorboard_dir": tensorboard.save_dir if tensorboard is not None else None,
            "monitors": monitor_lines(trainer),
        }
        if trainer.is_global_zero:
            print(self.format(), flush=True)

    def format(self) -> str:
        """The summary as printed."""
        s = self.summary
        seconds = f"{s['seconds']:.1f} s, " if s["seconds"] is not None else ""
        first = s.get("first_step", 0)
        steps = f"steps {first} -> {s['steps']}" if first else f"{s['steps']} steps"  # a resumed fit: its seconds are of its steps
        lines = [f"== lightning_qstate run summary ({seconds}{steps}) =="]
        shown = {key: value for key, value in s["metrics"].items() if not key.startswith("qstate/")}  # the callbacks' lines say those
        lines.append("metrics: " + ("  ".join(f"{key}={value:.4g}" for key, value in shown.items()) or "(none logged)"))
        stored, fp32 = s["state_bytes"], s["fp32_state_bytes"]
        if fp32:
            lines.append(
                f"optimizer states: {stored / 1e6:.3f} MB vs {fp32 / 1e6:.3f} MB in fp32 ({100 * stored / fp32:.1f} %, "
                f"{s['bits_per_value']:.2f} bits/value, {100 * (1 - stored / fp32):.1f} % saved) [{', '.join(s['optimizers'])}]"
            )
            per_state = (
                f"{name}: " + ", ".join(f"{fmt} x{count}" for fmt, count in sorted(counts.items()))
                for name, counts in s["state_formats"].items()
            )
            lines.append("  state formats: " + " | ".join(per_state))
            if s["step_paths"]:
                taken = ", ".join(f"{path} x{count}" for path, count in sorted(s["step_paths"].items()))
                lines.append(f"  step paths: {taken} (rank 0, last step)")
        else:
            lines.append(f"optimizer states: none held [{', '.join(s['optimizers']) or 'no optimizer'}]")
        if s.get("weight_formats"):
            counts = ", ".join(
                f"{name} x{entry['params']} ({entry['values'] / 1e6:.3f} M values)" for name, entry in s["weight_formats"].items()
            )
            modes = ", ".join(f"error_feedback={mode}" for mode in s["error_feedback"])
            lines.append(
                f"weights without master copy: {counts}: {s['weight_bytes'] / 1e6:.3f} MB held, "
                f"{s['packed_weight_bytes'] / 1e6:.3f} MB packed [{modes}, {', '.join(s['weight_rounding'])}]"
            )
        lines += s.get("monitors", [])
        if s["tensorboard_dir"] is not None:
            lines.append(f"TensorBoard logs: {s['log_dir']}  ->  tensorboard --logdir {s['tensorboard_dir']}")
            lines.append(f"report: lightning-qstate report {s['log_dir']}  (report.png, report.html)")
        elif s["log_dir"] is not None:
            lines.append(f"logs: {s['log_dir']}")
        return "\n".join(lines)


def monitor_lines(trainer: pl.Trainer) -> list[str]:
    """What this library's monitoring callbacks in ``trainer`` saw, a line each: the last stall rates, measured against
    predicted (``StallMonitor``); the resets, or why none fired (``StateResetScheduler``); the adaptive plan
    (``AdaptiveBitWidth``); the last probe (``QuantizationProbe``); the advisor's verdicts (``PrecisionAdvisor``)."""
    from .adaptive_bits import AdaptiveBitWidth
    from .precision_advisor import PrecisionAdvisor
    from .quantization_probe import QuantizationProbe
    from .stall_monitor import StallMonitor
    from .state_reset import StateResetScheduler

    lines = []
    for callback in trainer.callbacks:
        if isinstance(callback, StallMonitor) and callback.last_rates:
            rates = callback.last_rates
            states = [tag.rsplit("/", 1)[1] for tag in rates if tag.startswith("qstate/stall/")]
            lines.append(
                "stalled updates (last measurement, measured / predicted): "
                + ", ".join(f"{state} {rates[f'qstate/stall/{state}']:.3f} / {predicted(rates, state)}" for state in states)
            )
        elif isinstance(callback, StateResetScheduler):
            lines.append(reset_line(callback, trainer))
        elif isinstance(callback, AdaptiveBitWidth) and callback.planner is not None:
            metrics = callback.metrics()
            formats = planned_formats(callback.planner)
            target = metrics.get("qstate/adaptive/target_bits")
            zones = ", ".join(f"{key.rsplit('_', 1)[1]} x{int(value)}" for key, value in metrics.items() if "/zone_" in key and value)
            kept = max((sum(counts.pop(name) for name in [n for n in counts if kept_plain(n)]) for counts in formats.values()), default=0)
            lines.append(
                f"adaptive bit-widths: {metrics['qstate/adaptive/avg_bits']:.3f} bits per state value"
                + (f" (target {target:g})" if target is not None else "")
                + f", {int(metrics['qstate/adaptive/transitions'])} re-encodings; "
                + " | ".join(
                    f"{state}: " + ", ".join(f"{name} x{count}" for name, count in sorted(counts.items()))
                    for state, counts in formats.items()
                )
                + (f" (+{kept} small layers kept plain)" if kept else "")
                + (f"; zones: {zones}" if zones else "")
            )
        elif isinstance(callback, QuantizationProbe) and callback.history:
            last = callback.history[-1]
            lines.append(
                f"quantization probe (step {last.step}, {callback.weights or 'fp'} weights, {callback.activations or 'fp'} activations): "
                f"loss {last.loss:.4f} -> {last.ptq_loss:.4f} under PTQ ({last.ptq_loss_increase:+.4f}), R_L {last.R_L:.3g}"
            )
        elif isinstance(callback, PrecisionAdvisor) and callback.reports:
            several = len(callback.reports) > 1  # each entry names its optimizer
            verdicts = ", ".join(
                f"{f'{label} ' if several else ''}group {row.group} {row.component} {row.format}: {row.verdict}"
                for label, report in callback.labelled_reports()
                for row in report.risky
            )
            lines.append(f"precision advisor: {verdicts or 'every component has the bits this run needs'}")
    return lines


def predicted(rates: dict[str, float], state: str) -> str:
    """The theory's stall rate of ``state`` in a ``StallMonitor``'s ``last_rates``; the weights (and plain states) have none."""
    value = rates.get(f"qstate/stall_predicted/{state}")
    return "(no prediction)" if value is None else f"{value:.3f}"


def planned_formats(planner) -> dict[str, Counter]:
    """``{state: Counter(format name)}`` the planner's adapted layers are stored in (``Layer.plain_name``, ``"fp32"`` or
    ``"bf16 (plain)"``: kept plain by ``min_quant_size``)."""
    formats: dict[str, Counter] = {}
    for layer in planner.layers:
        if layer.pinned is None and layer.choice is not None:
            for state, name, stored in zip(ADAPTED_STATES, layer.choice, layer.stored_formats(layer.choice), strict=False):
                formats.setdefault(state, Counter())[name if stored is not None else layer.plain_name] += 1
    return formats


def reset_line(scheduler, trainer: pl.Trainer) -> str:
    """How many layer resets ``scheduler`` made, and when; if none, why (each layer's period against the run's steps)."""
    if scheduler.history:
        steps = sorted({step for step, _ in scheduler.history})
        shown = ", ".join(map(str, steps[:8])) + (", ..." if len(steps) > 8 else "")
        line = f"state resets: {len(scheduler.history)} layer resets after optimizer steps {shown}"
        reset = {layer for _, layer in scheduler.history}
        waiting = [scheduler.layer_period(rows) for layer, rows in scheduler.layers(trainer).items() if layer not in reset]
        periods = sorted({period for period in waiting if period is not None})
        reasons = [f"period {', '.join(map(str, periods))} > run {trainer.global_step} steps"] if periods else []
        if None in waiting:  # no period: the formats need none, or only the threshold resets
            below = f"measured stall rates under threshold={scheduler.threshold:g}" if scheduler.threshold is not None else ""
            reasons.append(below if scheduler.period is None else ", ".join(filter(None, ["formats that need no resets", below])))
        if waiting:
            line += f"; {len(waiting)} layer{'s' if len(waiting) > 1 else ''} never reset ({'; '.join(reasons)})"
        return line
    periods = [scheduler.layer_period(rows) for rows in scheduler.layers(trainer).values()]
    periods = [period for period in periods if period is not None]
    if scheduler.threshold is not None:
        return f"state resets: none fired (no layer's measured stall rate reached threshold={scheduler.threshold:g})"
    if not periods:
        return "state resets: none fired (no quantized state whose format and decay call for resets; theory.reset_period is None)"
    return f"state resets: none fired: the run took {trainer.global_step} steps, the shortest reset period is {min(periods)} steps"


class WeightTally:
    """The parameters that have a weight grid (``QuantizedStates.weight_grid``), per format: how many and their values
    (full shapes: rank-independent), with the local bytes they hold and would take packed, and the modes used."""

    def __init__(self) -> None:
        self.formats: dict[str, Counter] = {}
        self.held_bytes = self.packed_bytes = 0
        self.feedback: set[str | None] = set()
        self.rounding: set[str] = set()

    def add(self, optimizer: QuantizedStates) -> None:
        full_numels = optimizer.__dict__.get("full_numels", {})
        for group in optimizer.param_groups:
            for key in group["params"]:
                grid = optimizer.weight_grid(group, key)
                if grid is None:
                    continue
                param = local_tensor(key)
                counts = self.formats.setdefault(grid.name, Counter())
                counts["params"] += 1
                counts["values"] += full_numels.get(key, key.numel())  # a DTensor's numel() is the full parameter's
                self.held_bytes += param.nbytes
                self.packed_bytes += grid.packed_nbytes(param.shape)
                self.feedback.add(group["error_feedback"])
                self.rounding.add(group["weight_rounding"])
