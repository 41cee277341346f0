"""Round-trip error and CPU throughput of our storage formats next to torchao's and bitsandbytes' quantizers.

Usage::

    python benchmarks/formats.py [--numel N] [--repeats R] [--seed S] [--out PATH]

Every method (ours in RN and SR, the peers in their only mode, RN) quantizes and
dequantizes the same seeded tensors: normal, heavy-tailed (Student-t, 2 dof),
sparse (90% zeros) and a non-negative ``v``-like one (``x**2``). Per tensor kind
it prints a markdown table: bits/value (scales included), relative RMS error
``||deq - x|| / ||x||``, max abs error / absmax, the error ratio to the peer of
the same code width, and quantize/dequantize throughput (M values/s, median of
``R`` timed calls after one warm-up call, whose output gives the errors; the
methods of a table are timed round-robin, one call each per round). The
same text goes to ``--out``, with the versions and command line in its header,
and a verdict on the target "our int8/int4 error is within 5% of the peers'".

Peers are imported lazily: a missing or failing peer shows as ``n/a (reason)``.
Code tables (256 or 16 floats per tensor, for us and the peers alike) are not
counted in bits/value.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import math
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as ``python benchmarks/formats.py``: the checkout's packages (benchmarks, lightning_qstate)
    sys.path.insert(0, str(ROOT))

from benchmarks.arguments import positive_int  # noqa: E402
from lightning_qstate.formats import CodebookFormat, dynamic_map, get_format  # noqa: E402
from lightning_qstate.formats.packing import unpack  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "formats.md"
TARGET_RATIO = 1.05  # "no worse than theirs, within 5%"

Applies = Literal["any", "signed", "nonnegative"]


# --------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    """One quantizer under test: ``quantize(x) -> state``, ``dequantize(state) -> x̂``, ``nbytes(state)``.

    ``applies`` picks the tensor kinds it runs on: ``"any"``, ``"signed"`` (peers'
    signed maps, for ``m``-like data) or ``"nonnegative"`` (unsigned maps, ``v``-like
    data). ``unavailable`` is the reason it cannot run at all (peer not installed).
    Codebook methods in RN also give ``codes(state)`` (unpacked indices into the
    sorted ``code_table``) and ``block_size``, to check that each code is the nearest one;
    ``scales(state)`` gives the stored block scales where they are not the block absmax
    (ours, rounded up to bf16 for signed formats).
    """

    family: str  # "ours", "torchao", "bitsandbytes"
    base: str  # format name, or the peer's quantizer
    bits: int  # bits per code, scales excluded
    signed: bool
    rounding: str  # "RN" or "SR"
    applies: Applies
    quantize: Callable[[torch.Tensor], Any]
    dequantize: Callable[[Any], torch.Tensor]
    nbytes: Callable[[Any], int]
    unavailable: str | None = None
    codes: Callable[[Any], torch.Tensor] | None = None
    code_table: torch.Tensor | None = None
    block_size: int = 0
    scales: Callable[[Any], torch.Tensor] | None = None

    @property
    def label(self) -> str:
        unsigned = "" if self.signed else " unsigned"
        if self.family == "ours":
            return f"{self.base}{unsigned} · {self.rounding}"
        return f"{self.family}: {self.base}{unsigned}"

    def runs_on(self, kind: TensorKind) -> bool:
        if self.applies == "any":
            return True
        return (self.applies == "nonnegative") == kind.nonnegative


# (format name, signed) of our formats; fp32 has no SR variant.
OUR_FORMATS: tuple[tuple[str, bool], ...] = (
    ("fp32", True),
    ("bf16", True),
    ("fp16", True),
    ("fp8_e4m3", True),
    ("fp8_e5m2", True),
    ("int8", True),
    ("int8", False),
    ("int4", True),
    ("int4", False),
    ("int8_linear", True),
    ("int4_linear", True),
    ("e2m2", True),
    ("e3m0", False),
)
ROUNDING_NAMES = {"RN": "nearest", "SR": "stochastic"}


def our_methods(seed: int) -> list[Method]:
    """Every format of :data:`OUR_FORMATS`, RN and (except fp32) SR; SR draws from a seeded generator."""
    methods = []
    for name, signed in OUR_FORMATS:
        fmt = get_format(name, signed=signed)
        for short in ("RN",) if name == "fp32" else ("RN", "SR"):
            generator = torch.Generator().manual_seed(seed)

            def quantize(x: torch.Tensor, fmt=fmt, rounding=ROUNDING_NAMES[short], generator=generator) -> Any:
                return fmt.quantize(x, rounding, generator)

            codebook = isinstance(fmt, CodebookFormat) and short == "RN"
            methods.append(
                Method(
                    family="ours",
                    base=name,
                    bits=fmt.bits,
                    signed=signed,
                    rounding=short,
                    applies="any" if signed else "nonnegative",
                    quantize=quantize,
                    dequantize=lambda q: q.dequantize(),
                    nbytes=lambda q: q.nbytes,
                    codes=(lambda q: unpack(q.codes, q.format.bits, q.numel)) if codebook else None,
                    code_table=fmt.decode_values() if codebook else None,
                    block_size=getattr(fmt, "block_size", 0),
                    scales=lambda q: q.scales,
                )
            )
    return methods


def _unavailable(family: str, specs: list[tuple[str, int, bool]], reason: str) -> list[Method]:
    """Placeholder rows for peers that cannot be imported."""

    def fail(*_: Any) -> Any:
        raise RuntimeError(reason)

    return [Method(family, base, bits, signed, "RN", _applies(signed), fail, fail, fail, reason) for base, bits, signed in specs]


def _applies(signed: bool) -> Applies:
    """Peers' signed maps run on signed data, their unsigned maps on non-negative data."""
    return "signed" if signed else "nonnegative"


