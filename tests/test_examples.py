"""The examples through the CLI: every YAML config parses, and GPT / ViT configs train end to end for a few
steps with tiny models, quantized states and TensorBoard logs."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("timm")
pytest.importorskip("sklearn")

import lightning.pytorch as pl  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from lightning_qstate.callbacks import RunSummary, StateResetScheduler  # noqa: E402
from lightning_qstate.cli import build_cli  # noqa: E402
from lightning_qstate.formats import QuantizedTensor  # noqa: E402
from lightning_qstate.optim import QAdamW  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
QSTATE_TAGS = {"qstate/state_bytes", "qstate/bits_per_value", "qstate/saving_vs_fp32", "qstate/nonfinite_skips"}
TINY_GPT = [
    "--model.init_args.n_embd=32",
    "--model.init_args.n_layer=1",
    "--model.init_args.n_head=2",
    "--data.init_args.seq_len=32",
    "--data.init_args.batch_size=4",
]
# AdaptiveBitWidth's cheapest plan (m int4, v int5: 4.6 bits) plus the fp32 states of biases and norms must fit 5.1 bits:
# at n_embd 32 those are 2 % of the values (5.2 bits in all), at 64 about 1 %
ADAPTIVE_GPT = [*(arg for arg in TINY_GPT if "n_embd" not in arg), "--model.init_args.n_embd=64"]
TINY_VIT = [
    "--model.init_args.embed_dim=64",
    "--model.init_args.depth=1",
    "--model.init_args.num_heads=2",
    "--data.init_args.batch_size=16",
]
SHORT = [
    "--trainer.max_steps=3",
    "--trainer.log_every_n_steps=1",
    "--trainer.limit_val_batches=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch):
    """LightningCLI warns when both ``args`` and ``sys.argv`` (pytest's) carry arguments."""
    monkeypatch.setattr(sys, "argv", ["lightning-qstate"])


def fit(config: str, tmp_path: Path, *extra: str):
    return build_cli(["fit", "--config", str(CONFIGS / config), f"--trainer.logger.init_args.save_dir={tmp_path}", *SHORT, *extra])


def quantized_formats(optimizer: torch.optim.Optimizer) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for state in optimizer.state.values():
        for name, value in state.items():
            if isinstance(value, QuantizedTensor):
                found.setdefault(name, set()).add(value.format.name)
    return found


def scalar_tags(log_dir: str) -> set[str]:
    accumulator = EventAccumulator(log_dir)
    accumulator.Reload()
    return set(accumulator.Tags()["scalars"])


@pytest.mark.parametrize("config", sorted(path.name for path in CONFIGS.glob("*.yaml")))
def test_every_config_parses_and_instantiates(config, tmp_path):
    cli = build_cli(["--config", str(CONFIGS / config), f"--trainer.logger.init_args.save_dir={tmp_path}"], run=False)
    assert cli.trainer.max_steps > 0 and cli.trainer.log_every_n_steps > 0
    assert type(cli.trainer.logger).__name__ == "TensorBoardLogger"
    assert any(isinstance(callback, RunSummary) for callback in cli.trainer.callbacks)
    assert type(cli.model).__module__ == ("examples.gpt" if config.startswith("gpt") else "examples.vit")


EXPECTED_FORMATS = {  # state formats each config gives the tiny models' quantized parameters (None: plain torch AdamW)
    "gpt_fp32.yaml": None,
    "gpt_int8.yaml": {"exp_avg": {"int8"}, "exp_avg_sq": {"int8"}},
    "gpt_int4.yaml": {"exp_avg": {"int4", "int8"}, "exp_avg_sq": {"int4", "int8"}},  # int8: the tied embedding (override)
    "gpt_bf16_sr.yaml": {"exp_avg": {"bf16"}, "exp_avg_sq": {"bf16"}},
    "gpt_eco.yaml": {"exp_avg": {"int8"}, "exp_avg_sq": {"int8"}},
    "gpt_callbacks.yaml": {"exp_avg": {"int8"}, "exp_avg_sq": {"int4"}},
    "gpt_stale.yaml": {"exp_avg": {"bf16"}, "exp_avg_sq": {"bf16"}},
    "gpt_adaptive.yaml": {"exp_avg": {"int4"}, "exp_avg_sq": {"int5", "int7"}},  # 5.1-bit cap: the room above the floor goes to v
    "gpt_demo.yaml": {"exp_avg": {"int4"}, "exp_avg_sq": {"int5", "int7"}},  # the same plan
    "vit_fp32.yaml": None,
    "vit_int8.yaml": {"exp_avg": {"int8"}, "exp_avg_sq": {"int8"}},
}


@pytest.mark.filterwarnings("ignore:`GPTModule.configure_optimizers` will be overridden")
@pytest.mark.parametrize("config", sorted(EXPECTED_FORMATS))
def test_every_config_trains_two_steps(config, tmp_path):
    assert {path.name for path in CONFIGS.glob("*.yaml")} == set(EXPECTED_FORMATS)
    tiny = (ADAPTIVE_GPT if config in ("gpt_adaptive.yaml", "gpt_demo.yaml") else TINY_GPT) if config.startswith("gpt") else TINY_VIT
    cli = fit(config, tmp_path, *tiny, "--trainer.max_steps=2", "--trainer.enable_checkpointing=false")
    (optimizer,) = cli.trainer.strategy.optimizers
    expected = EXPECTED_FORMATS[config]
    if expected is None:
        assert type(optimizer) is torch.optim.AdamW
    else:
        assert isinstance(optimizer, QAdamW) and quantized_formats(optimizer) == expected
    assert cli.trainer.global_step == 2 and torch.isfinite(cli.trainer.callback_metrics["train_loss"])


def test_gpt_int8_plugin_trains_and_logs(tmp_path, capsys):
    cli = fit("gpt_int8.yaml", tmp_path, *TINY_GPT, "--trainer.val_check_interval=2")
    (optimizer,) = cli.trainer.strategy.optimizers
    assert isinstance(optimizer, QAdamW)
    assert quantized_formats(optimizer) == {"exp_avg": {"int8"}, "exp_avg_sq": {"int8"}}
    assert {"train_loss", "val_loss"} <= set(cli.trainer.callback_metrics)
    assert torch.isfinite(cli.trainer.callback_metrics["train_loss"])
    assert cli.trainer.global_step == 3
    assert QSTATE_TAGS | {"train_loss", "val_loss"} <= scalar_tags(cli.trainer.log_dir)
    (summary,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, RunSummary)]
    assert 0 < summary.summary["state_bytes"] < summary.summary["fp32_state_bytes"]
    printed = capsys.readouterr().out
    assert "run summary" in printed and "in fp32" in printed and f"tensorboard --logdir {tmp_path}" in printed
    paths = optimizer.step_paths()  # which path stepped each parameter, as the summary counts them
    assert set(paths) == {name for name, p in cli.model.named_parameters() if p.requires_grad} and summary.summary["step_paths"]
    assert sum(summary.summary["step_paths"].values()) == len(paths) and "step paths: " in printed


