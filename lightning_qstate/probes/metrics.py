"""Outlier and error metrics: MMR, kurtosis, SQNR, and the first two on every linear layer's input.

arXiv 2509.23500 finds that MMR and kurtosis fail to predict PTQ damage across optimizers (the ABC decomposition's
``R_L`` does, :mod:`lightning_qstate.probes.abc`); they are here to measure that claim.

Example::

    >>> import torch
    >>> from lightning_qstate.probes import kurtosis, mmr, sqnr
    >>> x = torch.tensor([[1.0, -2.0, 3.0, 10.0]])
    >>> mmr(x)  # max|x| / median|x| of the row: 10 / 2.5
    4.0
    >>> round(kurtosis(torch.tensor([-1.0, 1.0])), 3)  # two equal spikes: the smallest excess kurtosis
    -2.0
    >>> round(sqnr(torch.ones(4), torch.full((4,), 1.1)), 4)  # 20·log10(‖x‖ / ‖x − y‖)
    20.0
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .ptq import layer_input, linear_modules

KurtosisVariant = Literal["elements", "channel_rms"]
KURTOSIS_VARIANTS: tuple[str, ...] = ("elements", "channel_rms")


def _rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` as float64 rows ``(n, x.shape[dim])``.

    Raises:
        ValueError: ``x`` has no values (no maximum, median or moments).
    """
    if not x.numel():
        raise ValueError(f"x of shape {tuple(x.shape)} has no values to measure")
    x = x.detach().double()
    return x.movedim(dim, -1).reshape(-1, x.shape[dim]) if x.ndim else x.reshape(1, 1)


def mmr(x: torch.Tensor, dim: int = -1) -> float:
    """Max-to-median ratio: per row along ``dim`` (per token of an activation ``(..., features)``),
    ``max|x| / median|x|``, averaged over the rows (the median of an even count is the mean of the two middle values;
    a row whose median is 0 counts as ``inf``)."""
    magnitudes = _rows(x, dim).abs().sort(dim=-1).values
    count = magnitudes.shape[-1]
    median = (magnitudes[:, (count - 1) // 2] + magnitudes[:, count // 2]) / 2
    ratio = torch.where(median > 0, magnitudes[:, -1] / median, math.inf)
    return float(ratio.mean())


def kurtosis(x: torch.Tensor, variant: KurtosisVariant = "elements", dim: int = -1) -> float:
    """Excess kurtosis ``E[(y − μ)^4] / σ^4 − 3`` (population moments; 0 for a Gaussian, −2 at least) of ``y``:

    - ``"elements"``: every element of ``x``;
    - ``"channel_rms"``: the RMS of each channel (index along ``dim``, over all other positions), so a few channels
      that are large everywhere (the outlier features of transformers) make it large.

    arXiv 2509.23500 does not say which one it uses (``docs/algorithms.md``, "Quantization-robustness probe"); both are
    offered and named. A constant ``y`` has no kurtosis: ``nan``.
    """
    if variant not in KURTOSIS_VARIANTS:
        raise ValueError(f"variant={variant!r} is not valid; use one of {KURTOSIS_VARIANTS}")
    rows = _rows(x, dim)
    values = rows.reshape(-1) if variant == "elements" else rows.square().mean(dim=0).sqrt()
    centred = values - values.mean()
    variance = centred.square().mean()
    if variance == 0:
        return math.nan
    return float(centred.pow(4).mean() / variance.square() - 3)


def sqnr(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of ``y`` as an approximation of ``x`` in dB: ``20·log10(‖x‖ / ‖x − y‖)``
    (torchao's ``compute_error``); ``inf`` where they are equal.

    Raises:
        ValueError: ``x`` and ``y`` differ in shape (broadcasting would compare other values).
    """
    if x.shape != y.shape:
        raise ValueError(f"sqnr: x {tuple(x.shape)} and y {tuple(y.shape)} must have the same shape")
    x, y = x.detach().double(), y.detach().double()
    noise = torch.linalg.vector_norm(x - y)
    return math.inf if noise == 0 else float(20 * torch.log10(torch.linalg.vector_norm(x) / noise))


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode (dropout off, norms on their running statistics) for the ``with`` block; each module's own
    mode is put back on exit (a frozen norm stays in eval)."""
    modes = {module: module.training for module in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in modes.items():
            module.training = training


def call_model(model: torch.nn.Module, batch: Any) -> Any:
    """The default forward of the probes: ``model(batch)`` for a tensor, ``model(batch[0])`` for a tuple or list
    (``(inputs, targets)``), ``model(**batch)`` for a dict."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, list | tuple):
        return model(batch[0])
    return model(batch)


@dataclass
class InputStatistics:
    """MMR and kurtosis of each linear layer's input, and their means over the layers.

    ``layers`` maps a layer's name to ``{"mmr", "kurtosis", "kurtosis_channel_rms"}`` (averaged over its calls).
    """

    layers: dict[str, dict[str, float]] = field(default_factory=dict)

    def mean(self, metric: str) -> float:
        """``metric`` averaged over the layers (the model-wide figure)."""
        values = [layer[metric] for layer in self.layers.values()]
        return sum(values) / len(values) if values else math.nan

    @property
    def mmr(self) -> float:
        return self.mean("mmr")

    @property
    def kurtosis(self) -> float:
        return self.mean("kurtosis")


def linear_input_statistics(
    model: torch.nn.Module,
    batch: Any,
    *,
    forward: Callable[[torch.nn.Module, Any], Any] = call_model,
    modules: Iterable[str] | None = None,
) -> InputStatistics:
    """MMR (per token) and both kurtosis variants of the input of every linear layer (or those matching ``modules``)
    during one forward ``forward(model, batch)`` without gradients, in the model's current mode and precision."""
    layers = linear_modules(model, modules)
    sums: dict[str, dict[str, float]] = {}
    calls: dict[str, int] = {}

    def record(name: str, args: tuple, kwargs: dict) -> None:
        x = layer_input(args, kwargs)
        figures = {"mmr": mmr(x), "kurtosis": kurtosis(x), "kurtosis_channel_rms": kurtosis(x, "channel_rms")}
        total = sums.setdefault(name, dict.fromkeys(figures, 0.0))
        for key, value in figures.items():
            total[key] += value
        calls[name] = calls.get(name, 0) + 1

    handles = [
        module.register_forward_pre_hook(lambda m, args, kwargs, name=name: record(name, args, kwargs), with_kwargs=True)
        for name, module in layers.items()
    ]
    try:
        with torch.no_grad():
            forward(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    return InputStatistics({name: {key: value / calls[name] for key, value in sums[name].items()} for name in layers if name in sums})
