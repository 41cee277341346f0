"""Training without master weights (``weights=``, ``error_feedback=``; ``optim/weights.py``, ECO arXiv 2601.22101).

The closed forms of ``docs/algorithms.md`` (f(x) = (L/2) x², the quantizer as additive noise), ``eco_exact`` against
master-weight SGD-momentum bit for bit, the paper's exact injection, ECO's Adam rule on one step, a regression where
ECO closes naive removal's gap, the options' validation and the checkpoint round trip.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from test_adam_reference import correctly_rounded_torch_sqrt, torch_rounds_once

import lightning_qstate as lq
from lightning_qstate.arguments import ConfigurationError
from lightning_qstate.formats import get_format
from lightning_qstate.formats.weights import WeightGrid, get_weight_grid
from lightning_qstate.kernels import dispatch
from lightning_qstate.kernels.bounds import MOMENT_BOUND_STATE
from lightning_qstate.optim import ERROR_STATE, FEEDBACK_STALLS, QuantizationPolicy, block_linear_weight_names

L, BETA, LR, SIGMA = 1.0, 0.9, 0.05, 0.01


class NoiseGrid(WeightGrid):
    """The closed forms' quantizer: ``x + σ·N(0, 1)`` (zero-mean, variance σ²), drawn from the optimizer's stream."""

    def round(self, values, rounding, generator=None):
        return values + SIGMA * torch.randn(values.shape, generator=generator)


def stationary_square(feedback: str | None, master: bool = False, numel: int = 50_000, steps: int = 1500) -> float:
    """E[x̂²] of SGD-momentum in EMA form (``dampening = momentum``) on f = (L/2) x², averaged over the last half."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.zeros(numel))
    options = {"lr": LR, "momentum": BETA, "dampening": BETA}
    if master:
        optimizer = torch.optim.SGD([param], **options)
    else:
        optimizer = lq.QSGD(
            [param], **options, states="fp32", error_feedback=feedback, weights="fp32", generator=torch.Generator().manual_seed(1)
        )
        optimizer.weight_grid = lambda group, key, p=None: NoiseGrid(get_format("fp32"))
    total, count = 0.0, 0
    for step in range(steps):
        stored = param.detach() + SIGMA * torch.randn(numel) if master else param.detach()
        param.grad = L * stored
        optimizer.step()
        if step >= steps // 2:
            total, count = total + float(stored.square().mean()), count + 1
    return total / count


def test_closed_forms_of_the_quadratic():
    """Master weights, naive removal and ECO against their stationary E[x̂²] (1.0250e-4, 1.4756e-3, 5.2701e-4)."""
    u = L * LR * SIGMA**2 * (1 + BETA) / (2 * (1 + BETA) - L * LR * (1 - BETA))
    expected = {
        "master": u + SIGMA**2,
        "naive": SIGMA**2 * ((1 - BETA**2) + 2 * BETA * L * LR) / (L * LR * (2 * (1 - BETA**2) - L * LR * (1 - BETA) ** 2)),
        "eco": 2 * SIGMA**2 / (2 * (1 - BETA**2) - L * LR * (1 - BETA) ** 2),
    }
    assert [float(f"{expected[k]:.4e}") for k in ("master", "naive", "eco")] == [1.0250e-4, 1.4756e-3, 5.2701e-4]
    measured = {"master": stationary_square(None, master=True), "naive": stationary_square(None), "eco": stationary_square("eco")}
    for name, value in measured.items():
        assert value == pytest.approx(expected[name], rel=0.03), (name, value, expected[name])


