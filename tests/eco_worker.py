"""Training without fp32 master weights (ECO) under Lightning: the model of ``tests/test_eco_lightning.py``, and one
multi-process run on CPU (gloo, 2 ranks) that it launches.

Usage::

    python tests/eco_worker.py --strategy {ddp,fsdp2} --variants JSON --out DIR

``--variants`` is a JSON list of ``{"name": ..., "precision": ..., "weights": ..., "error_feedback": ...,
"weight_rounding": ..., "weight_overrides": ..., "optimizer": "adamw" | "sgd" | "qadamw", "phases": [...],
"desync_rng": bool}``. For each variant, in the same processes (a fresh Trainer and model each time), the phases
(default all three) run in order:

- ``straight``: fit to ``--steps`` steps (``OUT/<name>/straight/``);
- ``first``: fit to ``--save-step`` steps, saving a checkpoint there (``OUT/<name>/first/ckpt.ckpt``: a full
  checkpoint; under FSDP2 a full one too, gathered by ``get_optimizer_state_dict``);
- ``resume``: fit to ``--steps`` steps from that checkpoint (``OUT/<name>/resume/``).

Each phase writes ``rank<r>.json`` (per parameter: a hash of the rank's local values, its dtype, local and full
shape, its weight grid and whether the local values are on it; every optimizer state described as in
``distributed_worker.describe_state``; the optimizer's SR step; for ``resume`` the same right after the checkpoint
was loaded, before any step), ``weights.pt`` (the gathered weights, rank 0) and ``done<r>``; a phase that raises
writes ``error<r>.txt`` (its traceback) instead, and the next one runs. ``desync_rng``: each
rank draws a different number of values from torch's global generator before ``configure_optimizers`` (as a
rank-dependent seed or data pipeline would), to show whether stochastic rounding still keeps DDP replicas equal.

Under FSDP2 the run ends with a check of a parameter that is a *replicated* DTensor (placement ``Replicate``, as
tensor parallelism's norms or HSDP's replica dimension): ``OUT/replicated<r>.json`` holds the hash of its values
after a few ``QAdamW(weights="bf16")`` steps with stochastic rounding, on each rank.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import traceback
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE), str(HERE.parent)):  # runnable without PYTHONPATH too
    if path not in sys.path:
        sys.path.insert(0, path)

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from lightning_qstate.optim import QuantizedStates, clean_parameter_name  # noqa: E402
from lightning_qstate.optim.base import local_tensor  # noqa: E402
from lightning_qstate.plugins import QStatePrecision  # noqa: E402

from distributed_worker import RecordLoaded, describe_state, digest, full_weights, make_strategy, run_worker  # noqa: E402
from lightning_models import step_batch  # noqa: E402

WIDTH, DIM, HIDDEN, OUTPUTS = 24, 32, 51, 8  # hidden=51: fc1's rows shard 26 / 25 under FSDP2
# the weights ECO's policy selects in EcoModule: the linear layers inside its repeated blocks
BLOCK_WEIGHTS = ("net.blocks.0.fc1.weight", "net.blocks.0.fc2.weight", "net.blocks.1.fc1.weight", "net.blocks.1.fc2.weight")


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.fc1 = torch.nn.Linear(DIM, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


class BlockNet(torch.nn.Module):
    """An input projection, two residual MLP blocks (``blocks.0``, ``blocks.1``) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(WIDTH, DIM)
        self.blocks = torch.nn.ModuleList([Block() for _ in range(2)])
        self.head = torch.nn.Linear(DIM, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class EcoModule(pl.LightningModule):
    """``BlockNet`` on ``step_batch`` data (a function of the step: resumes exactly), AdamW (or SGD with momentum) with
    a step-wise LR schedule. ``fsdp2``: ``configure_model`` shards every block and the net (``ModelParallelStrategy``)."""

    def __init__(self, lr: float = 1e-2, optimizer: str = "adamw", fsdp2: bool = False, desync_rng: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = BlockNet()
        self.lr, self.optimizer_name, self.fsdp2, self.desync_rng = lr, optimizer, fsdp2, desync_rng

    def configure_model(self) -> None:
        if not self.fsdp2:
            return
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.net, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(self.net.inp.weight.dtype)).float()

    def training_step(self, batch, batch_idx):
        x, y = step_batch(self.global_step, self.global_rank, WIDTH)
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        if self.desync_rng:  # a rank-dependent use of torch's global generator before the optimizer is built
            torch.rand(1 + 7 * self.global_rank)
        if self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=0.01)
        elif self.optimizer_name == "qadamw":  # built quantized here: the plugin keeps it as it is
            from lightning_qstate import QAdamW

            optimizer = QAdamW(self.parameters(), lr=self.lr, weight_decay=0.01, min_quant_size=0, weights="bf16", error_feedback="eco")
        else:
            optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def eco_data(samples: int = 32):
    """A loader of ``samples // 8`` batches that only drives the loop (the data comes from ``step_batch``)."""
    from lightning_models import regression_data

    return regression_data(samples, WIDTH)


