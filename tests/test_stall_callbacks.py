"""StallMonitor and StateResetScheduler on a single device: what they measure, log, reset and checkpoint."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_qstate.callbacks import QuantizedOptimizerStates, StallMonitor, StateResetScheduler, state_reset
from lightning_qstate.callbacks.summary import reset_line
from lightning_qstate.formats import count_stalls
from lightning_qstate.plugins import QStatePrecision
from lightning_qstate.theory import reset_period, stall_probability

from lightning_models import MemoryLogger, Regressor, flat_weights, regression_data, step_batch

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")


class TrackingSpy(Callback):
    """Records, at every optimizer step, whether the optimizer counts stalls in it."""

    def __init__(self) -> None:
        self.tracked: dict[int, bool] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.tracked[trainer.global_step + 1] = trainer.strategy.optimizers[0].track_stalls


def fit(tmp_path, model=None, max_steps=10, callbacks=(), plugins=None, logger=None, ckpt_path=None, **kwargs) -> pl.Trainer:
    options = dict(
        accelerator="cpu", devices=1, max_steps=max_steps, default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, logger=logger if logger is not None else False, callbacks=list(callbacks),
        plugins=plugins if plugins is not None else [QStatePrecision(states="bf16", min_quant_size=0)],
    )  # fmt: skip
    trainer = pl.Trainer(**{**options, **kwargs})
    trainer.fit(model or Regressor(scheduler=False), regression_data(), ckpt_path=ckpt_path)
    return trainer


# --- StallMonitor ------------------------------------------------------------------------------------------
class RatioSpy(Callback):
    """Records, before every optimizer step, ``g²/v`` and ``g/m`` of ``net.0.weight``'s moving entries (``g`` clipped as
    the Trainer will), and after it the states' values."""

    def __init__(self) -> None:
        self.ratios: dict[int, dict[str, torch.Tensor]] = {}
        self.values: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        state = trainer.strategy.optimizers[0].state[pl_module.net[0].weight]
        self.values[trainer.global_step] = {name: state[name].dequantize() for name in ("exp_avg_sq", "exp_avg")}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        state = trainer.strategy.optimizers[0].state.get(pl_module.net[0].weight, {})
        if "exp_avg_sq" in state:
            params = [p for p in pl_module.parameters() if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params]))
            scale = min(1.0, trainer.gradient_clip_val / (float(norm) + 1e-6)) if trainer.gradient_clip_val else 1.0
            grad = (pl_module.net[0].weight.grad * scale).reshape(-1)
            ratios = {}
            for name, inputs in (("exp_avg_sq", grad.square()), ("exp_avg", grad)):
                values = state[name].dequantize().reshape(-1)
                moving = (values != 0) | (grad != 0)
                ratios[name] = torch.where(values[moving] != 0, inputs[moving] / values[moving], torch.inf)
            self.ratios[trainer.global_step + 1] = ratios


@pytest.mark.parametrize("clip", [None, 0.05])
def test_monitor_measures_one_step_per_interval_and_logs_measured_and_predicted(tmp_path, clip):
    """The prediction follows the measured step: the ratios g²/v and g/m of its moving entries (after clipping) in
    place of the Gaussian model; it tracks the measured rate where the age model is far off."""
    logger, spy, ratios = MemoryLogger(), TrackingSpy(), RatioSpy()
    callbacks = [StallMonitor(per_layer=True, log_every_n_steps=4), spy, ratios]
    trainer = fit(tmp_path, max_steps=12, callbacks=callbacks, logger=logger, gradient_clip_val=clip)
    assert [step for step, on in sorted(spy.tracked.items()) if on] == [4, 8, 12]  # tracking only on the measured steps
    optimizer = trainer.strategy.optimizers[0]
    assert not optimizer.track_stalls and not optimizer._stall_counts
    measured = logger.values("qstate/stall/exp_avg_sq/net.0.weight")
    predicted = logger.values("qstate/stall_predicted/exp_avg_sq/net.0.weight")
    assert len(measured) == 3 and all(0.0 <= rate <= 1.0 for rate in measured)
    expected = [
        stall_probability("bf16", 0.999, ratios=ratios.ratios[step]["exp_avg_sq"], values=ratios.values[step]["exp_avg_sq"])
        for step in (4, 8, 12)
    ]
    assert predicted == pytest.approx(expected, rel=1e-6)
    assert max(predicted) < stall_probability("bf16", 0.999) / 2  # a young v stalls far less than in the steady state
    assert max(abs(m - p) for m, p in zip(measured, predicted, strict=True)) < 0.05  # 64 entries of bf16
    first = [
        stall_probability("bf16", 0.9, moment="first", ratios=ratios.ratios[step]["exp_avg"], values=ratios.values[step]["exp_avg"])
        for step in (4, 8, 12)
    ]
    assert logger.values("qstate/stall_predicted/exp_avg/net.0.weight") == pytest.approx(first, rel=1e-6)
    model_wide = logger.values("qstate/stall/exp_avg_sq")
    assert len(model_wide) == 3 and all(0.0 <= rate <= 1.0 for rate in model_wide)
    assert "qstate/stall_predicted/exp_avg_sq" in logger.records[-1][1]


def test_monitor_samples_the_ratios_of_large_states(tmp_path, monkeypatch):
    """Above MAX_RATIOS moving entries a state's ratios are a uniform sample: the same run predicts within sampling
    error of its prediction from all of them (net.0.weight: 7200 entries)."""
    from lightning_qstate.callbacks import stall_monitor

    def predictions(folder: str) -> tuple[list[float], StallMonitor]:
        logger, monitor = MemoryLogger(), StallMonitor(per_layer=True, log_every_n_steps=4)
        fit(tmp_path / folder, max_steps=12, callbacks=[monitor], logger=logger)
        return logger.values("qstate/stall_predicted/exp_avg_sq/net.0.weight"), monitor

    full, _ = predictions("full")
    monkeypatch.setattr(stall_monitor, "MAX_RATIOS", 1024)
    sampled, monitor = predictions("sampled")
    assert max(ratios.numel() for ratios in monitor._ratios.values()) == 1024
    assert len(full) == len(sampled) == 3 and full != sampled
    assert max(abs(a - b) for a, b in zip(full, sampled, strict=True)) < 0.05, (full, sampled)


