"""Smoke test of ``benchmarks/eco.py``: a ``--quick`` run (tiny GPT, a few steps, two seeds, a few configurations and one
peer), the report's structure and numbers; and the verdicts' statistics on made-up runs."""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest

from benchmark_scripts import load_benchmark, markdown_table

pytest.importorskip("transformers")
pytest.importorskip("optimi")

QUICK_CONFIGS = ["master_fp32", "master_int8", "bf16_naive_sr_int8", "bf16_eco_sr_int8", "fp8_eco_sr_fp32", "optimi_kahan"]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("eco")


def numbers(cell: str) -> list[float]:
    """The numbers of a cell such as ``4.9564 ± 0.0372``, ``2.000 + 2.029 = 4.029`` or ``0.52×``."""
    return [float(part) for part in cell.replace("×", "").replace("±", " ").replace("+ ", " ").replace("=", " ").split()]


def test_quick_run(bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["eco.py"])
    out = tmp_path / "results" / "eco.md"
    argv = ["--quick", "--seeds", "0", "1", "--configs", ",".join(QUICK_CONFIGS), "--out", str(out)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = bench.main(argv)
    assert out.read_text() == text
    assert f"`python benchmarks/eco.py --quick --seeds 0 1 --configs {','.join(QUICK_CONFIGS)} --out" in text
    assert "LR at the end / peak: 0.1)" in text, "every run ends its cosine at 0.1x the peak"
    assert "optimi 0.3" in text and "- machine:" in text and "- date:" in text
    section = text.split("### gpt:")[1].split("## Targets")[0]
    assert "; seeds 0, 1" in section.splitlines()[0]
    tables = [[line for line in block.splitlines() if line.startswith("|")] for block in section.split("\n\n")]
    means, per_seed = (markdown_table(lines) for lines in tables if lines)
    assert list(means) == list(per_seed) == QUICK_CONFIGS
    for config, row in means.items():
        loss = numbers(row["val loss"])
        assert len(loss) == 2 and all(math.isfinite(value) for value in loss) and 3 < loss[0] < 6, (config, row)
        weights, states, total = numbers(row["bytes/param: weights + states"])
        assert total == pytest.approx(weights + states, abs=2e-3) and float(row["packed"]) <= total + 1e-9
        assert numbers(row["step time vs master_fp32"])[0] > 0 and float(row["median step ms"]) >= 0
        if config.startswith("master"):
            assert row["Δ vs master (same states)"] == "–"
        else:
            assert all(math.isfinite(value) for value in numbers(row["Δ vs master (same states)"])), row
        seed_losses = [float(per_seed[config][f"seed {seed}"].split(",")[0]) for seed in (0, 1)]
        assert loss[0] == pytest.approx(sum(seed_losses) / 2, abs=2e-4)
        assert loss[1] == pytest.approx(abs(seed_losses[0] - seed_losses[1]) / 2**0.5, abs=2e-4)
    bytes_of = {config: numbers(row["bytes/param: weights + states"]) for config, row in means.items()}
    assert bytes_of["master_fp32"][:2] == pytest.approx([4.0, 8.0], abs=0.01)  # fp32 weights, two fp32 states (and the step)
    assert bytes_of["master_int8"][0] == 4.0 and 2.0 < bytes_of["master_int8"][1] < 2.1  # every state int8 (min_quant_size 0)
    assert bytes_of["bf16_eco_sr_int8"][0] == 2.0 and bytes_of["bf16_eco_sr_int8"][1] == bytes_of["master_int8"][1]
    assert bytes_of["fp8_eco_sr_fp32"][0] == 2.0 and float(means["fp8_eco_sr_fp32"]["packed"]) < bytes_of["fp8_eco_sr_fp32"][2]
    assert bytes_of["optimi_kahan"][:2] == pytest.approx([2.0, 6.0], abs=0.01)  # bf16 m, v and Kahan buffer
    assert "Δ" in per_seed["bf16_eco_sr_int8"]["seed 1"] and "Δ" not in per_seed["master_int8"]["seed 1"]
    targets = text.split("## Targets")[1]
    verdicts = [line for line in targets.splitlines() if line.startswith("- ")]
    assert len(verdicts) == 6  # ECO+SR quality x2, orderings x2, bytes, ECO's step time
    assert all(any(f"**{word}**" in line for word in ("PASS", "FAIL", "NOT RESOLVED")) for line in verdicts)
    assert "ordering master_int8 ≤ bf16_eco_sr_int8 < bf16_naive_sr_int8 (the configurations run)" in targets
    assert "bf16 weights + int8 states + ECO (eco_sr) at <= 4.1 bytes/param: **PASS**" in targets


def test_verdicts_on_made_up_differences(bench: ModuleType) -> None:
    interval = bench.Paired([0.010, 0.012, 0.008, 0.011, 0.009]).interval()
    assert interval == pytest.approx((0.010 - 2.776 * 0.000707, 0.010 + 2.776 * 0.000707), abs=1e-5)  # t(4) = 2.776
    assert bench.at_most(bench.Paired([0.001, 0.002, 0.0, 0.001]), 0.01)[0] == "PASS"
    assert bench.at_most(bench.Paired([0.03, 0.02, 0.025]), 0.01)[0] == "FAIL"
    assert bench.at_most(bench.Paired([0.0, 0.02, 0.01]), 0.01)[0] == "NOT RESOLVED"
    assert bench.at_most(bench.Paired([0.001]), 0.01)[0] == "NOT RESOLVED"  # one seed: no interval
    # a diverged run (an infinite difference): judged on the per-seed range
    assert bench.Paired([0.1, math.inf]).interval() == (0.1, math.inf) and "diverged" in bench.Paired([0.1, math.inf]).text()
    with pytest.raises(SystemExit):
        bench.parse_args(["--configs", "fp8_eco"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--seeds", "0", "0"])
    args = bench.parse_args([])
    assert args.seeds == [0, 1, 2, 3, 4] and args.config_names == list(bench.CONFIGS) and len(args.config_names) == 20
    assert bench.parse_args(["--configs", "peers,master"]).config_names == ["master_fp32", "master_int8", "torchao_bf16_sr", "optimi_kahan"]
    assert bench.CONFIGS["fp8_eco_rn_int8"].precision_for("fp32") == "32-true"
    assert bench.CONFIGS["optimi_kahan"].precision_for("fp32") == "32-true" and bench.CONFIGS["optimi_kahan"].precision == "bf16-true"


def test_peers_under_fp32_compute_keep_bf16_parameters(bench: ModuleType) -> None:
    """``--compute fp32``: the peers' parameters stay bf16 (tied embedding included) and the forward is the fp32 model's
    on those values; gradients reach the bf16 parameters."""
    import torch

    model = {"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 16}
    peer = bench.PeerGPT(**model, seed=0, peer="optimi", fp32_compute=True)
    reference = bench.GPTModule(**model, seed=0)
    assert all(param.dtype == torch.bfloat16 for param in peer.parameters())
    assert peer.model.lm_head.weight is peer.model.transformer.wte.weight
    with torch.no_grad():
        for param in reference.parameters():
            param.copy_(param.to(torch.bfloat16))
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = peer(tokens)
    assert logits.dtype == torch.float32 and torch.equal(logits, reference(tokens))
    logits.square().mean().backward()
    assert all(param.grad is not None and param.grad.dtype == torch.bfloat16 for param in peer.parameters())


def test_rows_file_resumes_and_merges(bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs saved with ``--rows`` by two calls (disjoint seeds) make the report of a third call, which trains nothing."""
    rows, configs = tmp_path / "rows.jsonl", "master_fp32,bf16_eco_sr_int8"
    common = ["--quick", "--steps", "2", "--configs", configs, "--rows", str(rows)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in ("0", "1"):
            bench.main([*common, "--seeds", seed, "--out", str(tmp_path / f"seed{seed}.md")])
    assert len(rows.read_text().splitlines()) == 4
    rows.write_text(rows.read_text() + '{"settings": {"cut sh')  # a line a killed process left unfinished
    monkeypatch.setattr(bench, "run_config", lambda *args: pytest.fail("a saved run was trained again"))
    text = bench.main([*common, "--seeds", "0", "1", "--out", str(tmp_path / "all.md")])
    assert "; seeds 0, 1" in text and "torch threads per run" in text
    per_seed = text.split("val loss per seed")[1]
    for seed in ("0", "1"):
        single = (tmp_path / f"seed{seed}.md").read_text().split("val loss per seed")[1]
        line = next(line for line in single.splitlines() if line.startswith("| bf16_eco_sr_int8"))
        assert line.split("|")[2].strip() in per_seed  # the same seed's number, taken from the file
    # other settings (here the step count) do not match the saved runs: they are trained
    monkeypatch.setattr(bench, "run_config", lambda *args: (_ for _ in ()).throw(RuntimeError("trained")))
    with pytest.raises(RuntimeError, match="trained"):
        bench.main(["--quick", "--steps", "3", "--configs", configs, "--rows", str(rows), "--seeds", "0"])
