"""torch's optimizer contract, resumes that honour the configuration, non-finite gradients and damaged checkpoints."""

from __future__ import annotations

import copy
import io
import pickle
import re
import tempfile
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import lightning_qstate as lq
from lightning_qstate.formats import QuantizedTensor
from lightning_qstate.kernels.bounds import MOMENT_BOUND_STATE, bound_square


def roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)).to(dtype)


def run(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, start: int = 0) -> None:
    """``steps`` steps on batches that depend on the step index only, so runs split by a checkpoint see the same data."""
    dtype = next(model.parameters()).dtype
    for step in range(start, start + steps):
        x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step)).to(dtype)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()


def states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    for pa, pb in zip((p for g in a.param_groups for p in g["params"]), (p for g in b.param_groups for p in g["params"]), strict=False):
        for name, value in a.state[pa].items():
            other = b.state[pb][name]
            if isinstance(value, QuantizedTensor):
                if value.format.config != other.format.config or not torch.equal(value.codes, other.codes):
                    return False
            elif not torch.equal(torch.as_tensor(value), torch.as_tensor(other)):
                return False
    return True


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=False))


# --- torch's optimizer contract -------------------------------------------------------------------------------
@pytest.mark.parametrize("clone", [copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o))], ids=["deepcopy", "pickle"])
def test_copies_keep_the_quantization_and_step_alike(clone):
    """deepcopy/pickle keep every added attribute (policy, stall counters, seed), so the copy steps exactly like the original."""
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), lr=1e-2, min_quant_size=0, rounding="stochastic", track_stalls=True)
    run(model, optimizer, 2)
    both = clone((model, optimizer))
    run(model, optimizer, 2, start=2)
    run(*both, 2, start=2)
    assert params_equal(model, both[0]) and states_equal(optimizer, both[1])
    assert both[1].stall_stats().keys() == optimizer.stall_stats().keys()


def test_float64_parameters_step_with_quantized_states():
    """float64 parameters: fp32 states follow torch bit for bit; quantized states are stored through fp32 and read back as float64."""
    reference, ours, quantized = make_model(dtype=torch.float64), make_model(dtype=torch.float64), make_model(dtype=torch.float64)
    run(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), 5)
    run(ours, lq.QAdamW(ours.parameters(), lr=1e-2, states="fp32"), 5)
    assert params_equal(reference, ours)
    optimizer = lq.QAdamW(quantized.parameters(), lr=1e-2, states="int8", min_quant_size=0)
    run(quantized, optimizer, 5)
    state = optimizer.state[quantized[0].weight]["exp_avg"]
    assert isinstance(state, QuantizedTensor) and state.dequantize().dtype == torch.float64
    assert max(float((a - b).detach().abs().max()) for a, b in zip(reference.parameters(), quantized.parameters(), strict=False)) < 5e-2
    resumed = lq.QAdamW(quantized.parameters(), lr=1e-2, states="int8", min_quant_size=0)
    resumed.load_state_dict(roundtrip(optimizer.state_dict()))
    assert resumed.state[quantized[0].weight]["exp_avg"].dtype == torch.float64


def test_add_param_group_checks_like_the_constructor():
    optimizer = lq.QAdamW(make_model().parameters(), states="int4")
    with pytest.raises(ValueError, match="complex parameters"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.randn(8, dtype=torch.complex64))]})
    with pytest.raises(ValueError, match="states"):
        optimizer.add_param_group({"params": [torch.nn.Parameter(torch.randn(8))], "states": "int9"})
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.randn(8))]})
    assert optimizer.param_groups[-1]["states"] == "int4"  # the optimizer's defaults, as the constructor's groups


def test_differentiable_is_refused():
    with pytest.raises(ValueError, match="differentiable=True is not supported"):
        lq.QAdamW(make_model().parameters(), differentiable=True)


def test_state_entries_under_non_parameter_keys_round_trip():
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), min_quant_size=0)
    run(model, optimizer, 1)
    optimizer.state["extra"] = {"count": torch.tensor(3.0)}
    saved = roundtrip(optimizer.state_dict())
    resumed = lq.QAdamW(model.parameters(), min_quant_size=0)
    resumed.load_state_dict(saved)
    assert torch.equal(resumed.state["extra"]["count"], torch.tensor(3.0)) and states_equal(optimizer, resumed)


def test_hooks_see_packed_checkpoints_and_loaded_states():
    """state_dict post-hooks see the packed form; load pre-hooks the dict as given; load post-hooks the loaded states."""
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), min_quant_size=0)
    run(model, optimizer, 1)
    seen = {}
    optimizer.register_state_dict_post_hook(lambda opt, sd: seen.__setitem__("saved", type(sd["state"][0]["exp_avg"])))
    saved = optimizer.state_dict()
    resumed = lq.QAdamW(model.parameters(), min_quant_size=0)
    resumed.register_load_state_dict_pre_hook(lambda opt, sd: seen.__setitem__("given", type(sd["state"][0]["exp_avg"])))
    resumed.register_load_state_dict_post_hook(lambda opt: seen.__setitem__("loaded", type(opt.state[model[0].weight]["exp_avg"])))
    resumed.register_load_state_dict_pre_hook(lambda opt, sd: sd.__setitem__("note", 1))  # as torch: on a copy of the dict
    resumed.load_state_dict(saved)
    assert seen == {"saved": dict, "given": dict, "loaded": QuantizedTensor} and "note" not in saved


