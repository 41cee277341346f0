"""Helpers of the benchmark scripts' tests: import a script of ``benchmarks/`` as a module, read its markdown tables."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(stem: str) -> ModuleType:
    """``benchmarks/<stem>.py`` imported as the module ``benchmarks_<stem>``."""
    spec = importlib.util.spec_from_file_location(f"benchmarks_{stem}", BENCHMARKS / f"{stem}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def markdown_table(lines: list[str]) -> dict[str, dict[str, str]]:
    """``{first cell: {column: cell}}`` of a markdown table's lines (header, rule, rows)."""
    header, _, *rows = lines
    columns = [cell.strip() for cell in header.strip("|").split("|")]
    return {
        cells[0]: dict(zip(columns, cells, strict=False))
        for cells in ([cell.strip() for cell in line.strip("|").split("|")] for line in rows)
    }
