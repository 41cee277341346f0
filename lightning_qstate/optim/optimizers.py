"""QAdam, QAdamW, QSGD, QMuon: the torch optimizers with low-bit states.

Each class takes exactly its torch counterpart's arguments and defaults, and its
semantics (weight decay, amsgrad, nesterov, maximize, tensor LR, ...) are torch's:
the reference path runs torch's own functional update on fp32 copies of one
parameter's states at a time. The added keyword arguments are the fields of
:class:`~lightning_qstate.optim.policy.QuantizationPolicy` (or ``policy=`` one):

- ``states``: one format name for every state, or ``{state_name: format}``
  (unnamed states stay fp32), e.g. ``{"exp_avg": "int8", "exp_avg_sq": "e4m3"}``;
- ``rounding``: ``"nearest"`` or ``"stochastic"``;
- ``block_size``: values per scale (power of two; default per format);
- ``min_quant_size``: parameters with fewer elements keep fp32 states (default 4096);
- ``grads``: a format the gradients are rounded to before each step (``None``: left as they are), with ``rounding``;

these five may be overridden per param group, as may ``weights``, ``weight_rounding``, ``weight_block`` and
``error_feedback`` (training without fp32 master weights, ECO: ``optim/weights.py``). For the whole optimizer:
``track_stalls`` (count stalled state entries and weight entries whose update was lost to rounding, see
``stall_stats``), ``nonfinite`` (``"skip"``: skip a parameter
whose gradient holds inf/NaN, count it in ``nonfinite_skips`` and warn; ``"skip_step"``;
``"raise"``) and ``generator`` (the random source of stochastic rounding).

Each parameter of QAdam/QAdamW takes the fastest path that applies to it (``kernels/dispatch.py``:
the C++ kernel, Triton, ``torch.compile``, torch's multi-tensor Adam, or the reference), and of
QSGD/QMuon the C++ step of a coded momentum buffer on the CPU, or the reference;
``optimizer.step_paths()`` tells which one each took at the last step. Round to nearest, the
fast paths give the reference's codes bit for bit. ``optimizer.cpu_compile = False`` keeps CPU
parameters on the torch paths.

Example::

    >>> import torch
    >>> from lightning_qstate import QAdamW
    >>> model = torch.nn.Linear(128, 128)
    >>> opt = QAdamW(model.parameters(), lr=1e-3, states={"exp_avg": "int8", "exp_avg_sq": "int4"}, min_quant_size=0)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz, muon
from torch.optim.adam import adam
from torch.optim.optimizer import _get_scalar_dtype, _to_scalar
from torch.optim.sgd import sgd

from ..arguments import ConfigurationError
from ..formats import QuantizedTensor, StorageFormat
from ..formats.weights import WeightBlock
from ..kernels.adam_reference import adam_denominator, adam_hyper, decoupled_decay, eco_feedback, hold_moment, sqrt_rn
from ..kernels.bounds import held_moment_bound
from ..kernels.dispatch import ADAM_PATHS, MOMENTUM_PATHS, StepPath, fused_adam_step
from ..kernels.native import native_adam_steps, native_momentum_steps
from .base import QuantizedStates, finite_grads, local_tensor
from .policy import ErrorFeedback, NonFiniteGradPolicy, QuantizationPolicy, StatesSpec
from .weights import sgd_feedback_coefficient


class _AdamStates(QuantizedStates):
    """Adam-family state handling shared by QAdam and QAdamW (the same functional ``adam``).

    Each parameter takes a path of ``kernels.dispatch.ADAM_PATHS``; each path steps its parameters of a param group
    in one go (``native``: one C++ call, gradient checks included; ``multi_tensor``: one torch call after one
    batched gradient check) or one by one (``triton``, ``compiled``, ``reference``).
    """

    state_names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    step_path_table = ADAM_PATHS

    def _run_path(self, path: StepPath, group: dict, keys: list[torch.Tensor]) -> None:
        if path is StepPath.NATIVE:
            self._native_steps(group, keys)
        elif path is StepPath.MULTI_TENSOR:
            self._multi_tensor_steps(group, keys)
        elif path in (StepPath.TRITON, StepPath.COMPILED):
            self._step_each(group, keys, self._fused_step)
        else:
            super()._run_path(path, group, keys)

    def _multi_tensor_steps(self, group: dict, keys: list[torch.Tensor]) -> None:
        """torch's multi-tensor Adam(W) for params whose states are plain tensors (on the CPU bit-identical to its
        per-parameter loop), after one batched gradient check: an L1 norm per gradient (defined for empty shards),
        and the exact check only where it is not finite (finite values can overflow it)."""
        grads = [local_tensor(key.grad) for key in keys]
        finite = finite_grads(grads)
        for key in (key for key, ok in zip(keys, finite, strict=True) if not ok):
            self._skip_nonfinite_grad(key)
        kept = [(key, grad) for key, grad, ok in zip(keys, grads, finite, strict=True) if ok]
        if kept:
            targets = self._intended_updates(group, [key for key, _ in kept])
            states = [self.state[key] for key, _ in kept]
            # torch's multi-tensor Adam takes neither autograd nor a tensor lr or betas (unless capturable), and under
            # torch.compile its scalar lists of CPU step tensors do not trace (the per-tensor loop keeps them tensors)
            tensors = [group["lr"], *group["betas"]]
            tensor_options = any(isinstance(value, torch.Tensor) for value in tensors) and not group["capturable"]
            unsupported = group["fused"] or group["differentiable"] or tensor_options or torch.compiler.is_compiling()
            # foreach=None is torch's default: its per-tensor loop on the CPU, where its multi-tensor ops round fp16/bf16
            # parameters otherwise (fp32 ones agree bit for bit and keep the faster multi-tensor step)
            low_precision = any(key.dtype in (torch.float16, torch.bfloat16) and key.device.type == "cpu" for key, _ in kept)
            multi_tensor = (group["foreach"] or (group["foreach"] is None and not low_precision)) and not unsupported
            self._adam(group, [local_tensor(key) for key, _ in kept], [grad for _, grad in kept], states, multi_tensor)
            self._count_intended_stalls(targets)

    def _native_steps(self, group: dict, keys: list[torch.Tensor]) -> None:
        """The ``native`` path: one C++ call for ``keys`` (``kernels.native``), with each parameter's weight grid and,
        for stochastic weight rounding, a seed per parameter (``_kernel_seeds(key, "weights")``); for stochastic
        rounding of the moments, seeds of ``m`` and ``v`` (``_kernel_seeds(key, "moments", 2)``): reproducible from the
        optimizer's seed, a resumed run rounds alike."""
        states = [self.state[key] for key in keys]
        params, grads = [local_tensor(key) for key in keys], [local_tensor(key.grad) for key in keys]
        weights = [self.weight_grid(group, key, param) for key, param in zip(keys, params, strict=True)]
        stochastic = group["weight_rounding"] == "stochastic"
        seeds = [
            self._kernel_seeds(key, "weights")[0] if grid is not None and stochastic else 0 for key, grid in zip(keys, weights, strict=True)
        ]
        moment_seeds = [
            tuple(self._kernel_seeds(key, "moments", 2))
            if group["rounding"] == "stochastic"
            and any(isinstance(self.state[key][name], QuantizedTensor) for name in self.state_names[:2])
            else (0, 0)
            for key in keys
        ]
        targets = self._intended_updates(group, keys)

        def finish(rows: list[list[int]], overflowed: frozenset[int]) -> None:
            for k, (key, state, row) in enumerate(zip(keys, states, rows, strict=True)):
                if not row[0]:
                    self._skip_nonfinite_grad(key)
                elif self.track_stalls and k not in overflowed:
                    for name, counts in zip(self.state_names[:2], (row[2:4], row[4:6]), strict=True):
                        if isinstance(state[name], QuantizedTensor):  # a plain moment (an fp32 cast there) has none
                            self._add_stall_counts(key, name, torch.tensor(counts))
            self._count_intended_stalls(targets, [keys[k] for k in overflowed])  # after the skips are known

        call = functools.partial(native_adam_steps, params, grads, states, group, self.track_stalls, weights, seeds, moment_seeds)
        self._fused_call(keys, call, finish)

    def _fused_step(self, group: dict, key: torch.Tensor, param: torch.Tensor, grad: torch.Tensor, state: dict) -> None:
        """The ``triton`` or ``compiled`` path of one parameter (``kernels.dispatch.fused_adam_step``)."""
        weights = self.weight_grid(group, key, param)
        stochastic = group["rounding"] == "stochastic" or (weights is not None and group["weight_rounding"] == "stochastic")
        generator = self.rounding_generator(key, "moments", param.device) if stochastic else None
        # the compiled CPU step draws from torch's global generator: seed it from this step's stream, then restore it
        on_cpu = generator is not None and param.device.type == "cpu"
        targets = self._intended_updates(group, [key])

        def finish(counts: torch.Tensor, overflowed: frozenset[int]) -> None:
            if self.track_stalls and not overflowed:
                self._add_stall_counts(key, "exp_avg", counts[:2])
                self._add_stall_counts(key, "exp_avg_sq", counts[2:])
                self._count_intended_stalls(targets)

        with torch.random.fork_rng(devices=[], enabled=on_cpu):
            if on_cpu:
                torch.manual_seed(int(torch.randint(2**62, (1,), generator=generator)))
            call = functools.partial(fused_adam_step, param, grad, state, group, self.track_stalls, generator, weights)
            self._fused_call([key], call, finish)

    def _init_state(self, group: dict, key: torch.Tensor, param: torch.Tensor, state: dict) -> None:
        on_device = group["capturable"] or group["fused"]
        state["step"] = torch.zeros((), dtype=_get_scalar_dtype(is_fused=group["fused"]), device=param.device if on_device else "cpu")
        names = self.state_names if group["amsgrad"] else self.state_names[:2]
        for name in names:
            state[name] = self._initial(group, key, name, torch.zeros_like(param, memory_format=torch.preserve_format))

    def _update(self, group: dict, param: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor], state: dict) -> None:
        """torch's Adam on the decoded moments. Where a moment is stored quantized, the updated ``m`` is then held to
        ``|m| <= K sqrt(v)`` of the updated ``v``, which exact Adam never exceeds (``kernels.bounds``): storage never
        makes a step larger. torch's update is one call, so where the hold acts the parameter's value is taken again
        from the held ``m``, as the fused steps take it (``adam_reference.adam_math``'s last line, torch's
        ``addcdiv_``; amsgrad's denominator from ``max_exp_avg_sq``); elsewhere it is torch's. No host sync. Not where
        ECO feeds the rounding error into ``m`` (``_feeding_back``): ``m`` is outside the bound by design there."""
        quantized = any(isinstance(state[name], QuantizedTensor) for name in ("exp_avg", "exp_avg_sq"))
        bound = (
            held_moment_bound(state, *(float(beta) for beta in group["betas"]), float(state["step"]), self._feeding_back)
            if quantized
            else math.inf
        )
        if math.isinf(bound):
            self._adam(group, [param], [grad], [{**state, **states}], multi_tensor=False)
            return
        before, merged = param.clone(), {**state, **states}
        self._adam(group, [param], [grad], [merged], multi_tensor=False)
        exp_avg, exp_avg_sq = merged["exp_avg"], merged["exp_avg_sq"]
        hyper = adam_hyper(group, float(state["step"]), bound)
        held = hold_moment(exp_avg, sqrt_rn(exp_avg_sq), hyper["moment_bound"])
        acted = (held != exp_avg) & ~exp_avg.isnan()
        denom = adam_denominator(merged["max_exp_avg_sq"] if group["amsgrad"] else exp_avg_sq, hyper)
        decayed = before * hyper["decay"] if decoupled_decay(group) else before
        param.copy_(torch.where(acted, decayed - hyper["step_size"] * held / denom, param))
        exp_avg.copy_(held)

    def _check_weight_options(self, group: dict, owner: str) -> None:
        super()._check_weight_options(group, owner)
        if group["error_feedback"] == "eco" and float(group["betas"][0]) == 0:
            raise ConfigurationError(
                f"{owner}: error_feedback='eco' feeds the rounding error into m, which betas[0]=0 does not keep; use 'eco_exact'"
            )

    def _feed_back_error(self, group: dict, key: torch.Tensor, error: torch.Tensor, states: dict, state: dict) -> None:
        """ECO's Adam rule (``optim.weights``) with this step's ``v``, learning rate and bias corrections."""
        hyper = adam_hyper(group, float(state["step"]))
        v = states["max_exp_avg_sq" if group["amsgrad"] else "exp_avg_sq"]
        corrected = eco_feedback(states["exp_avg"], adam_denominator(v, hyper), error, hyper)
        self._count_feedback_stalls(key, state.get("exp_avg"), states["exp_avg"], corrected)
        states["exp_avg"] = corrected

    @staticmethod
    def _adam(group: dict, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict], multi_tensor: bool) -> None:
        """torch's functional Adam(W) with ``group``'s options on plain tensors; ``states``: per param, ``step`` and moments."""
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            [state["exp_avg"] for state in states],
            [state["exp_avg_sq"] for state in states],
            [state["max_exp_avg_sq"] for state in states] if group["amsgrad"] else [],
            [state["step"] for state in states],
            foreach=multi_tensor,
            capturable=group["capturable"],
            differentiable=group["differentiable"],
            fused=group["fused"],
            decoupled_weight_decay=group["decoupled_weight_decay"],
            amsgrad=group["amsgrad"],
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )


