"""Adaptive per-layer bit-widths: the policy pieces (``lightning_qstate.adaptive``) and the ``AdaptiveBitWidth`` callback on one device.

The multi-process runs (DDP-style decisions on every rank, FSDP1/FSDP2 with uneven shards, resume) are in
``test_distributed.py``; ``BitWidthPlanner`` driven by a plain torch loop is in ``test_adaptive_planner.py``.
"""

from __future__ import annotations

import io
import warnings

import lightning.pytorch as pl
import matplotlib.image
import matplotlib.pyplot
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_qstate import QAdamW
from lightning_qstate.adaptive import (
    DEFAULT_M_FORMATS,
    DEFAULT_V_FORMATS,
    ZONES,
    AnnealedThreshold,
    BudgetError,
    ZoneHysteresis,
    budget_ladder,
    budget_order,
    check_zone_formats,
    classify_zone,
    ema,
    fit_budget,
    format_nbytes,
    gradient_statistics,
    model_statistics,
    resolved_nbytes,
    zone_ladder,
)
from lightning_qstate.arguments import ConfigurationError
from lightning_qstate.callbacks import AdaptiveBitWidth, QuantizedOptimizerStates
from lightning_qstate.callbacks.adaptive_bits import bit_width_figure
from lightning_qstate.formats import QuantizedTensor, get_format
from lightning_qstate.optim import state_summary
from lightning_qstate.plugins import QStatePrecision

from lightning_models import Regressor, flat_weights, quiet_trainer, regression_data

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")

# Checks at every step, a threshold that rises fast: zones (and formats) change within a few steps.
FAST = dict(interval=1, hysteresis=1, threshold_start=0.3, threshold_end=6.0, anneal_steps=8, ema_decay=0.5)
TARGET = 9.0  # Regressor with min_quant_size=1024: 6.65 bits at least (fp32 small states), 10.2 with every state at 8 bits


# --- statistics, zones, annealing, hysteresis -----------------------------------------------------------
def sums(tensor: torch.Tensor) -> tuple[float, float, float]:
    tensor = tensor.double()
    return float(tensor.abs().sum()), float(tensor.square().sum()), float(tensor.numel())


def test_gradient_statistics_from_sums_of_shards():
    grad = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.1, 3, 1000)
    rms, dispersion = gradient_statistics(*sums(grad))
    assert rms == pytest.approx(float(grad.double().square().mean().sqrt()), rel=1e-12)
    assert dispersion == pytest.approx(float(grad.double().abs().std(unbiased=False) / grad.double().abs().mean()), rel=1e-9)
    parts = [sums(part) for part in grad.split([1, 600, 399])]  # uneven shards add up to the whole
    assert gradient_statistics(*(sum(column) for column in zip(*parts, strict=False))) == pytest.approx((rms, dispersion), rel=1e-12)
    assert gradient_statistics(0.0, 0.0, 0.0) == gradient_statistics(0.0, 0.0, 10.0) == (0.0, 0.0)


def test_model_statistics_references():
    layers = [
        torch.randn(300, generator=torch.Generator().manual_seed(1)),
        10 * torch.randn(100, generator=torch.Generator().manual_seed(2)),
    ]
    abs_sums, square_sums, counts = zip(*(sums(layer) for layer in layers), strict=False)
    pooled = gradient_statistics(*sums(torch.cat(layers)))
    assert model_statistics(abs_sums, square_sums, counts, "model") == pytest.approx(pooled, rel=1e-12)
    per_layer = [gradient_statistics(*sums(layer)) for layer in layers]
    weighted = [(300 * a + 100 * b) / 400 for a, b in zip(*per_layer, strict=False)]
    assert model_statistics(abs_sums, square_sums, counts, "layers") == pytest.approx(weighted, rel=1e-12)
    assert pooled[1] > max(r for _, r in per_layer)  # pooling mixes the scales: its dispersion exceeds every layer's
    with pytest.raises(ValueError, match="reference='median'.*'layers', 'model'"):
        model_statistics(abs_sums, square_sums, counts, "median")


def test_ema_starts_at_the_first_value():
    assert ema(None, 3.0, 0.9) == 3.0
    assert ema(3.0, 1.0, 0.75) == pytest.approx(2.5)


@pytest.mark.parametrize(
    "rms,dispersion,zone", [(2.0, 2.0, "critical"), (2.0, 0.5, "magnitude"), (0.5, 2.0, "structural"), (0.5, 0.5, "redundant")]
)
def test_zones_are_the_four_quadrants(rms, dispersion, zone):
    assert classify_zone(rms, dispersion, 1.0, 1.0, threshold=1.0) == zone
    assert classify_zone(rms, dispersion, 1.0, 1.0, threshold=4.0) == "redundant"  # a high enough threshold: nothing is high


