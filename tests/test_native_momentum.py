"""The C++ CPU step of QSGD's and QMuon's coded momentum buffers (``kernels/native.py``: ``native_momentum_steps``;
issue #22), and of QSGD's parameters kept on a weight grid without master weights (``weights=``, ECO's feedback).

Round to nearest, the native path writes the reference path's buffer codes and scales and the same params bit for bit
(torch's single-tensor ``sgd`` and ``muon`` on the decoded buffer, as ``kernels.dispatch.native_kernel_available``
patched to ``False`` forces it); stochastic rounding draws from the optimizer's ``rounding_generator``, independent of
the thread count, resumes exactly from a checkpoint and is unbiased; a parameter with an inf/NaN gradient is skipped.
"""

from __future__ import annotations

import pytest
import torch
from test_native_formats import cast_stochastic_rounding, check_unbiased, same_bits

import lightning_qstate as lq
from lightning_qstate.formats import get_format
from lightning_qstate.formats.weights import get_weight_grid
from lightning_qstate.kernels import dispatch, native
from lightning_qstate.kernels.native import native_momentum_steps

pytestmark = pytest.mark.skipif(not native.native_kernel_available(), reason="no C++ compiler here: the optimizer uses another path")

FORMATS = ["int8", "int4", "int6", "fp8_e4m3", "bf16"]
# (optimizer, options): name -> case
CASES = {
    "sgd": (lq.QSGD, {"lr": 0.1, "momentum": 0.9}),
    "sgd nesterov, decay": (lq.QSGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}),
    "sgd dampening, decay, maximize": (lq.QSGD, {"lr": 0.05, "momentum": 0.7, "dampening": 0.3, "weight_decay": 0.1, "maximize": True}),
    "sgd lr tensor, nesterov, maximize": (lq.QSGD, {"lr": torch.tensor(0.03), "momentum": 0.6, "nesterov": True, "maximize": True}),
    "muon": (lq.QMuon, {"lr": 0.02}),
    "muon plain momentum": (lq.QMuon, {"lr": 0.02, "momentum": 0.3, "nesterov": False, "weight_decay": 0.0}),
}
SHAPES = [(64, 257), (3, 5)]  # partial last blocks and chunks, two threads' work (16 chunks each); one shorter than a vector


