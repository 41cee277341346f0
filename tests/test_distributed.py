"""Multi-process Lightning tests on CPU (gloo, 2 ranks): DDP, FSDP1 (``CPUFSDPStrategy``) and FSDP2 (``ModelParallelStrategy``).

Each run is ``tests/distributed_worker.py`` launched on two ranks, as ``torchrun`` launches them (the DDP run: as
``python script.py``, where Lightning re-executes ``sys.argv`` for the second rank); it writes the gathered weights and
every rank's optimizer states (formats, block sizes, hashes of the codes) into a folder that the tests below read.
Launching costs most of the time (importing Lightning), so one launch runs several phases: an uninterrupted run to
step 6 and a run saving a checkpoint at step 3 (for each checkpoint kind), then, in a second launch, the resume to step 6.

Round-to-nearest states resume bit-exactly under every strategy: DDP checkpoints hold the packed codes,
FSDP1/FSDP2 ones fp32 values that re-quantize to the very same codes and scales.
"""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from lightning_qstate import QAdamW
from lightning_qstate.adaptive import DEFAULT_M_FORMATS, DEFAULT_V_FORMATS
from lightning_qstate.formats import QuantizedTensor, get_format
from lightning_qstate.optim.serialization import format_from_marker, is_exported, quantize_exactly, unpacked_state_dict
from lightning_qstate.theory import stall_probability

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
WORKER = TESTS / "distributed_worker.py"
LAUNCH_TIMEOUT = 300  # seconds per launch; a launch takes ~10-30 s on 2 loaded cores
STEPS, SAVE_STEP = 6, 3

GLOO = torch.distributed.is_available() and torch.distributed.is_gloo_available()
pytestmark = pytest.mark.skipif(not GLOO, reason="needs torch.distributed with gloo")


@dataclass(frozen=True)
class RunSpec:
    """One configuration: a strategy, its checkpoint kinds and the quantization policy."""

    strategy: str
    kinds: tuple[str, ...]
    hidden: int
    min_quant_size: int
    states: str = "int8"
    via: str = "plugin"
    fresh_resume: bool = True  # resume in new processes (else in the processes that saved the checkpoint)
    quantized: tuple[str, ...] = ("net.0.weight",)  # parameters whose states must be quantized (on every rank holding a part)
    callbacks: str = "[]"  # JSON list of lightning_qstate callbacks (see the worker's --callbacks)
    log_every: int = 1
    decay_groups: bool = False  # the optimizer's ids in another order than the module's parameters (the worker's --decay-groups)
    by_lightning: bool = False  # start rank 0 alone and let Lightning start rank 1 (else both at once, as torchrun does)

    def args(self) -> list[str]:
        return [
            "--strategy", self.strategy, "--state-dict", ",".join(self.kinds), "--hidden", str(self.hidden),
            "--min-quant-size", str(self.min_quant_size), "--states", self.states, "--via", self.via,
            "--steps", str(STEPS), "--save-step", str(SAVE_STEP),
            "--callbacks", self.callbacks, "--log-every", str(self.log_every), *(["--decay-groups"] if self.decay_groups else []),
        ]  # fmt: skip


# StallMonitor + StateResetScheduler (periodic, staggered, and threshold-triggered from rank-summed counts) under FSDP1 with
# uneven shards (rank 0 holds no part of net.3.weight): e2m2 states stall within a few steps. The DDP and FSDP2 runs use them too.
STALL_CALLBACKS = [
    {"class": "StallMonitor", "init_args": {"log_every_n_steps": 2, "per_layer": True}},
    {"class": "StateResetScheduler", "init_args": {"period": 4, "stagger": True, "threshold": 0.3, "check_every_n_steps": 2}},
]
STALL_CALLBACKS_JSON = json.dumps(STALL_CALLBACKS)

RUNS = {
    # Both big weights quantized; DDP saves the packed codes.
    "ddp": RunSpec(
        "ddp",
        ("full",),
        hidden=300,
        min_quant_size=1024,
        quantized=("net.0.weight", "net.3.weight"),
        fresh_resume=False,
        callbacks=STALL_CALLBACKS_JSON,
        by_lightning=True,
        decay_groups=True,  # resumed under FSDP1/FSDP2 below: Lightning names the ids by the module's order
    ),
    # hidden=301: uneven flat shards. net.0.weight (19264 values) falls on rank 0 (11296 values) and rank 1 (7968):
    # min_quant_size=8192 lies between, so deciding from the local numel would quantize it on rank 0 only.
    "fsdp": RunSpec("fsdp", ("full", "sharded"), hidden=301, min_quant_size=8192),
    # hidden=301 rows sharded 151/150; rows of 64 give row-aligned blocks of 64, rows of 301 (net.3.weight) keep fp32.
    "fsdp2": RunSpec("fsdp2", ("full", "sharded"), hidden=301, min_quant_size=1024, callbacks=STALL_CALLBACKS_JSON),
    # int4 through the callback; net.3.weight lies wholly on rank 1 (rank 0 holds an empty view and no state).
    "fsdp-int4-callback": RunSpec(
        "fsdp",
        ("full", "sharded"),
        hidden=301,
        min_quant_size=1024,
        states="int4",
        via="callback",
        fresh_resume=False,
        quantized=("net.0.weight", "net.3.weight"),
    ),
}


# Runs with AdaptiveBitWidth under DDP, FSDP1 and FSDP2 (hidden=301: uneven shards). Formats change during these runs, so the
# fixed-format tests of `run` leave them out; theirs are below. A check at every step and a threshold rising fast change decisions
# before and after the checkpoint at step 3; the targets make the budget bind (FSDP2 keeps net.3.weight fp32: rows of 301). Without
# the budget's promotions (fill_budget=False): with them a binding cap plans these two quantized layers alike whatever
# their zones, and nothing would change (the promotions are tested on one device).
ADAPTIVE = {
    "interval": 1, "hysteresis": 1, "threshold_start": 0.3, "threshold_end": 6.0, "anneal_steps": STEPS, "ema_decay": 0.5,
    "fill_budget": False,
}  # fmt: skip


def adaptive_callbacks(target_bits: float, fill_budget: bool = False) -> str:
    return json.dumps([{"class": "AdaptiveBitWidth", "init_args": {**ADAPTIVE, "target_bits": target_bits, "fill_budget": fill_budget}}])