def test_annealed_threshold_rises_to_its_end_and_stays():
    threshold = AnnealedThreshold(1.0, 1.5, steps=100)
    values = [threshold(step) for step in range(0, 201, 10)]
    assert values[0] == 1.0 and threshold(50) == pytest.approx(1.25) and threshold(100) == threshold(10_000) == 1.5
    assert values == sorted(values)
    with pytest.raises(ValueError, match="start=0"):
        AnnealedThreshold(0, 1.5, 10)
    with pytest.raises(ValueError, match="steps=0"):
        AnnealedThreshold(1.0, 1.5, 0)


def test_annealing_moves_layers_to_lower_zones():
    threshold = AnnealedThreshold(1.0, 2.0, steps=10)
    zones = [classify_zone(1.5, 1.5, 1.0, 1.0, threshold(step)) for step in (0, 10)]
    assert zones == ["critical", "redundant"]


def test_hysteresis_needs_a_zone_to_persist():
    layer = ZoneHysteresis()
    assert layer.observe("critical", persist=3) and layer.zone == "critical"  # the first observation is adopted at once
    assert not layer.observe("redundant", 3) and not layer.observe("redundant", 3)
    assert layer.zone == "critical" and (layer.pending, layer.streak) == ("redundant", 2)
    assert not layer.observe("structural", 3) and (layer.pending, layer.streak) == ("structural", 1)  # another zone restarts the count
    assert not layer.observe("critical", 3) and (layer.pending, layer.streak) == (None, 0)  # back to its zone: nothing pending
    assert [layer.observe("magnitude", 3) for _ in range(3)] == [False, False, True]
    assert layer.zone == "magnitude" and layer.pending is None
    assert layer.observe("redundant", persist=1) and layer.zone == "redundant"


# --- formats, bytes and the budget ------------------------------------------------------------------------
def test_zone_formats_are_checked():
    good = {zone: "int4" for zone in ZONES}
    assert check_zone_formats(good, "v_formats") == good
    with pytest.raises(ValueError, match=r"v_formats must name exactly the zones \['critical', 'magnitude', 'structural', 'redundant'\]"):
        check_zone_formats({"critical": "int8"}, "v_formats")
    with pytest.raises(ValueError, match=r"m_formats\['redundant'\]: unknown format 'int3'"):
        check_zone_formats({**good, "redundant": "int3"}, "m_formats")
    with pytest.raises(ValueError, match=r"m_formats\['critical'\]='fp32' is not a candidate"):
        check_zone_formats({**good, "critical": "fp32"}, "m_formats")
    with pytest.raises(TypeError, match="m_formats must be a mapping"):
        check_zone_formats("int8", "m_formats")


@pytest.mark.parametrize("numel", [1, 100, 4096, 5000, 70_000])
@pytest.mark.parametrize(
    "name,signed", [("int8", True), ("int4", False), ("int4_linear", True), ("e4m0", False), ("e3m3", False), ("bf16", True)]
)
def test_priced_bytes_are_the_stored_bytes(numel, name, signed):
    """The budget prices a candidate at exactly the bytes a quantized state of that size holds (scales included)."""
    state = "exp_avg" if signed else "exp_avg_sq"
    param = torch.nn.Parameter(torch.zeros(numel))
    group = {"states": name, "block_size": None, "min_quant_size": 0}
    stored = get_format(name, signed=signed).quantize(torch.rand(numel))
    assert resolved_nbytes(group, state, param, numel) == stored.nbytes == format_nbytes(stored.format, numel)
    assert resolved_nbytes({**group, "min_quant_size": numel + 1}, state, param, numel) == 4 * numel  # kept fp32: priced as fp32


def stored_nbytes(numel: int):
    """Bytes of a state of ``numel`` values in a format (m signed, v unsigned), as the callback prices it."""
    return lambda state, name: get_format(name, signed=state == "exp_avg").nbytes(numel)


def test_zone_ladder_falls_to_the_floor():
    formats = {"exp_avg": {"critical": "int8_linear", "magnitude": "int8_linear", "structural": "int8", "redundant": "int4_linear"},
               "exp_avg_sq": {"critical": "int8", "magnitude": "e4m0", "structural": "e4m0", "redundant": "e4m0"}}  # fmt: skip
    nbytes = stored_nbytes(10_000)

    ladder = zone_ladder(None, formats, nbytes)
    assert [choice for choice, _ in ladder] == [
        ("int8_linear", "int8"),
        ("int8_linear", "e4m0"),
        ("int4_linear", "e4m0"),
    ]  # structural saves nothing over magnitude
    assert [cost for _, cost in ladder] == sorted({cost for _, cost in ladder}, reverse=True)
    assert zone_ladder("structural", formats, nbytes)[0][0] == ("int8", "e4m0")
    assert zone_ladder("redundant", formats, nbytes) == [
        (("int4_linear", "e4m0"), nbytes("exp_avg", "int4_linear") + nbytes("exp_avg_sq", "e4m0"))
    ]
    upside_down = {state: {**per_zone, "redundant": per_zone["critical"]} for state, per_zone in formats.items()}
    assert zone_ladder("redundant", upside_down, nbytes)[-1][0] == ("int8_linear", "e4m0")  # the floor: the cheapest candidates