@pytest.mark.parametrize(
    ("make", "schedule", "warned"),
    [
        (lambda params: lq.QAdamW(params, lr=1e-2), lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0),
         r"group 0 lr: configured 0.01, checkpoint 0.0001 \(a ReduceLROnPlateau lowers it: then nothing to do\)"),
        (lambda params: lq.QAdamW(params, lr=1e-2),
         lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10), None),
        (lambda params: lq.QSGD(params, lr=1e-2, momentum=0.9),
         lambda opt: torch.optim.lr_scheduler.CyclicLR(opt, base_lr=1e-3, max_lr=1e-2, step_size_up=2), None),
    ],
    ids=["ReduceLROnPlateau", "OneCycleLR", "CyclicLR"],
)  # fmt: skip
def test_a_resume_does_not_warn_about_what_its_scheduler_moved(make, schedule, warned):
    """The betas OneCycleLR and the momentum CyclicLR cycle (``base_momentum`` in the group), built as in the run and
    loaded: the checkpoint's values are taken silently, as torch does (the warning's advice to set the configured values
    again would undo the schedule). ReduceLROnPlateau keeps nothing in the group: an lr below the configured one is
    named with that possibility (a raised lr in the configuration looks the same)."""
    model = make_model()
    optimizer = make(model.parameters())
    scheduler = schedule(optimizer)
    for step in range(3):
        run(model, optimizer, 1, start=step)
        scheduler.step(1.0) if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) else scheduler.step()
    saved = roundtrip(optimizer.state_dict())
    resumed = make(model.parameters())
    schedule(resumed).load_state_dict(scheduler.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed.load_state_dict(saved)
    messages = [str(warning.message) for warning in caught]
    assert (messages == []) if warned is None else (len(messages) == 1 and re.search(warned, messages[0])), messages
    assert resumed.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"] != 1e-2


def test_a_changed_beta2_under_a_cycled_beta1_is_warned_about():
    """OneCycleLR cycles ``beta1`` only: a resume whose configured ``beta2`` differs from the checkpoint's is warned about."""
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=10)
    run(model, optimizer, 1)
    scheduler.step()
    resumed = lq.QAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    torch.optim.lr_scheduler.OneCycleLR(resumed, max_lr=1e-2, total_steps=10).load_state_dict(scheduler.state_dict())
    with pytest.warns(UserWarning, match=r"group 0 betas: configured \(0.95, 0.95\), checkpoint \(.*, 0.999\)"):
        resumed.load_state_dict(roundtrip(optimizer.state_dict()))


@pytest.mark.parametrize(
    ("make", "flag"),
    [
        (lambda params, **flags: lq.QAdamW(params, lr=1e-2, **flags), "amsgrad"),
        (lambda params, **flags: lq.QAdamW(params, lr=1e-2, **flags), "maximize"),
        (lambda params, **flags: lq.QSGD(params, lr=1e-2, momentum=0.9, **flags), "nesterov"),
        (lambda params, **flags: lq.QAdam(params, lr=1e-2, **flags), "decoupled_weight_decay"),
    ],
)
def test_a_changed_flag_is_warned_about_as_a_changed_number(make, flag):
    """An on/off option that changes the update (``amsgrad``, ``maximize``, ``nesterov``, ``decoupled_weight_decay``)
    comes from the checkpoint as the numbers do, and is named when the configured one differs (a run resumed into
    ``QAdamW(amsgrad=True)`` from a checkpoint without it trained as plain AdamW without a word)."""
    model = make_model()
    optimizer = make(model.parameters())
    run(model, optimizer, 1)
    resumed = make(model.parameters(), **{flag: True})
    with pytest.warns(UserWarning, match=rf"group 0 {flag}: configured True, checkpoint False"):
        resumed.load_state_dict(roundtrip(optimizer.state_dict()))
    assert resumed.param_groups[0][flag] is False


def test_a_bound_below_the_closed_form_of_its_step_is_restarted_at_load():
    """torch's ``set_optimizer_state_dict`` (Lightning's FSDP2 one-file resume) loads a plain torch checkpoint into the
    optimizer's own state dict, whose ``K_n²`` is that of its initializing step: a bound below the closed form of the
    loaded step count is restarted as a lost one (it held ``m`` 22 % short of Adam's at the next step); the state's own
    bound is kept (bit-exact resume)."""
    from lightning_qstate.kernels.bounds import MOMENT_BOUND_STATE, bound_square

    param = torch.nn.Parameter(torch.zeros(4096))
    plain = torch.optim.AdamW([param], lr=1e-3)
    for _ in range(3):
        param.grad = torch.ones_like(param)
        plain.step()
    merged = roundtrip(plain.state_dict())
    merged["state"][0][MOMENT_BOUND_STATE] = torch.tensor(bound_square(0.9, 0.999, 1), dtype=torch.float64)  # a fresh one's
    resumed = lq.QAdamW([torch.nn.Parameter(param.detach().clone())], lr=1e-3, states="int8")
    resumed.load_state_dict(merged)
    loaded = resumed.param_groups[0]["params"][0]
    assert float(resumed.state[loaded][MOMENT_BOUND_STATE]) >= bound_square(0.9, 0.999, 3)
    loaded.grad = torch.ones_like(loaded)
    resumed.step()
    assert float(resumed.state[loaded]["exp_avg"].dequantize().max()) == pytest.approx(1 - 0.9**4, rel=0.01)  # not held
    own = roundtrip(resumed.state_dict())
    again = lq.QAdamW([torch.nn.Parameter(loaded.detach().clone())], lr=1e-3, states="int8")
    again.load_state_dict(own)
    assert torch.equal(again.state[again.param_groups[0]["params"][0]][MOMENT_BOUND_STATE], resumed.state[loaded][MOMENT_BOUND_STATE])