ADAPTIVE_RUNS = {
    "ddp-adaptive": RunSpec(
        "ddp", ("full",), hidden=301, min_quant_size=1024, callbacks=adaptive_callbacks(7.0), quantized=(), fresh_resume=False
    ),
    "fsdp-adaptive": RunSpec("fsdp", ("full", "sharded"), hidden=301, min_quant_size=1024, callbacks=adaptive_callbacks(7.0), quantized=()),
    "fsdp2-adaptive": RunSpec(
        "fsdp2", ("full", "sharded"), hidden=301, min_quant_size=1024, callbacks=adaptive_callbacks(10.5), quantized=()
    ),
    # the default, with the promotions: rank agreement and exact resume (the plan need not change during the run)
    "fsdp-adaptive-fill": RunSpec(
        "fsdp", ("full", "sharded"), hidden=301, min_quant_size=1024, callbacks=adaptive_callbacks(7.0, fill_budget=True), quantized=()
    ),
}


def adaptive_options(run: Run) -> dict:
    """The ``AdaptiveBitWidth`` arguments of an adaptive run."""
    return json.loads(run.spec.callbacks)[0]["init_args"]


STALL_RUNS = {
    "fsdp-stalls": RunSpec(
        "fsdp", ("full",), hidden=301, min_quant_size=1024, states="e2m2", fresh_resume=False, callbacks=STALL_CALLBACKS_JSON
    ),
}


LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # set by launch() alone
RANKS = 2


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(out: Path, args: list[str], timeout: float = LAUNCH_TIMEOUT, worker: Path = WORKER, by_lightning: bool = False) -> float:
    """Run ``worker`` on 2 ranks in a session of their own; fail with their output on error.

    By default both ranks start at once, as ``torchrun`` starts them (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` in
    their environment), so their imports (~10 s each, Lightning's torchmetrics import pulls in transformers and scipy) run
    side by side. ``by_lightning=True`` starts rank 0 alone and lets Lightning re-execute it for rank 1 (``python
    script.py`` with ``devices=2``), one import after the other.
    """
    env = {key: value for key, value in os.environ.items() if key not in LAUNCHER_VARIABLES}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"  # a rank killed on a failure or timeout leaves all it printed
    command = [sys.executable, str(worker), "--out", str(out), *args]
    ranks = [{}] if by_lightning else [
        {"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(RANKS), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        for port in [free_port()]
        for rank in range(RANKS)
    ]  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    logs = [out / f"launch{len(list(out.glob('launch*-rank0.log')))}-rank{rank}.log" for rank in range(len(ranks))]
    start = time.perf_counter()
    processes: list[subprocess.Popen] = []
    try:
        for rank_env, log in zip(ranks, logs, strict=True):
            with log.open("w") as stream:  # its own session: on failure or timeout its process group is killed
                processes.append(
                    subprocess.Popen(
                        command, env={**env, **rank_env}, cwd=REPO, stdout=stream, stderr=subprocess.STDOUT, start_new_session=True
                    )
                )
        while None in (codes := [process.poll() for process in processes]) and not any(codes):  # until all end or one fails
            if time.perf_counter() - start > timeout:
                pytest.fail(f"{' '.join(command)} timed out after {timeout} s:\n{tails(logs)}")
            time.sleep(0.1)
    finally:
        for process in processes:
            kill_group(process.pid)  # a rank left behind by a failure (with Lightning's rank 1 in rank 0's group)
            process.wait()
    codes = [process.returncode for process in processes]
    if any(codes):
        finished = sorted(str(path.relative_to(out)) for path in out.rglob("done*"))  # the phases each rank completed
        pytest.fail(f"{' '.join(command)} exited with {codes} (finished: {finished}):\n{tails(logs)}")
    return time.perf_counter() - start


def tails(logs: list[Path], chars: int = 8000) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text()[-chars:]}" for log in logs)


@dataclass
class Run:
    spec: RunSpec
    out: Path
    seconds: list[float] = field(default_factory=list)

    def phases(self) -> list[str]:
        return ["straight", *(f"{phase}-{kind}" for phase in ("first", "resume") for kind in self.spec.kinds)]

    def info(self, phase: str, rank: int) -> dict:
        return json.loads((self.out / phase / f"rank{rank}.json").read_text())

    def weights(self, phase: str) -> dict[str, torch.Tensor]:
        return torch.load(self.out / phase / "weights.pt", weights_only=True)


_EXECUTED: dict[str, Run] = {}


@pytest.fixture(scope="module", params=list(RUNS))
def run(request, tmp_path_factory) -> Run:
    return executed(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> Run:
    return executed("ddp", tmp_path_factory)


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory) -> Run:
    return executed("fsdp2", tmp_path_factory)


@pytest.fixture(scope="module", params=list(ADAPTIVE_RUNS))
def adaptive_run(request, tmp_path_factory) -> Run:
    return executed(request.param, tmp_path_factory)


def executed(name: str, tmp_path_factory) -> Run:
    """The finished run ``name`` (launched once per session, shared by every test that reads it)."""
    if name not in _EXECUTED:
        _EXECUTED[name] = launch_run({**RUNS, **ADAPTIVE_RUNS, **STALL_RUNS}[name], tmp_path_factory.mktemp(name))
    return _EXECUTED[name]


def launch_run(spec: RunSpec, out: Path) -> Run:
    result = Run(spec, out)
    for modes in ["straight,first", "resume"] if spec.fresh_resume else ["straight,first,resume"]:
        result.seconds.append(launch(result.out, [*spec.args(), "--mode", modes], by_lightning=spec.by_lightning))
    for phase in result.phases():
        for rank in (0, 1):
            assert (result.out / phase / f"done{rank}").is_file(), f"rank {rank} did not finish {phase}"
    return result


def states_of(info: dict) -> dict[str, dict[str, dict]]:
    """``{param: {state: description}}`` of a rank's report."""
    return {name: entry["states"] for name, entry in info["params"].items()}


