"""Two gloo ranks of FSDP1 on CPU: a NaN in rank 1's part of a parameter split across both ranks must skip that
parameter on both. Run standalone (``python tests/nonfinite_worker.py OUT_DIR PORT``); writes ``rank{r}.json``."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_exit import end_rank
from torch.distributed.fsdp import FullyShardedDataParallel

from lightning_qstate.optim import QuantizationPolicy


def worker(rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)), device_id=torch.device("cpu"), use_orig_params=True
    )
    optimizer = QuantizationPolicy(states="int8", min_quant_size=0, nonfinite="skip").apply(
        torch.optim.AdamW(model.parameters(), lr=1e-2), model
    )
    names = [name.split(".")[-2] + "." + name.split(".")[-1] for name, _ in model.named_parameters()]
    for step in range(2):
        optimizer.zero_grad()
        model(torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * step + rank))).square().mean().backward()
        split = names.index("0.bias")  # 128 values; the flat shard boundary (8288 of 16576) cuts it in two
        if step == 1 and rank == 1:
            list(model.parameters())[split].grad[0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
    changed = {name: (p.numel(), not torch.equal(b, p.detach())) for name, b, p in zip(names, before, model.parameters(), strict=False)}
    messages = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump({"changed": changed, "skips": optimizer.nonfinite_skips, "warnings": messages}, file)
    del model, optimizer
    end_rank()


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