class QAdam(_AdamStates, torch.optim.Adam):
    """``torch.optim.Adam`` with quantized ``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq``.

    The first arguments, up to ``decoupled_weight_decay``, are ``torch.optim.Adam``'s, with its defaults and
    meaning. The rest choose how the states (and optionally the weights) are stored.

    Args:
        states: a format name for every state (``"int8"``, ``"int4"``, ``"fp8_e4m3"``, ``"bf16"``, ``"e2m2"``, ...;
            :func:`lightning_qstate.formats.get_format`), or ``{state_name: format}`` (states not named stay fp32),
            e.g. ``{"exp_avg": "int8", "exp_avg_sq": "int4"}``. ``v`` gets the unsigned, zero-free map of its format.
        rounding: ``"nearest"`` or ``"stochastic"`` (unbiased; draws from ``generator``). Stochastic rounding keeps
            slowly moving states such as ``v`` at ``beta2 = 0.999`` from stalling (``theory.stall_probability``).
        block_size: values per absmax scale, a power of two (default: 256, or 128 for formats of 4 bits or fewer).
        min_quant_size: parameters with fewer elements keep fp32 states (biases, norms; default 4096).
        weights: keep the parameters themselves in this format after each step, without an fp32 master copy
            (``"bf16"``, ``"fp16"``, ``"fp8_e4m3"``, ...; ``None``: torch's behaviour).
        weight_rounding: ``"stochastic"`` (default) or ``"nearest"`` for ``weights``.
        weight_block: scale granularity of block-scaled weight formats: ``"row"`` (default), a block size, ``"tensor"``.
        error_feedback: ``None``, ``"eco"`` (feed the weights' rounding error into ``m``, arXiv 2601.22101) or
            ``"eco_exact"`` (with one fp32 error buffer per parameter).
        grads: round the gradients to this format before the step (``None``: as they are).
        track_stalls: count state entries whose update was lost to rounding (:meth:`stall_stats`).
        nonfinite: a gradient holding inf/NaN: ``"skip"`` that parameter (default, counted and warned),
            ``"skip_step"`` (the whole step) or ``"raise"``. Stored states never hold NaN.
        generator: where the stochastic-rounding seed is drawn from at construction (seed it for reproducible runs;
            checkpointed); ``None``: the draw torch's global generator would give next, without advancing it.
        policy: a :class:`~lightning_qstate.optim.policy.QuantizationPolicy` instead of the keywords above.

    ``states``, ``rounding``, ``block_size``, ``min_quant_size``, ``grads`` and the weight options may also be set per
    param group. Each parameter takes the fastest step path that applies (C++ on the CPU, Triton on CUDA,
    ``torch.compile``, or torch's own functional Adam on decoded states); ``step_paths()`` says which.
    Round to nearest, every path writes the reference's codes bit for bit.

    Useful methods: :meth:`step_paths`, :meth:`stall_stats`, :meth:`reencode_state` (change a state's format),
    :meth:`reset_states`, :meth:`fp32_state_dict` (a plain torch checkpoint); ``state_dict``/``load_state_dict``
    round-trip the codes exactly and load with ``weights_only=True``; a plain ``torch.optim.Adam`` state dict loads too.

    Example::

        >>> import torch
        >>> from lightning_qstate import QAdam, state_nbytes
        >>> model = torch.nn.Linear(256, 256)
        >>> opt = QAdam(model.parameters(), lr=1e-3, states="int8", min_quant_size=0)
        >>> model(torch.randn(8, 256)).square().mean().backward()
        >>> opt.step()
        >>> round(state_nbytes(opt) / sum(p.numel() for p in model.parameters()), 2)  # bytes per parameter
        2.02
    """

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
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
        torch.optim.Adam.__init__(
            self, params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize, capturable=capturable,
            differentiable=differentiable, fused=fused, decoupled_weight_decay=decoupled_weight_decay,
        )  # fmt: skip
        self._setup_quantized_states(QuantizationPolicy.from_arguments(type(self).__name__, policy, locals()), generator)


