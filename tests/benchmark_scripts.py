"""Helpers of the benchmark scripts' tests: import a script of ``benchmarks/`` as a module, read its markdown tables."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(stem: str) -> ModuleType:
    """``benchmarks/<stem>.py`` as the module ``benchmarks.<stem>`` (the checkout's root on ``sys.path``), the module its
    sibling scripts import."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"benchmarks.{stem}")


def markdown_table(lines: list[str]) -> dict[str, dict[str, str]]:
    """``{first cell: {column: cell}}`` of a markdown table's lines (header, rule, rows)."""
    header, _, *rows = lines
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    return {
        cells[0]: dict(zip(columns, cells, strict=False))
        for cells in ([cell.strip() for cell in line.strip("|").split("|")] for line in rows)
    }
