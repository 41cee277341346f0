"""``lightning-qstate report``: ``cli.main`` hands ``report`` and what follows it to ``lightning_qstate.report.main`` (imported
only then) and exits with its status; ``lightning-qstate --help`` names the subcommand."""

from __future__ import annotations

import subprocess
import sys
import types

import pytest

from lightning_qstate import cli


@pytest.fixture
def fake_report(monkeypatch):
    """A stand-in ``lightning_qstate.report`` whose ``main`` records its arguments and returns ``status[0]``."""
    calls: list[list[str]] = []
    status = [0]

    def main(argv):
        calls.append(list(argv))
        return status[0]

    module = types.ModuleType("lightning_qstate.report")
    module.main = main
    monkeypatch.setitem(sys.modules, "lightning_qstate.report", module)
    monkeypatch.setattr(sys, "argv", ["lightning-qstate"])
    monkeypatch.setattr(cli, "build_cli", lambda *args, **kwargs: pytest.fail("report must not reach LightningCLI"))
    return calls, status


@pytest.mark.parametrize("code", [0, 2])
def test_report_is_dispatched_with_the_rest_of_the_arguments(fake_report, code):
    calls, status = fake_report
    status[0] = code
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["report", "runs/gpt_demo/version_0", "--out", "somewhere"])
    assert exit_info.value.code == code
    assert calls == [["runs/gpt_demo/version_0", "--out", "somewhere"]]


def test_report_from_sys_argv(fake_report, monkeypatch):
    calls, _ = fake_report
    monkeypatch.setattr(sys, "argv", ["lightning-qstate", "report", "runs/x"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 0 and calls == [["runs/x"]]


def test_other_subcommands_go_to_lightning(fake_report, monkeypatch):
    calls, _ = fake_report
    seen = []
    monkeypatch.setattr(cli, "build_cli", lambda args=None, run=True: seen.append(args))
    assert cli.main(["fit", "--config", "report"]) is None  # "report" only counts as the first argument
    assert seen == [["fit", "--config", "report"]] and calls == []


def test_help_names_report():
    done = subprocess.run([sys.executable, "-m", "lightning_qstate.cli", "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "lightning-qstate report RUN_DIR" in " ".join(done.stdout.split())  # the help wraps lines
