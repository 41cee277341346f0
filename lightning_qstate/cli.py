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
the optimizer-state memory against fp32 and the TensorBoard command.

The example models live in the repository's ``examples`` package, which is not installed. ``build_cli``
makes it importable by appending to ``sys.path`` the checkout root (when ``examples/`` sits next to the
package, as in an editable install) and the working directory (so ``--model mypackage.MyModule``
works from your project, as with ``python -m``). Nothing is imported before the config names it.

Under ``ModelParallelStrategy`` (FSDP2) do not use the ``optimizer:`` config: LightningCLI builds that
optimizer before ``configure_model`` shards the model; let the module's ``configure_optimizers`` do it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lightning.pytorch.cli import ArgsType, LightningCLI

from .callbacks import RunSummary


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
    return LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"callbacks": [RunSummary()]},
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main(args: ArgsType = None) -> None:
    """Entry point of ``lightning-qstate`` and ``python -m lightning_qstate.cli``. Returns nothing, as console
    scripts pass the return value to ``sys.exit``; use :func:`build_cli` to get hold of the trainer."""
    build_cli(args)


if __name__ == "__main__":
    main()
