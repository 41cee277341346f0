"""Training without fp32 master weights (ECO, ``weights=``/``error_feedback=``) under Lightning: the plugins and the
callback put the selected weights on their grid and keep them there, ``weight_overrides`` apply, resume is exact
(stochastic rounding of the weights included), and under DDP and FSDP2 (gloo, 2 processes) the ranks agree.

The model (``eco_worker.EcoModule``) has linear layers inside two repeated blocks (``net.blocks.<i>.fc1/fc2``: the
weights ECO's policy selects) and others outside them (``net.inp``, ``net.head``) that keep their dtype. The
multi-process runs are ``tests/eco_worker.py`` launched once per strategy (as ``test_distributed.py`` does).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_qstate.callbacks import QuantizedOptimizerStates, RunSummary
from lightning_qstate.formats import QuantizedTensor
from lightning_qstate.formats.weights import get_weight_grid
from lightning_qstate.optim import QAdamW
from lightning_qstate.plugins import QStateHalfPrecision, QStatePrecision

from eco_worker import BLOCK_WEIGHTS, EcoModule, eco_data
from lightning_models import quiet_trainer
from test_distributed import GLOO, TESTS, launch

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")
warnings.filterwarnings("ignore", ".*dataloader is not resumable.*")

STEPS, SAVE_STEP = 6, 3


def on_grid(param: torch.Tensor, weights: str, block="row") -> bool:
    """Whether ``param`` holds values of the grid of ``weights`` (one scale per row for block formats)."""
    grid = get_weight_grid(weights, block)
    return torch.equal(grid.round(param.detach().float(), "nearest").to(param.dtype), param.detach())


def named(model: EcoModule) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


class OnGridAtStart(Callback):
    """Records, at ``on_train_start`` (after the conversion and any checkpoint restore, before a step), which parameters
    are on the grid the optimizer keeps them on."""

    def __init__(self) -> None:
        self.on_grid: dict[str, bool] = {}
        self.error_dtypes: dict[str, torch.dtype] = {}  # of eco_exact's "weight_error" states

    def on_train_start(self, trainer, pl_module) -> None:
        optimizer = trainer.strategy.optimizers[0]
        names = {param: name for name, param in pl_module.named_parameters()}
        for group in optimizer.param_groups:
            for param in group["params"]:
                grid = optimizer.weight_grid(group, param)
                if grid is not None:
                    self.on_grid[names[param]] = on_grid(param, grid.name, grid.block)
                if "weight_error" in optimizer.state.get(param, {}):
                    self.error_dtypes[names[param]] = optimizer.state[param]["weight_error"].dtype


def same_states(first: torch.optim.Optimizer, second: torch.optim.Optimizer) -> None:
    """The two optimizers hold bit-identical states (codes, scales, formats, plain tensors) and SR streams."""
    params = [[p for group in opt.param_groups for p in group["params"]] for opt in (first, second)]
    assert first._rounding_seed == second._rounding_seed and first._rounding_step == second._rounding_step
    for index, (a, b) in enumerate(zip(*params, strict=True)):
        states, others = first.state[a], second.state[b]
        assert states.keys() == others.keys(), index
        for name, value in states.items():
            other = others[name]
            if isinstance(value, QuantizedTensor):
                assert isinstance(other, QuantizedTensor) and value.format.config == other.format.config, (index, name)
                assert torch.equal(value.codes, other.codes) and torch.equal(value.scales, other.scales), (index, name)
            else:
                assert value.dtype == other.dtype and torch.equal(value, other), (index, name, value.dtype, other.dtype)


# --- one device -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("precision", "weights"),
    [("bf16-true", "bf16"), ("32-true", "fp8_e4m3"), ("32-true", "bf16")],
)
def test_plugin_keeps_the_block_weights_on_their_grid(tmp_path, precision, weights):
    model, start = EcoModule(), OnGridAtStart()
    plugin = QStatePrecision(precision, states="int8", min_quant_size=0, weights=weights, error_feedback="eco")
    trainer = quiet_trainer(tmp_path, STEPS, plugins=[plugin], callbacks=[start])
    initial = {name: p.detach().clone() for name, p in named(model).items()}
    trainer.fit(model, eco_data())
    optimizer = trainer.strategy.optimizers[0]
    assert isinstance(optimizer, QAdamW) and trainer.global_step == STEPS
    dtype = torch.bfloat16 if precision == "bf16-true" else torch.float32
    gridded = BLOCK_WEIGHTS if dtype == torch.float32 else list(named(model))  # half precision: the others on their dtype's
    assert start.on_grid == dict.fromkeys(gridded, True), "the weights go on their grid when the plugin converts"
    group = optimizer.param_groups[0]
    for name, param in named(model).items():
        assert param.dtype == dtype and torch.isfinite(param).all()
        assert not torch.equal(param.float(), initial[name].float()), f"{name} did not train"
        grid = optimizer.weight_grid(group, param)
        if name in BLOCK_WEIGHTS:
            assert grid is not None and grid.name == weights and on_grid(param, weights), name
            assert isinstance(optimizer.state[param]["exp_avg"], QuantizedTensor)
        elif dtype == torch.float32:  # embeddings-like input layer, norms, biases and the head: torch's update
            assert grid is None, name
        else:  # the same in bf16: their dtype as the grid, with the group's rounding and feedback (no master copy)
            assert grid is not None and grid.name == "bf16", name
    if precision == "32-true":  # fp32 values off the grid outside the blocks
        assert not on_grid(model.net.inp.weight, weights) and not on_grid(model.net.head.weight, weights)


def test_weight_overrides_and_the_run_summary(tmp_path, capsys):
    model, summary = EcoModule(), RunSummary()
    plugin = QStatePrecision(
        "32-true",
        states="int8",
        min_quant_size=0,
        weights="fp8_e4m3",
        error_feedback="eco",
        weight_overrides={"net.head.weight": "int8_linear", "net.blocks.1.fc2.*": None},
    )
    quiet_trainer(tmp_path, STEPS, plugins=[plugin], callbacks=[summary]).fit(model, eco_data())
    params = named(model)
    fp8 = [name for name in BLOCK_WEIGHTS if name != "net.blocks.1.fc2.weight"]
    assert all(on_grid(params[name], "fp8_e4m3") for name in fp8)
    assert on_grid(params["net.head.weight"], "int8_linear") and not on_grid(params["net.head.weight"], "fp8_e4m3")
    assert not on_grid(params["net.blocks.1.fc2.weight"], "fp8_e4m3"), "None: the parameter keeps its dtype"
    held = {"fp8_e4m3": sum(params[name].numel() for name in fp8), "int8_linear": params["net.head.weight"].numel()}
    rows = sum(params[name].shape[0] for name in fp8) + params["net.head.weight"].shape[0]
    assert summary.summary["weight_formats"] == {
        "fp8_e4m3": {"params": 3, "values": held["fp8_e4m3"]},
        "int8_linear": {"params": 1, "values": held["int8_linear"]},
    }
    assert summary.summary["weight_bytes"] == 4 * sum(held.values())  # fp32 parameters holding grid values
    assert summary.summary["packed_weight_bytes"] == sum(held.values()) + 4 * rows  # 8-bit codes and an fp32 scale per row
    assert summary.summary["error_feedback"] == ["eco"] and summary.summary["weight_rounding"] == ["stochastic"]
    printed = capsys.readouterr().out
    line = next(line for line in printed.splitlines() if line.startswith("weights without master copy"))
    assert "fp8_e4m3 x3" in line and "int8_linear x1" in line and "error_feedback=eco" in line and "packed" in line


def test_run_summary_without_weight_grids_has_no_weight_line(tmp_path, capsys):
    summary = RunSummary()
    quiet_trainer(tmp_path, 2, plugins=[QStatePrecision(states="int8", min_quant_size=0)], callbacks=[summary]).fit(EcoModule(), eco_data())
    assert summary.summary["weight_formats"] == {} and "weights without master copy" not in capsys.readouterr().out


def test_a_weight_override_that_matches_nothing_raises(tmp_path):
    plugin = QStatePrecision("bf16-true", weights="bf16", error_feedback="eco", weight_overrides={"*.lm_head.*": None})
    with pytest.raises(ValueError, match=r"weight_overrides pattern '\*\.lm_head\.\*' matches no parameter of .*net\.blocks\.\*\.fc1"):
        quiet_trainer(tmp_path, 1, plugins=[plugin]).fit(EcoModule(), eco_data())


def test_plugin_keywords_and_validation():
    plugin = QStatePrecision("bf16-true", weights="fp8_e4m3", weight_rounding="nearest", weight_block=128, error_feedback="eco_exact")
    assert type(plugin) is QStateHalfPrecision
    assert (plugin.policy.weights, plugin.policy.weight_rounding, plugin.policy.weight_block, plugin.policy.error_feedback) == (
        "fp8_e4m3", "nearest", 128, "eco_exact",
    )  # fmt: skip
    with pytest.raises(ValueError, match="error_feedback='ecoo' is not valid"):
        QStatePrecision(error_feedback="ecoo")
    with pytest.raises(ValueError, match=r"QuantizedOptimizerStates: weight_overrides\['\*head\*'\]"):
        QuantizedOptimizerStates(weight_overrides={"*head*": "int9"})


def test_callback_quantizes_the_weights_as_the_plugin_does(tmp_path):
    """The callback (with Lightning's own precision) gives the same run as the plugin: weights on the grid from the start,
    eco_exact's fp32 error buffer on the block weights only."""
    options = dict(states="int8", min_quant_size=0, weights="fp8_e4m3", weight_rounding="nearest", error_feedback="eco_exact")
    by_plugin, by_callback, start = EcoModule(), EcoModule(), OnGridAtStart()
    quiet_trainer(tmp_path, STEPS, plugins=[QStatePrecision(**options)]).fit(by_plugin, eco_data())
    trainer = quiet_trainer(tmp_path, STEPS, callbacks=[QuantizedOptimizerStates(**options, log_stats=False), start])
    trainer.fit(by_callback, eco_data())
    assert start.on_grid == dict.fromkeys(BLOCK_WEIGHTS, True)
    optimizer = trainer.strategy.optimizers[0]
    for name, param in named(by_callback).items():
        assert torch.equal(param, named(by_plugin)[name]), name
        error = optimizer.state[param].get("weight_error")
        assert (error is not None and error.dtype == torch.float32) == (name in BLOCK_WEIGHTS), name


def test_callback_puts_the_weights_of_an_optimizer_the_module_built_on_their_grid(tmp_path):
    """A quantized optimizer with ``weights=`` built in ``configure_optimizers`` (every parameter on the bf16 grid) under
    the callback and Lightning's own precision: on the grid at the first step, as under the plugin (it was left off)."""
    start = OnGridAtStart()
    trainer = quiet_trainer(tmp_path, 1, callbacks=[QuantizedOptimizerStates(log_stats=False), start])
    trainer.fit(EcoModule(optimizer="qadamw"), eco_data())
    assert start.on_grid and all(start.on_grid.values()), start.on_grid


def test_weights_are_rounded_when_a_fit_starts_only(tmp_path):
    """bf16 parameters on an int8 row grid hold ``bf16(code·scale)``, which a second rounding moves by an ulp in places:
    the callback leaves a resumed checkpoint's weights as they are, and ``validate`` after ``fit`` leaves the trained
    weights alone, under the plugin too (Lightning connects the plugin in every stage)."""
    options = dict(states="int8", min_quant_size=0, weights="int8", error_feedback="eco")
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="ckpt", every_n_train_steps=SAVE_STEP, save_top_k=-1)
    trainer = quiet_trainer(tmp_path / "a", SAVE_STEP, precision="bf16-true", enable_checkpointing=True,
                            callbacks=[QuantizedOptimizerStates(**options, log_stats=False), checkpoint])  # fmt: skip
    trainer.fit(EcoModule(), eco_data())
    saved = torch.load(tmp_path / "ckpt" / "ckpt.ckpt", weights_only=True)["state_dict"]

    class WeightsAtStart(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            self.weights = {name: param.detach().clone() for name, param in pl_module.named_parameters()}

    start, resumed = WeightsAtStart(), EcoModule()
    quiet_trainer(
        tmp_path / "b", STEPS, precision="bf16-true", callbacks=[QuantizedOptimizerStates(**options, log_stats=False), start]
    ).fit(resumed, eco_data(), ckpt_path=str(tmp_path / "ckpt" / "ckpt.ckpt"))
    assert all(torch.equal(start.weights[name], saved[name]) for name in BLOCK_WEIGHTS)

    class Validated(EcoModule):
        def validation_step(self, batch, batch_idx):
            return self.training_step(batch, batch_idx)

    model = Validated()
    trainer = quiet_trainer(tmp_path / "c", SAVE_STEP, plugins=[QStateHalfPrecision("bf16-true", **options)])
    trainer.fit(model, eco_data())
    trained = {name: param.detach().clone() for name, param in named(model).items()}
    trainer.validate(model, eco_data(), verbose=False)
    assert all(torch.equal(param, trained[name]) for name, param in named(model).items())


RESUME_CASES = [
    pytest.param("bf16-true", "bf16", "eco", id="bf16-true-bf16-eco"),
    pytest.param("32-true", "fp8_e4m3", "eco_exact", id="32-true-fp8-eco_exact"),
    pytest.param("bf16-true", "bf16", "eco_exact", id="bf16-true-bf16-eco_exact"),  # fp32 "weight_error" of a bf16 parameter
    # bf16 parameters on a block grid: rounding them again moves some by an ulp (it was done to the restored weights)
    pytest.param("bf16-true", "int8", None, id="bf16-true-int8"),
]


@pytest.mark.parametrize(("precision", "weights", "feedback"), RESUME_CASES)
def test_resume_is_bit_exact_with_stochastic_weight_rounding(tmp_path, precision, weights, feedback):
    """Fit 6 steps straight, or 3, save, and 3 more from the checkpoint: the same parameters and optimizer states, bit for
    bit (the SR stream of the weights is seeded from the optimizer's seed and step, which the checkpoint holds)."""

    def plugin():
        return QStatePrecision(precision, states="int8", min_quant_size=0, weights=weights, error_feedback=feedback)

    straight = EcoModule()
    first_run = quiet_trainer(tmp_path / "a", STEPS, plugins=[plugin()])
    first_run.fit(straight, eco_data())
    checkpoint = ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="ckpt", every_n_train_steps=SAVE_STEP, save_top_k=-1)
    quiet_trainer(tmp_path / "b", SAVE_STEP, enable_checkpointing=True, callbacks=[checkpoint], plugins=[plugin()]).fit(
        EcoModule(), eco_data()
    )
    path = tmp_path / "ckpt" / "ckpt.ckpt"
    saved = torch.load(path, weights_only=True)["optimizer_states"][0]
    assert saved["param_groups"][0]["qstate_rounding_seed"][1] == SAVE_STEP
    names = list(named(EcoModule()))
    gridded = BLOCK_WEIGHTS if precision == "32-true" else names  # bf16 parameters outside the blocks: their dtype's grid
    for index, name in enumerate(names):
        entry = saved["state"][index]
        if feedback == "eco_exact" and name in gridded:
            assert entry["weight_error"].dtype == torch.float32 and entry["weight_error"].abs().max() > 0
        else:
            assert "weight_error" not in entry
    resumed, start = EcoModule(), OnGridAtStart()
    resumed_run = quiet_trainer(tmp_path / "c", STEPS, plugins=[plugin()], callbacks=[start])
    resumed_run.fit(resumed, eco_data(), ckpt_path=str(path))
    if not (precision == "bf16-true" and weights == "int8"):  # bf16(code·scale) is no fixed point of a second rounding
        assert start.on_grid == dict.fromkeys(gridded, True), "the checkpoint's weights are on the grid"
    assert start.error_dtypes == (dict.fromkeys(gridded, torch.float32) if feedback == "eco_exact" else {}), "weight_error loads as fp32"
    for name, param in named(straight).items():
        assert torch.equal(param, named(resumed)[name]), f"{name} differs by {(param.float() - named(resumed)[name].float()).abs().max()}"
    same_states(first_run.strategy.optimizers[0], resumed_run.strategy.optimizers[0])


