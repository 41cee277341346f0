"""Cases and helpers shared by the format and kernel tests."""

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# (name, options) of every block format, with the sign convention used for m (signed) and v (unsigned).
BLOCK_FORMATS = [
    ("int8", {}),
    ("int8", {"signed": False}),
    ("int4", {}),
    ("int4", {"signed": False}),
    ("int8_linear", {}),
    ("int8_linear", {"signed": False}),
    ("int4_linear", {}),
    ("fp8_e4m3", {}),
    ("fp8_e5m2", {}),
    ("fp8_e4m3", {"signed": False}),
    ("e2m2", {"signed": False}),
    ("e3m0", {"signed": False}),
    ("e4m3", {}),
    ("e2m1", {}),
    ("e5m10", {}),
    ("int6", {}),  # dense 5- to 7-bit containers
    ("int5", {"signed": False}),
    ("int7_linear", {}),
    ("e3m2", {}),
    ("e2m3", {"signed": False}),
    ("int8", {"signed": False, "scale_dtype": "bf16"}),  # the scale types the defaults do not pick
    ("fp8_e4m3", {"scale_dtype": "fp32"}),
]
FORMAT_IDS = [
    f"{name}-{'u' if options.get('signed') is False else 's'}" + (f"-{options['scale_dtype']}" if "scale_dtype" in options else "")
    for name, options in BLOCK_FORMATS
]


_INTERPRETER_RUNS: dict[Path, tuple[subprocess.Popen, IO[str]]] = {}  # test file -> its running suite and output
INTERPRETER_TIMEOUT = 900  # seconds


def start_interpreter_suite(test_file: str | Path) -> None:
    """Start ``test_file``'s cases in a subprocess with ``TRITON_INTERPRET=1`` (once; without Triton, nothing).

    ``conftest.py`` calls this when collection ends, so the suites (one core each) run beside the rest of the
    session instead of after it; :func:`run_under_interpreter` collects the report.
    """
    path = Path(test_file).resolve()
    if path in _INTERPRETER_RUNS or os.environ.get("TRITON_INTERPRET") == "1" or importlib.util.find_spec("triton") is None:
        return
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(path)]
    output = tempfile.TemporaryFile("w+")  # a file, not a pipe: a long report must not block the suite
    # at the lowest priority: it takes the cores the session leaves idle, not the multi-process tests' time
    lowest = (lambda: os.nice(19)) if hasattr(os, "nice") else None
    process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, text=True, preexec_fn=lowest)
    _INTERPRETER_RUNS[path] = (process, output)


def stop_interpreter_suites() -> None:
    """Kill the suites nobody collected (the session stopped before their tests)."""
    for process, output in _INTERPRETER_RUNS.values():
        process.kill()
        process.wait()
        output.close()
    _INTERPRETER_RUNS.clear()


def run_under_interpreter(test_file: str) -> None:
    """Wait for ``test_file``'s interpreter suite (started now if it was not) and fail with its report.

    ``TRITON_INTERPRET`` must be set before triton is imported, so it never reaches this process (where the
    AOT compile test needs real ``JITFunction``s).
    """
    pytest.importorskip("triton")
    start_interpreter_suite(test_file)
    process, output = _INTERPRETER_RUNS.pop(Path(test_file).resolve())
    try:
        process.wait(timeout=INTERPRETER_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    output.seek(0)
    report = output.read()[-20000:]
    output.close()
    assert process.returncode == 0, f"interpreter suite failed (rc={process.returncode}):\n{report}"
    assert " passed" in report and " skipped" not in report, report
