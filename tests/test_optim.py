"""Quantized optimizers: torch parity, checkpoints, wrapping, stall statistics, non-finite gradients, errors."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

import lightning_qstate as lq
from lightning_qstate.formats import QuantizedTensor
from lightning_qstate.kernels.bounds import MOMENT_BOUND_STATE
from lightning_qstate.kernels.native import native_kernel_available
from lightning_qstate.optim import QuantizedOptimizerWrapper

X = torch.randn(128, 32, generator=torch.Generator().manual_seed(1))
Y = torch.randn(128, 16, generator=torch.Generator().manual_seed(2))


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, scheduler=None) -> float:
    loss = torch.tensor(0.0)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = ((model(X) - Y) ** 2).mean()
        loss.backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return float(loss.detach())


CASES = [
    (torch.optim.AdamW, lq.QAdamW, {"lr": 1e-2}),
    (torch.optim.AdamW, lq.QAdamW, {"lr": 1e-2, "weight_decay": 0.3, "amsgrad": True, "betas": (0.8, 0.99)}),
    (torch.optim.AdamW, lq.QAdamW, {"lr": torch.tensor(1e-2), "maximize": False, "eps": 1e-6}),
    (torch.optim.Adam, lq.QAdam, {"lr": 1e-2}),
    (torch.optim.Adam, lq.QAdam, {"lr": 1e-2, "weight_decay": 1e-2, "amsgrad": True}),
    (torch.optim.Adam, lq.QAdam, {"lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 0.1}),
    (torch.optim.SGD, lq.QSGD, {"lr": 1e-2}),
    (torch.optim.SGD, lq.QSGD, {"lr": 1e-2, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    (torch.optim.SGD, lq.QSGD, {"lr": 1e-2, "momentum": 0.9, "dampening": 0.2}),
    (torch.optim.SGD, lq.QSGD, {"lr": 1e-3, "momentum": 0.5, "maximize": True}),
]
MUON_CASES = [{"lr": 1e-2}, {"lr": 1e-2, "nesterov": False, "weight_decay": 0.0}, {"lr": 1e-2, "adjust_lr_fn": "match_rms_adamw"}]


@pytest.mark.parametrize("torch_class,quantized_class,options", CASES, ids=[f"{c[1].__name__}-{i}" for i, c in enumerate(CASES)])
def test_fp32_states_follow_torch_for_200_steps(torch_class, quantized_class, options):
    reference, ours = make_model(), make_model()
    train(reference, torch_class(reference.parameters(), **options), 200)
    train(ours, quantized_class(ours.parameters(), states="fp32", **options), 200)
    a, b = flat_params(reference), flat_params(ours)
    assert float((a - b).abs().max() / a.abs().max()) <= 1e-6


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_fp32_states_of_low_precision_parameters_are_torchs_bit_for_bit(dtype, foreach):
    """fp32 states on fp16/bf16 parameters: AdamW's very iterates with each ``foreach`` (torch's default, ``None``, is its
    per-tensor loop on the CPU; the multi-tensor step rounded fp16 parameters otherwise)."""
    torch.manual_seed(0)
    reference = torch.nn.Parameter(torch.randn(5000).to(dtype))
    ours = torch.nn.Parameter(reference.detach().clone())
    optimizers = [
        torch.optim.AdamW([reference], lr=1e-2, eps=1e-3, foreach=foreach),
        lq.QAdamW([ours], lr=1e-2, eps=1e-3, foreach=foreach, states="fp32"),
    ]
    for _ in range(3):
        grad = torch.randn(5000).to(dtype)
        reference.grad, ours.grad = grad.clone(), grad.clone()
        for optimizer in optimizers:
            optimizer.step()
    assert torch.equal(reference, ours)


@pytest.mark.parametrize("options", MUON_CASES)
def test_qmuon_fp32_follows_torch_muon(options):
    def run(make):
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(64, 32) * 0.1)
        optimizer = make([weight])
        for _ in range(200):
            optimizer.zero_grad()
            loss = ((X @ weight.t() - torch.ones(128, 64)) ** 2).mean()
            loss.backward()
            optimizer.step()
        return weight.detach().clone(), float(loss.detach())

    a, loss_a = run(lambda p: torch.optim.Muon(p, **options))
    b, _ = run(lambda p: lq.QMuon(p, states="fp32", **options))
    assert float((a - b).abs().max() / a.abs().max()) <= 1e-6
    _, loss_c = run(lambda p: lq.QMuon(p, states="int8", min_quant_size=0, **options))
    assert loss_c < loss_a * 1.05 + 1e-3


@pytest.mark.parametrize("states", ["int8", "int4", "fp8_e4m3", "bf16", {"exp_avg": "int8", "exp_avg_sq": "e4m3"}])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_low_bit_states_train_close_to_fp32(states, rounding):
    reference, ours = make_model(), make_model()
    loss_fp32 = train(reference, torch.optim.AdamW(reference.parameters(), lr=3e-3), 150)
    optimizer = lq.QAdamW(
        ours.parameters(), lr=3e-3, states=states, rounding=rounding, min_quant_size=0, generator=torch.Generator().manual_seed(0)
    )
    loss = train(ours, optimizer, 150)
    if (states, rounding) == ("int4", "nearest"):
        # 4-bit RN moments stall on this small problem (the effect StallMonitor measures); it still learns
        assert loss < 0.5 * float(((make_model()(X) - Y) ** 2).mean().detach())
    else:
        assert loss < loss_fp32 * 1.25 + 0.02
    kinds = {type(v) for s in optimizer.state.values() for k, v in s.items() if k not in ("step", MOMENT_BOUND_STATE)}
    assert kinds == {QuantizedTensor}


def test_state_bytes_per_parameter():
    big = torch.nn.Linear(1024, 1024, bias=False)
    big.weight.grad = torch.randn_like(big.weight)
    for states, limit in [("int8", 2.05), ("int4", 1.1), ("bf16", 4.01)]:
        optimizer = lq.QAdamW(big.parameters(), states=states)
        optimizer.step()
        assert lq.state_nbytes(optimizer) / big.weight.numel() <= limit
    fp32 = torch.optim.AdamW(big.parameters())
    fp32.step()
    assert lq.state_nbytes(fp32) == 8 * big.weight.numel() + 4


def test_per_group_overrides_and_min_quant_size():
    model = make_model()
    first, second = model[0], model[2]
    optimizer = lq.QAdamW(
        [
            {"params": first.parameters(), "states": "fp32"},
            {"params": second.parameters(), "states": {"exp_avg": "int4"}, "block_size": 64},
        ],
        states="int8",
        min_quant_size=100,
    )
    train(model, optimizer, 2)
    assert optimizer.state_format(first.weight, "exp_avg") is None
    fmt = optimizer.state_format(second.weight, "exp_avg")
    assert fmt.name == "int4" and fmt.block_size == 64
    assert optimizer.state_format(second.weight, "exp_avg_sq") is None  # unnamed in the mapping: fp32
    assert optimizer.state_format(second.bias, "exp_avg") is None  # 16 elements < min_quant_size
    assert fmt.signed  # m is signed; v (exp_avg_sq) takes the unsigned maps
    assert optimizer.param_groups[1]["block_size"] == 64


@pytest.mark.parametrize("build", ["qadamw", "wrapper"])
def test_a_min_quant_size_above_every_parameter_warns_once(build):
    """states= asks for int8, and min_quant_size (the default 4096) keeps every parameter of a small model fp32: the first
    step says so once; nothing is said where some state is quantized, or where states= asks for fp32 only."""
    model = make_model()  # weights of 2048 and 1024 values, biases

    def optimizer(**options):
        if build == "wrapper":
            return lq.quantize_optimizer(torch.optim.Adagrad(model.parameters()), **options)
        return lq.QAdamW(model.parameters(), **options)

    with pytest.warns(
        UserWarning, match=r"no state will be quantized: each of the 4 parameter\(s\).*largest: 2048\) than min_quant_size=4096"
    ) as caught:
        train(model, optimizer(states="int8"), 3)
    assert sum("no state will be quantized" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for options in [{"states": "int8", "min_quant_size": 500}, {"states": "fp32"}, {"states": "int8", "min_quant_size": 0}]:
            train(model, optimizer(**options), 1)


@pytest.mark.parametrize(
    "options, warned",
    [
        ({"error_feedback": "eco", "rounding": "stochastic"}, "error_feedback='eco'"),  # an fp32 grid of fp32 params: ECO of nothing
        ({"weight_rounding": "nearest"}, "weight_rounding='nearest'"),
        ({"weights": "fp32", "error_feedback": "eco_exact"}, "error_feedback='eco_exact'"),
        ({"weights": "bf16", "weight_rounding": "nearest", "error_feedback": "eco", "rounding": "stochastic"}, None),
        ({"error_feedback": "eco", "rounding": "stochastic", "dtype": torch.bfloat16}, None),  # bf16 params: their own grid
        ({"weights": "bf16", "weight_block": "tensor"}, "weight_block='tensor'"),  # a cast grid has no scale groups
        ({"weights": "fp8_e4m3", "weight_block": "tensor"}, None),
    ],
)
def test_weight_options_that_round_nothing_are_warned_about_at_the_first_step(options, warned):
    """error_feedback and weight_rounding act on the rounding of the new weights: with fp32 parameters and no weights= (or
    weights='fp32') nothing is rounded, so they would change nothing (ECO without weights= trained as plain Adam, paying
    for ECO's step); weight_block sets the scale groups of block-scaled grids only. The first step says so once,
    pointing at the caller. A weight grid, or parameters of a narrower dtype (rounded to their own dtype), take them
    silently."""
    dtype = options.pop("dtype", torch.float32)
    param = torch.nn.Parameter(torch.ones(64, 64, dtype=dtype))
    optimizer = lq.QAdamW([param], min_quant_size=0, **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            param.grad = torch.full_like(param, 0.5)
            optimizer.step()
    messages = [w for w in caught if "weight grids" in str(w.message)]
    if warned is None:
        assert not messages
    else:
        assert len(messages) == 1 and warned in str(messages[0].message) and "nothing" in str(messages[0].message)
        assert messages[0].filename == __file__


def test_step_warnings_point_at_the_caller_of_step():
    """The first step's and the non-finite policy's warnings name the line that called ``step``, not torch's wrappers of it."""
    param = torch.nn.Parameter(torch.ones(8, 8))
    optimizer = lq.QAdamW([param])  # 64 values < min_quant_size: nothing quantized, said at the first step
    param.grad = torch.full_like(param, float("nan"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        optimizer.step()
    messages = [str(w.message) for w in caught]
    assert len(caught) == 2 and "no state will be quantized" in messages[0] and "non-finite gradient" in messages[1]
    assert all(w.filename == __file__ for w in caught), [(str(w.message)[:40], w.filename) for w in caught]


@pytest.mark.parametrize("build", ["qadamw", "wrapper"])
def test_loaded_states_that_keep_formats_the_policy_does_not_give_are_warned_about_once(build):
    """A checkpoint's per-parameter formats (AdaptiveBitWidth's plan, a reencode_state) are kept on load; where the
    configured policy does not give them (a resume without the callback), the first step after the load says so, once.
    A plain resume, and a resume after which the formats are the policy's again, say nothing."""
    model = make_model()

    def optimizer():
        if build == "wrapper":
            return lq.quantize_optimizer(torch.optim.Adagrad(model.parameters()), states="int8", min_quant_size=0)
        return lq.QAdamW(model.parameters(), states="int8", min_quant_size=0)

    saved = optimizer()
    train(model, saved, 2)
    name = "sum" if build == "wrapper" else "exp_avg"  # Adagrad's state, Adam's first moment
    plain = copy.deepcopy(saved.state_dict())  # as saved to disk: a state dict shares the optimizer's tensors
    saved.reencode_state(model[0].weight, name, "int4")
    for checkpoint, warns in ((plain, False), (copy.deepcopy(saved.state_dict()), True)):
        resumed = optimizer()
        resumed.load_state_dict(checkpoint)
        assert resumed.state_format(model[0].weight, name).name == ("int4" if warns else "int8")  # kept
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(model, resumed, 2)
        messages = [str(w.message) for w in caught if "keep the checkpoint's formats" in str(w.message)]
        assert messages == ([f"{type(resumed).__name__}: 1 loaded state(s) keep the checkpoint's formats, which the configured "
                             "policy does not give them: 1 in int4 (configured: int8). The run that saved them chose them "
                             "(AdaptiveBitWidth, reencode_state, another block_size or sharding); resume with the AdaptiveBitWidth "
                             "callback to go on adapting them, or call reencode_state to convert them"] if warns else [])  # fmt: skip
    resumed = optimizer()
    resumed.load_state_dict(copy.deepcopy(saved.state_dict()))
    # what AdaptiveBitWidth sets before the first step
    resumed.state_overrides[model[0].weight] = {"sum": "int4"} if build == "wrapper" else {"exp_avg": "int4", "exp_avg_sq": "int8"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train(model, resumed, 1)


def test_a_kept_state_with_other_blocks_is_warned_about():
    """A kept state in the configured format but other blocks (a ``reencode_state`` with a block size; a packed state
    resharded onto FSDP2 rows) is named with its block sizes; it passed unnoticed when only the names were compared."""
    from lightning_qstate.formats import get_format

    model = make_model()
    saved = lq.QAdamW(model.parameters(), states="int8", min_quant_size=0)
    train(model, saved, 1)
    saved.reencode_state(model[0].weight, "exp_avg", get_format("int8", block_size=64, signed=True))
    resumed = lq.QAdamW(model.parameters(), states="int8", min_quant_size=0)
    resumed.load_state_dict(copy.deepcopy(saved.state_dict()))
    assert resumed.state_format(model[0].weight, "exp_avg").block_size == 64
    with pytest.warns(UserWarning, match=r"1 loaded state\(s\) keep.*1 in int8 blocks of 64 \(configured: int8 blocks of 256\)"):
        train(model, resumed, 1)


@pytest.mark.parametrize("mode", ["packed", "fp32"])
def test_a_state_re_encoded_to_fp32_stays_fp32_on_resume(mode):
    """A state kept plain by choice (``reencode_state(..., "fp32")``) is saved with a marker, so that loading keeps it
    plain (it was quantized per the policy, as a plain torch checkpoint's state, and the resumed run differed); the
    first step says that it differs from the policy. The resumed run is the uninterrupted one."""
    straight_model, resumed_model = make_model(), make_model()
    straight = lq.QAdamW(straight_model.parameters(), states="int8", min_quant_size=0)
    train(straight_model, straight, 2)
    straight.reencode_state(straight_model[0].weight, "exp_avg", "fp32")
    straight.checkpoint_mode = mode
    saved = copy.deepcopy(straight.state_dict())
    resumed_model.load_state_dict(straight_model.state_dict())
    resumed = lq.QAdamW(resumed_model.parameters(), states="int8", min_quant_size=0)
    resumed.load_state_dict(saved)
    assert type(resumed.state[resumed_model[0].weight]["exp_avg"]) is torch.Tensor
    with pytest.warns(UserWarning, match=r"1 loaded state\(s\) keep the checkpoint's formats.*1 in fp32 \(configured: int8\)"):
        train(resumed_model, resumed, 2)
    train(straight_model, straight, 2)
    assert all(torch.equal(a, b) for a, b in zip(straight_model.parameters(), resumed_model.parameters(), strict=True))


def test_v_states_use_unsigned_maps():
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), states="int4", min_quant_size=0)
    train(model, optimizer, 1)
    assert optimizer.state_format(model[0].weight, "exp_avg").signed
    assert not optimizer.state_format(model[0].weight, "exp_avg_sq").signed


def test_lr_scheduler_and_tensor_lr():
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), lr=torch.tensor(1e-2), min_quant_size=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.1)
    train(model, optimizer, 4, scheduler)
    assert float(optimizer.param_groups[0]["lr"]) == pytest.approx(1e-4)