# --- two processes: DDP and FSDP2 ----------------------------------------------------------------------------------
@dataclass
class EcoRun:
    out: Path
    seconds: float

    def info(self, variant: str, phase: str, rank: int) -> dict:
        folder = self.out / variant / phase
        error = folder / f"error{rank}.txt"
        if error.is_file():
            pytest.fail(f"{variant}/{phase} raised on rank {rank}:\n{error.read_text()[-4000:]}")
        return json.loads((folder / f"rank{rank}.json").read_text())

    def weights(self, variant: str, phase: str) -> dict[str, torch.Tensor]:
        return torch.load(self.out / variant / phase / "weights.pt", weights_only=True)


BF16_ECO = {"precision": "bf16-true", "weights": "bf16", "error_feedback": "eco"}
DDP_VARIANTS = [
    {"name": "eco", **BF16_ECO},
    {"name": "eco_exact", **BF16_ECO, "error_feedback": "eco_exact"},
    # each rank uses torch's global generator differently before configure_optimizers (a rank-dependent seed or pipeline)
    {"name": "desync", **BF16_ECO, "desync_rng": True, "phases": ["straight"]},
    {"name": "desync_own_qadamw", **BF16_ECO, "desync_rng": True, "optimizer": "qadamw", "phases": ["straight"]},
]
FSDP2_VARIANTS = [
    {"name": "eco", **BF16_ECO},
    {"name": "fp8_eco", "precision": "32-true", "weights": "fp8_e4m3", "error_feedback": "eco"},
    {"name": "fp8_naive", "precision": "32-true", "weights": "fp8_e4m3", "error_feedback": None},
    {"name": "fp8_eco_exact", "precision": "32-true", "weights": "fp8_e4m3", "error_feedback": "eco_exact"},
]
_RUNS: dict[str, EcoRun] = {}
LAUNCH_TIMEOUT = 400  # seconds; a launch takes ~20-60 s on 2 loaded cores