def regression(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(256, 64, generator=generator)
    return inputs, inputs @ torch.randn(64, 8, generator=generator)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_eco_exact_is_master_weight_sgd_momentum(rounding):
    """``eco_exact`` on bf16 weights gives, at every step, the bf16 rounding of master-weight SGD-momentum's fp32 iterate
    whose gradients are taken at that rounding (the same random draws for SR): bit for bit."""
    inputs, targets = regression(0)
    start = (torch.randn(64, 8, generator=torch.Generator().manual_seed(1)) * 0.1).bfloat16()
    master = torch.nn.Parameter(start.float())
    stored = torch.nn.Parameter(start.clone())
    reference = torch.optim.SGD([master], lr=0.02, momentum=0.9)
    options = {"states": "fp32", "weights": "bf16", "weight_rounding": rounding, "error_feedback": "eco_exact"}
    optimizer = lq.QSGD([stored], lr=0.02, momentum=0.9, **options)
    bf16 = get_format("bf16")
    forward = master.detach().bfloat16()  # the initial weights are on the bf16 grid in both runs
    for _ in range(30):
        assert torch.equal(stored.detach(), forward)
        generator = optimizer.rounding_generator(stored, "weights", torch.device("cpu")) if rounding == "stochastic" else None
        grad = (inputs.T @ (inputs @ stored.detach().float() - targets) / len(inputs)).bfloat16()  # at the common weights
        master.grad, stored.grad = grad.float(), grad
        reference.step()
        optimizer.step()
        forward = bf16.round_saturated(master.detach().reshape(-1), rounding, generator).view(master.shape)
    assert torch.equal(stored.detach(), forward)
    assert optimizer.state[stored][ERROR_STATE].dtype == torch.float32


def test_eco_exact_matches_the_papers_injection_at_a_fixed_lr():
    """The paper's exact variant (inject ``(1/η) e_t − (1/(ηβ)) e_{t+1}`` into the momentum) gives the same weights as
    ``eco_exact`` (error added back to the weight), but for float rounding."""
    inputs, targets = regression(2)
    start = (torch.randn(64, 8, generator=torch.Generator().manual_seed(3)) * 0.1).bfloat16()
    ours = torch.nn.Parameter(start.clone())
    optimizer = lq.QSGD([ours], lr=0.02, momentum=0.9, states="fp32", weights="bf16", weight_rounding="nearest", error_feedback="eco_exact")
    weights, momentum, previous_error = start.float(), torch.zeros(64, 8), torch.zeros(64, 8)
    for _ in range(40):
        ours.grad = (inputs.T @ (inputs @ ours.detach().float() - targets) / len(inputs)).bfloat16()
        optimizer.step()
        grad = inputs.T @ (inputs @ weights - targets) / len(inputs)
        momentum = 0.9 * momentum + grad.bfloat16().float()
        updated = weights - 0.02 * momentum
        weights = updated.bfloat16().float()
        error = updated - weights
        momentum = momentum + previous_error / 0.02 - error / (0.02 * 0.9)
        previous_error = error
    differs = ours.detach().float() != weights
    assert differs.float().mean() < 0.02
    assert torch.allclose(ours.detach().float(), weights, rtol=2**-7, atol=0)


@pytest.mark.parametrize("decoupled", [True, False])
def test_eco_adam_rule_on_one_step(decoupled):
    """ECO's Adam(W) rule: ``m = m̃ + ((1−β1^t)/η)(1 − 1/β1)(sqrt(v̂) + eps)(1 − ηλ if decoupled)·e``, ``v`` untouched."""
    torch.manual_seed(0)
    start = torch.randn(4096).bfloat16()
    grad = torch.randn(4096).bfloat16()
    eco = torch.nn.Parameter(start.clone())
    twin = torch.nn.Parameter(start.float())
    options = {"lr": 0.01, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.1, "decoupled_weight_decay": decoupled, "states": "fp32"}
    optimizer = lq.QAdam([eco], **options, weights="bf16", weight_rounding="nearest", error_feedback="eco")
    optimizer.cpu_compile = False
    reference = torch.optim.Adam([twin], **{k: v for k, v in options.items() if k != "states"})
    eco.grad, twin.grad = grad, grad.float()
    optimizer.step()
    reference.step()
    updated = twin.detach()
    assert torch.equal(eco.detach(), updated.bfloat16())
    error = updated - updated.bfloat16().float()
    m, v = reference.state[twin]["exp_avg"], reference.state[twin]["exp_avg_sq"]
    coefficient = (1 - 0.8) / 0.01 * (1 - 1 / 0.8) * ((1 - 0.01 * 0.1) if decoupled else 1)
    expected = m + coefficient * (v.sqrt() / math.sqrt(1 - 0.99) + 1e-6) * error
    state = optimizer.state[eco]  # plain states under a weight grid are fp32
    assert torch.allclose(state["exp_avg"], expected, rtol=1e-5, atol=1e-9) and not torch.equal(state["exp_avg"], m)
    assert torch.equal(state["exp_avg_sq"], v)


def final_loss(feedback: str | None, seed: int, master: bool = False) -> float:
    """A least-squares fit with FP8 E4M3 row-wise weights (round to nearest), SGD-momentum, 300 steps at a small LR."""
    inputs, targets = regression(seed)
    param = torch.nn.Parameter(torch.randn(64, 8, generator=torch.Generator().manual_seed(seed + 100)) * 0.1)
    options = {"lr": 0.003, "momentum": 0.9}
    if master:
        optimizer = torch.optim.SGD([param], **options)
    else:
        optimizer = lq.QSGD([param], **options, states="fp32", weights="fp8_e4m3", weight_rounding="nearest", error_feedback=feedback)
    grid = get_weight_grid("fp8_e4m3")
    for _ in range(300):
        weights = grid.round(param.detach(), "nearest") if master else param.detach()
        param.grad = inputs.T @ (inputs @ weights - targets) / len(inputs)
        optimizer.step()
    weights = grid.round(param.detach(), "nearest")
    return float(((inputs @ weights - targets) ** 2).mean())


def test_eco_closes_most_of_naive_removals_gap():
    """Master weights < ECO << naive removal on a regression with FP8 weights (3 seeds, means)."""
    losses = {name: sum(final_loss(fb, seed, master) for seed in range(3)) / 3 for name, fb, master in [
        ("master", None, True), ("naive", None, False), ("eco", "eco", False)]}  # fmt: skip
    gap = losses["naive"] - losses["master"]
    assert gap > 0.1 * losses["master"], losses
    assert losses["naive"] - losses["eco"] > 0.75 * gap, losses


def test_weights_stay_on_their_grid_and_nothing_fp32_is_kept():
    """Row-wise FP8 weights on fp32 parameters: grid values after each step; ``eco`` keeps no fp32 buffer, ``eco_exact`` one."""
    torch.manual_seed(0)
    for feedback, extra in (("eco", set()), ("eco_exact", {ERROR_STATE}), (None, set())):
        param = torch.nn.Parameter(torch.randn(32, 48))
        optimizer = lq.QAdamW([param], weights="fp8_e4m3", error_feedback=feedback, min_quant_size=0)
        grid = optimizer.weight_grid(optimizer.param_groups[0], param)
        for _ in range(3):
            param.grad = torch.randn_like(param)
            optimizer.step()
            assert torch.equal(grid.round(param.detach(), "nearest"), param.detach())
        assert set(optimizer.state[param]) == {"step", "exp_avg", "exp_avg_sq", MOMENT_BOUND_STATE} | extra  # K_n², 0-d float64
        rows = param.detach().abs().amax(dim=1)
        assert torch.equal(((param.detach() / rows[:, None]) * 448).abs().amax(dim=1), torch.full((32,), 448.0))


def test_feedback_stalls_are_counted():
    """With int8 ``m`` and round to nearest, ECO's small corrections are often lost: counted as ``eco_correction``, on
    the native path (from the update run again on copies) as the reference path counts them in its step, and the
    moments' and weights' stall counts of the two paths agree too."""
    counts = []
    for native in (True, False):
        param = torch.nn.Parameter(torch.randn(8192, generator=torch.Generator().manual_seed(0)).bfloat16())
        warning = r"QAdamW: error_feedback='eco' feeds .* into 'exp_avg', stored in 'int8' with rounding='nearest'"
        with pytest.warns(UserWarning, match=warning):
            optimizer = lq.QAdamW([param], lr=1e-3, weights="bf16", weight_rounding="nearest", error_feedback="eco", track_stalls=True)
        optimizer.cpu_compile, optimizer.track_weight_stalls = native, True  # lr 1e-3: 312 of 40960 lost (1e-4: none)
        for step in range(5):
            param.grad = torch.randn(8192, generator=torch.Generator().manual_seed(step + 1)).bfloat16()
            optimizer.step()
        assert optimizer.step_paths() == {"param0": "native" if native else "reference"}
        counts.append({name: c.tolist() for name, c in optimizer.stall_counts()[param].items()})
    assert counts[0] == counts[1] and set(counts[0]) == {"exp_avg", "exp_avg_sq", "eco_correction", "weights"}
    stalled, moved = counts[0]["eco_correction"]
    assert 0 < stalled <= moved


@pytest.mark.parametrize("cpu_compile", [True, False], ids=["native", "reference"])
def test_a_tracked_eco_step_whose_moment_overflows_raises_floating_point_error(cpu_compile):
    """Counting ECO's lost corrections quantizes the corrected ``m``: where it overflowed, the reference path raised the
    format's ``NonFiniteError`` (a ``ValueError``) from the count instead of the step's ``FloatingPointError``."""
    param = torch.nn.Parameter(torch.linspace(-1, 1, 256))
    with pytest.warns(UserWarning, match="error_feedback='eco'"):
        opt = lq.QAdamW([param], states="int8", min_quant_size=0, weights="bf16", error_feedback="eco", track_stalls=True)
    opt.cpu_compile = cpu_compile
    param.grad = torch.full((256,), 1e30)  # v = 1e-3 g² overflows fp32
    with pytest.raises(FloatingPointError, match="overflowed"):
        opt.step()
    assert FEEDBACK_STALLS not in opt.stall_counts().get(param, {})


def test_eco_warns_only_where_nearest_storage_drops_its_corrections():
    """The warning names the momentum state and its format, at the user's line; stochastic rounding, an fp32 momentum and
    eco_exact (its error stays in an fp32 state) do not warn."""
    param = torch.nn.Parameter(torch.zeros(64))
    with pytest.warns(UserWarning, match=r"QSGD: error_feedback='eco' .* into 'momentum_buffer', stored in 'bf16'") as caught:
        lq.QSGD([param], lr=0.1, momentum=0.9, states="bf16", weights="bf16", error_feedback="eco")
    assert caught[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lq.QAdamW([param], states="int8", rounding="stochastic", weights="bf16", error_feedback="eco")
        lq.QAdamW([param], states={"exp_avg_sq": "int8"}, weights="bf16", error_feedback="eco")
        lq.QAdamW([param], states="int8", weights="bf16", error_feedback="eco_exact")


@pytest.mark.skipif(not torch_rounds_once(), reason="torch's CPU kernels round a * b + c twice here: the reference path is not adam_math")
def test_compiled_path_is_the_reference_bit_for_bit(monkeypatch):
    """The compiled CPU step (the C++ kernel made unavailable) with bf16 weights and ECO (round to nearest, int4
    moments) gives the reference path's bits, on any CPU whose torch kernels fuse ``a * b + c`` once: the reference path
    runs torch's Adam, so its ``sqrt`` is made correctly rounded, as ``adam_math``'s (MKL's last bit depends on the CPU)."""
    monkeypatch.setattr(dispatch, "FUSED_MIN_NUMEL", 1024)
    monkeypatch.setattr(dispatch, "native_kernel_available", lambda: False)
    results = []
    for compile_cpu in (True, False):
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(40, 77).bfloat16())
        optimizer = lq.QAdamW([param], weights="bf16", weight_rounding="nearest", error_feedback="eco", min_quant_size=0, states="int4")
        optimizer.cpu_compile = compile_cpu
        with monkeypatch.context() as patch:
            if not compile_cpu:
                correctly_rounded_torch_sqrt(patch)
            for _ in range(3):
                param.grad = torch.randn_like(param)
                optimizer.step()
        expected_path = "compiled" if compile_cpu else "reference"
        assert optimizer.step_paths() == {"param0": expected_path}
        results.append([param.detach().clone(), *(optimizer.state[param][n].codes.clone() for n in ("exp_avg", "exp_avg_sq"))])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("feedback", ["eco", "eco_exact"])
def test_resume_is_exact(feedback):
    """Four steps straight equal two, a state-dict round trip into a new optimizer, and two more (SR weights)."""

    def run(split: bool) -> tuple[torch.Tensor, dict]:
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(64, 96).bfloat16())
        grads = [torch.randn(64, 96).bfloat16() for _ in range(4)]
        options = {"weights": "bf16", "error_feedback": feedback, "min_quant_size": 0, "generator": torch.Generator().manual_seed(5)}
        optimizer = lq.QAdamW([param], **options)
        for step, grad in enumerate(grads):
            if split and step == 2:
                saved = optimizer.state_dict()
                optimizer = lq.QAdamW([param], **{**options, "generator": torch.Generator().manual_seed(9)})
                optimizer.load_state_dict(saved)
            param.grad = grad
            optimizer.step()
        return param.detach().clone(), optimizer.state_dict()["state"][0]

    (straight, state), (resumed, resumed_state) = run(False), run(True)
    assert torch.equal(straight, resumed)
    if feedback == "eco_exact":
        assert torch.equal(state[ERROR_STATE], resumed_state[ERROR_STATE])


