"""The generic wrapper and in-place conversion: exact resume, closures (LBFGS), step hooks, copies, class names, overrides."""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

import lightning_qstate as lq
from lightning_qstate.callbacks import QuantizedOptimizerStates
from lightning_qstate.formats import QuantizedTensor
from lightning_qstate.optim import QuantizationPolicy, QuantizedOptimizerWrapper, wrap
from lightning_qstate.plugins import QStatePrecision

from lightning_models import Regressor, flat_weights, regression_data

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")

INNER = {
    "RMSprop": lambda params: torch.optim.RMSprop(params, lr=1e-2, momentum=0.9, centered=True),
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=1e-1),  # has state before its first step
    "NAdam": lambda params: torch.optim.NAdam(params, lr=1e-2),
}


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of step ``step`` alone, so that runs split by a checkpoint see the same data."""
    gen = torch.Generator().manual_seed(step)
    return torch.randn(16, 32, generator=gen), torch.randn(16, 16, generator=gen)


def run(model: torch.nn.Module, optimizer: torch.optim.Optimizer, start: int, stop: int) -> None:
    for step in range(start, stop):
        x, y = batch(step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()


def roundtrip(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def assert_states_equal(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    """Every state of ``a`` and ``b`` bit-identical (codes, scales and format of quantized ones), parameter by parameter."""
    params_a = [p for group in a.param_groups for p in group["params"]]
    params_b = [p for group in b.param_groups for p in group["params"]]
    for pa, pb in zip(params_a, params_b, strict=True):
        assert a.state[pa].keys() == b.state[pb].keys()
        for name, value in a.state[pa].items():
            other = b.state[pb][name]
            if isinstance(value, QuantizedTensor):
                assert value.format.config == other.format.config and torch.equal(value.codes, other.codes), name
                assert (value.scales is None and other.scales is None) or torch.equal(value.scales, other.scales), name
            else:
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), name


def assert_shared(wrapped: QuantizedOptimizerWrapper) -> None:
    assert wrapped.optimizer.state is wrapped.state and wrapped.optimizer.param_groups is wrapped.param_groups
    assert wrapped.optimizer._optimizer_step_pre_hooks is wrapped._optimizer_step_pre_hooks


# --- resume ---------------------------------------------------------------------------------------------------
RESUME_CASES = [("RMSprop", "nearest"), ("RMSprop", "stochastic"), ("Adagrad", "nearest"), ("NAdam", "nearest")]


@pytest.mark.parametrize("into", ["fresh", "stepped"])
@pytest.mark.parametrize("inner,rounding", RESUME_CASES)
def test_wrapped_resume_is_bit_exact(inner, rounding, into):
    """k steps, save, a new model and wrapper (fresh, or one that already stepped) load and go on to n: the same
    parameters and states, bit for bit, as n steps straight."""

    def quantize(model: torch.nn.Module) -> QuantizedOptimizerWrapper:
        return lq.quantize_optimizer(INNER[inner](model.parameters()), states="int8", rounding=rounding, min_quant_size=0)

    straight = make_model()
    straight_optimizer = quantize(straight)
    run(straight, straight_optimizer, 0, 6)

    first = make_model()
    first_optimizer = quantize(first)
    run(first, first_optimizer, 0, 3)
    saved = roundtrip({"model": first.state_dict(), "optimizer": first_optimizer.state_dict()})

    resumed = make_model(seed=1)
    resumed_optimizer = quantize(resumed)
    if into == "stepped":
        run(resumed, resumed_optimizer, 100, 102)
    resumed.load_state_dict(saved["model"])
    resumed_optimizer.load_state_dict(saved["optimizer"])
    run(resumed, resumed_optimizer, 3, 6)
    assert torch.equal(flat_weights(resumed), flat_weights(straight))
    assert_states_equal(resumed_optimizer, straight_optimizer)
    assert_shared(resumed_optimizer)
    assert any(isinstance(v, QuantizedTensor) for s in resumed_optimizer.state.values() for v in s.values())


class RMSpropRegressor(Regressor):
    """The shared MLP with torch's RMSprop and a step LR schedule (built on the inner optimizer)."""

    def configure_optimizers(self):
        optimizer = torch.optim.RMSprop(self.parameters(), lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.7)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def fit(tmp_path, max_steps: int, **kwargs) -> pl.Trainer:
    options = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    options["enable_model_summary"] = False
    return pl.Trainer(default_root_dir=tmp_path, max_steps=max_steps, **{**options, **kwargs})


