"""The weights' own stall counts (``track_stalls=True`` with ``track_weight_stalls``, pseudo-state ``WEIGHT_STALLS``):
entries of a parameter whose update moved them but whose stored value did not change.

Counted exactly (checked against a recount of unchanged entries) on every step path, for bf16, fp32 (against the
float64 update) and weight-grid parameters; tiny learning rates stall ~100 %, large ones ~0 %. Tracking changes no
bit of the run, and untracked steps compute nothing for it. The counts flow through ``stall_counts``/``stall_stats``
and the Lightning callbacks: ``StallMonitor`` logs them, ``StateResetScheduler`` leaves them alone.
"""

from __future__ import annotations

import pytest
import torch

import lightning_qstate as lq
from lightning_qstate.formats import QuantizedTensor
from lightning_qstate.kernels import dispatch
from lightning_qstate.kernels.native import native_kernel_available
from lightning_qstate.optim import FEEDBACK_STALLS, WEIGHT_STALLS, QuantizedStates


@pytest.fixture(autouse=True)
def count_weight_stalls(monkeypatch):
    """Every optimizer of these tests counts the weights' stalls when it tracks stalls (off by default: it costs)."""
    monkeypatch.setattr(QuantizedStates, "track_weight_stalls", True)


def steps_with_recount(optimizer: QuantizedStates, param: torch.nn.Parameter, steps: int = 3) -> list[tuple[int, int, int]]:
    """Step ``optimizer`` ``steps`` times with random gradients; per step ``(stalled, moved, unchanged entries)``.

    An entry the update does not move keeps its value, so ``stalled + (numel - moved)`` must be ``unchanged``, exactly.
    """
    recounts = []
    for step in range(steps):
        before = param.detach().clone()
        param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(step)).to(param.dtype)
        optimizer.step()
        stalled, moved = (int(count) for count in optimizer.stall_counts()[param][WEIGHT_STALLS])
        unchanged = int((param.detach() == before).sum())
        assert stalled + param.numel() - moved == unchanged
        assert moved > 0.99 * param.numel()  # Adam without weight decay: m = 0 only where it cancels exactly
        recounts.append((stalled, moved, unchanged))
    return recounts


@pytest.mark.parametrize(
    ("states", "numel", "path"),
    [("int8", 8192, "reference"), ("fp32", 8192, "multi_tensor")],
    ids=["quantized_states", "plain_states"],
)
def test_bf16_weights_stall_at_a_tiny_lr_and_move_at_a_large_one(states, numel, path):
    """A bf16 parameter's half ulp is 2^-9 of its magnitude: Adam steps of 1e-5 are lost for all but the entries near 0,
    steps of 1 for none (torch's update runs in bf16, on the reference or the multi-tensor path)."""
    rates = {}
    for lr in (1e-5, 1.0):
        param = torch.nn.Parameter(torch.randn(numel, generator=torch.Generator().manual_seed(0)).bfloat16())
        optimizer = lq.QAdam([param], lr=lr, states=states, min_quant_size=0, track_stalls=True)
        recounts = steps_with_recount(optimizer, param)
        assert optimizer.step_paths() == {"param0": path}
        rates[lr] = sum(stalled for stalled, _, _ in recounts) / sum(moved for _, moved, _ in recounts)
    assert rates[1e-5] > 0.99 and rates[1.0] < 0.01, rates


@pytest.mark.parametrize("states", ["int8", "fp32"])
def test_fp32_weights_count_updates_below_half_an_ulp(states):
    """fp32 parameters against their float64 update: ``lr = 1e-9`` is below half an fp32 ulp of every entry above ~0.02
    in magnitude; ``lr = 1e-3`` moves all but the rare entry whose ``m / sqrt(v)`` nearly vanishes. Fast paths (the C++
    kernel, torch's multi-tensor Adam) count too."""
    rates = {}
    for lr in (1e-9, 1e-3):
        param = torch.nn.Parameter(torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)))
        optimizer = lq.QAdam([param], lr=lr, states=states, min_quant_size=0, track_stalls=True)
        recounts = steps_with_recount(optimizer, param)
        rates[lr] = sum(stalled for stalled, _, _ in recounts) / sum(moved for _, moved, _ in recounts)
        expected = {"int8": "native" if native_kernel_available() else "compiled", "fp32": "multi_tensor"}[states]
        assert optimizer.step_paths() == {"param0": expected}
    assert 0.9 < rates[1e-9] < 1.0 and rates[1e-3] < 1e-4, rates


