"""Checkpoint form of quantized states: plain dicts of tensors and strings.

A :class:`~lightning_qstate.formats.QuantizedTensor` is exported as::

    {"qstate_version": 3, "format": {get_format kwargs}, "codes": uint8/int16/float tensor,
     "scales": bf16/fp32 tensor or None, "shape": [..], "dtype": "float32", "checksum": int}

``checksum`` is the CRC-32 of the codes' and the scales' bytes; loading recomputes it, so a damaged
checkpoint raises instead of loading wrong values. Loading also refuses non-finite block scales (a state
that held them would only surface as an overflow at the next step).

Older versions load: version 1 (before block scales could be bf16) stored fp32 scales and no
``scale_dtype``, so its states load in the same format with ``scale_dtype="fp32"``; versions 1 and 2 have no
checksum, and their non-negative states may hold code 0 for positive values (the flushed ``v`` that
version 3's zero-free encoders never write), which loading lifts to the smallest positive code.

Only tensors, strings, numbers and containers appear, so ``torch.load(...,
weights_only=True)`` needs no safe globals, and ``torch.optim.Optimizer``'s
loader never sees (and so never casts) the codes.
"""

from __future__ import annotations

import json
import zlib
from typing import Any

import torch

from ..formats import BlockFormat, QuantizedTensor, StorageFormat, get_format

STATE_FORMAT_VERSION = 3
VERSION_KEY = "qstate_version"
FORMAT_SUFFIX = ".qstate_format"  # "<state>.qstate_format" holds the format of a state exported as fp32
# The marker of a per-value state kept plain where the policy would quantize it (``reencode_state(..., "fp32")``, a
# plan's fp32): loading keeps it plain instead of quantizing it as a plain torch checkpoint's state.
PLAIN_MARKER = "fp32"


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
        "checksum": checksum(value.codes, value.scales),
    }


def checksum(*tensors: torch.Tensor | None) -> int:
    """CRC-32 of the bytes of ``tensors`` (``None`` skipped), chained; read from the CPU in 64 MiB pieces."""
    crc = 0
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


def import_state(entry: dict, param: torch.Tensor, where: str) -> QuantizedTensor:
    """Rebuild a quantized state for ``param`` from its checkpoint form, on ``param``'s device, codes untouched.

    Raises:
        ValueError: a newer checkpoint version; a state whose shape or size does not fit ``param`` (a checkpoint
            of another rank's shard or another model never loads silently); a checksum that does not match the
            codes and scales, or non-finite scales (a damaged checkpoint).
    """
    missing = sorted({"format", "codes", "scales", "shape", "dtype"} - set(entry))
    if missing:
        raise ValueError(f"{where}: the checkpoint is damaged: its packed state lacks {missing}")
    version = entry[VERSION_KEY]
    fmt = versioned_format(version, entry["format"], where)
    shape = torch.Size(entry["shape"])
    if shape != param.shape:
        raise ValueError(f"{where}: checkpoint state has shape {tuple(shape)} but the parameter has shape {tuple(param.shape)}")
    codes, scales = entry["codes"], entry["scales"]
    stored = codes.nbytes + (0 if scales is None else scales.nbytes)
    if stored != fmt.nbytes(shape.numel()):
        raise ValueError(
            f"{where}: checkpoint state holds {stored} bytes but format {fmt.name!r} needs {fmt.nbytes(shape.numel())} "
            f"for shape {tuple(shape)}"
        )
    if version >= 3 and ("checksum" not in entry or checksum(codes, scales) != int(entry["checksum"])):
        raise ValueError(
            f"{where}: the checkpoint is damaged: its codes and scales do not match their checksum (or, a state dict held in "
            "memory, the optimizer stepped its tensors since: state_dict() shares them, as torch's does; copy.deepcopy it)"
        )
    if scales is not None and getattr(fmt, "nonfinite", "raise") == "raise" and not bool(torch.isfinite(scales).all()):
        raise ValueError(f"{where}: the checkpoint is damaged: {int((~torch.isfinite(scales)).sum())} block scale(s) are inf or NaN")
    device = param.device
    codes = codes.to(device)
    if version < 3 and isinstance(fmt, BlockFormat):
        codes = fmt.lift_zero_codes(codes, shape.numel())
    return QuantizedTensor(fmt, codes, None if scales is None else scales.to(device), shape, getattr(torch, entry["dtype"]))


