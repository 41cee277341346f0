"""Zero stale low-precision optimizer states on the stall theory's schedule, or when they measurably stall."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from ..arguments import ConfigurationError, check_flags, finite_real, is_positive_int
from ..formats import StorageFormat
from ..theory import moment_of, reset_period, state_decay
from ..theory.stall import RUNNING_MAXIMA
from .stall_counts import (
    MeasuredSteps,
    StateRow,
    across_ranks,
    held_on_some_rank,
    known_state_names,
    optimizer_steps,
    quantized_optimizers,
    state_rows,
)
from .tensorboard import log_scalars

STATE_VERSION = 1
# Steps between the stall measurements of the threshold trigger, by default.
CHECK_EVERY_N_STEPS = 50


@lru_cache(maxsize=256)
def _theory_period(fmt: StorageFormat, beta: float, rounding: str, state: str) -> int | None:
    return reset_period(fmt, beta, rounding, moment=moment_of(state))


def _period_decay(beta: float) -> float:
    """The decay ``period="auto"`` computes a period for: ``beta`` with ``1 - beta`` rounded to two significant digits
    (0.9, 0.95, 0.99, 0.999 and 0.9995 stay as they are). Under a schedule of the decays (``OneCycleLR`` and
    ``CyclicLR`` cycle Adam's ``beta1`` every step) a period is computed once per rounded value, not at every step
    (25-450 ms each). ``1 - β`` moves by up to 5 % within a rounding step, the period (about the square root of the
    half-staleness age over ``1 - β``) by a few percent, well inside its rounding to a 1-2-3-5 series."""
    gap = 1.0 - beta
    return 1.0 - float(f"{gap:.2g}") if gap > 0.0 else beta


class StateResetScheduler(Callback):
    """Periodically zero the EMA states of quantized optimizers, which stall as they age (arXiv 2603.16731).

    A state that is zeroed is responsive again: its stall probability builds up from about zero to the steady
    state over the following hundreds of steps (:func:`lightning_qstate.theory.stall_probability` with
    ``age``). A *layer* here is one parameter; its selected states are zeroed together, keeping their formats.

    **When.** ``period="auto"`` (default): each layer every :func:`lightning_qstate.theory.reset_period` steps
    for its states' formats, decays and rounding (the shortest over its states; bf16 1000, FP8 300, E2M2 200
    at ``β2 = 0.999``; fp32 and fp16 states never), recomputed when a format or a decay changes (a decay scheduled
    every step, as ``OneCycleLR`` cycles ``β1``, counts by ``1 - β`` to two significant digits). An int: every layer with
    a quantized selected state, every ``period`` steps. ``threshold``: also (or, with ``period=None``, only)
    reset a layer once its measured stall rate of any selected state reaches ``threshold``, measured on one
    step every ``check_every_n_steps``. ``stagger=True`` spreads the layers' first resets over one period. Steps are
    those of the layer's optimizer (under manual optimization with several optimizers the global step counts them all:
    each counts its own).

    **What.** ``states``: the state names to zero (default: all of the optimizer's EMA states, i.e. Adam's two
    moments or SGD's momentum). ``reset_step``: also restart Adam's step count, hence its bias correction.
    The paper does not (the default); then the first step after a reset is about ``(1 - β1) / sqrt(1 - β2)``
    times a normal one (3.16 at ``(0.9, 0.999)``), which is logged as ``qstate/reset/first_step_ratio``.

    **fp32 states** are never reset unless ``include_fp32=True`` (which warns: resets slightly hurt there).

    Resets happen after the optimizer step, identically on every rank (from the step counts and
    rank-summed measurements). Logged from rank 0 at every reset: ``qstate/reset/layers`` (layers reset at
    that step) and ``qstate/reset/total``. The schedule (last reset of each layer, history) is saved in
    checkpoints, so a resumed run resets at the same steps. One instance per Trainer (Lightning refuses a second: the
    schedule is checkpointed under the class name).

    Example::

        trainer = Trainer(plugins=[QStatePrecision(states="bf16", rounding="stochastic")],
                          callbacks=[StateResetScheduler()])             # bf16 states: every 1000 steps at β2 = 0.999

    Args:
        period: ``"auto"``, a number of steps, or ``None`` (only the threshold trigger).
        threshold: measured stall rate in ``(0, 1]`` that triggers a layer's reset, or ``None``.
        check_every_n_steps: steps between stall measurements of the threshold trigger (only with a ``threshold``).
        states: names of the states to zero; default all of the optimizer's EMA states.
        reset_step: restart the step count (bias correction) of the reset layers.
        stagger: give the layers evenly spread phases, so they do not all reset at the same step.
        include_fp32: reset plain fp32 states too.

    Raises:
        ValueError: for invalid options, or (at the start of training) state names the optimizer does not have.
    """

    def __init__(
        self,
        period: int | Literal["auto"] | None = "auto",
        threshold: float | None = None,
        check_every_n_steps: int = CHECK_EVERY_N_STEPS,
        states: Sequence[str] | None = None,
        reset_step: bool = False,
        stagger: bool = False,
        include_fp32: bool = False,
    ) -> None:
        if not (period == "auto" or period is None or is_positive_int(period)):
            raise ValueError(f"StateResetScheduler: period={period!r} is not valid; use 'auto', a positive int, or None (threshold only)")
        if threshold is not None and not (finite_real(threshold) and 0.0 < threshold <= 1.0):
            raise ValueError(f"StateResetScheduler: threshold={threshold!r} must lie in (0, 1] (a stall rate), or be None")
        if period is None and threshold is None:
            raise ValueError("StateResetScheduler: period=None needs a threshold; give period='auto', an int, or a threshold")
        if not is_positive_int(check_every_n_steps):
            raise ValueError(f"StateResetScheduler: check_every_n_steps={check_every_n_steps!r} must be a positive int")
        if threshold is None and check_every_n_steps != CHECK_EVERY_N_STEPS:
            raise ValueError(
                f"StateResetScheduler: check_every_n_steps={check_every_n_steps!r} paces the threshold trigger, and threshold=None "
                "has none; give a threshold (a stall rate in (0, 1]) too, or leave check_every_n_steps out"
            )
        if states is not None and (isinstance(states, str) or not states or not all(isinstance(name, str) for name in states)):
            raise ValueError(
                f"StateResetScheduler: states={states!r} must be a non-empty list of state names, e.g. ['exp_avg', 'exp_avg_sq']"
            )
        check_flags("StateResetScheduler", reset_step=reset_step, stagger=stagger, include_fp32=include_fp32)
        if include_fp32:
            rank_zero_warn(
                "StateResetScheduler(include_fp32=True): resetting fp32 states slightly hurts training (arXiv 2603.16731); "
                "they do not stall"
            )
        self.period = int(period) if is_positive_int(period) else period  # numpy's ints as Python's
        self.threshold = None if threshold is None else float(threshold)
        self.check_every_n_steps = int(check_every_n_steps)
        self.states = None if states is None else tuple(states)
        self.reset_step = reset_step
        self.stagger = stagger
        self.include_fp32 = include_fp32
        self.last_reset: dict[str, int] = {}  # layer -> its optimizer's step of its last reset (negative: the stagger phase)
        self.history: list[tuple[int, str]] = []  # (that step, layer) of every reset
        self._last_seen_step = -1
        self._checks = MeasuredSteps()  # the threshold's measured steps
        self._names_checked = False  # states= checked against the optimizers' names (a wrapped one's exist after its first step)

    # --- which layers and states ------------------------------------------------------------------------
    def layers(self, trainer: pl.Trainer) -> dict[str, list[StateRow]]:
        """``{layer: rows of its selected states}``, in parameter order (the same on every rank)."""
        layers: dict[str, list[StateRow]] = {}
        for row in state_rows(trainer):
            selected = row.state in self.states if self.states is not None else state_decay(row.group, row.state) is not None
            if selected and (self.include_fp32 or row.format is not None):
                layers.setdefault(row.layer, []).append(row)
        return layers

    def layer_period(self, rows: list[StateRow]) -> int | None:
        """Steps between resets of a layer (``None``: never by period); ``"auto"``: the shortest theory period of its
        quantized EMA states (a running maximum, AMSGrad's ``max_exp_avg_sq``, has no stall model: it is reset with
        the layer's others, never for itself)."""
        if self.period != "auto":
            return self.period
        periods = []
        for row in rows:
            beta = state_decay(row.group, row.state)
            if row.format is not None and beta is not None and row.state not in RUNNING_MAXIMA:
                periods.append(_theory_period(row.format, _period_decay(beta), row.group["rounding"], row.state))
        periods = [p for p in periods if p is not None]
        return min(periods) if periods else None

    # --- hooks ----------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # a fresh schedule for every fit; a checkpoint's is restored after this hook
            self.last_reset, self.history = {}, []

    def _check_names(self, trainer: pl.Trainer) -> bool:
        """Check ``states=`` against the optimizers' state names and warn where nothing is to be reset; ``False`` (put
        off) while a wrapped optimizer has not made its states yet (they appear at its first step)."""
        optimizers = quantized_optimizers(trainer)
        names = [known_state_names(optimizer) for optimizer in optimizers]
        if not all(names):
            return False
        if self.states is not None:
            known = {name for per_optimizer in names for name in per_optimizer}
            unknown = sorted(set(self.states) - known)
            if unknown:
                raise ConfigurationError(
                    f"StateResetScheduler: unknown state name(s) {unknown} in states=; the optimizers have {sorted(known)}"
                )
            amsgrad = any(group.get("amsgrad") for optimizer in optimizers for group in optimizer.param_groups)
            if "max_exp_avg_sq" in self.states and not amsgrad:
                raise ConfigurationError(
                    "StateResetScheduler: states= names 'max_exp_avg_sq', which Adam keeps only with amsgrad=True; drop it"
                )
        if not self.layers(trainer):
            rank_zero_warn(
                "StateResetScheduler: no quantized state to reset (fp32 states are left alone: resets hurt there). "
                "Quantize the states with QStatePrecision or QuantizedOptimizerStates, or pass include_fp32=True."
            )
        return True

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._names_checked = self._check_names(trainer)
        self._phase_new_layers(trainer, self.layers(trainer), stepped=False)
        self._last_seen_step = trainer.global_step
        self._checks = MeasuredSteps()

    def _phase_new_layers(self, trainer: pl.Trainer, layers: dict[str, list[StateRow]], stepped: bool) -> None:
        """Start the schedule of every layer of ``layers`` that has none (a resumed run keeps its own) from the optimizer
        step before its states were made, once they are: after the first step for those that step from the start, and
        later for layers whose states appear later (a parameter unfrozen after some steps, a group added with
        ``add_param_group``); a layer that holds states when training starts (resumed without a schedule for it) from
        there. With ``stagger``, the layers that start together spread their first resets over one period. Every rank
        phases alike: whether a layer's states exist is taken over the ranks (a collective while some layer has no
        schedule; an FSDP rank whose shard is empty holds none)."""
        # a frozen parameter (the same on every rank) makes no states: left out without a collective until it trains
        new = [(layer, rows) for layer, rows in layers.items() if layer not in self.last_reset and rows[0].param.requires_grad]
        if not new:
            return
        held = held_on_some_rank(trainer, [(rows[0].optimizer, rows[0].param) for _, rows in new])
        appeared = [entry for entry, has_states in zip(new, held, strict=True) if has_states]
        for index, (layer, rows) in enumerate(appeared):
            period = self.layer_period(rows)
            origin = optimizer_steps(trainer, rows[0].optimizer) - int(stepped)
            self.last_reset[layer] = origin - ((index * period) // len(appeared)) if self.stagger and period else origin

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        if self.threshold is not None:
            self._checks.request(trainer, optimizer, self.check_every_n_steps)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == self._last_seen_step:  # no optimizer step in this batch (gradient accumulation)
            return
        self._last_seen_step = trainer.global_step
        if not self._names_checked:
            self._names_checked = self._check_names(trainer)
        layers = self.layers(trainer)
        self._phase_new_layers(trainer, layers, stepped=True)
        due = []
        for layer, rows in layers.items():
            period = self.layer_period(rows)
            if period is None or layer not in self.last_reset:  # no states yet on any rank (frozen): nothing to reset
                continue
            if optimizer_steps(trainer, rows[0].optimizer) - self.last_reset[layer] >= period:
                due.append(layer)
        checked = self._checks.collect(trainer)
        if checked is not None:
            rates, measured = checked[0].rates(), checked[1]
            due += [
                layer
                for layer, rows in layers.items()
                if layer not in due
                and rows[0].optimizer in measured
                and any(rates.get((layer, row.state), 0.0) >= self.threshold for row in rows)
            ]
        if due:
            self._reset(trainer, {layer: layers[layer] for layer in due})

    def _reset(self, trainer: pl.Trainer, layers: dict[str, list[StateRow]]) -> None:
        # each layer's Adam step count and whether it holds states, the largest over ranks (a collective: every rank
        # resets and counts the same layers): a rank whose FSDP shard of the parameter is empty has no state, and would
        # log the ratio of a first step
        states = [rows[0].optimizer.state.get(rows[0].param, {}) for rows in layers.values()]
        local = [[float(state.get("step", -1)), float(bool(state))] for state in states]
        steps, held = across_ranks(trainer, torch.tensor(local, dtype=torch.float64).view(-1, 2), "max").T.tolist()
        ratios, count = [], 0
        for (layer, rows), adam_step, has_states in zip(layers.items(), steps, held, strict=True):
            names = [row.state for row in rows]
            rows[0].optimizer.reset_states(rows[0].param, names, restart_step=self.reset_step)
            step = optimizer_steps(trainer, rows[0].optimizer)
            # a parameter without states on every rank (frozen, or never given a gradient) had nothing to reset: not
            # counted, and phased again when its states appear
            if not has_states:
                self.last_reset.pop(layer, None)
            else:
                self.last_reset[layer] = step
                state = {"step": adam_step} if adam_step >= 0 else {}
                ratios.append(first_step_ratio(rows[0].group, state, self.reset_step, names))
                self.history.append((step, layer))
                count += 1
        if not count:
            return
        metrics = {"qstate/reset/layers": float(count), "qstate/reset/total": float(len(self.history))}
        ratios = [r for r in ratios if r is not None]
        if ratios:
            metrics["qstate/reset/first_step_ratio"] = max(ratios)
        if trainer.is_global_zero:
            log_scalars(trainer, metrics, trainer.fit_loop.epoch_loop._batches_that_stepped)

    # --- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "last_reset": dict(self.last_reset), "history": [list(entry) for entry in self.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("version") != STATE_VERSION:
            raise ValueError(f"StateResetScheduler: checkpoint state version {state_dict.get('version')!r} is not {STATE_VERSION}")
        self.last_reset = {layer: int(step) for layer, step in state_dict["last_reset"].items()}
        self.history = [(int(step), layer) for step, layer in state_dict["history"]]


def first_step_ratio(group: dict, state: dict, restarted: bool, zeroed: Sequence[str] = ("exp_avg", "exp_avg_sq")) -> float | None:
    """Size of the first Adam step after a reset of the states ``zeroed`` relative to a steady one (``m̂/sqrt(v̂) ≈ 1``),
    at the next step ``t``: both moments rebuilt from zero by one gradient, ``(1 - β1)·sqrt(1 - β2^t) / ((1 - β1^t)·
    sqrt(1 - β2))``; ``m`` alone (``v`` steady), ``(1 - β1) / (1 - β1^t)``; both 1 when the step count restarted (t = 1).
    ``None`` for optimizers without ``betas``, and where ``v`` alone was zeroed (the moment hold bounds that step)."""
    if "betas" not in group or "exp_avg" not in zeroed:
        return None
    beta1, beta2 = (float(b) for b in group["betas"])
    t = 1.0 if restarted or "step" not in state else float(state["step"]) + 1
    m_alone = (1 - beta1) / (1 - beta1**t)
    return m_alone * ((1 - beta2**t) / (1 - beta2)) ** 0.5 if "exp_avg_sq" in zeroed else m_alone
