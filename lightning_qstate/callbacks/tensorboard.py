"""What the callbacks' TensorBoard output says: a description on every ``qstate/`` scalar and one custom-scalars layout.

:func:`log_scalars` writes scalars to every logger; to TensorBoard loggers with the tag's description (from
:data:`TAG_DESCRIPTIONS`) on its first value, which TensorBoard shows beside the chart. :func:`write_layout` gathers
the charts of every callback of this library that has ``tensorboard_charts(trainer)`` into one layout (TensorBoard's
"Custom Scalars" tab keeps one per run), e.g. the measured and predicted stall rates of a state on one chart with
the resets beside them.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Mapping

import lightning.pytorch as pl
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.tensorboard.summary import scalar

# (tag pattern, description); the first match wins
TAG_DESCRIPTIONS: tuple[tuple[str, str], ...] = (
    (r"qstate/stall/weights(/.*)?", "Fraction of weight entries whose update moved them but whose stored value did not change "
     "(lost to rounding into the parameter's dtype or weight grid), on the measured step."),
    (r"qstate/stall/[^/]+/.+", "Measured stall rate of one parameter's state: entries whose fp32 update moved them but whose "
     "stored code stayed the same, over entries moved, on the measured step."),
    (r"qstate/stall/[^/]+", "Measured stall rate of this state over the whole model: stalled entries over moved entries on the "
     "measured step (StallMonitor). Compare with qstate/stall_predicted (Custom Scalars tab: both on one chart)."),
    (r"qstate/stall_predicted/.+", "Stall probability from theory.stall_probability for the state's format, decay and rounding "
     "on the measured step, given that step's measured ratios of the moving entries (g²/v for v, g/m for m) and the stored "
     "codes' occupancy."),
    (r"qstate/stall_resets", "Fraction of layers whose states StateResetScheduler zeroed since the previous stall measurement."),
    (r"qstate/reset/layers", "Layers whose states were zeroed at this step (StateResetScheduler)."),
    (r"qstate/reset/total", "Layer resets since training started (StateResetScheduler)."),
    (r"qstate/reset/first_step_ratio", "Largest first-step update after a reset relative to Adam's bound (1 = a full-size step)."),
    (r"qstate/weight_stall(/.*)?", "Fraction of weight entries whose update was lost to rounding (PrecisionAdvisor)."),
    (r"qstate/state_bytes", "Bytes of all optimizer states (codes, scales and plain states), summed over ranks."),
    (r"qstate/bits_per_value", "Average bits per stored optimizer-state value, scales included."),
    (r"qstate/saving_vs_fp32", "Fraction of the fp32 optimizer-state memory saved (0.75 = a quarter of fp32's bytes)."),
    (r"qstate/nonfinite_skips", "Parameter updates skipped for non-finite gradients since training started."),
    (r"qstate/adaptive/avg_bits", "Average bits per state value the adaptive plan stores (AdaptiveBitWidth); see target_bits."),
    (r"qstate/adaptive/target_bits", "The bit budget AdaptiveBitWidth plans to (its target_bits)."),
    (r"qstate/adaptive/.+", "AdaptiveBitWidth's plan (see the callback's documentation)."),
    (r"qstate/probe/R_L", "Relative squared error of the last block's output under PTQ (ABC decomposition; lower is more robust)."),
    (r"qstate/probe/ptq_loss_increase", "Validation loss under post-training quantization minus the full-precision loss."),
    (r"qstate/probe/.+", "QuantizationProbe on fixed validation batches (see the callback's documentation)."),
)  # fmt: skip

_DESCRIBED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # SummaryWriter -> tags already written once
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # SummaryWriter -> the layout it was given last


def describe(tag: str) -> str | None:
    """The description of a ``qstate/`` tag, ``None`` for others."""
    return next((text for pattern, text in TAG_DESCRIPTIONS if re.fullmatch(pattern, tag)), None)


def logs_this_step(trainer: pl.Trainer) -> bool:
    """Whether Lightning logs its own step metrics at this ``on_train_batch_end``: a step of its logging interval, at the
    batch that ends a gradient accumulation window (automatic optimization), not at every micro-batch of it."""
    if not trainer._logger_connector.should_update_logs:
        return False
    return not (trainer.lightning_module.automatic_optimization and trainer.fit_loop._should_accumulate())


def log_scalars(trainer: pl.Trainer, metrics: Mapping[str, float], step: int) -> None:
    """Log ``metrics`` at ``step`` to every logger of ``trainer``; TensorBoard gets each tag's description once."""
    for logger in trainer.loggers:
        if not isinstance(logger, TensorBoardLogger):
            logger.log_metrics(dict(metrics), step=step)
            continue
        writer = logger.experiment
        written = _DESCRIBED.setdefault(writer, set())
        for tag, value in metrics.items():
            summary = scalar(tag, float(value))
            description = describe(tag) if tag not in written else None
            if description:  # a value with metadata must name its plugin, or TensorBoard warns that it is "oddly" plugin-less
                summary.value[0].metadata.summary_description = description
                summary.value[0].metadata.plugin_data.plugin_name = "scalars"
            written.add(tag)
            writer._get_file_writer().add_summary(summary, step)


def write_layout(trainer: pl.Trainer) -> None:
    """Write the custom-scalars layout of every callback with ``tensorboard_charts(trainer)`` (``{category: {chart title:
    [tag regexes]}}``, each chart a multi-line chart) to each TensorBoard run, again where it changed since (TensorBoard
    shows a run's last: a wrapped optimizer's states, and so their charts, appear at its first step). Call it on global
    rank 0."""
    charts: dict[str, dict[str, list[str]]] = {}
    for callback in trainer.callbacks:
        provider = getattr(callback, "tensorboard_charts", None)
        if provider is not None and type(callback).__module__.startswith("lightning_qstate."):
            for category, entries in provider(trainer).items():
                charts.setdefault(category, {}).update(entries)
    if not charts:
        return
    layout = {category: {title: ["Multiline", tags] for title, tags in entries.items()} for category, entries in charts.items()}
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger) and _LAYOUTS.get(logger.experiment) != layout:
            logger.experiment.add_custom_scalars(layout)
            _LAYOUTS[logger.experiment] = layout