@pytest.mark.parametrize("reset", [False, True], ids=["stepped", "just reset"])
def test_distributed_checkpoint_raw_pattern(reset):
    """``dcp.save(opt.state_dict())`` ... ``dcp.load(sd)``; ``opt.load_state_dict(sd)`` (DCP puts non-tensor values under
    stringified keys) resumes exactly; also saved just after ``reset_states`` (as an overflow's reset leaves a parameter),
    which had dropped the moments' bound ``K_n²`` and failed DCP's load ("Missing key ... moment_bound_sq"): a reset keeps
    it, restarted as a lost one would (the closed form after the step count)."""
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), lr=1e-2, min_quant_size=0)
    run(model, optimizer, 2)
    if reset:
        for param in model.parameters():
            optimizer.reset_states(param, ["exp_avg", "exp_avg_sq"])
            assert float(optimizer.state[param][MOMENT_BOUND_STATE]) == bound_square(0.9, 0.999, 2.0)
    with tempfile.TemporaryDirectory() as directory:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's single-process warnings
            dcp.save(optimizer.state_dict(), checkpoint_id=directory)
            resumed_model = make_model(1)
            resumed_model.load_state_dict(model.state_dict())
            resumed = lq.QAdamW(resumed_model.parameters(), lr=1e-2, min_quant_size=0)
            run(resumed_model, resumed, 1, start=50)  # a state to load into
            resumed_model.load_state_dict(model.state_dict())
            target = resumed.state_dict()
            dcp.load(target, checkpoint_id=directory)
    resumed.load_state_dict(target)
    assert states_equal(optimizer, resumed)
    run(model, optimizer, 2, start=2)
    run(resumed_model, resumed, 2, start=2)
    assert params_equal(model, resumed_model)


def test_sgd_without_momentum_keeps_no_state():
    model = make_model()
    optimizer = lq.QSGD(model.parameters(), lr=0.1)
    run(model, optimizer, 2)
    assert len(optimizer.state) == 0 and optimizer.state_dict()["state"] == {}


@pytest.mark.parametrize(
    "make_optimizer,features",
    [
        (lambda params: lq.QAdamW(params, lr=1e-2, min_quant_size=0, rounding="stochastic"), 64),
        (
            lambda params: lq.QAdamW(params, lr=1e-2, min_quant_size=0, rounding="stochastic", states="e4m3"),
            1024,
        ),  # compiled path (a 65,536-value weight)
        (lambda params: lq.QSGD(params, lr=1e-2, momentum=0.9, min_quant_size=0, rounding="stochastic", states="bf16"), 64),
    ],
    ids=["adamw-int8", "adamw-e4m3-compiled", "sgd-bf16"],
)
def test_stochastic_rounding_resumes_exactly(make_optimizer, features):
    """The rounding's random stream is seeded from (seed, step, parameter, state) and the checkpoint holds seed and step:
    a run split by a checkpoint, with torch's global generator in another state, equals the straight run."""

    def fresh():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, features), torch.nn.Linear(features, 64))
        return model, make_optimizer(model.parameters())

    straight_model, straight = fresh()
    run(straight_model, straight, 4)
    model, optimizer = fresh()
    run(model, optimizer, 2)
    saved = roundtrip({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    torch.manual_seed(1234)  # another global stream: nothing may depend on it
    resumed_model, resumed = fresh()
    torch.manual_seed(99)
    resumed_model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["optimizer"])
    run(resumed_model, resumed, 2, start=2)
    assert params_equal(straight_model, resumed_model) and states_equal(straight, resumed)


# --- the configuration the user gave ----------------------------------------------------------------------------
def test_resume_with_other_states_re_encodes_into_the_configured_formats():
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), lr=1e-2, states="int8", min_quant_size=0)
    run(model, optimizer, 2)
    saved = roundtrip(optimizer.state_dict())
    resumed = lq.QAdamW(model.parameters(), lr=1e-2, states="int4", min_quant_size=0)
    with pytest.warns(UserWarning, match=r"states='int8' -> 'int4'.*re-encoded"):
        resumed.load_state_dict(saved)
    assert all(resumed.state_format(p, "exp_avg").name == "int4" for p in model.parameters())
    assert resumed.param_groups[0]["states"] == "int4"
    same = lq.QAdamW(model.parameters(), lr=1e-2, states="int8", min_quant_size=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unchanged configuration loads silently and exactly
        same.load_state_dict(saved)
    assert states_equal(optimizer, same)


def test_resume_of_fp32_states_into_quantized_ones_counts_them():
    """A ``states="fp32"`` checkpoint resumed with ``states="int8"`` quantizes its plain states: the warning counts them
    as re-encoded (it named the change and said nothing of the states)."""
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), lr=1e-2, states="fp32", min_quant_size=0)
    run(model, optimizer, 2)
    resumed = lq.QAdamW(model.parameters(), lr=1e-2, states="int8", min_quant_size=0)
    states = 2 * len(list(model.parameters()))
    with pytest.warns(UserWarning, match=rf"group 0: states='fp32' -> 'int8'; {states} states re-encoded\)"):
        resumed.load_state_dict(roundtrip(optimizer.state_dict()))
    assert all(resumed.state_format(p, "exp_avg").name == "int8" for p in model.parameters())