ladders_strategy = st.lists(
    st.lists(st.integers(1, 10_000), min_size=1, max_size=4, unique=True).map(lambda costs: sorted(costs, reverse=True)),
    min_size=1,
    max_size=12,
)


def test_budget_ladder_adds_the_higher_zones_above_the_zone():
    formats = {"exp_avg": {"critical": "int8_linear", "magnitude": "int4_linear", "structural": "int4", "redundant": "int4"},
               "exp_avg_sq": {"critical": "int8", "magnitude": "int8", "structural": "int8", "redundant": "e4m0"}}  # fmt: skip
    nbytes = stored_nbytes(10_000)

    def cost(m: str, v: str) -> int:
        return nbytes("exp_avg", m) + nbytes("exp_avg_sq", v)

    for zone in (None, "critical"):
        assert budget_ladder(zone, formats, nbytes) == (zone_ladder(zone, formats, nbytes), 0)
    ladder, start = budget_ladder("redundant", formats, nbytes)  # magnitude costs what structural costs: skipped
    assert [choice for choice, _ in ladder] == [("int8_linear", "int8"), ("int4", "int8"), ("int4", "e4m0")] and start == 2
    assert [bytes_ for _, bytes_ in ladder] == [cost("int8_linear", "int8"), cost("int4", "int8"), cost("int4", "e4m0")]
    ladder, start = budget_ladder("structural", formats, nbytes)
    assert [choice for choice, _ in ladder] == [("int8_linear", "int8"), ("int4", "int8"), ("int4", "e4m0")] and start == 1
    assert ladder[start:] == zone_ladder("structural", formats, nbytes)


@settings(max_examples=300, deadline=None)
@given(ladders=ladders_strategy, fixed=st.integers(0, 5_000), target_bits=st.floats(0.5, 40), data=st.data())
def test_budget_is_always_met_or_refused(ladders, fixed, target_bits, data):
    values = sum(ladder[0] for ladder in ladders) // 2 + 1
    order = data.draw(st.permutations(range(len(ladders))))
    start = [data.draw(st.integers(0, len(ladder) - 1)) for ladder in ladders]
    cap = target_bits * values / 8
    floor = fixed + sum(ladder[-1] for ladder in ladders)
    if floor > cap:
        with pytest.raises(BudgetError, match=f"target_bits={target_bits} cannot be met"):
            fit_budget(ladders, fixed, values, target_bits, order, start)
        return
    rungs = fit_budget(ladders, fixed, values, target_bits, order, start)
    total = fixed + sum(ladder[rung] for ladder, rung in zip(ladders, rungs, strict=False))
    assert total <= cap
    # no layer left above rung 0 could take its next rung up within the cap: the slack is used
    assert all(total + ladder[rung - 1] - ladder[rung] > cap for ladder, rung in zip(ladders, rungs, strict=False) if rung > 0)
    asked = fixed + sum(ladder[rung] for ladder, rung in zip(ladders, start, strict=False))
    if asked <= cap:  # nothing demoted: every layer at its zone's rung or promoted
        assert all(rung <= first for rung, first in zip(rungs, start, strict=False))
    else:  # some layer stays demoted below its zone's rung
        assert any(rung > first for rung, first in zip(rungs, start, strict=False))
    assert fit_budget(ladders, fixed, values, None, order, start) == start
    assert fit_budget(ladders, fixed, values, None, order) == [0] * len(ladders)
    assert fit_budget(ladders, fixed, values, target_bits, order, start) == rungs  # deterministic