def test_gpt_eco_trains_without_master_weights(tmp_path, capsys):
    """gpt_eco.yaml: bf16 parameters; the blocks' linear weights take the fp32 update, SR and ECO's feedback on the
    bf16 grid, and so do the others (embeddings, norms, biases, tied head: no master copy either) on their dtype's
    grid, bf16 too; the run summary reports the weights."""
    cli = fit("gpt_eco.yaml", tmp_path, *TINY_GPT, "--trainer.enable_checkpointing=false")
    (optimizer,) = cli.trainer.strategy.optimizers
    assert isinstance(optimizer, QAdamW) and cli.trainer.global_step == 3
    assert torch.isfinite(cli.trainer.callback_metrics["train_loss"])
    names = {param: name for name, param in cli.model.named_parameters()}
    grids = {names[param]: optimizer.weight_grid(group, param) for group in optimizer.param_groups for param in group["params"]}
    selected = {names[param] for group in optimizer.param_groups for param in group["params"] if param not in optimizer.weight_overrides}
    assert selected == {f"model.transformer.h.0.{layer}.weight" for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert all(grid is not None and grid.name == "bf16" for grid in grids.values())  # the others on their dtype's grid
    assert all(p.dtype == torch.bfloat16 for p in cli.model.parameters())
    assert {group["error_feedback"] for group in optimizer.param_groups} == {"eco"}
    (summary,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, RunSummary)]
    assert summary.summary["weight_formats"]["bf16"]["params"] == len(grids) and summary.summary["error_feedback"] == ["eco"]
    assert f"weights without master copy: bf16 x{len(grids)}" in capsys.readouterr().out


