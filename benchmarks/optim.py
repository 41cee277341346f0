"""Optimizer step time, state size and memory on the CPU: fp32 AdamW, torchao's and bitsandbytes' low-bit AdamW, and QAdamW.

Usage::

    python benchmarks/optim.py [--repeats R] [--out PATH] [--models mlp,transformer] [--quick]
                               [--methods KEY,...] [--no-compile] [--warm-cache] [--threads N]
                               [--budget S] [--profile KEY,...|none] [--mode separate|shared|both]

Only ``optimizer.step()`` is timed: each model's gradients are fixed seeded random
tensors, set once. Models: an MLP 1024 -> 4096 -> 1024 (8.4M parameters) and a small
transformer (256-token embedding, ``nn.TransformerEncoder`` with d_model 256,
4 layers, ffn 1024, and a 256-way head: 3.3M parameters).

Every (method, model) pair runs in its own worker process (``--worker KEY``), so
that RSS, ``torch.compile`` caches and imports do not leak between methods; all
workers start with the same seed. The parent drives them over a pipe:

1. ``setup``: build the model and optimizer, time the first step (state allocation
   and, for compiling methods, ``torch.compile``) and the warm-up steps. One worker
   at a time, so compiles do not compete for the CPU.
2. ``step``, ``R`` rounds: every worker times one ``optimizer.step()`` per round, one
   worker at a time, in a rotated order, so a slow phase of a shared machine hits all
   methods alike. Before each timed step the parent waits until no thread of another
   worker runs (:func:`wait_for_quiet`: the OpenMP threads of the worker that has just
   replied spin for several ms, and would take cores from the next one's step). A
   method whose timed steps have taken more than ``--budget`` seconds sits out the
   remaining rounds (after at least 2), so one pathologically slow method cannot
   stretch the run. Reported: the median,
   the interquartile range and the number of rounds, and ``x fused fp32``: the median
   over rounds of the step time over the fused fp32 AdamW step of the same round.
3. ``finish``: memory figures (below); ``profile``: one step under ``torch.profiler``.

``--mode shared`` (or ``both``, which runs this after the above) measures the way an adaptive run uses the
optimizer: several formats in one process. One worker per model (``--shared-worker``) builds every method in turn,
each on its own copy of the model, takes its first step (reported as ``first step s``: state allocation and the C++
build or ``torch.compile``, with the compiles of the methods before it already in the process) and the remaining
warm-up steps (default 3 steps in all), then times ``R`` rounds of one step of every method, rotated, in that one
process; ``x fused fp32`` as above. No memory figures there (one process holds every method). Target (d) (issue
#22): every format of ours <= 1.5x fused fp32 AdamW with RN, <= 1.7x with SR, int8 RN <= 1.15x, in both modes.

Memory, from ``/proc/self/status`` (``VmRSS``/``VmHWM``; the high-water mark is reset
through ``/proc/self/clear_refs`` where Linux allows it, else ``ru_maxrss`` is read):

- RSS peak: the worker's highest RSS over its whole life (torch and peer imports
  included: the mapped torch libraries alone are several hundred MB);
- step RSS increase: the high-water mark over the timed steps minus the RSS just
  before them: the transient memory of a steady-state step;
- first-step RSS increase: the high-water mark over the first and warm-up steps minus
  the RSS before them: the states allocated, plus whatever compiling took.

Inductor and ``torch.utils.cpp_extension`` build in a cache directory that is fresh
for each method in each run, unless ``--warm-cache``: a method's first model
compiles cold (as on a first run), its later models find that method's kernels of the
first model on disk (as on a second run; graphs of new shapes still compile).
Compiler subprocesses are not in the RSS.

State bytes per parameter: ours through ``lightning_qstate.state_nbytes`` (codes and
scales of every quantized state, every plain tensor); the peers through
:func:`state_bytes`, which counts each distinct tensor storage in ``optimizer.state``
once, expanding tensor subclasses (torchao's ``OptimState8bit``/``4bit``: ``codes``,
``scale`` and ``qmap``) into their inner tensors via ``__tensor_flatten__``;
bitsandbytes' states are plain tensors (``state1``/``state2`` codes, ``absmax1/2``
scales, the shared ``qmap1/2`` counted once). Everyone's ``step`` counter is
included where it is a tensor. All methods keep fp32 states for parameters with
fewer than 4096 values (``min_quant_size=4096``; torchao also for sizes that are not
a multiple of its block, bitsandbytes' ``min_8bit_size=4096``).

A method that cannot run (peer not installed, or failing on the CPU) shows as
``n/a (reason)``. The report ends with PASS/FAIL lines for the targets (a) QAdamW
int8 step <= 1.5x fused fp32 AdamW, (b) QAdamW int8 faster than bitsandbytes' and
torchao's 8-bit AdamW, (c) state <= 2.05 bytes/param for int8 and <= 1.1 for int4.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import hashlib
import json
import math
import os
import platform
import re
import resource
import select
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as ``python benchmarks/optim.py``: the checkout's packages (benchmarks, lightning_qstate)
    sys.path.insert(0, str(ROOT))

import benchmarks.formats as _formats  # noqa: E402  (its helpers)
from benchmarks.arguments import names, non_negative_int, positive_int  # noqa: E402
from lightning_qstate import QAdamW, state_nbytes  # noqa: E402
from lightning_qstate.formats import QuantizedTensor  # noqa: E402

_short_reason, _version, seconds = _formats._short_reason, _formats._version, _formats.seconds

SCRIPT = Path(__file__).resolve()
DEFAULT_OUT = SCRIPT.parent / "results" / "optim.md"
LR, WEIGHT_DECAY = 1e-3, 1e-2  # every method gets the same AdamW hyperparameters (betas, eps: torch's defaults)
MIN_QUANT_SIZE = 4096
BASELINE = "adamw-fused"
OUR_INT8 = "qadamw-int8-rn"
TARGET_STEP_RATIO = 1.5
TARGET_RN_RATIO, TARGET_SR_RATIO, TARGET_INT8_RATIO = 1.5, 1.7, 1.15  # issue #22, every format, both modes
MODES = ("separate", "shared")
MODE_NAMES = {"separate": "a process per method", "shared": "all methods in one process"}
TARGET_BYTES = {"int8": 2.05, "int4": 1.1}
WORKER_TIMEOUT_S = 900.0
QUIET_TIMEOUT_S = 1.0  # the longest wait for the other workers' threads to go to sleep before a timed step


# --------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Options:
    """What a worker was asked to do; ``compile=False`` turns off ``torch.compile`` for every method."""

    compile: bool = True


@dataclass(frozen=True)
class Method:
    """One optimizer under test: ``build(params, options)`` makes it (importing peers lazily).

    ``family``: ``"torch"``, ``"torchao"``, ``"bitsandbytes"`` or ``"ours"``; ``compiles``: whether it runs
    ``torch.compile`` on the CPU (its first step then includes a compile); ``fmt``: our state format.
    """

    key: str  # CLI name, e.g. "qadamw-int8-rn"
    label: str
    family: str
    build: Callable[[list[torch.nn.Parameter], Options], torch.optim.Optimizer]
    compiles: bool = False
    fmt: str | None = None
    rounding: str | None = None


def _torch_adamw(**kwargs: Any) -> Callable[[list[torch.nn.Parameter], Options], torch.optim.Optimizer]:
    return lambda params, _: torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **kwargs)


def _torchao_adamw(name: str) -> Callable[[list[torch.nn.Parameter], Options], torch.optim.Optimizer]:
    def build(params: list[torch.nn.Parameter], options: Options) -> torch.optim.Optimizer:
        import torchao.optim

        if not options.compile:  # torchao calls torch.compile(fullgraph=True) in every step: make it the identity
            torch.compile = lambda model=None, **_: model  # (only in this worker process)
        return getattr(torchao.optim, name)(params, lr=LR, weight_decay=WEIGHT_DECAY)  # min size 4096 is built in

    return build


def _bnb_adamw8bit(params: list[torch.nn.Parameter], _: Options) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=LR, weight_decay=WEIGHT_DECAY, min_8bit_size=MIN_QUANT_SIZE)


def _qadamw(fmt: str, rounding: str) -> Callable[[list[torch.nn.Parameter], Options], torch.optim.Optimizer]:
    def build(params: list[torch.nn.Parameter], options: Options) -> torch.optim.Optimizer:
        opt = QAdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, states=fmt, rounding=rounding, min_quant_size=MIN_QUANT_SIZE)
        opt.cpu_compile = options.compile
        return opt

    return build


OUR_FORMATS = ("int8", "int4", "int6", "fp8_e4m3", "bf16", "fp16")
ROUNDINGS = {"rn": "nearest", "sr": "stochastic"}


def all_methods() -> list[Method]:
    """The registry: torch's fp32 AdamW (the baseline first), the peers, then QAdamW per format and rounding."""
    methods = [
        Method("adamw-fused", "torch AdamW fused (fp32)", "torch", _torch_adamw(fused=True)),
        Method("adamw-foreach", "torch AdamW foreach (fp32)", "torch", _torch_adamw(foreach=True)),
        Method("torchao-adamw8bit", "torchao AdamW8bit", "torchao", _torchao_adamw("AdamW8bit"), compiles=True),
        Method("torchao-adamw4bit", "torchao AdamW4bit", "torchao", _torchao_adamw("AdamW4bit"), compiles=True),
        Method("bnb-adamw8bit", "bitsandbytes AdamW8bit", "bitsandbytes", _bnb_adamw8bit),
    ]
    for fmt in OUR_FORMATS:
        for short, rounding in ROUNDINGS.items():
            label = f"QAdamW {fmt} · {short.upper()}"
            methods.append(Method(f"qadamw-{fmt}-{short}", label, "ours", _qadamw(fmt, rounding), True, fmt, rounding))
    return methods


