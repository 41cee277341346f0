"""The ``lightning-qstate`` command: Lightning's CLI for any LightningModule and DataModule, where the
YAML config chooses how the optimizer states are stored.

Subcommands are LightningCLI's (``fit``, ``validate``, ``test``, ``predict``); model and data are given
as class paths (in the config or with ``--model``/``--data``), quantization through
``trainer.plugins`` (``lightning_qstate.plugins.QStatePrecision``) or ``trainer.callbacks``
(``lightning_qstate.callbacks.QuantizedOptimizerStates``)::

    lightning-qstate fit --config examples/configs/gpt_int8.yaml
    python -m lightning_qstate.cli fit --config examples/configs/vit_int8.yaml --trainer.max_steps=50
    lightning-qstate fit --model examples.gpt.GPTModule --data examples.data.ByteTextDataModule \\
        --trainer.plugins+=lightning_qstate.plugins.QStatePrecision --trainer.plugins.states=int4

A :class:`~lightning_qstate.callbacks.RunSummary` is always added: ``fit`` ends with the final metrics,
the optimizer-state memory against fp32 and the TensorBoard command. ``lightning-qstate report RUN_DIR`` turns a
run's event files into ``report.png`` and ``report.html`` (:mod:`lightning_qstate.report`).

The example models live in the repository's ``examples`` package, which is not installed. ``build_cli``
makes it importable by appending to ``sys.path`` the checkout root (when ``examples/`` sits next to the
package, as in an editable install) and the working directory (so ``--model mypackage.MyModule``
works from your project, as with ``python -m``). Nothing is imported before the config names it.

Under ``ModelParallelStrategy`` (FSDP2) do not use the ``optimizer:`` config: LightningCLI builds that
optimizer before ``configure_model`` shards the model; let the module's ``configure_optimizers`` do it.

An option that one of this library's callbacks or plugins rejects (``states: int9``, ``rounding: up``), when it is
built or when the run starts (an ``overrides`` pattern that matches no parameter, a ``states=`` name the optimizer does
not have, ``error_feedback`` without momentum), ends the command with a short message and exit status 2, like any usage
error (:class:`OptionError`, :class:`~lightning_qstate.arguments.ConfigurationError`). ``JSONARGPARSE_DEBUG=true``
shows the traceback instead.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import reprlib
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

try:
    import lightning.pytorch  # noqa: F401
except ModuleNotFoundError as error:
    raise ImportError(f"{__name__} needs Lightning: pip install 'lightning-qstate[lightning]'") from error

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.cli import ArgsType, LightningCLI
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from lightning.pytorch.utilities.warnings import PossibleUserWarning

from . import callbacks, plugins
from .arguments import ConfigurationError
from .callbacks import RunSummary

# Classes whose constructor errors are option checks written for the user (subclasses included).
_LIBRARY_CLASSES = tuple(
    obj for module in (callbacks, plugins) for obj in (getattr(module, name) for name in module.__all__) if isinstance(obj, type)
)


class OptionError(ValueError):
    """One of this library's callbacks or plugins rejected the options the config gave it; the message names
    the class, the options set (those not at their defaults) and the class's own reason."""


def _is_default(parameter: inspect.Parameter | None, value: Any) -> bool:
    default = inspect.Parameter.empty if parameter is None else parameter.default
    return value is default or (type(value) is type(default) and value == default)


def _option_error(class_type: type, options: dict[str, Any], error: Exception) -> OptionError:
    parameters = inspect.signature(class_type.__init__).parameters
    given = ", ".join(f"{name}={reprlib.repr(value)}" for name, value in options.items() if not _is_default(parameters.get(name), value))
    return OptionError(f"invalid option for {class_type.__name__}({given}):\n{textwrap.indent(str(error), '  ')}")


