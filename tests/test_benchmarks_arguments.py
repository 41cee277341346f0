"""The benchmark scripts refuse bad arguments as usage errors (exit 2, the option named) before any work."""

from __future__ import annotations

import pytest

from benchmark_scripts import load_benchmark


@pytest.mark.parametrize(
    ("stem", "argv", "said"),
    [
        ("optim", ["--models", ","], "--models"),
        ("optim", ["--methods", ","], "--methods"),
        ("optim", ["--repeats", "0"], "--repeats"),
        ("staleness", ["--steps", "0"], "--steps"),
        ("staleness", ["--jobs", "0"], "--jobs"),
        ("stall_simulation", ["--entries", "0"], "--entries"),
        ("stall_simulation", ["--horizons", "0"], "--horizons"),
        ("kernel_ab", ["--base", "HEAD", "--formats", "bogus"], "unknown format 'bogus'"),
        ("adaptive_bits", ["--target-bits", "0"], "--target-bits"),
        ("adaptive_bits", ["--gpt-steps", "0"], "--gpt-steps"),
        ("ptq_robustness", ["--steps", "0"], "--steps"),
        ("eco", ["--steps", "-1"], "--steps"),
        ("mantissa_sweep", ["--seeds", "0"], "--seeds"),
        ("formats", ["--numel", "0"], "--numel"),
        ("formats", ["--numel", "100"], "--numel 100: give a multiple of 256"),
    ],
)
def test_bad_arguments_are_usage_errors(stem, argv, said, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_benchmark(stem).main(argv)
    assert exit_info.value.code == 2 and said in capsys.readouterr().err
