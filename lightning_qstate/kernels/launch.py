"""Host-side launchers of the Triton kernels: tensors in, tensors out.

They take any device Triton can run on: CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1`` (how the tests check them against the torch reference).
SR takes ``seed``: an int, or a one-element integer tensor on the input's device
(what :func:`draw_seed` returns; it is read by the kernel, so drawing it needs no
host synchronization). :func:`triton_adam_step` runs the fused Adam(W) step of
:mod:`.triton_adam` on a parameter and its two quantized moments, in place, with
the parameter kept on a weight grid and ECO's error feedback when asked to
(training without master weights, ``optim/weights.py``).
"""

from __future__ import annotations

import contextlib

import torch

from ..formats import FLOAT_INPUT_DTYPES, BlockFormat, CastFormat, CodebookFormat, QuantizedTensor, Rounding
from ..formats.packing import container_dtype, num_blocks, packed_numel
from .triton_adam import COEFFICIENTS, STALL_SLOTS, adam_step_kernel
from .triton_kernels import (
    adam_step_variant,
    dequantize_blocks_kernel,
    dequantize_blocks_variant,
    quantize_blocks_kernel,
    quantize_blocks_variant,
    stochastic_cast_kernel,
    stochastic_cast_variant,
)

SEED_HIGH = 2**31 - 1

_PLACEHOLDERS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def draw_seed(generator: torch.Generator | None, device: torch.device, count: int = 1) -> torch.Tensor:
    """A ``(count,)`` int64 tensor of seeds in ``[0, 2**31 - 1)`` on ``device`` from ``generator`` (default: the device's)."""
    return torch.randint(0, SEED_HIGH, (count,), generator=generator, device=device)


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


def _encoder_args(fmt: BlockFormat, device: torch.device) -> tuple:
    """``bucket_floor, values, key_shift, half, last, max_value`` of :func:`~.triton_formats.encode_block` for ``fmt``."""
    tables = fmt.tables(device)
    if isinstance(fmt, CodebookFormat):
        index = tables["index"]
        return (index.bucket_floor, index.values, index.key_shift, index.half, index.values.numel() - 1, 1.0)
    int_placeholder, _ = _placeholders(device)
    return (int_placeholder, tables["decode"], 0, 0, 0, float(fmt.max_value))


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
    """``flat`` ``(n,)`` -> (packed codes, ``(num_blocks,)`` scales in ``fmt.scale_dtype``, NaN for non-finite blocks).

    Same codes and scales as ``fmt.quantize_reference`` for RN; for SR the same
    distribution, drawn from ``seed`` (a fresh one from the default generator if ``None``).
    """
    flat = _check_float_input(flat)
    device, numel = flat.device, flat.numel()
    variant = quantize_blocks_variant(fmt, rounding, flat.dtype)
    codes = torch.empty(packed_numel(numel, fmt.bits), dtype=container_dtype(fmt.bits), device=device)
    blocks = num_blocks(numel, fmt.block_size)
    scales = torch.empty(blocks, dtype=fmt.scale_dtype, device=device)
    if numel == 0:
        return codes, scales
    _, seed_placeholder = _placeholders(device)
    seed_tensor = _seed_tensor(seed, device) if rounding == "stochastic" else seed_placeholder
    with _on_device(device):
        quantize_blocks_kernel[(blocks,)](flat, codes, scales, seed_tensor, numel, *_encoder_args(fmt, device), **variant.launch_options)
    return codes, scales