def eco_run(strategy: str, tmp_path_factory) -> EcoRun:
    if not GLOO:
        pytest.skip("needs torch.distributed with gloo")
    if strategy not in _RUNS:
        out = tmp_path_factory.mktemp(f"eco-{strategy}")
        variants = DDP_VARIANTS if strategy == "ddp" else FSDP2_VARIANTS
        args = ["--strategy", strategy, "--variants", json.dumps(variants), "--steps", str(STEPS), "--save-step", str(SAVE_STEP)]
        _RUNS[strategy] = EcoRun(out, launch(out, args, LAUNCH_TIMEOUT, TESTS / "eco_worker.py"))
    return _RUNS[strategy]


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> EcoRun:
    return eco_run("ddp", tmp_path_factory)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> EcoRun:
    return eco_run("fsdp2", tmp_path_factory)


def assert_resume_exact(run: EcoRun, variant: str) -> None:
    """The resumed run ends where the straight one does (each rank's parameters, states and SR step, and the gathered
    weights), and the checkpoint's weights were loaded on their grid."""
    for rank in (0, 1):
        reference, info = run.info(variant, "straight", rank), run.info(variant, "resume", rank)
        assert info["global_step"] == reference["global_step"] == STEPS and info["rounding_step"] == reference["rounding_step"]
        assert info["params"] == reference["params"], f"{variant}: rank {rank}'s parameters or states differ"
        loaded = info["loaded"]
        assert loaded["global_step"] == SAVE_STEP
        # the block weights, and bf16 parameters outside the blocks on their dtype's grid
        gridded = [name for name, entry in loaded["params"].items() if name in BLOCK_WEIGHTS or entry["dtype"] == "torch.bfloat16"]
        assert {name: entry["on_grid"] for name, entry in loaded["params"].items() if entry["grid"]} == dict.fromkeys(gridded, True)
        assert loaded["params"] == run.info(variant, "first", rank)["params"], f"{variant}: rank {rank} did not get back its state"
    straight, resumed = run.weights(variant, "straight"), run.weights(variant, "resume")
    for name, value in straight.items():
        assert torch.equal(resumed[name], value), f"{variant}: {name} differs by {(resumed[name].float() - value.float()).abs().max()}"


