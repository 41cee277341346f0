"""One policy object (``QuantizationPolicy``) and one dispatcher (``kernels.dispatch``).

Every entry point takes the policy's keywords with its defaults, or ``policy=``; each parameter's step path comes from
one capability table and is reported by ``optimizer.step_paths()``.
"""

from __future__ import annotations

import inspect
import math

import pytest
import torch

import lightning_qstate as lq
from lightning_qstate.kernels import dispatch
from lightning_qstate.kernels.native import native_kernel_available
from lightning_qstate.optim import POLICY_DEFAULTS, POLICY_FIELDS, QuantizationPolicy, QuantizedOptimizerWrapper
from lightning_qstate.optim.policy import NAME_PATTERN_FIELDS

OPTIMIZER_ENTRY_POINTS = [lq.QAdam, lq.QAdamW, lq.QSGD, lq.QMuon, QuantizedOptimizerWrapper, lq.quantize_optimizer]


def lightning_entry_points() -> list:
    pytest.importorskip("lightning")
    from lightning_qstate.callbacks import QuantizedOptimizerStates
    from lightning_qstate.plugins import QStateFSDPPrecision, QStateHalfPrecision, QStateMixedPrecision, QStatePrecision

    return [QStatePrecision, QStateMixedPrecision, QStateHalfPrecision, QStateFSDPPrecision, QuantizedOptimizerStates]


def policy_parameters(entry) -> dict[str, object]:
    signature = inspect.signature(entry)
    return {name: p.default for name, p in signature.parameters.items() if name in POLICY_FIELDS}


@pytest.mark.parametrize("entry", OPTIMIZER_ENTRY_POINTS, ids=lambda e: e.__name__)
def test_optimizer_keywords_are_the_policy_fields(entry):
    """The optimizers spell out the policy's fields (``overrides``, ``weight_overrides`` need names: ``policy=``) with its defaults."""
    parameters = inspect.signature(entry).parameters
    expected = {name: POLICY_DEFAULTS[name] for name in POLICY_FIELDS if name not in NAME_PATTERN_FIELDS}
    assert policy_parameters(entry) == expected
    assert parameters["policy"].default is None and parameters["policy"].kind is inspect.Parameter.KEYWORD_ONLY


def test_lightning_keywords_are_the_policy_fields():
    for entry in lightning_entry_points():
        defaults = policy_parameters(entry)
        for name in NAME_PATTERN_FIELDS:  # None in the signatures (a mutable default would be shared)
            defaults[name] = defaults[name] or {}
        assert defaults == POLICY_DEFAULTS, entry.__name__
        assert inspect.signature(entry).parameters["policy"].default is None


def model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64))


def test_policy_object_configures_an_optimizer():
    net = model()
    policy = QuantizationPolicy(states="int4", min_quant_size=0, track_stalls=True, nonfinite="skip_step")
    optimizer = lq.QAdamW(net.parameters(), policy=policy)
    assert optimizer.param_groups[0]["states"] == "int4" and optimizer.track_stalls and optimizer.nonfinite == "skip_step"
    keywords = lq.QAdamW(model().parameters(), states="int4", min_quant_size=0, track_stalls=True, nonfinite="skip_step")
    assert keywords.param_groups[0]["states"] == optimizer.param_groups[0]["states"]
    with pytest.raises(ValueError, match=r"QAdamW: give either policy= or the keywords \['states'\], not both"):
        lq.QAdamW(net.parameters(), states="int8_linear", policy=policy)
    with pytest.raises(TypeError, match="QSGD: policy= must be a QuantizationPolicy"):
        lq.QSGD(net.parameters(), policy={"states": "int4"})