def _short_reason(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return text if len(text) <= 90 else text[:87] + "..."


TORCHAO_SPECS = [("8-bit", 8, True), ("8-bit", 8, False), ("4-bit", 4, True), ("4-bit", 4, False)]
BNB_SPECS = [("8-bit", 8, True), ("8-bit", 8, False)]


def torchao_qmaps() -> dict[tuple[int, bool], torch.Tensor]:
    """The qmaps of torchao's ``OptimState8bit`` / ``OptimState4bit`` (``subclass_8bit`` / ``subclass_4bit``)."""
    from torchao.optim import subclass_4bit, subclass_8bit

    return {
        (8, True): torch.tensor(subclass_8bit.get_qmap_signed(), dtype=torch.float32),
        (8, False): torch.tensor(subclass_8bit.get_qmap_unsigned(), dtype=torch.float32),
        (4, True): torch.tensor(subclass_4bit.get_qmap_signed(), dtype=torch.float32),
        (4, False): torch.tensor(subclass_4bit.get_qmap_unsigned(), dtype=torch.float32),
    }


def torchao_methods(compiled: bool = True) -> list[Method]:
    """torchao's low-bit optimizer-state quantizers, as its ``copy_`` into ``OptimState8bit``/``4bit`` runs them.

    8-bit: block 256, ``quantize_8bit_with_qmap``; 4-bit: block 128,
    ``quantize_4bit_with_qmap`` then two codes per byte. Dequantize: ``dequant_with_qmap``. ``compiled``: both under
    ``torch.compile(fullgraph=True, dynamic=False)``, as torchao's optimizers run them (its ``single_param_adam`` is
    compiled so; its search over the qmap is written for it); the compile falls in the untimed warm-up call.
    """
    try:
        from torchao.optim.quant_utils import dequant_with_qmap, quantize_4bit_with_qmap, quantize_8bit_with_qmap, scale_tensor

        qmaps = torchao_qmaps()
    except Exception as error:  # noqa: BLE001 - any import failure makes the peer n/a
        return _unavailable("torchao", TORCHAO_SPECS, f"torchao unavailable: {_short_reason(error)}")

    def make(bits: int, signed: bool) -> Method:
        qmap, block = qmaps[(bits, signed)], 256 if bits == 8 else 128

        def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Size]:
            scaled, scale = scale_tensor(x.reshape(-1), block)
            if bits == 8:
                return quantize_8bit_with_qmap(scaled, qmap), scale, x.shape
            codes = quantize_4bit_with_qmap(scaled, qmap)
            return (codes[::2] << 4) | codes[1::2], scale, x.shape

        def dequantize(state: tuple[torch.Tensor, torch.Tensor, torch.Size]) -> torch.Tensor:
            codes, scale, shape = state
            if bits == 4:
                codes = torch.stack([codes >> 4, codes & 0b1111], dim=-1)
            return dequant_with_qmap(codes, qmap, scale).view(shape)

        def codes(state: tuple[torch.Tensor, torch.Tensor, torch.Size]) -> torch.Tensor:
            return state[0] if bits == 8 else torch.stack([state[0] >> 4, state[0] & 0b1111], dim=-1).view(-1)

        if compiled:
            quantize, dequantize = (torch.compile(fn, fullgraph=True, dynamic=False) for fn in (quantize, dequantize))
        return Method(
            "torchao", f"{bits}-bit", bits, signed, "RN", _applies(signed), quantize, dequantize,
            nbytes=lambda state: state[0].nbytes + state[1].nbytes, codes=codes, code_table=qmap, block_size=block,
        )  # fmt: skip

    return [make(bits, signed) for _, bits, signed in TORCHAO_SPECS]