def gradient(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Gaussian values, with exact zeros of both signs (the sign of a zero survives into a bf16 buffer)."""
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    grad.view(-1)[::7] = 0.0
    grad.view(-1)[3::11] = -0.0
    return grad


def train(cls, hyper: dict, steps, native_path: bool = True, resume_from=None, param_dtype=torch.float32, **options):
    """``cls(**hyper, **options)`` on two parameters (``SHAPES``) of ``param_dtype``, stepped with ``gradient(shape,
    step)`` for each of ``steps``, on the native path or (``native_path=False``) the reference path; ``resume_from``:
    (params, state dict)."""
    params = [
        torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(k)).to(param_dtype)) for k, shape in enumerate(SHAPES)
    ]
    optimizer = cls(params, min_quant_size=0, generator=torch.Generator().manual_seed(3), **hyper, **options)
    if resume_from is not None:
        for param, saved in zip(params, resume_from[0], strict=True):
            param.data.copy_(saved)
        optimizer.load_state_dict(resume_from[1])
    with pytest.MonkeyPatch.context() as patch:
        if not native_path:
            patch.setattr(dispatch, "native_kernel_available", lambda: False)
        for step in steps:
            for k, param in enumerate(params):
                param.grad = gradient(param.shape, 10 * step + k).to(param_dtype)
            optimizer.step()
    return params, optimizer


def run(case: str, states: str, steps, native_path: bool = True, resume_from=None, **options):
    """``case``'s optimizer (``CASES``) with ``states``, as ``train`` steps it."""
    cls, hyper = CASES[case]
    return train(cls, hyper, steps, native_path, resume_from, states=states, **options)


def tracked_step_counts(params, optimizer, native_path: bool, param_dtype=torch.float32) -> dict:
    """One more step of ``optimizer`` (made with ``track_stalls``) on the native or the reference path, with
    ``track_weight_stalls``: its ``stall_counts()`` as lists."""
    optimizer.track_weight_stalls = True
    for k, param in enumerate(params):
        param.grad = gradient(param.shape, 100 + k).to(param_dtype)
    with pytest.MonkeyPatch.context() as patch:
        if not native_path:
            patch.setattr(dispatch, "native_kernel_available", lambda: False)
        optimizer.step()
    assert set(optimizer.step_paths().values()) == {"native" if native_path else "reference"}
    return {key: {name: c.tolist() for name, c in v.items()} for key, v in optimizer.stall_counts().items()}


def buffers(optimizer, params) -> list:
    return [optimizer.state[param]["momentum_buffer"] for param in params]


def check_threads_and_resume(train_steps) -> tuple[list, object]:
    """``train_steps(steps, resume_from=None)`` (a fresh run, as ``train``) gives the same buffers and params bit for bit
    with 1 and 2 threads, and resumed from a state dict after step 2, on the native path; returns the first run."""
    saved = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            runs.append(train_steps(range(4)))
    finally:
        torch.set_num_threads(saved)
    half_params, half = train_steps(range(2))
    runs.append(train_steps(range(2, 4), resume_from=([p.detach().clone() for p in half_params], half.state_dict())))
    (params, first), others = runs[0], runs[1:]
    assert set(first.step_paths().values()) == {"native"}
    for other_params, other in others:
        for a, b in zip(buffers(first, params), buffers(other, other_params), strict=True):
            assert same_bits(a.codes, b.codes) and same_bits(a.scales, b.scales)
        for a, b in zip(params, other_params, strict=True):
            assert same_bits(a.detach(), b.detach())
    return params, first


@pytest.mark.parametrize("states", FORMATS)
@pytest.mark.parametrize("case", list(CASES))
def test_native_step_is_the_reference_path_bit_for_bit(case, states):
    """One step and four (QSGD's first creates the buffer): the buffers' codes and scales and the params equal the
    reference path's bit for bit after each, and ``step_paths()`` reports ``native``."""
    for steps in (range(1), range(4)):
        fast_params, fast = run(case, states, steps)
        slow_params, slow = run(case, states, steps, native_path=False)
        assert set(fast.step_paths().values()) == {"native"} and set(slow.step_paths().values()) == {"reference"}
        for k, (a, b) in enumerate(zip(buffers(fast, fast_params), buffers(slow, slow_params), strict=True)):
            assert a.dtype == b.dtype and same_bits(a.codes, b.codes) and same_bits(a.scales, b.scales), k
        for a, b in zip(fast_params, slow_params, strict=True):
            assert same_bits(a.detach(), b.detach())


@pytest.mark.parametrize("case", ["sgd dampening, decay, maximize", "muon"])
def test_native_stall_counts_are_the_reference_paths(case):
    """``track_stalls``: the buffer's and the params' stall counts of the native path are the reference path's."""
    counts = [
        tracked_step_counts(*run(case, "int4", range(3), native_path, track_stalls=True), native_path) for native_path in (True, False)
    ]
    assert list(counts[0].values()) == list(counts[1].values())


def test_paths_that_stay_on_the_reference():
    """fp32 buffers (a parameter under ``min_quant_size``: its first step too; not on a weight grid), block-scaled weight
    grids, momentum 0 and ``cpu_compile=False`` take the reference path; every step of a coded buffer, QSGD's first
    (which creates it) too, the native one, ECO's with ``track_stalls`` too."""
    weight = torch.nn.Parameter(torch.randn(64, 64))

    def paths(optimizer, steps=1) -> list[str]:
        taken = []
        for step in range(steps):
            weight.grad = gradient(weight.shape, step)
            optimizer.step()
            taken.append(optimizer.step_paths()["param0"])
        return taken

    assert paths(lq.QSGD([weight], lr=0.01, momentum=0.9, min_quant_size=0), 2) == ["native"] * 2
    assert paths(lq.QMuon([weight], lr=0.01, min_quant_size=0)) == ["native"]
    assert paths(lq.QSGD([weight], lr=0.01, momentum=0.9, min_quant_size=1 << 20), 2) == ["reference"] * 2  # an fp32 buffer
    on_grid = lq.QSGD([weight], lr=0.01, momentum=0.9, min_quant_size=1 << 20, weights="bf16")
    assert paths(on_grid, 2) == ["native"] * 2  # an fp32 buffer on a weight grid: stepped as an fp32 cast
    assert paths(lq.QSGD([weight], lr=0.01, momentum=0.0, min_quant_size=0), 2) == ["reference"] * 2
    assert paths(lq.QMuon([weight], lr=0.01, min_quant_size=0, weights="bf16")) == ["native"]
    assert paths(lq.QMuon([weight], lr=0.01, min_quant_size=0, weights="bf16", error_feedback="eco_exact")) == ["reference"]
    assert paths(lq.QSGD([weight], lr=0.01, momentum=0.9, min_quant_size=0, weights="bf16"), 2) == ["native"] * 2
    assert paths(lq.QSGD([weight], lr=0.01, momentum=0.9, min_quant_size=0, weights="int8"), 2) == ["reference"] * 2  # block-scaled
    tracked = lq.QSGD([weight], lr=0.01, momentum=0.9, min_quant_size=0, weights="bf16", error_feedback="eco", track_stalls=True)
    assert paths(tracked, 2) == ["native"] * 2  # ECO's corrections counted on copies (a tracked step trains as any)
    slow = lq.QMuon([weight], lr=0.01, min_quant_size=0)
    slow.cpu_compile = False
    assert paths(slow) == ["reference"]


GRID_OPTIMIZERS = {
    "sgd": (lq.QSGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}),
    "muon": (lq.QMuon, {"lr": 0.02, "weight_decay": 0.1}),
}