def test_resume_gives_the_weights_and_states_of_an_uninterrupted_run(run):
    straight = run.weights("straight")
    assert set(straight) == {"net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias", "net.3.weight", "net.3.bias"}
    for kind in run.spec.kinds:
        resumed = run.weights(f"resume-{kind}")
        assert set(resumed) == set(straight)
        for name, value in straight.items():
            assert resumed[name].shape == value.shape
            assert torch.equal(resumed[name], value), f"{kind}: {name} differs by {(resumed[name] - value).abs().max().item()}"
        for rank in (0, 1):
            info, reference = run.info(f"resume-{kind}", rank), run.info("straight", rank)
            assert info["global_step"] == reference["global_step"] == STEPS
            assert info["lr"] == reference["lr"]
            assert states_of(info) == states_of(reference), f"{kind}: rank {rank}'s states differ from the uninterrupted run"
    assert not torch.equal(run.weights(f"first-{run.spec.kinds[0]}")["net.0.weight"], straight["net.0.weight"])  # it trained on


def test_checkpoint_loads_into_the_same_formats_codes_and_ranks(run):
    """Right after loading (before a step): every rank's states are what that rank saved, in the same formats."""
    for kind in run.spec.kinds:
        for rank in (0, 1):
            saved, loaded = run.info(f"first-{kind}", rank), run.info(f"resume-{kind}", rank)["loaded"]
            assert loaded["global_step"] == SAVE_STEP
            assert states_of(loaded) == states_of(saved), f"{kind}: rank {rank} did not get back its own states"
            for name in run.spec.quantized:
                for state in states_of(loaded)[name].values():
                    if state.get("shape") != []:  # not the step counter
                        assert state["quantized"] and state["format"]["name"] == run.spec.states, (kind, rank, name, state)


def test_every_rank_takes_the_same_decisions(run):
    """Which states are quantized, in which format and block size, follows the full shape on every rank."""
    for phase in run.phases():
        first, second = run.info(phase, 0), run.info(phase, 1)
        assert first["optimizer"] == second["optimizer"] == "InPlaceQAdamW"
        # FSDP1 exports fp32 flat shards; FSDP2's DTensor parameters always export fp32, whatever the mode
        assert first["checkpoint_mode"] == second["checkpoint_mode"] == ("fp32" if run.spec.strategy == "fsdp" else "packed")
        assert first["params"].keys() == second["params"].keys()
        for name, entry in first["params"].items():
            other = second["params"][name]
            assert entry["full_numel"] == other["full_numel"], name
            if run.spec.strategy != "fsdp":  # FSDP1's parameters are 1-D views of each rank's part
                assert entry["shape"] == other["shape"] and entry["full_numel"] == torch.Size(entry["shape"]).numel(), name
            assert entry["policy"] == other["policy"], f"{phase}: ranks decide differently for {name}"
            for state, value in entry["states"].items():
                if state in other["states"]:  # a rank holding no part of a parameter (FSDP1) has no state for it
                    assert value["format"] == other["states"][state]["format"], (phase, name, state)
                assert value["format"] == entry["policy"].get(state), (phase, name, state)
        for name in run.spec.quantized:
            assert first["params"][name]["policy"]["exp_avg"]["name"] == run.spec.states


def test_uneven_shards(run):
    info = [run.info("straight", rank)["params"] for rank in (0, 1)]
    weight = [entry["net.0.weight"] for entry in info]
    if run.spec.strategy == "fsdp2":  # rows sharded 151 / 150; blocks never straddle rows (64 values each)
        assert [w["local_shape"] for w in weight] == [[151, 64], [150, 64]]
        assert all(w["states"]["exp_avg"]["format"]["resolved_block_size"] == 64 for w in weight)
        assert all(entry["net.3.weight"]["policy"]["exp_avg"] is None for entry in info)  # rows of 301 allow no aligned block
    elif run.spec.strategy == "fsdp":  # 1-D views of the flat shards; the decisions use the full numel
        local = [w["local_shape"][0] for w in weight]
        assert 0 < local[1] < local[0] and sum(local) == 301 * 64
        assert all(w["full_numel"] == 301 * 64 for w in weight)
        assert all(w["states"]["exp_avg"]["quantized"] for w in weight)
        assert info[0]["net.3.weight"]["local_shape"] == [0] and info[0]["net.3.weight"]["states"] == {}
    else:
        assert weight[0]["local_shape"] == weight[1]["local_shape"] == [300, 64]


def test_a_failing_rank_ends_the_launch_at_once_with_every_ranks_output(tmp_path):
    worker = tmp_path / "worker.py"  # rank 1 fails at once while rank 0 would wait for it (in a collective) for a minute
    worker.write_text("import os, sys, time\nprint('rank', os.environ['LOCAL_RANK'], 'of', os.environ['WORLD_SIZE'])\n"
                      "sys.exit(3) if os.environ['LOCAL_RANK'] == '1' else time.sleep(60)\n")  # fmt: skip
    start = time.perf_counter()
    with pytest.raises(pytest.fail.Exception, match=r"exited with \[-9, 3\][\s\S]*rank 0 of 2[\s\S]*rank 1 of 2"):
        launch(tmp_path / "out", [], timeout=30, worker=worker)
    assert time.perf_counter() - start < 20


def test_ddp_states_are_identical_on_both_ranks(ddp_run):
    run = ddp_run
    for phase in run.phases():
        first, second = (states_of(run.info(phase, rank)) for rank in (0, 1))
        assert first == second, f"{phase}: the ranks' optimizer states differ"
        assert first["net.0.weight"]["exp_avg"]["quantized"] and first["net.3.weight"]["exp_avg_sq"]["quantized"]


def test_checkpoint_contents(run):
    """DDP keeps the packed low-bit codes; FSDP1/FSDP2 fp32 values of the parameter's shape plus a format marker."""
    for kind in run.spec.kinds:
        path = run.out / f"first-{kind}" / "ckpt.ckpt"
        if kind == "sharded":
            assert path.is_dir() and any(path.iterdir())
            continue
        checkpoint = torch.load(path, weights_only=True)
        optimizer_state = checkpoint["optimizer_states"][0]
        names = list(checkpoint["state_dict"])  # full checkpoints key the optimizer states by parameter position
        by_name = optimizer_state["state"][names.index("net.0.weight")]
        if run.spec.strategy == "ddp":
            packed = by_name["exp_avg"]
            assert packed["codes"].dtype == torch.uint8 and packed["format"]["name"] == run.spec.states
            assert packed["codes"].numel() == 300 * 64 and packed["shape"] == [300, 64]
        else:
            assert by_name["exp_avg"].dtype == torch.float32 and by_name["exp_avg"].shape == (301, 64)
            assert json.loads(by_name["exp_avg.qstate_format"])["name"] == run.spec.states
            assert json.loads(by_name["exp_avg_sq.qstate_format"])["signed"] is False
            # every state its own values (torch's FSDP1 CPU offload used to alias them all to the last one)
            assert not torch.equal(by_name["exp_avg"], by_name["exp_avg_sq"]) and bool((by_name["exp_avg"] < 0).any())