def test_monitor_rates_equal_the_counts_of_the_step(tmp_path):
    """The logged rate is the optimizer's in-step count of that very step, checked against a recount."""
    monitor, logger = StallMonitor(log_every_n_steps=3, per_layer=True, histograms=False), MemoryLogger()

    class Recount(Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            opt = trainer.strategy.optimizers[0]
            state = opt.state[pl_module.net[0].weight]["exp_avg_sq"] if opt.state.get(pl_module.net[0].weight) else None
            # copies: the C++ step updates the state's storage in place
            self.before = None if state is None else (state.dequantize(torch.float32).reshape(-1).clone(), state.unit_values().clone())
            self.grad = pl_module.net[0].weight.grad.clone()

        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 6:
                opt = trainer.strategy.optimizers[0]
                beta2 = opt.param_groups[0]["betas"][1]
                before, before_units = self.before
                updated = before * beta2 + (1 - beta2) * self.grad.reshape(-1) ** 2
                new = opt.state[pl_module.net[0].weight]["exp_avg_sq"]
                stalled, moved = count_stalls(before, updated, new.dequantize(torch.float32).reshape(-1), before_units, new.unit_values())
                self.rate = float(stalled) / float(moved)

    recount = Recount()
    fit(tmp_path, max_steps=6, callbacks=[monitor, recount], logger=logger, plugins=[QStatePrecision(states="bf16", min_quant_size=0)])
    assert logger.values("qstate/stall/exp_avg_sq/net.0.weight")[-1] == pytest.approx(recount.rate, abs=2e-3)


def test_monitor_writes_tensorboard_histograms(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="tb")
    fit(tmp_path, max_steps=4, callbacks=[StallMonitor(per_layer=True, log_every_n_steps=2)], logger=logger)
    logger.experiment.flush()
    events = EventAccumulator(logger.log_dir, size_guidance={"histograms": 0, "scalars": 0}).Reload()
    assert "qstate/stall/exp_avg_sq/layers" in events.Tags()["histograms"]
    assert "qstate/stall/exp_avg_sq" in events.Tags()["scalars"]


def test_monitor_keeps_user_tracking_and_warns_without_quantized_states(tmp_path):
    trainer = fit(
        tmp_path,
        max_steps=4,
        callbacks=[StallMonitor(per_layer=True, log_every_n_steps=2)],
        plugins=[QStatePrecision(states="int8", min_quant_size=0, track_stalls=True)],
    )
    assert trainer.strategy.optimizers[0].track_stalls
    with pytest.warns(UserWarning, match="no optimizer has quantized states"):
        fit(tmp_path, max_steps=2, callbacks=[StallMonitor()], plugins=[])
    with pytest.raises(ValueError, match="log_every_n_steps=0"):
        StallMonitor(per_layer=True, log_every_n_steps=0)


# --- StateResetScheduler -------------------------------------------------------------------------------------
class StateSpy(Callback):
    """Snapshots, after each step, the exp_avg_sq of net.0.weight and Adam's step count."""

    def __init__(self) -> None:
        self.zero: dict[int, bool] = {}
        self.step: dict[int, float] = {}
        self.format: dict[int, str] = {}

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        state = trainer.strategy.optimizers[0].state[pl_module.net[0].weight]
        self.zero[trainer.global_step] = bool((state["exp_avg_sq"].dequantize() == 0).all() and (state["exp_avg"].dequantize() == 0).all())
        self.step[trainer.global_step] = float(state["step"])
        self.format[trainer.global_step] = state["exp_avg_sq"].format.name


@pytest.mark.parametrize("reset_step", [False, True])
def test_periodic_resets_zero_the_states_and_keep_their_formats(tmp_path, reset_step):
    spy, logger = StateSpy(), MemoryLogger()
    scheduler = StateResetScheduler(period=3, reset_step=reset_step)
    fit(tmp_path, max_steps=8, callbacks=[scheduler, spy], logger=logger, plugins=[QStatePrecision(states="int8", min_quant_size=0)])
    assert [step for step, zero in sorted(spy.zero.items()) if zero] == [3, 6]
    assert set(spy.format.values()) == {"int8"}
    assert spy.step[3] == (0.0 if reset_step else 3.0) and spy.step[4] == (1.0 if reset_step else 4.0)
    assert sorted({step for step, _ in scheduler.history}) == [3, 6] and len(scheduler.history) == 2 * 6  # six parameters
    assert logger.values("qstate/reset/total") == [6.0, 12.0] and logger.values("qstate/reset/layers") == [6.0, 6.0]
    ratio = logger.values("qstate/reset/first_step_ratio")[0]
    assert ratio == pytest.approx(1.0 if reset_step else 0.1 * (1 - 0.999**4) ** 0.5 / ((1 - 0.9**4) * 0.001**0.5))


def test_auto_period_follows_the_theory_and_skips_fp32(tmp_path):
    model = Regressor(scheduler=False)
    spy = StateSpy()
    scheduler = StateResetScheduler()  # auto
    plugin = QStatePrecision(states="e2m2", min_quant_size=0, overrides={"net.1.*": "fp32"})

    class Betas(Regressor):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=self.lr, betas=(0.9, 0.99))

    model = Betas(scheduler=False)
    fit(tmp_path, model=model, max_steps=105, callbacks=[scheduler, spy], plugins=[plugin])
    period = reset_period("e2m2", 0.99)
    assert period == 50
    assert [step for step, zero in sorted(spy.zero.items()) if zero] == [50, 100]
    assert not any(layer.startswith("net.1.") for _, layer in scheduler.history)  # fp32 states are never reset


