"""Which path steps each parameter: one table of capabilities, one function that reads it.

The paths, fastest first:

============  ==================================================================  ==============================
path          what runs                                                           where
============  ==================================================================  ==============================
native        the C++ kernel, every such parameter of a param group in one call   ``kernels/native.py``
triton        one Triton pass per block (decode, update, requantize)              ``kernels/triton_adam.py``
compiled      ``torch.compile`` of the reference step                             ``kernels/compiled.py``
multi_tensor  torch's own multi-tensor (foreach) Adam(W) on fp32 states           ``torch.optim.adam``
reference     torch's functional update on decoded states, one parameter a time   ``optim/base.py``
============  ==================================================================  ==============================

A parameter takes the first path of its optimizer's table (``ADAM_PATHS`` for QAdam/QAdamW; ``MOMENTUM_PATHS`` for
QSGD/QMuon, whose ``native`` steps their coded momentum buffers; ``PER_PARAMETER_PATHS`` for the generic wrapper) whose
every requirement holds; ``reference`` has none. In a param group that has ``native`` parameters, the fp32-state ones
that meet ``NATIVE_JOIN`` join that call too (one call for the small parameters ``min_quant_size`` keeps fp32). Round to
nearest, ``native``, ``triton`` and ``compiled`` give the codes of ``kernels.adam_reference`` bit for bit (QSGD's and
QMuon's ``native``: the reference path's buffer codes and params). A change to the update (a new format, ECO's error
feedback) is one requirement or one row here and one branch per path.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from ..formats import FLOAT_INPUT_DTYPES, BlockFormat, CastFormat, QuantizedTensor, StorageFormat
from ..formats.weights import WeightGrid
from . import TRITON_AVAILABLE
from .adam_reference import adam_hyper, decoupled_decay
from .bounds import MOMENT_BOUND_STATE, held_moment_bound
from .compiled import compiled_cpu_step
from .native import FP32_CAST, VALUE_DTYPES, StateOverflowError, native_format, native_formats, native_kernel_available

if TRITON_AVAILABLE:
    from . import adam_step_supported, draw_seed, triton_adam_step

# Parameters smaller than this take the reference path on the CPU (compiling would not pay off).
FUSED_MIN_NUMEL = 1 << 16
# Device types whose parameters step with the Triton kernel (tests add "cpu" under TRITON_INTERPRET=1).
TRITON_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


class StepPath(str, enum.Enum):
    """The ways a parameter can be stepped (module docstring); the value is the name ``step_paths()`` reports."""

    NATIVE = "native"
    TRITON = "triton"
    COMPILED = "compiled"
    MULTI_TENSOR = "multi_tensor"
    REFERENCE = "reference"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Candidate:
    """One parameter at one step, as the requirements see it: local ``param``/``grad`` tensors (a shard's, under FSDP),
    its param ``group``, its ``state`` (initialized), whether the optimizer allows compiled CPU paths, the grid its
    values are kept on without master weights (``None``: torch's behaviour; ``optim/weights.py``), and the states this
    step creates with the formats the policy gives them (SGD's first
    ``momentum_buffer``; ``None``: a plain tensor)."""

    param: torch.Tensor
    grad: torch.Tensor
    group: dict
    state: dict
    compile_cpu: bool
    weights: WeightGrid | None = None
    created: Mapping[str, StorageFormat | None] = field(default_factory=dict)


Requirement = Callable[[Candidate], bool]


def on_cpu(c: Candidate) -> bool:
    return c.param.device.type == "cpu"


def compile_allowed(c: Candidate) -> bool:
    """``optimizer.cpu_compile`` (default ``True``); ``False`` sends CPU parameters to the torch paths."""
    return c.compile_cpu


def plain_adam_options(c: Candidate) -> bool:
    """A contiguous parameter, fp32 (any float dtype with a weight grid: the math runs in fp32), and no amsgrad,
    capturable, differentiable or fused."""
    group = c.group
    return (
        (c.param.dtype == torch.float32 or c.weights is not None)
        and c.param.is_contiguous()
        and not (group["amsgrad"] or group["capturable"] or group["differentiable"] or group["fused"])
    )


def no_weight_grid(c: Candidate) -> bool:
    """torch's behaviour for the parameter's values (no ``weights``, no ``error_feedback``)."""
    return c.weights is None


def fused_weight_update(c: Candidate) -> bool:
    """No weight grid, or one the fused steps (C++, Triton, compiled) round to: a cast format's (elementwise) that the
    parameter's dtype holds exactly (its own dtype's, or any on an fp32 parameter), with ``error_feedback`` ``None`` or
    ``"eco"`` (tracked steps count ECO's corrections beside them: ``QuantizedStates._intended_updates``). Block-scaled
    grids, ``"eco_exact"``'s buffer and a grid whose ``round`` is not ``WeightGrid``'s (a subclass's quantizer, which
    only the reference path calls) are the reference path's."""
    if c.weights is None:
        return True
    if type(c.weights).round is not WeightGrid.round:
        return False
    feedback = c.group["error_feedback"]
    held = c.weights.cast_dtype is not None and c.param.dtype in (c.weights.cast_dtype, torch.float32)
    return held and feedback in (None, "eco")


def both_moments_quantized(c: Candidate) -> bool:
    """Both Adam moments ``QuantizedTensor``s, fp32-valued (any float dtype with a weight grid: the math runs in fp32)."""
    m, v = c.state.get("exp_avg"), c.state.get("exp_avg_sq")
    return isinstance(m, QuantizedTensor) and isinstance(v, QuantizedTensor) and (m.dtype == torch.float32 or c.weights is not None)


def coded_moments(c: Candidate) -> bool:
    """The Adam moments as the native step takes them: fp32-valued ``QuantizedTensor``s (any float dtype with a weight
    grid: the math runs in fp32), one of them possibly a plain contiguous fp32 tensor, which it steps as an fp32 cast
    (``states={"exp_avg": "int8"}`` leaves ``v`` so); both plain is ``NATIVE_JOIN``'s."""
    moments = (c.state.get("exp_avg"), c.state.get("exp_avg_sq"))
    coded = [isinstance(x, QuantizedTensor) and (x.dtype == torch.float32 or c.weights is not None) for x in moments]
    return any(coded) and all(is_coded or _plain_fp32(x) for is_coded, x in zip(coded, moments, strict=True))


def _plain_fp32(x: object) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, QuantizedTensor) and x.dtype == torch.float32 and x.is_contiguous()


def fp32_moments(c: Candidate) -> bool:
    """Both moments plain contiguous fp32 tensors (``min_quant_size`` or a ``"fp32"`` policy kept them so)."""
    return _plain_fp32(c.state.get("exp_avg")) and _plain_fp32(c.state.get("exp_avg_sq"))


def no_quantized_state(c: Candidate) -> bool:
    """Every state a plain tensor: torch's own multi-tensor update applies as is."""
    return not any(isinstance(value, QuantizedTensor) for value in c.state.values())


def native_moments(c: Candidate) -> bool:
    """Moments the C++ kernel stores (``native.native_format``: 1- to 8-bit codebook and minifloat codes, any
    block sizes, bf16/fp16/fp32 casts; a plain fp32 moment as an fp32 cast), with either rounding."""
    m, v = (c.state[name] for name in ("exp_avg", "exp_avg_sq"))
    return native_formats(*(x.format if isinstance(x, QuantizedTensor) else FP32_CAST for x in (m, v)))


def float_betas(c: Candidate) -> bool:
    """Betas given as numbers, not tensors: torch computes the bias corrections of tensor betas in fp32 tensor
    arithmetic, the kernel in double from their values (fp32 moments would land up to 16 ulps from torch's)."""
    return not any(isinstance(beta, torch.Tensor) for beta in c.group["betas"])


def native_built(c: Candidate) -> bool:
    return native_kernel_available()


def native_values(c: Candidate) -> bool:
    """What the C++ kernel reads values in: an fp32 parameter, or with a weight grid one of fp32, bf16 or fp16, and a
    gradient of the parameter's dtype."""
    dtypes = VALUE_DTYPES if c.weights is not None else (torch.float32,)
    return c.param.dtype in dtypes and c.grad.dtype == c.param.dtype


def native_momentum_values(c: Candidate) -> bool:
    """``native_values`` (fp32, or with a weight grid fp32/bf16/fp16, the gradient of the parameter's dtype), the
    parameter contiguous (what the momentum kernel reads)."""
    return native_values(c) and c.param.is_contiguous()


def plain_momentum_options(c: Candidate) -> bool:
    """SGD or Muon with momentum (``momentum != 0``), and neither differentiable nor fused."""
    group = c.group
    return group["momentum"] != 0 and not (group.get("differentiable") or group.get("fused"))


def native_momentum(c: Candidate) -> bool:
    """A coded ``momentum_buffer`` in a format the C++ kernel stores (``native.native_format``), with either rounding:
    a fp32-valued ``QuantizedTensor`` already there, or one this step creates (SGD's first) in a policy format. On a
    weight grid also a plain buffer (``min_quant_size`` or an ``"fp32"`` policy keeps it so; fp32 there, as the
    reference path's update runs in fp32): the kernel steps it as an fp32 cast, as ``NATIVE_JOIN`` does Adam's moments."""
    buffer = c.state.get("momentum_buffer")
    if buffer is None:
        if "momentum_buffer" not in c.created:
            return False
        fmt = c.created["momentum_buffer"]
        return native_format(fmt) if fmt is not None else c.weights is not None
    if isinstance(buffer, QuantizedTensor):
        return buffer.dtype == torch.float32 and native_format(buffer.format)
    return c.weights is not None and buffer.dtype == torch.float32 and buffer.is_contiguous()


def on_triton_device(c: Candidate) -> bool:
    return c.param.device.type in TRITON_DEVICE_TYPES and TRITON_AVAILABLE


def triton_formats(c: Candidate) -> bool:
    return adam_step_supported(c.state["exp_avg"].format, c.state["exp_avg_sq"].format)


def half_or_fp32_values(c: Candidate) -> bool:
    """An fp32, bf16 or fp16 parameter and gradient (what the Triton kernel loads)."""
    return c.param.dtype in FLOAT_INPUT_DTYPES and c.grad.dtype in FLOAT_INPUT_DTYPES


def block_or_cast_moments(c: Candidate) -> bool:
    return all(isinstance(c.state[name].format, (BlockFormat, CastFormat)) for name in ("exp_avg", "exp_avg_sq"))


def large_param(c: Candidate) -> bool:
    return c.param.numel() >= FUSED_MIN_NUMEL


# The capability tables: (path, requirements), in order of preference. Requirements are checked left to right, so
# cheap checks come first, those that most often fail first of all (``coded_moments``: a model's many small
# parameters keep fp32 moments), and ``native_built`` last (it builds the C++ kernel on its first call).
ADAM_PATHS: tuple[tuple[StepPath, tuple[Requirement, ...]], ...] = (
    (
        StepPath.NATIVE,
        (
            coded_moments,
            on_cpu,
            compile_allowed,
            fused_weight_update,
            native_values,
            plain_adam_options,
            native_moments,
            native_built,
        ),
    ),  # fmt: skip
    (
        StepPath.TRITON,
        (
            on_triton_device,
            fused_weight_update,
            half_or_fp32_values,
            plain_adam_options,
            both_moments_quantized,
            block_or_cast_moments,
            triton_formats,
        ),
    ),
    (
        StepPath.COMPILED,
        (both_moments_quantized, on_cpu, compile_allowed, fused_weight_update, plain_adam_options, block_or_cast_moments, large_param),
    ),
    (StepPath.MULTI_TENSOR, (no_weight_grid, no_quantized_state)),
    (StepPath.REFERENCE, ()),
)
# SGD and Muon: the C++ step of the coded momentum buffers, else torch's functional update one parameter at a time.
# Parameters may be kept on a cast weight grid there (``weights=``; ECO's feedback into SGD's buffer; as the fused Adam
# steps, ``fused_weight_update``): SGD's rounded in the kernel, Muon's after its orthogonalized update, in torch.
MOMENTUM_PATHS: tuple[tuple[StepPath, tuple[Requirement, ...]], ...] = (
    (
        StepPath.NATIVE,
        (on_cpu, compile_allowed, fused_weight_update, native_momentum_values, plain_momentum_options, native_momentum, native_built),
    ),
    (StepPath.REFERENCE, ()),
)
# The generic wrapper: torch's functional update, one parameter at a time.
PER_PARAMETER_PATHS: tuple[tuple[StepPath, tuple[Requirement, ...]], ...] = ((StepPath.REFERENCE, ()),)
# fp32-state parameters that join a group's native call (as a rule, the small ones ``min_quant_size`` keeps fp32),
# those on a weight grid too (``weights=``, ECO's feedback: they step as coded ones with fp32 cast moments), where the
# fused steps handle the grid and the kernel reads the values (``native_values``). Under ``ADAM_PATHS``, those on a
# grid, whose other path is the per-parameter reference, take the native path even where no other parameter of the
# group does (the generic wrapper's ``exp_avg`` may belong to another update).
NATIVE_JOIN: tuple[Requirement, ...] = (
    fp32_moments,
    on_cpu,
    compile_allowed,
    native_values,
    fused_weight_update,
    plain_adam_options,
    float_betas,
    native_built,
)


# The param-group options the requirements and ``plan_group`` read (tested): with ``plan_inputs``, what a group's plan
# is made from.
PLAN_OPTIONS = ("amsgrad", "capturable", "differentiable", "fused", "error_feedback", "momentum", "states", "betas")


def plan_options(group: Mapping) -> tuple:
    """The group's ``PLAN_OPTIONS`` as the requirements tell them apart: their values, but ``betas`` by whether each is
    a tensor (``float_betas``; a scheduler that cycles ``beta1`` moves its value every step, and the plan with it not)."""
    return tuple(
        tuple(isinstance(beta, torch.Tensor) for beta in group[option]) if option == "betas" and option in group else group.get(option)
        for option in PLAN_OPTIONS
    )


def quantizing_policy(group: Mapping) -> bool:
    """Whether ``group``'s ``states=`` names a quantized format for some state: its fp32 moments are then those
    ``min_quant_size`` (or an override) keeps plain, not a choice of torch's fp32 update (``states="fp32"``)."""
    states = group.get("states", "fp32")
    return any(name != "fp32" for name in (states.values() if isinstance(states, Mapping) else (states,)))


def plan_inputs(
    param: torch.Tensor, grad: torch.Tensor, state: dict, weights: WeightGrid | None, created: Mapping[str, StorageFormat | None]
) -> tuple:
    """What the requirements read of one parameter (a ``Candidate``'s fields but its group and the optimizer's
    switches), as a tuple equal for two parameters exactly where every requirement decides alike: the local tensor's
    dtype, device, size and layout, the gradient's dtype, the weight grid, the states the step creates, and per state
    its name, type, dtype, and a ``QuantizedTensor``'s format or a tensor's layout. A requirement that reads more must
    add it here: an optimizer reuses a group's plan while these (and the group's ``PLAN_OPTIONS``) stay equal."""
    states = [
        (name, value.format, value.dtype)
        if isinstance(value, QuantizedTensor)
        else (name, value.dtype, value.is_contiguous())
        if isinstance(value, torch.Tensor)
        else (name, type(value))
        for name, value in state.items()
        if name != MOMENT_BOUND_STATE  # read by no requirement; it appears after the first step
    ]
    return (param.dtype, param.device, param.numel(), param.is_contiguous(), grad.dtype, weights, tuple(created.items()), *states)


def meets(candidate: Candidate, requirements: tuple[Requirement, ...]) -> bool:
    """Whether ``candidate`` meets every one of ``requirements``, checked left to right (a plain loop: a generator
    under ``all`` costs more than the checks themselves, and the step plans every parameter each step)."""
    for requirement in requirements:
        if not requirement(candidate):
            return False
    return True


def choose_path(table: tuple[tuple[StepPath, tuple[Requirement, ...]], ...], candidate: Candidate) -> StepPath:
    """The first path of ``table`` whose requirements ``candidate`` meets."""
    for path, requirements in table:
        if meets(candidate, requirements):
            return path
    raise ValueError(f"no step path of {[str(path) for path, _ in table]} applies; a table must end with one without requirements")


def plan_group(table: tuple[tuple[StepPath, tuple[Requirement, ...]], ...], candidates: list[Candidate]) -> list[StepPath]:
    """The path of each candidate of one param group (``choose_path``), with ``NATIVE_JOIN``: where some take the
    native path, the ``multi_tensor`` and ``reference`` ones that meet it join their call. Under ``ADAM_PATHS`` the
    ``reference`` ones that meet it take the native path in any case, and so do the ``multi_tensor`` ones of a group
    whose policy quantizes (``quantizing_policy``: a group of biases and norms that ``min_quant_size`` keeps fp32; one
    C++ call costs a fraction of torch's multi-tensor step over many small tensors); ``states="fp32"`` keeps torch's
    multi-tensor update, bit for bit ``torch.optim.AdamW``'s."""
    paths = [choose_path(table, candidate) for candidate in candidates]
    if StepPath.NATIVE in paths or (table is ADAM_PATHS and candidates and quantizing_policy(candidates[0].group)):
        joining = (StepPath.MULTI_TENSOR, StepPath.REFERENCE)
    else:
        joining = (StepPath.REFERENCE,) if table is ADAM_PATHS else ()
    return [StepPath.NATIVE if path in joining and meets(c, NATIVE_JOIN) else path for path, c in zip(paths, candidates, strict=True)]


def fused_adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    group: dict,
    track_stalls: bool,
    generator: torch.Generator | None = None,
    weights: WeightGrid | None = None,
) -> torch.Tensor:
    """The ``triton`` or ``compiled`` path: one Adam step of ``param`` and its quantized moments in ``state`` (in
    place; ``step`` goes up by one); returns ``int64 [stalled_m, moved_m, stalled_v, moved_v]``.

    Triton devices: one kernel pass (SR seeds drawn from ``generator``, default: the device's). CPU: compiled
    step on the whole blocks of ``param``, eager on the partial last block. Both with the weight grid ``weights`` (a
    cast format's, ``fused_weight_update``) and ECO's feedback where the group asks for them.

    Raises:
        StateOverflowError: a moment overflowed to inf/NaN (its block scale is not finite, or its cast stored inf; its
            codes written in place).
    """
    m, v = state["exp_avg"], state["exp_avg_sq"]
    # ECO's parameters are not held: both paths skip the hold where they feed the error back (adam_step_quantized's eco)
    bound = held_moment_bound(state, *(float(beta) for beta in group["betas"]), float(state["step"]))
    state["step"] += 1
    hyper = adam_hyper(group, float(state["step"]), bound)
    if param.device.type in TRITON_DEVICE_TYPES:
        seed = None
        weight_stochastic = weights is not None and group["weight_rounding"] == "stochastic"
        if group["rounding"] == "stochastic" or weight_stochastic:  # seeds (m, v[, weights]), drawn where the generator lives
            where = generator.device if generator is not None else param.device
            seed = draw_seed(generator, where, 3 if weight_stochastic else 2).to(param.device, non_blocking=True)
        options = (group["rounding"], decoupled_decay(group), group["maximize"], track_stalls, seed)
        if weights is not None:
            options += (weights.format, group["weight_rounding"], group["error_feedback"] == "eco")
        counts = triton_adam_step(param, grad, m, v, hyper, *options)
    else:
        counts = compiled_cpu_step(param, grad, m, v, hyper, group, track_stalls, weights)
    stored = [q.scales if q.scales is not None else q.codes for q in (m, v)]  # a cast stores a finite value past its range as inf
    if not bool(torch.stack([torch.isfinite(s).all() for s in stored]).all()):  # one host sync
        raise StateOverflowError("an Adam moment overflowed to inf/NaN during the step", [0], counts)
    return counts