def test_packed_state_of_the_full_shape_never_loads_into_a_shard(fsdp2_run):
    run = fsdp2_run
    for rank in (0, 1):
        error = json.loads((run.out / "straight" / f"packed_into_shard{rank}.json").read_text())["error"]
        assert error is not None and "shape (301, 64)" in error and ("(151, 64)" if rank == 0 else "(150, 64)") in error


@pytest.fixture(scope="module", params=["fsdp", "fsdp2"])
def resharded_ddp_run(request, ddp_run, tmp_path_factory) -> tuple[str, Path]:
    """The DDP run's packed checkpoint (step 3) resumed to step 6 under FSDP1 or FSDP2, with the same model and policy."""
    out = tmp_path_factory.mktemp(f"ddp-into-{request.param}")
    spec = RUNS["ddp"]
    args = [*spec.args(), "--strategy", request.param, "--mode", "resume", "--ckpt", str(ddp_run.out / "first-full" / "ckpt.ckpt")]
    launch(out, args)
    return request.param, out


def test_packed_checkpoint_resumes_under_a_strategy_that_reshards(resharded_ddp_run, ddp_run):
    """FSDP1 and FSDP2 take the DDP checkpoint's packed states as decoded values cut into their shards (FSDP2 failed inside
    torch, FSDP1 refused the full shape): each rank's loaded states hold its part of the saved values (re-quantized to
    nearest where the shard's blocks are not the checkpoint's), in the saved formats, and training goes on from there."""
    strategy, out = resharded_ddp_run
    saved = torch.load(ddp_run.out / "first-full" / "ckpt.ckpt", weights_only=True)["optimizer_states"][0]["state"]
    saved_formats = states_of(ddp_run.info("first-full", 0))
    parts = {}
    for rank in (0, 1):
        info, loaded = (
            json.loads((out / "resume-full" / f"rank{rank}.json").read_text()),
            torch.load(out / "resume-full" / f"loaded{rank}.pt"),
        )
        assert info["global_step"] == STEPS and info["loaded"]["global_step"] == SAVE_STEP
        for index, name in enumerate(["net.0.weight", "net.3.weight"]):
            entry = info["loaded"]["params"][name]
            n = math.prod(entry["local_shape"])
            for state in ("exp_avg", "exp_avg_sq"):
                described = entry["states"].get(state)
                if n == 0 or described is None:  # FSDP1: an empty view on this rank
                    continue
                # the saved format (FSDP2's policy would keep net.3.weight fp32, its rows of 300 allowing no block >= 32: a
                # format that differs from the policy's is kept on load, and named in a warning at the next step)
                assert described["quantized"] and described["format"]["name"] == saved_formats[name][state]["format"]["name"]
                packed = saved[index][state]  # ids 0 and 1, the decay group's matrices: net.0.weight, net.3.weight
                fmt = get_format(**packed["format"])
                full = QuantizedTensor(fmt, packed["codes"], packed["scales"], torch.Size(packed["shape"]), torch.float32).dequantize()
                full = full.reshape(-1)
                expected = full[:n] if rank == 0 else full[full.numel() - n :]  # rows or flat chunks: a prefix, a suffix
                values = loaded[name][state].reshape(-1)
                decode = fmt.tables(torch.device("cpu"))["decode"].sort().values
                half_gap = float((decode[1:] - decode[:-1]).max()) / 2 * 1.01  # round to nearest, a scale rounded up
                assert (values - expected).abs().max() <= half_gap * expected.abs().max(), (strategy, rank, name, state)
                parts.setdefault((name, state), []).append(n)
    assert {key: sum(sizes) for key, sizes in parts.items()} == {
        (name, state): numel
        for name, numel in (("net.0.weight", 300 * 64), ("net.3.weight", 8 * 300))
        for state in ("exp_avg", "exp_avg_sq")
    }
    saved_weights, straight = ddp_run.weights("first-full"), ddp_run.weights("straight")
    resumed = torch.load(out / "resume-full" / "weights.pt", weights_only=True)
    for name, value in straight.items():  # states off by a rounding: steps 4-6 as DDP's, but where a tiny v was rounded
        assert (resumed[name] - value).abs().mean() < 0.02 * (value - saved_weights[name]).abs().mean(), name  # measured <= 0.006


# --- adaptive bit-widths ---------------------------------------------------------------------------------
def adaptive_state(info: dict) -> dict:
    return info["callbacks"]["AdaptiveBitWidth"]


def test_adaptive_bit_widths_are_identical_on_every_rank(adaptive_run):
    """Decisions come from all-reduced statistics only: both ranks hold the same callback state and state formats."""
    run = adaptive_run
    for phase in run.phases():
        first, second = run.info(phase, 0), run.info(phase, 1)
        assert adaptive_state(first) == adaptive_state(second), f"{phase}: decisions, EMAs or history differ between ranks"
        decisions = adaptive_state(first)["layers"]
        for name, entry in first["params"].items():
            other = second["params"][name]
            assert entry["policy"] == other["policy"], (phase, name)
            for state, value in entry["states"].items():
                if state in other["states"]:  # FSDP1: a rank holding no part of net.3.weight has no state for it
                    assert value["format"] == other["states"][state]["format"], (phase, name, state)
                assert value["format"] == entry["policy"].get(state), (phase, name, state)  # re-encoded as decided (blocks included)
            for state in ("exp_avg", "exp_avg_sq"):
                policy = entry["policy"][state]
                assert policy is None or policy["name"] == decisions[name]["formats"][state], (phase, name, state)
    straight, first = adaptive_state(run.info("straight", 0)), adaptive_state(run.info(f"first-{run.spec.kinds[0]}", 0))
    assert [entry["step"] for entry in straight["history"]] == list(range(STEPS))
    if not adaptive_options(run)["fill_budget"]:
        # transitions count re-encoded states; the plan changes during the run (the resumed half repeats the straight one)
        assert straight["transitions"] >= first["transitions"] > 0, "a decision re-encoded a state before the checkpoint"
        assert len({repr(entry["bits"]) for entry in straight["history"]}) > 1, "decisions change during the run"
    formats = {
        state["format"]["name"]
        for entry in run.info("straight", 0)["params"].values()
        for state in entry["states"].values()
        if state["quantized"]
    }
    assert formats and formats <= {*DEFAULT_M_FORMATS.values(), *DEFAULT_V_FORMATS.values()}  # the default zone formats


