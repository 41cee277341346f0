"""``benchmarks/mantissa_sweep.py``: the M-bit quantizer against float64 arithmetic, the batched Muon against
``torch.optim.Muon``, the batched rows' independence, thresholds/calibration on made-up curves, and a ``--quick`` run."""

from __future__ import annotations

import ast
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from benchmark_scripts import load_benchmark, markdown_table

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("mantissa_sweep")


def nearest_reference(values: np.ndarray, mantissa: int) -> np.ndarray:
    """Round-to-nearest-even of float64 ``values`` to ``mantissa`` fraction bits (normal fp32 range, exponent unbounded)."""
    spacing = 2.0 ** (np.floor(np.log2(np.abs(values))) - mantissa)
    return np.round(values / spacing) * spacing  # numpy rounds ties to even


@pytest.mark.parametrize("mantissa", [1, 2, 3, 5, 7, 10, 15, 22])
def test_nearest_matches_float64_rounding(bench: ModuleType, mantissa: int) -> None:
    generator = torch.Generator().manual_seed(mantissa)
    values = torch.randn(4096, generator=generator) * torch.logspace(-20, 20, 4096)
    spacing = 2.0 ** (torch.floor(torch.log2(values.abs())) - mantissa)
    head, step = values[:512].double(), spacing[:512].double()
    ties = head.sign() * (torch.floor(head.abs() / step) + 0.5) * step  # exactly halfway: even and odd kept parts
    values = torch.cat([values, ties.float()])
    quantized = bench.quantize_mantissa_(values.clone(), mantissa, "nearest")
    expected = nearest_reference(values.double().numpy(), mantissa)
    np.testing.assert_array_equal(quantized.double().numpy(), expected)


def test_per_row_mantissas_and_special_values(bench: ModuleType) -> None:
    rows = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)) * 100
    mantissas = torch.tensor([1, 4, 9, 23])
    quantized = bench.quantize_mantissa_(rows.clone(), mantissas, "nearest")
    for row, mantissa in enumerate(mantissas.tolist()):
        np.testing.assert_array_equal(quantized[row].double().numpy(), nearest_reference(rows[row].double().numpy(), mantissa))
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 3.0, -3.0])
    out = bench.quantize_mantissa_(specials.clone(), 1, "stochastic", torch.Generator().manual_seed(0))
    assert out[0].item() == 0.0 and math.copysign(1, out[1].item()) == -1 and out[2] == math.inf and out[3] == -math.inf
    assert math.isnan(out[4]) and out[5].item() == 3.0 and out[6].item() == -3.0  # 3 = 1.1b x 2: exact at M = 1
    largest = torch.tensor([torch.finfo(torch.float32).max])
    assert bench.quantize_mantissa_(largest, 3, "nearest").item() == math.inf  # rounds past the largest finite value
    assert bench.quantize_mantissa_(rows[0].clone(), 23, "stochastic").equal(rows[0])
    with pytest.raises(ValueError, match="mantissa=24"):
        bench.quantize_mantissa_(rows.clone(), 24, "nearest")
    with pytest.raises(ValueError, match="rounding='up'"):
        bench.quantize_mantissa_(rows.clone(), 3, "up")
    with pytest.raises(ValueError, match="one M per row"):
        bench.quantize_mantissa_(rows.clone(), torch.tensor([3, 4]), "nearest")
    with pytest.raises(ValueError, match="float32"):
        bench.quantize_mantissa_(rows.double(), 3, "nearest")


