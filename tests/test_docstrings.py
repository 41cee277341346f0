"""The public classes document themselves: ``help()`` shows their arguments and an example, and the examples run."""

from __future__ import annotations

import doctest
import importlib

import pytest

import lightning_qstate
from lightning_qstate import callbacks, plugins

OPTIMIZERS = ("QAdam", "QAdamW", "QSGD", "QMuon", "QuantizedOptimizerWrapper", "quantize_optimizer")
PUBLIC = [getattr(lightning_qstate, name) for name in OPTIMIZERS]
PUBLIC += [getattr(callbacks, name) for name in callbacks.__all__ if isinstance(getattr(callbacks, name), type) and name != "ProbeResult"]
PUBLIC += [plugins.QStatePrecision, plugins.QStateFSDPPrecision]


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda obj: obj.__name__)
def test_public_class_has_arguments_and_an_example(obj):
    doc = obj.__doc__ or ""
    assert len(doc.splitlines()) >= 10, f"{obj.__name__}: help() shows {len(doc.splitlines())} lines"
    assert "Example" in doc or "::" in doc, f"{obj.__name__}: no usage example"


@pytest.mark.parametrize("module", ["lightning_qstate.optim.optimizers", "lightning_qstate.optim.wrap", "lightning_qstate.optim.base"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
