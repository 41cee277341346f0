"""PrecisionAdvisor on a single device: the report (printed, TensorBoard text, warnings, strict), the planned steps, the
gradient format of the run, and the weights' stall rates logged during training."""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.precision import FSDPPrecision, HalfPrecision, MixedPrecision, Precision

from lightning_qstate.callbacks import PrecisionAdvisor, StallMonitor
from lightning_qstate.callbacks.precision_advisor import gradient_format
from lightning_qstate.plugins import QStatePrecision
from lightning_qstate.theory.precision import required_mantissa_bits

from lightning_models import MemoryLogger, Regressor, regression_data

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")


class StepCounter(Callback):
    """Counts the optimizer steps that reached ``on_before_optimizer_step``."""

    def __init__(self) -> None:
        self.steps = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.steps += 1


class AdagradRegressor(Regressor):
    def configure_optimizers(self):
        return torch.optim.Adagrad(self.parameters(), lr=self.lr)


def fit(tmp_path, advisor, model=None, plugins=None, logger=None, callbacks=(), **kwargs) -> pl.Trainer:
    """A quiet CPU fit of ``model`` (a Regressor without scheduler) with ``advisor``; ``plugins`` default bf16 states (RN)."""
    options = dict(
        accelerator="cpu", devices=1, max_steps=4, default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0, logger=logger if logger is not None else False,
        callbacks=[advisor, *callbacks], plugins=plugins if plugins is not None else [QStatePrecision(states="bf16", min_quant_size=0)],
    )  # fmt: skip
    trainer = pl.Trainer(**{**options, **kwargs})
    trainer.fit(model or Regressor(scheduler=False), regression_data())
    return trainer


def advisor_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("PrecisionAdvisor")]


# --- the report -----------------------------------------------------------------------------------------------------
def test_report_is_printed_and_logged_as_tensorboard_text(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path, name="tb")
    advisor = PrecisionAdvisor(log_weight_stalls=False)
    with pytest.warns(UserWarning, match="PrecisionAdvisor"):
        fit(tmp_path, advisor, logger=logger, max_steps=3)
    (report,) = advisor.reports
    assert report.steps == 3 and {row.component for row in report.rows} == {"grads", "weights", "exp_avg", "exp_avg_sq"}
    printed = capsys.readouterr().out
    assert "== PrecisionAdvisor:" in printed and str(report) in printed
    logger.experiment.flush()
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0}).Reload()
    (text,) = events.Tensors("qstate/precision_advice/text_summary")
    assert text.step == 0 and text.tensor_proto.string_val[0].decode() == report.to_markdown()


def test_bf16_round_to_nearest_states_warn_of_the_stall_ratchet(tmp_path):
    advisor = PrecisionAdvisor(log_weight_stalls=False, verbose=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(tmp_path, advisor)  # AdamW at β2 = 0.999, bf16 states written round-to-nearest
    messages = advisor_warnings(record)
    (second_moment,) = [row for row in advisor.reports[0].risky if row.component == "exp_avg_sq"]
    assert second_moment.verdict == "insufficient" and second_moment.format == "bf16"
    assert len(messages) == len(advisor.reports[0].risky)  # one line per risky component
    (line,) = [message for message in messages if " exp_avg_sq in bf16 " in message]
    assert "insufficient" in line and "stall ratchet" in line and "\n" not in line


def test_fp32_run_has_no_risky_component(tmp_path):
    advisor = PrecisionAdvisor(log_weight_stalls=False, verbose=False)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(tmp_path, advisor, plugins=[])  # torch's AdamW, fp32 everywhere
    assert advisor.reports[0].rows and not advisor.reports[0].risky
    assert advisor_warnings(record) == []


def test_strict_raises_before_the_first_step(tmp_path):
    counter = StepCounter()
    with pytest.warns(UserWarning, match="PrecisionAdvisor"), pytest.raises(ValueError, match=r"strict=True.*\n.*exp_avg_sq in bf16"):
        fit(tmp_path, PrecisionAdvisor(strict=True, verbose=False), callbacks=[counter])
    assert counter.steps == 0
    trainer = fit(tmp_path, PrecisionAdvisor(strict=True, log_weight_stalls=False, verbose=False), plugins=[], callbacks=[counter])
    assert counter.steps == trainer.global_step == 4  # nothing at risk: trains


def test_optimizer_without_a_rule_is_skipped_with_a_warning(tmp_path):
    advisor = PrecisionAdvisor(strict=True, log_weight_stalls=False, verbose=False)
    with pytest.warns(UserWarning, match="Adagrad is not advised"):
        trainer = fit(tmp_path, advisor, model=AdagradRegressor(scheduler=False), plugins=[])
    assert advisor.reports == [] and trainer.global_step == 4


# --- the planned steps and the run's formats ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("advisor_steps", "trainer_options", "expected"),
    [
        (None, {"max_steps": 7}, 7),
        (None, {"max_steps": -1, "max_epochs": 2}, 8),  # 4 batches per epoch
        (None, {"max_steps": -1, "max_epochs": 2, "accumulate_grad_batches": 2}, 4),
        (None, {"max_steps": 3000, "max_epochs": 1}, 4),  # the epochs end the run first
        (5000, {"max_steps": 3}, 5000),
    ],
)
def test_planned_steps(tmp_path, advisor_steps, trainer_options, expected):
    advisor = PrecisionAdvisor(steps=advisor_steps, log_weight_stalls=False, verbose=False)
    fit(tmp_path, advisor, plugins=[], **trainer_options)
    assert advisor.reports[0].steps == expected


