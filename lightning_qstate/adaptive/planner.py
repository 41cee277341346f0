"""``BitWidthPlanner``: per-layer, per-state bit-widths for Adam's m and v that adapt during training under a memory cap
(STQuant, a reconstruction); it drives any ``QAdam``/``QAdamW`` from a plain torch loop or from the Lightning callback."""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..arguments import ConfigurationError, finite_real, is_positive_int
from ..formats import StorageFormat, get_format
from ..optim import QuantizedStates, clean_parameter_name, resolve_format
from ..optim.base import local_tensor, plain_state_name
from ..optim.policy import format_name_for
from .budget import BudgetError, Choice, budget_ladder, budget_order, fit_budget, floor_option, resolved_nbytes
from .zones import (
    REFERENCES,
    ZONES,
    AnnealedThreshold,
    ZoneHysteresis,
    check_candidate,
    check_zone_formats,
    classify_zone,
    ema,
    gradient_statistics,
    model_statistics,
)

ADAPTED_STATES = ("exp_avg", "exp_avg_sq")  # Adam's m and v
# The maps spend bits where the screens show they matter (GPT benchmark, 10 seeds against fixed int8: m int4 + v int8
# +0.07 %, m int8 + v int4 +1.70 %): m takes 4 bits (the dynamic int4 map) in every zone but the critical one
# (int8_linear, as STQuant's 8-bit critical layers), and v steps down one bit per zone with the dense codes (int8,
# int7, int6, int5: 8, 7, 6 and 5 bits per value plus the fp32 scales, ``formats.packing``). A layer's ladder (see
# ``adaptive.budget``) therefore changes only v from redundant up to magnitude, so the budget's promotions, which give
# the cap's slack to the least precise layers first, spend it on v; at 4 bits m takes the dynamic map, not
# int4_linear, which stores every m under 1/14 of its block's absmax as 0. (Before the dense codes, 5 to 8 bits took a
# byte, and v was int8 in three zones and the logarithmic e4m0 in the redundant one.) Pass m_formats with
# "int4_linear" for the paper's all-linear m.
DEFAULT_M_FORMATS = {"critical": "int8_linear", "magnitude": "int4", "structural": "int4", "redundant": "int4"}
DEFAULT_V_FORMATS = {"critical": "int8", "magnitude": "int7", "structural": "int6", "redundant": "int5"}
# The budget's last resort below every zone's formats (``floor_formats``): used only where the zones' formats cannot
# meet ``target_bits`` (a model with many small parameters kept plain by ``min_quant_size``, e.g. the ViT benchmark,
# whose cheapest zone plan is 5.115 bits), so a cap the zones can meet plans exactly as without it.
DEFAULT_FLOOR_FORMATS = {"exp_avg": "int4", "exp_avg_sq": "int4"}
STATE_DICT_VERSION = 1


def check_options(
    owner: str,
    *,
    target_bits: float | None,
    interval: int,
    ema_decay: float,
    hysteresis: int,
    threshold_start: float,
    threshold_end: float,
    reference: str,
    m_formats: Mapping[str, str] | None,
    v_formats: Mapping[str, str] | None,
    max_history: int,
    floor_formats: Mapping[str, str] | None = None,
    fill_budget: bool = True,
    anneal_steps: int | None = None,
) -> tuple[dict[str, dict[str, str]], dict[str, str]]:
    """Check the planner's options (errors start with ``owner``; ``anneal_steps=None``: left to the caller); returns
    ``({state: {zone: format name}}, {state: floor format name})`` for m and v, the defaults filled in
    (``floor_formats=None``: ``DEFAULT_FLOOR_FORMATS``; a state it does not name has no floor below its zones' formats)."""
    if target_bits is not None and not (finite_real(target_bits) and target_bits > 0):
        raise ConfigurationError(
            f"{owner}: target_bits={target_bits!r} must be a number > 0 (average bits per state value) or None (no cap)"
        )
    counts = {"interval": interval, "hysteresis": hysteresis, "max_history": max_history, "anneal_steps": anneal_steps}
    for option, value in counts.items():
        if not is_positive_int(value) and not (option == "anneal_steps" and value is None):
            none = " or None (the Trainer's max_steps)" if option == "anneal_steps" and owner == "AdaptiveBitWidth" else ""
            raise ConfigurationError(f"{owner}: {option}={value!r} must be an int >= 1{none}")
    if not isinstance(fill_budget, bool):
        raise ConfigurationError(f"{owner}: fill_budget={fill_budget!r} must be True or False")
    if not (finite_real(ema_decay) and 0 <= ema_decay < 1):
        raise ConfigurationError(f"{owner}: ema_decay={ema_decay!r} must be in [0, 1)")
    if reference not in REFERENCES:
        raise ConfigurationError(f"{owner}: reference={reference!r} is not valid; use one of {REFERENCES}")
    try:
        AnnealedThreshold(threshold_start, threshold_end)
    except ValueError:
        raise ConfigurationError(f"{owner}: threshold_start={threshold_start!r} and threshold_end={threshold_end!r} must be > 0") from None
    floor = DEFAULT_FLOOR_FORMATS if floor_formats is None else floor_formats
    if not isinstance(floor, Mapping) or not set(floor) <= set(ADAPTED_STATES):
        raise ConfigurationError(
            f"{owner}: floor_formats={floor_formats!r} must map some of {list(ADAPTED_STATES)} to a format name, or be None"
        )
    for state, name in floor.items():
        check_candidate(name, f"{owner}: floor_formats[{state!r}]")
    zones = {
        "exp_avg": check_zone_formats(DEFAULT_M_FORMATS if m_formats is None else m_formats, f"{owner}: m_formats"),
        "exp_avg_sq": check_zone_formats(DEFAULT_V_FORMATS if v_formats is None else v_formats, f"{owner}: v_formats"),
    }
    return zones, dict(floor)