def exact_values(value: QuantizedTensor) -> torch.Tensor:
    """The values of ``value`` as an fp32 tensor (whatever dtype it decodes to: a bf16 parameter's states are quantized
    from fp32 values) that re-quantizes (round-to-nearest) to the very same codes and scales.

    This is what the ``"fp32"`` checkpoint mode exports. ``dequantize()`` alone does not round-trip where a
    block's largest stored value is below its scale, for re-quantizing would rescale the block and move codes:
    signed dynamic maps stop short of -1 (``int8`` at -0.993, ``int4`` at -0.8875), and a bf16 scale is the
    absmax rounded up, so the absmax itself may have rounded to a code below 1. In such a block the first value
    holding the block's largest code magnitude is exported as a value ``t`` that re-quantizes to the same scale
    and code: the largest ``t <= scale`` whose scale is this one (for a bf16 scale, above the previous bf16
    value) and whose code is that one, found by bisection over its fp32 bit pattern. Every other value is
    exactly its dequantized value. Where no such ``t`` exists (stochastic rounding took a block's largest value to a
    code whose values all lie below the previous bf16 scale), the block re-quantizes to a new scale.
    """
    values = value.dequantize(torch.float32)
    fmt = value.format
    if not isinstance(fmt, BlockFormat) or value.scales is None or value.numel == 0:
        return values
    block, blocks = fmt.block_size, value.scales.numel()
    flat = torch.nn.functional.pad(values.reshape(-1).float(), (0, blocks * block - value.numel)).view(blocks, block)
    scales = value.scales.float()
    largest = flat.abs().amax(dim=1)
    short = torch.isfinite(scales) & (scales > 0) & (largest < scales)
    for sign in (-1.0, 1.0):
        holds = (flat * sign == largest[:, None]) & (largest > 0)[:, None]
        rows = (short & holds.any(dim=1)).nonzero().view(-1)
        if rows.numel() == 0:
            continue
        columns = holds[rows].int().argmax(dim=1)
        pinned = _same_code_value(fmt, flat[rows, columns], scales[rows])
        found = ~torch.isnan(pinned)
        flat[rows[found], columns[found]] = pinned[found]
        short[rows[found]] = False
    return flat.view(-1)[: value.numel].view(values.shape)


def _same_code_value(fmt: BlockFormat, stored: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per entry, the largest-magnitude ``t`` (sign of ``stored``) with ``fmt.stored_scale(|t|) == scale`` and the
    code of ``stored / scale``; NaN where none exists. ``stored``, ``scales``: ``(k,)`` fp32."""
    target = fmt.encode(stored / scales, "nearest", None)
    decode = fmt.tables(stored.device)["decode"]
    target_units = decode[target.long()].abs()
    top = scales.view(torch.int32)
    high = top.clone()
    low = top - 0xFFFF if fmt.scale_dtype == torch.bfloat16 else top.clone()  # smallest pattern whose scale is this one
    found = torch.full_like(stored, float("nan"))
    sign = torch.where(stored < 0, -1.0, 1.0)
    for _ in range(18):  # the pattern range holds at most 2**16 values
        searching = low <= high
        middle = torch.where(searching, low + torch.div(high - low, 2, rounding_mode="floor"), top)
        candidate = sign * middle.view(torch.float32)
        units = decode[fmt.encode(candidate / scales, "nearest", None).long()].abs()
        found = torch.where(searching & (units == target_units), candidate, found)
        low = torch.where(searching & (units <= target_units), middle + 1, low)  # look higher for the largest hit
        high = torch.where(searching & (units > target_units), middle - 1, high)
    return found


def format_marker(fmt: StorageFormat) -> str:
    """The string that records a state's format next to its fp32 export."""
    return json.dumps({VERSION_KEY: STATE_FORMAT_VERSION, **fmt.config}, sort_keys=True)


def format_from_marker(marker: str) -> StorageFormat:
    config = json.loads(marker)
    return versioned_format(config.pop(VERSION_KEY), config, "format marker")


def versioned_format(version: int, config: dict, where: str) -> StorageFormat:
    """The format of a state saved at checkpoint ``version`` with ``get_format`` arguments ``config``."""
    if version > STATE_FORMAT_VERSION:
        raise ValueError(
            f"{where}: checkpoint state version {version} is newer than this lightning_qstate ({STATE_FORMAT_VERSION}); upgrade to load it"
        )
    if version < 2:  # version 1 stored every block scale in fp32
        config = {**config, "scale_dtype": "fp32"}
    return get_format(**config)