def test_stochastic_rounding_is_unbiased_between_the_two_neighbours(bench: ModuleType) -> None:
    value, mantissa = 1.3, 2  # neighbours 1.25 and 1.5 at M = 2; P(up) = 0.05 / 0.25 = 0.2
    samples = bench.quantize_mantissa_(torch.full((200_000,), value), mantissa, "stochastic", torch.Generator().manual_seed(0))
    assert set(samples.unique().tolist()) == {1.25, 1.5}
    assert (samples == 1.5).float().mean().item() == pytest.approx(0.2, abs=0.005)
    assert samples.double().mean().item() == pytest.approx(np.float32(value), rel=1e-3)
    negative = bench.quantize_mantissa_(torch.full((1000,), -value), mantissa, "stochastic", torch.Generator().manual_seed(1))
    assert set(negative.unique().tolist()) == {-1.5, -1.25}


def test_batched_muon_equals_torch_muon(bench: ModuleType) -> None:
    shapes, rows = [(8, 5), (4, 8), (1, 2)], 3
    size = sum(a * b for a, b in shapes)
    start = torch.randn(rows, size, generator=torch.Generator().manual_seed(0))
    batched = {dtype: start.clone() for dtype in (torch.bfloat16, torch.float32)}
    generator, steps, lr = torch.Generator().manual_seed(1), 6, 0.02
    optimizers = {dtype: bench.BatchedMuon([param], shapes, lr=lr, ns_dtype=dtype) for dtype, param in batched.items()}
    references = [
        [start[row, a:b].reshape(shape).clone() for (a, b), shape in zip(_spans(shapes), shapes, strict=True)] for row in range(rows)
    ]
    torch_muons = [torch.optim.Muon(params, lr=lr, weight_decay=0.0) for params in references]
    for _ in range(steps):
        grad = torch.randn(rows, size, generator=generator)
        for param, optimizer in zip(batched.values(), optimizers.values(), strict=True):
            param.grad = grad.clone()
            optimizer.step()
        for row, (params, muon) in enumerate(zip(references, torch_muons, strict=True)):
            for (a, b), param in zip(_spans(shapes), params, strict=True):
                param.grad = grad[row, a:b].reshape(param.shape).clone()
            muon.step()
    expected = torch.stack([torch.cat([p.flatten() for p in params]) for params in references])
    # bf16 Newton-Schulz: torch's arithmetic; batched and single matrix products may round differently (up to ~2e-4 seen
    # over 40 random inputs), so within one bf16 rounding of the update (2^-7 relative) per step
    bf16_gap, fp32_gap = ((batched[dtype] - expected).abs().max().item() for dtype in (torch.bfloat16, torch.float32))
    assert bf16_gap <= steps * lr * 2**-7
    assert 0 < fp32_gap <= 0.02 and bf16_gap < fp32_gap  # the fp32 iteration drops bf16's rounding: further from torch's
    with pytest.raises(ValueError, match=r"\[K, 74\]"):
        bench.BatchedMuon([torch.zeros(3, 10)], shapes)


def _spans(shapes):
    start = 0
    for rows, cols in shapes:
        yield start, start + rows * cols
        start += rows * cols


@pytest.mark.parametrize("optimizer", ["adam", "muon"])
def test_batched_rows_train_independently(bench: ModuleType, optimizer: str) -> None:
    """A configuration's row gives the same result alone as among others (rows share nothing but the batch order)."""
    problem = bench.DigitsMLP(widths=(64, 8, 10), batch_size=16)
    configs = [bench.FP32, bench.Config("weights", 3, "nearest"), bench.Config("all", 5, "nearest"), bench.Config("exp_avg", 2, "nearest")]
    together = bench.train_batched(problem, optimizer, configs, [0, 1], 15)
    alone = torch.cat([bench.train_batched(problem, optimizer, [config], [0, 1], 15) for config in configs])
    torch.testing.assert_close(together, alone, rtol=2e-5, atol=1e-7)
    assert together.shape == (4, 2) and not torch.equal(together[0], together[1])
    rosenbrock = bench.train_batched(bench.Rosenbrock(), optimizer, [bench.FP32, bench.Config("all", 1, "nearest")], [0, 1, 2], 200)
    assert rosenbrock[0].max() < 0.1 < rosenbrock[1].min(), rosenbrock  # fp32 gets near (1, 1); one-bit everything does not


