"""Adaptive per-layer, per-state bit-widths over training (STQuant, a reconstruction): the Lightning layer over
:class:`~lightning_qstate.adaptive.BitWidthPlanner` (hooks, the cross-rank collective, logging, the heatmap)."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from ..adaptive import ADAPTED_STATES, STATE_DICT_VERSION, BitWidthPlanner
from ..adaptive.planner import adaptable, check_options, kept_plain
from ..arguments import ConfigurationError
from .stall_counts import held_on_some_rank
from .tensorboard import log_scalars, logs_this_step, write_layout


def frozen_with_states(trainer: pl.Trainer, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer's frozen parameters that some rank holds states of (under FSDP1 a rank whose shard of one is empty
    holds none): a collective where some parameter is frozen (alike on every rank)."""
    frozen = [param for group in optimizer.param_groups for param in group["params"] if not param.requires_grad]
    if not frozen:
        return []
    held = held_on_some_rank(trainer, [(optimizer, param) for param in frozen])
    return [param for param, holds in zip(frozen, held, strict=True) if holds]


class AdaptiveBitWidth(Callback):
    """Per-layer, per-state bit-widths for Adam's ``exp_avg`` (m) and ``exp_avg_sq`` (v) that adapt during
    training under a hard memory cap: STQuant (arXiv 2604.06836) as reconstructed in ``docs/algorithms.md``
    ("Adaptive bit-widths"). The paper's method text was unavailable: the statistics, zones, annealing, hysteresis, format
    maps and budget rule below are that reconstruction, each a parameter here. The decisions are
    :class:`~lightning_qstate.adaptive.BitWidthPlanner`'s (``planner``, built at the start of training; a plain torch
    loop can drive it without Lightning); this callback calls it from the Trainer's hooks, sums its statistics over
    ranks, and logs.

    Every ``interval`` optimizer steps (at ``global_step % interval == 0``, before the step):

    1. per parameter ("layer"), the gradient's ``N = RMS(g)`` and ``R = std(|g|)/mean(|g|)`` from three
       sums, all-reduced over ranks in one collective (so every rank decides alike under DDP, FSDP and
       FSDP2, with uneven shards), and EMAs (``ema_decay``) of both, per layer and for the whole model
       (``reference``);
    2. each layer's zone: N and R above ``threshold`` times the model's count as high (critical: both,
       magnitude: N only, structural: R only, redundant: neither); the threshold rises linearly from
       ``threshold_start`` to ``threshold_end`` over ``anneal_steps``; a new zone is adopted once seen at
       ``hysteresis`` consecutive checks (the first observation at once);
    3. zone -> formats (``m_formats``, ``v_formats``; by default ``v`` gets int8, int7, int6, int5 from
       ``critical`` to ``redundant``, ``m`` int8_linear in ``critical`` and int4 elsewhere), then the budget over
       the average of **all** m and v values
       (those the optimizer keeps fp32 because of ``min_quant_size`` or FSDP2 row alignment included, priced at
       their real stored bytes, scales included; a parameter with neither states nor a gradient, on any rank, stores
       none and is left out until it has either): if it exceeds ``target_bits``, layers are demoted
       (lowest-priority zone first, then the largest, then by name) down their ladder of cheaper zones' formats
       until it fits (below those, to ``floor_formats``, only where the zones' formats cannot meet the cap); then
       (``fill_budget``) the slack under the cap is spent: in rounds, layers in the same order (the least precise
       first) move one rung up their ladder (back up, or to a higher zone's formats) while the average stays within
       ``target_bits`` (:func:`~lightning_qstate.adaptive.fit_budget`), so the plan ends close to
       the cap. The maps and both budget passes are reconstruction choices;
    4. changed states are re-encoded through ``optimizer.reencode_state`` (round-to-nearest from the decoded
       values: nothing is lost beyond the new format's precision), and ``optimizer.state_overrides`` is set so
       states created later use the decided formats.

    Before the first check every layer is planned as ``critical`` and capped by the budget. With
    ``target_bits=None`` every layer keeps its zone's formats (no demotion, no promotion). Parameters with a
    user override (``overrides=`` of the plugin or ``QuantizedOptimizerStates``) keep it; they count in the
    average. A ``states=`` that keeps m or v fp32 (``"fp32"``, or a mapping without it) is refused: the plan would
    override it. ``target_bits`` that even the cheapest candidates miss raises at the start of training. Under
    FSDP1 blocks are cut from each rank's flat shard, so the stored bytes can exceed the plan by at most one
    partial block's scale per rank and state.

    Decisions, EMAs, hysteresis counters and the history are in ``state_dict()`` (so in checkpoints); a
    resumed run continues exactly as an uninterrupted one. Needs one ``QAdam``/``QAdamW`` (plugin or
    callback-quantized) without ``amsgrad``; one instance per Trainer (Lightning refuses a second: the state is
    checkpointed under the class name). Frozen parameters (``requires_grad=False``) hold no states and are not planned.

    Logged by global rank 0 at the Trainer's logging interval: ``qstate/adaptive/avg_bits``,
    ``qstate/adaptive/bytes_saved`` (versus fp32 m and v), ``qstate/adaptive/zone_<zone>`` (layer counts),
    ``qstate/adaptive/threshold`` and ``qstate/adaptive/transitions`` (states re-encoded so far: changed decisions
    for states kept fp32 by ``min_quant_size``, and the first check's, made before any state exists, do not
    count) and ``qstate/adaptive/target_bits``; at every check, with a ``TensorBoardLogger``, the figure
    ``qstate/adaptive/bit_widths`` (:func:`bit_width_figure`: m above v, a row per quantized layer, a column per check,
    a colour per format, with a legend).

    Example::

        trainer = Trainer(plugins=[QStatePrecision(states="int8", rounding="stochastic")],
                          callbacks=[AdaptiveBitWidth(target_bits=5.1, interval=25, hysteresis=2)])

    Write the states with stochastic rounding, as above: below 8 bits a ``v`` rounded to nearest ratchets and the
    plan's bits buy little (the planner warns; GPT benchmark, 10 seeds, in the README).

    Args:
        target_bits: cap on the average stored bits per m/v value, scales included; ``None``: no cap.
        interval: optimizer steps between checks (K).
        ema_decay: EMA factor of the statistics, in ``[0, 1)``.
        hysteresis: consecutive checks a new zone must persist before a layer moves (H >= 1).
        threshold_start, threshold_end: zone threshold (times the model's N and R) at step 0 and at ``anneal_steps``.
        anneal_steps: steps of the annealing; default the Trainer's ``max_steps`` (or estimated stepping batches).
        reference: the model's N and R that layers are compared with: ``"layers"``, the size-weighted mean of the
            layers' values, or ``"model"``, all gradients pooled (see :func:`~lightning_qstate.adaptive.model_statistics`).
        m_formats, v_formats: ``{zone: format name}`` for the four zones (defaults: ``DEFAULT_M_FORMATS``, ``DEFAULT_V_FORMATS``
            of :mod:`lightning_qstate.adaptive`).
        max_history: checks kept for the figure.
        fill_budget: spend the room left under ``target_bits`` on promotions (step 3); ``False``: the zones' formats,
            demoted only where the cap needs it.
        floor_formats: ``{state: format name}``, the budget's last resort below every zone's formats (default
            ``DEFAULT_FLOOR_FORMATS``: int4 for m and v): used only where the zones' formats cannot meet ``target_bits``,
            so a cap they can meet is planned as without it; ``{}``: no floor (such a cap raises ``BudgetError``).
    """

    def __init__(
        self,
        target_bits: float | None = 5.1,
        interval: int = 50,
        ema_decay: float = 0.9,
        hysteresis: int = 3,
        threshold_start: float = 1.0,
        threshold_end: float = 1.5,
        anneal_steps: int | None = None,
        reference: str = "layers",
        m_formats: Mapping[str, str] | None = None,
        v_formats: Mapping[str, str] | None = None,
        max_history: int = 256,
        fill_budget: bool = True,
        floor_formats: Mapping[str, str] | None = None,
    ) -> None:
        options = dict(
            target_bits=target_bits,
            interval=interval,
            ema_decay=ema_decay,
            hysteresis=hysteresis,
            threshold_start=threshold_start,
            threshold_end=threshold_end,
            reference=reference,
            m_formats=m_formats,
            v_formats=v_formats,
            max_history=max_history,
            floor_formats=floor_formats,
            fill_budget=fill_budget,
        )
        check_options("AdaptiveBitWidth", **options, anneal_steps=anneal_steps)
        self.planner_options: dict[str, Any] = options  # BitWidthPlanner's, but anneal_steps
        self.anneal_steps = None if anneal_steps is None else int(anneal_steps)
        self.planner: BitWidthPlanner | None = None
        self.overhead_seconds = 0.0  # this fit's time in the hooks: checks (statistics, collective, decisions, re-encoding), logging
        self._restored: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Build the planner (which prices every candidate format per layer and checks the budget), restore it, apply its plan."""
        optimizers = trainer.strategy.optimizers
        if len(optimizers) != 1:
            raise ConfigurationError(f"AdaptiveBitWidth supports one optimizer; the Trainer has {len(optimizers)}")
        if not adaptable(optimizers[0]):  # a usage error of the run's configuration (the planner raises TypeError)
            raise ConfigurationError(
                f"AdaptiveBitWidth needs a QAdam/QAdamW optimizer with quantized states, got {type(optimizers[0]).__name__}; add "
                "the QStatePrecision plugin or the QuantizedOptimizerStates callback, or return lightning_qstate.QAdamW from "
                "configure_optimizers"
            )
        model = trainer.strategy.model if trainer.strategy.model is not None else pl_module
        # a new planner per fit: one without a checkpoint starts afresh
        self.planner = BitWidthPlanner(
            optimizers[0],
            model,
            anneal_steps=self._anneal_steps(trainer),
            also_track=frozen_with_states(trainer, optimizers[0]),
            **self.planner_options,
        )
        if self._restored is not None:
            self.planner.load_state_dict(self._restored)
            self._restored = None
        self.planner.apply()
        self.overhead_seconds = 0.0
        if trainer.is_global_zero:
            write_layout(trainer)

    def tensorboard_charts(self, trainer: pl.Trainer) -> dict[str, dict[str, list[str]]]:
        """Custom-scalars charts: the average stored bits against the target, and the layers per zone."""
        return {
            "qstate: adaptive bit-widths": {
                "average bits per state value vs target_bits": ["^qstate/adaptive/avg_bits$", "^qstate/adaptive/target_bits$"],
                "layers per zone": ["^qstate/adaptive/zone_"],
            }
        }

    def _anneal_steps(self, trainer: pl.Trainer) -> int:
        if self.anneal_steps is not None:
            return self.anneal_steps
        steps = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        if not math.isfinite(steps):
            raise ConfigurationError("AdaptiveBitWidth: anneal_steps=None needs a Trainer with max_steps or max_epochs; pass anneal_steps")
        return max(int(steps), 1)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        planner, step = self.planner, trainer.global_step
        if planner is None or optimizer is not planner.optimizer:
            return
        if not planner.should_replan(step):
            start = time.perf_counter()
            planner.update(step)  # between checks: a group added, a parameter unfrozen joins the plan now (no collective)
            self.overhead_seconds += time.perf_counter() - start
            return
        start = time.perf_counter()
        sums = trainer.strategy.reduce(planner.gradient_sums(trainer.strategy.root_device), reduce_op="sum")  # the one collective
        planner.update(step, sums)
        if trainer.is_global_zero:
            self._log_figure(trainer, step)
        self.overhead_seconds += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """The logged numbers (:meth:`BitWidthPlanner.metrics`); empty before training starts."""
        return {} if self.planner is None else self.planner.metrics()

    def decisions(self) -> dict[str, dict[str, Any]]:
        """``{layer name: {"zone": ..., "exp_avg": format name, "exp_avg_sq": format name}}`` of the adapted layers."""
        return {} if self.planner is None else self.planner.decisions()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.planner is None or not trainer.is_global_zero or not logs_this_step(trainer):
            return
        start = time.perf_counter()
        log_scalars(trainer, self.planner.metrics(), trainer.fit_loop.epoch_loop._batches_that_stepped)
        self.overhead_seconds += time.perf_counter() - start

    def _log_figure(self, trainer: pl.Trainer, step: int) -> None:
        loggers = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        if not loggers:
            return
        for logger in loggers:  # add_figure closes the figure
            logger.experiment.add_figure(
                "qstate/adaptive/bit_widths", bit_width_figure(self.planner.history, [layer.name for layer in self.planner.layers]), step
            )

    def state_dict(self) -> dict[str, Any]:
        """The planner's state (decisions, EMAs, hysteresis counters, history); a loaded one until training starts."""
        if self.planner is None:
            return {} if self._restored is None else self._restored
        return self.planner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the saved state; the planner loads it in ``on_train_start``, once the optimizer exists."""
        if state_dict.get("version") != STATE_DICT_VERSION:
            raise ValueError(f"AdaptiveBitWidth: checkpoint state version {state_dict.get('version')!r}, expected {STATE_DICT_VERSION}")
        self._restored = state_dict


def bit_width_figure(history: Sequence[Mapping[str, Any]], names: Sequence[str]):
    """A matplotlib figure of the plan over the checks: one panel per state (``exp_avg`` above ``exp_avg_sq``), a row
    per layer that some check stored quantized (named, the common prefix dropped; layers kept plain throughout are left
    out and counted in the title), a column per check (the x axis is the step), one colour per stored format (legend).

    ``history``: the planner's entries (``step``, ``bits``, ``formats``: ``[[m per layer], [v per layer]]``, ``names``:
    the layers then, which grow where parameters join; entries of older checkpoints without ``formats`` are labelled
    by their bits, without ``names`` taken as the first of ``names``); ``names``: the layers, in the planner's order. A
    layer an entry does not hold is drawn as "not planned"; with no quantized layer the figure says so.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    labels = []  # per entry, per state: {layer name: label}
    for entry in history:
        per_state = entry.get("formats") or [[f"{bits:.2f} bits" for bits in column] for column in entry["bits"]]
        held = entry.get("names") or names[: len(per_state[0])]
        labels.append([dict(zip(held, column, strict=True)) for column in per_state])
    absent = "not planned"
    shown = [i for i in range(len(names)) if any(not kept_plain(column.get(names[i], "fp32")) for entry in labels for column in entry)]
    if not shown:
        figure, axis = plt.subplots(figsize=(6, 1.2))
        axis.axis("off")
        axis.text(0.5, 0.5, f"no quantized layer: all {len(names)} layers keep plain m and v", ha="center", va="center", fontsize=9)
        return figure
    formats = sorted({column.get(names[i], absent) for entry in labels for column in entry for i in shown})
    colours = plt.get_cmap("tab10" if len(formats) <= 10 else "tab20")(range(len(formats)))
    steps = [entry["step"] for entry in history]
    edges = steps + [steps[-1] + (steps[-1] - steps[-2] if len(steps) > 1 else 1)]
    prefix = os.path.commonprefix([names[i] for i in shown]) if len(shown) > 1 else ""
    prefix = prefix[: prefix.rfind(".") + 1]
    height = 1.6 + 0.17 * len(shown) * len(ADAPTED_STATES)
    figure, axes = plt.subplots(len(ADAPTED_STATES), 1, figsize=(9, height), sharex=True, squeeze=False)
    for panel, (axis, state) in enumerate(zip(axes[:, 0], ADAPTED_STATES, strict=True)):
        grid = [[formats.index(entry[panel].get(names[i], absent)) for entry in labels] for i in shown]
        axis.pcolormesh(edges, range(len(shown) + 1), grid, cmap=ListedColormap(colours), vmin=-0.5, vmax=len(formats) - 0.5)
        axis.set_yticks([row + 0.5 for row in range(len(shown))], [names[i][len(prefix) :] for i in shown], fontsize=7)
        axis.invert_yaxis()
        axis.set_ylabel(f"{state}\nlayer" + (f" ({prefix}…)" if prefix else ""), fontsize=8)
    axes[-1, 0].set_xlabel("optimizer step (a column per check)")
    kept = len(names) - len(shown)
    axes[0, 0].set_title(
        f"stored format of each quantized layer's m and v ({len(shown)} layers"
        + (f"; {kept} kept plain throughout, not shown)" if kept else ")"),
        fontsize=9,
    )
    figure.legend(
        handles=[Patch(color=colour, label=name) for name, colour in zip(formats, colours, strict=True)],
        loc="upper right", fontsize=8, title="format", title_fontsize=8, bbox_to_anchor=(1.0, 1.0),
    )  # fmt: skip
    figure.tight_layout(rect=(0, 0, 0.86, 1))
    return figure
