"""Adaptive per-layer, per-state bit-widths over training (STQuant, a reconstruction; see ``theory/bits.py``)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger

from ..formats import StorageFormat
from ..optim import QuantizedStates, clean_parameter_name, resolve_format
from ..optim.base import local_tensor
from ..theory.bits import (
    REFERENCES,
    ZONES,
    AnnealedThreshold,
    BudgetError,
    Choice,
    ZoneHysteresis,
    budget_ladder,
    budget_order,
    check_zone_formats,
    classify_zone,
    ema,
    fit_budget,
    gradient_statistics,
    model_statistics,
    resolved_nbytes,
)

ADAPTED_STATES = ("exp_avg", "exp_avg_sq")  # Adam's m and v
# Formats of 5 to 8 bits all store one byte per value, so each state has two real widths: 8 bits and 4 bits (with
# scales: 8.0625 and 4.125 for m, 8.125 and 4.25 for v). The maps give v the 8 bits first (a reconstruction choice):
# every zone with high N or R stores v as int8, m takes 8 bits (the linear int8_linear) only in the critical zone, and
# redundant layers store m as the dynamic int4 map and v as the logarithmic e4m0. (On the GPT benchmark a 4-bit v cost
# more than a 4-bit m: over 10 seeds fixed m int4 + v int8 came within 0.07 % of int8, m int8 + v int4 1.70 % above.)
# At 4 bits m takes the dynamic int4 map, not int4_linear: a 4-bit linear map stores every m under 1/14 of its block's
# absmax as 0. (The ViT benchmark cannot tell the two apart: their seed-to-seed spread is larger than the difference.)
# Pass m_formats with "int4_linear" for the paper's all-linear m. Whatever the maps, the budget spends the cap's slack
# on promotions (see fit_budget), the least precise layers first, so a plan under the cap usually ends close to
# target_bits.
DEFAULT_M_FORMATS = {"critical": "int8_linear", "magnitude": "int4", "structural": "int4", "redundant": "int4"}
DEFAULT_V_FORMATS = {"critical": "int8", "magnitude": "int8", "structural": "int8", "redundant": "e4m0"}
STATE_DICT_VERSION = 1


@dataclass
class Layer:
    """One parameter the callback tracks (``param``: the optimizer's key; ``numel``: the full parameter's size)."""

    name: str
    param: torch.Tensor
    group: dict
    numel: int
    pinned: dict[str, int] | None  # bytes per state of a parameter a user override fixes; None: adapted
    nbytes: dict[tuple[str, str], int] = field(default_factory=dict)  # (state, candidate format) -> bytes
    rms: float | None = None
    dispersion: float | None = None
    hysteresis: ZoneHysteresis = field(default_factory=ZoneHysteresis)
    choice: Choice | None = None

    def state_bytes(self) -> list[int]:
        """Bytes of each adapted state in its current format."""
        if self.pinned is not None:
            return [self.pinned[state] for state in ADAPTED_STATES]
        return [self.nbytes[(state, name)] for state, name in zip(ADAPTED_STATES, self.choice, strict=False)]

    def stored_formats(self, choice: Choice) -> list[StorageFormat | None]:
        """The format each adapted state is stored in under ``choice``, as the optimizer resolves it (``None``: fp32,
        e.g. below ``min_quant_size``); depends on the full parameter only, so it is the same on every rank."""
        override = dict(zip(ADAPTED_STATES, choice, strict=False))
        return [resolve_format({**self.group, "states": override}, state, self.param, self.numel) for state in ADAPTED_STATES]


class AdaptiveBitWidth(Callback):
    """Per-layer, per-state bit-widths for Adam's ``exp_avg`` (m) and ``exp_avg_sq`` (v) that adapt during
    training under a hard memory cap: STQuant (arXiv 2604.06836) as reconstructed in ``docs/algorithms.md``
    ("Adaptive bit-widths"). The paper's method text was unavailable: the statistics, zones, annealing, hysteresis, format
    maps and budget rule below are that reconstruction, each a parameter here.

    Every ``interval`` optimizer steps (at ``global_step % interval == 0``, before the step):

    1. per parameter ("layer"), the gradient's ``N = RMS(g)`` and ``R = std(|g|)/mean(|g|)`` from three
       sums, all-reduced over ranks in one collective (so every rank decides alike under DDP, FSDP and
       FSDP2, with uneven shards), and EMAs (``ema_decay``) of both, per layer and for the whole model
       (``reference``);
    2. each layer's zone: N and R above ``threshold`` times the model's count as high (critical: both,
       magnitude: N only, structural: R only, redundant: neither); the threshold rises linearly from
       ``threshold_start`` to ``threshold_end`` over ``anneal_steps``; a new zone is adopted once seen at
       ``hysteresis`` consecutive checks (the first observation at once);
    3. zone -> formats (``m_formats``, ``v_formats``; by default ``v`` gets 8 bits in every zone but
       ``redundant``, ``m`` only in ``critical``), then the budget over the average of **all** m and v values
       (those the optimizer keeps fp32 because of ``min_quant_size`` or FSDP2 row alignment included, priced at
       their real stored bytes, scales included): if it exceeds ``target_bits``, layers are demoted
       (lowest-priority zone first, then the largest, then by name) down their ladder of cheaper zones' formats
       until it fits; then (``fill_budget``) the slack under the cap is spent: in rounds, layers in the same order (the
       least precise first) move one rung up their ladder (back up, or to a higher zone's formats) while the average
       stays within ``target_bits`` (:func:`~lightning_qstate.theory.fit_budget`), so the plan ends close to
       the cap. The maps and both budget passes are reconstruction choices;
    4. changed states are re-encoded through ``optimizer.reencode_state`` (round-to-nearest from the decoded
       values: nothing is lost beyond the new format's precision), and ``optimizer.state_overrides`` is set so
       states created later use the decided formats.

    Before the first check every layer is planned as ``critical`` and capped by the budget. With
    ``target_bits=None`` every layer keeps its zone's formats (no demotion, no promotion). Parameters with a
    user override (``overrides=`` of the plugin or ``QuantizedOptimizerStates``) keep it; they count in the
    average. ``target_bits`` that even the cheapest candidates miss raises at the start of training. Under
    FSDP1 blocks are cut from each rank's flat shard, so the stored bytes can exceed the plan by at most one
    partial block's scale per rank and state.

    Decisions, EMAs, hysteresis counters and the history are in ``state_dict()`` (so in checkpoints); a
    resumed run continues exactly as an uninterrupted one. Needs one ``QAdam``/``QAdamW`` (plugin or
    callback-quantized) without ``amsgrad``.

    Logged by global rank 0 at the Trainer's logging interval: ``qstate/adaptive/avg_bits``,
    ``qstate/adaptive/bytes_saved`` (versus fp32 m and v), ``qstate/adaptive/zone_<zone>`` (layer counts),
    ``qstate/adaptive/threshold`` and ``qstate/adaptive/transitions`` (states re-encoded so far: changed decisions
    for states kept fp32 by ``min_quant_size``, and the first check's, made before any state exists, do not
    count); at every check, with a ``TensorBoardLogger``, the image ``qstate/adaptive/bit_widths`` (rows: layers,
    m panel above v panel; columns: checks; dark blue 4 bits to yellow 32 bits, log scale).

    Example::

        trainer = Trainer(plugins=[QStatePrecision(states="int8")],
                          callbacks=[AdaptiveBitWidth(target_bits=5.1, interval=25, hysteresis=2)])

    Args:
        target_bits: cap on the average stored bits per m/v value, scales included; ``None``: no cap.
        interval: optimizer steps between checks (K).
        ema_decay: EMA factor of the statistics, in ``[0, 1)``.
        hysteresis: consecutive checks a new zone must persist before a layer moves (H >= 1).
        threshold_start, threshold_end: zone threshold (times the model's N and R) at step 0 and at ``anneal_steps``.
        anneal_steps: steps of the annealing; default the Trainer's ``max_steps`` (or estimated stepping batches).
        reference: the model's N and R that layers are compared with: ``"layers"``, the size-weighted mean of the
            layers' values, or ``"model"``, all gradients pooled (see :func:`~lightning_qstate.theory.model_statistics`).
        m_formats, v_formats: ``{zone: format name}`` for the four zones (defaults: ``DEFAULT_M_FORMATS``, ``DEFAULT_V_FORMATS``).
        max_history: checks kept for the heatmap.
        fill_budget: spend the room left under ``target_bits`` on promotions (step 3); ``False``: the zones' formats,
            demoted only where the cap needs it.
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
    ) -> None:
        if target_bits is not None and not (isinstance(target_bits, (int, float)) and target_bits > 0):
            raise ValueError(f"AdaptiveBitWidth: target_bits={target_bits!r} must be a number > 0 (average bits per state value) or None")
        for option, value in (("interval", interval), ("hysteresis", hysteresis), ("max_history", max_history)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"AdaptiveBitWidth: {option}={value!r} must be an int >= 1")
        if not (isinstance(ema_decay, (int, float)) and 0 <= ema_decay < 1):
            raise ValueError(f"AdaptiveBitWidth: ema_decay={ema_decay!r} must be in [0, 1)")
        if anneal_steps is not None and (not isinstance(anneal_steps, int) or anneal_steps < 1):
            raise ValueError(f"AdaptiveBitWidth: anneal_steps={anneal_steps!r} must be an int >= 1 or None (the Trainer's max_steps)")
        if reference not in REFERENCES:
            raise ValueError(f"AdaptiveBitWidth: reference={reference!r} is not valid; use one of {REFERENCES}")
        try:
            AnnealedThreshold(threshold_start, threshold_end)
        except ValueError:
            raise ValueError(
                f"AdaptiveBitWidth: threshold_start={threshold_start!r} and threshold_end={threshold_end!r} must be > 0"
            ) from None
        self.formats = {
            "exp_avg": check_zone_formats(DEFAULT_M_FORMATS if m_formats is None else m_formats, "AdaptiveBitWidth: m_formats"),
            "exp_avg_sq": check_zone_formats(DEFAULT_V_FORMATS if v_formats is None else v_formats, "AdaptiveBitWidth: v_formats"),
        }
        self.target_bits = target_bits
        self.interval = interval
        self.ema_decay = float(ema_decay)
        self.hysteresis = hysteresis
        self.threshold_start, self.threshold_end, self.anneal_steps = float(threshold_start), float(threshold_end), anneal_steps
        self.reference = reference
        self.max_history = max_history
        self.fill_budget = bool(fill_budget)
        self.layers: list[Layer] = []
        self.global_rms: float | None = None
        self.global_dispersion: float | None = None
        self.last_check: int | None = None
        self.transitions = 0
        self.history: list[dict[str, Any]] = []  # per check: {"step": s, "bits": [[m bits per layer], [v bits per layer]]}
        self.overhead_seconds = (
            0.0  # this fit's time in the callback's hooks: checks (statistics, collective, decisions, re-encoding), logging
        )
        self._optimizer: QuantizedStates | None = None
        self._threshold: AnnealedThreshold | None = None
        self._restored: dict[str, Any] | None = None

    # --- set-up ------------------------------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Find the optimizer, price every candidate format per layer, check the budget, restore or plan, apply."""
        self._optimizer = self._adapted_optimizer(trainer)
        self.layers = self._collect_layers(self._optimizer, trainer.strategy.model if trainer.strategy.model is not None else pl_module)
        self._threshold = AnnealedThreshold(self.threshold_start, self.threshold_end, self._anneal_steps(trainer))
        self.overhead_seconds = 0.0
        if self._restored is not None:
            self._restore(self._restored)
            self._restored = None
        else:  # a fit without a checkpoint starts afresh
            self.global_rms = self.global_dispersion = self.last_check = None
            self.transitions, self.history = 0, []
        self._solve(count_transitions=False)  # raises here if even every layer's cheapest formats miss target_bits
        self._apply()

    def _adapted_optimizer(self, trainer: pl.Trainer) -> QuantizedStates:
        optimizers = trainer.strategy.optimizers
        if len(optimizers) != 1:
            raise ValueError(f"AdaptiveBitWidth supports one optimizer; the Trainer has {len(optimizers)}")
        optimizer = optimizers[0]
        if not isinstance(optimizer, QuantizedStates) or not set(ADAPTED_STATES) <= set(optimizer.state_names):
            raise TypeError(
                f"AdaptiveBitWidth needs a QAdam/QAdamW optimizer (states {list(ADAPTED_STATES)}), got {type(optimizer).__name__}; "
                "quantize it with QStatePrecision or QuantizedOptimizerStates"
            )
        if any(group.get("amsgrad") for group in optimizer.param_groups):
            raise ValueError("AdaptiveBitWidth does not support amsgrad=True (its max_exp_avg_sq state is not adapted)")
        return optimizer

    def _collect_layers(self, optimizer: QuantizedStates, model: torch.nn.Module) -> list[Layer]:
        """Every parameter of ``optimizer``, named as the user's module names it, with its candidates priced."""
        names = {param: clean_parameter_name(name) for name, param in model.named_parameters()}
        fallback = optimizer.param_names()
        layers = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                numel = optimizer.full_numels.get(param, param.numel())
                override = optimizer.state_overrides.get(param)
                pinned = None
                if override is not None:
                    pinned = {state: resolved_nbytes({**group, "states": override}, state, param, numel) for state in ADAPTED_STATES}
                layer = Layer(names.get(param, fallback[param]), param, group, numel, pinned)
                if pinned is None:
                    layer.nbytes = {
                        (state, name): resolved_nbytes({**group, "states": name}, state, param, numel)
                        for state, per_zone in self.formats.items()
                        for name in per_zone.values()
                    }
                layers.append(layer)
        return layers

    def _anneal_steps(self, trainer: pl.Trainer) -> int:
        if self.anneal_steps is not None:
            return self.anneal_steps
        steps = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        if not math.isfinite(steps):
            raise ValueError("AdaptiveBitWidth: anneal_steps=None needs a Trainer with max_steps or max_epochs; pass anneal_steps")
        return max(int(steps), 1)

    # --- checks ------------------------------------------------------------------------------------------
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        step = trainer.global_step
        if optimizer is not self._optimizer or step % self.interval or step == self.last_check:
            return
        start = time.perf_counter()
        self._observe(self._gradient_sums(trainer), step)
        self._solve(count_transitions=step > 0)  # the optimizer's states exist from its first step on
        self._apply()
        self.history.append({"step": step, "bits": self._bits()})
        del self.history[: -self.max_history]
        self.last_check = step
        if trainer.is_global_zero:
            self._log_heatmap(trainer, step)
        self.overhead_seconds += time.perf_counter() - start

    def _gradient_sums(self, trainer: pl.Trainer) -> list[list[float]]:
        """``[sum |g|, sum g^2, count]`` per layer, summed over ranks: two foreach norms (L1, L2) over all gradients, one collective."""
        grads, where = [], []
        for index, layer in enumerate(self.layers):
            grad = layer.param.grad
            if grad is not None and local_tensor(grad).numel():
                grads.append(local_tensor(grad))
                where.append(index)
        sums = torch.zeros(3, len(self.layers), dtype=torch.float64, device=trainer.strategy.root_device)
        if grads:
            index = torch.tensor(where, device=sums.device)
            sums[0, index] = torch.stack(torch._foreach_norm(grads, 1, dtype=torch.float32)).to(sums)
            sums[1, index] = torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).to(sums).square()
            sums[2, index] = torch.tensor([float(g.numel()) for g in grads], dtype=torch.float64, device=sums.device)
        return trainer.strategy.reduce(sums, reduce_op="sum").tolist()  # the one host sync of a check

    def _observe(self, sums: list[list[float]], step: int) -> None:
        """Update the EMAs from the all-reduced sums (float64, the same on every rank) and the layers' zones."""
        abs_sums, square_sums, counts = sums
        for layer, abs_sum, square_sum, count in zip(self.layers, abs_sums, square_sums, counts, strict=False):
            if count > 0:
                rms, dispersion = gradient_statistics(abs_sum, square_sum, count)
                layer.rms, layer.dispersion = ema(layer.rms, rms, self.ema_decay), ema(layer.dispersion, dispersion, self.ema_decay)
        rms, dispersion = model_statistics(abs_sums, square_sums, counts, self.reference)
        self.global_rms, self.global_dispersion = (
            ema(self.global_rms, rms, self.ema_decay),
            ema(self.global_dispersion, dispersion, self.ema_decay),
        )
        threshold = self._threshold(step)
        for layer in self.layers:
            if layer.pinned is None and layer.rms is not None:
                zone = classify_zone(layer.rms, layer.dispersion, self.global_rms, self.global_dispersion, threshold)
                layer.hysteresis.observe(zone, self.hysteresis)

    def _solve(self, count_transitions: bool) -> None:
        """Choose each adapted layer's formats: its zone's (``critical`` before the first check), demoted where the budget
        needs it, promoted where the room left under the cap allows it.

        With ``count_transitions``, every state whose stored format changes adds one to ``transitions``.
        """
        adapted = [layer for layer in self.layers if layer.pinned is None]
        zones = [layer.hysteresis.zone for layer in adapted]
        planned = [
            budget_ladder(zone, self.formats, lambda state, name, layer=layer: layer.nbytes[(state, name)])
            for zone, layer in zip(zones, adapted, strict=False)
        ]
        ladders, starts = [ladder for ladder, _ in planned], [start for _, start in planned]
        fixed = sum(sum(layer.state_bytes()) for layer in self.layers if layer.pinned is not None)
        values = len(ADAPTED_STATES) * sum(layer.numel for layer in self.layers)
        order = budget_order(zones, [layer.numel for layer in adapted], [layer.name for layer in adapted])
        try:
            costs = [[cost for _, cost in ladder] for ladder in ladders]
            rungs = fit_budget(costs, fixed, values, self.target_bits, order, starts, self.fill_budget)
        except BudgetError as error:
            raise BudgetError(f"AdaptiveBitWidth: {error}; raise target_bits or lower the optimizer's min_quant_size") from None
        for layer, ladder, rung in zip(adapted, ladders, rungs, strict=False):
            choice = ladder[rung][0]
            if count_transitions and layer.choice is not None:
                old, new = layer.stored_formats(layer.choice), layer.stored_formats(choice)
                self.transitions += sum(format_config(a) != format_config(b) for a, b in zip(old, new, strict=False))
            layer.choice = choice

    def _apply(self) -> None:
        """Make the optimizer store every adapted state as decided: overrides for new states, re-encoding for existing ones."""
        optimizer = self._optimizer
        for layer in self.layers:
            if layer.pinned is not None:
                continue
            optimizer.state_overrides[layer.param] = dict(zip(ADAPTED_STATES, layer.choice, strict=False))
            state = optimizer.state.get(layer.param, {})
            for name, target in zip(ADAPTED_STATES, layer.stored_formats(layer.choice), strict=False):
                if name not in state:
                    continue
                if format_config(target) != format_config(optimizer.state_format(layer.param, name)):
                    optimizer.reencode_state(layer.param, name, "fp32" if target is None else target)

    # --- reporting ---------------------------------------------------------------------------------------
    def _bits(self) -> list[list[float]]:
        """Stored bits per value of each layer's m and v (scales included): ``[[m per layer], [v per layer]]``."""
        per_layer = [[8 * nbytes / layer.numel if layer.numel else 0.0 for nbytes in layer.state_bytes()] for layer in self.layers]
        return [list(column) for column in zip(*per_layer, strict=False)]

    def metrics(self) -> dict[str, float]:
        """The logged numbers: average bits, bytes saved versus fp32, layers per zone, threshold, transitions."""
        stored = sum(sum(layer.state_bytes()) for layer in self.layers)
        values = len(ADAPTED_STATES) * sum(layer.numel for layer in self.layers)
        step = self.last_check if self.last_check is not None else 0
        metrics = {
            "qstate/adaptive/avg_bits": 8 * stored / values if values else 0.0,
            "qstate/adaptive/bytes_saved": float(4 * values - stored),
            "qstate/adaptive/threshold": self._threshold(step) if self._threshold is not None else self.threshold_start,
            "qstate/adaptive/transitions": float(self.transitions),
        }
        for zone in ZONES:
            metrics[f"qstate/adaptive/zone_{zone}"] = float(sum(layer.hysteresis.zone == zone for layer in self.layers))
        return metrics

    def decisions(self) -> dict[str, dict[str, Any]]:
        """``{layer name: {"zone": ..., "exp_avg": format name, "exp_avg_sq": format name}}`` of the adapted layers."""
        return {
            layer.name: {"zone": layer.hysteresis.zone, **dict(zip(ADAPTED_STATES, layer.choice, strict=False))}
            for layer in self.layers
            if layer.pinned is None
        }

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self.layers or not trainer.is_global_zero or not trainer._logger_connector.should_update_logs:
            return
        start = time.perf_counter()
        metrics = self.metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.fit_loop.epoch_loop._batches_that_stepped)
        self.overhead_seconds += time.perf_counter() - start

    def _log_heatmap(self, trainer: pl.Trainer, step: int) -> None:
        loggers = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
        if not loggers:
            return
        image = bit_width_heatmap(torch.tensor([entry["bits"] for entry in self.history], dtype=torch.float32).permute(1, 2, 0))
        for logger in loggers:
            logger.experiment.add_image("qstate/adaptive/bit_widths", image, global_step=step)

    # --- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Decisions, EMAs, hysteresis counters and history, as plain Python values (JSON-serialisable)."""
        if not self.layers and self._restored is not None:
            return self._restored
        return {
            "version": STATE_DICT_VERSION,
            "layers": {
                layer.name: {
                    "rms": layer.rms,
                    "dispersion": layer.dispersion,
                    "zone": layer.hysteresis.zone,
                    "pending": layer.hysteresis.pending,
                    "streak": layer.hysteresis.streak,
                    "formats": None if layer.choice is None else dict(zip(ADAPTED_STATES, layer.choice, strict=False)),
                }
                for layer in self.layers
            },
            "global_rms": self.global_rms,
            "global_dispersion": self.global_dispersion,
            "last_check": self.last_check,
            "transitions": self.transitions,
            "history": self.history,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the saved state; it is applied in ``on_train_start``, once the optimizer exists."""
        if state_dict.get("version") != STATE_DICT_VERSION:
            raise ValueError(f"AdaptiveBitWidth: checkpoint state version {state_dict.get('version')!r}, expected {STATE_DICT_VERSION}")
        self._restored = state_dict

    def _restore(self, saved: dict[str, Any]) -> None:
        entries = saved["layers"]
        missing, unknown = (
            sorted({layer.name for layer in self.layers} - set(entries)),
            sorted(set(entries) - {layer.name for layer in self.layers}),
        )
        if missing or unknown:
            raise ValueError(
                f"AdaptiveBitWidth: the checkpoint's layers do not match the optimizer's (missing: {missing}, unknown: {unknown})"
            )
        for layer in self.layers:
            entry = entries[layer.name]
            layer.rms, layer.dispersion = entry["rms"], entry["dispersion"]
            layer.hysteresis = ZoneHysteresis(entry["zone"], entry["pending"], entry["streak"])
            layer.choice = (
                None if entry["formats"] is None or layer.pinned is not None else tuple(entry["formats"][state] for state in ADAPTED_STATES)
            )
        self.global_rms, self.global_dispersion = saved["global_rms"], saved["global_dispersion"]
        self.last_check, self.transitions = saved["last_check"], saved["transitions"]
        self.history = [dict(entry) for entry in saved["history"]]


def format_config(fmt: StorageFormat | None) -> dict | None:
    """What identifies a format (``get_format``'s arguments), ``None`` for plain fp32."""
    return None if fmt is None else fmt.config


# Dark blue -> teal -> yellow, for log2(bits) from 2 (4 bits) to 5 (32 bits).
HEATMAP_PALETTE = torch.tensor([[30, 30, 110], [40, 150, 140], [250, 230, 40]], dtype=torch.float32)


def bit_width_heatmap(bits: torch.Tensor, low: float = 4.0, high: float = 32.0, cell: int = 4) -> torch.Tensor:
    """A ``(3, H, W)`` uint8 image of ``bits`` (``(panels, layers, checks)``: stored bits per value): one panel per
    state stacked vertically with a white line between, each value a ``cell`` x ``cell`` square, colour on a log
    scale from ``low`` (dark blue) to ``high`` bits (yellow)."""
    position = ((bits.clamp(low, high).log2() - math.log2(low)) / (math.log2(high) - math.log2(low))) * (len(HEATMAP_PALETTE) - 1)
    lower = position.floor().clamp(max=len(HEATMAP_PALETTE) - 2).long()
    weight = (position - lower).unsqueeze(-1)
    colours = HEATMAP_PALETTE[lower] * (1 - weight) + HEATMAP_PALETTE[lower + 1] * weight  # (panels, layers, checks, 3)
    separator = torch.full((1, colours.shape[2], 3), 255.0)
    rows = [part for panel in colours for part in (panel, separator)][:-1]
    image = torch.cat(rows).repeat_interleave(cell, dim=0).repeat_interleave(cell, dim=1)
    return image.round().to(torch.uint8).permute(2, 0, 1).contiguous()