def test_quantizer_slices_follow_the_configurations(bench: ModuleType) -> None:
    configs = [bench.FP32, bench.Config("grads", 2, "nearest"), bench.Config("grads", 5, "nearest"), bench.Config("all", 3, "stochastic")]
    quantize = bench.Quantizer(configs, seeds=2, generator=torch.Generator().manual_seed(0))
    assert [(s.start, s.stop, m.tolist(), r) for s, m, r in quantize.slices["grads"]] == [
        (2, 6, [2, 2, 5, 5], "nearest"),
        (6, 8, [3, 3], "stochastic"),
    ]
    assert [(s.start, s.stop) for s, _, _ in quantize.slices["exp_avg_sq"]] == [(6, 8)]
    tensor = torch.full((8, 3), 1.3)
    quantize("weights", tensor)
    assert (tensor[:6] == 1.3).all() and set(tensor[6:].unique().tolist()) <= {1.25, 1.375}


def made_up_results(bench: ModuleType, curves: dict[tuple[str, str, int], dict[int, float]], fp32: float = 1.0):
    """Results of one problem ("digits") and rounding (SR) from ``{(optimizer, component, T): {M: loss}}``."""
    results = [bench.Result("digits", o, t, "fp32", None, None, [fp32, fp32]) for o, t in {(o, t) for o, _, t in curves}]
    for (optimizer, component, horizon), curve in curves.items():
        results += [bench.Result("digits", optimizer, horizon, component, "stochastic", m, [v, v]) for m, v in curve.items()]
    return results


def test_thresholds_calibration_and_predictions(bench: ModuleType) -> None:
    bad, ok = 2.0, 1.001
    curves = {
        # v: needs 6 at T=1000, 8 at T=4000: the law's slope 2 predicts 6 + 2·2 = 10 there: FAIL by 2 bits
        ("adam", "exp_avg_sq", 1000): {m: ok if m >= 6 else bad for m in range(1, 11)},
        ("adam", "exp_avg_sq", 4000): {m: ok if m >= 8 else bad for m in range(1, 11)},
        # grads: 3 then 5 (slope 1: PASS); a lucky pass at M = 1 below a failing M = 2 does not count
        ("adam", "grads", 1000): {m: ok if m >= 3 or m == 1 else bad for m in range(1, 11)},
        ("adam", "grads", 4000): {m: ok if m >= 5 else bad for m in range(1, 11)},
        ("muon", "weights", 1000): {m: ok for m in range(1, 11)},  # every M passes: "≤1", an upper-bound constant
        ("muon", "weights", 4000): {m: bad for m in range(1, 11)},  # none passes: ">10"
    }
    results = made_up_results(bench, curves)
    tolerance = {"digits": bench.Tolerance(0.01, 0.0)}
    thresholds = bench.thresholds_of(results, tolerance)
    found = {(t.optimizer, t.component, t.horizon): t for t in thresholds}
    assert found["adam", "exp_avg_sq", 1000].mantissa == 6 and found["adam", "grads", 1000].mantissa == 3
    assert found["muon", "weights", 1000].text() == "≤1" and found["muon", "weights", 4000].text() == ">10"
    calibrations = {(c.optimizer, c.component): c for c in bench.calibrate(thresholds, ["digits"], 1000)}
    assert calibrations["adam", "exp_avg_sq"].constant == pytest.approx(6 - 2 * math.log2(1000), abs=0.01)
    assert calibrations["adam", "grads"].constant == pytest.approx(3 - math.log2(1000), abs=0.01)
    assert calibrations["muon", "weights"].censored == "upper bound"
    verdicts = {(p.optimizer, p.component, p.horizon): p for p in bench.predictions_of(thresholds, list(calibrations.values()))}
    assert verdicts["adam", "exp_avg_sq", 4000].predicted == pytest.approx(10, abs=0.01)
    assert verdicts["adam", "exp_avg_sq", 4000].verdict == "FAIL" and verdicts["adam", "grads", 4000].verdict == "PASS"
    assert verdicts["adam", "exp_avg_sq", 1000].verdict == "PASS"  # the fit reproduces its own horizon
    assert verdicts["muon", "weights", 4000].verdict == "NOT RESOLVED"  # a FAIL from an upper-bound constant decides nothing
    assert bench.log_t_slope(thresholds, "digits", "adam", "exp_avg_sq", "stochastic") == pytest.approx(1.0)
    assert bench.log_t_slope(thresholds, "digits", "muon", "weights", "stochastic") is None


