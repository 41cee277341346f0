"""Two gloo ranks of FSDP2 (``fully_shard``) on CPU: StallMonitor's emulation of the Trainer's norm clipping must take
the norm of the full gradients, every rank's shards together, as ``torch.nn.utils.clip_grad_norm_`` does over DTensors
(it took this rank's shards alone: ratios off by (global / local norm)², about 2×). Run standalone
(``python tests/shard_norm_worker.py OUT_DIR PORT``); writes ``rank{r}.json``."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_exit import end_rank
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from lightning_qstate.callbacks.stall_monitor import _gradient_norm
from lightning_qstate.optim import QuantizationPolicy


def worker(rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optimizer = QuantizationPolicy(states="int8", min_quant_size=0).apply(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(rank))  # other data per rank: other shards' norms
    model(x).square().mean().backward()
    local = float(torch.stack([p.grad.to_local().float().norm() for p in model.parameters()]).norm())
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)  # the norm the Trainer clips with
    total = float(total.full_tensor() if isinstance(total, DTensor) else total)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump({"emulated": _gradient_norm(optimizer), "clip_grad_norm": total, "local": local}, file)
    del model, optimizer
    end_rank()


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
