"""The values a parameter may hold when it has no fp32 master copy (``weights=``, ECO): a weight grid.

A :class:`WeightGrid` rounds fp32 values (a parameter's shape) to the grid of a storage format and returns them as
fp32 values on that grid; the optimizer writes them into the parameter in its own dtype.

- Cast formats (``bf16``, ``fp16``, ``fp32``): every value of the dtype; a parameter of that dtype stores the grid
  exactly, one of a wider dtype (``weights="bf16"`` on fp32 parameters) holds bf16 values in fp32.
- Block-scaled formats (``fp8_e4m3``, ``fp8_e5m2``, ``int8``, ``int4``, ``int8_linear``, ``int4_linear``, any
  ``eXmY``): a group of values shares one fp32 absmax scale, as ECO's quantizer (``max|row| / 448`` for FP8 E4M3):
  ``block="row"`` (default: one scale per row, the last dimension; a 1-D parameter is one row), ``"tensor"``
  (one scale) or a power of two (flat blocks, as the optimizer states). Their codes are not a torch dtype, so the
  parameter keeps grid values in its own dtype (a bf16 parameter rounds them to bf16 once more):
  :meth:`WeightGrid.packed_nbytes` is what the packed codes and scales would take, the parameter's ``nbytes`` what
  it takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import uniform_like
from .block import BlockFormat, is_block_size
from .cast import CastFormat
from .packing import as_blocks, packed_numel
from .rounding import Rounding, lookup

# Scale groups of a block-scaled weight grid, besides a power-of-two block size.
WEIGHT_BLOCKS: tuple[str, ...] = ("row", "tensor")
WeightBlock = str | int


@dataclass(frozen=True)
class WeightGrid:
    """The grid of format ``name`` (``formats.get_format``), with scale groups ``block`` for block-scaled formats.

    Attributes:
        format: the storage format whose codes the grid is made of (block formats: fp32 scales, signed).
        block: ``"row"``, ``"tensor"`` or a power of two; unused by cast formats.
    """

    format: CastFormat | BlockFormat
    block: WeightBlock = "row"

    @property
    def name(self) -> str:
        return self.format.name

    @property
    def cast_dtype(self) -> torch.dtype | None:
        """The dtype whose values the grid is, for cast formats (elementwise: no scale); ``None`` for block formats."""
        return self.format.dtype if isinstance(self.format, CastFormat) else None

    def round(self, values: torch.Tensor, rounding: Rounding, generator: torch.Generator | None = None) -> torch.Tensor:
        """fp32 ``values`` (a parameter's shape) rounded to the grid (RN, or SR drawing from ``generator``): fp32, same shape.
        float64 values stay float64 on a block-scaled grid (scales and products in float64: no group is lost to fp32's
        range; the probes' float64 models), other dtypes are taken as fp32.

        Zero-mean under SR except where a block-scaled value reaches its group's absmax (stored exactly). A cast grid
        saturates: a value past the dtype's range (``fp16``: 65504) becomes its largest value (``CastFormat.round_saturated``).
        A block-scaled group holding inf or NaN comes out non-finite as a whole (its scale is); NaN stays NaN.
        """
        flat = values.detach().reshape(-1)
        if isinstance(self.format, CastFormat) or flat.dtype != torch.float64:
            flat = flat.float()
        if isinstance(self.format, CastFormat):
            return self.format.round_saturated(flat, rounding, generator).float().view(values.shape)
        if not flat.numel():
            return flat.view(values.shape)
        groups = self._groups(flat, values)
        decode = self.format.tables(flat.device)["decode"]
        scale = group_scales(groups, decode)
        normalized = torch.where(scale.isfinite(), groups / torch.where(scale > 0, scale, 1.0), 0.0).float()  # finite codes
        uniform = uniform_like(normalized, generator) if rounding == "stochastic" else None
        codes = self.format.encode(normalized, rounding, uniform)
        grid = lookup(decode, codes).to(scale.dtype) * scale
        return grid.reshape(-1)[: flat.numel()].view(values.shape)

    def packed_nbytes(self, shape: torch.Size) -> int:
        """Bytes the packed codes and fp32 scales of a parameter of ``shape`` would take (a cast format: its dtype's size)."""
        numel = shape.numel()
        if isinstance(self.format, CastFormat):
            return self.format.nbytes(numel)
        code_bytes = packed_numel(numel, self.format.bits) * (1 if self.format.bits <= 8 else 2)
        return code_bytes + 4 * self._group_count(shape)

    def _groups(self, flat: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if self.block == "tensor":
            return flat.view(1, -1)
        if self.block == "row":
            return flat.view(-1, values.shape[-1] if values.ndim else 1)
        return as_blocks(flat, self.block)

    def _group_count(self, shape: torch.Size) -> int:
        if self.block == "tensor":
            return 1
        if self.block == "row":
            return shape.numel() // shape[-1] if len(shape) and shape[-1] else 1
        return -(-shape.numel() // self.block)


def group_scales(groups: torch.Tensor, decode: torch.Tensor) -> torch.Tensor:
    """``(n_groups, 1)`` scales of ``groups`` ``(n_groups, size)`` on a code table ``decode``: each side's extreme onto the
    table's end of that side (signed dynamic maps stop at -0.993 or -0.8875), so that a group's largest magnitude stays
    on the grid and grid values round to themselves (but for a rare last ulp). A finite group whose scale would pass
    the dtype's range (-3.4e38 / 0.993) takes the largest finite scale (its extreme then rounds inwards); a group holding
    inf or NaN keeps a non-finite one."""
    high, low = groups.amax(dim=1, keepdim=True), groups.amin(dim=1, keepdim=True)
    scale = torch.maximum(high.clamp(min=0) / decode.max(), low.clamp(max=0) / decode.min())
    finite = high.isfinite() & low.isfinite()
    return torch.where(finite, scale.clamp(max=torch.finfo(scale.dtype).max), scale)


def check_weight_block(block: object, option: str = "weight_block") -> None:
    """Raise ``ValueError`` naming ``option`` where ``block`` is neither ``"row"``, ``"tensor"`` nor a power of two >= 2."""
    if not (block in WEIGHT_BLOCKS if isinstance(block, str) else is_block_size(block)):
        raise ValueError(f"{option}={block!r} is not valid; use one of {WEIGHT_BLOCKS} or a power of two >= 2 (e.g. 128)")


def get_weight_grid(name: str, block: WeightBlock = "row") -> WeightGrid:
    """The weight grid of format ``name`` (``formats.get_format``) with scale groups ``block``.

    Raises:
        ValueError: an unknown format name, or ``block`` neither ``"row"``, ``"tensor"`` nor a power of two.
    """
    from . import get_format

    check_weight_block(block)
    # casts ignore both options; block formats get fp32 scales (their own block size is unused by "row" and "tensor")
    fmt = get_format(name, block_size=block if isinstance(block, int) else None, scale_dtype="fp32")
    return WeightGrid(fmt, block)
