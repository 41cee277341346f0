"""Log how often quantized optimizer states stall, measured in the step, next to the theory's prediction."""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_warn

from ..arguments import check_flags, is_positive_int
from ..formats import BlockFormat, QuantizedTensor
from ..optim import QuantizedStates
from ..optim.base import local_tensor
from ..theory import moment_of, stall_probability, state_decay, state_input
from ..theory.stall import RUNNING_MAXIMA
from .stall_counts import MeasuredSteps, StallMeasurement, StateRow, across_ranks, optimizer_steps, quantized_optimizers, state_rows
from .state_reset import StateResetScheduler
from .tensorboard import log_scalars, write_layout

MAX_RATIOS = 65536  # measured ratios per state that a prediction uses
MAX_PREDICTIONS = 4096  # cached predictions of all-zero states (one per format, decay, rounding, moment and age)


class StallMonitor(Callback):
    """Measure the stall rate of every quantized optimizer state, per layer and per state, and log it with the prediction.

    An entry *stalls* on a step when the fp32 update moved it but its stored code stayed put
    (:func:`lightning_qstate.formats.count_stalls`). Every ``log_every_n_steps`` optimizer steps the monitor
    has the optimizers count that during the step that completes the interval (no copies of the states are
    kept, and the other steps pay nothing), sums the counts over ranks, and logs from rank 0 (steps of each
    optimizer: under manual optimization with several, each is measured on every ``log_every_n_steps``-th of its own
    steps, and a layer's age counts its optimizer's steps):

    - ``qstate/stall/<state>/<layer>``: the measured rate of one parameter's state (``per_layer``);
    - ``qstate/stall_predicted/<state>/<layer>``: :func:`lightning_qstate.theory.stall_probability` for its
      format, decay (``β1``/``β2``/momentum) and rounding on the measured step, given how large that step's
      inputs are against the states: the measured ratios ``g²/v`` (second moments) or ``g/m`` (first) of the layer's
      moving entries (``v``, ``m`` before the step, ``g`` the gradient the optimizer receives, after the Trainer's
      clipping; at most ``MAX_RATIOS`` of them, sampled) replace the theory's Gaussian gradients (``ratios=``).
      Only the format's gaps, the rounding and the block-scale drift are then modelled. This follows what the
      Gaussian model cannot: gradients that shrink as training goes (``v`` lags them), entries whose gradient is
      zero or unusually small on a step (an embedding's rows: they only decay and stall at the steady-state rate
      from the first steps), and each layer's own reset times. So the prediction
      climbs as a state ages and drops after every reset, as the measured rate does. The code gaps are weighted
      by the stored state's own code occupancy (``values=``): the format-only model assumes an occupancy that
      heavy-tailed states do not have, and no subnormals (an fp16 ``v`` of gradients under about 8e-3 is mostly
      subnormal, with far coarser gaps);
    - ``qstate/stall/<state>`` and ``qstate/stall_predicted/<state>``: the same over the whole model (all
      stalled over all moved entries; the prediction weighted alike);
    - ``qstate/stall_resets``: the fraction of layers a :class:`~lightning_qstate.callbacks.StateResetScheduler`
      zeroed since the previous measurement (where one is among the callbacks), so resets show on the same steps;
    - a TensorBoard histogram ``qstate/stall/<state>/layers`` of the per-layer rates (``histograms``).

    To TensorBoard every tag goes with a description, and the "Custom Scalars" tab gets one chart per state with
    the measured rate, the prediction and the resets together (and one per layer with ``per_layer``).

    Where an optimizer's ``track_weight_stalls`` is on (``PrecisionAdvisor`` turns it on for the fit), the parameters
    themselves are measured too, as the pseudo-state ``weights``
    (:data:`~lightning_qstate.optim.WEIGHT_STALLS`): ``qstate/stall/weights/<layer>`` and ``qstate/stall/weights`` are
    the fractions of entries whose update (in float64; fp32 on a weight grid) moved them but whose stored value did
    not change, lost to rounding into the parameter's dtype or weight grid (``weights=``). They have no prediction;
    nor has AMSGrad's ``max_exp_avg_sq`` (a running maximum of ``exp_avg_sq``, not an EMA the theory models: measured only).
    Plain (fp32) states are not measured. The optimizers must have quantized states: use this callback with
    :class:`~lightning_qstate.plugins.QStatePrecision` or after
    :class:`~lightning_qstate.callbacks.QuantizedOptimizerStates`.

    Example::

        trainer = Trainer(plugins=[QStatePrecision(states="bf16")],
                          callbacks=[StallMonitor(log_every_n_steps=50)],
                          logger=TensorBoardLogger("runs"))

    Args:
        log_every_n_steps: optimizer steps between measurements; default: the Trainer's ``log_every_n_steps`` (its 0, logging
            off, turns the measurements off too).
        per_layer: also log a scalar per layer and state (off by default: a model has many; the histograms show
            the per-layer spread).
        histograms: log histograms of the per-layer rates to TensorBoard loggers.

    Raises:
        ValueError: if ``log_every_n_steps`` is not a positive int.
    """

    def __init__(self, log_every_n_steps: int | None = None, per_layer: bool = False, histograms: bool = True) -> None:
        if log_every_n_steps is not None and not is_positive_int(log_every_n_steps):
            raise ValueError(f"StallMonitor: log_every_n_steps={log_every_n_steps!r} must be a positive int, or None for the Trainer's")
        check_flags("StallMonitor", per_layer=per_layer, histograms=histograms)
        self.log_every_n_steps = log_every_n_steps
        self.per_layer = per_layer
        self.histograms = histograms
        self._predictions: dict[tuple, float] = {}  # (format, decay, rounding, moment, age) -> prediction, at most MAX_PREDICTIONS
        self._measured = MeasuredSteps()
        self._measured_steps: dict[QuantizedStates, int] = {}  # optimizer -> its steps done once its measured step has run
        self._previous_measured_steps: dict[QuantizedStates, int] = {}  # optimizer -> its measured step before
        self._last_resets: dict[str, int] = {}  # layer -> its optimizer's step of its last reset, as of the measured step
        self._ratios: dict[tuple[str, str], torch.Tensor] = {}  # (layer, state) -> the measured step's g²/v or g/m
        self.last_rates: dict[str, float] = {}  # the last measurement's model-wide qstate/stall* scalars (RunSummary reads them)

    def interval(self, trainer: pl.Trainer) -> int:
        """Optimizer steps between measurements; 0: none (the Trainer's logging is off and no interval was given)."""
        return self.log_every_n_steps or trainer.log_every_n_steps

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not quantized_optimizers(trainer):
            rank_zero_warn(
                "StallMonitor: no optimizer has quantized states, so there is nothing to measure. Add "
                "QStatePrecision to the Trainer's plugins, or QuantizedOptimizerStates to its callbacks."
            )
        interval = self.interval(trainer)  # a resumed run: the last measurement before the checkpoint (resets since count)
        steps = {optimizer: optimizer_steps(trainer, optimizer) for optimizer in quantized_optimizers(trainer)}
        self._previous_measured_steps = {optimizer: step - step % interval if interval else step for optimizer, step in steps.items()}
        self._measured = MeasuredSteps()
        if trainer.is_global_zero:
            write_layout(trainer)

    def tensorboard_charts(self, trainer: pl.Trainer) -> dict[str, dict[str, list[str]]]:
        """Custom-scalars charts: per state, measured and predicted rates with the resets; per layer with ``per_layer``."""
        rows = [row for row in state_rows(trainer) if _logged(row)]
        resets = ["^qstate/stall_resets$"] if any(isinstance(callback, StateResetScheduler) for callback in trainer.callbacks) else []
        charts = {"qstate: stall rates (measured, predicted, resets)": {
            f"{state}": [f"^qstate/stall/{re.escape(state)}$", f"^qstate/stall_predicted/{re.escape(state)}$", *resets]
            for state in dict.fromkeys(row.state for row in rows)
        }}  # fmt: skip
        if self.per_layer:
            charts["qstate: stall rates per layer"] = {
                f"{row.state} {row.layer}": [f"^qstate/stall(_predicted)?/{re.escape(row.state)}/{re.escape(row.layer)}$"] for row in rows
            }
        return charts

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        first = not self._measured.pending
        if not self._measured.request(trainer, optimizer, self.interval(trainer)):
            return
        if first:  # the batch's first measured optimizer
            schedulers = [callback for callback in trainer.callbacks if isinstance(callback, StateResetScheduler)]
            self._last_resets = {layer: step for scheduler in schedulers for layer, step in scheduler.last_reset.items()}
            self._ratios = {}
        self._measured_steps[optimizer] = optimizer_steps(trainer, optimizer) + 1
        self._ratios.update(measured_ratios(trainer, optimizer))

    def age(self, row: StateRow) -> int:
        """Optimizer steps ``row``'s state has taken since it was zeroed, counting the measured step (a negative
        ``last_reset``, a staggered schedule's phase before its first reset, counts from the start)."""
        return max(1, self._measured_steps.get(row.optimizer, 0) - max(self._last_resets.get(row.layer, 0), 0))

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        collected = self._measured.collect(trainer)
        if collected is None:
            return
        predictions = self.predictions(trainer, *collected)  # a collective: every rank
        if trainer.is_global_zero:
            write_layout(trainer)  # a wrapped optimizer's states (and their charts) appear at its first step
            self._log(trainer, *collected, predictions)

    def predictions(self, trainer: pl.Trainer, measurement: StallMeasurement, optimizers: Collection[QuantizedStates]) -> dict[int, float]:
        """``{row index: prediction}`` of the measured rows: each rank predicts from the entries it holds (its shard's ratios
        and stored values), weighted by the entries that moved there, summed over ranks (a collective: every rank)."""
        local = measurement.local if measurement.local is not None else measurement.counts
        sums = torch.zeros(len(measurement.rows), 2, dtype=torch.float64)  # [prediction * moved, moved]
        for index, (row, (_, moved)) in enumerate(zip(measurement.rows, local.tolist(), strict=True)):
            if moved and row.optimizer in optimizers and (prediction := self.predicted(row, self.age(row))) is not None:
                sums[index] = torch.tensor([prediction * moved, moved], dtype=torch.float64)
        return {index: weighted / moved for index, (weighted, moved) in enumerate(across_ranks(trainer, sums, "sum").tolist()) if moved}

    def predicted(self, row: StateRow, age: int | None = None) -> float | None:
        """The prediction for ``row``'s format, decay and rounding at ``age`` steps since it was zeroed (``None``: the
        steady state); block-scaled formats weighted by the stored state's code occupancy (where it is not all zero).
        ``None`` for plain states, unknown decays, running maxima (AMSGrad's ``max_exp_avg_sq``) and the weights' row."""
        fmt, beta = row.format, state_decay(row.group, row.state)
        if fmt is None or beta is None or row.state in RUNNING_MAXIMA:
            return None
        rounding, moment = row.group["rounding"], moment_of(row.state)
        ratios = self._ratios.get((row.layer, row.state))
        stored = row.optimizer.state.get(row.param, {}).get(row.state)
        values = stored if isinstance(stored, QuantizedTensor) and _occupied(stored) else None  # all zero: no occupancy to weight by
        if ratios is not None or values is not None:
            timing = {"ratios": ratios} if ratios is not None else {"age": age}
            return stall_probability(fmt, beta, rounding, moment=moment, values=values, **timing)
        key = (fmt, beta, rounding, moment, age)
        if key not in self._predictions:
            if len(self._predictions) >= MAX_PREDICTIONS:  # ages grow every step, cycled decays change: drop the oldest
                del self._predictions[next(iter(self._predictions))]
            self._predictions[key] = stall_probability(fmt, beta, rounding, moment=moment, age=age)
        return self._predictions[key]

    def metrics(
        self,
        measurement: StallMeasurement,
        optimizers: Collection[QuantizedStates] | None = None,
        predictions: dict[int, float] | None = None,
    ) -> tuple[dict[str, float], dict[str, list[float]]]:
        """``(scalars, per-layer rates by state)`` of one measurement, of the states of ``optimizers`` (default: all), with
        ``predictions`` by row index (default: this rank's, :meth:`predicted`)."""
        scalars: dict[str, float] = {}
        per_state: dict[str, list[float]] = {}
        totals: dict[str, list[float]] = {}  # state -> [stalled, moved, predicted * moved, moved with a prediction]
        for index, (row, (stalled, moved)) in enumerate(zip(measurement.rows, measurement.counts.tolist(), strict=False)):
            if moved == 0 or (optimizers is not None and row.optimizer not in optimizers):
                continue
            rate = stalled / moved
            prediction = self.predicted(row, self.age(row)) if predictions is None else predictions.get(index)
            per_state.setdefault(row.state, []).append(rate)
            total = totals.setdefault(row.state, [0.0, 0.0, 0.0, 0.0])
            total[0] += stalled
            total[1] += moved
            if self.per_layer:
                scalars[f"qstate/stall/{row.state}/{row.layer}"] = rate
            if prediction is not None:
                total[2] += prediction * moved
                total[3] += moved
                if self.per_layer:
                    scalars[f"qstate/stall_predicted/{row.state}/{row.layer}"] = prediction
        for state, (stalled, moved, weighted, predicted_moved) in totals.items():
            scalars[f"qstate/stall/{state}"] = stalled / moved
            if predicted_moved:
                scalars[f"qstate/stall_predicted/{state}"] = weighted / predicted_moved
        return scalars, per_state

    def reset_fraction(self, trainer: pl.Trainer, optimizers: Collection[QuantizedStates]) -> float | None:
        """Fraction of the layers of ``optimizers`` reset since their previous measured step and before this one (a reset
        after step ``s`` first acts on step ``s + 1``); ``None`` without a StateResetScheduler."""
        schedulers = [callback for callback in trainer.callbacks if isinstance(callback, StateResetScheduler)]
        windows = {
            layer: range(self._previous_measured_steps.get(rows[0].optimizer, 0), self._measured_steps[rows[0].optimizer])
            for scheduler in schedulers
            for layer, rows in scheduler.layers(trainer).items()
            if rows[0].optimizer in optimizers
        }
        if not windows:
            return None
        resets = {layer for scheduler in schedulers for step, layer in scheduler.history if step in windows.get(layer, ())}
        return len(resets) / len(windows)

    def _log(
        self, trainer: pl.Trainer, measurement: StallMeasurement, optimizers: list[QuantizedStates], predictions: dict[int, float]
    ) -> None:
        scalars, per_state = self.metrics(measurement, optimizers, predictions)
        resets = self.reset_fraction(trainer, optimizers)
        self._previous_measured_steps.update({optimizer: self._measured_steps[optimizer] for optimizer in optimizers})
        if not scalars:
            return
        if resets is not None:
            scalars["qstate/stall_resets"] = resets
        self.last_rates = {tag: value for tag, value in scalars.items() if tag.count("/") <= 2}
        step = trainer.fit_loop.epoch_loop._batches_that_stepped
        log_scalars(trainer, scalars, step)
        for logger in trainer.loggers:
            if self.histograms and isinstance(logger, TensorBoardLogger):
                for state, rates in per_state.items():
                    logger.experiment.add_histogram(f"qstate/stall/{state}/layers", torch.tensor(rates), global_step=step)


