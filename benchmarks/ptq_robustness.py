"""Which optimizer trains the most quantizable model, and which metric predicts it (arXiv 2509.23500 at CPU scale).

Usage::

    python benchmarks/ptq_robustness.py [--quick] [--out PATH] [--runs all|NAME,...] [--steps N] [--eval-every K]
                                        [--seed S] [--work DIR]

The GPT example (byte-level GPT-2, pydoc text; ``benchmarks/eco.py``'s setup) is trained by each run of ``RUNS``: six
optimizers at two learning rates each (AdamW, Muon, SGD with momentum, Lion, Shampoo, SOAP; torch's own and
``pytorch-optimizer``'s), and AdamW (first learning rate) with int8, int4 and adaptive states and with ECO (bf16 weights,
no master copy). Every run validates every ``--eval-every`` steps and keeps a checkpoint there. The paper's protocol
then picks, for every run, its first checkpoint at or below the **common validation loss**: the highest of the runs'
best losses, each optimizer at its better learning rate (the loss every optimizer reaches; runs that never reach it,
e.g. at a learning rate too small or too large, are left out and named).

The same measurements are also taken at every run's last checkpoint (the end of training), where the optimizers'
models differ most: a common loss that the slowest optimizer sets can fall early in the others' runs. At each
checkpoint, on the whole validation set: the loss, the loss under post-training quantization
(``lightning_qstate.probes.ptq``: W4A4 and W8A8, symmetric absmax per output channel and per token, round-to-nearest,
every linear layer) and its increase; on the first two validation batches: ``R_L`` of the ABC decomposition
(``abc_decomposition``, per recipe), and MMR and kurtosis (both variants) of every linear layer's input, averaged over
layers. Reported per view: one row per run, the Pearson and Spearman correlations of each metric with the PTQ
increase over the optimizer runs and over all runs, the optimizers' ranking next to the paper's; and a plot (PTQ
increase against ``R_L``, MMR and kurtosis) next to the report.

``--work DIR`` (default: a folder in the system's temp directory) holds each run's trajectory and checkpoints; a run
found there with the same settings and library sources is not trained again, so a long run resumes, and two
processes with disjoint ``--runs`` and the same ``--work`` split it (then one call with all runs writes the report).
``--quick`` trains a tiny GPT for a few steps on a few runs, to test the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import platform
import shlex
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the examples package lives in the checkout
    sys.path.insert(0, str(ROOT))

import lightning  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402

import benchmarks.eco as _eco  # noqa: E402  (their helpers)
import benchmarks.optim as _optim  # noqa: E402
from benchmarks.arguments import positive_int  # noqa: E402
from examples.data import ByteTextDataModule  # noqa: E402
from examples.gpt import GPTModule  # noqa: E402
from lightning_qstate.callbacks import AdaptiveBitWidth  # noqa: E402
from lightning_qstate.optim import block_linear_weight_names  # noqa: E402
from lightning_qstate.plugins import QStatePrecision  # noqa: E402
from lightning_qstate.probes import RECIPES, abc_decomposition, linear_input_statistics, ptq  # noqa: E402

Setup, source_digest, _version = _eco.Setup, _optim.source_digest, _optim._version

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "ptq_robustness.md"
DEFAULT_STEPS, QUICK_STEPS, DEFAULT_EVAL_EVERY = 400, 8, 25
PTQ_RECIPES = ("W4A4", "W8A8")
PROBE_BATCHES = 2  # validation batches of the ABC decomposition and the outlier metrics
COMMON_VIEW, FINAL_VIEW = "At the common validation loss", "At the end of training"
METRICS = ("R_L", "mmr", "kurtosis", "kurtosis_channel_rms")
# PTQ accuracy (%) at 760M, W4A4, and full precision where given (arXiv 2509.23500; docs/algorithms.md, "Quantization-robustness probe")
PAPER_PTQ_ACCURACY = {"AdamW": 59.22, "Muon": 50.00, "PSGD": 52.11, "Scion": 53.74, "Shampoo": 59.26, "SOAP": 46.22}
PAPER_FULL_ACCURACY = {"AdamW": 63.90, "Muon": 64.63, "Shampoo": 63.05}


@dataclass(frozen=True)
class RunSpec:
    """One training run: an optimizer family at a learning rate, and for AdamW optionally quantized states or ECO."""

    name: str
    optimizer: str  # "adamw", "muon", "sgd", "lion", "shampoo", "soap"
    lr: float
    states: str | None = None  # "int8", "int4", "adaptive" (QStatePrecision + AdaptiveBitWidth)
    eco: bool = False  # bf16 weights without master copy, ECO with stochastic rounding

    @property
    def family(self) -> str:
        return OPTIMIZER_LABELS[self.optimizer]

    @property
    def low_bit(self) -> bool:
        return self.states is not None or self.eco

    def label(self) -> str:
        extra = f", {self.states} states" if self.states else ", bf16 weights + ECO (SR), no master copy" if self.eco else ""
        return f"{self.family} lr {self.lr:g}{extra}"


OPTIMIZER_LABELS = {"adamw": "AdamW", "muon": "Muon", "sgd": "SGD", "lion": "Lion", "shampoo": "Shampoo", "soap": "SOAP"}
# two learning rates per optimizer: the first is its usual setting for this GPT, the second a third of it
# (Shampoo without grafting moves little at AdamW's rates: 4.98 nats/byte after 400 steps at 3e-3; 3.53 after 60 at 0.3)
LEARNING_RATES = {
    "adamw": (3e-3, 1e-3),
    "muon": (0.02, 0.006),
    "sgd": (0.3, 0.1),
    "lion": (3e-4, 1e-4),
    "shampoo": (0.3, 0.1),
    "soap": (3e-3, 1e-3),
}


def _all_runs() -> dict[str, RunSpec]:
    runs = [RunSpec(f"{optimizer}_{index}", optimizer, lr) for optimizer, lrs in LEARNING_RATES.items() for index, lr in enumerate(lrs)]
    lr = LEARNING_RATES["adamw"][0]
    runs += [RunSpec(f"adamw_{states}", "adamw", lr, states=states) for states in ("int8", "int4", "adaptive")]
    runs.append(RunSpec("adamw_eco", "adamw", lr, eco=True))
    return {run.name: run for run in runs}


RUNS = _all_runs()
QUICK_RUNS = ("adamw_0", "muon_0", "sgd_0", "adamw_int8")


class OptimizerGPT(GPTModule):
    """The GPT example with another optimizer: the same weight-decay groups (matrices only) and LR schedule.

    Muon (``pytorch_optimizer.Muon``) orthogonalizes the linear layers inside the blocks and steps everything else with
    its AdamW at AdamW's first learning rate, as Muon is used; SGD has momentum 0.9 (Nesterov); Lion, Shampoo and SOAP are
    ``pytorch-optimizer``'s with their defaults but the learning rate and weight decay.
    """

    def __init__(self, *args, optimizer: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.optimizer_name = optimizer

    def configure_optimizers(self):
        configured = super().configure_optimizers()
        if self.optimizer_name == "adamw":
            return configured
        import pytorch_optimizer

        adamw, schedule = configured["optimizer"], configured["lr_scheduler"]["scheduler"]
        lr, decay = self.hparams.lr, self.hparams.weight_decay
        groups = [{"params": group["params"], "weight_decay": group["weight_decay"]} for group in adamw.param_groups]
        if self.optimizer_name == "muon":
            hidden = set(block_linear_weight_names(self))
            named = list(self.named_parameters())
            adamw_lr = LEARNING_RATES["adamw"][0]
            groups = [
                {"params": [p for n, p in named if n in hidden], "use_muon": True, "lr": lr, "weight_decay": decay},
                {
                    "params": [p for n, p in named if n not in hidden and p.ndim >= 2],
                    "use_muon": False,
                    "lr": adamw_lr,
                    "weight_decay": decay,
                },
                {"params": [p for n, p in named if n not in hidden and p.ndim < 2], "use_muon": False, "lr": adamw_lr, "weight_decay": 0.0},
            ]
            optimizer = pytorch_optimizer.Muon(groups, lr=lr, adamw_betas=tuple(self.hparams.betas))
        elif self.optimizer_name == "sgd":
            optimizer = torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True)
        elif self.optimizer_name == "lion":
            optimizer = pytorch_optimizer.Lion(groups, lr=lr)
        elif self.optimizer_name == "shampoo":
            optimizer = pytorch_optimizer.Shampoo(groups, lr=lr, momentum=0.9)
        else:
            optimizer = pytorch_optimizer.SOAP(groups, lr=lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lr_lambdas[0])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class CheckpointEveryValidation(Callback):
    """After every validation: the validation loss and a checkpoint of the model (``<folder>/step<N>.pt``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.trajectory: list[tuple[int, float]] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        step = trainer.global_step
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.save({name: value.detach().float().clone() for name, value in pl_module.state_dict().items()}, self.folder / f"step{step}.pt")
        self.trajectory.append((step, float(trainer.callback_metrics["val_loss"])))


def make_setup(args: argparse.Namespace) -> Setup:
    return _eco.make_setup(argparse.Namespace(quick=args.quick, steps=args.steps, min_quant_size=None))


def make_module(setup: Setup, run: RunSpec, seed: int) -> OptimizerGPT:
    return OptimizerGPT(**{**setup.model, "lr": run.lr}, seed=seed, optimizer=run.optimizer)


def train(setup: Setup, run: RunSpec, args: argparse.Namespace, folder: Path) -> dict:
    """Train ``run`` with a validation and a checkpoint every ``--eval-every`` steps; its trajectory and settings."""
    pl.seed_everything(args.seed, verbose=False)
    module = make_module(setup, run, args.seed)
    plugins, callbacks = [], [checkpoints := CheckpointEveryValidation(folder)]
    min_quant_size = setup.min_quant_size
    if run.states:
        plugins.append(QStatePrecision("32-true", states="int8" if run.states == "adaptive" else run.states, min_quant_size=min_quant_size))
        if run.states == "adaptive":
            callbacks.append(AdaptiveBitWidth(target_bits=5.1, interval=max(1, args.eval_every)))
    if run.eco:
        plugins.append(
            QStatePrecision(
                "32-true", states="fp32", weights="bf16", weight_rounding="stochastic", error_feedback="eco", weight_overrides={"*": "bf16"}
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=setup.steps,
        val_check_interval=args.eval_every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        plugins=plugins,
    )  # as the other benchmarks' (benchmark_trainer), with a validation every --eval-every steps
    start = time.perf_counter()
    trainer.fit(module, ByteTextDataModule(**setup.data, seed=args.seed))
    return {"trajectory": checkpoints.trajectory, "train_seconds": time.perf_counter() - start}


@dataclass
class Measured:
    """One run at the common loss: its checkpoint's step and the figures of every recipe."""

    run: str
    step: int
    loss: float
    ptq_loss: dict[str, float]
    R_L: dict[str, float]  # noqa: N815
    mmr: float
    kurtosis: float
    kurtosis_channel_rms: float

    def increase(self, recipe: str) -> float:
        return self.ptq_loss[recipe] - self.loss


def measure(setup: Setup, run: RunSpec, args: argparse.Namespace, checkpoint: Path, step: int) -> Measured:
    """PTQ losses, ``R_L`` and outlier metrics of ``run``'s model at ``checkpoint``."""
    module = make_module(setup, run, args.seed)
    module.load_state_dict(torch.load(checkpoint, weights_only=True))
    module.eval()
    data = ByteTextDataModule(**setup.data, seed=args.seed)
    data.setup("fit")
    batches = list(data.val_dataloader())

    def loss(model: torch.nn.Module, batch) -> torch.Tensor:
        return model._loss(batch)

    def mean_loss() -> float:
        return sum(float(loss(module, batch)) * len(batch[0]) for batch in batches) / sum(len(batch[0]) for batch in batches)

    with torch.no_grad():
        clean = mean_loss()
        quantized, r_l = {}, {}
        for recipe in PTQ_RECIPES:
            with ptq(module, **RECIPES[recipe]):
                quantized[recipe] = mean_loss()
            runs = [abc_decomposition(module, batch, **RECIPES[recipe], forward=loss, layers=False) for batch in batches[:PROBE_BATCHES]]
            r_l[recipe] = sum(result.R_L for result in runs) / len(runs)
        stats = [linear_input_statistics(module, batch, forward=loss) for batch in batches[:PROBE_BATCHES]]
    average = lambda values: sum(values) / len(values)  # noqa: E731
    return Measured(
        run.name,
        step,
        clean,
        quantized,
        r_l,
        average([s.mmr for s in stats]),
        average([s.kurtosis for s in stats]),
        average([s.mean("kurtosis_channel_rms") for s in stats]),
    )


def common_loss(trajectories: dict[str, list[tuple[int, float]]]) -> tuple[float, list[str]]:
    """The loss every optimizer reaches, and the runs left out because they never reach it.

    Each optimizer (``RUNS``' family, low-bit AdamW runs excluded) is represented by its better learning rate; the
    common loss is the highest of those best validation losses (non-finite losses count as not reached). Any run,
    low-bit ones included, whose best is above it is left out.
    """
    best = {name: min((loss for _, loss in points if math.isfinite(loss)), default=math.inf) for name, points in trajectories.items()}
    families: dict[str, float] = {}
    for name, loss in best.items():
        run = RUNS.get(name)
        if run is None or not run.low_bit:
            family = run.family if run is not None else name
            families[family] = min(families.get(family, math.inf), loss)
    reachable = [loss for loss in families.values() if math.isfinite(loss)]
    if not reachable:
        raise RuntimeError("no run has a finite validation loss: no common loss")
    target = max(reachable)
    return target, [name for name, loss in best.items() if loss > target]


def first_at(points: list[tuple[int, float]], target: float) -> int:
    """The first validation step whose loss is at or below ``target``."""
    return next(step for step, loss in points if loss <= target)


# --- statistics ---------------------------------------------------------------------------------------------------
def pearson(x: list[float], y: list[float]) -> float:
    n = len(x)
    if n < 3:
        return math.nan
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True))
    sxx, syy = sum((a - mx) ** 2 for a in x), sum((b - my) ** 2 for b in y)
    return sxy / math.sqrt(sxx * syy) if sxx > 0 and syy > 0 else math.nan


