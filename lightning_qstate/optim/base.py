"""The quantized-state machinery shared by QAdam, QAdamW, QSGD, QMuon and the generic wrapper.

A quantized optimizer is its torch counterpart whose per-parameter states live in
low-bit :class:`~lightning_qstate.formats.QuantizedTensor` buffers between steps.
Each step, one parameter at a time: dequantize its states to fp32, run torch's
own update math on them, and quantize them back. The transient memory is the fp32
states of a single parameter.
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch

from ..formats import QuantizedTensor, StorageFormat, get_format
from .policy import NONNEGATIVE_STATES, POLICY_DEFAULTS, StatesSpec, resolve_format, validate_policy
from .serialization import STATE_FORMAT_VERSION, VERSION_KEY, export_state, import_state, is_exported

NonFiniteGradPolicy = Literal["skip", "raise"]
NONFINITE_GRAD_POLICIES: tuple[str, ...] = ("skip", "raise")
StateValue = torch.Tensor | QuantizedTensor


def dequantized(value: StateValue) -> torch.Tensor:
    """A state as a tensor: quantized states are decoded into a new tensor, plain tensors returned as they are."""
    return value.dequantize() if isinstance(value, QuantizedTensor) else value


def state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held by ``optimizer.state``: every tensor, and every quantized state's codes and scales.

    Works for any ``torch.optim.Optimizer``, so a quantized optimizer can be compared with its fp32 twin.
    """
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, QuantizedTensor):
                total += value.nbytes
            elif isinstance(value, torch.Tensor):
                total += value.nbytes
    return total