# --- checkpoints --------------------------------------------------------------------------------------


def roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize(
    "quantized_class,options",
    [
        (lq.QAdamW, {"states": "int4", "rounding": "stochastic"}),
        (lq.QSGD, {"momentum": 0.9, "states": "e2m2"}),
        (lq.QAdam, {"states": {"exp_avg": "fp8_e4m3", "exp_avg_sq": "bf16"}, "amsgrad": True}),
    ],
)
def test_checkpoint_resume_is_bit_exact(quantized_class, options):
    def fresh(model):
        return quantized_class(model.parameters(), lr=1e-2, min_quant_size=0, generator=torch.Generator().manual_seed(3), **options)

    model = make_model()
    optimizer = fresh(model)
    train(model, optimizer, 5)
    saved_model = roundtrip(model.state_dict())
    saved = roundtrip(optimizer.state_dict())
    assert saved["qstate_version"] == lq.optim.STATE_FORMAT_VERSION == 4
    train(model, optimizer, 5)

    resumed_model = make_model(seed=9)
    resumed_model.load_state_dict(saved_model)
    resumed = fresh(resumed_model)
    resumed.load_state_dict(saved)
    again = resumed.state_dict()
    for index, entries in saved["state"].items():
        for name, value in entries.items():
            if isinstance(value, dict):
                assert torch.equal(value["codes"], again["state"][index][name]["codes"])
                assert again["state"][index][name]["codes"].dtype == value["codes"].dtype
    # SR streams are seeded from (seed, step, parameter, state), and the checkpoint holds seed and step
    train(resumed_model, resumed, 5)
    assert torch.equal(flat_params(model), flat_params(resumed_model))


