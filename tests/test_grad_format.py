"""The gradient format option ``grads=``: gradients rounded to a format before the step, on every step path.

Round to nearest, a run with ``grads=`` is the run without it fed the rounded gradients, bit for bit (torch's AdamW
with fp32 states; QAdamW's native, compiled and reference paths with quantized ones). Stochastic rounding draws from
the optimizer's own streams, so a resumed run is the uninterrupted one. Groups override it; non-finite gradients meet
the non-finite policy unrounded; errors name ``grads=``; the Lightning entry points pass it on.
"""

from __future__ import annotations

import pytest
import torch

import lightning_qstate as lq
from lightning_qstate.formats import get_format
from lightning_qstate.kernels import dispatch
from lightning_qstate.optim import QuantizationPolicy

FORMATS = ["bf16", "int8", "fp8_e4m3"]


def step_gradient(step: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """The gradient of a step, a function of the step alone (so that a resumed run sees the same ones)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * seed + step))


def rounded(grad: torch.Tensor, name: str) -> torch.Tensor:
    """``grad`` rounded to format ``name`` (signed, default block, round to nearest), in its own dtype."""
    return get_format(name).quantize(grad).dequantize(grad.dtype)


@pytest.mark.parametrize("name", FORMATS)
def test_rounded_gradients_give_torch_adamw_on_rounded_gradients(name):
    """fp32 states: QAdamW(grads=name) takes torch's multi-tensor AdamW; torch's AdamW on the rounded gradients matches it."""
    start = torch.randn(64, 100)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    quantized = lq.QAdamW([ours], lr=1e-2, states="fp32", grads=name)
    reference = torch.optim.AdamW([theirs], lr=1e-2)
    for step in range(5):
        grad = step_gradient(step, start.shape)
        ours.grad, theirs.grad = grad.clone(), rounded(grad, name)
        quantized.step()
        reference.step()
        assert torch.equal(ours.grad, theirs.grad) and not torch.equal(ours.grad, grad)  # param.grad holds the rounded values
    assert quantized.step_paths() == {"param0": "multi_tensor"}
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("cpu_compile", [True, False], ids=["fast_paths", "reference_path"])
def test_every_step_path_sees_the_rounded_gradients(monkeypatch, name, cpu_compile):
    """Quantized states, round to nearest: ``grads=name`` is the run without it fed the rounded gradients, bit for bit, on
    the path each parameter takes (the C++ kernel or ``torch.compile`` for the large fp32 one, the reference for the
    small int4 and the bf16 ones, torch's multi-tensor Adam for the one ``min_quant_size`` keeps fp32)."""
    monkeypatch.setattr(dispatch, "FUSED_MIN_NUMEL", 4096)
    shapes = {"int8": ((64, 128), torch.float32, "int8"), "int4": ((16, 64), torch.float32, "int4"),
              "bf16_param": ((32, 128), torch.bfloat16, "int8"), "fp32_states": ((10,), torch.float32, "int8")}  # fmt: skip
    runs = []
    for grads in (name, None):
        params = {key: torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(7)).to(dtype))
                  for key, (shape, dtype, _) in shapes.items()}  # fmt: skip
        groups = [{"params": [p], "param_names": [key], "states": shapes[key][2]} for key, p in params.items()]
        optimizer = lq.QAdamW(groups, lr=1e-2, min_quant_size=1000, grads=grads)
        optimizer.cpu_compile = cpu_compile
        for step in range(3):
            for seed, p in enumerate(params.values()):
                grad = step_gradient(step, p.shape, seed).to(p.dtype)
                p.grad = grad if grads is not None else rounded(grad, name)
            optimizer.step()
        runs.append((optimizer.step_paths(), {key: p.detach().clone() for key, p in params.items()}))
    (paths, rounded_in_step), (same_paths, rounded_before) = runs
    assert paths == same_paths
    if cpu_compile:
        assert paths["int8"] in ("native", "compiled") and paths["fp32_states"] in ("native", "multi_tensor")
    else:
        assert paths["int8"] == "reference"
    for key, values in rounded_in_step.items():
        assert torch.equal(values, rounded_before[key]), key