class QuantizedStates:
    """Mixin holding the state-storage logic; concrete optimizers combine it with a ``torch.optim`` class.

    Subclasses set ``state_names`` and implement ``_update(group, param, grad, states, state)``, which
    applies torch's update to the fp32 ``states`` (a dict of tensors, mutated in place or replaced), and
    ``_init_state(group, param, state)`` to create a parameter's states.
    """

    state_names: tuple[str, ...] = ()

    def _setup_quantized_states(
        self,
        states: StatesSpec,
        rounding: str,
        block_size: int | None,
        min_quant_size: int,
        track_stalls: bool,
        nonfinite: NonFiniteGradPolicy,
        generator: torch.Generator | None,
    ) -> None:
        """Add the policy options to the defaults and every group (validated), and the step options."""
        if nonfinite not in NONFINITE_GRAD_POLICIES:
            raise ValueError(f"{type(self).__name__}: nonfinite={nonfinite!r} is not valid; use one of {NONFINITE_GRAD_POLICIES}")
        self.defaults.update({"states": states, "rounding": rounding, "block_size": block_size, "min_quant_size": min_quant_size})
        for group in self.param_groups:
            self._complete_group(group)
        self.track_stalls = bool(track_stalls)
        self.nonfinite = nonfinite
        self.generator = generator
        self.nonfinite_skips = 0
        self._stall_counts: dict[tuple[torch.Tensor, str], torch.Tensor] = {}
        self._step_supports_amp_scaling = False  # a GradScaler must unscale the grads before our step

    def _complete_group(self, group: dict) -> None:
        for key, value in POLICY_DEFAULTS.items():
            group.setdefault(key, self.defaults.get(key, value))
        validate_policy(group, self.state_names or None, type(self).__name__)
        for param in group["params"]:
            if torch.is_complex(param):
                raise ValueError(f"{type(self).__name__}: complex parameters are not supported; give them to a separate torch optimizer")

    # --- the step -------------------------------------------------------------------------------------
    def _grad_is_finite(self, param: torch.Tensor, grad: torch.Tensor) -> bool:
        """Apply the non-finite-gradient policy: ``skip`` (count and warn) or ``raise``."""
        if bool(torch.isfinite(grad).all()):
            return True
        message = f"{type(self).__name__}: non-finite gradient for a parameter of shape {tuple(param.shape)}"
        if self.nonfinite == "raise":
            raise FloatingPointError(message + " (nonfinite='raise')")
        self.nonfinite_skips += 1
        warnings.warn(message + "; its update was skipped and its states left unchanged (nonfinite='skip')", RuntimeWarning, stacklevel=3)
        return False

    def _check_grad(self, grad: torch.Tensor) -> None:
        if grad.is_sparse:
            raise RuntimeError(f"{type(self).__name__} does not support sparse gradients; use torch.optim.SparseAdam for sparse embeddings")

    @torch.no_grad()
    def step(self, closure=None):
        """One optimization step, parameter by parameter; ``closure`` re-evaluates the loss under grad mode."""
        loss = self._evaluate(closure)
        self._step_params()
        return loss

    @staticmethod
    def _evaluate(closure):
        """Run the closure (if any) with gradients enabled, before any gradient is checked."""
        if closure is None:
            return None
        with torch.enable_grad():
            return closure()

    def _step_params(self) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                self._check_grad(grad)
                if not self._grad_is_finite(param, grad):
                    continue
                self._step_param(group, param, grad, self.state[param])

    def _step_param(self, group: dict, param: torch.Tensor, grad: torch.Tensor, state: dict) -> None:
        if not state:
            self._init_state(group, param, state)
        states = {name: dequantized(state[name]) for name in self.state_names if state.get(name) is not None}
        before = {name: value.clone() for name, value in states.items() if self.track_stalls and isinstance(state[name], QuantizedTensor)}
        self._update(group, param, grad, states, state)
        for name, value in states.items():
            state[name] = self._store(group, param, name, value, state.get(name), before.get(name))

    def _store(self, group: dict, param: torch.Tensor, name: str, value: torch.Tensor, old: StateValue | None, before: torch.Tensor | None) -> StateValue:
        """Write an updated fp32 state back in its format: the old state's format, or the policy's for a new state."""
        fmt = self._format_for(group, param, name, value, old)
        if fmt is None:
            return value
        stored = fmt.quantize(value, rounding=group["rounding"], generator=self.generator)
        if before is not None:
            self._count_stalls(param, name, before, value, stored)
        return stored

    def _format_for(self, group: dict, param: torch.Tensor, name: str, value: torch.Tensor, old: StateValue | None) -> StorageFormat | None:
        """Format to store ``value`` in: a quantized state keeps its format, a plain one stays plain, a new one follows the policy."""
        if isinstance(old, QuantizedTensor):
            return old.format
        return resolve_format(group, name, param) if old is None else None

    def _initial(self, group: dict, param: torch.Tensor, name: str, value: torch.Tensor) -> StateValue:
        """Store a freshly created state per the group's policy."""
        fmt = resolve_format(group, name, param)
        return value if fmt is None else fmt.quantize(value, rounding="nearest")

    # --- stall statistics -----------------------------------------------------------------------------
    def _count_stalls(self, param: torch.Tensor, name: str, before: torch.Tensor, updated: torch.Tensor, stored: QuantizedTensor) -> None:
        """Count entries whose stored value stayed put although the fp32 update moved them."""
        moved = updated != before
        stalled = moved & (stored.dequantize() == before)
        self._add_stall_counts(param, name, torch.stack([stalled.sum(), moved.sum()]))

    def _add_stall_counts(self, param: torch.Tensor, name: str, counts: torch.Tensor) -> None:
        """Accumulate ``[stalled, moved]`` for one state (device tensors: no sync)."""
        key = (param, name)
        if key in self._stall_counts:
            self._stall_counts[key] += counts
        else:
            self._stall_counts[key] = counts

    def stall_counts(self, reset: bool = True) -> dict[torch.Tensor, dict[str, torch.Tensor]]:
        """Raw counters since the last reset: ``{param: {state_name: tensor([stalled, moved])}}`` (int64, on the param's device).

        Needs ``track_stalls=True``. Counts are sums, so they can be all-reduced across ranks.
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
        """Name of every parameter: from ``param_names`` in the groups when given, else ``"param{i}"``."""
        names: dict[torch.Tensor, str] = {}
        index = 0
        for group in self.param_groups:
            given = group.get("param_names")
            for position, param in enumerate(group["params"]):
                names[param] = given[position] if given else f"param{index}"
                index += 1
        return names

    # --- formats over training ------------------------------------------------------------------------
    def reencode_state(self, param: torch.Tensor, name: str, fmt: str | StorageFormat) -> None:
        """Store state ``name`` of ``param`` in a new format from now on (``"fp32"`` for a plain tensor).

        The values are decoded and re-encoded with round-to-nearest, so nothing is lost beyond the new
        format's precision. A format name gets the group's block size and the state's sign convention.
        """
        state = self.state[param]
        if name not in state:
            raise KeyError(f"{type(self).__name__}: parameter has no state {name!r} yet (states: {sorted(state)})")
        group = next(g for g in self.param_groups if any(p is param for p in g["params"]))
        if isinstance(fmt, str):
            fmt = None if fmt == "fp32" else get_format(fmt, block_size=group["block_size"], signed=name not in NONNEGATIVE_STATES)
        value = dequantized(state[name])
        state[name] = value if fmt is None else fmt.quantize(value)

    def state_format(self, param: torch.Tensor, name: str) -> StorageFormat | None:
        """The format state ``name`` of ``param`` is stored in; ``None`` for a plain tensor."""
        value = self.state[param].get(name)
        return value.format if isinstance(value, QuantizedTensor) else None

    # --- checkpoints ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Torch's state dict, with each quantized state as a versioned dict of its codes and scales (bit-exact)."""
        state_dict = super().state_dict()
        state_dict["state"] = {index: {k: export_state(v) for k, v in entries.items()} for index, entries in state_dict["state"].items()}
        state_dict[VERSION_KEY] = STATE_FORMAT_VERSION
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load our own state dict bit-exactly, or a plain torch one (its fp32 states are quantized per the policy).

        Packed codes never pass through ``torch.optim.Optimizer.load_state_dict``, which would cast them.
        """
        packed = {index: {k: v for k, v in entries.items() if is_exported(v)} for index, entries in state_dict["state"].items()}
        plain = {index: {k: v for k, v in entries.items() if not is_exported(v)} for index, entries in state_dict["state"].items()}
        super().load_state_dict({**{k: v for k, v in state_dict.items() if k != VERSION_KEY}, "state": plain})
        params = [p for group in self.param_groups for p in group["params"]]
        for index, entries in packed.items():
            for name, entry in entries.items():
                self.state[params[index]][name] = import_state(entry, params[index], f"{type(self).__name__} state {index} ({name!r})")
        for group in self.param_groups:
            self._complete_group(group)
            for param in group["params"]:
                state = self.state.get(param, {})
                for name in self.state_names:
                    if isinstance(state.get(name), torch.Tensor):
                        state[name] = self._initial(group, param, name, state[name])

    def fp32_state_dict(self) -> dict[str, Any]:
        """A plain torch state dict (quantized states decoded to their original dtype), loadable by the torch optimizer."""
        state_dict = super().state_dict()
        state_dict["state"] = {index: {k: dequantized(v) for k, v in entries.items()} for index, entries in state_dict["state"].items()}
        state_dict["param_groups"] = [{k: v for k, v in group.items() if k not in POLICY_DEFAULTS} for group in state_dict["param_groups"]]
        return state_dict