def test_run_of_unknown_length_raises(tmp_path):
    with pytest.raises(ValueError, match=r"length is unknown.*max_steps=\.\.\..*PrecisionAdvisor\(steps=\.\.\.\)"):
        fit(tmp_path, PrecisionAdvisor(verbose=False), plugins=[], max_steps=-1, max_epochs=-1)


class TwoOptimizers(Regressor):
    """Manual optimization with two AdamW, each stepped once per batch: Lightning's global step counts both."""

    def __init__(self) -> None:
        super().__init__(scheduler=False)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        x, y = batch
        self.manual_backward(torch.nn.functional.mse_loss(self(x), y))
        for optimizer in (first, second):
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        return [torch.optim.AdamW(self.net[:2].parameters(), lr=1e-9), torch.optim.AdamW(self.net[2:].parameters(), lr=1e-9)]


def test_several_optimizers_need_the_steps_each_takes(tmp_path, capsys):
    """max_steps counts every optimizer's steps under manual optimization: each was advised for T = max_steps, twice
    its own run; the advisor asks for ``steps`` instead. The run summary names each optimizer's risky rows."""
    from lightning_qstate.callbacks import RunSummary

    with pytest.raises(ValueError, match=r"with 2 optimizers \(manual optimization\) Lightning counts the steps of all.*steps=\.\.\."):
        fit(tmp_path, PrecisionAdvisor(verbose=False), model=TwoOptimizers(), plugins=[QStatePrecision("bf16-true", states="fp32")])
    advisor = PrecisionAdvisor(steps=2, log_weight_stalls=False, verbose=False, constants={("adam", "grads", "nearest"): np.float64(1)})
    with pytest.warns(UserWarning):  # lr 1e-9 moves no bf16 weight: both optimizers' weights insufficient
        fit(tmp_path, advisor, model=TwoOptimizers(), plugins=[QStatePrecision("bf16-true", states="fp32")], callbacks=[RunSummary()])
    assert [report.steps for report in advisor.reports] == [2, 2]
    line = next(line for line in capsys.readouterr().out.splitlines() if "precision advisor:" in line)
    assert "optimizer 0 (AdamW) group 0 weights bf16: insufficient" in line and "optimizer 1 (AdamW) group 0 weights" in line


def test_constants_change_the_bits_needed(tmp_path):
    constants = {("adam", "exp_avg_sq", "nearest"): -30.0}
    advisor = PrecisionAdvisor(steps=1024, constants=constants, log_weight_stalls=False, verbose=False)
    fit(tmp_path, advisor, plugins=[], max_steps=1)
    (row,) = [row for row in advisor.reports[0].rows if row.component == "exp_avg_sq"]
    assert row.required_bits == required_mantissa_bits("exp_avg_sq", 1024, "adam", "nearest", constant=-30.0) == 0.0


def test_gradient_format_follows_the_precision_plugin():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    assert gradient_format(HalfPrecision("bf16-true"), optimizer) == "bf16"
    assert gradient_format(HalfPrecision("16-true"), optimizer) == "fp16"
    assert gradient_format(MixedPrecision("bf16-mixed", "cpu"), optimizer) is None  # fp32 gradients of fp32 parameters
    assert gradient_format(Precision(), optimizer) is None
    assert gradient_format(FSDPPrecision("bf16-mixed"), optimizer) == "bf16"  # FSDP reduces the gradients in bf16
    assert gradient_format(QStatePrecision("bf16-true"), optimizer) == "bf16"
    optimizer.param_groups[0]["grads"] = "e4m3"  # a group's own gradient format: advise reads it
    assert gradient_format(HalfPrecision("bf16-true"), optimizer) is None


