"""Strategy helpers."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, FullyShardedDataParallel, OptimStateKeyType, StateDictType

from ..optim.serialization import is_exported, unpacked_state_dict


class CPUFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` that also runs on CPU (e.g. tests with gloo).

    Lightning 2.6 wraps the model with ``device_id=None`` on CPU, which torch >= 2.5 rejects. This
    subclass wraps it itself with ``device_id=torch.device("cpu")`` (applying the same options and
    auto-wrap policy) and lets ``FSDPStrategy`` finish the set-up; on GPUs it changes nothing.

    It also gathers full (``state_dict_type="full"``) optimizer state dicts on CPU without
    ``offload_to_cpu``: torch's FSDP1 gathers every state of a flat parameter into one reused buffer
    and "offloads" views of it with ``.cpu()``, a no-op on CPU, so every state would come out equal to
    the last one gathered (``exp_avg == exp_avg_sq``, also for plain torch optimizers).

    Example::

        Trainer(accelerator="cpu", devices=2, strategy=CPUFSDPStrategy(), plugins=[QStateFSDPPrecision()])
    """

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.root_device.type == "cpu" and not any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
            self.kwargs.pop("auto_wrap_policy", None)  # applied above; FSDPStrategy would warn that it is ignored
        return super()._setup_model(model)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        if self.root_device.type != "cpu" or self._state_dict_type != "full":
            return super().optimizer_state(optimizer)
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        with FullyShardedDataParallel.state_dict_type(
            self.model,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=True),  # without offload, FSDP clones each gathered state
        ):
            state_dict = FullyShardedDataParallel.optim_state_dict(self.model, optimizer)
            if self.global_rank == 0:  # the standard (parameter id) form, as FSDPStrategy saves it
                state_dict = FullyShardedDataParallel.rekey_optim_state_dict(state_dict, OptimStateKeyType.PARAM_ID, self.model)
            return state_dict


def in_module_order(state_dict: dict[str, Any], module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A packed optimizer state dict (saved on one device or under DDP: ids are positions in the optimizer's groups, as
    torch numbers them) with its ids renumbered to positions in ``module.parameters()``, which Lightning's FSDP1 and
    FSDP2 loads take them for when they turn them into names (``FSDP.rekey_optim_state_dict`` without the optimizer): an
    optimizer whose groups list the parameters in another order (weight-decay groups; a group added with
    ``add_param_group``) got each state attached to another parameter. The saved groups' ids are matched to
    ``optimizer``'s parameters by position, as torch's ``Optimizer.load_state_dict`` matches them. Returned as it is: a
    state dict with no packed state (one FSDP saved holds ids in module order already, and the two numberings cannot
    be told apart otherwise; a plain torch one is left to Lightning), name keys, groups of other sizes."""
    if not any(is_exported(entry) for entries in state_dict.get("state", {}).values() for entry in entries.values()):
        return state_dict
    groups = state_dict.get("param_groups") or []
    saved = [index for group in groups for index in group["params"]]
    current = [param for group in optimizer.param_groups for param in group["params"]]
    position = {id(param): index for index, param in enumerate(module.parameters())}
    fits = len(saved) == len(current) and all(isinstance(index, int) for index in saved) and all(id(p) in position for p in current)
    if not fits or not set(state_dict.get("state", {})) <= set(saved):
        return state_dict
    renumbered = {old: position[id(param)] for old, param in zip(saved, current, strict=True)}
    return {
        **state_dict,
        "state": {renumbered[index]: value for index, value in state_dict["state"].items()},
        "param_groups": [{**group, "params": [renumbered[index] for index in group["params"]]} for group in groups],
    }


def _loadable_by_fsdp1(checkpoint: Any, strategy: FSDPStrategy) -> Any:
    """``checkpoint`` (as ``FSDPStrategy.load_checkpoint`` read it from one file) with its optimizer states unpacked and in
    module order (``in_module_order``)."""
    if isinstance(checkpoint, dict) and isinstance(checkpoint.get("optimizer_states"), list):
        states = checkpoint["optimizer_states"]
        if len(states) == len(strategy.optimizers):
            states = [
                in_module_order(state, strategy.model, optimizer) for state, optimizer in zip(states, strategy.optimizers, strict=True)
            ]
        checkpoint["optimizer_states"] = [unpacked_state_dict(state) for state in states]
    return checkpoint


def _loadable_by_fsdp2(rekey: Callable, strategy: ModelParallelStrategy) -> Callable:
    """Lightning's ``_rekey_optimizer_state_if_needed(state, module)``, called once per optimizer in order, with each state
    unpacked and in module order first (``in_module_order``)."""
    optimizers = iter(strategy.optimizers)

    def rekeyed(state: dict[str, Any], module: torch.nn.Module) -> dict[str, Any]:
        optimizer = next(optimizers, None)
        ordered = state if optimizer is None else in_module_order(state, module, optimizer)  # told by its packed states
        return rekey(unpacked_state_dict(ordered), module)

    return rekeyed


# Where each strategy that reshards optimizer states hands what it read from a one-file checkpoint to torch's resharding
# (Lightning has no hook in between): the module, the function it calls there, and that function with the packed states
# converted first (``(function, strategy) -> function``).
_RESHARDING_LOADS = (
    (
        ModelParallelStrategy,
        "lightning.fabric.strategies.model_parallel",
        "_rekey_optimizer_state_if_needed",  # (optimizer state, module) -> optimizer state, then set_optimizer_state_dict
        _loadable_by_fsdp2,
    ),
    (
        FSDPStrategy,
        "lightning.pytorch.strategies.fsdp",
        "_materialize_tensors",  # (checkpoint) -> checkpoint, then FSDP.rekey_optim_state_dict and optim_state_dict_to_load
        lambda materialize, strategy: lambda checkpoint: _loadable_by_fsdp1(materialize(checkpoint), strategy),
    ),
)


def load_packed_checkpoints_into_shards(strategy: Strategy) -> None:
    """Let ``strategy`` (``FSDPStrategy``, ``ModelParallelStrategy``) resume a checkpoint whose quantized states are
    packed (saved on one device or under DDP): its ``load_checkpoint`` converts them to the fp32 form (decoded values of
    the parameter's shape, ``optim.serialization.unpacked_state_dict``), which the strategy cuts into shards like any
    torch state and loading re-quantizes into the saved formats. Without it FSDP2 fails inside torch (it cannot unflatten
    the packed dicts against its DTensor states) and FSDP1 refuses the full-shape states. The states' parameter ids are
    renumbered to the module's order first (``in_module_order``: Lightning names them by it). The plugins and
    ``QuantizedOptimizerStates`` call it when they connect; other strategies are left as they are.
    """
    point = next((point for point in _RESHARDING_LOADS if isinstance(strategy, point[0])), None)
    if point is None or getattr(strategy, "_loads_packed_checkpoints", False):
        return
    _, module_name, name, converting = point
    module = importlib.import_module(module_name)
    if not callable(getattr(module, name, None)):
        raise RuntimeError(
            f"lightning_qstate: {module_name}.{name} is gone from this Lightning version; packed (single-device, DDP) checkpoints "
            f"cannot be resumed under {type(strategy).__name__}. Use the Lightning version in requirements/ci.txt"
        )
    load = strategy.load_checkpoint

    def load_checkpoint(checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        original = getattr(module, name)
        setattr(module, name, converting(original, strategy))
        try:
            return load(checkpoint_path, *args, **kwargs)
        finally:
            setattr(module, name, original)

    strategy.load_checkpoint = load_checkpoint
    strategy._loads_packed_checkpoints = True
