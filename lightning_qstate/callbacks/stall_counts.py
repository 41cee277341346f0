"""Stall counts of the trainer's quantized optimizers, measured on chosen steps and shared by the callbacks.

A callback that needs stall rates on every ``n``-th step of each optimizer keeps a :class:`MeasuredSteps`: it asks for
counts in ``on_before_optimizer_step`` (:func:`request_stall_tracking`) and collects them in ``on_train_batch_end``
(:func:`collect_stalls`). The optimizer counts in the step itself (``track_stalls``; no copies of the states are kept
between steps), and the counts of every ``(layer, state)`` are summed over ranks in one all-reduce. The result is
cached per global step, so :class:`StallMonitor`, :class:`StateResetScheduler` and :class:`PrecisionAdvisor` read
the same numbers, and tracking is switched back to what the user configured.

Steps are counted per optimizer (:func:`optimizer_steps`): under manual optimization with several optimizers, the
Trainer's global step counts all their steps.

Besides the states, every parameter of an optimizer that counts them (``QuantizedStates.counts_weight_stalls``: QAdam,
QAdamW, QSGD, QMuon, not the generic wrapper) has a row for the pseudo-state ``"weights"``
(:data:`~lightning_qstate.optim.WEIGHT_STALLS`): its entries whose update was lost to rounding. It is not a state:
its row has no ``format``, and the callbacks that act on states (resets, bit-widths) leave it alone.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import lightning.pytorch as pl
import torch

from ..formats import QuantizedTensor, StorageFormat
from ..optim import WEIGHT_STALLS, QuantizedStates, clean_parameter_name


@dataclass(frozen=True)
class StateRow:
    """One state of one parameter: ``layer`` is the parameter's clean name, ``state`` the state's name (or
    ``WEIGHT_STALLS``, the parameter's own values: ``is_state`` is ``False``)."""

    layer: str
    state: str
    optimizer: QuantizedStates
    group: dict
    param: torch.Tensor

    @property
    def is_state(self) -> bool:
        """Whether the row is an optimizer state (``False`` for the parameter's own values, ``WEIGHT_STALLS``)."""
        return self.state != WEIGHT_STALLS

    @property
    def format(self) -> StorageFormat | None:
        """The state's format here, or the policy's where this rank holds none of it (an empty shard); ``None`` for a
        plain state and for the weights' row."""
        if not self.is_state:
            return None
        if self.state in self.optimizer.state.get(self.param, {}):
            return self.optimizer.state_format(self.param, self.state)
        return self.optimizer._policy_format(self.group, self.param, self.state)


@dataclass
class StallMeasurement:
    """Stall counts of one measured step: ``counts[i] = [stalled, moved]`` of ``rows[i]``, summed over ranks (``local``:
    this rank's)."""

    step: int
    rows: list[StateRow]
    counts: torch.Tensor  # (len(rows), 2) float64, on the CPU
    local: torch.Tensor | None = None  # the same, of this rank alone

    def rates(self) -> dict[tuple[str, str], float]:
        """``{(layer, state): stalled / moved}`` of the rows that moved."""
        return {(row.layer, row.state): float(c[0] / c[1]) for row, c in zip(self.rows, self.counts, strict=False) if c[1] > 0}


_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # trainer -> (its optimizers then, its last StallMeasurement)
_TRACKING_BASE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> the user's track_stalls
_SET_ASIDE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> the user's counts before a measured step


def quantized_optimizers(trainer: pl.Trainer) -> list[QuantizedStates]:
    return [optimizer for optimizer in trainer.strategy.optimizers if isinstance(optimizer, QuantizedStates)]


_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # trainer -> (holders, rows), built once per set of parameters


def state_rows(trainer: pl.Trainer) -> list[StateRow]:
    """Every ``(parameter, state name)`` of the quantized optimizers, then ``(parameter, WEIGHT_STALLS)`` where the
    optimizer counts the weights' stalls, in the same order on every rank (built again only when the optimizers or
    their parameters change, as ``add_param_group`` does, or a wrapped optimizer's state names, which appear at its
    first step: callbacks call this at every step)."""
    optimizers = quantized_optimizers(trainer)
    holders = [item for optimizer in optimizers for item in (optimizer, *(p for g in optimizer.param_groups for p in g["params"]))]
    # a wrapped optimizer's states appear at its first step (RMSprop, NAdam...): rows built before it would stay empty
    wrapped = {optimizer: _wrapped_state_names(optimizer) for optimizer in optimizers if not optimizer.state_names}
    cached = _ROWS.get(trainer)  # compared by identity: an id() of a discarded optimizer can be reused by a new one
    if (
        cached is None
        or cached[2] != wrapped
        or len(cached[0]) != len(holders)
        or any(a is not b for a, b in zip(cached[0], holders, strict=True))
    ):
        cached = _ROWS[trainer] = (holders, _build_state_rows(trainer, wrapped), wrapped)
    return cached[1]


def _build_state_rows(trainer: pl.Trainer, wrapped: dict[QuantizedStates, tuple[str, ...]]) -> list[StateRow]:
    """The rows of ``state_rows``; ``wrapped``: the state names of the wrapped optimizers (``_wrapped_state_names``)."""
    model = trainer.strategy.model if trainer.strategy.model is not None else trainer.lightning_module
    names = {param: clean_parameter_name(name) for name, param in model.named_parameters()}
    rows = []
    for optimizer in quantized_optimizers(trainer):
        fallback = optimizer.param_names()
        state_names = optimizer.state_names or wrapped[optimizer]
        if optimizer.counts_weight_stalls:
            state_names = (*state_names, WEIGHT_STALLS)
        for group in optimizer.param_groups:
            for param in group["params"]:
                rows += [StateRow(names.get(param, fallback[param]), name, optimizer, group, param) for name in state_names]
    return rows


def known_state_names(optimizer: QuantizedStates) -> tuple[str, ...]:
    """The state names of ``optimizer``: its class's, or a wrapped optimizer's once its first step made them (empty before)."""
    return optimizer.state_names or _wrapped_state_names(optimizer)


def _wrapped_state_names(optimizer: QuantizedStates) -> tuple[str, ...]:
    """State names of a wrapped optimizer of unknown kind: its parameter-shaped states, over all its parameters
    (one list for every parameter, so ranks that hold different parameters agree)."""
    names = {
        name
        for state in optimizer.state.values()
        for name, value in state.items()
        if isinstance(value, QuantizedTensor) or (isinstance(value, torch.Tensor) and value.dim() > 0)
    }
    return tuple(sorted(names))


def optimizer_steps(trainer: pl.Trainer, optimizer: QuantizedStates) -> int:
    """Optimizer steps ``optimizer`` has taken: the Trainer's global step where it is the only optimizer; with several
    (manual optimization, whose global step counts every optimizer's steps), its own count (``steps_taken``, which its
    checkpoint restores). The same on every rank."""
    return trainer.global_step if len(trainer.strategy.optimizers) == 1 else optimizer.steps_taken


class MeasuredSteps:
    """The steps a callback measures: every ``interval``-th step of each quantized optimizer (:func:`optimizer_steps`).

    :meth:`request` in ``on_before_optimizer_step`` turns the stall counting on for the step about to run where it
    completes an interval; :meth:`collect` in ``on_train_batch_end`` returns the counts of a batch that had such a step
    (an optimizer that steps again in the same batch is counted until its end), with the optimizers measured.
    """

    def __init__(self) -> None:
        self.pending: list[QuantizedStates] = []  # this batch's measured optimizers

    def request(self, trainer: pl.Trainer, optimizer: torch.optim.Optimizer, interval: int) -> bool:
        """Whether ``optimizer``'s coming step completes an ``interval`` (0: never); if so, count its stalls."""
        if not interval or not isinstance(optimizer, QuantizedStates) or (optimizer_steps(trainer, optimizer) + 1) % interval:
            return False
        request_stall_tracking(trainer, optimizer)
        if optimizer not in self.pending:
            self.pending.append(optimizer)
        return True

    def collect(self, trainer: pl.Trainer) -> tuple[StallMeasurement, list[QuantizedStates]] | None:
        """The batch's measurement and its measured optimizers (a collective: every rank alike), or ``None``."""
        if not self.pending:
            return None
        measured, self.pending = self.pending, []
        return collect_stalls(trainer), measured


def request_stall_tracking(trainer: pl.Trainer, optimizer: QuantizedStates) -> None:
    """Count stalls in the coming optimizer step(s) of ``optimizer``. Where the user tracks stalls too
    (``track_stalls=True``), the counts gathered so far are set aside, so that the measurement holds the coming step only,
    and given back at :func:`collect_stalls` (with the measured step's) so that the user's totals stay whole."""
    if optimizer not in _TRACKING_BASE:
        _TRACKING_BASE[optimizer] = optimizer.track_stalls
        if optimizer.track_stalls:
            _SET_ASIDE[optimizer] = optimizer.__dict__.pop("_stall_counts", {})
            optimizer._stall_counts = {}
    optimizer.track_stalls = True


def across_ranks(trainer: pl.Trainer, local: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """``local`` (a CPU tensor, left as it is) reduced over ranks with ``reduce_op`` (``"sum"``, ``"max"``), on the CPU; a
    collective where there are several ranks (the strategy's reduce works in place on a copy sent to its device)."""
    if trainer.world_size == 1:
        return local
    return trainer.strategy.reduce(local.to(trainer.strategy.root_device, copy=True), reduce_op=reduce_op).cpu()


def held_on_some_rank(trainer: pl.Trainer, entries: Sequence[tuple[torch.optim.Optimizer, torch.Tensor]]) -> list[bool]:
    """Whether some rank's optimizer holds states of each ``(optimizer, parameter)`` (an FSDP1 rank whose shard of a
    parameter is empty holds none): a collective where there are several ranks."""
    local = torch.tensor([float(bool(optimizer.state.get(param))) for optimizer, param in entries])
    return [bool(held) for held in across_ranks(trainer, local, "max").tolist()]


def collect_stalls(trainer: pl.Trainer) -> StallMeasurement:
    """The counts since the last collection, summed over ranks (a collective: call it on every rank at the
    same step); a second call at the same global step, with the same optimizers, returns the same measurement (another
    fit of the trainer, resumed to an earlier step, has other optimizers: measured afresh)."""
    optimizers = quantized_optimizers(trainer)
    cached_optimizers, cached = _CACHE.get(trainer, ((), None))
    same_optimizers = len(cached_optimizers) == len(optimizers) and all(a is b for a, b in zip(cached_optimizers, optimizers, strict=True))
    if cached is not None and cached.step == trainer.global_step and same_optimizers:
        return cached
    rows = state_rows(trainer)
    local = torch.zeros(len(rows), 2, dtype=torch.float64)
    taken = {id(optimizer): optimizer.stall_counts(reset=True) if optimizer.track_stalls else {} for optimizer in optimizers}
    for index, row in enumerate(rows):
        counts = taken[id(row.optimizer)].get(row.param, {}).get(row.state)
        if counts is not None:
            local[index] = counts.to("cpu", torch.float64)
    total = across_ranks(trainer, local, "sum")
    for optimizer in optimizers:
        optimizer.track_stalls = _TRACKING_BASE.pop(optimizer, optimizer.track_stalls)
        if optimizer in _SET_ASIDE:  # the user's own tracking: its counts before the measured step, plus the measured step's
            counts = _SET_ASIDE.pop(optimizer)
            for param, states in taken[id(optimizer)].items():
                for name, value in states.items():
                    counts[param, name] = counts[param, name] + value if (param, name) in counts else value
            optimizer._stall_counts = counts
    measurement = StallMeasurement(trainer.global_step, rows, total, local)
    _CACHE[trainer] = (tuple(optimizers), measurement)
    return measurement
