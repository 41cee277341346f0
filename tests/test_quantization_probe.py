"""QuantizationProbe on the GPT example: what it logs (scalars, the ABC figure), that its numbers are the library's on the
fixed validation batches, that training is exactly as without it, and its argument checks."""

from __future__ import annotations

import math
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_qstate.arguments import ConfigurationError
from lightning_qstate.callbacks import QuantizationProbe
from lightning_qstate.probes import abc_decomposition, ptq

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from examples.data import ByteTextDataModule  # noqa: E402
from examples.gpt import GPTModule  # noqa: E402

from lightning_models import Regressor, flat_weights, quiet_trainer, regression_data  # noqa: E402

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")

MODEL = {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 16, "warmup_steps": 2}


def fit(tmp_path, callbacks, epochs: int = 2, logger=None) -> tuple[pl.Trainer, GPTModule]:
    pl.seed_everything(0, verbose=False)
    module = GPTModule(**MODEL, seed=0)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_epochs=epochs,
        limit_train_batches=3,
        limit_val_batches=2,
        logger=logger or False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        num_sanity_val_steps=1,
    )
    trainer.fit(module, ByteTextDataModule(seq_len=16, batch_size=4, val_windows=8))
    return trainer, module


def test_probe_logs_what_the_library_measures_and_leaves_training_unchanged(tmp_path):
    probe = QuantizationProbe(batches=2)
    logger = TensorBoardLogger(tmp_path, name="runs", version=0)
    trainer, module = fit(tmp_path, [probe], logger=logger)
    _, plain = fit(tmp_path / "plain", [])
    for (name, param), other in zip(module.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(param, other), name  # off the training path: no RNG drawn, the model restored exactly
    assert [result.step for result in probe.history] == [3, 6]
    result = probe.history[-1]
    assert len(probe._batches) == 2  # the first two validation batches, kept from the first validation
    module.eval()
    with torch.no_grad():
        losses = [module._loss(batch).item() for batch in probe._batches]
        with ptq(module):
            quantized = [module._loss(batch).item() for batch in probe._batches]
        abc = [abc_decomposition(module, batch, forward=lambda m, b: m._loss(b)) for batch in probe._batches]
    assert result.loss == pytest.approx(sum(losses) / 2, rel=1e-6) and result.ptq_loss == pytest.approx(sum(quantized) / 2, rel=1e-6)
    assert result.ptq_loss_increase == result.ptq_loss - result.loss and result.ptq_loss != result.loss and result.seconds > 0
    assert result.R_L == pytest.approx(sum(run.R_L for run in abc) / 2, rel=1e-6)
    assert [row.name for row in result.abc.units] == ["model.transformer.h.0", "model.transformer.h.1"] and len(result.abc.rows) == 10
    assert result.mmr > 1 and math.isfinite(result.kurtosis) and math.isfinite(result.kurtosis_channel_rms)
    events = EventAccumulator(str(tmp_path / "runs" / "version_0")).Reload()
    scalars = set(events.Tags()["scalars"])
    for name in ("loss", "ptq_loss", "ptq_loss_increase", "R_L", "mmr", "kurtosis", "kurtosis_channel_rms", "seconds"):
        assert f"qstate/probe/{name}" in scalars
    assert events.Scalars("qstate/probe/R_L")[-1].value == pytest.approx(result.R_L, rel=1e-5)
    images = events.Images("qstate/probe/abc")  # at the scalars' steps (Lightning's: one less; the figure was at 3, 6)
    assert [image.step for image in images] == [event.step for event in events.Scalars("qstate/probe/R_L")] == [2, 5]
    assert images[0].width >= 600 and images[0].height >= 400


def test_every_n_val_epochs_recipe_loss_fn_and_verbose(tmp_path, capsys):
    calls = []

    def loss_fn(module, batch):
        calls.append(1)
        return module._loss(batch)

    probe = QuantizationProbe(every_n_val_epochs=2, activations=None, loss_fn=loss_fn, log_images=False, verbose=True, modules=["*.mlp.*"])
    fit(tmp_path, [probe], epochs=4)
    assert [result.step for result in probe.history] == [6, 12] and probe.recipe == "Wint4A-"
    assert len(calls) == 2 * (1 + 1 + 2 + 1)  # per probe: the loss, the PTQ loss, the ABC's two forwards, the statistics' one
    assert "QuantizationProbe (Wint4A-) at step 12" in capsys.readouterr().out


def test_a_validation_step_without_the_loss_key_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"neither logs 'val_nll' \(it logged \['val_loss'\]\) nor returns a loss"):
        fit(tmp_path, [QuantizationProbe(loss_key="val_nll", log_images=False)])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"every_n_val_epochs": 0}, "every_n_val_epochs=0 must be a positive int"),
        ({"batches": 1.5}, "batches=1.5 must be a positive int"),
        ({"weights": None, "activations": None}, "quantize nothing"),
        ({"weights": "int3"}, "weights: PTQ format 'int3'"),
        ({"activations": "int4", "block": 100}, "QuantizationProbe: block=100 is not valid"),
        ({"block": "rows"}, "QuantizationProbe: block='rows' is not valid"),
        ({"modules": 5}, "modules=5 must be name patterns"),
        ({"loss_fn": lambda module, batch: 0.0, "loss_key": "val_nll"}, "loss_key='val_nll' names validation_step's logged loss"),
        ({"per_token": "yes"}, "per_token='yes' must be True or False"),
        ({"loss_fn": "val_loss"}, "loss_fn='val_loss' must be callable"),
        ({"units": []}, r"units=\[\] must be module names"),
        ({"units": [0, 1]}, r"units=\[0, 1\] must be module names"),
    ],
)
def test_bad_arguments_are_refused_up_front(kwargs, message):
    with pytest.raises(ValueError, match=message):
        QuantizationProbe(**kwargs)


