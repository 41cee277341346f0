"""Host-side launchers of the Triton kernels: tensors in, tensors out.

They take any device Triton can run on: CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1`` (how the tests check them against the torch reference).
SR takes ``seed``: an int, or a one-element integer tensor on the input's device
(what :func:`draw_seed` returns; it is read by the kernel, so drawing it needs no
host synchronization).
"""

from __future__ import annotations

import contextlib

import torch

from ..formats import FLOAT_INPUT_DTYPES, BlockFormat, CastFormat, CodebookFormat, Rounding
from ..formats.packing import container_dtype, num_blocks, packed_numel
from .triton_kernels import (
    dequantize_blocks_kernel,
    dequantize_blocks_variant,
    quantize_blocks_kernel,
    quantize_blocks_variant,
    stochastic_cast_kernel,
    stochastic_cast_variant,
)

SEED_HIGH = 2**31 - 1

_PLACEHOLDERS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def draw_seed(generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """A ``(1,)`` int64 seed in ``[0, 2**31 - 1)`` on ``device`` from ``generator`` (default: the device's)."""
    return torch.randint(0, SEED_HIGH, (1,), generator=generator, device=device)


def _seed_tensor(seed: int | torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if seed is None:
        return draw_seed(None, device)
    if isinstance(seed, torch.Tensor):
        return seed.reshape(-1)[:1].to(device=device, dtype=torch.int64)
    return torch.tensor([int(seed)], dtype=torch.int64, device=device)


def _placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Unread int32/fp32 table arguments for the encoder a format does not use, and the unread RN seed."""
    if device not in _PLACEHOLDERS:
        _PLACEHOLDERS[device] = (torch.zeros(1, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int64, device=device))
    return _PLACEHOLDERS[device]


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` current for the launch (Triton launches on the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _check_float_input(flat: torch.Tensor) -> torch.Tensor:
    if flat.dtype not in FLOAT_INPUT_DTYPES:
        raise TypeError(f"Triton kernels take float32, bfloat16 or float16 input, got {flat.dtype}")
    return flat.reshape(-1).contiguous()


def triton_quantize_blocks(
    fmt: BlockFormat, flat: torch.Tensor, rounding: Rounding = "nearest", seed: int | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat`` ``(n,)`` -> (packed codes, ``(num_blocks,)`` fp32 scales, NaN for non-finite blocks).

    Same codes and scales as ``fmt.quantize_reference`` for RN; for SR the same
    distribution, drawn from ``seed`` (a fresh one from the default generator if ``None``).
    """
    flat = _check_float_input(flat)
    device, numel = flat.device, flat.numel()
    variant = quantize_blocks_variant(fmt, rounding, flat.dtype)
    codes = torch.empty(packed_numel(numel, fmt.bits), dtype=container_dtype(fmt.bits), device=device)
    blocks = num_blocks(numel, fmt.block_size)
    scales = torch.empty(blocks, dtype=torch.float32, device=device)
    if numel == 0:
        return codes, scales
    int_placeholder, seed_placeholder = _placeholders(device)
    seed_tensor = _seed_tensor(seed, device) if rounding == "stochastic" else seed_placeholder
    tables = fmt.tables(device)
    if isinstance(fmt, CodebookFormat):
        index = tables["index"]
        encoder_args = (index.bucket_floor, index.values, index.key_shift, index.half, index.values.numel() - 1, 1.0)
    else:
        encoder_args = (int_placeholder, tables["decode"], 0, 0, 0, float(fmt.max_value))
    with _on_device(device):
        quantize_blocks_kernel[(blocks,)](
            flat, codes, scales, seed_tensor, numel, *encoder_args, num_warps=variant.num_warps, **variant.constexprs
        )
    return codes, scales


def triton_dequantize_blocks(
    fmt: BlockFormat, codes: torch.Tensor, scales: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed codes + scales -> ``(numel,)`` values in ``dtype``: ``fmt.dequantize_reference(...).to(dtype)``."""
    variant = dequantize_blocks_variant(fmt, dtype)
    out = torch.empty(numel, dtype=dtype, device=codes.device)
    if numel == 0:
        return out
    expected = packed_numel(numel, fmt.bits)
    if codes.numel() != expected or codes.dtype != container_dtype(fmt.bits):
        raise ValueError(
            f"format {fmt.name!r}: {numel} values need {expected} {container_dtype(fmt.bits)} codes, got {codes.numel()} {codes.dtype}"
        )
    blocks = num_blocks(numel, fmt.block_size)
    if scales.numel() != blocks:
        raise ValueError(f"format {fmt.name!r}: {numel} values need {blocks} scales, got {scales.numel()}")
    decode = fmt.tables(codes.device)["decode"]
    with _on_device(codes.device):
        dequantize_blocks_kernel[(blocks,)](
            codes.contiguous(), scales.float().contiguous(), decode, out, numel, num_warps=variant.num_warps, **variant.constexprs
        )
    return out


def triton_stochastic_cast(fmt: CastFormat, flat: torch.Tensor, seed: int | torch.Tensor | None = None) -> torch.Tensor:
    """SR cast of ``flat`` to ``fmt.dtype`` (bf16 or fp16): the distribution of ``fmt.stochastic_reference``."""
    flat = _check_float_input(flat)
    variant = stochastic_cast_variant(fmt, flat.dtype)
    out = torch.empty(flat.numel(), dtype=fmt.dtype, device=flat.device)
    if flat.numel() == 0:
        return out
    grid = (-(-flat.numel() // variant.constexprs["BLOCK_SIZE"]),)
    seed_tensor = _seed_tensor(seed, flat.device)
    with _on_device(flat.device):
        stochastic_cast_kernel[grid](flat, out, seed_tensor, flat.numel(), num_warps=variant.num_warps, **variant.constexprs)
    return out