@pytest.mark.parametrize(
    ("saved_overrides", "configured_overrides", "layer_0_format"),
    [({}, {"0.*": "int4"}, "int4"), ({"0.*": "fp32"}, {}, "int8"), ({"0.*": "int4"}, {"0.*": {"exp_avg": "int4"}}, "int4")],
)
def test_resume_with_other_overrides_applies_the_configured_ones(saved_overrides, configured_overrides, layer_0_format):
    """``overrides`` belong to the storage policy: a changed one re-encodes that layer's states (they were kept in the
    checkpoint's formats, as a plan's are) and is named in the warning; the other layers keep their codes."""

    def fresh(overrides):
        policy = lq.QuantizationPolicy(states="int8", min_quant_size=0, overrides=overrides)
        return lq.QAdamW(model.named_parameters(), lr=1e-2, policy=policy)

    model = make_model()
    optimizer = fresh(saved_overrides)
    run(model, optimizer, 2)
    saved = roundtrip(optimizer.state_dict())
    resumed = fresh(configured_overrides)
    with pytest.warns(UserWarning, match=r"group 0: overrides of 2 parameter\(s\); \d states re-encoded"):  # 0.weight, 0.bias
        resumed.load_state_dict(roundtrip(saved))  # a copy: the loaded codes are the checkpoint's tensors
    assert torch.equal(resumed.state[model[2].weight]["exp_avg"].codes, saved["state"][2]["exp_avg"]["codes"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no state left in a format the policy does not give it
        run(model, resumed, 1, start=2)
    fmt = resumed.state_format(model[0].weight, "exp_avg")
    assert ("fp32" if fmt is None else fmt.name) == layer_0_format
    unchanged = fresh(saved_overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same overrides load silently
        unchanged.load_state_dict(saved)


def test_resume_with_another_lr_warns_and_keeps_torchs_semantics():
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), lr=1e-2)
    run(model, optimizer, 1)
    resumed = lq.QAdamW(model.parameters(), lr=3e-4)
    with pytest.warns(UserWarning, match=r"lr: configured 0.0003, checkpoint 0.01"):
        resumed.load_state_dict(roundtrip(optimizer.state_dict()))
    assert resumed.param_groups[0]["lr"] == 1e-2


# --- non-finite gradients -------------------------------------------------------------------------------------
def named_model_and_optimizer(**options):
    model = make_model()
    optimizer = lq.QAdamW(model.named_parameters(), lr=1e-2, min_quant_size=0, **options)
    run(model, optimizer, 1)
    optimizer.zero_grad()
    model(torch.randn(4, 64)).square().mean().backward()
    model[0].weight.grad[0, 0] = float("inf")
    model[2].bias.grad[1] = float("nan")
    return model, optimizer


def test_one_warning_per_step_names_the_skipped_parameters():
    model, optimizer = named_model_and_optimizer()
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    messages = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    assert len(messages) == 1 and "0.weight" in messages[0] and "2.bias" in messages[0]
    assert optimizer.nonfinite_skips == 2 and optimizer.skipped_steps == 0
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=False)]
    assert changed == [False, True, True, False]


def test_skip_step_skips_every_parameter():
    model, optimizer = named_model_and_optimizer(nonfinite="skip_step")
    before = [p.detach().clone() for p in model.parameters()]
    codes = optimizer.state[model[0].bias]["exp_avg"].codes.clone()
    steps = [float(optimizer.state[p]["step"]) for p in model.parameters()]
    with pytest.warns(RuntimeWarning, match=r"2 parameter\(s\): 0.weight, 2.bias; the whole step was skipped"):
        optimizer.step()
    assert params_equal(torch.nn.ParameterList(before), torch.nn.ParameterList(list(model.parameters())))
    assert torch.equal(codes, optimizer.state[model[0].bias]["exp_avg"].codes)
    assert steps == [float(optimizer.state[p]["step"]) for p in model.parameters()]
    assert optimizer.skipped_steps == 1 and optimizer.nonfinite_skips == 4
    assert all(p.grad is not None for p in model.parameters())  # gradients are left to the user, as GradScaler does
    run(model, optimizer, 1, start=5)
    assert not torch.equal(before[1], model[0].bias)


@pytest.mark.parametrize("cpu_compile", [True, False], ids=["fused steps", "reference path"])
def test_raise_names_the_parameters_before_anything_changes(cpu_compile):
    """``"raise"`` checks every gradient before any parameter or state is written, on every path (the C++ step had
    updated the parameters before the bad one, or all others, and QMuon's buffers without their parameters)."""
    model, optimizer = named_model_and_optimizer(nonfinite="raise")
    optimizer.cpu_compile = cpu_compile
    before = [p.detach().clone() for p in model.parameters()], copy.deepcopy(optimizer.state_dict())
    with pytest.raises(FloatingPointError, match=r"0.weight"):
        optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before[0], strict=True))
    for index, entries in optimizer.state_dict()["state"].items():
        for name, value in entries.items():
            saved = before[1]["state"][index][name]
            pairs = [(value["codes"], saved["codes"]), (value["scales"], saved["scales"])] if isinstance(value, dict) else [(value, saved)]
            assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b for a, b in pairs), (index, name)
    with pytest.raises(ValueError, match="nonfinite='skip_all' is not valid.*'skip_step'"):
        lq.QAdamW(make_model().parameters(), nonfinite="skip_all")


# Optimizer and states, and gradients that overflow them: a block-scaled state past fp32's range (Adam's ``v``, SGD's
# buffer at its second step), an fp16 cast past 65504 (Adam's ``v = 0.001 g^2`` at its first step, SGD's new buffer).
OVERFLOWING_STATES = {
    ("QAdamW", "int8"): [1e21],
    ("QSGD", "int8"): [3e38, 3e38],
    ("QAdamW", "fp16"): [1e4],
    ("QSGD", "fp16"): [1e5],
}


@pytest.mark.parametrize("cpu_compile", [True, False], ids=["fused steps", "reference path"])
@pytest.mark.parametrize(("optimizer", "states"), list(OVERFLOWING_STATES))
def test_a_state_that_overflows_raises_floating_point_error_on_every_path(optimizer, states, cpu_compile):
    """A finite gradient that takes a state past what its format stores: ``FloatingPointError`` whichever path steps it
    (the reference path's format raised ``NonFiniteError``, a ``ValueError``, where the fused steps raised
    ``FloatingPointError``; an fp16 cast stored inf silently, and Adam's next update was inf / inf = NaN)."""
    weight = torch.nn.Parameter(torch.zeros(1000))
    options = {"momentum": 0.9} if optimizer == "QSGD" else {}
    opt = getattr(lq, optimizer)([weight], lr=0.01, **options, states=states, min_quant_size=0)
    opt.cpu_compile = cpu_compile
    with pytest.raises(FloatingPointError, match="overflowed"):
        for value in OVERFLOWING_STATES[optimizer, states]:
            weight.grad = torch.full((1000,), value)
            opt.step()
    # no NaN or inf stays in the quantized states (the fused steps, which write in place, zero them; the reference path
    # keeps the states of before the step), so the checkpoint loads and training goes on
    for name, value in opt.state[weight].items():
        if isinstance(value, QuantizedTensor):
            assert value.scales is None or torch.isfinite(value.scales).all(), name
            assert torch.isfinite(value.dequantize()).all(), name
    type(opt)([weight], lr=0.01, **options, states=states, min_quant_size=0).load_state_dict(roundtrip(opt.state_dict()))
    with torch.no_grad():
        weight.zero_()
    weight.grad = torch.ones(1000)
    opt.step()
    assert torch.isfinite(weight).all()


