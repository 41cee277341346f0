"""Smoke test of ``benchmarks/ptq_robustness.py``: a ``--quick`` run (tiny GPT, four runs), its report and plot, the
reuse of finished runs; the common-loss protocol and the correlations on made-up numbers."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest

from benchmark_scripts import load_benchmark, markdown_table

pytest.importorskip("transformers")
pytest.importorskip("pytorch_optimizer")
pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("ptq_robustness")


def test_quick_run_reports_every_run_and_reuses_them(bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["ptq_robustness.py"])
    out = tmp_path / "results" / "ptq.md"
    argv = ["--quick", "--runs", "adamw_0,muon_0,lion_0,adamw_int8", "--out", str(out), "--work", str(tmp_path / "work")]
    messages: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = bench.main(argv, progress=messages.append)
    assert out.read_text() == text and out.with_suffix(".png").stat().st_size > 10_000
    assert [message.split(":")[0] for message in messages] == ["adamw_0", "muon_0", "lion_0", "adamw_int8"]
    assert all("trained in" in message for message in messages)
    target = float(text.split("common loss **")[1].split("**")[0])
    common, final = (
        text.split(f"## {title}")[1].split("\n## ")[0] for title in ("At the common validation loss", "At the end of training")
    )
    last_validation = text.split("## Validation losses along each run")[1].split(" |\n")[0].split("step ")[-1]
    for section in (common, final):
        table = markdown_table([line for line in section.split("\n\n")[1].splitlines() if line.startswith("|")])
        assert list(table) == ["adamw_0", "muon_0", "lion_0", "adamw_int8"]
        for name, row in table.items():
            assert float(row["W4A4 increase"]) == pytest.approx(float(row["W4A4 loss"]) - float(row["val loss"]), abs=2e-4)
            assert float(row["R_L W4A4"]) > float(row["R_L W8A8"]) > 0 and float(row["MMR"]) > 1
            if section is common:
                assert float(row["val loss"]) <= target + 1e-9, name  # each at its first validation at or below the common loss
            else:
                assert row["step"] == last_validation, name
        assert "| W4A4 | optimizer runs | 3 |" in section and "| W8A8 | all runs | 4 |" in section
        assert "| adamw_int8 |" in section.split("Low-bit states and ECO")[1]
    assert "- At the common validation loss, W4A4, optimizer runs: R_L predicts the PTQ increase better" in text
    assert "- At the end of training, W8A8, optimizer runs:" in text
    messages.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = bench.main(argv, progress=messages.append)
    assert all("reused" in message for message in messages) and again.split("- date:")[0] == text.split("- date:")[0]


def test_common_loss_is_the_worst_optimizers_best(bench: ModuleType) -> None:
    trajectories = {
        "adamw_0": [(25, 3.0), (50, 2.0)],
        "adamw_1": [(25, 3.5), (50, 2.6)],
        "sgd_0": [(25, math.nan), (50, 9.0)],  # SGD at its worse rate...
        "sgd_1": [(25, 3.5), (50, 2.5), (75, 2.4)],  # ... and its better one, which reaches 2.4: the common loss
        "adamw_int4": [(25, 3.6), (50, 2.45)],  # low-bit runs never set it; this one does not reach it
    }
    target, left_out = bench.common_loss(trajectories)
    assert (target, left_out) == (2.4, ["adamw_1", "sgd_0", "adamw_int4"])
    assert bench.first_at(trajectories["adamw_0"], target) == 50 and bench.first_at(trajectories["sgd_1"], target) == 75
    with pytest.raises(RuntimeError, match="no common loss"):
        bench.common_loss({"adamw_0": [(25, math.nan)]})


def test_correlations(bench: ModuleType) -> None:
    assert bench.ranks([3.0, 1.0, 3.0, 2.0]) == [3.5, 1.0, 3.5, 2.0]
    x = [1.0, 2.0, 3.0, 4.0, 5.0]
    assert bench.pearson(x, [2 * v + 1 for v in x]) == pytest.approx(1.0)
    assert bench.spearman(x, [v**3 for v in x]) == pytest.approx(1.0) and bench.pearson(x, [v**3 for v in x]) < 1
    assert bench.spearman(x, [-v for v in x]) == pytest.approx(-1.0)
    assert math.isnan(bench.pearson([1.0, 1.0, 1.0], [1.0, 2.0, 3.0])) and math.isnan(bench.pearson([1.0, 2.0], [1.0, 2.0]))