def test_muon_takes_eco_exact():
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
    optimizer = lq.QMuon([param], weights="bf16", error_feedback="eco_exact", min_quant_size=0)
    param.grad = torch.randn_like(param)
    optimizer.step()
    assert optimizer.state[param][ERROR_STATE].shape == param.shape


def test_wrong_weight_options_raise():
    param = torch.nn.Parameter(torch.randn(8, 8))
    cases = [
        (lambda: lq.QAdamW([param], weights="fp7"), ValueError, r"QAdamW: weights='fp7': unknown format"),
        (lambda: lq.QAdamW([param], weights="int8", weight_block=100), ValueError, r"weight_block=100 is not valid"),
        (lambda: lq.QAdamW([param], weights="int8", weight_block="rows"), ValueError, r"weight_block='rows' is not valid"),
        (lambda: lq.QAdamW([param], weight_rounding="up"), ValueError, r"weight_rounding='up' is not valid"),
        (lambda: lq.QAdamW([param], error_feedback="kahan"), ValueError, r"error_feedback='kahan' is not valid"),
        (lambda: lq.QAdam([param], betas=(0.0, 0.9), error_feedback="eco"), ValueError, r"betas\[0\]=0"),
        (lambda: lq.QSGD([param], error_feedback="eco"), ValueError, r"set momentum > 0"),
        (lambda: lq.QMuon([param], error_feedback="eco"), ValueError, r"QMuon: error_feedback='eco' is not supported here"),
        (lambda: lq.quantize_optimizer(torch.optim.RMSprop([param]), weights="bf16"), ValueError, r"weights= and error_feedback= need"),
        (lambda: QuantizationPolicy(weight_overrides={"*": "fp9"}), ValueError, r"weight_overrides\['\*'\]: weights='fp9'"),
        (lambda: lq.QAdamW([param], weights=""), ValueError, r"QAdamW: weights='' is not a format"),
        (lambda: QuantizationPolicy(weight_overrides={"*": ""}), ValueError, r"weight_overrides\['\*'\]: weights='' is not a format"),
        # a grid the parameter's dtype cannot hold: every update would be rounded to nearest on the way back
        (lambda: lq.QAdamW([torch.nn.Parameter(param.bfloat16())], weights="fp32"), ValueError, r"shape \(8, 8\): weights='fp32' needs"),
        (lambda: lq.QSGD([torch.nn.Parameter(param.bfloat16())], momentum=0.9, weights="fp16"), ValueError, r"torch.bfloat16 parameter"),
        (lambda: lq.QAdamW([torch.nn.Parameter(param.half())], weights="bf16"), ValueError, r"use weights='fp16'"),
        (lambda: lq.QAdamW([torch.nn.Parameter(param.double())], error_feedback="eco"), TypeError, r"QAdamW: .*error_feedback needs"),
    ]
    for build, error, message in cases:
        with pytest.raises(error, match=message):
            build()


