"""Which storage format each optimizer state gets: ``QuantizationPolicy``, its defaults and validation, in one place.

Every public entry point (``QAdam``/``QAdamW``/``QSGD``/``QMuon``, ``QuantizedOptimizerWrapper``,
``quantize_optimizer``, the ``QStatePrecision`` plugins, the ``QuantizedOptimizerStates`` callback) takes a
``policy=`` or the same keywords, named as the fields of ``QuantizationPolicy`` and with its defaults (the signatures
spell them out so that LightningCLI and IDEs see them; ``tests/test_policy.py`` holds them to ``POLICY_FIELDS``), but
for the name patterns (``NAME_PATTERN_FIELDS``: ``overrides``, ``weight_overrides``), which need a module's parameter
names: only the plugins and the callback take them as keywords; an optimizer gets them from
``QuantizationPolicy.apply(optimizer, module)``.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections import Counter
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Union

import torch
from torch.distributed.tensor import DTensor, Shard

if TYPE_CHECKING:
    from .base import QuantizedStates

from ..arguments import ConfigurationError, short_list, whole_number
from ..formats import ROUNDINGS, BlockFormat, StorageFormat, check_block_size, get_format
from ..formats.base import local_tensor
from ..formats.weights import WeightBlock, WeightGrid, get_weight_grid
from .weights import overridden_grid

# typing.Union, not `|`: the optimizers' signatures (read by the CLI's jsonargparse) keep the object they always had.
StatesSpec = Union[str, Mapping[str, str]]  # noqa: UP007

# States that are never negative get unsigned maps (no codes spent on the sign).
NONNEGATIVE_STATES = frozenset(
    {"exp_avg_sq", "max_exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col", "sum", "square_avg", "acc_delta"}
    | {"exp_inf", "variance", "step_size"}  # Adamax's infinity norm, Adafactor's 1-D variance, Rprop's step sizes
)

# Smallest block a row-aligned (sharded) parameter may use before it keeps fp32 states.
MIN_ALIGNED_BLOCK = 32

NonFiniteGradPolicy = Literal["skip", "skip_step", "raise"]
NONFINITE_GRAD_POLICIES: tuple[str, ...] = ("skip", "skip_step", "raise")

# How the rounding error of a parameter kept without master weights (``weights=``) is fed back (``optim/weights.py``).
ErrorFeedback = Literal["eco", "eco_exact"]
ERROR_FEEDBACKS: tuple[str | None, ...] = (None, "eco", "eco_exact")


# Options that hold a count: an integer of numpy's or a 0-d integer tensor is taken, and stored, as a Python int.
COUNT_OPTIONS = ("block_size", "min_quant_size")


def python_count(value: Any) -> Any:
    """``value`` as a Python int where it is an integer (``arguments.whole_number``), else as it is (for
    ``validate_policy`` to refuse)."""
    count = whole_number(value)
    return value if count is None else count


def as_python_counts(options: dict[str, Any]) -> None:
    """Replace the integers of ``COUNT_OPTIONS`` in ``options`` (a param group that holds them) by Python ints, in place."""
    for name in COUNT_OPTIONS:
        options[name] = python_count(options[name])


def validate_policy(group: Mapping[str, Any], state_names: tuple[str, ...] | None, owner: str) -> None:
    """Check a param group's policy options up front; errors name the option and the valid values.

    ``state_names`` is the optimizer's set of state names, or ``None`` when
    unknown (the generic wrapper), in which case any name is accepted.
    """
    states = group["states"]
    if isinstance(states, Mapping):
        if state_names is not None:
            unknown = sorted(set(states) - set(state_names))
            if unknown:
                raise ConfigurationError(f"{owner}: unknown state name(s) {unknown} in states=; valid names: {list(state_names)}")
        if not all(isinstance(name, str) for name in states.values()):
            raise TypeError(f"{owner}: states={states!r} must map state names to format names (strings, e.g. 'int8', 'fp32')")
    elif not isinstance(states, str):
        raise TypeError(f"{owner}: states= must be a format name or a mapping of state name -> format name, got {type(states).__name__}")
    if group["block_size"] is not None:
        try:
            check_block_size(group["block_size"])
        except ValueError as error:
            raise ConfigurationError(f"{owner}: {error}") from None
    for state, name in states.items() if isinstance(states, Mapping) else [(None, states)]:
        try:  # with the group's block size (dense 5-7-bit codes need blocks of 8 or more) and the state's sign
            get_format(name, block_size=group["block_size"], signed=state not in NONNEGATIVE_STATES)
        except ValueError as error:  # name the option that holds the bad value
            raise ConfigurationError(f"{owner}: states={states!r}: {error}") from None
    if group["rounding"] not in ROUNDINGS:
        raise ConfigurationError(f"{owner}: rounding={group['rounding']!r} is not valid; use one of {ROUNDINGS}")
    min_size = group["min_quant_size"]
    if not isinstance(min_size, int) or isinstance(min_size, bool) or min_size < 0:
        raise ConfigurationError(f"{owner}: min_quant_size={min_size!r} must be an int >= 0")
    validate_weight_options(group, owner)
    validate_grads_option(group, owner)


def validate_grads_option(group: Mapping[str, Any], owner: str) -> None:
    """Check ``grads`` (a param group's or a policy's): ``None`` or a format name ``get_format`` accepts."""
    grads = group["grads"]
    if grads is None:
        return
    if not isinstance(grads, str):
        raise TypeError(
            f"{owner}: grads= must be a format name (e.g. 'bf16', 'fp8_e4m3', 'e5m3', 'int8') or None, got {type(grads).__name__}"
        )
    try:
        gradient_format(group)
    except ValueError as error:
        raise ConfigurationError(f"{owner}: grads={grads!r}: {error}") from None


def gradient_format(group: Mapping[str, Any]) -> StorageFormat | None:
    """The format a param group's gradients are rounded to before the step (``grads``, signed, the group's ``block_size``),
    or ``None`` where they are left as they are (``grads=None`` or ``"fp32"``)."""
    if group["grads"] is None or group["grads"] == "fp32":
        return None
    return get_format(group["grads"], block_size=group["block_size"], signed=True)


def validate_weight_options(group: Mapping[str, Any], owner: str) -> None:
    """Check ``weights``, ``weight_block``, ``weight_rounding`` and ``error_feedback`` (a param group's or a policy's)."""
    if group["weight_rounding"] not in ROUNDINGS:
        raise ConfigurationError(f"{owner}: weight_rounding={group['weight_rounding']!r} is not valid; use one of {ROUNDINGS}")
    if group["error_feedback"] not in ERROR_FEEDBACKS:
        raise ConfigurationError(f"{owner}: error_feedback={group['error_feedback']!r} is not valid; use one of {ERROR_FEEDBACKS}")
    if group["weights"] is not None and not isinstance(group["weights"], str):
        raise TypeError(f"{owner}: weights= must be a format name or None, got {type(group['weights']).__name__}")
    if group["weights"] == "":
        raise ConfigurationError(f"{owner}: weights='' is not a format; give a format name (e.g. 'bf16', 'fp8_e4m3') or None")
    try:
        get_weight_grid(group["weights"] or "bf16", group["weight_block"])
    except ValueError as error:
        raise ConfigurationError(f"{owner}: weights={group['weights']!r}: {error}") from None


def format_name_for(group: Mapping[str, Any], state_name: str) -> str:
    """Format name for ``state_name`` under this group's ``states=`` (a mapping leaves unnamed states fp32)."""
    states = group["states"]
    return states.get(state_name, "fp32") if isinstance(states, Mapping) else states