@pytest.mark.parametrize("wrapped", [False, True])
def test_stagger_spreads_the_first_resets(tmp_path, wrapped):
    """Also for a wrapped optimizer, whose states (and so its layers) appear at its first step: they all reset at step
    6, their phases given only at the start of training."""

    class RMSprop(Regressor):
        def configure_optimizers(self):
            return torch.optim.RMSprop(self.parameters(), lr=1e-3)

    scheduler = StateResetScheduler(period=6, stagger=True)
    model = RMSprop(scheduler=False) if wrapped else None
    fit(tmp_path, model=model, max_steps=6, callbacks=[scheduler], plugins=[QStatePrecision(states="int8", min_quant_size=0)])
    first = {}
    for step, layer in scheduler.history:
        first.setdefault(layer, step)
    assert sorted(first.values()) == [1, 2, 3, 4, 5, 6]


def test_threshold_trigger_resets_layers_that_measurably_stall(tmp_path):
    logger = MemoryLogger()
    scheduler = StateResetScheduler(period=None, threshold=0.5, check_every_n_steps=5, states=["exp_avg_sq", "exp_avg"])
    monitor = StallMonitor(per_layer=True, log_every_n_steps=5)
    fit(tmp_path, max_steps=20, callbacks=[monitor, scheduler], logger=logger, plugins=[QStatePrecision(states="e2m2", min_quant_size=0)])
    rates = {step: metrics for step, metrics in logger.records if "qstate/stall/exp_avg_sq/net.0.weight" in metrics}
    assert scheduler.history, "e2m2 states at β2 = 0.999 stall above 0.5 within a few steps"
    for step, _layer in scheduler.history:
        assert step % 5 == 0
    reset_at = sorted({step for step, layer in scheduler.history if layer == "net.0.weight"})
    logged = [metrics["qstate/stall/exp_avg_sq/net.0.weight"] for metrics in rates.values()]
    assert reset_at and len(logged) == 4 and max(logged) >= 0.5  # the monitor saw what triggered the reset (shared measurement)


def test_fp32_states_are_left_alone_unless_forced(tmp_path):
    with pytest.warns(UserWarning, match="no quantized state to reset"):
        fit(tmp_path, max_steps=2, callbacks=[StateResetScheduler(period=1)], plugins=[QStatePrecision(states="fp32")])
    with pytest.warns(UserWarning, match="slightly hurts"):
        forced = StateResetScheduler(period=1, include_fp32=True)
    fit(tmp_path, max_steps=2, callbacks=[forced], plugins=[QStatePrecision(states="fp32")])
    assert len(forced.history) == 2 * 6


def test_resume_continues_the_reset_schedule_exactly(tmp_path):
    plugin = lambda: QStatePrecision(states="int8", min_quant_size=0)  # noqa: E731
    straight_model, straight = Regressor(), StateResetScheduler(period=3, stagger=True)
    fit(tmp_path / "a", model=straight_model, max_steps=10, callbacks=[straight], plugins=[plugin()])
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    fit(
        tmp_path / "b",
        model=Regressor(),
        max_steps=4,
        callbacks=[StateResetScheduler(period=3, stagger=True), checkpoint],
        plugins=[plugin()],
        enable_checkpointing=True,
    )
    resumed_model, resumed = Regressor(), StateResetScheduler(period=3, stagger=True)
    ckpt = str(next((tmp_path / "ckpt").glob("*.ckpt")))
    fit(tmp_path / "c", model=resumed_model, max_steps=10, callbacks=[resumed], plugins=[plugin()], ckpt_path=ckpt)
    assert resumed.history == straight.history and resumed.last_reset == straight.last_reset
    assert torch.equal(flat_weights(resumed_model), flat_weights(straight_model))


def test_scheduler_with_the_callback_and_bad_options(tmp_path):
    scheduler = StateResetScheduler(period=2, states=["exp_avg_sq"])
    fit(
        tmp_path, max_steps=4, callbacks=[QuantizedOptimizerStates(states="int4", min_quant_size=0, log_stats=False), scheduler], plugins=[]
    )
    assert sorted({step for step, _ in scheduler.history}) == [2, 4]
    with pytest.raises(ValueError, match=r"unknown state name\(s\) \['momentum'\]"):
        fit(tmp_path, max_steps=1, callbacks=[StateResetScheduler(states=["momentum"])])
    with pytest.raises(ValueError, match="period=0"):
        StateResetScheduler(period=0)
    with pytest.raises(ValueError, match="threshold=1.5"):
        StateResetScheduler(threshold=1.5)
    with pytest.raises(ValueError, match="period=None needs a threshold"):
        StateResetScheduler(period=None)


def test_monitor_and_resets_cover_sgd_momentum(tmp_path):
    class Momentum(Regressor):
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)

    logger, scheduler = MemoryLogger(), StateResetScheduler(period=3)
    monitor = StallMonitor(per_layer=True, log_every_n_steps=2)
    fit(tmp_path, model=Momentum(scheduler=False), max_steps=6, callbacks=[monitor, scheduler], logger=logger,
        plugins=[QStatePrecision(states="e2m2", min_quant_size=0)])  # fmt: skip
    # SGD's b <- 0.9·b + g is the EMA of 10·g: the prediction follows the measured rate (without the factor it
    # would see the gradients 10x smaller than they are, as if they were near zero, and predict stalls by the half)
    measured, predicted = logger.values("qstate/stall/momentum_buffer"), logger.values("qstate/stall_predicted/momentum_buffer")
    assert len(measured) == len(predicted) == 3 and all(0.0 <= rate <= 1.0 for rate in measured)
    assert max(abs(m - p) for m, p in zip(measured, predicted, strict=True)) < 0.1, (measured, predicted)
    assert sorted({step for step, _ in scheduler.history}) == [3, 6]


