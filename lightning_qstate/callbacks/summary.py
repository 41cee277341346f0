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

from ..formats import QuantizedTensor
from ..optim import QuantizedStates, state_summary
from ..optim.base import local_tensor

PLAIN_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # plain (unquantized) state tensors


class RunSummary(Callback):
    """At the end of ``fit``, print (on global rank 0) a few lines such as::

        == lightning_qstate run summary (612.3 s, 1000 steps) ==
        metrics: train_loss=1.532  val_loss=1.498
        optimizer states: 0.85 MB vs 3.37 MB in fp32 (25.3 %, 8.09 bits/value, 74.7 % saved) [QAdamW]
          state formats: exp_avg: fp32 x34, int8 x18 | exp_avg_sq: fp32 x34, int8 x18
          step paths: native x52 (rank 0, last step)
        weights without master copy: fp8_e4m3 x16 (0.786 M values): 3.146 MB held, 0.800 MB packed [error_feedback=eco, stochastic]
        TensorBoard logs: runs/gpt_int8/version_0  ->  tensorboard --logdir runs

    Metrics are the scalars in ``trainer.callback_metrics`` (the last logged values). State memory is
    :func:`~lightning_qstate.optim.state_summary` over ``trainer.strategy.optimizers``, summed over ranks
    (per-element states only; scalars such as Adam's ``step`` are left out). The summary is also kept in
    ``self.summary`` (a dict) for scripts and tests. Step paths are the quantized optimizers' ``step_paths()``
    (``kernels.dispatch``) on rank 0: how many parameters took each path at the last step.

    Where some parameter has a weight grid (``weights=``, ``error_feedback=``: training without fp32 master weights),
    one more line counts those parameters and their values (full shapes) per weight format, the bytes they take (their
    dtype's; summed over ranks, as the states) against what the packed format would take
    (``WeightGrid.packed_nbytes``: codes and scales), and the ``error_feedback`` and ``weight_rounding`` modes.
    """

    def __init__(self) -> None:
        self.summary: dict[str, Any] = {}
        self._start: float | None = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = time.perf_counter()

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
                        formats.setdefault(name, Counter())[PLAIN_NAMES.get(value.dtype, str(value.dtype).removeprefix("torch."))] += 1
        local[3:] = [weights.held_bytes, weights.packed_bytes]
        totals = trainer.strategy.reduce(torch.tensor(local, dtype=torch.float64, device=trainer.strategy.root_device), reduce_op="sum")
        stored, values, fp32_bytes, weight_bytes, packed_weight_bytes = (float(t) for t in totals)
        metrics = {
            key: float(value)
            for key, value in sorted(trainer.callback_metrics.items())
            if isinstance(value, torch.Tensor) and value.numel() == 1
        }
        self.summary = {
            "seconds": time.perf_counter() - self._start if self._start is not None else None,
            "steps": trainer.global_step,
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
            "log_dir": trainer.log_dir,
            "tensorboard_dir": next((logger.save_dir for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)), None),
        }
        if trainer.is_global_zero:
            print(self.format(), flush=True)

    def format(self) -> str:
        """The summary as printed."""
        s = self.summary
        seconds = f"{s['seconds']:.1f} s, " if s["seconds"] is not None else ""
        lines = [f"== lightning_qstate run summary ({seconds}{s['steps']} steps) =="]
        lines.append("metrics: " + ("  ".join(f"{key}={value:.4g}" for key, value in s["metrics"].items()) or "(none logged)"))
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
        if s["tensorboard_dir"] is not None:
            lines.append(f"TensorBoard logs: {s['log_dir']}  ->  tensorboard --logdir {s['tensorboard_dir']}")
        elif s["log_dir"] is not None:
            lines.append(f"logs: {s['log_dir']}")
        return "\n".join(lines)


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
