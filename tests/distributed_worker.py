"""One multi-process Lightning run on CPU (gloo, 2 ranks), launched by ``tests/test_distributed.py``.

Usage::

    python tests/distributed_worker.py --strategy {ddp,fsdp,fsdp2} --mode straight,first --state-dict full,sharded --out DIR
    python tests/distributed_worker.py --strategy {ddp,fsdp,fsdp2} --mode resume --state-dict full,sharded --out DIR

``--mode`` is one phase or a comma-separated list, run in order in the same processes (a fresh
Trainer and model each time); ``--state-dict`` is one checkpoint kind or a comma-separated list:

- ``straight``: fit to ``--steps`` steps (``OUT/straight/``);
- ``first``: for each checkpoint kind, fit to ``--save-step`` steps, saving a checkpoint at that step
  (``OUT/first-<kind>/ckpt.ckpt``, a directory for sharded checkpoints);
- ``resume``: for each checkpoint kind, fit to ``--steps`` steps from ``--ckpt`` (default: the
  checkpoint of ``first`` with the same kind in ``OUT``) into ``OUT/resume-<kind>/``.

Each phase writes into its folder: ``weights.pt`` (the full, gathered model weights, written by
rank 0), ``rank<r>.json`` (written by rank ``r``: per parameter, the policy's decision and every
state's format, block size, shape and a hash of its codes; for ``resume`` also the same right after
the checkpoint was loaded, before any step, and ``loaded<r>.pt``: the values of those states; ``metrics``: every
``log_metrics`` call the rank's logger got;
``callbacks``: the ``state_dict()`` of each ``--callbacks`` entry) and ``done<r>`` when the rank finished. Under FSDP2,
``straight`` also writes ``packed_into_shard<r>.json``: the error raised when a packed state of the full
parameter's shape (a DDP checkpoint) is loaded into the rank's shard.

Lightning re-executes ``sys.argv`` for rank 1, so this file runs standalone. Any failure prints the
traceback and exits the rank with status 1 (a peer blocked in a collective is ended by the process
group timeout or Lightning's process observer).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
for path in (str(HERE), str(HERE.parent)):  # runnable without PYTHONPATH too
    if path not in sys.path:
        sys.path.insert(0, path)

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy  # noqa: E402
from rank_exit import end_rank  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

import lightning_qstate.callbacks as qstate_callbacks  # noqa: E402
from lightning_qstate.callbacks import QuantizedOptimizerStates, stall_counts  # noqa: E402
from lightning_qstate.formats import BlockFormat, QuantizedTensor, get_format  # noqa: E402
from lightning_qstate.optim import QuantizedStates, clean_parameter_name  # noqa: E402
from lightning_qstate.optim.base import local_tensor  # noqa: E402
from lightning_qstate.optim.serialization import export_state  # noqa: E402
from lightning_qstate.plugins import CPUFSDPStrategy, QStateFSDPPrecision, QStatePrecision  # noqa: E402

from lightning_models import Regressor, regression_data, step_batch  # noqa: E402

PHASES = ("straight", "first", "resume")
TIMEOUT = datetime.timedelta(seconds=120)  # a rank whose peer died fails instead of hanging for 30 minutes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategy", choices=("ddp", "fsdp", "fsdp2"), required=True)
    parser.add_argument("--mode", required=True, help="a phase or comma-separated phases: straight, first, resume")
    parser.add_argument(
        "--state-dict",
        default="full",
        help="checkpoint kind(s), comma-separated: full, sharded (FSDP: state_dict_type; FSDP2: save_distributed_checkpoint)",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt", type=Path, default=None, help="checkpoint to resume from (default OUT/first-<kind>/ckpt.ckpt)")
    parser.add_argument("--steps", type=int, default=6, help="total steps (straight, resume)")
    parser.add_argument("--save-step", type=int, default=3, help="step of the checkpoint (first)")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=300)
    parser.add_argument("--states", default="int8", help="a format name, or a JSON mapping state name -> format")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--min-quant-size", type=int, default=1024)
    parser.add_argument(
        "--via",
        choices=("plugin", "callback", "none"),
        default="plugin",
        help="how the optimizer gets quantized (none: plain torch states, a control)",
    )
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument(
        "--callbacks", default="[]", help='JSON list of lightning_qstate.callbacks to add: [{"class": "StallMonitor", "init_args": {...}}]'
    )
    parser.add_argument("--log-every", type=int, default=1, help="Trainer log_every_n_steps (metrics are recorded per rank)")
    parser.add_argument("--decay-groups", action="store_true", help="two param groups, the weight matrices first (not the module's order)")
    args = parser.parse_args(argv)
    args.phases = [phase.strip() for phase in args.mode.split(",") if phase.strip()]
    unknown = sorted(set(args.phases) - set(PHASES))
    if unknown or not args.phases:
        parser.error(f"--mode: unknown phase(s) {unknown}; use {PHASES}")
    args.kinds = [kind.strip() for kind in args.state_dict.split(",") if kind.strip()]
    if not args.kinds or set(args.kinds) - {"full", "sharded"} or (args.strategy == "ddp" and args.kinds != ["full"]):
        parser.error(f"--state-dict {args.state_dict!r}: use full and/or sharded (ddp: full only)")
    if args.states.startswith("{"):
        args.states = json.loads(args.states)
    args.callbacks = json.loads(args.callbacks)
    return args


class WidthRegressor(Regressor):
    """``Regressor`` fed ``width`` inputs (FSDP2 keeps fp32 states for rows that allow no aligned block of >= 32); with
    ``decay_groups`` its AdamW has the usual two groups, the weight matrices (decayed) before the rest: ids in another
    order than the module's parameters."""

    def __init__(self, width: int = 64, hidden: int = 300, lr: float = 1e-2, decay_groups: bool = False) -> None:
        super().__init__(width=width, hidden=hidden, lr=lr)
        self.width = width
        self.decay_groups = decay_groups

    def configure_optimizers(self):
        if not self.decay_groups:
            return super().configure_optimizers()
        # by name (FSDP1 shows its parameters as flat shards here): the Linear layers' weights
        named = [(name.replace("_fsdp_wrapped_module.", ""), param) for name, param in self.named_parameters()]
        matrices = [param for name, param in named if name in ("net.0.weight", "net.3.weight")]
        rest = [param for name, param in named if name not in ("net.0.weight", "net.3.weight")]
        groups = [{"params": matrices, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def training_step(self, batch, batch_idx):
        x, y = step_batch(self.global_step, self.global_rank, self.width)
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss


class FullyShardedRegressor(WidthRegressor):
    """The same model for ``ModelParallelStrategy`` (FSDP2): each Linear and the whole net fully sharded on dim 0."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.net, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[3]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


def policy_options(args: argparse.Namespace) -> dict:
    return {"states": args.states, "block_size": args.block_size, "min_quant_size": args.min_quant_size}


def make_strategy(args: argparse.Namespace, kind: str):
    if args.strategy == "ddp":
        return DDPStrategy(process_group_backend="gloo", timeout=TIMEOUT)
    if args.strategy == "fsdp":
        return CPUFSDPStrategy(state_dict_type=kind, process_group_backend="gloo", timeout=TIMEOUT)
    return ModelParallelStrategy(
        data_parallel_size=args.devices,
        tensor_parallel_size=1,
        save_distributed_checkpoint=kind == "sharded",
        process_group_backend="gloo",
        timeout=TIMEOUT,
    )


class RecordingLogger(Logger):
    """Keeps every ``log_metrics`` call of this rank, on every rank: ``[{"step": s, **metrics}, ...]``."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict] = []

    @property
    def name(self) -> str:
        return "recording"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.records.append({"step": step, **{key: float(value) for key, value in metrics.items()}})

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


class LocalPredictions(Callback):
    """Records, on every rank, what this rank's StallMonitor alone predicts per layer at each measurement (right after the
    monitor: the measurement is cached, no collective; before any reset): ``[{"step": global step, tag: prediction}, ...]``."""

    def __init__(self) -> None:
        self.records: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        _, measurement = stall_counts._CACHE.get(trainer, ((), None))
        monitors = [c for c in trainer.callbacks if isinstance(c, qstate_callbacks.StallMonitor)]
        if monitors and measurement is not None and measurement.step == trainer.global_step:
            scalars, _ = monitors[0].metrics(measurement)
            self.records.append({"step": trainer.global_step, **{k: v for k, v in scalars.items() if "stall_predicted" in k}})


def named_callbacks(args: argparse.Namespace) -> list[Callback]:
    """The ``--callbacks`` specs, instantiated from ``lightning_qstate.callbacks``."""
    return [getattr(qstate_callbacks, spec["class"])(**spec.get("init_args", {})) for spec in args.callbacks]


def make_trainer(args: argparse.Namespace, phase: str, kind: str, out: Path, extra_callbacks: list[Callback]) -> pl.Trainer:
    callbacks = [*extra_callbacks, *named_callbacks(args)]
    monitors = [index for index, callback in enumerate(callbacks) if isinstance(callback, qstate_callbacks.StallMonitor)]
    callbacks.insert(monitors[0] + 1 if monitors else len(callbacks), LocalPredictions())  # before a reset zeroes states
    plugins = []
    if args.via == "callback":
        callbacks.append(QuantizedOptimizerStates(**policy_options(args), log_stats=False))
    elif args.via == "none":
        pass
    elif args.strategy == "fsdp":
        plugins.append(QStateFSDPPrecision(**policy_options(args)))
    else:
        plugins.append(QStatePrecision(**policy_options(args)))
    if phase == "first":
        callbacks.append(ModelCheckpoint(dirpath=out, filename="ckpt", every_n_train_steps=args.save_step, save_top_k=-1))
    return pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=make_strategy(args, kind),
        plugins=plugins,
        callbacks=callbacks,
        max_steps=args.save_step if phase == "first" else args.steps,
        default_root_dir=out,
        logger=RecordingLogger(),
        log_every_n_steps=args.log_every,
        enable_checkpointing=phase == "first",
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def make_model(args: argparse.Namespace) -> pl.LightningModule:
    model_class = FullyShardedRegressor if args.strategy == "fsdp2" else WidthRegressor
    return model_class(width=args.width, hidden=args.hidden, decay_groups=args.decay_groups)


# --- what each rank reports -------------------------------------------------------------------------
def digest(tensor: torch.Tensor | None) -> str:
    if tensor is None:
        return "none"
    tensor = local_tensor(tensor).detach().cpu().contiguous().reshape(-1)
    return hashlib.sha256(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"").hexdigest()[:16]


def describe_format(fmt) -> dict | None:
    if fmt is None:
        return None
    return {**fmt.config, "resolved_block_size": fmt.block_size if isinstance(fmt, BlockFormat) else None}


def describe_state(value) -> dict:
    if isinstance(value, QuantizedTensor):
        return {
            "quantized": True,
            "format": describe_format(value.format),
            "shape": list(value.shape),
            "hash": digest(value.codes) + digest(value.scales),
        }
    if isinstance(value, torch.Tensor):
        local = local_tensor(value)
        return {"quantized": False, "format": None, "shape": list(local.shape), "dtype": str(local.dtype), "hash": digest(local)}
    return {"quantized": False, "format": None, "value": repr(value)}


def describe_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict:
    """Per parameter (by clean name): its local/full shape, the policy's decision per state, and its states."""
    names = {param: clean_parameter_name(name) for name, param in model.named_parameters()}
    params: dict[str, dict] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = names.get(param, f"<unnamed {len(params)}>")
            entry = {"local_shape": list(local_tensor(param).shape), "shape": list(param.shape)}
            if isinstance(optimizer, QuantizedStates):
                entry["policy"] = {state: describe_format(optimizer._policy_format(group, param, state)) for state in optimizer.state_names}
                full_numels = getattr(optimizer, "full_numels", {})
                entry["full_numel"] = full_numels.get(param, param.numel())
            entry["states"] = {state: describe_state(value) for state, value in optimizer.state.get(param, {}).items()}
            params[name] = entry
    return {"optimizer": type(optimizer).__qualname__, "checkpoint_mode": getattr(optimizer, "checkpoint_mode", None), "params": params}


class RecordLoaded(Callback):
    """Records the optimizer (``describe(optimizer, model)``) right after a checkpoint was restored, before the first
    resumed step, and the values of its states (``values``: ``{param: {state: this rank's values, fp32}}``)."""

    def __init__(self, describe=None) -> None:
        self.describe = describe or describe_optimizer
        self.loaded: dict | None = None
        self.values: dict[str, dict[str, torch.Tensor]] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizer, model = trainer.strategy.optimizers[0], trainer.strategy.model
        self.loaded = self.describe(optimizer, model)
        self.loaded["global_step"] = trainer.global_step
        for name, param in model.named_parameters():
            states = optimizer.state.get(param, {}).items()
            self.values[clean_parameter_name(name)] = {
                state: local_tensor(value.dequantize(torch.float32) if isinstance(value, QuantizedTensor) else value).float().clone()
                for state, value in states
                if isinstance(value, QuantizedTensor | torch.Tensor) and len(value.shape) > 0
            }


def full_weights(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """The full model weights (a collective: every rank calls it; rank 0 gets the tensors)."""
    state = get_model_state_dict(trainer.strategy.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {clean_parameter_name(name): value.detach().clone() for name, value in state.items()}


def load_full_packed_state_into_shard(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> str | None:
    """Load a packed (DDP-style) state of the full parameter shape into this rank's DTensor shard of ``net.0.weight``.

    Returns the error it raises (``None`` if it loaded: another rank's or the wrong amount of state). Run it only at
    the end of a phase: on failure the optimizer's state is left half-loaded.
    """
    param = dict((clean_parameter_name(name), p) for name, p in model.named_parameters())["net.0.weight"]
    assert isinstance(param, DTensor), type(param)
    index = [p for group in optimizer.param_groups for p in group["params"]].index(param)
    state_dict = optimizer.state_dict()
    entries = {k: v for k, v in state_dict["state"][index].items() if not k.startswith("exp_avg.")}
    entries["exp_avg"] = export_state(get_format("int8").quantize(torch.zeros(param.shape)))
    try:
        optimizer.load_state_dict({**state_dict, "state": {**state_dict["state"], index: entries}})
    except ValueError as error:
        return str(error)
    return None


def run_phase(args: argparse.Namespace, phase: str, kind: str) -> None:
    """Fit one phase with checkpoint kind ``kind`` and report into ``OUT/straight`` or ``OUT/<phase>-<kind>``."""
    start = time.perf_counter()
    out = args.out / (phase if phase == "straight" else f"{phase}-{kind}")
    recorder = RecordLoaded()
    trainer = make_trainer(args, phase, kind, out, [recorder] if phase == "resume" else [])
    model = make_model(args)
    ckpt = None
    if phase == "resume":
        ckpt = str(args.ckpt or args.out / f"first-{kind}" / "ckpt.ckpt")
    trainer.fit(model, regression_data(width=args.width), ckpt_path=ckpt)
    weights = full_weights(trainer)
    rank = trainer.global_rank
    out.mkdir(parents=True, exist_ok=True)
    optimizer = trainer.strategy.optimizers[0]
    info = {
        "phase": phase,
        "kind": kind,
        "rank": rank,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "seconds": time.perf_counter() - start,
        "lr": optimizer.param_groups[0]["lr"],
        **describe_optimizer(optimizer, trainer.strategy.model),
        "loaded": recorder.loaded,
        "metrics": trainer.logger.records,
        "callbacks": {type(c).__name__: c.state_dict() for c in trainer.callbacks if type(c).__module__.startswith("lightning_qstate.")},
        "local_predictions": next(c.records for c in trainer.callbacks if isinstance(c, LocalPredictions)),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    if rank == 0:
        torch.save(weights, out / "weights.pt")
    if phase == "resume":
        torch.save(recorder.values, out / f"loaded{rank}.pt")
    if args.strategy == "fsdp2" and phase == "straight" and isinstance(optimizer, QuantizedStates):  # after everything was recorded
        error = load_full_packed_state_into_shard(optimizer, trainer.strategy.model)
        (out / f"packed_into_shard{rank}.json").write_text(json.dumps({"error": error}))
    trainer.strategy.barrier()
    (out / f"done{rank}").write_text("ok")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")
    warnings.filterwarnings("ignore", ".*is an experimental feature.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    for phase in args.phases:
        for kind in args.kinds[:1] if phase == "straight" else args.kinds:
            run_phase(args, phase, kind)
    return 0


def run_worker(main: Callable[[], int]) -> None:
    """Run one rank's ``main`` and end the process with its status.

    Any failure is printed and ends this rank at once with status 1; success ends it by ``rank_exit.end_rank`` (the
    phases' trainers, models and optimizers collected, the process group destroyed, no interpreter teardown).
    """
    try:
        status = main()
    except BaseException:  # noqa: BLE001 - any failure: report it and end this rank with a non-zero status
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    end_rank(status)


if __name__ == "__main__":
    run_worker(main)