def adaptable(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a :class:`BitWidthPlanner` can plan ``optimizer``'s states: a quantized Adam (``QAdam``/``QAdamW``, or a
    wrapped torch Adam) with ``exp_avg`` and ``exp_avg_sq``."""
    return isinstance(optimizer, QuantizedStates) and set(ADAPTED_STATES) <= set(optimizer.state_names)


def format_config(fmt: StorageFormat | None) -> dict | None:
    """What identifies a format (``get_format``'s arguments), ``None`` for a plain state."""
    return None if fmt is None else fmt.config


def _configs(formats: Sequence[StorageFormat | None]) -> list[dict | None]:
    return [format_config(fmt) for fmt in formats]


def kept_plain(name: str) -> bool:
    """Whether ``name`` (of :meth:`BitWidthPlanner.format_names`) is a state kept plain (``Layer.plain_name``)."""
    return name == "fp32" or name.endswith(" (plain)")


@dataclass
class Layer:
    """One parameter the planner tracks (``param``: the optimizer's key; ``numel``: the full parameter's size)."""

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
    held: bool | None = None  # some rank held its states at the last check (None: not checked yet)
    fed: bool = False  # some rank had its gradient at the last check (its states exist after that step)
    plain: torch.dtype = torch.float32  # the dtype of a state kept plain, as priced (the optimizer's for it)

    @property
    def plain_name(self) -> str:
        """The name of a state kept plain: ``"fp32"``, else its dtype's and ``" (plain)"`` (``"bf16 (plain)"``: not the
        bf16 format a plan may choose)."""
        return "fp32" if self.plain == torch.float32 else f"{plain_state_name(self.plain)} (plain)"

    @property
    def stored(self) -> bool:
        """Whether its states count in the budget: held or about to be made (before the first check: assumed). A
        trainable parameter that gets no gradient has none, and priced it would lend the others bits."""
        return self.held is None or self.held or self.fed

    def state_bytes(self) -> list[int]:
        """Bytes of each adapted state in its current format."""
        if self.pinned is not None:
            return [self.pinned[state] for state in ADAPTED_STATES]
        return [self.nbytes[(state, name)] for state, name in zip(ADAPTED_STATES, self.choice, strict=False)]

    def stored_formats(self, choice: Choice) -> list[StorageFormat | None]:
        """The format each adapted state is stored in under ``choice``, as the optimizer resolves it (``None``: plain,
        e.g. below ``min_quant_size``); depends on the full parameter only, so it is the same on every rank."""
        override = dict(zip(ADAPTED_STATES, choice, strict=False))
        return [resolve_format({**self.group, "states": override}, state, self.param, self.numel) for state in ADAPTED_STATES]


class BitWidthPlanner:
    """Per-layer, per-state bit-widths for Adam's ``exp_avg`` (m) and ``exp_avg_sq`` (v) that adapt during training
    under a hard memory cap: STQuant (arXiv 2604.06836) as reconstructed in ``docs/algorithms.md`` ("Adaptive
    bit-widths"). The statistics, zones, annealing, hysteresis, format maps and budget rule are that reconstruction,
    each an option here. Pure torch: a plain loop drives it with :meth:`update`; the Lightning callback
    :class:`~lightning_qstate.callbacks.AdaptiveBitWidth` all-reduces the statistics over ranks first.

    A check (:meth:`update` at ``step % interval == 0``, before the optimizer step; ``step``: optimizer steps taken):

    1. :meth:`observe`: per parameter ("layer"), the gradient's ``N = RMS(g)`` and ``R = std(|g|)/mean(|g|)`` from
       three sums (:meth:`gradient_sums`; summed over ranks, every rank decides alike), and EMAs (``ema_decay``) of
       both, per layer and for the whole model (``reference``); each layer's zone: N and R above ``threshold`` times
       the model's count as high (critical: both, magnitude: N only, structural: R only, redundant: neither); the
       threshold rises linearly from ``threshold_start`` to ``threshold_end`` over ``anneal_steps``; a new zone is
       adopted once seen at ``hysteresis`` consecutive checks (the first observation at once);
    2. :meth:`plan`: zone -> formats (``m_formats``, ``v_formats``), then the budget over the average of **all** m and
       v values (those kept plain by ``min_quant_size`` or FSDP2 row alignment included, at their real stored bytes,
       scales included; a parameter with neither states nor a gradient stores none and is left out until it has
       either): above ``target_bits``, layers are demoted (lowest-priority zone first, then the largest,
       then by name) down their ladder of cheaper zones' formats until it fits (to ``floor_formats`` only where the
       zones' formats cannot meet the cap); then (``fill_budget``) in rounds,
       layers in the same order move one rung up while the average stays within the cap
       (:func:`~lightning_qstate.adaptive.fit_budget`);
    3. :meth:`apply`: changed states are re-encoded through ``optimizer.reencode_state`` (round-to-nearest from the
       decoded values), and ``optimizer.state_overrides`` is set so that states created later use the decided formats.

    Construction plans every layer as ``critical``, capped by the budget (:class:`~lightning_qstate.adaptive.BudgetError`
    if even the cheapest candidates miss ``target_bits``); the optimizer is untouched until :meth:`apply`. With
    ``target_bits=None`` every layer keeps its zone's formats. Parameters with a user override
    (``optimizer.configured_overrides``: the policy's ``overrides``, not a plan's entries in ``state_overrides``) keep
    it and count in the average. A param group
    whose ``states=`` keeps m or v fp32 (``"fp32"``, or a mapping without it) is refused: the plan would override it.

    Example (a plain torch loop; step 0 is a check, so the first plan is applied before the first optimizer step)::

        model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
        optimizer = lightning_qstate.QAdamW(model.parameters(), lr=1e-3, min_quant_size=0, rounding="stochastic")
        planner = BitWidthPlanner(optimizer, model, target_bits=5.1, interval=10, hysteresis=2, anneal_steps=100)
        for step in range(100):
            x = torch.randn(64, 32)
            loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
            optimizer.zero_grad()
            loss.backward()
            planner.update(step)  # every 10 steps: statistics, zones, plan, re-encoding
            optimizer.step()
        planner.decisions()  # {"0.weight": {"zone": "redundant", "exp_avg": "int4", "exp_avg_sq": "int5"}, ...}
        planner.metrics()["qstate/adaptive/avg_bits"]  # <= 5.1

    Args:
        optimizer: a ``QAdam``/``QAdamW`` (or a quantized wrapper with their states) without ``amsgrad``.
        module: names the layers (``module.named_parameters()``); ``None``: the optimizer's ``param_names()``.
        target_bits: cap on the average stored bits per m/v value, scales included; ``None``: no cap.
        interval: optimizer steps between checks (K).
        ema_decay: EMA factor of the statistics, in ``[0, 1)``.
        hysteresis: consecutive checks a new zone must persist before a layer moves (H >= 1).
        threshold_start, threshold_end: zone threshold (times the model's N and R) at step 0 and at ``anneal_steps``.
        anneal_steps: optimizer steps of the annealing (the run's length, typically).
        reference: the model's N and R that layers are compared with: ``"layers"``, the size-weighted mean of the
            layers' values, or ``"model"``, all gradients pooled (:func:`~lightning_qstate.adaptive.model_statistics`).
        m_formats, v_formats: ``{zone: format name}`` for the four zones (defaults: ``DEFAULT_M_FORMATS``, ``DEFAULT_V_FORMATS``).
        max_history: checks kept in ``history``.
        fill_budget: spend the room left under ``target_bits`` on promotions; ``False``: the zones' formats, demoted
            only where the cap needs it.
        floor_formats: ``{state: format name}`` (some of ``exp_avg``, ``exp_avg_sq``), the budget's last resort below
            every zone's formats (default ``DEFAULT_FLOOR_FORMATS``, int4 for both): each layer's ladder ends with it
            where it saves bytes (:func:`~lightning_qstate.adaptive.floor_option`), and the budget uses it only where
            the zones' formats cannot meet ``target_bits``; ``{}``: no floor.
        also_track: frozen parameters to plan as layers although this rank holds no states of them: under FSDP1 the
            frozen ones some rank holds states of (a rank whose shard of one is empty holds none), so that every rank
            plans the same layers (:class:`~lightning_qstate.callbacks.AdaptiveBitWidth` all-reduces which; without it
            a planner built after such a parameter was frozen planned other layers per rank). Trainable parameters, and
            frozen ones this rank holds states of, are planned in any case.

    Attributes:
        layers: every parameter of the optimizer with its statistics, zone and chosen formats.
        transitions: states whose stored format a check changed, once the optimizer has states (``step > 0``).
        history: per check, ``{"step": s, "bits": [[m bits per layer], [v bits per layer]], "formats": [[m format names
            per layer], [v ...]]}`` (the last ``max_history``; checkpoints written before the formats lack them).
        last_check: the step of the last check, ``None`` before the first.
    """

    def __init__(
        self,
        optimizer: QuantizedStates,
        module: torch.nn.Module | None = None,
        *,
        target_bits: float | None = 5.1,
        interval: int = 50,
        ema_decay: float = 0.9,
        hysteresis: int = 3,
        threshold_start: float = 1.0,
        threshold_end: float = 1.5,
        anneal_steps: int = 1000,
        reference: str = "layers",
        m_formats: Mapping[str, str] | None = None,
        v_formats: Mapping[str, str] | None = None,
        max_history: int = 256,
        fill_budget: bool = True,
        floor_formats: Mapping[str, str] | None = None,
        also_track: Iterable[torch.Tensor] = (),
    ) -> None:
        self.formats, self.floor_formats = check_options(
            "BitWidthPlanner",
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
            anneal_steps=anneal_steps,
        )
        if anneal_steps is None:  # AdaptiveBitWidth's default (the Trainer's max_steps); a planner has no Trainer
            raise ConfigurationError("BitWidthPlanner: anneal_steps=None is not valid; give the steps of the annealing, an int >= 1")
        if not adaptable(optimizer):
            raise TypeError(
                f"BitWidthPlanner needs a QAdam/QAdamW optimizer (states {list(ADAPTED_STATES)}), got {type(optimizer).__name__}; "
                "use lightning_qstate.QAdamW or quantize_optimizer (with Lightning: QStatePrecision or QuantizedOptimizerStates)"
            )
        if any(group.get("amsgrad") for group in optimizer.param_groups):
            raise ConfigurationError("BitWidthPlanner does not support amsgrad=True (its max_exp_avg_sq state is not adapted)")
        self.optimizer = optimizer
        tracked = {id(param) for param in also_track}
        self._check_states_quantized(tracked)
        self.target_bits = None if target_bits is None else float(target_bits)  # numpy's numbers as Python's
        self.interval = int(interval)
        self.ema_decay = float(ema_decay)
        self.hysteresis = int(hysteresis)
        self.threshold = AnnealedThreshold(float(threshold_start), float(threshold_end), int(anneal_steps))
        self.reference = reference
        self.max_history = int(max_history)
        self.fill_budget = fill_budget
        self.module = module
        self.layers = self._collect_layers(tracked)
        self._pending_entries: dict[str, dict[str, Any]] = {}  # a checkpoint's layers that have not joined yet
        self.global_rms: float | None = None
        self.global_dispersion: float | None = None
        self.last_check: int | None = None
        self.transitions = 0
        self.history: list[dict[str, Any]] = []
        self._solve(count_transitions=False)  # raises here if even every layer's cheapest formats miss target_bits
        self._warn_nearest_v()

    def _check_states_quantized(self, kept: Collection[int]) -> None:
        """Refuse a param group whose ``states=`` keeps m or v in fp32 (``"fp32"``, or a mapping that leaves the state
        out) for parameters the plan would cover (``kept``: ids of parameters covered in any case, as ``_collect_layers``
        takes them, so that FSDP1 ranks that hold different frozen parameters' states decide alike): every plan stores
        both quantized, so that choice would be overridden silently. A parameter with its own override
        (``optimizer.configured_overrides``) is pinned, not planned."""
        optimizer = self.optimizer
        for index, group in enumerate(optimizer.param_groups):
            planned = any(
                (self._tracked(param) or id(param) in kept) and param not in optimizer.configured_overrides for param in group["params"]
            )
            plain = [state for state in ADAPTED_STATES if format_name_for(group, state) == "fp32"]
            if planned and plain:
                raise ConfigurationError(
                    f"BitWidthPlanner: param group {index} has states={group['states']!r}, which keeps {' and '.join(plain)} in fp32, "
                    f"but the plan stores both {' and '.join(ADAPTED_STATES)} in the formats it chooses (m_formats, v_formats) and "
                    "would override that; give the group a quantized format for both (e.g. states='int8': only the start, the "
                    "plan replaces it), or keep such parameters out of the plan with a per-parameter override (overrides=)"
                )

    def candidates(self, state: str) -> set[str]:
        """Every format name ``state`` (``exp_avg`` or ``exp_avg_sq``) may be stored in: its zones' and its floor's."""
        floor = self.floor_formats.get(state)
        return {*self.formats[state].values(), *([floor] if floor is not None else [])}

    def _warn_nearest_v(self, layers: Sequence[Layer] | None = None) -> None:
        """Warn (at construction, and where ``layers`` join) where ``v`` may go below 8 bits in a param group that rounds
        to nearest: such a ``v``
        ratchets (``1 - beta2`` is under half a code gap, so it only falls with its block's scale) and the plan's bits
        buy little (GPT benchmark, 10 seeds, against fixed int8: adaptive at 5.1 bits +1.25 % loss with round to
        nearest, about int4's; -0.07 % with stochastic rounding, and 1.37 % below int4 over 20 seeds)."""
        narrow = sorted(name for name in self.candidates("exp_avg_sq") if get_format(name).bits < 8)
        nearest = any(
            layer.pinned is None and layer.group["rounding"] == "nearest" for layer in (self.layers if layers is None else layers)
        )
        if narrow and nearest:
            warnings.warn(
                f"BitWidthPlanner: v (exp_avg_sq) may be stored in {', '.join(narrow)} (under 8 bits), and the optimizer rounds "
                "to nearest: such a v ratchets (1 - beta2 is under half its code gap) and the bits buy little; write the states "
                "with rounding='stochastic' (QStatePrecision(rounding='stochastic') or QAdamW(rounding='stochastic')), or pass "
                "v_formats and floor_formats of 8 bits",
                UserWarning,
                stacklevel=3,
            )

    def _sync_layers(self, also: Collection[int] = ()) -> list[Layer]:
        """Track the parameters that joined since the layers were collected (``add_param_group``, as Lightning's
        ``BackboneFinetuning`` does; ``requires_grad_(True)``): priced, and planned (as ``critical`` until observed) by the
        caller's next solve; a checkpoint's entry for a layer of that name, kept by :meth:`load_state_dict` until it
        joined, restores its statistics and plan. Known layers stay, with theirs, also one frozen since: whether a rank
        holds a frozen parameter's states can differ between FSDP1 ranks, whose layers must stay alike (a frozen layer
        that no rank holds states of stays out of the budget: ``Layer.stored``); ``also``: ids of parameters to track in
        any case (a checkpoint's frozen layers). Returns the layers that joined."""
        previous = {id(layer.param): layer for layer in self.layers}
        kept = set(previous) | set(also)
        current = [p for group in self.optimizer.param_groups for p in group["params"] if self._tracked(p) or id(p) in kept]
        known = [layer.param for layer in self.layers]
        if len(current) == len(known) and all(a is b for a, b in zip(current, known, strict=True)):
            return []
        self._check_states_quantized(kept)
        self.layers = [previous.get(id(layer.param), layer) for layer in self._collect_layers(kept)]
        joined = [layer for layer in self.layers if id(layer.param) not in previous]
        for layer in joined:
            entry = self._pending_entries.pop(layer.name, None)
            if entry is not None:
                self._restore_layer(layer, entry)
        if joined:
            self._warn_nearest_v(joined)
        return joined

    def join_new_layers(self) -> bool:
        """Between checks (every step, before the optimizer's): make layers of the parameters that joined
        (:meth:`_sync_layers`) and plan them at once with the others (their zones as before; the budget may demote some
        to make room, as a check would), so that the states their first step makes keep the average under the cap, and
        are priced and checkpointed from then on. Returns whether any joined."""
        joined = self._sync_layers()
        if joined:
            self._solve(count_transitions=True, since_check=True)
            self.apply()
        return bool(joined)

    def _tracked(self, param: torch.Tensor) -> bool:
        """A parameter the plan covers: a trainable one, or one frozen after it got states (they still take memory)."""
        return param.requires_grad or bool(self.optimizer.state.get(param))

    def _parameter_names(self) -> dict[torch.Tensor, str]:
        """``{parameter: layer name}`` of the optimizer's parameters: as the module names them, else ``param_names()``."""
        fallback = self.optimizer.param_names()
        names = {} if self.module is None else {param: clean_parameter_name(name) for name, param in self.module.named_parameters()}
        return {param: names.get(param, fallback[param]) for group in self.optimizer.param_groups for param in group["params"]}

    def _collect_layers(self, kept: Collection[int] = ()) -> list[Layer]:
        """Every trainable parameter of the optimizer (and every frozen one that has states), named as ``module`` names it,
        with its candidates priced. One frozen from the start (``requires_grad=False``) gets no gradient, hence no states:
        priced, it would lend the others bits over the cap. ``kept``: ids of parameters collected in any case."""
        optimizer = self.optimizer
        names = self._parameter_names()
        layers = []
        for group in optimizer.param_groups:
            for param in group["params"]:
                if not self._tracked(param) and id(param) not in kept:
                    continue
                numel = optimizer.full_numels.get(param, param.numel())
                plain = optimizer._decoded_dtype(group, param)  # a state kept plain: the dtype the optimizer keeps it in
                # the user's (a plan's own entries in state_overrides are no pin: a layer unfrozen later is planned again)
                override = optimizer.configured_overrides.get(param)
                pinned = None
                if override is not None:
                    spec = {**group, "states": override}
                    pinned = {state: resolved_nbytes(spec, state, param, numel, plain.itemsize) for state in ADAPTED_STATES}
                layer = Layer(names[param], param, group, numel, pinned, plain=plain)
                if pinned is None:
                    try:
                        layer.nbytes = {
                            (state, name): resolved_nbytes({**group, "states": name}, state, param, numel, plain.itemsize)
                            for state in ADAPTED_STATES
                            for name in self.candidates(state)
                        }
                    except ValueError as error:  # dense 5-7-bit codes under block_size 2 or 4
                        raise ConfigurationError(
                            f"BitWidthPlanner: a candidate format does not fit the param group's block_size={group['block_size']!r}: "
                            f"{error}. Give the group a larger block_size, or m_formats/v_formats/floor_formats without that format"
                        ) from None
                layers.append(layer)
        if not layers:
            raise ConfigurationError(
                "BitWidthPlanner: every parameter of the optimizer is frozen (requires_grad=False); there is nothing to plan"
            )
        return layers

    # --- checks ------------------------------------------------------------------------------------------
    def should_replan(self, step: int) -> bool:
        """Whether ``step`` (optimizer steps taken) is a check: a multiple of ``interval`` not checked yet."""
        return step % self.interval == 0 and step != self.last_check

    def update(self, step: int, sums: torch.Tensor | Sequence[Sequence[float]] | None = None) -> bool:
        """Before every optimizer step: at a check (:meth:`should_replan`) :meth:`observe`, :meth:`plan`, :meth:`apply`;
        between checks :meth:`join_new_layers`. ``sums``: as :meth:`observe` takes them (of the layers after parameters
        that joined were added: :meth:`gradient_sums` at this check). Returns whether ``step`` was a check."""
        if not self.should_replan(step):
            self.join_new_layers()
            self._drop_pending_entries()
            return False
        self._sync_layers()
        self._drop_pending_entries()
        self.observe(step, sums)
        self.plan(step)
        self.apply()
        return True

    def _drop_pending_entries(self) -> None:
        """At the first step after a load: warn about the checkpoint's layers that no parameter of the optimizer took up
        (another model, or a param group not added back before training), and drop them."""
        if self._pending_entries:
            warnings.warn(
                f"BitWidthPlanner: the checkpoint's layers {sorted(self._pending_entries)} have no parameter in the optimizer "
                "(another model, or a param group not added back before the first step?); their plan is dropped",
                UserWarning,
                stacklevel=3,
            )
            self._pending_entries = {}

    def gradient_sums(self, device: torch.device | None = None) -> torch.Tensor:
        """``(4, layers)`` float64 on ``device`` (default: the first parameter's): ``sum |g|``, ``sum g^2`` and the
        number of values of each layer's local gradient (zeros without one), and 1 where this process's optimizer holds
        the layer's states. Two foreach norms (L1, L2) over all gradients; sums over shards and ranks add up, so they can
        be all-reduced before :meth:`observe`. Parameters that joined the optimizer since the last call become layers
        first."""
        self._sync_layers()
        grads, where = [], []
        for index, layer in enumerate(self.layers):
            grad = layer.param.grad
            if grad is not None and local_tensor(grad).numel():
                grads.append(local_tensor(grad))
                where.append(index)
        sums = torch.zeros(4, len(self.layers), dtype=torch.float64, device=self.layers[0].param.device if device is None else device)
        sums[3] = torch.tensor(self._held_here(), dtype=torch.float64)
        if grads:
            index = torch.tensor(where, device=sums.device)
            wide = torch.float64 if any(grad.dtype == torch.float64 for grad in grads) else torch.float32  # no narrowing
            sums[0, index] = torch.stack(torch._foreach_norm(grads, 1, dtype=wide)).to(sums)
            sums[1, index] = torch.stack(torch._foreach_norm(grads, 2, dtype=wide)).to(sums).square()
            sums[2, index] = torch.tensor([float(g.numel()) for g in grads], dtype=torch.float64, device=sums.device)
        return sums

    def _held_here(self) -> list[float]:
        """Per layer, 1.0 where this process's optimizer holds its states (``gradient_sums``' fourth row), else 0.0."""
        return [float(bool(self.optimizer.state.get(layer.param))) for layer in self.layers]

    def observe(self, step: int, sums: torch.Tensor | Sequence[Sequence[float]] | None = None) -> None:
        """Update the EMAs and the layers' zones (with hysteresis) at ``step``.

        ``sums``: :meth:`gradient_sums`, all-reduced over ranks where there are several (a tensor is read back to the
        host: the one sync of a check); ``None``: this process's gradients. A layer whose sums are not finite (an inf or
        NaN gradient, which the optimizer's non-finite policy or ``GradScaler`` skips) counts as having no gradient at
        this check; the model's reference is then taken over the others (and kept where none is left). A layer with
        neither states (on any rank: the fourth row; this process's where ``sums`` has three) nor a gradient stores
        nothing, and is left out of the budget until it has either.
        """
        if sums is None:
            sums = self.gradient_sums()
        rows = sums.tolist() if isinstance(sums, torch.Tensor) else [list(row) for row in sums]
        held = rows[3] if len(rows) > 3 else self._held_here()
        abs_sums, square_sums, counts = rows[:3]
        for layer, holds, count in zip(self.layers, held, counts, strict=False):  # a non-finite gradient is one too
            layer.held, layer.fed = holds > 0, count > 0
        finite = [math.isfinite(a) and math.isfinite(s) for a, s in zip(abs_sums, square_sums, strict=True)]
        abs_sums, square_sums, counts = (
            [value if ok else 0.0 for value, ok in zip(column, finite, strict=True)] for column in (abs_sums, square_sums, counts)
        )
        for layer, abs_sum, square_sum, count in zip(self.layers, abs_sums, square_sums, counts, strict=False):
            if count > 0:
                rms, dispersion = gradient_statistics(abs_sum, square_sum, count)
                layer.rms, layer.dispersion = ema(layer.rms, rms, self.ema_decay), ema(layer.dispersion, dispersion, self.ema_decay)
        if sum(counts) > 0:
            rms, dispersion = model_statistics(abs_sums, square_sums, counts, self.reference)
            self.global_rms, self.global_dispersion = (
                ema(self.global_rms, rms, self.ema_decay),
                ema(self.global_dispersion, dispersion, self.ema_decay),
            )
        threshold = self.threshold(step)
        for layer in self.layers:
            if layer.pinned is None and layer.rms is not None:
                zone = classify_zone(layer.rms, layer.dispersion, self.global_rms, self.global_dispersion, threshold)
                layer.hysteresis.observe(zone, self.hysteresis)

    def plan(self, step: int) -> None:
        """Choose every adapted layer's formats from the zones observed so far and the budget, and record the check at
        ``step`` (``history``, ``last_check``; ``transitions`` once the optimizer has states, ``step > 0``)."""
        self._solve(count_transitions=step > 0)
        names = [layer.name for layer in self.layers]
        self.history.append({"step": step, "bits": self.bits(), "formats": self.format_names(), "names": names})
        del self.history[: -self.max_history]
        self.last_check = step

    def _solve(self, count_transitions: bool, since_check: bool = False) -> None:
        """Choose each adapted layer's formats: its zone's (``critical`` before the first check), demoted where the budget
        needs it, promoted where the room left under the cap allows it.

        With ``count_transitions``, every state whose stored format changes adds one to ``transitions``: of the layers
        that held states at the last check, and (``since_check``: between checks, at a load) of those that got their
        gradient there (their states were made by that step).
        """
        counted = [layer for layer in self.layers if layer.stored]
        adapted, zones, ladders, starts, reserve = [], [], [], [], []
        for layer in self.layers:
            if layer.pinned is not None:
                continue
            ladder, start, floor = self._ladder(layer)
            if not layer.stored:  # outside the budget: its cheapest formats, so that states it makes before the next
                layer.choice = ladder[-1][0]  # check lower the average rather than raise it
                continue
            adapted.append(layer)
            zones.append(layer.hysteresis.zone)
            ladders.append(ladder)
            starts.append(start)
            reserve.append(int(floor is not None))
        fixed = sum(sum(layer.state_bytes()) for layer in counted if layer.pinned is not None)
        values = len(ADAPTED_STATES) * sum(layer.numel for layer in counted)
        order = budget_order(zones, [layer.numel for layer in adapted], [layer.name for layer in adapted])
        try:
            costs = [[cost for _, cost in ladder] for ladder in ladders]
            rungs = fit_budget(costs, fixed, values, self.target_bits, order, starts, self.fill_budget, reserve)
        except BudgetError as error:
            raise BudgetError(
                f"BitWidthPlanner: {error}; raise target_bits, or keep fewer states plain (those min_quant_size keeps fp32, "
                "overrides that pin a format, and under FSDP2 parameters whose rows allow no aligned block are priced as they are)"
            ) from None
        for layer, ladder, rung in zip(adapted, ladders, rungs, strict=False):
            choice = ladder[rung][0]
            if count_transitions and layer.choice is not None and (layer.held or (since_check and layer.fed)):  # re-encoded
                old, new = layer.stored_formats(layer.choice), layer.stored_formats(choice)
                self.transitions += sum(format_config(a) != format_config(b) for a, b in zip(old, new, strict=False))
            layer.choice = choice

    def _ladder(self, layer: Layer) -> tuple[list[tuple[Choice, int]], int, tuple[Choice, int] | None]:
        """``(ladder, start, floor)`` of an adapted layer: :func:`budget_ladder` of its zone with its floor option
        (:func:`floor_option`, also the ladder's last rung where there is one)."""
        nbytes = lambda state, name: layer.nbytes[(state, name)]  # noqa: E731
        ladder, start = budget_ladder(layer.hysteresis.zone, self.formats, nbytes)
        floor = floor_option(ladder[-1], ADAPTED_STATES, self.floor_formats, nbytes)
        return ladder + ([floor] if floor else []), start, floor

    def apply(self) -> None:
        """Make the optimizer store every adapted state as planned: overrides for new states, re-encoding for existing ones."""
        optimizer = self.optimizer
        for layer in self.layers:
            if layer.pinned is not None:
                continue
            targets = layer.stored_formats(layer.choice)
            before = optimizer.state_overrides.get(layer.param)
            if before is None or _configs(layer.stored_formats(tuple(before[state] for state in ADAPTED_STATES))) != _configs(targets):
                optimizer.format_changes += 1  # the states (made now, or later) take other formats
            optimizer.state_overrides[layer.param] = dict(zip(ADAPTED_STATES, layer.choice, strict=False))
            state = optimizer.state.get(layer.param, {})
            for name, target in zip(ADAPTED_STATES, targets, strict=False):
                if name not in state:
                    continue
                if format_config(target) != format_config(optimizer.state_format(layer.param, name)):
                    optimizer.reencode_state(layer.param, name, "fp32" if target is None else target)

    def _restore_layer(self, layer: Layer, entry: Mapping[str, Any]) -> None:
        """A layer's statistics, zone and plan from its checkpoint entry (:meth:`state_dict`)."""
        layer.rms, layer.dispersion = entry["rms"], entry["dispersion"]
        layer.hysteresis = ZoneHysteresis(entry["zone"], entry["pending"], entry["streak"])
        layer.held, layer.fed = entry.get("held"), entry.get("fed", False)  # checkpoints before them: counted
        layer.choice = (
            None if entry["formats"] is None or layer.pinned is not None else tuple(entry["formats"][state] for state in ADAPTED_STATES)
        )

    # --- reporting ---------------------------------------------------------------------------------------
    def bits(self) -> list[list[float]]:
        """Stored bits per value of each layer's m and v (scales included): ``[[m per layer], [v per layer]]``."""
        per_layer = [[8 * nbytes / layer.numel if layer.numel else 0.0 for nbytes in layer.state_bytes()] for layer in self.layers]
        return [list(column) for column in zip(*per_layer, strict=False)]

    def format_names(self) -> list[list[str]]:
        """The format each layer's m and v is stored in (a plain tensor, e.g. below ``min_quant_size``: ``Layer.plain_name``,
        ``"fp32"`` or ``"bf16 (plain)"``):
        ``[[m per layer], [v per layer]]``; pinned layers (a user override) report their override's formats."""
        overrides = self.optimizer.configured_overrides
        per_layer = []
        for layer in self.layers:
            if layer.pinned is None:
                formats = layer.stored_formats(layer.choice)
            else:
                group = {**layer.group, "states": overrides[layer.param]}
                formats = [resolve_format(group, state, layer.param, layer.numel) for state in ADAPTED_STATES]
            per_layer.append([layer.plain_name if fmt is None else fmt.name for fmt in formats])
        return [list(column) for column in zip(*per_layer, strict=False)]

    def metrics(self) -> dict[str, float]:
        """``qstate/adaptive/*``: ``avg_bits`` (stored bits per m/v value), ``target_bits`` (the cap, where set),
        ``bytes_saved`` (versus fp32 m and v), ``threshold`` (at the last check), ``transitions`` and ``zone_<zone>``
        (layers per zone)."""
        counted = [layer for layer in self.layers if layer.stored]
        stored = sum(sum(layer.state_bytes()) for layer in counted)
        values = len(ADAPTED_STATES) * sum(layer.numel for layer in counted)
        metrics = {
            "qstate/adaptive/avg_bits": 8 * stored / values if values else 0.0,
            "qstate/adaptive/bytes_saved": float(4 * values - stored),
            "qstate/adaptive/threshold": self.threshold(self.last_check if self.last_check is not None else 0),
            "qstate/adaptive/transitions": float(self.transitions),
        }
        if self.target_bits is not None:
            metrics["qstate/adaptive/target_bits"] = float(self.target_bits)
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

    # --- checkpoints -------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Decisions, EMAs, hysteresis counters and history, as plain Python values (JSON-serialisable)."""
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
                    "held": layer.held,
                    "fed": layer.fed,
                }
                for layer in self.layers
            },
            "global_rms": self.global_rms,
            "global_dispersion": self.global_dispersion,
            "last_check": self.last_check,
            "transitions": self.transitions,
            "history": self.history,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict` (layers matched by name) and plan from it; :meth:`apply` puts the plan in effect."""
        if state_dict.get("version") != STATE_DICT_VERSION:
            raise ValueError(f"BitWidthPlanner: checkpoint state version {state_dict.get('version')!r}, expected {STATE_DICT_VERSION}")
        entries = dict(state_dict["layers"])
        for layer in self.layers:
            entry = entries.pop(layer.name, None)
            if entry is not None:  # else not in the checkpoint (joined after it was saved): planned below, as one that joins
                self._restore_layer(layer, entry)
        self._pending_entries = entries  # layers the optimizer does not have yet (a group a callback adds back later)
        # the checkpoint's layers of parameters frozen here (re-frozen on resume, as BackboneFinetuning does): tracked on
        # every rank alike, as the checkpoint says, whichever rank holds their states
        frozen = [id(param) for param, name in self._parameter_names().items() if name in entries]
        self._sync_layers(also=frozen)
        self.global_rms, self.global_dispersion = state_dict["global_rms"], state_dict["global_dispersion"]
        self.last_check, self.transitions = state_dict["last_check"], state_dict["transitions"]
        self.history = [dict(entry) for entry in state_dict["history"]]
        # under the checkpoint's options the same plan; under others (target_bits, formats) the states re-encoded count
        self._solve(count_transitions=True, since_check=True)
