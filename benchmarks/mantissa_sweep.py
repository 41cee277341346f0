"""How many mantissa bits each training component needs: a sweep against fp32, and the precision advisor's law checked on it.

Usage::

    python benchmarks/mantissa_sweep.py [--quick] [--out PATH] [--problems rosenbrock,digits,gpt] [--optimizers adam,muon]
                                        [--horizons T ...] [--mantissas M ...] [--seeds N] [--gpt-steps N] [--threads N]

``docs/algorithms.md``, "Precision advisor" (arXiv 2510.21314): Adam needs about ``log2 T`` mantissa bits for the gradients and ``m``,
``2·log2 T`` for the weights and ``v``; Muon about ``½·log2 T`` for all. This script quantizes one component at a time
(``grads``: ``p.grad`` before the step; ``weights``: the parameters after the step, and at initialisation;
``exp_avg``: Adam's ``m`` or Muon's momentum buffer, and ``exp_avg_sq``: Adam's ``v``, in place after the step), and
all of them together (``all``), to a minifloat with ``M`` mantissa bits and fp32's 8-bit exponent (range is never the
limit; :func:`quantize_mantissa_`), with round-to-nearest-even or stochastic rounding, and reports the final loss
against fp32's.

Problems (``PROBLEMS``); every run follows the paper's regime, ``η = η_1000·sqrt(1000/T)`` and
``1 − β2 = BETA2_WINDOW/T`` (β1 = 0.9, Muon's momentum 0.95 with Nesterov, no weight decay), with a cosine decay of
the learning rate to 0 at step ``T`` (after a linear warmup for the GPT):

- ``rosenbrock``: ``(1−x)² + 100·(y−x²)²`` from ``(−1.2, 1)`` plus a seeded offset in ``[−0.2, 0.2]²``; the metric is
  ``f`` at the last iterate. Under Muon ``(x, y)`` is a 1×2 matrix: the orthogonalized update is the normalized
  (Nesterov) momentum, scaled by the Newton–Schulz polynomial.
- ``digits``: a bias-free MLP 64→32→32→10 (ReLU) on scikit-learn's digits (standardized, a fixed 80/20 split),
  minibatches of 128 drawn per seed; objective and metric: cross-entropy + ``1e-3/2·‖W‖²`` (without the L2 term the
  MLP memorizes the digits and the loss goes to 0, where no tolerance separates a degraded run from fp32), the metric
  on the whole training set at the end. Under Muon all three matrices are Muon's.
- ``gpt``: ``examples.gpt.GPTModule`` (byte-level GPT-2 with random init, a small configuration) on the pydoc text, one
  horizon (``--gpt-steps``), stochastic rounding only, ``M`` in ``GPT_MANTISSAS``: Adam with ``all`` and ``exp_avg_sq``,
  Muon with ``all``; torch's ``Muon`` on the matrices inside the transformer blocks and torch's ``Adam`` on the rest
  (embeddings, norms, biases, as is standard); the metric is the validation loss at the end (nats/byte). One seed.

Rosenbrock and the digits are trained batched: every configuration and seed is a row of one ``[rows, P]`` parameter
stepped by ONE ``torch.optim.Adam`` (elementwise, so the rows are independent) or by :class:`BatchedMuon` (torch's
Muon update, with its Newton–Schulz iteration batched over the rows and, for speed on CPUs without bf16 arithmetic,
in fp32 instead of torch's bf16; in bf16 the test finds it within bf16's rounding of ``torch.optim.Muon``). Each
horizon is one run.

A component's **threshold** is the smallest ``M`` of the sweep such that it and every larger ``M`` swept stay within
the problem's tolerance of fp32 (``TOLERANCES``; one-sided: the mean per-seed excess over fp32 at most ``relative·fp32
+ absolute``, widened by twice the run's own noise floor where training is chaotic: :class:`Tolerance`). The
advisor's law ``M = slope·log2 T + c`` (``lightning_qstate.theory.precision.required_mantissa_bits``) is calibrated
per (optimizer, component, rounding) on ONE horizon (``CALIBRATION_HORIZON`` on the digits: ``c = threshold −
slope·log2 T``) and checked on the others: the target is the prediction within ±1 bit of the measured threshold on
the held-out horizons. The report also gives conservative constants, from the largest threshold of Rosenbrock and the
digits at that horizon.

Measured on 2 idle cores (one torch thread): the default run takes 691 s. ``--quick`` runs tiny versions (a smoke test).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the examples package lives in the checkout
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.arguments import positive_int  # noqa: E402
from lightning_qstate.formats import ROUNDINGS  # noqa: E402
from lightning_qstate.theory.precision import COMPONENTS, SLOPES, required_mantissa_bits  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results" / "mantissa_sweep.md"
FP32_MANTISSA = 23
PROBLEMS = ("rosenbrock", "digits", "gpt")
OPTIMIZERS = ("adam", "muon")
SWEPT = (*COMPONENTS, "all")  # what one configuration quantizes: one component, or every one
MUON_SWEPT = ("grads", "weights", "exp_avg", "all")  # Muon has no second moment
DEFAULT_HORIZONS, DEFAULT_MANTISSAS, DEFAULT_SEEDS, DEFAULT_GPT_STEPS = (300, 1000, 3000), tuple(range(1, 11)), 3, 300
GPT_MANTISSAS = (1, 2, 3, 4, 5, 7, 10)
GPT_SWEPT = {"adam": ("all", "exp_avg_sq"), "muon": ("all",)}
T_REF, BETA2_WINDOW, BETA1, MUON_MOMENTUM = 1000, 10.0, 0.9, 0.95
CALIBRATION_PROBLEM, CALIBRATION_HORIZON = "digits", 1000  # --calibration-horizon overrides the horizon
PREDICTION_SLACK = 1.0  # the issue's target: predicted M within ±1 bit of the measured threshold


@dataclass(frozen=True)
class Tolerance:
    """How far above fp32 a configuration's loss may be: ``relative·|mean fp32| + absolute``, plus ``NOISE_SIGMAS``
    times the run's own noise (:func:`noise_floors`), where training is chaotic enough that a perturbation as small as
    the largest ``M`` swept moves the result by more than the tolerance (Muon on the digits at T = 300: ±5 % per seed)."""

    relative: float
    absolute: float

    def limit(self, reference: Sequence[float], noise: float = 0.0) -> float:
        """The largest mean excess over fp32 (``reference``: fp32's loss per seed) that still counts as fp32's."""
        return self.relative * abs(statistics.fmean(reference)) + self.absolute + NOISE_SIGMAS * noise

    def within(self, losses: Sequence[float], reference: Sequence[float], noise: float = 0.0) -> bool:
        """Whether the mean per-seed excess of ``losses`` over fp32's ``reference`` (same seed order) is within :meth:`limit`."""
        return mean_excess(losses, reference) <= self.limit(reference, noise)

    def text(self) -> str:
        parts = [f"{self.relative:.0%} relative"] if self.relative else []
        parts += [f"{self.absolute:g} absolute"] if self.absolute else []
        return " + ".join(parts)


NOISE_SIGMAS = 2.0  # the tolerance widens by this many standard errors of the run's own noise (noise_floors)
# From fp32's scale: Rosenbrock's fp32 ends at 1e-4..1e-13, so absolute: f <= 1e-3 puts the point within about 0.03 of the
# minimum (1, 1); the digits' regularized objective ends near 0.04-0.06 and the GPT's validation loss near 2.2-2.5
# nats/byte: 1 % relative.
TOLERANCES = {"rosenbrock": Tolerance(0.0, 1e-3), "digits": Tolerance(0.01, 0.0), "gpt": Tolerance(0.01, 0.0)}
# The paper's small runs (SR): Adam ≈ fp32 at M >= 7, fails at M <= 2; Muon ≈ fp32 at M >= 3; v hurts Adam most, then the
# weights, then m; the gradients least.
PAPER = {"adam_ok_from": 7, "adam_fails_upto": 2, "muon_ok_from": 3, "adam_order": ("exp_avg_sq", "weights", "exp_avg", "grads")}


# --------------------------------------------------------------------------------------------------------------------
# Quantization to M mantissa bits


def quantize_mantissa_(
    x: torch.Tensor, mantissa: int | torch.Tensor, rounding: str, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Round the fp32 tensor ``x`` in place to ``mantissa`` fraction bits, keeping fp32's sign and 8-bit exponent.

    Args:
        x: fp32 values, any shape (a non-contiguous view is fine); zeros, infinities and NaNs are left alone.
        mantissa: ``M`` in ``[1, 23]`` (23 leaves ``x`` as it is): an int, or a tensor of one ``M`` per leading row of
            ``x`` (shape ``[x.shape[0]]``).
        rounding: ``"nearest"`` (to nearest, ties to even, on the dropped bits) or ``"stochastic"`` (uniform random
            bits added below the kept ones, then truncated: unbiased).
        generator: the random stream of stochastic rounding.

    Returns ``x``. A value that rounds past fp32's largest finite value becomes infinite, as in any float format.
    """
    if x.dtype != torch.float32:
        raise ValueError(f"quantize_mantissa_: x must be float32, got {x.dtype}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"quantize_mantissa_: rounding={rounding!r} is not valid; use one of {ROUNDINGS}")
    bits = x.view(torch.int32)
    magnitude = bits & 0x7FFFFFFF
    if isinstance(mantissa, int):
        if not 1 <= mantissa <= FP32_MANTISSA:
            raise ValueError(f"quantize_mantissa_: mantissa={mantissa} must lie in [1, {FP32_MANTISSA}]")
        if mantissa == FP32_MANTISSA:
            return x
        drop: int | torch.Tensor = FP32_MANTISSA - mantissa
        low: int | torch.Tensor = (1 << drop) - 1
    else:
        if mantissa.shape != (x.shape[0],):
            raise ValueError(
                f"quantize_mantissa_: a mantissa tensor needs one M per row of x, shape {(x.shape[0],)}; got {tuple(mantissa.shape)}"
            )
        drop = (FP32_MANTISSA - mantissa.to(torch.int32)).view(-1, *([1] * (x.ndim - 1)))
        low = (1 << drop) - 1
    if rounding == "nearest":
        offset = ((low >> 1) + ((magnitude >> drop) & 1)) & low  # 2^(d-1) − 1, plus one when the kept part is odd
    else:
        offset = torch.randint(0, 1 << FP32_MANTISSA, x.shape, generator=generator, dtype=torch.int32) & low
    rounded = (magnitude + offset) & ~low
    bits.copy_(torch.where(magnitude >= 0x7F800000, magnitude, rounded) | (bits & ~0x7FFFFFFF))
    return x


# --------------------------------------------------------------------------------------------------------------------
# Muon batched over independent configurations


def newton_schulz_batched(
    update: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """torch's ``_zeropower_via_newtonschulz`` on a stack of matrices ``[K, A, B]``, each normalized by its own norm,
    computed in ``dtype`` (torch uses bf16); returns ``[K, A, B]`` in ``dtype``."""
    a, b, c = coefficients
    ortho = update.to(dtype)
    transposed = update.shape[-2] > update.shape[-1]
    if transposed:
        ortho = ortho.mT
    ortho = ortho / ortho.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = ortho @ ortho.mT
        gram_update = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        ortho = torch.baddbmm(ortho, gram_update, ortho, beta=a)
    return ortho.mT if transposed else ortho


class BatchedMuon(torch.optim.Optimizer):
    """``torch.optim.Muon``'s update for many independent configurations at once.

    Each parameter is ``[K, P]``: row ``k`` holds one configuration's matrices of ``shapes`` back to back (row-major).
    Per row and matrix it does what torch's Muon does to a 2-D parameter: ``buf.lerp_(g, 1 − momentum)``, the
    Nesterov mix ``g.lerp(buf, momentum)``, Newton–Schulz orthogonalization, decoupled weight decay and the
    ``sqrt(max(1, A/B))`` learning-rate adjustment (torch's ``adjust_lr_fn=None``). The state ``momentum_buffer`` is
    ``[K, P]``, so a quantizer can treat it in one call. ``ns_dtype=torch.bfloat16`` is torch's arithmetic (batched
    matrix products can round a bf16 unit differently from torch's single ones); ``torch.float32`` is the same
    iteration without bf16's rounding (and far faster on CPUs without bf16 units).
    """

    def __init__(
        self,
        params,
        shapes: Sequence[tuple[int, int]],
        lr: float = 1e-3,
        momentum: float = MUON_MOMENTUM,
        nesterov: bool = True,
        weight_decay: float = 0.0,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        ns_dtype: torch.dtype = torch.float32,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
        )
        super().__init__(params, defaults)
        self.shapes, self.ns_dtype = [tuple(shape) for shape in shapes], ns_dtype
        size = sum(a * b for a, b in self.shapes)
        for group in self.param_groups:
            for param in group["params"]:
                if param.ndim != 2 or param.shape[1] != size:
                    raise ValueError(
                        f"BatchedMuon: parameters must be [K, {size}] (the matrices {self.shapes} per row); got {tuple(param.shape)}"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad, state = param.grad, self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad)
                buffer = state["momentum_buffer"]
                buffer.lerp_(grad, 1 - group["momentum"])
                update = grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
                param.mul_(1 - group["lr"] * group["weight_decay"])
                start = 0
                for rows, cols in self.shapes:
                    stop = start + rows * cols
                    matrices = update[:, start:stop].reshape(-1, rows, cols)
                    ortho = newton_schulz_batched(matrices, group["ns_coefficients"], group["ns_steps"], group["eps"], self.ns_dtype)
                    adjusted_lr = group["lr"] * math.sqrt(max(1.0, rows / cols))
                    param[:, start:stop].add_(ortho.reshape(-1, rows * cols).to(param.dtype), alpha=-adjusted_lr)
                    start = stop
        return loss


# --------------------------------------------------------------------------------------------------------------------
# Configurations and the regime


@dataclass(frozen=True)
class Config:
    """One configuration: ``component`` (one of ``SWEPT``, or ``"fp32"``: nothing quantized) at ``mantissa`` bits."""

    component: str
    mantissa: int = FP32_MANTISSA
    rounding: str = "stochastic"

    def quantizes(self, component: str) -> bool:
        return self.component in (component, "all")

    @property
    def key(self) -> str:
        return "fp32" if self.component == "fp32" else f"{self.component}/{self.rounding}/M{self.mantissa}"


FP32 = Config("fp32")


def sweep_configs(components: Sequence[str], mantissas: Sequence[int], roundings: Sequence[str]) -> list[Config]:
    """fp32, then every (component, rounding) block of ``mantissas`` (the blocks are contiguous rows of a batched run)."""
    return [FP32] + [Config(c, m, r) for c in components for r in roundings for m in mantissas]


def beta2_for(steps: int) -> float:
    """``1 − BETA2_WINDOW/T`` (the paper's ``1 − β2 = Θ(1/T)``), at most 0.999 and at least 0.9."""
    return min(0.999, max(0.9, 1.0 - BETA2_WINDOW / steps))


def peak_lr(lr_at_ref: float, steps: int) -> float:
    """``η = Θ(1/sqrt(T))``: the learning rate of a ``T``-step run from the one at ``T_REF`` steps."""
    return lr_at_ref * math.sqrt(T_REF / steps)


def schedule(steps: int, warmup: int) -> Callable[[int], float]:
    """The LR factor of step ``t``: linear warmup over ``warmup`` steps, then a cosine decay to 0 at ``steps``."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min((step - warmup) / max(steps - warmup, 1), 1.0)))

    return factor


class Quantizer:
    """Where each configuration's rows of a batched run lie and what they quantize.

    Rows are ``config index · seeds + seed index``; per component, the rows that quantize it form a few contiguous
    slices of one rounding each, quantized with one ``M`` per row.
    """

    def __init__(self, configs: Sequence[Config], seeds: int, generator: torch.Generator) -> None:
        self.generator = generator
        self.slices: dict[str, list[tuple[slice, torch.Tensor, str]]] = {}
        for component in COMPONENTS:
            blocks: list[tuple[slice, torch.Tensor, str]] = []
            index = 0
            while index < len(configs):
                config = configs[index]
                if not config.quantizes(component):
                    index += 1
                    continue
                end = index
                while end < len(configs) and configs[end].quantizes(component) and configs[end].rounding == config.rounding:
                    end += 1
                mantissas = torch.tensor([c.mantissa for c in configs[index:end]], dtype=torch.int32).repeat_interleave(seeds)
                blocks.append((slice(index * seeds, end * seeds), mantissas, config.rounding))
                index = end
            self.slices[component] = blocks

    def __call__(self, component: str, tensor: torch.Tensor) -> None:
        """Quantize ``tensor`` ``[rows, ...]`` in place where the rows' configurations quantize ``component``."""
        for rows, mantissas, rounding in self.slices[component]:
            quantize_mantissa_(tensor[rows], mantissas, rounding, self.generator)


# --------------------------------------------------------------------------------------------------------------------
# Batched problems


class Rosenbrock:
    """``(1−x)² + 100·(y−x²)²``; each row a point ``(x, y)``."""

    name, label = "rosenbrock", "Rosenbrock (1−x)² + 100(y−x²)² from (−1.2, 1) + U[−0.2, 0.2]² per seed"
    shapes = ((1, 2),)
    adam_lr, muon_lr, warmup = 0.2, 0.03, 0

    def initial(self, seed: int) -> torch.Tensor:
        offset = torch.rand(2, generator=torch.Generator().manual_seed(seed)) * 0.4 - 0.2
        return torch.tensor([-1.2, 1.0]) + offset

    def begin(self, seeds: Sequence[int]) -> None:
        pass

    @staticmethod
    def value(theta: torch.Tensor) -> torch.Tensor:
        x, y = theta[..., 0], theta[..., 1]
        return (1 - x) ** 2 + 100 * (y - x * x) ** 2

    def train_loss(self, theta: torch.Tensor, step: int) -> torch.Tensor:
        return self.value(theta)

    def metric(self, theta: torch.Tensor) -> torch.Tensor:
        return self.value(theta)


class DigitsMLP:
    """A bias-free MLP 64→32→32→10 (ReLU) on scikit-learn's digits; each row one network's weights.

    The objective is the cross-entropy plus ``l2/2·‖W‖²`` (in the loss, so Adam and Muon see it in the gradient): without
    it the MLP memorizes the 1437 digits and the training loss goes to 0 (exactly 0 in fp32 under Muon by T = 3000),
    where no tolerance tells a degraded run from fp32; with it the minimum is well above 0, as Rosenbrock's is well
    defined. The metric is that objective on the whole training set.
    """

    name = "digits"
    adam_lr, muon_lr, warmup = 3e-3, 0.02, 0

    def __init__(self, widths: Sequence[int] = (64, 32, 32, 10), batch_size: int = 128, l2: float = 1e-3) -> None:
        from sklearn.datasets import load_digits

        self.widths, self.batch_size, self.l2 = tuple(widths), batch_size, l2
        self.shapes = tuple((fan_out, fan_in) for fan_in, fan_out in zip(self.widths, self.widths[1:], strict=False))
        features, labels = load_digits(return_X_y=True)
        features, labels = torch.tensor(features, dtype=torch.float32) / 16, torch.tensor(labels)
        order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(0))
        train = order[: int(0.8 * len(labels))]
        mean, std = features[train].mean(0), features[train].std(0).clamp(min=0.1)
        self.features, self.labels = (features[train] - mean) / std, labels[train]
        self.generators: list[torch.Generator] = []
        self.label = (
            f"bias-free MLP {'→'.join(map(str, self.widths))} (ReLU) on sklearn digits ({len(self.labels)} train), batch {batch_size}; "
            f"objective and metric: cross-entropy + {l2:g}/2·‖W‖² (on the whole training set for the metric)"
        )

    def initial(self, seed: int) -> torch.Tensor:
        """nn.Linear's default init, ``U(±1/sqrt(fan_in))``, flattened: ``[P]``."""
        generator = torch.Generator().manual_seed(seed)
        return torch.cat(
            [(torch.rand(out, fan_in, generator=generator) * 2 - 1).flatten() / math.sqrt(fan_in) for out, fan_in in self.shapes]
        )

    def begin(self, seeds: Sequence[int]) -> None:
        self.generators = [torch.Generator().manual_seed(10_000 + seed) for seed in seeds]

    def logits(self, theta: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """``theta`` ``[R, S, P]``, ``features`` ``[S or 1, N, 64]`` → logits ``[R, S, N, 10]``."""
        hidden, start = features, 0
        for layer, (out, fan_in) in enumerate(self.shapes):
            weight = theta[..., start : start + out * fan_in].unflatten(-1, (out, fan_in))
            hidden = hidden @ weight.mT
            hidden = hidden if layer == len(self.shapes) - 1 else torch.relu(hidden)
            start += out * fan_in
        return hidden

    def train_loss(self, theta: torch.Tensor, step: int) -> torch.Tensor:
        index = torch.stack([torch.randint(len(self.labels), (self.batch_size,), generator=g) for g in self.generators])
        logits = self.logits(theta, self.features[index])  # [R, S, B, 10]
        targets = self.labels[index].expand(theta.shape[0], -1, -1)
        cross_entropy = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), reduction="none").view(targets.shape).mean(-1)
        return cross_entropy + self.penalty(theta)

    def penalty(self, theta: torch.Tensor) -> torch.Tensor:
        """``l2/2·‖W‖²`` per row: ``[R, S]``."""
        return 0.5 * self.l2 * theta.square().sum(-1)

    @torch.no_grad()
    def metric(self, theta: torch.Tensor) -> torch.Tensor:
        losses = []
        for row in range(theta.shape[0]):  # one configuration at a time: [S, N, 10]
            logits = self.logits(theta[row : row + 1], self.features[None])[0]
            cross_entropy = F.cross_entropy(logits.flatten(0, 1), self.labels.repeat(theta.shape[1]), reduction="none")
            losses.append(cross_entropy.view(theta.shape[1], -1).mean(-1))
        return torch.stack(losses) + self.penalty(theta)


def train_batched(problem, optimizer: str, configs: Sequence[Config], seeds: Sequence[int], steps: int) -> torch.Tensor:
    """Train every configuration from every seed for ``steps`` steps as rows of one parameter; the metric ``[configs, seeds]``
    (``inf`` where a row diverged)."""
    count = len(seeds)
    theta = torch.stack([problem.initial(seed) for seed in seeds]).repeat(len(configs), 1).requires_grad_(True)  # [rows, P]
    quantize = Quantizer(configs, count, torch.Generator().manual_seed(7919 * steps + 1 + 104729 * len(configs)))
    lr = peak_lr(problem.adam_lr if optimizer == "adam" else problem.muon_lr, steps)
    if optimizer == "adam":
        opt = torch.optim.Adam([theta], lr=lr, betas=(BETA1, beta2_for(steps)), eps=1e-8, foreach=False)
        state_names = {"exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    else:
        opt = BatchedMuon([theta], problem.shapes, lr=lr)
        state_names = {"exp_avg": "momentum_buffer"}
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule(steps, problem.warmup))
    problem.begin(seeds)
    with torch.no_grad():
        quantize("weights", theta)
    for step in range(steps):
        loss = problem.train_loss(theta.view(len(configs), count, -1), step)
        (theta.grad,) = torch.autograd.grad(loss.sum(), theta)
        quantize("grads", theta.grad)
        opt.step()
        scheduler.step()
        with torch.no_grad():
            quantize("weights", theta)
            for component, name in state_names.items():
                quantize(component, opt.state[theta][name])
    with torch.no_grad():
        metric = problem.metric(theta.detach().view(len(configs), count, -1))
    return torch.nan_to_num(metric, nan=math.inf, posinf=math.inf)


# --------------------------------------------------------------------------------------------------------------------
# The GPT example (one configuration at a time)


@dataclass(frozen=True)
class GPTSetup:
    """The GPT's size, data and regime."""

    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 2
    seq_len: int = 64
    batch_size: int = 16
    val_windows: int = 64
    adam_lr: float = 2e-3  # at T_REF steps; fp32's best of 5e-4, 1e-3, 2e-3, 5e-3, 1e-2 at T=300
    muon_lr: float = 0.02
    warmup_fraction: float = 0.1

    @property
    def label(self) -> str:
        return (
            f"byte-level GPT-2 (random init; n_embd {self.n_embd}, {self.n_layer} layers, {self.n_head} heads), pydoc text, "
            f"seq {self.seq_len}, batch {self.batch_size}; metric: val loss on {self.val_windows} windows (nats/byte)"
        )


def train_gpt(setup: GPTSetup, optimizer: str, config: Config, seed: int, steps: int) -> float:
    """Train the GPT example with ``config``'s components quantized; the final validation loss (``inf`` if it diverged)."""
    from examples.gpt import GPTModule

    module = GPTModule(n_embd=setup.n_embd, n_layer=setup.n_layer, n_head=setup.n_head, n_positions=setup.seq_len, dropout=0.0, seed=seed)
    data = _gpt_data(setup.seq_len, setup.batch_size, setup.val_windows, seed)
    named = dict(module.named_parameters())
    hidden = [p for name, p in named.items() if p.ndim == 2 and ".h." in name] if optimizer == "muon" else []
    rest = [p for p in named.values() if all(p is not h for h in hidden)]
    generator = torch.Generator().manual_seed(seed + 1)
    optimizers: list[torch.optim.Optimizer] = [
        torch.optim.Adam(rest, lr=peak_lr(setup.adam_lr, steps), betas=(BETA1, beta2_for(steps)), eps=1e-8, foreach=False)
    ]
    if hidden:
        optimizers.append(torch.optim.Muon(hidden, lr=peak_lr(setup.muon_lr, steps), momentum=MUON_MOMENTUM, weight_decay=0.0))
    factor = schedule(steps, round(setup.warmup_fraction * steps))
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, factor) for opt in optimizers]

    def quantize(component: str, tensors: Iterator[torch.Tensor]) -> None:
        if config.quantizes(component):
            for tensor in tensors:
                quantize_mantissa_(tensor, config.mantissa, config.rounding, generator)

    def states(name: str) -> Iterator[torch.Tensor]:
        return (state[name] for opt in optimizers for state in opt.state.values() if name in state)

    params = list(named.values())
    with torch.no_grad():
        quantize("weights", iter(params))
    batches = _cycle(data.train_dataloader)
    for _ in range(steps):
        tokens, targets = next(batches)
        logits = module(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        if not torch.isfinite(loss):
            return math.inf
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        with torch.no_grad():
            quantize("grads", (p.grad for p in params if p.grad is not None))
            for opt, scheduler in zip(optimizers, schedulers, strict=True):
                opt.step()
                scheduler.step()
            quantize("weights", iter(params))
            quantize("exp_avg", (*states("exp_avg"), *states("momentum_buffer")))
            quantize("exp_avg_sq", states("exp_avg_sq"))
    module.eval()
    with torch.no_grad():
        losses = [F.cross_entropy(module(x).reshape(-1, 256), y.reshape(-1), reduction="sum") for x, y in data.val_dataloader()]
        count = sum(y.numel() for _, y in data.val_dataloader())
    value = float(torch.stack(losses).sum() / count)
    return value if math.isfinite(value) else math.inf


@functools.lru_cache(maxsize=4)
def _gpt_data(seq_len: int, batch_size: int, val_windows: int, seed: int):
    """The example's ``ByteTextDataModule``, set up once per seed (its loaders restart their seeded order on every call)."""
    from examples.data import ByteTextDataModule

    data = ByteTextDataModule(seq_len=seq_len, batch_size=batch_size, val_windows=val_windows, seed=seed)
    data.setup()
    return data


def _cycle(make_loader: Callable[[], torch.utils.data.DataLoader]) -> Iterator:
    while True:
        yield from make_loader()


# --------------------------------------------------------------------------------------------------------------------
# Results, thresholds, calibration


@dataclass
class Result:
    """One configuration of one (problem, optimizer, horizon): its metric per seed."""

    problem: str
    optimizer: str
    horizon: int
    component: str
    rounding: str | None
    mantissa: int | None  # None for fp32
    losses: list[float]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.losses) if all(math.isfinite(v) for v in self.losses) else math.inf