def test_bf16_true_run_is_advised_on_bf16_gradients_and_weights(tmp_path):
    advisor = PrecisionAdvisor(log_weight_stalls=False, verbose=False)
    with pytest.warns(UserWarning, match="PrecisionAdvisor"):
        fit(tmp_path, advisor, plugins=[QStatePrecision("bf16-true", states="bf16", min_quant_size=0)])
    formats = {row.component: row.format for row in advisor.reports[0].rows}
    assert formats["grads"] == "bf16" and formats["weights"] == "bf16"


def test_learning_rate_too_small_for_bf16_weights_names_the_layers(tmp_path):
    advisor = PrecisionAdvisor(log_weight_stalls=False, verbose=False)
    with pytest.warns(UserWarning, match=r"weights in bf16 .* insufficient.*net\.0\.weight"):
        fit(
            tmp_path, advisor, model=Regressor(lr=1e-9, scheduler=False), plugins=[QStatePrecision("bf16-true", states="fp32")], max_steps=1
        )
    (weights,) = [row for row in advisor.reports[0].rows if row.component == "weights"]
    assert weights.verdict == "insufficient" and any("FlashOptim" in reason for reason in weights.reasons)


# --- weight stall rates ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "plugin",
    [
        lambda: QStatePrecision("bf16-true", states="bf16", min_quant_size=0),
        # fp32 parameters kept on the bf16 grid without master weights (every layer: weights= alone picks block linears)
        lambda: QStatePrecision(
            states="int8", min_quant_size=0, weights="bf16", weight_rounding="nearest", weight_overrides={"net.*": "bf16"}
        ),
    ],
    ids=["bf16-true", "weights=bf16"],
)
def test_weight_stall_rates_are_logged_per_layer_and_model_wide(tmp_path, plugin):
    logger = MemoryLogger()
    advisor = PrecisionAdvisor(log_every_n_steps=2, verbose=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(tmp_path, advisor, model=Regressor(lr=1e-2, scheduler=False), plugins=[plugin()], logger=logger, max_steps=6)
    model_wide = logger.values("qstate/weight_stall")
    assert len(model_wide) == 3 and all(0.0 <= rate <= 1.0 for rate in model_wide)
    layers = {key for key in logger.keys() if key.startswith("qstate/weight_stall/")}
    assert "qstate/weight_stall/net.0.weight" in layers and "qstate/weight_stall/net.3.weight" in layers
    assert all(0.0 <= rate <= 1.0 for key in layers for rate in logger.values(key))
    assert [step for step, metrics in logger.records if "qstate/weight_stall" in metrics] == [1, 3, 5]  # Lightning's step of the batch

    # lr 1e-6: moves the fp32 weights, but by far less than half the bf16 spacing of entries of ~0.1 (2^-12)
    tiny = MemoryLogger()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(tmp_path, PrecisionAdvisor(log_every_n_steps=2, verbose=False), model=Regressor(lr=1e-6, scheduler=False), plugins=[plugin()],
            logger=tiny, max_steps=2)  # fmt: skip
    (first_matrix,) = tiny.values("qstate/weight_stall/net.0.weight")
    (norm_bias,) = tiny.values("qstate/weight_stall/net.1.bias")  # zero-initialised: bf16 holds a 1e-6 step near 0
    (rate,) = tiny.values("qstate/weight_stall")
    assert first_matrix > 0.99 and norm_bias < 0.01 and 0.95 < rate < 1.0 and rate > max(model_wide)


def test_weight_stalls_share_the_measured_step_with_the_stall_monitor(tmp_path):
    logger = MemoryLogger()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        monitor = StallMonitor(per_layer=True, log_every_n_steps=2)
        trainer = fit(tmp_path, PrecisionAdvisor(log_every_n_steps=2, verbose=False), callbacks=[monitor],
                      logger=logger, plugins=[QStatePrecision("bf16-true", states="bf16", min_quant_size=0)])  # fmt: skip
    weights, states = logger.values("qstate/weight_stall"), logger.values("qstate/stall/exp_avg_sq")
    assert len(weights) == len(states) == 2 and all(0.0 <= rate <= 1.0 for rate in weights + states)
    assert not trainer.strategy.optimizers[0].track_stalls  # tracking switched back off after the measured steps


def test_plain_torch_optimizer_warns_and_logs_no_weight_stalls(tmp_path):
    logger = MemoryLogger()
    with pytest.warns(UserWarning, match="weight stall rates need a lightning_qstate optimizer.*AdamW does not count them"):
        fit(tmp_path, PrecisionAdvisor(verbose=False), plugins=[], logger=logger, log_every_n_steps=1)
    assert logger.records and not any(key.startswith("qstate/weight_stall") for key in logger.keys())


# --- arguments ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"steps": 0}, "steps=0 must be a positive int"),
        ({"steps": 10.0}, "steps=10.0 must be a positive int"),
        ({"steps": True}, "steps=True must be a positive int"),
        ({"log_every_n_steps": 0}, "log_every_n_steps=0 must be a positive int"),
        ({"strict": "yes"}, "strict='yes' must be True or False"),
        ({"log_weight_stalls": 1}, "log_weight_stalls=1 must be True or False"),
        ({"per_layer": None}, "per_layer=None must be True or False"),
        ({"verbose": 0}, "verbose=0 must be True or False"),
        ({"constants": [1.0]}, r"constants=\[1.0\] must be a dict"),
        ({"constants": {("adam", "v", "nearest"): 1.0}}, r"key \('adam', 'v', 'nearest'\) is not valid.*'exp_avg_sq'"),
        ({"constants": {("muon", "exp_avg_sq", "nearest"): 1.0}}, "no 'exp_avg_sq' for muon"),
        ({"constants": {("adam", "grads", "nearest"): math.nan}}, "must be a finite number"),
        ({"constants": {("adam", "grads", "nearest"): "7"}}, "must be a finite number"),
    ],
)
def test_invalid_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrecisionAdvisor(**kwargs)