class QAdamW(QAdam, torch.optim.AdamW):
    """``torch.optim.AdamW`` with quantized ``exp_avg``/``exp_avg_sq``/``max_exp_avg_sq``: :class:`QAdam` with
    decoupled weight decay, as torch's ``AdamW`` is ``Adam``'s. The arguments are ``torch.optim.AdamW``'s, then
    :class:`QAdam`'s storage options (``states``, ``rounding``, ``block_size``, ``min_quant_size``, ``weights``,
    ``weight_rounding``, ``weight_block``, ``error_feedback``, ``grads``, ``track_stalls``, ``nonfinite``,
    ``generator``, ``policy``), described there.

    Example: 8-bit ``m``, 4-bit ``v`` with stochastic rounding, and bf16 weights without an fp32 master copy::

        >>> import torch
        >>> from lightning_qstate import QAdamW
        >>> model = torch.nn.Linear(256, 256).bfloat16()
        >>> opt = QAdamW(
        ...     model.parameters(), lr=1e-3, states={"exp_avg": "int8", "exp_avg_sq": "int4"}, rounding="stochastic",
        ...     weights="bf16", error_feedback="eco", min_quant_size=0, generator=torch.Generator().manual_seed(0),
        ... )
        >>> model(torch.randn(8, 256, dtype=torch.bfloat16)).float().square().mean().backward()
        >>> opt.step()
        >>> model.weight.dtype, opt.state_format(model.weight, "exp_avg_sq").name
        (torch.bfloat16, 'int4')
    """

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
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
        QAdam.__init__(
            self, params, lr, betas, eps, weight_decay, amsgrad, foreach=foreach, maximize=maximize, capturable=capturable,
            differentiable=differentiable, fused=fused, decoupled_weight_decay=True, generator=generator,
            policy=QuantizationPolicy.from_arguments(type(self).__name__, policy, locals()),
        )  # fmt: skip


