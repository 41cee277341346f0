"""Strategy helpers."""

from __future__ import annotations

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel


class CPUFSDPStrategy(FSDPStrategy):
    """``FSDPStrategy`` that also runs on CPU (e.g. tests with gloo).

    Lightning 2.6 wraps the model with ``device_id=None`` on CPU, which torch >= 2.5 rejects. This
    subclass wraps it itself with ``device_id=torch.device("cpu")`` (applying the same options and
    auto-wrap policy) and lets ``FSDPStrategy`` finish the set-up; on GPUs it changes nothing.

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