# Optimizer, options, and the gradients of the overflowing parameter (its second overflows a block-scaled state).
OVERFLOWING = {
    "QAdamW": ({"lr": 1e-3}, (1e-3, 1e21)),
    "QSGD": ({"lr": 0.01, "momentum": 0.9}, (1.7e38, 3e38)),
    "QMuon": ({"lr": 0.02, "momentum": 0.1}, (3e38, -3e38)),
}


def overflow_run(optimizer: str, cpu_compile: bool, overflow: bool, track: bool = False):
    """Two param groups, ``[over, other (NaN gradient at the second step: skipped)]`` and ``[third]``, two steps;
    ``over`` takes the overflowing gradients, or (``overflow=False``) none at the second step. Returns the params, the
    optimizer, the second step's error, and ``over``'s state and stall counts just before that step."""
    options, values = OVERFLOWING[optimizer]
    generator = torch.Generator().manual_seed(0)
    over, other, third = (torch.nn.Parameter(torch.randn(32, 32, generator=generator)) for _ in range(3))
    opt = getattr(lq, optimizer)([{"params": [over, other]}, {"params": [third]}], **options, min_quant_size=0, track_stalls=track)
    opt.cpu_compile = cpu_compile
    error, kept = None, None
    for step, value in enumerate(values):
        over.grad = torch.full_like(over, value) if overflow or step == 0 else None
        other.grad = torch.randn(32, 32, generator=generator)
        third.grad = torch.randn(32, 32, generator=generator)
        if step == 1:
            other.grad[3, 4] = float("nan")
            kept = dict(opt.state[over]), {k: c.clone() for (p, k), c in opt._stall_counts.items() if p is over}
        try:
            opt.step()
        except FloatingPointError as caught:
            error = caught
    return (over, other, third), opt, error, kept


@pytest.mark.parametrize("cpu_compile", [True, False], ids=["fused steps", "reference path"])
@pytest.mark.parametrize("optimizer", list(OVERFLOWING))
def test_an_overflow_stops_no_other_parameters_step(optimizer, cpu_compile):
    """A state that overflows raises ``FloatingPointError`` once every other parameter is stepped: the rest of its group,
    whatever path it took, and the later groups, with their skip counts (a NaN gradient beside it is still counted and
    warned about) and their stall counts, as in a step without the overflowing parameter. The reference path keeps
    the overflowed parameter's states (the same objects), step count and stall counts of before the step."""
    with pytest.warns(RuntimeWarning, match=r"non-finite gradient.*param1"):
        params, opt, error, (kept_state, kept_counts) = overflow_run(optimizer, cpu_compile, True, track=True)
    with pytest.warns(RuntimeWarning, match=r"non-finite gradient.*param1"):
        alone_params, alone, _, _ = overflow_run(optimizer, cpu_compile, False, track=True)
    assert error is not None and "param0" in str(error) and "param1" not in str(error), error
    assert opt.nonfinite_skips == alone.nonfinite_skips == 1
    path = "native" if cpu_compile else "reference"
    assert set(opt.step_paths().values()) == {path} and len(opt.step_paths()) == 3
    counts = opt.stall_counts()
    alone_counts = alone.stall_counts()
    for k in (1, 2):
        assert torch.equal(params[k], alone_params[k]), k
        for name, value in opt.state[params[k]].items():
            twin = alone.state[alone_params[k]][name]
            assert torch.equal(value.dequantize(), twin.dequantize()) if isinstance(value, QuantizedTensor) else torch.equal(value, twin)
        ours, theirs = counts.get(params[k], {}), alone_counts.get(alone_params[k], {})
        assert {n: c.tolist() for n, c in ours.items()} == {n: c.tolist() for n, c in theirs.items()}
    over_state = opt.state[params[0]]
    if cpu_compile:  # written in place: zeroed
        assert all(not v.dequantize().any() for v in over_state.values() if isinstance(v, QuantizedTensor))
    else:
        assert over_state.keys() == kept_state.keys() and all(
            over_state[name] is value or torch.equal(over_state[name], value) for name, value in kept_state.items()
        )
        assert {n: c.tolist() for n, c in counts.get(params[0], {}).items()} == {n: c.tolist() for (n, c) in kept_counts.items()}