# --- what each rank reports -------------------------------------------------------------------------
def describe_weights(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict:
    """Per parameter (clean name): hash, dtype, shapes, weight grid and whether the local values are on it; its states."""
    names = {param: clean_parameter_name(name) for name, param in model.named_parameters()}
    params = {}
    for group in optimizer.param_groups:
        for key in group["params"]:
            local = local_tensor(key).detach()
            grid = optimizer.weight_grid(group, key) if isinstance(optimizer, QuantizedStates) else None
            params[names[key]] = {
                "hash": digest(local),
                "dtype": str(local.dtype),
                "local_shape": list(local.shape),
                "shape": list(key.shape),
                "grid": None if grid is None else grid.name,
                "on_grid": None if grid is None else bool(torch.equal(grid.round(local.float(), "nearest").to(local.dtype), local)),
                "states": {name: describe_state(value) for name, value in optimizer.state.get(key, {}).items()},
            }
    return {"params": params, "rounding_step": getattr(optimizer, "_rounding_step", None)}


def plugin_for(variant: dict) -> QStatePrecision:
    return QStatePrecision(
        variant.get("precision", "bf16-true"),
        states=variant.get("states", "int8"),
        min_quant_size=0,
        weights=variant.get("weights", "bf16"),
        weight_rounding=variant.get("weight_rounding", "stochastic"),
        error_feedback=variant.get("error_feedback", "eco"),
        weight_overrides=variant.get("weight_overrides"),
    )


def run_phase(args: argparse.Namespace, variant: dict, phase: str) -> None:
    start = time.perf_counter()
    out = args.out / variant["name"] / phase
    recorder = RecordLoaded(describe_weights)
    callbacks: list[Callback] = [recorder]
    if phase == "first":
        callbacks.append(ModelCheckpoint(dirpath=out, filename="ckpt", every_n_train_steps=args.save_step, save_top_k=-1))
    strategy_args = argparse.Namespace(strategy=args.strategy, devices=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=make_strategy(strategy_args, "full"),
        plugins=[plugin_for(variant)],
        callbacks=callbacks,
        max_steps=args.save_step if phase == "first" else args.steps,
        default_root_dir=out,
        logger=False,
        enable_checkpointing=phase == "first",
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = EcoModule(
        fsdp2=args.strategy == "fsdp2", desync_rng=variant.get("desync_rng", False), optimizer=variant.get("optimizer", "adamw")
    )
    ckpt = str(args.out / variant["name"] / "first" / "ckpt.ckpt") if phase == "resume" else None
    trainer.fit(model, eco_data(), ckpt_path=ckpt)
    weights = full_weights(trainer)
    rank = trainer.global_rank
    out.mkdir(parents=True, exist_ok=True)
    optimizer = trainer.strategy.optimizers[0]
    info = {
        "variant": variant,
        "phase": phase,
        "rank": rank,
        "global_step": trainer.global_step,
        "seconds": time.perf_counter() - start,
        "lr": optimizer.param_groups[0]["lr"],
        **describe_weights(optimizer, trainer.strategy.model),
        "loaded": recorder.loaded if phase == "resume" else None,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    if rank == 0:
        torch.save(weights, out / "weights.pt")
    trainer.strategy.barrier()
    (out / f"done{rank}").write_text("ok")


def replicated_dtensor_check(out: Path) -> None:
    """Step a parameter that is a replicated DTensor (identical on both ranks) with SR bf16 weights; record its hash."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from lightning_qstate import QAdamW

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    values = torch.randn(16, 64, generator=torch.Generator().manual_seed(0))
    param = torch.nn.Parameter(DTensor.from_local(values, mesh, [Replicate()], run_check=False))
    optimizer = QAdamW([param], lr=1e-3, weights="bf16", error_feedback="eco", generator=torch.Generator().manual_seed(1))
    for step in range(3):
        grad = torch.randn(16, 64, generator=torch.Generator().manual_seed(10 + step))
        param.grad = DTensor.from_local(grad, mesh, [Replicate()], run_check=False)
        optimizer.step()
    (out / f"replicated{rank}.json").write_text(json.dumps({"hash": digest(param.to_local())}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=("ddp", "fsdp2"), required=True)
    parser.add_argument("--variants", required=True, help="JSON list of variants (see the module docs)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-step", type=int, default=3)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")
    warnings.filterwarnings("ignore", ".*is an experimental feature.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    for variant in json.loads(args.variants):
        for phase in variant.get("phases", ("straight", "first", "resume")):
            try:
                run_phase(args, variant, phase)
            except Exception:  # noqa: BLE001 - recorded for the test (both ranks fail alike: the run goes on)
                record_error(args.out / variant["name"] / phase, traceback.format_exc())
    if args.strategy == "fsdp2":
        replicated_dtensor_check(args.out)
    return 0


def record_error(out: Path, text: str) -> None:
    import torch.distributed as dist

    out.mkdir(parents=True, exist_ok=True)
    (out / f"error{dist.get_rank() if dist.is_initialized() else 0}.txt").write_text(text)


if __name__ == "__main__":
    run_worker(main)