@pytest.mark.parametrize("by", ["plugin", "callback"])
def test_lightning_resume_of_a_wrapped_optimizer_is_bit_exact(tmp_path, by):
    def quantizing() -> dict:
        if by == "plugin":
            return {"plugins": [QStatePrecision(states="int8", min_quant_size=0)]}
        return {"callbacks": [QuantizedOptimizerStates(states="int8", min_quant_size=0, log_stats=False)]}

    straight = RMSpropRegressor()
    straight_fit = fit(tmp_path / "a", 8, **quantizing())
    straight_fit.fit(straight, regression_data())
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    options = quantizing()
    options["callbacks"] = [*options.get("callbacks", []), checkpoint]
    fit(tmp_path / "b", 4, enable_checkpointing=True, **options).fit(RMSpropRegressor(), regression_data())
    resumed = RMSpropRegressor()
    resumed_fit = fit(tmp_path / "c", 8, **quantizing())
    resumed_fit.fit(resumed, regression_data(), ckpt_path=str(next((tmp_path / "ckpt").glob("*.ckpt"))))
    optimizer = resumed_fit.strategy.optimizers[0]
    assert isinstance(optimizer, QuantizedOptimizerWrapper)
    assert torch.equal(flat_weights(resumed), flat_weights(straight))
    assert_states_equal(optimizer, straight_fit.strategy.optimizers[0])
    assert_shared(optimizer)
    assert resumed_fit.lr_scheduler_configs[0].scheduler.optimizer is optimizer.optimizer
    assert isinstance(optimizer.state[resumed.net[0].weight]["square_avg"], QuantizedTensor)


# --- closures and hooks ---------------------------------------------------------------------------------------
def test_wrapped_lbfgs_follows_lbfgs():
    """LBFGS evaluates the closure several times per step: the wrapper forwards it, and the trajectory, the losses
    returned and the number of evaluations are LBFGS's own."""

    def trajectory(wrap_it: bool) -> tuple[list[torch.Tensor], list[float], int]:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
        y = x @ torch.arange(8.0).unsqueeze(1) + 0.5
        optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5, history_size=4, line_search_fn="strong_wolfe")
        if wrap_it:
            optimizer = lq.quantize_optimizer(optimizer, states="int8", min_quant_size=0)
        evaluations = 0

        def closure():
            nonlocal evaluations
            assert torch.is_grad_enabled()
            evaluations += 1
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        weights, losses = [], []
        for _ in range(4):
            losses.append(float(optimizer.step(closure).detach()))
            weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]).clone())
        return weights, losses, evaluations

    plain, wrapped = trajectory(False), trajectory(True)
    assert wrapped[2] == plain[2] > 4
    assert wrapped[1] == plain[1]
    for a, b in zip(plain[0], wrapped[0], strict=True):
        assert torch.equal(a, b)
    assert plain[1][-1] < plain[1][0] * 1e-2