def test_apply_keeps_the_papers_selection():
    """``policy.apply(optimizer, module)`` with ``weights``: linear layers inside repeated blocks get it; the embedding,
    norms, biases and head keep their dtype; a ``weight_overrides`` pattern wins; one that matches nothing raises, and so
    does ``weights`` where it would reach no parameter."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.blocks, self.head = (
                torch.nn.Embedding(10, 16),
                torch.nn.ModuleList([Block(), Block()]),
                torch.nn.Linear(16, 10),
            )

    net = Net()
    assert block_linear_weight_names(net) == ["blocks.0.fc.weight", "blocks.1.fc.weight"]
    policy = QuantizationPolicy(weights="fp8_e4m3", error_feedback="eco", weight_overrides={"head.weight": "bf16"})
    optimizer = policy.apply(torch.optim.AdamW(net.parameters()), net)
    group = optimizer.param_groups[0]
    grids = {name: optimizer.weight_grid(group, p) for name, p in net.named_parameters()}
    assert {name for name, grid in grids.items() if grid is not None} == {"blocks.0.fc.weight", "blocks.1.fc.weight", "head.weight"}
    assert grids["head.weight"].name == "bf16" and grids["blocks.1.fc.weight"].name == "fp8_e4m3"
    with pytest.raises(ValueError, match=r"weight_overrides pattern '\*lm_head\*' matches no parameter"):
        QuantizationPolicy(weights="bf16", weight_overrides={"*lm_head*": None}).apply(torch.optim.AdamW(Net().parameters()), Net())

    # a module without repeated blocks: weights= would reach no parameter, so it raises instead of doing nothing
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
    with pytest.raises(
        ValueError, match=r"weights='fp8_e4m3' would put no parameter of Sequential on its grid.*0\.weight.*weight_overrides"
    ):
        QuantizationPolicy(weights="fp8_e4m3").apply(torch.optim.AdamW(mlp.parameters()), mlp)
    with pytest.raises(ValueError, match=r"no parameter of Net on its grid"):  # every block weight overridden to its dtype
        QuantizationPolicy(weights="bf16", weight_overrides={"blocks.*": None}).apply(torch.optim.AdamW(net.parameters()), net)
    optimizer = QuantizationPolicy(weights="fp8_e4m3", weight_overrides={"*.weight": "fp8_e4m3"}).apply(
        torch.optim.AdamW(mlp.parameters()), mlp
    )
    assert [name for name, p in mlp.named_parameters() if optimizer.weight_grid(optimizer.param_groups[0], p)] == ["0.weight", "2.weight"]

    # an optimizer built with weights= puts every parameter on the grid: apply with the same weights and the module would
    # select only the block weights, and returned it unchanged, silently; it raises now (a converted one passes again)
    built, policy = (
        lq.QAdamW(net.parameters(), weights="fp8_e4m3", error_feedback="eco"),
        QuantizationPolicy(weights="fp8_e4m3", error_feedback="eco"),
    )
    with pytest.raises(ValueError, match=r"so the selection of weights='fp8_e4m3' \(the linear weights inside repeated blocks\) would be"):
        policy.apply(built, net)
    assert policy.apply(optimizer := policy.apply(torch.optim.AdamW(net.parameters()), net), net) is optimizer


def test_half_precision_parameters_left_out_of_the_selection_keep_the_rounding_and_feedback():
    """A bf16 model: the selection keeps norms, biases, embedding and head in their dtype. With a plain bf16 update (round
    to nearest, no feedback) a norm gain of 1.0 never moved at lr 1e-4 (bf16's spacing there is 2^-7); they take their
    own dtype as the grid now, with the group's stochastic rounding and ECO. fp32 parameters left out step as torch's."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc = torch.nn.LayerNorm(32), torch.nn.Linear(32, 32)

        def forward(self, x):
            return x + self.fc(self.norm(x))

    torch.manual_seed(0)
    net = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(32, 4)).bfloat16()
    policy = QuantizationPolicy(weights="bf16", error_feedback="eco", rounding="stochastic", min_quant_size=0)
    optimizer = policy.apply(torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0), net)
    group, gain = optimizer.param_groups[0], net[0].norm.weight
    assert optimizer.weight_grid(group, gain).name == "bf16" and optimizer.weight_overrides[gain] is None
    start = gain.detach().clone()
    x, y = torch.randn(64, 32).bfloat16(), torch.randn(64, 4)
    for _ in range(20):
        torch.nn.functional.mse_loss(net(x).float(), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    assert bool((gain != start).any())
    wide = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(32, 4))
    optimizer = policy.apply(torch.optim.AdamW(wide.parameters()), wide)
    assert optimizer.weight_grid(optimizer.param_groups[0], wide[0].norm.weight) is None