def resolve_format(group: Mapping[str, Any], state_name: str, param: torch.Tensor, numel: int | None = None) -> StorageFormat | None:
    """The format a state of ``param`` is stored in, or ``None`` for plain fp32 storage.

    Parameters with fewer than ``min_quant_size`` elements, and ``fp32`` states, stay plain tensors.
    ``numel`` is the full parameter's size when ``param`` cannot tell it: under FSDP1 the optimizer holds
    1-D views of this rank's part of the flat shard, and ``QuantizationPolicy.apply`` records their full
    sizes (``optimizer.full_numels``), so every rank takes the same decisions. The block layout there
    follows the local flat shard (blocks are cut from each rank's 1-D view); that is consistent because
    FSDP1 checkpoints store the states as fp32 shards and loading re-quantizes them.
    For a DTensor sharded on dim 0 (FSDP2), blocks must not straddle rows, so that every rank and every
    world size cuts the same blocks: the block size becomes the largest power of two dividing the row
    length when the format's does not, and a parameter whose rows allow no block of at least
    ``MIN_ALIGNED_BLOCK`` keeps fp32 states. All of this depends on the full shape only.
    """
    name = format_name_for(group, state_name)
    # A DTensor's numel() is the full parameter's: decisions never depend on the local shard.
    if name == "fp32" or (param.numel() if numel is None else numel) < group["min_quant_size"]:
        return None
    signed = state_name not in NONNEGATIVE_STATES
    fmt = get_format(name, block_size=group["block_size"], signed=signed)
    if not isinstance(fmt, BlockFormat) or not isinstance(param, DTensor):
        return fmt
    sharded_dims = [p.dim for p in param.placements if isinstance(p, Shard)]
    if any(dim != 0 for dim in sharded_dims):
        return None
    row = param.shape[1:].numel() if param.ndim > 1 else 1
    if not sharded_dims or row % fmt.block_size == 0:
        return fmt
    aligned = row & -row
    return get_format(name, block_size=aligned, signed=signed) if aligned >= MIN_ALIGNED_BLOCK else None