def test_step_hooks_run_once_per_step_with_the_wrapper():
    model = make_model()
    inner = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    calls: dict[str, list] = {name: [] for name in ("global_pre", "global_post", "pre", "post", "inner_pre", "inner_post")}

    def recorder(name: str):
        return lambda optimizer, args, kwargs: calls[name].append(optimizer)

    inner.register_step_pre_hook(recorder("inner_pre"))  # registered before wrapping
    wrapped = lq.quantize_optimizer(inner, min_quant_size=0)
    inner.register_step_post_hook(recorder("inner_post"))  # and after
    wrapped.register_step_pre_hook(recorder("pre"))
    wrapped.register_step_post_hook(recorder("post"))
    handles = [register_optimizer_step_pre_hook(recorder("global_pre")), register_optimizer_step_post_hook(recorder("global_post"))]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()": the scheduler sees the inner step
            for step in range(3):
                run(model, wrapped, step, step + 1)
                scheduler.step()
    finally:
        for handle in handles:
            handle.remove()
    for name, optimizers in calls.items():
        assert len(optimizers) == 3 and all(o is wrapped for o in optimizers), name
    assert wrapped.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5**3)


@pytest.mark.parametrize("nonfinite", ["skip", "skip_step", "raise"])
def test_wrapper_applies_the_nonfinite_policy(nonfinite):
    model = make_model()
    wrapped = lq.quantize_optimizer(INNER["RMSprop"](model.parameters()), min_quant_size=0, nonfinite=nonfinite)
    run(model, wrapped, 0, 1)
    x, y = batch(1)
    wrapped.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    model[0].weight.grad[0, 0] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    codes = wrapped.state[model[0].weight]["square_avg"].codes.clone()
    if nonfinite == "raise":
        with pytest.raises(FloatingPointError, match="non-finite gradient"):
            wrapped.step()
        return
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        wrapped.step()
    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=False)]
    assert changed == ([False] * 4 if nonfinite == "skip_step" else [False, True, True, True])
    assert torch.equal(wrapped.state[model[0].weight]["square_avg"].codes, codes)
    assert model[0].weight.grad is not None and wrapped.nonfinite_skips == (4 if nonfinite == "skip_step" else 1)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_states_the_inner_step_leaves_alone_keep_their_codes(rounding):
    """A frozen parameter (no gradient) and one the non-finite policy skips keep every stored code: each step re-encoded
    them, and a signed block's bf16 scale (its absmax rounded up) shrank them step by step (RMSprop's int8 momentum of a
    frozen layer: 24 % in 100 steps; SR drew new codes)."""
    model = make_model()
    wrapped = lq.quantize_optimizer(INNER["RMSprop"](model.parameters()), min_quant_size=0, rounding=rounding)
    run(model, wrapped, 0, 2)
    frozen = model[0].weight
    frozen.requires_grad_(False)
    saved = {
        name: (value.codes.clone(), value.scales.clone())
        for name, value in wrapped.state[frozen].items()
        if isinstance(value, QuantizedTensor)
    }
    assert saved.keys() == {"square_avg", "momentum_buffer", "grad_avg"}
    run(model, wrapped, 2, 12)
    x, y = batch(12)
    wrapped.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    model[2].weight.grad[0, 0] = float("nan")
    skipped = {name: value.codes.clone() for name, value in wrapped.state[model[2].weight].items() if isinstance(value, QuantizedTensor)}
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        wrapped.step()
    for name, (codes, scales) in saved.items():
        assert torch.equal(wrapped.state[frozen][name].codes, codes) and torch.equal(wrapped.state[frozen][name].scales, scales), name
    assert all(torch.equal(wrapped.state[model[2].weight][name].codes, codes) for name, codes in skipped.items())


class SlowWeights(torch.optim.Optimizer):
    """SGD with Lookahead's slow weights: its state ``slow`` is written every ``k`` steps only."""

    def __init__(self, params, lr: float = 1e-2, k: int = 5) -> None:
        super().__init__(params, {"lr": lr, "k": k})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    state = self.state[param]
                    slow = state.setdefault("slow", param.detach().clone())
                    state["count"] = state.get("count", 0) + 1
                    param.add_(param.grad, alpha=-group["lr"])
                    if state["count"] % group["k"] == 0:
                        slow.add_(param - slow, alpha=0.5)
                        param.copy_(slow)