def test_policy_overrides_match_named_parameters():
    """``overrides`` need names: from ``model.named_parameters()`` given to the optimizer, or a module given to ``apply``."""
    net = model()
    policy = QuantizationPolicy(states="int8", min_quant_size=0, overrides={"1.*": "fp32"})
    optimizer = lq.QAdamW(net.named_parameters(), policy=policy)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert isinstance(optimizer.state[net[0].weight]["exp_avg"], lq.formats.QuantizedTensor)
    assert not isinstance(optimizer.state[net[1].weight]["exp_avg"], lq.formats.QuantizedTensor)
    applied = policy.apply(torch.optim.AdamW(net.parameters()), net)
    assert applied.state_overrides == {net[1].weight: "fp32", net[1].bias: "fp32"}
    with pytest.raises(ValueError, match="named_parameters"):
        lq.QAdamW(net.parameters(), policy=policy)
    with pytest.raises(ValueError, match="'2.\\*' matches no parameter"):
        lq.QAdamW(net.named_parameters(), policy=QuantizationPolicy(overrides={"2.*": "fp32"}))


def test_policy_patterns_match_groups_added_later():
    """``add_param_group`` applies the policy's ``overrides`` and ``weight_overrides`` to the new group's names (its
    ``param_names``, else the module's that ``apply`` recorded): they held for the constructor's parameters only, a
    bias added later took the group's int8 states silently. A group without names is refused, and not added."""
    first, later = model(), model()
    policy = QuantizationPolicy(states="int8", min_quant_size=0, overrides={"*bias": "fp32"}, weight_overrides={"*.0.weight": "bf16"})
    optimizer = lq.QAdamW([(f"first.{name}", p) for name, p in first.named_parameters()], policy=policy)
    later_names = [f"later.{name}" for name, _ in later.named_parameters()]
    optimizer.add_param_group({"params": list(later.parameters()), "param_names": later_names})
    assert optimizer.state_overrides == {first[0].bias: "fp32", first[1].bias: "fp32", later[0].bias: "fp32", later[1].bias: "fp32"}
    assert optimizer.configured_overrides == optimizer.state_overrides
    assert optimizer.weight_overrides == {first[0].weight: "bf16", later[0].weight: "bf16"}
    # apply(optimizer, module): a group of the module's parameters added later (Lightning's BackboneFinetuning) is named by it
    frozen = model()
    converted = QuantizationPolicy(states="int8", min_quant_size=0, overrides={"1.*": "int4"}).apply(
        torch.optim.AdamW(frozen[0].parameters()), frozen
    )
    converted.add_param_group({"params": list(frozen[1].parameters())})
    assert converted.state_overrides == {frozen[1].weight: "int4", frozen[1].bias: "int4"}
    outside = torch.nn.Linear(4, 4)  # not the module's: no name for the patterns
    with pytest.raises(ValueError, match=r"AdamW: the policy's overrides patterns match parameter names.*shapes \[\(4, 4\), \(4,\)\]"):
        converted.add_param_group({"params": list(outside.parameters())})
    assert len(converted.param_groups) == 2
    # a refused group leaves the overrides as they were (it dropped entries apply had made for those parameters)
    policy = QuantizationPolicy(weights="bf16", weight_overrides={"0.weight": "bf16"}, min_quant_size=0)
    selected = policy.apply(torch.optim.AdamW([frozen[0].weight]), frozen)
    kept = dict(selected.weight_overrides)
    assert kept[frozen[1].weight] is None  # the module's other parameters: their dtype
    with pytest.raises(ValueError, match="complex parameters are not supported"):
        selected.add_param_group({"params": [frozen[1].weight, torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))]})
    assert selected.weight_overrides == kept
    # an optimizer pickled before the patterns were kept (no name_patterns) still takes groups
    del converted.__dict__["name_patterns"]
    converted.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})


@pytest.mark.parametrize("make", [lq.QAdamW, lambda params: lq.QMuon([p for p in params if p.ndim == 2])], ids=["QAdamW", "QMuon"])
def test_apply_names_the_parameters_of_an_optimizer_quantized_already(make):
    """``apply(optimizer, module)`` of an optimizer built quantized (``configure_optimizers`` returning a QAdamW or QMuon,
    under the Lightning callback or plugin) names its parameters after the module, as it does a converted one: they
    were ``param0``, ``param1``... in ``step_paths()``, errors and the callbacks' logs."""
    net = model()
    optimizer = QuantizationPolicy().apply(make(list(net.parameters())), net)
    names = dict(net.named_parameters())
    assert set(optimizer.param_names().values()) <= set(names)
    assert optimizer.param_names()[net[0].weight] == "0.weight"


