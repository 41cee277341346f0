"""Training without fp32 master weights (ECO, arXiv 2601.22101): the weight update and its error feedback.

With ``weights=`` set (or ``error_feedback=`` on low-precision parameters), each step computes the new parameter
values ``θ̃`` in fp32 from the stored ones, writes ``θ̂ = q(θ̃)`` (the weight grid, ``formats.weights``, with
``weight_rounding``) and handles the rounding error ``e = θ̃ − θ̂`` as ``error_feedback`` says:

- ``None``: dropped (naive master-weight removal; its error floor grows like ``1/η`` as the LR decays).
- ``"eco"``: fed into the momentum at once, and forgotten. SGD with momentum (torch's ``buf = μ·buf + (1−τ)·g``,
  ``θ −= η·buf``): ``buf += (1/η)(1 − 1/μ)·e``; with Nesterov ``θ −= η(g + μ·buf)``, ``buf += (1/(ημ))(1 − 1/μ)·e``
  (the same derivation: the injected term, decaying by ``μ`` a step, moves ``θ`` by ``+e`` in all). Adam(W):
  ``m += ((1−β1^t)/η)(1 − 1/β1)·(sqrt(v/(1−β2^t)) + eps)·e``, the SGD rule with Adam's element-wise step size
  (``v``: ``max_exp_avg_sq`` with amsgrad; ``kernels.adam_reference.eco_coefficient``); ``v`` untouched; ``η`` and
  ``t`` the current step's. Decoupled weight
  decay multiplies the coefficient by ``(1 − ηλ)``: the published extension (the paper has no weight decay),
  since the master weight would have decayed the lost error too.
- ``"eco_exact"``: kept in one fp32 buffer (state ``"weight_error"``) and added back to the stored weights before
  the next update, so the update runs on the master weight ``θ̂ + e`` itself: the iterates of master-weight
  training, exactly but for float rounding, for any optimizer and LR schedule. For SGD-momentum at a fixed LR this
  is the paper's exact variant (inject ``(1/η)·e_t − (1/(ημ))·e_{t+1}`` into the momentum): both keep
  ``θ̃_t = x_t``, the master iterate (``docs/algorithms.md``).

Nothing of fp32 size is kept between steps except ``eco_exact``'s buffer; the fp32 copy of one parameter lives
for its update. ``"eco"`` needs an update linear in a momentum state: QMuon (orthogonalized momentum) and the
generic wrapper refuse it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..formats.packing import as_blocks
from ..formats.rounding import lookup
from ..formats.weights import WeightGrid, get_weight_grid, group_scales

# The optimizer state that ``eco_exact`` keeps the rounding error in (fp32, the parameter's shape).
ERROR_STATE = "weight_error"


def weight_grid(weights: str | None, group: dict, param: torch.Tensor) -> WeightGrid | None:
    """The grid ``param`` is kept on after a step (format ``weights``: its group's, or its ``weight_overrides`` entry),
    or ``None`` for torch's behaviour (no ``weights`` and no ``error_feedback``). A parameter with ``error_feedback``
    and no ``weights`` uses its own dtype as the grid.

    Raises:
        ValueError: a cast grid (``"fp32"``, ``"bf16"``, ``"fp16"``) that ``param``'s dtype cannot hold.
        TypeError: ``error_feedback`` without ``weights`` for a parameter whose dtype is not a grid (float64).
    """
    if weights is None and group["error_feedback"] is None:
        return None
    grid = get_weight_grid(weights or _dtype_format(param.dtype), group["weight_block"])
    if grid.cast_dtype is not None and torch.promote_types(grid.cast_dtype, param.dtype) != param.dtype:
        raise ValueError(
            f"weights={weights!r} needs parameters that can hold its values, and a {param.dtype} parameter cannot (writing them "
            f"back would round every update to nearest, stochastic rounding or not); use weights={_dtype_format(param.dtype)!r} "
            "(its own dtype), a block-scaled format, or wider parameters"
        )
    return grid


def grid_units(grid: WeightGrid, values: torch.Tensor) -> torch.Tensor:
    """Flat fp32 ``(numel,)``: ``values`` (a parameter's, on ``grid``) in units of their scale group's scale, i.e. the
    value of each one's code, as ``QuantizedTensor.unit_values`` gives a state's. Two writes of a parameter kept an
    entry's code exactly where these agree (``formats.count_stalls``); a block-scaled grid's values also move with their
    group's scale while their codes stay. A cast grid's values are their own units.

    The scale is recomputed from the stored values as ``WeightGrid.round`` sets it (the group's extremes sit on the code
    table's ends, stored exactly) and the codes are recovered by rounding to nearest, which also absorbs the second
    rounding of grid values kept in a narrower dtype (a bf16 parameter).
    """
    flat = values.detach().reshape(-1).float()
    if grid.cast_dtype is not None or flat.numel() == 0:
        return flat
    if grid.block == "tensor":
        groups = flat.view(1, -1)
    elif grid.block == "row":
        groups = flat.view(-1, values.shape[-1] if values.ndim else 1)
    else:
        groups = as_blocks(flat, grid.block)
    decode = grid.format.tables(flat.device)["decode"]
    scale = group_scales(groups, decode)
    codes = grid.format.encode(groups / torch.where(scale > 0, scale, 1.0), "nearest", None)
    return lookup(decode, codes).reshape(-1)[: flat.numel()]


def overridden_grid(
    group: dict, key: torch.Tensor, param: torch.Tensor, overrides: Mapping[torch.Tensor, str | None] | None
) -> WeightGrid | None:
    """The grid of parameter ``key`` (``param``: the tensor it updates, its local shard) under ``weight_overrides``
    ``overrides``: its entry (``None``: its own dtype, :func:`own_dtype_grid`), else its group's ``weights``."""
    if overrides:  # looked up only where there are some: a tensor key hashes in Python, and each step asks for every parameter
        if key in overrides and overrides[key] is None:
            return own_dtype_grid(group, param)
        return weight_grid(overrides.get(key, group["weights"]), group, param)
    return weight_grid(group["weights"], group, param)


def own_dtype_grid(group: dict, param: torch.Tensor) -> WeightGrid | None:
    """The grid of a parameter that a weight selection keeps in its dtype (``weight_overrides`` ``None``): none for a
    wide one (fp32, float64: torch's update, its own master weight); for a half-precision one (bf16, fp16), where a
    plain update rounds small steps away, its dtype as the grid, written with the group's ``weight_rounding`` and
    ``error_feedback`` (none where the group has neither ``weights`` nor ``error_feedback``)."""
    if param.dtype not in (torch.bfloat16, torch.float16) or (group["weights"] is None and group["error_feedback"] is None):
        return None
    return get_weight_grid(_dtype_format(param.dtype), group["weight_block"])


PLAIN_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}  # the dtypes' names beside the formats


def _dtype_format(dtype: torch.dtype) -> str:
    if dtype not in PLAIN_NAMES:
        raise TypeError(f"error_feedback needs parameters of dtype {list(PLAIN_NAMES)} (or weights=), got {dtype}")
    return PLAIN_NAMES[dtype]


def sgd_feedback_coefficient(group: dict) -> float:
    """ECO's coefficient of ``e`` in SGD's momentum buffer (module docstring): ``(1/η)(1 − 1/μ)``, ``/μ`` with Nesterov;
    0 at ``η = 0``."""
    lr, momentum = float(group["lr"]), group["momentum"]
    if lr == 0:  # no step to correct (FSDP2's resume takes such a step before loading)
        return 0.0
    coefficient = (1 - 1 / momentum) / lr
    return coefficient / momentum if group["nesterov"] else coefficient


def block_linear_weight_names(module: torch.nn.Module) -> list[str]:
    """Names (as ``module.named_parameters()``) of the weights that ECO's paper keeps in low precision: the 2-D weight of
    every linear layer (``nn.Linear``, or transformers' ``Conv1D``) inside a repeated block, i.e. under a numbered
    child (``transformer.h.3.attn.c_attn.weight``, not ``lm_head.weight``, nor ``0.weight`` of a bare
    ``nn.Sequential``). Embeddings, norms, biases and the head keep their dtype."""
    names = []
    for name, child in module.named_modules():
        parts = name.split(".")
        inside_block = any(part.isdigit() for part in parts[:-1])
        linear = isinstance(child, torch.nn.Linear) or type(child).__name__ == "Conv1D"
        weight = getattr(child, "weight", None)
        if inside_block and linear and isinstance(weight, torch.Tensor) and weight.ndim == 2:
            names.append(f"{name}.weight")
    return names