@pytest.mark.parametrize("states", ["int8", "int4"])
def test_a_state_written_every_k_steps_keeps_its_codes_in_between(states):
    """A stepped parameter's state the inner step leaves alone keeps its codes: encoded again at every step, a block
    whose absmax is negative shrank by the map's negative end (int8 -0.993, int4 -0.8875) each time (Lookahead's slow
    weights: 4 % of their norm in 20 steps with int4)."""
    model = make_model()
    wrapped = lq.quantize_optimizer(SlowWeights(model.parameters()), states=states, min_quant_size=0)
    weight = model[0].weight
    run(model, wrapped, 0, 1)
    slow = wrapped.state[weight]["slow"]
    run(model, wrapped, 1, 4)  # steps 2-4 leave it alone
    assert wrapped.state[weight]["slow"] is slow
    run(model, wrapped, 4, 5)  # the fifth writes it
    assert wrapped.state[weight]["slow"] is not slow


@pytest.mark.parametrize("states", ["int4", "int8"])
def test_adamax_infinity_norm_is_stored_unsigned(states):
    """Adamax's ``exp_inf`` (its denominator) takes the zero-free unsigned map, so no step is larger than Adamax's own
    ``lr·|m̂|/u`` allows (about ``lr`` here; torch's moves no more): with the signed map, entries far below their block's
    absmax read 0 and the update became ``lr·m/eps`` (a weight moved 84 where torch's moved 0.0026)."""
    param = torch.nn.Parameter(torch.zeros(256))
    wrapped = lq.quantize_optimizer(torch.optim.Adamax([param], lr=1e-3), states=states, min_quant_size=0)
    largest = 0.0
    for step in range(70):  # one spike in the block, a few ordinary gradients elsewhere, then zeros
        grad = torch.zeros(256)
        grad[0] = 1e4 if step == 0 else 0.0
        grad[1:] = 1e-3 if 61 <= step <= 65 else 0.0
        before = param.detach().clone()
        param.grad = grad
        wrapped.step()
        largest = max(largest, float((param.detach() - before).abs().max()))
    assert not wrapped.state_format(param, "exp_inf").signed
    assert largest <= 1.1e-3, largest


def test_scalar_parameters_keep_their_step_counts_exact():
    """A 0-d parameter's 0-d states are scalars (``step``, NAdam's ``mu_product``): kept as they are (bf16 held the step
    count at 256, so Adam's bias correction stopped there)."""
    temperature = torch.nn.Parameter(torch.tensor(1.0))
    wrapped = lq.quantize_optimizer(torch.optim.NAdam([temperature], lr=1e-3), states="bf16", min_quant_size=0)
    for _ in range(300):
        temperature.grad = torch.tensor(0.5)
        wrapped.step()
    state = wrapped.state[temperature]
    assert not any(isinstance(value, QuantizedTensor) for value in state.values()) and float(state["step"]) == 300.0


def test_state_dict_hooks_of_the_inner_optimizer_run():
    """state_dict and load_state_dict hooks registered on the inner optimizer before wrapping run (only step hooks did)."""
    model = make_model()
    inner = INNER["RMSprop"](model.parameters())
    calls = []
    inner.register_state_dict_pre_hook(lambda optimizer: calls.append("save pre"))
    inner.register_state_dict_post_hook(lambda optimizer, state_dict: calls.append("save post"))
    inner.register_load_state_dict_pre_hook(lambda optimizer, state_dict: calls.append("load pre"))
    inner.register_load_state_dict_post_hook(lambda optimizer: calls.append("load post"))
    wrapped = lq.quantize_optimizer(inner, min_quant_size=0)
    run(model, wrapped, 0, 1)
    wrapped.load_state_dict(wrapped.state_dict())
    assert calls == ["save pre", "save post", "load pre", "load post"]