def test_adaptive_resume_continues_exactly(adaptive_run):
    run = adaptive_run
    straight = run.weights("straight")
    for kind in run.spec.kinds:
        resumed = run.weights(f"resume-{kind}")
        for name, value in straight.items():
            assert torch.equal(resumed[name], value), f"{kind}: {name} differs by {(resumed[name] - value).abs().max().item()}"
        for rank in (0, 1):
            info, reference = run.info(f"resume-{kind}", rank), run.info("straight", rank)
            assert adaptive_state(info) == adaptive_state(reference), (
                f"{kind}: rank {rank}'s decisions or EMAs differ from the uninterrupted run"
            )
            assert states_of(info) == states_of(reference), f"{kind}: rank {rank}'s states differ from the uninterrupted run"
            assert states_of(info["loaded"]) == states_of(run.info(f"first-{kind}", rank)), (
                f"{kind}: rank {rank} did not get back its own states"
            )


def average_bits_logged(run: Run) -> list[float]:
    return [record["qstate/adaptive/avg_bits"] for record in run.info("straight", 0)["metrics"] if "qstate/adaptive/avg_bits" in record]


def test_adaptive_budget_is_met_and_logged_by_rank_zero(adaptive_run):
    run = adaptive_run
    target = adaptive_options(run)["target_bits"]
    averages = average_bits_logged(run)
    assert len(averages) == STEPS and all(value <= target for value in averages)
    assert not any("qstate/adaptive/avg_bits" in record for record in run.info("straight", 1)["metrics"])


def test_adaptive_promotions_spend_the_room_under_the_cap(tmp_path_factory):
    """Under FSDP with uneven shards, the same cap with the promotions ends closer to it than without them."""
    filled, demoted = (executed(name, tmp_path_factory) for name in ("fsdp-adaptive-fill", "fsdp-adaptive"))
    assert adaptive_options(filled)["target_bits"] == adaptive_options(demoted)["target_bits"]
    assert average_bits_logged(demoted)[-1] < average_bits_logged(filled)[-1] <= adaptive_options(filled)["target_bits"]


# --- stall monitoring and resets ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["fsdp-stalls", "ddp", "fsdp2"])
def stall_run(request, tmp_path_factory) -> Run:
    return executed(request.param, tmp_path_factory)


def test_resets_are_identical_on_every_rank_and_resume_exactly(stall_run):
    run = stall_run
    schedules = {phase: [run.info(phase, rank)["callbacks"]["StateResetScheduler"] for rank in (0, 1)] for phase in run.phases()}
    for phase, (first, second) in schedules.items():
        assert first == second, f"{phase}: the ranks reset differently"
    straight = schedules["straight"][0]
    assert straight["history"] and {step for step, _ in straight["history"]} <= set(range(1, STEPS + 1))
    for kind in run.spec.kinds:
        assert schedules[f"resume-{kind}"][0] == straight
        weights, resumed = run.weights("straight"), run.weights(f"resume-{kind}")
        for name, value in weights.items():
            assert torch.equal(resumed[name], value), (kind, name)


def test_stall_rates_are_summed_over_ranks_and_logged_by_rank_zero(stall_run):
    run = stall_run
    records = [record for record in run.info("straight", 0)["metrics"] if "qstate/stall/exp_avg_sq" in record]
    assert [record["step"] for record in records] == [1, 3, 5]  # Lightning's logging step: batches stepped before this one
    block = run.info("straight", 0)["params"]["net.0.weight"]["states"]["exp_avg_sq"]["format"]["resolved_block_size"]  # 64 under FSDP2
    steady = stall_probability(get_format(run.spec.states, block_size=block, signed=False), 0.999)
    for record in records:
        assert 0.0 <= record["qstate/stall/exp_avg_sq/net.0.weight"] <= 1.0
        # a young v (a few steps, or just reset): measured from the state and the gradients, below the steady state
        assert 0.0 < record["qstate/stall_predicted/exp_avg_sq/net.0.weight"] < steady
        if run.spec.strategy == "fsdp":
            assert "qstate/stall/exp_avg_sq/net.3.weight" in record  # held by rank 1 alone: counted through the all-reduce
    assert not any(key.startswith("qstate/") for record in run.info("straight", 1)["metrics"] for key in record)


def test_predictions_and_reset_ratios_come_from_the_ranks_that_hold_the_layer(stall_run):
    """Rank 0 logs each layer's prediction from every rank's entries (FSDP1's net.3.weight lies on rank 1 alone: rank 0
    fell back to the age-only model), and the first step after a reset at the layer's own Adam step count (a layer
    whose shard on rank 0 is empty was logged as a first step, 1.0)."""
    run = stall_run
    logged = {record["step"] + 1: record for record in run.info("straight", 0)["metrics"] if "qstate/stall/exp_avg_sq" in record}
    local = {record["step"]: record for record in run.info("straight", 1)["local_predictions"]}
    tag = "qstate/stall_predicted/exp_avg_sq/net.3.weight"
    if run.spec.strategy == "fsdp":
        assert [logged[step][tag] for step in logged] == pytest.approx([local[step][tag] for step in logged], rel=1e-9)
    ratios = [(record["step"] + 1, record["qstate/reset/first_step_ratio"]) for record in run.info("straight", 0)["metrics"]
              if "qstate/reset/first_step_ratio" in record]  # fmt: skip
    assert ratios
    for step, ratio in ratios:  # reset after global step ``step``: the next Adam step is step + 1
        t = step + 1
        assert ratio == pytest.approx(0.1 * (1 - 0.999**t) ** 0.5 / ((1 - 0.9**t) * 0.001**0.5), rel=1e-9), step