@pytest.mark.parametrize("inner", [torch.optim.RMSprop, torch.optim.NAdam, torch.optim.Adagrad])
def test_the_wrapper_keeps_its_states_quantized_through_an_overflow(inner):
    """``quantize_optimizer`` of any optimizer: a state that overflows raises ``FloatingPointError`` naming its parameter,
    which keeps its quantized states and step count of before the step; every state of the others is stepped and
    stored quantized (they stayed decoded fp32 for good, one holding inf, and checkpoints marked them plain), and
    ``step_paths()`` names the parameters stepped."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(32, 32, generator=generator)) for _ in range(3)]
    opt = lq.quantize_optimizer(inner(params, lr=1e-3), states="int8", min_quant_size=0)
    for p in params:
        p.grad = torch.randn(32, 32, generator=generator) * 1e-3
    opt.step()
    kept = dict(opt.state[params[0]])
    counters = {name: value.clone() for name, value in kept.items() if type(value) is torch.Tensor}
    params[0].grad = torch.full((32, 32), 1e21)
    with pytest.raises(FloatingPointError, match=r"param0 overflowed"):
        opt.step()
    assert all(opt.state[params[0]][name] is value for name, value in kept.items() if isinstance(value, QuantizedTensor))
    assert all(torch.equal(opt.state[params[0]][name], value) for name, value in counters.items())
    assert opt.step_paths() == {"param0": "reference", "param1": "reference", "param2": "reference"}
    for p in params:
        p.grad = torch.randn(32, 32, generator=generator) * 1e-3
    opt.step()
    for p in params:
        per_value = [v for v in opt.state[p].values() if isinstance(v, (torch.Tensor, QuantizedTensor)) and v.shape == p.shape]
        assert per_value and all(isinstance(v, QuantizedTensor) and torch.isfinite(v.dequantize()).all() for v in per_value)
    assert not any(k.endswith(".qstate_format") for entry in opt.state_dict()["state"].values() for k in entry)
    fresh = lq.quantize_optimizer(inner(params, lr=1e-3), states="int8", min_quant_size=0)  # an overflow at the first step
    initial = dict(fresh.state.get(params[0], {}))  # Adagrad's, made by its constructor; none for the others
    params[0].grad = torch.full((32, 32), 1e21)
    with pytest.raises(FloatingPointError, match=r"param0 overflowed"):
        fresh.step()
    assert dict(fresh.state.get(params[0], {})).keys() == initial.keys()
    assert all(isinstance(v, QuantizedTensor) for v in fresh.state[params[1]].values() if len(v.shape))


@pytest.mark.parametrize(
    ("inner", "states"),
    [
        (lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.9, centered=True), {"square_avg": "fp16"}),
        (lambda params: torch.optim.NAdam(params, lr=1e-3), {"exp_avg_sq": "fp16"}),
    ],
    ids=["RMSprop", "NAdam"],
)
def test_the_wrapper_puts_back_the_plain_states_of_a_parameter_that_overflows(inner, states):
    """``quantize_optimizer`` with one state quantized and the others kept fp32 (RMSprop's ``momentum_buffer`` and
    ``grad_avg``, NAdam's ``exp_avg``): where the quantized one overflows, the plain ones are as before the step too
    (the inner step had updated them in place, and they kept the failed step's values)."""
    param = torch.nn.Parameter(torch.randn(1000, generator=torch.Generator().manual_seed(0)))
    opt = lq.quantize_optimizer(inner([param]), states=states, min_quant_size=0)
    param.grad = torch.ones(1000)
    opt.step()
    before = {name: value.clone() for name, value in opt.state[param].items() if type(value) is torch.Tensor}
    assert any(value.ndim for value in before.values())
    param.grad = torch.full((1000,), 1e4)
    with pytest.raises(lq.StepOverflowError, match="param0"):
        opt.step()
    assert all(torch.equal(opt.state[param][name], value) for name, value in before.items())


def test_skip_counters_are_checkpointed():
    """``nonfinite_skips`` and ``skipped_steps`` ride in the state dict (logged as cumulative, they restarted at 0 on a
    resume); a checkpoint without them (before 2026-11-28) loads with 0."""
    for nonfinite in ("skip", "skip_step"):
        model, optimizer = named_model_and_optimizer(nonfinite=nonfinite)
        with pytest.warns(RuntimeWarning, match="non-finite gradient"):
            optimizer.step()
        saved = roundtrip(optimizer.state_dict())
        _, resumed = named_model_and_optimizer(nonfinite=nonfinite)
        resumed.load_state_dict(saved)
        assert (resumed.nonfinite_skips, resumed.skipped_steps) == (optimizer.nonfinite_skips, optimizer.skipped_steps) != (0, 0)
        saved["param_groups"][0]["qstate_rounding_seed"] = saved["param_groups"][0]["qstate_rounding_seed"][:2]
        resumed.load_state_dict(saved)
        assert (resumed.nonfinite_skips, resumed.skipped_steps) == (0, 0)


# --- damaged checkpoints ----------------------------------------------------------------------------------------
def saved_checkpoint():
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), min_quant_size=0)
    run(model, optimizer, 2)
    return model, roundtrip(optimizer.state_dict())


def test_flipped_bytes_in_packed_codes_are_detected():
    model, saved = saved_checkpoint()
    codes = saved["state"][0]["exp_avg"]["codes"]
    where = torch.randperm(codes.numel(), generator=torch.Generator().manual_seed(0))[:2000]
    codes.view(-1)[where] ^= 0x5A
    with pytest.raises(ValueError, match=r"state 0 \('exp_avg'\): the checkpoint is damaged.*checksum"):
        lq.QAdamW(model.parameters(), min_quant_size=0).load_state_dict(saved)
    model, saved = saved_checkpoint()
    del saved["state"][0]["exp_avg"]["shape"]  # was a bare KeyError
    with pytest.raises(ValueError, match=r"state 0 \('exp_avg'\): the checkpoint is damaged: its packed state lacks \['shape'\]"):
        lq.QAdamW(model.parameters(), min_quant_size=0).load_state_dict(saved)


def damaged(saved: dict, change) -> dict:
    """A copy of ``saved`` with ``change`` applied to state 0's packed ``exp_avg`` entry."""
    saved = copy.deepcopy(saved)
    change(saved["state"][0]["exp_avg"])
    return saved