def test_state_nbytes_counts_tensors_held_in_lists():
    """LBFGS keeps its curvature history in lists of tensors: they count (65,540 bytes were reported of 458,804 held)."""
    model = make_model()
    optimizer = torch.optim.LBFGS(model.parameters(), history_size=5)
    x, y = batch(0)

    def closure():
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    optimizer.step(closure)
    state = optimizer.state[optimizer.param_groups[0]["params"][0]]
    listed = sum(t.nbytes for name in ("old_dirs", "old_stps", "ro", "al") for t in state[name] if isinstance(t, torch.Tensor))
    plain = sum(value.nbytes for value in state.values() if isinstance(value, torch.Tensor))
    assert listed > 0 and lq.state_nbytes(optimizer) == plain + listed


def test_optimizers_a_wrapper_cannot_take_are_refused_when_converting():
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    with pytest.raises(TypeError, match="SparseAdam steps sparse gradients"):
        lq.quantize_optimizer(torch.optim.SparseAdam(embedding.parameters()))
    with pytest.raises(TypeError, match="QAdamW already has quantized states"):
        QuantizedOptimizerWrapper(lq.QAdamW(make_model().parameters()), states="int4")


# --- copies -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("clone", [copy.deepcopy, lambda obj: pickle.loads(pickle.dumps(obj))], ids=["deepcopy", "pickle"])
def test_copies_of_a_wrapper_share_with_their_inner_optimizer(clone):
    model = make_model()
    wrapped = lq.quantize_optimizer(INNER["RMSprop"](model.parameters()), states="int4", min_quant_size=0, nonfinite="raise")
    run(model, wrapped, 0, 2)
    model_copy, copied = clone((model, wrapped))
    assert isinstance(copied, QuantizedOptimizerWrapper) and type(copied.optimizer) is torch.optim.RMSprop
    assert_shared(copied)
    assert copied.param_groups[0]["params"][0] is next(model_copy.parameters())
    assert copied.nonfinite == "raise" and copied.state_names == ()
    run(model, wrapped, 2, 4)
    run(model_copy, copied, 2, 4)
    assert torch.equal(flat_weights(model_copy), flat_weights(model))
    assert_states_equal(copied, wrapped)


# --- in-place conversion keeps the torch class's name -----------------------------------------------------------
IN_PLACE = [(torch.optim.Adam, lq.QAdam), (torch.optim.AdamW, lq.QAdamW), (torch.optim.SGD, lq.QSGD)]


@pytest.mark.parametrize("torch_class,quantized_class", IN_PLACE, ids=[q.__name__ for _, q in IN_PLACE])
def test_in_place_conversion_keeps_the_class_name(torch_class, quantized_class):
    model = make_model()
    converted = lq.quantize_optimizer(torch_class(model.parameters(), lr=1e-2), min_quant_size=0)
    cls = type(converted)
    assert cls.__name__ == torch_class.__name__ and isinstance(converted, quantized_class)
    assert getattr(wrap, cls.__qualname__) is cls and cls.__module__ == wrap.__name__
    assert type(quantized_class(make_model().parameters())).__name__ == quantized_class.__name__  # built directly: its own name
    run(model, converted, 0, 2)
    for copied in (copy.deepcopy(converted), pickle.loads(pickle.dumps(converted))):
        assert type(copied) is cls
        assert_states_equal(copied, converted)