def bnb_methods() -> list[Method]:
    """bitsandbytes' ``quantize_blockwise`` / ``dequantize_blockwise``, blocksize 256.

    Signed: its default dynamic map (the 8-bit optimizers' ``qmap1``); unsigned:
    ``create_dynamic_map(signed=False)`` (their ``qmap2``, for ``v``).
    """
    try:
        import bitsandbytes.functional as F

        codes = {True: F.create_dynamic_map(signed=True), False: F.create_dynamic_map(signed=False)}
    except Exception as error:  # noqa: BLE001
        return _unavailable("bitsandbytes", BNB_SPECS, f"bitsandbytes unavailable: {_short_reason(error)}")

    def make(signed: bool) -> Method:
        def quantize(x: torch.Tensor) -> Any:
            return F.quantize_blockwise(x, code=codes[signed], blocksize=256)

        def dequantize(state: Any) -> torch.Tensor:
            return F.dequantize_blockwise(state[0], state[1])

        return Method(
            "bitsandbytes", "8-bit", 8, signed, "RN", _applies(signed), quantize, dequantize,
            nbytes=lambda state: state[0].nbytes + state[1].absmax.nbytes,
            codes=lambda state: state[0], code_table=codes[signed], block_size=256,
        )  # fmt: skip

    return [make(True), make(False)]


def all_methods(seed: int, torchao_compiled: bool = True) -> list[Method]:
    """The registry: ours, then torchao (``torchao_methods``' ``compiled``), then bitsandbytes."""
    return our_methods(seed) + torchao_methods(torchao_compiled) + bnb_methods()


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class TensorKind:
    """A named test tensor; ``nonnegative`` ones get the unsigned maps."""

    name: str
    description: str
    nonnegative: bool
    tensor: torch.Tensor


def make_tensors(numel: int, seed: int) -> list[TensorKind]:
    """The four test tensors, fp32, each drawn from its own generator seeded with ``seed``."""

    def gen() -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    g = gen()
    normal = torch.randn(numel, generator=g)
    g = gen()
    z = torch.randn(numel, generator=g)
    chi2 = torch.randn(numel, generator=g).square() + torch.randn(numel, generator=g).square()
    student = z / (chi2 / 2).sqrt()
    g = gen()
    sparse = torch.randn(numel, generator=g) * (torch.rand(numel, generator=g) < 0.1)
    v_like = torch.randn(numel, generator=gen()).square()
    return [
        TensorKind("normal", "N(0, 1)", False, normal),
        TensorKind("heavy-tailed", "Student-t, 2 dof (z / sqrt(chi2_2 / 2))", False, student),
        TensorKind("sparse", "N(0, 1) with 90% of values zeroed", False, sparse),
        TensorKind("v-like", "x**2 with x ~ N(0, 1) (non-negative, like Adam's v)", True, v_like),
    ]