def test_tolerance_and_noise_floor(bench: ModuleType) -> None:
    tolerance, fp32 = bench.Tolerance(0.01, 0.0), [1.00, 1.10, 0.90]
    assert tolerance.within([1.005, 1.105, 0.905], fp32)  # +0.5 % every seed
    assert not tolerance.within([1.02, 1.12, 0.92], fp32)  # +2 %
    assert tolerance.within([1.02, 1.12, 0.92], fp32, noise=0.006)  # 1 % + 2 x 0.6 % of noise
    assert tolerance.limit(fp32, noise=0.006) == pytest.approx(0.022)
    assert not tolerance.within([1.0, math.inf, 0.9], fp32, noise=1.0)  # a diverged seed fails whatever the noise
    assert bench.Tolerance(0.0, 1e-3).within([2e-3], [1.5e-3]) and not bench.Tolerance(0.0, 1e-3).within([3e-3], [1e-3])
    with pytest.raises(ValueError, match="pair them by seed"):
        tolerance.within([1.0], fp32)
    # noise: per-seed excess at the largest M swept (10), variance pooled over the components, over sqrt(seeds)
    results = [
        bench.Result("digits", "muon", 300, "fp32", None, None, [1.0, 1.0, 1.0]),
        bench.Result("digits", "muon", 300, "grads", "nearest", 10, [1.1, 0.9, 1.0]),  # variance 0.01
        bench.Result("digits", "muon", 300, "weights", "nearest", 10, [1.3, 1.1, 1.2]),  # variance 0.01 (its +0.2 bias excluded)
        bench.Result("digits", "muon", 300, "weights", "nearest", 1, [9.0, 1.0, 1.0]),  # not the largest M: ignored
        bench.Result("gpt", "adam", 300, "fp32", None, None, [2.5]),
        bench.Result("gpt", "adam", 300, "all", "stochastic", 10, [2.6]),
    ]
    floors = bench.noise_floors(results)
    assert floors["digits", "muon", 300] == pytest.approx(math.sqrt(0.01 / 3)) and floors["gpt", "adam", 300] == 0.0


def test_conservative_calibration_takes_the_largest_threshold(bench: ModuleType) -> None:
    thresholds = [
        bench.Threshold("digits", "adam", 1000, "weights", "nearest", 7, 1, 10),
        bench.Threshold("rosenbrock", "adam", 1000, "weights", "nearest", 9, 1, 10),
        bench.Threshold("rosenbrock", "adam", 1000, "grads", "nearest", None, 1, 10),
        bench.Threshold("digits", "adam", 1000, "grads", "nearest", 1, 1, 10),
        bench.Threshold("digits", "adam", 300, "weights", "nearest", 10, 1, 10),  # another horizon: ignored
    ]
    own = {c.component: c for c in bench.calibrate(thresholds, ["digits"], 1000)}
    both = {c.component: c for c in bench.calibrate(thresholds, ["digits", "rosenbrock"], 1000)}
    assert own["weights"].constant == pytest.approx(7 - 2 * math.log2(1000), abs=0.01) and own["grads"].censored == "upper bound"
    assert both["weights"].constant == pytest.approx(9 - 2 * math.log2(1000), abs=0.01)
    assert both["grads"].constant is None and both["grads"].censored == "lower bound"  # above the sweep on Rosenbrock


