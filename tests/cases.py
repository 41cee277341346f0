"""Cases and helpers shared by the format and kernel tests."""

import os
import subprocess
import sys
from pathlib import Path

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


def run_under_interpreter(test_file: str) -> None:
    """Run ``test_file``'s cases in a subprocess with ``TRITON_INTERPRET=1`` and fail with its report.

    The variable must be set before triton is imported, so it never reaches this process (where the
    AOT compile test needs real ``JITFunction``s).
    """
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(test_file).resolve())]
    result = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    report = (result.stdout + result.stderr)[-20000:]
    assert result.returncode == 0, f"interpreter suite failed (rc={result.returncode}):\n{report}"
    assert " passed" in result.stdout and " skipped" not in result.stdout, report