def test_version_1_checkpoints_load_as_saved_with_fp32_scales():
    """State version 1 (before bf16 scales) stored every block scale in fp32 and no ``scale_dtype``: such states load
    bit for bit in their fp32-scaled formats, keep them while training on (the C++ kernel takes either scale type),
    and so do their fp32 exports' format markers."""
    from lightning_qstate.optim.serialization import format_from_marker

    def fresh(seed: int):
        torch.manual_seed(seed)
        layer = torch.nn.Linear(256, 256)
        return layer, lq.QAdamW(layer.parameters(), lr=1e-2, states="int8", min_quant_size=0)

    def steps(layer, optimizer, count: int) -> None:
        for step in range(count):
            optimizer.zero_grad()
            layer(torch.randn(8, 256, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            optimizer.step()

    layer, optimizer = fresh(0)
    steps(layer, optimizer, 3)
    saved = roundtrip(optimizer.state_dict())
    saved["qstate_version"] = 1
    for entries in saved["state"].values():
        for entry in entries.values():
            if isinstance(entry, dict):  # what version 1 wrote
                entry["qstate_version"] = 1
                del entry["format"]["scale_dtype"], entry["checksum"]
                entry["scales"] = entry["scales"].float()
    resumed_layer, resumed = fresh(1)
    resumed_layer.load_state_dict(layer.state_dict())
    resumed.load_state_dict(saved)
    for param, resumed_param in zip(layer.parameters(), resumed_layer.parameters(), strict=False):
        for name in ("exp_avg", "exp_avg_sq"):
            before, after = optimizer.state[param][name], resumed.state[resumed_param][name]
            assert after.format.scale_dtype == after.scales.dtype == torch.float32
            assert torch.equal(after.codes, before.codes) and torch.equal(after.dequantize(), before.dequantize())
    steps(resumed_layer, resumed, 2)
    assert all(
        resumed.state_format(p, name).scale_dtype == torch.float32 for p in resumed_layer.parameters() for name in ("exp_avg", "exp_avg_sq")
    )
    assert all(bool(torch.isfinite(p).all()) for p in resumed_layer.parameters())
    assert (
        format_from_marker('{"qstate_version": 1, "name": "int8", "block_size": null, "signed": true, "nonfinite": "raise"}').scale_dtype
        == torch.float32
    )


def test_resume_matches_uninterrupted_run():
    def fresh(model):
        return lq.QAdamW(model.parameters(), lr=1e-2, states="int8", min_quant_size=0)

    straight = make_model()
    straight_opt = fresh(straight)
    train(straight, straight_opt, 10)

    first = make_model()
    first_opt = fresh(first)
    train(first, first_opt, 4)
    model_state, opt_state = roundtrip(first.state_dict()), roundtrip(first_opt.state_dict())
    second = make_model(seed=5)
    second.load_state_dict(model_state)
    second_opt = fresh(second)
    second_opt.load_state_dict(opt_state)
    train(second, second_opt, 6)
    assert torch.equal(flat_params(straight), flat_params(second))


def test_torch_fp32_checkpoint_loads_quantized_and_exports_back():
    model = make_model()
    reference = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, reference, 3)
    optimizer = lq.QAdamW(model.parameters(), lr=1e-2, states="int8", min_quant_size=0)
    optimizer.load_state_dict(roundtrip(reference.state_dict()))
    state = optimizer.state[model[0].weight]
    assert isinstance(state["exp_avg"], QuantizedTensor) and state["exp_avg"].format.name == "int8"
    torch.testing.assert_close(state["exp_avg"].dequantize(), reference.state[model[0].weight]["exp_avg"], atol=2e-3, rtol=0.05)
    assert optimizer.param_groups[0]["states"] == "int8"

    exported = roundtrip(optimizer.fp32_state_dict())
    back = torch.optim.AdamW(model.parameters(), lr=1e-2)
    back.load_state_dict(exported)
    assert back.state[model[0].weight]["exp_avg"].dtype == torch.float32
    assert "states" not in back.param_groups[0]
    train(model, back, 1)


def test_checkpoint_of_another_shape_is_refused():
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), min_quant_size=0)
    train(model, optimizer, 1)
    saved = optimizer.state_dict()
    other = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
    with torch.no_grad():
        other[0].weight = torch.nn.Parameter(torch.zeros(64, 32))
    saved["state"][0]["exp_avg"]["shape"] = [32, 64]
    with pytest.raises(ValueError, match=r"shape \(32, 64\).*\(64, 32\)"):
        lq.QAdamW(other.parameters(), min_quant_size=0).load_state_dict(saved)
    saved["state"][0]["exp_avg"]["shape"] = [64, 32]
    saved["state"][0]["exp_avg"]["codes"] = saved["state"][0]["exp_avg"]["codes"][:100]
    with pytest.raises(ValueError, match="bytes but format 'int8' needs"):
        lq.QAdamW(other.parameters(), min_quant_size=0).load_state_dict(saved)
    saved["qstate_version"] = 1
    saved["state"][0]["exp_avg"]["qstate_version"] = 99
    with pytest.raises(ValueError, match="version 99 is newer"):
        lq.QAdamW(other.parameters(), min_quant_size=0).load_state_dict(saved)