def test_monitor_measures_amsgrad_maximum_without_a_prediction(tmp_path):
    """AMSGrad's ``max_exp_avg_sq`` is a running maximum, not an EMA of g² (it moves only where ``v`` passes it): its
    rate is measured and no prediction is logged for it (the EMA model predicted it as ``exp_avg_sq``)."""

    class AmsGrad(Regressor):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, amsgrad=True)

    logger = MemoryLogger()
    fit(tmp_path, model=AmsGrad(scheduler=False), max_steps=4, callbacks=[StallMonitor(per_layer=True, log_every_n_steps=2)],
        logger=logger, plugins=[QStatePrecision(states="int8", min_quant_size=0)])  # fmt: skip
    tags = {tag for _, metrics in logger.records for tag in metrics}
    assert {"qstate/stall/max_exp_avg_sq", "qstate/stall/max_exp_avg_sq/net.0.weight", "qstate/stall_predicted/exp_avg_sq"} <= tags
    assert not any(tag.startswith("qstate/stall_predicted/max_exp_avg_sq") for tag in tags)
    assert all(0.0 <= rate <= 1.0 for rate in logger.values("qstate/stall/max_exp_avg_sq"))
    # nor does StateResetScheduler(period="auto") time a layer by it: where it is the only quantized state, no period
    scheduler = StateResetScheduler()
    trainer = fit(tmp_path, model=AmsGrad(scheduler=False), max_steps=2, callbacks=[scheduler],
                  plugins=[QStatePrecision(states={"max_exp_avg_sq": "bf16"}, min_quant_size=0)])  # fmt: skip
    layers = scheduler.layers(trainer)
    assert layers and all(scheduler.layer_period(rows) is None for rows in layers.values())


