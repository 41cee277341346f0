"""The quantized-state machinery shared by QAdam, QAdamW, QSGD, QMuon and the generic wrapper.

A quantized optimizer is its torch counterpart whose per-parameter states live in
low-bit :class:`~lightning_qstate.formats.QuantizedTensor` buffers between steps.
Each step, one parameter at a time: dequantize its states to fp32, run torch's
own update math on them, and quantize them back. The transient memory is the fp32
states of a single parameter.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..arguments import ConfigurationError, short_list
from ..formats import CastFormat, NonFiniteError, QuantizedTensor, StorageFormat, count_stalls, local_tensor
from ..formats.weights import WeightGrid
from ..kernels import dispatch
from ..kernels.bounds import MOMENT_BOUND_STATE, bound_square, restart_square
from ..kernels.dispatch import PER_PARAMETER_PATHS, Candidate, StepPath, plan_group, plan_inputs, plan_options
from ..kernels.native import StateOverflowError
from .policy import (
    GROUP_OPTIONS,
    POLICY_DEFAULTS,
    QuantizationPolicy,
    StatesSpec,
    as_python_counts,
    format_name_for,
    gradient_format,
    match_patterns,
    resolve_format,
    validate_policy,
)
from .serialization import (
    FORMAT_SUFFIX,
    PLAIN_MARKER,
    STATE_FORMAT_VERSION,
    VERSION_KEY,
    check_state_shape,
    check_version,
    export_state,
    format_from_marker,
    format_marker,
    import_state,
    is_exported,
    quantize_exactly,
)
from .weights import ERROR_STATE, PLAIN_NAMES, grid_units, overridden_grid

CheckpointMode = Literal["packed", "fp32"]
StateValue = torch.Tensor | QuantizedTensor
# Parameter dtypes the quantized optimizers step (float64 states are quantized through fp32).
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# Where the stochastic-rounding seed and step counter travel in a state dict (param group 0: it survives every
# strategy's optimizer-state conversion, which may drop unknown top-level keys).
ROUNDING_KEY = "qstate_rounding_seed"
# Param group 0 of a state dict: each parameter's ``overrides`` spec (JSON, or None), in the order of the groups' params.
OVERRIDES_KEY = "qstate_overrides"
# Attributes the quantized optimizers add to torch's; kept by pickle and deepcopy.
QSTATE_ATTRIBUTES = (
    "track_stalls", "nonfinite", "generator", "nonfinite_skips", "skipped_steps", "state_overrides", "configured_overrides",
    "module_names", "name_patterns", "full_numels", "shard_indices", "checkpoint_mode", "weight_overrides", "_stall_counts",
    "_step_supports_amp_scaling", "_rounding_seed", "_rounding_step", "_seed_shared", "_policy_ready", "_kept_formats_unchecked",
    "format_changes",
)  # fmt: skip
MASK64 = (1 << 64) - 1
# Why torch.compile does not trace a quantized optimizer's step (torch.compiler.disable): it plans its paths in Python and
# runs its own C++, compiled and Triton kernels (traced, the compiled path's mark_dynamic raised inside dynamo).
STEP_NOT_TRACED = "a quantized optimizer's step runs its own C++, compiled and Triton kernels"
# The stall counts of ECO's momentum corrections (``error_feedback="eco"``, ``track_stalls=True``).
FEEDBACK_STALLS = "eco_correction"
# The stall counts of the parameters themselves (``track_stalls=True``): entries whose update was lost to rounding.
WEIGHT_STALLS = "weights"
# The name of the stochastic-rounding stream of the gradients (``grads=``), next to the states' names.
GRADIENT_STREAM = "grads"


StateOutline = tuple[set[str], float | None]  # a parameter's state names and step count (None: none) before a step


class StepOverflowError(FloatingPointError):
    """A step's state overflowed: fp32 where its format cannot store inf/NaN, or a cast's range (fp16 past 65504, bf16 past
    3.39e38); ``names``: the parameters it happened to. The
    step went on with the other parameters, whose steps are complete; raised once it is done, naming them all."""

    def __init__(self, message: str, names: list[str]) -> None:
        super().__init__(message)
        self.names = names


def raise_overflows(errors: list[StepOverflowError]) -> None:
    """Raise ``errors`` (collected while the step went on) as one ``StepOverflowError``; nothing where there are none."""
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise StepOverflowError("; ".join(str(error) for error in errors), [name for error in errors for name in error.names])


@dataclass(frozen=True)
class _Intended:
    """What a tracked step's update intends for one parameter, computed on copies before a path that does not count
    stalls itself steps it (``QuantizedStates._intended_updates``): the parameter, its param group, its local values
    before the step, the entries the update moves (``None``: its ``WEIGHT_STALLS`` are not counted) and, for ECO's
    corrections, ``(θ̃, the updated states before the correction, the state copy the update ran on)``."""

    key: torch.Tensor
    group: dict
    before: torch.Tensor
    moved: torch.Tensor | None
    feedback: tuple[torch.Tensor, dict[str, torch.Tensor], dict] | None


def mix64(*values: int) -> int:
    """A 63-bit seed from integers (splitmix64 chained): stable across processes, unlike ``hash``."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & MASK64)) * 0xBF58476D1CE4E5B9 & MASK64
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB & MASK64
        state ^= state >> 29
    return state >> 1


def several_ranks() -> bool:
    """Whether ``torch.distributed`` runs a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rounding_seed(generator: torch.Generator | None, params: list[torch.Tensor]) -> int:
    """An optimizer's stochastic-rounding seed: a draw from ``generator``, or else the draw torch's global generator
    would give next, taken without advancing it (an optimizer built in place of torch's leaves the dropout masks and the
    data order that follow it as they were), mixed with the parameters' sizes: two optimizers built one after the other
    over parameters of other sizes draw apart; over parameters of the same sizes (an ensemble of equal models), with
    nothing drawn from the global generator between them, they take the same seed and draw alike (give each its own
    ``generator``)."""
    if generator is not None:
        drawn = int(torch.randint(2**62, (1,), generator=generator, device=generator.device))
    else:
        with torch.random.fork_rng(devices=[]):
            drawn = int(torch.randint(2**62, (1,)))
    return mix64(drawn, *(p.numel() for p in params))


def quantize_state(
    fmt: StorageFormat, value: torch.Tensor, rounding: str = "nearest", generator: torch.Generator | None = None
) -> QuantizedTensor:
    """``fmt.quantize(value)``; a float64 state is quantized through fp32 and reads back as float64."""
    if value.dtype != torch.float64:
        return fmt.quantize(value, rounding=rounding, generator=generator)
    quantized = fmt.quantize(value.float(), rounding=rounding, generator=generator)
    quantized.dtype = torch.float64
    return quantized


@contextlib.contextmanager
def suspended_hooks(optimizer: torch.optim.Optimizer, *names: str) -> Iterator[None]:
    """Hide ``optimizer``'s hook dicts ``names`` while torch's own (de)serialization runs, so that we run them around ours."""
    saved = {name: getattr(optimizer, name) for name in names}
    for name in names:
        setattr(optimizer, name, type(saved[name])())
    try:
        yield
    finally:
        for name, hooks in saved.items():
            setattr(optimizer, name, hooks)


def merge_stringified_keys(state: dict) -> dict:
    """``state`` with keys such as ``"0"`` merged into the int key ``0``, recursively, the string-keyed values winning.

    ``torch.distributed.checkpoint.load`` into an optimizer state dict loads tensors in place under the int keys
    but sets non-tensor values (format configs, shapes, checksums) under stringified keys.
    """
    merged = dict(state)
    for key in [k for k in state if isinstance(k, str) and k.isdigit() and int(k) in state]:
        merged[int(key)] = _deep_merge(merged[int(key)], merged.pop(key))
    return merged


def finite_grads(grads: list[torch.Tensor]) -> list[bool]:
    """Whether each gradient holds only finite values: one L1 norm per gradient (defined for empty shards) and one host
    sync for all, then the exact element check only where a norm is not finite (finite values can overflow it)."""
    if not grads:
        return []
    norms_finite = torch.isfinite(torch.stack([norm.float() for norm in torch._foreach_norm(grads, 1)])).tolist()
    return [ok or bool(torch.isfinite(grad).all()) for ok, grad in zip(norms_finite, grads, strict=True)]


# The on/off options that change an update's math, compared at a resume as the numbers are (a checkpoint saved without
# amsgrad resumed into QAdamW(amsgrad=True) trains as plain AdamW).
FLAG_HYPERPARAMETERS = ("amsgrad", "maximize", "nesterov", "decoupled_weight_decay")


def _changed_hyperparameters(saved: dict, configured: dict) -> list[str]:
    """``"key: configured X, checkpoint Y"`` for each hyperparameter a resume takes from the checkpoint (``saved``) that
    differs from the ``configured`` one, leaving out what an LR scheduler moves by design: ``lr`` under a scheduler that
    keeps ``initial_lr`` (that is compared instead), ``betas[0]`` and ``momentum`` where ``OneCycleLR`` or ``CyclicLR``
    cycle them (``base_momentum`` in the group). An lr ``ReduceLROnPlateau`` lowered (it keeps nothing in the group) is
    named with that possibility."""
    cycled = "base_momentum" in saved
    changed = []
    for key in (
        "initial_lr" if "initial_lr" in saved and "initial_lr" in configured else "lr",
        "betas",
        "eps",
        "weight_decay",
        "momentum",
        "dampening",
        *FLAG_HYPERPARAMETERS,
    ):
        if key not in saved or key not in configured or (cycled and key == "momentum"):
            continue
        old, new = saved[key], configured[key]
        if cycled and key == "betas":
            old, new = tuple(old)[1:], tuple(new)[1:]
        if not _same_value(old, new):
            plateau = " (a ReduceLROnPlateau lowers it: then nothing to do)" if key == "lr" and _below(saved[key], configured[key]) else ""
            changed.append(f"{key}: configured {configured[key]!r}, checkpoint {saved[key]!r}{plateau}")
    return changed


def _below(saved: Any, configured: Any) -> bool:
    """Whether a loaded ``lr`` (a number or a one-value tensor) is below the configured one."""
    try:
        return float(saved) < float(configured)
    except (TypeError, ValueError, RuntimeError):
        return False


def _listing(names: list[str]) -> str:
    """``"3 parameter(s): a, b, c"``, the first 8 names."""
    return f"{len(names)} parameter(s): {short_list(names, 8)}"


def _deep_merge(base: Any, update: Any) -> Any:
    if isinstance(base, dict) and isinstance(update, dict):
        return {**base, **{k: _deep_merge(base[k], v) if k in base else v for k, v in update.items()}}
    return update


def like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor laid out like ``param``: a DTensor with its mesh and placements under FSDP2."""
    if isinstance(param, DTensor):
        return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return local


def _is_local_shard(value: Any, param: DTensor) -> bool:
    """Whether ``value`` is a plain (non-DTensor) tensor shaped like this rank's shard of ``param``."""
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.ndim > 0 and value.shape == param.to_local().shape


def dequantized(value: StateValue) -> torch.Tensor:
    """A state as a tensor: quantized states are decoded into a new tensor, plain tensors returned as they are."""
    return value.dequantize() if isinstance(value, QuantizedTensor) else value