def test_only_entries_the_update_moves_count():
    """Adam's first step without weight decay leaves entries with a zero gradient where they are: not moved, not stalled."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4096).bfloat16())
    optimizer = lq.QAdam([param], lr=1e-5, min_quant_size=0, track_stalls=True)
    param.grad = torch.randn(4096).bfloat16()
    param.grad[::2] = 0
    optimizer.step()
    stalled, moved = optimizer.stall_counts()[param][WEIGHT_STALLS].tolist()
    assert moved == 2048 and stalled > 0.99 * moved


@pytest.mark.parametrize(
    ("build", "lr", "low"),
    [
        (lambda p, lr: lq.QSGD([p], lr=lr, momentum=0.9, min_quant_size=0, track_stalls=True), 1e-6, True),
        (lambda p, lr: lq.QSGD([p], lr=lr, momentum=0.9, min_quant_size=0, track_stalls=True), 1.0, False),
        (lambda p, lr: lq.QMuon([p], lr=lr, min_quant_size=0, track_stalls=True), 1e-6, True),
        (lambda p, lr: lq.QMuon([p], lr=lr, min_quant_size=0, track_stalls=True), 1.0, False),
    ],
    ids=["sgd_tiny_lr", "sgd_large_lr", "muon_tiny_lr", "muon_large_lr"],
)
def test_sgd_and_muon_count_their_weights(build, lr, low):
    param = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
    optimizer = build(param, lr)
    for step in range(3):
        param.grad = torch.randn(64, 64, generator=torch.Generator().manual_seed(step)).bfloat16()
        optimizer.step()
    rate = optimizer.stall_stats()["param0"][WEIGHT_STALLS]
    assert rate > 0.95 if low else rate < 0.05, rate


@pytest.mark.parametrize(
    ("weights", "dtype"),
    [("bf16", torch.float32), ("bf16", torch.bfloat16), ("fp8_e4m3", torch.float32), ("e2m3", torch.bfloat16)],
)
def test_weight_grids_count_the_entries_that_keep_their_code(weights, dtype):
    """ECO's weights (``weights=``): an entry stalls when ``θ̃`` moved but it kept its code (block-scaled grids: its value
    still moves with its row's scale). Tiny learning rates stall ~100 %, large ones ~0 %; the first-step rounding of the
    initial values onto the grid (``quantize_weights``) is not a step. fp8 E4M3's grid step is 1/8 of a value's octave:
    an Adam step of ``lr = 0.1`` is below half of it for many entries (those above ~2 in magnitude), ``lr = 1`` for none."""
    rates = {}
    for lr in (1e-6, 1.0):
        param = torch.nn.Parameter(torch.randn(96, 128, generator=torch.Generator().manual_seed(0)).to(dtype))
        optimizer = lq.QAdamW([param], lr=lr, weights=weights, weight_rounding="nearest", min_quant_size=0, track_stalls=True)
        optimizer.quantize_weights()
        for step in range(3):
            param.grad = torch.randn(96, 128, generator=torch.Generator().manual_seed(step)).to(dtype)
            optimizer.step()
        rates[lr] = optimizer.stall_stats()["param0"][WEIGHT_STALLS]
    assert rates[1e-6] > 0.95 and rates[1.0] < 0.05, rates


def path_configurations() -> list[tuple[str, dict, torch.dtype, int]]:
    """``(id, QAdamW options, parameter dtype, numel)`` over the step paths and weight grids."""
    return [
        ("native_or_compiled", {"states": "int8"}, torch.float32, 1 << 16),
        ("compiled_int4", {"states": "int4"}, torch.float32, 1 << 16),
        ("compiled_stochastic", {"states": "int8", "rounding": "stochastic"}, torch.float32, 1 << 16),
        ("reference_stochastic", {"states": "int8", "rounding": "stochastic"}, torch.float32, 4096),
        ("multi_tensor", {"states": "fp32"}, torch.bfloat16, 4096),
        ("bf16_grid_fused", {"states": "int8", "weights": "bf16"}, torch.float32, 1 << 16),
        ("bf16_grid_eco_exact", {"states": "int8", "weights": "bf16", "error_feedback": "eco_exact"}, torch.bfloat16, 4096),
        ("fp8_grid", {"states": "int8", "weights": "fp8_e4m3", "error_feedback": "eco"}, torch.float32, 4096),
        (
            "bf16_grid_eco_stochastic",
            {"states": "int8", "rounding": "stochastic", "weights": "bf16", "weight_rounding": "stochastic", "error_feedback": "eco"},
            torch.bfloat16,
            1 << 16,
        ),
    ]


@pytest.mark.parametrize(("options", "dtype", "numel"), [c[1:] for c in path_configurations()], ids=[c[0] for c in path_configurations()])
def test_tracking_changes_no_bit_of_the_run(options, dtype, numel):
    runs = []
    for track in (False, True):
        param = torch.nn.Parameter(torch.randn(numel // 128, 128, generator=torch.Generator().manual_seed(0)).to(dtype))
        optimizer = lq.QAdamW([param], lr=1e-3, min_quant_size=0, track_stalls=track, generator=torch.Generator().manual_seed(1), **options)
        for step in range(3):
            param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(step)).to(dtype)
            optimizer.step()
        states = {name: v.dequantize() if isinstance(v, QuantizedTensor) else v for name, v in optimizer.state[param].items()}
        runs.append((optimizer.step_paths(), param.detach().clone(), states))
        if track:
            stats = optimizer.stall_stats()["param0"]
            assert WEIGHT_STALLS in stats and (FEEDBACK_STALLS in stats) == (options.get("error_feedback") == "eco")
    (paths, values, states), (tracked_paths, tracked_values, tracked_states) = runs
    assert paths == tracked_paths and torch.equal(values, tracked_values)
    assert all(torch.equal(states[name], tracked_states[name]) for name in states)


def test_untracked_steps_compute_no_intended_update(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the weights' update was recomputed on an untracked step")

    monkeypatch.setattr(QuantizedStates, "_intended_update", refuse)
    monkeypatch.setattr(dispatch, "FUSED_MIN_NUMEL", 1024)
    params = [torch.nn.Parameter(torch.randn(n)) for n in (4096, 2048, 64)]
    optimizer = lq.QAdamW([{"params": params[:1], "states": "int8"}, {"params": params[1:2], "states": "int4"}, {"params": params[2:]}])
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    assert not optimizer._stall_counts


def test_tracked_steps_count_no_weight_stalls_unless_asked(monkeypatch):
    """``track_stalls`` alone counts the states (as before): the weights' second update only with ``track_weight_stalls``."""
    monkeypatch.setattr(QuantizedStates, "track_weight_stalls", False)
    param = torch.nn.Parameter(torch.randn(4096))
    optimizer = lq.QAdamW([param], lr=1e-3, min_quant_size=0, track_stalls=True)
    param.grad = torch.randn(4096)
    optimizer.step()
    assert set(optimizer.stall_stats()["param0"]) == {"exp_avg", "exp_avg_sq"}
    optimizer.track_weight_stalls = True
    optimizer.step()
    assert set(optimizer.stall_stats()["param0"]) == {"exp_avg", "exp_avg_sq", WEIGHT_STALLS}