def test_tensorboard_tells_the_story(tmp_path):
    """Model-wide rates only by default, each tag with its description, one custom-scalars chart per state holding the
    measured and predicted rates and the resets, which are logged on the measured steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    logger = TensorBoardLogger(tmp_path, name="tb", version=0)
    scheduler = StateResetScheduler(period=4)
    fit(tmp_path, max_steps=12, callbacks=[StallMonitor(log_every_n_steps=2), scheduler], logger=logger, log_every_n_steps=2)
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"qstate/stall/exp_avg_sq", "qstate/stall_predicted/exp_avg_sq", "qstate/stall_resets", "qstate/reset/total"} <= set(scalars)
    assert not any(tag.startswith("qstate/stall/exp_avg_sq/") for tag in scalars)  # per_layer is opt-in
    # every layer reset after steps 4, 8 and 12: counted on the measured steps they act on (6 and 10; 12's comes after)
    assert [event.value for event in events.Scalars("qstate/stall_resets")] == [0.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert [step for step, _ in scheduler.history][:2] == [4, 4]
    for tag in ("qstate/stall/exp_avg_sq", "qstate/stall_predicted/exp_avg", "qstate/stall_resets", "qstate/reset/total"):
        assert "stall" in events.SummaryMetadata(tag).summary_description or "reset" in events.SummaryMetadata(tag).summary_description, tag
    layout = layout_pb2.Layout()
    layout.ParseFromString(events.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0])
    charts = {chart.title: list(chart.multiline.tag) for category in layout.category for chart in category.chart}
    assert charts["exp_avg_sq"] == ["^qstate/stall/exp_avg_sq$", "^qstate/stall_predicted/exp_avg_sq$", "^qstate/stall_resets$"]
    assert set(charts) == {"exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize(("kind", "state"), [("Adagrad", "sum"), ("RMSprop", "square_avg"), ("NAdam", "exp_avg_sq")])
def test_monitor_and_resets_cover_wrapped_optimizers(tmp_path, kind, state):
    """Adagrad makes its states in its constructor, RMSprop and NAdam at their first step: their watched states were
    cached before that step, empty for the whole fit (nothing measured, nothing reset)."""

    class Wrapped(Regressor):
        def configure_optimizers(self):
            return getattr(torch.optim, kind)(self.parameters(), lr=1e-3)

    logger, scheduler = MemoryLogger(), StateResetScheduler(period=2)
    fit(tmp_path, model=Wrapped(scheduler=False), max_steps=4, logger=logger,
        callbacks=[StallMonitor(per_layer=True, log_every_n_steps=2), scheduler],
        plugins=[QStatePrecision(states="bf16", min_quant_size=0)])  # fmt: skip
    ema = kind != "Adagrad"  # Adagrad's sum is no EMA: no prediction, nothing to reset
    assert len(logger.values(f"qstate/stall/{state}/net.0.weight")) == 2
    assert any(key.startswith("qstate/stall_predicted") for _, metrics in logger.records for key in metrics) == ema
    assert bool(scheduler.state_dict()["history"]) == ema


class RMSpropRegressor(Regressor):
    def configure_optimizers(self):
        return torch.optim.RMSprop(self.parameters(), lr=1e-3, momentum=0.9)


def test_wrapped_optimizers_states_are_checked_and_charted_once_they_exist(tmp_path):
    """A wrapped optimizer (RMSprop) makes its states at its first step: a misspelt ``states=`` name of the scheduler
    was accepted (no reset ever) beside a warning that there were only fp32 states, also given where the names were
    right; the TensorBoard layout, written before that step, had no stall chart. Both follow the states now."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2

    misspelt = StateResetScheduler(period=2, states=["square_avgg"])
    with pytest.raises(
        ValueError, match=r"unknown state name\(s\) \['square_avgg'\] in states=; the optimizers have \['momentum_buffer', "
    ):
        fit(tmp_path, model=RMSpropRegressor(scheduler=False), max_steps=4, callbacks=[misspelt])
    logger, scheduler = TensorBoardLogger(tmp_path, name="tb", version=0), StateResetScheduler(period=2, states=["square_avg"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path, model=RMSpropRegressor(scheduler=False), max_steps=4, logger=logger, log_every_n_steps=2,
            callbacks=[scheduler, StallMonitor(log_every_n_steps=2)])  # fmt: skip
    assert not [w for w in caught if "no quantized state to reset" in str(w.message)]
    assert sorted({step for step, _ in scheduler.history}) == [2, 4]
    events = EventAccumulator(str(tmp_path / "tb" / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    layout = layout_pb2.Layout()
    layout.ParseFromString(events.Tensors("custom_scalars__config__")[-1].tensor_proto.string_val[0])
    assert {chart.title for category in layout.category for chart in category.chart} == {"momentum_buffer", "square_avg"}


def test_rmsprop_momentum_ratios_take_its_normalized_gradient(tmp_path):
    """RMSprop's buffer is the EMA of d/((sqrt(v) + eps)(1 - μ)), v this step's square_avg (``theory.state_input`` with
    the states); the monitor took d (ratios ~40 times too small: 0.50 predicted where 0.25 was measured)."""
    from lightning_qstate.callbacks.stall_monitor import measured_ratios
    from lightning_qstate.theory import state_input

    class Check(Callback):
        checked = 0

        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            ratios = measured_ratios(trainer)
            if ("net.0.weight", "momentum_buffer") not in ratios:
                return
            param = pl_module.net[0].weight
            state = optimizer.state[param]
            inputs = state_input(optimizer.param_groups[0], "momentum_buffer", param.grad.reshape(-1), param.detach().reshape(-1), state)
            values = state["momentum_buffer"].dequantize().reshape(-1)
            expected = torch.where(values != 0, inputs / values, torch.inf)[(inputs != 0) | (values != 0)]
            assert torch.equal(ratios["net.0.weight", "momentum_buffer"], expected)
            Check.checked += 1

    fit(tmp_path, model=RMSpropRegressor(scheduler=False), max_steps=3, callbacks=[Check()])
    assert Check.checked == 2


# --- changes during training, resumes, counting ------------------------------------------------------------------
class HeadFirst(Regressor):
    """Trains the head first; ``JoinBackbone`` adds ``net.0`` to the optimizer later (as BackboneFinetuning does)."""

    def configure_optimizers(self):
        return torch.optim.AdamW(self.net[1:].parameters(), lr=self.lr)


class JoinBackbone(Callback):
    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        if trainer.global_step == 2:
            trainer.optimizers[0].add_param_group({"params": list(pl_module.net[0].parameters())})


def test_layers_added_during_training_are_staggered_from_when_they_join(tmp_path):
    """Layers joining after a period were phased from step 0: all due at once, reset together at their first step (a
    wrapped optimizer's states one step old zeroed) and in lockstep after. They start from the step they join now."""

    class JoinLate(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            if trainer.global_step == 8:
                trainer.optimizers[0].add_param_group({"params": list(pl_module.net[0].parameters())})

    scheduler = StateResetScheduler(period=6, stagger=True)
    fit(tmp_path, model=HeadFirst(scheduler=False), max_steps=20, callbacks=[JoinLate(), scheduler])
    resets = {layer: [step for step, name in scheduler.history if name == layer] for layer in ("net.0.weight", "net.0.bias")}
    assert sorted(steps[0] for steps in resets.values()) == [11, 14], resets  # joined at step 8: phases 0 and 3 of 6


def test_layers_added_during_training_are_reset_and_measured(tmp_path):
    """A param group added on the same optimizer is reset and measured (the rows were cached per optimizer object)."""
    logger, scheduler = MemoryLogger(), StateResetScheduler(period=3)
    fit(tmp_path, model=HeadFirst(scheduler=False), max_steps=8, logger=logger, log_every_n_steps=1,
        callbacks=[JoinBackbone(), scheduler, StallMonitor(per_layer=True, log_every_n_steps=2)])  # fmt: skip
    assert "net.0.weight" in {layer for _, layer in scheduler.history}
    assert "qstate/stall/exp_avg_sq/net.0.weight" in logger.keys()


def test_resets_count_the_layers_they_zero(tmp_path):
    """A layer without states (frozen, yet held by the optimizer) is not counted as reset; a state Adam never makes
    without amsgrad is refused at fit start (nothing was zeroed, and every layer was counted every period)."""
    model = Regressor(scheduler=False)
    model.net[0].requires_grad_(False)
    logger, scheduler = MemoryLogger(), StateResetScheduler(period=3)
    fit(tmp_path, model=model, max_steps=6, logger=logger, log_every_n_steps=1, callbacks=[scheduler])
    assert logger.values("qstate/reset/layers") == [4.0, 4.0] and "net.0.weight" not in {layer for _, layer in scheduler.history}
    unused = Regressor(scheduler=False)
    unused.spare = torch.nn.Linear(4, 4)  # trainable, in the optimizer, never given a gradient: no state to reset
    scheduler = StateResetScheduler(period=3)
    fit(tmp_path, model=unused, max_steps=6, callbacks=[scheduler])
    assert {layer for _, layer in scheduler.history} == {f"net.{i}.{kind}" for i in (0, 1, 3) for kind in ("weight", "bias")}
    with pytest.raises(ValueError, match="'max_exp_avg_sq', which Adam keeps only with amsgrad=True"):
        fit(tmp_path, max_steps=2, callbacks=[StateResetScheduler(period=3, states=["max_exp_avg_sq"])])


def test_a_scheduler_used_again_starts_a_fresh_fit_afresh(tmp_path):
    """The same StateResetScheduler given to a second fit without a checkpoint kept the first fit's last resets (and
    history): period 4 reset at steps 4 and 8 in the first fit, at none in the second."""
    scheduler = StateResetScheduler(period=4)
    histories = []
    for _ in range(2):
        fit(tmp_path, max_steps=10, callbacks=[scheduler])
        histories.append(list(scheduler.history))
    assert histories[0] == histories[1] and sorted({step for step, _ in histories[0]}) == [4, 8]


def test_first_step_ratio_follows_the_states_zeroed():
    """m alone rebuilt (v steady) gives (1 - β1)/(1 - β1^t), both the closed form of a full reset, v alone nothing."""
    from lightning_qstate.callbacks.state_reset import first_step_ratio

    group, state = {"betas": (0.9, 0.999)}, {"step": torch.tensor(99.0)}
    full = first_step_ratio(group, state, False)
    assert full == pytest.approx(0.1 * (1 - 0.999**100) ** 0.5 / ((1 - 0.9**100) * 0.001**0.5))
    assert first_step_ratio(group, state, False, ["exp_avg"]) == pytest.approx(0.1 / (1 - 0.9**100))
    assert first_step_ratio(group, state, False, ["exp_avg_sq"]) is None
    assert first_step_ratio(group, state, True) == first_step_ratio(group, state, True, ["exp_avg"]) == pytest.approx(1.0)


def test_monitor_reset_fraction_is_of_layers_and_survives_a_resume(tmp_path):
    """``qstate/stall_resets`` counts each layer once per window (2.0 and 3.0 were logged as a "fraction"), and a run
    resumed between two measurements counts the resets since the last one before the checkpoint (it dropped them)."""

    def run(root, ckpt_path=None, max_steps=8):
        logger = MemoryLogger()
        callbacks = [StallMonitor(log_every_n_steps=4), StateResetScheduler(period=5)]
        if ckpt_path is None:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1))
        fit(root, max_steps=max_steps, logger=logger, log_every_n_steps=1, callbacks=callbacks, ckpt_path=ckpt_path,
            enable_checkpointing=ckpt_path is None)  # fmt: skip
        return [(step, metrics["qstate/stall_resets"]) for step, metrics in logger.records if "qstate/stall_resets" in metrics]

    straight = run(tmp_path / "a")
    resumed = run(tmp_path / "b", str(next((tmp_path / "ckpt").glob("*.ckpt"))))
    assert straight[-1:] == resumed == [(7, 1.0)]
    frequent = MemoryLogger()
    fit(tmp_path / "c", max_steps=12, logger=frequent, log_every_n_steps=1,
        callbacks=[StallMonitor(log_every_n_steps=6), StateResetScheduler(period=2)])  # fmt: skip
    assert frequent.values("qstate/stall_resets") == [1.0, 1.0]


def test_logging_turned_off_turns_the_measurements_off(tmp_path):
    spy = TrackingSpy()
    fit(tmp_path, max_steps=4, log_every_n_steps=0, callbacks=[StallMonitor(), spy])
    assert not any(spy.tracked.values())


def test_the_users_own_stall_counts_neither_change_the_measurement_nor_get_lost(tmp_path):
    """With ``track_stalls=True`` of the user's, the monitor still measures one step (it summed every step since the last
    measurement) and the user's counters keep every step's counts (they were emptied at each measurement)."""
    logged = []
    for tracked in (False, True):
        logger = MemoryLogger()
        trainer = fit(tmp_path, max_steps=8, logger=logger, log_every_n_steps=1, callbacks=[StallMonitor(log_every_n_steps=4)],
                      plugins=[QStatePrecision(states="int8", min_quant_size=0, track_stalls=tracked)])  # fmt: skip
        logged.append(logger.values("qstate/stall/exp_avg_sq"))
    weight = trainer.lightning_module.net[0].weight
    assert logged[0] == logged[1] and len(logged[0]) == 2
    assert int(trainer.strategy.optimizers[0].stall_counts()[weight]["exp_avg_sq"][1]) == 8 * weight.numel()  # every entry, 8 steps


def test_state_figures_are_logged_once_per_optimizer_step_under_accumulation(tmp_path):
    """With ``accumulate_grad_batches=3`` the callback logs once per optimizer step, as Lightning's own metrics (it logged
    at every micro-batch, the first ones before the first step: ``state_bytes`` 0)."""
    logger = MemoryLogger()
    fit(tmp_path, max_steps=3, logger=logger, log_every_n_steps=1, accumulate_grad_batches=3, plugins=[],
        callbacks=[QuantizedOptimizerStates(states="int8", min_quant_size=0)])  # fmt: skip
    steps = [step for step, metrics in logger.records if "qstate/state_bytes" in metrics]
    assert steps == [0, 1, 2] and 0.0 not in logger.values("qstate/state_bytes")


class TwoOptimizers(pl.LightningModule):
    """Manual optimization, GAN-style: optimizer 0 (``first``) steps on every batch, optimizer 1 (``second``) on every
    other one, so the global step counts both."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(24, 64), torch.nn.Linear(64, 8)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        x, y = step_batch(batch_idx, 0)
        loss = torch.nn.functional.mse_loss(self.second(torch.relu(self.first(x))), y)
        first, second = self.optimizers()
        first.zero_grad()
        second.zero_grad()
        self.manual_backward(loss)
        first.step()
        if batch_idx % 2:
            second.step()

    def configure_optimizers(self):
        return [torch.optim.AdamW(self.first.parameters(), lr=1e-2), torch.optim.AdamW(self.second.parameters(), lr=1e-2)]


class OwnStepSpy(Callback):
    """Records, per optimizer, its own steps on which it counted stalls, and the Adam step counts of ``first.weight`` and
    ``second.weight`` whenever their states were just zeroed."""

    def __init__(self) -> None:
        self.tracked: list[tuple[int, int]] = []
        self.reset_at: dict[str, list[int]] = {"first": [], "second": []}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if optimizer.track_stalls:
            self.tracked.append((trainer.strategy.optimizers.index(optimizer), optimizer.steps_taken + 1))

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        for index, name in enumerate(self.reset_at):
            state = trainer.strategy.optimizers[index].state.get(getattr(pl_module, name).weight, {})
            zeroed = "exp_avg_sq" in state and not state["exp_avg_sq"].dequantize().any()
            if zeroed and int(state["step"]) not in self.reset_at[name]:  # still zero on a batch it did not step in
                self.reset_at[name].append(int(state["step"]))


def test_several_optimizers_are_measured_and_reset_on_their_own_steps(tmp_path):
    """Under manual optimization the global step counts every optimizer's steps: each optimizer is measured on every
    n-th of its own steps (all were tracked whenever any one completed an interval, and a measurement summed several
    steps) and its layers reset every ``period`` of their own updates (they reset twice as often)."""
    logger, spy, scheduler = MemoryLogger(), OwnStepSpy(), StateResetScheduler(period=3)
    trainer = fit(tmp_path, model=TwoOptimizers(), max_steps=18, logger=logger, log_every_n_steps=1,
                  callbacks=[StallMonitor(log_every_n_steps=2, per_layer=True), scheduler, spy])  # fmt: skip
    assert [optimizer.steps_taken for optimizer in trainer.strategy.optimizers] == [12, 6]
    assert spy.tracked == [(0, 2), (0, 4), (1, 2), (0, 6), (0, 8), (1, 4), (0, 10), (0, 12), (1, 6)]
    assert len(logger.values("qstate/stall/exp_avg_sq/first.weight")) == 6
    assert len(logger.values("qstate/stall/exp_avg_sq/second.weight")) == 3
    assert spy.reset_at == {"first": [3, 6, 9, 12], "second": [3, 6]}
    resets = [(step, f"{name}.{part}") for name, steps in spy.reset_at.items() for step in steps for part in ("weight", "bias")]
    assert sorted(scheduler.history) == sorted(resets)


class SmallGradients(Regressor):
    """The loss scaled by 0.1: Adam's ``v`` of the first layer lies below fp16's smallest normal, 6.1e-5."""

    def training_step(self, batch, batch_idx):
        return 1e-1 * super().training_step(batch, batch_idx)


def test_monitor_predicts_the_stalls_of_a_subnormal_fp16_state(tmp_path):
    """An fp16 ``v`` below 6.1e-5 has the subnormals' absolute gaps: the prediction follows the measured rate (it
    modelled normal-range gaps: a few points against 0.6-0.7)."""
    logger = MemoryLogger()
    trainer = fit(tmp_path, model=SmallGradients(scheduler=False), max_steps=12, logger=logger, log_every_n_steps=1,
                  callbacks=[StallMonitor(log_every_n_steps=4)], plugins=[QStatePrecision(states="fp16", min_quant_size=0)])  # fmt: skip
    v = trainer.strategy.optimizers[0].state[trainer.lightning_module.net[0].weight]["exp_avg_sq"].dequantize()
    assert float((v < torch.finfo(torch.float16).smallest_normal).float().mean()) > 0.9
    measured, predicted = logger.values("qstate/stall/exp_avg_sq"), logger.values("qstate/stall_predicted/exp_avg_sq")
    assert len(measured) == 3 and min(measured) > 0.4
    assert max(abs(m - p) for m, p in zip(measured, predicted, strict=True)) < 0.05


def test_monitor_keeps_a_bounded_cache_of_its_predictions(monkeypatch):
    """The predictions of states without measured values (all zero) are cached by age, which grows every step: at most
    ``MAX_PREDICTIONS`` are kept (the oldest dropped), and a dropped one is computed again alike."""
    from lightning_qstate.callbacks import stall_monitor
    from lightning_qstate.callbacks.stall_counts import StateRow
    from lightning_qstate.optim import QAdamW

    monkeypatch.setattr(stall_monitor, "MAX_PREDICTIONS", 3)
    param = torch.nn.Parameter(torch.zeros(64))
    optimizer = QAdamW([param], states="int8", min_quant_size=0)
    row = StateRow("w", "exp_avg_sq", optimizer, optimizer.param_groups[0], param)
    monitor = StallMonitor()
    first = [monitor.predicted(row, age) for age in range(1, 11)]
    assert len(monitor._predictions) == 3 and [key[-1] for key in monitor._predictions] == [8, 9, 10]
    assert [monitor.predicted(row, age) for age in range(1, 11)] == first
    assert first == [stall_probability("int8", 0.999, "nearest", moment="second", age=age) for age in range(1, 11)]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_frozen_layer_is_phased_when_its_states_appear(tmp_path, optimizer):
    """A parameter frozen at the start (in the optimizer, ``requires_grad`` off) and unfrozen later: its schedule starts
    when its states are made, so its first reset comes a whole period later (it was phased from the start of training:
    its new states were zeroed after one step)."""
    period, unfreeze_at = 5, 4

    class Unfreeze(Callback):
        made: int | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            pl_module.net[0].weight.requires_grad_(trainer.global_step >= unfreeze_at)

        def on_train_batch_end(self, trainer, pl_module, *args) -> None:
            if self.made is None and trainer.strategy.optimizers[0].state.get(pl_module.net[0].weight):
                self.made = trainer.global_step

    class Frozen(Regressor):
        def configure_optimizers(self):
            if optimizer == "sgd":
                return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9)
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    unfreeze, scheduler = Unfreeze(), StateResetScheduler(period=period)
    fit(tmp_path, model=Frozen(scheduler=False), max_steps=14, callbacks=[unfreeze, scheduler],
        plugins=[QStatePrecision(states="int8", min_quant_size=0)])  # fmt: skip
    resets = sorted(step for step, layer in scheduler.history if layer == "net.0.weight")
    assert unfreeze.made == unfreeze_at + 1 and resets == [unfreeze.made - 1 + period, unfreeze.made - 1 + 2 * period]
    assert [step for step, layer in scheduler.history if layer == "net.3.weight"] == [5, 10]


def test_a_trainer_fitted_again_from_an_earlier_checkpoint_measures_its_new_optimizer(tmp_path):
    """The measurement cache is per trainer and optimizers: a second fit of the same trainer, resumed to a step the first
    fit measured, measures its own optimizer (it got the old optimizer's measurement: nothing logged, and the new
    optimizer's stall tracking never switched back off)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def make(logger: MemoryLogger) -> pl.Trainer:
        callbacks = [StallMonitor(log_every_n_steps=2), ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=4, save_top_k=-1)]
        return pl.Trainer(
            accelerator="cpu", devices=1, max_steps=10, default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False,
            logger=logger, log_every_n_steps=1, callbacks=callbacks, plugins=[QStatePrecision(states="int4", min_quant_size=0)],
        )  # fmt: skip

    first = make(MemoryLogger())
    first.fit(Regressor(scheduler=False), regression_data(samples=80))
    checkpoint = tmp_path / "epoch=0-step=8.ckpt"
    again = MemoryLogger()
    first.loggers = [again]
    first.fit(Regressor(scheduler=False), regression_data(samples=80), ckpt_path=checkpoint)
    fresh_logger = MemoryLogger()
    fresh = make(fresh_logger)
    fresh.fit(Regressor(scheduler=False), regression_data(samples=80), ckpt_path=checkpoint)

    def measured(logger: MemoryLogger) -> list[int]:
        return [step for step, metrics in logger.records if "qstate/stall/exp_avg" in metrics]

    assert measured(again) == measured(fresh_logger) == [9]
    assert not first.strategy.optimizers[0].track_stalls and not fresh.strategy.optimizers[0].track_stalls


def test_a_frozen_layer_costs_no_collective_at_each_step(tmp_path, monkeypatch):
    """A layer frozen in the optimizer (the same on every rank) is left out of phasing without a collective: it cost an
    all-reduce at every step under DDP/FSDP while it had no states."""
    from lightning_qstate.callbacks import state_reset

    calls = []
    real = state_reset.across_ranks

    def counted(trainer, local, reduce_op):
        calls.append(trainer.global_step)
        return real(trainer, local, reduce_op)

    monkeypatch.setattr(state_reset, "across_ranks", counted)

    class Frozen(Regressor):
        def __init__(self) -> None:
            super().__init__(scheduler=False)
            self.net[0].weight.requires_grad_(False)

    fit(tmp_path, model=Frozen(), max_steps=8, callbacks=[StateResetScheduler(period=100)],
        plugins=[QStatePrecision(states="int8", min_quant_size=0)])  # fmt: skip
    assert [step for step in calls if step > 1] == []


def test_auto_period_under_a_cycled_beta_is_computed_once_per_rounded_decay(tmp_path, monkeypatch, request):
    """OneCycleLR and CyclicLR give Adam's ``beta1`` a new value every step: ``period="auto"`` computes a period (25-450
    ms) once per decay with ``1 - β`` rounded to two significant digits, not at every step, and keeps a bounded cache;
    the usual decays are taken as they are."""
    computed = []

    def period_of(beta):
        return round(1.0 / (1.0 - beta))

    def counted(fmt, beta, rounding="nearest", *, moment="second"):
        computed.append(beta)
        return period_of(beta)

    monkeypatch.setattr(state_reset, "reset_period", counted)
    state_reset._theory_period.cache_clear()
    request.addfinalizer(state_reset._theory_period.cache_clear)  # the fake periods stay out of later tests
    scheduler = StateResetScheduler()
    trainer = fit(tmp_path, max_steps=1, callbacks=[scheduler], plugins=[QStatePrecision(states="e2m2", min_quant_size=0)])
    rows = scheduler.layers(trainer)["net.0.weight"]
    group = rows[0].group
    assert scheduler.layer_period(rows) == 10 and sorted(computed) == [0.9, 0.999]  # torch's defaults, unrounded
    cycled = torch.linspace(0.85, 0.95, 1000).tolist()  # OneCycleLR's default momentum range, 1000 steps
    for beta1 in cycled:
        group["betas"] = (beta1, 0.999)
        assert scheduler.layer_period(rows) == period_of(1.0 - float(f"{1.0 - beta1:.2g}"))  # m's, the shorter
    rounded = {1.0 - float(f"{1.0 - beta1:.2g}") for beta1 in cycled}
    assert len(computed) == len(set(computed)) and set(computed) == rounded | {0.999} and len(rounded) < 60  # each once
    assert state_reset._theory_period.cache_info().currsize <= state_reset._theory_period.cache_info().maxsize


@pytest.mark.parametrize(
    ("period", "states", "reason"),
    [
        (None, "int8", "measured stall rates under threshold=0.5"),
        ("auto", "fp16", "formats that need no resets, measured stall rates under threshold=0.5"),  # fp16: no period
    ],
)
def test_the_summary_says_why_a_layer_was_never_reset(tmp_path, period, states, reason):
    """A threshold-only scheduler (``period=None``) leaves a layer alone because its measured stall rate stayed under the
    threshold, not because its format needs no resets (int8 does): the run summary's reason said the latter."""
    scheduler = StateResetScheduler(period=period, threshold=0.5)
    trainer = fit(tmp_path, max_steps=1, callbacks=[scheduler], plugins=[QStatePrecision(states=states, min_quant_size=0)])
    scheduler.history = [(1, "net.0.weight")]
    layers = len(scheduler.layers(trainer)) - 1
    assert reset_line(scheduler, trainer).endswith(f"; {layers} layers never reset ({reason})")
