"""Post-training quantization of a model's linear layers, as a context manager that restores the model exactly.

Example::

    >>> import torch
    >>> from lightning_qstate.probes import ptq
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> x = torch.randn(4, 8)
    >>> clean = model(x)
    >>> with ptq(model, weights="int4", activations="int4"):  # W4A4 on both linear layers
    ...     quantized = model(x)
    >>> torch.equal(model(x), clean)
    True
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial

import torch
from torch.nn.utils.parametrize import is_parametrized

from ..formats.rounding import Rounding, check_rounding
from ..formats.weights import WeightBlock
from .fake_quant import fake_quantize, probe_grid


def weight_input_dim(module: torch.nn.Module) -> int:
    """The input-feature dimension of a linear layer's weight: 1 for ``nn.Linear`` ``(out, in)``, 0 for the
    ``Conv1D`` of transformers' GPT-2 ``(in, out)``; its scale groups run along it (one scale per output channel)."""
    return 0 if is_conv1d(module) else 1


def is_conv1d(module: torch.nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's linear layers: ``x @ weight + bias`` with ``weight`` of shape ``(in, out)``)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def is_linear(module: torch.nn.Module) -> bool:
    """A linear layer the probes quantize: ``torch.nn.Linear`` (and subclasses) or transformers' ``Conv1D``."""
    return isinstance(module, torch.nn.Linear) or is_conv1d(module)


def linear_modules(model: torch.nn.Module, modules: Iterable[str] | None = None) -> dict[str, torch.nn.Module]:
    """The linear layers of ``model`` by name, in registration order: all (``modules=None``) or those whose names match
    one of the ``fnmatch`` patterns in ``modules`` (e.g. ``"*.mlp.*"``; exact names match themselves).

    Raises:
        ValueError: a pattern that matches no linear layer (a typo is never silently ignored), no pattern, or a model
            without any linear layer.
    """
    layers = {name: module for name, module in model.named_modules() if is_linear(module)}
    if not layers:
        raise ValueError(f"{type(model).__name__} has no linear layers (torch.nn.Linear or transformers' Conv1D) to quantize")
    if modules is None:
        return layers
    patterns = [modules] if isinstance(modules, str) else list(modules)
    if not patterns:
        raise ValueError(f"modules={patterns} selects no linear layer; pass patterns, or None for every linear layer")
    unmatched = [pattern for pattern in patterns if not any(fnmatch.fnmatchcase(name, pattern) for name in layers)]
    if unmatched:
        raise ValueError(f"modules={unmatched} match no linear layer of {type(model).__name__}; its linear layers are {list(layers)}")
    return {name: module for name, module in layers.items() if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)}


def layer_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The input of a linear layer's call (a forward pre-hook's ``args``, ``kwargs``): its first positional argument,
    or its one keyword argument (``layer(input=x)``)."""
    if args:
        return args[0]
    if len(kwargs) == 1:
        return next(iter(kwargs.values()))
    raise TypeError(f"a linear layer was called with no positional input and keywords {list(kwargs)}; expected its input alone")


def _quantize_input(module, args, kwargs, *, fmt: str, block: WeightBlock, rounding: Rounding, ran: set[torch.nn.Module]):
    ran.add(module)
    rounded = fake_quantize(layer_input(args, kwargs), fmt, block=block, rounding=rounding)
    return ((rounded, *args[1:]), kwargs) if args else (args, dict.fromkeys(kwargs, rounded))


@contextmanager
def ptq(
    model: torch.nn.Module,
    weights: str | None = "int4",
    activations: str | None = "int4",
    *,
    modules: Iterable[str] | None = None,
    block: WeightBlock = "row",
    rounding: Rounding = "nearest",
) -> Iterator[dict[str, torch.nn.Module]]:
    """Quantize the linear layers of ``model`` in place for the ``with`` block (default W4A4 on all, as arXiv 2509.23500).

    Each selected layer's weight is replaced by a fake-quantized copy (symmetric absmax, one scale per output channel
    with ``block="row"``) and its input is fake-quantized on every call (one scale per token); the layer's original
    ``Parameter`` objects are put back on exit, untouched, so the model, its optimizer and tied weights (GPT-2's
    ``lm_head`` shares the embedding, which stays unquantized) are exactly as before. Non-linear modules (norms,
    embeddings, attention's softmax) keep the model's precision. Yields the quantized layers by name. A selected layer
    that the forward never calls as a module while others run (``nn.MultiheadAttention`` uses its ``out_proj``'s weight
    directly) has its weight quantized but not its input: a warning on exit names it.

    Args:
        weights, activations: PTQ format names (:mod:`lightning_qstate.probes.fake_quant`), ``None`` to keep that
            side unquantized; :data:`RECIPES` names the usual pairs (``ptq(model, **RECIPES["W8A8"])``).
        modules: ``fnmatch`` patterns of the layers to quantize (default: every linear layer).
        block, rounding: as :func:`fake_quantize`.

    Raises:
        ValueError: an unknown format, block or rounding, ``modules`` matching no linear layer, or a selected layer whose
            weight is parametrized (``torch.nn.utils.parametrize``, ``weight_norm``).
    """
    for fmt in (weights, activations):
        if fmt is not None:
            probe_grid(fmt, block)  # errors before anything changes
    check_rounding(rounding)
    layers = linear_modules(model, modules)
    parametrized = parametrized_weights(layers) if weights is not None else []
    if parametrized:
        raise ValueError(
            f"the weights of {parametrized} are parametrized (torch.nn.utils.parametrize, weight_norm), which ptq cannot swap; "
            "remove the parametrization (parametrize.remove_parametrizations) or leave them out with modules="
        )
    swapped: list[tuple[torch.nn.Module, torch.nn.Parameter]] = []
    handles, ran = [], set()
    try:
        for module in layers.values():
            if weights is not None:
                original = module._parameters["weight"]
                with torch.no_grad():
                    rounded = fake_quantize(original.detach(), weights, block=block, dim=weight_input_dim(module), rounding=rounding)
                module._parameters["weight"] = torch.nn.Parameter(rounded, requires_grad=original.requires_grad)
                swapped.append((module, original))
            if activations is not None:
                hook = partial(_quantize_input, fmt=activations, block=block, rounding=rounding, ran=ran)
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
        yield layers
        skipped = [name for name, module in layers.items() if module not in ran]
        if ran and skipped:
            warnings.warn(
                f"ptq: the inputs of {skipped} were not quantized: the forward never called them as modules (their parent uses "
                "their weight directly, as nn.MultiheadAttention does its out_proj); their weights were",
                UserWarning,
                stacklevel=3,
            )
    finally:
        for module, original in reversed(swapped):
            module._parameters["weight"] = original
        for handle in handles:
            handle.remove()


def parametrized_weights(layers: Mapping[str, torch.nn.Module]) -> list[str]:
    """The names of ``layers`` whose ``weight`` is parametrized (``torch.nn.utils.parametrize``, ``weight_norm``): a
    weight :func:`ptq` cannot swap for its rounded copy."""
    return [name for name, module in layers.items() if is_parametrized(module, "weight")]
