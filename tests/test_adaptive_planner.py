"""``BitWidthPlanner`` without Lightning: a plain torch loop drives it (the example of its docstring), its plan is what the
optimizer stores, it resumes from its ``state_dict``, and importing ``lightning_qstate.adaptive`` never imports Lightning.

The pieces (statistics, zones, budget) and the Lightning callback over the planner are tested in ``test_adaptive_bits.py``.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import lightning_qstate
from lightning_qstate.adaptive import ZONES, BitWidthPlanner
from lightning_qstate.formats import QuantizedTensor
from lightning_qstate.optim import state_summary

REPO_ROOT = Path(__file__).resolve().parents[1]
# Checks every 10 steps; a layer moves after 2 checks in a new zone; on this model one layer's zone, and so its v's
# format, changes within 30 steps.
OPTIONS = dict(interval=10, hysteresis=2, anneal_steps=100)


def mlp_and_optimizer(seed: int = 0) -> tuple[torch.nn.Module, lightning_qstate.QAdamW]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    return model, lightning_qstate.QAdamW(model.parameters(), lr=1e-3, min_quant_size=0)


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    planner: BitWidthPlanner,
    steps: range,
    on_check: Callable[[int], None] | None = None,
    external_sums: bool = False,
) -> None:
    """The docstring's loop: ``planner.update`` after the backward pass, before the optimizer step (batch ``step``: seed ``step``).
    ``external_sums``: pass the planner its own ``gradient_sums()``, as the callback passes them once all-reduced."""
    for step in steps:
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
        loss = (model(x) - x.sum(1, keepdim=True)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        if planner.update(step, planner.gradient_sums().tolist() if external_sums else None) and on_check is not None:
            on_check(step)
        optimizer.step()


def stored_formats(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, dict[str, str]]:
    """``{parameter name: {state: stored format name}}`` of the states that exist."""
    return {
        name: {state: optimizer.state_format(param, state).name for state in ("exp_avg", "exp_avg_sq")}
        for name, param in model.named_parameters()
        if param in optimizer.state
    }


def test_a_plain_torch_loop_drives_the_planner():
    """Without a cap the zones decide; after every check each state is stored as planned, and a zone change re-encodes."""
    model, optimizer = mlp_and_optimizer()
    planner = BitWidthPlanner(optimizer, model, target_bits=None, **OPTIONS)
    assert not optimizer.state_overrides and planner.last_check is None  # planned, not applied yet
    seen, checks = [], []

    def check(step: int) -> None:
        checks.append(step)
        decisions = planner.decisions()
        assert set(decisions) == {name for name, _ in model.named_parameters()}
        assert all(entry["zone"] in ZONES for entry in decisions.values())
        planned = {name: {state: entry[state] for state in ("exp_avg", "exp_avg_sq")} for name, entry in decisions.items()}
        if step > 0:  # the optimizer's states exist from its first step on, in the planned formats
            assert stored_formats(model, optimizer) == planned
        assert {name: optimizer.state_overrides[param] for name, param in model.named_parameters()} == planned  # new states follow
        seen.append(planned)
        counted.append(optimizer.format_changes)

    counted: list[int] = []  # the optimizer's format_changes after each check (PrecisionAdvisor advises again when it moves)
    train(model, optimizer, planner, range(60), check)
    assert checks == [0, 10, 20, 30, 40, 50] and planner.last_check == 50 and [entry["step"] for entry in planner.history] == checks
    changes = sum(a[name][state] != b[name][state] for a, b in zip(seen, seen[1:], strict=False) for name in a for state in a[name])
    assert changes > 0, "a zone change re-encoded a state during the run"
    moved = [a != b for a, b in zip(counted, counted[1:], strict=False)]
    assert counted[0] > 0 and moved == [a != b for a, b in zip(seen, seen[1:], strict=False)]
    assert planner.transitions == changes  # step 0's plan comes before any state exists: not a transition
    assert planner.metrics()["qstate/adaptive/transitions"] == changes


@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "first-layer-frozen"])
def test_the_cap_holds_at_every_check(frozen: bool):
    """The plan is the stored bytes. A frozen layer left in the optimizer has no states: it is not planned (priced, its
    cheap formats lent the trainable layers bits: 5.6 stored bits under a 5.1 cap)."""
    model, optimizer = mlp_and_optimizer()
    if frozen:
        model[0].requires_grad_(False)
    planner = BitWidthPlanner(optimizer, model, target_bits=5.1, **OPTIONS)
    assert set(planner.decisions()) == {name for name, param in model.named_parameters() if param.requires_grad}
    averages = []

    def check(step: int) -> None:
        if step > 0:
            summary = state_summary(optimizer)
            averages.append(8 * summary["bytes"] / summary["values"])
            assert planner.metrics()["qstate/adaptive/avg_bits"] == pytest.approx(averages[-1], rel=1e-12)  # the plan is the stored bytes
            assert all(isinstance(state[name], QuantizedTensor) for state in optimizer.state.values() for name in ("exp_avg", "exp_avg_sq"))

    train(model, optimizer, planner, range(41), check)
    assert len(averages) == 4 and max(averages) <= 5.1


def test_a_non_finite_gradient_at_a_check_counts_as_no_gradient():
    """An inf in a layer's sums at a check (an overflow the optimizer or GradScaler skips) is as if that layer had no
    gradient there: the statistics stay finite (they stayed inf for good, and every layer was 'redundant' after)."""

    def run(poisoned: bool) -> dict:
        model, optimizer = mlp_and_optimizer()
        planner = BitWidthPlanner(optimizer, model, target_bits=None, **OPTIONS)
        for step in range(41):
            x = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
            optimizer.zero_grad()
            (model(x) - x.sum(1, keepdim=True)).square().mean().backward()
            sums = planner.gradient_sums()
            if step == 10:
                sums[:3, 0] = torch.tensor([math.inf, math.inf, sums[2, 0]]) if poisoned else 0.0  # its states stay held
            planner.update(step, sums)
            optimizer.step()
        return planner.state_dict()

    poisoned = run(True)
    assert poisoned == run(False) and math.isfinite(poisoned["global_rms"])
    assert all(math.isfinite(entry["rms"]) for entry in poisoned["layers"].values())


def test_parameters_that_join_later_are_planned_and_counted():
    """A parameter group added during training (Lightning's BackboneFinetuning) is planned from the next check and counts
    in the average, which stays the stored bits under the cap (it kept int8 states: 7.66 stored bits under a 5.0 cap)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    optimizer = lightning_qstate.QAdamW(model[2].parameters(), lr=1e-3, min_quant_size=0)
    planner = BitWidthPlanner(optimizer, model, target_bits=5.1, **OPTIONS)
    train(model, optimizer, planner, range(15))
    assert set(planner.decisions()) == {"2.weight", "2.bias"}
    optimizer.add_param_group({"params": list(model[0].parameters())})
    train(model, optimizer, planner, range(15, 41))
    assert set(planner.decisions()) == {name for name, _ in model.named_parameters()}
    summary = state_summary(optimizer)
    stored_bits = 8 * summary["bytes"] / summary["values"]
    assert planner.metrics()["qstate/adaptive/avg_bits"] == pytest.approx(stored_bits, rel=1e-12) and stored_bits <= 5.1
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.randn(8, 8))], "states": "fp32"})
    with pytest.raises(ValueError, match=r"param group 2 has states='fp32', which keeps exp_avg and exp_avg_sq in fp32"):
        planner.update(50)


