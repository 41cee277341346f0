"""What ``lightning-qstate`` prints besides the run: the progress bar it gives a Trainer (no ``Epoch 0/-2``, no ``v_num``)
and the known third-party warnings ``main`` filters (only those)."""

from __future__ import annotations

import sys
import warnings

import pytest
from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from lightning_qstate import cli

BORING = ["--model=lightning.pytorch.demos.boring_classes.BoringModel", "--trainer.accelerator=cpu"]


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-qstate"])


def progress_bars(*args: str) -> list[ProgressBar]:
    trainer = cli.build_cli([*BORING, "--trainer.logger=false", *args], run=False).trainer
    return [callback for callback in trainer.callbacks if isinstance(callback, ProgressBar)]


def test_the_default_progress_bar_has_no_negative_epoch_limit_nor_v_num(tmp_path):
    built = cli.build_cli([*BORING, f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=5"], run=False)
    trainer, model = built.trainer, built.model
    (bar,) = [callback for callback in trainer.callbacks if isinstance(callback, ProgressBar)]
    bar._trainer = trainer  # as Lightning attaches it in setup
    model.trainer = trainer
    trainer.fit_loop.max_epochs = -1  # what Lightning sets when max_steps ends the run
    if hasattr(bar, "_get_train_description"):  # the rich bar (rich installed)
        assert bar._get_train_description(0).rstrip() == "Epoch 0"
        trainer.fit_loop.max_epochs = 3
        assert bar._get_train_description(0).rstrip() == "Epoch 0/2"
    assert trainer.loggers and "v_num" not in bar.get_metrics(trainer, model)


def test_one_run_summary_where_the_config_lists_one():
    """The CLI adds a RunSummary; a config that lists one too printed the summary twice."""
    from lightning_qstate.callbacks import RunSummary

    def summaries(*args: str) -> int:
        trainer = cli.build_cli([*BORING, "--trainer.logger=false", *args], run=False).trainer
        return sum(isinstance(callback, RunSummary) for callback in trainer.callbacks)

    assert summaries() == 1 and summaries("--trainer.callbacks+=lightning_qstate.callbacks.RunSummary") == 1


def test_the_summary_names_the_tensorboard_folder_and_a_resumed_fits_steps(tmp_path):
    """With a CSVLogger before the TensorBoard one, the summary's logs and report lines named the CSV folder (the report
    found no event files there); a resumed fit printed the checkpoint's steps too beside its own seconds (one resumed at
    max_steps, where no training runs, printed its steps as if it had run them all)."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    from lightning_qstate.callbacks import RunSummary

    def fit(max_steps: int, ckpt_path: str | None = None, logged: bool = True) -> tuple[Trainer, RunSummary]:
        summary = RunSummary()
        trainer = Trainer(
            accelerator="cpu", max_steps=max_steps, default_root_dir=tmp_path, callbacks=[summary], enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
            logger=[CSVLogger(tmp_path, name="csv"), TensorBoardLogger(tmp_path, name="tb")] if logged else False,
        )  # fmt: skip
        trainer.fit(BoringModel(), ckpt_path=ckpt_path)
        return trainer, summary

    trainer, summary = fit(4)
    printed = summary.format()
    assert ", 4 steps) ==" in printed.splitlines()[0]
    assert f"report: lightning-qstate report {tmp_path / 'tb' / 'version_0'} " in printed and "csv" not in printed
    trainer.save_checkpoint(tmp_path / "four.ckpt")
    assert ", steps 4 -> 6) ==" in fit(6, str(tmp_path / "four.ckpt"))[1].format().splitlines()[0]
    assert ", steps 4 -> 4) ==" in fit(4, str(tmp_path / "four.ckpt"))[1].format().splitlines()[0]  # resumed at max_steps: none ran
    assert "logs" not in fit(2, logged=False)[1].format()  # it named default_root_dir, where nothing was logged


def test_a_configured_progress_bar_or_none_is_left_alone():
    (bar,) = progress_bars("--trainer.callbacks+=TQDMProgressBar", "--trainer.callbacks.refresh_rate=7")
    assert type(bar) is TQDMProgressBar and bar.refresh_rate == 7
    assert progress_bars("--trainer.enable_progress_bar=false") == []


MESSAGES = [  # (message, category, module) as the third-party code raises them
    ("\n    ``ArgumentParser.add_instantiator`` was deprecated in v4.49.0 and will be\n", DeprecationWarning, "lightning.pytorch.cli"),
    ("\n    ``instantiate_classes`` was deprecated in v4.49.0 and will be removed\n", DeprecationWarning, "lightning.pytorch.cli"),
    ("\n    skip_none parameter was deprecated in v4.49.0 and will be removed in v5.0.0.\n", DeprecationWarning, "lightning.pytorch.cli"),
    ("\n    By default only one JsonargparseDeprecationWarning per type is shown. To see\n", DeprecationWarning, "lightning.pytorch.cli"),
    ("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, "lightning.pytorch.utilities._pytree"),
    ("`GPTModule.configure_optimizers` will be overridden by `LightningCLI.configure_optimizers`.", UserWarning, "lightning.pytorch.cli"),
    ("The 'train_dataloader' does not have many workers which may be a bottleneck. Consider", PossibleUserWarning, "lightning.pytorch.x"),
]


def caught(message: str, category: type[Warning], module: str) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cli.quiet_known_noise()
        warnings.warn_explicit(message, category, "somewhere.py", 1, module=module)
    return seen


@pytest.mark.parametrize(("message", "category", "module"), MESSAGES)
def test_known_third_party_warnings_are_filtered(message, category, module):
    assert caught(message, category, module) == []


@pytest.mark.parametrize(
    ("message", "category", "module"),
    [
        ("StateResetScheduler(include_fp32=True): resetting fp32 states slightly hurts training", UserWarning, "lightning_qstate.x"),
        ("PrecisionAdvisor: AdamW group 0 exp_avg_sq in int5 is marginal", UserWarning, "lightning_qstate.callbacks.precision_advisor"),
        ("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, "mypackage"),  # not Lightning's: shown
        ("``instantiate_classes`` was deprecated", UserWarning, "lightning.pytorch.cli"),  # another category: shown
    ],
)
def test_other_warnings_are_shown(message, category, module):
    assert len(caught(message, category, module)) == 1