def test_ddp_replicas_stay_identical_with_stochastic_weight_rounding(ddp):
    """DDP's replicas round alike (one SR stream for all ranks, rank 0's seed): identical parameters and states."""
    for variant in ("eco", "eco_exact", "desync"):
        for phase in ("straight",) if variant == "desync" else ("straight", "first", "resume"):
            first, second = (ddp.info(variant, phase, rank) for rank in (0, 1))
            assert first["params"] == second["params"], f"{variant}/{phase}: the ranks' parameters or states differ"
            for name in BLOCK_WEIGHTS:
                assert first["params"][name]["grid"] == "bf16" and first["params"][name]["on_grid"], (variant, phase, name)
                assert first["params"][name]["dtype"] == "torch.bfloat16"
            assert first["params"]["net.head.weight"]["grid"] == "bf16"  # outside the blocks: its dtype's grid


def test_ddp_replicas_of_an_optimizer_built_quantized(ddp):
    first, second = (ddp.info("desync_own_qadamw", "straight", rank) for rank in (0, 1))
    assert first["params"] == second["params"], "the ranks' parameters differ"


def test_ddp_resume_is_exact(ddp):
    assert_resume_exact(ddp, "eco")


def test_ddp_resume_is_exact_with_eco_exact(ddp):
    assert_resume_exact(ddp, "eco_exact")


