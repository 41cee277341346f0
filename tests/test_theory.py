"""The stall model: the paper's reference numbers, the closed forms against sampling, reset periods, and the
controlled simulation of ``benchmarks/stall_simulation.py`` against the prediction."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from lightning_qstate.formats import get_format
from lightning_qstate.theory import half_staleness_age, relative_gaps, reset_period, stall_probability, state_decay, state_input

SIMULATION = Path(__file__).resolve().parents[1] / "benchmarks" / "stall_simulation.py"


@pytest.mark.parametrize(
    "fmt, rho, rn, sr",
    [("bf16", 2.71, 0.946, 0.825), ("fp8_e4m3", 43.3, 1.0, 0.989), ("e2m2", 86.6, 1.0, 0.994)],
)
def test_reference_values_of_the_paper(fmt, rho, rn, sr):
    """docs/algorithms.md, "Stall model and resets" (reference values), β2 = 0.999 (the paper's closed forms: no block-scale drift)."""
    _, gap, _ = relative_gaps(get_format(fmt, signed=False))
    assert float(gap[0]) / (2 * 0.001) == pytest.approx(rho, abs=0.05)
    assert stall_probability(fmt, 0.999, "nearest", block_drift=False) == pytest.approx(rn, abs=5e-4)
    assert stall_probability(fmt, 0.999, "stochastic", block_drift=False) == pytest.approx(sr, abs=5e-4)


def test_build_up_after_a_reset():
    """bf16 at β2 = 0.999: about 0.45 at k=100, 0.67 at 300, 0.87 at 1000, rising to the steady 0.946."""
    ages = [1, 10, 100, 300, 1000, 3000, 10000]
    curve = [stall_probability("bf16", 0.999, age=k) for k in ages]
    assert curve[2:5] == pytest.approx([0.45, 0.67, 0.87], abs=0.01)
    assert all(a <= b for a, b in zip(curve, curve[1:], strict=False))
    assert curve[-1] == pytest.approx(stall_probability("bf16", 0.999), abs=1e-4)
    assert curve[0] < 0.05  # just after a reset the state is responsive


def sampled_stall(rho: float, center: float, rounding: str, moment: str, samples: int = 2_000_000) -> float:
    """Monte Carlo of the model's stall condition (the closed forms must equal it)."""
    gen = torch.Generator().manual_seed(0)
    if moment == "second":
        noise, centers = (
            torch.randn(samples, generator=gen, dtype=torch.float64).square(),
            torch.full((samples,), center, dtype=torch.float64),
        )
    else:
        noise = torch.randn(samples, generator=gen, dtype=torch.float64)
        centers = (center * torch.randn(samples, generator=gen, dtype=torch.float64)).abs()
    distance = (noise - centers).abs() / (rho * centers)
    if rounding == "nearest":
        return float((distance < 1).double().mean())
    return float((1 - distance / 2).clamp(min=0).mean())


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt, beta, age", [("bf16", 0.999, None), ("bf16", 0.999, 300), ("e4m3", 0.99, None), ("fp16", 0.999, 50)])
def test_second_moment_closed_forms_match_sampling(fmt, beta, age, rounding):
    _, gap, _ = relative_gaps(get_format(fmt, signed=False))
    rho = float(gap[0]) / (2 * (1 - beta))
    center = 1.0 if age is None else 1 - beta**age
    predicted = stall_probability(fmt, beta, rounding, age=age, block_drift=False)
    assert predicted == pytest.approx(sampled_stall(rho, center, rounding, "second"), abs=2e-3)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("fmt, beta", [("bf16", 0.9), ("e2m2", 0.9), ("e3m2", 0.99)])
def test_first_moment_quadrature_matches_sampling(fmt, beta, rounding):
    _, gap, _ = relative_gaps(get_format(fmt))
    rho = float(gap[0]) / (2 * (1 - beta))
    spread = math.sqrt((1 - beta) / (1 + beta))
    predicted = stall_probability(fmt, beta, rounding, moment="first")
    assert predicted == pytest.approx(sampled_stall(rho, spread, rounding, "first"), abs=2e-3)


def model_ratios(moment: str, beta: float, age: int | None, samples: int = 1_000_000) -> torch.Tensor:
    """The ratios x/s that the noise model implies: g²/v with v = a·σ² (second), g/m with m ~ N(0, s²) (first)."""
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(samples, generator=gen, dtype=torch.float64)
    if moment == "second":
        return g.square() / (1.0 if age is None else 1 - beta**age)
    decay = 1.0 if age is None else 1 - beta ** (2 * age)
    return g / (math.sqrt((1 - beta) * decay / (1 + beta)) * torch.randn(samples, generator=gen, dtype=torch.float64))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize(
    "fmt, beta, age, moment",
    [("bf16", 0.999, 300, "second"), ("bf16", 0.999, None, "second"), ("fp8_e4m3", 0.99, None, "second"), ("int8", 0.999, 100, "second"),
     ("e2m2", 0.9, None, "first"), ("bf16", 0.9, 5, "first")],
)  # fmt: skip
def test_measured_ratios_drawn_from_the_noise_model_give_its_prediction(fmt, beta, age, moment, rounding):
    """``ratios=`` swaps the noise model for a measured distribution: drawn from the model, it gives the model's value
    (block formats with the scale's drift, their z' drawn from the same ratios)."""
    expected = stall_probability(fmt, beta, rounding, age=age, moment=moment)
    assert stall_probability(fmt, beta, rounding, moment=moment, ratios=model_ratios(moment, beta, age)) == pytest.approx(
        expected, abs=3e-3
    )


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_zero_inputs_decay_and_fresh_states_stall_where_written_as_zero(rounding):
    """A zero input only decays the state (r = 0): bf16 v at β2 = 0.999 stalls always under RN (ρ > 1) and with
    probability 1 - 1/(2ρ) under SR, far above the noise model's young state. A state written from zero (r = ∞) never
    stalls in a cast; in a block format it stalls where its code stays 0, as quantizing fresh blocks shows."""
    _, gap, _ = relative_gaps(get_format("bf16", signed=False))
    rho = float(gap[0]) / (2 * 0.001)
    zeros = torch.zeros(1000, dtype=torch.float64)
    assert stall_probability("bf16", 0.999, rounding, ratios=zeros) == pytest.approx(1.0 if rounding == "nearest" else 1 - 1 / (2 * rho))
    assert stall_probability("bf16", 0.999, rounding, ratios=torch.full((10,), torch.inf)) == 0.0
    mixed = torch.cat([zeros, model_ratios("second", 0.999, 100, 3000)])
    young = stall_probability("bf16", 0.999, rounding, age=100)
    assert stall_probability("bf16", 0.999, rounding, ratios=mixed) == pytest.approx(
        0.25 * stall_probability("bf16", 0.999, rounding, ratios=zeros) + 0.75 * young, abs=0.02
    )
    gen = torch.Generator().manual_seed(0)
    for fmt, moment in (("e2m2", "first"), ("int4", "second")):
        storage = get_format(fmt, signed=moment == "first")
        g = torch.randn(storage.block_size * 400, generator=gen)
        fresh = g if moment == "first" else g.square()
        trials = 20 if rounding == "stochastic" else 1
        zero = storage.quantize(torch.zeros_like(fresh)).unit_values()  # int4's v has no code 0: zero is its smallest code
        written = [storage.quantize(fresh, rounding=rounding, generator=gen).unit_values() for _ in range(trials)]
        kept_zero = sum(float((units == zero).double().mean()) for units in written) / trials
        predicted = stall_probability(fmt, 0.9, rounding, moment=moment, ratios=torch.full((5,), torch.inf))
        assert predicted == pytest.approx(kept_zero, abs=0.004), fmt


def test_state_inputs_follow_the_optimizers_updates():
    """x in s <- β·s + (1 - β)·x: SGD's b <- μ·b + (1 - dampening)·d is the EMA of (1 - dampening)·d/(1 - μ)."""
    g, p = torch.tensor([1.0, -2.0]), torch.tensor([10.0, 10.0])
    assert torch.equal(state_input({"betas": (0.9, 0.99), "weight_decay": 0.1, "decoupled_weight_decay": True}, "exp_avg", g, p), g)
    coupled = {"betas": (0.9, 0.99), "weight_decay": 0.1, "decoupled_weight_decay": False, "maximize": True}
    assert torch.allclose(state_input(coupled, "exp_avg", g, p), torch.tensor([0.0, 3.0]))
    assert torch.allclose(state_input(coupled, "exp_avg_sq", g, p), torch.tensor([0.0, 9.0]))
    sgd = {"momentum": 0.9, "dampening": 0.5, "weight_decay": 0.0}
    assert torch.allclose(state_input(sgd, "momentum_buffer", g, p), g * 5)
    muon = {"momentum": 0.95, "weight_decay": 0.1, "ns_steps": 5}  # Muon: buf.lerp_(g, 1 - μ), decay decoupled
    assert torch.equal(state_input(muon, "momentum_buffer", g, p), g)
    assert state_input({"momentum": 0}, "momentum_buffer", g, p) is None


@pytest.mark.parametrize("options", [{}, {"centered": True}, {"weight_decay": 0.1, "maximize": True}])
def test_rmsprop_momentum_input_is_its_normalized_gradient(options):
    """RMSprop's buffer is b <- μ·b + d/(sqrt(v) + eps): the EMA of d/((sqrt(v) + eps)(1 - μ)) with this step's v; the
    input was taken as d (about 40 times too small: the monitor predicted 0.50 where 0.25 was measured). It needs the
    states; without them nothing is predicted."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(1000))
    optimizer = torch.optim.RMSprop([param], lr=1e-3, momentum=0.9, **options)
    for _ in range(4):
        param.grad = torch.randn(1000)
        if _ == 3:
            group, state = optimizer.param_groups[0], {k: v.clone() for k, v in optimizer.state[param].items()}
            predicted = state_input(group, "momentum_buffer", param.grad, param.detach().clone(), state)
            assert state_input(group, "momentum_buffer", param.grad, param.detach()) is None
        optimizer.step()
    actual = (optimizer.state[param]["momentum_buffer"] - 0.9 * state["momentum_buffer"]) / (1 - 0.9)  # cancels: fp32 noise
    assert float((predicted - actual).abs().max() / actual.abs().max()) < 1e-5


def test_codebook_gaps_and_occupancy():
    weights, up, down = relative_gaps(get_format("int8_linear", signed=False))
    assert float(weights.sum()) == pytest.approx(1.0)
    assert torch.allclose(up * torch.linspace(0, 1, 256, dtype=torch.float64)[-len(up) :], torch.full_like(up, 1 / 255), rtol=1e-5)
    # a state whose entries all sit at one code is predicted from that code's gaps alone
    fmt = get_format("int8_linear", signed=False)
    state = fmt.quantize(torch.cat([torch.ones(1), torch.full((255,), 0.5)]))
    one_code = stall_probability(fmt, 0.99, values=state, block_drift=False)
    rho = (1 / 255) / (0.5 * 2 * 0.01)
    expected = math.erf(math.sqrt((1 + rho) / 2)) - math.erf(math.sqrt((1 - rho) / 2))
    assert one_code == pytest.approx(expected, abs=0.01)
    assert 0.0 < stall_probability("int8", 0.999) < 1.0 and 0.0 < stall_probability("int4", 0.999, "stochastic") < 1.0


def test_block_drift_lowers_the_stall_of_block_formats_only():
    assert stall_probability("bf16", 0.99, "stochastic") == stall_probability("bf16", 0.99, "stochastic", block_drift=False)
    assert stall_probability("fp8_e4m3", 0.99, "stochastic") < stall_probability("fp8_e4m3", 0.99, "stochastic", block_drift=False) - 0.02


def test_reset_periods_reproduce_the_paper_and_skip_formats_that_do_not_stall():
    assert [reset_period(f, 0.999) for f in ("bf16", "fp8_e4m3", "e2m2")] == [1000, 300, 200]
    assert [reset_period(f, 0.999, "stochastic") for f in ("bf16", "fp8_e4m3", "e2m2")] == [1000, 300, 200]
    assert reset_period("fp32", 0.999) is None and reset_period(None, 0.999) is None and reset_period("fp16", 0.999) is None
    unrounded = [reset_period(f, 0.999, round_period=False) for f in ("bf16", "fp8_e4m3", "e2m2")]
    assert all(0.85 < got / paper < 1.15 for got, paper in zip(unrounded, (1000, 300, 200), strict=False))
    assert half_staleness_age("bf16", 0.999) > half_staleness_age("fp8_e4m3", 0.999) > half_staleness_age("e2m2", 0.999)
    assert reset_period("e2m2", 0.99) < reset_period("e2m2", 0.999)  # a shorter EMA horizon resets sooner


def test_state_decays():
    adam = {"betas": (0.9, 0.98)}
    assert state_decay(adam, "exp_avg") == 0.9 and state_decay(adam, "exp_avg_sq") == 0.98
    assert state_decay({"momentum": 0.95}, "momentum_buffer") == 0.95
    assert state_decay({"momentum": 0}, "momentum_buffer") is None and state_decay(adam, "step") is None
    assert state_decay({"alpha": 0.99}, "square_avg") == 0.99 and state_decay({"lr_decay": 0}, "sum") is None


def test_bad_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="beta=1.5"):
        stall_probability("bf16", 1.5)
    with pytest.raises(ValueError, match="rounding='up'.*nearest"):
        stall_probability("bf16", 0.9, "up")
    with pytest.raises(ValueError, match="age=0"):
        stall_probability("bf16", 0.9, age=0)
    with pytest.raises(ValueError, match="moment='third'"):
        stall_probability("bf16", 0.9, moment="third")
    with pytest.raises(ValueError, match="unknown format 'bf17'"):
        stall_probability("bf17", 0.9)
    with pytest.raises(ValueError, match="ratios= replaces age= and center="):
        stall_probability("bf16", 0.9, age=3, ratios=torch.ones(4))
    with pytest.raises(ValueError, match="ratios= must be a non-empty tensor"):
        stall_probability("bf16", 0.9, ratios=torch.tensor([1.0, math.nan]))
    for beta in ("0.999", None, True):
        with pytest.raises(ValueError, match=f"beta={beta!r} must be a number in"):
            stall_probability("bf16", beta)
    with pytest.raises(ValueError, match="age=True must be None"):
        stall_probability("bf16", 0.9, age=True)
    for values in (torch.zeros(10), torch.empty(0)):  # no occupancy: the empty sum used to predict 0
        with pytest.raises(ValueError, match="values= has no positive value"):
            stall_probability("int8", 0.999, values=values)
    for special in (math.inf, math.nan):  # inf counted at the top code, NaN dropped: silently another occupancy
        with pytest.raises(ValueError, match="values= holds inf or NaN"):
            stall_probability("int8", 0.999, values=torch.tensor([0.5, special]))
    for ratio in (-1.0, -math.inf):  # g²/v is never negative
        with pytest.raises(ValueError, match="ratios= of the second moment are g²/v: >= 0"):
            stall_probability("bf16", 0.999, ratios=torch.tensor([1.0, ratio]))
    assert 0 <= stall_probability("bf16", 0.9, moment="first", ratios=torch.tensor([1.0, -0.5])) <= 1  # g/m may be
    for horizons in (math.nan, math.inf, 0, True):
        with pytest.raises(ValueError, match=f"horizons={horizons!r} must be a finite number > 0"):
            reset_period("bf16", 0.999, horizons=horizons)
    for min_stall in ("0.5", 1.5, None):  # a string raised a bare TypeError
        with pytest.raises(ValueError, match=f"min_stall={min_stall!r} must be a number in"):
            reset_period("bf16", 0.999, min_stall=min_stall)
    with pytest.raises(ValueError, match="block_drift='no' must be True or False"):  # read as True
        stall_probability("int8", 0.999, block_drift="no")
    with pytest.raises(ValueError, match="round_period='no' must be True or False"):
        reset_period("bf16", 0.999, round_period="no")


def test_numpy_numbers_are_numbers():
    """numpy's floats and ints (a config's, a sweep's) were refused as "not a number in (0, 1)"."""
    np = pytest.importorskip("numpy")
    assert stall_probability("bf16", np.float32(0.999)) == stall_probability("bf16", float(np.float32(0.999)))
    assert stall_probability("bf16", 0.999, age=np.int64(300)) == stall_probability("bf16", 0.999, age=300)
    assert reset_period("bf16", np.float32(0.999), horizons=np.float64(8.4)) == reset_period("bf16", 0.999) == 1000


@pytest.mark.parametrize(("beta", "options"), [(0.1, {"min_stall": 0.0}), (0.9, {"horizons": 0.001})])
def test_a_reset_period_under_one_step_is_one_step(beta, options):
    """An unrounded period below 1 rounded to 0.5 and was truncated to 0 steps (round_period=False gave 1)."""
    assert reset_period("bf16" if beta == 0.1 else "e2m2", beta, **options) == 1
    assert reset_period("bf16" if beta == 0.1 else "e2m2", beta, round_period=False, **options) == 1


@pytest.fixture(scope="module")
def simulation():
    spec = importlib.util.spec_from_file_location("benchmarks_stall_simulation", SIMULATION)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("beta", [0.99, 0.999])
@pytest.mark.parametrize("fmt", ["bf16", "fp8_e4m3"])
def test_simulated_stall_rate_is_within_3_points_of_the_prediction(simulation, fmt, beta, rounding):
    result = simulation.run_case(
        simulation.Case(fmt, beta, rounding, "gaussian", "second"), entries=16384, horizons=1.0, long_run=False, seed=0
    )
    assert abs(result.measured - result.predicted) <= 0.03, (result.measured, result.predicted)


@pytest.mark.parametrize(
    ("fmt", "beta", "rounding", "tolerance"),
    [
        ("fp8_e4m3", 0.99, "nearest", 0.035),
        ("fp8_e4m3", 0.99, "stochastic", 0.03),
        ("int8", 0.999, "nearest", 0.06),
        ("int8", 0.999, "stochastic", 0.06),
    ],
)
def test_bf16_scales_of_a_second_moment_follow_the_grid_drift_model(simulation, fmt, beta, rounding, tolerance):
    """Not the default for v (see formats.block), but a user may choose it: the prediction follows the bf16 scale's grid."""
    case = simulation.Case(fmt, beta, rounding, "gaussian", "second", scale_dtype="bf16")
    result = simulation.run_case(case, entries=16384, horizons=1.0, long_run=False, seed=0)
    assert abs(result.measured - result.predicted) <= tolerance, (result.measured, result.predicted)
    fp32_model = stall_probability(get_format(fmt, signed=False, scale_dtype="fp32"), beta, rounding)
    assert result.predicted != fp32_model


def test_simulation_script_writes_its_table(simulation, tmp_path):
    out = tmp_path / "stall.md"
    results = simulation.main(["--quick", "--entries", "2048", "--out", str(out), "--quiet"])
    text = out.read_text()
    assert len(results) == 8 and "| v | bf16 | 0.999 | nearest | gaussian |" in text and "--quick" in text


def test_subnormal_values_of_a_cast_have_their_absolute_gaps():
    """An fp16 ``v`` under 6.1e-5 is subnormal: its gap is the spacing 2^-24 (``1/k`` at ``k`` steps), not ε·ln2. With the
    stored values, the prediction matches one RN step of a log-normal ``v`` (inputs of its own scale); without, it saw
    normal-range gaps (0.17 against 0.95)."""
    fmt, spacing = get_format("fp16", signed=False), 2.0**-24
    weights, up, down = relative_gaps(fmt, torch.tensor([3 * spacing, 3 * spacing, 1.5]).half())
    assert weights.tolist() == pytest.approx([1 / 3, 2 / 3]) and up[1] == down[1] == pytest.approx(1 / 3)
    gen = torch.Generator().manual_seed(0)
    stored = (9e-6 * torch.exp(0.5 * torch.randn(200_000, generator=gen))).half()
    v = stored.float()
    grad = v.sqrt() * torch.randn(v.numel(), generator=gen)
    updated = v * 0.999 + 0.001 * grad.square()
    moved = updated != v
    measured = float((moved & (updated.half() == stored)).sum() / moved.sum())
    ratios = (grad.square() / v)[moved]
    assert stall_probability(fmt, 0.999, ratios=ratios, values=stored) == pytest.approx(measured, abs=0.005)
    assert stall_probability(fmt, 0.999, ratios=ratios) < 0.2