# Prefixes that DDP, FSDP, activation checkpointing and Lightning's wrappers add to parameter names.
WRAPPER_PREFIXES = ("module.", "_forward_module.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_parameter_name(name: str) -> str:
    """A parameter's name as the user's module knows it, without wrapper prefixes."""
    return ".".join(part for part in name.split(".") if part + "." not in WRAPPER_PREFIXES)


@dataclass
class QuantizationPolicy:
    """Everything that decides how an optimizer's states are stored: one object with the defaults and the checks.

    Args:
        states: one format name for every state, or ``{state_name: format}`` (unnamed states stay fp32), e.g.
            ``{"exp_avg": "int8", "exp_avg_sq": "e4m3"}``.
        rounding: ``"nearest"`` or ``"stochastic"``.
        block_size: values per scale (power of two); ``None`` for each format's default.
        min_quant_size: parameters with fewer elements (full shape) keep fp32 states.
        overrides: ``{pattern: states}`` for parameters whose name (as in ``module.named_parameters()``, wrapper
            prefixes removed) matches the ``fnmatch`` pattern (case-sensitive), e.g. for a GPT-2
            ``{"*.wte.*": "fp32", "*.ln_*": "fp32"}``. The first matching pattern wins; a pattern that matches no
            parameter raises. Names come from the module given to ``apply``, or from ``param_names`` in the groups
            (an optimizer built from ``model.named_parameters()``).
        weights: the format parameter values are kept in after each step, without an fp32 master copy (ECO,
            ``optim/weights.py``): ``None`` (default: torch's behaviour in the parameter's own dtype), ``"bf16"``,
            ``"fp16"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"int8"``, ``"int4"`` or any ``eXmY``. Formats that are not
            a torch dtype are kept as grid values in the parameter's dtype (``formats.weights``).
        weight_rounding: ``"stochastic"`` (default) or ``"nearest"``, for writing the weights.
        weight_block: scale groups of block-scaled ``weights``: ``"row"`` (default, one per row as the ECO paper),
            ``"tensor"`` or a power of two.
        error_feedback: ``None`` (the rounding error is dropped: naive master-weight removal), ``"eco"`` (fed into
            the momentum, ECO's rule) or ``"eco_exact"`` (kept in one fp32 buffer: the master-weight iterates).
            Without ``weights``, the parameter's own dtype is the grid.
        weight_overrides: ``{pattern: weights}`` (``None`` keeps the parameter's dtype), matched as ``overrides``.
            ``apply(optimizer, module)`` with ``weights`` set gives the weights of linear layers inside repeated
            blocks the format and keeps the others (embeddings, norms, the head: the paper's choice) unless a pattern
            matches; an optimizer built with the policy applies ``weights`` to every parameter of its groups.
        track_stalls: count stalled state entries in ``optimizer.stall_stats()``, read by ``StallMonitor``; with the
            optimizer's ``track_weight_stalls = True`` (set by ``PrecisionAdvisor``; it costs a second update computation
            per tracked step) also the weight entries whose update was lost to rounding (the pseudo-state ``"weights"``,
            ``WEIGHT_STALLS``).
        nonfinite: for gradients holding inf/NaN: ``"skip"`` (those parameters are not updated, one warning per step
            names them), ``"skip_step"`` (no parameter is updated, as ``GradScaler`` does) or ``"raise"``.
        grads: a format the gradients are rounded to before each step, to test a gradient precision: ``None`` (default:
            left as they are) or any format name (``"bf16"``, ``"fp16"``, ``"fp8_e4m3"``, ``"e5m3"``, ``"int8"``, ...), with
            the group's ``rounding`` and ``block_size``, for every parameter of the group whatever its size (``min_quant_size``
            is for states). Each finite gradient is replaced in place (``param.grad`` holds the rounded values after the
            step, in its own dtype) before the non-finite check and the choice of step path, so every path sees it;
            non-finite ones are left to ``nonfinite``, as are those the rounding overflows (fp16 above 65504). Stochastic
            rounding draws from the optimizer's rounding streams (exact resume).
        owner: the name errors start with (the entry points pass theirs); not stored.

    Raises:
        ValueError, TypeError: an option with an invalid value (the message names it and the valid values).

    Example::

        >>> import torch
        >>> from lightning_qstate import QAdamW, QuantizationPolicy
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))
        >>> policy = QuantizationPolicy(states="int8", overrides={"1.*": "fp32"}, min_quant_size=0)
        >>> optimizer = policy.apply(torch.optim.AdamW(model.parameters()), model)  # or QAdamW(params, policy=policy)
    """

    states: StatesSpec = "int8"
    rounding: str = "nearest"
    block_size: int | None = None
    min_quant_size: int = 4096
    overrides: Mapping[str, StatesSpec] = field(default_factory=dict)
    weights: str | None = None
    weight_rounding: str = "stochastic"
    weight_block: WeightBlock = "row"
    error_feedback: ErrorFeedback | None = None
    weight_overrides: Mapping[str, str | None] = field(default_factory=dict)
    track_stalls: bool = False
    nonfinite: NonFiniteGradPolicy = "skip"
    grads: str | None = None
    owner: InitVar[str] = "QuantizationPolicy"  # the name errors start with: the entry point the user called

    def __post_init__(self, owner: str) -> None:
        for name in COUNT_OPTIONS:
            setattr(self, name, python_count(getattr(self, name)))
        self.overrides = pattern_mapping(self.overrides, "overrides", owner)
        self.weight_overrides = pattern_mapping(self.weight_overrides, "weight_overrides", owner)
        self.validate(owner)

    def validate(self, owner: str, state_names: tuple[str, ...] | None = None) -> None:
        """Check every option; errors name ``owner`` and the option. ``state_names``: the optimizer's (``None``: any)."""
        validate_policy(self.group_options(), state_names, owner)
        if not isinstance(self.track_stalls, bool):
            raise ConfigurationError(f"{owner}: track_stalls={self.track_stalls!r} must be True or False")
        if self.nonfinite not in NONFINITE_GRAD_POLICIES:
            raise ConfigurationError(f"{owner}: nonfinite={self.nonfinite!r} is not valid; use one of {NONFINITE_GRAD_POLICIES}")
        for name in NAME_PATTERN_FIELDS:
            pattern_mapping(getattr(self, name), name, owner)
        for pattern, states in self.overrides.items():
            options = {**self.group_options(), "states": states, "min_quant_size": 0}
            validate_policy(options, state_names, f"{owner}: overrides[{pattern!r}]")
        for pattern, weights in self.weight_overrides.items():
            validate_weight_options({**self.group_options(), "weights": weights}, f"{owner}: weight_overrides[{pattern!r}]")

    def group_options(self) -> dict[str, Any]:
        """The options every param group carries (``GROUP_OPTIONS``; each may be overridden per group)."""
        return {name: getattr(self, name) for name in GROUP_OPTIONS}

    @classmethod
    def from_arguments(cls, owner: str, policy: QuantizationPolicy | None, arguments: Mapping[str, Any]) -> QuantizationPolicy:
        """The policy of an entry point called with ``policy=`` or with the policy keywords in ``arguments`` (its
        ``locals()``; other names are ignored): errors name ``owner``.

        Raises:
            ValueError: both ``policy`` and a keyword that differs from its default.
        """
        options = {name: arguments[name] for name in POLICY_FIELDS if name in arguments}
        for name in NAME_PATTERN_FIELDS:
            options[name] = pattern_mapping(options.get(name), name, owner)
        if policy is not None:
            if not isinstance(policy, QuantizationPolicy):
                raise TypeError(f"{owner}: policy= must be a QuantizationPolicy, got {type(policy).__name__}")
            given = sorted(name for name, value in options.items() if value != POLICY_DEFAULTS[name])
            if given:
                raise ConfigurationError(f"{owner}: give either policy= or the keywords {given}, not both")
            policy.validate(owner)
            return policy
        return cls(**options, owner=owner)

    def apply(self, optimizer: torch.optim.Optimizer, module: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The quantized form of ``optimizer`` (converted in place where possible); an already quantized one is returned as is
        (the options this policy sets must then be its own: ``_check_held_by``).

        ``module`` supplies parameter names for ``overrides`` (else the groups' ``param_names``, where every group has them).
        Under ``torch.distributed`` every rank must call it (the Lightning plugins and callback do): rank 0's
        stochastic-rounding seed is broadcast, so replicated parameters and states round alike on every rank.

        Raises:
            ValueError: ``overrides`` without names, a pattern that matches no parameter, or an override naming a
                state the quantized optimizer does not have (checked before ``optimizer`` is converted); an already
                quantized ``optimizer`` whose options differ from those this policy sets.
        """

        from .base import QuantizedStates
        from .wrap import QUANTIZED_EQUIVALENTS, QuantizedOptimizerWrapper, quantize_optimizer

        names = None if module is None else [(clean_parameter_name(name), param) for name, param in module.named_parameters()]
        if names is None and all(group.get("param_names") for group in optimizer.param_groups):
            names = [
                (name, param) for group in optimizer.param_groups for name, param in zip(group["param_names"], group["params"], strict=True)
            ]
        owner = type(module).__name__ if module is not None else type(optimizer).__name__
        if isinstance(optimizer, QuantizedStates):
            self._check_held_by(optimizer, names, owner, module)
            if module is not None:  # names for its messages, step_paths() and the callbacks' logs, as a converted one has
                optimizer.module_names = {param: name for name, param in names}
            optimizer._share_rounding_seed()
            _fit_to_fsdp1(optimizer, module)
            return optimizer
        given = [name for name in NAME_PATTERN_FIELDS if getattr(self, name)]
        if given and names is None:
            raise ConfigurationError(
                f"QuantizationPolicy: {given[0]}= needs the parameter names it matches; call apply(optimizer, module), "
                "or build the optimizer from model.named_parameters()"
            )
        overrides = None
        if self.overrides:  # the wrapper has no fixed state names: any is accepted
            self.validate("QuantizationPolicy", QUANTIZED_EQUIVALENTS.get(type(optimizer), QuantizedOptimizerWrapper).state_names or None)
            overrides = self.overrides_for(names, owner)
        weight_overrides = self.weight_overrides_for(names, owner, module) if names is not None else {}
        _fit_to_fsdp1(optimizer, module, self.error_feedback)  # refuses eco_exact before the optimizer is converted
        quantized = quantize_optimizer(optimizer, policy=dataclasses.replace(self, overrides={}, weight_overrides={}))
        if overrides is not None:
            quantized.state_overrides, quantized.configured_overrides = overrides, dict(overrides)
        quantized.weight_overrides = weight_overrides
        quantized.name_patterns = {name: dict(getattr(self, name)) for name in given}
        quantized.check_weight_grids()
        quantized._share_rounding_seed()
        if module is not None:
            quantized.module_names = {param: name for name, param in names}
        _fit_to_fsdp1(quantized, module)
        return quantized

    def _check_held_by(
        self, optimizer: QuantizedStates, names: list[tuple[str, torch.Tensor]] | None, owner: str, module: torch.nn.Module | None
    ) -> None:
        """An optimizer quantized already (built as one, or converted by another plugin or callback) keeps its options:
        raise where an option this policy sets (one not at its default) is not the optimizer's, since ``apply`` would
        ignore it. Group options are compared with every group's, ``track_stalls`` and ``nonfinite`` with the optimizer's,
        the override patterns by the parameters they give."""
        ignored = []
        # weights given with a module select the parameters they go to (weight_overrides_for), also without patterns
        selects = module is not None and self.weights is not None
        for name in POLICY_FIELDS:
            value = getattr(self, name)
            if value == POLICY_DEFAULTS[name] and not (name == "weight_overrides" and selects):
                continue
            if name in GROUP_OPTIONS:
                held = all(group.get(name) == value for group in optimizer.param_groups)
            elif name == "overrides":
                chosen = self.overrides_for(names, owner) if names is not None else None
                given = optimizer.state_overrides
                held = chosen is not None and {id(p): v for p, v in chosen.items()} == {id(p): v for p, v in given.items()}
            elif name == "weight_overrides":  # by the grids they give: another selection may give every parameter the same one
                held = names is not None and _same_grids(optimizer, self.weight_overrides_for(names, owner, module))
            else:
                held = getattr(optimizer, name) == value
            if not held:
                selection = name == "weight_overrides" and not value
                chosen_by = f"the selection of weights={self.weights!r} (the linear weights inside repeated blocks)"
                ignored.append(chosen_by if selection else f"{name}={value!r}")
        if ignored:
            raise ConfigurationError(
                f"QuantizationPolicy: {type(optimizer).__name__} of {owner} has quantized states already (built as a quantized "
                f"optimizer, or converted by another plugin or callback), so {', '.join(ignored)} would be ignored; give "
                "them where it is built (its constructor, or the one plugin or callback that converts it), or leave them out here"
            )

    def attach_overrides(self, optimizer: QuantizedStates) -> None:
        """Set ``optimizer.state_overrides`` and ``weight_overrides`` from the names in its groups (``param_names``), for
        an optimizer built with this policy; raises where a pattern option is set and the groups carry no names."""
        given = [name for name in NAME_PATTERN_FIELDS if getattr(self, name)]
        if not given:
            return
        if not all(group.get("param_names") for group in optimizer.param_groups):
            raise ConfigurationError(
                f"{type(optimizer).__name__}: policy.{given[0]} match parameter names; build the optimizer from "
                "model.named_parameters(), or use policy.apply(torch_optimizer, model)"
            )
        self.validate(type(optimizer).__name__, optimizer.state_names or None)
        named = [
            (name, param) for group in optimizer.param_groups for name, param in zip(group["param_names"], group["params"], strict=True)
        ]
        optimizer.state_overrides = self.overrides_for(named, type(optimizer).__name__)
        optimizer.configured_overrides = dict(optimizer.state_overrides)
        optimizer.weight_overrides = self.weight_overrides_for(named, type(optimizer).__name__)
        optimizer.name_patterns = {name: dict(getattr(self, name)) for name in given}

    def weight_overrides_for(
        self, named: list[tuple[str, torch.Tensor]], owner: str, module: torch.nn.Module | None = None
    ) -> dict[torch.Tensor, str | None]:
        """``{parameter: weights}`` for the parameters whose ``weights`` differ from their group's: those a
        ``weight_overrides`` pattern matches, and, given a ``module`` and ``weights``, every parameter that is not the
        weight of a linear layer inside a repeated block (``optim.weights.block_linear_weight_names``: ``None``, its dtype).

        Raises:
            ValueError: a pattern matches no name of ``named``; ``weights`` set and, given a ``module``, no parameter left
                on its grid (the module has no linear layer inside a repeated block, and no override names one).
        """
        from .weights import block_linear_weight_names

        matched = self.overrides_for(named, owner, "weight_overrides")
        if module is not None and self.weights is not None:
            in_blocks = {clean_parameter_name(name) for name in block_linear_weight_names(module)}
            matched.update({param: None for name, param in named if param not in matched and name not in in_blocks})
            if named and all(matched.get(param, self.weights) is None for _, param in named):
                raise ConfigurationError(
                    f"QuantizationPolicy: weights={self.weights!r} would put no parameter of {owner} on its grid: given the "
                    "module, it goes to the weights of linear layers inside repeated blocks (under a numbered child, as "
                    f"transformer.h.3.attn.c_attn.weight), and {owner} has none ({_name_summary(named)}); name the parameters "
                    f"with weight_overrides (e.g. {{'*.weight': {self.weights!r}}}), or, calling apply yourself, pass no module"
                )
        return matched

    def overrides_for(self, named: list[tuple[str, torch.Tensor]], owner: str, option: str = "overrides") -> dict[torch.Tensor, Any]:
        """``{parameter: value}`` for every ``(name, parameter)`` of ``named`` that a pattern of ``option`` (``overrides``:
        states, or ``weight_overrides``: weights) matches.

        Raises:
            ValueError: a pattern matches no name of ``named`` (it would be silently ignored).
        """
        patterns = getattr(self, option)
        for pattern in patterns:
            if not any(fnmatch.fnmatchcase(name, pattern) for name, _ in named):
                raise ConfigurationError(
                    f"QuantizationPolicy: {option} pattern {pattern!r} matches no parameter of {owner}; patterns are "
                    f"matched with fnmatch (case-sensitive) against the parameter names: {_name_summary(named)}; "
                    "fix the pattern or remove it"
                )
        return match_patterns(named, patterns)


def _same_grids(optimizer: QuantizedStates, overrides: Mapping[torch.Tensor, str | None]) -> bool:
    """Whether every parameter of ``optimizer`` is kept on the grid (``WeightGrid``: its format and scale groups) that
    ``overrides`` (``weight_overrides`` as a policy would set them) give it, in its group."""

    def key(grid: WeightGrid | None) -> tuple[str, Any] | None:
        return None if grid is None else (grid.name, grid.block)

    for group in optimizer.param_groups:
        for param in group["params"]:
            if key(overridden_grid(group, param, local_tensor(param), overrides)) != key(optimizer.weight_grid(group, param)):
                return False
    return True


def pattern_mapping(value: Any, option: str, owner: str) -> dict[str, Any]:
    """``overrides`` or ``weight_overrides`` (``option``) as a dict (``None``: empty); anything but a mapping raises,
    naming ``owner`` and the option (a string pattern alone would read as a sequence of characters)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        kind = "states" if option == "overrides" else "weights"
        raise TypeError(f"{owner}: {option}= must be a mapping of name pattern -> {kind}, e.g. {{'*.bias': 'fp32'}}, got {value!r}")
    return dict(value)


def match_patterns(named: list[tuple[str, torch.Tensor]], patterns: Mapping[str, Any]) -> dict[torch.Tensor, Any]:
    """``{parameter: value}`` of the first pattern (fnmatch, case-sensitive) of ``patterns`` that each name of ``named``
    matches; parameters no pattern matches are left out."""
    matched: dict[torch.Tensor, Any] = {}
    for name, param in named:
        for pattern, value in patterns.items():
            if fnmatch.fnmatchcase(name, pattern):
                matched[param] = value
                break
    return matched


# The options of a policy, in signature order; those of GROUP_OPTIONS are carried by every param group.
POLICY_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(QuantizationPolicy))
GROUP_OPTIONS: tuple[str, ...] = (
    "states", "rounding", "block_size", "min_quant_size", "weights", "weight_rounding", "weight_block", "error_feedback", "grads",
)  # fmt: skip
# The options that match parameter names: they need ``policy=`` (or a module given to ``apply``), not the optimizers' keywords.
NAME_PATTERN_FIELDS: tuple[str, ...] = ("overrides", "weight_overrides")
POLICY_DEFAULTS: dict[str, Any] = {
    f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    for f in dataclasses.fields(QuantizationPolicy)
}


def _fit_to_fsdp1(optimizer: torch.optim.Optimizer, module: torch.nn.Module | None, error_feedback: str | None = None) -> None:
    """Under FSDP1 (``module`` holds a ``FullyShardedDataParallel``), for an optimizer ``apply`` converted or one built
    quantized: fp32 checkpoints (FSDP1 gathers and reshapes state tensors like its flat shards; packed codes made every
    save fail), decisions from the full sizes (its parameters are local 1-D views) and stochastic-rounding streams per
    shard, not per rank (``NO_SHARD`` and hybrid sharding replicate). ``eco_exact`` (a group's, or
    ``error_feedback`` for a torch optimizer about to be converted: checked before it is) is refused."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from .base import QuantizedStates
    from .wrap import fsdp_views

    if module is None or not any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
        return
    if "eco_exact" in [error_feedback, *(group.get("error_feedback") for group in optimizer.param_groups)]:
        raise ConfigurationError(
            f"{type(optimizer).__name__}: error_feedback='eco_exact' is not supported under FSDP1: its fp32 error buffer "
            "belongs to the parameters on a weight grid only, and FSDP1's optimizer state dict needs every parameter of a flat "
            "parameter to hold the same states. Use FSDP2 (ModelParallelStrategy) or error_feedback='eco'"
        )
    if isinstance(optimizer, QuantizedStates):
        optimizer.checkpoint_mode = "fp32"
        optimizer.full_numels, optimizer.shard_indices = fsdp_views(module)


def _name_summary(named: list[tuple[str, torch.Tensor]]) -> str:
    """The distinct forms of the parameter names, the first 20 of them: the index of a repeated block (a numeric
    part under which the same names and shapes recur, such as a transformer's layers) written as ``*``."""
    subtrees: dict[tuple[str, ...], set[tuple[str, tuple[int, ...]]]] = {}
    for name, param in named:
        parts = name.split(".")
        for i, part in enumerate(parts):
            if part.isdigit():
                subtrees.setdefault(tuple(parts[: i + 1]), set()).add((".".join(parts[i + 1 :]), tuple(param.shape)))
    kinds = Counter((key[:-1], frozenset(contents)) for key, contents in subtrees.items())
    repeated = {key for key, contents in subtrees.items() if kinds[key[:-1], frozenset(contents)] > 1}
    forms: dict[str, None] = {}
    for name, _ in named:
        parts = name.split(".")
        forms[".".join("*" if tuple(parts[: i + 1]) in repeated else part for i, part in enumerate(parts))] = None
    return short_list(list(forms), 20) if forms else "(none: the module has no parameters)"
