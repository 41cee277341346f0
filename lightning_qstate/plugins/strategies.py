"""Strategy helpers."""

from __future__ import annotations

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, FullyShardedDataParallel, OptimStateKeyType, StateDictType


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
