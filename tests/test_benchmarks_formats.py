"""Smoke test of ``benchmarks/formats.py``: a tiny run, with and without the peers installed."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import ModuleType

import pytest

from benchmark_scripts import load_benchmark

PEER_MODULES = (
    "torchao",
    "torchao.optim",
    "torchao.optim.quant_utils",
    "torchao.optim.subclass_8bit",
    "torchao.optim.subclass_4bit",
    "bitsandbytes",
    "bitsandbytes.functional",
    "bitsandbytes.cextension",
)


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("formats")


def expected_labels(bench: ModuleType) -> list[str]:
    """``name[ unsigned] · RN|SR`` of every format the script promises."""
    labels = []
    for name, signed in bench.OUR_FORMATS:
        for rounding in ("RN",) if name == "fp32" else ("RN", "SR"):
            labels.append(f"{name}{'' if signed else ' unsigned'} · {rounding}")
    return labels


def run_tiny(bench: ModuleType, out: Path):
    return bench.main(["--numel", "1024", "--repeats", "1", "--seed", "1", "--out", str(out), "--quiet"])


def check_ours(bench: ModuleType, report, out: Path) -> None:
    text = out.read_text()
    assert text == report.text
    for label in expected_labels(bench):
        assert f"| {label} |" in text, label
    ours = [row for row in report.rows if row.method.family == "ours"]
    assert {row.method.label for row in ours} == set(expected_labels(bench))
    assert len(ours) == 3 * 19 + 25  # signed formats on all four kinds, unsigned ones on v-like only
    for row in ours:
        assert row.failure is None, (row.method.label, row.failure)
        assert math.isfinite(row.rel_rms) and math.isfinite(row.max_rel), row.method.label
        assert 0 <= row.rel_rms < 1 and row.bits_per_value > 0
    assert "**Verdict**" in text and "torch " in text and "--numel 1024" in text


def test_tiny_run(bench: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "results" / "formats.md"
    report = run_tiny(bench, out)
    check_ours(bench, report, out)
    fp32 = [row for row in report.rows if row.method.base == "fp32"]
    assert all(row.rel_rms == 0 for row in fp32)


def test_tiny_run_without_peers(bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PEER_MODULES:
        monkeypatch.setitem(sys.modules, name, None)  # makes ``import name`` raise ImportError
    out = tmp_path / "formats.md"
    report = run_tiny(bench, out)
    check_ours(bench, report, out)
    peers = [row for row in report.rows if row.method.family != "ours"]
    assert peers and all(row.failure for row in peers)
    assert "n/a (" in report.text
    assert "no peer result to compare with" in report.text
