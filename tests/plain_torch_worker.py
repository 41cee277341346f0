"""Two gloo ranks of plain torch.distributed, without Lightning and without ``QuantizationPolicy.apply``. Run standalone
(``python tests/plain_torch_worker.py OUT_DIR PORT``); writes ``rank{r}.json``.

- ``seeds``: DDP, the ranks' global generators seeded apart: the optimizers built on each rank drew different
  stochastic-rounding seeds, and their replicas drifted apart without an error; the first step that rounds
  stochastically takes rank 0's seed. Per case the parameters after four steps, the seed and whether it was shared.
- ``zero_resume``: ``ZeroRedundancyOptimizer(optimizer_class=QAdamW)``: its ``load_state_dict`` copies each rank's states
  into the local optimizer's ``state`` without calling its ``load_state_dict``; stepped on as they were, the packed
  dicts raised a TypeError inside torch's Adam. The parameters after 3 steps, a consolidated save, a load and 3 more,
  against 6 straight steps (round to nearest: ZeRO's checkpoint drops the stochastic-rounding seed).
- ``full_to_single``: FSDP2 to an unsharded model through a full optimizer state dict (``get_optimizer_state_dict`` with
  ``full_state_dict=True``, then ``set_optimizer_state_dict`` on rank 0 alone), the way README gives for moving between
  layouts (a sharded DCP checkpoint cannot: its keys follow the layout). The loaded states' types, formats and decoded
  values against the full state dict's.
- ``wrapper_resume``: FSDP2 (``fully_shard``) and ``quantize_optimizer(Adagrad)``: its plain states (a parameter under
  ``min_quant_size``, a bias) came back from ``load_state_dict`` as local tensors, and torch's Adagrad raised "got mixed
  torch.Tensor and DTensor" at the next step. The parameters after a save, a load and two more steps, against two
  steps without the round trip.
- ``fsdp1``: FSDP1 (``FullyShardedDataParallel``), both ``use_orig_params``. Under ``NO_SHARD`` with stochastic rounding
  and ``QuantizationPolicy.apply``, each rank rounded with its rank's stream and the replicas drifted apart (the
  parameters after five steps on other data per rank); under ``FULL_SHARD``, ``nonfinite="skip_step"`` and a NaN in
  one rank's part, the ranks counted other numbers of skipped parameter updates (``nonfinite_skips``); a QAdamW built on
  the FSDP1 model without ``apply`` (the error of its first step: it had stepped, with one rank skipping a NaN the
  other did not see, and saved checkpoints FSDP1 could not gather).
- ``overflow``: FSDP2, a gradient that overflows the fp16 states of one rank's shard only (QAdamW native, QAdamW with
  rank 0's shard native and rank 1's on the reference path, ``quantize_optimizer(RMSprop)`` with fp16 ``square_avg``
  beside its fp32 momentum, QSGD at its first step, whose buffer the step creates): that rank raised
  ``StepOverflowError`` while the other stepped on (a hang at the next collective), and the shards' states and step
  counts parted. Per case and rank the error (type, names, step, message), the states after it (their dimensions,
  whether any value is not zero), the paths, and the states after one more step."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rank_exit import end_rank
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

import lightning_qstate as lq
from lightning_qstate.formats import QuantizedTensor


def build(case: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    options = {"states": "int8", "rounding": "stochastic", "min_quant_size": 0}
    if case == "qadamw":
        return lq.QAdamW(params, lr=1e-2, **options)
    if case == "qmuon":
        return lq.QMuon([p for p in params if p.ndim == 2], lr=1e-2, **options)
    if case == "wrapper":
        return lq.quantize_optimizer(torch.optim.SGD(params, lr=1e-2, momentum=0.9), **options)
    if case == "eco_weights":  # states rounded to nearest, bf16 weights rounded stochastically (weight_rounding's default)
        return lq.QAdamW(params, lr=1e-2, states="int8", min_quant_size=0, weights="bf16")
    return lq.QAdamW(params, lr=1e-2, states="int8", min_quant_size=0)  # "nearest": nothing drawn, nothing shared


def seed_cases(rank: int) -> dict:
    results = {}
    for case in ("qadamw", "qmuon", "wrapper", "eco_weights", "nearest"):
        torch.manual_seed(100 + rank)  # a seed per rank; DDP broadcasts rank 0's weights
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        if case == "eco_weights":
            model = model.bfloat16()
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = build(case, list(ddp.parameters()))
        drawn = optimizer._rounding_seed
        for _ in range(4):
            x = torch.randn(8, 32, dtype=next(model.parameters()).dtype)  # other data per rank: DDP averages the grads
            ddp(x).float().square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        results[case] = {
            "params": [p.detach().float().flatten().tolist() for p in model.parameters()],
            "drawn": drawn,
            "seed": optimizer._rounding_seed,
            "shared": optimizer._seed_shared,
        }
    return results


def wrapper_resume(rank: int) -> dict:
    runs = {}
    for resumed in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32))  # a weight of 2048 values: plain
        fully_shard(model)
        optimizer = lq.quantize_optimizer(torch.optim.Adagrad(model.parameters(), lr=1e-2), min_quant_size=4096)
        for step in range(4):
            if step == 2 and resumed:
                optimizer.load_state_dict(optimizer.state_dict())
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * step + rank))
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        kinds = sorted({type(value).__name__ for state in optimizer.state.values() for value in state.values()})
        params = [(p.full_tensor() if isinstance(p, DTensor) else p).detach().flatten().tolist() for p in model.parameters()]
        held = [value.to_local() if isinstance(value, DTensor) else value for state in optimizer.state.values() for value in state.values()]
        per_value = [value for value in held if not isinstance(value, torch.Tensor) or value.ndim > 0]  # not the step counts
        # what this rank holds (a DTensor's nbytes is the full tensor's: counted world_size times over the ranks)
        nbytes = {"state_nbytes": lq.state_nbytes(optimizer), "held": sum(value.nbytes for value in held),
                  "summary": lq.optim.state_summary(optimizer)["bytes"], "per_value": sum(value.nbytes for value in per_value)}  # fmt: skip
        runs["resumed" if resumed else "straight"] = {"params": params, "kinds": kinds, "nbytes": nbytes}
    return runs


def zero_resume(rank: int, out: str) -> dict:
    def build() -> tuple[torch.nn.Module, torch.nn.Module, ZeroRedundancyOptimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return model, ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=lq.QAdamW, lr=1e-2, min_quant_size=0)

    def train(ddp: torch.nn.Module, optimizer: ZeroRedundancyOptimizer, steps: range) -> None:
        for step in steps:
            optimizer.zero_grad()
            ddp(torch.randn(16, 64, generator=torch.Generator().manual_seed(1000 * step + rank))).square().mean().backward()
            optimizer.step()

    model, ddp, optimizer = build()
    train(ddp, optimizer, range(6))
    straight = [p.detach().flatten().tolist() for p in model.parameters()]
    model, ddp, optimizer = build()
    train(ddp, optimizer, range(3))
    optimizer.consolidate_state_dict(to=0)
    if rank == 0:
        torch.save(optimizer.state_dict(), os.path.join(out, "zero.pt"))
    dist.barrier()
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    model, ddp, optimizer = build()
    model.load_state_dict(weights)
    optimizer.load_state_dict(torch.load(os.path.join(out, "zero.pt"), weights_only=False))
    train(ddp, optimizer, range(3, 6))
    kinds = sorted({type(value).__name__ for state in optimizer.optim.state.values() for value in state.values()})
    return {"straight": straight, "resumed": [p.detach().flatten().tolist() for p in model.parameters()], "kinds": kinds}


def full_to_single(rank: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(32, 64)
    fully_shard(model)
    optimizer = lq.QAdamW(model.parameters(), lr=1e-2, min_quant_size=0)
    for step in range(3):
        model(torch.randn(8, 32, generator=torch.Generator().manual_seed(step + 10 * rank))).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full, weights = get_optimizer_state_dict(model, optimizer, options=options), get_model_state_dict(model, options=options)
    if rank != 0:
        return {}
    single = torch.nn.Linear(32, 64)
    single.load_state_dict(weights)
    loaded = lq.QAdamW(single.parameters(), lr=1e-2, min_quant_size=0)
    set_optimizer_state_dict(single, loaded, full)
    states = {name: loaded.state[param] for name, param in single.named_parameters()}
    formats = {
        f"{name}.{key}": value.format.name for name, state in states.items() for key, value in state.items() if hasattr(value, "format")
    }
    exact = {
        f"{name}.{key}": torch.equal(states[name][key].dequantize(torch.float32), full["state"][name][key])
        for name in states
        for key in ("exp_avg", "exp_avg_sq")
    }
    result = {"formats": formats, "steps": [float(state["step"]) for state in states.values()], "exact": exact}
    single(torch.randn(8, 32)).square().mean().backward()
    loaded.step()  # steps on
    result["steps_after"] = [float(state["step"]) for state in states.values()]
    return result


def fsdp1(rank: int) -> dict:
    def model_on(strategy: ShardingStrategy, orig: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 32), torch.nn.Linear(32, 8))
        wrap = ModuleWrapPolicy({torch.nn.Linear})  # a flat parameter per layer
        return FullyShardedDataParallel(
            model, sharding_strategy=strategy, use_orig_params=orig, device_id=torch.device("cpu"), auto_wrap_policy=wrap
        )

    results = {}
    for orig in (True, False):
        model = model_on(ShardingStrategy.NO_SHARD, orig)
        optimizer = lq.QuantizationPolicy().apply(lq.QAdamW(model.parameters(), lr=1e-2, rounding="stochastic", min_quant_size=0), model)
        for step in range(5):
            model(torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        with FullyShardedDataParallel.summon_full_params(model):
            results[f"no_shard_{orig}"] = [p.detach().flatten().tolist() for p in model.parameters()]
        model = model_on(ShardingStrategy.FULL_SHARD, orig)
        optimizer = lq.QuantizationPolicy().apply(lq.QAdamW(model.parameters(), lr=1e-2, min_quant_size=0, nonfinite="skip_step"), model)
        model(torch.randn(8, 32)).square().mean().backward()
        for param in model.parameters():
            if param.grad is not None and param.grad.numel() and rank == 1:
                param.grad.view(-1)[0] = float("nan")
                break
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the skip's
            optimizer.step()
        results[f"skips_{orig}"] = [optimizer.nonfinite_skips, optimizer.skipped_steps, len(list(model.parameters()))]
        model = model_on(ShardingStrategy.FULL_SHARD, orig)
        unfitted = lq.QAdamW(model.parameters(), lr=1e-2, min_quant_size=0)
        model(torch.randn(8, 32)).square().mean().backward()
        try:
            unfitted.step()
            results[f"unfitted_{orig}"] = "stepped"
        except RuntimeError as error:
            results[f"unfitted_{orig}"] = str(error)
    return results


def local_values(state: dict) -> dict[str, torch.Tensor]:
    """Copies of an optimizer state's tensors as this rank holds them (quantized ones decoded)."""
    local = {name: value.to_local() if isinstance(value, DTensor) else value for name, value in state.items()}
    return {name: (value.dequantize() if isinstance(value, QuantizedTensor) else value).clone() for name, value in local.items()}


