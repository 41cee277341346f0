"""The README's Python examples run as a newcomer pastes them, each on its own, and say what they print.

Each ```python block runs in a fresh namespace (in a temporary directory). A line that is one expression with a comment
that starts with numbers (``stall_probability("bf16", 0.999)  # 0.946 (RN, steady state)``, ``a, b, c  # 1000, 300,
200``; a leading ``label:`` is skipped) must evaluate to those numbers at the precision written. A block that prints,
followed by a ```text block, must print that text.
"""

from __future__ import annotations

import ast
import contextlib
import io
import math
import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
NUMBER = r"-?\d+(?:\.\d+)?(?:e-?\d+)?"
LEADING_NUMBERS = re.compile(rf"^(?:\w+:\s*)?({NUMBER}(?:,\s*{NUMBER})*)(?![\w.])")


def blocks() -> list[tuple[str, str, int]]:
    """(language, code, line of the opening fence) of every fenced block of the README."""
    text = README.read_text()
    return [(match[1], match[2], text.count("\n", 0, match.start()) + 1) for match in FENCE.finditer(text)]


def python_blocks() -> list[tuple[str, str | None, int]]:
    """Every ```python block, with the ```text block right after it (its output), or None."""
    found = blocks()
    return [
        (code, found[i + 1][1] if i + 1 < len(found) and found[i + 1][0] == "text" else None, line)
        for i, (language, code, line) in enumerate(found)
        if language == "python"
    ]


def claims(code: str) -> list[tuple[int, str, list[str]]]:
    """(line, expression, numbers as written) of each expression line whose comment starts with numbers."""
    tree = ast.parse(code)
    lines = code.splitlines()
    found = []
    for node in tree.body:
        if not isinstance(node, ast.Expr) or node.lineno != node.end_lineno:
            continue
        line = lines[node.lineno - 1]
        comment = line[node.end_col_offset :].strip()
        if not comment.startswith("#"):
            continue
        match = LEADING_NUMBERS.match(comment[1:].strip())
        if match:
            found.append((node.lineno, ast.get_source_segment(code, node), re.split(r",\s*", match[1])))
    return found


def scalars(value) -> list[float]:
    """The numbers of ``value``: itself, or the items of a tuple."""
    items = value if isinstance(value, tuple) else (value,)
    return [float(item) for item in items if isinstance(item, (int, float)) and not isinstance(item, bool)]


def matches(value: float, written: str) -> bool:
    """``value`` shown at the precision of ``written`` (its decimals, or its significant digits in e-notation)."""
    if "e" in written:
        mantissa = written.split("e")[0]
        digits = len(mantissa.replace("-", "").replace(".", "").lstrip("0"))
        return float(f"{value:.{max(digits - 1, 0)}e}") == float(written)
    decimals = len(written.split(".")[1]) if "." in written else 0
    return math.isclose(round(value, decimals), float(written), abs_tol=0.5 * 10**-decimals * 1e-9)


BLOCKS = python_blocks()


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 8 and any(output for _, output, _ in BLOCKS)
    assert sum(len(claims(code)) for code, _, _ in BLOCKS) >= 6


@pytest.mark.parametrize(("code", "output", "line"), BLOCKS, ids=[f"line{line}" for _, _, line in BLOCKS])
def test_example_runs_and_shows_what_it_says(code, output, line, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, f"README.md:{line}", "exec"), namespace)
    for number, expression, written in claims(code):
        got = scalars(eval(expression, namespace))  # noqa: S307 - the README's own example line
        assert len(got) >= len(written), f"README.md:{line + number}: {expression} gives {got}, the comment says {written}"
        wrong = [(value, text) for value, text in zip(got, written, strict=False) if not matches(value, text)]
        assert not wrong, f"README.md:{line + number}: {expression} gives {got}, the comment says {', '.join(written)}"
    if output is not None:
        shown = [text for text in printed.getvalue().splitlines() if text.strip()]
        assert shown[-len(output.splitlines()) :] == output.splitlines(), f"README.md:{line}: the block after it is not what it prints"


@pytest.mark.parametrize(
    ("written", "value", "expected"),
    [("0.946", 0.9461, True), ("0.946", 0.9466, False), ("1000", 1000.4, True), ("1000", 999, False), ("5.10", 5.1049, True),
     ("5.10", 5.106, False), ("2e-5", 2.04e-5, True), ("2e-5", 2.6e-5, False)],
)  # fmt: skip
def test_numbers_compare_at_the_precision_written(written, value, expected):
    assert matches(value, written) is expected


def test_claims_read_the_numbers_a_comment_starts_with():
    code = "\n".join(
        [
            "f(1)  # 0.946 (RN)",
            "f(2)  # exp_avg: 0.014",
            "g(), h()  # 1000, 300, 200",
            "f(3)  # 0.673: 300 steps",
            "f(4)  # values, 4.25",
            "x = 1  # 5",
        ]
    )
    assert [(line, written) for line, _, written in claims(code)] == [
        (1, ["0.946"]),
        (2, ["0.014"]),
        (3, ["1000", "300", "200"]),
        (4, ["0.673"]),
    ]
