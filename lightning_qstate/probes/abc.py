"""The ABC decomposition of quantization error (arXiv 2509.23500): how much of each unit's output error it propagates
from its input (A), adds itself (B), and the cross term (C).

For a module ``f`` with clean input ``h`` and the quantized path's input ``h^q`` (``f^q``: ``f`` under :func:`ptq`),
four forwards give::

    a = ½[(f^q(h^q) − f^q(h)) + (f(h^q) − f(h))]     propagated
    b = ½[(f^q(h^q) − f(h^q)) + (f^q(h) − f(h))]     local,        a + b = f^q(h^q) − f(h) = Δ
    R = ‖Δ‖²/‖f(h)‖² = A + B + C,  A = ‖a‖²/‖f(h)‖²,  B = ‖b‖²/‖f(h)‖²,  C = 2⟨a, b⟩/‖f(h)‖²
    G = A / R_in,  R_in = ‖h^q − h‖²/‖h‖²  (the gain; for a chain of units R_in is the previous unit's R)

Norms are over the whole tensor by default (one ratio per unit); ``per_token=True`` takes each ratio per token (row
of the last dimension) and averages them over the tokens whose clean state is not 0 (padding), a different estimator
with the same identity ``R = A + B + C``. ``R_L``, the figure the paper finds predicts PTQ damage, is ``R`` of the last
unit.

Example::

    >>> import torch
    >>> from lightning_qstate.probes import abc_decomposition
    >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
    <torch._C.Generator object at ...>
    >>> model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    >>> result = abc_decomposition(model, torch.randn(8, 16))  # W4A4; units: the Sequential's children
    >>> [row.name for row in result.rows]
    ['0', '1', '2']
    >>> row = result.rows[-1]
    >>> abs(row.A + row.B + row.C - row.R) < 1e-12 and result.R_L == row.R
    True
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..arguments import ConfigurationError
from ..formats.rounding import Rounding
from ..formats.weights import WeightBlock
from .metrics import call_model, evaluating
from .ptq import linear_modules, ptq


@dataclass(frozen=True)
class ABCRow:
    """One module's decomposition: ``kind`` is ``"unit"`` (a block of the chain) or ``"linear"`` (a linear layer inside
    one); ``R``, ``A``, ``B``, ``C`` are relative squared errors (dimensionless), ``G = A / R_in`` (``nan`` where the
    input is exact, as for the first block after an unquantized embedding)."""

    name: str
    kind: str
    R: float
    A: float
    B: float
    C: float
    G: float
    R_in: float


@dataclass(frozen=True)
class ABCResult:
    """The rows in forward order, and which norms they use."""

    rows: list[ABCRow]
    per_token: bool

    @property
    def units(self) -> list[ABCRow]:
        return [row for row in self.rows if row.kind == "unit"]

    @property
    def R_L(self) -> float:  # noqa: N802 - the paper's name
        """``R`` at the last unit: the relative squared error the quantized model carries out of its last block."""
        return self.units[-1].R

    def __str__(self) -> str:
        header = f"{'module':<40} {'kind':<6} {'R':>10} {'A':>10} {'B':>10} {'C':>10} {'G':>8}"
        lines = [header, "-" * len(header)]
        for row in self.rows:
            lines.append(f"{row.name:<40} {row.kind:<6} {row.R:10.3e} {row.A:10.3e} {row.B:10.3e} {row.C:10.3e} {row.G:8.3f}")
        return "\n".join(lines)


def default_units(model: torch.nn.Module) -> list[str]:
    """The chain of units: the children of the largest ``ModuleList`` whose children are all of one class (transformer
    blocks, e.g. GPT-2's ``transformer.h``), else the children of a ``Sequential`` model, else those of the one inner
    ``Sequential`` whose children are all of a class no other such container holds (timm's ViT ``blocks``; not one of
    a CNN's stages, whose blocks other stages hold too: the chain would end mid-network).

    Raises:
        ValueError: none of these exists (pass ``units=`` explicitly).
    """

    def one_class(module: torch.nn.Module, kind: type) -> bool:
        return isinstance(module, kind) and len(module) > 0 and len({type(child) for child in module}) == 1

    def chain(name: str) -> list[str]:
        return [f"{name}.{index}" if name else str(index) for index in range(len(model.get_submodule(name)))]

    lists = [(len(module), name) for name, module in model.named_modules() if one_class(module, torch.nn.ModuleList)]
    if lists:
        return chain(max(lists, key=lambda candidate: candidate[0])[1])  # the first of the largest
    if isinstance(model, torch.nn.Sequential):
        return [name for name, _ in model.named_children()]
    inner = [(name, type(module[0])) for name, module in model.named_modules() if name and one_class(module, torch.nn.Sequential)]
    classes = Counter(kind for _, kind in inner)
    alone = [name for name, kind in inner if classes[kind] == 1]
    if len(alone) == 1:
        return chain(alone[0])
    raise ConfigurationError(
        f"{type(model).__name__} has no transformer blocks (a ModuleList or Sequential of one class) and is not a Sequential: "
        "pass units=[module names in forward order]"
    )


def _main_tensor(value: Any) -> torch.Tensor:
    """The hidden state of a module's output or inputs: the tensor itself, or the first element of a tuple, list or
    ``ModelOutput``-like mapping."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    raise TypeError(f"cannot find the hidden state in a {type(value).__name__}; the ABC decomposition needs tensors")


@dataclass
class _Call:
    args: tuple
    kwargs: dict
    output: torch.Tensor

    @property
    def input(self) -> torch.Tensor:
        if self.args and isinstance(self.args[0], torch.Tensor):
            return self.args[0]
        return _main_tensor(self.kwargs.get("hidden_states", self.kwargs))

    def again(self, module: torch.nn.Module) -> torch.Tensor:
        """``module`` run again on copies of the recorded inputs (an in-place module would change them)."""
        return _main_tensor(module(*_snapshot(self.args), **_snapshot(self.kwargs)))


def _snapshot(value: Any) -> Any:
    """``value`` with every tensor in it (nested in tuples, lists, dicts) copied: a later in-place operation of the
    forward (``ReLU(inplace=True)``, a residual ``h += block(h)``) must not change what was recorded."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {key: _snapshot(item) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_snapshot(item) for item in value))
    if isinstance(value, list | tuple):
        return type(value)(_snapshot(item) for item in value)
    return value


def _record(model: torch.nn.Module, names: list[str], run: Callable[[], Any], optional: Iterable[str] = ()) -> dict[str, _Call]:
    """Each named module's inputs (as called, before any other pre-hook such as :func:`ptq`'s input rounding) and
    output during ``run()``, copied (:func:`_snapshot`); a module called twice is refused (not a chain), one that did
    not run too, unless it is ``optional`` (a linear layer: left out where its parent uses it through its weight or
    calls it more than once)."""
    inputs: dict[str, tuple[tuple, dict]] = {}
    calls: dict[str, _Call] = {}
    skippable, repeated = set(optional), set()

    def before(module, args, kwargs, name: str) -> None:
        if name in inputs:
            if name not in skippable:
                raise ConfigurationError(f"unit {name!r} ran more than once in one forward; the ABC decomposition needs each unit once")
            repeated.add(name)
            return
        inputs[name] = (_snapshot(args), _snapshot(kwargs))

    def after(module, args, kwargs, output, name: str) -> None:
        if name not in repeated:
            calls[name] = _Call(*inputs[name], _snapshot(_main_tensor(output)))

    handles = []
    for name in names:
        module = model.get_submodule(name)
        handles.append(module.register_forward_pre_hook(lambda m, a, k, name=name: before(m, a, k, name), with_kwargs=True, prepend=True))
        handles.append(module.register_forward_hook(lambda m, a, k, o, name=name: after(m, a, k, o, name), with_kwargs=True))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    missing = [name for name in names if name not in calls and name not in skippable]
    if missing:
        raise ConfigurationError(
            f"units {missing} did not run as modules in the forward; pass units= that the forward calls, in forward order"
        )
    return {name: call for name, call in calls.items() if name not in repeated}


def _mean_ratio(value: torch.Tensor, norm: torch.Tensor) -> float:
    """``value / norm`` (float64, per row) averaged over the rows whose ``norm`` is not 0; ``nan`` where none is."""
    kept = norm > 0
    return (value[kept] / norm[kept]).mean().item() if bool(kept.any()) else math.nan


def _rows(x: torch.Tensor, per_token: bool) -> torch.Tensor:
    """``x`` in float64 as one row, or one per token (last dimension)."""
    return x.double().reshape(-1, x.shape[-1] if per_token and x.ndim else x.numel())


def _decompose(name: str, kind: str, clean: _Call, quantized: _Call, fq_h: torch.Tensor, f_hq: torch.Tensor, per_token: bool) -> ABCRow:
    f_h, fq_hq, fq_h, f_hq = (_rows(x, per_token) for x in (clean.output, quantized.output, fq_h, f_hq))
    a = ((fq_hq - fq_h) + (f_hq - f_h)) / 2
    b = ((fq_hq - f_hq) + (fq_h - f_h)) / 2
    norm = f_h.square().sum(-1)
    R, A, B, C = (
        _mean_ratio(value, norm) for value in ((fq_hq - f_h).square().sum(-1), a.square().sum(-1), b.square().sum(-1), 2 * (a * b).sum(-1))
    )
    h, h_q = _rows(clean.input, per_token), _rows(quantized.input, per_token)
    r_in = _mean_ratio((h_q - h).square().sum(-1), h.square().sum(-1))
    return ABCRow(name, kind, R, A, B, C, gain(A, r_in), r_in)


def gain(A: float, R_in: float) -> float:  # noqa: N803 - the paper's names
    """``G = A / R_in``; ``nan`` where the input is exact (``R_in`` 0) or unknown."""
    return A / R_in if R_in > 0 else math.nan


def abc_decomposition(
    model: torch.nn.Module,
    batch: Any,
    weights: str | None = "int4",
    activations: str | None = "int4",
    units: Iterable[str] | None = None,
    *,
    layers: bool = True,
    per_token: bool = False,
    forward: Callable[[torch.nn.Module, Any], Any] = call_model,
    modules: Iterable[str] | None = None,
    block: WeightBlock = "row",
    rounding: Rounding = "nearest",
) -> ABCResult:
    """Decompose the PTQ error of ``model`` on ``batch`` into propagated, local and cross parts per unit.

    Runs the clean and the quantized forward (``forward(model, batch)``, under :func:`ptq` with ``weights``,
    ``activations``, ``modules``, ``block`` and ``rounding``), then each module once more on the other path's input, in
    eval mode (dropout off; the mode is restored) and without gradients.

    Args:
        units: module names of the chain in forward order (default :func:`default_units`: transformer blocks, or a
            ``Sequential``'s children). Each must run exactly once per forward.
        layers: also a row for every selected linear layer inside the units (``kind="linear"``), after its unit's row;
            a layer the forward does not call as a module (``nn.MultiheadAttention`` uses its ``out_proj``'s weight
            directly) or calls more than once (one layer's row needs one input and output) has none.
        per_token: per-token ratios averaged, instead of whole-tensor norms.

    Returns:
        :class:`ABCResult`; its ``R_L`` is the last unit's ``R``.

    Raises:
        ValueError: unknown formats, no units or units that do not run once, or ``modules`` matching no linear layer.
    """
    unit_names = list(default_units(model) if units is None else units)
    if not unit_names:
        raise ConfigurationError("units=[] gives no chain to decompose; pass module names in forward order, or None for the default")
    modules = None if modules is None else ([modules] if isinstance(modules, str) else list(modules))  # read twice below
    quantized_layers = linear_modules(model, modules)
    inner = {unit: [name for name in quantized_layers if name.startswith(f"{unit}.")] if layers else [] for unit in unit_names}
    layer_names = [name for unit in unit_names for name in inner[unit]]
    with evaluating(model), torch.no_grad():
        clean = _record(model, unit_names + layer_names, lambda: forward(model, batch), optional=layer_names)
        names = unit_names + [name for name in layer_names if name in clean]  # the layers that ran as modules
        with ptq(model, weights, activations, modules=modules, block=block, rounding=rounding):
            quantized = _record(model, names, lambda: forward(model, batch))
            fq_h = {name: clean[name].again(model.get_submodule(name)) for name in names}
        f_hq = {name: quantized[name].again(model.get_submodule(name)) for name in names}
    rows = []
    for unit in unit_names:
        for name in (unit, *inner[unit]):
            if name in clean:
                kind = "unit" if name == unit else "linear"
                rows.append(_decompose(name, kind, clean[name], quantized[name], fq_h[name], f_hq[name], per_token))
    return ABCResult(rows, per_token)