def ranks(values: list[float]) -> list[float]:
    """Ranks from 1, ties given their mean rank."""
    order = sorted(range(len(values)), key=lambda index: values[index])
    result = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for position in range(start, end + 1):
            result[order[position]] = (start + end) / 2 + 1
        start = end + 1
    return result


def spearman(x: list[float], y: list[float]) -> float:
    return pearson(ranks(x), ranks(y))


def metric_values(measured: list[Measured], metric: str, recipe: str) -> list[float]:
    return [m.R_L[recipe] if metric == "R_L" else getattr(m, metric) for m in measured]


# --- report -------------------------------------------------------------------------------------------------------
def report(
    args: argparse.Namespace,
    setup: Setup,
    results: dict,
    target: float,
    diverged: list[str],
    views: dict[str, list[Measured]],
    argv: list[str],
    digest: str,
    seconds: float,
) -> str:
    """The markdown report: the settings, then per view (``{title: measured runs}``: the common loss, the end of
    training) the runs, the correlations, the target's verdict, the ranking and the low-bit rows."""
    command = shlex.join(["python", "benchmarks/ptq_robustness.py", *argv])
    trained = sum(result["train_seconds"] for result in results.values())
    lines = [
        "# Which optimizer trains the most quantizable model (arXiv 2509.23500 at CPU scale)",
        "",
        f"- command: `{command}`",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; "
        f"runtime {seconds:.0f} s (training, summed: {trained:.0f} s)",
        f"- versions: python {platform.python_version()}, torch {torch.__version__}, lightning {lightning.__version__}, "
        f"pytorch-optimizer {_version('pytorch_optimizer')}, lightning_qstate source digest {digest}",
        f"- machine: {platform.machine()}, {platform.system()}, CPUs {torch.get_num_threads()} torch threads",
        f"- model: {setup.label}; at most {setup.steps} steps, warmup then cosine to 0.1x peak, gradient clipping 1.0, "
        f"validation every {args.eval_every} steps; one seed ({args.seed}): differences between single runs are not resolved "
        "by a standard error",
        f"- protocol (the paper's): each run taken at its first validation at or below the common loss **{target:.4f}** "
        "nats/byte (the highest of the optimizers' best losses, each optimizer at its better learning rate)"
        f"{'; left out, never reaching it: ' + ', '.join(diverged) if diverged else ''}. Also: every run at its last "
        "validation (the end of training), where the optimizers' models differ most",
        "- PTQ: symmetric absmax per output channel (weights) and per token (activations), round-to-nearest, every linear "
        "layer (`lightning_qstate.probes.ptq`); loss on the whole validation set; R_L (whole-tensor norms, last block), MMR "
        "(per token) and kurtosis (excess, of all elements; and of the per-channel RMS) on the first "
        f"{PROBE_BATCHES} validation batches, averaged over the linear layers' inputs",
        "",
    ]
    verdicts = []
    for title, measured in views.items():
        section, section_verdicts = view_section(title, measured)
        lines += section
        verdicts += section_verdicts
    lines += ["## Targets", "", *verdicts, ""]
    steps = [step for step, _ in next(iter(results.values()))["trajectory"]]
    lines += ["## Validation losses along each run", "", "| run | " + " | ".join(f"step {step}" for step in steps) + " |"]
    lines.append("|---|" + "---:|" * len(steps))
    for name, result in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{loss:.4f}" for _, loss in result["trajectory"]) + " |")
    return "\n".join(lines) + "\n"


