"""Smoke test of ``benchmarks/optim.py``: a ``--quick`` run, with and without the peers installed."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from benchmark_scripts import load_benchmark

PEERS = {"torchao-adamw8bit": "torchao", "bnb-adamw8bit": "bitsandbytes"}


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("optim")


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def run_quick(bench: ModuleType, out: Path, methods: list[str], models: str):
    argv = ["--quick", "--no-compile", "--quiet", "--profile", "none", "--methods", ",".join(methods), "--models", models]
    argv += ["--out", str(out)]
    return bench.main(argv)


def check_rows(report, out: Path, methods: list[str], models: list[str]) -> None:
    text = out.read_text()
    assert text == report.text
    assert "torch " in text and "--quick" in text and "## Verdicts" in text
    assert {(row.method.key, row.model) for row in report.rows} == {(key, model) for key in methods for model in models}
    for model in models:
        assert f"### {model}:" in text
    for row in report.rows:
        assert f"| {row.method.label}" in text
        if row.method.family in ("torch", "ours"):
            assert row.failure is None, (row.method.key, row.failure)
        if row.failure is None:
            assert row.times_ms and all(math.isfinite(t) and t > 0 for t in row.times_ms), row.method.key
            assert math.isfinite(row.first_step_s) and math.isfinite(row.rss_peak_mb) and row.rss_peak_mb > 0
            assert math.isfinite(row.step_rss_increase_mb) and math.isfinite(row.first_rss_increase_mb)
            assert 0 < row.bytes_per_param < 9, (row.method.key, row.bytes_per_param)
    by_key = {(row.method.key, row.model): row for row in report.rows}
    for model in models:
        assert by_key[("adamw-fused", model)].bytes_per_param == pytest.approx(8, abs=0.01)
        if ("qadamw-int8-rn", model) in by_key:
            assert by_key[("qadamw-int8-rn", model)].bytes_per_param < by_key[("adamw-fused", model)].bytes_per_param / 2


def test_quick_run(bench: ModuleType, tmp_path: Path) -> None:
    methods = ["adamw-fused", "qadamw-int8-rn"] + (["bnb-adamw8bit"] if installed("bitsandbytes") else [])
    out = tmp_path / "results" / "optim.md"
    report = run_quick(bench, out, methods, models="mlp")
    check_rows(report, out, methods, ["mlp"])
    assert "(a) QAdamW int8 · RN step" in report.text and ("PASS" in report.text or "FAIL" in report.text)


def test_quick_run_without_peers(bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Peers that cannot be imported (hidden from the workers by stub modules) show as n/a rows; nothing fails.

    The transformer (the other test has the MLP) and no QAdamW row, to keep it quick: each row is a worker
    process that imports torch.
    """
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    for module in PEERS.values():
        (stubs / f"{module}.py").write_text("raise ImportError('hidden by the test')\n")
        monkeypatch.setitem(sys.modules, module, None)  # the parent's version lookup
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(stubs), *filter(None, [os.environ.get("PYTHONPATH")])]))
    methods = ["adamw-fused", *PEERS]
    out = tmp_path / "optim.md"
    report = run_quick(bench, out, methods, models="transformer")
    check_rows(report, out, methods, ["transformer"])
    peers = [row for row in report.rows if row.method.key in PEERS]
    assert peers and all(row.failure and "hidden by the test" in row.failure for row in peers)
    assert "n/a (" in report.text


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads /proc")
def test_timed_steps_wait_for_the_other_workers_to_sleep(bench: ModuleType) -> None:
    """``wait_for_quiet`` returns once a process sleeps and waits out its timeout for a spinning one."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; print(flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        sleeper.stdout.readline()  # started: from here on it only goes to sleep
        assert bench.wait_for_quiet([sleeper.pid], timeout=30.0) < 30.0
        assert bench.running_threads([sleeper.pid]) == 0
        deadline = time.monotonic() + 30.0
        while bench.running_threads([spinner.pid]) == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # may still read files while it starts
        assert bench.running_threads([spinner.pid]) == 1
        assert bench.wait_for_quiet([sleeper.pid, spinner.pid], timeout=0.2) >= 0.2
    finally:
        for process in (sleeper, spinner):
            process.kill()
            process.wait()
        sleeper.stdout.close()
    assert bench.running_threads([spinner.pid]) == 0  # gone: no /proc entry


def test_quick_run_in_one_process(bench: ModuleType, tmp_path: Path) -> None:
    """``--mode shared``: every method in one worker process (as an adaptive run uses several formats), each warmed up
    3 steps, then stepped round-robin; its table has each method's first step (build / compile) and the issue #22
    targets are judged on it."""
    methods = ["adamw-fused", "qadamw-int8-rn", "qadamw-int4-rn", "qadamw-fp8_e4m3-sr"]
    out = tmp_path / "optim.md"
    argv = ["--quick", "--no-compile", "--quiet", "--profile", "none", "--mode", "shared", "--repeats", "2", "--models", "mlp"]
    report = bench.main([*argv, "--methods", ",".join(methods), "--out", str(out)])
    assert out.read_text() == report.text
    assert {(row.method.key, row.model, row.mode) for row in report.rows} == {(key, "mlp", "shared") for key in methods}
    for row in report.rows:
        assert row.failure is None, (row.method.key, row.failure)
        assert len(row.times_ms) == 2 and all(math.isfinite(t) and t > 0 for t in row.times_ms), row.method.key
        assert math.isfinite(row.first_step_s) and row.first_step_s > 0 and len(row.warmup_s) == 2
        assert (row.method.family == "ours") == bool(row.paths)
    assert "### mlp, all methods in one process:" in report.text and "### mlp: MLP" not in report.text
    assert "first step s (build / compile)" in report.text
    assert "(d) every QAdamW format's step" in report.text and "all methods in one process: **" in report.text
    assert "a process per method: **" not in report.text
    by_key = {row.method.key: row for row in report.rows}
    assert by_key["adamw-fused"].bytes_per_param == pytest.approx(8, abs=0.01)
    assert by_key["qadamw-int4-rn"].bytes_per_param < by_key["qadamw-int8-rn"].bytes_per_param < 2.2


def test_paired_ratio_pairs_each_step_with_the_baselines_of_its_round(bench: ModuleType) -> None:
    """Each step time is divided by the baseline's in the same round, whatever order the rounds were recorded in, and
    rounds that either one lacks are left out; the median of those ratios is reported (NaN without a baseline)."""
    base = bench.Row(None, "mlp", times_ms=[10.0, 20.0, 40.0, 5.0], rounds=[0, 1, 2, 3])
    row = bench.Row(None, "mlp", times_ms=[60.0, 15.0, 30.0], rounds=[2, 0, 1])  # rotated; round 3 missing
    assert bench.paired_ratio(row, base) == 1.5  # ratios 1.5, 1.5, 1.5: not 60/10 or the medians' 30/15
    skewed = bench.Row(None, "mlp", times_ms=[10.0, 20.0, 400.0], rounds=[0, 1, 2])
    assert bench.paired_ratio(skewed, base) == 1.0  # ratios 1, 1, 10: the median
    assert math.isnan(bench.paired_ratio(row, None))
    assert math.isnan(bench.paired_ratio(row, bench.Row(None, "mlp", times_ms=[1.0], rounds=[7])))
