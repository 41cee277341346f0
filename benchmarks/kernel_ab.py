"""Two builds of the C++ CPU step side by side in one process: this checkout's kernel against another git revision's.

Usage::

    python benchmarks/kernel_ab.py --base REV [--formats int8,int8:sr,bf16] [--model mlp|transformer|param]
                                   [--numel N] [--threads T] [--rounds R]

The paired measurement behind the step changes of issue #22 (README, "Optimizer step on the CPU"): separate runs
on a shared machine differ by 10-40 %, two builds stepped alternately in one process see the same machine. The
base revision's ``lightning_qstate/kernels/csrc`` is compiled once (~45 s; torch caches it by the sources' hash)
and loaded beside this checkout's build; this checkout's Python side drives both, so the base kernel must take the
same arguments (compare revisions that differ in ``csrc/`` alone: a different signature stops the run with the
error). For each format (``name``, or ``name:sr`` for stochastic rounding) two QAdamW optimizers (benchmarks/optim.py's
AdamW settings and ``min_quant_size``) step copies of the same parameters and fixed gradients (optim.py's models, or
``param``: one parameter of ``--numel`` values): 3 warm-up steps each, then ``--rounds`` rounds of one timed
``optimizer.step()`` per build, the order alternating between rounds. Reported per format: each build's median ms
per step, the median and the mean (± its standard error) over rounds of ``head / base - 1`` (a paired difference:
both steps of a round ran on the same machine state; the median resists a round that a burst on another tenant hit),
and whether the two copies hold the same parameters and states afterwards, bit for bit (they must: the builds
compute the same codes and draws).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as ``python benchmarks/kernel_ab.py``: the checkout's packages (benchmarks, lightning_qstate)
    sys.path.insert(0, str(ROOT))

import benchmarks.optim as optim  # noqa: E402  (its models and AdamW settings)
from benchmarks.arguments import positive_int  # noqa: E402
from lightning_qstate import QAdamW  # noqa: E402
from lightning_qstate.formats import QuantizedTensor, get_format  # noqa: E402
from lightning_qstate.kernels import native  # noqa: E402


def revision_sources(revision: str) -> Path:
    """A directory holding the kernel's sources (``native.SOURCES``) as git ``revision`` has them (under the system's
    temporary directory, named by the commit, so a second run finds them). Raises ``ValueError`` for a revision git
    does not know or whose kernel lacks one of the files."""
    relative = native.CSRC.resolve().relative_to(ROOT.resolve())  # a symlinked checkout: both resolved
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{revision}^{{commit}}"], capture_output=True,
                                text=True, check=True).stdout.strip()  # fmt: skip
    except subprocess.CalledProcessError as error:
        raise ValueError(f"--base {revision!r}: not a revision of {ROOT} ({error.stderr.strip()})") from None
    directory = Path(tempfile.gettempdir()) / f"lightning_qstate_csrc_{commit[:12]}"
    directory.mkdir(exist_ok=True)
    for path in native.SOURCES:
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:{relative / path.name}"], capture_output=True)
        if shown.returncode != 0:
            raise ValueError(f"--base {revision!r}: it has no {relative / path.name}; pick a revision with this kernel layout")
        (directory / path.name).write_bytes(shown.stdout)
    return directory


def build_optimizer(params: list[torch.nn.Parameter], fmt: str) -> QAdamW:
    """QAdamW with optim.py's settings and a fixed rounding seed; ``fmt``: a state format, ``:sr`` appended for stochastic
    rounding."""
    name, _, rounding = fmt.partition(":")
    return QAdamW(params, lr=optim.LR, weight_decay=optim.WEIGHT_DECAY, states=name, rounding="stochastic" if rounding else "nearest",
                  min_quant_size=optim.MIN_QUANT_SIZE, generator=torch.Generator().manual_seed(0))  # fmt: skip


def make_params(model: str, numel: int) -> list[torch.nn.Parameter]:
    """optim.py's model ``model``, or ``param``: one parameter of ``numel`` values; seeded parameters and gradients as
    optim.py's ``make_model`` makes them."""
    if model == "param":
        spec = optim.ModelSpec("param", f"one parameter of {numel} values", lambda: torch.nn.ParameterList([torch.randn(numel)]))
    else:
        spec = optim.model_specs(False)[model]
    return optim.make_model(spec, 0)


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """Every parameter, then every tensor of its state (a coded state's codes and scales), in order."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            yield param.detach()
            for value in optimizer.state[param].values():
                if isinstance(value, QuantizedTensor):
                    yield value.codes
                    if value.scales is not None:
                        yield value.scales
                elif isinstance(value, torch.Tensor):
                    yield value


def same_bits(first: torch.optim.Optimizer, second: torch.optim.Optimizer) -> bool:
    """Whether both optimizers hold the same parameters and states, bit for bit (NaNs equal where their patterns are)."""
    pairs = list(zip(_state_tensors(first), _state_tensors(second), strict=True))
    return all(a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)) for a, b in pairs)


def compare(fmt: str, builds: dict[str, object], args: argparse.Namespace) -> str:
    """One format's line: both builds stepping copies of the same parameters, ``args.rounds`` paired rounds."""
    params = make_params(args.model, args.numel)
    copies = {name: copy.deepcopy(params) for name in builds}
    for copied in copies.values():  # deepcopy leaves .grad out: each copy gets its own clone
        for param, original in zip(copied, params, strict=True):
            param.grad = original.grad.clone()
    optimizers = {name: build_optimizer(copied, fmt) for name, copied in copies.items()}
    seconds: dict[str, list[float]] = {name: [] for name in builds}
    package_kernel = native._kernel
    try:
        for round_index in range(-3, args.rounds):  # 3 warm-up steps each (the first allocates the states)
            for name in list(builds) if round_index % 2 == 0 else list(reversed(builds)):
                native._kernel = lambda module=builds[name]: module  # the build this step calls (native._function reads it)
                start = time.perf_counter()
                optimizers[name].step()
                if round_index >= 0:
                    seconds[name].append(time.perf_counter() - start)
    finally:
        native._kernel = package_kernel
    differences = [head / base - 1 for base, head in zip(seconds["base"], seconds["head"], strict=True)]
    error = statistics.stdev(differences) / len(differences) ** 0.5
    base_ms, head_ms = (1e3 * statistics.median(seconds[name]) for name in ("base", "head"))
    verdict = "same bits" if same_bits(optimizers["base"], optimizers["head"]) else "BITS DIFFER"
    return (f"| {fmt} | {base_ms:.2f} | {head_ms:.2f} | {100 * statistics.median(differences):+.1f} % | "
            f"{100 * statistics.mean(differences):+.1f} % ± {100 * error:.1f} | {verdict} |")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the git revision to compare this checkout's kernel with (e.g. HEAD~1)")
    parser.add_argument("--formats", default="int8,int8:sr,int4,fp8_e4m3,bf16,bf16:sr", help="comma-separated; name:sr for SR")
    parser.add_argument("--model", choices=("mlp", "transformer", "param"), default="param")
    parser.add_argument("--numel", type=positive_int, default=1 << 20, help="values of the one parameter of --model param")
    parser.add_argument("--threads", type=positive_int, default=1)
    parser.add_argument("--rounds", type=positive_int, default=40)
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be at least 2")
    bad = [fmt for fmt in args.formats.split(",") if fmt.partition(":")[2] not in ("", "sr")]
    if bad:
        parser.error(f"--formats: {', '.join(bad)}: append ':sr' for stochastic rounding, or nothing for round to nearest")
    for fmt in args.formats.split(","):  # before the two builds (a minute each)
        try:
            get_format(fmt.partition(":")[0])
        except (ValueError, TypeError) as error:
            parser.error(f"--formats: {error}")
    try:
        sources = revision_sources(args.base)
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    builds = {"base": native.build_extension(sources), "head": native._kernel()}
    if builds["head"] is None:
        sys.exit("the C++ CPU kernel does not build here: nothing to compare")
    print(f"{args.model} ({args.numel} values)" if args.model == "param" else args.model, f"{args.threads} thread(s),",
          f"{args.rounds} paired rounds; base {args.base}, head this checkout ({native.extension_name()})\n")  # fmt: skip
    print("| states | base ms | head ms | head / base - 1: median | mean ± s.e. | check |\n|---|---:|---:|---:|---:|---|")
    for fmt in args.formats.split(","):
        print(compare(fmt, builds, args), flush=True)


if __name__ == "__main__":
    main()