def view_section(title: str, measured: list[Measured]) -> tuple[list[str], list[str]]:
    """One view's tables and its verdicts on the target (R_L predicts the increase better than MMR and kurtosis)."""
    lines = [
        f"## {title}",
        "",
        "| run | setup | step | val loss | W4A4 loss | W4A4 increase | R_L W4A4 | W8A8 increase | R_L W8A8 | MMR | kurtosis "
        "| kurtosis (channel RMS) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for m in measured:
        lines.append(
            f"| {m.run} | {RUNS[m.run].label()} | {m.step} | {m.loss:.4f} | {m.ptq_loss['W4A4']:.4f} | {m.increase('W4A4'):+.4f} | "
            f"{m.R_L['W4A4']:.3e} | {m.increase('W8A8'):+.4f} | {m.R_L['W8A8']:.3e} | {m.mmr:.2f} | {m.kurtosis:.2f} | "
            f"{m.kurtosis_channel_rms:.2f} |"
        )
    lines += ["", f"Correlation of each metric with the PTQ loss increase ({title.lower()}):", ""]
    lines += [
        "| recipe | runs | n | " + " | ".join(f"{metric} Pearson / Spearman" for metric in METRICS) + " |",
        "|---|---|---:|" + "---:|" * len(METRICS),
    ]
    groups = {"optimizer runs": [m for m in measured if not RUNS[m.run].low_bit], "all runs": measured}
    verdicts = []
    for recipe in PTQ_RECIPES:
        for group, members in groups.items():
            increase = [m.increase(recipe) for m in members]
            cells, strengths = [], {}
            for metric in METRICS:
                values = metric_values(members, metric, recipe)
                r, rho = pearson(values, increase), spearman(values, increase)
                strengths[metric] = (abs(r), abs(rho))
                cells.append(f"{r:+.2f} / {rho:+.2f}")
            lines.append(f"| {recipe} | {group} | {len(members)} | " + " | ".join(cells) + " |")
            if group == "optimizer runs":
                others = [metric for metric in METRICS if metric != "R_L"]
                best = all(strengths["R_L"][k] > strengths[metric][k] for metric in others for k in (0, 1))
                verdicts.append(
                    f"- {title}, {recipe}, optimizer runs: R_L predicts the PTQ increase better than MMR and both kurtosis "
                    f"variants (|Pearson| and |Spearman| both larger): **{'PASS' if best else 'FAIL'}** "
                    f"(|r|, |ρ|: R_L {strengths['R_L'][0]:.2f}, {strengths['R_L'][1]:.2f}; "
                    + "; ".join(f"{metric} {strengths[metric][0]:.2f}, {strengths[metric][1]:.2f}" for metric in others)
                    + ")"
                )
    best_per_family: dict[str, Measured] = {}
    for m in measured:
        run = RUNS[m.run]
        if not run.low_bit and (run.family not in best_per_family or m.loss < best_per_family[run.family].loss):
            best_per_family[run.family] = m
    lines += [
        "",
        f"Optimizers ranked by their W4A4 increase ({title.lower()}; each at its learning rate with the lower loss there):",
        "",
        "| rank | optimizer | run | val loss | W4A4 increase | R_L W4A4 | paper: W4A4 accuracy (760M) | paper: full precision |",
        "|---:|---|---|---:|---:|---:|---:|---:|",
    ]
    for rank, (family, m) in enumerate(sorted(best_per_family.items(), key=lambda item: item[1].increase("W4A4")), 1):
        paper, full = PAPER_PTQ_ACCURACY.get(family), PAPER_FULL_ACCURACY.get(family)
        lines.append(
            f"| {rank} | {family} | {m.run} | {m.loss:.4f} | {m.increase('W4A4'):+.4f} | {m.R_L['W4A4']:.3e} | "
            f"{'–' if paper is None else f'{paper:.2f}'} | {'–' if full is None else f'{full:.2f}'} |"
        )
    lines += [
        "",
        "Paper (760M, W4A4 PTQ accuracy, higher is better): Shampoo 59.26 ≈ AdamW 59.22 > Scion 53.74 > PSGD 52.11 > Muon 50.00 > "
        "SOAP 46.22; Muon best in full precision (64.63) and among the worst under PTQ.",
        "",
        f"Low-bit states and ECO (AdamW at the same learning rate; {title.lower()}):",
        "",
        "| run | val loss | W4A4 increase | Δ vs fp32 states | W8A8 increase | Δ vs fp32 states | R_L W4A4 |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    reference = next((m for m in measured if m.run == "adamw_0"), None)
    for m in measured:
        if RUNS[m.run].low_bit or m.run == "adamw_0":
            deltas = [f"{m.increase(r) - reference.increase(r):+.4f}" if reference else "–" for r in PTQ_RECIPES]
            lines.append(
                f"| {m.run} | {m.loss:.4f} | {m.increase('W4A4'):+.4f} | {deltas[0]} | {m.increase('W8A8'):+.4f} | {deltas[1]} | "
                f"{m.R_L['W4A4']:.3e} |"
            )
    return [*lines, ""], verdicts


def plot(views: dict[str, list[Measured]], path: Path) -> None:
    """PTQ increase (W4A4) against R_L, MMR and kurtosis, one point per run, a row of panels per view."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(views), 3, figsize=(15, 4.5 * len(views)), squeeze=False)
    labels = ("R_L (W4A4)", "MMR of linear inputs", "excess kurtosis of linear inputs")
    for row, (title, measured) in zip(axes, views.items(), strict=True):
        increase = [m.increase("W4A4") for m in measured]
        for axis, metric, label in zip(row, ("R_L", "mmr", "kurtosis"), labels, strict=True):
            values = metric_values(measured, metric, "W4A4")
            for m, x, y in zip(measured, values, increase, strict=True):
                axis.scatter(x, y, color="tab:red" if RUNS[m.run].low_bit else "tab:blue")
                axis.annotate(m.run, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
            axis.set_xlabel(label)
            axis.set_title(f"{title}: Pearson {pearson(values, increase):+.2f}, Spearman {spearman(values, increase):+.2f}", fontsize=9)
        row[0].set_ylabel("W4A4 PTQ loss increase (nats/byte)")
    figure.suptitle("PTQ damage against its predictors (blue: optimizers, red: AdamW with low-bit states / ECO)")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def settings_key(setup: Setup, run: RunSpec, args: argparse.Namespace, digest: str) -> dict:
    return {
        "setup": dataclasses.asdict(setup),
        "run": dataclasses.asdict(run),
        "seed": args.seed,
        "eval_every": args.eval_every,
        "source": digest,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny GPT for a few steps on a few runs (tests the script)")
    parser.add_argument("--out", type=Path, default=None, help=f"report path (default {DEFAULT_OUT.relative_to(ROOT)}; the plot beside it)")
    parser.add_argument("--runs", default=None, help="all, or comma-separated names of RUNS")
    parser.add_argument(
        "--steps", type=positive_int, default=None, help=f"most training steps (default {DEFAULT_STEPS}; quick {QUICK_STEPS})"
    )
    parser.add_argument(
        "--eval-every", type=positive_int, default=None, help=f"steps between validations (default {DEFAULT_EVAL_EVERY}; quick 2)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "lightning_qstate_ptq_robustness")
    args = parser.parse_args(argv)
    names = (",".join(QUICK_RUNS) if args.quick else "all") if args.runs is None else args.runs
    args.run_names = list(RUNS) if names == "all" else names.split(",")
    unknown = [name for name in args.run_names if name not in RUNS]
    if unknown:
        parser.error(f"--runs: unknown {unknown}; valid: all or {', '.join(RUNS)}")
    args.eval_every = args.eval_every or (2 if args.quick else DEFAULT_EVAL_EVERY)
    return args


def main(argv: list[str] | None = None, progress: Callable[[str], None] = print) -> str:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    setup = make_setup(args)
    digest = source_digest()
    start = time.perf_counter()
    results = {}
    for name in args.run_names:
        run = RUNS[name]
        folder = args.work / ("quick" if args.quick else "full") / name
        key = settings_key(setup, run, args, digest)
        saved = folder / "run.json"
        if saved.exists() and json.loads(saved.read_text())["settings"] == json.loads(json.dumps(key)):
            results[name] = json.loads(saved.read_text())
            progress(f"{name}: reused from {saved}")
            continue
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*does not have many workers.*")
            results[name] = {"settings": key, **train(setup, run, args, folder)}
        saved.write_text(json.dumps(results[name]))
        best = min(loss for _, loss in results[name]["trajectory"])
        progress(f"{name}: trained in {results[name]['train_seconds']:.0f} s, best val loss {best:.4f}")
    target, diverged = common_loss({name: result["trajectory"] for name, result in results.items()})
    views: dict[str, list[Measured]] = {COMMON_VIEW: [], FINAL_VIEW: []}
    for name, result in results.items():
        folder = args.work / ("quick" if args.quick else "full") / name
        final = result["trajectory"][-1][0]
        if name not in diverged:
            step = first_at(result["trajectory"], target)
            views[COMMON_VIEW].append(measure(setup, RUNS[name], args, folder / f"step{step}.pt", step))
        views[FINAL_VIEW].append(measure(setup, RUNS[name], args, folder / f"step{final}.pt", final))
    text = report(args, setup, results, target, diverged, views, argv, digest, time.perf_counter() - start)
    out = args.out or DEFAULT_OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    plot(views, out.with_suffix(".png"))
    return text


if __name__ == "__main__":
    print(main())