def test_a_parameter_that_gets_no_gradient_lends_no_bits():
    """A trainable parameter that never gets a gradient holds no states: priced, and as the largest demoted first, its
    savings paid for the others' bits (stored 8.13 bits per value under a 6.0 cap while avg_bits said 5.87). It is left
    out of the budget (and of avg_bits) until it has states; its decisions made nothing to re-encode."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"used": torch.nn.Linear(32, 32), "unused": torch.nn.Linear(64, 256)})
    optimizer = lightning_qstate.QAdamW(model.parameters(), lr=1e-3, min_quant_size=0, rounding="stochastic")
    planner = BitWidthPlanner(optimizer, model, target_bits=6.0, interval=2, hysteresis=1, threshold_start=0.01, threshold_end=0.01)
    for step in range(8):
        optimizer.zero_grad()
        model["used"](torch.randn(16, 32, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        planner.update(step)
        optimizer.step()
        summary = state_summary(optimizer)
        stored_bits = 8 * summary["bytes"] / summary["values"]
        assert stored_bits <= 6.0 and planner.metrics()["qstate/adaptive/avg_bits"] == pytest.approx(stored_bits, rel=1e-12), step
    assert not optimizer.state[model["unused"].weight] and planner.transitions == 0
    # its formats are the cheapest (the floor), so states it makes before the next check lower the average
    assert planner.decisions()["unused.weight"]["exp_avg"] == planner.decisions()["unused.weight"]["exp_avg_sq"] == "int4"


def test_a_non_finite_first_check_still_counts_the_layers():
    """GradScaler's first step overflows: at the step-0 check every gradient was inf, no layer counted, and the plan left
    the cap (8.10 stored bits under 5.0). A non-finite gradient is a gradient: its states follow."""
    model, optimizer = mlp_and_optimizer()
    planner = BitWidthPlanner(optimizer, model, target_bits=5.0, **OPTIONS)
    (model(torch.randn(8, 32)).sum() * math.inf).backward()
    planner.update(0)
    assert all(layer.stored for layer in planner.layers) and planner.metrics()["qstate/adaptive/avg_bits"] <= 5.0


def test_a_layer_unfrozen_later_is_planned_again():
    """The plan's own entries in ``state_overrides`` were read as a user's pin by layers collected later (a layer frozen
    at the start and unfrozen, or a second planner on the same optimizer): they kept their formats for good."""
    model, optimizer = mlp_and_optimizer()
    first = BitWidthPlanner(optimizer, model, target_bits=5.1, **OPTIONS)
    train(model, optimizer, first, range(12))
    second = BitWidthPlanner(optimizer, model, target_bits=5.1, **OPTIONS)
    assert all(layer.pinned is None for layer in second.layers) and set(second.decisions()) == set(first.decisions())


def test_summed_statistics_can_come_from_outside():
    """``update(step, sums)`` with the planner's own ``gradient_sums()`` (as the callback passes them, all-reduced) decides alike."""
    model, optimizer = mlp_and_optimizer()
    sums = BitWidthPlanner(optimizer, model).gradient_sums()
    assert sums.shape == (4, 4) and sums.dtype == torch.float64 and not sums.any()  # no gradients nor states yet: zeros
    planners = []
    for external in (False, True):
        model, optimizer = mlp_and_optimizer()
        planner = BitWidthPlanner(optimizer, model, target_bits=5.1, **OPTIONS)
        train(model, optimizer, planner, range(30), external_sums=external)
        planners.append(planner)
    assert planners[0].state_dict() == planners[1].state_dict()
    param = next(iter(model.parameters()))
    grad = param.grad.double()
    assert planners[1].gradient_sums()[:, 0].tolist() == pytest.approx(
        [float(grad.abs().sum()), float(grad.square().sum()), grad.numel(), 1.0],
        rel=1e-5,  # and: states held
    )