def run_on_grid(param_dtype, grid, feedback, states, steps, native_path=True, resume_from=None, optimizer="sgd", **options):
    """QSGD (nesterov, weight decay) or QMuon (``GRID_OPTIMIZERS``) on parameters of ``param_dtype`` kept on the weight
    grid ``grid`` with ``error_feedback=feedback`` (round to nearest unless ``options`` say), as ``train`` steps it."""
    cls, hyper = GRID_OPTIMIZERS[optimizer]
    options = {"weight_rounding": "nearest", **options}
    return train(cls, hyper, steps, native_path, resume_from, param_dtype, states=states, weights=grid, error_feedback=feedback, **options)


GRIDS = [(torch.float32, "bf16"), (torch.float32, "fp16"), (torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")]


@pytest.mark.parametrize("optimizer, feedback", [("sgd", None), ("sgd", "eco"), ("muon", None)])
@pytest.mark.parametrize("states", ["int8", "int4"])
@pytest.mark.parametrize("param_dtype, grid", GRIDS, ids=[f"{str(d)[6:]} on {g}" for d, g in GRIDS])
def test_momentum_on_a_weight_grid_is_the_reference_path_bit_for_bit(param_dtype, grid, states, optimizer, feedback):
    """QSGD and QMuon without master weights, round to nearest: four steps on the native path (QSGD's first creates
    the buffer there) leave the params on the grid, in their dtype, and the buffers' codes and scales equal the reference
    path's bit for bit, ECO's feedback into SGD's buffer included."""
    fast_params, fast = run_on_grid(param_dtype, grid, feedback, states, range(4), optimizer=optimizer)
    slow_params, slow = run_on_grid(param_dtype, grid, feedback, states, range(4), native_path=False, optimizer=optimizer)
    assert set(fast.step_paths().values()) == {"native"} and set(slow.step_paths().values()) == {"reference"}
    for k, (a, b) in enumerate(zip(buffers(fast, fast_params), buffers(slow, slow_params), strict=True)):
        assert same_bits(a.codes, b.codes) and same_bits(a.scales, b.scales), k
    for a, b in zip(fast_params, slow_params, strict=True):
        assert a.dtype == param_dtype and same_bits(a.detach(), b.detach())
        if grid != "fp32":
            held = a.detach().to(getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[grid]))
            assert torch.equal(held.to(param_dtype), a.detach())


@pytest.mark.parametrize("optimizer, feedback", [("sgd", None), ("sgd", "eco"), ("muon", None)])
@pytest.mark.parametrize("param_dtype, grid", GRIDS, ids=[f"{str(d)[6:]} on {g}" for d, g in GRIDS])
def test_plain_buffers_on_a_weight_grid_take_the_native_path_bit_for_bit(param_dtype, grid, optimizer, feedback):
    """fp32 buffers (``states="fp32"``, as ``min_quant_size`` keeps small parameters') of parameters on a weight grid
    step on the native path as fp32 casts (QSGD's first step creates its buffer there, plain): buffers and params equal
    the reference path's bit for bit, ECO's feedback included, and the buffers stay plain fp32 tensors."""
    fast_params, fast = run_on_grid(param_dtype, grid, feedback, "fp32", range(4), optimizer=optimizer)
    slow_params, slow = run_on_grid(param_dtype, grid, feedback, "fp32", range(4), native_path=False, optimizer=optimizer)
    assert set(fast.step_paths().values()) == {"native"} and set(slow.step_paths().values()) == {"reference"}
    for a, b in zip(buffers(fast, fast_params), buffers(slow, slow_params), strict=True):
        assert type(a) is torch.Tensor and a.dtype == torch.float32 and same_bits(a, b)
    for a, b in zip(fast_params, slow_params, strict=True):
        assert a.dtype == param_dtype and same_bits(a.detach(), b.detach())


@pytest.mark.parametrize("optimizer, feedback", [("sgd", None), ("sgd", "eco"), ("muon", None)])
@pytest.mark.parametrize("param_dtype, grid", [(torch.float32, "bf16"), (torch.float16, "fp16")], ids=["fp32 on bf16", "float16 on fp16"])
def test_momentum_on_a_weight_grid_counts_stalls_as_the_reference_path(param_dtype, grid, optimizer, feedback):
    """``track_stalls`` with ``track_weight_stalls``: the buffer's and the weights' stall counts of QSGD and QMuon on a
    weight grid, and those of ECO's corrections of SGD's buffer, are the reference path's (the weights' and ECO's from the
    update run again on copies, for every path alike)."""
    runs = [
        (run_on_grid(param_dtype, grid, feedback, "int4", range(3), native, track_stalls=True, optimizer=optimizer), native)
        for native in (True, False)
    ]
    counts = [tracked_step_counts(*run, native, param_dtype) for run, native in runs]
    assert list(counts[0].values()) == list(counts[1].values())
    expected = {"momentum_buffer", "weights"} | ({"eco_correction"} if feedback else set())
    assert all(set(by_name) == expected for by_name in counts[0].values())


def test_tracking_changes_no_bit_of_an_eco_run():
    """QSGD with ECO and stochastic rounding of buffer and weights: tracked steps (``StallMonitor``'s, the advisor's)
    take the native path as untracked ones do, so a run tracked at every step ends with the same bits (the reference
    path, which tracked ECO steps took before, draws other random bits)."""
    options = {"rounding": "stochastic", "weight_rounding": "stochastic"}
    untracked = run_on_grid(torch.bfloat16, "bf16", "eco", "int8", range(4), **options)
    tracked = run_on_grid(torch.bfloat16, "bf16", "eco", "int8", range(4), track_stalls=True, **options)
    assert set(tracked[1].step_paths().values()) == {"native"}
    for a, b in zip(buffers(untracked[1], untracked[0]), buffers(tracked[1], tracked[0]), strict=True):
        assert same_bits(a.codes, b.codes) and same_bits(a.scales, b.scales)
    assert all(same_bits(a.detach(), b.detach()) for a, b in zip(untracked[0], tracked[0], strict=True))
    assert all("eco_correction" in by_name for by_name in tracked[1].stall_stats().values())


@pytest.mark.parametrize("optimizer, feedback", [("sgd", None), ("sgd", "eco"), ("muon", None)])
def test_stochastic_weight_rounding_reproduces_and_resumes_exactly(optimizer, feedback):
    """Stochastic weight rounding on the native path draws from ``rounding_generator(key, "weights")``: the same
    generator seed gives the same params with 1 and 2 threads, a run resumed after step 2 matches the uninterrupted
    one, and the draws differ from round to nearest (the rounding is stochastic)."""
    params, _ = check_threads_and_resume(
        lambda steps, resume_from=None: run_on_grid(
            torch.bfloat16, "bf16", feedback, "int4", steps, resume_from=resume_from, weight_rounding="stochastic", optimizer=optimizer
        )
    )
    nearest_params, _ = run_on_grid(torch.bfloat16, "bf16", feedback, "int4", range(4), optimizer=optimizer)
    assert not all(torch.equal(a, b) for a, b in zip(params, nearest_params, strict=True))


def test_a_nonfinite_gradient_at_sgds_first_step_creates_no_buffer():
    """QSGD's first step with an inf/NaN gradient for one parameter: that parameter has no state afterwards (as in
    torch: no buffer, no entry) and stays as it was; the other's buffer is created. At the next step the skipped one's
    buffer is created then (``buf = d``: no dampening), bit for bit as on the reference path."""
    results = []
    for native_path in (True, False):
        params, optimizer = run("sgd dampening, decay, maximize", "int8", range(0))
        before = params[0].detach().clone()
        with pytest.MonkeyPatch.context() as patch:
            if not native_path:
                patch.setattr(dispatch, "native_kernel_available", lambda: False)
            params[0].grad, params[1].grad = torch.full(params[0].shape, float("nan")), gradient(params[1].shape, 1)
            with pytest.warns(RuntimeWarning, match="non-finite gradient"):
                optimizer.step()
            assert params[0] not in optimizer.state and same_bits(params[0].detach(), before)
            assert optimizer.state_format(params[1], "momentum_buffer").name == "int8"
            for k, param in enumerate(params):
                param.grad = gradient(param.shape, 2 + k)
            optimizer.step()
        assert set(optimizer.step_paths().values()) == {"native" if native_path else "reference"}
        results.append((params, buffers(optimizer, params)))
    (fast_params, fast), (slow_params, slow) = results
    for a, b in zip(fast, slow, strict=True):
        assert same_bits(a.codes, b.codes) and same_bits(a.scales, b.scales)
    for a, b in zip(fast_params, slow_params, strict=True):
        assert same_bits(a.detach(), b.detach())


@pytest.mark.parametrize("case", ["sgd nesterov, decay", "muon"])
def test_a_nonfinite_gradient_skips_its_parameter(case):
    """An inf/NaN gradient: that parameter and its buffer are left as they were (counted in ``nonfinite_skips``), the
    other one steps as on the reference path; ``nonfinite="raise"`` raises."""
    results = []
    for native_path in (True, False):
        params, optimizer = run(case, "int8", range(2), native_path=native_path)
        before = (params[0].detach().clone(), buffers(optimizer, params)[0].codes.clone())
        params[0].grad, params[1].grad = torch.full(params[0].shape, float("nan")), gradient(params[1].shape, 7)
        with pytest.MonkeyPatch.context() as patch, pytest.warns(RuntimeWarning, match="non-finite gradient"):
            if not native_path:
                patch.setattr(dispatch, "native_kernel_available", lambda: False)
            optimizer.step()
        assert optimizer.nonfinite_skips == 1 and same_bits(params[0].detach(), before[0])
        assert same_bits(buffers(optimizer, params)[0].codes, before[1])
        results.append((params[1].detach(), buffers(optimizer, params)[1].codes))
    assert same_bits(results[0][0], results[1][0]) and same_bits(results[0][1], results[1][1])
    params, optimizer = run(case, "int8", range(1), nonfinite="raise")
    params[0].grad = torch.full(params[0].shape, float("inf"))
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        optimizer.step()


def test_a_buffer_that_overflows_raises():
    """A finite gradient that takes the buffer past fp32's range: FloatingPointError, as the Adam kernel's."""
    weight = torch.nn.Parameter(torch.zeros(1000))
    optimizer = lq.QSGD([weight], lr=0.01, momentum=0.9, min_quant_size=0)
    weight.grad = torch.full((1000,), 3e38)
    optimizer.step()  # the buffer: the gradient
    with pytest.raises(FloatingPointError, match="momentum buffer overflowed"):
        optimizer.step()


# Gradients of param0 whose second takes its buffer past fp32's range (SGD: 0.9 buf + grad, its first step finite; Muon,
# 0.9 (grad - buf)), and the steps at which param1 has a gradient (SGD's buffer of param1 is created at the overflow step).
OVERFLOWS = {"sgd": ({"momentum": 0.9}, (1.7e38, 3e38), (1,)), "muon": ({"momentum": 0.1}, (3e38, -3e38), (0, 1))}


@pytest.mark.parametrize("optimizer", ["sgd", "muon"])
def test_a_buffer_that_overflows_leaves_the_other_parameters_stepped(optimizer):
    """One parameter's buffer overflows in a group's C++ call: the other's step is complete (QMuon's orthogonalized
    update applied to the buffer the call advanced; QSGD's buffer created at that step kept; stall counts kept), as in a
    run without the overflowing parameter, and the overflowed one's buffer is zeroed."""
    (cls, hyper), (momentum, values, sibling_steps) = GRID_OPTIMIZERS[optimizer], OVERFLOWS[optimizer]
    runs = []
    for with_overflow in (True, False):
        params = [torch.nn.Parameter(torch.zeros(64, 64)), torch.nn.Parameter(gradient((64, 64), 99))]
        opt = cls(params if with_overflow else params[1:], min_quant_size=0, states="int8", track_stalls=True, **{**hyper, **momentum})
        for step, value in enumerate(values):
            params[0].grad = torch.full((64, 64), value)
            params[1].grad = gradient((64, 64), step) if step in sibling_steps else None
            if not (with_overflow and step == 1):
                opt.step()
                continue
            with pytest.raises(FloatingPointError, match=r"momentum buffer overflowed.*\['param0'\]"):
                opt.step()
            assert opt.step_paths() == {"param0": "native", "param1": "native"}
            assert not opt.state[params[0]]["momentum_buffer"].dequantize().any()
        counts = {name: c.tolist() for name, c in opt.stall_counts().get(params[1], {}).items()}
        runs.append((params[1].detach().clone(), opt.state[params[1]]["momentum_buffer"], counts))
    (weights, buffer, counts), (alone_weights, alone_buffer, alone_counts) = runs
    assert same_bits(weights, alone_weights) and all(same_bits(getattr(buffer, n), getattr(alone_buffer, n)) for n in ("codes", "scales"))
    assert counts == alone_counts and (optimizer == "sgd" or counts)


@pytest.mark.parametrize("states", ["int4", "bf16"])
@pytest.mark.parametrize("case", ["sgd nesterov, decay", "muon"])
def test_stochastic_rounding_reproduces_across_threads_and_resumes_exactly(case, states):
    """SR seeds from ``rounding_generator(key, "momentum_buffer")``: the same generator seed gives the same codes and
    params with 1 and 2 threads, and a run resumed from a state dict after step 2 rounds steps 3-4 as the
    uninterrupted run does."""
    check_threads_and_resume(lambda steps, resume_from=None: run(case, states, steps, rounding="stochastic", resume_from=resume_from))


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_sgd_weight_grid_stochastic_rounding_uses_the_documented_draws(name):
    """QSGD's parameters on a bf16 / fp16 grid, rounded stochastically: from a zero fp32 buffer with lr a power of two
    the new value ``p - lr * g`` is exact before its rounding, which takes the kernel's draws of the weight seed
    (``cast_bits``: ``test_native_formats.cast_stochastic_rounding``) bit for bit, over many chunks of draws."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
    numel, seed, lr = 5 * 1024 + 3, 24680, 2.0**-6
    generator = torch.Generator().manual_seed(7)
    param, grad = torch.randn(numel, generator=generator).to(dtype), torch.randn(numel, generator=generator).to(dtype)
    updated = param.float() - grad.float() * lr
    group = {"lr": lr, "weight_decay": 0.0, "momentum": 0.9, "dampening": 0.0, "nesterov": False, "rounding": "nearest"}
    group["weight_rounding"] = "stochastic"
    rows, _ = native_momentum_steps(
        [param], [grad], [torch.zeros(numel)], group, False, False, weights=[get_weight_grid(name)], weight_seeds=[seed]
    )
    assert rows[0][:2] == [1, 1]
    assert torch.equal(param.view(torch.int16), cast_stochastic_rounding(name, updated, seed).view(torch.int16))
    assert 0.1 < float((param != updated.to(dtype)).float().mean()) < 0.6  # SR leaves the nearest value often


@pytest.mark.parametrize("muon", [False, True], ids=["sgd", "muon"])
@pytest.mark.parametrize("name", FORMATS)
def test_kernel_stochastic_rounding_is_unbiased(name, muon):
    """From a zero buffer, SGD's new buffer is the gradient and Muon's (without nesterov) its update, exactly: 64 SR
    trials with their own seeds store one of its two neighbours each, unbiased (``check_unbiased``)."""
    fmt = get_format(name, **({} if name == "bf16" else {"block_size": 64}))
    numel = 64 * 40 + 21
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=generator) * 10.0 ** (-3 * torch.rand(numel, generator=generator))
    group = {"lr": 0.0, "weight_decay": 0.0, "momentum": 0.5, "dampening": 0.0, "nesterov": False, "rounding": "stochastic"}
    draws = []
    for trial in range(64):
        buffer = fmt.quantize(torch.zeros(numel))
        rows, updates = native_momentum_steps([torch.zeros(numel)], [grad], [buffer], group, muon, False, [trial + 1])
        assert rows == [[1, 1, 0, 0]]
        target = updates[0] if muon else grad
        draws.append(buffer.dequantize())
    check_unbiased(f"{name} {'muon' if muon else 'sgd'}", target, torch.stack(draws))
