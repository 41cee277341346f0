"""Small LightningModules shared by the single-process and the multi-process Lightning tests."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger
from torch.utils.data import DataLoader, TensorDataset


def quiet_trainer(tmp_path, max_steps: int, **kwargs) -> pl.Trainer:
    """A CPU Trainer for ``max_steps`` steps without logger, checkpoints, progress bar or model summary (``kwargs`` win)."""
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return pl.Trainer(default_root_dir=tmp_path, **{**defaults, **kwargs})


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call."""

    name = "memory"
    version = 0

    def __init__(self) -> None:
        super().__init__()
        self.records: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics, step=None) -> None:
        self.records.append((step, dict(metrics)))

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def values(self, key: str) -> list[float]:
        return [metrics[key] for _, metrics in self.records if key in metrics]

    def keys(self) -> set[str]:
        return {key for _, metrics in self.records for key in metrics}


def step_batch(step: int, rank: int = 0, width: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of a training step, a function of the step (and rank) alone.

    Lightning restarts a plain DataLoader from its first batch when it resumes mid-epoch, so models
    that must resume exactly take their data from here and use the loader only to drive the loop.
    """
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, width, generator=gen)
    teacher = torch.randn(width, 8, generator=torch.Generator().manual_seed(0))
    return x, x @ teacher + 0.1 * torch.randn(8, 8, generator=gen)


def regression_data(samples: int = 32, width: int = 24) -> DataLoader:
    """A loader of ``samples // 8`` batches that drives the loop (the data itself comes from ``step_batch``)."""
    x = torch.zeros(samples, width)
    return DataLoader(TensorDataset(x, x[:, :8]), batch_size=8, shuffle=False)


class Regressor(pl.LightningModule):
    """An embedding-free MLP with a norm layer; ``hidden`` can be uneven to test uneven shards."""

    def __init__(self, width: int = 24, hidden: int = 300, lr: float = 1e-2, scheduler: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(width, hidden), torch.nn.LayerNorm(hidden), torch.nn.GELU(), torch.nn.Linear(hidden, 8)
        )
        self.lr = lr
        self.scheduler = scheduler

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = step_batch(self.global_step, self.global_rank)
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def flat_weights(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten() for p in module.parameters()])
