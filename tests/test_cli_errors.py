"""Errors the user can act on: a rejected option in a CLI config is a short usage error, and the Lightning
modules say which extra to install when Lightning is missing (while the rest of the package needs none)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_qstate.cli import OptionError, build_cli, main

REPO_ROOT = Path(__file__).resolve().parents[1]
BORING = ["--model=lightning.pytorch.demos.boring_classes.BoringModel"]
NO_OUTPUT = ["--trainer.logger=false", "--trainer.enable_checkpointing=false", "--trainer.accelerator=cpu"]

# Run first in a subprocess: every import of Lightning (and the rest of the [lightning] extra) fails as if not installed.
BLOCK_LIGHTNING_EXTRA = """
import importlib.abc, sys
BLOCKED = {"lightning", "lightning_fabric", "pytorch_lightning", "torchmetrics", "tensorboard", "jsonargparse"}
class Uninstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Uninstalled())
"""


@pytest.fixture(autouse=True)
def plain_argv(monkeypatch):
    """LightningCLI warns when both ``args`` and ``sys.argv`` (pytest's) carry arguments; no debug mode from the caller."""
    monkeypatch.setattr(sys, "argv", ["lightning-qstate"])
    monkeypatch.delenv("JSONARGPARSE_DEBUG", raising=False)


def config(tmp_path: Path, key: str, class_path: str, init_args: str) -> str:
    """A config with one ``trainer.plugins`` or ``trainer.callbacks`` entry."""
    path = tmp_path / "config.yaml"
    path.write_text(f"trainer:\n  {key}:\n    - class_path: {class_path}\n      init_args: {init_args}\n")
    return str(path)


def usage_error(capsys, args: list[str]) -> str:
    """``main(args)``'s stderr, checked to be a short usage error (status 2, no traceback, no jsonargparse union dump)."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Union subtypes" not in err
    report = err[err.index("lightning-qstate: error: ") :]
    assert len(report.splitlines()) <= 4, report
    assert report.rstrip().endswith("(JSONARGPARSE_DEBUG=true shows the traceback)")
    return report


PLUGIN = "lightning_qstate.plugins.QStatePrecision"
FSDP_PLUGIN = "lightning_qstate.plugins.QStateFSDPPrecision"
CALLBACK = "lightning_qstate.callbacks.QuantizedOptimizerStates"
FORMATS, ROUNDINGS, BLOCK_SIZES = "valid formats: ", "'nearest', 'stochastic'", "power of two"
REJECTED = {  # id: (trainer key, class path, init_args, the class and options the report names, the library's reason it quotes)
    "plugin-states": ("plugins", PLUGIN, "{states: int9}", "QStatePrecision(states='int9')", FORMATS),
    "plugin-rounding": ("plugins", PLUGIN, "{precision: 32-true, rounding: up}", "QStatePrecision(rounding='up')", ROUNDINGS),
    "plugin-block_size": ("plugins", PLUGIN, "{block_size: 100}", "QStatePrecision(block_size=100)", BLOCK_SIZES),
    "fsdp-overrides": ("plugins", FSDP_PLUGIN, "{overrides: {'*emb*': int9}}", "QStateFSDPPrecision(overrides={'*emb*': 'int9'})", FORMATS),
    "callback-states": (
        "callbacks",
        CALLBACK,
        "{states: {exp_avg: int8, exp_avg_sq: int9}, log_stats: true}",
        "QuantizedOptimizerStates(states={'exp_avg': 'int8', 'exp_avg_sq': 'int9'})",
        FORMATS,
    ),
    "callback-rounding": ("callbacks", CALLBACK, "{rounding: up}", "QuantizedOptimizerStates(rounding='up')", ROUNDINGS),
}


@pytest.mark.parametrize(("key", "class_path", "init_args", "rejected", "reason"), REJECTED.values(), ids=REJECTED.keys())
def test_rejected_option_is_a_short_usage_error(tmp_path, capsys, key, class_path, init_args, rejected, reason):
    report = usage_error(capsys, ["fit", "--config", config(tmp_path, key, class_path, init_args), *BORING, *NO_OUTPUT])
    assert report.startswith(f"lightning-qstate: error: invalid option for {rejected}:\n  ")
    assert reason in report


def test_rejected_option_in_the_example_config(capsys):
    """The issue's example: ``lightning-qstate fit --config examples/configs/gpt_int8.yaml --trainer.plugins.init_args.states=int9``."""
    pytest.importorskip("transformers")
    gpt_int8 = str(REPO_ROOT / "examples" / "configs" / "gpt_int8.yaml")
    report = usage_error(capsys, ["fit", "--config", gpt_int8, "--trainer.plugins.init_args.states=int9"])
    assert report.startswith("lightning-qstate: error: invalid option for QStatePrecision(states='int9'):\n") and FORMATS in report


FIT_TIME = {  # id: (the plugin's init_args, the start of the report): checks made when the plugin meets the optimizer
    "overrides": ("{overrides: {'*embedding*': int8}}", "QuantizationPolicy: overrides pattern '*embedding*' matches no parameter"),
    "eco-without-momentum": ("{weights: bf16, error_feedback: eco, weight_overrides: {'*.weight': bf16}}", "SGD: error_feedback='eco'"),
}


@pytest.mark.parametrize(("init_args", "start"), FIT_TIME.values(), ids=FIT_TIME.keys())
def test_an_option_rejected_when_the_run_starts_is_a_short_usage_error(tmp_path, capsys, init_args, start):
    """Options refused when fit starts (the policy meets the model and its optimizer there: BoringModel's SGD has no
    momentum) ended in a traceback and exit status 1: they raise ConfigurationError now."""
    plugin = config(tmp_path, "plugins", PLUGIN, init_args)
    run = ["--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}"]  # LightningCLI writes config.yaml there
    report = usage_error(capsys, ["fit", "--config", plugin, *BORING, *NO_OUTPUT, *run])
    assert report.startswith(f"lightning-qstate: error: {start}")


def test_adaptive_bits_without_a_quantized_adam_is_a_short_usage_error(tmp_path, capsys):
    """AdaptiveBitWidth meeting BoringModel's plain SGD at the start of the run (a TypeError of the planner, printed with
    its traceback and exit status 1); an unreachable ``target_bits`` is a ConfigurationError too (``BudgetError``)."""
    callback = config(tmp_path, "callbacks", "lightning_qstate.callbacks.AdaptiveBitWidth", "{}")
    run = ["--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path / 'run'}"]
    report = usage_error(capsys, ["fit", "--config", callback, *BORING, *NO_OUTPUT, *run])
    assert report.startswith("lightning-qstate: error: AdaptiveBitWidth needs a QAdam/QAdamW optimizer with quantized states, got SGD")


class RaisesValueError(BoringModel):
    def training_step(self, batch, batch_idx):
        raise ValueError("the user's own error")


def test_a_value_error_of_the_users_code_keeps_its_traceback(tmp_path):
    with pytest.raises(ValueError, match="the user's own error"):
        main(["fit", f"--model={__name__}.RaisesValueError", *NO_OUTPUT, "--trainer.max_steps=1", f"--trainer.default_root_dir={tmp_path}"])


def test_debug_mode_raises_with_the_library_error_as_cause(tmp_path, monkeypatch):
    """``JSONARGPARSE_DEBUG=true``: the traceback, led by the error the class raised (jsonargparse's union error hidden)."""
    monkeypatch.setenv("JSONARGPARSE_DEBUG", "true")
    with pytest.raises(OptionError, match=r"QStatePrecision\(rounding='up'\)") as error:
        main(["fit", "--config", config(tmp_path, "plugins", PLUGIN, "{rounding: up}"), *BORING, *NO_OUTPUT])
    assert isinstance(error.value.__cause__, ValueError) and "rounding='up'" in str(error.value.__cause__)
    assert error.value.__suppress_context__


def test_build_cli_raises_option_error(tmp_path):
    """Programmatic use gets the exception, not an exit."""
    with pytest.raises(OptionError, match=r"QuantizedOptimizerStates\(block_size=3\):\n  .*power of two"):
        build_cli(["--config", config(tmp_path, "callbacks", CALLBACK, "{block_size: 3}"), *BORING, *NO_OUTPUT], run=False)


def test_other_errors_keep_their_traceback(tmp_path):
    """An error of a class outside the library (here Lightning's ModelCheckpoint) is not turned into a usage error."""
    checkpoint = config(tmp_path, "callbacks", "lightning.pytorch.callbacks.ModelCheckpoint", "{every_n_train_steps: -1}")
    with pytest.raises(ValueError, match="Union subtypes") as error:
        main(["fit", "--config", checkpoint, *BORING, *NO_OUTPUT])
    assert not isinstance(error.value, OptionError)


def run_without_lightning(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_LIGHTNING_EXTRA + code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def test_lightning_modules_name_the_extra_to_install():
    result = run_without_lightning(
        """
import importlib, json
found = {}
for name in ("lightning_qstate.callbacks", "lightning_qstate.plugins", "lightning_qstate.cli"):
    try:
        importlib.import_module(name)
    except ImportError as error:
        found[name] = [type(error).__name__, str(error), type(error.__cause__).__name__]
import lightning_qstate
print(json.dumps(found))
"""
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.splitlines()[-1])
    for name in ("lightning_qstate.callbacks", "lightning_qstate.plugins", "lightning_qstate.cli"):
        assert found[name] == ["ImportError", f"{name} needs Lightning: pip install 'lightning-qstate[lightning]'", "ModuleNotFoundError"]


def test_core_modules_import_without_lightning():
    """The layering rule: only callbacks, plugins and cli use Lightning; no other module needs the [lightning] extra."""
    result = run_without_lightning(
        """
import importlib, pkgutil
import lightning_qstate
LIGHTNING_MODULES = {"lightning_qstate.callbacks", "lightning_qstate.plugins", "lightning_qstate.cli"}
for module in pkgutil.walk_packages(lightning_qstate.__path__, "lightning_qstate."):
    if not any(module.name == name or module.name.startswith(name + ".") for name in LIGHTNING_MODULES):
        importlib.import_module(module.name)
print(sorted(name for name in sys.modules if name.startswith("lightning_qstate")))
"""
    )
    assert result.returncode == 0, result.stderr[-3000:]
    imported = result.stdout.splitlines()[-1]
    for name in ("lightning_qstate.formats", "lightning_qstate.kernels", "lightning_qstate.optim", "lightning_qstate.theory"):
        assert f"'{name}'" in imported
