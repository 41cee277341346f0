"""The torch definition of the quantized Adam(W) step (``kernels.adam_reference``) against exact arithmetic and torch's AdamW.

``kernels.adam_reference.adam_math`` rounds every operation once, in the order of torch's CPU kernels (its rounding contract, in the
module docstring of ``kernels/adam_reference.py``), so that the eager step, the compiled step and the Triton kernel agree bit
for bit on any CPU. Checked here: ``fma`` and ``sqrt_rn`` round once (against rational arithmetic and
IEEE ``sqrt``); ``adam_hyper`` rounds torch's float64 coefficients to fp32 once; ``adam_math``, the compiled step
and the per-parameter path give torch's AdamW moments bit for bit, and its parameter bit for bit once torch's
``sqrt`` is correctly rounded (on the CPU it is MKL's, within 1 ulp, CPU-dependent: the one operation that differs).
"""

from __future__ import annotations

import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch

from lightning_qstate import QAdam, QAdamW
from lightning_qstate.formats import get_format
from lightning_qstate.kernels import TRITON_AVAILABLE, adam_reference, dispatch
from lightning_qstate.kernels.adam_reference import adam_hyper, adam_math, fma, sqrt_rn
from lightning_qstate.kernels.bounds import moment_bound
from lightning_qstate.optim import optimizers

FP32 = get_format("fp32")


def float32_nearest(value: Fraction) -> float:
    """``value`` rounded to the nearest fp32, ties to even."""
    guess = np.float32(float(value))  # within an ulp: float() rounds to float64 first
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return float(min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(np.float32(c).view(np.int32)) & 1)))


def torch_rounds_once() -> bool:
    """Whether torch's CPU ``add(alpha=)``, ``addcmul_`` and ``lerp_`` round ``a * b + c`` once (ATen capabilities AVX2
    and AVX512 fuse them; DEFAULT, on CPUs without FMA, rounds the product first). 33 values: vector body and tail.

    ``(1 + 2**-12)**2 = 1 + 2**-11 + 2**-24``: rounded alone it ties to ``1 + 2**-11``, so ``- 1`` gives ``2**-11``
    instead of ``2**-11 + 2**-24``.
    """
    full = lambda value: torch.full((33,), value)  # noqa: E731
    a, exact = 1 + 2**-12, 2**-11 + 2**-24
    return (
        bool((full(-1.0).add(full(a), alpha=a) == exact).all())
        and bool((full(-1.0).addcmul_(full(a), full(a)) == exact).all())
        and bool((full(-0.25).lerp_(full(0.75 + 2**-12), a / 4) == exact / 4).all())
    )


def correctly_rounded_torch_sqrt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch's optimizers take a correctly rounded ``sqrt`` (single- and multi-tensor)."""
    monkeypatch.setattr(torch.Tensor, "sqrt", lambda self: torch.sqrt(self.double()).float())
    monkeypatch.setattr(torch, "_foreach_sqrt", lambda tensors: [torch.sqrt(t.double()).float() for t in tensors])


def test_fma_rounds_once():
    generator = torch.Generator().manual_seed(0)
    binades = lambda: torch.exp2(torch.randint(-40, 40, (3000,), generator=generator).float())  # noqa: E731
    a, b, c = (torch.randn(3000, generator=generator) * binades() for _ in range(3))
    exact = torch.tensor(
        [float32_nearest(Fraction(x) * Fraction(y) + Fraction(z)) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist(), strict=False)]
    )
    assert torch.equal(fma(a, b, c), exact)
    # The float64 shortcut rounds twice: (1 + 2**-23) + 2**-24 - 2**-70 is the tie 1 + 2**-23 + 2**-24 in float64,
    # which rounds to 1 + 2**-22 in fp32; rounded once it is 1 + 2**-23.
    x, y, z = torch.tensor([1 + 2**-23]), torch.tensor([(1 - 2**-23) * 2**-24]), torch.tensor([1 + 2**-23])
    assert float(fma(x, y, z)) == 1 + 2**-23 and float((x.double() * y.double() + z.double()).float()) == 1 + 2**-22
    signs = fma(torch.tensor([0.0, -0.0, 3.0]), torch.zeros(3), torch.full((3,), -0.0))
    assert signs.tolist() == [0.0, 0.0, 0.0] and signs.signbit().tolist() == [False, True, False]  # as IEEE fma
    special = fma(torch.tensor([float("inf"), float("nan")]), torch.ones(2), torch.ones(2))
    assert float(special[0]) == float("inf") and bool(special[1].isnan())