@pytest.mark.parametrize(
    "change",
    [
        lambda entry: entry["format"].update(signed=not entry["format"].get("signed", True)),  # decodes through the other map
        lambda entry: entry["format"].update(name="fp8_e4m3"),  # one byte per value too
        lambda entry: entry.update(shape=list(reversed(entry["shape"]))),
        lambda entry: entry.update(dtype="bfloat16"),
        lambda entry: entry.update(qstate_version=3),  # version 3's checksum covers codes and scales only
        lambda entry: (entry.update(qstate_version=2), entry["codes"].view(-1)[:1].__ixor__(1)),  # 2 has none: still checked
    ],
    ids=["signed", "name", "shape", "dtype", "as-version-3", "as-version-2"],
)
def test_damaged_format_shape_or_version_is_detected(change):
    """The checksum covers the metadata too: a packed state's bytes read through another format, shape or dtype raise."""
    model, saved = saved_checkpoint()
    with pytest.raises(ValueError, match=r"state 0 \('exp_avg'\): (the checkpoint is damaged|checkpoint state has shape)"):
        lq.QAdamW(model.parameters(), min_quant_size=0).load_state_dict(damaged(saved, change))


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (lambda saved: saved["state"][0]["exp_avg"].update(qstate_version="4"), "its version '4' is not a version number"),
        (lambda saved: saved["state"][0]["exp_avg"].update(dtype="float33"), "its dtype 'float33' is not a torch dtype"),
        (lambda saved: saved["state"][0]["exp_avg"]["format"].update(sign=True), "format .*unexpected keyword"),
        (lambda saved: saved.update(qstate_version=99), "version 99 is newer than this lightning_qstate"),
        (lambda saved: saved["param_groups"][0].update(qstate_rounding_seed=[1]), "qstate_rounding_seed holds 1 values"),
    ],
    ids=["version-type", "dtype", "format-argument", "newer-dict", "rounding-counters"],
)
def test_malformed_checkpoint_fields_raise_clear_errors_before_loading(change, said):
    """Fields of the wrong type or content raise ValueError naming them (they gave TypeError, AttributeError or an
    unpacking error, some after states had loaded), and nothing is loaded."""
    model, saved = saved_checkpoint()
    saved = copy.deepcopy(saved)
    change(saved)
    target = lq.QAdamW(model.parameters(), min_quant_size=0)
    with pytest.raises(ValueError, match=said):
        target.load_state_dict(saved)


def test_a_checkpoint_without_its_rounding_seed_warns_under_stochastic_rounding():
    """A converter that drops param group 0's unknown keys loses the SR seed: the resume cannot be exact, and says so."""
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), min_quant_size=0, rounding="stochastic")
    run(model, optimizer, 1)
    saved = roundtrip(optimizer.state_dict())
    del saved["param_groups"][0]["qstate_rounding_seed"]
    with pytest.warns(UserWarning, match="no qstate_rounding_seed in param group 0"):
        lq.QAdamW(model.parameters(), min_quant_size=0, rounding="stochastic").load_state_dict(saved)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # round to nearest draws nothing
        lq.QAdamW(model.parameters(), min_quant_size=0).load_state_dict(saved)


@pytest.mark.parametrize(
    "build",
    [
        lambda params: lq.QAdamW(params, rounding="stochastic"),
        lambda params: lq.QMuon(params),
        lambda params: lq.quantize_optimizer(torch.optim.SGD(params, lr=0.1, momentum=0.9)),
    ],
)
def test_building_an_optimizer_leaves_the_global_generator_as_it_was(build):
    """An optimizer built in place of torch's leaves the random numbers that follow as they were (dropout masks, the
    data order: a paired comparison against torch's optimizer kept its draws), where its seed drew one from torch's
    global generator; two built one after the other over other parameters still draw apart, and a global seed still
    reproduces the seed."""
    torch.manual_seed(0)
    expected = torch.rand(4)
    seeds = []
    for _ in range(2):
        torch.manual_seed(0)
        optimizer = build([torch.nn.Parameter(torch.ones(64, 64))])
        seeds.append(optimizer._rounding_seed)
        assert torch.equal(torch.rand(4), expected)
    other = build([torch.nn.Parameter(torch.ones(32, 64))])
    assert seeds[0] == seeds[1] != other._rounding_seed


def test_a_garbled_format_marker_is_a_damaged_checkpoint():
    model, _ = saved_checkpoint()
    optimizer = lq.QAdamW(model.parameters(), min_quant_size=0)
    run(model, optimizer, 1)
    optimizer.checkpoint_mode = "fp32"
    saved = roundtrip(optimizer.state_dict())
    saved["state"][0]["exp_avg.qstate_format"] = '{"name": "int8"'
    with pytest.raises(ValueError, match=r"state 0 \('exp_avg'\): the checkpoint is damaged: its format marker"):
        lq.QAdamW(model.parameters(), min_quant_size=0).load_state_dict(saved)


def test_version_3_checkpoints_load_with_their_checksum_of_codes_and_scales():
    from lightning_qstate.optim.serialization import checksum

    model, saved = saved_checkpoint()
    as_version_3 = damaged(saved, lambda entry: entry.update(qstate_version=3, checksum=checksum(entry["codes"], entry["scales"])))
    resumed = lq.QAdamW(model.parameters(), min_quant_size=0)
    resumed.load_state_dict(as_version_3)
    assert torch.equal(resumed.state_dict()["state"][0]["exp_avg"]["codes"], saved["state"][0]["exp_avg"]["codes"])


@pytest.mark.parametrize(
    ("states", "retype"),
    [
        ("bf16", lambda entry: entry.update(codes=entry["codes"].view(torch.float16))),
        ("fp16", lambda entry: entry.update(codes=entry["codes"].view(torch.bfloat16))),
        ("int8", lambda entry: entry.update(codes=entry["codes"].view(torch.int8))),
        ("int8", lambda entry: entry.update(scales=entry["scales"].view(torch.float16))),
    ],
    ids=["bf16-as-fp16", "fp16-as-bf16", "uint8-as-int8", "bf16-scales-as-fp16"],
)
def test_codes_or_scales_of_another_dtype_are_refused(states, retype):
    """The same bytes typed as another dtype (the checksum reads bytes) decode to other values: refused at load."""
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), min_quant_size=0, states=states)
    run(model, optimizer, 2)
    saved = damaged(roundtrip(optimizer.state_dict()), retype)
    with pytest.raises(ValueError, match=r"state 0 \('exp_avg'\): the checkpoint is damaged: its codes and scales are \(torch\."):
        lq.QAdamW(model.parameters(), min_quant_size=0, states=states).load_state_dict(saved)