@pytest.mark.parametrize("optimizer_class", [lq.QSGD, lq.QMuon])
def test_momentum_optimizers_round_their_gradients(optimizer_class):
    start = torch.randn(32, 48)
    runs = []
    for grads in ("e3m2", None):
        param = torch.nn.Parameter(start.clone())
        options = {"momentum": 0.9} if optimizer_class is lq.QSGD else {}
        optimizer = optimizer_class([param], lr=1e-2, min_quant_size=0, grads=grads, **options)
        for step in range(3):
            grad = step_gradient(step, start.shape)
            param.grad = grad if grads is not None else rounded(grad, "e3m2")
            optimizer.step()
        runs.append(param.detach().clone())
    assert torch.equal(*runs)


def stochastic_run(steps: int, resume_at: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """QAdamW with int8 states and e3m2 gradients, stochastic rounding; saved and loaded into a new optimizer (another
    seed) after ``resume_at`` steps. Returns the parameter and the gradients the steps used."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(40, 100))

    def build(seed: int) -> lq.QAdamW:
        generator = torch.Generator().manual_seed(seed)
        return lq.QAdamW([param], lr=1e-2, grads="e3m2", rounding="stochastic", min_quant_size=0, generator=generator)

    optimizer, used = build(1), []
    for step in range(steps):
        if step == resume_at:
            saved = optimizer.state_dict()
            optimizer = build(2)
            optimizer.load_state_dict(saved)
        param.grad = step_gradient(step, param.shape)
        optimizer.step()
        used.append(param.grad.clone())
    return param.detach().clone(), used


def test_stochastic_rounding_draws_from_the_optimizer_streams_and_resumes_exactly():
    uninterrupted, grads = stochastic_run(6)
    resumed, resumed_grads = stochastic_run(6, resume_at=3)
    assert torch.equal(uninterrupted, resumed)
    assert all(torch.equal(a, b) for a, b in zip(grads, resumed_grads, strict=True))
    exact = step_gradient(0, grads[0].shape)
    assert not torch.equal(grads[0], rounded(exact, "e3m2"))  # stochastic, not round to nearest
    assert torch.equal(grads[0], stochastic_run(1)[1][0])  # a run reproduces from its seed


def test_stochastic_rounding_is_unbiased():
    """The mean of many stochastic roundings of one gradient tends to the gradient (e2m1: a coarse grid)."""
    param = torch.nn.Parameter(torch.zeros(4096))
    optimizer = lq.QSGD([param], lr=0.0, grads="e2m1", rounding="stochastic", min_quant_size=0, generator=torch.Generator().manual_seed(3))
    grad = torch.rand(4096, generator=torch.Generator().manual_seed(4)) * 2 - 1
    total = torch.zeros(4096)
    for _ in range(200):
        param.grad = grad.clone()
        optimizer.step()
        total += param.grad
    error = (total / 200 - grad).abs().mean()
    assert error < 0.02 < (rounded(grad, "e2m1") - grad).abs().mean()


def test_param_groups_override_the_format():
    a, b, c = (torch.nn.Parameter(torch.randn(512)) for _ in range(3))
    optimizer = lq.QAdamW([{"params": [a], "grads": "int8"}, {"params": [b], "grads": None}, {"params": [c]}], grads="bf16")
    assert [group["grads"] for group in optimizer.param_groups] == ["int8", None, "bf16"]
    grads = [step_gradient(0, (512,), seed) for seed in range(3)]
    a.grad, b.grad, c.grad = (g.clone() for g in grads)
    optimizer.step()
    assert torch.equal(a.grad, rounded(grads[0], "int8"))
    assert torch.equal(b.grad, grads[1])
    assert torch.equal(c.grad, rounded(grads[2], "bf16"))
    added = torch.nn.Parameter(torch.randn(8))
    optimizer.add_param_group({"params": [added]})
    assert optimizer.param_groups[-1]["grads"] == "bf16"


def test_nonfinite_gradients_meet_the_policy_unrounded():
    """A gradient holding inf is neither rounded nor stepped (``"skip"``); a finite gradient that overflows fp16 becomes
    inf and meets the policy as any other (``"skip"``, ``"skip_step"``); ``"raise"`` raises."""
    finite, broken, large = (torch.nn.Parameter(torch.randn(300)) for _ in range(3))
    optimizer = lq.QAdamW([{"params": [finite, broken], "grads": "int8"}, {"params": [large], "grads": "fp16"}], min_quant_size=0)
    finite.grad, broken.grad, large.grad = torch.randn(300), torch.randn(300), torch.full((300,), 1e6)
    broken.grad[5] = float("inf")
    unrounded, before = broken.grad.clone(), [p.detach().clone() for p in (finite, broken, large)]
    with pytest.warns(RuntimeWarning, match="non-finite gradient in 2 parameter"):
        optimizer.step()
    assert torch.equal(broken.grad, unrounded) and torch.equal(broken, before[1])
    assert torch.isinf(large.grad).all() and torch.equal(large, before[2])
    assert not torch.equal(finite, before[0]) and optimizer.nonfinite_skips == 2
    whole_step = lq.QAdamW([{"params": [finite]}, {"params": [large], "grads": "fp16"}], nonfinite="skip_step")
    finite.grad, large.grad = torch.randn(300), torch.full((300,), 1e6)
    before = [p.detach().clone() for p in (finite, large)]
    with pytest.warns(RuntimeWarning, match="the whole step was skipped"):  # the overflow is checked like any inf
        whole_step.step()
    assert torch.equal(finite, before[0]) and torch.equal(large, before[1]) and whole_step.skipped_steps == 1
    strict = lq.QAdamW([finite], grads="int8", nonfinite="raise")
    finite.grad = torch.full((300,), float("nan"))
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        strict.step()


def test_invalid_formats_are_refused_naming_the_option():
    params = [torch.nn.Parameter(torch.randn(8))]
    with pytest.raises(ValueError, match=r"^QAdamW: grads='int9': unknown format 'int9'; valid formats: fp32, bf16"):
        lq.QAdamW(params, grads="int9")
    with pytest.raises(TypeError, match=r"^QSGD: grads= must be a format name .* or None, got dtype"):
        lq.QSGD(params, grads=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^QMuon: grads='e9m2': format 'e9m2' is not supported"):
        lq.QMuon([torch.nn.Parameter(torch.randn(4, 4))], grads="e9m2")
    with pytest.raises(ValueError, match=r"^QAdam: grads='fp7'"):
        lq.QAdam([{"params": params, "grads": "fp7"}])
    with pytest.raises(ValueError, match=r"^quantize_optimizer: grads='int9'"):
        lq.quantize_optimizer(torch.optim.SGD(params), grads="int9")
    with pytest.raises(ValueError, match=r"^QuantizationPolicy: grads='bf8'"):
        QuantizationPolicy(grads="bf8")


def test_policy_and_converted_optimizers_carry_the_format():
    """``QuantizationPolicy.apply`` converts torch's AdamW in place and wraps Adagrad: both round the gradients they step."""
    converted, wrapped = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 64))
    adamw = QuantizationPolicy(grads="fp8_e4m3", min_quant_size=0).apply(torch.optim.AdamW([converted], lr=1e-2))
    adagrad = lq.quantize_optimizer(torch.optim.Adagrad([wrapped], lr=1e-2), grads="bf16", min_quant_size=0)
    assert isinstance(adamw, lq.QAdamW) and isinstance(adagrad, lq.QuantizedOptimizerWrapper)
    for step in range(3):
        grad = step_gradient(step, (64, 64))
        converted.grad, wrapped.grad = grad.clone(), grad.clone()
        adamw.step()
        adagrad.step()
        assert torch.equal(converted.grad, rounded(grad, "fp8_e4m3")) and torch.equal(wrapped.grad, rounded(grad, "bf16"))
    assert float(adagrad.state[wrapped]["sum"].dequantize().max()) > 0  # the inner step ran


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
def test_lightning_entry_points_pass_the_format_on(tmp_path):
    pytest.importorskip("lightning")
    from lightning_qstate.callbacks import QuantizedOptimizerStates
    from lightning_qstate.plugins import QStatePrecision

    from lightning_models import Regressor, quiet_trainer, regression_data

    entry_points = {"bf16": {"plugins": [QStatePrecision(grads="bf16", min_quant_size=0)]},
                    "fp16": {"callbacks": [QuantizedOptimizerStates(grads="fp16", min_quant_size=0)]}}  # fmt: skip
    for name, options in entry_points.items():
        model = Regressor(scheduler=False)
        trainer = quiet_trainer(tmp_path, max_steps=2, **options)
        trainer.fit(model, regression_data())
        assert all(group["grads"] == name for group in trainer.strategy.optimizers[0].param_groups)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[name]
        for param in model.parameters():  # the last step's gradients, as the optimizer rounded them
            assert torch.equal(param.grad, param.grad.to(dtype).float())
    with pytest.raises(ValueError, match=r"^QStatePrecision: grads='int9'"):
        QStatePrecision(grads="int9")
    with pytest.raises(ValueError, match=r"^QuantizedOptimizerStates: grads='int9'"):
        QuantizedOptimizerStates(grads="int9")
