"""Checkpoint form of quantized states: plain dicts of tensors and strings.

A :class:`~lightning_qstate.formats.QuantizedTensor` is exported as::

    {"qstate_version": 4, "format": {get_format kwargs}, "codes": uint8/int16/float tensor,
     "scales": bf16/fp32 tensor or None, "shape": [..], "dtype": "float32", "checksum": int}

``checksum`` is the CRC-32 of the version, format, shape and dtype (as sorted JSON) followed by the codes' and the
scales' bytes; loading recomputes it, so a damaged checkpoint raises instead of loading wrong values (a flipped
``signed`` would decode the codes through another map, a relabelled dtype or format the same bytes as other values).
Loading also refuses non-finite block scales (a state that held them would only surface as an overflow at the next
step), and codes or scales of another dtype than the format stores.

Older versions load: version 1 (before block scales could be bf16) stored fp32 scales and no
``scale_dtype``, so its states load in the same format with ``scale_dtype="fp32"``; versions 1 and 2 have no
checksum, and their non-negative states may hold code 0 for positive values (the flushed ``v`` that
version 3's zero-free encoders never write), which loading lifts to the smallest positive code; version 3's checksum
covers the codes and scales only. An entry that carries a checksum is checked whatever version it names (a relabelled
version does not skip it).

Only tensors, strings, numbers and containers appear, so ``torch.load(...,
weights_only=True)`` needs no safe globals, and ``torch.optim.Optimizer``'s
loader never sees (and so never casts) the codes.
"""

from __future__ import annotations

import json
import warnings
import zlib
from typing import Any

import torch

from ..formats import BlockFormat, QuantizedTensor, StorageFormat, get_format
from ..formats.packing import as_blocks, pack, unpack

STATE_FORMAT_VERSION = 4
VERSION_KEY = "qstate_version"
FORMAT_SUFFIX = ".qstate_format"  # "<state>.qstate_format" holds the format of a state exported as fp32
# The marker of a per-value state kept plain where the policy would quantize it (``reencode_state(..., "fp32")``, a
# plan's fp32): loading keeps it plain instead of quantizing it as a plain torch checkpoint's state.
PLAIN_MARKER = "fp32"


def export_state(value: Any) -> Any:
    """Checkpoint form of one state value; tensors and other values pass through."""
    if not isinstance(value, QuantizedTensor):
        return value
    entry = {
        VERSION_KEY: STATE_FORMAT_VERSION,
        "format": dict(value.format.config),
        "codes": value.codes,
        "scales": value.scales,
        "shape": list(value.shape),
        "dtype": str(value.dtype).removeprefix("torch."),
    }
    return {**entry, "checksum": entry_checksum(entry)}


def entry_checksum(entry: dict, version: int | None = None) -> int:
    """The checksum of a packed state as checkpoint ``version`` (default: the entry's own) computes it: from version 4
    the metadata too, as sorted JSON, then the codes and scales."""
    version = entry[VERSION_KEY] if version is None else version
    if version < 4:
        return checksum(entry["codes"], entry["scales"])
    meta = {key: entry[key] for key in (VERSION_KEY, "format", "shape", "dtype")}
    return checksum(entry["codes"], entry["scales"], start=zlib.crc32(json.dumps(meta, sort_keys=True).encode()))


def checksum(*tensors: torch.Tensor | None, start: int = 0) -> int:
    """CRC-32 of the bytes of ``tensors`` (``None`` skipped), chained from ``start``; read from the CPU in 64 MiB pieces."""
    crc = start
    piece = 1 << 26
    for tensor in tensors:
        if tensor is None or tensor.numel() == 0:
            continue
        data = tensor.detach().reshape(-1).view(torch.uint8)
        for start in range(0, data.numel(), piece):
            crc = zlib.crc32(data[start : start + piece].cpu().numpy(), crc)
    return crc


def is_exported(value: Any) -> bool:
    return isinstance(value, dict) and VERSION_KEY in value