def test_budget_demotes_in_order_then_fills_the_slack_in_the_same_order():
    ladders = [[100, 60, 20], [100, 60, 20], [40, 10], [30, 20]]
    order = [0, 1, 2, 3]  # layer 0 is demoted first and promoted first
    # asks 260 bytes; cap 200: layer 0 demoted to its floor (180), then the slack promotes layer 3 to rung 0 (190)
    assert fit_budget(ladders, 0, 200, 8.0, order, [0, 0, 0, 1]) == [2, 0, 0, 0]
    # asks 70 bytes; cap 200: round 1 moves layers 0, 1, 2, 3 one rung up (190), round 2 has no room left
    assert fit_budget(ladders, 0, 200, 8.0, order, [2, 2, 1, 1]) == [1, 1, 0, 0]
    # cap 230: round 2 promotes layer 0 (the first in the order, 230) but not layer 1
    assert fit_budget(ladders, 0, 230, 8.0, order, [2, 2, 1, 1]) == [0, 1, 0, 0]
    # a rung too big for the slack is skipped and a smaller one later in the order still takes it
    assert fit_budget([[100, 20], [30, 20]], 0, 55, 8.0, [0, 1], [1, 1]) == [1, 0]
    assert fit_budget(ladders, 0, 200, None, order, [2, 2, 1, 1]) == [2, 2, 1, 1]
    # fill=False: demotions only (layer 3 stays at its zone's rung 1, 180 bytes)
    assert fit_budget(ladders, 0, 200, 8.0, order, [0, 0, 0, 1], fill=False) == [2, 0, 0, 1]
    assert fit_budget(ladders, 0, 200, 8.0, order, [2, 2, 1, 1], fill=False) == [2, 2, 1, 1]


def test_reserved_rungs_are_a_last_resort():
    ladders, order = [[100, 60, 20], [40, 30]], [0, 1]  # layer 0's last rung (20) is reserved
    # cap 95: met without the reserve (layer 1 demoted too); without a reserve layer 0 would fall to 20 alone
    assert fit_budget(ladders, 0, 95, 8.0, order, reserve=[1, 0]) == [1, 1]
    assert fit_budget(ladders, 0, 95, 8.0, order) == [2, 0]
    # cap 85: the zones' rungs cannot meet it (60 + 30 = 90), so the reserve is used
    assert fit_budget(ladders, 0, 85, 8.0, order, reserve=[1, 0]) == fit_budget(ladders, 0, 85, 8.0, order) == [2, 0]
    with pytest.raises(BudgetError, match="cheapest candidates give 8.000 bits"):  # 20 + 30 bytes over 50 values at the floor
        fit_budget(ladders, 0, 50, 7.0, order, reserve=[1, 0])
    assert fit_budget(ladders, 0, 95, None, order, [0, 1], reserve=[1, 0]) == [0, 1]


def test_the_room_goes_to_the_least_precise_layers_first():
    """With the default maps, the room goes to the least precise layer's v first: a redundant layer's v from 5 to 6
    bits, before a magnitude layer's promotion (m 4 -> 8 bits and v 7 -> 8)."""
    formats = {"exp_avg": DEFAULT_M_FORMATS, "exp_avg_sq": DEFAULT_V_FORMATS}
    nbytes = stored_nbytes(10_000)
    zones, names = ["magnitude", "redundant", "critical"], ["a", "b", "c"]
    assert budget_order(zones, [10_000] * 3, names) == [1, 0, 2]
    assert budget_order(zones, [1, 2, 3], names) == [1, 0, 2]  # the zone decides before the size
    assert budget_order(["redundant", "redundant", None], [1, 2, 3], names) == [1, 0, 2]  # then the size, then the name; None is critical
    assert budget_order(["redundant"] * 2, [5, 5], ["y", "x"]) == [1, 0]
    planned = [budget_ladder(zone, formats, nbytes) for zone in zones]
    assert [choice for choice, _ in planned[1][0]] == [("int8_linear", "int8"), ("int4", "int7"), ("int4", "int6"), ("int4", "int5")]
    costs = [[cost for _, cost in ladder] for ladder, _ in planned]
    starts = [start for _, start in planned]
    asked = sum(ladder[start] for ladder, start in zip(costs, starts, strict=False))
    v_step = nbytes("exp_avg_sq", "int6") - nbytes("exp_avg_sq", "int5")
    a_step = nbytes("exp_avg", "int8_linear") - nbytes("exp_avg", "int4") + nbytes("exp_avg_sq", "int8") - nbytes("exp_avg_sq", "int7")
    values = 2 * 3 * 10_000
    target_bits = 8 * (asked + v_step) / values  # room for b's first promotion, not for a's
    assert a_step > v_step
    rungs = fit_budget(costs, 0, values, target_bits, budget_order(zones, [10_000] * 3, names), starts)
    chosen = [planned[i][0][rung][0] for i, rung in enumerate(rungs)]
    assert chosen == [("int4", "int7"), ("int4", "int6"), ("int8_linear", "int8")]  # b's v promoted; a stays


# --- the callback on one device -------------------------------------------------------------------------
def trainer(tmp_path, max_steps: int = 8, **kwargs) -> pl.Trainer:
    return quiet_trainer(tmp_path, max_steps, **kwargs)


def plugin(min_quant_size: int = 1024) -> QStatePrecision:
    return QStatePrecision(states="int8", min_quant_size=min_quant_size)


def average_bits(optimizer: torch.optim.Optimizer) -> float:
    summary = state_summary(optimizer)
    return 8 * summary["bytes"] / summary["values"]


