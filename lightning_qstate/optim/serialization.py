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

from ..formats import QuantizedTensor, StorageFormat, get_format

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


def format_marker(fmt: StorageFormat) -> str:
    """The string that records a state's format next to its fp32 export."""
    return json.dumps({VERSION_KEY: STATE_FORMAT_VERSION, **fmt.config}, sort_keys=True)


def format_from_marker(marker: str) -> StorageFormat:
    config = json.loads(marker)
    version = config.pop(VERSION_KEY)
    if version > STATE_FORMAT_VERSION:
        raise ValueError(f"checkpoint state version {version} is newer than this lightning_qstate ({STATE_FORMAT_VERSION}); upgrade to load it")
    return get_format(**config)