def test_a_plain_state_of_another_shape_is_refused_at_load():
    """A torch AdamW state dict of another model with as many values per parameter: torch's own step would fail on it;
    the C++ step ran on it silently."""
    source = torch.nn.Linear(32, 32, bias=False)
    torch_optimizer = torch.optim.AdamW(source.parameters(), lr=1e-3)
    source(torch.randn(2, 32)).sum().backward()
    torch_optimizer.step()
    target = torch.nn.Linear(64, 16, bias=False)
    with pytest.raises(
        ValueError, match=r"state 0 \('exp_avg'\): checkpoint state has shape \(32, 32\) but the parameter has shape \(16, 64\)"
    ):
        lq.QAdamW(target.parameters(), lr=1e-3, min_quant_size=0).load_state_dict(torch_optimizer.state_dict())


def test_non_finite_scales_are_refused_at_load():
    model, saved = saved_checkpoint()
    entry = saved["state"][2]["exp_avg_sq"]
    entry["scales"][3] = float("nan")
    from lightning_qstate.optim.serialization import entry_checksum

    entry["checksum"] = entry_checksum(entry)  # consistent bytes, bad values
    with pytest.raises(ValueError, match=r"damaged: 1 block scale\(s\) are inf or NaN"):
        lq.QAdamW(model.parameters(), min_quant_size=0).load_state_dict(saved)


@pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()), reason="needs gloo")
def test_a_nan_in_one_ranks_shard_skips_the_parameter_on_every_rank(tmp_path):
    """FSDP1, 2 gloo ranks: ``0.bias`` is split between the ranks' flat shards; a NaN in rank 1's part skips it on both."""
    import json
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    worker = Path(__file__).resolve().parent / "nonfinite_worker.py"
    result = subprocess.run([sys.executable, str(worker), str(tmp_path), str(port)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank in ranks:
        assert rank["changed"]["0.bias"][1] is False and rank["skips"] == 1 and len(rank["warnings"]) == 1
        assert "1 parameter(s): 0.bias;" in rank["warnings"][0]  # named as the module names it
    assert ranks[0]["changed"]["0.bias"][0] > 0 and ranks[1]["changed"]["0.bias"][0] > 0  # both hold a part of it
    assert ranks[0]["changed"]["0.weight"] == [8192, True] and ranks[1]["changed"]["1.weight"] == [8192, True]


def test_version_2_checkpoints_with_flushed_v_load_lifted():
    """Version 2 wrote code 0 for a positive ``v`` far below its block's absmax; loading lifts it to the smallest positive
    code, so the next step after a zero gradient stays an Adam-sized step instead of ``m / eps``."""
    weight = torch.nn.Parameter(torch.zeros(4096))
    optimizer = lq.QAdamW([weight], lr=1e-3, weight_decay=0)
    weight.grad = torch.zeros(4096)
    weight.grad[0], weight.grad[1] = 1.0, 1e-4
    optimizer.step()
    saved = roundtrip(optimizer.state_dict())
    entry = saved["state"][0]["exp_avg_sq"]
    entry["codes"][1] = 0  # what version 2's encoder wrote for v[1] = 1e-11 next to v[0] = 1e-3
    entry["qstate_version"] = saved["qstate_version"] = 2
    del entry["checksum"]
    resumed = lq.QAdamW([weight], lr=1e-3, weight_decay=0)
    resumed.load_state_dict(saved)
    assert int(resumed.state[weight]["exp_avg_sq"].codes[1]) == resumed.state_format(weight, "exp_avg_sq").min_code > 0
    before = float(weight[1])
    weight.grad = torch.zeros(4096)
    resumed.step()
    assert abs(float(weight[1]) - before) < 3e-3  # torch AdamW: 1.67e-3; a flushed v gave 4.21


def test_each_compiled_format_pair_has_its_own_dynamo_cache():
    """dynamo caches (and limits to 8 recompilations) per code object: one shared compiled function failed under
    ``fullgraph`` once a process had compiled 8 format pairs. Each options tuple gets its own copy, once."""
    from lightning_qstate.formats import get_format
    from lightning_qstate.kernels import adam_reference, compiled

    options = [(get_format(name), get_format(name, signed=False), "nearest", True, False, False) for name in ("int8", "int4", "fp8_e4m3")]
    functions = [compiled.compiled_adam_step(option) for option in options]
    codes = {id(function._torchdynamo_orig_callable.__code__) for function in functions}
    assert len(codes) == 3 and id(adam_reference.adam_step_quantized.__code__) not in codes
    assert compiled.compiled_adam_step(options[0]) is functions[0]


def test_a_step_tensor_shared_in_a_loaded_state_dict_counts_once_per_parameter():
    """A state dict whose parameters share one ``step`` tensor (torch's FSDP1 full optimizer state dict with
    ``use_orig_params=False``, loaded into an unwrapped model; torch's load keeps it shared): each parameter counts
    its own steps (the shared tensor went up once per parameter per step: 5 after two, with three parameters) and the
    run goes on as the uninterrupted one."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, generator=generator)) for _ in range(3)]
    straight = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizers = [lq.QAdamW(ps, lr=1e-2, states="int8", min_quant_size=0) for ps in (params, straight)]
    grads = [[torch.randn(64, generator=generator) for _ in range(3)] for _ in range(3)]

    def step(index: int) -> None:
        for optimizer, optimizer_params in zip(optimizers, (params, straight), strict=True):
            for param, grad in zip(optimizer_params, grads[index], strict=True):
                param.grad = grad.clone()
            optimizer.step()

    step(0)
    saved = optimizers[0].state_dict()
    for entry in saved["state"].values():
        entry["step"] = saved["state"][0]["step"]
    optimizers[0].load_state_dict(saved)
    step(1)
    step(2)
    assert [float(optimizers[0].state[p]["step"]) for p in params] == [3.0, 3.0, 3.0]
    assert all(torch.equal(a, b) for a, b in zip(params, straight, strict=True))