def test_stall_monitor_clips_with_the_norm_of_every_ranks_shards(tmp_path):
    """Under FSDP2 the ratios StallMonitor predicts from see the gradients clipped as the Trainer clips them: by the norm
    of the full gradients (``clip_grad_norm_`` over DTensors), the same on both ranks, not by this rank's shards alone."""
    worker = TESTS / "shard_norm_worker.py"
    command = [sys.executable, str(worker), str(tmp_path), str(free_port())]
    result = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    for rank in ranks:
        assert rank["emulated"] == pytest.approx(rank["clip_grad_norm"], rel=1e-6) and rank["local"] < 0.9 * rank["emulated"]
    assert ranks[0]["emulated"] == ranks[1]["emulated"]


@pytest.fixture(scope="module")
def plain_torch_ranks(tmp_path_factory):
    """The two ranks' results of ``plain_torch_worker.py`` (DDP and FSDP2 without Lightning), run once."""
    out = tmp_path_factory.mktemp("plain-torch")
    command = [sys.executable, str(TESTS / "plain_torch_worker.py"), str(out), str(free_port())]
    result = subprocess.run(command, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_replicas_round_alike_when_the_ranks_are_seeded_apart(plain_torch_ranks):
    """Plain DDP with optimizers built on each rank from global generators seeded apart: the first step that rounds
    stochastically takes rank 0's seed (states, QMuon's buffer, the wrapper's, a weight grid), so the replicas stay
    identical (they drifted apart: 3e-3 after 5 steps). Round-to-nearest optimizers draw nothing and join no broadcast."""
    ranks = [rank["seeds"] for rank in plain_torch_ranks]
    for case in ("qadamw", "qmuon", "wrapper", "eco_weights"):
        assert ranks[0][case]["drawn"] != ranks[1][case]["drawn"], case  # the ranks did draw apart
        assert ranks[0][case]["seed"] == ranks[1][case]["seed"] == ranks[0][case]["drawn"], case
        assert ranks[0][case]["shared"] and ranks[1][case]["shared"], case
        assert ranks[0][case]["params"] == ranks[1][case]["params"], case
    assert not ranks[0]["nearest"]["shared"] and ranks[0]["nearest"]["seed"] != ranks[1]["nearest"]["seed"]
    assert ranks[0]["nearest"]["params"] == ranks[1]["nearest"]["params"]


def test_zero_redundancy_optimizer_resumes(plain_torch_ranks):
    """ZeroRedundancyOptimizer(optimizer_class=QAdamW) writes the loaded states into the local optimizer's state without
    its load_state_dict: the packed entries are imported at the next step (a TypeError inside torch's Adam before), and
    the resumed run is the uninterrupted one."""
    for rank in plain_torch_ranks:
        runs = rank["zero_resume"]
        assert runs["kinds"] == ["QuantizedTensor", "Tensor"]
        assert runs["resumed"] == runs["straight"]


def test_a_full_state_dict_moves_fsdp2_states_to_an_unsharded_model(plain_torch_ranks):
    """The README's way between layouts in plain torch: a full optimizer state dict of FSDP2's (2 ranks) loaded with
    set_optimizer_state_dict into an unsharded model on one rank. The weight's states (FSDP2 blocks of a row) load
    exactly, in the saved blocks; the bias, plain under FSDP2 (its rows allow no aligned block), is quantized per the
    policy; the step counts carry on."""
    result = plain_torch_ranks[0]["full_to_single"]
    assert set(result["formats"].values()) == {"int8"}
    assert result["exact"] == {"weight.exp_avg": True, "weight.exp_avg_sq": True, "bias.exp_avg": False, "bias.exp_avg_sq": False}
    assert result["steps"] == [3.0, 3.0] and result["steps_after"] == [4.0, 4.0]


def test_the_wrapper_resumes_under_fsdp2(plain_torch_ranks):
    """quantize_optimizer(Adagrad) on a fully_shard model: its plain states came back from load_state_dict as local
    tensors and the next step raised (torch's update mixed them with the DTensor gradient); they load as DTensors like
    their parameters, and the resumed run is the uninterrupted one."""
    for rank in plain_torch_ranks:
        runs = rank["wrapper_resume"]
        assert runs["resumed"]["kinds"] == runs["straight"]["kinds"] == ["DTensor", "QuantizedTensor", "Tensor"]  # Tensor: step
        assert runs["resumed"]["params"] == runs["straight"]["params"]
        nbytes = runs["resumed"]["nbytes"]  # this rank's, as state_summary's values are (a DTensor's full size was counted)
        assert nbytes["state_nbytes"] == nbytes["held"] and nbytes["summary"] == nbytes["per_value"]


def test_an_overflow_in_one_ranks_shard_is_raised_and_reset_alike_on_every_rank(plain_torch_ranks):
    """FSDP2, fp16 states overflowing in rank 1's shard only: every rank raises the same ``StepOverflowError`` (names,
    message) and resets the parameter alike, whatever path its shard took (native on both, native beside the reference
    path, the wrapper): its per-value states zero (the wrapper's fp32 momentum too), the step counted (2 after steps 0
    and 1); QSGD's buffer, which its first step creates, kept by neither. The next step runs on both ranks alike."""
    ranks = [rank["overflow"] for rank in plain_torch_ranks]
    for case in ("native", "mixed_paths", "wrapper", "sgd_first_step"):
        first, second = (rank[case] for rank in ranks)
        assert first["error"] == second["error"], case
        assert first["error"][:3] == ["StepOverflowError", ["param0"], 0 if case == "sgd_first_step" else 1], case
        assert first["after"] == second["after"] and first["last"] == second["last"], case
        if case == "sgd_first_step":
            assert first["after"] == {} and list(first["last"]) == ["momentum_buffer"], case
        else:
            assert all(not value[1] for value in first["after"].values() if isinstance(value, list)), (case, first["after"])
            assert first["after"]["step"] == 2.0 and first["last"]["step"] == 3.0, case
    paths = [rank["mixed_paths"]["paths"][1]["param0"] for rank in ranks]
    assert paths == ["native", "reference"]


def test_fsdp1_replicas_and_skips_agree_and_an_unfitted_optimizer_is_refused(plain_torch_ranks):
    """Plain-torch FSDP1, both use_orig_params: under NO_SHARD with stochastic rounding the replicas stay identical
    (each rank rounded with its own rank's stream: 3e-3 apart after five steps); a NaN in one rank's part under
    skip_step counts every parameter on both ranks (one rank counted those it held a part of);
    a QAdamW that QuantizationPolicy.apply has not fitted to the FSDP1 model refuses its first step, naming apply."""
    ranks = [rank["fsdp1"] for rank in plain_torch_ranks]
    for orig in ("True", "False"):
        assert ranks[0][f"no_shard_{orig}"] == ranks[1][f"no_shard_{orig}"], orig
        skipped, steps, params = ranks[0][f"skips_{orig}"]
        assert ranks[1][f"skips_{orig}"] == [skipped, steps, params] and skipped == params and steps == 1, orig
        for rank in ranks:
            assert "QuantizationPolicy().apply(optimizer, fsdp_model)" in rank[f"unfitted_{orig}"], orig


# --- single process ----------------------------------------------------------------------------------
def trained_optimizer(shape: tuple[int, ...], states: str = "int8") -> tuple[QAdamW, torch.nn.Parameter]:
    param = torch.nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)))
    optimizer = QAdamW([param], lr=1e-2, states=states, min_quant_size=0)
    for step in range(3):
        param.grad = torch.randn(shape, generator=torch.Generator().manual_seed(step + 1))
        optimizer.step()
    return optimizer, param


