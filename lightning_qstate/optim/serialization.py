"""Checkpoint form of quantized states: plain dicts of tensors and strings.

A :class:`~lightning_qstate.formats.QuantizedTensor` is exported as::

    {"qstate_version": 1, "format": {get_format kwargs}, "codes": uint8/int16/float tensor,
     "scales": fp32 tensor or None, "shape": [..], "dtype": "float32"}

Only tensors, strings, numbers and containers appear, so ``torch.load(...,
weights_only=True)`` needs no safe globals, and ``torch.optim.Optimizer``'s
loader never sees (and so never casts) the codes.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ..formats import BlockFormat, QuantizedTensor, StorageFormat, get_format
from ..formats.packing import unpack

STATE_FORMAT_VERSION = 1
VERSION_KEY = "qstate_version"
FORMAT_SUFFIX = ".qstate_format"  # "<state>.qstate_format" holds the format of a state exported as fp32


def export_state(value: Any) -> Any:
    """Checkpoint form of one state value; tensors and other values pass through."""
    if not isinstance(value, QuantizedTensor):
        return value
    return {
        VERSION_KEY: STATE_FORMAT_VERSION,
        "format": dict(value.format.config),
        "codes": value.codes,
        "scales": value.scales,
        "shape": list(value.shape),
        "dtype": str(value.dtype).removeprefix("torch."),
    }


def is_exported(value: Any) -> bool:
    return isinstance(value, dict) and VERSION_KEY in value


def import_state(entry: dict, param: torch.Tensor, where: str) -> QuantizedTensor:
    """Rebuild a quantized state for ``param`` from its checkpoint form, on ``param``'s device, codes untouched.

    Raises:
        ValueError: a newer checkpoint version, or a state whose shape or size does not fit ``param``
            (a checkpoint of another rank's shard or another model never loads silently).
    """
    version = entry[VERSION_KEY]
    if version > STATE_FORMAT_VERSION:
        raise ValueError(f"{where}: checkpoint state version {version} is newer than this lightning_qstate ({STATE_FORMAT_VERSION}); upgrade to load it")
    fmt = get_format(**entry["format"])
    shape = torch.Size(entry["shape"])
    if shape != param.shape:
        raise ValueError(f"{where}: checkpoint state has shape {tuple(shape)} but the parameter has shape {tuple(param.shape)}")
    codes, scales = entry["codes"], entry["scales"]
    stored = codes.nbytes + (0 if scales is None else scales.nbytes)
    if stored != fmt.nbytes(shape.numel()):
        raise ValueError(f"{where}: checkpoint state holds {stored} bytes but format {fmt.name!r} needs {fmt.nbytes(shape.numel())} for shape {tuple(shape)}")
    device = param.device
    return QuantizedTensor(fmt, codes.to(device), None if scales is None else scales.to(device), shape, getattr(torch, entry["dtype"]))


def exact_values(value: QuantizedTensor) -> torch.Tensor:
    """The values of ``value`` as a tensor that re-quantizes (round-to-nearest) to the very same codes and scales.

    This is what the ``"fp32"`` checkpoint mode exports. ``dequantize()`` alone does not round-trip: signed
    dynamic maps stop short of -1 (``int8`` at -0.993, ``int4`` at -0.8875), so a block whose absmax was a
    negative value decodes to a smaller absmax, and re-quantizing it would rescale the block and move codes.
    In such blocks the first value holding the code that -1 rounds to is exported as ``-scale`` instead: the
    block's exact absmax before quantization, which rounds to that same code. Every other value is exactly
    its dequantized value.
    """
    values = value.dequantize()
    fmt = value.format
    if not isinstance(fmt, BlockFormat) or value.scales is None or value.numel == 0:
        return values
    device = value.codes.device
    decode = fmt.tables(device)["decode"]
    ends = fmt.encode(torch.tensor([-1.0, 1.0], device=device), "nearest", None).long()  # codes that -1 and +1 round to
    block, blocks = fmt.block_size, value.scales.numel()
    padding = blocks * block - value.numel
    codes = torch.nn.functional.pad(unpack(value.codes, fmt.bits, value.numel).long(), (0, padding), value=-1).view(blocks, block)
    flat = torch.nn.functional.pad(values.reshape(-1).float(), (0, padding)).view(blocks, block)
    scales = value.scales.float()
    short = torch.isfinite(scales) & (scales > 0) & (flat.abs().amax(dim=1) < scales)
    for sign, end in zip((-1.0, 1.0), ends.tolist()):
        reach = sign * float(decode[end])
        if not 0 < reach < 1:  # that end decodes to +-1 already, or belongs to the other sign (unsigned maps)
            continue
        holds = codes == end
        pin = short & holds.any(dim=1)
        rows = pin.nonzero().view(-1)
        flat[rows, holds[rows].int().argmax(dim=1)] = sign * scales[rows]
        short = short & ~pin
    return flat.view(-1)[: value.numel].to(values.dtype).view(values.shape)


def format_marker(fmt: StorageFormat) -> str:
    """The string that records a state's format next to its fp32 export."""
    return json.dumps({VERSION_KEY: STATE_FORMAT_VERSION, **fmt.config}, sort_keys=True)


def format_from_marker(marker: str) -> StorageFormat:
    config = json.loads(marker)
    version = config.pop(VERSION_KEY)
    if version > STATE_FORMAT_VERSION:
        raise ValueError(f"checkpoint state version {version} is newer than this lightning_qstate ({STATE_FORMAT_VERSION}); upgrade to load it")
    return get_format(**config)