@pytest.mark.parametrize("refused", ["complex", "differentiable"])
def test_a_refused_conversion_leaves_the_torch_optimizer_as_it_was(refused):
    """The class is swapped before the groups are checked: a refusal used to leave a half-built InPlaceQAdamW whose next
    step failed (no ``_rounding_step``), with the policy's options in its defaults and groups."""
    param = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.complex64) if refused == "complex" else torch.randn(8, 8))
    optimizer = torch.optim.AdamW([param], lr=1e-2, differentiable=refused == "differentiable")
    param.grad = torch.ones_like(param)
    if refused == "complex":  # (a differentiable AdamW steps non-leaf parameters only)
        optimizer.step()
    before = (dict(optimizer.defaults), [dict(group) for group in optimizer.param_groups], dict(optimizer.state[param]))
    with pytest.raises(ValueError, match="not supported"):
        lq.quantize_optimizer(optimizer, min_quant_size=0)
    assert type(optimizer) is torch.optim.AdamW and not hasattr(optimizer, "_rounding_step")
    after = (optimizer.defaults, optimizer.param_groups, optimizer.state[param])
    assert after[0] == before[0] and after[1] == before[1] and after[2].keys() == before[2].keys()
    if refused == "complex":
        optimizer.step()  # still torch's AdamW


def test_muon_in_place_keeps_its_name():
    converted = lq.quantize_optimizer(torch.optim.Muon([torch.nn.Parameter(torch.randn(64, 64))]), min_quant_size=0)
    assert type(converted).__name__ == "Muon" and isinstance(converted, lq.QMuon)


class TorchOptimizerRegressor(Regressor):
    """The shared MLP with the ``torch.optim`` class named ``optimizer``, with or without an LR schedule."""

    def __init__(self, optimizer: str, scheduler: bool) -> None:
        super().__init__(scheduler=scheduler)
        self.optimizer_name = optimizer

    def configure_optimizers(self):
        optimizer = getattr(torch.optim, self.optimizer_name)(self.parameters(), lr=self.lr)
        if not self.scheduler:
            return optimizer
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)}


@pytest.mark.parametrize("optimizer,scheduler", [("AdamW", True), ("AdamW", False), ("RMSprop", True)])
def test_learning_rate_monitor_keys_do_not_change(tmp_path, optimizer, scheduler):
    """Lightning's LearningRateMonitor names its keys after the optimizer's class: the plugin must not rename them."""

    def logged_keys(name: str, **kwargs) -> set[str]:
        logger = CSVLogger(tmp_path, name=name)
        monitor = LearningRateMonitor(log_momentum=True)
        trainer = fit(tmp_path, 2, logger=logger, log_every_n_steps=1, callbacks=[monitor], **kwargs)
        trainer.fit(TorchOptimizerRegressor(optimizer, scheduler), regression_data())
        header = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()[0]
        return {key for key in header.split(",") if key.startswith("lr-")}

    plain = logged_keys("plain")
    assert plain == {f"lr-{optimizer}", f"lr-{optimizer}-momentum"}
    assert logged_keys("quantized", plugins=[QStatePrecision(min_quant_size=0)]) == plain


# --- overrides --------------------------------------------------------------------------------------------------
class Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 8)
        self.h = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 8)) for _ in range(12))


def test_override_patterns_must_match_a_parameter():
    model = Blocks()
    policy = QuantizationPolicy(min_quant_size=0, overrides={"embed.*": "fp32", "*norm*": "fp32"})
    optimizer = torch.optim.AdamW(model.parameters())
    names = r"embed\.weight, h\.\*\.0\.weight, h\.\*\.0\.bias, h\.\*\.1\.weight, h\.\*\.1\.bias;"  # the 12 blocks as h.*
    with pytest.raises(ValueError, match=rf"pattern '\*norm\*' matches no parameter of Blocks.*: {names}"):
        policy.apply(optimizer, model)
    assert type(optimizer) is torch.optim.AdamW, "nothing is converted when the policy is refused"
    quantized = QuantizationPolicy(min_quant_size=0, overrides={"embed.*": "fp32", "h.*.0.*": "bf16"}).apply(optimizer, model)
    assert quantized.state_overrides == {model.embed.weight: "fp32", **{p: "bf16" for block in model.h for p in block[0].parameters()}}