@pytest.mark.parametrize(
    "kwargs,error",
    [
        ({"target_bits": 0}, r"target_bits=0 must be a number > 0"),
        ({"target_bits": "5"}, r"target_bits='5' must be a number > 0"),
        ({"target_bits": float("inf")}, r"target_bits=inf must be a number > 0 \(average bits per state value\) or None \(no cap\)"),
        ({"interval": 0}, r"interval=0 must be an int >= 1"),
        ({"hysteresis": 1.5}, r"hysteresis=1.5 must be an int >= 1"),
        ({"max_history": 0}, r"max_history=0 must be an int >= 1"),
        ({"ema_decay": 1.0}, r"ema_decay=1.0 must be in \[0, 1\)"),
        ({"anneal_steps": 0}, r"anneal_steps=0 must be an int >= 1 or None"),
        ({"threshold_end": -1}, r"threshold_start=1.0 and threshold_end=-1 must be > 0"),
        ({"reference": "pooled"}, r"reference='pooled' is not valid; use one of \('layers', 'model'\)"),
        ({"m_formats": {"critical": "int8"}}, r"m_formats must name exactly the zones"),
        ({"v_formats": {zone: "int9" for zone in ZONES}}, r"v_formats\['critical'\]: unknown format 'int9'"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, error):
    with pytest.raises(ValueError, match="AdaptiveBitWidth: " + error):
        AdaptiveBitWidth(**kwargs)


@pytest.mark.parametrize("target_bits", [None, TARGET])
def test_decisions_reencode_states_and_meet_the_budget(tmp_path, monkeypatch, target_bits):
    """Without a cap the zones alone decide, and they change formats during the run; with ``TARGET`` the budget binds
    at every check and (two quantized layers) plans the same formats whatever the zones."""
    model = Regressor()
    callback = AdaptiveBitWidth(target_bits=target_bits, **FAST)
    reencoded = []
    original = QAdamW.reencode_state

    def recording(self, param, name, fmt):  # compared at once: later native steps update the new state's codes in place
        before = self.state[param][name]
        direct = fmt.quantize(before.dequantize())
        original(self, param, name, fmt)
        after = self.state[param][name]
        same = torch.equal(after.codes, direct.codes) and torch.equal(after.scales, direct.scales)
        reencoded.append((before.format, after.format, fmt, same))

    monkeypatch.setattr(QAdamW, "reencode_state", recording)
    fit = trainer(tmp_path, plugins=[plugin()], callbacks=[callback])
    fit.fit(model, regression_data())
    optimizer = fit.strategy.optimizers[0]

    assert callback.planner.last_check == 7 and len(callback.planner.history) == 8
    if target_bits is None:
        assert reencoded, "a decision changed a state's format"
    # a transition is a re-encoded state: not a changed decision for a state kept fp32, nor the plan of the first check (no states yet)
    assert callback.planner.transitions == len(reencoded)
    for before, after, fmt, same in reencoded:  # re-encoding loses nothing beyond the new format's precision: RN from the decoded values
        assert after is fmt and before.config != fmt.config and same

    names = {param: name for name, param in model.named_parameters()}
    decisions = callback.decisions()
    assert set(decisions) == set(names.values()) and all(entry["zone"] in ZONES for entry in decisions.values())
    for param, state in optimizer.state.items():
        decided = decisions[names[param]]
        assert optimizer.state_overrides[param] == {
            "exp_avg": decided["exp_avg"],
            "exp_avg_sq": decided["exp_avg_sq"],
        }  # new states follow too
        for name in ("exp_avg", "exp_avg_sq"):
            if param.numel() >= 1024:
                assert state[name].format.name == decided[name], (names[param], name)
            else:  # below min_quant_size: fp32 whatever the zone
                assert not isinstance(state[name], QuantizedTensor)

    metrics = callback.metrics()
    assert metrics["qstate/adaptive/avg_bits"] == pytest.approx(average_bits(optimizer), rel=1e-12)  # the plan is the stored bytes
    assert metrics["qstate/adaptive/bytes_saved"] == state_summary(optimizer)["fp32_bytes"] - state_summary(optimizer)["bytes"]
    assert sum(metrics[f"qstate/adaptive/zone_{zone}"] for zone in ZONES) == len(names)
    if target_bits is not None:
        assert metrics["qstate/adaptive/avg_bits"] <= TARGET
        numels = torch.tensor([float(param.numel()) for param in model.parameters()])
        for entry in callback.planner.history:  # the cap held at every check
            bits = torch.tensor(entry["bits"])
            assert float((bits * numels).sum() / (2 * numels.sum())) <= TARGET


def test_the_plan_spends_the_room_under_the_cap(tmp_path):
    """After the fit no adapted layer could move one rung up its budget ladder within the cap; the zones alone ask for less."""
    callback = AdaptiveBitWidth(target_bits=TARGET, **FAST)
    fit = trainer(tmp_path, plugins=[plugin()], callbacks=[callback])
    fit.fit(Regressor(), regression_data())
    values = 2 * sum(layer.numel for layer in callback.planner.layers)
    total = sum(sum(layer.state_bytes()) for layer in callback.planner.layers)
    assert 8 * total / values <= TARGET
    promoted = 0
    for layer in callback.planner.layers:
        ladder, start = budget_ladder(
            layer.hysteresis.zone, callback.planner.formats, lambda state, name, layer=layer: layer.nbytes[(state, name)]
        )
        rung = [choice for choice, _ in ladder].index(layer.choice)
        promoted += rung < start
        if rung > 0:
            assert 8 * (total + ladder[rung - 1][1] - ladder[rung][1]) / values > TARGET, layer.name
    assert promoted, "the zones' formats alone leave room under the cap: some layer is promoted"


def test_tighter_budget_demotes_more(tmp_path):
    bits = {}
    for target in (None, 8.0, 7.0):
        fit = trainer(tmp_path, max_steps=2, plugins=[plugin()], callbacks=[AdaptiveBitWidth(target_bits=target, interval=1)])
        fit.fit(Regressor(), regression_data())
        bits[target] = average_bits(fit.strategy.optimizers[0])
    assert bits[7.0] <= 7.0 and bits[8.0] <= 8.0 < bits[None]  # without a cap the zones' formats alone give more
    assert bits[7.0] <= bits[8.0]


def test_unreachable_budget_raises_at_the_start(tmp_path):
    callback = AdaptiveBitWidth(target_bits=8.0)
    with pytest.raises(
        BudgetError, match=r"BitWidthPlanner: target_bits=8.0 cannot be met: the cheapest candidates give .* bits.*min_quant_size"
    ):
        trainer(tmp_path, plugins=[plugin(min_quant_size=8000)], callbacks=[callback]).fit(Regressor(), regression_data())


def test_unsupported_optimizers_are_refused(tmp_path):
    # a usage error of the run's configuration (the command line's exit 2), as an unreachable budget (a BudgetError)
    with pytest.raises(ConfigurationError, match="AdaptiveBitWidth needs a QAdam/QAdamW optimizer with quantized states, got AdamW; add"):
        trainer(tmp_path, callbacks=[AdaptiveBitWidth()]).fit(Regressor(), regression_data())
    assert issubclass(BudgetError, ConfigurationError)

    class AMSGrad(Regressor):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), amsgrad=True)

    with pytest.raises(ValueError, match="does not support amsgrad=True"):
        trainer(tmp_path, plugins=[plugin()], callbacks=[AdaptiveBitWidth()]).fit(AMSGrad(), regression_data())