def test_sqrt_rn_is_correctly_rounded():
    """Against IEEE fp32 ``sqrt`` (numpy's: the instruction, correctly rounded on every x86-64 CPU), over every binade
    from the subnormals up (torch's CPU ``sqrt``, MKL's, gives 17 % of these 1 ulp off on an AMD EPYC)."""
    generator = torch.Generator().manual_seed(0)
    bits = torch.randint(1, 0x7F800000, (200_000,), generator=generator, dtype=torch.int32)
    ends = [0.0, 1e-45, 2.0**-126, 1.0, 4.0, float(np.finfo(np.float32).max), float("inf")]
    x = torch.cat([bits.view(torch.float32), torch.tensor(ends)])
    assert torch.equal(sqrt_rn(x), torch.from_numpy(np.sqrt(x.numpy())))


@pytest.mark.parametrize("betas", [(0.9, 0.999), (0.3, 0.99)])
def test_adam_hyper_rounds_torch_double_values_once(betas):
    """torch's AdamW computes ``1 - beta2`` (``addcmul_``'s value), ``1 - beta1`` (``lerp_``'s weight) and the rest in
    Python floats and rounds them to fp32 in the op; ``1 - fp32(0.999)`` would be ~110 ulps off."""
    group = {"lr": 3e-3, "betas": betas, "weight_decay": 0.1, "eps": 1e-8, "decoupled_weight_decay": True}
    beta1, beta2 = betas
    hyper = adam_hyper(group, 7.0)
    expected = {
        "decay": 1 - 3e-3 * 0.1, "weight_decay": 0.1, "lerp_weight": 1 - beta1, "beta2": beta2, "square_weight": 1 - beta2,
        "eps": 1e-8, "step_size": 3e-3 / (1 - beta1**7.0), "bias_correction2_sqrt": (1 - beta2**7.0) ** 0.5,
        "moment_bound": moment_bound(beta1, beta2, 7),  # the moments after step 7 (an fp32 value already)
        "eco_coefficient": (1 - beta1**7.0) / 3e-3 * (1 - 1 / beta1) * (1 - 3e-3 * 0.1),  # ECO's, with (1 - lr * wd)
    }  # fmt: skip
    assert {name: float(value) for name, value in hyper.items()} == {name: float(np.float32(value)) for name, value in expected.items()}
    assert all(value.dtype == torch.float32 and value.dim() == 0 for value in hyper.values())
    if TRITON_AVAILABLE:
        from lightning_qstate.kernels.triton_adam import COEFFICIENTS

        assert set(hyper) == set(COEFFICIENTS)
    if betas == (0.9, 0.999):
        fp32_difference = 1 - torch.tensor(0.999)
        ulps = int(hyper["square_weight"].view(torch.int32)) - int(fp32_difference.view(torch.int32))
        assert 100 < ulps < 120


ADAM_CASES = [
    pytest.param(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, id="adamw"),
    pytest.param(torch.optim.Adam, {"lr": 1e-3, "weight_decay": 0.1, "maximize": True}, id="adam-l2-maximize"),
    pytest.param(torch.optim.AdamW, {"lr": 3e-2, "betas": (0.3, 0.99), "eps": 1e-6}, id="adamw-large-lerp-weight"),
]


