"""Which storage format each optimizer state gets: the ``states=`` policy and its per-group options."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Union

import torch
from torch.distributed.tensor import DTensor, Shard

from ..formats import ROUNDINGS, BlockFormat, StorageFormat, check_block_size, get_format

# typing.Union, not `|`: the optimizers' signatures (read by the CLI's jsonargparse) keep the object they always had.
StatesSpec = Union[str, Mapping[str, str]]  # noqa: UP007

# States that are never negative get unsigned maps (no codes spent on the sign).
NONNEGATIVE_STATES = frozenset({"exp_avg_sq", "max_exp_avg_sq", "exp_avg_sq_row", "exp_avg_sq_col", "sum", "square_avg", "acc_delta"})

# Smallest block a row-aligned (sharded) parameter may use before it keeps fp32 states.
MIN_ALIGNED_BLOCK = 32

# Options every quantized optimizer adds to its torch counterpart; each may be overridden per param group.
POLICY_DEFAULTS: dict[str, Any] = {
    "states": "int8",
    "rounding": "nearest",
    "block_size": None,
    "min_quant_size": 4096,
}


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