@dataclass
class Threshold:
    """The smallest ``M`` of the sweep from which on the seed-mean metric stays within tolerance of fp32's."""

    problem: str
    optimizer: str
    horizon: int
    component: str
    rounding: str
    mantissa: int | None  # None: even the largest M swept fails
    lowest_swept: int
    highest_swept: int

    def text(self) -> str:
        if self.mantissa is None:
            return f">{self.highest_swept}"
        return f"≤{self.mantissa}" if self.mantissa == self.lowest_swept else str(self.mantissa)


def mean_excess(losses: Sequence[float], reference: Sequence[float]) -> float:
    """The mean over seeds of ``loss − fp32`` (paired by seed); ``inf`` if a seed diverged."""
    if len(losses) != len(reference):
        raise ValueError(f"mean_excess: {len(losses)} losses against {len(reference)} fp32 values; pair them by seed")
    if not all(math.isfinite(value) for value in losses):
        return math.inf
    return statistics.fmean(loss - ref for loss, ref in zip(losses, reference, strict=True))


def noise_floors(results: Sequence[Result]) -> dict[tuple[str, str, int], float]:
    """Per (problem, optimizer, horizon): the standard error of a seed-mean excess over fp32 that the run's chaos alone
    gives. At the largest ``M`` swept every configuration is fp32 perturbed by at most ``2^-(M+1)`` relative; the
    variance over seeds of its per-seed excess, pooled over the components, over the number of seeds. 0 with one seed."""
    fp32 = {(r.problem, r.optimizer, r.horizon): r.losses for r in results if r.component == "fp32"}
    highest: dict[tuple[str, str, int], int] = {}
    for r in results:
        if r.mantissa is not None:
            key = (r.problem, r.optimizer, r.horizon)
            highest[key] = max(highest.get(key, r.mantissa), r.mantissa)
    variances: dict[tuple[str, str, int], list[float]] = {}
    for r in results:
        key = (r.problem, r.optimizer, r.horizon)
        if r.mantissa is None or r.mantissa != highest[key] or len(r.losses) < 2 or not all(map(math.isfinite, r.losses)):
            continue
        variances.setdefault(key, []).append(statistics.variance([a - b for a, b in zip(r.losses, fp32[key], strict=True)]))
    return {key: math.sqrt(statistics.fmean(variances[key]) / len(fp32[key])) if key in variances else 0.0 for key in fp32}