def test_options_are_validated(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in (
        (["--problems", "mnist"], "--problems 'mnist': use a comma-separated list of rosenbrock, digits, gpt"),
        (["--optimizers", "sgd"], "--optimizers 'sgd'"),
        (["--mantissas", "0"], "--mantissas: each M must lie in [1, 22]"),
        (["--horizons", "300", "3000"], "--calibration-horizon 1000 must be one of --horizons [300, 3000]"),
    ):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert message in capsys.readouterr().err
    args = bench.parse_args([])
    assert args.horizons == (300, 1000, 3000) and args.mantissas == tuple(range(1, 11)) and args.seeds == 3
    assert (
        args.problems == ["rosenbrock", "digits", "gpt"] and args.calibration_horizon == 1000 and args.gpt_mantissas == bench.GPT_MANTISSAS
    )
    assert bench.beta2_for(1000) == pytest.approx(0.99) and bench.peak_lr(0.01, 4000) == pytest.approx(0.005)
    assert bench.schedule(100, 10)(0) == pytest.approx(0.1) and bench.schedule(100, 10)(10) == 1.0 and bench.schedule(100, 0)(100) == 0.0


def test_quick_run(bench: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(sys, "argv", ["mantissa_sweep.py"])
    out = tmp_path / "results" / "mantissa_sweep.md"
    text = bench.main(["--quick", "--out", str(out)])
    assert out.read_text() == text + "\n"
    assert f"`python benchmarks/mantissa_sweep.py --quick --out {out}`" in text and "- machine:" in text and "- date:" in text
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["settings"]["horizons"] == [10, 20] and data["settings"]["mantissas"] == [1, 4, 10]
    adam_rows = [r for r in data["results"] if r["problem"] == "digits" and r["optimizer"] == "adam" and r["horizon"] == 20]
    assert len(adam_rows) == 1 + 5 * 2 * 3  # fp32, then components x roundings x M
    assert all(len(r["losses"]) == 2 and (r["mean"] == "inf" or r["mean"] > 0) for r in adam_rows)
    gpt = [r for r in data["results"] if r["problem"] == "gpt"]
    swept = sorted((r["optimizer"], r["component"], r["mantissa"]) for r in gpt if r["component"] != "fp32")
    assert swept == [(o, c, m) for o, c in (("adam", "all"), ("adam", "exp_avg_sq"), ("muon", "all")) for m in (1, 10)]
    targets = text.split("## Targets")[1].split("## Thresholds")[0]
    verdicts = [line for line in targets.splitlines() if line.startswith("- ")]
    assert verdicts and all(any(f"**{word}**" in line for word in ("PASS", "FAIL", "NOT RESOLVED")) for line in verdicts)
    assert sum("advisor's prediction within ±1 bit" in line for line in verdicts) == 1
    table = [line for line in text.split("## Thresholds")[1].splitlines() if line.startswith("|")]
    rows = markdown_table(table[:2] + [line for line in table[2:] if line.startswith("| adam | exp_avg_sq | SR")])
    assert rows["adam"]["digits T=20"] not in ("", "–") and "fit" in rows["adam"]["advisor (digits-calibrated)"]
    blocks = [block.split("```")[0] for block in text.split("```python\n")[1:]]
    assert [block.split(" = ")[0] for block in blocks] == ["DEFAULT_CONSTANTS", "CONSERVATIVE_CONSTANTS"]
    for block in blocks:
        constants = ast.literal_eval(block.split("=", 1)[1])
        assert set(constants) == {(o, c, r) for o, c in bench.SLOPES if o in ("adam", "muon") for r in ("nearest", "stochastic")}
        assert all(value is None or isinstance(value, float) for value in constants.values())
    assert len(data["calibration"]) == len(data["conservative_calibration"]) == 14
