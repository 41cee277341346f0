"""Smoke test of ``benchmarks/adaptive_bits.py``: a ``--quick`` run (tiny GPT and ViT, a few steps, every base configuration
and two with stochastic rounding, two seeds)."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest

from benchmark_scripts import load_benchmark, markdown_table

pytest.importorskip("transformers")
pytest.importorskip("timm")
pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("adaptive_bits")


def test_quick_run(bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["adaptive_bits.py"])
    out = tmp_path / "results" / "adaptive_bits.md"
    configs = (*bench.BASE_CONFIGS, "adaptive_sr", "int4_sr")
    roundings: list[str] = []  # of each quantized run's plugin, in run order
    plugin = bench.QStatePrecision
    monkeypatch.setattr(bench, "QStatePrecision", lambda **options: roundings.append(options["rounding"]) or plugin(**options))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = [
            "--quick",
            "--seeds",
            "0",
            "1",
            "--configs",
            ",".join(configs),
            "--out",
            str(out),
            "--rows",
            str(tmp_path / "rows.jsonl"),
        ]
        text = bench.main(args)
    assert out.read_text() == text
    assert "- the C++ step was built (or loaded from its cache) before the first run, outside every timing: " in text
    assert roundings == 2 * 2 * (6 * ["nearest"] + 2 * ["stochastic"])  # 2 models x 2 seeds; fp32 has no plugin
    assert f"`python benchmarks/adaptive_bits.py --quick --seeds 0 1 --configs {','.join(configs)} --out" in text and "## Targets" in text
    for model in ("gpt", "vit"):
        section = text.split(f"### {model}:")[1].split("###")[0]
        assert "; seeds 0, 1" in section.splitlines()[0]
        tables = [[line for line in block.splitlines() if line.startswith("|")] for block in section.split("\n\n")]
        means, per_seed = (markdown_table(lines) for lines in tables if lines)
        assert set(means) == set(per_seed) == set(configs)
        bits = {config: float(row["avg bits/value"]) for config, row in means.items()}
        assert bits["fp32"] == 32.0 and 8.0 < bits["int8"] < 8.5 and 4.0 < bits["int4"] < 4.5
        assert 6.0 < bits["m_int4"] < 6.5 and 6.0 < bits["v_int4"] < 6.5  # one state at 8 bits, the other at 4
        assert 5.0 < bits["m4_v6"] < 5.5  # dense 6-bit v: 6 bits a value, not 8
        assert bits["adaptive"] <= 5.1 and bits["adaptive_sr"] <= 5.1 and 4.0 < bits["int4_sr"] < 4.5
        assert "%" in means["adaptive"]["callback overhead"]
        assert means["fp32"]["callback overhead"] == "–"
        assert all(float(row["update × fused fp32"]) > 0 for row in means.values())
        assert all(float(row["median update ms"]) > 0 for row in means.values())
        assert means["int8"]["Δ mean loss vs int8"] == "+0.00 %"
        loss, spread = (float(part) for part in means["adaptive"]["val loss"].split(" ± "))  # mean ± sd over the two seeds
        seed_losses = [float(per_seed["adaptive"][f"seed {seed}"].split()[0].rstrip(",")) for seed in (0, 1)]  # "loss (acc), Δ ..."
        assert loss == pytest.approx(sum(seed_losses) / 2, abs=2e-4) and spread == pytest.approx(
            abs(seed_losses[0] - seed_losses[1]) / 2**0.5, abs=2e-4
        )
        assert "Δ" in per_seed["adaptive"]["seed 1"] and "Δ" not in per_seed["int8"]["seed 1"]
        assert section.count("\nadaptive, seed ") == section.count("\nadaptive_sr, seed ") == 2 and "at the end: zones critical" in section
    # per adaptive configuration: bits, saving, overhead, the update against paired fused fp32 steps, loss vs int8, int4 and int4_sr;
    # ViT: accuracy vs the three too
    verdicts = [line for line in text.split("## Targets")[1].splitlines() if line.startswith("- ")]
    assert len(verdicts) == 2 * (7 + 10) and all(re.search(r": (PASS|FAIL|NOT RESOLVED) \(", line) for line in verdicts)
    assert text.count("optimizer update <= 1.5x torch's fused fp32 AdamW's (median of the per-step paired ratios)") == 4
    assert text.count("- gpt adaptive_sr: final val loss: better than fixed int4_sr by more than 2 standard errors") == 1
    assert text.count("vs fixed int8 within 0.3 % (95 % interval)") == 2 * 3  # the paired per-seed differences
    assert text.count("better than fixed int4 by more than 2 standard errors") == text.count("better than fixed int4_sr by") == 2 * 3
    trained = []
    monkeypatch.setattr(bench, "run_config", lambda *args: trained.append(args))
    assert bench.main(args).split("## Targets")[1] == text.split("## Targets")[1]  # every run reused from --rows
    assert trained == []


def test_arguments_are_checked(bench: ModuleType) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--configs", "fp16"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--configs", "fp32_sr"])  # fp32 states have no rounding
    with pytest.raises(SystemExit):
        bench.parse_args(["--models", "resnet"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--seeds", "0", "0"])
    assert bench.parse_args([]).seeds == [0, 1, 2]
    assert bench.parse_args([]).config_names == ["fp32", "int8", "int4", "adaptive"]


def test_paired_differences_and_verdicts_on_made_up_runs(bench: ModuleType) -> None:
    """The differences pair runs by seed (seeds in another order, or missing on one side, are matched or left out),
    are relative to the reference and signed so that a positive one is a worsening (accuracy: -1); the quality verdict
    is judged on the 95 % interval (one seed: NOT RESOLVED, not PASS on its mean) and the int4 margin likewise."""

    def runs(config: str, values: dict[int, float]) -> object:
        return bench.Summary([bench.Row("gpt", config, seed, {"val_acc": value}, 0.0, 0.0, 0.0, []) for seed, value in values.items()])

    reference = runs("int8", {0: 0.80, 1: 0.90, 2: 0.50})
    adaptive = runs("adaptive", {2: 0.55, 0: 0.84, 3: 0.70})  # seed 3 has no reference: left out
    difference = bench.paired_difference(adaptive, reference, "val_acc", sign=-1)
    assert difference.deltas == pytest.approx([-0.10, -0.05])  # seed 2 (+10 %) then seed 0 (+5 %): both better
    assert bench.per_seed_text(difference, -1) == "+10.0 %, +5.0 %"
    assert bench.at_most(bench.Paired([0.001]), bench.QUALITY_TOLERANCE, percent=True)[0] == "NOT RESOLVED"
    assert bench.at_most(bench.Paired([-0.0053, 0.004, -0.012, 0.001, -0.009]), bench.QUALITY_TOLERANCE)[0] == "NOT RESOLVED"
    assert bench.at_most(bench.Paired([-0.0053, -0.004, -0.006, -0.005]), bench.QUALITY_TOLERANCE)[0] == "PASS"
    assert bench.beyond_margin(bench.Paired([-0.05])) == "NOT RESOLVED"  # one seed: no standard error
    assert bench.beyond_margin(bench.Paired([-0.05, -0.04, -0.06])) == "PASS"
    assert bench.beyond_margin(bench.Paired([-0.05, 0.04, -0.06])) == "FAIL"


def test_each_update_is_paired_with_a_fused_fp32_step_on_the_same_gradients(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The update-time target's baseline: after each timed update, torch's fused AdamW kernel (not the CPU's default
    for-loop) steps fp32 copies of the parameters, with the groups' hyperparameters, on the same gradients; the ratios
    are per step."""
    import torch

    calls = []
    fused = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *args, **kwargs: calls.append(args[1]) or fused(*args, **kwargs))
    params = [torch.nn.Parameter(torch.randn(64)), torch.nn.Parameter(torch.randn(8))]
    optimizer = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:], "weight_decay": 0.0}], lr=1e-3)
    seconds: list[float] = []
    shadow = bench.FusedShadow(optimizer)
    bench.timed_optimizer_step(optimizer, seconds, after=shadow.step)
    for _ in range(2):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    assert len(seconds) == len(shadow.seconds) == 2 and len(calls) == 4  # one fused call per group and step
    assert all(torch.equal(grad, param.grad) for grads, param in zip(calls[2:], params, strict=True) for grad in grads)
    assert [group["weight_decay"] for group in shadow.optimizer.param_groups] == [0.01, 0.0]
    row = bench.Row("gpt", "adaptive", 0, {}, 0.0, 0.0, 0.0, [], update_seconds=[2.0, 3.0], fused_update_seconds=[1.0, 2.0])
    summary = bench.Summary([row])
    assert summary.update_ratios == [2.0, 1.5]