# --- re-encoding ----------------------------------------------------------------------------------------


def test_reencode_changes_format_and_keeps_values():
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), states="int8", min_quant_size=0)
    train(model, optimizer, 3)
    weight = model[0].weight
    before = optimizer.state[weight]["exp_avg_sq"].dequantize()
    optimizer.reencode_state(weight, "exp_avg_sq", "int4")
    after = optimizer.state[weight]["exp_avg_sq"]
    assert after.format.name == "int4" and not after.format.signed
    spacing = 1 / 16 * before.abs().max()
    assert float((after.dequantize() - before).abs().max()) <= float(spacing)
    optimizer.reencode_state(weight, "exp_avg_sq", "fp32")
    assert torch.equal(optimizer.state[weight]["exp_avg_sq"], after.dequantize())
    train(model, optimizer, 2)
    assert isinstance(optimizer.state[weight]["exp_avg_sq"], torch.Tensor)  # stays in the chosen format
    with pytest.raises(KeyError, match="no state 'momentum'"):
        optimizer.reencode_state(weight, "momentum", "int8")
    with pytest.raises(ValueError, match=r"state 'step' is not a per-value state.*re-encode one of \['exp_avg', 'exp_avg_sq'\]"):
        optimizer.reencode_state(weight, "step", "int8")  # a QuantizedTensor step count broke the next step()