# --- formats that change during training ------------------------------------------------------------------------------
@pytest.mark.parametrize("advisor_first", [True, False], ids=["advisor-first", "planner-first"])
def test_a_plan_that_changes_the_formats_is_advised_again(tmp_path, capsys, advisor_first):
    """AdaptiveBitWidth's first check (step 0) replaces the formats it started with: the advisor advises the new plan at
    that step, whichever callback comes first, so its reports describe the formats that train (they described a plan
    that never trained, or the plugin's int8 before any plan)."""
    from lightning_qstate.callbacks import AdaptiveBitWidth
    from lightning_qstate.theory.precision import advise

    advisor = PrecisionAdvisor(log_weight_stalls=False)
    adaptive = AdaptiveBitWidth(target_bits=5.1, interval=2, hysteresis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first, second = (advisor, adaptive) if advisor_first else (adaptive, advisor)  # fit's callbacks: its second argument first
        trainer = fit(tmp_path, first, plugins=[QStatePrecision(states="int8", min_quant_size=0)], max_steps=5, callbacks=[second])
    printed = capsys.readouterr().out
    titles = [line for line in printed.splitlines() if line.startswith("== PrecisionAdvisor:")]
    assert titles[0] == "== PrecisionAdvisor: AdamW ==" and "== PrecisionAdvisor: AdamW (the state formats changed at step 0) ==" in titles
    optimizer = trainer.strategy.optimizers[0]
    final = {(row.group, row.component): row.format for row in advise(optimizer, 5).rows}
    (report,) = advisor.reports
    assert {(row.group, row.component): row.format for row in report.rows} == final
    assert str(report) not in printed.split(titles[1])[0] and str(report) in printed.split(titles[-1])[1]  # the start's did not train


def test_a_state_re_encoded_by_hand_is_advised_again(tmp_path, capsys):
    """``reencode_state`` moves ``format_changes``: the report at the next hook names the new format."""

    class ReEncode(Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 2:
                optimizer = trainer.strategy.optimizers[0]
                for param in pl_module.parameters():
                    optimizer.reencode_state(param, "exp_avg", "int4")

    advisor = PrecisionAdvisor(log_weight_stalls=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit(tmp_path, advisor, plugins=[QStatePrecision(states="int8", min_quant_size=0)], callbacks=[ReEncode()])
    assert "(the state formats changed at step 2)" in capsys.readouterr().out
    assert {row.component: row.format for row in advisor.reports[0].rows}["exp_avg"].startswith("int4")