def thresholds_of(results: Sequence[Result], tolerances: dict[str, Tolerance]) -> list[Threshold]:
    """Every (problem, optimizer, horizon, component, rounding)'s threshold."""
    noise = noise_floors(results)
    fp32 = {(r.problem, r.optimizer, r.horizon): r.losses for r in results if r.component == "fp32"}
    curves: dict[tuple, dict[int, list[float]]] = {}
    for r in results:
        if r.component != "fp32":
            curves.setdefault((r.problem, r.optimizer, r.horizon, r.component, r.rounding), {})[r.mantissa] = r.losses
    found = []
    for (problem, optimizer, horizon, component, rounding), curve in curves.items():
        reference, tolerance = fp32[problem, optimizer, horizon], tolerances[problem]
        passing = None
        for mantissa in sorted(curve, reverse=True):
            if not tolerance.within(curve[mantissa], reference, noise[problem, optimizer, horizon]):
                break
            passing = mantissa
        found.append(Threshold(problem, optimizer, horizon, component, rounding, passing, min(curve), max(curve)))
    return found


def lookup(thresholds: Sequence[Threshold], **key) -> Threshold | None:
    return next((t for t in thresholds if all(getattr(t, name) == value for name, value in key.items())), None)


@dataclass
class Calibration:
    """``c`` of ``M = slope·log2 T + c`` for one (optimizer, component, rounding), from one measured threshold."""

    optimizer: str
    component: str
    rounding: str
    slope: float
    constant: float | None  # None: the threshold was above the sweep
    censored: str  # "", "upper bound" (threshold at the lowest M swept: it may need fewer) or "lower bound"


