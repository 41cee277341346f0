"""The precision advisor (arXiv 2510.21314): mantissa bits of every format, the T-scaling rule, and ``advise`` on real optimizers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_qstate import QSGD, QAdamW, QMuon
from lightning_qstate.formats import FORMAT_NAMES, ROUNDINGS, get_format
from lightning_qstate.optim import QuantizedOptimizerWrapper, quantize_optimizer
from lightning_qstate.theory import (
    COMPONENTS,
    DEFAULT_CONSTANTS,
    PrecisionReport,
    advise,
    mantissa_bits,
    relative_gaps,
    required_mantissa_bits,
    reset_period,
)
from lightning_qstate.theory.precision import SLOPES

# name -> (signed, unsigned): casts and minifloats their fraction bits, codebooks the effective M of the module docstring
EXPECTED_BITS = {
    "fp32": (23.0, 23.0),
    "bf16": (7.0, 7.0),
    "fp16": (10.0, 10.0),
    "fp8_e4m3": (3.0, 3.0),
    "fp8_e5m2": (2.0, 2.0),
    "int8": (5.10, 6.10),
    "int4": (1.20, 2.94),
    "int8_linear": (5.93, 6.94),
    "int4_linear": (1.76, 2.85),
    "int7": (4.11, 5.10),  # each code bit of the dynamic maps adds about one mantissa bit; unsigned = signed with one bit more
    "int6": (3.12, 4.11),
    "int5": (2.14, 3.12),
    "int7_linear": (4.92, 5.93),
    "int6_linear": (3.90, 4.92),
    "int5_linear": (2.85, 3.90),
    "e2m2": (2.0, 2.0),
    "e3m0": (0.0, 0.0),
    "e5m10": (10.0, 10.0),
}


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)).to(dtype)


def _row(report: PrecisionReport, component: str, group: int = 0):
    return next(row for row in report.rows if row.component == component and row.group == group)


# --- mantissa_bits ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(EXPECTED_BITS))
def test_mantissa_bits_of_every_format(name):
    signed, unsigned = EXPECTED_BITS[name]
    assert mantissa_bits(name) == pytest.approx(signed, abs=0.005)
    assert mantissa_bits(name, signed=False) == pytest.approx(unsigned, abs=0.005)
    assert mantissa_bits(get_format(name, signed=False)) == mantissa_bits(name, signed=False)  # a format object as its name


def test_every_format_name_is_covered():
    assert {name for name in FORMAT_NAMES if name != "eXmY"} <= set(EXPECTED_BITS)


def test_floats_come_out_exactly_p_under_the_codebook_definition():
    """The effective M, log2(ln 2 / mean relative gap), gives a float its fraction bits."""
    for name, p in (("bf16", 7), ("fp16", 10), ("fp8_e4m3", 3), ("e2m2", 2)):
        weights, up, down = relative_gaps(get_format(name))
        assert math.log2(math.log(2) / float((weights * (up + down) / 2).sum())) == pytest.approx(p)


def _linear_codebook_bits(levels: int) -> float:
    """By hand: codes k/levels; those with a share of the top binade (0.5, 1] weighted by the log-width of their
    rounding cell there; relative gap 1/k on both sides (the top code's upper gap taken equal to its lower one)."""
    share = {k: math.log(min(k + 0.5, levels) / max(k - 0.5, levels / 2)) for k in range(levels // 2, levels + 1)}
    mean_gap = sum(w / k for k, w in share.items() if w > 0) / math.log(2)
    return math.log2(math.log(2) / mean_gap)


def test_effective_bits_of_codebooks_by_hand():
    assert mantissa_bits("int4_linear") == pytest.approx(_linear_codebook_bits(7), abs=1e-6)  # k/7, k = -7..7 (fp32 codes)
    assert mantissa_bits("int4", signed=False) == pytest.approx(_linear_codebook_bits(16), abs=1e-9)  # zero-free k/16
    assert mantissa_bits("int8_linear", signed=False) == pytest.approx(_linear_codebook_bits(255), abs=0.01)  # k/255
    assert mantissa_bits("int6_linear") == pytest.approx(_linear_codebook_bits(31), abs=0.01)  # dense 6-bit codes: k/31
    assert mantissa_bits("int5_linear", signed=False) == pytest.approx(_linear_codebook_bits(31), abs=0.01)  # k/31
    # int8's dynamic map spaces its top-binade codes 0.9/64 apart: mean relative gap ≈ (0.9/64)·E[1/x] = (0.9/64)/ln 2
    assert mantissa_bits("int8") == pytest.approx(math.log2(math.log(2) ** 2 / (0.9 / 64)), abs=0.05)


def test_mantissa_bits_of_dtypes_and_none():
    assert mantissa_bits(None) == 23.0
    assert [mantissa_bits(d) for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)] == [23.0, 7.0, 10.0, 52.0]
    assert mantissa_bits(torch.float8_e4m3fn) == 3.0 and mantissa_bits(torch.float8_e5m2) == 2.0


def test_mantissa_bits_errors_name_the_valid_values():
    with pytest.raises(ValueError, match="valid formats: fp32, bf16"):
        mantissa_bits("int9")
    with pytest.raises(ValueError, match="valid dtypes: .*bfloat16"):
        mantissa_bits(torch.int8)
    with pytest.raises(TypeError, match="format name, a StorageFormat, a torch dtype or None"):
        mantissa_bits(8)


# --- required_mantissa_bits -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optimizer, component", sorted(SLOPES))
@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_required_bits_follow_the_slopes(optimizer, component, rounding):
    """Doubling T adds ``slope`` bits: 1 for Adam's grads and m, 2 for its weights and v, 1/2 for Muon (and SGD)."""
    slope = {"adam": 2.0 if component in ("weights", "exp_avg_sq") else 1.0, "muon": 0.5, "sgd": 0.5}[optimizer]
    steps = 2**16
    longer = required_mantissa_bits(component, 2 * steps, optimizer, rounding)
    assert longer - required_mantissa_bits(component, steps, optimizer, rounding) == pytest.approx(slope)
    assert required_mantissa_bits(component, steps, optimizer, rounding, constant=1.5) == pytest.approx(slope * 16 + 1.5)


def test_constants_are_the_sweeps_calibration():
    """DEFAULT_CONSTANTS hold what benchmarks/mantissa_sweep.py fitted (its results file); SGD takes Muon's."""
    assert set(DEFAULT_CONSTANTS) == {(o, c, r) for o, c in SLOPES for r in ROUNDINGS}
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "mantissa_sweep.json"
    calibration = json.loads(results.read_text())["calibration"]
    assert len(calibration) == 14  # Adam's 4 components and Muon's 3, both roundings
    for fit in calibration:
        key = (fit["optimizer"], fit["component"], fit["rounding"])
        assert fit["slope"] == SLOPES[key[:2]] and DEFAULT_CONSTANTS[key] == fit["constant"], key
        if fit["optimizer"] == "muon":
            assert DEFAULT_CONSTANTS["sgd", key[1], key[2]] == fit["constant"]
    # what they say at the calibrated horizon: RN needs more than SR for Adam's weights and v, the weights most
    adam = {(c, r): required_mantissa_bits(c, 1000, "adam", r) for c in COMPONENTS for r in ROUNDINGS}
    assert max(adam, key=adam.get) == ("weights", "nearest") and adam["exp_avg_sq", "nearest"] > adam["exp_avg_sq", "stochastic"]
    assert required_mantissa_bits("grads", 1, "adam") == 0.0  # never negative


@pytest.mark.parametrize(
    "arguments, message",
    [
        (("momentum", 1000), r"component='momentum' is not valid; use one of \('grads', 'weights', 'exp_avg', 'exp_avg_sq'\)"),
        (("grads", 1000, "lion"), r"optimizer='lion' is not valid; use one of \('adam', 'muon', 'sgd'\)"),
        (("grads", 1000, "adam", "up"), r"rounding='up' is not valid; use one of \('nearest', 'stochastic'\)"),
        (("grads", 0), r"steps=0 must be an integer >= 1"),
        (("grads", 10.5), r"steps=10.5 must be an integer >= 1"),
        (("grads", True), r"steps=True must be an integer >= 1"),
        (("exp_avg_sq", 1000, "muon"), r"muon has no second moment.*use one of \('grads', 'exp_avg', 'weights'\)"),
        (("exp_avg_sq", 1000, "adam", "nearest", math.nan), r"constant=nan must be a finite real number"),  # max(0, nan) was 0
        (("exp_avg_sq", 1000, "adam", "nearest", "3"), r"constant='3' must be a finite real number"),
    ],
)
def test_required_bits_argument_errors(arguments, message):
    with pytest.raises(ValueError, match=message):
        required_mantissa_bits(*arguments)


def test_integers_and_reals_of_any_type_are_taken():
    """numpy's and 0-d tensor integers for ``steps``, numpy reals for ``constant`` (refused as "not an int >= 1" and
    "not a finite number" before)."""
    expected = required_mantissa_bits("exp_avg_sq", 1000, constant=-13.0)
    for steps in (np.int64(1000), torch.tensor(1000)):
        assert required_mantissa_bits("exp_avg_sq", steps, constant=np.float32(-13.0)) == expected
    optimizer = torch.optim.AdamW(_model().parameters())
    assert advise(optimizer, np.int64(1000)).steps == 1000 and type(advise(optimizer, torch.tensor(1000)).steps) is int


# --- advise -----------------------------------------------------------------------------------------------------------
def test_torch_adamw_in_fp32_is_ok_for_a_moderate_run():
    report = advise(torch.optim.AdamW(_model().parameters()), 10_000)
    assert report.optimizer == "adam" and report.steps == 10_000
    assert [row.component for row in report.rows] == list(COMPONENTS)
    assert all(row.verdict == "ok" and row.mantissa_bits == 23.0 and row.format == "fp32" for row in report.rows)
    assert report.risky == []


def test_bf16_states_written_rn_at_beta2_0999_ratchet():
    model = _model()
    report = advise(QAdamW(model.parameters(), states="bf16", min_quant_size=0), 1000)
    v = _row(report, "exp_avg_sq")
    assert v.format == "bf16" and v.rounding == "nearest" and v.margin > 0  # the T-rule alone would pass it
    assert v.verdict == "insufficient" and v in report.risky
    (ratchet,) = [reason for reason in v.reasons if reason.startswith("stall ratchet")]
    assert "rounding='stochastic'" in ratchet and f"every {reset_period('bf16', 0.999)} steps" in ratchet
    assert "StateResetScheduler" in ratchet and ratchet.endswith("(arXiv 2603.16731, section 1)")
    assert _row(report, "exp_avg").verdict == "ok"  # 1 - β1 = 0.1 is far above bf16's half gap
    stochastic = advise(QAdamW(model.parameters(), states="bf16", min_quant_size=0, rounding="stochastic"), 1000)
    assert _row(stochastic, "exp_avg_sq").verdict == "ok" and not _row(stochastic, "exp_avg_sq").reasons


@pytest.mark.parametrize(("states", "beta1", "steps"), [("bf16", 0.999, 1000), ("int4", 0.9, 100)])
def test_first_moments_have_no_ratchet(states, beta1, steps):
    """The ratchet needs a non-negative input (``v``'s ``g²``); ``m``'s step ``(1 - β1)(g - m)`` grows with a gradient of
    the other sign, so ``m`` is not reported as unable to decrease (bf16 ``m`` at β1 = 0.999 was ``insufficient``, int4's
    at 0.9 ``marginal``, though ``|m|`` falls on about half the steps), for Adam and SGD's momentum alike."""
    params = _model().parameters()
    adam = QAdamW(params, states=states, betas=(beta1, 0.999), min_quant_size=0)
    sgd = QSGD(_model().parameters(), lr=0.1, momentum=beta1, dampening=beta1, states=states, min_quant_size=0)
    for optimizer in (adam, sgd):
        m = _row(advise(optimizer, steps), "exp_avg")
        t_rule = "ok" if m.margin >= 0 else "marginal" if m.margin >= -1 else "insufficient"
        assert m.verdict == t_rule and not any("ratchet" in reason for reason in m.reasons), m


def test_block_scaled_v_ratchets_only_marginally_through_its_scale():
    """int8 v follows its block's fp32 scale down: marginal, not insufficient (the T-rule passes it at 300 steps)."""
    report = advise(QAdamW(_model().parameters(), states="int8", min_quant_size=0), 300)
    v = _row(report, "exp_avg_sq")
    assert v.verdict == "marginal" and any("block's scale" in reason for reason in v.reasons)


def test_v_with_fewer_bits_than_m_is_flagged():
    states = {"exp_avg": "bf16", "exp_avg_sq": "fp8_e4m3"}
    report = advise(QAdamW(_model().parameters(), states=states, min_quant_size=0, rounding="stochastic"), 100)
    v = _row(report, "exp_avg_sq")
    assert v.margin >= 0 and v.verdict == "marginal"  # the T-rule passes it over 100 steps; the ordering does not
    assert len(v.reasons) == 1 and "fewer mantissa bits than m" in v.reasons[0] and v.reasons[0].endswith("(arXiv 2510.21314)")
    assert _row(report, "exp_avg").verdict == "ok"


def test_the_t_rule_grows_with_the_run():
    optimizer = QAdamW(_model().parameters(), states="fp8_e4m3", min_quant_size=0, rounding="stochastic")
    short, long = (_row(advise(optimizer, steps), "exp_avg_sq") for steps in (1000, 1000 * 2**10))
    assert short.verdict == "ok" and long.verdict == "insufficient"
    assert long.required_bits - short.required_bits == pytest.approx(20.0)  # 2 bits per doubling
    assert "e.g. fp32" in long.reasons[0]  # 21 bits: the literal rule over a million steps
    overridden = advise(optimizer, 1000 * 2**10, constants={("adam", "exp_avg_sq", "stochastic"): -40.0})
    assert _row(overridden, "exp_avg_sq").verdict == "ok"


def test_learning_rate_too_small_for_bf16_weights():
    model = _model(torch.bfloat16)
    names = {param: name for name, param in model.named_parameters()}
    report = advise(torch.optim.AdamW(model.parameters(), lr=1e-6), 1000, names=names)
    weights = _row(report, "weights")
    assert weights.format == "bf16" and weights.verdict == "insufficient"
    (lost,) = [reason for reason in weights.reasons if "FlashOptim" in reason]
    assert "4 of 4 parameter(s)" in lost and "0.weight" in lost and "weight_rounding='stochastic'" in lost
    largest = float(model[0].weight.detach().abs().max())
    assert f"{2.0 ** (math.floor(math.log2(largest)) - 8):.3g}" in lost  # 2^(floor(log2 max|W|) - M - 1), M = 7
    moving = _row(advise(torch.optim.AdamW(model.parameters(), lr=1e-2), 1000), "weights").reasons
    assert not any("FlashOptim" in reason for reason in moving)  # (the T-rule still asks for more than bf16 under RN)
    assert not _row(advise(torch.optim.AdamW(_model().parameters(), lr=1e-6), 1000), "weights").reasons  # fp32 weights


def test_learning_rate_check_takes_the_schedulers_base_lr():
    """A warm-up from 0 leaves the group's lr at 0 when training starts: the check reads the ``initial_lr`` torch's
    schedulers keep (every bf16 weight was ``insufficient`` under a warm-up, fine without one); a group at lr 0 without
    a scheduler is frozen, not reported."""
    model = _model(torch.bfloat16)
    plain = _row(advise(torch.optim.AdamW(model.parameters(), lr=1e-2), 1000), "weights")
    warm_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.optim.lr_scheduler.LambdaLR(warm_optimizer, lambda step: step / 100)
    assert warm_optimizer.param_groups[0]["lr"] == 0.0
    assert _row(advise(warm_optimizer, 1000), "weights") == plain
    slow = torch.optim.AdamW(model.parameters(), lr=1e-6)
    torch.optim.lr_scheduler.LambdaLR(slow, lambda step: step / 100)
    (lost,) = [reason for reason in _row(advise(slow, 1000), "weights").reasons if "FlashOptim" in reason]
    assert "lr = 1e-06 (its scheduler's peak; now 0)" in lost
    frozen = _row(advise(torch.optim.AdamW(model.parameters(), lr=0.0), 1000), "weights")
    assert not any("FlashOptim" in reason for reason in frozen.reasons)
    # OneCycleLR keeps its low start (max_lr / 25) as initial_lr and its peak as max_lr: the peak is the run's lr
    cycled = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.optim.lr_scheduler.OneCycleLR(cycled, max_lr=1e-2, total_steps=1000)
    assert _row(advise(cycled, 1000), "weights") == plain


def test_fp16_v_written_rn_is_marginal_for_its_subnormals():
    """fp16's normals have the bits for v at β2 = 0.999, but below 2^-14 its grid is subnormal (spacing 2^-24): a v under
    2^-25 / (1 - β2) ~ 3e-5 never decreases written RN, and gradients of 1e-4 to 1e-3 put all of a model's v there (the
    advisor said ok while StallMonitor measured a stall rate of 1). Stochastic rounding is unbiased there: no note."""
    v = _row(advise(QAdamW(_model().parameters(), states="fp16", min_quant_size=0), 1000), "exp_avg_sq")
    assert v.margin >= 0 and v.verdict == "marginal"
    (subnormal,) = v.reasons
    assert subnormal.startswith("fp16 subnormals") and "2.98e-05" in subnormal and "rounding='stochastic'" in subnormal
    stochastic = _row(advise(QAdamW(_model().parameters(), states="fp16", min_quant_size=0, rounding="stochastic"), 1000), "exp_avg_sq")
    assert stochastic.verdict == "ok" and not stochastic.reasons
    slow = _row(advise(QAdamW(_model().parameters(), states="fp16", betas=(0.9, 0.9999), min_quant_size=0), 1000), "exp_avg_sq")
    assert slow.verdict == "insufficient" and len(slow.reasons) == 2  # the normals' ratchet too: the worse verdict stands


def test_weights_kept_with_exact_error_feedback_count_as_master_weights():
    optimizer = QAdamW(_model().parameters(), lr=1e-6, weights="bf16", error_feedback="eco_exact", min_quant_size=0)
    weights = _row(advise(optimizer, 1000), "weights")
    assert weights.format == "bf16+eco_exact" and weights.mantissa_bits == 23.0 and weights.verdict == "ok"


@pytest.mark.parametrize("quantized", [False, True])
def test_muon_has_no_second_moment(quantized):
    params = [p for p in _model().parameters() if p.ndim == 2]
    optimizer = QMuon(params, states="bf16", min_quant_size=0) if quantized else torch.optim.Muon(params)
    report = advise(optimizer, 1000)
    assert report.optimizer == "muon" and [row.component for row in report.rows] == ["grads", "weights", "exp_avg"]
    assert _row(report, "exp_avg").format == ("bf16" if quantized else "fp32")
    assert _row(report, "exp_avg").required_bits == pytest.approx(0.5 * math.log2(1000) + DEFAULT_CONSTANTS["muon", "exp_avg", "nearest"])


def test_learning_rate_too_small_for_muon_on_bf16_weights():
    """Muon's typical update is its adjusted lr over sqrt(max(A, B)): 0.1 moves 64x32 bf16 weights, 1e-6 does not."""
    params = [p for p in _model(torch.bfloat16).parameters() if p.ndim == 2]
    (lost,) = _row(advise(torch.optim.Muon(params, lr=1e-6), 1000), "weights").reasons
    assert "Muon's typical update" in lost and "2 of 2 parameter(s)" in lost
    assert not _row(advise(torch.optim.Muon(params, lr=1e-1), 1000), "weights").reasons


def test_sgd_momentum_is_the_exp_avg_component():
    params = list(_model().parameters())
    assert [row.component for row in advise(torch.optim.SGD(params, lr=0.1), 1000).rows] == ["grads", "weights"]
    report = advise(torch.optim.SGD(params, lr=0.1, momentum=0.9), 1000)
    assert report.optimizer == "sgd" and [row.component for row in report.rows] == ["grads", "weights", "exp_avg"]


def test_quantize_optimizer_forms_of_adam():
    model = _model()
    converted = quantize_optimizer(torch.optim.Adam(model.parameters()), states="int8", min_quant_size=0)
    report = advise(converted, 1000)
    assert report.optimizer == "adam" and (_row(report, "exp_avg").format, _row(report, "exp_avg_sq").format) == ("int8", "int8")
    assert _row(report, "exp_avg").mantissa_bits == pytest.approx(EXPECTED_BITS["int8"][0], abs=0.005)  # signed map for m
    assert _row(report, "exp_avg_sq").mantissa_bits == pytest.approx(EXPECTED_BITS["int8"][1], abs=0.005)  # unsigned for v
    wrapped = quantize_optimizer(torch.optim.NAdam(model.parameters()), states="bf16", min_quant_size=0)
    assert isinstance(wrapped, QuantizedOptimizerWrapper)
    report = advise(wrapped, 1000)
    assert report.optimizer == "adam" and _row(report, "exp_avg_sq").format == "bf16"


def test_parameters_with_different_formats_report_the_coarsest():
    optimizer = QAdamW(_model().parameters(), states="int8", min_quant_size=512)  # the weights (2048, 512) int8, the biases fp32
    v = _row(advise(optimizer, 300), "exp_avg_sq")
    assert v.format == "int8" and any("fp32 ×2, int8 ×2" in reason and "coarsest" in reason for reason in v.reasons)


def test_gradient_formats():
    params = list(_model().parameters())
    assert _row(advise(torch.optim.AdamW(params), 1000, grads="fp8_e4m3"), "grads").mantissa_bits == 3.0
    assert _row(advise(torch.optim.AdamW(params), 1000, grads=torch.bfloat16), "grads").format == "bf16"
    grouped = torch.optim.AdamW([{"params": params[:2], "grads": "e3m2", "rounding": "stochastic"}, {"params": params[2:]}])
    report = advise(grouped, 1000)
    assert (_row(report, "grads", 0).format, _row(report, "grads", 0).rounding) == ("e3m2", "stochastic")
    assert _row(report, "grads", 1).format == "fp32"
    with pytest.raises(ValueError, match="grads='int9'.*valid formats"):
        advise(torch.optim.AdamW(params), 1000, grads="int9")


def test_advise_argument_errors():
    params = list(_model().parameters())
    with pytest.raises(TypeError, match="no precision rule for Adagrad; supported: .*Muon"):
        advise(torch.optim.Adagrad(params), 1000)
    with pytest.raises(ValueError, match="steps=0 must be an integer >= 1"):
        advise(torch.optim.AdamW(params), 0)
    with pytest.raises(ValueError, match=r"advise: constants key \('adam', 'exp_avg_sq', 'up'\) is not valid"):
        advise(torch.optim.AdamW(params), 1000, constants={("adam", "exp_avg_sq", "up"): 0.0})
    # the values too, every one (a NaN for a key the optimizer does not use passed; one it used named no option)
    for constants in ({("muon", "exp_avg", "nearest"): math.nan}, {("adam", "exp_avg", "nearest"): math.inf}):
        with pytest.raises(ValueError, match=r"advise: constants\[\('\w+', 'exp_avg', 'nearest'\)\]=\w+ must be a finite number"):
            advise(torch.optim.AdamW(params), 1000, constants=constants)
    with pytest.raises(ValueError, match=r"advise: constants=5 must be a dict"):
        advise(torch.optim.AdamW(params), 1000, constants=5)
    numpy_constant = {("adam", "exp_avg", "nearest"): np.float64(-2.0)}  # numpy numbers as advise takes them
    assert advise(torch.optim.AdamW(params), 1000, constants=numpy_constant).rows


def test_text_and_markdown_tables_hold_every_row_and_note():
    states = {"exp_avg": "bf16", "exp_avg_sq": "fp8_e4m3"}
    report = advise(QAdamW(_model(torch.bfloat16).parameters(), lr=1e-6, states=states, min_quant_size=0), 5000)
    notes = [reason for row in report.rows for reason in row.reasons]
    assert len(notes) >= 3
    text, markdown = str(report), report.to_markdown()
    table = text.splitlines()[2 : 2 + len(report.rows)]
    for line, row in zip(table, report.rows, strict=True):
        assert line.split()[:2] == [str(row.group), row.component] and row.verdict in line and f"{row.margin:+.1f}" in line
    assert sum(line.startswith("| 0 |") for line in markdown.splitlines()) == len(report.rows)
    for number, note in enumerate(notes, 1):
        assert f"[{number}] " in text and note in text and f"{number}. " in markdown and note in markdown
    assert f"{len(report.risky)} component(s) at risk" in text.splitlines()[0]