def test_fp32_state_dict_warns_where_eco_exact_keeps_remainders():
    """``fp32_state_dict()`` hands a run to a torch optimizer, which ignores ``weight_error``: it warns, naming the
    parameters and how to fold the remainders in."""
    param = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
    optimizer = lq.QAdamW([param], lr=1e-3, weights="bf16", error_feedback="eco_exact", min_quant_size=0)
    param.grad = torch.randn_like(param)
    optimizer.step()
    warned = r"QAdamW.fp32_state_dict: the weights of 1 parameter\(s\): param0 are kept rounded.*param.float\(\) \+ state"
    with pytest.warns(UserWarning, match=warned):
        exported = optimizer.fp32_state_dict()
    assert ERROR_STATE in exported["state"][0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lq.QAdamW([torch.nn.Parameter(torch.randn(8))], weights="bf16").fp32_state_dict()  # no remainders: no warning


def test_a_grid_dtype_not_held_is_refused_through_weight_overrides():
    """The check of ``weights=`` against each parameter's dtype covers the per-parameter grids ``apply`` sets."""
    model = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(8, 8)), torch.nn.Sequential(torch.nn.Linear(8, 8))).bfloat16()
    policy = QuantizationPolicy(weights="bf16", weight_overrides={"1.0.weight": "fp16"})
    with pytest.raises(ValueError, match=r"AdamW: parameter of shape \(8, 8\): weights='fp16' needs parameters that can hold"):
        policy.apply(torch.optim.AdamW(model.parameters()), model)