@pytest.mark.skipif(not torch_rounds_once(), reason="torch's CPU kernels round a * b + c twice here (ATen capability DEFAULT, no FMA)")
@pytest.mark.parametrize("foreach", [False, True], ids=["single-tensor", "multi-tensor"])
@pytest.mark.parametrize(("torch_class", "options"), ADAM_CASES)
def test_adam_math_matches_torch(torch_class, options, foreach, monkeypatch):
    """``adam_math`` with ``adam_hyper`` gives torch's moments bit for bit, and its parameter with a correctly rounded
    ``sqrt``, step after step (1000 values: vector bodies and tails)."""
    correctly_rounded_torch_sqrt(monkeypatch)
    generator = torch.Generator().manual_seed(0)
    reference = torch.nn.Parameter(torch.randn(1000, generator=generator))
    optimizer = torch_class([reference], foreach=foreach, **options)
    group = optimizer.param_groups[0]
    param, exp_avg, exp_avg_sq = reference.detach().clone(), torch.zeros(1000), torch.zeros(1000)
    for step in range(1, 5):
        reference.grad = torch.randn(1000, generator=generator) * torch.exp(torch.randn(1000, generator=generator)) * 1e-2
        optimizer.step()
        hyper = adam_hyper(group, float(step))
        param = adam_math(param, reference.grad, exp_avg, exp_avg_sq, hyper, group["decoupled_weight_decay"], group["maximize"])
        state = optimizer.state[reference]
        assert torch.equal(exp_avg, state["exp_avg"]) and torch.equal(exp_avg_sq, state["exp_avg_sq"]), f"step {step}: moments differ"
        assert torch.equal(param, reference.detach()), f"step {step}: parameters differ"


@pytest.mark.parametrize("foreach", [False, True], ids=["single-tensor", "multi-tensor"])
def test_fp32_states_are_torch_adamw(foreach):
    """``states="fp32"``: QAdamW is torch's AdamW, bit for bit (moments and parameter)."""
    generator = torch.Generator().manual_seed(1)
    weights = [torch.nn.Parameter(torch.randn(300, generator=generator)) for _ in range(2)]
    references = [torch.nn.Parameter(w.detach().clone()) for w in weights]
    optimizer = QAdamW(weights, lr=1e-2, weight_decay=0.1, states="fp32", foreach=foreach)
    reference = torch.optim.AdamW(references, lr=1e-2, weight_decay=0.1, foreach=foreach)
    for _ in range(3):
        for w, r in zip(weights, references, strict=False):
            w.grad = torch.randn(300, generator=generator) * 1e-2
            r.grad = w.grad.clone()
        optimizer.step()
        reference.step()
        for w, r in zip(weights, references, strict=False):
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(optimizer.state[w][name], reference.state[r][name]), name
            assert torch.equal(w, r)


def lossless_quantized_states(optimizer: torch.optim.Optimizer, weight: torch.Tensor) -> None:
    """Give ``weight`` quantized moments in the lossless ``fp32`` cast format (the policy keeps fp32 states plain)."""
    zeros = lambda: FP32.quantize(torch.zeros(weight.numel()))  # noqa: E731
    optimizer.state[weight] = {"step": torch.tensor(0.0), "exp_avg": zeros(), "exp_avg_sq": zeros()}


def noisy_gradient(numel: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(numel, generator=generator) * torch.exp(torch.randn(numel, generator=generator)) * 1e-2


COMPILED_CASES = [
    pytest.param(QAdamW, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}, id="adamw"),
    pytest.param(QAdam, torch.optim.Adam, {"lr": 1e-3, "betas": (0.3, 0.99), "weight_decay": 0.1, "maximize": True}, id="adam-l2-maximize"),
]


