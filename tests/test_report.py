"""``lightning-qstate report``: the page rendered from a real run's event files, and its errors."""

from __future__ import annotations

import re
import warnings
from html import escape
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
from lightning_qstate.report import PANELS, load_scalars, main, render

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


TITLES = [escape(panel.title) for panel in PANELS]  # as the page writes them


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    callbacks = [
        QuantizedOptimizerStates(log_stats=True),
        StallMonitor(log_every_n_steps=2),
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
    assert png.stat().st_size > 10_000 and picture.shape[1] >= 1000 and picture.shape[0] >= 7 * 220  # seven panels, one column
    assert html.count("data:image/png;base64,") == 3  # the report and the callbacks' two figures, embedded
    assert all(f"<b>{title}</b>" in html for title in TITLES) and "Not in this run" not in html
    scalars = load_scalars(full_run)
    step, val_loss = scalars["val_loss"][-1]
    assert re.search(rf"<td><code>val_loss</code></td><td>{step}</td><td>{val_loss:.6g}</td>", html)
    assert "<th>verdict</th>" in html and "<b>Precision advice" in html  # the advisor's markdown table as a table
    assert "<h3><code>qstate/adaptive/bit_widths</code> (last logged)" in html and "<h3><code>qstate/probe/abc</code>" in html
    assert "Average bits per state value the adaptive plan stores" in html  # the tags' descriptions (TAG_DESCRIPTIONS)


def test_the_stall_panel_draws_measured_predicted_and_resets(full_run):
    scalars = load_scalars(full_run)
    figure, drawn = render(scalars)
    assert [escape(panel.title) for panel in drawn] == TITLES
    stall = next(axis for axis in figure.axes if axis.get_title(loc="left").startswith("Stalled"))
    lines = {line.get_label(): line for line in stall.get_lines()}
    for state in ("exp_avg", "exp_avg_sq"):
        measured, predicted = lines[f"{state} measured"], lines[f"{state} predicted"]
        assert list(measured.get_xdata()) == [step for step, _ in scalars[f"qstate/stall/{state}"]]
        assert list(predicted.get_ydata()) == pytest.approx([rate for _, rate in scalars[f"qstate/stall_predicted/{state}"]])
    assert "weights measured" in lines
    resets = [step for step, layers in scalars["qstate/reset/layers"] if layers > 0]
    assert resets and len([line for line in stall.get_lines() if line.get_linestyle() == "-" and line.get_color() == "grey"]) == len(resets)
    assert stall.get_ylim() == (0, 1.02) and "fraction" in stall.get_ylabel()
    memory = next(axis for axis in figure.axes if axis.get_title(loc="left") == "Optimizer-state memory")
    assert (
        memory.get_lines()[0].get_ydata()[-1] == pytest.approx(scalars["qstate/state_bytes"][-1][1] / 1e6) and "MB" in memory.get_ylabel()
    )


def test_a_run_with_only_the_loss_names_the_missing_monitors(tmp_path):
    run = train(tmp_path, [], [])
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0
    html = (tmp_path / "out" / "report.html").read_text()
    assert [title for title in TITLES if f"<b>{title}</b>" in html] == ["Loss"]
    missing = html.split("<h2>Not in this run</h2>")[1]
    for callback in ("QuantizedOptimizerStates(log_stats=True)", "StallMonitor", "StateResetScheduler", "AdaptiveBitWidth",
                     "QuantizationProbe", "PrecisionAdvisor"):  # fmt: skip
        assert f"add <code>{callback}</code>" in missing
    assert render(load_scalars(run))[1] == [PANELS[0]]


def test_a_reset_scheduler_that_has_not_reset_yet_is_in_the_run(tmp_path):
    """Before its first reset a StateResetScheduler logs nothing itself; StallMonitor's qstate/stall_resets shows it is
    there (StallMonitor logs it only beside one), so the report does not ask for it."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(tmp_path / "run") as writer:
        for step in range(3):
            for tag in ("train_loss", "qstate/stall/exp_avg", "qstate/stall_predicted/exp_avg", "qstate/stall_resets"):
                writer.add_scalar(tag, 0.4 if tag != "qstate/stall_resets" else 0.0, step)
    assert main([str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    missing = (tmp_path / "out" / "report.html").read_text().split("<h2>Not in this run</h2>")[1]
    assert "add <code>StallMonitor</code>" not in missing and "add <code>StateResetScheduler</code>" not in missing
    assert "add <code>AdaptiveBitWidth</code>" in missing


def test_usage_errors_exit_2_and_say_why(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert str(tmp_path) in error and "no TensorBoard event files" in error
    assert main([str(tmp_path / "absent")]) == 2 and "absent: no such directory" in capsys.readouterr().err
    assert main([]) == 2 and "RUN_DIR" in capsys.readouterr().err.upper()
    assert not (tmp_path / "report.html").exists()


def test_runs_mixed_damaged_files_and_an_out_file_are_usage_errors(tmp_path, capsys):
    """A directory above several runs (their series would interleave by step into one), event files that hold nothing
    readable, and ``--out`` naming a file exit 2 with the reason; nothing is written."""
    from torch.utils.tensorboard import SummaryWriter

    for version, value in enumerate((1.0, 2.0)):
        with SummaryWriter(tmp_path / "runs" / f"version_{version}") as writer:
            writer.add_scalar("train_loss", value, 0)
    assert main([str(tmp_path / "runs")]) == 2
    error = capsys.readouterr().err
    assert "holds the event files of 2 runs" in error and "version_0" in error and "version_1" in error
    (tmp_path / "report.html").write_text("")
    assert main([str(tmp_path / "runs" / "version_0"), "--out", str(tmp_path / "report.html")]) == 2
    assert "report.html is a file; pass a directory" in capsys.readouterr().err
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "events.out.tfevents.1.host").write_text("not an event file")
    assert main([str(damaged)]) == 2 and "hold no values: damaged" in capsys.readouterr().err
    assert not (damaged / "report.html").exists()
    assert main([str(tmp_path / "runs" / "version_1")]) == 0
    assert load_scalars(tmp_path / "runs" / "version_1") == {"train_loss": [(0, 2.0)]}


def test_the_cli_dispatches_report(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", str(tmp_path)])
    assert exit_info.value.code == 2 and "no TensorBoard event files" in capsys.readouterr().err


def test_a_file_is_not_a_run_directory(tmp_path, capsys):
    (tmp_path / "events.txt").write_text("")
    assert main([str(tmp_path / "events.txt")]) == 2
    assert "events.txt is a file, not a directory" in capsys.readouterr().err


def test_non_finite_values_are_listed_first_and_other_tags_are_described(tmp_path):
    """A loss that turned NaN is named at the top of the page with its first step, not left as a gap in the plot and
    a ``nan`` in the final values; the module's own tags say where they come from."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(tmp_path / "run") as writer:
        for step, loss in enumerate((2.0, 1.5, float("nan"), float("inf"), float("nan"))):
            writer.add_scalar("train_loss", loss, step)
            writer.add_scalar("qstate/state_bytes", 1e6, step)
    assert main([str(tmp_path / "run")]) == 0
    page = (tmp_path / "run" / "report.html").read_text()
    listed = page.split("<h2>Non-finite values (NaN or inf)</h2>")[1].split("</ul>")[0]
    assert "<code>train_loss</code>: first at step 2; 3 of its 5 logged values" in listed and "state_bytes" not in listed
    assert page.index("Non-finite values") < page.index("What the panels show")
    assert "<td><code>train_loss</code></td><td>4</td><td>nan</td><td>logged by the LightningModule or another callback" in page
    clean = tmp_path / "clean_run"
    with SummaryWriter(clean) as writer:
        writer.add_scalar("train_loss", 1.0, 0)
    assert main([str(clean)]) == 0 and "Non-finite" not in (clean / "report.html").read_text()