def test_gpt_callback_with_cli_optimizer(tmp_path):
    """gpt_callbacks.yaml: LightningCLI builds AdamW from `optimizer:`, the callback quantizes it and logs qstate/*."""
    with pytest.warns(UserWarning, match="configure_optimizers"):
        cli = fit("gpt_callbacks.yaml", tmp_path, *TINY_GPT)
    (optimizer,) = cli.trainer.strategy.optimizers
    assert isinstance(optimizer, QAdamW)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert quantized_formats(optimizer) == {"exp_avg": {"int8"}, "exp_avg_sq": {"int4"}}
    assert QSTATE_TAGS <= scalar_tags(cli.trainer.log_dir)


def test_gpt_stale_config_logs_stall_rates_to_tensorboard(tmp_path):
    cli = fit("gpt_stale.yaml", tmp_path, *TINY_GPT)  # the monitor follows the Trainer's log_every_n_steps (1 here)
    tags = scalar_tags(cli.trainer.log_dir)
    assert {"qstate/stall/exp_avg_sq", "qstate/stall_predicted/exp_avg_sq", "qstate/stall_resets"} <= tags
    assert not any(tag.startswith("qstate/stall/exp_avg_sq/") for tag in tags)  # per layer: histograms, not 28 more cards
    events = EventAccumulator(cli.trainer.log_dir)
    events.Reload()
    assert "qstate/stall/exp_avg_sq/layers" in events.Tags()["histograms"]
    (scheduler,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, StateResetScheduler)]
    assert set(scheduler.last_reset) and all(scheduler.layer_period(rows) == 1000 for rows in scheduler.layers(cli.trainer).values())


@pytest.mark.parametrize("period", ["auto", "100"])
def test_gpt_stale_predicted_stall_rates_follow_the_measured_ones(tmp_path, period):
    """The config's own model and data, 300 steps: without a reset (the theory's period, 1000 steps, is longer) and
    with one every 100 steps, the logged prediction (from the step's measured ratios g²/v and g/m) stays within a
    point of the measured rate at every logged step, while v's measured rate climbs from ~0.25 and drops after each
    reset. (The Gaussian model with a per-layer centre was up to 6 points low: the tied embedding's rows of rare
    tokens get tiny gradients, only decay, and stall at 0.72 where it said 0.37.)"""
    cli = fit(
        "gpt_stale.yaml", tmp_path, "--trainer.max_steps=300", "--trainer.log_every_n_steps=50", "--trainer.val_check_interval=300",
        f"--trainer.callbacks.init_args.period={period}", "--trainer.enable_checkpointing=false",
    )  # fmt: skip
    events = EventAccumulator(cli.trainer.log_dir)
    events.Reload()
    for state, tolerance in (("exp_avg_sq", 0.01), ("exp_avg", 0.01)):
        measured = [event.value for event in events.Scalars(f"qstate/stall/{state}")]
        predicted = [event.value for event in events.Scalars(f"qstate/stall_predicted/{state}")]
        assert len(measured) == len(predicted) == 6
        assert max(abs(m - p) for m, p in zip(measured, predicted, strict=True)) <= tolerance, (state, measured, predicted)
    v = [event.value for event in events.Scalars("qstate/stall/exp_avg_sq")]
    assert v[0] < 0.3 and max(v) > 0.5  # far from the steady state's 0.825 early on: a prediction must follow it
    (scheduler,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, StateResetScheduler)]
    assert (len(scheduler.history) > 0) == (period == "100")


def test_gpt_fp32_baseline_keeps_torch_adamw(tmp_path):
    cli = fit("gpt_fp32.yaml", tmp_path, *TINY_GPT)
    (optimizer,) = cli.trainer.strategy.optimizers
    assert type(optimizer) is torch.optim.AdamW
    (summary,) = [callback for callback in cli.trainer.callbacks if isinstance(callback, RunSummary)]
    assert summary.summary["state_bytes"] == summary.summary["fp32_state_bytes"] > 0


def test_vit_int8_trains(tmp_path):
    cli = fit("vit_int8.yaml", tmp_path, *TINY_VIT, "--trainer.val_check_interval=2")
    (optimizer,) = cli.trainer.strategy.optimizers
    assert isinstance(optimizer, QAdamW)
    assert quantized_formats(optimizer)["exp_avg"] == {"int8"}
    assert {"train_loss", "train_acc", "val_loss", "val_acc"} <= set(cli.trainer.callback_metrics)
    assert QSTATE_TAGS | {"val_acc"} <= scalar_tags(cli.trainer.log_dir)