def test_counts_flow_through_stall_stats_and_skip_nonfinite_parameters():
    stepped, skipped = torch.nn.Parameter(torch.randn(512).bfloat16()), torch.nn.Parameter(torch.randn(512).bfloat16())
    optimizer = lq.QAdamW([stepped, skipped], lr=1e-6, min_quant_size=0, track_stalls=True)
    stepped.grad, skipped.grad = torch.randn(512).bfloat16(), torch.full((512,), float("nan")).bfloat16()
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        optimizer.step()
    counts = optimizer.stall_counts(reset=False)
    assert WEIGHT_STALLS in counts[stepped] and skipped not in counts
    stats = optimizer.stall_stats()
    assert set(stats) == {"param0"} and stats["param0"][WEIGHT_STALLS] == pytest.approx(1.0, abs=0.01)
    assert optimizer.stall_stats() == {}  # reset


def test_the_wrapper_counts_no_weight_stalls():
    """The generic wrapper's inner optimizer writes the parameters itself: its states are counted, not its weights."""
    param = torch.nn.Parameter(torch.randn(256))
    optimizer = lq.quantize_optimizer(torch.optim.Adagrad([param], lr=1e-9), states="bf16", min_quant_size=0, track_stalls=True)
    for _ in range(2):
        param.grad = torch.randn(256)
        optimizer.step()
    assert set(optimizer.stall_stats()["param0"]) == {"sum"} and not optimizer.counts_weight_stalls


@pytest.mark.filterwarnings("ignore:.*does not have many workers")
def test_stall_monitor_logs_the_weights_and_resets_leave_them_alone(tmp_path):
    pytest.importorskip("lightning")
    from test_stall_callbacks import fit

    from lightning_qstate.callbacks import StallMonitor, StateResetScheduler
    from lightning_qstate.callbacks.stall_counts import state_rows
    from lightning_qstate.plugins import QStatePrecision

    from lightning_models import MemoryLogger

    logger, scheduler = MemoryLogger(), StateResetScheduler(period=2)
    trainer = fit(tmp_path, max_steps=4, callbacks=[StallMonitor(per_layer=True, log_every_n_steps=2), scheduler], logger=logger,
                  plugins=[QStatePrecision("bf16-true", states="bf16", min_quant_size=0)])  # fmt: skip
    layers = ["net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias", "net.3.weight", "net.3.bias"]
    for layer in layers:
        rates = logger.values(f"qstate/stall/weights/{layer}")
        assert len(rates) == 2 and all(0.0 <= rate <= 1.0 for rate in rates), layer
    model_wide = logger.values("qstate/stall/weights")
    assert len(model_wide) == 2 and all(0.0 < rate < 1.0 for rate in model_wide)  # bf16 weights at lr 1e-2: some stall
    assert not any(key.startswith("qstate/stall_predicted/weights") for _, metrics in logger.records for key in metrics)
    rows = [row for row in state_rows(trainer) if row.state == WEIGHT_STALLS]
    assert [row.layer for row in rows] == layers and all(row.format is None and not row.is_state for row in rows)
    assert all(row.state != WEIGHT_STALLS for rows in scheduler.layers(trainer).values() for row in rows)
    assert sorted({step for step, _ in scheduler.history}) == [2, 4]