def test_override_state_names_are_checked_against_the_optimizer():
    model = Blocks()
    policy = QuantizationPolicy(min_quant_size=0, overrides={"h.*": {"exp_avgsq": "int4"}})
    adamw = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match=r"overrides\['h\.\*'\]: unknown state name\(s\) \['exp_avgsq'\].*exp_avg_sq"):
        policy.apply(adamw, model)
    assert type(adamw) is torch.optim.AdamW
    wrapped = policy.apply(torch.optim.RMSprop(model.parameters()), model)  # the wrapper knows no names before its first step
    assert isinstance(wrapped, QuantizedOptimizerWrapper) and wrapped.state_overrides[model.h[0][1].weight] == {"exp_avgsq": "int4"}


@pytest.mark.parametrize("by", ["states", "overrides"])
def test_state_names_the_wrapped_optimizer_does_not_keep_raise_at_its_first_step(by):
    """Adam's ``exp_avg_sq`` for RMSprop (whose state is ``square_avg``) quantized nothing, silently (QAdamW raises at
    construction; the wrapper learns the names at the first step)."""
    model = make_model()
    inner = INNER["RMSprop"](model.parameters())
    if by == "states":
        wrapped = lq.quantize_optimizer(inner, states={"exp_avg_sq": "int4"}, min_quant_size=0)
    else:
        wrapped = QuantizationPolicy(min_quant_size=0, overrides={"0.*": {"exp_avg_sq": "int4"}}).apply(inner, model)
    unknown = r"names \['exp_avg_sq'\], which RMSprop does not keep; its states are \['grad_avg', 'momentum_buffer', "
    with pytest.raises(ValueError, match=unknown):
        run(model, wrapped, 0, 1)
    with pytest.raises(ValueError, match=unknown):  # and at every step after, until it is fixed
        run(model, wrapped, 1, 2)
    assert repr(wrapped).startswith("QuantizedOptimizerWrapper[RMSprop] (")


class DataMomentum(torch.optim.Optimizer):
    """A user's optimizer that writes its state through ``.data`` (no version bump on the state tensor)."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    buffer = self.state[param].setdefault("buf", torch.zeros_like(param))
                    buffer.data.mul_(0.9).add_(param.grad)
                    param.add_(buffer, alpha=-group["lr"])


@pytest.mark.parametrize("make", [lambda params: torch.optim.Adagrad(params, fused=True), DataMomentum], ids=["fused-Adagrad", "data"])
def test_states_written_without_a_version_bump_are_stored(make):
    """torch's fused CPU Adagrad and a ``.data`` write change a state without bumping its version: the wrapper took the
    state as left alone and kept its first codes (Adagrad's ``sum`` stayed 0). Stepped parameters are encoded again."""
    model, reference = make_model(), make_model()
    wrapped, plain = lq.quantize_optimizer(make(model.parameters()), states="int8", min_quant_size=0), make(reference.parameters())
    run(model, wrapped, 0, 4)
    run(reference, plain, 0, 4)
    name = "sum" if "sum" in plain.state[reference[0].weight] else "buf"
    stored, exact = wrapped.state[model[0].weight][name].dequantize(), plain.state[reference[0].weight][name]
    assert (stored - exact).norm() < 0.05 * exact.norm()


def test_converted_sgd_follows_its_foreach_choice():
    """``SGD(foreach=True)`` with bf16 parameters: torch's multi-tensor ops round otherwise than its per-tensor loop, and
    the converted optimizer always took the loop; with ``states="fp32"`` it is torch's, bit for bit."""
    start = [torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).bfloat16(), torch.randn(64).bfloat16()]
    ours, theirs = ([torch.nn.Parameter(t.clone()) for t in start] for _ in range(2))
    converted = lq.quantize_optimizer(torch.optim.SGD(ours, lr=0.1, momentum=0.9, foreach=True), states="fp32", min_quant_size=0)
    plain = torch.optim.SGD(theirs, lr=0.1, momentum=0.9, foreach=True)
    for step in range(3):
        for a, b in zip(ours, theirs, strict=True):
            a.grad = b.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(step)).bfloat16()
        converted.step()
        plain.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_overrides_need_the_module():
    policy = QuantizationPolicy(overrides={"*": "fp32"})
    with pytest.raises(ValueError, match=r"overrides=.*apply\(optimizer, module\)"):
        policy.apply(torch.optim.AdamW(make_model().parameters()))
    assert isinstance(QuantizationPolicy().apply(torch.optim.AdamW(make_model().parameters())), lq.QAdamW)


