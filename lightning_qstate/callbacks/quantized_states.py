"""Quantize the optimizer states of a LightningModule from a callback, and log their memory."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override

from ..arguments import check_flags
from ..formats.weights import WeightBlock
from ..optim import (
    ErrorFeedback,
    NonFiniteGradPolicy,
    QuantizationPolicy,
    QuantizedStates,
    StatesSpec,
    check_optimizer_parameters,
    state_summary,
)
from ..plugins.precision import QStatePolicyMixin, apply_policy, is_tuner_checkpoint, put_weights_on_grid
from ..plugins.strategies import load_packed_checkpoints_into_shards
from .stall_counts import across_ranks
from .tensorboard import log_scalars, logs_this_step


class QuantizedOptimizerStates(Callback):
    """Store the optimizer states of any LightningModule in low-bit formats, and log what that saves.

    For users who keep their own precision plugin: in ``on_fit_start`` the optimizers of
    ``trainer.strategy`` are converted (in place for Adam/AdamW/SGD/Muon, wrapped otherwise), before
    any checkpoint is restored, so resuming loads straight into the quantized optimizers. Optimizers a
    :class:`~lightning_qstate.plugins.QStatePrecision` already converted are left as they are; the
    callback then only logs. With ``weights=`` (training without fp32 master weights, ECO; its own or that of a quantized
    optimizer ``configure_optimizers`` built), the parameters are rounded onto their weight grid there too (round to
    nearest), before a checkpoint's weights (on the grid already) are restored; under a QState plugin, the plugin did.

    At the Trainer's logging interval (``log_every_n_steps``) it logs, summed over ranks:
    ``qstate/state_bytes``, ``qstate/bits_per_value`` (average, scales included),
    ``qstate/saving_vs_fp32`` (fraction of the fp32 state memory saved) and
    ``qstate/nonfinite_skips`` (parameter updates skipped for non-finite gradients, cumulative).

    Example::

        trainer = Trainer(callbacks=[QuantizedOptimizerStates(states={"exp_avg": "int8", "exp_avg_sq": "int4"},
                                                              overrides={"*.wte.*": "fp32"})])
        # fp8 (E4M3, one scale per row) weights in the blocks' linear layers, ECO error feedback:
        trainer = Trainer(callbacks=[QuantizedOptimizerStates(rounding="stochastic", weights="fp8_e4m3", error_feedback="eco")])

    Args:
        states, rounding, block_size, min_quant_size, overrides, weights, weight_rounding, weight_block,
            error_feedback, weight_overrides, track_stalls, nonfinite, grads, policy:
            as for :class:`~lightning_qstate.plugins.QStatePrecision`.
        log_stats: log the memory statistics above.
    """

    def __init__(
        self,
        states: StatesSpec = "int8",
        rounding: str = "nearest",
        block_size: int | None = None,
        min_quant_size: int = 4096,
        overrides: Mapping[str, StatesSpec] | None = None,
        weights: str | None = None,
        weight_rounding: str = "stochastic",
        weight_block: WeightBlock = "row",
        error_feedback: ErrorFeedback | None = None,
        weight_overrides: Mapping[str, str | None] | None = None,
        track_stalls: bool = False,
        nonfinite: NonFiniteGradPolicy = "skip",
        grads: str | None = None,
        policy: QuantizationPolicy | None = None,
        log_stats: bool = True,
    ) -> None:
        self.policy = QuantizationPolicy.from_arguments(type(self).__name__, policy, locals())
        check_flags(type(self).__name__, log_stats=log_stats)
        self.log_stats = log_stats

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._resumed = False  # the fit's own checkpoint was restored (on_load_checkpoint)

    @override
    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        # the fit's checkpoint, restored before on_fit_start; a tuner callback's temporary one (restored in its
        # on_fit_start, which runs before ours: it sets trainer.ckpt_path) is no resume
        if not is_tuner_checkpoint(trainer.ckpt_path):
            self._resumed = True

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model if trainer.strategy.model is not None else pl_module
        check_optimizer_parameters(model, trainer.strategy.optimizers)
        trainer.strategy.optimizers = apply_policy(self.policy, trainer.strategy.optimizers, model)
        load_packed_checkpoints_into_shards(trainer.strategy)
        plugin_rounds = isinstance(trainer.strategy.precision_plugin, QStatePolicyMixin)  # its connect() put them on their grids
        if not plugin_rounds and not self.__dict__.get("_resumed", False):  # weights=: round to nearest (not a resumed fit's weights)
            put_weights_on_grid(trainer.strategy.optimizers)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.log_stats or not logs_this_step(trainer):
            return
        metrics = memory_metrics(trainer)
        if trainer.is_global_zero:
            log_scalars(trainer, metrics, trainer.fit_loop.epoch_loop._batches_that_stepped)


def memory_metrics(trainer: pl.Trainer) -> dict[str, float]:
    """State memory of all of ``trainer``'s optimizers, summed over ranks, and the skipped updates, which every rank
    counts alike (each replica, and each shard from the all-reduced decision): their largest (collectives: call it on
    every rank)."""
    local = [0, 0, 0, 0]
    for optimizer in trainer.strategy.optimizers:
        summary = state_summary(optimizer)
        local[0] += summary["bytes"]
        local[1] += summary["values"]
        local[2] += summary["fp32_bytes"]
        local[3] += optimizer.nonfinite_skips if isinstance(optimizer, QuantizedStates) else 0
    stored, values, fp32_bytes = across_ranks(trainer, torch.tensor(local[:3], dtype=torch.float64), "sum").tolist()
    skips = float(across_ranks(trainer, torch.tensor(float(local[3]), dtype=torch.float64), "max"))
    return {
        "qstate/state_bytes": stored,
        "qstate/bits_per_value": 8 * stored / values if values else 0.0,
        "qstate/saving_vs_fp32": 1 - stored / fp32_bytes if fp32_bytes else 0.0,
        "qstate/nonfinite_skips": skips,
    }
