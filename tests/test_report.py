"""``lightning-qstate report``: the page rendered from a real run's event files, and its errors."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import lightning.pytorch as pl
import matplotlib.image
import pytest
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_qstate import cli
from lightning_qstate.callbacks import (
    AdaptiveBitWidth,
    PrecisionAdvisor,
    QuantizationProbe,
    QuantizedOptimizerStates,
    StallMonitor,
    StateResetScheduler,
)
from lightning_qstate.plugins import QStatePrecision
from lightning_qstate.report import load_scalars, main

pytest.importorskip("transformers")


def train(log_dir: Path, callbacks: list, plugins: list) -> Path:
    from examples.data import ByteTextDataModule
    from examples.gpt import GPTModule

    pl.seed_everything(0, verbose=False)
    logger = TensorBoardLogger(log_dir, name="run", version=0)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=12, log_every_n_steps=2, val_check_interval=4, check_val_every_n_epoch=None, logger=logger,
        limit_val_batches=2, num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=plugins, callbacks=callbacks,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(GPTModule(n_embd=32, n_layer=1, n_head=2, n_positions=32), ByteTextDataModule(seq_len=32, batch_size=4, val_windows=8))
    logger.experiment.flush()
    return Path(logger.log_dir)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    callbacks = [
        QuantizedOptimizerStates(log_stats=True),
        StallMonitor(),
        StateResetScheduler(period=5),
        AdaptiveBitWidth(target_bits=6.0, interval=3, hysteresis=1),
        QuantizationProbe(batches=1, verbose=False),
        PrecisionAdvisor(verbose=False),
    ]
    return train(tmp_path_factory.mktemp("full"), callbacks, [QStatePrecision(states="int8", rounding="nearest", min_quant_size=0)])


def test_report_of_a_run_with_every_monitor(full_run, capsys):
    assert main([str(full_run)]) == 0
    html, png = (full_run / "report.html").read_text(), full_run / "report.png"
    assert str(full_run / "report.html") in capsys.readouterr().out
    picture = matplotlib.image.imread(png)
    assert png.stat().st_size > 10_000 and picture.shape[1] >= 900 and picture.shape[0] >= 4 * 250  # five panels
    assert "data:image/png;base64," in html
    for title in ("Loss", "Optimizer-state memory", "Stalled state updates", "Adaptive bit-widths", "Quantization probe"):
        assert title in html
    assert "Not in this run" not in html
    scalars = load_scalars(full_run)
    assert scalars["qstate/stall/exp_avg_sq"] and scalars["qstate/stall_predicted/exp_avg_sq"]  # both on the stall panel
    assert any(layers > 0 for _, layers in scalars["qstate/reset/layers"])  # resets fired (period 5 in 12 steps)
    step, val_loss = scalars["val_loss"][-1]
    assert re.search(rf"<code>val_loss</code></td><td>{step}</td><td>{val_loss:.6g}</td>", html)
    assert "qstate/precision_advice" in html and "Precision advice" in html  # the advisor's report, quoted
    assert "<h2>qstate/adaptive/bit_widths (last)</h2>" in html and "<h2>qstate/probe/abc (last)</h2>" in html


def test_a_run_with_only_the_loss_names_the_missing_monitors(tmp_path):
    run = train(tmp_path, [], [])
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0
    html = (tmp_path / "out" / "report.html").read_text()
    assert "<b>Loss</b>" in html and "Stalled state updates" not in html.split("Not in this run")[0]
    missing = html.split("Not in this run")[1]
    assert "StallMonitor and StateResetScheduler" in missing and "AdaptiveBitWidth" in missing and "QuantizationProbe" in missing


def test_a_directory_without_event_files_is_a_usage_error(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert str(tmp_path) in error and "no TensorBoard event files" in error


def test_the_cli_dispatches_report(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", str(tmp_path)])
    assert exit_info.value.code == 2 and "no TensorBoard event files" in capsys.readouterr().err
