"""Step plans (``kernels.dispatch``): an optimizer reuses a param group's plan only while nothing it was made from changed."""

from __future__ import annotations

import pytest
import torch

import lightning_qstate as lq
from lightning_qstate.formats import QuantizedTensor, get_format
from lightning_qstate.kernels import dispatch, native
from lightning_qstate.kernels.dispatch import ADAM_PATHS, MOMENTUM_PATHS, PLAN_OPTIONS, Candidate, plan_group, plan_inputs
from lightning_qstate.optim import base
from lightning_qstate.optim.weights import weight_grid

needs_kernel = pytest.mark.skipif(not native.native_kernel_available(), reason="no C++ compiler here: the optimizer uses another path")
# What ``plan_inputs`` records of a tensor and of a ``QuantizedTensor``.
PLANNED_TENSOR_READS = {"dtype", "device", "numel", "is_contiguous"}
PLANNED_STATE_READS = {"format", "dtype"}


class _RecordingTensor(torch.Tensor):
    """A tensor that records the attributes and methods read of it."""

    reads: set[str] = set()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = func.__name__
        cls.reads.add(func.__self__.__name__ if name == "__get__" else name)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


class _RecordingState(QuantizedTensor):
    reads: set[str] = set()

    def __getattribute__(self, name):
        type(self).reads.add(name)
        return super().__getattribute__(name)


class _RecordingGroup(dict):
    reads: set[str] = set()

    def __getitem__(self, key):
        type(self).reads.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        type(self).reads.add(key)
        return super().get(key, default)


def _candidates(momentum: bool) -> list[Candidate]:
    """Parameters of every kind the tables tell apart: coded and fp32 states, a weight grid, a buffer still to create."""
    recorded = []
    int8 = get_format("int8")
    for states, weights in (("int8", None), ("fp32", None), ("int8", "bf16"), ("fp32", "bf16")):
        param = torch.zeros(5000).as_subclass(_RecordingTensor)
        grad = torch.zeros(5000).as_subclass(_RecordingTensor)
        zeros = torch.zeros(5000)
        if states == "int8":
            q = int8.quantize(zeros)
            moments = [_RecordingState(q.format, q.codes, q.scales, q.shape, q.dtype) for _ in range(2)]
        else:
            moments = [zeros.clone().as_subclass(_RecordingTensor) for _ in range(2)]
        state = {"step": torch.tensor(1.0)}
        state.update({"momentum_buffer": moments[0]} if momentum else {"exp_avg": moments[0], "exp_avg_sq": moments[1]})
        group = _RecordingGroup(
            lr=1e-3, weight_decay=0.0, amsgrad=False, capturable=False, differentiable=False, fused=None, error_feedback=None,
            momentum=0.9, rounding="nearest", weights=weights, betas=(0.9, 0.999),
        )  # fmt: skip
        grid = weight_grid(weights, {"error_feedback": None, "weight_block": "row"}, zeros)
        recorded.append(Candidate(param, grad, group, state, True, grid, {}))
        if momentum:  # SGD's first step: the buffer is created by the step
            recorded.append(Candidate(param, grad, group, {"step": state["step"]}, True, grid, {"momentum_buffer": int8}))
    return recorded


@pytest.mark.parametrize("table", ["adam", "momentum"])
def test_requirements_read_only_what_a_plan_is_made_from(table):
    """Every requirement of the tables reads of a candidate only what ``plan_inputs`` and ``PLAN_OPTIONS`` hold (a
    requirement that read more would let an optimizer reuse a plan after that changed)."""
    for recorder in (_RecordingTensor, _RecordingState, _RecordingGroup):
        recorder.reads = set()
    candidates = _candidates(momentum=table == "momentum")
    plan_group(MOMENTUM_PATHS if table == "momentum" else ADAM_PATHS, candidates)
    assert _RecordingGroup.reads <= set(PLAN_OPTIONS), _RecordingGroup.reads - set(PLAN_OPTIONS)
    assert _RecordingTensor.reads <= PLANNED_TENSOR_READS, _RecordingTensor.reads - PLANNED_TENSOR_READS
    assert _RecordingState.reads <= PLANNED_STATE_READS, _RecordingState.reads - PLANNED_STATE_READS
    assert _RecordingGroup.reads and _RecordingTensor.reads and _RecordingState.reads  # the recorders saw the reads
    for c in candidates:  # and the inputs read them without error
        assert plan_inputs(c.param, c.grad, c.state, c.weights, c.created)


def _stepped(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], steps: int = 1) -> dict[str, str]:
    for _ in range(steps):
        for param in params:
            param.grad = torch.randn_like(param)
        optimizer.step()
    return optimizer.step_paths()


