"""Example LightningModules and DataModules for ``lightning_qstate`` (not part of the installed package).

``examples`` is a regular package so that configs can name ``examples.gpt.GPTModule``,
``examples.vit.ViTModule``, ``examples.data.ByteTextDataModule`` and ``examples.data.DigitsDataModule``
as class paths. It is importable when the repository root is on ``sys.path``: ``python -m ...`` from
the root, pytest from the root, and ``lightning-qstate`` / ``python -m lightning_qstate.cli`` from an
editable install (the CLI adds the checkout root). ``lightning_qstate`` itself never imports it.

The helper below builds the plain ``torch.optim.AdamW`` + warmup schedule both examples use; the
``QStatePrecision`` plugin or the ``QuantizedOptimizerStates`` callback then quantizes its states.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

Schedule = Literal["cosine", "linear", "constant"]


def adamw_with_schedule(
    named_parameters,
    *,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    warmup_steps: int,
    schedule: Schedule,
    total_steps: int,
    min_lr_ratio: float = 0.1,
    no_decay: set[str] | frozenset[str] = frozenset(),
):
    """``torch.optim.AdamW`` (weight decay on matrices only: no decay for biases, norms and 1-d gains) and,
    unless ``schedule == "constant"`` with no warmup, a per-step ``LambdaLR``: linear warmup over
    ``warmup_steps``, then cosine or linear decay to ``min_lr_ratio * lr`` at ``total_steps``.
    Parameters named in ``no_decay`` (e.g. position embeddings) get no weight decay either.

    Returns what ``configure_optimizers`` returns."""
    decay, plain = [], []
    for name, param in named_parameters:
        if param.requires_grad:
            (decay if param.ndim >= 2 and name not in no_decay else plain).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), weight_decay=weight_decay)
    if schedule == "constant" and warmup_steps <= 0:
        return optimizer
    total_steps = max(int(total_steps), 1)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress
        return min_lr_ratio + (1 - min_lr_ratio) * shape

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
