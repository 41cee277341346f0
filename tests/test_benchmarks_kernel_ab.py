"""``benchmarks/kernel_ab.py``: another revision's kernel sources, the paired comparison and its bit check, bad options.

The comparison runs here with this checkout's build on both sides (building another revision takes ~45 s)."""

from __future__ import annotations

import argparse
import subprocess
from types import ModuleType, SimpleNamespace

import pytest
import torch

from lightning_qstate.kernels import native

from benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_benchmark("kernel_ab")


def test_a_revisions_sources_are_its_files(bench):
    directory = bench.revision_sources("HEAD")
    for path in native.SOURCES:
        relative = path.relative_to(bench.ROOT).as_posix()
        shown = subprocess.run(["git", "-C", str(bench.ROOT), "show", f"HEAD:{relative}"], capture_output=True, check=True).stdout
        assert (directory / path.name).read_bytes() == shown
    with pytest.raises(ValueError, match="--base 'no-such-revision': not a revision"):
        bench.revision_sources("no-such-revision")


def test_the_comparison_reports_both_builds_and_whether_their_bits_agree(bench):
    """One table row per format: both builds' ms, the paired differences, and the bit check, which a build that moves
    one parameter by an ulp fails."""
    kernel = native._kernel()
    args = argparse.Namespace(model="param", numel=4096, rounds=3)
    row = bench.compare("int8:sr", {"base": kernel, "head": kernel}, args)
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[0] == "int8:sr" and cells[-1] == "same bits" and len(cells) == 6
    assert float(cells[1]) > 0 and float(cells[2]) > 0 and cells[3].endswith("%") and "±" in cells[4]

    def nudged(**kwargs):  # the kernel's step, then one parameter value an ulp up
        rows = kernel.adam_steps_u8(**kwargs)
        with torch.no_grad():
            first = kwargs["params"][0].view(-1)
            first[0] = torch.nextafter(first[0], torch.tensor(float("inf")))
        return rows

    differing = SimpleNamespace(adam_steps_u8=nudged)
    assert bench.compare("int8", {"base": kernel, "head": differing}, args).rstrip().endswith("| BITS DIFFER |")
    assert native._kernel() is kernel  # each step chose its build; the package's kernel is back afterwards


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--base", "HEAD", "--formats", "int8,int8:rn"], "--formats: int8:rn: append ':sr'"),
        (["--base", "no-such-revision"], "--base 'no-such-revision': not a revision"),
        (["--base", "HEAD", "--rounds", "1"], "--rounds must be at least 2"),
    ],
)
def test_bad_options_stop_before_any_build_naming_the_option(bench, capsys, argv, message):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err