@pytest.mark.parametrize("shape", [(31, 64), (64, 32), (2048,)])
def test_packed_checkpoint_refuses_a_parameter_of_another_shape(shape):
    saved, _ = trained_optimizer((32, 64))
    state_dict = saved.state_dict()
    assert state_dict["state"][0]["exp_avg"]["codes"].dtype == torch.uint8  # packed, as DDP saves it
    target, _ = trained_optimizer(shape)
    with pytest.raises(ValueError, match=r"checkpoint state has shape \(32, 64\) but the parameter has shape"):
        target.load_state_dict(state_dict)


def test_packed_checkpoint_refuses_codes_of_the_wrong_size():
    saved, _ = trained_optimizer((32, 64))
    state_dict = saved.state_dict()
    entry = state_dict["state"][0]["exp_avg"]
    entry["codes"] = entry["codes"][:-1]
    target, _ = trained_optimizer((32, 64))
    with pytest.raises(ValueError, match="holds .* bytes but format 'int8' needs"):
        target.load_state_dict(state_dict)


@pytest.mark.parametrize("states", ["int8", "int4"])
def test_fp32_checkpoint_requantizes_to_the_same_codes(states):
    """The fp32 export (FSDP1/FSDP2) loads back bit-exactly, although signed maps cannot reach -1."""
    saved, _ = trained_optimizer((40, 64), states)
    saved.checkpoint_mode = "fp32"
    state_dict = saved.state_dict()
    assert state_dict["state"][0]["exp_avg"].dtype == torch.float32 and "exp_avg.qstate_format" in state_dict["state"][0]
    target, _ = trained_optimizer((40, 64), states)  # the same configuration: the markers' formats load exactly
    target.load_state_dict(state_dict)
    for name in ("exp_avg", "exp_avg_sq"):
        before, after = saved.state[saved.param_groups[0]["params"][0]][name], target.state[target.param_groups[0]["params"][0]][name]
        assert isinstance(after, QuantizedTensor) and after.format.config == before.format.config
        assert torch.equal(after.codes, before.codes) and torch.equal(after.scales, before.scales)


@pytest.mark.parametrize("states", ["int8", "int4", "fp8_e4m3"])
def test_unpacked_state_dict_is_the_fp32_form_of_a_packed_one(states):
    """``unpacked_state_dict`` (what FSDP1/FSDP2 read from a packed checkpoint) holds the decoded values and markers that
    load into the very codes and scales; it checks what loading checks, and leaves the packed dict as it was."""
    saved, _ = trained_optimizer((40, 64), states)
    packed = saved.state_dict()
    unpacked = unpacked_state_dict(packed)
    assert is_exported(packed["state"][0]["exp_avg"]) and unpacked["param_groups"] is packed["param_groups"]
    param = saved.param_groups[0]["params"][0]
    for name in ("exp_avg", "exp_avg_sq"):
        assert unpacked["state"][0][name].dtype == torch.float32
        assert torch.equal(unpacked["state"][0][name], saved.state[param][name].dequantize(torch.float32))
        assert format_from_marker(unpacked["state"][0][name + ".qstate_format"]).config == saved.state[param][name].format.config
    target, _ = trained_optimizer((40, 64), states)
    target.load_state_dict(unpacked)
    for name in ("exp_avg", "exp_avg_sq"):
        before, after = saved.state[param][name], target.state[target.param_groups[0]["params"][0]][name]
        assert torch.equal(after.codes, before.codes) and torch.equal(after.scales, before.scales)
    packed["state"][0]["exp_avg"]["codes"][0] ^= 1
    with pytest.raises(ValueError, match=r"optimizer state 0 \('exp_avg'\): the checkpoint is damaged"):
        unpacked_state_dict(packed)


