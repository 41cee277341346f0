"""Byte containers for codes and the block view of a flat tensor.

Codes of 4 bits or fewer pack two per byte: element ``2i`` in the low nibble and
``2i + 1`` in the high nibble of byte ``i``. Codes of 5 to 8 bits take a byte,
9 to 16 bits an int16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def container_dtype(bits: int) -> torch.dtype:
    """Storage dtype for codes of ``bits`` bits (``bits <= 16``)."""
    return torch.uint8 if bits <= 8 else torch.int16


def packed_numel(numel: int, bits: int) -> int:
    """Number of container elements holding ``numel`` codes."""
    return -(-numel // 2) if bits <= 4 else numel


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Int codes ``(n,)`` -> container ``(packed_numel(n, bits),)``."""
    if bits > 8:
        return codes.to(torch.int16)
    codes = codes.to(torch.uint8)
    if bits > 4:
        return codes
    if codes.numel() % 2:
        codes = F.pad(codes, (0, 1))
    pairs = codes.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Container -> int32 codes ``(numel,)``, the inverse of :func:`pack`."""
    if bits > 8:
        return packed.to(torch.int32) & 0xFFFF
    if bits > 4:
        return packed.to(torch.int32)
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(-1)
    return nibbles[:numel].to(torch.int32)


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def as_blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """``(n,)`` -> ``(num_blocks, block_size)``, zero-padding the last block (zeros never change an absmax)."""
    padding = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    if padding:
        flat = F.pad(flat, (0, padding))
    return flat.view(-1, block_size)