def triton_dequantize_blocks(
    fmt: BlockFormat, codes: torch.Tensor, scales: torch.Tensor, numel: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Packed codes + scales -> ``(numel,)`` values in ``dtype``: ``fmt.dequantize_reference(...).to(dtype)``. The kernel
    writes fp32, bf16 or fp16; another dtype (a float64 parameter's states) is the fp32 values cast (exact)."""
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return triton_dequantize_blocks(fmt, codes, scales, numel).to(dtype)
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
            codes.contiguous(), scales.to(fmt.scale_dtype).contiguous(), decode, out, numel, **variant.launch_options
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
        stochastic_cast_kernel[grid](flat, out, seed_tensor, flat.numel(), **variant.launch_options)
    return out


def adam_coefficients(hyper: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    """The fp32 coefficient vector of :func:`~.triton_adam.adam_step_kernel` on ``device`` (layout ``COEFFICIENTS``).

    ``hyper``: 0-d fp32 tensors by the names of ``COEFFICIENTS``, as ``kernels.adam_reference.adam_hyper`` makes them (the values
    ``kernels.adam_reference.adam_math`` uses; numbers are rounded to fp32). No host synchronization.
    """
    tensors = [torch.as_tensor(hyper[name], dtype=torch.float32).reshape(()) for name in COEFFICIENTS]
    if all(tensor.device == device for tensor in tensors):
        return torch.stack(tensors)
    if all(tensor.device.type == "cpu" for tensor in tensors):
        return torch.stack(tensors).to(device, non_blocking=True)
    return torch.stack([tensor.to(device, non_blocking=True) for tensor in tensors])


ADAM_SEEDS = 3  # exp_avg, exp_avg_sq, weights


def _adam_seeds(seed: int | torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """``(3,)`` int64 seeds (``exp_avg``, ``exp_avg_sq``, weights): drawn, the first three of a tensor, or those a
    tensor has and the rest derived from its first (seed ``k`` is ``first + k * (2**31 - 1)``: streams that never
    share a seed drawn in ``[0, 2**31 - 1)``)."""
    if seed is None:
        return draw_seed(None, device, ADAM_SEEDS)
    if isinstance(seed, torch.Tensor):
        given = seed.reshape(-1)[:ADAM_SEEDS].to(device=device, dtype=torch.int64)
    else:
        given = _seed_tensor(seed, device)
    if given.numel() == 0:
        raise ValueError("triton_adam_step: an empty seed tensor")
    derived = [given[:1] + k * SEED_HIGH for k in range(given.numel(), ADAM_SEEDS)]
    return torch.cat([given, *derived])


def _weight_grid_dtype(weight_format: CastFormat | None) -> torch.dtype | None:
    if weight_format is None:
        return None
    if not isinstance(weight_format, CastFormat) or weight_format.zero_free or weight_format.dtype not in FLOAT_INPUT_DTYPES:
        raise TypeError(f"triton_adam_step rounds parameters to a fp32, bf16 or fp16 cast format (not zero-free), got {weight_format!r}")
    return weight_format.dtype


def _check_moment(name: str, q: QuantizedTensor, numel: int, device: torch.device) -> None:
    fmt = q.format
    if not isinstance(fmt, BlockFormat) or q.scales is None:
        raise TypeError(f"triton_adam_step: {name} must be stored in a block format, got {fmt!r}")
    if q.numel != numel:
        raise ValueError(f"triton_adam_step: {name} holds {q.numel} values, the parameter {numel}")
    expected = packed_numel(numel, fmt.bits)
    if q.codes.numel() != expected or q.codes.dtype != container_dtype(fmt.bits) or not q.codes.is_contiguous():
        raise ValueError(f"triton_adam_step: {name} ({fmt.name!r}) needs {expected} contiguous {container_dtype(fmt.bits)} codes")
    blocks = num_blocks(numel, fmt.block_size)
    if q.scales.numel() != blocks or q.scales.dtype != fmt.scale_dtype or not q.scales.is_contiguous():
        raise ValueError(f"triton_adam_step: {name} ({fmt.name!r}) needs {blocks} contiguous {fmt.scale_dtype} scales")
    if q.codes.device != device or q.scales.device != device:
        raise ValueError(f"triton_adam_step: {name} is on {q.codes.device}, the parameter on {device}")


def triton_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    m: QuantizedTensor,
    v: QuantizedTensor,
    hyper: dict[str, torch.Tensor],
    rounding: Rounding = "nearest",
    decoupled_weight_decay: bool = False,
    maximize: bool = False,
    track_stalls: bool = False,
    seed: int | torch.Tensor | None = None,
    weight_format: CastFormat | None = None,
    weight_rounding: Rounding = "nearest",
    eco: bool = False,
) -> torch.Tensor:
    """One Adam(W) step of ``param`` (contiguous) with moments ``m`` (``exp_avg``) and ``v`` (``exp_avg_sq``).

    Updates ``param`` and the codes and scales of ``m`` and ``v`` in place, in one kernel pass: the step of
    ``kernels.adam_reference.adam_step_quantized`` (``hyper``, ``weight_format``, ``weight_rounding`` and ``eco`` as
    there). ``param``: fp32, or bf16/fp16 too (the update runs in fp32 and its result is stored rounded to nearest;
    exactly with a weight grid of ``param``'s dtype). ``weight_format``: the cast format (fp32, bf16 or fp16) of the
    weight grid, or ``None``; ``eco`` needs one.

    SR (of the moments, ``rounding``, or of the weights, ``weight_rounding``) draws from ``seed``: up to three seeds
    (``m``, ``v``, weights) as a tensor, the missing ones derived from the first, or one (an int); ``None`` draws
    them from the device's default generator. Returns int64 ``[stalled_m, moved_m, stalled_v, moved_v]`` on
    ``param``'s device (zeros unless ``track_stalls``).
    """
    device, numel = param.device, param.numel()
    if param.dtype not in FLOAT_INPUT_DTYPES or not param.is_contiguous():
        contiguous = param.is_contiguous()
        raise TypeError(f"triton_adam_step updates contiguous float32, bfloat16 or float16 parameters, got {param.dtype} ({contiguous=})")
    if grad.numel() != numel or grad.dtype not in FLOAT_INPUT_DTYPES or grad.device != device:
        raise ValueError(f"triton_adam_step: the gradient ({grad.numel()} {grad.dtype} on {grad.device}) does not match the parameter")
    _check_moment("exp_avg", m, numel, device)
    _check_moment("exp_avg_sq", v, numel, device)
    if track_stalls and numel >= 2**32:
        raise ValueError("triton_adam_step counts stalls of parameters with fewer than 2**32 elements")
    weight_dtype = _weight_grid_dtype(weight_format)
    flags = (decoupled_weight_decay, maximize, track_stalls)
    variant = adam_step_variant(m.format, v.format, rounding, grad.dtype, *flags, param.dtype, weight_dtype, weight_rounding, eco)
    if numel == 0:
        return torch.zeros(4, dtype=torch.int64, device=device)
    _, int64_placeholder = _placeholders(device)
    counts = torch.zeros(int(STALL_SLOTS), 2, dtype=torch.int64, device=device) if track_stalls else int64_placeholder
    stochastic = variant.constexprs["STOCHASTIC"] or variant.constexprs["WEIGHT_STOCHASTIC"]
    seeds = _adam_seeds(seed, device) if stochastic else int64_placeholder
    coefficients = adam_coefficients(hyper, device)
    m_format, v_format = m.format, v.format
    blocks = -(-numel // variant.constexprs["BLOCK_SIZE"])
    with _on_device(device):
        adam_step_kernel[(blocks,)](
            param, grad.reshape(-1).contiguous(),
            m.codes, m.scales, m_format.tables(device)["decode"], *_encoder_args(m_format, device),
            v.codes, v.scales, v_format.tables(device)["decode"], *_encoder_args(v_format, device),
            coefficients, seeds, counts, numel,
            **variant.launch_options,
        )  # fmt: skip
    if not track_stalls:
        return torch.zeros(4, dtype=torch.int64, device=device)
    # each slot holds stalled + (moved << 32) per moment, exact (< 2**32 values); unpacked before the slots are added: the
    # packed sum of a parameter with >= 2**31 moved entries overflows int64
    return torch.stack([(counts & 0xFFFFFFFF).sum(dim=0), (counts >> 32).sum(dim=0)], dim=1).view(4)
