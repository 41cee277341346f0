"""Advise, before training starts, how many mantissa bits each component of the planned run needs, and log the weights'
own stall rate while it trains (arXiv 2510.21314; ``docs/algorithms.md``, "Precision advisor")."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from ..arguments import ConfigurationError, check_flags, is_positive_int
from ..optim import WEIGHT_STALLS, QuantizedStates, clean_parameter_name
from ..theory.precision import AdviceRow, PrecisionReport, advise, check_constants
from .stall_counts import MeasuredSteps, StallMeasurement, quantized_optimizers
from .tensorboard import log_scalars

ADVICE_TAG = "qstate/precision_advice"  # TensorBoard text tag of the report ("/<optimizer index>" appended with several optimizers)
WEIGHT_STALL_TAG = "qstate/weight_stall"  # model-wide rate; "/<layer>" per layer

# Gradient dtype of Lightning's precision settings where it differs from the parameters' (None: the parameter's dtype).
_HALF_GRADIENTS = {"16-true": "fp16", "bf16-true": "bf16"}
_FSDP_GRADIENTS = {"16-true": "fp16", "16-mixed": "fp16", "bf16-true": "bf16", "bf16-mixed": "bf16"}  # FSDP's reduce_dtype


class PrecisionAdvisor(Callback):
    """Check, before the first training step, whether each optimizer component has the mantissa bits the run needs.

    At the start of training the planned number of optimizer steps ``T`` (``steps``, else the Trainer's
    ``estimated_stepping_batches``: ``max_steps`` or ``max_epochs`` epochs, whichever ends the run first) goes with
    each of the Trainer's optimizers, their state and weight formats and the run's gradient format to
    :func:`lightning_qstate.theory.precision.advise`: per param group and component (gradients, weights, ``m``, ``v``)
    the bits it has, the bits the T-scaling rule asks for, the stall ratchet of states written round-to-nearest, and a
    learning rate too small to move the stored weights. The report is

    - printed on global rank 0 (``verbose``) and kept in :attr:`reports` (one per advised optimizer);
    - logged as markdown text ``qstate/precision_advice`` to every TensorBoard logger;
    - one warning per component at risk (verdict ``"marginal"`` or ``"insufficient"``), with its reasons and remedies;
    - with ``strict=True``, a ``ValueError`` listing the ``"insufficient"`` components, raised on every rank before any
      step. ``"marginal"`` ones (short of the rule by at most one bit, its accuracy near the calibrated horizon; or a
      block-scaled state that follows its block's scale down) only warn: the library's default int8 states are marginal
      where ``v`` written RN has a ratchet, and train well.

    The check runs in ``on_train_start``: after :class:`~lightning_qstate.callbacks.QuantizedOptimizerStates` converted
    the optimizers (in ``on_fit_start``) and after a checkpoint was restored. It runs again, at the step they change,
    for an optimizer whose state formats change during training (its ``format_changes`` moves: each plan of
    :class:`~lightning_qstate.callbacks.AdaptiveBitWidth`, whose first check at step 0 replaces the formats it started
    with, and ``reencode_state``): the new report is printed and logged as above, titled with the step, replaces the
    optimizer's entry in :attr:`reports`, warns, and with ``strict=True`` raises at that step. Optimizers with no
    precision rule (other than Adam/AdamW/NAdam/RAdam, SGD, Muon and their quantized forms) are skipped with a warning.

    **Gradient format.** ``"16-true"``/``"bf16-true"`` give fp16/bf16 gradients; under ``FSDPPrecision`` the mixed
    settings too (FSDP reduces them in that dtype); otherwise (``"32-true"``, ``"16-mixed"``, ``"bf16-mixed"``) the
    gradients have the parameters' dtype. A param group with its own ``grads=`` format (gradients quantized before
    the step) is advised on that format.

    **Weight stall rates** (``log_weight_stalls``). Every ``log_every_n_steps`` optimizer steps the quantized
    optimizers count (their ``track_weight_stalls`` is on for the fit), in the step that completes the interval, the
    weight entries whose fp32 update was lost to rounding (the pseudo-state :data:`~lightning_qstate.optim.WEIGHT_STALLS`,
    through the same machinery as :class:`~lightning_qstate.callbacks.StallMonitor`, summed over ranks). Logged from rank 0:
    ``qstate/weight_stall/<layer>`` per parameter (``per_layer``) and ``qstate/weight_stall`` for the whole model
    (all stalled over all moved entries). Only QAdam, QAdamW, QSGD and QMuon count them (also as made by
    ``QStatePrecision`` and ``QuantizedOptimizerStates`` from torch's Adam, AdamW, SGD and Muon), not plain torch
    optimizers nor the generic ``QuantizedOptimizerWrapper``: for those the callback warns once and logs none.

    Example::

        trainer = Trainer(max_steps=3000, plugins=[QStatePrecision("bf16-true", states="bf16")],
                          callbacks=[PrecisionAdvisor(strict=True)], logger=TensorBoardLogger("runs"))
        # raises before training: bf16 v written round-to-nearest can never decrease at β2 = 0.999 (stall ratchet)

    Args:
        steps: the run's planned optimizer steps ``T``; default the Trainer's ``estimated_stepping_batches`` (``max_steps``,
            or ``max_epochs`` times the optimizer steps per epoch where that ends the run first). Needed with several
            optimizers (manual optimization): Lightning's step count then adds up all of theirs, so it tells no one's.
        strict: raise before training when any component is ``"insufficient"``, instead of only warning.
        log_weight_stalls: log the weights' stall rates during training.
        log_every_n_steps: optimizer steps between weight stall measurements; default the Trainer's ``log_every_n_steps``
            (its 0, logging off, turns them off).
        per_layer: log a weight stall rate per parameter (else only the model-wide one).
        constants: ``{(optimizer, component, rounding): c}`` replacing entries of
            :data:`~lightning_qstate.theory.precision.DEFAULT_CONSTANTS` in the rule ``M = slope·log2(T) + c``,
            e.g. ``{("adam", "exp_avg_sq", "nearest"): -13.0}``.
        verbose: print the report on global rank 0.

    Raises:
        ValueError: for invalid arguments; at the start of training, for a run of unknown length (no ``steps``,
            ``max_steps`` or ``max_epochs``, or several optimizers without ``steps``) or, with ``strict=True``,
            ``"insufficient"`` components.
    """

    def __init__(
        self,
        steps: int | None = None,
        strict: bool = False,
        log_weight_stalls: bool = True,
        log_every_n_steps: int | None = None,
        per_layer: bool = True,
        constants: Mapping[tuple[str, str, str], float] | None = None,
        verbose: bool = True,
    ) -> None:
        if steps is not None and not is_positive_int(steps):
            raise ValueError(
                f"PrecisionAdvisor: steps={steps!r} must be a positive int (the run's optimizer steps), or None for the Trainer's"
            )
        if not is_positive_int(log_every_n_steps) and log_every_n_steps is not None:
            raise ValueError(f"PrecisionAdvisor: log_every_n_steps={log_every_n_steps!r} must be a positive int, or None for the Trainer's")
        check_flags("PrecisionAdvisor", strict=strict, log_weight_stalls=log_weight_stalls, per_layer=per_layer, verbose=verbose)
        self.steps = steps
        self.strict = strict
        self.log_weight_stalls = log_weight_stalls
        self.log_every_n_steps = log_every_n_steps
        self.per_layer = per_layer
        self.constants = check_constants(constants, "PrecisionAdvisor")
        self.verbose = verbose
        self.reports: list[PrecisionReport] = []  # this fit's latest reports, one per advised optimizer (rank-local)
        self._advised: list[_Advised] = []  # what each report advised, in the order of ``reports``
        self._steps = 0  # the run's planned length T, the same for every report of the fit
        self._measuring = False
        self._counting: dict[QuantizedStates, bool] = {}  # optimizer -> its track_weight_stalls before the fit
        self._measured = MeasuredSteps()

    def labelled_reports(self) -> list[tuple[str, PrecisionReport]]:
        """``(label, report)`` of each advised optimizer, as the warnings name it (``"optimizer 1 (AdamW)"`` among several)."""
        return [(advised.label, report) for advised, report in zip(self._advised, self.reports, strict=True)]

    def interval(self, trainer: pl.Trainer) -> int:
        """Optimizer steps between weight stall measurements; 0: none (the Trainer's logging is off, no interval given)."""
        return self.log_every_n_steps or trainer.log_every_n_steps

    def planned_steps(self, trainer: pl.Trainer) -> int:
        """The run's length ``T`` in optimizer steps: ``steps``, else the Trainer's ``estimated_stepping_batches`` (``max_steps``
        or ``max_epochs`` times the optimizer steps per epoch, whichever ends the run first)."""
        if self.steps is not None:
            return self.steps
        optimizers = len(trainer.strategy.optimizers)
        if optimizers > 1:  # manual optimization: max_steps and global_step count every optimizer's steps
            raise ConfigurationError(
                f"PrecisionAdvisor: with {optimizers} optimizers (manual optimization) Lightning counts the steps of all of "
                "them (max_steps, global_step) or the batches (max_epochs), not each optimizer's, so no optimizer's own "
                "run length is known; pass PrecisionAdvisor(steps=...), the steps each optimizer takes in the run"
            )
        estimated = trainer.estimated_stepping_batches
        if not math.isfinite(estimated) or estimated < 1:  # infinite training, or an iterable dataset without max_steps
            raise ConfigurationError(
                "PrecisionAdvisor: the run's length is unknown (no max_steps, and max_epochs=-1 or a dataset without a length): "
                "set Trainer(max_steps=...) or Trainer(max_epochs=...), or pass PrecisionAdvisor(steps=...)"
            )
        return int(estimated)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        steps = self.planned_steps(trainer)
        model = trainer.strategy.model if trainer.strategy.model is not None else pl_module
        names = {param: clean_parameter_name(name) for name, param in model.named_parameters()}
        optimizers = [_unwrapped(optimizer) for optimizer in trainer.strategy.optimizers]
        self.reports, self._advised, self._measured, self._steps = [], [], MeasuredSteps(), steps
        for index, optimizer in enumerate(optimizers):
            label = type(optimizer).__name__ if len(optimizers) == 1 else f"optimizer {index} ({type(optimizer).__name__})"
            known = {**optimizer.param_names(), **names} if isinstance(optimizer, QuantizedStates) else names
            advised = _Advised(
                optimizer, label, index if len(optimizers) > 1 else None, known, gradient_format(trainer.precision_plugin, optimizer)
            )
            try:
                self.reports.append(advised.advise(steps, self.constants))
            except TypeError as error:
                rank_zero_warn(f"PrecisionAdvisor: {label} is not advised: {error}")
                continue
            self._advised.append(advised)
        self._announce(trainer, list(range(len(self._advised))))
        counting = [optimizer for optimizer in quantized_optimizers(trainer) if optimizer.counts_weight_stalls]
        self._measuring = self.log_weight_stalls and bool(counting)
        if self._measuring:  # the optimizers' tracked steps count the weights too (a second update on copies)
            self._counting = {optimizer: optimizer.track_weight_stalls for optimizer in counting}
            for optimizer in counting:
                optimizer.track_weight_stalls = True
        if self.log_weight_stalls and len(counting) < len(optimizers):
            others = ", ".join(type(optimizer).__name__ for optimizer in optimizers if optimizer not in counting)
            rank_zero_warn(
                f"PrecisionAdvisor: weight stall rates need a lightning_qstate optimizer that updates the weights itself (QAdam, "
                f"QAdamW, QSGD, QMuon), and {others} does not count them: no qstate/weight_stall for its parameters. Add "
                "QStatePrecision to the Trainer's plugins or QuantizedOptimizerStates to its callbacks (they convert torch's "
                "Adam, AdamW, SGD and Muon), return a QAdamW... from configure_optimizers, or pass log_weight_stalls=False."
            )

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for optimizer, counted in self._counting.items():
            optimizer.track_weight_stalls = counted
        self._counting = {}

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        self._advise_changed_formats(trainer)  # a plan made earlier in this hook (AdaptiveBitWidth before this callback)
        if self._measuring:
            self._measured.request(trainer, optimizer, self.interval(trainer))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self._advise_changed_formats(trainer)  # a plan made after this callback's hook, or formats changed by the step
        collected = self._measured.collect(trainer)  # a collective: every rank
        if collected is not None and trainer.is_global_zero:
            scalars = self.metrics(*collected)
            if scalars:
                log_scalars(trainer, scalars, trainer.fit_loop.epoch_loop._batches_that_stepped)

    def metrics(self, measurement: StallMeasurement, optimizers: Collection[QuantizedStates] | None = None) -> dict[str, float]:
        """The weights' stall rates of one measurement (of the parameters of ``optimizers``; default: all):
        ``qstate/weight_stall/<layer>`` (``per_layer``) and ``qstate/weight_stall`` (stalled over moved entries of the whole
        model); parameters that did not move are left out."""
        scalars: dict[str, float] = {}
        stalled_total = moved_total = 0.0
        for row, (stalled, moved) in zip(measurement.rows, measurement.counts.tolist(), strict=True):
            if row.state != WEIGHT_STALLS or moved == 0 or (optimizers is not None and row.optimizer not in optimizers):
                continue
            stalled_total += stalled
            moved_total += moved
            if self.per_layer:
                scalars[f"{WEIGHT_STALL_TAG}/{row.layer}"] = stalled / moved
        if moved_total:
            scalars[WEIGHT_STALL_TAG] = stalled_total / moved_total
        return scalars

    def _advise_changed_formats(self, trainer: pl.Trainer) -> None:
        """Advise again the optimizers whose state formats changed since their last advice (``format_changes`` moved:
        AdaptiveBitWidth's plans, ``reencode_state``), so that the report describes the formats that train."""
        moved = [position for position, advised in enumerate(self._advised) if advised.changed()]  # alike on every rank
        changed = []
        for position in moved:
            report = self._advised[position].advise(self._steps, self.constants)
            if report.rows != self.reports[position].rows:  # a new plan may leave every stored format as it was
                self.reports[position] = report
                changed.append(position)
        if moved:  # every rank whose formats moved takes strict's collective, whatever its (shard's) rows say
            self._announce(trainer, changed, f"the state formats changed at step {trainer.global_step}")

    def _announce(self, trainer: pl.Trainer, positions: list[int], why: str | None = None) -> None:
        """Publish the reports at ``positions`` (global rank 0), warn for each component at risk and, with ``strict``,
        raise on every rank for the insufficient ones; ``why``: what made a report of a later step."""
        risky: list[tuple[str, AdviceRow]] = []
        for position in positions:
            advised, report = self._advised[position], self.reports[position]
            risky += [(advised.label, row) for row in report.risky]
            if trainer.is_global_zero:
                self._publish(trainer, report, advised, why)
        steps = self._steps
        when = f" ({why})" if why else ""
        for label, row in risky:
            rank_zero_warn(f"PrecisionAdvisor: {_describe(label, row, steps)}{when}: " + " | ".join(row.reasons))
        failing = [(label, row) for label, row in risky if row.verdict == "insufficient"]
        if self.strict and trainer.strategy.reduce_boolean_decision(bool(failing), all=False):
            listed = "\n".join(f"  - {_describe(label, row, steps)}" for label, row in failing) or "  (on another rank)"
            raise ConfigurationError(
                f"PrecisionAdvisor(strict=True): {len(failing)} component(s) lack the precision a {steps}-step run needs{when}:\n{listed}\n"
                "Change them as the printed report's notes say (more mantissa bits, rounding='stochastic', state resets, "
                "error_feedback for the weights), plan fewer steps, or pass strict=False to train anyway."
            )

    def _publish(self, trainer: pl.Trainer, report: PrecisionReport, advised: _Advised, why: str | None) -> None:
        """Print ``report`` (``verbose``) and add it as text to the TensorBoard loggers (global rank 0 only)."""
        if self.verbose:
            print(f"== PrecisionAdvisor: {advised.label}{f' ({why})' if why else ''} ==\n{report}", flush=True)
        index = advised.index
        tag = ADVICE_TAG if index is None else f"{ADVICE_TAG}/{index}"
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger.experiment.add_text(tag, report.to_markdown(), global_step=trainer.global_step)


@dataclass
class _Advised:
    """One advised optimizer: what :func:`advise` needs for it, and its ``format_changes`` when it was last advised."""

    optimizer: torch.optim.Optimizer
    label: str
    index: int | None  # its position among several optimizers (the TensorBoard tag's suffix); None for one
    names: dict[torch.Tensor, str]
    grads: str | None
    format_changes: int = 0

    def advise(self, steps: int, constants: Mapping[tuple[str, str, str], float] | None) -> PrecisionReport:
        self.format_changes = getattr(self.optimizer, "format_changes", 0)
        return advise(self.optimizer, steps, grads=self.grads, names=self.names, constants=constants)

    def changed(self) -> bool:
        return getattr(self.optimizer, "format_changes", 0) != self.format_changes


def gradient_format(plugin: Precision, optimizer: torch.optim.Optimizer) -> str | None:
    """The format the gradients reach ``optimizer`` in under the precision ``plugin``, for
    :func:`~lightning_qstate.theory.precision.advise`: ``"bf16"``/``"fp16"`` for the true half settings (and FSDP's
    mixed ones, reduced in that dtype), ``None`` otherwise, and ``None`` too where a param group has its own ``grads``
    format, so that ``advise`` reads the group's (and the parameters' dtype for the other groups)."""
    if any(group.get("grads") is not None for group in optimizer.param_groups):
        return None
    table = _FSDP_GRADIENTS if isinstance(plugin, FSDPPrecision) else _HALF_GRADIENTS
    return table.get(str(plugin.precision))


def _unwrapped(optimizer: torch.optim.Optimizer | LightningOptimizer) -> torch.optim.Optimizer:
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def _describe(label: str, row: AdviceRow, steps: int) -> str:
    return (
        f"{label} group {row.group} {row.component} in {row.format} (M = {row.mantissa_bits:.1f}, needs {row.required_bits:.1f} "
        f"over {steps} steps) is {row.verdict}"
    )