def test_quantize_exactly_finds_the_scales_round_to_nearest_misses():
    """fp32 scales: round-to-nearest re-quantization of the decoded values misses the scale of exactly the blocks whose
    absmax was negative (the signed map ends at -0.993) and no positive value took code 1; quantize_exactly recovers them."""
    fmt = get_format("int8", block_size=64, scale_dtype="fp32")
    values = torch.randn(64 * 50, generator=torch.Generator().manual_seed(0))
    quantized = fmt.quantize(values)
    decoded = quantized.dequantize()
    missed = fmt.quantize(decoded).scales != quantized.scales
    negative_max = values.view(50, 64).gather(1, values.view(50, 64).abs().argmax(1, keepdim=True)).squeeze(1) < 0
    assert missed.any() and not (missed & ~negative_max).any()
    again = quantize_exactly(fmt, decoded)
    assert torch.equal(again.codes, quantized.codes) and torch.equal(again.scales, quantized.scales)


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("scale_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("name", ["int8", "int4", "int8_linear", "int4_linear", "int6", "fp8_e4m3", "fp8_e5m2", "e2m2", "e5m10"])
@pytest.mark.parametrize("signed", [True, False])
def test_quantize_exactly_restores_every_block(name, signed, scale_dtype, rounding):
    """Every format, scale type and rounding, values from 1 down to 1e-12: the decoded values re-quantize to the same
    scales and the same values (a bf16 scale is the absmax rounded up, so a block's largest value may decode short of
    it with any map; stochastic rounding may take it a code further down)."""
    fmt = get_format(name, signed=signed, scale_dtype=scale_dtype, block_size=64)
    generator = torch.Generator().manual_seed(0)
    for magnitude in (1.0, 1e-3, 1e-6, 1e-12):
        values = torch.randn(64 * 200 + 7, generator=generator) * torch.rand(64 * 200 + 7, generator=generator) ** 4 * magnitude
        quantized = fmt.quantize(values if signed else values.abs(), rounding=rounding, generator=generator)
        decoded = quantized.dequantize()
        again = quantize_exactly(fmt, decoded)
        assert torch.equal(again.scales, quantized.scales) and torch.equal(again.dequantize(), decoded), magnitude


@pytest.mark.parametrize("states", ["int8", "e2m2", "int4"])
def test_fp32_checkpoint_resumes_stochastic_rounding_exactly(states):
    """The fp32 export of stochastically rounded states (bf16 scales for m) resumes the uninterrupted run bit for bit:
    a block whose largest value rounded down a code gets its scale back (it was rescaled on load)."""
    torch.manual_seed(0)
    straight_model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64))
    resumed_model = copy.deepcopy(straight_model)
    options = dict(states=states, rounding="stochastic", min_quant_size=0)
    straight = QAdamW(straight_model.parameters(), generator=torch.Generator().manual_seed(2), **options)
    inputs = [torch.randn(16, 64, generator=torch.Generator().manual_seed(i)) for i in range(8)]

    def train(model, optimizer, batches):
        for batch in batches:
            optimizer.zero_grad()
            model(batch).square().mean().backward()
            optimizer.step()

    train(straight_model, straight, inputs[:5])  # e2m2: 4 rescaled blocks (4 steps of seed 1's draws: none)
    straight.checkpoint_mode = "fp32"
    saved = copy.deepcopy(straight.state_dict())
    resumed_model.load_state_dict(straight_model.state_dict())
    resumed = QAdamW(resumed_model.parameters(), **options)
    resumed.load_state_dict(saved)
    short = 0
    for p, q in zip(straight_model.parameters(), resumed_model.parameters(), strict=True):
        value, after = straight.state[p]["exp_avg"], resumed.state[q]
        short += int((value.format.quantize(value.dequantize()).scales != value.scales).sum())
        assert torch.equal(after["exp_avg"].scales, value.scales) and torch.equal(after["exp_avg"].dequantize(), value.dequantize())
    assert short  # blocks that round-to-nearest re-quantization rescales were there
    train(straight_model, straight, inputs[5:])
    train(resumed_model, resumed, inputs[5:])
    assert all(torch.equal(a, b) for a, b in zip(straight_model.parameters(), resumed_model.parameters(), strict=True))


def test_fp32_checkpoint_refuses_a_state_of_another_shape():
    """The fp32 form is checked against the local parameter as the packed form is: a state of another shape (another
    rank's uneven shard, another world size under FSDP1) raises at load, not at the next step."""
    saved, _ = trained_optimizer((32, 64))
    saved.checkpoint_mode = "fp32"
    target, _ = trained_optimizer((31, 64))
    with pytest.raises(
        ValueError, match=r"state 0 \('exp_avg'\): checkpoint state has shape \(32, 64\) but the parameter has shape \(31, 64\)"
    ):
        target.load_state_dict(saved.state_dict())


def test_fp32_checkpoint_tells_of_blocks_no_scale_fits():
    """The fp32 form has no checksum; a changed value seldom decodes from any code and scale of its block, so loading
    says how many blocks it had to re-quantize to nearest (damage, or another block layout: FSDP1 at another world size)."""
    saved, _ = trained_optimizer((32, 64))
    saved.checkpoint_mode = "fp32"
    state_dict = copy.deepcopy(saved.state_dict())
    target, _ = trained_optimizer((32, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.load_state_dict(copy.deepcopy(state_dict))  # as saved: every block fits
    state_dict["state"][0]["exp_avg"].view(-1)[5] *= 1.0001
    with pytest.warns(UserWarning, match=r"state 0 \('exp_avg'\): 1 of 8 blocks of 256 values \(int8\) decode from no code and scale"):
        target.load_state_dict(state_dict)


def test_betas_given_back_as_a_list_are_the_same_betas():
    """torch's ``set_optimizer_state_dict`` (FSDP2 full checkpoints) gives the groups back with lists: no warning."""
    saved, _ = trained_optimizer((32, 64))
    state_dict = saved.state_dict()
    state_dict["param_groups"][0]["betas"] = list(state_dict["param_groups"][0]["betas"])
    target, _ = trained_optimizer((32, 64))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        target.load_state_dict(state_dict)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed")
def test_apply_under_fsdp1_fits_an_optimizer_built_quantized_and_refuses_eco_exact():
    """An optimizer built quantized (``configure_optimizers``) gets FSDP1's fp32 checkpoints and full sizes as a converted
    one does (its packed codes made every save fail). FSDP1 gathers every state name over all parameters of a flat
    parameter: eco_exact's error buffer, held by the parameters on a grid only, made every save fail. Refused."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FullyShardedDataParallel

    from lightning_qstate.optim import QuantizationPolicy

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model = FullyShardedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), device_id=torch.device("cpu"), use_orig_params=True
        )
        built = QuantizationPolicy().apply(QAdamW(model.parameters(), states="int8", min_quant_size=0), model)
        assert built.checkpoint_mode == "fp32" and built.full_numels
        policy = QuantizationPolicy(weights="bf16", error_feedback="eco_exact", weight_overrides={"0.weight": "bf16"})
        optimizer = torch.optim.AdamW(model.parameters())
        with pytest.raises(ValueError, match=r"AdamW: error_feedback='eco_exact' is not supported under FSDP1.*Use FSDP2"):
            policy.apply(optimizer, model)
        assert type(optimizer) is torch.optim.AdamW  # refused before it was converted
    finally:
        if created:
            dist.destroy_process_group()