class _QStateCLI(LightningCLI):
    """``LightningCLI`` that reports an error of a library class's constructor as an :class:`OptionError`.

    jsonargparse adapts a value given for a ``Union`` type (``trainer.plugins``, ``trainer.callbacks``) to
    each member type in turn; when all fail it raises a ``ValueError`` that quotes every member's error but
    chains only the first one's (for ``trainer.plugins``: that the list is not a ``Precision``), so the
    constructor's exception is not in the chain. An instantiator therefore records what each library class
    raises; if instantiation then fails with an error quoting one of those, that one is reported.
    """

    def instantiate_classes(self) -> None:
        rejected: list[tuple[type, dict[str, Any], Exception]] = []

        def instantiate(class_type: type, *args: Any, **kwargs: Any) -> Any:
            try:
                return class_type(*args, **kwargs)
            except (TypeError, ValueError) as error:
                rejected.append((class_type, kwargs, error))
                raise

        for class_type in _LIBRARY_CLASSES:
            self.parser.add_instantiator(instantiate, class_type)
        try:
            super().instantiate_classes()
        except (TypeError, ValueError) as error:
            reported = str(error)
            quoted = [(class_type, options, cause) for class_type, options, cause in rejected if str(cause).partition("\n")[0] in reported]
            if not quoted:
                raise
            class_type, options, cause = quoted[-1]
            raise _option_error(class_type, options, cause) from cause

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """LightningCLI's, with :func:`progress_bar` where Lightning would add its default one (the config names no
        progress bar and does not turn it off), and without the default :class:`RunSummary` where the config lists
        one (it printed the summary twice)."""
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        listed = config.get("callbacks")
        listed = [] if listed is None else list(listed) if isinstance(listed, list) else [listed]
        given = listed + [self._get(self.config_init, key) for key in self._parser(self.subcommand).callback_keys]
        wanted = config.get("enable_progress_bar") is not False and not config.get("barebones")
        if wanted and not any(isinstance(callback, ProgressBar) for callback in given):
            kwargs["callbacks"] = [*listed, progress_bar()]
        defaults = self.trainer_defaults
        if any(isinstance(callback, RunSummary) for callback in given):
            self.trainer_defaults = {**defaults, "callbacks": [c for c in defaults.get("callbacks", []) if not isinstance(c, RunSummary)]}
        try:
            return super().instantiate_trainer(**kwargs)
        finally:
            self.trainer_defaults = defaults


class _StepsRichProgressBar(RichProgressBar):
    """Lightning's rich progress bar without ``v_num`` and, where ``max_steps`` ends the run, without the ``/-2`` after the
    epoch: Lightning sets ``max_epochs=-1`` (no epoch limit) then, and ``RichProgressBar`` prints ``max_epochs - 1``."""

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, int | str | float | dict[str, float]]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's version: the run summary prints the log directory
        return metrics

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"  # padded as Lightning's, against flicker


class _TQDMProgressBar(TQDMProgressBar):
    """Lightning's tqdm progress bar (where ``rich`` is not installed) without ``v_num``."""

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, int | str | float | dict[str, float]]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics


def progress_bar() -> ProgressBar:
    """The progress bar the CLI gives a Trainer whose config names none: Lightning's default (rich where installed, else
    tqdm) without ``v_num`` and without rich's ``Epoch 0/-2`` in runs that ``max_steps`` ends."""
    return _StepsRichProgressBar() if _RICH_AVAILABLE else _TQDMProgressBar()


def _add_example_paths() -> None:
    """Append the checkout root (if it holds ``examples/``) and the working directory to ``sys.path``."""
    root = Path(__file__).resolve().parents[1]
    candidates = [str(root)] if (root / "examples" / "__init__.py").is_file() else []
    candidates.append(os.getcwd())
    for path in candidates:
        if path not in sys.path:
            sys.path.append(path)


def build_cli(args: ArgsType = None, run: bool = True) -> LightningCLI:
    """The ``LightningCLI`` on ``args`` (default: ``sys.argv[1:]``), run unless ``run=False`` (then ``args``
    holds no subcommand and the classes are only parsed and instantiated)."""
    _add_example_paths()
    return _QStateCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"callbacks": [RunSummary()]},
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"epilog": REPORT_HELP},
        args=args,
        run=run,
    )