@pytest.mark.parametrize("mode", ["packed", "fp32"])
def test_a_gridded_checkpoint_loads_into_an_optimizer_without_weights(mode):
    """States saved under a weight grid decode to fp32 (the update runs in fp32); loaded where no grid is configured they
    decode to the parameter's dtype again, and the step runs (it failed in torch's Adam: fp32 moments, bf16 gradient)."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64, 96).bfloat16())
    gridded = lq.QAdamW([param], weights="fp8_e4m3", error_feedback="eco", min_quant_size=0)
    param.grad = torch.randn_like(param)
    gridded.step()
    gridded.checkpoint_mode = mode
    plain = lq.QAdamW([param], min_quant_size=0)
    with pytest.warns(UserWarning, match=r"weights='fp8_e4m3' -> None, error_feedback='eco' -> None"):
        plain.load_state_dict(gridded.state_dict())
    assert all(plain.state[param][name].dtype == torch.bfloat16 for name in ("exp_avg", "exp_avg_sq"))
    plain.step()
    assert torch.isfinite(param).all()


def test_eco_exact_buffer_is_dropped_where_the_resumed_run_does_not_use_it():
    """Resuming an ``eco_exact`` run with ``eco``: the fp32 error buffer would stay, unused, in every later checkpoint
    (and come back, stale, with a later ``eco_exact``). It is dropped, and the change of policy is warned about."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64, 96).bfloat16())
    exact = lq.QAdamW([param], weights="bf16", error_feedback="eco_exact", min_quant_size=0)
    param.grad = torch.randn_like(param)
    exact.step()
    assert ERROR_STATE in exact.state[param]
    eco = lq.QAdamW([param], weights="bf16", error_feedback="eco", min_quant_size=0)
    with pytest.warns(UserWarning, match=r"group 0: error_feedback='eco_exact' -> 'eco'; eco_exact's error dropped for 1 parameters"):
        eco.load_state_dict(exact.state_dict())
    assert ERROR_STATE not in eco.state[param] and ERROR_STATE not in eco.state_dict()["state"][0]
    again = lq.QAdamW([param], weights="bf16", error_feedback="eco_exact", min_quant_size=0)
    again.load_state_dict(exact.state_dict())  # the same policy: kept, nothing to say
    assert torch.equal(again.state[param][ERROR_STATE], exact.state[param][ERROR_STATE])