METHODS = {m.key: m for m in all_methods()}


def state_bytes(optimizer: torch.optim.Optimizer, params: list[torch.Tensor] | None = None) -> int:
    """Bytes of every distinct tensor storage held in ``optimizer.state`` (of ``params`` only, if given; see the module docs).

    Our ``QuantizedTensor`` counts its codes and scales; a tensor subclass (torchao's states) counts the
    inner tensors of ``__tensor_flatten__``, recursively; storages shared between states (bitsandbytes'
    ``qmap1``/``qmap2``) count once. Non-tensor values (bitsandbytes' int ``step``) count nothing.
    """
    seen: set[int] = set()

    def count(value: Any) -> int:
        if isinstance(value, QuantizedTensor):
            return sum(count(t) for t in (value.codes, value.scales) if t is not None)
        if not isinstance(value, torch.Tensor):
            return 0
        if type(value) not in (torch.Tensor, torch.nn.Parameter) and hasattr(value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            return sum(count(getattr(value, name)) for name in names)
        storage = value.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    states = optimizer.state.values() if params is None else [optimizer.state[p] for p in params if p in optimizer.state]
    return sum(count(value) for state in states for value in state.values())


# --------------------------------------------------------------------------- models


@dataclass(frozen=True)
class ModelSpec:
    name: str
    description: str
    build: Callable[[], torch.nn.Module]


class TinyTransformer(torch.nn.Module):
    """Token embedding, ``nn.TransformerEncoder``, linear head (only its parameters matter here)."""

    def __init__(self, vocab: int, d_model: int, layers: int, ffn: int, heads: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        layer = torch.nn.TransformerEncoderLayer(d_model, heads, ffn, batch_first=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # enable_nested_tensor notice
            self.encoder = torch.nn.TransformerEncoder(layer, layers)
        self.head = torch.nn.Linear(d_model, vocab)


def model_specs(quick: bool) -> dict[str, ModelSpec]:
    """The two models; ``quick``: tiny ones (still above ``min_quant_size``, so states get quantized)."""
    if quick:
        mlp = (64, 256)
        tf = dict(vocab=256, d_model=32, layers=1, ffn=128, heads=2)
    else:
        mlp = (1024, 4096)
        tf = dict(vocab=256, d_model=256, layers=4, ffn=1024, heads=4)
    return {
        "mlp": ModelSpec(
            "mlp", f"MLP {mlp[0]} -> {mlp[1]} -> {mlp[0]} (GELU)",
            lambda: torch.nn.Sequential(torch.nn.Linear(*mlp), torch.nn.GELU(), torch.nn.Linear(mlp[1], mlp[0])),
        ),
        "transformer": ModelSpec(
            "transformer",
            f"{tf['vocab']}-token embedding + TransformerEncoder (d_model {tf['d_model']}, {tf['layers']} layers, "
            f"ffn {tf['ffn']}, {tf['heads']} heads) + {tf['vocab']}-way head",
            lambda: TinyTransformer(**tf),
        ),
    }  # fmt: skip


def cpu_description() -> str:
    """The CPU's model name (``/proc/cpuinfo``, where there is one) and torch's vector capability (``AVX512``, ``AVX2``,
    ...): the C++ step's speed depends on both (its AVX-512 loops against the compiler-vectorized ones)."""
    try:
        match = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
    except OSError:
        match = None
    name = match.group(1).strip() if match else platform.processor() or "unknown CPU"
    return f"{name}, torch CPU capability {torch.backends.cpu.get_cpu_capability()}"


def make_model(spec: ModelSpec, seed: int) -> list[torch.nn.Parameter]:
    """The model's parameters, each with a fixed seeded random gradient."""
    torch.manual_seed(seed)
    params = list(spec.build().parameters())
    generator = torch.Generator().manual_seed(seed + 1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator) * 1e-2
    return params


# --------------------------------------------------------------------------- worker side


def _proc_status_kb(field_name: str) -> int | None:
    try:
        match = re.search(rf"^{field_name}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def maxrss_mb() -> float:
    """``ru_maxrss`` in MiB (kB on Linux, bytes on macOS)."""
    value = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return value / (1 << 20) if sys.platform == "darwin" else value / 1024


def rss_mb() -> float:
    """Current RSS in MiB (``ru_maxrss`` where ``/proc`` is missing)."""
    kb = _proc_status_kb("VmRSS")
    return maxrss_mb() if kb is None else kb / 1024


def hwm_mb() -> float:
    """RSS high-water mark in MiB since the last :func:`reset_hwm`."""
    kb = _proc_status_kb("VmHWM")
    return maxrss_mb() if kb is None else kb / 1024


def reset_hwm() -> bool:
    """Reset the RSS high-water mark to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def state_figures(method: Method, optimizer: torch.optim.Optimizer, params: list[torch.Tensor]) -> dict[str, Any]:
    """The parameter and state-byte counts of a worker's reply: all parameters, and those under ``MIN_QUANT_SIZE``."""
    small = [p for p in params if p.numel() < MIN_QUANT_SIZE]
    return {
        "n_params": sum(p.numel() for p in params),
        "state_bytes": state_nbytes(optimizer) if method.family == "ours" else state_bytes(optimizer),
        "small_params": sum(p.numel() for p in small),
        "small_state_bytes": state_bytes(optimizer, small),
    }


def run_notes(caught: list[warnings.WarningMessage]) -> list[str]:
    """The distinct runtime warnings a method raised while it was built and stepped, shortened."""
    return sorted({_short_reason(w.message) for w in caught if issubclass(w.category, RuntimeWarning)})


class WorkerBench:
    """One method on one model, inside the worker process."""

    def __init__(self, method: Method, spec: ModelSpec, seed: int, warmup: int, options: Options) -> None:
        self.method, self.spec, self.seed, self.warmup, self.options = method, spec, seed, warmup, options
        self.peak = 0.0
        self.digest = source_digest()  # of the sources as imported (the package may change while the run goes on)

    def setup(self) -> dict[str, Any]:
        params = make_model(self.spec, self.seed)
        self.optimizer = self.method.build(params, self.options)
        gc.collect()
        rss_before = rss_mb()
        self.peak = max(hwm_mb(), maxrss_mb())  # imports and model
        self.hwm_reset = reset_hwm()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first_s = seconds(self.optimizer.step)
            for _ in range(self.warmup - 1):
                self.optimizer.step()
        first_peak = hwm_mb() if self.hwm_reset else maxrss_mb()
        self.peak = max(self.peak, first_peak)
        first_increase = first_peak - rss_before
        figures = state_figures(self.method, self.optimizer, params)
        nbytes, notes = figures["state_bytes"], run_notes(caught)
        if self.method.family == "ours" and nbytes != state_bytes(self.optimizer):
            notes.append(f"state_nbytes {nbytes} != storage count {state_bytes(self.optimizer)}")
        gc.collect()
        self.hwm_reset = self.hwm_reset and reset_hwm()
        self.rss_steady = rss_mb()
        self.maxrss_steady = maxrss_mb()
        return {
            **figures,
            "first_step_s": first_s,
            "rss_before_mb": rss_before,
            "first_rss_increase_mb": first_increase,
            "threads": torch.get_num_threads(),
            "digest": self.digest,
            "notes": notes,
        }

    def step(self) -> float:
        return 1e3 * seconds(self.optimizer.step)

    def finish(self) -> dict[str, Any]:
        if self.hwm_reset:
            step_peak, increase = hwm_mb(), hwm_mb() - self.rss_steady
        else:  # only what went beyond the earlier high-water mark shows
            step_peak, increase = maxrss_mb(), maxrss_mb() - self.maxrss_steady
        return {"rss_peak_mb": max(self.peak, step_peak), "step_rss_increase_mb": increase, "hwm_reset": self.hwm_reset}

    def profile(self, top: int = 8) -> list[list[Any]]:
        """The ``top`` ops of one step by self CPU time: ``[name, self ms, calls]``, plus the step's total."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            self.optimizer.step()
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in events) / 1e3
        rows = [[e.key if len(e.key) <= 60 else e.key[:57] + "...", e.self_cpu_time_total / 1e3, e.count] for e in events[:top]]
        grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        check = statistics.median(seconds(lambda: [bool(torch.isfinite(g).all()) for g in grads]) for _ in range(3))
        step = statistics.median(seconds(self.optimizer.step) for _ in range(3))
        return [
            ["(all ops, self CPU total)", total, sum(e.count for e in events)],
            *rows,
            ["(unprofiled) one step, median of 3", 1e3 * step, 1],
            ["(unprofiled) `bool(torch.isfinite(g).all())` for every grad alone, median of 3", 1e3 * check, len(grads)],
        ]


def worker_main(args: argparse.Namespace) -> None:
    """Serve ``setup`` / ``step`` / ``profile`` / ``finish`` requests on stdin, one JSON line each on the real stdout."""
    reply_stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything a library prints goes to stderr, not into the protocol
    sys.stdout = sys.stderr

    def reply(**message: Any) -> None:
        reply_stream.write(json.dumps(message) + "\n")
        reply_stream.flush()

    if args.threads:
        torch.set_num_threads(args.threads)
    spec, options = model_specs(args.quick)[args.model], Options(compile=not args.no_compile)
    bench = WorkerBench(METHODS[args.worker], spec, args.seed, args.warmup, options)
    reply(hello=True)
    for line in sys.stdin:
        command = line.strip()
        try:
            if command == "setup":
                reply(**bench.setup())
            elif command == "step":
                reply(ms=bench.step())
            elif command == "profile":
                reply(ops=bench.profile())
            elif command == "finish":
                reply(**bench.finish())
                return
            else:
                reply(error=f"unknown command {command!r}")
        except Exception as error:  # noqa: BLE001 - a peer failing on CPU is a result, not a crash
            reply(error=_short_reason(error))
            return


def shared_worker_main(args: argparse.Namespace) -> None:
    """``--shared-worker``: every method of ``--methods`` on ``--model`` in this one process (one JSON reply).

    As an adaptive run uses several formats: the optimizers are built one after another in this process, each on
    its own copy of the model (same seed), each taking its first step (timed: state allocation, the C++ build or
    ``torch.compile``) and ``--warmup - 1`` more right after it is built; then ``--repeats`` rounds, one timed step of
    every optimizer per round in a rotated order (a method sits out once its timed steps exceed ``--budget`` s, after
    >= 2). A method that fails is reported as such; the others go on.
    """
    reply_stream = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    if args.threads:
        torch.set_num_threads(args.threads)
    spec, options = model_specs(args.quick)[args.model], Options(compile=not args.no_compile)
    results: dict[str, dict[str, Any]] = {}
    optimizers: dict[str, torch.optim.Optimizer] = {}
    for key in args.methods:
        method, result = METHODS[key], {"times_ms": [], "rounds": [], "notes": [], "failure": None}
        results[key] = result
        try:
            params = make_model(spec, args.seed)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                optimizer = method.build(params, options)
                result["first_step_s"] = seconds(optimizer.step)
                result["warmup_s"] = [seconds(optimizer.step) for _ in range(args.warmup - 1)]
            result["notes"] = run_notes(caught)
            result.update(state_figures(method, optimizer, params))
            result["paths"] = sorted(set(optimizer.step_paths().values())) if method.family == "ours" else []
            optimizers[key] = optimizer
        except Exception as error:  # noqa: BLE001 - a peer failing on CPU is a result, not a crash
            result["failure"] = _short_reason(error)
        print(f"{key}: first step {result.get('first_step_s', math.nan):.2f} s", file=sys.stderr, flush=True)
    order = list(optimizers)
    for r in range(args.repeats):
        shift = r % len(order) if order else 0
        for key in order[shift:] + order[:shift]:
            result = results[key]
            if result["failure"] is None and (len(result["times_ms"]) < 2 or sum(result["times_ms"]) <= 1e3 * args.budget):
                try:
                    result["times_ms"].append(1e3 * seconds(optimizers[key].step))
                    result["rounds"].append(r)
                except Exception as error:  # noqa: BLE001
                    result["failure"], result["times_ms"], result["rounds"] = f"during timing: {_short_reason(error)}", [], []
    reply_stream.write(json.dumps({"results": results, "threads": torch.get_num_threads(), "digest": source_digest()}) + "\n")
    reply_stream.flush()


# --------------------------------------------------------------------------- parent side


class WorkerError(RuntimeError):
    pass


class Worker:
    """A ``--worker`` subprocess and its pipe; its stderr goes to ``log_path``."""

    def __init__(self, method: Method | None, model: str, args: argparse.Namespace, run_dir: Path) -> None:
        """``method`` ``None``: a ``--shared-worker`` running every method of ``args.methods`` (one cache for all)."""
        self.method = method
        name = method.key if method is not None else "shared"
        self.log_path = run_dir / f"{model}-{name}.log"
        env = dict(os.environ)
        if not args.warm_cache:
            cache = run_dir / f"cache-{name}"  # fresh per run and method, shared by its models
            env["TORCHINDUCTOR_CACHE_DIR"], env["TORCH_EXTENSIONS_DIR"] = str(cache / "inductor"), str(cache / "extensions")
        if method is not None:
            command = [sys.executable, str(SCRIPT), "--worker", method.key, "--model", model]
        else:
            command = [sys.executable, str(SCRIPT), "--shared-worker", "--methods", ",".join(args.methods), "--model", model]
            command += ["--repeats", str(args.repeats), "--budget", str(args.budget)]
        command += ["--seed", str(args.seed), "--warmup", str(args.warmup)]
        command += ["--quick"] * args.quick + ["--no-compile"] * args.no_compile
        command += ["--threads", str(args.threads)] if args.threads else []
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, bufsize=0, env=env)
        self.buffer = b""

    def _last_log_line(self) -> str:
        try:
            lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        errors = [line for line in lines if re.match(r"^\w*(Error|Exception)\b", line)]
        return (errors or lines or ["exited without output"])[-1][:200]

    def receive(self, timeout: float = WORKER_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.kill()
                raise WorkerError(f"worker timed out after {timeout:.0f} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if ready:
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    self.proc.wait()
                    raise WorkerError(f"worker exited ({self.proc.returncode}): {self._last_log_line()}")
                self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        message = json.loads(line)
        if "error" in message:
            raise WorkerError(message["error"])
        return message

    def request(self, command: str, timeout: float = WORKER_TIMEOUT_S) -> dict[str, Any]:
        try:
            self.proc.stdin.write(command.encode() + b"\n")
        except (BrokenPipeError, OSError):
            pass  # the read below reports why it died
        return self.receive(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()


@dataclass
class Row:
    """One method on one model; ``failure`` set (numbers NaN) when it could not run."""

    method: Method
    model: str
    n_params: int = 0
    times_ms: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)  # the round of each entry of times_ms
    small_params: int = 0  # parameters under min_quant_size (fp32 states everywhere)
    small_state_bytes: float = math.nan
    first_step_s: float = math.nan
    state_bytes: float = math.nan
    rss_peak_mb: float = math.nan
    step_rss_increase_mb: float = math.nan
    first_rss_increase_mb: float = math.nan
    rss_before_mb: float = math.nan
    hwm_reset: bool = True
    threads: int = 0
    digest: str = ""
    notes: list[str] = field(default_factory=list)
    profile: list[list[Any]] | None = None
    failure: str | None = None
    mode: str = "separate"  # "separate": a worker process per method; "shared": every method in one process
    warmup_s: list[float] = field(default_factory=list)  # the untimed steps after the first (shared mode)
    paths: list[str] = field(default_factory=list)  # ours: the step paths its parameters took (shared mode)

    @property
    def step_ms(self) -> float:
        return statistics.median(self.times_ms) if self.times_ms else math.nan

    @property
    def iqr_ms(self) -> tuple[float, float]:
        if len(self.times_ms) < 2:
            return self.step_ms, self.step_ms
        q = statistics.quantiles(self.times_ms, n=4, method="inclusive")
        return q[0], q[2]

    @property
    def bytes_per_param(self) -> float:
        return self.state_bytes / self.n_params if self.n_params else math.nan

    @property
    def quantized_bytes_per_param(self) -> float:
        """Bytes/param over the parameters of at least ``min_quant_size`` values only."""
        n = self.n_params - self.small_params
        return (self.state_bytes - self.small_state_bytes) / n if n > 0 else math.nan


def paired_ratio(row: Row, base: Row | None) -> float:
    """Median over rounds of ``row``'s step time over ``base``'s in the same round (NaN without both)."""
    if base is None or row.failure or base.failure:
        return math.nan
    base_times = dict(zip(base.rounds, base.times_ms, strict=False))
    ratios = [t / base_times[r] for r, t in zip(row.rounds, row.times_ms, strict=False) if r in base_times]
    return statistics.median(ratios) if ratios else math.nan


def running_threads(pids: list[int]) -> int:
    """How many threads of the processes ``pids`` are running or runnable (state ``R`` in ``/proc/PID/task/*/stat``)."""
    running = 0
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as stat:
                    running += stat.read().rsplit(")", 1)[1].split()[0] == "R"
            except (OSError, IndexError):
                continue
    return running


def wait_for_quiet(pids: list[int], timeout: float = QUIET_TIMEOUT_S) -> float:
    """Wait until no thread of ``pids`` runs (or ``timeout`` s pass); return the seconds waited.

    A worker that has just replied may still have OpenMP threads spinning: libgomp's threads spin-wait after a
    parallel region (``GOMP_SPINCOUNT``, 300,000 ``pause`` loops: several ms on recent x86) before they sleep. On a
    machine with few cores they would take cores from the next worker's timed step, which a training run (one
    process, one thread pool) never sees."""
    start = time.monotonic()
    while running_threads(pids) and time.monotonic() - start < timeout:
        time.sleep(0.001)
    return time.monotonic() - start


def measure_model(model: str, methods: list[Method], args: argparse.Namespace, run_dir: Path, log: Callable[[str], None]) -> list[Row]:
    """Start one worker per method (imports in parallel), set them up one at a time, then time them round-robin."""
    rows = [Row(method, model) for method in methods]
    workers: dict[int, Worker] = {}
    try:
        for i, row in enumerate(rows):
            workers[i] = Worker(row.method, model, args, run_dir)
        for i, row in enumerate(rows):
            try:
                workers[i].receive()  # hello: imports done
                info = workers[i].request("setup")
            except WorkerError as error:
                row.failure = str(error)
                workers.pop(i).kill()
                log(f"  {model:<11} {row.method.label:<28} n/a ({row.failure})")
                continue
            row.n_params, row.first_step_s, row.state_bytes = info["n_params"], info["first_step_s"], info["state_bytes"]
            row.small_params, row.small_state_bytes = info["small_params"], info["small_state_bytes"]
            row.rss_before_mb, row.first_rss_increase_mb = info["rss_before_mb"], info["first_rss_increase_mb"]
            row.threads, row.notes, row.digest = info["threads"], info["notes"], info["digest"]
            log(f"  {model:<11} {row.method.label:<28} first step {row.first_step_s:7.2f} s, {row.bytes_per_param:.3f} B/param")
        order = list(workers)
        for r in range(args.repeats):
            shift = r % len(order) if order else 0
            for i in order[shift:] + order[:shift]:
                row = rows[i]
                if row.failure is None and (len(row.times_ms) < 2 or sum(row.times_ms) <= 1e3 * args.budget):
                    wait_for_quiet([worker.proc.pid for j, worker in workers.items() if j != i])
                    try:
                        row.times_ms.append(workers[i].request("step")["ms"])
                        row.rounds.append(r)
                    except WorkerError as error:
                        row.failure, row.times_ms, row.rounds = f"during timing: {error}", [], []
            if r == 0 or (r + 1) % 5 == 0 or r + 1 == args.repeats:
                log(f"  {model:<11} round {r + 1}/{args.repeats}")
        # every profile before any worker finishes: a finished worker exits, and its teardown (freeing its memory, torch's
        # shutdown) took a core from the next worker's profiled and unprofiled steps (2x slower, its gradient check 5x)
        for i in order:
            row = rows[i]
            if row.failure is None and row.method.key in args.profile:
                wait_for_quiet([worker.proc.pid for j, worker in workers.items() if j != i])
                try:
                    row.profile = workers[i].request("profile")["ops"]
                except WorkerError as error:
                    row.notes.append(f"profile failed: {error}")
        for i in order:
            row = rows[i]
            if row.failure is not None:
                continue
            try:
                info = workers[i].request("finish")
                row.rss_peak_mb, row.step_rss_increase_mb = info["rss_peak_mb"], info["step_rss_increase_mb"]
                row.hwm_reset = info["hwm_reset"]
            except WorkerError as error:
                row.notes.append(f"finish failed: {error}")
    finally:
        for worker in workers.values():
            worker.close()
    return rows


def measure_model_shared(
    model: str, methods: list[Method], args: argparse.Namespace, run_dir: Path, log: Callable[[str], None]
) -> list[Row]:
    """Every method in one ``--shared-worker`` process (``shared_worker_main``); rows with ``mode="shared"`` (no memory
    figures: one process holds every method)."""
    rows = [Row(method, model, mode="shared") for method in methods]
    worker = Worker(None, model, args, run_dir)
    try:
        reply = worker.receive(timeout=WORKER_TIMEOUT_S * max(1, len(methods)))
    except WorkerError as error:
        for row in rows:
            row.failure = f"shared worker: {error}"
        return rows
    finally:
        worker.close()
    for row in rows:
        result = reply["results"][row.method.key]
        row.failure, row.notes = result["failure"], result["notes"]
        row.threads, row.digest = reply["threads"], reply["digest"]
        row.times_ms, row.rounds = result["times_ms"], result["rounds"]
        row.first_step_s, row.warmup_s = result.get("first_step_s", math.nan), result.get("warmup_s", [])
        row.n_params, row.state_bytes = result.get("n_params", 0), result.get("state_bytes", math.nan)
        row.small_params, row.small_state_bytes = result.get("small_params", 0), result.get("small_state_bytes", math.nan)
        row.paths = result.get("paths", [])
        outcome = row.failure or f"first step {row.first_step_s:7.2f} s, median step {row.step_ms:.1f} ms"
        log(f"  {model:<11} {row.method.label:<28} (one process) {outcome}")
    return rows


# --------------------------------------------------------------------------- verdicts


def _find(rows: list[Row], model: str, key: str) -> Row | None:
    return next((r for r in rows if r.model == model and r.method.key == key), None)


def _ok(flag: bool) -> str:
    return "PASS" if flag else "FAIL"


def _overall(outcomes: list[bool | None]) -> str:
    checked = [o for o in outcomes if o is not None]
    if not checked:
        return "n/a"
    return _ok(all(checked)) + (f" ({len(outcomes) - len(checked)} n/a)" if len(checked) < len(outcomes) else "")


def step_target(method: Method) -> float:
    """Issue #22's step-time target of one of our methods, as a multiple of fused fp32 AdamW's step."""
    if method.key == OUR_INT8:
        return TARGET_INT8_RATIO
    return TARGET_RN_RATIO if method.rounding == "nearest" else TARGET_SR_RATIO


def format_targets(rows: list[Row], models: list[str]) -> tuple[list[str], list[bool | None]]:
    """Issue #22's per-format targets (``step_target``) over our rows: details and outcomes."""
    details, outcomes = [], []
    for model in models:
        base = _find(rows, model, BASELINE)
        for row in rows:
            if row.model != model or row.method.family != "ours":
                continue
            ratio = paired_ratio(row, base)
            if math.isnan(ratio):
                details.append(f"{model} {row.method.key}: n/a")
                outcomes.append(None)
            else:
                details.append(f"{model} {row.method.key} {ratio:.2f}x (<= {step_target(row.method)})")
                outcomes.append(ratio <= step_target(row.method))
    return details, outcomes


def verdicts(rows: list[Row], models: list[str]) -> list[str]:
    """PASS/FAIL lines for targets (a), (b), (c), (d), per model, from this run's numbers: (a)-(c) of the per-process
    mode where it ran, (d) of each mode that ran."""
    lines = ["## Verdicts (this run; ratios are paired medians against fused fp32 AdamW, see header)", ""]
    by_mode = {mode: [r for r in rows if r.mode == mode] for mode in MODES}
    rows = by_mode["separate"] or by_mode["shared"]
    # (a)
    details, outcomes = [], []
    for model in models:
        ours, base = _find(rows, model, OUR_INT8), _find(rows, model, BASELINE)
        ratio = math.nan if ours is None else paired_ratio(ours, base)
        if math.isnan(ratio):
            details.append(f"{model}: n/a")
            outcomes.append(None)
        else:
            details.append(f"{model} {ours.step_ms:.1f} ms vs {base.step_ms:.1f} ms = {ratio:.2f}x")
            outcomes.append(ratio <= TARGET_STEP_RATIO)
    lines.append(f"- (a) QAdamW int8 · RN step <= {TARGET_STEP_RATIO}x fused fp32 AdamW: **{_overall(outcomes)}**: " + "; ".join(details))
    # (b)
    details, outcomes = [], []
    for model in models:
        ours, base = _find(rows, model, OUR_INT8), _find(rows, model, BASELINE)
        for key in ("bnb-adamw8bit", "torchao-adamw8bit"):
            peer = _find(rows, model, key)
            if ours is None or peer is None or ours.failure or peer.failure:
                reason = peer.failure if peer is not None and peer.failure else "no result"
                details.append(f"{model} vs {METHODS[key].label}: n/a ({reason})")
                outcomes.append(None)
                continue
            mine, theirs = paired_ratio(ours, base), paired_ratio(peer, base)
            if math.isnan(mine) or math.isnan(theirs):  # no baseline: compare the medians directly
                mine, theirs = ours.step_ms, peer.step_ms
            details.append(
                f"{model} vs {METHODS[key].label}: {ours.step_ms:.1f} ms vs {peer.step_ms:.1f} ms "
                f"({mine:.2f}x vs {theirs:.2f}x fused; ours / theirs {mine / theirs:.2f})"
            )
            outcomes.append(mine < theirs)
    target = "QAdamW int8 · RN faster than bitsandbytes' and torchao's 8-bit AdamW"
    lines.append(f"- (b) {target}: **{_overall(outcomes)}**: " + "; ".join(details))
    # (c)
    details, outcomes = [], []
    for fmt, limit in TARGET_BYTES.items():
        for model in models:
            for short in ROUNDINGS:
                row = _find(rows, model, f"qadamw-{fmt}-{short}")
                if row is None or row.failure:
                    continue
                details.append(
                    f"{fmt} · {short.upper()} {model} {row.bytes_per_param:.4f} ({row.quantized_bytes_per_param:.4f} over the params "
                    f">= {MIN_QUANT_SIZE} values; {row.small_params:,} smaller params keep fp32 states)"
                )
                outcomes.append(row.bytes_per_param <= limit)
    limits = ", ".join(f"<= {limit} for {fmt}" for fmt, limit in TARGET_BYTES.items())
    lines.append(f"- (c) state bytes/param {limits}: **{_overall(outcomes)}**: " + "; ".join(details))
    # (d)
    target = (
        f"every QAdamW format's step <= {TARGET_RN_RATIO}x fused fp32 AdamW with RN, <= {TARGET_SR_RATIO}x with SR, "
        f"int8 · RN <= {TARGET_INT8_RATIO}x (issue #22)"
    )
    for mode, mode_rows in by_mode.items():
        if mode_rows:
            details, outcomes = format_targets(mode_rows, models)
            lines.append(f"- (d) {target}, {MODE_NAMES[mode]}: **{_overall(outcomes)}**: " + "; ".join(details))
    return lines


# --------------------------------------------------------------------------- output


def _num(value: float, spec: str) -> str:
    return "—" if value is None or math.isnan(value) else format(value, spec)


def method_table(
    heading: str,
    rows: list[Row],
    base: Row | None,
    columns: list[str],
    cells: Callable[[Row], list[str]],
    failed: Callable[[Row], list[str]],
    left: int = 0,
) -> str:
    """A model's table: per method its label, step time, ratio to ``base`` and state bytes/param, then ``columns``
    filled by ``cells(row)`` (``failed(row)`` where the method failed); ``left``: how many of the last columns align
    left (text)."""
    lines = [
        heading,
        "",
        "| method | step ms, median [IQR] (rounds) | × fused fp32 | state bytes/param | " + " | ".join(columns) + " |",
        "|---|---:|---:|---:|" + "---:|" * (len(columns) - left) + "---|" * left,
    ]
    for row in rows:
        if row.failure:
            lines.append("| " + " | ".join([row.method.label, f"n/a ({row.failure})", "—", "—", *failed(row)]) + " |")
            continue
        low, high = row.iqr_ms
        common = [
            row.method.label + "".join(f" ⚠ {note}" for note in row.notes),
            f"{row.step_ms:.1f} [{low:.1f}–{high:.1f}] ({len(row.times_ms)})",
            _num(paired_ratio(row, base), ".2f"),
            _num(row.bytes_per_param, ".3f"),
        ]
        lines.append("| " + " | ".join(common + cells(row)) + " |")
    return "\n".join(lines)


def render_table(model: str, description: str, rows: list[Row]) -> str:
    """The per-process table of a model: step times, ratios, memory and the first step."""
    n_params = next((r.n_params for r in rows if r.n_params), 0)
    return method_table(
        f"### {model}: {description}, {n_params:,} parameters",
        rows,
        _find(rows, model, BASELINE),
        ["RSS peak MB", "step RSS increase MB", "first-step RSS increase MB", "first step s"],
        lambda row: [
            _num(row.rss_peak_mb, ".0f"),
            _num(row.step_rss_increase_mb, ".1f") + ("" if row.hwm_reset else " (≥)"),
            _num(row.first_rss_increase_mb, ".1f"),
            _num(row.first_step_s, ".2f"),
        ],
        lambda row: ["—"] * 4,
    )


def render_shared_table(model: str, description: str, rows: list[Row]) -> str:
    """The one-process table of a model: step times, ratios, the first step (build / compile) and the warm-up steps."""
    n_params = next((r.n_params for r in rows if r.n_params), 0)
    return method_table(
        f"### {model}, all methods in one process: {description}, {n_params:,} parameters",
        rows,
        _find(rows, model, BASELINE),
        ["first step s (build / compile)", "warm-up steps s", "paths"],
        lambda row: [_num(row.first_step_s, ".2f"), ", ".join(f"{t:.2f}" for t in row.warmup_s) or "—", ", ".join(row.paths) or "—"],
        lambda row: [_num(row.first_step_s, ".2f"), "—", "—"],
        left=1,
    )


def render_profiles(rows: list[Row]) -> str | None:
    profiled = [r for r in rows if r.profile]
    if not profiled:
        return None
    lines = [
        "## Where the step time goes (torch.profiler, one step after the timed rounds; self CPU ms)",
        "",
        "Work done outside aten ops (Python, a compiled C++ extension called directly) counts as self time of "
        "`Optimizer.step#...`; an inductor graph shows as `## Call CompiledFxGraph ...`. `isfinite` shows as "
        "`aten::abs`/`eq`/`ne`/`mul`/`all`.",
        "",
    ]
    for row in profiled:
        total = row.profile[0][1]
        lines += [f"**{row.method.label}, {row.model}** (profiled step: {total:.1f} ms of op self time)", ""]
        lines += ["| op | self ms | share | calls |", "|---|---:|---:|---:|"]
        ops, extra = [e for e in row.profile[1:] if not e[0].startswith("(")], [e for e in row.profile[1:] if e[0].startswith("(")]
        lines += [f"| `{name}` | {ms:.2f} | {100 * ms / total:.0f}% | {calls} |" for name, ms, calls in ops]
        lines += ["", *(f"- {name}: {ms:.1f} ms" for name, ms, _ in extra)]
        lines.append("")
    return "\n".join(lines).rstrip()


def source_digest() -> str:
    """Short SHA-1 of the ``lightning_qstate`` sources measured, Python and C++ (the package changes between runs; saved
    runs of the other benchmarks stand in only for the same sources)."""
    root = Path(sys.modules["lightning_qstate"].__file__).resolve().parent
    digest = hashlib.sha1()
    for path in sorted(path for path in root.rglob("*") if path.suffix in (".py", ".cpp", ".h")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def render_report(
    command: str, args: argparse.Namespace, specs: dict[str, ModelSpec], rows: list[Row], runtime_s: float, digest: str
) -> str:
    threads = sorted({r.threads for r in rows if r.threads})
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    compile_mode = "off (--no-compile: ours cpu_compile=False, torchao eager)" if args.no_compile else (
        "on; " + ("warm caches (--warm-cache)" if args.warm_cache else "inductor and cpp_extension caches fresh per method and run: "
                  f"`first step s` is a cold compile for {args.models[0]}, with that method's kernels of {args.models[0]} on disk for "
                  "later models (new graphs still compile)")
    )  # fmt: skip
    header = [
        "# Optimizer step on the CPU: fp32 AdamW vs torchao / bitsandbytes low-bit AdamW vs QAdamW",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; runtime {runtime_s:.0f} s",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}, "
        f"torchao {_version('torchao')}, bitsandbytes {_version('bitsandbytes')}, lightning_qstate source digest {digest}",
        f"- machine: {platform.machine()} ({cpu_description()}), {platform.system()}, CPUs {os.cpu_count()} (usable {affinity}), "
        f"torch threads per worker {', '.join(map(str, threads)) or '?'}; shared machine, timings are noisy",
        f"- timing: `optimizer.step()` only (fixed seeded gradients), {args.warmup} untimed first/warm-up step(s), then "
        f"{args.repeats} round(s), all methods of a model interleaved (one step each per round, rotated order; a method sits out "
        f"the remaining rounds once its timed steps exceed {args.budget:g} s, after >= 2), one worker process per method and model "
        f"(seed {args.seed}); × fused fp32 = median over rounds of step / fused fp32 step of the same round",
        f"- torch.compile: {compile_mode}; `first step s` includes state allocation and any compile",
        f"- hyperparameters: lr {LR}, weight_decay {WEIGHT_DECAY}, torch default betas/eps; states of parameters with "
        f"< {MIN_QUANT_SIZE} values stay fp32 (every method)",
        "- state bytes/param: ours `state_nbytes(opt)`; peers every distinct storage in `optimizer.state` (torchao subclass "
        "tensors expanded to codes + scale + qmap; bitsandbytes state1/2 + absmax1/2 + shared qmaps once); step counters included",
        "- RSS (MiB): peak = worker's high-water mark (includes the imported torch/peer libraries); step increase = high-water "
        "mark over the timed steps minus RSS before them (transient memory of one step; `(≥)`: no /proc high-water reset, "
        "only growth beyond the earlier peak); first-step increase = high-water mark over the first + warm-up steps minus "
        "RSS before them (states + compile)",
    ]
    changed = sorted({r.digest for r in rows if r.digest and r.digest != digest} | ({source_digest()} - {digest}))
    if changed:
        digests = ", ".join(changed)
        header.append(f"- **warning**: the lightning_qstate sources changed during the run (digests {digests}): rows may mix versions")
    if "shared" in args.modes:
        header.append(
            f"- one-process mode (`--mode shared`/`both`): one worker process per model builds every method in turn (each on its "
            f"own copy of the model, same seed) and takes its first step (`first step s`: state allocation plus any C++ build or "
            f"torch.compile, with the earlier methods' compiles already in the process) and {args.warmup - 1} more; then "
            f"{args.repeats} round(s), one timed step of every method per round in a rotated order, all in that process (as "
            "an adaptive run steps several formats); × fused fp32 as above"
        )
    body = []
    for name in args.models:
        for mode, render in (("separate", render_table), ("shared", render_shared_table)):
            model_rows = [r for r in rows if r.model == name and r.mode == mode]
            if model_rows:
                body.append(render(name, specs[name].description, model_rows))
    parts = ["\n".join(header), *body, "\n".join(verdicts(rows, args.models))]
    profiles = render_profiles(rows)
    if profiles:
        parts.append(profiles)
    return "\n\n".join(parts) + "\n"


# --------------------------------------------------------------------------- entry point


@dataclass
class Report:
    """What :func:`main` returns: the markdown it printed and wrote to ``path``, and the measured rows."""

    text: str
    rows: list[Row]
    path: Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=positive_int, default=None, help="timed rounds (default 10; 1 with --quick)")
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps before timing, the first included (default 2; 3 with --mode shared/both)"
    )
    parser.add_argument(
        "--mode",
        choices=("separate", "shared", "both"),
        default="separate",
        help="separate: a worker process per method and model (default); shared: every method in one process per model "
        "(as an adaptive run uses several formats); both",
    )
    parser.add_argument(
        "--budget", type=float, default=15.0, help="seconds of timed steps per method and model before it sits out (default 15)"
    )
    parser.add_argument("--threads", type=non_negative_int, default=0, help="torch threads per worker (default: torch's default)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown output (default benchmarks/results/optim.md)")
    parser.add_argument("--models", type=names, default=["mlp", "transformer"], help="comma-separated: mlp,transformer")
    parser.add_argument("--methods", type=names, default=list(METHODS), help=f"comma-separated keys (default all): {','.join(METHODS)}")
    parser.add_argument("--quick", action="store_true", help="tiny models and 1 round (smoke test)")
    parser.add_argument("--no-compile", action="store_true", help="no torch.compile anywhere (ours: cpu_compile=False; torchao eager)")
    parser.add_argument("--warm-cache", action="store_true", help="use the default inductor cache instead of a fresh one per worker")
    parser.add_argument("--profile", type=names, default=[OUR_INT8], help=f"methods to profile one step of (default {OUR_INT8}; 'none')")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--worker", metavar="KEY", help=argparse.SUPPRESS)
    parser.add_argument("--shared-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is None:
        args.repeats = 1 if args.quick else 10
    args.modes = list(MODES) if args.mode == "both" else [args.mode]
    if args.warmup is None:
        args.warmup = 3 if "shared" in args.modes else 2
    if args.repeats < 1 or args.warmup < 1 or args.threads < 0 or args.budget <= 0:
        parser.error("--repeats, --warmup and --budget must be positive, --threads >= 0")
    if args.profile == ["none"]:
        args.profile = []
    for key in args.methods + args.profile:
        if key not in METHODS:
            parser.error(f"unknown method {key!r}; choose from {', '.join(METHODS)}")
    for name in args.models:
        if name not in ("mlp", "transformer"):
            parser.error(f"unknown model {name!r}; choose from mlp, transformer")
    if BASELINE not in args.methods:
        print(f"note: {BASELINE} not selected: the x fused fp32 column stays empty", file=sys.stderr)
    return args


def main(argv: list[str] | None = None) -> Report | None:
    """Run the benchmark (or, with ``--worker``, serve as one worker), print the report and write it to ``--out``."""
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return None
    if args.shared_worker:
        shared_worker_main(args)
        return None
    command = shlex.join(["python", "benchmarks/optim.py", *(sys.argv[1:] if argv is None else argv)])
    log = (lambda _: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    specs = model_specs(args.quick)
    methods = [METHODS[key] for key in args.methods]
    start, digest = time.perf_counter(), source_digest()
    run_dir = Path(tempfile.mkdtemp(prefix="qstate-bench-optim-"))
    try:
        measures = {"separate": measure_model, "shared": measure_model_shared}
        rows = [row for model in args.models for mode in args.modes for row in measures[mode](model, methods, args, run_dir, log)]
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    text = render_report(command, args, specs, rows, time.perf_counter() - start, digest)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return Report(text, rows, args.out)


if __name__ == "__main__":
    main()