def test_resume_from_the_state_dict_continues_exactly():
    """40 steps straight == 20 steps, then 20 more with a new model, optimizer and planner loaded from their state dicts
    (the planner's through JSON)."""
    straight_model, straight_optimizer = mlp_and_optimizer()
    straight = BitWidthPlanner(straight_optimizer, straight_model, target_bits=None, **OPTIONS)
    train(straight_model, straight_optimizer, straight, range(40))

    model, optimizer = mlp_and_optimizer()
    first = BitWidthPlanner(optimizer, model, target_bits=None, **OPTIONS)
    train(model, optimizer, first, range(20))
    saved = json.loads(json.dumps(first.state_dict()))

    resumed_model, resumed_optimizer = mlp_and_optimizer(seed=1)
    resumed_model.load_state_dict(model.state_dict())
    resumed_optimizer.load_state_dict(optimizer.state_dict())
    resumed = BitWidthPlanner(resumed_optimizer, resumed_model, target_bits=None, **OPTIONS)
    resumed.load_state_dict(saved)
    resumed.apply()
    assert stored_formats(resumed_model, resumed_optimizer) == stored_formats(model, optimizer)
    train(resumed_model, resumed_optimizer, resumed, range(20, 40))

    assert resumed.state_dict() == straight.state_dict()
    assert straight.transitions > first.transitions, "decisions changed after the state dict was saved"
    for a, b in zip(straight_model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_bad_optimizers_and_options_are_refused():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match=r"BitWidthPlanner needs a QAdam/QAdamW optimizer.*got AdamW"):
        BitWidthPlanner(torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match=r"BitWidthPlanner needs a QAdam/QAdamW optimizer.*got QSGD"):
        BitWidthPlanner(lightning_qstate.QSGD(model.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(ValueError, match=r"BitWidthPlanner does not support amsgrad=True"):
        BitWidthPlanner(lightning_qstate.QAdamW(model.parameters(), amsgrad=True))
    for states, kept in (("fp32", "exp_avg and exp_avg_sq"), ({"exp_avg": "int8"}, "exp_avg_sq"), ({"exp_avg_sq": "int4"}, "exp_avg")):
        with pytest.raises(ValueError, match=rf"BitWidthPlanner: param group 0 has states=.*, which keeps {kept} in fp32"):
            BitWidthPlanner(lightning_qstate.QAdamW(model.parameters(), states=states, min_quant_size=0))
    pinned = lightning_qstate.QAdamW(model.parameters(), states={"exp_avg": "int8"}, min_quant_size=0)
    pinned.configured_overrides.update({param: "int8" for param in model.parameters()})
    pinned.state_overrides.update(pinned.configured_overrides)
    BitWidthPlanner(pinned, target_bits=None)  # every parameter pinned by an override: nothing planned is kept fp32
    optimizer = lightning_qstate.QAdamW(model.parameters(), min_quant_size=0)
    with pytest.raises(ValueError, match=r"BitWidthPlanner: anneal_steps=0 must be an int >= 1"):
        BitWidthPlanner(optimizer, anneal_steps=0)
    with pytest.raises(ValueError, match=r"BitWidthPlanner: interval=0 must be an int >= 1"):
        BitWidthPlanner(optimizer, interval=0)
    with pytest.raises(ValueError, match=r"BitWidthPlanner: target_bits=True must be a number > 0"):  # read as 1 bit before
        BitWidthPlanner(optimizer, target_bits=True)
    with pytest.raises(ValueError, match=r"BitWidthPlanner: ema_decay=False must be in \[0, 1\)"):
        BitWidthPlanner(optimizer, ema_decay=False)
    with pytest.raises(ValueError, match=r"BitWidthPlanner: target_bits=1.0 cannot be met.*min_quant_size"):
        BitWidthPlanner(optimizer, target_bits=1.0)
    planner = BitWidthPlanner(optimizer, target_bits=None)
    assert set(planner.decisions()) == {"param0", "param1"}  # without a module: the optimizer's names
    model.requires_grad_(False)
    with pytest.raises(ValueError, match=r"BitWidthPlanner: every parameter of the optimizer is frozen"):
        BitWidthPlanner(optimizer)
    model.requires_grad_(True)
    with pytest.raises(ValueError, match=r"BitWidthPlanner: checkpoint state version 2, expected 1"):
        planner.load_state_dict({**planner.state_dict(), "version": 2})


def test_the_floor_formats_are_a_last_resort():
    """A cap the zones' formats can meet is planned exactly as without a floor; a lower one that only the floor
    (int4 v) meets is met by moving some v to int4, where ``floor_formats={}`` raises."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))  # biases stay fp32
    optimizer = lightning_qstate.QAdamW(model.parameters(), min_quant_size=4096)
    layers = BitWidthPlanner(optimizer, model, target_bits=None).layers
    values = 2 * sum(layer.numel for layer in layers)

    def bits(m: str, v: str) -> float:  # every layer's m and v in these formats (fp32 below min_quant_size)
        return 8 * sum(layer.nbytes[("exp_avg", m)] + layer.nbytes[("exp_avg_sq", v)] for layer in layers) / values

    zones_cheapest, floor_cheapest = bits("int4", "int5"), bits("int4", "int4")
    assert floor_cheapest < zones_cheapest
    feasible = zones_cheapest + 0.05
    with_floor, without = (BitWidthPlanner(optimizer, model, target_bits=feasible, **floor) for floor in ({}, {"floor_formats": {}}))
    assert with_floor.decisions() == without.decisions()
    assert {decision["exp_avg_sq"] for decision in with_floor.decisions().values()} >= {"int5"}
    tight = (zones_cheapest + floor_cheapest) / 2
    with pytest.raises(ValueError, match=rf"target_bits={tight} cannot be met: the cheapest candidates give {zones_cheapest:.3f} bits"):
        BitWidthPlanner(optimizer, model, target_bits=tight, floor_formats={})
    planner = BitWidthPlanner(optimizer, model, target_bits=tight)
    assert planner.metrics()["qstate/adaptive/avg_bits"] <= tight
    assert "int4" in {decision["exp_avg_sq"] for decision in planner.decisions().values()}
    with pytest.raises(ValueError, match=rf"cannot be met: the cheapest candidates give {floor_cheapest:.3f} bits"):
        BitWidthPlanner(optimizer, model, target_bits=floor_cheapest - 0.05)
    planner = BitWidthPlanner(optimizer, model, target_bits=tight, floor_formats={"exp_avg_sq": "e4m0"})
    assert "e4m0" in {decision["exp_avg_sq"] for decision in planner.decisions().values()}
    for floor, message in (
        ({"exp_avg_sq": "fp32"}, r"BitWidthPlanner: floor_formats\['exp_avg_sq'\]='fp32' is not a candidate"),
        ({"exp_avg_sq": "int9"}, r"BitWidthPlanner: floor_formats\['exp_avg_sq'\]: .*int9"),
        ({"weights": "int4"}, r"floor_formats=\{'weights': 'int4'\} must map some of \['exp_avg', 'exp_avg_sq'\]"),
    ):
        with pytest.raises(ValueError, match=message):
            BitWidthPlanner(optimizer, model, floor_formats=floor)


def test_a_narrow_v_rounded_to_nearest_is_warned_about():
    """Below 8 bits a v written RN ratchets: the planner says so and what to do; stochastic rounding, or v kept at 8
    bits (zones and floor), plan without a warning."""
    model = torch.nn.Linear(64, 64)
    nearest = lightning_qstate.QAdamW(model.parameters(), min_quant_size=0)
    with pytest.warns(UserWarning, match=r"v \(exp_avg_sq\) may be stored in int4, int5, int6, int7 .*rounding='stochastic'"):
        BitWidthPlanner(nearest, model)
    eight_bits = {"v_formats": dict.fromkeys(ZONES, "int8"), "floor_formats": {"exp_avg": "int4"}}
    stochastic = lightning_qstate.QAdamW(model.parameters(), min_quant_size=0, rounding="stochastic")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BitWidthPlanner(stochastic, model)
        BitWidthPlanner(nearest, model, target_bits=None, **eight_bits)


def test_importing_the_planner_does_not_import_lightning():
    code = "import sys, lightning_qstate.adaptive; assert 'lightning' not in sys.modules and 'lightning.pytorch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_plain_states_are_priced_in_the_dtype_the_optimizer_keeps_them_in(dtype):
    """A bf16/fp16 parameter keeps a plain m or v (below min_quant_size) in its dtype, 2 bytes: the planner priced it at
    4, so its avg_bits was not what the optimizer stores (5.46 for 4.97), it named the states "fp32", and it refused a
    cap the cheapest plan meets."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)).to(dtype)
    optimizer = lightning_qstate.QAdamW(model.parameters(), lr=1e-3, rounding="stochastic")  # min_quant_size 4096: three small params plain
    planner = BitWidthPlanner(optimizer, model, target_bits=None, interval=2, hysteresis=1, anneal_steps=10)
    for step in range(3):
        x = torch.randn(16, 64).to(dtype)
        optimizer.zero_grad()
        (model(x).float() - x.float().sum(1, keepdim=True)).square().mean().backward()
        planner.update(step)
        optimizer.step()
    states = [state[name] for state in optimizer.state.values() for name in ("exp_avg", "exp_avg_sq")]
    values = sum(value.numel if isinstance(value, QuantizedTensor) else value.numel() for value in states)
    stored = 8 * sum(value.nbytes for value in states) / values
    assert planner.metrics()["qstate/adaptive/avg_bits"] == pytest.approx(stored, rel=1e-9)
    name = {torch.bfloat16: "bf16 (plain)", torch.float16: "fp16 (plain)", torch.float64: "float64 (plain)"}[dtype]
    assert [row[1:] for row in planner.format_names()] == [[name] * 3] * 2  # not the bf16 format a plan may choose
    if dtype != torch.float64:  # float64: its first update raised (foreach norms narrowed to fp32); 8-byte plain states
        fresh = lightning_qstate.QAdamW(model.parameters(), lr=1e-3, rounding="stochastic")
        BitWidthPlanner(fresh, model, target_bits=4.8, interval=2, hysteresis=1, anneal_steps=10)  # the cheapest stores ~4.55


JOIN_PLAN = dict(target_bits=5.1, interval=10, hysteresis=2, anneal_steps=100)  # the planner of joining_run


def train_step(model: torch.nn.Module, optimizer, planner: BitWidthPlanner, step: int) -> None:
    """One step of ``joining_run``'s MLP on step ``step``'s seeded batch, the planner's ``update`` before the optimizer's."""
    inputs = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
    loss = (model(inputs) - inputs.sum(1, keepdim=True)).square().mean()
    optimizer.zero_grad()
    loss.backward()
    planner.update(step)
    optimizer.step()


def joined_optimizer(model: torch.nn.Module) -> lightning_qstate.QAdamW:
    """``joining_run``'s optimizer after the join: its last layer's group, then its first layer's added."""
    optimizer = lightning_qstate.QAdamW(model[2].parameters(), lr=1e-3, min_quant_size=0, rounding="stochastic")
    optimizer.add_param_group({"params": list(model[0].parameters())})
    return optimizer


def joining_run(join: str, steps: range):
    """A 32-128-1 MLP whose first layer joins at step 13 (``join``: ``"group"``, added with ``add_param_group``, or
    ``"unfreeze"``, ``requires_grad_(True)``), the planner's ``update`` before every step (interval 10, cap 5.1).
    Returns (model, optimizer, planner, [(stored bits, reported avg_bits) per step])."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    if join == "group":
        optimizer = lightning_qstate.QAdamW(model[2].parameters(), lr=1e-3, min_quant_size=0, rounding="stochastic")
    else:
        model[0].requires_grad_(False)
        optimizer = lightning_qstate.QAdamW(model.parameters(), lr=1e-3, min_quant_size=0, rounding="stochastic")
    planner = BitWidthPlanner(optimizer, model, **JOIN_PLAN)
    averages = []
    for step in steps:
        if step == 13:
            if join == "group":
                optimizer.add_param_group({"params": list(model[0].parameters())})
            else:
                model[0].requires_grad_(True)
        train_step(model, optimizer, planner, step)
        summary = state_summary(optimizer)
        averages.append((8 * summary["bytes"] / summary["values"], planner.metrics()["qstate/adaptive/avg_bits"]))
    return model, optimizer, planner, averages


@pytest.mark.parametrize("join", ["group", "unfreeze"])
def test_a_layer_that_joins_between_checks_is_planned_at_once(join):
    """A parameter group added (BackboneFinetuning) or a parameter unfrozen between checks is planned at its first step:
    its states were made in the group's int8 until the next check (8.0 bits stored under a 5.1 cap, avg_bits said 5.09)."""
    _, _, _, averages = joining_run(join, range(21))
    assert all(stored <= 5.1 + 1e-9 and stored == pytest.approx(reported, abs=1e-9) for stored, reported in averages), averages


def test_a_plan_saved_between_a_join_and_the_next_check_resumes_exactly():
    """The joined layer is in the checkpoint from its first step, and the resumed planner continues as the uninterrupted
    one (the load refused such a checkpoint: "the checkpoint's layers do not match")."""
    model, optimizer, planner, _ = joining_run("group", range(15))
    saved = json.loads(json.dumps(planner.state_dict()))
    _, _, uninterrupted, _ = joining_run("group", range(30))
    torch.manual_seed(0)
    resumed_model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    resumed_model.load_state_dict(model.state_dict())
    resumed_optimizer = joined_optimizer(resumed_model)
    resumed_optimizer.load_state_dict(optimizer.state_dict())
    resumed = BitWidthPlanner(resumed_optimizer, resumed_model, **JOIN_PLAN)
    resumed.load_state_dict(saved)
    resumed.apply()
    for step in range(15, 30):
        train_step(resumed_model, resumed_optimizer, resumed, step)
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_a_checkpoints_layer_the_optimizer_has_not_yet_is_kept_until_it_joins():
    """A checkpoint's layer whose group is added back only after the planner loads (a callback restoring it later) waits
    for it; one that never comes back is warned about at the first step."""
    model, optimizer, planner, _ = joining_run("group", range(15))
    saved = json.loads(json.dumps(planner.state_dict()))
    fresh = lightning_qstate.QAdamW(model[2].parameters(), lr=1e-3, min_quant_size=0, rounding="stochastic")
    later = BitWidthPlanner(fresh, model, **JOIN_PLAN)
    later.load_state_dict(saved)  # 0.weight and 0.bias are not in the optimizer yet: kept
    fresh.add_param_group({"params": list(model[0].parameters())})
    assert later.join_new_layers()
    assert {name: later.decisions()[name]["zone"] for name in ("0.weight", "0.bias")} == {
        name: saved["layers"][name]["zone"] for name in ("0.weight", "0.bias")
    }
    never = BitWidthPlanner(
        lightning_qstate.QAdamW(model[2].parameters(), min_quant_size=0, rounding="stochastic"), model, target_bits=5.1, interval=10
    )
    never.load_state_dict(saved)
    with pytest.warns(UserWarning, match=r"the checkpoint's layers \['0.bias', '0.weight'\] have no parameter"):
        never.update(20)


def test_a_group_that_joins_with_round_to_nearest_is_warned_about():
    """The round-to-nearest ``v`` warning covers a group added later, not only those present at construction."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    optimizer = lightning_qstate.QAdamW(model[2].parameters(), min_quant_size=0, rounding="stochastic")
    planner = BitWidthPlanner(optimizer, model, target_bits=5.1, interval=10)
    optimizer.add_param_group({"params": list(model[0].parameters()), "rounding": "nearest"})
    with pytest.warns(UserWarning, match="rounds to nearest"):
        planner.update(3)


def test_a_resume_under_another_cap_counts_its_re_encodings():
    """Resumed under another ``target_bits`` the plan changes at load (honoured at once); the states it re-encodes are
    counted in ``transitions`` (they were not), and under the same options nothing is."""
    model, optimizer, planner, _ = joining_run("group", range(25))
    saved = json.loads(json.dumps(planner.state_dict()))
    formats = lambda opt: [opt.state_format(p, s).name for p in model.parameters() for s in ("exp_avg", "exp_avg_sq")]  # noqa: E731
    for target, expect_change in ((5.1, False), (6.5, True)):
        resumed_optimizer = joined_optimizer(model)
        resumed_optimizer.load_state_dict(optimizer.state_dict())
        before = formats(resumed_optimizer)
        resumed = BitWidthPlanner(resumed_optimizer, model, **{**JOIN_PLAN, "target_bits": target})
        resumed.load_state_dict(saved)
        resumed.apply()
        changed = sum(a != b for a, b in zip(before, formats(resumed_optimizer), strict=True))
        assert (changed > 0) == expect_change
        assert resumed.transitions - saved["transitions"] == changed


def test_frozen_layers_stay_planned_alike_whichever_rank_holds_their_states():
    """Under FSDP1 a rank whose shard holds no part of a parameter has no state for it: whether a frozen parameter is a
    layer must not depend on that (the ranks' gradient sums differed in shape at the next check). A known layer frozen
    later stays one; on resume, a checkpoint's layer whose parameter is frozen is tracked without a local state."""
    model, optimizer, planner, _ = joining_run("group", range(15))
    model[0].weight.requires_grad_(False)
    local = optimizer.state.pop(model[0].weight)  # as the rank without a part of it
    planner.update(16)  # between checks
    assert "0.weight" in [layer.name for layer in planner.layers]
    assert planner.gradient_sums().shape == (4, 4)
    optimizer.state[model[0].weight] = local
    saved = json.loads(json.dumps(planner.state_dict()))
    resumed_optimizer = joined_optimizer(model)  # no states: a fresh rank's view
    resumed = BitWidthPlanner(resumed_optimizer, model, **JOIN_PLAN)
    assert "0.weight" not in [layer.name for layer in resumed.layers]
    resumed.load_state_dict(saved)
    assert [layer.name for layer in resumed.layers] == [layer.name for layer in planner.layers] and not resumed._pending_entries
    # a planner built now, without a checkpoint (AdaptiveBitWidth added at a resume): the rank holding the frozen layer's
    # states and the rank holding none plan the same layers, the same formats, when told which some rank holds
    holding = BitWidthPlanner(optimizer, model, **JOIN_PLAN)
    optimizer.state.pop(model[0].weight)
    told = BitWidthPlanner(optimizer, model, **JOIN_PLAN, also_track=[model[0].weight])
    assert [(layer.name, layer.choice) for layer in told.layers] == [(layer.name, layer.choice) for layer in holding.layers]
    assert "0.weight" not in [layer.name for layer in BitWidthPlanner(optimizer, model, **JOIN_PLAN).layers]  # untold: its own


def test_a_frozen_layer_told_by_also_track_is_checked_alike_on_every_rank():
    """The fp32-states refusal covers the frozen parameters ``also_track`` names, as the layers do: a rank holding no
    state of a frozen parameter in a ``states='fp32'`` group refuses it as the rank holding one does (one FSDP1 rank
    raising while the other went on to a collective would hang)."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1))
    optimizer = lightning_qstate.QAdamW(model[2].parameters(), lr=1e-3, min_quant_size=0)
    optimizer.add_param_group({"params": list(model[0].parameters()), "states": "fp32"})
    model(torch.randn(8, 32)).square().mean().backward()
    optimizer.step()  # every parameter gets its states
    model[0].requires_grad_(False)
    refusal = r"param group 1 has states='fp32', which keeps exp_avg and exp_avg_sq in fp32"
    with pytest.raises(ValueError, match=refusal):  # the rank holding the frozen layer's states
        BitWidthPlanner(optimizer, model, **JOIN_PLAN)
    for param in model[0].parameters():
        optimizer.state.pop(param)  # as the rank without a part of them
    assert [layer.name for layer in BitWidthPlanner(optimizer, model, **JOIN_PLAN).layers] == ["2.weight", "2.bias"]
    with pytest.raises(ValueError, match=refusal):
        BitWidthPlanner(optimizer, model, **JOIN_PLAN, also_track=[model[0].weight])


def test_a_join_before_the_second_check_counts_the_states_it_re_encodes():
    """At a join between the first two checks no layer held states at the last check (none existed at check 0): the
    re-encodings of the layers that got their gradient there count (they did not)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    )
    optimizer = lightning_qstate.QAdamW([*model[2].parameters(), *model[4].parameters()], lr=1e-3, min_quant_size=0, rounding="stochastic")
    planner = BitWidthPlanner(optimizer, model, target_bits=6.0, interval=10, hysteresis=1, anneal_steps=100)
    states = ("exp_avg", "exp_avg_sq")
    for step in range(4):
        if step == 3:
            optimizer.add_param_group({"params": list(model[0].parameters())})
        inputs = torch.randn(64, 32, generator=torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        (model(inputs) - inputs.sum(1, keepdim=True)).square().mean().backward()
        held = [(p, s, optimizer.state_format(p, s)) for p in model.parameters() if optimizer.state.get(p) for s in states]
        planner.update(step)
        changed = sum(optimizer.state_format(p, s) is not before for p, s, before in held)
        optimizer.step()
    assert changed > 0 and planner.transitions == changed