def import_state(entry: dict, param: torch.Tensor | None, where: str) -> QuantizedTensor:
    """Rebuild a quantized state for ``param`` from its checkpoint form, on ``param``'s device, codes untouched
    (``param=None``: the entry's own shape, on the CPU).

    Raises:
        ValueError: a newer checkpoint version; a state whose shape or size does not fit ``param`` (a checkpoint
            of another rank's shard or another model never loads silently); a checksum that does not match the
            codes, scales and format, codes or scales of another dtype, or non-finite scales (a damaged checkpoint).
    """
    missing = sorted({"format", "codes", "scales", "shape", "dtype"} - set(entry))
    if missing:
        raise ValueError(f"{where}: the checkpoint is damaged: its packed state lacks {missing}")
    if param is not None:
        check_state_shape(torch.Size(entry["shape"]), param, where)
    version = entry[VERSION_KEY]
    fmt = versioned_format(version, entry["format"], where)
    shape = torch.Size(entry["shape"])
    codes, scales = entry["codes"], entry["scales"]
    dtype = getattr(torch, str(entry["dtype"]), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{where}: the checkpoint is damaged: its dtype {entry['dtype']!r} is not a torch dtype")
    layout = fmt.allocate(torch.Size([0]))  # the dtypes the format stores (same bytes as another dtype decode to other values)
    saved_dtypes = (codes.dtype, None if scales is None else scales.dtype)
    if saved_dtypes != (layout.codes.dtype, None if layout.scales is None else layout.scales.dtype):
        raise ValueError(
            f"{where}: the checkpoint is damaged: its codes and scales are {saved_dtypes}, format {fmt.name!r} stores "
            f"{(layout.codes.dtype, None if layout.scales is None else layout.scales.dtype)}"
        )
    stored = codes.nbytes + (0 if scales is None else scales.nbytes)
    if stored != fmt.nbytes(shape.numel()):
        raise ValueError(
            f"{where}: checkpoint state holds {stored} bytes but format {fmt.name!r} needs {fmt.nbytes(shape.numel())} "
            f"for shape {tuple(shape)}"
        )
    checked = version >= 3 or "checksum" in entry  # a relabelled version skips nothing
    if checked and ("checksum" not in entry or entry_checksum(entry, max(version, 3)) != int(entry["checksum"])):
        raise ValueError(
            f"{where}: the checkpoint is damaged: its codes, scales or format do not match their checksum (or, a state dict held in "
            "memory, the optimizer stepped its tensors since: state_dict() shares them, as torch's does; copy.deepcopy it)"
        )
    if scales is not None and getattr(fmt, "nonfinite", "raise") == "raise" and not bool(torch.isfinite(scales).all()):
        raise ValueError(f"{where}: the checkpoint is damaged: {int((~torch.isfinite(scales)).sum())} block scale(s) are inf or NaN")
    device = torch.device("cpu") if param is None else param.device
    codes = codes.to(device)
    if version < 3 and isinstance(fmt, BlockFormat):
        codes = fmt.lift_zero_codes(codes, shape.numel())
    return QuantizedTensor(fmt, codes, None if scales is None else scales.to(device), shape, dtype)


def unpacked_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with every packed state in the fp32 checkpoint form (``checkpoint_mode="fp32"``).

    A packed state (single device, DDP) holds the full parameter's codes; a strategy that reshards optimizer
    states (FSDP1, FSDP2) cuts fp32 tensors of the parameter's shape into shards, and cannot cut codes and block
    scales. Each packed ``state[i][name]`` becomes its decoded values (fp32, the parameter's shape, checked as loading
    checks them: size, checksum, scales) plus ``"<name>.qstate_format"``; loading quantizes them back into the same
    format (``quantize_exactly``: exactly where the shard's blocks are the checkpoint's blocks, else to nearest, with a
    warning that counts the blocks). Other entries are shared with ``state_dict``, which is not modified.
    """
    converted = {}
    for index, entries in state_dict["state"].items():
        converted[index] = dict(entries)
        for name, entry in entries.items():
            if is_exported(entry):
                state = import_state(entry, None, f"optimizer state {index} ({name!r})")
                converted[index][name] = state.dequantize(torch.float32)
                converted[index][name + FORMAT_SUFFIX] = format_marker(state.format)
    return {**state_dict, "state": converted}


def check_state_shape(shape: torch.Size, param: torch.Tensor, where: str) -> None:
    """Refuse a checkpoint state whose ``shape`` is not ``param``'s (a local shard's under FSDP): another model's, or
    another rank's or world size's shard, never loads silently."""
    if shape != param.shape:
        raise ValueError(
            f"{where}: checkpoint state has shape {tuple(shape)} but the parameter has shape {tuple(param.shape)} "
            "(under FSDP, a shard's: another rank's or world size's state, or a checkpoint saved under DDP or on one device, "
            "whose packed states hold the full parameters: load unpacked_state_dict(state_dict) instead, as the plugins and "
            "QuantizedOptimizerStates have FSDPStrategy and ModelParallelStrategy do)"
        )


def quantize_exactly(fmt: StorageFormat, values: torch.Tensor, where: str = "quantize_exactly") -> QuantizedTensor:
    """``values`` (the fp32 export of a state of format ``fmt``, ``checkpoint_mode="fp32"``) quantized back into codes
    and scales that decode to exactly them, whatever rounding made the state.

    Round-to-nearest re-quantization recovers a block's scale from its largest value, and misses it where that value's
    code is below 1: signed dynamic maps stop short of -1 (``int8`` at -0.993, ``int4`` at -0.8875), and a bf16 scale is
    the absmax rounded up, so round-to-nearest or stochastic rounding may have taken the absmax to a lower code. Such a
    block's scale is its largest value over one of the codes near the top of the map (``_top_codes``; for fp32 scales
    also two fp32 spacings either way): the first candidate whose codes decode to the block's values exactly replaces
    the re-quantized block. A block no scale fits keeps round-to-nearest's codes and scale, and a warning (naming
    ``where``) counts such blocks: values saved with another block layout (an FSDP1 checkpoint at another world size, a
    packed one resumed under FSDP: ``unpacked_state_dict``), by a version before this search (it exported one value
    per such block pinned), or damaged (the fp32 form has no checksum: a changed value seldom decodes from any code and
    scale of its block).
    """
    quantized = fmt.quantize(values, rounding="nearest")
    if not isinstance(fmt, BlockFormat) or quantized.scales is None or quantized.numel == 0:
        return quantized
    block, blocks, numel = fmt.block_size, quantized.scales.numel(), quantized.numel
    target = as_blocks(values.reshape(-1).float(), block)
    valid = as_blocks(torch.ones(numel, dtype=torch.bool, device=values.device), block)
    codes = as_blocks(unpack(quantized.codes, fmt.bits, numel), block)
    scales = quantized.scales.clone()
    decode = fmt.tables(values.device)["decode"]
    missed = ((decode[codes.long()] * scales.float()[:, None] != target) & valid).any(dim=1) & torch.isfinite(scales)
    rows = missed.nonzero().view(-1)
    if rows.numel() == 0:
        return quantized
    largest = (target[rows] * valid[rows]).abs().amax(dim=1)
    int_type = torch.int16 if fmt.scale_dtype == torch.bfloat16 else torch.int32
    spacings = (0,) if fmt.scale_dtype == torch.bfloat16 else (0, -1, 1, -2, 2)
    for top, sign, spacing in _top_codes(decode, spacings):
        if rows.numel() == 0:
            break
        scale = ((largest / top).to(fmt.scale_dtype).view(int_type) + spacing).view(fmt.scale_dtype)
        usable = torch.isfinite(scale) & (scale > 0) & (target[rows] == sign * largest[:, None]).any(dim=1)
        divisor = torch.where(usable, scale.float(), 1.0)
        trial = fmt.encode((target[rows] / divisor[:, None]).clamp(-1.0, 1.0), "nearest", None)
        fits = usable & ((decode[trial.long()] * divisor[:, None] == target[rows]) | ~valid[rows]).all(dim=1)
        codes[rows[fits]], scales[rows[fits]] = trial[fits], scale[fits]
        rows, largest = rows[~fits], largest[~fits]
    if rows.numel():
        warnings.warn(
            f"{where}: {rows.numel()} of {blocks} blocks of {block} values ({fmt.name}) decode from no code and scale of theirs; "
            "re-quantized to nearest. The checkpoint was saved with another block layout (FSDP1 at another world size, or on one "
            "device or under DDP and resumed under FSDP), by an earlier lightning_qstate, or is damaged",
            UserWarning,
            stacklevel=3,
        )
    return QuantizedTensor(fmt, pack(codes.view(-1)[:numel], fmt.bits), scales, quantized.shape, quantized.dtype)


def _top_codes(decode: torch.Tensor, spacings: tuple[int, ...]) -> list[tuple[float, float, int]]:
    """The (magnitude, sign, scale spacing) of every code that can hold a block's largest value, largest first.

    The block's absmax, in units of its scale, is above ``1 - 2**-7`` (a bf16 scale is the absmax rounded up) and rounds
    to a code at least the largest one at or below that (the top of a side that ends short of it included)."""
    sides = [(decode * sign, sign) for sign in (1.0, -1.0) if bool((decode * sign > 0).any())]
    lowest = min(float(values[(values > 0) & (values <= 1 - 2**-7)].max()) for values, _ in sides)
    tops = [(float(c), sign, spacing) for values, sign in sides for c in values[values >= lowest].tolist() for spacing in spacings]
    return sorted(tops, key=lambda top: -top[0])


def format_marker(fmt: StorageFormat) -> str:
    """The string that records a state's format next to its fp32 export."""
    return json.dumps({VERSION_KEY: STATE_FORMAT_VERSION, **fmt.config}, sort_keys=True)


