"""Which storage format each optimizer state gets: ``QuantizationPolicy``, its defaults and validation, in one place.

Every public entry point (``QAdam``/``QAdamW``/``QSGD``/``QMuon``, ``QuantizedOptimizerWrapper``,
``quantize_optimizer``, the ``QStatePrecision`` plugins, the ``QuantizedOptimizerStates`` callback) takes a
``policy=`` or the same keywords, named as the fields of ``QuantizationPolicy`` and with its defaults (the signatures
spell them out so that LightningCLI and IDEs see them; ``tests/test_policy.py`` holds them to ``POLICY_FIELDS``).
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

from ..formats import ROUNDINGS, BlockFormat, StorageFormat, check_block_size, get_format

# typing.Union, not `|`: the optimizers' signatures (read by the CLI's jsonargparse) keep the object they always had.
StatesSpec = Union[str, Mapping[str, str]]  # noqa: UP007

# States that are never negative get unsigned maps (no codes spent on the sign).
NONNEGATIVE_STATES = frozenset({"exp_avg_sq", "max_exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col", "sum", "square_avg", "acc_delta"})

# Smallest block a row-aligned (sharded) parameter may use before it keeps fp32 states.
MIN_ALIGNED_BLOCK = 32

NonFiniteGradPolicy = Literal["skip", "skip_step", "raise"]
NONFINITE_GRAD_POLICIES: tuple[str, ...] = ("skip", "skip_step", "raise")


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
                raise ValueError(f"{owner}: unknown state name(s) {unknown} in states=; valid names: {list(state_names)}")
        names = list(states.values())
    elif isinstance(states, str):
        names = [states]
    else:
        raise TypeError(f"{owner}: states= must be a format name or a mapping of state name -> format name, got {type(states).__name__}")
    for name in names:
        try:
            get_format(name)
        except ValueError as error:  # name the option that holds the bad value
            raise ValueError(f"{owner}: states={states!r}: {error}") from None
    if group["rounding"] not in ROUNDINGS:
        raise ValueError(f"{owner}: rounding={group['rounding']!r} is not valid; use one of {ROUNDINGS}")
    if group["block_size"] is not None:
        try:
            check_block_size(group["block_size"])
        except ValueError as error:
            raise ValueError(f"{owner}: {error}") from None
    min_size = group["min_quant_size"]
    if not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"{owner}: min_quant_size={min_size!r} must be an int >= 0")


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
        track_stalls: count stalled state entries (``optimizer.stall_stats()``, read by ``StallMonitor``).
        nonfinite: for gradients holding inf/NaN: ``"skip"`` (those parameters are not updated, one warning per step
            names them), ``"skip_step"`` (no parameter is updated, as ``GradScaler`` does) or ``"raise"``.
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
    track_stalls: bool = False
    nonfinite: NonFiniteGradPolicy = "skip"
    owner: InitVar[str] = "QuantizationPolicy"  # the name errors start with: the entry point the user called

    def __post_init__(self, owner: str) -> None:
        self.overrides = dict(self.overrides or {})
        self.validate(owner)

    def validate(self, owner: str, state_names: tuple[str, ...] | None = None) -> None:
        """Check every option; errors name ``owner`` and the option. ``state_names``: the optimizer's (``None``: any)."""
        validate_policy(self.group_options(), state_names, owner)
        if self.nonfinite not in NONFINITE_GRAD_POLICIES:
            raise ValueError(f"{owner}: nonfinite={self.nonfinite!r} is not valid; use one of {NONFINITE_GRAD_POLICIES}")
        if not isinstance(self.overrides, Mapping):
            raise TypeError(f"{owner}: overrides= must be a mapping of name pattern -> states, got {type(self.overrides).__name__}")
        for pattern, states in self.overrides.items():
            options = {"states": states, "rounding": self.rounding, "block_size": None, "min_quant_size": 0}
            validate_policy(options, state_names, f"{owner}: overrides[{pattern!r}]")

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
        options["overrides"] = dict(options.get("overrides") or {})
        if policy is not None:
            if not isinstance(policy, QuantizationPolicy):
                raise TypeError(f"{owner}: policy= must be a QuantizationPolicy, got {type(policy).__name__}")
            given = sorted(name for name, value in options.items() if value != POLICY_DEFAULTS[name])
            if given:
                raise ValueError(f"{owner}: give either policy= or the keywords {given}, not both")
            policy.validate(owner)
            return policy
        return cls(**options, owner=owner)

    def apply(self, optimizer: torch.optim.Optimizer, module: torch.nn.Module | None = None) -> torch.optim.Optimizer:
        """The quantized form of ``optimizer`` (converted in place where possible); an already quantized one is returned as is.

        ``module`` supplies parameter names for ``overrides`` (else the groups' ``param_names``, where every group has them).

        Raises:
            ValueError: ``overrides`` without names, a pattern that matches no parameter, or an override naming a
                state the quantized optimizer does not have (checked before ``optimizer`` is converted).
        """
        from torch.distributed.fsdp import FullyShardedDataParallel

        from .base import QuantizedStates
        from .wrap import QUANTIZED_EQUIVALENTS, QuantizedOptimizerWrapper, fsdp_full_numels, quantize_optimizer

        if isinstance(optimizer, QuantizedStates):
            return optimizer
        names = None if module is None else [(clean_parameter_name(name), param) for name, param in module.named_parameters()]
        if names is None and all(group.get("param_names") for group in optimizer.param_groups):
            names = [
                (name, param) for group in optimizer.param_groups for name, param in zip(group["param_names"], group["params"], strict=True)
            ]
        overrides = None
        if self.overrides:
            if names is None:
                raise ValueError(
                    "QuantizationPolicy: overrides= needs the parameter names it matches; call apply(optimizer, module), "
                    "or build the optimizer from model.named_parameters()"
                )  # the wrapper has no fixed state names: any is accepted
            self.validate("QuantizationPolicy", QUANTIZED_EQUIVALENTS.get(type(optimizer), QuantizedOptimizerWrapper).state_names or None)
            overrides = self.overrides_for(names, type(module).__name__ if module is not None else type(optimizer).__name__)
        quantized = quantize_optimizer(optimizer, policy=dataclasses.replace(self, overrides={}))
        if overrides is not None:
            quantized.state_overrides = overrides
        if module is not None:
            quantized.module_names = {param: name for name, param in names}
        if module is not None and any(isinstance(m, FullyShardedDataParallel) for m in module.modules()):
            quantized.checkpoint_mode = "fp32"  # FSDP1 gathers and reshapes state tensors like its flat shards
            quantized.full_numels = fsdp_full_numels(module)  # its parameters are local 1-D views: decide from the full sizes
        return quantized

    def attach_overrides(self, optimizer: QuantizedStates) -> None:
        """Set ``optimizer.state_overrides`` from the names in its groups (``param_names``), for an optimizer built with
        this policy; raises where ``overrides`` is set and the groups carry no names."""
        if not self.overrides:
            return
        if not all(group.get("param_names") for group in optimizer.param_groups):
            raise ValueError(
                f"{type(optimizer).__name__}: policy.overrides match parameter names; build the optimizer from "
                "model.named_parameters(), or use policy.apply(torch_optimizer, model)"
            )
        self.validate(type(optimizer).__name__, optimizer.state_names or None)
        named = [
            (name, param) for group in optimizer.param_groups for name, param in zip(group["param_names"], group["params"], strict=True)
        ]
        optimizer.state_overrides = self.overrides_for(named, type(optimizer).__name__)

    def overrides_for(self, named: list[tuple[str, torch.Tensor]], owner: str) -> dict[torch.Tensor, StatesSpec]:
        """``{parameter: states}`` for every ``(name, parameter)`` of ``named`` that an override pattern matches.

        Raises:
            ValueError: a pattern matches no name of ``named`` (it would be silently ignored).
        """
        for pattern in self.overrides:
            if not any(fnmatch.fnmatchcase(name, pattern) for name, _ in named):
                raise ValueError(
                    f"QuantizationPolicy: overrides pattern {pattern!r} matches no parameter of {owner}; patterns are "
                    f"matched with fnmatch (case-sensitive) against the parameter names: {_name_summary(named)}; "
                    "fix the pattern or remove it"
                )
        matched: dict[torch.Tensor, StatesSpec] = {}
        for name, param in named:
            for pattern, states in self.overrides.items():
                if fnmatch.fnmatchcase(name, pattern):
                    matched[param] = states
                    break
        return matched


# The options of a policy, in signature order; the first four are carried by every param group.
POLICY_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(QuantizationPolicy))
GROUP_OPTIONS: tuple[str, ...] = ("states", "rounding", "block_size", "min_quant_size")
POLICY_DEFAULTS: dict[str, Any] = {
    f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    for f in dataclasses.fields(QuantizationPolicy)
}


def _name_summary(named: list[tuple[str, torch.Tensor]], shown: int = 20) -> str:
    """The distinct forms of the parameter names, the first ``shown`` of them: the index of a repeated block (a numeric
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
    listed = list(forms)
    more = f", ... ({len(listed) - shown} more)" if len(listed) > shown else ""
    return ", ".join(listed[:shown]) + more if listed else "(none: the module has no parameters)"