class _MomentumStates(QuantizedStates):
    """The quantized ``momentum_buffer`` of QSGD and QMuon.

    Each parameter takes a path of ``kernels.dispatch.MOMENTUM_PATHS``: ``native`` steps the coded buffers of a param
    group in one C++ call (``kernels.native.native_momentum_steps``: gradient checks, SGD's whole step, or Muon's
    momentum with ``_apply_update`` after it; on a weight grid too), ``reference`` one parameter at a time.
    """

    state_names = ("momentum_buffer",)
    step_path_table = MOMENTUM_PATHS
    muon_momentum = False  # the kernel computes Muon's momentum and update (QMuon), not SGD's whole step

    def _run_path(self, path: StepPath, group: dict, keys: list[torch.Tensor]) -> None:
        if path is StepPath.NATIVE:
            self._native_steps(group, keys)
        else:
            super()._run_path(path, group, keys)

    def _native_steps(self, group: dict, keys: list[torch.Tensor]) -> None:
        """The ``native`` path: one C++ call for ``keys`` (SGD's first step creates the buffer there, in the policy's
        format, kept only if the parameter steps); for stochastic rounding, a seed per buffer
        (``_kernel_seeds(key, "momentum_buffer")``: reproducible from the optimizer's seed, a resumed run rounds alike), and
        for SGD's parameters on a weight grid, its seed of stochastic weight rounding (``_kernel_seeds(key,
        "weights")``) and ECO's coefficient (``optim.weights.sgd_feedback_coefficient``). QMuon's parameters on a weight
        grid (no ECO: QMuon refuses ``"eco"``) take the kernel's momentum and update, then ``_apply_update`` on fp32
        copies rounded onto the grid (``_round_to_grid``), as the reference path's ``_update_weights``."""
        params, grads = [local_tensor(key) for key in keys], [local_tensor(key.grad) for key in keys]
        weights = [self.weight_grid(group, key, param) for key, param in zip(keys, params, strict=True)]
        targets = self._intended_updates(group, keys)
        created = ["momentum_buffer" not in self.state[key] for key in keys]  # SGD's first step writes it (buf = d)
        buffers = [
            self._new_buffer(group, key, param) if new else self.state[key]["momentum_buffer"]
            for key, param, new in zip(keys, params, created, strict=True)
        ]
        stochastic = group["rounding"] == "stochastic"  # a plain buffer (fp32, on a weight grid) rounds nothing
        seeds = [
            self._kernel_seeds(key, "momentum_buffer")[0] if stochastic and isinstance(buffer, QuantizedTensor) else 0
            for key, buffer in zip(keys, buffers, strict=True)
        ]
        masters = params  # what Muon's update steps: the parameter, or (on a grid, as _update_weights) fp32 copies
        if self.muon_momentum:  # the kernel's momentum from fp32 gradients (it reads no parameter values); the rounding below
            masters = [
                param if grid is None else param.float() if param.dtype != torch.float32 else param.clone()
                for param, grid in zip(params, weights, strict=True)
            ]
            fp32_grads = [grad if grad.dtype == torch.float32 else grad.float() for grad in grads]
            call = functools.partial(native_momentum_steps, masters, fp32_grads, buffers, group, True, self.track_stalls, seeds)
        else:  # SGD's whole step, onto its weight grid too
            weight_stochastic = group["weight_rounding"] == "stochastic"
            weight_seeds = [
                self._kernel_seeds(key, "weights")[0] if grid is not None and weight_stochastic else 0
                for key, grid in zip(keys, weights, strict=True)
            ]
            feedback = group["error_feedback"] == "eco"
            eco = [sgd_feedback_coefficient(group) if grid is not None and feedback else 0.0 for grid in weights]
            call = functools.partial(
                native_momentum_steps, params, grads, buffers, group, False, self.track_stalls, seeds, weights, weight_seeds, eco, created
            )

        def finish(results: tuple[list[list[int]], list[torch.Tensor | None]], overflowed: frozenset[int]) -> None:
            """Keep each created buffer, count stalls and apply Muon's updates, but where a gradient was not finite
            (a buffer this step was to create is not kept: torch's step makes none) or a buffer overflowed."""
            rows, updates = results
            for k, (key, param, master, grid, row, update, buffer, new) in enumerate(
                zip(keys, params, masters, weights, rows, updates, buffers, created, strict=True)
            ):
                if not row[0]:
                    self._skip_nonfinite_grad(key)
                    continue
                if k in overflowed:
                    continue
                if new:
                    self.state[key]["momentum_buffer"] = buffer
                elif self.track_stalls and isinstance(buffer, QuantizedTensor):  # a new or plain buffer has none (as on the reference path)
                    self._add_stall_counts(key, "momentum_buffer", torch.tensor(row[2:4]))
                if update is None:
                    continue
                self._apply_update(group, master, update)
                if grid is not None:
                    param.copy_(self._round_to_grid(group, key, param, master, grid))
            self._count_intended_stalls(targets, [keys[k] for k in overflowed])  # after the skips are known

        self._fused_call(keys, call, finish)

    def _new_buffer(self, group: dict, key: torch.Tensor, param: torch.Tensor) -> QuantizedTensor | torch.Tensor:
        """The buffer SGD's first step creates in the kernel (its values written, not read): in the policy's format, or
        plain fp32 (a parameter on a weight grid, whose update runs in fp32)."""
        fmt = self._policy_format(group, key, "momentum_buffer")
        return (
            torch.empty(param.shape, dtype=torch.float32, device=param.device)
            if fmt is None
            else fmt.allocate(param.shape, device=param.device)
        )

    def _apply_update(self, group: dict, param: torch.Tensor, update: torch.Tensor) -> None:
        """Step ``param`` with the kernel's momentum ``update`` (fp32, param's shape): QMuon's orthogonalized step."""
        raise NotImplementedError(f"{type(self).__name__}: the kernel steps its parameters itself")