def test_patterns_and_units_that_match_nothing_fail_at_fit_start(tmp_path):
    with pytest.raises(ValueError, match=r"modules=\['\*.typo'\] match no linear layer"):
        fit(tmp_path, [QuantizationProbe(modules=["*.typo"], log_images=False)])
    with pytest.raises(ConfigurationError, match="nope"):  # the CLI's usage error, not an AttributeError
        fit(tmp_path, [QuantizationProbe(units=["model.nope"], log_images=False)])


class BlocklessRegressor(Regressor):
    """A module whose layers are neither transformer blocks nor a Sequential of its own (``self.net`` is one)."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))


def test_default_units_that_do_not_exist_fail_before_training(tmp_path):
    """The default units (transformer blocks, or the module's Sequential children) are resolved at fit start and at
    validate start, not at the end of the first validation; ``units`` may name one module as a string."""
    trainer = quiet_trainer(tmp_path, max_steps=3, callbacks=[QuantizationProbe(log_images=False)], num_sanity_val_steps=0)
    model = BlocklessRegressor()
    before = flat_weights(model).clone()
    with pytest.raises(ValueError, match=r"QuantizationProbe: BlocklessRegressor has no transformer blocks.*units="):
        trainer.fit(model, regression_data(), regression_data())
    assert torch.equal(flat_weights(model), before)  # no step was taken
    with pytest.raises(ValueError, match=r"QuantizationProbe: BlocklessRegressor has no transformer blocks"):
        quiet_trainer(tmp_path, max_steps=3, callbacks=[QuantizationProbe(log_images=False)]).validate(model, regression_data())
    probe = QuantizationProbe(units="net", log_images=False)
    assert probe.units == ["net"]
    quiet_trainer(tmp_path, max_steps=3, callbacks=[probe]).validate(model, regression_data())
    assert len(probe.history) == 1 and math.isfinite(probe.history[0].R_L)


class DropoutRegressor(BlocklessRegressor):
    """BlocklessRegressor with dropout between its layers: a forward in train mode is random."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(24, 64), torch.nn.Dropout(0.5), torch.nn.GELU(), torch.nn.Linear(64, 8))


def test_a_resumed_run_probes_at_the_same_validations(tmp_path):
    """The count of validations comes back from the checkpoint (it was restored, then zeroed at fit start: a run resumed
    after the first of every second validation probed at the third, not the second and fourth)."""

    def run(max_steps: int, ckpt_path=None) -> tuple[pl.Trainer, QuantizationProbe]:
        probe = QuantizationProbe(every_n_val_epochs=2, units="net", log_images=False)
        trainer = quiet_trainer(tmp_path, max_steps=max_steps, callbacks=[probe], num_sanity_val_steps=0)
        trainer.fit(BlocklessRegressor(), regression_data(), regression_data(), ckpt_path=ckpt_path)  # 4 steps per epoch
        return trainer, probe

    _, straight = run(16)
    trainer, first = run(4)
    trainer.save_checkpoint(tmp_path / "first.ckpt")
    _, resumed = run(16, tmp_path / "first.ckpt")
    assert [r.step for r in straight.history] == [8, 16] and not first.history and [r.step for r in resumed.history] == [8, 16]


def test_probe_runs_in_eval_mode_and_needs_batches(tmp_path):
    """``probe()`` after a fit (the module back in train mode) runs in eval mode: two calls give the same figures (dropout
    made them random) and each module's mode is restored; before any validation it says what is missing."""
    with pytest.raises(ValueError, match="no validation batches captured yet"):
        QuantizationProbe(units="net", log_images=False).probe(DropoutRegressor())
    probe = QuantizationProbe(units="net", log_images=False)
    model = DropoutRegressor()
    quiet_trainer(tmp_path, max_steps=4, callbacks=[probe], num_sanity_val_steps=0).fit(model, regression_data(), regression_data())
    model.train()
    model.net[1].eval()
    first, second = probe.probe(model), probe.probe(model)
    assert (first.loss, first.ptq_loss, first.R_L) == (second.loss, second.ptq_loss, second.R_L)
    assert model.training and not model.net[1].training and model.net[0].training


class IndexedValidation(BlocklessRegressor):
    """A validation loss that depends on the batch's index (as a module whose data comes from it)."""

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", (batch_idx + 1) * torch.nn.functional.mse_loss(self(x), y))


def test_the_probe_passes_each_batch_its_index(tmp_path):
    """The probe's loss is the validation's on its first batches (``validation_step`` got index 0 for every one):
    ``regression_data``'s batches are alike, so batches 0, 1, 2 give 1, 2 and 3 times one loss, 2 on average."""
    probe, model = QuantizationProbe(units="net", batches=3, log_images=False), IndexedValidation()
    quiet_trainer(tmp_path, max_steps=3, callbacks=[probe]).validate(model, regression_data())
    x, y = next(iter(regression_data()))
    with torch.no_grad():
        single = float(torch.nn.functional.mse_loss(model(x), y))
    assert probe.history[0].loss == pytest.approx(2 * single, rel=1e-6)


def test_a_block_that_does_not_divide_the_inputs_fails_at_fit_start(tmp_path):
    probe = QuantizationProbe(units="net", block=16, log_images=False)  # the first layer takes 24 features
    model = BlocklessRegressor()
    before = flat_weights(model).clone()
    with pytest.raises(ValueError, match=r"block=16 does not divide the input features of \{'net.0': 24, 'net.3': 300\}"):
        quiet_trainer(tmp_path, max_steps=4, callbacks=[probe]).fit(model, regression_data(), regression_data())
    assert torch.equal(flat_weights(model), before)  # no step taken (it failed after the first epoch)


def test_results_are_averaged_over_the_ranks_as_logged():
    """Under DDP each rank probes its own batches; the result kept in ``history`` (and printed, drawn, summarized) is the
    mean over the ranks, as the logged figures are (it was each rank's own: rank 0 printed a negative PTQ cost)."""
    from lightning_qstate.callbacks.quantization_probe import ProbeResult, _across_ranks
    from lightning_qstate.probes import ABCResult, ABCRow

    def result(scale: float) -> ProbeResult:
        rows = [ABCRow("u0", "unit", 1 * scale, 0.5 * scale, 0.25 * scale, 0.25 * scale, math.nan, 0.0),
                ABCRow("u1", "unit", 2 * scale, 1 * scale, 0.5 * scale, 0.5 * scale, scale / scale, scale)]  # fmt: skip
        return ProbeResult(5, scale, 2 * scale, 2 * scale, 3 * scale, 4 * scale, 5 * scale, ABCResult(rows, False), 6 * scale)

    other = result(3.0)  # rank 1's

    class TwoRanks:  # the mean of this rank's figures and rank 1's, as DDPStrategy.reduce(..., "mean")
        root_device = torch.device("cpu")

        @staticmethod
        def reduce(local, reduce_op):
            assert reduce_op == "mean"
            return (local + figures(other)) / 2

    def figures(r: ProbeResult) -> torch.Tensor:
        rows = [v for row in r.abc.rows for v in (row.R, row.A, row.B, row.C, row.R_in)]
        return torch.tensor([r.loss, r.ptq_loss, r.mmr, r.kurtosis, r.kurtosis_channel_rms, r.seconds, *rows], dtype=torch.float64)

    trainer = type("Trainer", (), {"world_size": 2, "strategy": TwoRanks()})()
    mean = _across_ranks(result(1.0), trainer)
    assert (mean.step, mean.loss, mean.ptq_loss, mean.mmr, mean.seconds) == (5, 2.0, 4.0, 6.0, 12.0)
    assert [row.R for row in mean.abc.rows] == [2.0, 4.0] and mean.R_L == 4.0
    assert math.isnan(mean.abc.rows[0].G) and mean.abc.rows[1].G == 1.0  # mean A over mean R_in


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_the_probe_forwards_in_the_validation_precision(tmp_path, precision):
    """Under a mixed precision the validation runs under autocast: the probe's loss on the same batch is the logged
    ``val_loss`` (its forwards ran in fp32, another model than the one validated)."""
    probe, model = QuantizationProbe(units="net", batches=1, log_images=False), IndexedValidation()
    trainer = quiet_trainer(tmp_path, max_steps=1, callbacks=[probe], precision=precision, limit_val_batches=1)
    trainer.validate(model, regression_data())
    assert probe.history[0].loss == float(trainer.callback_metrics["val_loss"])


class NoisyValidation(BlocklessRegressor):
    """A validation loss with noise drawn from the global stream (as a denoising or VAE objective), preprocessed in
    place (``normalize(inplace=True)``), for two validation dataloaders (``dataloader_idx`` then required)."""

    def training_step(self, batch, batch_idx):  # draws from the global stream too: a probe that moved it changes training
        x, y = batch
        return torch.nn.functional.mse_loss(self(x + 0.01 * torch.randn_like(x)), y)

    def validation_step(self, batch, batch_idx, dataloader_idx):
        x, y = batch
        x.sub_(0.1).div_(1.5)
        self.log("val_loss", torch.nn.functional.mse_loss(self(x + 0.1 * torch.randn_like(x)), y))


def test_a_random_in_place_validation_step_with_two_loaders(tmp_path):
    """The probe ran validation_step without dataloader_idx (TypeError with two loaders), on the stored batches themselves
    (an in-place step changed them for every later forward) and on the global random stream (training then differed
    from a run without the probe, and each forward drew other noise): with a recipe that quantizes nothing, loss and
    PTQ loss differed and R_L was not 0. Now each forward of a batch draws the same noise on a copy, and the global
    stream is left as it was."""

    def run(callbacks):
        pl.seed_everything(0, verbose=False)
        model = NoisyValidation()
        trainer = quiet_trainer(tmp_path, max_steps=8, callbacks=callbacks, num_sanity_val_steps=0, val_check_interval=4)
        trainer.fit(model, regression_data(), [regression_data(), regression_data()])
        return model

    probe = QuantizationProbe(weights="fp32", activations="fp32", units="net", log_images=False)
    probed, plain = run([probe]), run([])
    assert torch.equal(flat_weights(probed), flat_weights(plain))
    assert len(probe.history) == 2 and all(r.loss == r.ptq_loss and r.R_L == 0.0 for r in probe.history), probe.history
    x, _ = next(iter(regression_data()))
    assert torch.equal(probe._batches[0][0], x)  # the stored batch as the loader gave it


def test_a_parametrized_layer_fails_at_fit_start(tmp_path):
    """A ``weight_norm`` layer failed only inside the first probe, after an epoch of training."""
    model = BlocklessRegressor()
    torch.nn.utils.parametrizations.weight_norm(model.net[3])
    trainer = quiet_trainer(tmp_path, max_steps=3, callbacks=[QuantizationProbe(units="net", log_images=False)])
    with pytest.raises(ConfigurationError, match=r"the weights of \['net.3'\] are parametrized"):
        trainer.fit(model, regression_data(), regression_data())
    assert trainer.global_step == 0
    QuantizationProbe(units="net", modules=["net.0"], log_images=False)._check_module(model)  # not selected: fine


class StepWithoutIndex(BlocklessRegressor):
    def validation_step(self, batch):  # Lightning passes batch_idx only where the step takes it
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))


def test_a_validation_step_without_batch_idx(tmp_path):
    probe = QuantizationProbe(units="net", log_images=False)
    quiet_trainer(tmp_path, max_steps=3, callbacks=[probe]).validate(StepWithoutIndex(), regression_data())
    assert len(probe.history) == 1 and math.isfinite(probe.history[0].R_L)