def test_a_param_group_the_checks_refuse_is_not_added():
    """As torch's own checks do: a group with an invalid option raises and is not left in param_groups (where the next
    step ran with it, or failed at every step)."""
    model = make_model()
    optimizer = lq.QAdamW(model[0].parameters(), min_quant_size=0)
    for bad in ({"rounding": "up"}, {"min_quant_size": -1}, {"block_size": 100}, {"states": "int9"}):
        with pytest.raises(ValueError):
            optimizer.add_param_group({"params": list(model[2].parameters()), **bad})
        assert len(optimizer.param_groups) == 1
    optimizer.add_param_group({"params": list(model[2].parameters()), "states": "int4"})
    train(model, optimizer, 1)
    assert optimizer.state_format(model[2].weight, "exp_avg").name == "int4"


def test_dense_codes_under_a_small_block_are_refused_up_front():
    """int5-int7 pack 8 codes to 5-7 bytes: block sizes 2 and 4 raised at the first step, after the groups before had
    stepped (and left the parameter with a state of ``step`` alone)."""
    model = make_model()
    with pytest.raises(ValueError, match=r"QAdamW: states=\{'exp_avg_sq': 'int6'\}: format 'int6': block_size=4 is too small"):
        lq.QAdamW(model.parameters(), states={"exp_avg_sq": "int6"}, block_size=4)
    with pytest.raises(ValueError, match=r"overrides\['0\.\*'\]: states='int5': format 'int5': block_size=2 is too small"):
        lq.QuantizationPolicy(states="int8", block_size=2, overrides={"0.*": "int5"}).validate("QAdamW")
    assert lq.QAdamW(model.parameters(), states="int6", block_size=8).param_groups[0]["block_size"] == 8


def test_a_tensor_of_another_optimizer_is_refused_and_leaves_the_state_dict_intact():
    """state_format, reencode_state and reset_states name a parameter: one that is not the optimizer's raises instead of
    entering its state (a defaultdict), where state_dict() then failed with a bare KeyError."""
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), states="int8", min_quant_size=0)
    train(model, optimizer, 1)
    stranger = torch.nn.Parameter(torch.zeros(3))
    for call in (
        lambda: optimizer.state_format(stranger, "exp_avg"),
        lambda: optimizer.reencode_state(stranger, "exp_avg", "int4"),
        lambda: optimizer.reset_states(stranger, ["exp_avg"]),
    ):
        with pytest.raises(ValueError, match=r"QAdamW: a tensor of shape \(3,\) is not one of this optimizer's parameters"):
            call()
    assert len(optimizer.state) == 4 and len(optimizer.state_dict()["state"]) == 4
    fresh = lq.QAdamW(model.parameters(), states="int8", min_quant_size=0)  # its own parameter before the first step
    assert fresh.state_format(model[0].weight, "exp_avg") is None and fresh.reset_states(model[0].weight, ["exp_avg"]) == []
    assert len(fresh.state) == 0


# --- wrapping ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "torch_class,options",
    [(torch.optim.AdamW, {"lr": 1e-2}), (torch.optim.Adam, {"lr": 1e-2}), (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9})],
)
def test_quantize_optimizer_keeps_groups_state_and_schedulers(torch_class, options):
    model = make_model()
    original = torch_class(model.parameters(), **options)
    scheduler = torch.optim.lr_scheduler.StepLR(original, step_size=1, gamma=0.5)
    train(model, original, 2)
    groups = original.param_groups
    quantized = lq.quantize_optimizer(original, states="int8", min_quant_size=0)
    assert quantized is original and type(quantized) is lq.optim.QUANTIZED_EQUIVALENTS[torch_class]
    assert quantized.param_groups is groups and quantized.param_groups[0] is groups[0]
    assert isinstance(quantized.state[model[0].weight][quantized.state_names[0]], QuantizedTensor)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "optimizer.step() overridden" / "called before" warnings from the scheduler
        train(model, quantized, 2, scheduler)
    assert quantized.param_groups[0]["lr"] == pytest.approx(options["lr"] * 0.25)


def test_quantize_optimizer_muon():
    weight = torch.nn.Parameter(torch.randn(64, 64))
    quantized = lq.quantize_optimizer(torch.optim.Muon([weight]), min_quant_size=0)
    assert isinstance(quantized, lq.QMuon)


