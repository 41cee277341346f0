"""Fake quantization for post-training-quantization (PTQ) probes: round a tensor to a format's grid, keep its dtype.

Scales are symmetric absmax, one per group of values along one dimension: ``block="row"`` (default) makes a group of
each row, i.e. one scale per output channel of a weight and per token of an activation (as arXiv 2509.23500); a power
of two makes groups of that many values along the row; ``"tensor"`` one scale. Any storage format of
:func:`lightning_qstate.formats.get_format` may be used, with two aliases that follow PTQ practice rather than the
optimizer-state names: ``"int4"`` and ``"int8"`` are the uniform symmetric integer grids (``k / L`` for
``k = -L..L``, ``L = 7`` or ``127``; the formats ``int4_linear`` / ``int8_linear``); the project's dynamic-tree maps are
``"int4_dynamic"`` / ``"int8_dynamic"``. Casts (``bf16``, ``fp16``) round elementwise without a scale.

Example::

    >>> import torch
    >>> from lightning_qstate.probes import fake_quantize
    >>> w = torch.tensor([[0.7, -0.1, 0.35], [2.0, 1.0, -0.3]])
    >>> fake_quantize(w, "int4")  # rows scaled by max|row| / 7
    tensor([[ 0.7000, -0.1000,  0.3000],
            [ 2.0000,  0.8571, -0.2857]])
"""

from __future__ import annotations

from functools import cache

import torch

from ..formats import FORMAT_NAMES
from ..formats.rounding import Rounding, check_rounding
from ..formats.weights import WeightBlock, WeightGrid, check_weight_block, get_weight_grid

# PTQ names that differ from the optimizer-state formats of the same name (module docstring)
FORMAT_ALIASES: dict[str, str] = {"int4": "int4_linear", "int8": "int8_linear", "int4_dynamic": "int4", "int8_dynamic": "int8"}
# weights and activations of the usual PTQ recipes; ``None`` keeps that side in the model's precision
RECIPES: dict[str, dict[str, str | None]] = {
    "W4A4": {"weights": "int4", "activations": "int4"},
    "W8A8": {"weights": "int8", "activations": "int8"},
    "W4A16": {"weights": "int4", "activations": None},
    "W8A16": {"weights": "int8", "activations": None},
    "FP8": {"weights": "fp8_e4m3", "activations": "fp8_e4m3"},
}


@cache
def probe_grid(fmt: str, block: WeightBlock = "row") -> WeightGrid:
    """The grid of PTQ format ``fmt`` (aliases resolved) with scale groups ``block``.

    Raises:
        ValueError: an unknown format, or a block that is neither ``"row"``, ``"tensor"`` nor a power of two.
    """
    if not isinstance(fmt, str):
        raise ValueError(
            f"format {fmt!r} must be a format name such as 'int4', 'int8', 'fp8_e4m3', 'e2m1' or 'bf16' (None: no quantization)"
        )
    check_weight_block(block, "block")  # before the format: its error is not about the format's name
    try:
        return get_weight_grid(FORMAT_ALIASES.get(fmt, fmt), block)
    except ValueError as error:
        names = ", ".join([*FORMAT_ALIASES, *(name for name in FORMAT_NAMES if name not in FORMAT_ALIASES)])
        raise ValueError(f"PTQ format {fmt!r}: {error} (PTQ names: {names})") from None


def fake_quantize(
    x: torch.Tensor,
    fmt: str | None,
    *,
    block: WeightBlock = "row",
    dim: int = -1,
    rounding: Rounding = "nearest",
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``x`` rounded to the grid of ``fmt``, scale groups running along ``dim``; same shape and dtype (``None``: ``x``).

    Args:
        x: any shape; a weight ``(out, in)`` takes ``dim=-1`` for one scale per output channel, an activation
            ``(..., features)`` ``dim=-1`` for one per token.
        fmt: a PTQ format name (module docstring) or ``None``.
        block: ``"row"`` (the whole of ``dim``), ``"tensor"``, or a power of two dividing ``x.shape[dim]``.
        rounding: ``"nearest"`` (default) or ``"stochastic"`` (drawing from ``generator``).

    Raises:
        ValueError: an unknown format, rounding or block, or a block that does not divide the rows.
        TypeError: ``x`` not floating-point (integers, bools, complex).
    """
    if fmt is None:
        return x
    if not x.is_floating_point():
        raise TypeError(f"fake_quantize rounds floating-point tensors, got one of dtype {x.dtype}")
    check_rounding(rounding)
    grid = probe_grid(fmt, block)
    if not x.numel():
        return x.clone()
    rows = x.movedim(dim, -1) if x.ndim else x.reshape(1)
    if isinstance(block, int) and rows.shape[-1] % block:
        raise ValueError(f"block={block} does not divide the {rows.shape[-1]} values of each row; use a divisor or 'row'")
    rounded = grid.round(rows, rounding, generator).to(x.dtype)  # fp32, or float64 for float64 rows (WeightGrid.round)
    return rounded.movedim(-1, dim) if x.ndim else rounded.reshape(())