def test_weight_stalls_of_empty_parameters():
    """``track_weight_stalls`` (what PrecisionAdvisor turns on) with a block-scaled grid on empty parameters."""
    params = [torch.nn.Parameter(torch.zeros(5, 0)), torch.nn.Parameter(torch.zeros(0, 5))]
    for param, block in zip(params, ["row", "tensor"], strict=True):
        optimizer = lq.QAdamW([param], weights="int8", weight_block=block, error_feedback="eco", track_stalls=True, min_quant_size=0)
        optimizer.track_weight_stalls = True
        param.grad = torch.zeros_like(param)
        optimizer.step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_muon_on_a_grid_takes_the_native_step_from_the_first(dtype):
    """A gridded parameter's coded momentum decodes to fp32 from its creation, so its first step is native too (where
    the C++ kernel builds; else every step is the reference's)."""
    expected = "native" if dispatch.native_kernel_available() else "reference"
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64, 64).to(dtype))
    optimizer = lq.QMuon([param], states="int8", weights="bf16" if dtype == torch.bfloat16 else "fp16", min_quant_size=0)
    for _ in range(2):
        param.grad = torch.randn_like(param)
        optimizer.step()
        assert optimizer.step_paths()["param0"] == expected


@pytest.mark.parametrize("make", ["qsgd", "qadam"])
def test_a_checkpoint_whose_hyperparameters_cannot_carry_eco_is_refused_before_loading(make):
    """A load takes the checkpoint's hyperparameters (as torch's): a momentum-free SGD (or betas[0]=0 Adam) checkpoint
    resumed under ``error_feedback="eco"`` is the checkpoint's problem, reported as a plain ValueError (not the
    ConfigurationError the CLI prints as a usage error), and the optimizer is left as it was."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64, 96).bfloat16())
    options = dict(weights="bf16", error_feedback="eco", rounding="stochastic", min_quant_size=0)
    optimizer = lq.QSGD([param], lr=0.1, momentum=0.9, **options) if make == "qsgd" else lq.QAdam([param], **options)
    param.grad = torch.randn_like(param)
    optimizer.step()
    checkpoint = optimizer.state_dict()
    key, value = ("momentum", 0.0) if make == "qsgd" else ("betas", (0.0, 0.999))
    checkpoint["param_groups"][0][key] = value

    def values(state: dict) -> dict:
        return {name: tensor.dequantize() if hasattr(tensor, "dequantize") else tensor.clone() for name, tensor in state.items()}

    before = values(optimizer.state[param])
    with pytest.raises(ValueError, match=r"the checkpoint's param group 0 cannot be resumed under the configured policy") as raised:
        optimizer.load_state_dict(checkpoint)
    assert not isinstance(raised.value, ConfigurationError)
    assert optimizer.param_groups[0][key] == (0.9 if make == "qsgd" else (0.9, 0.999))
    after = values(optimizer.state[param])
    assert after.keys() == before.keys() and all(torch.equal(after[name], before[name]) for name in before)


def test_a_checkpoint_of_other_groups_meets_torchs_own_error_first():
    """The hyperparameter check steps aside where the groups do not match in number: torch's load names the mismatch."""
    torch.manual_seed(0)
    first, second = torch.nn.Parameter(torch.randn(64, 96)), torch.nn.Parameter(torch.randn(64, 96))
    options = dict(weights="bf16", error_feedback="eco", min_quant_size=0)
    optimizer = lq.QSGD([first, second], lr=0.1, momentum=0.9, **options)
    checkpoint = lq.QSGD([{"params": [first]}, {"params": [second]}], lr=0.1, momentum=0.9, **options).state_dict()
    checkpoint["param_groups"][0]["momentum"] = 0.0
    with pytest.raises(ValueError, match="different number of parameter groups"):
        optimizer.load_state_dict(checkpoint)