def test_overridden_parameters_keep_their_formats_and_count(tmp_path):
    model = Regressor()
    states = QuantizedOptimizerStates(min_quant_size=0, overrides={"net.0.weight": "bf16"}, log_stats=False)
    callback = AdaptiveBitWidth(target_bits=13.0, **FAST)  # bf16 for 70 % of the values: 12.3 bits at least
    fit = trainer(tmp_path, callbacks=[states, callback])
    fit.fit(model, regression_data())
    optimizer = fit.strategy.optimizers[0]
    assert "net.0.weight" not in callback.decisions()
    assert {optimizer.state_format(model.net[0].weight, name).name for name in ("exp_avg", "exp_avg_sq")} == {"bf16"}
    assert (
        callback.metrics()["qstate/adaptive/avg_bits"] == pytest.approx(average_bits(optimizer), rel=1e-12)
        and average_bits(optimizer) <= 13.0
    )


def test_resume_continues_exactly(tmp_path):
    """Straight to step 8 == to step 4, checkpoint, resume to 8: weights, states, decisions, EMAs and history.
    (Without the budget's promotions, so that the zones change the plan of the two quantized layers during the run.)"""
    straight_model, straight_callback = Regressor(), AdaptiveBitWidth(target_bits=TARGET, fill_budget=False, **FAST)
    straight = trainer(tmp_path / "a", plugins=[plugin()], callbacks=[straight_callback])
    straight.fit(straight_model, regression_data())

    first_callback = AdaptiveBitWidth(target_bits=TARGET, fill_budget=False, **FAST)
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    trainer(tmp_path / "b", max_steps=4, enable_checkpointing=True, plugins=[plugin()], callbacks=[first_callback, checkpoint]).fit(
        Regressor(), regression_data()
    )
    path = next((tmp_path / "ckpt").glob("*.ckpt"))
    saved = torch.load(path, weights_only=True)
    assert any(key.startswith("AdaptiveBitWidth") for key in saved["callbacks"])  # decisions and EMAs are in the checkpoint
    assert first_callback.planner.transitions < straight_callback.planner.transitions, "decisions changed after the checkpoint"

    resumed_model, resumed_callback = Regressor(), AdaptiveBitWidth(target_bits=TARGET, fill_budget=False, **FAST)
    resumed = trainer(tmp_path / "c", plugins=[plugin()], callbacks=[resumed_callback])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.fit(resumed_model, regression_data(), ckpt_path=str(path))
    assert not [w for w in caught if "keep the checkpoint's formats" in str(w.message)]  # the callback set its plan first
    without = trainer(tmp_path / "d", plugins=[plugin()])  # resumed without the callback: its formats stay, and it says so
    with pytest.warns(UserWarning, match=r"loaded state\(s\) keep the checkpoint's formats.*\(configured: int8\).*AdaptiveBitWidth"):
        without.fit(Regressor(), regression_data(), ckpt_path=str(path))

    assert torch.equal(flat_weights(straight_model), flat_weights(resumed_model))
    assert resumed_callback.state_dict() == straight_callback.state_dict()
    first, second = straight.strategy.optimizers[0], resumed.strategy.optimizers[0]
    for a, b in zip(straight_model.parameters(), resumed_model.parameters(), strict=False):
        for name in ("exp_avg", "exp_avg_sq"):
            x, y = first.state[a][name], second.state[b][name]
            assert type(x) is type(y)
            if isinstance(x, QuantizedTensor):
                assert x.format.config == y.format.config and torch.equal(x.codes, y.codes) and torch.equal(x.scales, y.scales)
            else:
                assert torch.equal(x, y)


