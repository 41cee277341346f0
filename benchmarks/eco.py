"""Training without fp32 master weights (ECO, arXiv 2601.22101) on the GPT example: master weights, naive removal and ECO,
bf16 and FP8 weights, fp32 and int8 states, and the peers that do this job on the CPU (torchao, optimi).

Usage::

    python benchmarks/eco.py [--quick] [--out PATH] [--configs all|master|bf16|fp8|peers|NAME,...] [--seeds S ...]
                             [--steps N] [--state-rounding nearest|stochastic] [--min-quant-size N] [--compute bf16|fp32]

Trains ``examples.gpt.GPTModule`` (byte-level GPT-2, 0.84 M parameters, the ``gpt_int8.yaml`` settings: AdamW lr 3e-3,
betas (0.9, 0.95), weight decay 0.1 on matrices, gradient clipping 1.0, 50 warmup steps, then a cosine decay to 0.1x
the peak LR at the last step) on CPython's pydoc text, on the CPU, one run after the other in this process: for each
seed of ``--seeds`` (default 0 1 2 3 4; a seed sets the initialisation, the data order and the rounding streams) every
configuration of ``--configs``, so the formats' step times are taken one after another, as users run them. Reported:
the final validation loss (nats/byte; mean ± sd over the seeds, and paired per-seed differences against the
master-weight run with the same states), the bytes per parameter of the weights plus the optimizer states at the end
(parameters' ``nbytes`` + ``state_nbytes(optimizer)``; for FP8 also the packed figure, ``WeightGrid.packed_nbytes``),
and the median time of ``optimizer.step()`` (its closure, i.e. forward, backward and clipping, subtracted).

Configurations (``CONFIGS``; ``--configs`` also takes the families ``master``, ``bf16``, ``fp8``, ``peers``):

- ``master_fp32``: ``bf16-mixed`` (fp32 master weights, bf16 autocast), torch's AdamW (fp32 states);
  ``master_int8``: the same through ``QStatePrecision("bf16-mixed", states="int8")``.
- ``bf16_{naive,eco}_{rn,sr}_{fp32,int8}``: ``QStatePrecision("bf16-true", states=..., weights="bf16",
  weight_rounding=..., error_feedback=None | "eco", weight_overrides={"*": "bf16"})``: every parameter is bf16 with no
  fp32 copy (under ``bf16-true`` all are bf16; the override gives the embeddings, norms and biases the same update
  instead of torch's plain bf16 arithmetic).
- ``fp8_{naive,eco}_{rn,sr}_{fp32,int8}``: ``weights="fp8_e4m3"`` (one absmax scale per row, ``max|row|/448``) on the
  linear layers inside the transformer blocks (the paper's selection, ``block_linear_weight_names``); every other
  parameter bf16 as in the bf16 rows (``weight_overrides``), with the same rounding and error feedback. The FP8 values
  are held in bf16 parameters (2 bytes each; rounded to bf16 once more, an error the feedback sees too); the packed
  codes and row scales would take about 1 byte.
- ``torchao_bf16_sr``: ``torchao.optim._AdamW(..., bf16_stochastic_round=True)`` on ``bf16-true`` parameters (bf16
  states; ``torch.compile`` per parameter, compiled in the first steps of its first run);
  ``optimi_kahan``: ``optimi.AdamW(..., kahan_sum=True)`` (bf16 states and a bf16 Kahan compensation buffer).
  Both with the example's groups, hyperparameters (eps 1e-8) and schedule.

Int8 states use ``--state-rounding`` (default nearest, the library's and the ``master_int8`` run's); parameters with fewer
than ``--min-quant-size`` values (default 4096) keep fp32 states, counted in every figure.

``--compute fp32`` runs every configuration under ``32-true`` instead: the library's weight grids held as values in fp32
parameters (their actual bytes are 4 per value; the packed column gives the stored format's), the peers' parameters
kept bf16 with each forward run on fp32 copies (``PeerGPT``); all with fp32 matmuls. The comparison of the weight
formats is the same, the compute precision is not the one users of ``bf16-true`` get. It exists for time: on a CPU
without bf16 arithmetic (this project's 2-core AVX2 machines) torch 2.14's bf16 matmuls run on one thread at about
1 GFLOP/s, so a bf16 training step of the GPT takes about 2.5 s against 0.1 s in fp32. Estimated on 2 idle cores: the
default run (20 configurations x 5 seeds x 400 steps) about 28 h; ``--compute fp32`` about 3 h (1.5 h in two
one-thread processes sharing ``--rows``).

``--rows FILE`` keeps every finished run as one JSON line in ``FILE``; a later call with the same file and the same
settings (model, steps, compute, state rounding, lightning_qstate sources) reuses the runs it finds there instead of
training them again. It makes a long run resumable and splits one across processes: e.g. two processes at one thread
each (``OMP_NUM_THREADS=1``), with disjoint ``--seeds`` and the same ``--rows``, then one call with all the seeds, which
only writes the report.

``--quick`` trains a tiny GPT for a few steps (every state quantized), to test the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import math
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the examples package lives in the checkout
    sys.path.insert(0, str(ROOT))

import lightning  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

import benchmarks.adaptive_bits as _adaptive  # noqa: E402  (their helpers)
import benchmarks.optim as _optim  # noqa: E402
from benchmarks.arguments import non_negative_int, positive_int  # noqa: E402
from benchmarks.paired import Paired, at_most  # noqa: E402
from examples.data import ByteTextDataModule  # noqa: E402
from examples.gpt import GPTModule  # noqa: E402
from lightning_qstate import state_nbytes  # noqa: E402
from lightning_qstate.formats import ROUNDINGS  # noqa: E402
from lightning_qstate.optim import QuantizedStates, block_linear_weight_names  # noqa: E402
from lightning_qstate.plugins import QStatePrecision  # noqa: E402

Summary, summaries, fmt_ms, benchmark_trainer = _adaptive.Summary, _adaptive.summaries, _adaptive.fmt_ms, _adaptive.benchmark_trainer
source_digest, _version = _optim.source_digest, _optim._version
load_rows, save_row, timed_optimizer_step = _adaptive.load_rows, _adaptive.save_row, _adaptive.timed_optimizer_step

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "eco.md"
DEFAULT_SEEDS, DEFAULT_STEPS, QUICK_STEPS = [0, 1, 2, 3, 4], 400, 6
# The targets: ECO + SR within this many nats of master weights; bytes/param of bf16 weights + int8 states + ECO;
# ECO's added optimizer-step time over naive removal with the same formats.
QUALITY_NATS, BF16_INT8_BYTES, ECO_STEP_OVERHEAD = 0.01, 4.1, 0.10
WEIGHT_FORMATS = {"bf16": "bf16", "fp8": "fp8_e4m3"}
METHODS = ("naive_rn", "naive_sr", "eco_rn", "eco_sr")  # the brief's order; the expected quality order is the reverse


@dataclass(frozen=True)
class Config:
    """One row: how the weights and states are kept and which optimizer updates them."""

    name: str
    precision: str  # Lightning's
    states: str  # "fp32", "int8", or "bf16" for the peers (their own)
    family: str  # "master", "bf16", "fp8" or "peers"
    method: str = "master"  # "master", one of METHODS, or the peer's name
    peer: str | None = None  # "torchao" or "optimi"

    @property
    def weights(self) -> str | None:
        return WEIGHT_FORMATS.get(self.family)

    @property
    def weight_rounding(self) -> str:
        return "stochastic" if self.method.endswith("_sr") else "nearest"

    @property
    def error_feedback(self) -> str | None:
        return "eco" if self.method.startswith("eco") else None

    def precision_for(self, compute: str) -> str:
        """Lightning's precision: as specified (``--compute bf16``), or ``32-true`` (``--compute fp32``)."""
        return "32-true" if compute == "fp32" else self.precision

    def label(self, compute: str) -> str:
        """What the report's legend says about it under ``--compute``."""
        precision = self.precision_for(compute)
        upcast = ", fp32 matmuls on upcast copies" if precision == "32-true" else ""
        if self.peer == "torchao":
            return f"torchao `_AdamW(bf16_stochastic_round=True)`, {precision} (bf16 weights and states{upcast})"
        if self.peer == "optimi":
            return f"optimi `AdamW(kahan_sum=True)`, {precision} (bf16 weights, states and Kahan buffer{upcast})"
        if self.family == "master":
            optimizer = "torch AdamW" if self.states == "fp32" else f'`QStatePrecision("{precision}", states="int8")`'
            return f"{precision} (fp32 master weights), {optimizer}"
        what = "bf16 weights (every parameter)" if self.family == "bf16" else "FP8 E4M3 row-scaled block linears, the rest bf16"
        held = " (grid values held in fp32 parameters)" if precision == "32-true" else ""
        feedback = "ECO" if self.error_feedback else "naive (error dropped)"
        return f"{precision}, {what}{held}, {feedback}, weight rounding {self.weight_rounding}, {self.states} states"