def calibrate(thresholds: Sequence[Threshold], problems: Sequence[str], horizon: int) -> list[Calibration]:
    """``c = threshold − slope·log2 horizon`` per (optimizer, component, rounding), from the largest threshold of
    ``problems`` at ``horizon`` (one problem: its own)."""
    worst: dict[tuple[str, str, str], Threshold] = {}
    for t in thresholds:
        if t.problem not in problems or t.horizon != horizon or t.component == "all":
            continue
        key = (t.optimizer, t.component, t.rounding)
        if key not in worst or _needed(t) > _needed(worst[key]):
            worst[key] = t
    calibrations = []
    for (optimizer, component, rounding), t in worst.items():
        slope = SLOPES[optimizer, component]
        if t.mantissa is None:
            calibrations.append(Calibration(optimizer, component, rounding, slope, None, "lower bound"))
            continue
        censored = "upper bound" if t.mantissa == t.lowest_swept else ""
        calibrations.append(Calibration(optimizer, component, rounding, slope, round(t.mantissa - slope * math.log2(horizon), 2), censored))
    return calibrations


@dataclass
class Prediction:
    problem: str
    optimizer: str
    component: str
    rounding: str
    horizon: int
    predicted: float | None
    measured: str
    verdict: str  # PASS, FAIL, or NOT RESOLVED (a censored threshold or constant)