def test_override_patterns_for_the_shipped_gpt():
    pytest.importorskip("transformers")
    from examples.gpt import GPTModule

    model = GPTModule(n_embd=32, n_layer=2, n_head=2)
    with pytest.raises(ValueError, match=r"'\*embed\*' matches no parameter of GPTModule.*model\.transformer\.wte\.weight"):
        QuantizationPolicy(overrides={"*embed*": "fp32", "*norm*": "fp32"}).apply(torch.optim.AdamW(model.parameters()), model)
    policy = QuantizationPolicy(overrides={"*.wte.*": "fp32", "*.wpe.*": "fp32", "*.ln_*": "fp32"})
    matched = policy.apply(torch.optim.AdamW(model.parameters()), model).state_overrides
    names = {param: name for name, param in model.named_parameters()}
    assert sorted(names[p] for p in matched) == sorted(n for n in names.values() if ".wte." in n or ".wpe." in n or ".ln_" in n)
    assert len(matched) == 2 + 2 * 4 + 2  # embeddings, ln_1/ln_2 per layer, ln_f (weights and biases)


@pytest.mark.parametrize("make", [torch.optim.AdamW, torch.optim.Adagrad])
def test_a_checkpoints_policy_left_in_a_torch_optimizer_does_not_override_the_conversion(make):
    """A torch optimizer that loaded a quantized optimizer's ``state_dict()`` carries its storage policy in its groups
    (torch copies every group key): converting it again uses the call's arguments (the checkpoint's ``states="fp32"``
    won, silently, and nothing was quantized), with a warning naming the dropped keys."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(64, 64))
    first = lq.quantize_optimizer(make([param], lr=1e-3), states="fp32", min_quant_size=0)
    param.grad = torch.randn_like(param)
    first.step()
    plain = make([param], lr=1e-3)
    plain.load_state_dict(first.state_dict())
    with pytest.warns(UserWarning, match=r"hold the storage policy of a quantized optimizer's state_dict it loaded \(.*states"):
        converted = lq.quantize_optimizer(plain, states="int8", min_quant_size=0)
    param.grad = torch.randn_like(param)
    converted.step()
    name = "exp_avg" if make is torch.optim.AdamW else "sum"
    assert converted.state_format(param, name).name == "int8"
    assert converted.param_groups[0]["states"] == "int8"


def test_a_group_added_after_loading_a_checkpoint_keeps_its_own_policy():
    """Only the loaded groups' uniform policy (the saved run's) is dropped: a group added after the load keeps the
    storage it asks for."""
    torch.manual_seed(0)
    param, head = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 64))
    first = lq.quantize_optimizer(torch.optim.AdamW([param], lr=1e-3), states="fp32", min_quant_size=0)
    param.grad = torch.randn_like(param)
    first.step()
    plain = torch.optim.AdamW([param], lr=1e-3)
    plain.load_state_dict(first.state_dict())
    plain.add_param_group({"params": [head], "states": "fp32"})
    with pytest.warns(UserWarning, match="set alike in every group: dropped"):
        converted = lq.quantize_optimizer(plain, states="int8", min_quant_size=0)
    param.grad, head.grad = torch.randn_like(param), torch.randn_like(head)
    converted.step()
    assert converted.state_format(param, "exp_avg").name == "int8" and converted.state_format(head, "exp_avg") is None