# The end of ``lightning-qstate --help``: ``report`` is dispatched by ``main`` before LightningCLI parses anything.
REPORT_HELP = (
    "Also: `lightning-qstate report RUN_DIR` writes report.png and report.html from a run's TensorBoard event files "
    "(RUN_DIR as the run summary prints it, e.g. runs/gpt_demo/version_0; see lightning-qstate report --help)."
)


# Known third-party console noise that says nothing about the run, filtered by ``main`` (the command line only; the
# library itself filters nothing): (logger name, message regex) for log records, (message regex, category) for warnings.
KNOWN_LOG_NOISE: tuple[tuple[str, str], ...] = (
    ("torch.utils._pytree", r".*is an Enum subclass and is now natively supported by torch.compile.*"),  # torchao at import
    ("torch.utils.cpp_extension", r"No CUDA runtime is found, using CUDA_HOME=.*"),  # building the C++ kernel on the CPU
    ("lightning.pytorch.utilities.rank_zero", r"💡 Tip: .*"),  # Lightning's advertisements for its cloud products
)
# Warnings: (message regex, category, module regex or ""), as ``warnings.filterwarnings`` takes them: the message must
# match from its start (``(?s)``: jsonargparse's start with a newline), the module is the one the warning points at.
KNOWN_WARNING_NOISE: tuple[tuple[str, type[Warning], str], ...] = (
    # LightningCLI (and _QStateCLI) on jsonargparse >= 4.49's deprecations, and the notice that comes with the first one
    (r"(?s)\s*(``ArgumentParser\.add_instantiator``|``instantiate_classes``|skip_none parameter) was deprecated", DeprecationWarning, ""),
    (r"(?s)\s*By default only one JsonargparseDeprecationWarning per type is shown", DeprecationWarning, ""),
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\.pytorch\."),  # Lightning on torch >= 2.10's pytree
    (r"`\w+\.configure_optimizers` will be overridden by `LightningCLI\.configure_optimizers`", UserWarning, ""),  # an optimizer: config
    (r"The '\w+' does not have many workers which may be a bottleneck", PossibleUserWarning, ""),  # CPU runs: workers would compete
)


class _DropMessages(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern, re.DOTALL)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.fullmatch(record.getMessage())


def quiet_known_noise() -> None:
    """Filter the third-party messages of :data:`KNOWN_LOG_NOISE` and :data:`KNOWN_WARNING_NOISE` (nothing else)."""
    for name, pattern in KNOWN_LOG_NOISE:
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _DropMessages) and existing.pattern.pattern == pattern for existing in logger.filters):
            logger.addFilter(_DropMessages(pattern))
    for pattern, category, module in KNOWN_WARNING_NOISE:
        warnings.filterwarnings("ignore", message=pattern, category=category, module=module)


def main(args: ArgsType = None) -> None:
    """Entry point of ``lightning-qstate`` and ``python -m lightning_qstate.cli``. Returns nothing, as console
    scripts pass the return value to ``sys.exit``; use :func:`build_cli` to get hold of the trainer.

    ``lightning-qstate report RUN_DIR`` writes a run's report (:mod:`lightning_qstate.report`); every other
    subcommand is LightningCLI's. An :class:`OptionError` or a ``ConfigurationError`` is printed to stderr and exits
    with status 2, unless ``JSONARGPARSE_DEBUG=true``."""
    quiet_known_noise()
    argv = sys.argv[1:] if args is None else args
    if isinstance(argv, list) and argv[:1] == ["report"]:
        from .report import main as report_main

        sys.exit(report_main(argv[1:]))
    try:
        build_cli(args)
    except (OptionError, ConfigurationError) as error:
        if os.environ.get("JSONARGPARSE_DEBUG", "").lower() == "true":
            raise
        print(f"lightning-qstate: error: {error}\n(JSONARGPARSE_DEBUG=true shows the traceback)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
