"""Smoke test of ``benchmarks/adaptive_bits.py``: a ``--quick`` run (tiny GPT and ViT, a few steps, every configuration)."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("transformers")
pytest.importorskip("timm")
pytest.importorskip("sklearn")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "adaptive_bits.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("benchmarks_adaptive_bits", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_quick_run(bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["adaptive_bits.py"])
    out = tmp_path / "results" / "adaptive_bits.md"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = bench.main(["--quick", "--out", str(out)])
    assert out.read_text() == text
    assert "`python benchmarks/adaptive_bits.py --quick --out" in text and "## Targets" in text
    for model in ("gpt", "vit"):
        section = text.split(f"### {model}:")[1].split("###")[0]
        header, _, *lines = [line for line in section.splitlines() if line.startswith("|")]
        columns = [cell.strip() for cell in header.strip("|").split("|")]
        rows = {cells[0]: dict(zip(columns, cells)) for cells in ([cell.strip() for cell in line.strip("|").split("|")] for line in lines)}
        assert set(rows) == set(bench.CONFIGS)
        bits = {config: float(row["avg bits/value"]) for config, row in rows.items()}
        assert bits["fp32"] == 32.0 and 8.0 < bits["int8"] < 8.5 and 4.0 < bits["int4"] < 4.5
        assert bits["adaptive"] <= 5.1
        assert "%" in rows["adaptive"]["callback overhead"] and rows["fp32"]["callback overhead"] == "–"
        assert "adaptive at the end: zones critical" in section
    assert text.count("PASS") + text.count("FAIL") == 9  # 4 targets per model, and the ViT's accuracy


def test_arguments_are_checked(bench: ModuleType) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--configs", "fp16"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "resnet"])