def _all_configs() -> dict[str, Config]:
    configs = [Config("master_fp32", "bf16-mixed", "fp32", "master"), Config("master_int8", "bf16-mixed", "int8", "master")]
    for family in WEIGHT_FORMATS:
        for states in ("fp32", "int8"):
            configs += [Config(f"{family}_{method}_{states}", "bf16-true", states, family, method) for method in METHODS]
    configs += [
        Config("torchao_bf16_sr", "bf16-true", "bf16", "peers", "torchao", "torchao"),
        Config("optimi_kahan", "bf16-true", "bf16", "peers", "optimi", "optimi"),
    ]
    return {config.name: config for config in configs}


CONFIGS = _all_configs()
FAMILIES = ("master", "bf16", "fp8", "peers")


class PeerGPT(GPTModule):
    """The GPT example with a peer's AdamW in place of torch's: the same groups, hyperparameters and LR schedule.

    ``fp32_compute=True`` (``--compute fp32``, under ``32-true``) keeps the parameters in bf16, as the peers need, and
    runs each forward on fp32 copies made for it (``torch.func.functional_call``; gradients flow back to the bf16
    parameters in bf16): the same weights and fp32 matmuls as the library's rows under ``--compute fp32``, and no fp32
    copy kept between steps.
    """

    def __init__(self, *args, peer: str, fp32_compute: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.peer = peer
        self.fp32_compute = fp32_compute
        if fp32_compute:
            for param in self.model.parameters():
                param.data = param.data.to(torch.bfloat16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not self.fp32_compute:
            return super().forward(tokens)
        upcast = {name: param.float() for name, param in self.model.named_parameters()}  # tied weights: named once
        return torch.func.functional_call(self.model, upcast, args=(), kwargs={"input_ids": tokens, "use_cache": False}).logits

    def configure_optimizers(self):
        configured = super().configure_optimizers()
        adamw, schedule = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
        groups = [{"params": group["params"], "weight_decay": group["weight_decay"]} for group in adamw.param_groups]
        options = {name: adamw.defaults[name] for name in ("lr", "betas", "eps", "weight_decay")}
        if self.peer == "torchao":
            from torchao.optim import _AdamW

            optimizer = _AdamW(groups, **options, bf16_stochastic_round=True)
        else:
            from optimi import AdamW

            optimizer = AdamW(groups, **options, kahan_sum=True)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_lambdas[0])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


@dataclass(frozen=True)
class Setup:
    """The model and data of this benchmark, and how long to train."""

    label: str
    model: dict  # GPTModule's keywords
    data: dict  # ByteTextDataModule's keywords
    steps: int
    min_quant_size: int


def make_setup(args: argparse.Namespace) -> Setup:
    schedule = {"schedule": "cosine", "min_lr_ratio": 0.1}
    if args.quick:
        return Setup(
            "GPT-2 (tiny: 1 layer, width 32), seq 32, batch 4",
            {"n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 32, "warmup_steps": 2, **schedule},
            {"seq_len": 32, "batch_size": 4, "val_windows": 8},
            args.steps or QUICK_STEPS,
            0 if args.min_quant_size is None else args.min_quant_size,
        )
    return Setup(
        "byte-level GPT-2 (n_embd 128, 4 layers, 0.84 M parameters), pydoc text, seq 128, batch 16",
        {"n_embd": 128, "n_layer": 4, "n_head": 4, "n_positions": 128, "lr": 0.003, "weight_decay": 0.1, "betas": (0.9, 0.95),
         "warmup_steps": 50, **schedule},
        {"seq_len": 128, "batch_size": 16, "val_windows": 128},
        args.steps or DEFAULT_STEPS,
        4096 if args.min_quant_size is None else args.min_quant_size,
    )  # fmt: skip


class OptimizerStepTimer(Callback):
    """Wall time of every ``optimizer.step()``, less the time of its closure (forward, backward, gradient clipping), and
    the weights' and states' bytes at the end of training."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self._step = None
        self.sizes: dict[str, int] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.optimizer = optimizer = trainer.strategy.optimizers[0]
        self._step = timed_optimizer_step(optimizer, self.seconds)

    def on_train_end(self, trainer, pl_module) -> None:
        optimizer = self.optimizer
        optimizer.step = self._step
        params = list(pl_module.parameters())
        packed = {}
        if isinstance(optimizer, QuantizedStates):
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grid = optimizer.weight_grid(group, param)
                    if grid is not None:
                        packed[param] = grid.packed_nbytes(param.shape)
        self.sizes = {
            "params": sum(param.numel() for param in params),
            "weight_bytes": sum(param.nbytes for param in params),
            "packed_weight_bytes": sum(packed.get(param, param.nbytes) for param in params),
            "state_bytes": state_nbytes(optimizer),
            "lr_ratio": float(optimizer.param_groups[0]["lr"]) / float(optimizer.param_groups[0]["initial_lr"]),
        }


@dataclass
class Row:
    """One run: the GPT trained in one configuration from one seed."""

    model: str  # always "gpt" (the adaptive-bits helpers group rows by model)
    config: str
    seed: int
    metrics: dict[str, float]
    params: int
    weight_bytes: int
    packed_weight_bytes: int
    state_bytes: int
    step_seconds: list[float]
    train_seconds: float
    lr_ratio: float
    threads: int  # torch's intra-op threads of the process that trained it

    @property
    def bytes_per_param(self) -> float:
        return (self.weight_bytes + self.state_bytes) / self.params

    @property
    def packed_bytes_per_param(self) -> float:
        return (self.packed_weight_bytes + self.state_bytes) / self.params


def plugin_for(config: Config, module: GPTModule, args: argparse.Namespace, setup: Setup):
    """The precision plugin (or name) of ``config``; ``module`` names the parameters kept bf16 in the FP8 rows."""
    precision = config.precision_for(args.compute)
    if config.peer is not None or config.name == "master_fp32":
        return precision
    options = {"states": config.states, "rounding": args.state_rounding, "min_quant_size": setup.min_quant_size}
    if config.weights is not None:
        blocks = set(block_linear_weight_names(module))
        overrides = (
            {"*": "bf16"} if config.weights == "bf16" else {name: "bf16" for name, _ in module.named_parameters() if name not in blocks}
        )
        options.update(
            weights=config.weights, weight_rounding=config.weight_rounding, error_feedback=config.error_feedback, weight_overrides=overrides
        )
    return QStatePrecision(precision, **options)


def run_config(setup: Setup, config: Config, seed: int, args: argparse.Namespace) -> Row:
    """Train the GPT in ``config`` from ``seed`` and measure it."""
    pl.seed_everything(seed, verbose=False)
    if config.peer:
        module = PeerGPT(**setup.model, seed=seed, peer=config.peer, fp32_compute=args.compute == "fp32")
    else:
        module = GPTModule(**setup.model, seed=seed)
    plugin = plugin_for(config, module, args, setup)
    timer = OptimizerStepTimer()
    trainer = benchmark_trainer(
        setup.steps, callbacks=[timer], **({"precision": plugin} if isinstance(plugin, str) else {"plugins": [plugin]})
    )
    start = time.perf_counter()
    trainer.fit(module, ByteTextDataModule(**setup.data, seed=seed))
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items() if key.startswith("val_")}
    sizes = timer.sizes
    return Row(
        "gpt", config.name, seed, metrics, sizes["params"], sizes["weight_bytes"], sizes["packed_weight_bytes"], sizes["state_bytes"],
        timer.seconds, time.perf_counter() - start, sizes["lr_ratio"], torch.get_num_threads(),
    )  # fmt: skip


def settings_key(setup: Setup, args: argparse.Namespace, digest: str) -> dict:
    """What must match for a saved run to stand in for a new one (``--rows``): the settings and the library's sources."""
    return {"setup": dataclasses.asdict(setup), "compute": args.compute, "state_rounding": args.state_rounding, "source": digest}


def final_loss(row: Row) -> float:
    """The final validation loss; a run that diverged (nan or inf) counts as +inf."""
    loss = row.metrics.get("val_loss", math.nan)
    return loss if math.isfinite(loss) else math.inf


def paired(a: Summary, b: Summary, value=final_loss) -> Paired:
    """``value(b) − value(a)`` for every seed both ran."""
    by_seed = {row.seed: value(row) for row in a.runs}
    return Paired([value(row) - by_seed[row.seed] for row in b.runs if row.seed in by_seed])


def lower(better: Summary, worse: Summary, strict: bool) -> tuple[str, str]:
    """Verdict on ``better``'s loss being below ``worse``'s (``strict``) or not above it, paired by seed."""
    difference = paired(better, worse)  # worse − better: positive where the order holds
    low, high = difference.interval()
    if not strict:
        if high < 0:
            return "FAIL", f"{difference.text()}"
        return ("PASS" if not math.isnan(high) else "NOT RESOLVED"), f"{difference.text()}"
    if low > 0:
        return "PASS", difference.text()
    if high < 0:
        return "FAIL", difference.text()
    return "NOT RESOLVED", f"{difference.text()}, 95 % interval straddles 0"


# --- report -------------------------------------------------------------------------------------------------------
def loss_cell(summary: Summary) -> str:
    diverged = sum(not math.isfinite(final_loss(row)) for row in summary.runs)
    if diverged:
        finite = [final_loss(row) for row in summary.runs if math.isfinite(final_loss(row))]
        return f"diverged in {diverged}/{len(summary.runs)}" + (f" (others {statistics.fmean(finite):.4f})" if finite else "")
    return summary.spread("val_loss")


def master_of(config: Config) -> str:
    """The master-weight run a configuration's quality is compared with: the one with the same states (fp32 for the peers)."""
    return "master_int8" if config.states == "int8" else "master_fp32"


def median_step(summary: Summary) -> float:
    return statistics.median(seconds for row in summary.runs for seconds in row.step_seconds)


def seed_medians(summary: Summary) -> dict[int, float]:
    return {row.seed: statistics.median(row.step_seconds) for row in summary.runs}


def results_table(by_config: dict[str, Summary]) -> list[str]:
    master = by_config.get("master_fp32")
    head = (
        "| config | weights | states | val loss | Δ vs master (same states) | bytes/param: weights + states | packed | "
        "step time vs master_fp32 | median step ms |"
    )
    lines = [head, "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, summary in by_config.items():
        config = CONFIGS[name]
        reference = by_config.get(master_of(config))
        delta = "–" if reference is None or reference is summary else paired(reference, summary).text()
        weights = summary.mean(lambda row: row.weight_bytes / row.params)
        states = summary.mean(lambda row: row.state_bytes / row.params)
        packed = summary.mean(lambda row: row.packed_bytes_per_param)
        weights_label = {"master": "fp32 master", "peers": "bf16"}.get(config.family, config.weights)
        step = "–" if master is None else f"{median_step(summary) / median_step(master):.2f}×"
        cells = [
            name, weights_label, config.states, loss_cell(summary), delta,
            f"{weights:.3f} + {states:.3f} = {weights + states:.3f}", f"{packed:.3f}", step,
            fmt_ms([seconds for row in summary.runs for seconds in row.step_seconds]),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def per_seed_table(by_config: dict[str, Summary]) -> list[str]:
    seeds = sorted({row.seed for summary in by_config.values() for row in summary.runs})
    lines = ["| config | " + " | ".join(f"seed {seed}" for seed in seeds) + " |", "|---|" + "---:|" * len(seeds)]
    for name, summary in by_config.items():
        reference = by_config.get(master_of(CONFIGS[name]))
        masters = {} if reference is None or reference is summary else {row.seed: final_loss(row) for row in reference.runs}
        cells = [name]
        for seed in seeds:
            row = next((row for row in summary.runs if row.seed == seed), None)
            if row is None:
                cells.append("–")
                continue
            cell = f"{row.metrics.get('val_loss', math.nan):.4f}"
            cells.append(cell + (f", Δ {final_loss(row) - masters[seed]:+.4f}" if seed in masters else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def verdicts(by_config: dict[str, Summary]) -> list[str]:
    """The issue's targets, each PASS, FAIL or NOT RESOLVED (95 % intervals of the paired per-seed differences)."""
    lines = ["## Targets", ""]
    judged = 0
    for family in WEIGHT_FORMATS:
        for states in ("fp32", "int8"):
            eco_sr, master = by_config.get(f"{family}_eco_sr_{states}"), by_config.get(f"master_{states}")
            if eco_sr is None or master is None:
                continue
            judged += 1
            difference = paired(master, eco_sr)
            verdict, why = at_most(difference, QUALITY_NATS)
            lines.append(
                f"- {family} weights, {states} states: ECO + SR within {QUALITY_NATS} nats of master weights: **{verdict}** "
                f"(Δ {difference.text()} nats over {len(difference.deltas)} seeds{'; ' + why if why else ''})"
            )
    for family in WEIGHT_FORMATS:
        for states in ("fp32", "int8"):
            chain = [f"master_{states}"] + [f"{family}_{method}_{states}" for method in reversed(METHODS)]
            present = [name for name in chain if name in by_config]
            if len(present) < 2:
                continue
            judged += 1
            links = []
            ordering = present[0]
            for better, worse in zip(present, present[1:], strict=False):
                strict = not better.startswith("master")
                verdict, why = lower(by_config[better], by_config[worse], strict)
                reversed_ = "; the order is reversed" if verdict == "FAIL" else ""
                links.append((verdict, f"{better} {'<' if strict else '≤'} {worse}: {verdict} (Δ {why}{reversed_})"))
                ordering += f" {'<' if strict else '≤'} {worse}"
            outcomes = {verdict for verdict, _ in links}
            overall = "FAIL" if "FAIL" in outcomes else "NOT RESOLVED" if "NOT RESOLVED" in outcomes else "PASS"
            partial = "" if present == chain else " (the configurations run)"
            lines.append(f"- {family} weights, {states} states: ordering {ordering}{partial}: **{overall}**")
            lines += [f"  - {text}" for _, text in links]
    for method in ("eco_sr", "eco_rn"):
        summary = by_config.get(f"bf16_{method}_int8")
        if summary is not None:
            judged += 1
            value, held = summary.mean(lambda row: row.packed_bytes_per_param), summary.mean(lambda row: row.bytes_per_param)
            verdict = "PASS" if value <= BF16_INT8_BYTES else "FAIL"
            lines.append(
                f"- bf16 weights + int8 states + ECO ({method}) at <= {BF16_INT8_BYTES} bytes/param: **{verdict}** ({value:.3f}"
                + ("" if abs(held - value) < 5e-4 else f"; {held:.3f} held, the fp32 parameters holding bf16 values")
                + ")"
            )
            break
    for family in WEIGHT_FORMATS:
        for states in ("fp32", "int8"):
            for rounding in ("rn", "sr"):
                eco, naive = by_config.get(f"{family}_eco_{rounding}_{states}"), by_config.get(f"{family}_naive_{rounding}_{states}")
                if eco is None or naive is None:
                    continue
                judged += 1
                naive_medians = seed_medians(naive)
                relative = Paired([median / naive_medians[seed] - 1 for seed, median in seed_medians(eco).items() if seed in naive_medians])
                verdict, why = at_most(relative, ECO_STEP_OVERHEAD, percent=True)
                pooled = median_step(eco) / median_step(naive) - 1
                lines.append(
                    f"- {family}, {states} states, {rounding.upper()}: ECO adds <= {100 * ECO_STEP_OVERHEAD:.0f} % to the optimizer step "
                    f"over naive: **{verdict}** (per-seed medians: {100 * relative.mean:+.1f} %"
                    + ("" if math.isnan(relative.se) else f" ± {100 * relative.se:.1f} %")
                    + f"; all steps pooled {100 * pooled:+.1f} %{'; ' + why if why else ''})"
                )
    if not judged:
        lines.append("- none of the targets' configurations ran together")
    return lines + [""]


def report(args: argparse.Namespace, setup: Setup, rows: list[Row], seconds: float, argv: list[str], digest: str, changed: bool) -> str:
    command = "python benchmarks/eco.py" + ("" if not argv else " " + shlex.join(argv))
    by_config = summaries(rows, "gpt")
    seeds = sorted({row.seed for row in rows})
    lr_ratios = sorted({round(row.lr_ratio, 4) for row in rows})
    threads = sorted({row.threads for row in rows})
    trained = sum(row.train_seconds for row in rows)
    params = sorted({row.params for row in rows})
    lines = [
        "# Training without fp32 master weights (ECO): master weights vs naive removal vs ECO, bf16 and FP8 weights",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; runtime {seconds:.0f} s "
        f"(training time of the runs, summed: {trained:.0f} s)",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}, "
        f"torchao {_version('torchao')}, optimi {_version('optimi')}, lightning_qstate source digest {digest}",
        f"- machine: {platform.machine()}, {platform.system()}, CPUs {os.cpu_count()}, "
        f"torch threads per run {', '.join(map(str, threads))}; "
        "shared machine, timings are noisy",
        f"- model: {setup.label}; {setup.steps} steps, AdamW, warmup {setup.model['warmup_steps']} then cosine to 0.1× peak "
        f"(LR at the end / peak: {', '.join(f'{ratio:g}' for ratio in lr_ratios)}), gradient clipping 1.0, one validation at "
        f"the end; seeds {', '.join(map(str, seeds))} (the initialisation, data order and rounding streams); "
        f"{', '.join(f'{count:,}' for count in params)} parameters",
        f"- compute: {args.compute} ("
        + (
            "the precisions of the configurations below"
            if args.compute == "bf16"
            else "32-true for all: the library's weight grids held in fp32 parameters, the peers' bf16 parameters upcast for each "
            "forward; fp32 matmuls"
        )
        + f"); int8 states: rounding {args.state_rounding}, parameters under {setup.min_quant_size} values keep fp32 states",
        "- val loss: nats/byte, mean ± sample sd over the seeds; Δ: mean ± standard error of the per-seed differences against "
        "the master-weight run with the same states (master_int8 for int8 states, master_fp32 otherwise)",
        "- bytes/param: parameters' `nbytes` + `state_nbytes(optimizer)` at the end, over the parameter count (means over "
        "seeds); packed: FP8 weights as `WeightGrid.packed_nbytes` (8-bit codes + an fp32 scale per row)",
        "- step time: `optimizer.step()` without its closure (forward, backward, clipping), median over all steps of all "
        "seeds, first steps (state allocation, compiles) included; configurations run one after another for each seed",
        "- verdicts: from 95 % Student-t intervals of the paired per-seed differences; NOT RESOLVED where the interval "
        "straddles the target (the data do not decide it)",
        *(["- **warning**: the lightning_qstate sources changed during the run: rows may mix versions"] if changed else []),
        "",
        "| config | setup |",
        "|---|---|",
        *(f"| {name} | {CONFIGS[name].label(args.compute)} |" for name in by_config),
        "",
        f"### gpt: {setup.label}; {setup.steps} steps; seeds {', '.join(map(str, seeds))}",
        "",
        *results_table(by_config),
        "",
        "val loss per seed; Δ: the seed's loss against the master-weight run with the same states from the same seed",
        "",
        *per_seed_table(by_config),
        "",
    ]
    return "\n".join(lines + verdicts(by_config))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT, a few steps (a smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--configs", default="all", help=f"comma-separated names ({', '.join(CONFIGS)}) or families ({', '.join(FAMILIES)}), or all"
    )
    parser.add_argument(
        "--seeds", type=int, nargs="+", default=DEFAULT_SEEDS, help="every configuration runs from each (default 0 1 2 3 4)"
    )
    parser.add_argument("--steps", type=positive_int, default=None, help=f"training steps (default {DEFAULT_STEPS}; quick {QUICK_STEPS})")
    parser.add_argument("--state-rounding", choices=ROUNDINGS, default="nearest", help="of the int8 states (default nearest)")
    parser.add_argument(
        "--compute", choices=("bf16", "fp32"), default="bf16", help="bf16: the precisions above (default); fp32: 32-true but for the peers"
    )
    parser.add_argument(
        "--min-quant-size", type=non_negative_int, default=None, help="smaller parameters keep fp32 states (default 4096; quick 0)"
    )
    parser.add_argument("--rows", type=Path, default=None, help="JSON lines of finished runs: saved as they end, reused when found")
    args = parser.parse_args(argv)
    names: list[str] = []
    for item in (item.strip() for item in args.configs.split(",")):
        if item == "all":
            names += list(CONFIGS)
        elif item in FAMILIES:
            names += [name for name, config in CONFIGS.items() if config.family == item]
        elif item in CONFIGS:
            names.append(item)
        elif item:
            parser.error(
                f"--configs {args.configs!r}: {item!r} is none of {', '.join(CONFIGS)}, nor a family ({', '.join(FAMILIES)}) or all"
            )
    if not names:
        parser.error("--configs: name at least one configuration")
    args.config_names = list(dict.fromkeys(name for name in CONFIGS if name in names))  # the report's order
    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {args.seeds}: each seed once")
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be >= 1")
    return args


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*GPU available but not used.*")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    start, digest = time.perf_counter(), source_digest()
    setup = make_setup(args)
    key = settings_key(setup, args, digest)
    saved, rows = {(row.config, row.seed): row for row in load_rows(args.rows, key, Row)}, []
    for seed in args.seeds:
        for name in args.config_names:
            if (name, seed) in saved:
                rows.append(saved[name, seed])
                continue
            row = run_config(setup, CONFIGS[name], seed, args)
            save_row(args.rows, key, row)
            print(
                f"{name} seed {seed}: val_loss {row.metrics.get('val_loss', math.nan):.4f}, {row.bytes_per_param:.3f} bytes/param, "
                f"step {fmt_ms(row.step_seconds)} ms, train {row.train_seconds:.0f} s",
                flush=True,
            )
            rows.append(row)
    text = report(args, setup, rows, time.perf_counter() - start, argv, digest, source_digest() != digest)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