def test_digits_validation_shifts():
    """``val_shift``: the held-out digits, then their copies shifted in the 8 directions, the border the background."""
    from examples.data import DigitsDataModule

    plain, shifted = DigitsDataModule(val_shift=0), DigitsDataModule(val_shift=2)
    plain.setup(), shifted.setup()
    (x, y), (xs, ys) = plain.val_set.tensors, shifted.val_set.tensors
    n = len(y)
    assert xs.shape == (9 * n, *x.shape[1:]) and torch.equal(ys, y.repeat(9))
    assert torch.equal(xs[4 * n : 5 * n], x) and torch.equal(plain.train_set.tensors[0], shifted.train_set.tensors[0])
    background = float(x.min())
    right = xs[5 * n : 6 * n]  # dy 0, dx +1: content moved left by 2 px, 2 background columns on the right
    assert torch.equal(right[..., :-2], x[..., 2:]) and bool((right[..., -2:] == background).all())
    with pytest.raises(ValueError, match="val_shift=32"):
        DigitsDataModule(val_shift=32)


def test_byte_text_windows():
    from examples.data import ByteTextDataModule

    data = ByteTextDataModule(seq_len=16, batch_size=4, val_windows=3)
    data.setup()
    tokens, targets = next(iter(data.train_dataloader()))
    assert tokens.shape == targets.shape == (4, 16) and tokens.dtype == torch.long
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    again, _ = next(iter(data.train_dataloader()))
    assert torch.equal(tokens, again)  # seeded sampler: the same windows every time
    assert len(data.val_dataloader().dataset) == 3


def test_digits_and_local_cifar10(tmp_path):
    from examples.data import DigitsDataModule

    data = DigitsDataModule(image_size=32, batch_size=8)
    data.setup()
    images, labels = next(iter(data.train_dataloader()))
    assert images.shape == (8, 3, 32, 32) and labels.max() < 10
    assert len(data.train_set) + len(data.val_set) == 1797
    with pytest.raises(FileNotFoundError, match="data_batch_1"):
        DigitsDataModule(cifar10_dir=str(tmp_path)).setup()
    folder = tmp_path / "cifar-10-batches-py"  # a fake CIFAR-10 in the pickle layout, 4 images per batch
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (4, 3072), dtype=np.uint8), b"labels": [0, 1, 2, 9]}
        (folder / name).write_bytes(pickle.dumps(batch))
    cifar = DigitsDataModule(image_size=16, batch_size=4, cifar10_dir=str(tmp_path))
    cifar.setup()
    assert len(cifar.train_set) == 20 and len(cifar.val_set) == 4
    assert cifar.train_set.tensors[0].shape == (20, 3, 16, 16)


def test_main_returns_none_for_console_scripts(tmp_path):
    """Console scripts call ``sys.exit(main())``: anything but None would become exit status 1."""
    from lightning_qstate.cli import main

    assert (
        main(["fit", "--config", str(CONFIGS / "vit_fp32.yaml"), f"--trainer.logger.init_args.save_dir={tmp_path}", *SHORT, *TINY_VIT])
        is None
    )