class Lion(torch.optim.Optimizer):
    """A minimal Lion, standing in for a third-party optimizer."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                beta1, beta2 = group["betas"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                update = state["exp_avg"].mul(beta1).add(p.grad, alpha=1 - beta1).sign_()
                p.add_(update, alpha=-group["lr"])
                state["exp_avg"].mul_(beta2).add_(p.grad, alpha=1 - beta2)


@pytest.mark.parametrize(
    "inner", [lambda p: Lion(p, lr=1e-3), lambda p: torch.optim.RMSprop(p, lr=1e-3), lambda p: torch.optim.Adagrad(p, lr=1e-2)]
)
def test_generic_wrapper(inner):
    reference, ours, exact = make_model(), make_model(), make_model()
    loss_reference = train(reference, inner(reference.parameters()), 100)
    wrapped = lq.quantize_optimizer(inner(ours.parameters()), states="int8", min_quant_size=0, track_stalls=True)
    assert isinstance(wrapped, QuantizedOptimizerWrapper)
    loss = train(ours, wrapped, 100)
    assert loss < loss_reference * 1.2 + 0.02
    quantized = [v for s in wrapped.state.values() for v in s.values() if isinstance(v, QuantizedTensor)]
    assert quantized, "parameter-shaped states must be stored quantized"
    assert lq.state_nbytes(wrapped) < lq.state_nbytes(wrapped.optimizer) * 10  # same object: the inner state is ours
    fractions = [f for per in wrapped.stall_stats().values() for f in per.values()]
    assert fractions and all(0.0 <= f <= 1.0 for f in fractions)
    # fp32 "quantization" is exact
    exact_wrapped = lq.quantize_optimizer(inner(exact.parameters()), states="fp32")
    train(exact, exact_wrapped, 100)
    assert torch.equal(flat_params(exact), flat_params(reference))


def test_generic_wrapper_checkpoint_roundtrip():
    model = make_model()
    wrapped = lq.quantize_optimizer(Lion(model.parameters(), lr=1e-3), states="int4", min_quant_size=0)
    train(model, wrapped, 3)
    saved = roundtrip(wrapped.state_dict())
    restored = lq.quantize_optimizer(Lion(model.parameters(), lr=1e-3), states="int4", min_quant_size=0)
    restored.load_state_dict(saved)
    assert torch.equal(restored.state[model[0].weight]["exp_avg"].codes, wrapped.state[model[0].weight]["exp_avg"].codes)


def test_wrapping_errors():
    with pytest.raises(TypeError, match="needs a torch.optim.Optimizer"):
        lq.quantize_optimizer(object())
    already = lq.QAdamW(make_model().parameters())
    with pytest.raises(TypeError, match="already has quantized states"):
        lq.quantize_optimizer(already)


# --- stalls, non-finite gradients, bad configuration ---------------------------------------------------


def test_stall_stats_measure_bf16_ratchet():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.zeros(8192))
    optimizer = lq.QAdamW([weight], lr=0.0, weight_decay=0.0, betas=(0.9, 0.999), states="bf16", track_stalls=True)
    for _ in range(300):
        weight.grad = torch.randn(8192)
        optimizer.step()
    optimizer.stall_stats()  # drop the build-up phase
    for _ in range(50):
        weight.grad = torch.randn(8192)
        optimizer.step()
    stats = optimizer.stall_stats()["param0"]
    assert 0.5 < stats["exp_avg_sq"] <= 1.0  # bf16 at beta2 = 0.999 mostly stalls
    assert stats["exp_avg"] < stats["exp_avg_sq"]
    assert optimizer.stall_stats() == {}  # counters were reset
    with pytest.raises(RuntimeError, match="track_stalls=True"):
        lq.QAdamW([weight]).stall_stats()


def test_named_parameters_name_the_stall_stats():
    model = make_model()
    optimizer = lq.QAdamW(model.named_parameters(), min_quant_size=0, track_stalls=True)
    train(model, optimizer, 2)
    assert set(optimizer.stall_stats()) == {"0.weight", "0.bias", "2.weight", "2.bias"}


def test_nonfinite_gradients_skip_or_raise():
    model = make_model()
    optimizer = lq.QAdamW(model.parameters(), min_quant_size=0)
    train(model, optimizer, 2)
    weight = model[0].weight
    codes_before = optimizer.state[weight]["exp_avg"].codes.clone()
    weight_before = weight.detach().clone()
    optimizer.zero_grad()
    ((model(X) - Y) ** 2).mean().backward()
    weight.grad[0, 0] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite gradient.*skipped"):
        optimizer.step()
    assert optimizer.nonfinite_skips == 1
    assert torch.equal(weight, weight_before) and torch.equal(optimizer.state[weight]["exp_avg"].codes, codes_before)
    assert not torch.equal(model[2].weight.grad, torch.zeros_like(model[2].weight))  # other params still stepped
    strict = lq.QAdamW(model.parameters(), nonfinite="raise")
    weight.grad[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        strict.step()


def test_fp32_state_params_step_together_with_the_same_gradient_policy():
    """Params under min_quant_size step in one multi-tensor call: an empty shard is fine, a finite gradient whose L1
    norm overflows still steps, a non-finite one is skipped; the others match torch.optim.AdamW exactly."""

    def make():
        return [torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.ones(10)), torch.nn.Parameter(torch.ones(10))]

    params, reference = make(), make()
    optimizer, torch_optimizer = lq.QAdamW(params, lr=0.1), torch.optim.AdamW(reference[:2], lr=0.1)
    for p, q in zip(params, reference, strict=False):
        p.grad, q.grad = torch.full_like(p, 3e37), torch.full_like(q, 3e37)  # 10 of them overflow an fp32 L1 norm
    params[2].grad[3] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        optimizer.step()
    torch_optimizer.step()
    assert optimizer.nonfinite_skips == 1 and torch.equal(params[2].detach(), torch.ones(10))
    assert torch.equal(params[1].detach(), reference[1].detach()) and not torch.equal(params[1].detach(), torch.ones(10))
    assert not any(isinstance(value, QuantizedTensor) for state in optimizer.state.values() for value in state.values())


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"states": "int3"}, ValueError, "unknown format 'int3'"),
        ({"states": {"exp_avgs": "int8"}}, ValueError, r"unknown state name\(s\) \['exp_avgs'\].*exp_avg_sq"),
        ({"states": 8}, TypeError, "states= must be a format name"),
        ({"rounding": "down"}, ValueError, "rounding='down'"),
        ({"block_size": 100}, ValueError, "block_size=100.*power of two"),
        ({"min_quant_size": -1}, ValueError, "min_quant_size=-1"),
        ({"min_quant_size": True}, ValueError, "min_quant_size=True must be an int"),
        ({"nonfinite": "ignore"}, ValueError, "nonfinite='ignore'.*skip"),
        ({"generator": "x"}, TypeError, "generator= must be a torch.Generator"),  # was an AttributeError at the first step
    ],
)
def test_bad_configuration_is_explained(kwargs, error, match):
    with pytest.raises(error, match=match):
        lq.QAdamW(make_model().parameters(), **kwargs)


def test_sparse_and_complex_are_refused():
    with pytest.raises(ValueError, match="complex parameters"):
        lq.QAdamW([torch.nn.Parameter(torch.randn(4, dtype=torch.complex64))])
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    optimizer = lq.QSGD(embedding.parameters(), lr=0.1)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        optimizer.step()


def test_closure_is_called_with_grad_enabled():
    model = make_model()
    optimizer = lq.QAdamW(model.parameters())

    def closure():
        assert torch.is_grad_enabled()
        optimizer.zero_grad()
        loss = ((model(X) - Y) ** 2).mean()
        loss.backward()
        return loss

    assert isinstance(optimizer.step(closure), torch.Tensor)


@pytest.mark.parametrize(
    "states", ["int8", "int4", {"exp_avg": "int8", "exp_avg_sq": "bf16"}, {"exp_avg": "int4", "exp_avg_sq": "int6"}, "e3m2"]
)  # the last two: dense 6-bit codes (v, and a signed minifloat m)
def test_fast_cpu_paths_match_the_plain_step(states):
    """Large CPU params take the C++ kernel (the compiled step without a compiler): the stored moments equal the plain
    path's bit for bit over three steps; params within an ulp of the largest, since the plain path is torch's
    functional AdamW, whose eager CPU square root (MKL's) is not always correctly rounded (the fast paths' and
    ``adam_reference``'s are)."""

    def run(fast: bool):
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn((1 << 17) + 77) * 0.1)  # a partial last block too
        optimizer = lq.QAdamW([weight], lr=1e-2, weight_decay=0.1, states=states)
        optimizer.cpu_compile = fast
        for step in range(3):  # decoupled decay: m and v do not depend on the params, so an ulp there stays there
            weight.grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(step))
            optimizer.step()
        return weight.detach(), optimizer.state[weight]

    fast_weight, fast_state = run(True)
    plain_weight, plain_state = run(False)
    torch.testing.assert_close(fast_weight, plain_weight, rtol=2.5e-7, atol=6e-8)  # |params| < 0.6: an ulp is <= 6e-8
    for name in ("exp_avg", "exp_avg_sq"):
        fast, plain = fast_state[name], plain_state[name]
        assert fast.format is plain.format
        assert torch.equal(fast.codes.view(torch.uint8), plain.codes.view(torch.uint8))
        assert fast.scales is None or torch.equal(fast.scales.view(torch.uint8), plain.scales.view(torch.uint8))


