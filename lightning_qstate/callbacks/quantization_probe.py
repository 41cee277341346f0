"""Measure, at the end of validation, how well the model being trained would survive post-training quantization (PTQ),
and why (arXiv 2509.23500; ``docs/algorithms.md``, "Quantization-robustness probe")."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from lightning_utilities.core.apply_func import apply_to_collection
from typing_extensions import override

from ..arguments import ConfigurationError, check_flags, is_positive_int
from ..formats.weights import WeightBlock, check_weight_block
from ..probes import ABCResult, ABCRow, abc_decomposition, default_units, linear_input_statistics, linear_modules, probe_grid, ptq
from ..probes.abc import gain
from ..probes.metrics import evaluating
from ..probes.ptq import parametrized_weights, weight_input_dim
from .tensorboard import write_layout

PROBE_TAG = "qstate/probe"  # scalars "<tag>/<figure>", images "<tag>/abc"


@dataclass(frozen=True)
class ProbeResult:
    """One probe, averaged over the fixed batches: the losses (the module's own, e.g. nats per token), PTQ's increase,
    ``R_L``, the outlier metrics of the linear layers' inputs (means over layers), the ABC rows and the seconds taken."""

    step: int
    loss: float
    ptq_loss: float
    R_L: float  # noqa: N815 - the paper's name
    mmr: float
    kurtosis: float
    kurtosis_channel_rms: float
    abc: ABCResult
    seconds: float

    @property
    def ptq_loss_increase(self) -> float:
        return self.ptq_loss - self.loss

    def metrics(self) -> dict[str, float]:
        """The logged scalars, ``qstate/probe/<name>``."""
        figures = {
            "loss": self.loss,
            "ptq_loss": self.ptq_loss,
            "ptq_loss_increase": self.ptq_loss_increase,
            "R_L": self.R_L,
            "mmr": self.mmr,
            "kurtosis": self.kurtosis,
            "kurtosis_channel_rms": self.kurtosis_channel_rms,
            "seconds": self.seconds,
        }
        return {f"{PROBE_TAG}/{name}": value for name, value in figures.items()}


class QuantizationProbe(Callback):
    """How quantizable the model is while it trains: PTQ loss, the ABC error decomposition and outlier metrics.

    At the end of every ``every_n_val_epochs``-th validation run (sanity checks excluded), on the first ``batches``
    batches of the first validation dataloader (captured at the first validation and reused, so every probe sees the
    same data), in eval mode and without gradients:

    - the loss, and the loss under PTQ (:func:`~lightning_qstate.probes.ptq` with ``weights`` and ``activations``,
      default W4A4 on every linear layer, symmetric absmax per output channel and per token, as the paper);
    - the ABC decomposition (:func:`~lightning_qstate.probes.abc_decomposition`): ``R_L``, and per unit (transformer
      block) and linear layer R, A, B, C and the gain G;
    - MMR and kurtosis of every linear layer's input (:func:`~lightning_qstate.probes.linear_input_statistics`).

    Each figure is averaged over the ranks (each probes its own batches) and logged with ``pl_module.log``:
    ``qstate/probe/loss``, ``ptq_loss``, ``ptq_loss_increase``, ``R_L``, ``mmr``, ``kurtosis``, ``kurtosis_channel_rms``
    and ``seconds`` (the probe's cost: it runs after validation, off the training path; about ``2 + 2·(units + layers)``
    forwards per batch). With ``log_images``, rank 0 adds to every TensorBoard logger a figure ``qstate/probe/abc``: A,
    B and C stacked per unit and layer, R marked, and the gain G below. Each result (the same on every rank: what was
    logged) is kept in :attr:`history`. The count of validations is checkpointed under the class name, so a resumed run
    probes at the same validations, and a Trainer takes one instance (Lightning refuses a second); for another recipe
    on the same model call :func:`~lightning_qstate.probes.ptq` or :meth:`probe` yourself.

    **Loss.** By default the module's own ``validation_step`` on the batch, with its ``self.log`` calls caught (nothing
    reaches the loggers): the value logged as ``loss_key`` (default ``"val_loss"``), else a returned scalar or a
    ``"loss"`` entry. ``validation_step`` runs several times per probed batch (the plain loss, the loss under PTQ, the ABC
    decomposition's and the input statistics' forwards), so its other side effects (a metric it updates, losses it
    collects for the epoch) happen that many times more; pass ``loss_fn(pl_module, batch) -> scalar tensor`` to avoid
    them. The forwards run in the Trainer's validation precision (autocast under ``"bf16-mixed"``/``"16-mixed"``).

    **Strategies.** Single device and DDP (each rank probes its own batches). Sharded strategies (FSDP, FSDP2) are
    refused at fit start: the probe runs the unwrapped module.

    Example::

        trainer = Trainer(callbacks=[QuantizationProbe()], logger=TensorBoardLogger("runs"))  # W4A4 after each validation
        trainer.fit(GPTModule(), data)
        trainer.callbacks[0].history[-1].R_L

    Args:
        every_n_val_epochs: probe after every n-th validation run.
        weights, activations: PTQ formats (:mod:`lightning_qstate.probes.fake_quant`: ``"int4"``, ``"int8"``,
            ``"fp8_e4m3"``, any ``eXmY``...) or ``None`` for that side unquantized (e.g. W4A16: ``activations=None``).
        batches: validation batches per probe.
        loss_fn: ``loss_fn(pl_module, batch)``, a scalar tensor; default the module's ``validation_step`` (above).
        loss_key: the name ``validation_step`` logs its loss under (default ``"val_loss"``; not with ``loss_fn``).
        units: the ABC decomposition's chain of module names, or one name (default: transformer blocks, or a ``Sequential``'s
            children; a module with neither is refused at fit start).
        modules: ``fnmatch`` patterns of the linear layers to quantize and measure (default: all).
        block: scale groups (``"row"``, ``"tensor"`` or a power of two); per_token: the ABC's per-token estimator.
        log_images: add the ABC figure to TensorBoard loggers (needs matplotlib).
        verbose: print a line per probe on rank 0.

    Raises:
        ValueError: invalid arguments at construction; at fit start, ``modules`` or ``units`` that match nothing in the
            module, a ``block`` that does not divide a selected layer's input features, or a sharded strategy; at a
            probe, a loss that cannot be found.
    """

    def __init__(
        self,
        every_n_val_epochs: int = 1,
        weights: str | None = "int4",
        activations: str | None = "int4",
        batches: int = 1,
        *,
        loss_fn: Callable[[pl.LightningModule, Any], torch.Tensor] | None = None,
        loss_key: str | None = None,
        units: Iterable[str] | None = None,
        modules: Iterable[str] | None = None,
        block: WeightBlock = "row",
        per_token: bool = False,
        log_images: bool = True,
        verbose: bool = False,
    ) -> None:
        for name, value in (("every_n_val_epochs", every_n_val_epochs), ("batches", batches)):
            if not is_positive_int(value):
                raise ValueError(f"QuantizationProbe: {name}={value!r} must be a positive int")
        if weights is None and activations is None:
            raise ValueError("QuantizationProbe: weights=None and activations=None quantize nothing; give at least one format")
        try:
            check_weight_block(block, "block")
        except ValueError as error:
            raise ValueError(f"QuantizationProbe: {error}") from None
        for name, value in (("weights", weights), ("activations", activations)):
            if value is not None:
                try:
                    probe_grid(value, block)
                except ValueError as error:
                    raise ValueError(f"QuantizationProbe: {name}: {error}") from None
        check_flags("QuantizationProbe", per_token=per_token, log_images=log_images, verbose=verbose)
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(f"QuantizationProbe: loss_fn={loss_fn!r} must be callable as loss_fn(pl_module, batch)")
        if loss_key is not None and not isinstance(loss_key, str):
            raise ValueError(f"QuantizationProbe: loss_key={loss_key!r} must be the name validation_step logs its loss under")
        if loss_key is not None and loss_fn is not None:
            raise ValueError(f"QuantizationProbe: loss_key={loss_key!r} names validation_step's logged loss; loss_fn= replaces it")
        if log_images:
            try:
                import matplotlib  # noqa: F401
            except ModuleNotFoundError:
                raise ValueError(
                    "QuantizationProbe: log_images=True needs matplotlib: pip install matplotlib, or log_images=False"
                ) from None
        self.every_n_val_epochs = every_n_val_epochs
        self.weights = weights
        self.activations = activations
        self.batches = batches
        self.loss_fn = loss_fn
        self.loss_key = "val_loss" if loss_key is None else loss_key
        self.units = _names(units)
        if units is not None and (not self.units or not all(isinstance(name, str) for name in self.units)):
            raise ValueError(f"QuantizationProbe: units={units!r} must be module names in forward order, e.g. ['blocks.0', 'blocks.1']")
        self.modules = _names(modules)
        if modules is not None and (not self.modules or not all(isinstance(pattern, str) for pattern in self.modules)):
            raise ValueError(
                f"QuantizationProbe: modules={modules!r} must be name patterns of linear layers (fnmatch), e.g. ['*.attn.*'], or None"
            )
        self.block = block
        self.per_token = per_token
        self.log_images = log_images
        self.verbose = verbose
        self.history: list[ProbeResult] = []
        self._batches: list[Any] = []
        self._several_loaders = False
        self._validations = 0

    @property
    def recipe(self) -> str:
        """``W<weights>A<activations>`` as the report says it, e.g. ``Wint4Aint4``, ``Wint4A-``."""
        return f"W{self.weights or '-'}A{self.activations or '-'}"

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # before a checkpoint's count is restored (on_fit_start comes after it)
            self._validations = 0

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(trainer.strategy, FSDPStrategy | ModelParallelStrategy):
            raise ConfigurationError(
                f"QuantizationProbe: {type(trainer.strategy).__name__} shards the parameters and the probe runs the unwrapped "
                "module; use it with a single device or DDP (e.g. on a checkpoint of this run)"
            )
        self._check_module(pl_module)
        self._batches = []

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING:  # trainer.validate(): no fit start
            self._check_module(pl_module)

    def _check_module(self, pl_module: pl.LightningModule) -> None:
        """Raise now, not after an epoch, where ``modules`` or ``units`` (given or default) match nothing in the module,
        ``block`` does not divide a selected layer's input features (its weight's rows and its inputs' tokens), or a
        selected layer's weight is parametrized (``weight_norm``: :func:`~lightning_qstate.probes.ptq` cannot swap it)."""
        try:
            layers = linear_modules(pl_module, self.modules)
            if self.units is None:
                default_units(pl_module)
            for name in self.units or ():
                pl_module.get_submodule(name)
        except (ValueError, AttributeError) as error:
            raise ConfigurationError(f"QuantizationProbe: {error}") from None
        if isinstance(self.block, int):
            features = {name: module.weight.shape[weight_input_dim(module)] for name, module in layers.items()}
            misfits = {name: count for name, count in features.items() if count % self.block}
            if misfits:
                raise ConfigurationError(
                    f"QuantizationProbe: block={self.block} does not divide the input features of {misfits}; use a divisor of "
                    "each, block='row', or modules= without these layers"
                )
        parametrized = parametrized_weights(layers) if self.weights is not None else []
        if parametrized:
            raise ConfigurationError(
                f"QuantizationProbe: the weights of {parametrized} are parametrized (torch.nn.utils.parametrize, weight_norm), "
                "which the probe cannot quantize; leave them out with modules=, or weights=None"
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            write_layout(trainer)

    def tensorboard_charts(self, trainer: pl.Trainer) -> dict[str, dict[str, list[str]]]:
        """Custom-scalars charts: the losses with and without PTQ, R_L, and the outlier metrics."""
        return {
            "qstate: quantization probe": {
                "loss and PTQ loss": [f"^{PROBE_TAG}/loss$", f"^{PROBE_TAG}/ptq_loss$"],
                "PTQ loss increase and R_L": [f"^{PROBE_TAG}/ptq_loss_increase$", f"^{PROBE_TAG}/R_L$"],
                "outliers: MMR and kurtosis": [f"^{PROBE_TAG}/mmr$", f"^{PROBE_TAG}/kurtosis"],
            }
        }

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if trainer.sanity_checking or dataloader_idx != 0 or len(self._batches) >= self.batches or batch_idx != len(self._batches):
            return
        self._batches.append(apply_to_collection(batch, torch.Tensor, lambda tensor: tensor.detach().clone()))
        self._several_loaders = len(trainer.num_val_batches) > 1  # validation_step then takes a dataloader_idx

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not self._batches:
            return
        self._validations += 1
        if self._validations % self.every_n_val_epochs:
            return
        result = _across_ranks(self.probe(pl_module, step=trainer.global_step), trainer)
        self.history.append(result)
        pl_module.log_dict(result.metrics(), sync_dist=True)
        if trainer.is_global_zero:
            if self.verbose:
                print(
                    f"QuantizationProbe ({self.recipe}) at step {result.step}: loss {result.loss:.4f} -> {result.ptq_loss:.4f} under PTQ "
                    f"(+{result.ptq_loss_increase:.4f}), R_L {result.R_L:.3e}, MMR {result.mmr:.1f}, kurtosis {result.kurtosis:.1f}, "
                    f"{result.seconds:.1f} s",
                    flush=True,
                )
            if self.log_images:
                loggers = [logger for logger in trainer.loggers if isinstance(logger, TensorBoardLogger)]
                if loggers:
                    figure = abc_figure(result.abc, title=f"{self.recipe} at step {result.step}: R_L = {result.R_L:.3e}")
                    for logger in loggers:
                        # at the scalars' step: Lightning logs a validation's at the index of the batch that ran it
                        logged_step = trainer.fit_loop.epoch_loop._batches_that_stepped
                        logger.experiment.add_figure(f"{PROBE_TAG}/abc", figure, global_step=logged_step, close=False)
                    import matplotlib.pyplot as plt

                    plt.close(figure)

    def probe(self, pl_module: pl.LightningModule, step: int = 0) -> ProbeResult:
        """Run the probe on the captured batches now, in eval mode (each module's mode restored after), on this rank's
        batches only (also usable outside a fit, after one validation).

        Raises:
            ValueError: no batches captured yet (no validation has run).
        """
        if not self._batches:
            raise ValueError("QuantizationProbe.probe: no validation batches captured yet; run a validation (fit or validate) first")
        start = time.perf_counter()
        options = {"modules": self.modules, "block": self.block}
        losses, quantized, abc_runs, statistics = [], [], [], []
        trainer = getattr(pl_module, "_trainer", None)
        # the validation's precision: autocast under the mixed settings (fp32 forwards measured another model)
        precision = trainer.precision_plugin.val_step_context() if trainer is not None else contextlib.nullcontext()
        streams = _RandomStreams(pl_module.device)  # training's streams untouched; each forward of a batch draws alike
        with streams.fork(), evaluating(pl_module), torch.no_grad(), precision:
            for batch_idx, batch in enumerate(self._batches):  # the validation's first batches, in order
                streams.mark()
                forward = functools.partial(self._loss, batch_idx=batch_idx, rewind=streams.rewind)
                losses.append(forward(pl_module, batch))
                with ptq(pl_module, self.weights, self.activations, **options):
                    quantized.append(forward(pl_module, batch))
                abc_runs.append(
                    abc_decomposition(
                        pl_module, batch, self.weights, self.activations, self.units, per_token=self.per_token, forward=forward, **options
                    )
                )
                statistics.append(linear_input_statistics(pl_module, batch, forward=forward, modules=self.modules))
        abc = _mean_abc(abc_runs)
        return ProbeResult(
            step=step,
            loss=_mean(losses),
            ptq_loss=_mean(quantized),
            R_L=abc.R_L,
            mmr=_mean([stats.mmr for stats in statistics]),
            kurtosis=_mean([stats.kurtosis for stats in statistics]),
            kurtosis_channel_rms=_mean([stats.mean("kurtosis_channel_rms") for stats in statistics]),
            abc=abc,
            seconds=time.perf_counter() - start,
        )

    def _step_args(self, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> tuple:
        """``validation_step``'s arguments as Lightning passes them: ``batch_idx`` where the step takes it, and the first
        dataloader's index where there are several."""
        takes_index = is_param_in_hook_signature(pl_module.validation_step, "batch_idx", min_args=2)
        return (batch, *([batch_idx] if takes_index else []), *([0] if self._several_loaders else []))

    def _loss(self, pl_module: pl.LightningModule, batch: Any, batch_idx: int = 0, rewind: Callable[[], None] | None = None) -> float:
        """The loss of ``batch``, the validation's ``batch_idx``-th: ``loss_fn``'s, else ``validation_step``'s (called as
        Lightning calls it: ``_step_args``), on a copy of ``batch`` (an in-place preprocessing step would change the
        stored batch for every later forward), after ``rewind()``."""
        batch = apply_to_collection(batch, torch.Tensor, torch.clone)
        if rewind is not None:
            rewind()
        if self.loss_fn is not None:
            return float(self.loss_fn(pl_module, batch))
        logged: dict[str, Any] = {}
        pl_module.log = lambda name, value, *args, **kwargs: logged.__setitem__(name, value)  # instance attribute: caught
        try:
            returned = pl_module.validation_step(*self._step_args(pl_module, batch, batch_idx))
        finally:
            del pl_module.log
        if self.loss_key in logged:
            return float(logged[self.loss_key])
        if isinstance(returned, torch.Tensor) and returned.numel() == 1:
            return float(returned)
        if isinstance(returned, Mapping) and "loss" in returned:
            return float(returned["loss"])
        raise ConfigurationError(
            f"QuantizationProbe: {type(pl_module).__name__}.validation_step neither logs {self.loss_key!r} (it logged "
            f"{sorted(logged)}) nor returns a loss; pass loss_key= or loss_fn=(pl_module, batch) -> loss"
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"validations": self._validations}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._validations = state_dict["validations"]


def _names(value: Any) -> list | None:
    """``units=``/``modules=`` as a list: one name, or the names given (anything else kept whole, for the check to name)."""
    if value is None:
        return None
    return [value] if isinstance(value, str) or not isinstance(value, Iterable) else list(value)


class _RandomStreams:
    """torch's global random streams (the CPU's, and ``device``'s where it is a CUDA GPU; not Python's or numpy's):
    :meth:`fork` keeps them as they are after a block, :meth:`mark` records where they stand and :meth:`rewind` sets
    them back there, so that each forward of one batch draws the same numbers (a ``validation_step`` that adds noise, as
    denoising or VAE objectives do) and the losses with and without quantization differ by the quantization alone."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.index = (device.index if device.index is not None else torch.cuda.current_device()) if self.cuda else None
        self._marked: list[torch.Tensor] = []

    def fork(self) -> contextlib.AbstractContextManager:
        return torch.random.fork_rng(devices=[self.index] if self.cuda else [])

    def mark(self) -> None:
        self._marked = [torch.get_rng_state(), *([torch.cuda.get_rng_state(self.index)] if self.cuda else [])]

    def rewind(self) -> None:
        torch.set_rng_state(self._marked[0])
        if self.cuda:
            torch.cuda.set_rng_state(self._marked[1], self.index)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _across_ranks(result: ProbeResult, trainer: pl.Trainer) -> ProbeResult:
    """``result`` with every figure averaged over the ranks (as ``log(..., sync_dist=True)`` averages them; ``G`` as the
    mean A over the mean R_in), the same on every rank."""
    if trainer.world_size == 1:
        return result
    rows = result.abc.rows
    scalars = [result.loss, result.ptq_loss, result.mmr, result.kurtosis, result.kurtosis_channel_rms, result.seconds]
    figures = scalars + [value for row in rows for value in (row.R, row.A, row.B, row.C, row.R_in)]
    local = torch.tensor(figures, dtype=torch.float64, device=trainer.strategy.root_device)
    mean = trainer.strategy.reduce(local, reduce_op="mean").tolist()
    loss, ptq_loss, mmr, kurtosis, channel_rms, seconds = mean[: len(scalars)]
    merged = []
    for index, row in enumerate(rows):
        r, a, b, c, r_in = mean[len(scalars) + 5 * index : len(scalars) + 5 * index + 5]
        merged.append(ABCRow(row.name, row.kind, r, a, b, c, gain(a, r_in), r_in))
    abc = ABCResult(merged, result.abc.per_token)
    return ProbeResult(result.step, loss, ptq_loss, abc.R_L, mmr, kurtosis, channel_rms, abc, seconds)


def _mean_abc(results: list[ABCResult]) -> ABCResult:
    """The rows of several batches' decompositions, each figure averaged (G as the mean A over the mean R_in)."""
    rows = []
    for index, first in enumerate(results[0].rows):
        group = [result.rows[index] for result in results]
        a, r_in = _mean([row.A for row in group]), _mean([row.R_in for row in group])
        figures = {name: _mean([getattr(row, name) for row in group]) for name in ("R", "B", "C")}
        rows.append(ABCRow(first.name, first.kind, figures["R"], a, figures["B"], figures["C"], gain(a, r_in), r_in))
    return ABCResult(rows, results[0].per_token)


def abc_figure(result: ABCResult, title: str = ""):
    """A matplotlib figure of ``result``: per unit and linear layer (forward order), A, B and |C| stacked with R marked
    (log scale), and the gain G below; units in bold. Close it with ``plt.close(figure)``."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    rows = result.rows
    positions = range(len(rows))
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(max(6.0, 0.45 * len(rows) + 2), 6.5), sharex=True, height_ratios=(3, 1.4))
    bottom_of = [0.0] * len(rows)
    for name, colour in (("A", "tab:blue"), ("B", "tab:orange"), ("C", "tab:green")):
        heights = [abs(getattr(row, name)) for row in rows]
        label = {"A": "A (propagated)", "B": "B (local)", "C": "|C| (cross)"}[name]
        top.bar(positions, heights, bottom=bottom_of, color=colour, label=label, width=0.7)
        bottom_of = [b + h for b, h in zip(bottom_of, heights, strict=True)]
    top.plot(positions, [row.R for row in rows], "k_", markersize=14, markeredgewidth=2, label="R = A + B + C")
    top.set_ylabel("relative squared error")
    top.set_yscale("log")
    top.legend(fontsize=8, loc="upper left")
    top.set_title(title, fontsize=10)
    bottom.bar(positions, [0.0 if math.isnan(row.G) else row.G for row in rows], color="tab:purple", width=0.7)
    bottom.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    bottom.set_ylabel("gain G = A / R_in")
    bottom.set_xticks(list(positions))
    labels = bottom.set_xticklabels([_short(row.name) for row in rows], rotation=60, ha="right", fontsize=7)
    for label, row in zip(labels, rows, strict=True):
        label.set_fontweight("bold" if row.kind == "unit" else "normal")
    figure.tight_layout()
    return figure


def _short(name: str) -> str:
    """A module name without the wrappers' prefixes (``model.transformer.h.0.attn.c_attn`` -> ``h.0.attn.c_attn``)."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[max(0, index - 1) :])
    return name