def overflow(rank: int) -> dict:
    results = {}
    for case in ("native", "mixed_paths", "wrapper", "sgd_first_step"):
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64, bias=False)
        fully_shard(model)
        if case == "wrapper":
            inner = torch.optim.RMSprop(model.parameters(), lr=1e-3, momentum=0.9)
            optimizer = lq.quantize_optimizer(inner, states={"square_avg": "fp16"}, min_quant_size=0)
        elif case == "sgd_first_step":
            optimizer = lq.QSGD(model.parameters(), lr=1e-3, momentum=0.9, dampening=0.5, states="fp16", min_quant_size=0)
        else:
            optimizer = lq.QAdamW(model.parameters(), lr=1e-3, states="fp16", min_quant_size=0)
            optimizer.cpu_compile = case == "native" or rank == 0  # mixed: rank 0's shard native, rank 1's the reference path
        overflow_at = 0 if case == "sgd_first_step" else 1
        result = {"paths": []}
        for step in range(3):
            model(torch.randn(4, 64, generator=torch.Generator().manual_seed(step))).square().mean().backward()
            if step == overflow_at and rank == 1:
                model.weight.grad.to_local().fill_(1e5)  # past fp16's 65504 in m, v or the buffer: this rank's rows only
            try:
                optimizer.step()
            except lq.StepOverflowError as error:
                after = local_values(optimizer.state.get(model.weight, {}))
                result["error"] = [type(error).__name__, error.names, step, str(error)]
                result["after"] = {name: v.tolist() if v.ndim == 0 else [v.ndim, bool(v.any())] for name, v in after.items()}
            result["paths"].append(optimizer.step_paths())
            optimizer.zero_grad()
        last = local_values(optimizer.state[model.weight])
        result["last"] = {name: value.tolist() if value.ndim == 0 else value.ndim for name, value in last.items()}
        results[case] = result
    return results


def worker(rank: int, out: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    results = {"seeds": seed_cases(rank), "wrapper_resume": wrapper_resume(rank), "zero_resume": zero_resume(rank, out)}
    results["full_to_single"] = full_to_single(rank)
    results["fsdp1"] = fsdp1(rank)
    results["overflow"] = overflow(rank)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as file:
        json.dump(results, file)
    end_rank()


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