@pytest.mark.parametrize("states", ["int8", "int4"])
def test_fast_cpu_paths_count_the_stalls_of_the_plain_step(states):
    """The C++ kernel (int8) and the compiled step (int4) count stalls as ``formats.count_stalls`` does."""

    def counts(fast: bool) -> torch.Tensor:
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn((1 << 17) + 77) * 0.1)
        optimizer = lq.QAdamW([weight], lr=1e-2, betas=(0.9, 0.999), states=states, track_stalls=True)
        optimizer.cpu_compile = fast
        for step in range(3):
            weight.grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(step))
            optimizer.step()
        per_state = optimizer.stall_counts()[weight]
        return torch.stack([per_state["exp_avg"], per_state["exp_avg_sq"]])

    fast, plain = counts(True), counts(False)
    assert bool((plain[:, 0] > 0).all()) and bool((plain[:, 1] > plain[:, 0]).all())
    # equal but for float-rounding ties of the Adam math (see the test above)
    assert float((fast - plain).abs().max()) <= 1e-3 * float(plain[:, 1].min()), (fast.tolist(), plain.tolist())


@pytest.mark.parametrize("states", ["int4", "bf16", "int7"])
def test_compiled_step_handles_stochastic_rounding(states):
    weight = torch.nn.Parameter(torch.randn(1 << 17))
    optimizer = lq.QAdamW([weight], states=states, rounding="stochastic")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the compiled path must not fall back to eager with a warning
        for _ in range(2):
            weight.grad = torch.randn_like(weight)
            optimizer.step()
    assert optimizer.state[weight]["exp_avg"].format.name == states


def test_fp32_state_remainder_of_a_quantized_group_steps_with_it():
    """Small params beside quantized ones step in the same C++ call (CPU): within 1e-6 relative of torch's AdamW over
    200 steps (the yardstick of fp32 states), and a non-finite gradient skips only its param."""
    torch.manual_seed(0)
    small, large, other = torch.nn.Parameter(torch.randn(100)), torch.nn.Parameter(torch.randn(8192)), torch.nn.Parameter(torch.randn(7))
    reference = torch.nn.Parameter(small.detach().clone())
    optimizer = lq.QAdamW([small, large, other], lr=0.01, weight_decay=0.1, states="int8")
    torch_optimizer = torch.optim.AdamW([reference], lr=0.01, weight_decay=0.1)
    for _ in range(200):
        small.grad, large.grad, other.grad = torch.randn(100), torch.randn(8192), torch.randn(7)
        reference.grad = small.grad.clone()
        optimizer.step(), torch_optimizer.step()
    assert isinstance(optimizer.state[large]["exp_avg"], QuantizedTensor) and not isinstance(
        optimizer.state[small]["exp_avg"], QuantizedTensor
    )
    assert optimizer.step_paths()["param0"] == ("native" if native_kernel_available() else "multi_tensor")
    for ours, theirs in ((small, reference), (optimizer.state[small]["exp_avg_sq"], torch_optimizer.state[reference]["exp_avg_sq"])):
        assert float((ours - theirs).abs().max() / theirs.abs().max()) <= 1e-6
    before = other.detach().clone()
    other.grad[2] = float("inf")
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        optimizer.step()
    assert torch.equal(other.detach(), before) and float(optimizer.state[other]["step"]) == 200.0
    assert float(optimizer.state[small]["step"]) == 201.0


def test_a_compiled_step_traces_groups_of_plain_states():
    """``torch.compile(optimizer.step)``, torch's pattern, traces a group whose states are all plain (the usual
    no-decay group of biases under ``min_quant_size``) and steps as the eager optimizer within a few fp32 ulps of the
    weights, 1e-4 of one update (traced, the hyperparameters' scalar arithmetic rounds otherwise, as for torch's own
    optimizers). torch's multi-tensor Adam with CPU step tensors raised under Dynamo ("Expected scalars to be on CPU,
    got meta"); the per-tensor loop keeps them tensors."""
    runs = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        decay = [{"params": [p for p in model.parameters() if p.ndim > 1], "weight_decay": 0.1}]
        groups = decay + [{"params": [p for p in model.parameters() if p.ndim == 1], "weight_decay": 0.0}]
        optimizer = lq.quantize_optimizer(torch.optim.AdamW(groups, lr=1e-3), states="int8", min_quant_size=1024)
        step = torch.compile(optimizer.step, backend="eager") if compiled else optimizer.step
        for _ in range(2):
            optimizer.zero_grad()
            model(torch.ones(8, 64)).square().mean().backward()
            step()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.allclose(a, b, rtol=0, atol=1e-7) for a, b in zip(*runs, strict=True))  # lr 1e-3: an update is ~1e-3


