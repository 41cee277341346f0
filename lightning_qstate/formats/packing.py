"""Byte containers for codes and the block view of a flat tensor.

Codes of 4 bits or fewer pack two per byte: element ``2i`` in the low nibble and ``2i + 1`` in the high nibble of
byte ``i``. Codes of 5 to 7 bits are dense: each group of 8 codes fills exactly ``bits`` bytes, as a little-endian
bit stream (code ``j`` of the group holds bits ``[j * bits, (j + 1) * bits)`` of the group's ``8 * bits``-bit
word, whose byte ``k`` is the group's byte ``k``); the last group is padded with zero codes. Codes of 8 bits take a
byte, 9 to 16 bits an int16. A block of ``block_size`` codes (a power of two >= 8) is then a whole number of
bytes, ``block_size * bits / 8`` (nibbles: ``block_size / 2``), so the blocks of a tensor stay byte-aligned.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP = 8  # codes per group of a dense (5- to 7-bit) container: ``bits`` bytes


def is_dense(bits: int) -> bool:
    """Whether codes of ``bits`` bits are stored densely (5, 6 or 7 bits)."""
    return 4 < bits < 8


def container_dtype(bits: int) -> torch.dtype:
    """Storage dtype for codes of ``bits`` bits (``bits <= 16``)."""
    return torch.uint8 if bits <= 8 else torch.int16


def packed_numel(numel: int, bits: int) -> int:
    """Number of container elements holding ``numel`` codes."""
    if bits <= 4:
        return -(-numel // 2)
    if is_dense(bits):
        return -(-numel // GROUP) * bits
    return numel


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Int codes ``(n,)`` -> container ``(packed_numel(n, bits),)``."""
    if bits > 8:
        return codes.to(torch.int16)
    if bits == 8:
        return codes.to(torch.uint8)
    width = 2 if bits <= 4 else GROUP
    codes = codes.to(torch.int64)
    if codes.numel() % width:
        codes = F.pad(codes, (0, width - codes.numel() % width))
    if bits <= 4:
        pairs = codes.view(-1, 2)
        return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)
    shifts = torch.arange(GROUP, device=codes.device, dtype=torch.int64) * bits
    words = (codes.view(-1, GROUP) << shifts).sum(dim=1, keepdim=True)  # disjoint bit fields: the sum is their OR
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    return ((words >> byte_shifts) & 0xFF).to(torch.uint8).view(-1)


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Container -> int32 codes ``(numel,)``, the inverse of :func:`pack`."""
    if bits > 8:
        return packed.to(torch.int32) & 0xFFFF
    if bits == 8:
        return packed.to(torch.int32)
    if bits <= 4:
        nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(-1)
        return nibbles[:numel].to(torch.int32)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    words = (packed.view(-1, bits).to(torch.int64) << byte_shifts).sum(dim=1, keepdim=True)
    shifts = torch.arange(GROUP, device=packed.device, dtype=torch.int64) * bits
    return ((words >> shifts) & ((1 << bits) - 1)).view(-1)[:numel].to(torch.int32)


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def as_blocks(flat: torch.Tensor, block_size: int) -> torch.Tensor:
    """``(n,)`` -> ``(num_blocks, block_size)``, zero-padding the last block (zeros never change an absmax)."""
    padding = num_blocks(flat.numel(), block_size) * block_size - flat.numel()
    if padding:
        flat = F.pad(flat, (0, padding))
    return flat.view(-1, block_size)