def _decoded(value: StateValue, dtype: torch.dtype | None) -> torch.Tensor:
    """``dequantized(value)``, as ``dtype`` (a new tensor) where given."""
    if dtype is None:
        return dequantized(value)
    return value.dequantize(dtype) if isinstance(value, QuantizedTensor) else value.to(dtype, copy=True)


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by ``optimizer.state`` on this rank: every tensor (also in lists, such as LBFGS's history; a DTensor's
    local shard), and every quantized state's codes and scales.

    Works for any ``torch.optim.Optimizer``, so a quantized optimizer can be compared with its fp32 twin.

    Example::

        >>> import torch
        >>> from lightning_qstate import QAdamW, state_nbytes
        >>> model = torch.nn.Linear(1024, 1024, bias=False)
        >>> fp32, int8 = torch.optim.AdamW(model.parameters()), QAdamW(model.parameters(), states="int8")
        >>> for opt in (fp32, int8):
        ...     model(torch.randn(4, 1024)).square().mean().backward()
        ...     opt.step()
        >>> state_nbytes(fp32), state_nbytes(int8)  # bytes: both hold the 4-byte step, int8 also its moments' 8-byte bound
        (8388612, 2121740)
    """
    return sum(_nbytes(state) for state in optimizer.state.values())


def _nbytes(value: Any) -> int:
    """Bytes of the tensors and quantized states in ``value``, also inside lists, tuples and dicts (LBFGS's history)."""
    if isinstance(value, QuantizedTensor):
        return value.nbytes
    if isinstance(value, torch.Tensor):
        return local_tensor(value).nbytes  # a DTensor's nbytes is the full tensor's: this rank holds its shard
    if isinstance(value, Mapping):
        return sum(_nbytes(item) for item in value.values())
    if isinstance(value, list | tuple):
        return sum(_nbytes(item) for item in value)
    return 0


def plain_state_name(dtype: torch.dtype) -> str:
    """How a plain (unquantized) state of ``dtype`` is named beside the formats: ``"fp32"``, ``"bf16"``, ``"fp16"``,
    else the dtype's name (``"float64"``)."""
    return PLAIN_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def state_summary(optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Local (this rank's) totals over the per-element states of ``optimizer``: ``bytes`` stored, ``values``
    held, and ``fp32_bytes`` they would take in fp32. Scalars such as Adam's ``step`` are left out."""
    stored = values = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, QuantizedTensor):
                stored, values = stored + value.nbytes, values + value.numel
            elif isinstance(value, torch.Tensor) and value.ndim > 0:  # a DTensor: its local shard, as the values
                stored, values = stored + local_tensor(value).nbytes, values + local_tensor(value).numel()
    return {"bytes": stored, "values": values, "fp32_bytes": 4 * values}


# Where frames that are not the user's call live: this package and torch (its optimizers' wrappers of step and __init__).
_NOT_THE_CALLER = tuple(
    directory + os.sep
    for directory in (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(os.path.abspath(torch.__file__)))
)
_CONTEXTLIB = os.path.abspath(contextlib.__file__)


def caller_stacklevel() -> int:
    """``stacklevel`` for a warning issued here that points at the user's call: the first frame outside this package,
    torch (its optimizer's wrappers of ``step`` and ``__init__``) and ``contextlib`` (a context manager's exit)."""
    frame, level = sys._getframe(1), 1
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not (path.startswith(_NOT_THE_CALLER) or path == _CONTEXTLIB):
            break
        frame, level = frame.f_back, level + 1
    return level


class QuantizedStates:
    """Mixin holding the state-storage logic; concrete optimizers combine it with a ``torch.optim`` class.

    Subclasses set ``state_names`` and implement ``_update(group, param, grad, states, state)``, which
    applies torch's update to the fp32 ``states`` (a dict of tensors, mutated in place or replaced; a state it drops
    from the dict, unused by this step, keeps its stored codes: a decoded block encoded again can move them), and
    ``_init_state(group, key, param, state)`` to create a parameter's states.
    """

    state_names: tuple[str, ...] = ()
    # The ``error_feedback`` values this optimizer's update supports (``optim/weights.py``), and whether it takes ``weights``.
    error_feedbacks: tuple[str | None, ...] = (None, "eco", "eco_exact")
    weights_supported = True
    # Whether ``track_stalls`` can also count the parameters' own stalls (``WEIGHT_STALLS``): needs the update math here.
    counts_weight_stalls = True
    # Whether tracked steps (``track_stalls``) count them: they run the update once more, on copies, so this is off unless
    # asked for (``PrecisionAdvisor`` turns it on for the fit; set it on the optimizer from plain PyTorch).
    track_weight_stalls = False
    # The paths this optimizer's parameters can take (``kernels.dispatch``), and whether CPU parameters may take the
    # compiled ones (C++, ``torch.compile``); ``optimizer.cpu_compile = False`` sends them to the torch paths.
    step_path_table = PER_PARAMETER_PATHS
    cpu_compile = True

    def _setup_quantized_states(self, policy: QuantizationPolicy, generator: torch.Generator | None) -> None:
        """Add ``policy``'s group options to the defaults and every group (validated), and its step options."""
        self.defaults.update(policy.group_options())
        # the policy's name patterns (overrides, weight_overrides; set by it): matched against groups added later too
        self.name_patterns: dict[str, dict[str, Any]] = {}
        for group in self.param_groups:
            self._complete_group(group)
        self._policy_ready = True
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(
                f"{type(self).__name__}: generator= must be a torch.Generator (the stochastic-rounding seed) or None, got {generator!r}"
            )
        self.track_stalls = policy.track_stalls
        self.nonfinite = policy.nonfinite
        self.generator = generator
        self.nonfinite_skips = 0
        self.skipped_steps = 0
        self.state_overrides: dict[torch.Tensor, StatesSpec] = {}
        # counts changes of the formats the states are or will be stored in (reencode_state, a new plan of AdaptiveBitWidth):
        # PrecisionAdvisor advises again when it moves
        self.format_changes = 0
        # the policy's ``overrides`` as configured (``state_overrides`` also takes an AdaptiveBitWidth plan): checkpoints record these
        self.configured_overrides: dict[torch.Tensor, StatesSpec] = {}
        self.weight_overrides: dict[torch.Tensor, str | None] = {}  # per-parameter ``weights`` (QuantizationPolicy.weight_overrides)
        self.module_names: dict[torch.Tensor, str] = {}  # parameter names from the module (QuantizationPolicy.apply)
        self.full_numels: dict[torch.Tensor, int] = {}  # full sizes of parameters that are local views (FSDP1), see resolve_format
        self.shard_indices: dict[torch.Tensor, int] = {}  # which shard of each FSDP1 view this rank holds (_shard_index)
        self.checkpoint_mode: CheckpointMode = "packed"
        self._stall_counts: dict[tuple[torch.Tensor, str], torch.Tensor] = {}
        self._step_supports_amp_scaling = False  # a GradScaler must unscale the grads before our step
        # Stochastic rounding draws from generators seeded by (seed, step, parameter, state): reproducible from the seed
        # alone, so a checkpoint that holds both resumes exactly (see ``rounding_generator``).
        self._rounding_seed = rounding_seed(generator, [p for group in self.param_groups for p in group["params"]])
        self._rounding_step = 0
        self._seed_shared = False  # rank 0's seed taken under torch.distributed (_share_rounding_seed)
        self._kept_formats_unchecked = False  # set by load_state_dict: _check_kept_formats at the next step
        policy.attach_overrides(self)

    def __getstate__(self) -> dict[str, Any]:
        """torch's pickled state plus the attributes this mixin adds (``copy.deepcopy`` and ``pickle`` keep them)."""
        state = super().__getstate__()
        state.update({name: self.__dict__[name] for name in QSTATE_ATTRIBUTES if name in self.__dict__})
        return state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's ``add_param_group``, then the same checks and policy defaults as the constructor's groups; a group
        they refuse is not added (as torch's own checks do not add it)."""
        super().add_param_group(param_group)
        if getattr(self, "_policy_ready", False):  # during torch's __init__ the policy defaults are not set yet
            group = self.param_groups[-1]
            overrides = (self.state_overrides, self.configured_overrides, self.weight_overrides)
            before = [{param: chosen[param] for param in group["params"] if param in chosen} for chosen in overrides]
            try:
                self._complete_group(group)
            except Exception:  # the group, and the overrides its patterns matched, as before the call
                self.param_groups.pop()
                for chosen, kept in zip(overrides, before, strict=True):
                    for param in group["params"]:
                        chosen.pop(param, None)
                    chosen.update(kept)
                raise

    def _complete_group(self, group: dict) -> None:
        for key in GROUP_OPTIONS:
            group.setdefault(key, self.defaults.get(key, POLICY_DEFAULTS[key]))
        as_python_counts(group)
        validate_policy(group, self.state_names or None, type(self).__name__)
        owner = type(self).__name__
        if group.get("differentiable"):
            raise ConfigurationError(
                f"{owner}: differentiable=True is not supported (quantized states are not differentiable); use the torch optimizer"
            )
        self._check_weight_options(group, owner)
        for param in group["params"]:
            if torch.is_complex(param):
                raise ConfigurationError(f"{owner}: complex parameters are not supported; give them to a separate torch optimizer")
            if param.dtype not in PARAM_DTYPES:
                raise TypeError(
                    f"{owner}: parameters of dtype {param.dtype} are not supported; use one of {[str(d) for d in PARAM_DTYPES]}"
                )
            self._check_param(param, owner)
        self._match_name_patterns(group, owner)
        self.check_weight_grids([group])

    def _match_name_patterns(self, group: dict, owner: str) -> None:
        """The policy's ``overrides`` and ``weight_overrides`` patterns applied to a group added after construction, as
        to the constructor's parameters: matched against its ``param_names``, else the module's names
        (``QuantizationPolicy.apply``)."""
        name_patterns = self.__dict__.get("name_patterns")  # an optimizer pickled before they were kept has none
        if not name_patterns:
            return
        given = group.get("param_names")
        names = list(given) if given else [self.module_names.get(param) for param in group["params"]]
        unnamed = [tuple(param.shape) for name, param in zip(names, group["params"], strict=True) if name is None]
        if unnamed:
            raise ValueError(
                f"{owner}: the policy's {' and '.join(name_patterns)} patterns match parameter names, and the added group's "
                f"parameters of shapes {unnamed} have none; add the group with param_names (as torch's named groups)"
            )
        named = list(zip(names, group["params"], strict=True))
        for option, patterns in name_patterns.items():
            matched = match_patterns(named, patterns)
            if option == "overrides":
                self.state_overrides.update(matched)
                self.configured_overrides.update(matched)
            else:
                self.weight_overrides.update(matched)

    def _check_param(self, param: torch.Tensor, owner: str) -> None:
        """What an optimizer's own math needs of a parameter (its constructor's checks, which ``add_param_group`` skips)."""

    def check_weight_grids(self, groups: list[dict] | None = None) -> None:
        """Resolve the weight grid of every parameter of ``groups`` (default: all), ``weight_overrides`` included, so that
        one its dtype cannot hold raises here rather than at the first step (see ``optim.weights.weight_grid``)."""
        for group in self.param_groups if groups is None else groups:
            for key in group["params"]:
                try:
                    self.weight_grid(group, key)
                except (TypeError, ValueError) as error:
                    kind = ConfigurationError if isinstance(error, ValueError) else TypeError
                    raise kind(f"{type(self).__name__}: parameter of shape {tuple(key.shape)}: {error}") from None

    def _check_weight_options(self, group: dict, owner: str) -> None:
        """Refuse ``weights``/``error_feedback`` values this optimizer's update cannot honour (subclasses add their rules)."""
        if not self.weights_supported and (group["weights"] is not None or group["error_feedback"] is not None):
            raise ConfigurationError(
                f"{owner}: weights= and error_feedback= need the update math of QAdam, QAdamW, QSGD or QMuon; the wrapped "
                "optimizer updates its parameters itself. Use one of those, or leave both None"
            )
        if group["error_feedback"] not in self.error_feedbacks:
            raise ConfigurationError(
                f"{owner}: error_feedback={group['error_feedback']!r} is not supported here (supported: {self.error_feedbacks}); "
                "'eco' needs an update linear in a momentum state (QSGD, QAdam, QAdamW); 'eco_exact' works for any"
            )
        momentum = self.state_names[0] if self.state_names else None
        stored_as = format_name_for(group, momentum)
        if group["error_feedback"] == "eco" and group["rounding"] == "nearest" and stored_as != "fp32":
            warnings.warn(
                f"{owner}: error_feedback='eco' feeds the weights' rounding error into {momentum!r}, stored in "
                f"{stored_as!r} with rounding='nearest', which drops every correction under half a "
                "code step (track_stalls=True counts them as 'eco_correction'); pass rounding='stochastic' (it keeps them in "
                "expectation), or keep the momentum in fp32",
                UserWarning,
                stacklevel=caller_stacklevel(),
            )

    # --- the step -------------------------------------------------------------------------------------
    @torch.compiler.disable(reason=STEP_NOT_TRACED)
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimization step, parameter by parameter; ``closure`` re-evaluates the loss under grad mode. Not traced
        by ``torch.compile`` (``torch.compile(optimizer.step)`` or a compiled training step run it as it is)."""
        loss = self._evaluate(closure)
        self._check_before_stepping()
        with self._nonfinite_policy():
            self._step_params()
        return loss

    def _check_fsdp1_fitted(self) -> None:
        """At the first step, and the first after a load: refuse FSDP1's parameters (flat parameters, or views with
        ``use_orig_params=True``) that ``QuantizationPolicy.apply`` has not fitted the optimizer to. Without their full
        sizes and shard layout every rank would decide ``min_quant_size`` from its own part, shards would draw one
        stochastic-rounding stream, a NaN in one rank's part would skip the parameter on that rank only, and FSDP1 would
        fail to gather the packed states into a checkpoint (or write one that cannot be loaded)."""
        if self.full_numels or not (self._rounding_step == 0 or self._kept_formats_unchecked):
            return
        if any(getattr(p, "_fsdp_flattened", False) for group in self.param_groups for p in group["params"]):
            raise RuntimeError(
                f"{type(self).__name__} holds parameters of an FSDP1 (FullyShardedDataParallel) model: call "
                "lightning_qstate.QuantizationPolicy().apply(optimizer, fsdp_model) on every rank after building the optimizer "
                "(the Lightning plugins and QuantizedOptimizerStates do), so that it decides from the full parameters, "
                "rounds each shard with its own stream and saves fp32 checkpoints FSDP1 can gather; or shard with FSDP2 "
                "(fully_shard)"
            )

    def _check_before_stepping(self) -> None:
        """The checks of a step that follows a start or a load (each returns at once otherwise)."""
        self._check_fsdp1_fitted()
        self._check_min_quant_size()
        self._check_weight_options_used()
        self._check_kept_formats()
        if not self._seed_shared and several_ranks() and self._rounds_stochastically():  # groups scanned only under several ranks
            self._share_rounding_seed()

    def _rounds_stochastically(self) -> bool:
        """Whether a step draws stochastic-rounding bits: a group's ``rounding`` (states, ``grads=``), or a weight grid's."""
        grids = any(weights is not None for weights in self.weight_overrides.values())
        return any(
            group.get("rounding") == "stochastic"
            or (group.get("weight_rounding") == "stochastic" and (grids or group.get("weights") is not None))
            for group in self.param_groups
        )

    def _share_rounding_seed(self) -> None:
        """Under ``torch.distributed`` with more than one rank: rank 0's stochastic-rounding seed for every rank, a broadcast
        every rank joins (``QuantizationPolicy.apply``, and the first step that rounds stochastically after construction or
        a load), so that replicated parameters and states (DDP) round alike. Ranks seeded apart (a seed per rank, as for
        data augmentation) drew different seeds at construction, and their replicas drifted apart without an error."""
        if several_ranks():
            seed = [self._rounding_seed]
            dist.broadcast_object_list(seed, src=0)
            self._rounding_seed = seed[0]
            self._seed_shared = True

    def _check_kept_formats(self) -> None:
        """At the first step after ``load_state_dict``: warn where a loaded state kept a format (name and block size) that the configured
        policy (``states=``, ``overrides``, ``state_overrides``) does not give it. A checkpoint's per-parameter formats
        (``AdaptiveBitWidth``'s plan, a ``reencode_state``) are kept on load, so that the callback, which sets its plan
        only at the start of training, resumes exactly; resumed without it, those states would keep them for good."""
        if not self._kept_formats_unchecked:
            return
        self._kept_formats_unchecked = False
        kept: Counter[tuple[str, str]] = Counter()
        for group in self.param_groups:
            for key in group["params"]:
                for name, value in self.state.get(key, {}).items():
                    if self._per_value_state(key, name, value):
                        target = self._policy_format(group, key, name)
                        stored = value.format if isinstance(value, QuantizedTensor) else None
                        if _format_key(stored) != _format_key(target):  # a version 1 state's fp32 scales pass
                            kept[_format_labels(stored, target)] += 1
        if kept:
            counts = ", ".join(f"{count} in {stored} (configured: {configured})" for (stored, configured), count in sorted(kept.items()))
            warnings.warn(
                f"{type(self).__name__}: {sum(kept.values())} loaded state(s) keep the checkpoint's formats, which the configured "
                f"policy does not give them: {counts}. The run that saved them chose them (AdaptiveBitWidth, reencode_state, "
                "another block_size or sharding); resume with the AdaptiveBitWidth callback to go on adapting them, or call "
                "reencode_state to convert them",
                UserWarning,
                stacklevel=caller_stacklevel(),
            )

    def _check_min_quant_size(self) -> None:
        """At the first step: warn where ``states=`` asks for a format and ``min_quant_size`` keeps every parameter it
        names in fp32 (a small model under the default 4096: bitsandbytes and torchao keep such states in fp32 silently).
        Decided from the full parameter sizes (``full_numels``: FSDP1's views), so every rank warns alike; the warning
        points at the caller of ``step``."""
        if self._rounding_step != 0:
            return
        asked = [(group, p) for group in self.param_groups for p in group["params"] if self._states_asked(group, p)]
        numels = [self.full_numels.get(p, p.numel()) for _, p in asked]
        if not asked or any(numel >= group["min_quant_size"] for (group, _), numel in zip(asked, numels, strict=True)):
            return
        limits = sorted({group["min_quant_size"] for group, _ in asked})
        warnings.warn(
            f"{type(self).__name__}: no state will be quantized: each of the {len(asked)} parameter(s) whose states= name a "
            f"format has fewer values (the largest: {max(numels)}) than min_quant_size={' / '.join(map(str, limits))}, "
            "so all states stay unquantized (in the parameters' dtype); pass a smaller min_quant_size (0: every parameter) to "
            "quantize them",
            UserWarning,
            stacklevel=caller_stacklevel(),
        )

    def _check_weight_options_used(self) -> None:
        """At the first step: warn where a param group sets ``error_feedback`` or ``weight_rounding="nearest"`` and none of
        its parameters' new values is rounded (``weights=None`` or ``"fp32"`` and fp32 parameters, no ``weight_overrides``):
        those act on the rounding of the weights, so they would change nothing (``error_feedback="eco"`` without
        ``weights=`` trains as plain Adam, at the cost of ECO's step); likewise a ``weight_block`` other than ``"row"``
        where no parameter is on a block-scaled grid."""
        if self._rounding_step != 0:
            return
        for index, group in enumerate(self.param_groups):
            options = [f"{name}={group[name]!r}" for name in ("error_feedback", "weight_rounding") if group[name] != POLICY_DEFAULTS[name]]
            grids = [(key, self.weight_grid(group, key)) for key in group["params"]]
            rounded = any(grid is not None and not (grid.cast_dtype == torch.float32 and key.dtype == torch.float32) for key, grid in grids)
            if options and not rounded:  # an fp32 grid of an fp32 parameter rounds nothing
                warnings.warn(
                    f"{type(self).__name__}: {' and '.join(options)} of param group {index} act on weight grids, and none of its "
                    "parameters' values is rounded (weights=None or 'fp32', fp32 parameters): they change nothing; give weights= "
                    "(e.g. 'bf16', 'fp8_e4m3') to train without fp32 master weights, or leave them out",
                    UserWarning,
                    stacklevel=caller_stacklevel(),
                )
            blocked = any(grid is not None and grid.cast_dtype is None for _, grid in grids)
            if group["weight_block"] != POLICY_DEFAULTS["weight_block"] and not blocked:
                warnings.warn(
                    f"{type(self).__name__}: weight_block={group['weight_block']!r} of param group {index} sets the scale groups of "
                    "block-scaled weight grids (weights='fp8_e4m3', 'int8', ...), and none of its parameters is on one (bf16, fp16 "
                    "and fp32 grids have no scales): it changes nothing",
                    UserWarning,
                    stacklevel=caller_stacklevel(),
                )

    def _states_asked(self, group: dict, param: torch.Tensor) -> bool:
        """Whether ``param``'s ``states=`` (its group's, or its override) name a format other than fp32 for any state."""
        override = self.state_overrides.get(param)
        spec = group["states"] if override is None else override
        return any(name != "fp32" for name in (spec.values() if isinstance(spec, Mapping) else [spec]))

    @staticmethod
    def _evaluate(closure):
        """Run the closure (if any) with gradients enabled, before any gradient is checked."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    @contextlib.contextmanager
    def _nonfinite_policy(self) -> Iterator[None]:
        """Round the gradients to their groups' ``grads`` formats (``_round_grads``), apply the non-finite-gradient
        policy around one step, and advance the stochastic-rounding step counter.

        ``"skip"``: a parameter whose gradient holds inf/NaN is not updated and its states are left unchanged;
        ``"skip_step"``: no parameter is updated if any gradient holds inf/NaN (as ``GradScaler`` does);
        ``"raise"``: ``FloatingPointError``. Skips are counted (``nonfinite_skips``: parameter updates,
        ``skipped_steps``: whole steps) and reported in one warning per step that names the parameters. Where the
        parameters are shards (FSDP1, FSDP2), every rank decides from gradients checked on all ranks, so a NaN in
        one rank's shard skips that parameter everywhere.
        """
        self._skipped: list[torch.Tensor] = []
        self._round_grads()
        withheld = self._withheld_by_policy()
        grads = {param: param.grad for param in withheld}
        for param in withheld:
            param.grad = None
        try:
            yield
        finally:
            for param, grad in grads.items():
                param.grad = grad
            self._rounding_step += 1
            self._report_skips()

    def _round_grads(self) -> None:
        """``grads=``: every group's gradients rounded to its format (``_quantize_grads``) before the non-finite policy
        checks them, so that one the rounding overflows (fp16 above 65504) meets the policy as any non-finite gradient
        does: ``"skip_step"`` and the cross-rank check of sharded parameters included."""
        for group in self.param_groups:
            if group["grads"] is not None:
                self._quantize_grads(group, self._params_with_grads(group))

    def _withheld_by_policy(self) -> list[torch.Tensor]:
        """Parameters whose gradients the whole-step or cross-rank check withholds from this step (counted as skipped)."""
        sharded = self.holds_shards()
        if self.nonfinite == "skip" and not sharded:
            return []  # each path checks its own gradients ("raise" and "skip_step": before any parameter is written)
        params = [p for group in self.param_groups for p in group["params"]]
        finite = self._finite_flags(params)
        without_grad = torch.tensor([int(p.grad is None) for p in params], dtype=finite.dtype, device=finite.device)
        flags = torch.cat([finite, without_grad])
        if sharded:  # one collective: a gradient non-finite on any rank, a parameter with a gradient on any rank
            dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        bad = [p for p, ok in zip(params, flags[: len(params)].tolist(), strict=True) if not ok]
        if not bad:
            return []
        if self.nonfinite == "raise":
            self._raise_nonfinite(bad)
        withheld = [p for p in params if p.grad is not None] if self.nonfinite == "skip_step" else bad
        if self.nonfinite == "skip_step":
            self.skipped_steps += 1
        self._skipped += bad
        # parameters, counted alike on every rank (an FSDP1 view empty on this rank has no local gradient)
        self.nonfinite_skips += len(params) - int(flags[len(params) :].sum()) if self.nonfinite == "skip_step" else len(bad)
        return withheld

    def holds_shards(self) -> bool:
        """Whether the parameters are shards of a process group's (FSDP1's flat views, FSDP2's DTensors): a full tensor's
        figures (a norm, a non-finite check) need every rank's part."""
        return dist.is_available() and dist.is_initialized() and (bool(self.full_numels) or self._has_dtensors())

    def _has_dtensors(self) -> bool:
        return any(isinstance(p, DTensor) for group in self.param_groups for p in group["params"])

    @staticmethod
    def _finite_flags(params: list[torch.Tensor]) -> torch.Tensor:
        """int32 ``(len(params),)``: 1 where the (local) gradient is finite or absent (``finite_grads``)."""
        indices = [i for i, p in enumerate(params) if p.grad is not None]
        flags = torch.ones(len(params), dtype=torch.int32, device=local_tensor(params[0]).device if params else "cpu")
        for i, ok in zip(indices, finite_grads([local_tensor(params[i].grad) for i in indices]), strict=True):
            flags[i] = int(ok)
        return flags

    def _grad_is_finite(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        """Apply the per-parameter non-finite-gradient policy to one parameter.

        One fp32-accumulated sum decides (inf and NaN propagate into it); only a non-finite sum, which an
        overflow of finite values can also give, pays for the exact element-wise check.
        """
        if bool(torch.isfinite(torch.sum(grad, dtype=torch.float32))) or bool(torch.isfinite(grad).all()):
            return True
        self._skip_nonfinite_grad(param)
        return False

    def _skip_nonfinite_grad(self, param: torch.Tensor) -> None:
        """Record a parameter whose gradient holds inf/NaN (reported once per step), or raise for ``nonfinite="raise"``."""
        if self.nonfinite == "raise":
            self._raise_nonfinite([param])
        self.nonfinite_skips += 1
        self._skipped.append(param)

    def _raise_nonfinite(self, params: list[torch.Tensor]) -> None:
        names = self.param_names()
        raise FloatingPointError(
            f"{type(self).__name__}: non-finite gradient in {_listing([names[p] for p in params])} (nonfinite='raise')"
        )

    def _report_skips(self) -> None:
        if not self._skipped:
            return
        names = self.param_names()
        what = (
            "the whole step was skipped" if self.nonfinite == "skip_step" else "their updates were skipped and their states left unchanged"
        )
        warnings.warn(
            f"{type(self).__name__}: non-finite gradient in {_listing([names[p] for p in self._skipped])}; {what} "
            f"(nonfinite={self.nonfinite!r}; {self.nonfinite_skips} parameter updates skipped so far)",
            RuntimeWarning,
            stacklevel=caller_stacklevel(),
        )

    def _check_grad(self, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            raise RuntimeError(
                f"{type(self).__name__} does not support sparse gradients (its states are stored dense); give the parameters with "
                "sparse gradients (sparse embeddings) to a separate torch optimizer that steps them: torch.optim.SparseAdam or SGD"
            )

    def rounding_generator(self, key: torch.Tensor, name: str, device: torch.device) -> torch.Generator:
        """The generator stochastic rounding of state ``name`` of parameter ``key`` draws from at this step.

        Seeded from (the optimizer's seed, its step count, the parameter's position, the state's name, and which shard
        this rank holds: ``_shard_index``), so runs reproduce from the seed (``rounding_seed``:
        from ``generator``, or torch's global generator without advancing it, at construction) and resume exactly from a checkpoint, which
        stores the seed and the step count. Replicated parameters (DDP) draw the same stream on every rank, so their
        replicas round alike and stay identical.
        """
        seed = mix64(self._rounding_seed, self._rounding_step, self._position(key), self._shard_index(key), *name.encode())
        return torch.Generator(device=device).manual_seed(seed)

    def _position(self, key: torch.Tensor) -> int:
        """``key``'s position among all the parameters of all param groups, in order."""
        positions = self.__dict__.get("_positions")
        if positions is None or key not in positions:  # built once, and again after add_param_group
            positions = self._positions = {p: i for i, p in enumerate(p for group in self.param_groups for p in group["params"])}
        return positions[key]

    def _kernel_seeds(self, key: torch.Tensor, name: str, count: int = 1) -> list[int]:
        """``count`` seeds of the C++ kernel's counter-based stochastic rounding of state ``name`` of parameter ``key`` at
        this step: ``mix64`` of the stream's base (``mix64`` of the optimizer's seed, the parameter's position and shard
        index and the name, as ``rounding_generator`` mixes them; made once per stream and seed), the step count and the
        seed's index. Reproducible from the seed alone and resumed exactly from a checkpoint, as the generator's draws
        (a few µs per parameter less than drawing from a generator, which the native path would pay every step)."""
        bases = self.__dict__.setdefault("_stream_bases", {})
        base = bases.get((key, name))
        if base is None or base[0] != self._rounding_seed:
            mixed = mix64(self._rounding_seed, self._position(key), self._shard_index(key), *name.encode())
            base = bases[key, name] = (self._rounding_seed, mixed)
        return [mix64(base[1], self._rounding_step, index) for index in range(count)]

    def _shard_index(self, key: torch.Tensor) -> int:
        """Which shard of ``key`` this rank holds: 0 for a replicated parameter (DDP, a DTensor's ``Replicate`` mesh
        dimensions, FSDP1's ``NO_SHARD``), the mesh coordinates of a DTensor's ``Shard`` dimensions (FSDP2; the rank on a
        1-D mesh), the rank in FSDP1's shard group for its views (``shard_indices``: the world's for ``FULL_SHARD``, a
        node's for ``HYBRID_SHARD``). Replicas draw alike and stay identical; shards draw independently."""
        if isinstance(key, DTensor):
            coordinate = key.device_mesh.get_coordinate() or []
            index = 0
            for position, placement in enumerate(key.placements):
                if placement.is_shard() and position < len(coordinate):
                    index = index * key.device_mesh.size(position) + coordinate[position]
            return index
        return self.shard_indices.get(key, 0)

    def _step_params(self) -> None:
        """Step every parameter that has a gradient: each param group's parameters are planned onto their paths
        (``_planned_paths``) and each path runs once per group (``_run_path``); ``step_paths()`` tells them. Where a
        state overflows (``StepOverflowError``) every other parameter is still stepped, then the error is raised."""
        taken: dict[torch.Tensor, StepPath] = {}
        self._taken_paths = taken
        errors = []  # a state that overflows stops no other parameter's step: raised at the end, naming them all
        outlines: dict[torch.Tensor, StateOutline] = {}  # sharded: what _agree_on_overflows resets to
        sharded = self.holds_shards()
        for index, group in enumerate(self.param_groups):
            keys = self._params_with_grads(group)
            if sharded:
                outlines.update(self._state_outlines(keys))
            by_path: dict[StepPath, list[torch.Tensor]] = {}
            for key, path in zip(keys, self._planned_paths(index, group, keys), strict=True):
                by_path.setdefault(path, []).append(key)
                taken[key] = path
            for path, members in by_path.items():
                try:
                    self._run_path(path, group, members)
                except StepOverflowError as error:
                    errors.append(error)
            for key in keys:  # a parameter that got no state (SGD without momentum) gets no entry, as in torch
                if not self.state[key]:
                    del self.state[key]
        if sharded:
            errors = self._agree_on_overflows(errors, outlines)
        raise_overflows(errors)

    def _state_outlines(self, keys: list[torch.Tensor]) -> dict[torch.Tensor, StateOutline]:
        """Per parameter of ``keys``, before its step: the names of its states and its step count (``None``: none)."""
        outlines = {}
        for key in keys:
            state = self.state.get(key, {})
            outlines[key] = set(state), float(state["step"]) if "step" in state else None
        return outlines

    def _agree_on_overflows(self, errors: list[StepOverflowError], outlines: dict[torch.Tensor, StateOutline]) -> list[StepOverflowError]:
        """The error every rank raises where the parameters are shards (``holds_shards``), given this rank's ``errors``:
        one all-reduce of a flag per parameter, every step; a parameter whose state overflowed on any rank's shard is
        reset on every rank that stepped it (``outlines``: its state names and step count before the step): its per-value
        states zeroed, formats kept, those its step created dropped, its step counted. Whatever path each rank's shard
        took (the reference path puts its states back, a fused step zeroes them; the path can differ by shard size),
        the shards keep one state and one step count; the error names the parameters in their order on every rank,
        this rank's own errors as its cause. Without it one rank raised while the others stepped on (a hang at the
        next collective)."""
        names = self.param_names()
        params = [p for group in self.param_groups for p in group["params"]]
        local = {name for error in errors for name in error.names}
        flags = torch.tensor([int(names[p] in local) for p in params], dtype=torch.int32, device=local_tensor(params[0]).device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        overflowed = [p for p, flag in zip(params, flags.tolist(), strict=True) if flag]
        if not overflowed:
            return errors
        for param in overflowed:
            if param in outlines and param in self.state:
                self._reset_after_overflow(param, *outlines[param])
        listed = [names[p] for p in overflowed]
        error = StepOverflowError(
            f"{type(self).__name__}: the states of {_listing(listed)} overflowed during the step (in this rank's shard or "
            "another's); on every rank their states were reset (zeroed, formats kept) and the step counted, so that the "
            "shards keep one state. Lower the learning rate or clip the gradients",
            listed,
        )
        error.__cause__ = errors[0] if errors else None
        return [error]

    def _reset_after_overflow(self, key: torch.Tensor, names: set[str], step: float | None) -> None:
        """``key``'s state as a shard of an overflowed parameter ends (``_agree_on_overflows``): the states it had before
        the step (``names``) zeroed where they hold a value per parameter value, the others dropped, its step count
        ``step + 1``."""
        state = self.state[key]
        for name in [name for name in state if name not in names]:
            del state[name]
        if step is not None and "step" in state:  # first: the moments' bound restarts from the counted step
            _set_step_count(state, step + 1)
        self.reset_states(key, [name for name, value in state.items() if self._per_value_state(key, name, value)])
        if not state:
            del self.state[key]

    def _planned_paths(self, index: int, group: dict, keys: list[torch.Tensor]) -> list[StepPath]:
        """The paths of ``keys`` (of ``group``, ``param_groups[index]``) by ``kernels.dispatch.plan_group`` over
        ``step_path_table``: planned again only where what the requirements read differs from the group's last plan
        (each parameter's ``dispatch.plan_inputs``, the group's ``PLAN_OPTIONS``, the optimizer's switches, the
        dispatch module's), else the last plan (planning every parameter each step costs more than a small one's step)."""
        rows = []
        for key in keys:
            param, state = local_tensor(key), self.state[key]
            if not state:
                self._init_state(group, key, param, state)
            rows.append(
                (param, local_tensor(key.grad), state, self.weight_grid(group, key, param), self._created_states(group, key, state))
            )
        inputs = (
            self.step_path_table, self.cpu_compile, dispatch.TRITON_DEVICE_TYPES, dispatch.FUSED_MIN_NUMEL,
            dispatch.native_kernel_available, *plan_options(group), *(plan_inputs(*row) for row in rows),
        )  # fmt: skip
        plans = self.__dict__.setdefault("_plans", {})
        if index in plans and plans[index][0] == inputs:
            return plans[index][1]
        if any(is_exported(value) for _, _, state, _, _ in rows for value in state.values()):  # read on a new plan only
            self._import_written_states()
            return self._planned_paths(index, group, keys)
        candidates = [
            Candidate(param, grad, group, state, self.cpu_compile, weights, created) for param, grad, state, weights, created in rows
        ]
        paths = plan_group(self.step_path_table, candidates)
        plans[index] = (inputs, paths)
        return paths

    def _created_states(self, group: dict, key: torch.Tensor, state: dict) -> dict[str, StorageFormat | None]:
        """The states that stepping parameter ``key`` (of ``group``, with its initialized ``state``) creates, with the
        policy's format of each (``None``: plain); none here (``_init_state`` makes them)."""
        return {}

    def _quantize_grads(self, group: dict, keys: list[torch.Tensor]) -> None:
        """``grads=``: replace each finite gradient of ``keys`` (of ``group``) in place by its rounding to the group's
        gradient format (``policy.gradient_format``), with the group's ``rounding``, before any check or step path.

        Stochastic rounding draws from the ``"grads"`` stream of ``rounding_generator``, so a resumed run rounds alike.
        A gradient holding inf/NaN is left as it is for the non-finite policy (a finite one that overflows the format, as
        an fp16 gradient above 65504 does, becomes inf and meets that policy too). Block-scaled formats cut their blocks
        from the local tensor (this rank's shard under FSDP). One finiteness check (a norm per gradient, one host sync)
        per group that has a format; groups without one pay nothing.
        """
        fmt = gradient_format(group)
        if fmt is None or not keys:
            return
        grads = [local_tensor(key.grad) for key in keys]
        stochastic = group["rounding"] == "stochastic"
        for key, grad, finite in zip(keys, grads, finite_grads(grads), strict=True):
            if finite:
                generator = self.rounding_generator(key, GRADIENT_STREAM, grad.device) if stochastic else None
                grad.copy_(quantize_state(fmt, grad, group["rounding"], generator).dequantize(grad.dtype))

    def _run_path(self, path: StepPath, group: dict, keys: list[torch.Tensor]) -> None:
        """Step ``keys`` (of ``group``) on ``path``; this base runs ``reference`` (subclasses add their fast paths)."""
        if path is not StepPath.REFERENCE:
            raise NotImplementedError(f"{type(self).__name__} has no {path} path")
        self._step_each(group, keys, self._step_param)

    def _step_each(self, group: dict, keys: list[torch.Tensor], step: Callable[..., None]) -> None:
        """``_step_checked`` of every one of ``keys`` (of ``group``) with ``step``: a parameter whose state overflows does
        not stop the others (its ``StepOverflowError`` is raised once they are stepped)."""
        errors = []
        for key in keys:
            try:
                self._step_checked(group, key, step)
            except StepOverflowError as error:
                errors.append(error)
        raise_overflows(errors)

    def step_paths(self) -> dict[str, str]:
        """``{parameter name: path}`` of the last step: ``"native"``, ``"triton"``, ``"compiled"``, ``"multi_tensor"``
        or ``"reference"`` (``kernels.dispatch``); parameters without a gradient at that step are absent. Names are
        as ``param_names()`` gives them."""
        names = self.param_names()
        return {names[key]: str(path) for key, path in self.__dict__.get("_taken_paths", {}).items()}

    def _params_with_grads(self, group: dict) -> list[torch.Tensor]:
        """The params of ``group`` that have a gradient (checked: dense)."""
        keys = [key for key in group["params"] if key.grad is not None]
        for key in keys:
            self._check_grad(key.grad)
        return keys

    def _step_checked(self, group: dict, key: torch.Tensor, step: Callable[..., None]) -> None:
        """``step(group, key, param, grad, state)`` of one parameter unless the non-finite-gradient policy skips it."""
        if self._grad_is_finite(key, local_tensor(key.grad)):  # this rank's part: under sharding the ranks agreed before
            step(group, key, local_tensor(key), local_tensor(key.grad), self.state[key])

    def _step_param(self, group: dict, key: torch.Tensor, param: torch.Tensor, grad: torch.Tensor, state: dict) -> None:
        """Step one parameter. ``key`` is the parameter as the optimizer holds it (a DTensor under FSDP2: all
        decisions use its full shape); ``param`` and ``grad`` are the local tensors the math runs on. Where a quantized
        state cannot store its new values (``StepOverflowError``), the parameter keeps its states, step count and
        stall counts of before the step (``_undo_record``); its values stay as the update left them (inf/NaN where the
        math gives them, as torch's own optimizer's would)."""
        grid = self.weight_grid(group, key, param)
        decode_as = torch.float32 if grid is not None else None  # the update runs in fp32 (module ``optim.weights``)
        states = {name: _decoded(state[name], decode_as) for name in self.state_names if state.get(name) is not None}
        before = {name: value.clone() for name, value in states.items() if self.track_stalls and isinstance(state[name], QuantizedTensor)}
        undo = self._undo_record(key, state) if any(isinstance(v, QuantizedTensor) for v in state.values()) else None
        targets = self._intended_updates(group, [key]) if grid is None else []  # a grid's update counts its weights' stalls itself
        try:
            if grid is None:
                self._update(group, param, grad, states, state)
            else:
                self._update_weights(group, key, param, grad, states, state, grid)
            stored = {name: self._store(group, key, name, value, state.get(name), decode_as) for name, value in states.items()}
        except StepOverflowError:
            if undo is not None:
                undo()
            raise
        self._count_intended_stalls(targets)
        for name, value in stored.items():
            if name in before:
                self._count_stalls(key, name, state[name], before[name], states[name], value)
            state[name] = value

    def _undo_record(self, key: torch.Tensor, state: dict) -> Callable[[], None]:
        """What puts ``state`` (of parameter ``key``) and its stall counts back as they are now, after a step that raised:
        the dict's entries (a step replaces a quantized state, not changes it), the values of its 0-d tensors (``step``,
        which torch's update counts in place) and, beside a quantized state (the only kind that overflows), of its plain
        per-value tensors (``_per_value_state``: updated in place, e.g. a wrapped optimizer's momentum kept fp32: a copy
        per step), the counts."""
        entries = dict(state)
        beside = any(isinstance(value, QuantizedTensor) for value in state.values())
        values = {
            name: value.clone()
            for name, value in state.items()
            if isinstance(value, torch.Tensor) and (value.ndim == 0 or (beside and self._per_value_state(key, name, value)))
        }
        names = [(key, name) for name in (*self.state_names, WEIGHT_STALLS, FEEDBACK_STALLS)]
        counts = {name: self._stall_counts[name].clone() for name in names if name in self._stall_counts}

        def undo() -> None:
            state.clear()
            state.update(entries)
            for name, value in values.items():
                entries[name].copy_(value)
            for name in names:
                self._stall_counts.pop(name, None)
            self._stall_counts.update(counts)

        return undo

    def weight_grid(self, group: dict, key: torch.Tensor, param: torch.Tensor | None = None) -> WeightGrid | None:
        """The grid parameter ``key`` (of ``group``) is kept on after a step (``optim.weights``); ``None``: torch's behaviour."""
        return overridden_grid(group, key, local_tensor(key) if param is None else param, self.__dict__.get("weight_overrides"))

    _feeding_back = False  # while _update_on_grid runs for a group whose error_feedback is "eco"

    def _update_on_grid(self, group: dict, param: torch.Tensor, grad: torch.Tensor, states: dict, state: dict) -> None:
        """``_update`` of a parameter on a weight grid, with ``_feeding_back`` set where ECO feeds the rounding error into
        its momentum (Adam's hold leaves that ``m`` alone: ``kernels.bounds.held_moment_bound``'s ``feedback``)."""
        self._feeding_back = group["error_feedback"] == "eco"
        try:
            self._update(group, param, grad, states, state)
        finally:
            self._feeding_back = False

    def _update_weights(
        self, group: dict, key: torch.Tensor, param: torch.Tensor, grad: torch.Tensor, states: dict, state: dict, grid: WeightGrid
    ) -> None:
        """The update without master weights: ``θ̃`` in fp32 from the stored ``θ̂`` (plus ``eco_exact``'s error), then
        ``θ̂ = q(θ̃)`` written into ``param`` and the error ``e = θ̃ − θ̂`` fed back as ``error_feedback`` says. With
        ``track_stalls``, the entries ``θ̃`` moves away from the stored ``θ̂`` and those of them that keep their value (a
        block-scaled grid: their code, ``grid_units``) are counted as ``WEIGHT_STALLS``."""
        feedback = group["error_feedback"]
        master = param.float() if param.dtype != torch.float32 else param.clone()
        if feedback == "eco_exact" and ERROR_STATE in state:
            master += local_tensor(state[ERROR_STATE])
        self._update_on_grid(group, master, grad.float(), states, state)
        stored = self._round_to_grid(group, key, param, master, grid)
        if self.track_stalls and self.track_weight_stalls:  # param still holds the old θ̂; a grid's entries stall when they keep their code
            flat = (param.reshape(-1).float(), master.reshape(-1), stored.reshape(-1).float())
            self._add_stall_counts(key, WEIGHT_STALLS, count_stalls(*flat, grid_units(grid, param), grid_units(grid, stored)))
        error = master.sub_(stored)  # exact where the grid is a dtype's: a value minus its rounding
        param.copy_(stored)
        if feedback == "eco_exact":
            state[ERROR_STATE] = error
        elif feedback == "eco":
            self._feed_back_error(group, key, error, states, state)

    def _round_to_grid(self, group: dict, key: torch.Tensor, param: torch.Tensor, master: torch.Tensor, grid: WeightGrid) -> torch.Tensor:
        """``θ̂ = q(θ̃)``: the new fp32 values ``master`` of parameter ``key`` rounded onto its ``grid`` with the group's
        ``weight_rounding`` (stochastic: from the ``"weights"`` stream of ``rounding_generator``), in ``param``'s dtype."""
        generator = self.rounding_generator(key, "weights", param.device) if group["weight_rounding"] == "stochastic" else None
        return grid.round(master, group["weight_rounding"], generator).to(param.dtype)

    def _feed_back_error(self, group: dict, key: torch.Tensor, error: torch.Tensor, states: dict, state: dict) -> None:
        """Add ECO's correction for the rounding ``error`` to the fp32 momentum in ``states`` (subclasses)."""
        raise NotImplementedError(f"{type(self).__name__} has no error feedback")

    def _count_feedback_stalls(self, key: torch.Tensor, old: StateValue | None, before: torch.Tensor, corrected: torch.Tensor) -> None:
        """With ``track_stalls`` and a quantized momentum ``old``: count ECO corrections (``corrected != before``) and
        those that round-to-nearest storage of the momentum loses (the same stored value with and without it), as
        stall counts of the pseudo-state ``"eco_correction"`` (``stall_stats()``, ``StallMonitor``)."""
        if not (self.track_stalls and isinstance(old, QuantizedTensor)) or not bool(torch.isfinite(corrected).all()):
            return  # an overflowed momentum is not counted: storing it raises the step's StepOverflowError
        with_it, without = (quantize_state(old.format, local_tensor(v).float()).dequantize(torch.float32) for v in (corrected, before))
        injected = corrected != before
        self._add_stall_counts(key, FEEDBACK_STALLS, torch.stack([(injected & (with_it == without)).sum(), injected.sum()]))

    def quantize_weights(self) -> int:
        """Round every parameter that has a weight grid onto it (round to nearest), as a run without master weights
        starts; returns how many parameters changed. ``QStatePrecision`` calls it at fit start."""
        changed = 0
        with torch.no_grad():
            for group in self.param_groups:
                for key in group["params"]:
                    param = local_tensor(key)
                    grid = self.weight_grid(group, key, param)
                    if grid is None:
                        continue
                    stored = grid.round(param.float(), "nearest").to(param.dtype)
                    changed += int(not torch.equal(stored, param))
                    param.copy_(stored)
        return changed

    def _store(
        self, group: dict, key: torch.Tensor, name: str, value: torch.Tensor, old: StateValue | None, dtype: torch.dtype | None = None
    ) -> StateValue:
        """Write an updated state back in its format (the old state's, or the policy's for a new state). A quantized state
        decodes to ``dtype`` (default: the old state's, the parameter's for a new one; fp32 under a weight grid, whose
        update runs in fp32, so that fp32 checkpoints re-quantize it exactly); a plain state is ``value`` itself: in
        the parameter's dtype as torch keeps it, or fp32 under a weight grid.

        Raises:
            StepOverflowError: the state holds inf/NaN (a block-scaled format stores no such block; a cast would
                store it: fp16 past 65504), as the fused steps raise when a moment overflows.
        """
        fmt = self._format_for(group, key, name, value, old)
        if fmt is None:
            return value
        dtype = dtype or (old.dtype if old is not None else self._decoded_dtype(group, key))
        local = local_tensor(value)
        generator = self.rounding_generator(key, name, local.device) if group["rounding"] == "stochastic" else None
        try:
            stored = quantize_state(fmt, local, group["rounding"], generator)
            if isinstance(fmt, CastFormat) and not bool(torch.isfinite(stored.codes).all()):  # a finite value past its range is inf
                raise NonFiniteError(f"{fmt.name} stored inf/NaN")
        except NonFiniteError as error:
            param_name = self.param_names()[key]
            raise StepOverflowError(
                f"{type(self).__name__}: state {name!r} of {param_name} overflowed to inf/NaN during the step; "
                f"{fmt.name} cannot store it (lower the learning rate or clip the gradients)",
                [param_name],
            ) from error
        stored.dtype = dtype  # what it decodes to (quantized from fp32 values of a bf16 parameter's state)
        return stored

    def _format_for(self, group: dict, key: torch.Tensor, name: str, value: torch.Tensor, old: StateValue | None) -> StorageFormat | None:
        """Format to store ``value`` in: a quantized state keeps its format, a plain one stays plain, a new one follows the policy."""
        if isinstance(old, QuantizedTensor):
            return old.format
        return self._policy_format(group, key, name) if old is None else None

    def _policy_format(self, group: dict, key: torch.Tensor, name: str) -> StorageFormat | None:
        """The policy's format for state ``name`` of parameter ``key``: the group's, or a per-parameter override."""
        override = self.state_overrides.get(key)
        return resolve_format(group if override is None else {**group, "states": override}, name, key, self.full_numels.get(key))

    def _initial(self, group: dict, key: torch.Tensor, name: str, value: torch.Tensor) -> StateValue:
        """Store a freshly created state of parameter ``key`` (``value``: local tensor) per the policy; a plain state of a
        parameter on a weight grid in fp32 from the start (its update runs in fp32 and stores it so: ``_step_param``)."""
        fmt, value = self._policy_format(group, key, name), local_tensor(value)
        if fmt is not None:
            return self._quantized(group, key, fmt, value)
        return value.float() if value.is_floating_point() and self.weight_grid(group, key) is not None else value

    def _quantized(self, group: dict, key: torch.Tensor, fmt: StorageFormat, value: torch.Tensor) -> QuantizedTensor:
        """``value``, a state of parameter ``key``, quantized into ``fmt`` (round to nearest), decoding to ``_decoded_dtype``."""
        stored = quantize_state(fmt, value)
        stored.dtype = self._decoded_dtype(group, key)
        return stored

    def _decoded_dtype(self, group: dict, key: torch.Tensor) -> torch.dtype:
        """What a quantized state of parameter ``key`` decodes to: fp32 under a weight grid (its update runs in fp32, and
        the native steps take only fp32-labelled states there), else the parameter's dtype."""
        return torch.float32 if self.weight_grid(group, key) is not None else local_tensor(key).dtype

    # --- stall statistics -----------------------------------------------------------------------------
    def _intended_updates(self, group: dict, keys: list[torch.Tensor]) -> list[_Intended]:
        """With ``track_stalls``, before a path that does not count them itself (all but the reference path's weight
        grids) steps the parameters ``keys`` (of ``group``): per parameter whose stalls this step counts, what its update
        intends (``_Intended``), for ``_count_intended_stalls`` once they are stepped; ``[]`` otherwise (untracked steps pay
        nothing). Counted are the parameters' own stalls (``WEIGHT_STALLS``, with ``track_weight_stalls``) and, for a
        parameter on a weight grid with ``error_feedback="eco"`` and a quantized momentum, ECO's corrections
        (``FEEDBACK_STALLS``, as ``_update_weights`` counts them).

        The update is run once more, on copies (``_intended_update``), so every step path counts alike without changing
        what it computes (a tracked step trains as an untracked one); tracked steps pay that second update and, on the
        paths that step a whole group in one call (``native``, ``multi_tensor``), the copies of that group's parameters
        at once.
        """
        if not self.track_stalls:
            return []
        weights = self.track_weight_stalls and self.counts_weight_stalls
        momentum = self.state_names[0] if self.state_names else None
        targets = []
        for key in keys:
            param, state = local_tensor(key), self.state[key]
            feedback = (
                group["error_feedback"] == "eco"
                and isinstance(state.get(momentum), QuantizedTensor)
                and self.weight_grid(group, key, param) is not None
            )
            if weights or feedback:
                master, states, copies = self._intended_update(group, key, param, local_tensor(key.grad), state)
                replay = (master, states, copies) if feedback else None
                targets.append(_Intended(key, group, param.clone(), master != param if weights else None, replay))
        return targets

    def _intended_update(
        self, group: dict, key: torch.Tensor, param: torch.Tensor, grad: torch.Tensor, state: dict
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict]:
        """The values this step's update gives ``param`` before they are stored, computed on copies (nothing changes):
        in fp32 for a parameter kept on a weight grid (``θ̃`` of ``_update_weights``, from the stored ``θ̂`` plus
        ``eco_exact``'s error: its update runs in fp32 by design), else in float64, so that an update too small for the
        parameter's dtype (a bf16 one's, or one below half an fp32 ulp of an fp32 one) still counts as moved; with the
        updated states (decoded, before ECO's correction) and the copy of ``state`` the update ran on."""
        grid = self.weight_grid(group, key, param)
        wide = torch.float32 if grid is not None else torch.float64
        master = param.to(wide, copy=True)
        if grid is not None and group["error_feedback"] == "eco_exact" and ERROR_STATE in state:
            master += local_tensor(state[ERROR_STATE]).to(wide)
        states = {name: _decoded(state[name], wide) for name in self.state_names if state.get(name) is not None}
        copies = {name: value.clone() if isinstance(value, torch.Tensor) and value.ndim == 0 else value for name, value in state.items()}
        update = self._update if grid is None else self._update_on_grid
        update(group, master, grad.to(wide), states, copies)  # copies: the scalar ``step`` moves on its own copy
        return master, states, copies

    def _count_intended_stalls(self, targets: list[_Intended], overflowed: Iterable[torch.Tensor] = ()) -> None:
        """Count, per stepped parameter of ``targets`` (``_intended_updates``), the entries its update moved and those of
        them whose stored value stayed put, as ``[stalled, moved]`` of the pseudo-state ``WEIGHT_STALLS``, and ECO's
        corrections of the error ``θ̃ − θ̂`` the step's rounding made (``_feed_back_error`` on the intended update's
        copies); parameters the non-finite policy skipped this step, and the ``overflowed`` ones, are left out."""
        if not targets:
            return
        skipped = {id(param) for param in (*self.__dict__.get("_skipped", []), *overflowed)}
        for target in targets:
            if id(target.key) in skipped:
                continue
            stored = local_tensor(target.key)
            if target.moved is not None:
                stalled = target.moved & (stored == target.before)
                self._add_stall_counts(target.key, WEIGHT_STALLS, torch.stack([stalled.sum(), target.moved.sum()]))
            if target.feedback is not None:
                master, states, copies = target.feedback
                self._feed_back_error(target.group, target.key, master - stored.float(), states, copies)

    def _count_stalls(
        self, param: torch.Tensor, name: str, old: QuantizedTensor, before: torch.Tensor, updated: torch.Tensor, stored: QuantizedTensor
    ) -> None:
        """Count the entries the fp32 update moved, and those of them that kept their code (see ``formats.count_stalls``)."""
        flat = (before.reshape(-1), local_tensor(updated).reshape(-1).float(), stored.dequantize(torch.float32).reshape(-1))
        self._add_stall_counts(param, name, count_stalls(*flat, old.unit_values(), stored.unit_values()))

    def _add_stall_counts(self, param: torch.Tensor, name: str, counts: torch.Tensor) -> None:
        """Accumulate ``[stalled, moved]`` for one state (device tensors: no sync)."""
        key = (param, name)
        if key in self._stall_counts:
            self._stall_counts[key] += counts
        else:
            self._stall_counts[key] = counts

    @property
    def steps_taken(self) -> int:
        """Calls of ``step`` so far, skipped ones included (the non-finite policy's), restored from checkpoints."""
        return self._rounding_step

    def stall_counts(self, reset: bool = True) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Raw counters since the last reset: ``{param: {state_name: tensor([stalled, moved])}}`` (int64, on the param's device).

        Needs ``track_stalls=True``. Counts are sums, so they can be all-reduced across ranks. Besides the quantized
        states, two pseudo-states: ``"weights"`` (``WEIGHT_STALLS``: entries of the parameter its update moved, and those
        of them whose stored value did not change, i.e. whose update was lost to rounding into the parameter's dtype or
        weight grid; every parameter stepped by QAdam/QAdamW/QSGD/QMuon, fp32 ones against their float64 update; not the
        generic wrapper, whose inner optimizer updates the parameters itself) and ``"eco_correction"``
        (``FEEDBACK_STALLS``: ECO's momentum corrections lost to the momentum's rounding).
        """
        out: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for (param, name), counts in self._stall_counts.items():
            out.setdefault(param, {})[name] = counts
        if reset:
            self._stall_counts = {}
        return out

    def stall_stats(self, reset: bool = True) -> dict[str, dict[str, float]]:
        """Stalled fraction ``stalled / moved`` per parameter and state since the last call, then resets the counters.

        Keys are parameter names when the optimizer was given ``named_parameters()``, else ``"param{i}"``
        (the index in the order of ``param_groups``). Needs ``track_stalls=True``.
        """
        if not self.track_stalls:
            raise RuntimeError(f"{type(self).__name__}: stall statistics need track_stalls=True")
        names = self.param_names()
        return {
            names[param]: {name: float(c[0]) / max(float(c[1]), 1.0) for name, c in per_state.items()}
            for param, per_state in self.stall_counts(reset).items()
        }

    def param_names(self) -> dict[torch.Tensor, str]:
        """Name of every parameter: from ``param_names`` in the groups when given, else the module's name for it
        (``module_names``, set by ``QuantizationPolicy.apply``), else ``"param{i}"``."""
        names: dict[torch.Tensor, str] = {}
        index = 0
        module_names = getattr(self, "module_names", {})
        for group in self.param_groups:
            given = group.get("param_names")
            for position, param in enumerate(group["params"]):
                names[param] = given[position] if given else module_names.get(param, f"param{index}")
                index += 1
        return names

    # --- formats over training ------------------------------------------------------------------------
    def reencode_state(self, param: torch.Tensor, name: str, fmt: str | StorageFormat) -> None:
        """Store state ``name`` of ``param`` in a new format from now on (``"fp32"`` for a plain tensor).

        The values are decoded and re-encoded with round-to-nearest, so nothing is lost beyond the new
        format's precision. A format name is resolved as the policy resolves new states (``resolve_format``, with
        no ``min_quant_size``): the group's block size, the state's sign convention, blocks aligned to rows of
        an FSDP2 shard (a shard whose rows allow no aligned block stays fp32) and FSDP1's full parameter size,
        so that every rank and world size re-encodes alike.
        """
        state = self._state_of(param)
        if name not in state:
            raise KeyError(f"{type(self).__name__}: parameter has no state {name!r} yet (states: {sorted(state)})")
        per_value = [key for key, value in state.items() if self._per_value_state(param, key, value)]
        if name not in per_value:
            raise ValueError(
                f"{type(self).__name__}: state {name!r} is not a per-value state of the parameter (such as Adam's step count); "
                f"re-encode one of {per_value}"
            )
        group = self._group_of(param)
        if isinstance(fmt, str):
            fmt = resolve_format({**group, "states": fmt, "min_quant_size": 0}, name, param, self.full_numels.get(param))
        # from the fp32 decode: a bf16/fp16 parameter's state decodes to its dtype, whose rounding would move codes
        state[name] = dequantized(state[name]) if fmt is None else self._quantized(group, param, fmt, _decoded(state[name], torch.float32))
        _drop_stale_bound(state)
        self.format_changes += 1

    def _fused_call(self, keys: list[torch.Tensor], call: Callable[[], Any], finish: Callable[[Any, frozenset[int]], None]) -> None:
        """``finish(call(), frozenset())`` for a fused step of ``keys`` (C++, compiled, Triton). Where a state overflowed fp32
        (``StateOverflowError``), the step had written its codes and scales in place (NaN) and stepped the other
        parameters: the overflowed parameters' per-value states are zeroed, quantized ones keeping their formats (as a
        reset; a plain fp32 moment beside a coded one holds the failed step's values too), so
        that no NaN stays in them and the next steps run, ``finish`` completes the others' steps from the results the
        error carries, given the positions in ``keys`` it is to leave out, and a ``StepOverflowError`` naming the
        overflowed parameters is raised."""
        try:
            results = call()
        except StateOverflowError as error:
            names = self.param_names()
            overflowed = [keys[k] for k in error.overflowed]
            for key in overflowed:  # every per-value state: a plain fp32 moment beside a coded one holds the failed step's values
                self.reset_states(key, [name for name, value in self.state[key].items() if self._per_value_state(key, name, value)])
            finish(error.results, frozenset(error.overflowed))
            overflowed_names = [names[key] for key in overflowed]
            raise StepOverflowError(
                f"{type(self).__name__}: {error} ({overflowed_names}); the fused step had written its packed codes in place, so "
                "the quantized states of these parameters were zeroed (as a reset). Lower the learning rate or clip the gradients",
                overflowed_names,
            ) from error
        finish(results, frozenset())

    def _per_value_state(self, param: torch.Tensor, name: str, value: Any) -> bool:
        """Whether state ``name`` holds one value per parameter value: stored (quantized), or a floating tensor of the
        parameter's local shape; one of the optimizer's ``state_names`` where it names them."""
        if self.state_names and name not in self.state_names:
            return False
        plain = isinstance(value, torch.Tensor) and value.is_floating_point() and local_tensor(value).shape == local_tensor(param).shape
        return isinstance(value, QuantizedTensor) or plain

    def reset_states(self, param: torch.Tensor, names: Iterable[str], restart_step: bool = False) -> list[str]:
        """Zero the states ``names`` of ``param`` in place, each keeping its format; returns the names it zeroed.

        States the parameter does not have (yet) are skipped; a tensor that is not one of the optimizer's parameters
        raises ``ValueError`` (as for ``reencode_state`` and ``state_format``). ``restart_step`` also zeroes ``state["step"]``
        (Adam's bias correction starts over); without it the first Adam step after a reset is about
        ``(1 - β1) / sqrt(1 - β2)`` times a normal one (3.16 at ``β = (0.9, 0.999)``).
        """
        state = self._state_of(param)
        zeroed = []
        for name in names:
            value = state.get(name)
            if isinstance(value, QuantizedTensor):
                state[name] = quantize_state(value.format, torch.zeros(value.shape, dtype=value.dtype, device=value.device))
            elif isinstance(value, torch.Tensor):
                value.zero_()
            else:
                continue
            zeroed.append(name)
        if restart_step and zeroed and "step" in state:
            _set_step_count(state, 0)
        if zeroed and MOMENT_BOUND_STATE in state:  # the moments' bound starts over (kernels.bounds); the key stays, as
            betas = self._group_of(param)["betas"]  # checkpoint templates (a fresh optimizer's state) hold it
            steps_done = float(state.get("step", 0))
            state[MOMENT_BOUND_STATE] = torch.tensor(restart_square(state, *(float(b) for b in betas), steps_done), dtype=torch.float64)
        return zeroed

    def _group_of(self, param: torch.Tensor) -> dict:
        """The param group that holds ``param``: a map built again where the groups changed (``add_param_group``, a load,
        which gives the groups new dicts, a parameter moved between groups: their dicts and sizes; two parameters that
        trade groups are not noticed, as torch's optimizers do not support moving parameters), so that calls for every
        parameter (a reset, a re-plan) cost O(n), not O(n²)."""
        signature = [(id(group), len(group["params"])) for group in self.param_groups]
        built = self.__dict__.get("_groups_by_param")
        if built is None or built[0] != signature or param not in built[1]:
            built = self._groups_by_param = (signature, {p: g for g in self.param_groups for p in g["params"]})
        return built[1][param]

    def state_format(self, param: torch.Tensor, name: str) -> StorageFormat | None:
        """The format state ``name`` of ``param`` is stored in; ``None`` for a plain tensor."""
        value = self._state_of(param).get(name)
        return value.format if isinstance(value, QuantizedTensor) else None

    def _state_of(self, param: torch.Tensor) -> dict[str, Any]:
        """``param``'s state (``{}`` before its first step); raises ``ValueError`` for a tensor that is not one of this
        optimizer's parameters, where ``self.state[param]`` (a defaultdict) would add it, and ``state_dict`` then fail."""
        if param in self.state:
            return self.state[param]
        try:
            self._position(param)
        except KeyError:
            raise ValueError(
                f"{type(self).__name__}: a tensor of shape {tuple(param.shape)} is not one of this optimizer's parameters; "
                "pass one of its param_groups' params (under FSDP/DDP, the parameter the strategy's model holds)"
            ) from None
        return {}

    # --- checkpoints ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Torch's state dict with every quantized state in checkpoint form (see ``checkpoint_mode``).

        ``"packed"`` (default): a versioned dict of codes, scales and a checksum, bit-exact. ``"fp32"``: a tensor
        shaped like the parameter (a DTensor under FSDP2, the flat shard under FSDP1) plus a
        ``"<name>.qstate_format"`` string, for strategies that reshard optimizer state: the decoded values, which
        loading re-quantizes into the same format and, with the same block layout (same world size), into the same
        values, whatever the rounding (``quantize_exactly``). DTensor parameters always
        use ``"fp32"``: per-rank packed buffers would load on the wrong rank; for the same reason their plain states,
        held as local shards, are exported as DTensors. A per-value state kept plain where the policy would quantize it
        gets the marker ``PLAIN_MARKER`` (both modes), so that loading keeps it plain. The stochastic-rounding seed and
        step count ride in param group 0. Hooks registered with
        ``register_state_dict_pre_hook``/``_post_hook`` see the optimizer before and the finished dict after.
        """
        for hook in self._optimizer_state_dict_pre_hooks.values():
            hook(self)
        with suspended_hooks(self, "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks"):
            state_dict = super().state_dict()
        params = [(group, p) for group in self.param_groups for p in group["params"]]
        state_dict["state"] = {
            index: self._export_entries(*params[index], entries) if isinstance(index, int) else entries
            for index, entries in state_dict["state"].items()
        }
        state_dict[VERSION_KEY] = STATE_FORMAT_VERSION
        if state_dict["param_groups"]:
            # with the counters of skipped updates (cumulative over a resumed run, as the callback logs them)
            counters = [self._rounding_seed, self._rounding_step, self.nonfinite_skips, self.skipped_steps]
            state_dict["param_groups"][0][ROUNDING_KEY] = counters
            state_dict["param_groups"][0][OVERRIDES_KEY] = [_override_json(self.configured_overrides.get(p)) for _, p in params]
        for hook in self._optimizer_state_dict_post_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        return state_dict

    def _export_entries(self, group: dict, key: torch.Tensor, entries: dict[str, Any]) -> dict[str, Any]:
        kept_plain = {
            name + FORMAT_SUFFIX: PLAIN_MARKER
            for name, value in entries.items()
            if isinstance(value, torch.Tensor) and self._per_value_state(key, name, value) and self._policy_format(group, key, name)
        }
        if self.checkpoint_mode == "packed" and not isinstance(key, DTensor):
            return {**{name: export_state(value) for name, value in entries.items()}, **kept_plain}
        exported: dict[str, Any] = dict(kept_plain)
        for name, value in entries.items():
            if isinstance(value, QuantizedTensor):
                exported[name + FORMAT_SUFFIX] = format_marker(value.format)
                value = like_param(value.dequantize(torch.float32), key)  # quantize_exactly loads these values: resume is exact
            elif isinstance(key, DTensor) and _is_local_shard(value, key):
                value = like_param(value, key)  # a plain state held as a local shard: as a DTensor, each rank saves and loads its own
            exported[name] = value
        return exported

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own state dict (either mode), or a plain torch one (its fp32 states are quantized per the policy).

        Packed codes never pass through ``torch.optim.Optimizer.load_state_dict``, which would cast them; a packed
        state whose shape, size, checksum or scales do not fit its parameter raises. State keys are matched to
        parameters as torch does, by position in the saved ``param_groups`` (ints, or FQNs from
        ``set_optimizer_state_dict``). Hyperparameters come from the checkpoint, as in torch (a configured value
        that differs is warned about, unless a scheduler moves it: ``_changed_hyperparameters``). The storage
        policy (``states``, ``rounding``, ``block_size``, ``min_quant_size``) stays as configured: where it differs
        from the checkpoint's, the states are re-encoded into the configured formats, with a warning. Hooks
        registered with ``register_load_state_dict_pre_hook`` see a shallow copy of the dict as given (as torch's),
        ``_post_hook`` the optimizer once every state is loaded.
        """
        state_dict = dict(state_dict)  # as torch: hooks may change the dict, not the caller's
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            state_dict = hook(self, state_dict) or state_dict
        state_dict = {**state_dict, "state": merge_stringified_keys(state_dict["state"])}
        if VERSION_KEY in state_dict:  # checked before anything loads
            check_version(state_dict[VERSION_KEY], type(self).__name__)
        counters = state_dict["param_groups"][0].get(ROUNDING_KEY) if state_dict["param_groups"] else None
        if counters is not None and len(counters) not in (2, 4):
            raise ValueError(
                f"{type(self).__name__}: the checkpoint is damaged: param group 0's {ROUNDING_KEY} holds {len(counters)} values"
            )
        configured = [dict(group) for group in self.param_groups]
        packed, markers, plain = {}, {}, {}
        for index, entries in state_dict["state"].items():
            packed[index] = {k: v for k, v in entries.items() if is_exported(v)}
            markers[index] = {k[: -len(FORMAT_SUFFIX)]: v for k, v in entries.items() if k.endswith(FORMAT_SUFFIX)}
            plain[index] = {k: v for k, v in entries.items() if not is_exported(v) and not k.endswith(FORMAT_SUFFIX)}
        saved_groups = [{k: v for k, v in group.items() if k not in (ROUNDING_KEY, OVERRIDES_KEY)} for group in state_dict["param_groups"]]
        self._check_saved_hyperparameters(saved_groups, configured)
        with suspended_hooks(self, "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
            super().load_state_dict(
                {**{k: v for k, v in state_dict.items() if k != VERSION_KEY}, "state": plain, "param_groups": saved_groups}
            )
        self._untie_steps()
        saved_keys = [key for group in state_dict["param_groups"] for key in group["params"]]
        params = dict(zip(saved_keys, (p for group in self.param_groups for p in group["params"]), strict=False))
        groups_by_param = {p: group for group, current in zip(configured, self.param_groups, strict=False) for p in current["params"]}
        self._restore_fp32_states(plain, markers, params, configured)
        for index, entries in plain.items():  # a plain torch state of another shape never loads (torch's would fail at its step)
            for name, value in entries.items():
                if name in self.state_names and isinstance(value, torch.Tensor) and value.ndim > 0 and index in params:
                    where = f"{type(self).__name__} state {index} ({name!r})"
                    check_state_shape(local_tensor(self.state[params[index]][name]).shape, local_tensor(params[index]), where)
        for index, entries in packed.items():
            for name, entry in entries.items():
                where = f"{type(self).__name__} state {index} ({name!r})"
                key = params[index]
                self.state[key][name] = self._imported(groups_by_param[key], key, entry, where)
        kept_plain = set()
        for index, entries in ((i, e) for i, e in markers.items() if e):
            key = params[index]
            for name, marker in entries.items():
                if marker == PLAIN_MARKER:
                    kept_plain.add((key, name))
                    continue
                state = self.state[key]
                values, where = local_tensor(state[name]), f"{type(self).__name__} state {index} ({name!r})"
                check_state_shape(values.shape, local_tensor(key), where)  # as import_state checks a packed state
                state[name] = quantize_exactly(format_from_marker(marker, where), values.float(), where)
                state[name].dtype = self._decoded_dtype(groups_by_param[key], key)
        changes = self._keep_configured_policy(configured)
        overridden = self._changed_overrides(state_dict["param_groups"])
        done = self._apply_policy_on_load(changes, kept_plain, overridden)
        for index, group in enumerate(self.param_groups):
            count = sum(p in overridden for p in group["params"])
            changes[index] = ", ".join(filter(None, [changes[index], f"overrides of {count} parameter(s)" * bool(count)]))
        described = [
            f"group {index}: {'; '.join(filter(None, [change, did]))}"
            for index, (change, did) in enumerate(zip(changes, done, strict=True))
            if change or did
        ]
        if described:
            warnings.warn(
                f"{type(self).__name__}: the checkpoint's storage policy differs from the configured one, which is used "
                f"({'; '.join(described)})",
                UserWarning,
                stacklevel=2,
            )
        self._kept_formats_unchecked = True
        self._restart_foreign_bounds()
        self._load_counters(counters, quantized=any(packed.values()) or any(markers.values()))
        for hook in self._optimizer_load_state_dict_post_hooks.values():
            hook(self)

    def _restart_foreign_bounds(self) -> None:
        """Restart, as a lost one (``restart_square``), each loaded ``K_n²`` below the closed form of its step count
        under its group's betas: the state's own never is while the betas stay as they are, so it came from elsewhere:
        torch's ``set_optimizer_state_dict`` (Lightning's FSDP2 one-file resume) loads a checkpoint that lacks it (a
        plain torch optimizer's) into this optimizer's own state dict, whose bound is that of its initializing step
        (``K_1²``: ``m`` was held 22 % short of Adam's the next step). Groups whose beta1 a scheduler cycles
        (``base_momentum``: OneCycleLR, CyclicLR) are left alone: their own bound can fall below the closed form of the
        current betas, and a resume stays exact."""
        for group in self.param_groups:
            betas = group.get("betas")
            if betas is None or "base_momentum" in group:
                continue
            beta1, beta2 = (float(beta) for beta in betas)
            for key in group["params"]:
                state = self.state.get(key, {})
                if MOMENT_BOUND_STATE not in state or "step" not in state:
                    continue
                steps = float(state["step"])
                if float(state[MOMENT_BOUND_STATE]) < bound_square(beta1, beta2, steps):
                    state[MOMENT_BOUND_STATE] = torch.tensor(restart_square(state, beta1, beta2, steps), dtype=torch.float64)

    def _untie_steps(self) -> None:
        """Give each parameter its own ``step`` tensor where a loaded state dict shared one among several (torch's FSDP1
        full optimizer state dict with ``use_orig_params=False`` gives every parameter of a flat parameter the same
        tensor, and torch's load keeps it shared): each step would count it once per parameter, and bias-correct
        with a step count several times too large (torch's own optimizers do)."""
        seen: set[int] = set()
        for state in self.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.clone()
                seen.add(id(state["step"]))

    def _load_counters(self, counters: list | None, quantized: bool) -> None:
        """The stochastic-rounding seed and step and the skip counts of a checkpoint's ``ROUNDING_KEY``; where it has none
        but holds ``quantized`` states under stochastic rounding, a warning that the resume is not draw for draw."""
        if counters is None:
            if quantized and any(group.get("rounding") == "stochastic" for group in self.param_groups):
                warnings.warn(
                    f"{type(self).__name__}: the checkpoint holds quantized states but no {ROUNDING_KEY} in param group 0 (a "
                    "converter dropped it?): stochastic rounding goes on from this optimizer's own seed, so the resumed run is "
                    "not the uninterrupted one draw for draw",
                    UserWarning,
                    stacklevel=caller_stacklevel(),
                )
            return
        saved = [int(v) for v in counters]  # checkpoints before 2026-11-28 hold the first two
        self._rounding_seed, self._rounding_step = saved[:2]
        self._seed_shared = False  # a rank's own checkpoint may hold its own seed (one saved before the seeds were shared)
        self.nonfinite_skips, self.skipped_steps = saved[2:] or (0, 0)

    def _imported(self, group: dict, key: torch.Tensor, entry: dict, where: str) -> QuantizedTensor:
        """A packed checkpoint entry of parameter ``key`` (of ``group``) as its state (``import_state``: checked against the
        local shard, so a full-shape packed state of a DDP checkpoint never loads into a DTensor shard), decoded in the
        dtype the configured grid gives, not the saved one."""
        loaded = import_state(entry, local_tensor(key), where)
        loaded.dtype = self._decoded_dtype(group, key)
        return loaded

    def _import_written_states(self) -> None:
        """Import checkpoint entries written into ``self.state`` without ``load_state_dict``, with its checks (shape, size,
        checksum): ``torch.distributed.optim.ZeroRedundancyOptimizer.load_state_dict`` copies each rank's states into its
        local optimizer's ``state`` (and the checkpoint's param group options, ``ROUNDING_KEY`` with them where present,
        into its groups); stepped on as they were, the packed dicts raised a TypeError deep inside torch's Adam."""
        members = [(group, key) for group in self.param_groups for key in group["params"]]
        for position, (group, key) in enumerate(members):
            state = self.state.get(key, {})
            for name, value in state.items():
                if is_exported(value):
                    state[name] = self._imported(group, key, value, f"{type(self).__name__} state {position} ({name!r})")
        self._load_counters(self.param_groups[0].pop(ROUNDING_KEY, None) if self.param_groups else None, quantized=True)
        if self.param_groups:
            self.param_groups[0].pop(OVERRIDES_KEY, None)

    def _restore_fp32_states(self, plain: dict, markers: dict, params: dict, configured: list[dict]) -> None:
        """Undo torch's cast of loaded floating states to the parameter's dtype where a state is fp32 by design: the
        fp32 values of ``checkpoint_mode="fp32"`` (re-quantized next, exactly), and under a weight grid of the
        ``configured`` groups plain states and ``eco_exact``'s error buffer (always held as a local tensor); the float64
        ``K_n²`` of ``kernels.bounds``."""
        groups = {p: group for group, current in zip(configured, self.param_groups, strict=False) for p in current["params"]}
        for index, entries in plain.items():
            key = params.get(index)
            if key is None or key not in groups:
                continue
            gridded = self.weight_grid(groups[key], key) is not None
            state = self.state[key]
            for name, value in entries.items():
                loaded = state.get(name)
                fp32_by_design = name in markers.get(index, {}) or gridded or name == MOMENT_BOUND_STATE  # K_n²: float64
                if fp32_by_design and isinstance(value, torch.Tensor) and isinstance(loaded, torch.Tensor) and value.dtype != loaded.dtype:
                    restored = value.detach().to(device=loaded.device, copy=True)
                    state[name] = restored if isinstance(loaded, DTensor) and name != ERROR_STATE else local_tensor(restored)
            if isinstance(state.get(ERROR_STATE), DTensor):
                state[ERROR_STATE] = local_tensor(state[ERROR_STATE])

    def _check_saved_hyperparameters(self, saved_groups: list[dict], configured: list[dict]) -> None:
        """Refuse, before anything loads, a checkpoint whose hyperparameters (which a load takes, as torch's) the
        configured policy cannot run with, e.g. ``momentum=0`` under ``error_feedback="eco"``: a problem of the
        checkpoint, so a plain ValueError (not the ConfigurationError of a wrong configuration). Groups that do not match
        the configured ones in number and sizes are left to torch's load, which refuses them with its own error."""
        owner = type(self).__name__
        if [len(group["params"]) for group in saved_groups] != [len(group["params"]) for group in configured]:
            return
        for index, (saved, before) in enumerate(zip(saved_groups, configured, strict=False)):
            candidate = {**saved, **{key: before[key] for key in GROUP_OPTIONS}, "params": before["params"]}
            try:
                with warnings.catch_warnings():  # the configured policy's own warnings were given at construction
                    warnings.simplefilter("ignore")
                    self._check_weight_options(candidate, owner)
            except ConfigurationError as error:
                raise ValueError(
                    f"{owner}: the checkpoint's param group {index} cannot be resumed under the configured policy "
                    f"(a load takes the checkpoint's hyperparameters, as torch does), nothing was loaded: {error}"
                ) from None

    def _keep_configured_policy(self, configured: list[dict]) -> list[str]:
        """Put the configured policy options back into the loaded groups; warn about other hyperparameters that the
        checkpoint changed. Returns, per group, a description of the policy change (``""`` where none)."""
        changes, hyper = [], []
        for index, (group, before) in enumerate(zip(self.param_groups, configured, strict=False)):
            policy_changes = [
                f"{k}={group[k]!r} -> {before[k]!r}" for k in GROUP_OPTIONS if k in group and k != "rounding" and group[k] != before[k]
            ]
            for key in GROUP_OPTIONS:
                group[key] = before[key]
            self._complete_group(group)
            changes.append(", ".join(policy_changes))
            hyper += [f"group {index} {change}" for change in _changed_hyperparameters(group, before)]
        if hyper:
            warnings.warn(
                f"{type(self).__name__}: the checkpoint's hyperparameters are used, as torch does ({'; '.join(hyper)}); "
                "set them on optimizer.param_groups after loading to override",
                UserWarning,
                stacklevel=3,
            )
        return changes

    def _changed_overrides(self, saved_groups: list[dict]) -> set[torch.Tensor]:
        """The parameters whose ``overrides`` spec differs from the checkpoint's (``OVERRIDES_KEY``; none for a checkpoint
        without it: a torch one, or one saved before 2026-11-28)."""
        saved = saved_groups[0].get(OVERRIDES_KEY) if saved_groups else None
        params = [p for group in self.param_groups for p in group["params"]]
        if saved is None or len(saved) != len(params):
            return set()
        return {p for p, spec in zip(params, saved, strict=True) if _override_json(self.configured_overrides.get(p)) != spec}

    def _plain_state(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """A loaded state kept plain, as this optimizer's step holds it: the local shard (the update runs on local tensors)."""
        return local_tensor(value)

    def _apply_policy_on_load(
        self, changes: list[str], kept_plain: set[tuple[torch.Tensor, str]], overridden: set[torch.Tensor]
    ) -> list[str]:
        """Quantize plain loaded states per the policy (but those ``kept_plain``: saved plain by choice, ``PLAIN_MARKER``),
        re-encode quantized ones of groups whose policy changed and of the parameters whose ``overrides`` changed
        (``overridden``; other states keep the formats they were saved in, see ``_check_kept_formats``), and drop
        ``eco_exact``'s error buffer where the group no longer uses it (a stale error would come back with a later
        ``eco_exact``). Returns, per group, what was done."""
        done = []
        for group, change in zip(self.param_groups, changes, strict=False):
            count, dropped = 0, 0
            for key in group["params"]:
                state = self.state.get(key, {})
                if ERROR_STATE in state and (group["error_feedback"] != "eco_exact" or self.weight_grid(group, key) is None):
                    del state[ERROR_STATE]
                    dropped += 1
                for name, value in state.items():
                    if name not in self.state_names and self.state_names:
                        continue
                    if isinstance(value, torch.Tensor):
                        kept = (key, name) in kept_plain and key not in overridden
                        local = local_tensor(value)
                        fmt = None if kept else self._format_for(group, key, name, local, None)
                        state[name] = self._plain_state(key, local) if fmt is None else self._quantized(group, key, fmt, local)
                        count += fmt is not None and (key in overridden or bool(change))  # a torch checkpoint's: no change
                    elif isinstance(value, QuantizedTensor) and (change or key in overridden):
                        target = self._policy_format(group, key, name)
                        if target is None or target.config != value.format.config:
                            state[name] = (
                                self._plain_state(key, value.dequantize())
                                if target is None
                                else self._quantized(group, key, target, value.dequantize(torch.float32))
                            )
                            count += 1
                _drop_stale_bound(state)
            done.append(
                ", ".join(
                    [f"{count} states re-encoded"] * bool(count) + [f"eco_exact's error dropped for {dropped} parameters"] * bool(dropped)
                )
            )
        return done

    def fp32_state_dict(self) -> dict[str, Any]:
        """A plain torch state dict (quantized states decoded to their original dtype), loadable by the torch optimizer.
        Warns where ``error_feedback="eco_exact"`` holds parameters' rounding remainders (``weight_error``): a torch
        optimizer steps the rounded parameters without them."""
        kept = [name for key, name in self.param_names().items() if ERROR_STATE in self.state.get(key, {})]
        if kept:
            warnings.warn(
                f"{type(self).__name__}.fp32_state_dict: the weights of {_listing(kept)} are kept rounded, "
                f"their remainders in the state {ERROR_STATE!r} (error_feedback='eco_exact'), which a torch optimizer ignores: it "
                f"steps the rounded values. To go on without this optimizer, add the remainders to fp32 copies of the "
                f"parameters first (param.float() + state[{ERROR_STATE!r}]), then build the torch optimizer on those",
                UserWarning,
                stacklevel=2,
            )
        state_dict = super().state_dict()
        state_dict["state"] = {
            index: {k: dequantized(v) for k, v in entries.items() if k != MOMENT_BOUND_STATE}
            for index, entries in state_dict["state"].items()
        }
        state_dict["param_groups"] = [{k: v for k, v in group.items() if k not in GROUP_OPTIONS} for group in state_dict["param_groups"]]
        return state_dict


def _override_json(spec: Any) -> str | None:
    """An ``overrides`` spec (a format name, or ``{state: format}``) as a checkpoint records it."""
    return None if spec is None else json.dumps(dict(spec) if isinstance(spec, Mapping) else spec, sort_keys=True)


def _set_step_count(state: dict, count: float) -> None:
    """``state["step"]`` set to ``count``: a tensor in place (torch's optimizers count in it), another number as its type."""
    step = state["step"]
    state["step"] = step.fill_(count) if isinstance(step, torch.Tensor) else type(step)(count)


def _drop_stale_bound(state: dict) -> None:
    """Drop the moments' bound ``K_n²`` (``kernels.bounds``) of a parameter left with no quantized moment: no step
    advances it there, and a moment quantized later must not read it stale (it starts from the closed form)."""
    if not any(isinstance(state.get(name), QuantizedTensor) for name in ("exp_avg", "exp_avg_sq")):
        state.pop(MOMENT_BOUND_STATE, None)


def _same_value(a: Any, b: Any) -> bool:
    """Equality for hyperparameters that may be tensors (a tensor ``lr``) or sequences (``betas``: a tuple, or the list
    torch's ``set_optimizer_state_dict`` gives back), element by element."""
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return bool(torch.equal(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)))
    return a == b


def _format_key(fmt: StorageFormat | None) -> tuple[str, int | None]:
    """What a kept format is compared by: its name and block size (``("fp32", None)`` for a plain state)."""
    return ("fp32", None) if fmt is None else (fmt.name, getattr(fmt, "block_size", None))


def _format_labels(stored: StorageFormat | None, configured: StorageFormat | None) -> tuple[str, str]:
    """``(stored, configured)`` as the kept-formats warning names them: the names, with the block sizes where only those differ."""
    (stored_name, stored_block), (configured_name, configured_block) = _format_key(stored), _format_key(configured)
    if stored_name != configured_name:
        return stored_name, configured_name
    return f"{stored_name} blocks of {stored_block}", f"{configured_name} blocks of {configured_block}"