def test_a_checkpoint_of_other_layers_is_warned_about_at_the_first_step(tmp_path):
    """A checkpoint's layer no parameter takes up is warned about at the first step (a group a callback adds back before
    it would have taken it) and dropped; a layer the checkpoint lacks is planned as one that joins."""
    callback = AdaptiveBitWidth(target_bits=TARGET, **FAST)
    trainer(tmp_path, max_steps=1, plugins=[plugin()], callbacks=[callback]).fit(Regressor(), regression_data())
    state = callback.state_dict()
    state["layers"]["net.9.weight"] = state["layers"].pop("net.0.weight")
    other = AdaptiveBitWidth(target_bits=TARGET, **FAST)
    other.load_state_dict(state)
    with pytest.warns(UserWarning, match=r"the checkpoint's layers \['net.9.weight'\] have no parameter"):
        trainer(tmp_path, max_steps=1, plugins=[plugin()], callbacks=[other]).fit(Regressor(), regression_data())
    assert "net.0.weight" in other.decisions() and "net.9.weight" not in other.decisions()


def test_metrics_and_heatmap_are_logged(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="tb")
    fit = trainer(
        tmp_path,
        max_steps=6,
        logger=logger,
        log_every_n_steps=2,
        plugins=[plugin()],
        callbacks=[AdaptiveBitWidth(target_bits=TARGET, **{**FAST, "interval": 2})],
    )
    fit.fit(Regressor(), regression_data())
    logger.experiment.flush()
    events = EventAccumulator(logger.log_dir, size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    expected = {"qstate/adaptive/avg_bits", "qstate/adaptive/bytes_saved", "qstate/adaptive/threshold", "qstate/adaptive/transitions"}
    assert expected | {f"qstate/adaptive/zone_{zone}" for zone in ZONES} <= scalars
    logged_steps = [event.step for event in events.Scalars("qstate/adaptive/avg_bits")]
    assert len(logged_steps) == 3 and logged_steps == [
        event.step for event in events.Scalars("train_loss")
    ]  # the Trainer's interval and steps
    assert all(event.value <= TARGET for event in events.Scalars("qstate/adaptive/avg_bits"))
    assert sum(events.Scalars(f"qstate/adaptive/zone_{zone}")[-1].value for zone in ZONES) == 6
    images = events.Images("qstate/adaptive/bit_widths")
    assert [image.step for image in images] == [0, 2, 4]  # at every check
    picture = matplotlib.image.imread(io.BytesIO(images[-1].encoded_image_string))
    assert picture.shape[1] >= 600 and picture.shape[0] >= 200  # readable at TensorBoard's size


def test_bit_width_figure_names_layers_formats_and_steps():
    names = ["model.h.0.attn.weight", "model.h.0.mlp.weight", "model.h.0.ln.weight"]
    history = [
        {
            "step": 0,
            "bits": [[8.06, 8.06, 32.0], [8.12, 8.12, 32.0]],
            "formats": [["int8_linear", "int4", "fp32"], ["int8", "int6", "fp32"]],
        },
        {"step": 10, "bits": [[4.12, 4.12, 32.0], [8.12, 5.12, 32.0]], "formats": [["int4", "int4", "fp32"], ["int8", "int5", "fp32"]]},
    ]
    figure = bit_width_figure(history, names)
    m_axis, v_axis = figure.axes
    assert [label.get_text() for label in m_axis.get_yticklabels()] == ["attn.weight", "mlp.weight"]  # fp32 layer left out, prefix dropped
    assert "1 kept plain throughout" in m_axis.get_title() and "step" in v_axis.get_xlabel()
    assert "exp_avg" in m_axis.get_ylabel() and "exp_avg_sq" in v_axis.get_ylabel()
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert legend == ["int4", "int5", "int6", "int8", "int8_linear"]  # int8 and int8_linear each their own colour
    old = bit_width_figure([{key: value for key, value in entry.items() if key != "formats"} for entry in history], names)
    assert "8.06 bits" in [text.get_text() for text in old.legends[0].get_texts()]  # checkpoints written before the formats
    # a layer that joined later (BackboneFinetuning): earlier entries hold fewer layers (an IndexError before)
    joined = [*names, "model.h.1.attn.weight"]
    grown = history + [{"step": 20, "bits": [[4.12] * 4, [8.12] * 4], "formats": [["int4"] * 3 + ["int8"], ["int8"] * 4], "names": joined}]
    figure = bit_width_figure(grown, joined)
    assert "not planned" in [text.get_text() for text in figure.legends[0].get_texts()]
    assert "model.h.1.attn.weight"[len("model.h.") :] in [label.get_text() for label in figure.axes[0].get_yticklabels()]
    for plain in ("fp32", "bf16 (plain)"):  # a bf16 model's plain states are no quantized layer either
        empty = bit_width_figure([{"step": 0, "bits": [[32.0], [32.0]], "formats": [[plain], [plain]], "names": ["w"]}], ["w"])
        assert "no quantized layer" in empty.axes[0].texts[0].get_text()  # every state plain (min_quant_size): pcolormesh raised
    matplotlib.pyplot.close("all")


# --- reencode_state resolves format names like the policy -------------------------------------------------
@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_reencode_by_name_aligns_blocks_to_rows_of_a_dtensor_shard():
    """FSDP2: a named format gets the row-aligned block that ``resolve_format`` gives new states (rows of 96: blocks of 32)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    created = not dist.is_initialized()  # a group of one rank: this process's own, or one left by the session
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        param = torch.nn.Parameter(distribute_tensor(torch.randn(10, 96, generator=torch.Generator().manual_seed(0)), mesh, [Shard(0)]))
        optimizer = QAdamW([param], lr=1e-2, states="int8", min_quant_size=0)
        param.grad = distribute_tensor(torch.randn(10, 96, generator=torch.Generator().manual_seed(1)), mesh, [Shard(0)])
        optimizer.step()
        assert optimizer.state_format(param, "exp_avg").block_size == 32
        optimizer.reencode_state(param, "exp_avg", "int4")
        optimizer.reencode_state(param, "exp_avg_sq", "e4m0")
        assert optimizer.state_format(param, "exp_avg").block_size == 32 != get_format("int4").block_size
        assert optimizer.state_format(param, "exp_avg_sq").config == {
            "name": "e4m0",
            "block_size": 32,
            "signed": False,
            "nonfinite": "raise",
            "scale_dtype": "fp32",
        }
        optimizer.step()  # and steps on from there
    finally:
        if created:
            dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reencode_rounds_a_half_precision_parameters_state_from_its_fp32_values(dtype):
    """A bf16/fp16 parameter's states decode to its dtype; re-encoding went through that rounding first (0.5-1.4 % of
    int8 -> int4 codes differed from round-to-nearest of the stored values), as did loading a checkpoint under another
    policy. Both round the fp32 decode now, and the state still reads back in the parameter's dtype."""
    param = torch.nn.Parameter(torch.randn(64, 256, generator=torch.Generator().manual_seed(0)).to(dtype))
    optimizer = QAdamW([param], lr=1e-2, states="int8", min_quant_size=0)
    for seed in range(3):
        param.grad = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
        optimizer.step()
    stored = optimizer.state[param]["exp_avg"].dequantize(torch.float32)
    loaded = QAdamW([param], lr=1e-2, states="int4", min_quant_size=0)  # a checkpoint loaded under another policy too
    with pytest.warns(UserWarning, match="re-encoded"):
        loaded.load_state_dict(optimizer.state_dict())
    optimizer.reencode_state(param, "exp_avg", "int4")
    expected = optimizer.state_format(param, "exp_avg").quantize(stored)
    for reencoded in (optimizer.state[param]["exp_avg"], loaded.state[param]["exp_avg"]):
        assert torch.equal(reencoded.codes, expected.codes) and torch.equal(reencoded.scales, expected.scales)
        assert reencoded.dequantize().dtype == dtype
    optimizer.step()
