"""Quantize the states of an optimizer that already exists.

``quantize_optimizer(opt)`` turns ``torch.optim.Adam``/``AdamW``/``SGD``/``Muon``
into ``QAdam``/``QAdamW``/``QSGD``/``QMuon`` in place: the same object changes
class, so its ``param_groups`` (the same dict objects), hyperparameters, hooks and
any LR scheduler built on it keep working, and its existing state is quantized.
The new class keeps the torch class's ``__name__`` (see ``InPlaceQAdamW``), so tools
that name things after it (Lightning's ``LearningRateMonitor``: ``lr-AdamW``) see no change.

Any other ``torch.optim.Optimizer`` (Lion, Adafactor, your own) gets
:class:`QuantizedOptimizerWrapper`: between steps, every floating state tensor
shaped like its parameter is stored in the chosen format.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
from torch.distributed.tensor import DTensor
from typing_extensions import override

from ..arguments import ConfigurationError
from ..formats import BlockFormat, QuantizedTensor, StorageFormat, get_format
from ..formats.weights import WeightBlock
from ..kernels.dispatch import StepPath
from .base import (
    OVERRIDES_KEY,
    ROUNDING_KEY,
    STEP_NOT_TRACED,
    QuantizedStates,
    StateValue,
    StepOverflowError,
    dequantized,
    like_param,
    local_tensor,
    raise_overflows,
)
from .optimizers import QSGD, QAdam, QAdamW, QMuon
from .policy import GROUP_OPTIONS, ErrorFeedback, NonFiniteGradPolicy, QuantizationPolicy, StatesSpec


def _in_place_class(quantized_class: type, torch_class: type) -> type:
    """The subclass of ``quantized_class`` that ``quantize_optimizer`` gives a ``torch_class`` converted in place.

    Its ``__name__`` is ``torch_class``'s, as tools that key logs on ``type(optimizer).__name__`` expect; its
    ``__qualname__`` is the module attribute that holds it, so pickle finds it.
    """
    qualname = f"InPlace{quantized_class.__name__}"
    doc = f"A ``{torch_class.__module__}.{torch_class.__name__}`` converted in place: "
    doc += f"a :class:`{quantized_class.__name__}` named ``{torch_class.__name__}``."
    return type(torch_class.__name__, (quantized_class,), {"__module__": __name__, "__qualname__": qualname, "__doc__": doc})


InPlaceQAdam = _in_place_class(QAdam, torch.optim.Adam)
InPlaceQAdamW = _in_place_class(QAdamW, torch.optim.AdamW)
InPlaceQSGD = _in_place_class(QSGD, torch.optim.SGD)
InPlaceQMuon = _in_place_class(QMuon, torch.optim.Muon)
# The class quantize_optimizer converts each of these (exact) torch classes to, in place.
QUANTIZED_EQUIVALENTS: dict[type, type] = {
    torch.optim.Adam: InPlaceQAdam,
    torch.optim.AdamW: InPlaceQAdamW,
    torch.optim.SGD: InPlaceQSGD,
    torch.optim.Muon: InPlaceQMuon,
}
# Step hooks the wrapper shares with its inner optimizer (the same dicts), like its param_groups and state.
SHARED_HOOKS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


class QuantizedOptimizerWrapper(QuantizedStates, torch.optim.Optimizer):
    """Low-bit states for an arbitrary optimizer.

    Between steps, each floating state tensor shaped like its parameter (with at
    least ``min_quant_size`` elements; not a 0-d one, which is a scalar such as a step
    count) is stored in the format ``states`` names for it; other states stay as they
    are. Unsigned maps are used for state names known to be non-negative
    (``exp_avg_sq``, Adamax's ``exp_inf``, ...: ``policy.NONNEGATIVE_STATES``); a state
    that turns out to hold negative values falls back to the signed variant, with a
    warning. A state the inner step leaves alone (every state of a parameter without a
    gradient, frozen or skipped by the non-finite policy; one the step did not write, as
    Lookahead's slow weights between syncs) keeps its stored codes.

    The wrapper and the inner optimizer share ``param_groups``, ``state``, ``defaults`` and the step and state-dict
    hooks (the same objects, also after ``load_state_dict``, ``copy.deepcopy`` and pickling), so LR schedulers built
    on either keep working. Step hooks, global (``torch.optim.optimizer.register_optimizer_step_pre_hook``) or
    registered on either optimizer, run once per step, with the wrapper as their ``optimizer`` argument.

    Transient memory: the inner optimizer updates all its parameters in one call,
    so during ``step()`` every quantized state is decoded to a full-precision tensor
    at once; the step peaks at the inner optimizer's unquantized state size, and
    only the low-bit states are held between steps.

    Args:
        optimizer: the optimizer to wrap; it keeps doing the math.
        states, rounding, block_size, min_quant_size, grads, track_stalls, nonfinite, generator, policy:
            as for :class:`~lightning_qstate.QAdamW`; ``states`` may name any state key. ``grads`` rounds the gradients
            of the first evaluation of a closure (those the non-finite policy checks), not those of later evaluations
            inside the inner step (LBFGS's line search). ``track_stalls`` counts the states' stalls only: the inner
            optimizer writes the parameters, so there is no update of the wrapper's to count the weights' stalls against.
        weights, weight_rounding, weight_block, error_feedback: must stay at their defaults (the inner optimizer
            updates the parameters itself, so there is no fp32 update to round: ``optim/weights.py``).

    Example (Adagrad's ``sum`` in 8 bits; ``quantize_optimizer`` builds the wrapper for any optimizer it has no
    quantized class for)::

        >>> import torch
        >>> from lightning_qstate import QuantizedOptimizerWrapper
        >>> model = torch.nn.Linear(256, 256)
        >>> opt = QuantizedOptimizerWrapper(torch.optim.Adagrad(model.parameters(), lr=0.1), states="int8", min_quant_size=0)
        >>> model(torch.randn(8, 256)).square().mean().backward()
        >>> opt.step()
        >>> opt.state_format(model.weight, "sum").name
        'int8'
    """

    weights_supported = False
    error_feedbacks = (None,)
    counts_weight_stalls = False  # the inner optimizer writes the parameters: there is no update of ours to compare with

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        states: StatesSpec = "int8",
        rounding: str = "nearest",
        block_size: int | None = None,
        min_quant_size: int = 4096,
        weights: str | None = None,
        weight_rounding: str = "stochastic",
        weight_block: WeightBlock = "row",
        error_feedback: ErrorFeedback | None = None,
        grads: str | None = None,
        track_stalls: bool = False,
        nonfinite: NonFiniteGradPolicy = "skip",
        generator: torch.Generator | None = None,
        policy: QuantizationPolicy | None = None,
    ) -> None:
        _check_wrappable(optimizer)
        _drop_checkpoint_policy(optimizer, type(self).__name__)
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, optimizer.defaults)
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups  # the same list and dicts: schedulers of the inner optimizer keep working
        self.state = optimizer.state
        self.defaults = optimizer.defaults
        for name in SHARED_HOOKS:
            setattr(self, name, getattr(optimizer, name))
        self._setup_quantized_states(QuantizationPolicy.from_arguments(type(self).__name__, policy, locals()), generator)
        self._quantize_existing()

    def __getstate__(self) -> dict[str, Any]:
        """The mixin's pickled state plus the inner optimizer (``copy.deepcopy`` and ``pickle`` copy both together)."""
        return {**super().__getstate__(), "optimizer": self.optimizer}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """torch's ``__setstate__``, then share ``state``, ``param_groups`` and the step hooks with the inner optimizer again.

        Both unpickling and torch's ``load_state_dict`` come here: the latter sets new ``state`` and ``param_groups``
        objects through ``__setstate__``, and the inner optimizer would go on stepping with its old ones.
        """
        super().__setstate__(state)
        self.optimizer.__setstate__({"state": self.state, "param_groups": self.param_groups})  # also runs its class's own fix-ups
        for name in SHARED_HOOKS:
            setattr(self.optimizer, name, getattr(self, name))

    def _quantize_existing(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                for name, value in self.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor):
                        self.state[param][name] = self._store(group, param, name, value, None)

    def _format_for(self, group: dict, key: torch.Tensor, name: str, value: torch.Tensor, old: StateValue | None) -> StorageFormat | None:
        per_value = isinstance(value, torch.Tensor) and value.ndim > 0 and self._per_value_state(key, name, value)
        if old is None and not per_value:  # a 0-d parameter's 0-d states are scalars too (step, ASGD's eta and mu)
            return None
        fmt = super()._format_for(group, key, name, value, old)
        if isinstance(fmt, BlockFormat) and not fmt.signed and bool((value < 0).any()):
            warnings.warn(
                f"state {name!r} holds negative values; storing it with the signed {fmt.name!r} map", RuntimeWarning, stacklevel=2
            )
            fmt = get_format(fmt.config["name"], block_size=fmt.config["block_size"], signed=True)
        return fmt

    @torch.compiler.disable(reason=STEP_NOT_TRACED)
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Evaluate ``closure``, decode the states, let the inner optimizer step, re-encode; returns what the inner step returns.

        ``closure`` is evaluated under grad mode before the states are decoded (the forward and backward pass never
        meet the decoded states), and the inner optimizer gets it too: its first call returns that evaluation, later
        calls (LBFGS's line search) evaluate it again under grad mode. The non-finite-gradient policy applies to the
        gradients of the first evaluation: a parameter it skips has no gradient during the inner step. A group's ``grads``
        format rounds the gradients of that first evaluation, before the check.
        """
        loss = self._evaluate(closure)
        self._check_before_stepping()
        with self._nonfinite_policy():
            held_back = {}
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        self._check_grad(param.grad)
                        if not self._grad_is_finite(param, local_tensor(param.grad)):
                            held_back[param] = param.grad
                            param.grad = None
            stored = {param: dict(state) for param, state in self.state.items()}
            sharded = self.holds_shards()  # the ranks agree on overflows after the step (_agree_on_overflows)
            stepped = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            outlines = self._state_outlines(stepped) if sharded else {}
            undo = {param: self._undo_record(param, state) for param, state in self.state.items()}  # where a state overflows
            # (param, name) -> (decoded tensor, its version, whether the parameter steps): a state the inner step left alone
            # keeps its codes (encoding a decoded block again can move them: a signed map's negative end is not -1, so its
            # absmax shrinks at each round trip), as _encoded tells
            decoded = {}
            for param, state in self.state.items():
                for name, value in state.items():
                    if isinstance(value, QuantizedTensor):
                        state[name] = like_param(dequantized(value), param)
                        decoded[param, name] = state[name], state[name]._version, param.grad is not None
            before = {
                (p, n): v.dequantize(torch.float32).reshape(-1)
                for p, s in stored.items()
                for n, v in s.items()
                if self.track_stalls and isinstance(v, QuantizedTensor)
            }
            try:
                result = self._inner_step(None if closure is None else _replaying(closure, loss))
            finally:
                for param, grad in held_back.items():
                    param.grad = grad
            errors = []
            for group in self.param_groups:
                for param in group["params"]:
                    state, old_states = self.state.get(param, {}), stored.get(param, {})
                    try:
                        encoded = {
                            name: self._encoded(group, param, name, value, old_states.get(name), decoded) for name, value in state.items()
                        }
                    except StepOverflowError as error:  # this parameter's states (and step counts) as before the step
                        errors.append(error)
                        if param in undo:
                            undo[param]()
                        else:  # its first step made its states: none, as before it
                            del self.state[param]
                        continue
                    for name, value in encoded.items():
                        if (param, name) in before and value is not old_states[name]:
                            self._count_stalls(param, name, old_states[name], before[param, name], state[name], value)
                        state[name] = value
            self._taken_paths = dict.fromkeys(
                (param for group in self.param_groups for param in group["params"] if param.grad is not None), StepPath.REFERENCE
            )
            if sharded:
                errors = self._agree_on_overflows(errors, outlines)
            raise_overflows(errors)
        self._check_state_names()
        return result

    def __repr__(self) -> str:
        """torch's listing of the groups, headed by the wrapped optimizer's name: ``QuantizedOptimizerWrapper[RMSprop] (...``."""
        text = super().__repr__()
        name = type(self).__name__
        return f"{name}[{type(self.optimizer).__name__}]{text[len(name) :]}" if text.startswith(name) else text

    def _check_state_names(self) -> None:
        """Once the inner optimizer has made its states (at its first step; the wrapper knows no names before), every
        state name that ``states=`` or a per-parameter override names must be one of them: a misspelt one (or Adam's
        ``exp_avg_sq`` for RMSprop's ``square_avg``) quantized nothing, silently."""
        if self.__dict__.get("_names_checked"):
            return
        made = {name for state in self.state.values() for name in state}
        if not made:
            return
        asked = {name for group in self.param_groups if isinstance(group["states"], Mapping) for name in group["states"]}
        asked |= {name for spec in self.state_overrides.values() if isinstance(spec, Mapping) for name in spec}
        unknown = sorted(asked - made)
        self._names_checked = not unknown  # a step after the error raises it again
        if unknown:
            raise ConfigurationError(
                f"{type(self).__name__}: states= (or overrides=) names {unknown}, which {type(self.optimizer).__name__} does not "
                f"keep; its states are {sorted(made)} (checked at its first step, once they exist)"
            )

    @override
    def _plain_state(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A loaded state kept plain, laid out as the inner optimizer made it: a per-value state of an FSDP2 parameter as a
        DTensor like it (torch's update mixes it with the DTensor gradient; as a local tensor it raised "got mixed
        torch.Tensor and DTensor" at the first step after every load), a step count as it is."""
        local = local_tensor(value)
        return like_param(local, key) if isinstance(key, DTensor) and local.shape == local_tensor(key).shape else local

    def _encoded(self, group: dict, param: torch.Tensor, name: str, value: Any, old: StateValue | None, decoded: dict) -> StateValue:
        """State ``name`` of ``param`` after the inner step, stored in its format (``_store``); a decoded state that the
        inner step left alone (``decoded``: the tensor, its version and whether the parameter stepped) is its old value,
        whose codes encoding again could move (a state written every k steps, as Lookahead's slow weights, would decay in
        between). The tensor and its version tell for a parameter without a gradient; a stepped one's states are compared
        with their decoded values as well, since a kernel may write them without bumping the version (torch's fused CPU
        Adagrad; ``.data``)."""
        tensor, version, stepped = decoded.get((param, name), (None, None, False))
        if value is tensor and value._version == version:
            if not stepped or torch.equal(local_tensor(value), local_tensor(like_param(dequantized(old), param))):
                return old
        return self._store(group, param, name, value, old)

    def _inner_step(self, closure: Callable[[], Any] | None) -> Any:
        """The inner optimizer's step function, without the step hooks torch puts around it: the wrapper's step runs
        them, once. An LR scheduler built on the inner optimizer is told that it stepped, as its own wrapper would."""
        step = type(self.optimizer).step
        if getattr(step, "hooked", False):  # torch.optim.Optimizer.profile_hook_step
            step = step.__wrapped__
        if getattr(self.optimizer.__dict__.get("step"), "_wrapped_by_lr_sched", False):
            self.optimizer._opt_called = True
        return step(self.optimizer) if closure is None else step(self.optimizer, closure)


def _replaying(closure: Callable[[], Any], loss: Any) -> Callable[[], Any]:
    """``closure`` for an optimizer's step when it was just evaluated to ``loss``: the first call returns ``loss``
    (the gradients are in place), later calls evaluate ``closure`` again under grad mode."""
    pending = [loss]

    def replay() -> Any:
        if pending:
            return pending.pop()
        with torch.enable_grad():
            return closure()

    return replay


def quantize_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    states: StatesSpec = "int8",
    rounding: str = "nearest",
    block_size: int | None = None,
    min_quant_size: int = 4096,
    weights: str | None = None,
    weight_rounding: str = "stochastic",
    weight_block: WeightBlock = "row",
    error_feedback: ErrorFeedback | None = None,
    grads: str | None = None,
    track_stalls: bool = False,
    nonfinite: NonFiniteGradPolicy = "skip",
    generator: torch.Generator | None = None,
    policy: QuantizationPolicy | None = None,
) -> torch.optim.Optimizer:
    """The quantized equivalent of ``optimizer``, keeping its param groups, hyperparameters and (quantized) state.

    The options are those of :class:`~lightning_qstate.QAdamW` (or ``policy=``).

    ``torch.optim.Adam``/``AdamW``/``SGD``/``Muon`` (exact classes) become ``QAdam``/``QAdamW``/``QSGD``/``QMuon``
    in place (subclasses that keep the torch class's ``__name__``: ``QUANTIZED_EQUIVALENTS``), and the same object
    is returned; any other ``torch.optim.Optimizer`` is wrapped in :class:`QuantizedOptimizerWrapper` (a new object
    sharing its param groups and state).

    Raises:
        TypeError: ``optimizer`` is not a ``torch.optim.Optimizer``, is quantized already, or is ``SparseAdam``.

    Example::

        >>> import torch
        >>> from lightning_qstate import QAdamW, quantize_optimizer
        >>> model = torch.nn.Linear(256, 256)
        >>> opt = quantize_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), states="int4", rounding="stochastic")
        >>> isinstance(opt, QAdamW), type(opt).__name__  # the same object, its class swapped (the name kept)
        (True, 'AdamW')
    """
    _check_wrappable(optimizer)
    resolved = QuantizationPolicy.from_arguments("quantize_optimizer", policy, locals())
    quantized_class = QUANTIZED_EQUIVALENTS.get(type(optimizer))
    if quantized_class is None:
        return QuantizedOptimizerWrapper(optimizer, generator=generator, policy=resolved)
    before = _Snapshot(optimizer)
    _drop_checkpoint_policy(optimizer, "quantize_optimizer")
    scheduler_wrapped = getattr(optimizer.__dict__.pop("step", None), "_wrapped_by_lr_sched", False)
    optimizer.__class__ = quantized_class
    try:
        optimizer._patch_step_function()
        if scheduler_wrapped:
            _track_step_for_schedulers(optimizer)
        optimizer._setup_quantized_states(resolved, generator)
        for group in optimizer.param_groups:
            for param in group["params"]:
                state = optimizer.state.get(param, {})
                for name in optimizer.state_names:
                    if isinstance(state.get(name), torch.Tensor):
                        state[name] = optimizer._initial(group, param, name, state[name])
    except BaseException:
        before.restore(optimizer)  # a refused conversion leaves the torch optimizer as it was, still usable
        raise
    return optimizer


def _check_wrappable(optimizer: object) -> None:
    """Refuse what a quantized optimizer cannot take, before anything changes."""
    if isinstance(optimizer, QuantizedStates):
        raise TypeError(f"{type(optimizer).__name__} already has quantized states; pass the original torch optimizer")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"quantize_optimizer needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise TypeError("SparseAdam steps sparse gradients, which quantized states do not support; keep torch.optim.SparseAdam")


def _drop_checkpoint_policy(optimizer: torch.optim.Optimizer, owner: str) -> None:
    """Remove from a torch optimizer's param groups the storage policy that a quantized optimizer's ``state_dict`` left
    there, with a warning: torch's ``load_state_dict`` gives every loaded group all the saved keys (group 0's
    ``ROUNDING_KEY`` marks them), so that run's policy would override the conversion's arguments for good. Only the
    options that run set alike on every group are dropped (its policy); those its groups set apart stay, as per-group
    choices, as do the options of groups added after the load (they lack the saved keys); a per-group choice equal to
    that run's policy cannot be told from it and is dropped with it."""
    groups = optimizer.param_groups
    if not groups or not any(key in groups[0] for key in (ROUNDING_KEY, OVERRIDES_KEY)):
        return
    loaded = [group for group in groups if all(key in group for key in GROUP_OPTIONS)]
    uniform = [key for key in GROUP_OPTIONS if loaded and all(group[key] == loaded[0][key] for group in loaded)]
    for group in loaded:
        for key in uniform:
            del group[key]
    for group in groups:
        group.pop(ROUNDING_KEY, None), group.pop(OVERRIDES_KEY, None)
    kept = [key for key in GROUP_OPTIONS if key not in uniform and loaded]
    warnings.warn(
        f"{owner}: the optimizer's param groups hold the storage policy of a quantized optimizer's state_dict it loaded "
        f"({', '.join(uniform) or 'none'} set alike in every group: dropped, this call's arguments are used"
        + (f"; {', '.join(kept)} set per group: kept)" if kept else ")"),
        UserWarning,
        stacklevel=3,
    )


class _Snapshot:
    """What ``quantize_optimizer`` changes on a torch optimizer: its class, attributes, defaults, groups' options and
    states (shallow copies: the tensors are replaced, never written)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.cls, self.attributes = type(optimizer), dict(optimizer.__dict__)
        self.defaults = dict(optimizer.defaults)
        self.groups = [dict(group) for group in optimizer.param_groups]
        self.states = {param: dict(state) for param, state in optimizer.state.items()}

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.__class__ = self.cls
        optimizer.__dict__.clear()
        optimizer.__dict__.update(self.attributes)
        optimizer.defaults.clear()
        optimizer.defaults.update(self.defaults)
        for group, saved in zip(optimizer.param_groups, self.groups, strict=True):
            group.clear()
            group.update(saved)
        for param, saved in self.states.items():
            optimizer.state[param].clear()
            optimizer.state[param].update(saved)


def _track_step_for_schedulers(optimizer: torch.optim.Optimizer) -> None:
    """Re-create the step wrapper an LR scheduler installed on the old class's ``step`` (it records ``_opt_called``)."""
    optimizer_ref = weakref.ref(optimizer)
    step_function = type(optimizer).step

    @functools.wraps(step_function)
    def tracked_step(*args, **kwargs):
        owner = optimizer_ref()
        owner._opt_called = True
        return step_function(owner, *args, **kwargs)

    tracked_step._wrapped_by_lr_sched = True
    optimizer.step = tracked_step


def fsdp_views(module: torch.nn.Module) -> tuple[dict[torch.Tensor, int], dict[torch.Tensor, int]]:
    """For the parameters FSDP1 (``FullyShardedDataParallel``) flattens in ``module``: ``{parameter: numel of the full
    parameter}`` and ``{parameter: which shard of it this rank holds}``.

    With ``use_orig_params=True`` the optimizer holds the original parameters, which FSDP1 turns into 1-D views of
    this rank's part of the flat shard (possibly empty); with ``use_orig_params=False`` it holds the flat parameter.
    Their local ``numel()`` differs between ranks; the flat parameter's handle knows the full sizes. The shard is the
    rank in the FSDP module's process group (the world's for ``FULL_SHARD``/``SHARD_GRAD_OP``, the node's for the
    hybrid strategies, whose other nodes hold replicas), and 0 under ``NO_SHARD``, where every rank holds it all.
    """
    numels: dict[torch.Tensor, int] = {}
    shards: dict[torch.Tensor, int] = {}
    for submodule in module.modules():
        flat = getattr(submodule, "_flat_param", None) if isinstance(submodule, FullyShardedDataParallel) else None
        if flat is None:
            continue
        replicated = submodule.sharding_strategy == ShardingStrategy.NO_SHARD
        shard = 0 if replicated else dist.get_rank(submodule.process_group)
        for param, numel in ((flat, flat._unpadded_unsharded_size.numel()), *zip(flat._params or [], flat._numels, strict=False)):
            numels[param], shards[param] = numel, shard
    return numels, shards


def check_optimizer_parameters(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """Raise if an optimizer holds parameters the (wrapped) model no longer has.

    That happens when the optimizer was built before the strategy sharded the model (for example
    LightningCLI's automatic ``--optimizer`` under ModelParallelStrategy): it would silently update nothing.
    """
    model_params = {id(p) for p in model.parameters()}
    for optimizer in optimizers:
        stale = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in model_params]
        if stale:
            raise RuntimeError(
                f"{type(optimizer).__name__} holds {len(stale)} parameter(s) that are not in the model the strategy set up; "
                "build the optimizer in configure_optimizers after configure_model (with LightningCLI and FSDP2 use an "
                "OptimizerCallable argument and auto_configure_optimizers=False)"
            )