def predictions_of(thresholds: Sequence[Threshold], calibrations: Sequence[Calibration]) -> list[Prediction]:
    """The advisor's prediction, with the calibrated constant, against every measured threshold of the same
    (optimizer, component, rounding), every problem and horizon.

    PASS: within ±1 bit of the threshold; a threshold ``≤ lowest`` accepts any prediction up to ``lowest + 1``, one
    ``> highest`` any from ``highest`` on. A FAIL from a censored constant is NOT RESOLVED."""
    constants = {(c.optimizer, c.component, c.rounding): c for c in calibrations}
    found = []
    for t in thresholds:
        calibration = constants.get((t.optimizer, t.component, t.rounding))
        if calibration is None:
            continue
        if calibration.constant is None:
            found.append(Prediction(t.problem, t.optimizer, t.component, t.rounding, t.horizon, None, t.text(), "NOT RESOLVED"))
            continue
        predicted = required_mantissa_bits(t.component, t.horizon, t.optimizer, t.rounding, constant=calibration.constant)
        if t.mantissa is None:
            ok = predicted >= t.highest_swept + 1 - PREDICTION_SLACK
        elif t.mantissa == t.lowest_swept:
            ok = predicted <= t.lowest_swept + PREDICTION_SLACK
        else:
            ok = abs(predicted - t.mantissa) <= PREDICTION_SLACK
        verdict = "PASS" if ok else ("NOT RESOLVED" if calibration.censored else "FAIL")
        found.append(Prediction(t.problem, t.optimizer, t.component, t.rounding, t.horizon, round(predicted, 2), t.text(), verdict))
    return found