def format_from_marker(marker: str, where: str = "format marker") -> StorageFormat:
    try:
        config = json.loads(marker)
        version = config.pop(VERSION_KEY)
    except (json.JSONDecodeError, TypeError, AttributeError, KeyError):
        raise ValueError(f"{where}: the checkpoint is damaged: its format marker {marker!r} is not one") from None
    return versioned_format(version, config, where)


def versioned_format(version: int, config: dict, where: str) -> StorageFormat:
    """The format of a state saved at checkpoint ``version`` with ``get_format`` arguments ``config``."""
    check_version(version, where)
    if not isinstance(config, dict):
        raise ValueError(f"{where}: the checkpoint is damaged: its format is {config!r}, not a dict of get_format arguments")
    if version < 2:  # version 1 stored every block scale in fp32
        config = {**config, "scale_dtype": "fp32"}
    try:
        return get_format(**config)
    except TypeError as error:  # an argument get_format does not take
        raise ValueError(f"{where}: the checkpoint is damaged: format {config}: {error}") from None


def check_version(version: Any, where: str) -> None:
    """Refuse a checkpoint version that is no version number (damage) or newer than this package's."""
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise ValueError(f"{where}: the checkpoint is damaged: its version {version!r} is not a version number")
    if version > STATE_FORMAT_VERSION:
        raise ValueError(
            f"{where}: checkpoint state version {version} is newer than this lightning_qstate ({STATE_FORMAT_VERSION}); upgrade to load it"
        )