def test_example_script_entry(tmp_path):
    """``python examples/vit.py`` from any directory resolves the configs' ``examples.*`` class paths."""
    import subprocess

    script = CONFIGS.parent / "vit.py"
    result = subprocess.run(
        [sys.executable, str(script), "fit", "--config", str(CONFIGS / "vit_int8.yaml"), "--print_config"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "class_path: examples.vit.ViTModule" in result.stdout and "lightning_qstate.plugins.QStatePrecision" in result.stdout


def test_demo_tells_the_story_on_a_quiet_console(tmp_path):
    """``make demo``'s config, tiny and short, as a user runs it: the summary tells memory, stalls, resets (or why none
    fired), the adaptive plan, the probe, the advisor and the report command; known third-party noise is filtered."""
    command = [sys.executable, "-m", "lightning_qstate.cli", "fit", "--config", str(CONFIGS / "gpt_demo.yaml")]
    command += [f"--trainer.logger.init_args.save_dir={tmp_path}", *ADAPTIVE_GPT, "--model.init_args.n_positions=32"]
    command += ["--trainer.max_steps=8", "--trainer.val_check_interval=4", "--trainer.limit_val_batches=2", "--trainer.log_every_n_steps=2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    summary = output.split("== lightning_qstate run summary")[1]
    for line in ("optimizer states:", "stalled updates (last measurement, measured / predicted): exp_avg", "adaptive bit-widths:",
                 "quantization probe (step", "precision advisor:", "report: lightning-qstate report"):  # fmt: skip
        assert line in summary, (line, summary)
    assert "state resets: none fired: the run took 8 steps, the shortest reset period is" in summary
    for noise in ("register_constant", "CUDA_HOME", "💡 Tip", "LeafSpec", "was deprecated", "/-2", "Total FLOPs: 0"):
        assert noise not in output, (noise, output[-3000:])


@pytest.mark.parametrize(
    "config, extra, metrics", [("gpt_int8.yaml", TINY_GPT, {"test_loss"}), ("vit_int8.yaml", TINY_VIT, {"test_loss", "test_acc"})]
)
def test_examples_test_on_the_held_out_split(config, extra, metrics, tmp_path):
    """``test`` runs (it raised Lightning's missing test_step error) on the data modules' held-out split."""
    cli = fit(config, tmp_path, *extra)
    (results,) = cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)
    assert set(results) == metrics and all(np.isfinite(value) for value in results.values())


class BatchRecorder(pl.LightningModule):
    """A linear model on the first 64 features of each batch; records every training batch's sum."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(64, 10)
        self.seen: list[float] = []

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        self.seen.append(float(inputs.float().sum()))
        logits = self.net(inputs.float().flatten(1)[:, :64])
        return torch.nn.functional.cross_entropy(logits, targets.reshape(len(logits), -1)[:, 0] % 10)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("data", ["digits", "text"])
@pytest.mark.parametrize("limit", [None, 7])
def test_data_modules_resume_mid_epoch_on_the_uninterrupted_batches(data, limit, tmp_path):
    """A fit resumed from a checkpoint trains on the batches the uninterrupted fit does: mid-epoch (the sampler restarted
    its epoch, Lightning warned) and at an epoch's end (the generator restarted: epoch 2 repeated epoch 1's order), also
    with ``limit_train_batches`` (epochs that end before the data does)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from examples.data import ByteTextDataModule, DigitsDataModule

    def run(steps: int, ckpt_path=None, every=None) -> BatchRecorder:
        torch.manual_seed(0)
        model = BatchRecorder()
        module = DigitsDataModule(image_size=8, batch_size=64) if data == "digits" else ByteTextDataModule(seq_len=64, batch_size=64)
        callbacks = [ModelCheckpoint(dirpath=tmp_path / str(steps), every_n_train_steps=every, save_top_k=-1)] if every else []
        trainer = pl.Trainer(
            max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
            enable_checkpointing=bool(every), limit_val_batches=0, limit_train_batches=limit,
        )  # fmt: skip
        trainer.fit(model, module, ckpt_path=ckpt_path)
        return model

    uninterrupted = run(30)
    for at in (9, 14, 22):  # digits: 22 batches an epoch (9, 14: mid-epoch; 22: its end); limit 7: 2, 0 (an end), 1 into an epoch
        run(at, every=at)
        (checkpoint,) = (tmp_path / str(at)).glob("*.ckpt")
        resumed = run(30, ckpt_path=checkpoint)
        assert resumed.seen == uninterrupted.seen[at:], at
        assert torch.equal(resumed.net.weight, uninterrupted.net.weight), at


def test_a_loader_state_from_other_generators_warns_and_draws_afresh():
    """A checkpoint's loader state whose generators do not fit this loader's (resumed on another number of devices:
    under DDP Lightning's DistributedSampler has none) warns and draws the epoch afresh (it raised at the first batch)."""
    from torch.utils.data import SequentialSampler

    from examples.data import ResumableLoader

    data = torch.arange(40.0)
    shuffled = ResumableLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0), batches_done=lambda: 2)
    ordered = ResumableLoader(data, batch_size=4, sampler=SequentialSampler(data), batches_done=lambda: 2)
    ordered.load_state_dict(shuffled.state_dict())
    with pytest.warns(UserWarning, match="other random generators"):
        batches = list(ordered)
    assert torch.equal(torch.cat(batches), data[8:])  # past the 2 batches trained on