def test_a_group_is_planned_once_while_nothing_changes(monkeypatch):
    calls = []
    monkeypatch.setattr(base, "plan_group", lambda *args: calls.append(1) or plan_group(*args))
    params = [torch.nn.Parameter(torch.randn(5000)), torch.nn.Parameter(torch.randn(16))]
    optimizer = lq.QAdamW(params, states="int8", min_quant_size=4096)
    _stepped(optimizer, params, steps=4)
    assert len(calls) == 1
    optimizer.param_groups[0]["betas"] = (0.85, 0.999)  # OneCycleLR cycles beta1 every step: the plan reads its kind only
    _stepped(optimizer, params)
    assert len(calls) == 1
    optimizer.param_groups[0]["betas"] = (torch.tensor(0.85), 0.999)  # a tensor: planned again
    _stepped(optimizer, params)
    assert len(calls) == 2 and optimizer.step_paths() == {"param0": "native", "param1": "multi_tensor"}
    calls.clear()
    params[1].grad = None  # another set of parameters with gradients: planned again
    optimizer.step()
    assert len(calls) == 1


def _reencode(optimizer, param):
    optimizer.reencode_state(param, "exp_avg", "fp32")
    optimizer.reencode_state(param, "exp_avg_sq", "fp32")


def _fp32_policy(optimizer, param):
    _reencode(optimizer, param)
    optimizer.param_groups[0]["states"] = "fp32"


def _strided(optimizer, param):
    param.data = torch.randn(param.numel(), 2)[:, 0]


def _block_grid(optimizer, param):
    optimizer.weight_overrides[param] = "fp8_e4m3"


def _no_compile(optimizer, param):
    optimizer.cpu_compile = False


def _option(optimizer, param):
    optimizer.param_groups[0]["error_feedback"] = "eco_exact"


@needs_kernel
@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (_reencode, "native"),  # fp32 moments in a group whose policy quantizes: fp32 casts in the C++ call
        (_fp32_policy, "multi_tensor"),  # the same with states="fp32": torch's multi-tensor update
        (_strided, "reference"),  # the kernel takes contiguous values only
        (_block_grid, "reference"),  # a block-scaled weight grid
        (_no_compile, "reference"),  # the optimizer's switch
        (_option, "reference"),  # a group option: ECO's exact buffer
    ],
)
def test_a_plan_is_made_again_when_what_it_was_made_from_changes(change, expected):
    """After a change to a state's format, the parameter's layout, its weight grid, the optimizer's switches
    or a group option, the next step takes the path a fresh plan gives (not the last plan's)."""
    param = torch.nn.Parameter(torch.randn(5000))
    optimizer = lq.QAdamW([param], states="int8", min_quant_size=0)
    assert _stepped(optimizer, [param], steps=2) == {"param0": "native"}
    change(optimizer, param)
    assert _stepped(optimizer, [param]) == {"param0": expected}
    del optimizer._plans  # planned from scratch: the same
    assert _stepped(optimizer, [param]) == {"param0": expected}


@needs_kernel
def test_a_plan_is_made_again_when_the_dispatch_module_changes(monkeypatch):
    """The module's switches (as tests set them) are part of what a plan is made from."""
    param = torch.nn.Parameter(torch.randn(5000))
    optimizer = lq.QAdamW([param], states="int8", min_quant_size=0)
    assert _stepped(optimizer, [param]) == {"param0": "native"}
    monkeypatch.setattr(dispatch, "native_kernel_available", lambda: False)
    assert _stepped(optimizer, [param]) == {"param0": "compiled" if dispatch.FUSED_MIN_NUMEL <= 5000 else "reference"}


@needs_kernel
def test_the_shared_zero_option_rows_stay_zero():
    """The native calls' all-zero option rows (``native._zeros``: grids, seeds, ECO coefficients, created buffers) are
    shared between calls and optimizers: the kernel only reads them."""
    params = [torch.nn.Parameter(torch.randn(5000)) for _ in range(2)]
    optimizers = [
        lq.QAdamW(params, states="int8", min_quant_size=0),
        lq.QSGD(params, lr=1e-2, momentum=0.9, states="int8", min_quant_size=0),
    ]
    for optimizer in optimizers:
        _stepped(optimizer, params, steps=2)
        assert set(optimizer.step_paths().values()) == {"native"}
    made = native._zeros.cache_info().misses
    for shape, dtype in [((2, 3), torch.int64), ((2,), torch.float32), ((2, 2), torch.int64), ((2,), torch.bool)]:
        assert not native._zeros(shape, dtype).any(), (shape, dtype)
    assert native._zeros.cache_info().misses == made  # the rows the steps used, not new ones
