"""A small timm Vision Transformer (random init) on scikit-learn's digits, or a local CIFAR-10.

The module builds a plain ``torch.optim.AdamW`` (plus a warmup/cosine schedule); quantized states come
from the Trainer: ``QStatePrecision`` in ``trainer.plugins`` or the ``QuantizedOptimizerStates`` callback.

Run (from the repository root)::

    python examples/vit.py fit --config examples/configs/vit_int8.yaml
    lightning-qstate fit --config examples/configs/vit_int8.yaml     # the same, through the package CLI
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `examples` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl
import timm
import torch
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAccuracy

from examples import Schedule, adamw_with_schedule


class ViTModule(pl.LightningModule):
    """A timm ViT classifier built from ``model_name`` with ``pretrained=False`` (nothing is downloaded)
    and the size options below overriding the named architecture's.

    Logs ``train_loss``/``train_acc`` every step, ``val_loss``/``val_acc`` per validation run and ``test_loss``/``test_acc``
    under ``test`` (the data module's held-out images: the digits ship no other split).

    Args:
        model_name: a timm ViT architecture name.
        img_size, patch_size, in_chans, num_classes: input and output of the classifier.
        embed_dim, depth, num_heads, mlp_ratio: size of the transformer.
        drop_path_rate: stochastic depth.
        label_smoothing: of the cross-entropy.
        lr, weight_decay, betas, warmup_steps, schedule, min_lr_ratio: as for :class:`examples.gpt.GPTModule`.
        seed: seed of the random initialisation.
    """

    def __init__(
        self,
        model_name: str = "vit_tiny_patch16_224",
        img_size: int = 32,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 10,
        embed_dim: int = 96,
        depth: int = 4,
        num_heads: int = 3,
        mlp_ratio: float = 2.0,
        drop_path_rate: float = 0.0,
        label_smoothing: float = 0.0,
        lr: float = 2e-3,
        weight_decay: float = 0.05,
        betas: tuple[float, float] = (0.9, 0.999),
        warmup_steps: int = 20,
        schedule: Schedule = "cosine",
        min_lr_ratio: float = 0.05,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = timm.create_model(
                model_name,
                pretrained=False,
                img_size=img_size,
                patch_size=patch_size,
                in_chans=in_chans,
                num_classes=num_classes,
                embed_dim=embed_dim,
                depth=depth,
                num_heads=num_heads,
                mlp_ratio=mlp_ratio,
                drop_path_rate=drop_path_rate,
            )
        self.example_input_array = torch.zeros(1, in_chans, img_size, img_size)  # Lightning's model summary counts FLOPs on it
        self.train_acc = MulticlassAccuracy(num_classes=num_classes)
        self.val_acc = MulticlassAccuracy(num_classes=num_classes)
        self.test_acc = MulticlassAccuracy(num_classes=num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.model(images)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        loss = F.cross_entropy(logits, labels, label_smoothing=self.hparams.label_smoothing)
        self.train_acc(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val", self.val_acc)

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test", self.test_acc)

    def _evaluate(self, batch, stage: str, accuracy: MulticlassAccuracy) -> None:
        images, labels = batch
        logits = self(images)
        accuracy(logits, labels)
        self.log(f"{stage}_loss", F.cross_entropy(logits, labels), prog_bar=True)
        self.log(f"{stage}_acc", accuracy, prog_bar=True)

    def configure_optimizers(self):
        hp = self.hparams
        total = self.trainer.estimated_stepping_batches if self._trainer is not None else 1
        return adamw_with_schedule(
            self.named_parameters(),
            lr=hp.lr,
            weight_decay=hp.weight_decay,
            betas=hp.betas,
            warmup_steps=hp.warmup_steps,
            schedule=hp.schedule,
            total_steps=total,
            min_lr_ratio=hp.min_lr_ratio,
            no_decay={f"model.{name}" for name in self.model.no_weight_decay()},
        )


if __name__ == "__main__":
    from lightning.pytorch.cli import LightningCLI

    from examples.data import DigitsDataModule
    from examples.vit import ViTModule as Model  # the importable class, which the configs' class paths name
    from lightning_qstate.callbacks import RunSummary

    LightningCLI(
        Model,
        DigitsDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"callbacks": [RunSummary()]},
        save_config_kwargs={"overwrite": True},
    )