# --------------------------------------------------------------------------- measurements


@dataclass
class Row:
    """One method on one tensor kind. ``failure`` is set (and the numbers are NaN) when it could not run."""

    method: Method
    kind: str
    bits_per_value: float = math.nan
    rel_rms: float = math.nan
    max_rel: float = math.nan
    quantize_mps: float = math.nan
    dequantize_mps: float = math.nan
    dequantize_copies: bool = True  # False: dequantize returned the stored tensor itself (no work to time)
    off_nearest: float | None = None  # fraction of codes that are not the exact nearest code
    zero_leak: float | None = None  # max |x̂| where x == 0, over max |x| (None: no zeros in x)
    failure: str | None = None


def roundtrip_error(x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(``||y - x|| / ||x||``, ``max|y - x| / max|x|``), in float64."""
    x64, diff = x.double(), y.double().view(-1) - x.double().view(-1)
    return float(diff.norm() / x64.norm()), float(diff.abs().max() / x64.abs().max())


def off_nearest_fraction(
    x: torch.Tensor, codes: torch.Tensor, table: torch.Tensor, block_size: int, scales: torch.Tensor | None = None
) -> float:
    """Fraction of ``codes`` that differ from the nearest entry of ``table`` to ``x / block scale``, in float64
    (``scales``: the stored ``(num_blocks,)`` scales; ``None``: the block absmax)."""
    flat = x.double().reshape(-1)
    blocks = torch.nn.functional.pad(flat, (0, -flat.numel() % block_size)).view(-1, block_size)
    scale = blocks.abs().amax(dim=1, keepdim=True) if scales is None else scales.double().view(-1, 1)
    normalized = (blocks / torch.where(scale > 0, scale, 1.0)).view(-1)[: flat.numel()]
    values = table.double()
    nearest = torch.bucketize(normalized, (values[1:] + values[:-1]) / 2)
    return float((codes.reshape(-1).long() != nearest).double().mean())


def zero_leak(x: torch.Tensor, y: torch.Tensor) -> float | None:
    """Largest ``|y|`` where ``x`` is exactly zero, relative to ``max |x|``; ``None`` when ``x`` has no zeros."""
    zeros = x.reshape(-1) == 0
    if not bool(zeros.any()):
        return None
    return float(y.reshape(-1)[zeros].abs().max().double() / x.abs().max().double())


def _storage_ptrs(state: Any) -> set[int]:
    """Data pointers of the tensors a quantized state holds (ours: codes and scales; peers: tuple items)."""
    items = (state.codes, state.scales) if hasattr(state, "codes") else state if isinstance(state, tuple) else (state,)
    return {t.untyped_storage().data_ptr() for t in items if isinstance(t, torch.Tensor)}


def seconds(fn: Callable[[], Any]) -> float:
    """Wall time of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def throughput(numel: int, elapsed: float) -> float:
    """Million values per second; ``inf`` for a call too fast to time."""
    return numel / elapsed / 1e6 if elapsed > 0 else math.inf


def measure_roundtrip(method: Method, kind: TensorKind) -> tuple[Row, Any]:
    """Errors, bits/value and code checks from one (warm-up) round trip; returns the row and the quantized state."""
    row = Row(method, kind.name)
    if method.unavailable:
        row.failure = method.unavailable
        return row, None
    x = kind.tensor
    try:
        state = method.quantize(x)
        y = method.dequantize(state)
        row.rel_rms, row.max_rel = roundtrip_error(x, y)
        row.bits_per_value = 8 * method.nbytes(state) / x.numel()
        row.dequantize_copies = y.untyped_storage().data_ptr() not in _storage_ptrs(state)
        row.zero_leak = zero_leak(x, y)
        if method.codes is not None and method.code_table is not None:
            scales = None if method.scales is None else method.scales(state)
            row.off_nearest = off_nearest_fraction(x, method.codes(state), method.code_table, method.block_size, scales)
    except Exception as error:  # noqa: BLE001 - a peer failing on CPU is a result, not a crash
        row.failure = _short_reason(error)
        return row, None
    return row, state


def measure_throughput(measured: list[tuple[Row, Any]], x: torch.Tensor, repeats: int) -> None:
    """Median quantize and dequantize throughput of every working method, timed round-robin.

    Each round times every method once each way, so that a slow phase of a shared
    machine hits all methods of a table alike instead of the ones that happen to
    run during it.
    """
    working = [(row, state) for row, state in measured if row.failure is None]
    times: dict[int, tuple[list[float], list[float]]] = {id(row): ([], []) for row, _ in working}
    for _ in range(repeats):
        for row, state in working:
            if row.failure is not None:
                continue
            try:
                times[id(row)][0].append(seconds(lambda row=row: row.method.quantize(x)))
                times[id(row)][1].append(seconds(lambda row=row, state=state: row.method.dequantize(state)))
            except Exception as error:  # noqa: BLE001
                row.failure = _short_reason(error)
    for row, _ in working:
        if row.failure is None:
            quantize_times, dequantize_times = times[id(row)]
            row.quantize_mps = throughput(x.numel(), statistics.median(quantize_times))
            row.dequantize_mps = throughput(x.numel(), statistics.median(dequantize_times))


def peer_row(rows: list[Row], row: Row, family: str) -> Row | None:
    """The ``family`` peer with ``row``'s code width that ran on the same tensor kind, if any."""
    for other in rows:
        if other.method.family == family and other.method.bits == row.method.bits and other.kind == row.kind:
            return other
    return None


def error_ratio(rows: list[Row], row: Row, family: str) -> float | None:
    """``row``'s rel. RMS error over its ``family`` peer's; ``None`` where there is no peer or either failed."""
    peer = peer_row(rows, row, family)
    if row.method.family != "ours" or peer is None or peer.failure or row.failure:
        return None
    return row.rel_rms / peer.rel_rms if peer.rel_rms > 0 else math.inf


def run_benchmark(
    numel: int, repeats: int, seed: int, log: Callable[[str], None] = lambda _: None, torchao_compiled: bool = True
) -> tuple[list[TensorKind], list[Row]]:
    """Every applicable method of the registry on every tensor kind (torchao's ``compiled`` or not)."""
    kinds = make_tensors(numel, seed)
    methods = all_methods(seed, torchao_compiled)
    rows = []
    for kind in kinds:
        measured = []
        for method in methods:
            if method.runs_on(kind):
                measured.append(measure_roundtrip(method, kind))
                row = measured[-1][0]
                log(f"  {kind.name:<13} {method.label:<28} {row.failure or f'{row.rel_rms:.3e}'}")
        log(f"  {kind.name:<13} timing {len(measured)} methods, {repeats} round(s)")
        measure_throughput(measured, kind.tensor, repeats)
        rows += [row for row, _ in measured]
    return kinds, rows


# --------------------------------------------------------------------------- verdict and notes


VERDICT_PAIRS = (("int8", "torchao"), ("int8", "bitsandbytes"), ("int4", "torchao"))


def verdict(kinds: list[TensorKind], rows: list[Row]) -> tuple[str, list[str]]:
    """Check the target on every kind: our int8 RN vs torchao and bnb 8-bit, our int4 RN vs torchao 4-bit.

    On the non-negative kind the unsigned variants are compared (what an optimizer stores ``v`` in).
    Returns (one-line verdict, one line per comparison).
    """
    details, outcomes = [], []
    for kind in kinds:
        signed = not kind.nonnegative
        for base, family in VERDICT_PAIRS:
            key = (kind.name, "ours", base, signed, "RN")
            ours = next((r for r in rows if (r.kind, r.method.family, r.method.base, r.method.signed, r.method.rounding) == key), None)
            ratio = None if ours is None else error_ratio(rows, ours, family)
            label = f"{base}{'' if signed else ' unsigned'} vs {family}"
            if ratio is None:
                peer = None if ours is None else peer_row(rows, ours, family)
                reason = peer.failure if peer is not None and peer.failure else "no result"
                details.append(f"- {kind.name}: {label}: n/a ({reason})")
                outcomes.append(None)
            else:
                ok = ratio <= TARGET_RATIO
                details.append(f"- {kind.name}: {label}: ratio {ratio:.4f} -> {'ok' if ok else 'MISSED'}")
                outcomes.append(ok)
    checked = [o for o in outcomes if o is not None]
    if not checked:
        line = "no peer result to compare with"
    elif all(checked):
        missing = len(outcomes) - len(checked)
        line = f"HOLDS on all {len(checked)} comparisons" + (f" ({missing} n/a)" if missing else "")
    else:
        line = f"MISSED on {checked.count(False)} of {len(checked)} comparisons"
    return f"**Verdict** (our int8/int4 RN rel. RMS error <= {TARGET_RATIO} x the peer's, every tensor kind): {line}.", details


def code_notes(kinds: list[TensorKind], rows: list[Row]) -> list[str]:
    """Per tensor kind: how often each RN codebook method's code is not the exact nearest one, and who loses exact zeros."""
    lines = []
    for kind in kinds:
        own = [r for r in rows if r.kind == kind.name]
        parts = [f"{r.method.label.replace(' · RN', '')} {100 * r.off_nearest:.4f}%" for r in own if r.off_nearest is not None]
        if parts:
            lines.append(f"codes that are not the exact nearest code (float64 check), {kind.name}: " + ", ".join(parts))
        if any(r.zero_leak is not None for r in own):
            leaks = ", ".join(f"{r.method.label} ({r.zero_leak:.2e})" for r in own if r.zero_leak) or "none"
            lines.append(f"exact zeros of {kind.name} that do not come back as 0 (max |x̂| / max |x|): {leaks}")
    return lines


def peer_notes() -> list[str]:
    """What the peers run on this machine: bitsandbytes' CPU backend and how their maps compare to ours."""
    notes = []
    try:
        import bitsandbytes.functional as F
        from bitsandbytes.cextension import ErrorHandlerMockBNBNativeLibrary, lib

        native = not isinstance(lib, ErrorHandlerMockBNBNativeLibrary)
        backend = f"native CPU library ({type(lib).__name__})" if native else "pure-torch fallback (native library not loaded)"
        for signed in (True, False):
            diff = float((F.create_dynamic_map(signed=signed).double() - dynamic_map(signed, 8)).abs().max())
            sign = "signed" if signed else "unsigned"
            notes.append(f"bitsandbytes {sign} map `create_dynamic_map(signed={signed})`: max |diff| to our int8 {sign} map {diff:.1e}")
        notes.append(f"bitsandbytes `quantize_blockwise` on CPU runs the {backend}")
    except Exception as error:  # noqa: BLE001
        notes.append(f"bitsandbytes: {_short_reason(error)}")
    try:
        for (bits, signed), qmap in torchao_qmaps().items():
            ours = get_format(f"int{bits}", signed=signed).decode_values()
            diff = float((qmap.double() - ours.double()).abs().max())
            sign = "signed" if signed else "unsigned"
            notes.append(f"torchao {bits}-bit {sign} qmap: max |difference| to our int{bits} {sign} map {diff:.1e}")
    except Exception as error:  # noqa: BLE001
        notes.append(f"torchao: {_short_reason(error)}")
    return notes


# --------------------------------------------------------------------------- output


def _mps(value: float, copies: bool = True) -> str:
    text = "inf" if value == math.inf else format(value, ".2e" if value >= 1e5 else ",.1f")
    return text if copies else f"{text} (no copy)"


def render_table(kind: TensorKind, rows: list[Row]) -> str:
    """Markdown table of one tensor kind's rows."""
    lines = [
        f"### {kind.name}: {kind.description}, {kind.tensor.numel():,} values",
        "",
        "| method | bits/value | rel. RMS error | max err / absmax | ours / torchao | ours / bnb | quantize M/s | dequantize M/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        if row.failure:
            lines.append(f"| {row.method.label} | — | n/a ({row.failure}) | — | — | — | — | — |")
            continue
        ratios = [error_ratio(rows, row, family) for family in ("torchao", "bitsandbytes")]
        cells = [
            row.method.label,
            f"{row.bits_per_value:.3f}",
            f"{row.rel_rms:.3e}",
            f"{row.max_rel:.3e}",
            *("—" if r is None else f"{r:.3f}" for r in ratios),
            _mps(row.quantize_mps),
            _mps(row.dequantize_mps, row.dequantize_copies),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _version(module: str) -> str:
    """``module``'s version: its ``__version__``, else its distribution's (``pytorch_optimizer`` has no ``__version__``)."""
    try:
        imported = __import__(module)
    except Exception as error:  # noqa: BLE001
        return f"not available ({_short_reason(error)})"
    if hasattr(imported, "__version__"):
        return imported.__version__
    distributions = importlib.metadata.packages_distributions().get(module, [])
    return importlib.metadata.version(distributions[0]) if distributions else "unknown"


def render_report(command: str, args: argparse.Namespace, kinds: list[TensorKind], rows: list[Row], runtime_s: float) -> str:
    """The whole markdown report: header, one table per kind, verdict, notes."""
    verdict_line, verdict_details = verdict(kinds, rows)
    header = [
        "# Storage formats: round-trip error and CPU throughput, ours vs torchao vs bitsandbytes",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; runtime {runtime_s:.0f} s",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}, "
        f"torchao {_version('torchao')}, bitsandbytes {_version('bitsandbytes')}",
        f"- machine: {platform.machine()}, {platform.system()}, torch threads {torch.get_num_threads()}, device cpu",
        f"- numel {args.numel:,}, repeats {args.repeats} (median after 1 warm-up call; methods timed round-robin), seed {args.seed}",
        "- bits/value counts codes and block scales (bf16 for our signed formats, fp32 for our unsigned ones and the peers;"
        " code tables excluded); ratio columns compare rel. RMS errors with the peer of the same code width on the same"
        " tensor (signed peers on signed data, unsigned ones on v-like data); peers have RN only. torchao is timed as"
        " `scale_tensor` + `quantize_*bit_with_qmap` (+ packing for 4-bit), "
        + (
            "eagerly (`--torchao-eager`)."
            if args.torchao_eager
            else "compiled (`torch.compile(fullgraph=True, dynamic=False)`, as its optimizers run it; the compile in the warm-up call)."
        ),
    ]
    body = [render_table(kind, [r for r in rows if r.kind == kind.name]) for kind in kinds]
    notes = ["## Notes", "", *(f"- {n}" for n in peer_notes() + code_notes(kinds, rows))]
    return "\n\n".join(["\n".join(header), *body, "\n".join([verdict_line, "", *verdict_details]), "\n".join(notes)]) + "\n"


# --------------------------------------------------------------------------- entry point


@dataclass
class Report:
    """What :func:`main` returns: the markdown it printed and wrote to ``path``, and the measured rows."""

    text: str
    rows: list[Row]
    path: Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--numel", type=positive_int, default=2**22, help="values per test tensor (default 2**22; torchao needs a multiple of 256)"
    )
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed calls per method and direction (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tensors and of SR (default 0)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="markdown output (default benchmarks/results/formats.md)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--torchao-eager", action="store_true", help="time torchao's quantizers eagerly (its optimizers run them compiled: the default)"
    )
    args = parser.parse_args(argv)
    if args.numel % 256:
        parser.error(f"--numel {args.numel}: give a multiple of 256 (torchao's blocks; its rows would be n/a)")
    return args


def main(argv: list[str] | None = None) -> Report:
    """Run the benchmark, print the report and write it to ``--out``."""
    args = parse_args(argv)
    command = shlex.join(["python", "benchmarks/formats.py", *(sys.argv[1:] if argv is None else argv)])
    log = (lambda _: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
    start = time.perf_counter()
    kinds, rows = run_benchmark(args.numel, args.repeats, args.seed, log, not args.torchao_eager)
    text = render_report(command, args, kinds, rows, time.perf_counter() - start)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return Report(text, rows, args.out)


if __name__ == "__main__":
    main()