class QSGD(_MomentumStates, torch.optim.SGD):
    """``torch.optim.SGD`` with a quantized ``momentum_buffer``.

    The first arguments are ``torch.optim.SGD``'s; the storage options (``states``, ``rounding``, ...,
    ``error_feedback="eco"`` for weights kept without master copies) are :class:`QAdam`'s. As in torch, the buffer is
    created from the first gradient, so there is no state when ``momentum=0``. On the CPU every step of a parameter
    with a coded buffer, the first (which creates it) too, is one C++ call per param group (``step_paths()``:
    ``"native"``): fp32 ones, and
    without master weights fp32/bf16/fp16 ones kept on a cast grid (``weights="bf16"``, ``error_feedback="eco"``);
    round to nearest, the reference path's codes and params bit for bit.

    Example::

        >>> import torch
        >>> from lightning_qstate import QSGD
        >>> model = torch.nn.Linear(256, 256)
        >>> opt = QSGD(model.parameters(), lr=0.1, momentum=0.9, states="int8", min_quant_size=0)
        >>> model(torch.randn(8, 256)).square().mean().backward()
        >>> opt.step()
        >>> opt.state_format(model.weight, "momentum_buffer").name
        'int8'
    """

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
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
        torch.optim.SGD.__init__(
            self, params, lr, momentum, dampening, weight_decay, nesterov, maximize=maximize, foreach=foreach,
            differentiable=differentiable, fused=fused,
        )  # fmt: skip
        self._setup_quantized_states(QuantizationPolicy.from_arguments(type(self).__name__, policy, locals()), generator)

    def _init_state(self, group: dict, key: torch.Tensor, param: torch.Tensor, state: dict) -> None:
        """No state until the first step with momentum (torch clones the first gradient into the buffer)."""

    def _created_states(self, group: dict, key: torch.Tensor, state: dict) -> dict[str, StorageFormat | None]:
        """The first step with momentum creates the buffer, in the policy's format."""
        if group["momentum"] == 0 or "momentum_buffer" in state:
            return {}
        return {"momentum_buffer": self._policy_format(group, key, "momentum_buffer")}

    def _update(self, group: dict, param: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor], state: dict) -> None:
        buffers = [states.get("momentum_buffer")]
        sgd(
            [param],
            [grad],
            buffers,
            # the group's choice (None: torch's per-tensor loop on the CPU): its multi-tensor ops round bf16/fp16 otherwise
            foreach=bool(group["foreach"]) and not group["fused"],
            fused=group["fused"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
        )
        if group["momentum"] != 0:
            states["momentum_buffer"] = buffers[0]
        else:  # unused (torch's SGD keeps it as it is for when momentum returns): its codes stay
            states.pop("momentum_buffer", None)

    def _check_weight_options(self, group: dict, owner: str) -> None:
        super()._check_weight_options(group, owner)
        if group["error_feedback"] == "eco" and group["momentum"] == 0:
            raise ConfigurationError(
                f"{owner}: error_feedback='eco' feeds the rounding error into the momentum buffer; set momentum > 0, or use 'eco_exact'"
            )

    def _feed_back_error(self, group: dict, key: torch.Tensor, error: torch.Tensor, states: dict, state: dict) -> None:
        """ECO's SGD-momentum rule (``optim.weights``) with this step's learning rate."""
        buffer = states["momentum_buffer"]
        corrected = buffer + sgd_feedback_coefficient(group) * error
        self._count_feedback_stalls(key, state.get("momentum_buffer"), buffer, corrected)
        states["momentum_buffer"] = corrected


class QMuon(_MomentumStates, torch.optim.Muon):
    """``torch.optim.Muon`` (2-D parameters) with a quantized ``momentum_buffer``.

    The first arguments are ``torch.optim.Muon``'s; the storage options are :class:`QAdam`'s. ``error_feedback="eco"``
    is refused: Muon's orthogonalized update is not linear in the momentum, so the rounding error cannot be folded
    into it; ``"eco_exact"`` (an error buffer) works. Muon needs about half of Adam's mantissa bits for a run of the
    same length (``theory.precision.required_mantissa_bits``). On the CPU the momentum of a parameter with a coded
    buffer is one C++ call per param group (``step_paths()``: ``"native"``), torch's Newton–Schulz orthogonalization
    and param update follow (on fp32 copies rounded onto the grid for a parameter kept on a cast weight grid, as
    ``weights="bf16"``): round to nearest, the reference path's codes and params bit for bit.

    Example::

        >>> import torch
        >>> from lightning_qstate import QMuon
        >>> weight = torch.nn.Parameter(torch.randn(128, 128))
        >>> opt = QMuon([weight], lr=0.02, states="int4", min_quant_size=0)
        >>> weight.square().sum().backward()
        >>> opt.step()
        >>> opt.state_format(weight, "momentum_buffer").bits
        4
    """

    error_feedbacks = (None, "eco_exact")  # the orthogonalized update is not linear in the momentum: no "eco"
    muon_momentum = True

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
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
        torch.optim.Muon.__init__(self, params, lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn)
        self._setup_quantized_states(QuantizationPolicy.from_arguments(type(self).__name__, policy, locals()), generator)

    def _check_param(self, param: torch.Tensor, owner: str) -> None:
        """2-D parameters only (torch's constructor checks, ``add_param_group`` did not), and no DTensor shards: Muon
        orthogonalizes the full matrix, and each rank would orthogonalize its own rows."""
        if isinstance(param, DTensor):
            raise ConfigurationError(
                f"{owner}: parameters sharded as DTensors (FSDP2) are not supported: Muon orthogonalizes the full matrix, and "
                "this optimizer would orthogonalize each rank's shard (another algorithm); keep Muon's parameters unsharded "
                "(DDP) or use QAdamW"
            )
        if param.ndim != 2:
            raise ValueError(
                f"{owner}: Muon only supports 2-D parameters, got one of shape {tuple(param.shape)}; give biases, norms "
                "and embeddings to an AdamW"
            )

    def _init_state(self, group: dict, key: torch.Tensor, param: torch.Tensor, state: dict) -> None:
        state["momentum_buffer"] = self._initial(
            group, key, "momentum_buffer", torch.zeros_like(param, memory_format=torch.preserve_format)
        )

    def _update(self, group: dict, param: torch.Tensor, grad: torch.Tensor, states: dict[str, torch.Tensor], state: dict) -> None:
        muon(
            [param],
            [grad],
            [states["momentum_buffer"]],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
            ns_coefficients=group["ns_coefficients"],
            ns_steps=group["ns_steps"],
            eps=group["eps"],
            adjust_lr_fn=group["adjust_lr_fn"],
            has_complex=False,
        )

    def _apply_update(self, group: dict, param: torch.Tensor, update: torch.Tensor) -> None:
        """The rest of torch's single-tensor ``muon`` after the momentum, with its own functions: the update
        orthogonalized, the param decayed and stepped with the adjusted learning rate."""
        lr = _to_scalar(group["lr"])
        update = _zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])
        param.mul_(1 - lr * group["weight_decay"])
        param.add_(update, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], param.shape))