def measured_ratios(trainer: pl.Trainer, optimizer: QuantizedStates | None = None) -> dict[tuple[str, str], torch.Tensor]:
    """``{(layer, state): ratios}`` of every quantized EMA state this rank holds (of ``optimizer``; default: all optimizers),
    before the step about to run: per
    moving entry (state or input not zero), ``x/s`` (:func:`~lightning_qstate.theory.state_input`: ``g²/v`` for Adam's
    second moment, ``g/m`` for its first), ``inf`` where the state is zero, with the gradients as the optimizer will
    see them (the Trainer's norm or value clipping applied); states not yet created, empty shards and states without
    a moving entry are left out."""
    clip, algorithm = trainer.gradient_clip_val, trainer.gradient_clip_algorithm
    by_norm = clip and getattr(algorithm, "value", algorithm) in ("norm", None)
    optimizers = quantized_optimizers(trainer) if optimizer is None else [optimizer]
    norms = {id(opt): _gradient_norm(opt) for opt in optimizers} if by_norm else {}  # collectives: before any row is skipped
    ratios = {}
    for row in state_rows(trainer):
        if optimizer is not None and row.optimizer is not optimizer:
            continue
        stored = row.optimizer.state.get(row.param, {}).get(row.state) if row.is_state else None
        grad = row.param.grad
        if stored is None or grad is None:
            continue
        values = (stored.dequantize() if isinstance(stored, QuantizedTensor) else stored).float().reshape(-1)
        grad = local_tensor(grad).float().reshape(-1)
        if values.numel() == 0 or grad.numel() != values.numel():
            continue
        if by_norm:
            grad = grad * min(1.0, float(clip) / (norms[id(row.optimizer)] + 1e-6))
        elif clip:
            grad = grad.clamp(-float(clip), float(clip))
        param = local_tensor(row.param).detach().float().reshape(-1)
        inputs = state_input(row.group, row.state, grad, param, row.optimizer.state[row.param])
        moving = (inputs != 0) | (values != 0) if inputs is not None else None
        if moving is None or not bool(moving.any()):
            continue
        inputs, values = inputs[moving], values[moving]
        if inputs.numel() > MAX_RATIOS:  # a uniform sample bounds the cost: the rate's sampling error is ~0.2 points
            sample = torch.randint(inputs.numel(), (MAX_RATIOS,), generator=torch.Generator().manual_seed(0)).to(inputs.device)
            inputs, values = inputs[sample], values[sample]
        ratios[row.layer, row.state] = torch.where(values != 0, inputs / values, torch.inf)
    return ratios


def _gradient_norm(optimizer: QuantizedStates) -> float:
    """The 2-norm of ``optimizer``'s gradients, as the Trainer's norm clipping takes it: of the full tensors, every rank's
    shards together where the parameters are shards (a collective there)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    start = torch.zeros((), device=local_tensor(params[0]).device) if params else torch.zeros(())
    square = sum((local_tensor(p.grad).float().square().sum() for p in params if p.grad is not None), start)
    if optimizer.holds_shards():
        dist.all_reduce(square)
    return float(square.sqrt())


def _occupied(stored: QuantizedTensor) -> bool:
    """Whether ``stored`` holds a nonzero value (a block format: a nonzero scale)."""
    return bool(stored.numel) and bool((stored.scales if isinstance(stored.format, BlockFormat) else stored.codes).any())


def _logged(row: StateRow) -> bool:
    """Whether ``row`` gets rates in this fit: a quantized state that exists (AMSGrad's maximum only with
    ``amsgrad``), or the weights where the optimizer counts them."""
    if not row.is_state:
        return bool(row.optimizer.track_weight_stalls)
    return row.format is not None and (row.state != "max_exp_avg_sq" or bool(row.group.get("amsgrad")))