def log_t_slope(thresholds: Sequence[Threshold], problem: str, optimizer: str, component: str, rounding: str) -> float | None:
    """Least-squares slope of the measured thresholds in ``log2 T`` (uncensored ones only; None under two)."""
    points = [
        (math.log2(t.horizon), t.mantissa)
        for t in thresholds
        if (t.problem, t.optimizer, t.component, t.rounding) == (problem, optimizer, component, rounding)
        and t.mantissa not in (None, t.lowest_swept)
    ]
    if len({x for x, _ in points}) < 2:
        return None
    mean_x, mean_y = statistics.fmean(x for x, _ in points), statistics.fmean(y for _, y in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / sum((x - mean_x) ** 2 for x, _ in points)


# --------------------------------------------------------------------------------------------------------------------
# Report


@dataclass
class Sweep:
    """Everything one invocation measured."""

    results: list[Result] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


def paper_targets(thresholds: Sequence[Threshold], results: Sequence[Result], predictions: Sequence[Prediction], args) -> list[str]:
    """The issue's targets, each with its verdict, on the paper's rounding (stochastic)."""
    lines = []
    by_key = {(r.problem, r.optimizer, r.horizon, r.component, r.rounding, r.mantissa): r for r in results}
    noise = noise_floors(results)
    fp32 = {(r.problem, r.optimizer, r.horizon): r for r in results if r.component == "fp32"}
    for problem in args.problems:
        horizons = [args.gpt_steps] if problem == "gpt" else args.horizons
        tolerance = TOLERANCES[problem]
        for horizon in horizons:
            where = f"{problem}, T={horizon}"
            adam = lookup(thresholds, problem=problem, optimizer="adam", horizon=horizon, component="all", rounding="stochastic")
            if adam is not None:
                ok = adam.mantissa is not None and adam.mantissa <= PAPER["adam_ok_from"]
                lines.append(
                    f"- Adam ≈ fp32 at M ≥ 7 (all components, SR), {where}: threshold {adam.text()}: **{'PASS' if ok else 'FAIL'}**"
                )
                low = [by_key[key] for m in (1, 2) if (key := (problem, "adam", horizon, "all", "stochastic", m)) in by_key]
                if low:
                    reference = fp32[problem, "adam", horizon]
                    fails = all(not tolerance.within(r.losses, reference.losses, noise[problem, "adam", horizon]) for r in low)
                    shown = ", ".join(f"M={r.mantissa}: {_loss(r.mean)}" for r in low)
                    lines.append(
                        f"- Adam fails at M ≤ 2 (all, SR), {where}: {shown} vs fp32 {_loss(reference.mean)}: "
                        f"**{'PASS' if fails else 'FAIL'}**"
                    )
            muon = lookup(thresholds, problem=problem, optimizer="muon", horizon=horizon, component="all", rounding="stochastic")
            if muon is not None:
                ok = muon.mantissa is not None and muon.mantissa <= PAPER["muon_ok_from"]
                lines.append(
                    f"- Muon ≈ fp32 at M ≥ 3 (all components, SR), {where}: threshold {muon.text()}: **{'PASS' if ok else 'FAIL'}**"
                )
            single = {
                c: lookup(thresholds, problem=problem, optimizer="adam", horizon=horizon, component=c, rounding="stochastic")
                for c in COMPONENTS
            }
            if all(t is not None for t in single.values()):
                need = {c: _needed(t) for c, t in single.items()}
                tied = max(need.values()) == min(need.values())  # every component needs the same: no ranking
                most = "NOT RESOLVED" if tied else ("PASS" if need["exp_avg_sq"] == max(need.values()) else "FAIL")
                least = "NOT RESOLVED" if tied else ("PASS" if need["grads"] == min(need.values()) else "FAIL")
                order = ", ".join(f"{c} {single[c].text()}" for c in sorted(COMPONENTS, key=lambda c: -need[c]))
                lines.append(f"- Adam: v most sensitive (SR), {where} ({order}): **{most}**")
                lines.append(f"- Adam: gradients least sensitive (SR), {where}: **{least}**")
    held_out = [p for p in predictions if p.problem == CALIBRATION_PROBLEM and p.horizon != args.calibration_horizon]
    if held_out:
        counts = {verdict: sum(p.verdict == verdict for p in held_out) for verdict in ("PASS", "FAIL", "NOT RESOLVED")}
        overall = "PASS" if counts["FAIL"] == 0 and counts["PASS"] else ("FAIL" if counts["FAIL"] else "NOT RESOLVED")
        lines.append(
            f"- advisor's prediction within ±1 bit on the held-out horizons ({CALIBRATION_PROBLEM}, T ≠ {args.calibration_horizon}; "
            f"{len(held_out)} thresholds): {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['NOT RESOLVED']} NOT RESOLVED: "
            f"**{overall}**"
        )
    return lines


def _needed(t: Threshold) -> float:
    """A threshold as a number for ranking: ``> highest`` ranks above every measured one."""
    return t.highest_swept + 1 if t.mantissa is None else t.mantissa


def _loss(value: float) -> str:
    return "diverged" if not math.isfinite(value) else (f"{value:.3g}" if abs(value) < 1e-3 else f"{value:.4f}")


def curve_tables(results: Sequence[Result], args) -> list[str]:
    """Seed-mean metric per M for every (problem, optimizer, horizon): rows components × rounding, columns M."""
    lines, noise = [], noise_floors(results)
    keys = list(dict.fromkeys((r.problem, r.optimizer, r.horizon) for r in results))
    for problem, optimizer, horizon in keys:
        rows = [r for r in results if (r.problem, r.optimizer, r.horizon) == (problem, optimizer, horizon)]
        reference = next(r for r in rows if r.component == "fp32")
        mantissas = sorted({r.mantissa for r in rows if r.mantissa is not None})
        tolerance, floor = TOLERANCES[problem], noise[problem, optimizer, horizon]
        lines += [
            f"#### {problem}, {optimizer}, T={horizon}: fp32 {_loss(reference.mean)} "
            f"(seeds: {', '.join(_loss(v) for v in reference.losses)}); noise floor {_loss(floor)}, "
            f"largest excess counted as fp32 {_loss(tolerance.limit(reference.losses, floor))}",
            "",
            "| component | rounding | " + " | ".join(f"M={m}" for m in mantissas) + " |",
            "|---|---|" + "---|" * len(mantissas),
        ]
        for component, rounding in dict.fromkeys((r.component, r.rounding) for r in rows if r.component != "fp32"):
            by_m = {r.mantissa: r for r in rows if (r.component, r.rounding) == (component, rounding)}
            cells = [
                (_loss(by_m[m].mean) + ("" if tolerance.within(by_m[m].losses, reference.losses, floor) else " ✗")) if m in by_m else "–"
                for m in mantissas
            ]
            lines.append(f"| {component} | {_short(rounding)} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _short(rounding: str | None) -> str:
    return {"nearest": "RN", "stochastic": "SR"}.get(rounding or "", "–")


def threshold_table(thresholds: Sequence[Threshold], predictions: Sequence[Prediction], args) -> list[str]:
    """Per (optimizer, component, rounding): the measured threshold of every problem and horizon, the prediction, the paper."""
    columns = [(p, h) for p in args.problems for h in ([args.gpt_steps] if p == "gpt" else args.horizons)]
    present = [(p, h) for p, h in columns if any(t.problem == p and t.horizon == h for t in thresholds)]
    lines = [
        "| optimizer | component | rounding | "
        + " | ".join(f"{p} T={h}" for p, h in present)
        + " | advisor (digits-calibrated) | log2 T slope: law / measured (digits) | paper |",
        "|---|---|---|" + "---|" * len(present) + "---|---|---|",
    ]
    predicted = {(p.problem, p.optimizer, p.component, p.rounding, p.horizon): p for p in predictions}
    for optimizer in args.optimizers:
        for component in SWEPT if optimizer == "adam" else MUON_SWEPT:
            for rounding in ROUNDINGS:
                cells = []
                for problem, horizon in present:
                    t = lookup(thresholds, problem=problem, optimizer=optimizer, horizon=horizon, component=component, rounding=rounding)
                    cells.append("–" if t is None else t.text())
                if all(cell == "–" for cell in cells):
                    continue
                advice = []
                for problem, horizon in present:
                    p = predicted.get((problem, optimizer, component, rounding, horizon))
                    if p is not None and p.problem == CALIBRATION_PROBLEM and p.predicted is not None:
                        advice.append(f"T={horizon}: {p.predicted:g} ({p.verdict if horizon != args.calibration_horizon else 'fit'})")
                slope = SLOPES.get((optimizer, component))
                measured = log_t_slope(thresholds, CALIBRATION_PROBLEM, optimizer, component, rounding)
                slope_cell = "–" if slope is None else f"{slope:g} / " + ("n/a" if measured is None else f"{measured:.2f}")
                lines.append(
                    f"| {optimizer} | {component} | {_short(rounding)} | "
                    + " | ".join(cells)
                    + f" | {'; '.join(advice) or '–'} | {slope_cell} | "
                    f"{_paper_cell(optimizer, component)} |"
                )
    return lines


def _paper_cell(optimizer: str, component: str) -> str:
    if optimizer == "muon":
        return "≈ fp32 at M ≥ 3 (all)" if component == "all" else "½·log2 T + c"
    return {
        "all": "≈ fp32 at M ≥ 7, fails at M ≤ 2",
        "exp_avg_sq": "most sensitive; 2·log2 T + c",
        "weights": "second; 2·log2 T + c",
        "exp_avg": "third; log2 T + c",
        "grads": "least; log2 T + c",
    }[component]


def constants_literal(calibrations: Sequence[Calibration], name: str = "DEFAULT_CONSTANTS") -> list[str]:
    lines = [f"{name} = {{"]
    for c in calibrations:
        note = f"  # {c.censored}" if c.censored else ""
        value = "None" if c.constant is None else f"{c.constant:.2f}"
        lines.append(f'    ("{c.optimizer}", "{c.component}", "{c.rounding}"): {value},{note}')
    return lines + ["}"]


def settings_lines(args) -> list[str]:
    lines = []
    for name in args.problems:
        if name == "gpt":
            setup = args.gpt_setup
            lines.append(
                f"- gpt: {setup.label}; T={args.gpt_steps}; Adam η {peak_lr(setup.adam_lr, args.gpt_steps):.3g}, Muon η "
                f"{peak_lr(setup.muon_lr, args.gpt_steps):.3g} (its matrices; Adam on the rest), warmup {setup.warmup_fraction:.0%} "
                f"then cosine to 0; β2 {beta2_for(args.gpt_steps):.4f}; M {', '.join(map(str, args.gpt_mantissas))}, SR; seed 0; "
                "Adam: all, exp_avg_sq; Muon: all (its momentum and the Adam side's m and v too); "
                f"tolerance {TOLERANCES[name].text()}"
            )
            continue
        problem = DigitsMLP(**args.digits_options) if name == "digits" else Rosenbrock()
        lines.append(
            f"- {name}: {problem.label}; η at T=1000: Adam {problem.adam_lr:g}, Muon {problem.muon_lr:g} (× sqrt(1000/T)), cosine to 0; "
            f"tolerance {TOLERANCES[name].text()}"
        )
    return lines


def report(args, sweep: Sweep, argv: Sequence[str], seconds: float) -> tuple[str, dict]:
    command = "python benchmarks/mantissa_sweep.py" + ("" if not argv else " " + shlex.join(argv))
    results = sweep.results
    thresholds = thresholds_of(results, TOLERANCES)
    calibrations = calibrate(thresholds, [CALIBRATION_PROBLEM], args.calibration_horizon)
    batched = [p for p in args.problems if p != "gpt"]
    conservative = calibrate(thresholds, batched, args.calibration_horizon)
    predictions = predictions_of(thresholds, calibrations)
    targets = paper_targets(thresholds, results, predictions, args)
    date = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
    import sklearn

    versions = f"python {platform.python_version()}, torch {torch.__version__}, scikit-learn {sklearn.__version__}"
    if "gpt" in args.problems:
        import transformers

        versions += f", transformers {transformers.__version__}"
    machine = f"{platform.machine()}, {platform.system()}, CPUs {os.cpu_count()}, torch threads {torch.get_num_threads()}"
    betas = ", ".join(f"T={h}: {beta2_for(h):.4f}" for h in args.horizons)
    held_out = [p for p in predictions if p.problem != CALIBRATION_PROBLEM or p.horizon != args.calibration_horizon]
    lines = [
        "# Mantissa bits per component: a sweep against fp32, and the precision advisor's law",
        "",
        f"- command: `{command}`",
        f"- date: {date}; runtime {seconds:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in sweep.seconds.items())})",
        f"- versions: {versions}",
        f"- machine: {machine}; runtimes are wall-clock (the machine may have been shared)",
        f"- quantization: fp32 bit patterns rounded to M mantissa bits with fp32's 8-bit exponent (range never the limit); "
        f"RN = to nearest even, SR = stochastic; components: grads (before the step), weights (after it, and at init), "
        f"exp_avg (Adam's m, Muon's momentum), exp_avg_sq (Adam's v), all; M in {', '.join(map(str, args.mantissas))}",
        f"- regime (the paper's): η ∝ 1/sqrt(T), 1 − β2 = {BETA2_WINDOW:g}/T (β2 {betas}), β1 {BETA1}, Muon momentum "
        f"{MUON_MOMENTUM} (Nesterov), no weight decay; cosine decay of η to 0; horizons {', '.join(map(str, args.horizons))}; "
        f"seeds 0..{args.seeds - 1} (initialisation, data order, rounding stream); means over the seeds",
        "- Muon on Rosenbrock and the digits: torch's update batched over the configurations (`BatchedMuon`), Newton–Schulz in "
        "fp32 (torch's runs it in bf16; the test checks the two agree); the GPT uses torch's `Muon` itself (bf16 Newton–Schulz)",
        *settings_lines(args),
        "- threshold: the smallest M such that it and every larger M swept stay within tolerance of fp32: the mean per-seed "
        f"excess over fp32 (paired by seed) at most the tolerance plus {NOISE_SIGMAS:g}× the run's noise floor (the standard "
        "error of a seed mean at the largest M swept, a 2^-11 perturbation, pooled over the components; 0 with one seed); "
        "`≤1`: every M passes; `>10`: even the largest fails. ✗ in the curves: outside the tolerance",
        f"- advisor: `required_mantissa_bits(component, T, optimizer, rounding, constant=c)` from "
        f"`lightning_qstate.theory.precision` (M = slope·log2 T + c), c fitted per (optimizer, component, rounding) on "
        f"{CALIBRATION_PROBLEM} T={args.calibration_horizon} and checked on the other horizons (PASS: within ±1 bit)",
        "",
        "## Targets (the paper's findings, SR; and the advisor)",
        "",
        *targets,
        "",
        "## Thresholds: measured, the advisor's prediction, the paper",
        "",
        *threshold_table(thresholds, predictions, args),
        "",
        f"Measured log2 T slope: least squares of the digits' thresholds over the horizons (uncensored ones only); the law's "
        f"slopes are the paper's. Constants calibrated on {CALIBRATION_PROBLEM} at T={args.calibration_horizon} "
        "(`upper bound`: the threshold was the lowest M swept, so the component may need even fewer bits; `None`: above the sweep):",
        "",
        "```python",
        *constants_literal(calibrations),
        "```",
        "",
        f"Conservative constants: the same fit on the largest threshold of {', '.join(batched)} at T={args.calibration_horizon} "
        "(not checked on the held-out horizons; an advisor that must not under-advise on either problem):",
        "",
        "```python",
        *constants_literal(conservative, name="CONSERVATIVE_CONSTANTS"),
        "```",
        "",
        "The same constants on the other problems (transfer, not the target):",
        "",
        "| problem | optimizer | component | rounding | T | predicted | measured | within ±1 |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {p.problem} | {p.optimizer} | {p.component} | {_short(p.rounding)} | {p.horizon} | "
            f"{'–' if p.predicted is None else f'{p.predicted:g}'} | {p.measured} | {p.verdict} |"
            for p in held_out
        ),
        "",
        "## Final metric vs M (seed means)",
        "",
        *curve_tables(results, args),
    ]
    data = {
        "command": command,
        "date": date,
        "versions": versions,
        "machine": machine,
        "seconds": {"total": seconds, **sweep.seconds},
        "settings": {
            "horizons": list(args.horizons),
            "mantissas": list(args.mantissas),
            "seeds": args.seeds,
            "gpt_steps": args.gpt_steps,
            "gpt_mantissas": list(args.gpt_mantissas),
            "beta2_window": BETA2_WINDOW,
            "tolerances": {name: asdict(t) for name, t in TOLERANCES.items()},
            "calibration": {"problem": CALIBRATION_PROBLEM, "horizon": args.calibration_horizon},
        },
        "results": [asdict(r) | {"mean": r.mean} for r in results],
        "thresholds": [asdict(t) for t in thresholds],
        "calibration": [asdict(c) for c in calibrations],
        "conservative_calibration": [asdict(c) for c in conservative],
        "predictions": [asdict(p) for p in predictions],
        "targets": targets,
    }
    return "\n".join(lines), data


def plot(results: Sequence[Result], path: Path, args) -> None:
    """Final metric vs M per component, one panel per (problem, optimizer), at the calibration horizon (the GPT at its one);
    diverged runs and exact zeros are left out of the log-scale curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(p, o) for p in args.problems for o in args.optimizers if any(r.problem == p and r.optimizer == o for r in results)]
    figure, axes = plt.subplots(
        len(args.problems), len(args.optimizers), figsize=(6 * len(args.optimizers), 3.6 * len(args.problems)), squeeze=False
    )
    colours = dict(zip(SWEPT, ("tab:green", "tab:orange", "tab:blue", "tab:red", "black"), strict=True))
    for row, problem in enumerate(args.problems):
        for column, optimizer in enumerate(args.optimizers):
            axis = axes[row][column]
            if (problem, optimizer) not in panels:
                axis.set_visible(False)
                continue
            horizons = sorted({r.horizon for r in results if r.problem == problem and r.optimizer == optimizer})
            horizon = args.calibration_horizon if args.calibration_horizon in horizons else horizons[-1]
            rows = [r for r in results if (r.problem, r.optimizer, r.horizon) == (problem, optimizer, horizon)]
            reference = next(r.mean for r in rows if r.component == "fp32")
            for component, rounding in dict.fromkeys((r.component, r.rounding) for r in rows if r.component != "fp32"):
                curve = sorted((r.mantissa, r.mean) for r in rows if (r.component, r.rounding) == (component, rounding))
                finite = [(m, v) for m, v in curve if math.isfinite(v) and v > 0]  # log axis: diverged and exact 0 left out
                if finite:
                    axis.plot(
                        *zip(*finite, strict=True), marker="o", markersize=3, color=colours[component],
                        linestyle="-" if rounding == "stochastic" else "--", label=f"{component} {_short(rounding)}",
                    )  # fmt: skip
            axis.axhline(reference, color="grey", linewidth=1, linestyle=":", label="fp32")
            axis.set_yscale("log")
            axis.set_xlabel("mantissa bits M")
            axis.set_ylabel("final metric (seed mean)")
            axis.set_title(f"{problem}, {optimizer}, T={horizon}")
            axis.legend(fontsize=6, ncol=2)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


# --------------------------------------------------------------------------------------------------------------------
# Running


def run(args) -> Sweep:
    sweep = Sweep()
    for name in args.problems:
        start = time.perf_counter()
        if name == "gpt":
            for optimizer in args.optimizers:
                configs = sweep_configs(GPT_SWEPT[optimizer], args.gpt_mantissas, ("stochastic",))
                for config in configs:
                    loss = train_gpt(args.gpt_setup, optimizer, config, 0, args.gpt_steps)
                    sweep.results.append(_result(name, optimizer, args.gpt_steps, config, [loss]))
                    print(f"gpt {optimizer} {config.key}: {_loss(loss)}", flush=True)
        else:
            problem = Rosenbrock() if name == "rosenbrock" else DigitsMLP(**args.digits_options)
            seeds = list(range(args.seeds))
            for optimizer in args.optimizers:
                configs = sweep_configs(SWEPT if optimizer == "adam" else MUON_SWEPT, args.mantissas, ROUNDINGS)
                for horizon in args.horizons:
                    begun = time.perf_counter()
                    metric = train_batched(problem, optimizer, configs, seeds, horizon)
                    for config, losses in zip(configs, metric.tolist(), strict=True):
                        sweep.results.append(_result(name, optimizer, horizon, config, losses))
                    seconds = time.perf_counter() - begun
                    print(
                        f"{name} {optimizer} T={horizon}: {len(configs)} configurations x {len(seeds)} seeds, {seconds:.0f} s", flush=True
                    )
        sweep.seconds[name] = time.perf_counter() - start
    return sweep


def _result(problem: str, optimizer: str, horizon: int, config: Config, losses: list[float]) -> Result:
    fp32 = config.component == "fp32"
    return Result(
        problem, optimizer, horizon, config.component, None if fp32 else config.rounding, None if fp32 else config.mantissa, losses
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny problems, a few steps (a smoke test)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the markdown report; the .json and .png go next to it")
    parser.add_argument("--problems", default=",".join(PROBLEMS), help=f"comma-separated, of {', '.join(PROBLEMS)}")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS), help=f"comma-separated, of {', '.join(OPTIMIZERS)}")
    parser.add_argument(
        "--horizons", type=int, nargs="+", default=None, help=f"steps T of Rosenbrock and the digits (default {DEFAULT_HORIZONS})"
    )
    parser.add_argument("--mantissas", type=int, nargs="+", default=None, help="M swept (default 1..10)")
    parser.add_argument("--seeds", type=positive_int, default=None, help=f"seeds 0..N-1 (default {DEFAULT_SEEDS})")
    parser.add_argument("--gpt-steps", type=positive_int, default=None, help=f"the GPT's one horizon (default {DEFAULT_GPT_STEPS})")
    parser.add_argument(
        "--calibration-horizon",
        type=int,
        default=None,
        help=f"the {CALIBRATION_PROBLEM} horizon the constants are fitted on (default {CALIBRATION_HORIZON})",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1: the tensors are small, and more threads stall on a busy machine)"
    )
    args = parser.parse_args(argv)
    for option, valid in (("problems", PROBLEMS), ("optimizers", OPTIMIZERS)):
        names = [item.strip() for item in getattr(args, option).split(",") if item.strip()]
        wrong = [item for item in names if item not in valid]
        if wrong or not names:
            parser.error(f"--{option} {getattr(args, option)!r}: use a comma-separated list of {', '.join(valid)}")
        setattr(args, option, [item for item in valid if item in names])
    args.horizons = tuple(args.horizons or ((10, 20) if args.quick else DEFAULT_HORIZONS))
    args.mantissas = tuple(sorted(set(args.mantissas or ((1, 4, 10) if args.quick else DEFAULT_MANTISSAS))))
    args.seeds = args.seeds or (2 if args.quick else DEFAULT_SEEDS)
    args.gpt_steps = args.gpt_steps or (3 if args.quick else DEFAULT_GPT_STEPS)
    if any(h < 2 for h in args.horizons) or args.gpt_steps < 2 or args.seeds < 1 or args.threads < 1:
        parser.error("--horizons and --gpt-steps must be >= 2, --seeds and --threads >= 1")
    if any(not 1 <= m <= FP32_MANTISSA - 1 for m in args.mantissas):
        parser.error(f"--mantissas: each M must lie in [1, {FP32_MANTISSA - 1}]")
    args.calibration_horizon = args.calibration_horizon or (args.horizons[-1] if args.quick else CALIBRATION_HORIZON)
    if CALIBRATION_PROBLEM in args.problems and args.calibration_horizon not in args.horizons:
        parser.error(f"--calibration-horizon {args.calibration_horizon} must be one of --horizons {list(args.horizons)}")
    args.gpt_mantissas = (args.mantissas[0], args.mantissas[-1]) if args.quick else GPT_MANTISSAS
    args.gpt_setup = GPTSetup(n_embd=32, n_layer=1, n_head=2, seq_len=32, batch_size=4, val_windows=4) if args.quick else GPTSetup()
    args.digits_options = {"widths": (64, 16, 10), "batch_size": 32} if args.quick else {}
    return args


def main(argv: Sequence[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    start = time.perf_counter()
    sweep = run(args)
    text, data = report(args, sweep, argv, time.perf_counter() - start)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    args.out.with_suffix(".json").write_text(json.dumps(_json_ready(data), indent=1, allow_nan=False) + "\n")
    plot(sweep.results, args.out.with_suffix(".png"), args)
    print(text)
    return text


def _json_ready(value):
    """``value`` with non-finite floats as the strings ``"inf"``/``"nan"`` (strict JSON has no infinities)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _json_ready(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(item) for item in value]
    return value


if __name__ == "__main__":
    main()