def test_errors_name_the_entry_point_and_the_option():
    with pytest.raises(ValueError, match="QuantizationPolicy: rounding='up'"):
        QuantizationPolicy(rounding="up")
    with pytest.raises(ValueError, match="QAdam: nonfinite='ignore' is not valid"):
        lq.QAdam(model().parameters(), nonfinite="ignore")
    with pytest.raises(ValueError, match="quantize_optimizer: states='int9'"):
        lq.quantize_optimizer(torch.optim.SGD(model().parameters(), momentum=0.9), states="int9")
    with pytest.raises(TypeError, match=r"QAdamW: states=\{'exp_avg': None\} must map state names to format names"):
        lq.QAdamW(model().parameters(), states={"exp_avg": None})
    for entry in lightning_entry_points():
        with pytest.raises(ValueError, match=f"^{entry.__name__}: min_quant_size=-1"):
            entry(min_quant_size=-1)


def test_integer_counts_of_numpy_and_tensors_are_taken_as_python_ints():
    """``block_size`` and ``min_quant_size`` given as numpy integers or 0-d integer tensors (a sweep's grid) are accepted
    by the policy, the constructors and ``add_param_group``, and stored as Python ints (checkpoints and JSON hold no
    numpy scalars); a float count is still refused."""
    import numpy as np

    policy = QuantizationPolicy(min_quant_size=np.int32(0), block_size=torch.tensor(128))
    assert (type(policy.min_quant_size), type(policy.block_size)) == (int, int) and policy.block_size == 128
    optimizer = lq.QAdamW(model().parameters(), min_quant_size=np.int64(0), block_size=np.int64(64))
    optimizer.add_param_group({"params": [torch.nn.Parameter(torch.randn(10))], "min_quant_size": np.int16(3)})
    for group in optimizer.param_groups:
        assert type(group["min_quant_size"]) is int and type(group["block_size"]) is int
    assert [group["min_quant_size"] for group in optimizer.param_groups] == [0, 3]
    with pytest.raises(ValueError, match=r"QAdamW: min_quant_size=np.float64\(3.0\) must be an int >= 0"):
        lq.QAdamW(model().parameters(), min_quant_size=np.float64(3))