def test_qmuon_refuses_what_muon_cannot_step_in_add_param_group_too():
    """torch's Muon checks 2-D parameters in its constructor only: a bias or a conv weight added later failed in the middle
    of a step (the other groups stepped, its momentum advanced). DTensor shards (FSDP2) are refused: Muon would
    orthogonalize each rank's rows, another algorithm."""
    weight = torch.nn.Parameter(torch.randn(64, 32))
    optimizer = lq.QMuon([weight], lr=0.02, min_quant_size=0)
    for shape in [(64,), (8, 4, 3, 3)]:
        with pytest.raises(ValueError, match=rf"QMuon: Muon only supports 2-D parameters, got one of shape \({shape[0]},"):
            optimizer.add_param_group({"params": [torch.nn.Parameter(torch.randn(shape))]})
    assert len(optimizer.param_groups) == 1  # refused groups are not added
    muon = torch.optim.Muon([weight], lr=0.02)
    muon.add_param_group({"params": [torch.nn.Parameter(torch.randn(64))]})
    with pytest.raises(ValueError, match="Muon only supports 2-D parameters"):
        lq.quantize_optimizer(muon)
    assert type(muon) is torch.optim.Muon  # the refused conversion left it as it was


@pytest.mark.parametrize(
    "build",
    [
        lambda params: lq.QAdamW(params, lr=1e-2, states="e5m7", min_quant_size=0),  # the compiled CPU path (>= 65,536 values)
        lambda params: lq.QAdamW(params, lr=1e-2, states="int8", rounding="stochastic", min_quant_size=0),
        lambda params: lq.quantize_optimizer(torch.optim.Adagrad(params, lr=1e-2), min_quant_size=0),
    ],
)
def test_a_compiled_step_runs_the_quantized_step_as_it_is(build):
    """torch.compile(optimizer.step) (or a compiled training step that calls it) does not trace the quantized step, which
    plans its paths in Python and runs its own kernels: traced, the compiled CPU path raised an AssertionError inside
    dynamo ("Attempt to trace forbidden callable mark_dynamic"). The results are the eager step's, bit for bit."""

    def run(compiled: bool) -> torch.Tensor:
        weight = torch.nn.Parameter(torch.randn(300, 256, generator=torch.Generator().manual_seed(1)))
        optimizer = build([weight])
        step = torch.compile(optimizer.step) if compiled else optimizer.step
        for t in range(3):
            weight.grad = torch.randn(weight.shape, generator=torch.Generator().manual_seed(t))
            step()
        return weight.detach()

    torch.manual_seed(0)
    eager = run(False)
    torch.manual_seed(0)
    assert torch.equal(run(True), eager)


def test_the_group_of_a_parameter_follows_loads_and_added_groups():
    """``_group_of`` keeps a map (a reset or re-plan of every parameter was O(n²)); a load gives the groups new dicts,
    ``add_param_group`` new parameters: the map follows both."""
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(3)]
    optimizer = lq.QAdamW(params[:2], min_quant_size=0)
    assert optimizer._group_of(params[1]) is optimizer.param_groups[0]
    optimizer.load_state_dict(optimizer.state_dict())
    assert optimizer._group_of(params[1]) is optimizer.param_groups[0]
    optimizer.add_param_group({"params": [params[2]], "lr": 0.5})
    assert optimizer._group_of(params[2]) is optimizer.param_groups[1] and optimizer._group_of(params[0]) is optimizer.param_groups[0]


def test_the_group_of_a_parameter_moved_to_another_group_is_the_new_one():
    """A parameter taken out of its group and added in another: the map is built again (the groups' sizes changed)."""
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(3)]
    optimizer = lq.QAdamW(params, min_quant_size=0)
    assert optimizer._group_of(params[2]) is optimizer.param_groups[0]
    optimizer.param_groups[0]["params"].pop()
    optimizer.add_param_group({"params": [params[2]], "betas": (0.5, 0.6)})
    assert optimizer._group_of(params[2])["betas"] == (0.5, 0.6)


@pytest.mark.parametrize("states", ["int8", "int4"])
def test_sgd_momentum_set_to_zero_keeps_the_buffer_for_later(states):
    """torch's SGD with ``momentum=0`` leaves a buffer it made as it is (used again once momentum returns): QSGD keeps its
    codes. Decoded and encoded again at every step, a block whose absmax is negative shrank by the map's negative end
    (int8 -0.993, int4 -0.8875) each time."""
    model = make_model()
    optimizer = lq.QSGD(model.parameters(), lr=1e-2, momentum=0.9, states=states, min_quant_size=0)
    train(model, optimizer, 2)
    optimizer.param_groups[0]["momentum"] = 0.0
    kept = {
        param: (state["momentum_buffer"].codes.clone(), state["momentum_buffer"].dequantize()) for param, state in optimizer.state.items()
    }
    train(model, optimizer, 3)
    assert all(torch.equal(optimizer.state[param]["momentum_buffer"].codes, codes) for param, (codes, _) in kept.items())
    optimizer.param_groups[0]["momentum"] = 0.9
    train(model, optimizer, 1)
    assert not any(torch.equal(optimizer.state[param]["momentum_buffer"].dequantize(), values) for param, (_, values) in kept.items())


@pytest.mark.parametrize(
    ("make", "state"),
    [
        (lambda params, fused: lq.QAdamW(params, lr=1e-2, states="int8", min_quant_size=0, fused=fused), "exp_avg_sq"),
        (lambda params, fused: lq.QSGD(params, lr=1e-2, momentum=0.9, states="int8", min_quant_size=0, fused=fused), "momentum_buffer"),
    ],
    ids=["QAdamW", "QSGD"],
)
def test_fused_updates_store_their_states(make, state):
    """torch's fused CPU kernels write the decoded states without bumping their version: the states are stored after
    every step all the same (a check of 'left alone' by version kept Adam's v at zero and SGD's buffer at the first
    gradient)."""
    runs = []
    for fused in (False, True):
        model = make_model()
        optimizer = make(model.parameters(), fused)
        train(model, optimizer, 4)
        runs.append(optimizer.state[model[0].weight][state].dequantize())
    unfused, fused = runs
    # equal here (Intel AVX-512): torch's fused kernel and the unfused paths compute the same fma forms; the bound leaves
    # room for an ulp-level difference elsewhere moving a value across an int8 threshold (one code step, ~1 % of it)
    assert fused.abs().max() > 0 and (fused - unfused).norm() <= 0.02 * unfused.norm()