@pytest.mark.parametrize(("ours", "theirs", "options"), COMPILED_CASES)
def test_compiled_step_matches_eager_and_torch(ours, theirs, options, monkeypatch):
    """The compiled step (``fused_adam_step``: whole 256-value rows compiled, the last 77 values eager) with lossless
    quantized moments: the eager reference ``adam_step_quantized`` bit for bit on any CPU, and torch's moments bit for
    bit, its parameter with a correctly rounded ``sqrt`` too, where torch rounds ``a * b + c`` once."""
    numel = dispatch.FUSED_MIN_NUMEL + 77
    generator = torch.Generator().manual_seed(2)
    weight = torch.nn.Parameter(torch.randn(numel, generator=generator))
    optimizer = ours([weight], **options)
    lossless_quantized_states(optimizer, weight)
    reference = torch.nn.Parameter(weight.detach().clone())
    torch_optimizer = theirs([reference], foreach=False, **options)
    group = optimizer.param_groups[0]
    eager_param, eager_m, eager_v = weight.detach().clone(), torch.zeros(numel), torch.zeros(numel)
    exact_torch = torch_rounds_once()
    calls = []
    monkeypatch.setattr(optimizers, "fused_adam_step", lambda *args: calls.append(1) or dispatch.fused_adam_step(*args))
    monkeypatch.setattr(dispatch, "native_kernel_available", lambda: False)  # fp32 states would take the C++ step
    for step in range(1, 4):
        weight.grad = noisy_gradient(numel, generator)
        reference.grad = weight.grad.clone()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a failed compile would fall back to the eager step with a warning
            optimizer.step()
        flags = ("nearest", group["decoupled_weight_decay"], group["maximize"], False)  # rounding, ..., track_stalls
        hyper = adam_hyper(group, float(step))
        adam_reference.adam_step_quantized(eager_param, weight.grad, eager_m, None, eager_v, None, hyper, FP32, FP32, *flags)
        state = optimizer.state[weight]
        assert torch.equal(weight.detach(), eager_param), f"step {step}: compiled and eager parameters differ"
        assert torch.equal(state["exp_avg"].dequantize(), eager_m) and torch.equal(state["exp_avg_sq"].dequantize(), eager_v)
        with monkeypatch.context() as patch:
            correctly_rounded_torch_sqrt(patch)
            torch_optimizer.step()
        if exact_torch:
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[name].dequantize(), torch_optimizer.state[reference][name]), f"step {step}: {name} differs"
            assert torch.equal(weight, reference), f"step {step}: parameters differ"
    assert len(calls) == 3


def test_per_parameter_path_keeps_torch_exp_avg_sq():
    """The per-parameter path (decode, torch's AdamW on the decoded moments, store) with lossless quantized moments gives
    torch's ``exp_avg_sq`` bit for bit (``exp_avg`` first passes the clamp of ``_AdamStates._update``)."""
    numel = dispatch.FUSED_MIN_NUMEL + 77
    generator = torch.Generator().manual_seed(3)
    weight = torch.nn.Parameter(torch.randn(numel, generator=generator))
    optimizer = QAdamW([weight], lr=1e-2, weight_decay=0.1)
    optimizer.cpu_compile = False
    lossless_quantized_states(optimizer, weight)
    reference = torch.nn.Parameter(weight.detach().clone())
    torch_optimizer = torch.optim.AdamW([reference], lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(1, 4):
        weight.grad = noisy_gradient(numel, generator)
        reference.grad = weight.grad.clone()
        optimizer.step()
        torch_optimizer.step()
        expected = torch_optimizer.state[reference]["exp_avg_sq"]
        assert torch.equal(optimizer.state[weight]["exp_avg_sq"].dequantize(), expected), f"step {step}: exp_avg_sq differs"


def test_the_hold_keeps_exact_moments_of_any_magnitude():
    """The first update's moments (``|m| = K_1 sqrt(v)`` exactly, Adam's equality case) are kept by ``hold_moment`` for
    gradients from fp32's least subnormal to its largest: where ``g²`` underflows, the root's floor ``2^-63`` keeps
    ``m`` (it had been held to 0); where it overflows, the infinite root keeps it."""
    magnitudes = torch.exp2(torch.arange(-149.0, 128.0))
    for betas in ((0.0, 0.0), (0.9, 0.999)):
        group = {"lr": 1e-3, "betas": betas, "weight_decay": 0.0, "eps": 1e-8, "decoupled_weight_decay": True}
        hyper = adam_hyper(group, 1.0)
        for grad in (magnitudes, -magnitudes * 1.7):
            m, v = torch.zeros_like(grad), torch.zeros_like(grad)
            adam_math(torch.zeros_like(grad), grad, m, v, hyper, True, False)
            expected = fma(hyper["lerp_weight"], grad, torch.zeros_like(grad))  # the lerp from 0, never held
            assert torch.equal(m, expected), betas
