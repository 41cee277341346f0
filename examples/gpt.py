"""A small byte-level GPT-2 (transformers, random init) on the ``pydoc_data.topics`` text.

The module builds a plain ``torch.optim.AdamW`` (plus a warmup/cosine schedule); quantized states come
from the Trainer: ``QStatePrecision`` in ``trainer.plugins`` or the ``QuantizedOptimizerStates`` callback.

Run (from the repository root)::

    python examples/gpt.py fit --config examples/configs/gpt_int8.yaml
    lightning-qstate fit --config examples/configs/gpt_int8.yaml     # the same, through the package CLI
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the `examples` package importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel

from examples import Schedule, adamw_with_schedule


class GPTModule(pl.LightningModule):
    """GPT-2 over bytes (vocabulary 256), trained with next-byte cross-entropy.

    Logs ``train_loss`` every step, ``val_loss`` per validation run and ``test_loss`` under ``test`` (nats per byte; the
    data module's held-out text: the corpus ships no other split).

    Args:
        n_embd, n_layer, n_head: width, depth and heads of the transformer.
        n_positions: longest context; must be at least the data's ``seq_len``.
        dropout: residual, embedding and attention dropout.
        lr, weight_decay, betas: ``torch.optim.AdamW`` hyperparameters (no decay on biases and norms).
        warmup_steps: linear warmup of the learning rate.
        schedule: ``"cosine"`` or ``"linear"`` decay to ``min_lr_ratio * lr`` at the last step, or ``"constant"``.
        min_lr_ratio: final learning rate relative to ``lr``.
        seed: seed of the random initialisation.
    """

    def __init__(
        self,
        n_embd: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_positions: int = 256,
        dropout: float = 0.0,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 50,
        schedule: Schedule = "cosine",
        min_lr_ratio: float = 0.1,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        config = GPT2Config(
            vocab_size=256,
            n_positions=n_positions,
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            resid_pdrop=dropout,
            embd_pdrop=dropout,
            attn_pdrop=dropout,
            bos_token_id=0,
            eos_token_id=0,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.model = GPT2LMHeadModel(config)
        self.example_input_array = torch.zeros(1, n_positions, dtype=torch.long)  # Lightning's model summary counts FLOPs on it

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-byte logits ``(batch, seq, 256)`` for byte tokens ``(batch, seq)``."""
        return self.model(input_ids=tokens, use_cache=False).logits

    def _loss(self, batch) -> torch.Tensor:
        tokens, targets = batch
        if tokens.shape[1] > self.hparams.n_positions:
            raise ValueError(f"GPTModule: sequences of {tokens.shape[1]} tokens exceed n_positions={self.hparams.n_positions}")
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch), prog_bar=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), prog_bar=True)

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
        )

    @torch.no_grad()
    def sample(self, prompt: str, max_new_bytes: int = 80, temperature: float = 0.8, seed: int = 0) -> str:
        """Continue ``prompt`` byte by byte (for a look at what the model learned)."""
        generator = torch.Generator(device=self.device).manual_seed(seed)
        tokens = torch.tensor([list(prompt.encode("utf-8"))], device=self.device)
        for _ in range(max_new_bytes):
            logits = self(tokens[:, -self.hparams.n_positions :])[:, -1].float() / temperature
            tokens = torch.cat([tokens, torch.multinomial(logits.softmax(-1), 1, generator=generator)], dim=1)
        return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")


if __name__ == "__main__":
    from lightning.pytorch.cli import LightningCLI

    from examples.data import ByteTextDataModule
    from examples.gpt import GPTModule as Model  # the importable class, which the configs' class paths name
    from lightning_qstate.callbacks import RunSummary

    LightningCLI(
        Model,
        ByteTextDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"callbacks": [RunSummary()]},
        save_config_kwargs={"overwrite": True},
    )