def test_fsdp2_row_grids_follow_the_rows_of_each_shard(fsdp2):
    """Dim-0 sharding never splits a row: each rank rounds its own rows with their own scales, so the gathered weights
    are on the row grid of the full parameter (fc1's 51 rows shard 26 / 25)."""
    for variant, weights in (("eco", "bf16"), ("fp8_eco", "fp8_e4m3"), ("fp8_naive", "fp8_e4m3")):
        for phase in ("straight", "first"):
            infos = [fsdp2.info(variant, phase, rank)["params"] for rank in (0, 1)]
            assert [info["net.blocks.0.fc1.weight"]["local_shape"] for info in infos] == [[26, 32], [25, 32]]
            for name in BLOCK_WEIGHTS:
                assert all(info[name]["grid"] == weights and info[name]["on_grid"] for info in infos), (variant, phase, name)
                assert all(info[name]["local_shape"][1:] == info[name]["shape"][1:] for info in infos)
            full = fsdp2.weights(variant, phase)
            for name in BLOCK_WEIGHTS:
                assert on_grid(full[name], weights), (variant, phase, name)
            assert not on_grid(full["net.head.weight"], weights) or weights == "bf16"


def test_fsdp2_resume_is_exact_without_error_feedback(fsdp2):
    """SR of the weights resumes exactly under FSDP2 (each rank's stream: its seed, step, parameter and rank)."""
    assert_resume_exact(fsdp2, "fp8_naive")


def test_fsdp2_resume_is_exact_with_eco(fsdp2):
    assert_resume_exact(fsdp2, "fp8_eco")


def test_fsdp2_resume_is_exact_with_eco_in_bf16(fsdp2):
    assert_resume_exact(fsdp2, "eco")


def test_fsdp2_resume_is_exact_with_eco_exact(fsdp2):
    assert_resume_exact(fsdp2, "fp8_eco_exact")


def test_replicated_dtensor_parameters_round_alike_on_every_rank(fsdp2):
    hashes = [json.loads((fsdp2.out / f"replicated{rank}.json").read_text())["hash"] for rank in (0, 1)]
    assert hashes[0] == hashes[1]