def test_each_state_is_checked_with_its_sign():
    """``v`` is stored unsigned: a 16-bit minifloat without a sign bit (e4m12) is valid for it alone (it was checked
    as a signed format, 17 bits, and refused); for ``m``, or for every state at once, it is not."""
    net = model()
    optimizer = lq.QAdamW(net.parameters(), states={"exp_avg_sq": "e4m12"}, min_quant_size=0)
    net(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    stored = optimizer.state_format(net[0].weight, "exp_avg_sq")
    assert stored.name == "e4m12" and stored.bits == 16 and optimizer.state_format(net[0].weight, "exp_avg") is None
    for states in ({"exp_avg": "e4m12"}, "e4m12"):
        with pytest.raises(ValueError, match=r"QAdamW: states=.*'e4m12' is not supported.*at most 16 bits"):
            lq.QAdamW(model().parameters(), states=states)


def test_qadamw_is_qadam_with_decoupled_weight_decay():
    torch.manual_seed(0)
    start = torch.randn(5000)
    weights = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    adamw = lq.QAdamW([weights[0]], lr=1e-2, weight_decay=0.1, min_quant_size=0)
    adam = lq.QAdam([weights[1]], lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, min_quant_size=0)
    assert isinstance(adamw, lq.QAdam) and isinstance(adamw, torch.optim.AdamW) and adamw.param_groups[0]["decoupled_weight_decay"]
    for _ in range(3):
        grad = torch.randn(5000)
        weights[0].grad, weights[1].grad = grad.clone(), grad.clone()
        adamw.step(), adam.step()
    assert torch.equal(weights[0], weights[1])
    adamw.load_state_dict(adamw.state_dict())
    assert adamw.param_groups[0]["decoupled_weight_decay"]


def adam_with(states: dict, cpu_compile: bool = True) -> tuple[lq.QAdamW, dict[str, torch.nn.Parameter]]:
    """One QAdamW over parameters named after the path each should take; ``states``: {name: (numel, dtype, states)}."""
    params = {name: torch.nn.Parameter(torch.randn(numel, dtype=dtype)) for name, (numel, dtype, _) in states.items()}
    groups = [{"params": [p], "param_names": [name], "states": states[name][2]} for name, p in params.items()]
    optimizer = lq.QAdamW(groups, min_quant_size=4096)
    optimizer.cpu_compile = cpu_compile
    for p in params.values():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return optimizer, params


PATH_CASES = {
    "int8": (dispatch.FUSED_MIN_NUMEL, torch.float32, "int8"),  # coded moments: the C++ kernel
    "int4_large": (dispatch.FUSED_MIN_NUMEL, torch.float32, "int4"),  # the C++ kernel; without it torch.compile
    "int4_small": (8192, torch.float32, "int4"),  # the C++ kernel; without it too small to compile: torch's math
    "bf16_param": (8192, torch.bfloat16, "int8"),  # no fast path for bf16 parameters without a weight grid
    "fp32_states": (100, torch.float32, "int8"),  # min_quant_size keeps fp32: fp32 casts in the C++ call; else torch's
    "fp32_policy": (8192, torch.float32, "fp32"),  # states="fp32": torch's multi-tensor Adam, bit for bit torch's
}


def test_each_parameter_takes_the_first_path_that_applies(monkeypatch):
    native = native_kernel_available()
    optimizer, _ = adam_with(PATH_CASES)
    assert optimizer.step_paths() == {
        "int8": "native" if native else "compiled",
        "int4_large": "native" if native else "compiled",
        "int4_small": "native" if native else "reference",
        "bf16_param": "reference",
        "fp32_states": "native" if native else "multi_tensor",
        "fp32_policy": "multi_tensor",
    }
    monkeypatch.setattr(dispatch, "native_kernel_available", lambda: False)  # a machine without a C++ compiler
    without, _ = adam_with(PATH_CASES)
    assert without.step_paths() == {
        "int8": "compiled",
        "int4_large": "compiled",
        "int4_small": "reference",
        "bf16_param": "reference",
        "fp32_states": "multi_tensor",
        "fp32_policy": "multi_tensor",
    }
    plain, _ = adam_with({"int8": (8192, torch.float32, "int8"), "fp32_states": (100, torch.float32, "int8")}, cpu_compile=False)
    assert plain.step_paths() == {"int8": "reference", "fp32_states": "multi_tensor"}


@pytest.mark.skipif(not native_kernel_available(), reason="no C++ compiler here")
def test_fp32_state_parameters_join_their_group_native_call():
    params = [torch.nn.Parameter(torch.randn(n)) for n in (8192, 100)]
    optimizer = lq.QAdamW([{"params": params, "param_names": ["large", "small"]}])
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    assert optimizer.step_paths() == {"large": "native", "small": "native"}


@pytest.mark.skipif(not native_kernel_available(), reason="no C++ compiler here")
def test_a_group_of_small_parameters_steps_in_one_native_call_as_torch_steps_them():
    """A group whose every parameter ``min_quant_size`` keeps fp32 (biases and norms without weight decay) under a
    quantizing policy steps in one C++ call as fp32 casts (torch's multi-tensor step over a GPT's 34 such tensors took
    0.7 ms, most of its quantized step's lead over fused fp32 AdamW): moments bit for bit ``torch.optim.AdamW``'s,
    params within 2 ulps; a ``states="fp32"`` group keeps torch's own update."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(n)) for n in [128] * 20 + [7, 1]]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    optimizer = lq.QAdamW([{"params": params, "weight_decay": 0.0}], lr=1e-2, states="int8")
    reference = torch.optim.AdamW([{"params": copies, "weight_decay": 0.0}], lr=1e-2)
    for _ in range(5):
        for p, copy in zip(params, copies, strict=True):
            p.grad = torch.randn_like(p)
            copy.grad = p.grad.clone()
        optimizer.step()
        reference.step()
    assert set(optimizer.step_paths().values()) == {"native"}
    for p, copy in zip(params, copies, strict=True):
        assert all(torch.equal(optimizer.state[p][name], reference.state[copy][name]) for name in ("exp_avg", "exp_avg_sq"))
        ulp = torch.nextafter(copy.detach().abs(), torch.tensor(math.inf)) - copy.detach().abs()
        assert float(((p.detach() - copy.detach()).abs() / ulp).max()) <= 2
    plain = lq.QAdamW([torch.nn.Parameter(torch.randn(128))], states="fp32")
    plain.param_groups[0]["params"][0].grad = torch.randn(128)
    plain.step()
    assert plain.step_paths() == {"param0": "multi_tensor"}


def test_tensor_betas_keep_torchs_update_for_fp32_moments():
    """Tensor betas: torch computes their bias corrections in fp32 tensor arithmetic, the C++ kernel in double, so fp32
    moments keep torch's per-tensor step (bit for bit ``torch.optim.AdamW``'s; the kernel was 16 ulps off), in a
    quantizing group as in a ``states="fp32"`` one (whose multi-tensor step raised: torch's foreach refuses tensor betas)."""
    for states in ("int8", "fp32"):
        param = torch.nn.Parameter(torch.randn(4000))
        copy = torch.nn.Parameter(param.detach().clone())
        betas = (torch.tensor(0.9), torch.tensor(0.999))
        optimizer = lq.QAdamW([param], lr=1e-3, betas=betas, states=states)
        reference = torch.optim.AdamW([copy], lr=1e-3, betas=tuple(beta.clone() for beta in betas))
        for _ in range(3):
            param.grad = torch.randn_like(param)
            copy.grad = param.grad.clone()
            optimizer.step()
            reference.step()
        assert optimizer.step_paths() == {"param0": "multi_tensor"} and torch.equal(param, copy), states


@pytest.mark.parametrize("make", [lambda p: lq.QAdamW(p, states="int8"), lambda p: lq.QSGD(p, momentum=0.9, states="int8")])
def test_a_step_between_forward_and_backward_is_caught_by_autograd(make):
    """The C++ step writes parameters through their data pointers; it bumps their version counters as torch's in-place
    update does, so a backward through a graph that saved a parameter before the step raises (it ran on the new
    values silently), for coded parameters and for the small ones with fp32 states alike."""
    params = [torch.nn.Parameter(torch.randn(8192)), torch.nn.Parameter(torch.randn(8))]
    optimizer = make(params)
    for param in params:
        param.grad = torch.randn_like(param)
    optimizer.step()
    if native_kernel_available():  # SGD's small parameter keeps a plain buffer: torch's update
        expected = {"param0": "native", "param1": "reference" if isinstance(optimizer, lq.QSGD) else "native"}
        assert optimizer.step_paths() == expected
    for param in params:
        param.grad = torch.randn_like(param)
        saved = (param * param).sum()
        optimizer.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            saved.backward()
        param.grad = None


def test_sgd_and_muon_step_their_coded_buffers_natively():
    """QSGD's steps (the first creates the buffer) and QMuon's take the C++ step of the coded buffer (where the kernel
    builds)."""
    native = "native" if native_kernel_available() else "reference"
    weight = torch.nn.Parameter(torch.randn(64, 64))
    cases = (
        (lq.QSGD([weight], momentum=0.9, min_quant_size=0), [native] * 2),
        (lq.QMuon([weight], min_quant_size=0), [native] * 2),
    )
    for optimizer, expected in cases:
        taken = []
        for _ in expected:
            weight.grad = torch.randn_like(weight)
            optimizer.step()
            taken.append(optimizer.step_paths()["param0"])
        assert taken == expected
    skipped = lq.QSGD([weight, torch.nn.Parameter(torch.randn(3))], momentum=0.9)
    skipped.step()
    assert skipped.step_paths() == {"param0": native}  # a parameter without a gradient takes no path


def test_choose_path_needs_a_final_path_without_requirements():
    candidate = dispatch.Candidate(torch.zeros(4), torch.zeros(4), {}, {}, compile_cpu=True)
    assert dispatch.choose_path(dispatch.PER_PARAMETER_PATHS, candidate) is dispatch.StepPath.REFERENCE
    with pytest.raises(ValueError, match="must end with one without requirements"):
        dispatch.choose_path(((dispatch.StepPath.COMPILED, (lambda c: False,)),), candidate)
