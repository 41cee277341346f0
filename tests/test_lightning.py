"""Lightning integration on a single device: plugins, callback, resume, logging, training loop features."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_qstate import QSGD, QAdamW, callbacks
from lightning_qstate.adaptive import BitWidthPlanner
from lightning_qstate.callbacks import QuantizedOptimizerStates
from lightning_qstate.formats import QuantizedTensor
from lightning_qstate.optim import QuantizedOptimizerWrapper
from lightning_qstate.plugins import QStateFSDPPrecision, QStateHalfPrecision, QStateMixedPrecision, QStatePrecision

from lightning_models import Regressor, flat_weights, quiet_trainer, regression_data, step_batch

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")


def trainer(tmp_path, max_steps: int = 6, **kwargs) -> pl.Trainer:
    return quiet_trainer(tmp_path, max_steps, **kwargs)


def test_plugin_converts_and_matches_the_callback(tmp_path):
    by_plugin, by_callback = Regressor(), Regressor()
    first = trainer(tmp_path, plugins=[QStatePrecision(states="int8", min_quant_size=0)])
    first.fit(by_plugin, regression_data())
    second = trainer(tmp_path, callbacks=[QuantizedOptimizerStates(states="int8", min_quant_size=0, log_stats=False)])
    second.fit(by_callback, regression_data())
    for fitted in (first, second):
        optimizer = fitted.strategy.optimizers[0]
        assert isinstance(optimizer, QAdamW)
        assert isinstance(
            optimizer.state[by_plugin.net[0].weight if fitted is first else by_callback.net[0].weight]["exp_avg"], QuantizedTensor
        )
        assert fitted.lr_scheduler_configs[0].scheduler.optimizer is optimizer
    assert torch.equal(flat_weights(by_plugin), flat_weights(by_callback))
    assert first.lr_scheduler_configs[0].scheduler.get_last_lr()[0] == pytest.approx(1e-2 * 0.7**2)


def test_options_an_already_quantized_optimizer_would_ignore_raise(tmp_path):
    """A plugin and a callback, or a quantized optimizer from configure_optimizers and a plugin: the one that comes second
    finds the optimizer quantized and leaves it; where it was given options of its own that differ, that raises (they
    would be ignored), and options it shares with the optimizer are accepted."""

    class OwnQAdamW(Regressor):
        def configure_optimizers(self):
            return QAdamW(self.parameters(), lr=1e-2, states="bf16")

    with pytest.raises(ValueError, match=r"QAdamW of .* has quantized states already .*, so states='int4' would be ignored"):
        trainer(tmp_path, plugins=[QStatePrecision(states="int4")]).fit(OwnQAdamW(), regression_data())
    plugin = QStatePrecision(states="int8", min_quant_size=0, rounding="stochastic")
    with pytest.raises(ValueError, match=r"AdamW of Regressor has quantized states already .*, so states='int4' would be ignored"):
        callback = QuantizedOptimizerStates(states="int4", min_quant_size=0, rounding="stochastic", log_stats=False)
        trainer(tmp_path, plugins=[plugin], callbacks=[callback]).fit(Regressor(), regression_data())
    for agreeing in (QStatePrecision(states="bf16"), QStatePrecision()):  # the optimizer's own states; the defaults
        fitted = trainer(tmp_path, max_steps=1, plugins=[agreeing])
        fitted.fit(OwnQAdamW(), regression_data())
        assert fitted.strategy.optimizers[0].param_groups[0]["states"] == "bf16"
    callback = QuantizedOptimizerStates(states="int8", min_quant_size=0, rounding="stochastic", log_stats=False)
    trainer(tmp_path, max_steps=1, plugins=[plugin], callbacks=[callback]).fit(Regressor(), regression_data())


def test_precision_variants():
    assert type(QStatePrecision("bf16-mixed")) is QStateMixedPrecision
    assert type(QStatePrecision("bf16-true")) is QStateHalfPrecision
    assert QStatePrecision("16-true").precision == "16-true"
    assert isinstance(QStateFSDPPrecision("32-true"), QStatePrecision.__mro__[1])
    with pytest.raises(ValueError, match="precision='64-true'.*32-true"):
        QStatePrecision("64-true")
    for variant, other in ((QStateHalfPrecision, "bf16-mixed"), (QStateMixedPrecision, "32-true")):  # not trained as fp16
        with pytest.raises(ValueError, match=f"precision='{other}'"):
            variant(other)
    with pytest.raises(ValueError, match="unknown format 'int9'"):
        QStatePrecision(states="int9")
    with pytest.raises(ValueError, match=r"overrides\['\*norm\*'\].*unknown format"):
        QStateMixedPrecision(overrides={"*norm*": "fp31"})


def test_bf16_mixed_plugin_trains(tmp_path):
    model = Regressor()
    fit = trainer(tmp_path, plugins=[QStatePrecision("bf16-mixed", states="int4", min_quant_size=0)])
    fit.fit(model, regression_data())
    assert isinstance(fit.strategy.optimizers[0], QAdamW)
    assert torch.isfinite(flat_weights(model)).all()


def test_overrides_keep_matching_parameters_fp32(tmp_path):
    model = Regressor()
    fit = trainer(
        tmp_path,
        max_steps=2,
        callbacks=[QuantizedOptimizerStates(min_quant_size=0, overrides={"net.1.*": "fp32", "net.0.bias": "bf16"}, log_stats=False)],
    )
    fit.fit(model, regression_data())
    optimizer = fit.strategy.optimizers[0]
    assert optimizer.state_format(model.net[1].weight, "exp_avg") is None
    assert optimizer.state_format(model.net[0].bias, "exp_avg").name == "bf16"
    assert optimizer.state_format(model.net[0].weight, "exp_avg").name == "int8"


def test_resume_is_bit_exact_with_round_to_nearest(tmp_path):
    plugin = lambda: QStatePrecision(states="int8", min_quant_size=0)  # noqa: E731
    straight = Regressor()
    trainer(tmp_path / "a", max_steps=8, plugins=[plugin()]).fit(straight, regression_data())
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_epochs=1, save_top_k=-1)
    trainer(tmp_path / "b", max_steps=4, enable_checkpointing=True, callbacks=[checkpoint], plugins=[plugin()]).fit(
        Regressor(), regression_data()
    )
    saved = torch.load(next((tmp_path / "ckpt").glob("*.ckpt")), weights_only=True)
    packed = saved["optimizer_states"][0]["state"][0]["exp_avg"]
    assert packed["codes"].dtype == torch.uint8 and packed["format"]["name"] == "int8", "the checkpoint keeps the low-bit codes"
    resumed = Regressor(lr=0.5)  # hyperparameters and weights must come from the checkpoint
    resumed.lr = 1e-2
    trainer(tmp_path / "c", max_steps=8, plugins=[plugin()]).fit(
        resumed, regression_data(), ckpt_path=str(next((tmp_path / "ckpt").glob("*.ckpt")))
    )
    assert torch.equal(flat_weights(straight), flat_weights(resumed))


def test_memory_metrics_are_logged(tmp_path):
    logger = CSVLogger(tmp_path)
    fit = trainer(
        tmp_path, max_steps=4, logger=logger, log_every_n_steps=2, callbacks=[QuantizedOptimizerStates(states="int8", min_quant_size=0)]
    )
    fit.fit(Regressor(), regression_data())
    logger.save()
    text = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    header, *rows = text.strip().splitlines()
    for name in ("qstate/state_bytes", "qstate/bits_per_value", "qstate/saving_vs_fp32", "qstate/nonfinite_skips"):
        assert name in header
    columns = header.split(",")
    values = [dict(zip(columns, row.split(","), strict=False)) for row in rows]
    bits = [float(v["qstate/bits_per_value"]) for v in values if v.get("qstate/bits_per_value")]
    assert bits and all(8.0 < b < 8.5 for b in bits)
    saving = [float(v["qstate/saving_vs_fp32"]) for v in values if v.get("qstate/saving_vs_fp32")]
    assert all(0.7 < s < 0.76 for s in saving)


class TwoOptimizers(Regressor):
    """Manual optimization with two optimizers (one SGD with momentum), gradient clipping done by hand."""

    def __init__(self) -> None:
        super().__init__(scheduler=False)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        x, y = step_batch(self.global_step)
        loss = torch.nn.functional.mse_loss(self(x), y)
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(first, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        first.step()
        second.step()
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net[0].parameters(), lr=1e-2), torch.optim.SGD(self.net[3].parameters(), lr=1e-2, momentum=0.9)


def test_manual_optimization_with_two_optimizers(tmp_path):
    model = TwoOptimizers()
    fit = trainer(tmp_path, max_steps=6, plugins=[QStatePrecision(states="int8", min_quant_size=0)])
    fit.fit(model, regression_data())
    first, second = fit.strategy.optimizers
    assert isinstance(first, QAdamW) and isinstance(second, QSGD)
    assert isinstance(second.state[model.net[3].weight]["momentum_buffer"], QuantizedTensor)


class Accumulating(Regressor):
    def configure_optimizers(self):
        return torch.optim.RMSprop(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_accumulation_clipping_and_generic_optimizers(tmp_path, clip):
    model = Accumulating()
    fit = trainer(
        tmp_path,
        max_steps=3,
        accumulate_grad_batches=2,
        gradient_clip_val=0.5,
        gradient_clip_algorithm=clip,
        callbacks=[QuantizedOptimizerStates(min_quant_size=0, log_stats=False)],
    )
    fit.fit(model, regression_data())
    optimizer = fit.strategy.optimizers[0]
    assert isinstance(optimizer, QuantizedOptimizerWrapper)
    assert isinstance(optimizer.state[model.net[0].weight]["square_avg"], QuantizedTensor)
    assert fit.global_step == 3


def test_stale_optimizer_parameters_are_refused(tmp_path):
    class Stale(Regressor):
        def configure_optimizers(self):
            return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])

    with pytest.raises(RuntimeError, match="not in the model the strategy set up"):
        trainer(tmp_path, plugins=[QStatePrecision()]).fit(Stale(), regression_data())


@pytest.mark.parametrize(
    ("callback", "kwargs", "message"),
    [
        ("StateResetScheduler", {"reset_step": "no"}, "reset_step='no' must be True or False"),  # "no" read as True
        ("StateResetScheduler", {"stagger": 5}, "stagger=5 must be True or False"),
        ("StateResetScheduler", {"include_fp32": None}, "include_fp32=None must be True or False"),
        ("StateResetScheduler", {"check_every_n_steps": True}, "check_every_n_steps=True must be a positive int"),
        ("StateResetScheduler", {"check_every_n_steps": 10}, "check_every_n_steps=10 paces the threshold trigger, and threshold=None"),
        ("StateResetScheduler", {"threshold": "x"}, r"threshold='x' must lie in \(0, 1\]"),
        ("StallMonitor", {"per_layer": "yes"}, "per_layer='yes' must be True or False"),
        ("StallMonitor", {"histograms": 3}, "histograms=3 must be True or False"),
        ("QuantizedOptimizerStates", {"log_stats": "no"}, "log_stats='no' must be True or False"),
        ("QuantizedOptimizerStates", {"track_stalls": "yes"}, "track_stalls='yes' must be True or False"),
        ("AdaptiveBitWidth", {"fill_budget": "no"}, "fill_budget='no' must be True or False"),
        ("AdaptiveBitWidth", {"anneal_steps": True}, "anneal_steps=True must be an int >= 1"),
        ("QuantizationProbe", {"modules": [1]}, r"modules=\[1\] must be name patterns of linear layers"),  # a TypeError at fit
    ],
)
def test_flags_and_counts_of_another_type_are_refused(callback, kwargs, message):
    """A string or number where a flag belongs (``"no"`` would read as true), or a bool where a count belongs, raises at
    construction, naming the argument."""
    with pytest.raises(ValueError, match=f"{callback}: {message}"):
        getattr(callbacks, callback)(**kwargs)
    with pytest.raises(ValueError, match="QStatePrecision: track_stalls=1 must be True or False"):
        QStatePrecision(track_stalls=1)


def test_numpy_numbers_are_taken_as_python_numbers():
    """A count or rate given as a numpy number (read from an array, a sweep's grid) is taken by the callbacks as by the
    planner they build, and kept as a Python number (checkpoints and JSON hold no numpy scalars): ``anneal_steps`` passed
    the callback, then failed the planner at fit start."""
    adaptive = callbacks.AdaptiveBitWidth(
        anneal_steps=np.int64(1000), interval=np.int64(10), ema_decay=np.float32(0.5), target_bits=np.float64(5.0)
    )
    assert type(adaptive.anneal_steps) is int
    planner = BitWidthPlanner(QAdamW(torch.nn.Linear(8, 8).parameters(), min_quant_size=0), **adaptive.planner_options,
                              anneal_steps=adaptive.anneal_steps)  # fmt: skip
    assert [type(value) for value in (planner.interval, planner.target_bits, planner.ema_decay)] == [int, float, float]
    resets = callbacks.StateResetScheduler(period=np.int32(7), threshold=np.float32(0.5), check_every_n_steps=np.int64(5))
    assert (resets.period, resets.check_every_n_steps) == (7, 5) and type(resets.period) is type(resets.check_every_n_steps) is int
    with pytest.raises(ValueError, match=r"BitWidthPlanner: anneal_steps=None is not valid"):
        BitWidthPlanner(planner.optimizer, anneal_steps=None)


@pytest.mark.parametrize("entry", ["QStatePrecision", "QuantizedOptimizerStates"])
def test_a_pattern_where_a_mapping_belongs_is_refused_by_name(entry):
    """``overrides="*.wte.*"`` (one pattern, not a mapping) raised dict()'s 'dictionary update sequence element #0'."""
    make = QStatePrecision if entry == "QStatePrecision" else callbacks.QuantizedOptimizerStates
    with pytest.raises(TypeError, match=rf"{entry}: overrides= must be a mapping of name pattern -> states, .* got '\*\.wte\.\*'"):
        make(overrides="*.wte.*")
    with pytest.raises(TypeError, match=rf"{entry}: weight_overrides= must be a mapping of name pattern -> weights"):
        make(weight_overrides=["*.weight"])


def test_numpy_integers_are_counts():
    """A count read from a numpy array or config (``np.int64``) is an int like any other; ``np.bool_`` is not a count."""
    counts = np.int64(20)
    assert callbacks.PrecisionAdvisor(steps=counts, log_every_n_steps=counts).steps == 20
    assert callbacks.StallMonitor(log_every_n_steps=counts).log_every_n_steps == 20
    assert callbacks.StateResetScheduler(period=counts, threshold=0.5, check_every_n_steps=np.int32(5)).period == 20
    with pytest.raises(ValueError, match="PrecisionAdvisor: steps=.*must be a positive int"):
        callbacks.PrecisionAdvisor(steps=np.bool_(True))


class ActivationDtype(Regressor):
    """Records the dtype of the network's output (autocast's)."""

    def training_step(self, batch, batch_idx):
        x, _ = step_batch(self.global_step)
        self.activation_dtype = self(x).dtype
        return super().training_step(batch, batch_idx)


def test_mixed_precision_autocasts_on_the_models_device(tmp_path, monkeypatch):
    """A plugin built where CUDA is available and given to a CPU Trainer autocasts on the CPU, as ``precision="bf16-mixed"``
    does (it autocast for "cuda": fp32 activations, silently), and 16-mixed's GradScaler is the CPU's."""
    with monkeypatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        plugins = {name: QStatePrecision(name, min_quant_size=0) for name in ("bf16-mixed", "16-mixed")}
    assert {plugin.device for plugin in plugins.values()} == {"cuda"}
    for name, dtype in (("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)):
        model = ActivationDtype()
        trainer(tmp_path, 1, plugins=[plugins[name]]).fit(model, regression_data())
        assert model.activation_dtype == dtype and plugins[name].device == "cpu", name
    assert plugins["16-mixed"].scaler._device == "cpu"
    fixed = QStatePrecision("bf16-mixed", device="cpu")
    trainer(tmp_path, 1, plugins=[fixed]).fit(ActivationDtype(), regression_data())
    assert fixed.device == "cpu"


class Overflowing(Regressor):
    """An inf gradient at the first three steps: a GradScaler halves its scale at each."""

    def on_after_backward(self) -> None:
        if self.global_step < 3:
            self.net[0].weight.grad[0, 0] = float("inf")

    def on_train_start(self) -> None:
        self.scale_at_start = self.trainer.precision_plugin.scaler.get_scale()


@pytest.mark.parametrize("saved_by", ["plugin", "lightning"])
def test_the_gradscaler_state_crosses_between_the_plugin_and_lightnings_own(tmp_path, saved_by):
    """Lightning keeps a precision plugin's state under its class name: a 16-mixed run saved by the plugin and resumed with
    Lightning's ``MixedPrecision`` (and the callback), or the other way, restarted the GradScaler at 65536."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    def plugin(kind: str):
        return QStatePrecision("16-mixed", min_quant_size=0) if kind == "plugin" else MixedPrecision("16-mixed", "cpu")

    def extra(kind: str) -> list:
        return [] if kind == "plugin" else [QuantizedOptimizerStates(min_quant_size=0, log_stats=False)]

    resumed_by = "lightning" if saved_by == "plugin" else "plugin"
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="ckpt", every_n_train_steps=4, save_top_k=-1)
    first = trainer(tmp_path / "a", 4, plugins=[plugin(saved_by)], enable_checkpointing=True, callbacks=[checkpoint, *extra(saved_by)])
    first.fit(Overflowing(), regression_data())
    saved = first.precision_plugin.scaler.get_scale()
    assert saved == 65536.0 / 8
    resumed = Overflowing()
    trainer(tmp_path / "b", 6, plugins=[plugin(resumed_by)], callbacks=extra(resumed_by)).fit(
        resumed, regression_data(), ckpt_path=str(tmp_path / "ckpt" / "ckpt.ckpt")
    )
    assert resumed.scale_at_start == saved


# --- Lightning features beside the plugins and callbacks (hunt_lit) ---------------------------------------------------
class OnGrid(pl.Callback):
    """Records, at the start of training, whether the weights are bf16 values."""

    def on_train_start(self, trainer, pl_module) -> None:
        self.on_grid = all(torch.equal(p, p.bfloat16().float()) for name, p in pl_module.named_parameters() if name.endswith("weight"))


def test_a_tuner_callbacks_checkpoint_is_no_resume_for_the_weight_grid(tmp_path):
    """``LearningRateFinder`` runs first and restores its temporary checkpoint (setting ``trainer.ckpt_path``): the fit
    still starts fresh, so ``QuantizedOptimizerStates(weights=...)`` puts the weights on their grid (it took the fit for
    a resume and left them off it)."""
    from lightning.pytorch.callbacks import LearningRateFinder

    class Tunable(Regressor):
        def train_dataloader(self):
            return regression_data(samples=160)

    spy = OnGrid()
    states = QuantizedOptimizerStates(states="int8", min_quant_size=0, weights="bf16", weight_overrides={"*.weight": "bf16"})
    finder = LearningRateFinder(min_lr=1e-4, max_lr=1e-1, num_training_steps=8)
    quiet_trainer(tmp_path, max_steps=2, callbacks=[states, spy, finder]).fit(Tunable(scheduler=False))
    assert spy.on_grid

    # a resumed fit with a finder stays a resume: its weights are not rounded again (an int8 grid of bf16 weights
    # moves them where rounded twice)
    class AtStart(pl.Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.weights = {name: p.detach().clone() for name, p in pl_module.named_parameters()}

    def int8_states() -> QuantizedOptimizerStates:
        return QuantizedOptimizerStates(states="int8", min_quant_size=0, weights="int8", weight_overrides={"*.weight": "int8"})

    first = quiet_trainer(tmp_path, max_steps=4, precision="bf16-true", callbacks=[int8_states()])
    first.fit(Tunable(scheduler=False))
    first.save_checkpoint(tmp_path / "resume.ckpt")
    saved = torch.load(tmp_path / "resume.ckpt", weights_only=False)["state_dict"]
    spy = AtStart()
    finder = LearningRateFinder(min_lr=1e-4, max_lr=1e-1, num_training_steps=8)
    resumed = quiet_trainer(tmp_path, max_steps=5, precision="bf16-true", callbacks=[int8_states(), spy, finder])
    resumed.fit(Tunable(scheduler=False), ckpt_path=tmp_path / "resume.ckpt")
    assert all(torch.equal(spy.weights[name], saved[name]) for name in saved)


@pytest.mark.parametrize("use_plugin", [True, False], ids=["plugin", "callback"])
def test_configure_optimizers_returning_none_trains_as_in_lightning(tmp_path, use_plugin):
    """Lightning steps a module whose ``configure_optimizers`` returns ``None`` with a placeholder optimizer without
    param groups: left as it is (wrapping it raised "optimizer got an empty parameter list")."""

    class NoOptimizer(Regressor):
        def configure_optimizers(self):
            return None

    quantize = dict(states="int8", min_quant_size=0)
    extra = {"plugins": [QStatePrecision(**quantize)]} if use_plugin else {"callbacks": [QuantizedOptimizerStates(**quantize)]}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", ".*configure_optimizers.*")
        trainer = quiet_trainer(tmp_path, max_steps=3, **extra)
        trainer.fit(NoOptimizer(), regression_data())
    assert trainer.global_step == 3


def test_optimizer_ids_are_renumbered_to_the_module_order_for_fsdp_loads():
    """Lightning's FSDP1 and FSDP2 loads name a one-file checkpoint's parameter ids by the module's order: states saved
    packed (one device, DDP) by an optimizer whose groups list the parameters otherwise (the usual weight-decay split)
    went to other parameters (an error where the shapes differ, silently where they match). ``in_module_order``
    renumbers them first; a state dict without packed states (FSDP saved it: module order already) stays as it is."""
    from lightning_qstate.plugins.strategies import in_module_order

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 32))
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.ndim == 2]}, {"params": [p for p in params if p.ndim != 2], "weight_decay": 0.0}]
    optimizer = QAdamW(groups, min_quant_size=0)
    model(torch.randn(5, 16)).square().sum().backward()
    optimizer.step()
    saved = optimizer.state_dict()
    renumbered = in_module_order(saved, model, optimizer)
    assert [group["params"] for group in renumbered["param_groups"]] == [[0, 4], [1, 2, 3, 5]]
    assert [renumbered["state"][index]["exp_avg"]["shape"] for index in range(6)] == [list(param.shape) for param in params]
    fp32 = {**saved, "state": {index: {"step": entries["step"]} for index, entries in saved["state"].items()}}
    assert in_module_order(fp32, model, optimizer) is fp32
