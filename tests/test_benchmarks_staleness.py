"""Smoke test of ``benchmarks/staleness.py``: a ``--quick`` run of a few steps writes the paper-style table."""

from __future__ import annotations

import pytest

from benchmark_scripts import load_benchmark

pytest.importorskip("transformers")


def load():
    return load_benchmark("staleness")


def test_quick_runs_are_short(monkeypatch, tmp_path):
    """``--quick`` ("three short runs") shortens the runs (they trained the full 3000 steps)."""
    bench = load()

    class Launched(Exception):
        pass

    def launch(spec):
        raise Launched(spec.steps)

    monkeypatch.setattr(bench, "launch", launch)
    with pytest.raises(Launched, match="^60$"):
        bench.main(["--quick", "--out", str(tmp_path / "staleness.md")])


def test_quick_runs_take_the_formats_asked_for(monkeypatch, tmp_path):
    """``--quick --formats fp8_e4m3`` runs that format's RN and SR + resets (it ran fp32 and bf16 whatever was asked)."""
    bench = load()
    launched = []

    def launch(spec):
        launched.append((spec.states, spec.variant))
        return {"spec": {"states": spec.states, "variant": spec.variant}}

    monkeypatch.setattr(bench, "launch", launch)
    monkeypatch.setattr(bench, "render", lambda *args: "")
    bench.main(["--quick", "--formats", "fp8_e4m3", "--out", str(tmp_path / "staleness.md")])
    assert launched == [("fp8_e4m3", "RN"), ("fp8_e4m3", "SR + resets")]
    launched.clear()
    bench.main(["--quick", "--out", str(tmp_path / "staleness.md")])
    assert launched == [("fp32", "RN"), ("bf16", "RN"), ("bf16", "SR + resets")]
    assert [spec.variant for spec in bench.specs(3000, False, ("fp32", "e2m2"))] == ["RN", "resets only", *bench.VARIANTS]


def test_quick_run_writes_the_table(tmp_path):
    bench = load()
    out = tmp_path / "staleness.md"
    results = bench.main(["--quick", "--steps", "24", "--jobs", "2", "--out", str(out)])
    assert set(results) == {("fp32", "RN"), ("bf16", "RN"), ("bf16", "SR + resets")}
    text = out.read_text()
    assert "| RN | " in text and "| SR + resets | " in text and "--quick" in text
    assert "measurements (one step in 2)" in text  # a tenth of the 24-step runs, not the full runs' 50
    bf16 = results["bf16", "RN"]
    assert bf16["state_bytes"] * 2 == bf16["fp32_bytes"] and results["fp32", "RN"]["stall_v"] is None
    assert 0.0 <= bf16["stall_v"] <= 1.0 and bf16["stall_v_predicted"] == pytest.approx(bf16["stall_v"], abs=0.06)
