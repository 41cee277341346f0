"""The C++ CPU Adam kernel (``kernels/native.py``) on every format it stores beyond 8-bit codebooks (issue #22).

4-bit codebooks (two codes per byte), dense 5- to 7-bit codes (groups of 8 in ``bits`` bytes), minifloats (FP8
E4M3/E5M2 and any ExMy of at most 8 bits: a 256-entry decode table, the reference's encoder arithmetic),
bf16/fp16/fp32 casts, and pairs of these with different block sizes for ``m`` and ``v``: under round to nearest the
kernel's codes, scales and stall counts are those of ``kernels.adam_reference.adam_step_quantized`` bit for bit
(params within a few ulps without a weight grid, bit for bit on one), and the optimizer sends these formats to the
native path.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import lightning_qstate as lq
from lightning_qstate.formats import CodebookFormat, MinifloatFormat, QuantizedTensor, get_format
from lightning_qstate.formats.codebooks import nearest_thresholds
from lightning_qstate.formats.packing import unpack
from lightning_qstate.formats.rounding import encode_codebook
from lightning_qstate.formats.weights import get_weight_grid
from lightning_qstate.kernels import native
from lightning_qstate.kernels.adam_reference import adam_hyper, adam_step_quantized
from lightning_qstate.kernels.bounds import held_moment_bound
from lightning_qstate.kernels.native import StateOverflowError, native_adam_steps, native_formats

pytestmark = pytest.mark.skipif(not native.native_kernel_available(), reason="no C++ compiler here: the optimizer uses another path")

# (m format, v format): name -> pair
PAIRS = {
    "int4": (get_format("int4"), get_format("int4", signed=False)),
    "int4_linear": (get_format("int4_linear"), get_format("int4_linear", signed=False)),
    "int4 m, int8 v": (get_format("int4"), get_format("int8", signed=False)),  # blocks 128 and 256
    "int8 m, int4 v": (get_format("int8", block_size=64), get_format("int4", signed=False, block_size=512)),
    "int8 blocks 256 and 64": (get_format("int8"), get_format("int8", signed=False, block_size=64)),
    "fp8_e4m3": (get_format("fp8_e4m3"), get_format("fp8_e4m3", signed=False)),
    "fp8_e5m2": (get_format("fp8_e5m2"), get_format("fp8_e5m2", signed=False)),
    "fp8_e4m3 m, int8 v, fp32 scales": (get_format("fp8_e4m3", scale_dtype="fp32"), get_format("int8", signed=False)),
    "e2m1 (4 and 3 bits)": (get_format("e2m1", block_size=64), get_format("e2m1", signed=False, block_size=64)),
    "e3m0 m, e4m4 v": (get_format("e3m0", block_size=32), get_format("e4m4", signed=False)),
    "bf16": (get_format("bf16"), get_format("bf16", signed=False)),
    "fp16": (get_format("fp16"), get_format("fp16", signed=False)),
    "bf16 m, int4 v": (get_format("bf16"), get_format("int4", signed=False)),
    "fp32 m, fp8 v": (get_format("fp32"), get_format("fp8_e5m2", signed=False)),
    "int5 (dense)": (get_format("int5"), get_format("int5", signed=False)),
    "int6 m, int7 v (dense, blocks 32 and 256)": (get_format("int6", block_size=32), get_format("int7", signed=False)),
    "int7_linear m, int5_linear v": (get_format("int7_linear"), get_format("int5_linear", signed=False, block_size=8)),
    "e2m3 m, e3m3 v (dense minifloats)": (get_format("e2m3", block_size=64), get_format("e3m3", signed=False)),
    "int4 m, int6 v": (get_format("int4"), get_format("int6", signed=False)),
}
SIZES = [(1 << 12) + 77, 3 * 512 + 1, 13]  # partial last blocks (an odd count of nibbles), one shorter than a vector


def adam_group(betas=(0.9, 0.999), weight_decay=0.1, decoupled=True, maximize=False) -> dict:
    return {
        "lr": 1e-2, "betas": betas, "eps": 1e-8, "weight_decay": weight_decay, "decoupled_weight_decay": decoupled,
        "maximize": maximize, "amsgrad": False, "capturable": False, "differentiable": False, "fused": None, "rounding": "nearest",
        "weight_rounding": "nearest", "error_feedback": None,
    }  # fmt: skip


def adam_state(m_format, v_format, numel: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    m = m_format.quantize(torch.randn(numel, generator=generator) * 0.1)
    v = v_format.quantize(torch.rand(numel, generator=generator) * 0.01 * (torch.rand(numel, generator=generator) < 0.9))
    return {"step": torch.tensor(3.0), "exp_avg": m, "exp_avg_sq": v}


def reference_hyper(group: dict, state: dict) -> dict:
    """``adam_hyper`` of ``state``'s next step (``step`` counted here) with the bound an optimizer holds ``m`` to
    (``held_moment_bound``: ``K²`` kept in ``state``, seeded from its moments where missing, as the native step does)."""
    bound = held_moment_bound(state, *(float(beta) for beta in group["betas"]), float(state["step"]))
    state["step"] += 1
    return adam_hyper(group, float(state["step"]), bound)


def reference_step(param, grad, state, group, track, weight_format=None) -> list[int]:
    m, v = state["exp_avg"], state["exp_avg_sq"]
    counts = adam_step_quantized(
        param, grad, m.codes, m.scales, v.codes, v.scales, reference_hyper(group, state), m.format, v.format, "nearest",
        group["decoupled_weight_decay"], group["maximize"], track, weight_format,
    )  # fmt: skip
    return counts.tolist()


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def test_the_kernel_takes_these_formats_and_not_wider_codes():
    for m_format, v_format in PAIRS.values():
        assert native_formats(m_format, v_format)
    assert not native_formats(get_format("e5m10"), get_format("int8", signed=False))  # 16-bit codes


@pytest.mark.parametrize("track", [True, False], ids=["stalls", "no-stalls"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "options",
    [{}, {"decoupled": False}, {"betas": (0.3, 0.99)}, {"maximize": True, "weight_decay": 0.0}],
    ids=["adamw", "l2", "lerp", "max"],
)
@pytest.mark.parametrize("name", list(PAIRS))
def test_kernel_step_matches_the_reference_step(name, options, threads, track):
    """Three parameters in one call, two steps (each from the reference's params): codes, scales and stall counts equal
    the reference's; params within about two ulps of the update (the kernel multiplies by reciprocals where the
    reference divides). With and without stall counts: sub-byte codes of one block size take the fused block step
    only without them."""
    m_format, v_format = PAIRS[name]
    group = adam_group(**options)
    params, states, references = [], [], []
    for seed, numel in enumerate(SIZES):
        params.append(torch.randn(numel, generator=torch.Generator().manual_seed(seed)))
        states.append(adam_state(m_format, v_format, numel, seed))
        references.append((params[-1].clone(), adam_state(m_format, v_format, numel, seed)))
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for step in range(2):
            for param, (reference_param, _) in zip(params, references, strict=True):
                param.copy_(reference_param)  # the same start: with L2 decay the update's ulps reach m
            grads = [torch.randn(p.numel(), generator=torch.Generator().manual_seed(10 * step + k)) * 0.1 for k, p in enumerate(params)]
            rows = native_adam_steps(params, grads, states, group, track_stalls=track)
            for k, (row, grad, (reference_param, reference_state)) in enumerate(zip(rows, grads, references, strict=True)):
                counts = reference_step(reference_param, grad, reference_state, group, track=track)
                assert row[:2] == [1, 1] and (not track or row[2:] == counts), (step, k, row, counts)
                state = states[k]
                assert float(state["step"]) == float(reference_state["step"])
                for key in ("exp_avg", "exp_avg_sq"):
                    assert same_bits(state[key].codes, reference_state[key].codes), (step, k, key)
                    assert same_bits(state[key].scales, reference_state[key].scales), (step, k, key)
                torch.testing.assert_close(params[k], reference_param, rtol=3e-7, atol=2e-9)
    finally:
        torch.set_num_threads(saved_threads)


def assert_m_stored_like_the_reference(fmt, grad: torch.Tensor) -> None:
    """One step with beta1 = 0 and no weight decay, so that the new ``m`` (in ``fmt``, beside an int8 ``v``) is ``grad``:
    the kernel's codes and scales of ``m`` equal the reference path's."""
    group = adam_group(betas=(0.0, 0.999), weight_decay=0.0)
    state, reference = (adam_state(fmt, get_format("int8", signed=False), grad.numel(), 0) for _ in range(2))
    native_adam_steps([torch.zeros(grad.numel())], [grad], [state], group, track_stalls=False)
    reference_step(torch.zeros(grad.numel()), grad, reference, group, track=False)
    assert torch.equal(state["exp_avg"].codes, reference["exp_avg"].codes)
    assert torch.equal(state["exp_avg"].scales, reference["exp_avg"].scales)


@pytest.mark.parametrize(
    ("m_name", "v_name"),
    [("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "e5m3"), ("e4m3", "e4m4"), ("e6m1", "e6m2"), ("e3m4", "fp8_e5m2")],
)
def test_kernel_decodes_every_8_bit_minifloat_code_as_its_table(m_name, v_name):
    """Every code of 8-bit minifloat moments (those above the largest one and the negative zero included) is decoded
    as the table says: the AVX2 step reads tables whose values are powers of two apart by register permutes and
    exponent arithmetic (``exponent_decode``), the others value by value (``gather_bytes8``). The step from such
    moments equals the reference's (``v``: every code whose value is not negative; an 8-bit ``signed=False`` table may
    hold negative ones)."""
    m_format, v_format = get_format(m_name), get_format(v_name, signed=False)
    assert m_format.bits == 8 and v_format.bits == 8
    numel = 4 * 256 + 8
    state, reference = (adam_state(m_format, v_format, numel, 0) for _ in range(2))
    every_code = torch.arange(numel).remainder(256).to(torch.uint8)
    nonnegative = (v_format.decode_values() >= 0).nonzero().flatten()
    v_codes = nonnegative[torch.arange(numel).remainder(nonnegative.numel())].roll(37).to(torch.uint8)
    for moments in (state, reference):
        moments["exp_avg"].codes.copy_(every_code)
        moments["exp_avg_sq"].codes.copy_(v_codes)
    group = adam_group()
    param, grad = torch.randn(numel, generator=torch.Generator().manual_seed(1)), torch.randn(numel) * 0.1
    reference_param = param.clone()
    assert native_adam_steps([param], [grad], [state], group, track_stalls=False)[0][:2] == [1, 1]
    reference_step(reference_param, grad, reference, group, track=False)
    for key in ("exp_avg", "exp_avg_sq"):
        assert same_bits(state[key].codes, reference[key].codes), key
        assert same_bits(state[key].scales, reference[key].scales), key
    assert same_bits(param, reference_param)


@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2", "e2m1", "e3m0", "e4m3"])
@pytest.mark.parametrize("absmax", [1.0, 0.3, 12345.678])
def test_kernel_encodes_minifloats_like_the_reference(name, absmax):
    """With beta1 = 0 and no weight decay the new ``m`` is the gradient: blocks of ``absmax`` and every value halfway
    between two codes (and its fp32 neighbours) times it give the reference encoder's codes (ties to even)."""
    fmt = get_format(name, block_size=64)
    assert isinstance(fmt, MinifloatFormat)
    absmax = float(torch.tensor(absmax).to(torch.bfloat16))  # a bf16 scale: stored exactly
    values = fmt.decode_values().double().unique()
    middles = ((values[1:] + values[:-1]) / 2).float()
    hard = torch.cat(
        [middles, torch.nextafter(middles, torch.full_like(middles, -2.0)), torch.nextafter(middles, torch.full_like(middles, 2.0))]
    )
    hard = torch.cat([hard, values.float(), torch.tensor([0.0, -0.0, 1e-30, -1e-30])]).clamp(-1, 1) * absmax
    rows = hard[: hard.numel() // 63 * 63].view(-1, 63)
    grad = torch.cat([torch.full((rows.shape[0], 1), absmax), rows], dim=1).view(-1)
    assert_m_stored_like_the_reference(fmt, grad)


CODEBOOKS = {
    **{f"{name} {kind}": get_format(name, signed=kind == "signed", block_size=64)
       for name in ["int4", "int4_linear", "int5", "int6", "int6_linear", "int7", "int7_linear"] for kind in ["signed", "unsigned"]},
    "3 values (padded search)": CodebookFormat("three", torch.tensor([-1.0, 0.0, 1.0], dtype=torch.float64), 64, signed=True),
    "8 values": CodebookFormat("eight", torch.linspace(-1, 1, 8, dtype=torch.float64) ** 3, 64, signed=True),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CODEBOOKS))
def test_kernel_encodes_codebooks_like_the_reference(name):
    """The AVX-512 encoder's binary search of the thresholds (and the scalar encoder's buckets, for the tail of each
    block) on every rounding threshold of a 2- to 7-bit codebook and its fp32 neighbours: with beta1 = 0 and no weight
    decay the new ``m`` is the gradient, in blocks of 64 that each hold the scale 1.0, so the codes are the reference
    encoder's of these values."""
    fmt = CODEBOOKS[name]
    signed = fmt.signed
    thresholds = nearest_thresholds(fmt.codebook)
    thresholds = thresholds[thresholds.isfinite()]
    hard = torch.cat(
        [
            thresholds,
            torch.nextafter(thresholds, torch.full_like(thresholds, -2.0)),
            torch.nextafter(thresholds, torch.full_like(thresholds, 2.0)),
            fmt.codebook.float(),
            torch.tensor([0.0, -0.0, 1e-30, -1e-30]),
            torch.rand(2000, generator=torch.Generator().manual_seed(0)) * 2 - 1,
        ]
    )
    hard = hard.clamp(-1, 1) if signed else hard.abs().clamp(max=1)
    rows = torch.cat([hard, hard.flip(0)])[: hard.numel() // 63 * 63 * 2].view(-1, 63)
    grad = torch.cat([torch.ones(rows.shape[0], 1), rows], dim=1).view(-1)
    assert_m_stored_like_the_reference(fmt, grad)


@pytest.mark.parametrize("name", ["int4 m, int8 v", "int4", "e2m1 (4 and 3 bits)", "int5 (dense)", "fp8_e4m3", "bf16"])
@pytest.mark.parametrize("grid_name", ["bf16", "fp16"])
def test_kernel_weight_grid_step_is_the_reference_bit_for_bit(name, grid_name):
    """Without master weights (params on a bf16/fp16 grid, RN): params, codes and scales are the reference's bit for bit."""
    m_format, v_format = PAIRS[name]
    group, grid = adam_group(), get_weight_grid(grid_name)
    dtype = grid.cast_dtype
    params = [torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype) for numel in SIZES]
    states = [adam_state(m_format, v_format, p.numel(), k) for k, p in enumerate(params)]
    references = [(p.clone(), adam_state(m_format, v_format, p.numel(), k)) for k, p in enumerate(params)]
    for step in range(2):
        grads = [(torch.randn(p.numel(), generator=torch.Generator().manual_seed(step + k)) * 0.1).to(dtype) for k, p in enumerate(params)]
        rows = native_adam_steps(params, grads, states, group, track_stalls=False, weights=[grid] * len(params))
        assert all(row[:2] == [1, 1] for row in rows)
        for k, (grad, (reference_param, reference_state)) in enumerate(zip(grads, references, strict=True)):
            reference_step(reference_param, grad, reference_state, group, track=False, weight_format=grid.format)
            assert same_bits(params[k], reference_param), (step, k)
            for key in ("exp_avg", "exp_avg_sq"):
                assert same_bits(states[k][key].codes, reference_state[key].codes), (step, k, key)
                assert same_bits(states[k][key].scales, reference_state[key].scales), (step, k, key)


def native_and_reference(states, steps: int, **options) -> tuple[lq.QAdamW, lq.QAdamW, torch.Tensor, torch.Tensor]:
    """Two QAdamW with ``states`` (and ``options``) over copies of one 70,000-value parameter, ``steps`` steps of the
    same gradients: the first on the CPU's default path, the second on the reference path (torch's functional update on
    decoded states). Returns both optimizers and their parameters."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(70_000))
    fast, slow = (
        lq.QAdamW([p], lr=1e-3, states=states, min_quant_size=0, **options) for p in (weight, torch.nn.Parameter(weight.detach().clone()))
    )
    slow.cpu_compile = False
    slow_weight = slow.param_groups[0]["params"][0]
    for step in range(steps):
        grad = torch.randn(70_000, generator=torch.Generator().manual_seed(step))
        weight.grad, slow_weight.grad = grad, grad.clone()
        fast.step(), slow.step()
    return fast, slow, weight, slow_weight


@pytest.mark.parametrize(
    "states",
    [
        "int4",
        "int6",
        "fp8_e4m3",
        "fp8_e5m2",
        "bf16",
        "fp16",
        {"exp_avg": "int4", "exp_avg_sq": "int8"},
        {"exp_avg": "int4", "exp_avg_sq": "int5"},
    ],
)
def test_the_optimizer_steps_these_formats_on_the_native_path(states):
    """QAdamW with these states on the CPU takes the native path (RN) and agrees with the reference path."""
    fast, slow, weight, slow_weight = native_and_reference(states, 2)
    assert fast.step_paths() == {"param0": "native"} and slow.step_paths() == {"param0": "reference"}
    for key in ("exp_avg", "exp_avg_sq"):  # torch's own update (its sqrt is not correctly rounded): codes nearly all equal
        fast_codes, slow_codes = fast.state[weight][key].codes, slow.state[slow_weight][key].codes
        assert float((fast_codes == slow_codes).float().mean()) > 0.999, key
    torch.testing.assert_close(weight, slow_weight, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "states", [{"exp_avg": "int8"}, {"exp_avg": "fp32", "exp_avg_sq": "int8"}, {"exp_avg": "int4", "exp_avg_sq": "fp32"}], ids=str
)
def test_a_coded_moment_beside_a_plain_fp32_one_takes_the_native_path(states):
    """One moment coded and the other plain fp32 (``states={"exp_avg": "int8"}`` leaves ``v`` so): the native step takes
    the plain one as an fp32 cast (the parameter took the per-parameter reference path, 10-20x slower), agrees with the
    reference path (the hold of ``m`` included) and counts the coded moment's stalls as it does."""
    fast, slow, weight, slow_weight = native_and_reference(states, 3, track_stalls=True)
    assert fast.step_paths() == {"param0": "native"} and slow.step_paths() == {"param0": "reference"}
    for key in ("exp_avg", "exp_avg_sq"):
        ours, theirs = fast.state[weight][key], slow.state[slow_weight][key]
        assert type(ours) is type(theirs), key
        if isinstance(ours, QuantizedTensor):  # torch's own update (its sqrt is not correctly rounded): codes nearly all equal
            assert float((ours.codes == theirs.codes).float().mean()) > 0.999, key
        else:  # the kernel's lerp/addcmul are torch's fma forms (its AVX2 and AVX-512 kernels): equal bits there
            assert ours.dtype == torch.float32 and ours.shape == weight.shape
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    torch.testing.assert_close(weight, slow_weight, rtol=1e-5, atol=1e-6)
    coded = {name for name in ("exp_avg", "exp_avg_sq") if isinstance(fast.state[weight][name], QuantizedTensor)}
    assert set(fast.stall_stats()["param0"]) == set(slow.stall_stats()["param0"]) == coded


def overflow_step(states: dict, big: float, reference: bool) -> tuple[lq.QAdamW, torch.nn.Parameter, bool]:
    """Two steps of a 3000-value parameter, then one whose gradient holds ``big`` at one place; returns the optimizer,
    the parameter and whether that step raised ``StepOverflowError``."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(3000))
    optimizer = lq.QAdamW([param], lr=1e-2, states=states, min_quant_size=0)
    optimizer.cpu_compile = not reference
    for step in range(2):
        param.grad = torch.randn(3000, generator=torch.Generator().manual_seed(step))
        optimizer.step()
    param.grad = torch.randn(3000, generator=torch.Generator().manual_seed(9))
    param.grad[5] = big
    try:
        optimizer.step()
    except lq.StepOverflowError:
        return optimizer, param, True
    return optimizer, param, False


@pytest.mark.parametrize(("states", "big"), [({"exp_avg": "fp16"}, 1e20), ({"exp_avg": "fp32", "exp_avg_sq": "int8"}, 1e22)], ids=str)
def test_a_coded_moment_that_overflows_beside_a_plain_one_zeroes_both(states, big):
    """The native step writes in place: where the coded moment overflows, the plain fp32 one beside it (which held the
    failed step's values: a v of 1e37 that stopped the element for ~85k steps) is zeroed with it."""
    optimizer, param, raised = overflow_step(states, big, reference=False)
    assert raised and optimizer.step_paths() == {"param0": "native"}
    for name in ("exp_avg", "exp_avg_sq"):
        value = optimizer.state[param][name]
        assert not bool((value.dequantize() if isinstance(value, QuantizedTensor) else value).any()), name


def test_a_plain_fp32_moment_that_goes_inf_beside_a_coded_one_is_no_overflow():
    """A plain fp32 ``v`` that overflows to inf (g = 1e22) does what torch's fp32 state does on both paths: no
    ``StepOverflowError`` (the native step raised one and zeroed the coded ``m``), the same moments."""
    (native, native_param, native_raised), (reference, reference_param, reference_raised) = (
        overflow_step({"exp_avg": "int8"}, 1e22, reference) for reference in (False, True)
    )
    assert not native_raised and not reference_raised
    assert native.step_paths() == {"param0": "native"} and reference.step_paths() == {"param0": "reference"}
    assert bool(torch.isinf(native.state[native_param]["exp_avg_sq"][5]))
    m, reference_m = native.state[native_param]["exp_avg"].dequantize(), reference.state[reference_param]["exp_avg"].dequantize()
    assert float(m.abs().max()) > 1e20 and float((m == reference_m).float().mean()) > 0.999


SR_FORMATS = ["int8", "int4", "int4_linear", "int5", "int6", "int7_linear", "fp8_e4m3", "fp8_e5m2", "e2m1", "e2m3", "bf16", "fp16"]


def sr_trials(name: str, trials: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``trials`` SR steps of betas (0, 0) from fresh states, each with its own seeds: the new ``m`` is the gradient
    and ``v`` its square, exactly, so the stored moments are SR of known values. Returns (grad, decoded m per trial,
    grad², decoded v per trial)."""
    block = {} if name in ("bf16", "fp16") else {"block_size": 64}
    m_format, v_format = get_format(name, **block), get_format(name, signed=False, **block)
    numel = 64 * 40 + 21
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(numel, generator=generator) * 10.0 ** (-3 * torch.rand(numel, generator=generator))
    group = adam_group(betas=(0.0, 0.0), weight_decay=0.0)
    group["rounding"] = "stochastic"
    ms, vs = [], []
    for trial in range(trials):
        state = adam_state(m_format, v_format, numel, 0)
        rows = native_adam_steps([torch.zeros(numel)], [grad], [state], group, False, moment_seeds=[(2 * trial + 1, 2 * trial + 2)])
        assert rows[0][:2] == [1, 1]
        ms.append(state["exp_avg"].dequantize()), vs.append(state["exp_avg_sq"].dequantize())
    return grad, torch.stack(ms), grad * grad, torch.stack(vs)


def check_unbiased(name: str, target: torch.Tensor, draws: torch.Tensor) -> None:
    """Each value is stored as one of its two neighbours on the format's grid (at most two distinct values over the
    trials, around it where both were drawn), and the mean over trials is unbiased: the bias summed over the values
    drawn both ways, in units of each one's gap, within 5 standard deviations of 0 (a rounding that always went down
    would be thousands off)."""
    low, high = draws.min(dim=0).values, draws.max(dim=0).values
    assert bool(((draws == low) | (draws == high)).all()), name
    split = high > low
    assert bool(((low <= target) & (target <= high))[split].all()), name
    gap, trials = (high - low)[split].double(), draws.shape[0]
    p = ((target[split].double() - low[split].double()) / gap).clamp(0, 1)
    bias = ((draws[:, split].double().mean(dim=0) - target[split].double()) / gap).sum()
    sigma = (p * (1 - p) / trials).sum().sqrt()
    assert int(split.sum()) > 100, name  # most values sit between two codes
    assert abs(float(bias)) < 5 * float(sigma), (name, float(bias), float(sigma))


@pytest.mark.parametrize("name", SR_FORMATS)
def test_kernel_stochastic_rounding_is_unbiased(name):
    """Stochastic rounding of ``m`` (signed) and ``v`` (zero-free) in the kernel, 64 trials: unbiased (check_unbiased)."""
    grad, ms, square, vs = sr_trials(name, 64)
    check_unbiased(f"{name} m", grad, ms)
    check_unbiased(f"{name} v", square, vs)


def test_kernel_stochastic_rounding_depends_on_the_seed_only():
    """The draws are counter-based: the same seeds give the same codes with 1 and 2 threads, other seeds others."""
    results = []
    for threads, seeds in ((1, (5, 6)), (2, (5, 6)), (2, (7, 8))):
        state = adam_state(get_format("int4"), get_format("int4", signed=False), 70_000, 0)
        group = adam_group()
        group["rounding"] = "stochastic"
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            grad = torch.randn(70_000, generator=torch.Generator().manual_seed(1))
            native_adam_steps([torch.zeros(70_000)], [grad], [state], group, False, moment_seeds=[seeds])
        finally:
            torch.set_num_threads(saved)
        results.append(state["exp_avg"].codes.clone())
    assert torch.equal(results[0], results[1]) and not torch.equal(results[1], results[2])


def splitmix64_outputs(seed: int, outputs: np.ndarray) -> np.ndarray:
    """splitmix64's outputs number ``outputs`` (uint64) from state ``seed`` (``csrc/adam_cpu.h``: ``splitmix64``)."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + outputs * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def splitmix64_bits(seed: int, count: int) -> np.ndarray:
    """The kernel's draws ``random_bits(seed, i)``, ``i < count`` (codebooks and minifloats): splitmix64 output
    ``i // 2 + 1``, its upper 32 bits for an even ``i``, its lower 32 bits for an odd one."""
    index = np.arange(count, dtype=np.uint64)
    z = splitmix64_outputs(seed, index // np.uint64(2) + np.uint64(1))
    return np.where(index % np.uint64(2) == 0, z >> np.uint64(32), z & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def splitmix64_quarters(seed: int, count: int) -> np.ndarray:
    """The kernel's draws ``cast_bits(seed, i)``, ``i < count`` (bf16/fp16 casts and weight grids): bits
    ``16 * (i % 4)`` to ``16 * (i % 4) + 15`` of splitmix64 output ``i // 4 + 1``, in the upper half of a word."""
    index = np.arange(count, dtype=np.uint64)
    z = splitmix64_outputs(seed, index // np.uint64(4) + np.uint64(1))
    return (((z >> (np.uint64(16) * (index % np.uint64(4)))) & np.uint64(0xFFFF)) << np.uint64(16)).astype(np.uint32)


def splitmix64_uniforms(seed: int, count: int) -> torch.Tensor:
    """The kernel's U[0, 1) of element ``i < count`` (``uniform_of``): the upper 24 bits of its draw times 2^-24."""
    return torch.from_numpy((splitmix64_bits(seed, count) >> np.uint32(8)).astype(np.float32)) * 2.0**-24


def cast_rounding_inputs(numel: int) -> torch.Tensor:
    """``numel`` gradients over many binades, led by the casts' hard cases: zero, fp16's largest value and those past
    it (up to inf after rounding), its smallest normal and subnormals, fp32 subnormals, values on a grid, bf16's largest
    value and those past it (below and above the midpoint to inf)."""
    hard = [0.0, 65504.0, -65504.0, 65505.0, 65519.0, -65520.0, 7e4, 2.0**-14, 2.0**-14 * (1 - 2.0**-11)]
    hard += [2.0**-24, -(2.0**-25), 3 * 2.0**-26, 2.0**-24 * 1.5, 1e-40, -1e-40, 1.0, 1.0 + 2.0**-11, -2049.0, 2.0**60]
    bf16_max = torch.finfo(torch.bfloat16).max
    hard += [bf16_max, -bf16_max, 3.39e38, -3.3900e38, 3.3965e38, -3.4e38]
    generator = torch.Generator().manual_seed(3)
    scales = 10.0 ** (14 * torch.rand(numel - len(hard), generator=generator) - 9)
    return torch.cat([torch.tensor(hard), torch.randn(numel - len(hard), generator=generator) * scales])


def cast_stochastic_rounding(name: str, target: torch.Tensor, seed: int) -> torch.Tensor:
    """fp32 ``target`` rounded stochastically to ``name`` (``"bf16"``, ``"fp16"``) with the kernel's draws of ``seed``
    (``splitmix64_quarters``): bf16 adds element ``i``'s 16 bits to the fp32 pattern and truncates, 0x8000 (RN) past
    bf16's largest value (inf/NaN pass);
    fp16 adds 8191 less their upper 13 bits to the 13 bits of ``|x|``'s pattern below fp16's mantissa (of the fp32 sum
    ``|x| + 2^-14`` below 2^-14) and truncates there, the RN cast past 65504 and for inf/NaN (``fp16_stochastic``)."""
    bits = splitmix64_quarters(seed, target.numel())
    if name == "fp16":
        magnitude = np.abs(target.numpy())
        small = magnitude < np.float32(2.0**-14)
        lifted = np.where(small, magnitude + np.float32(2.0**-14), magnitude).view(np.uint32).astype(np.int64)
        pattern = ((lifted + (~bits >> np.uint32(19))) >> 13) - np.where(small, 113 << 10, 112 << 10)
        signed = (pattern | (np.signbit(target.numpy()).astype(np.int64) << 15)).astype(np.uint16).view(np.int16)
        return torch.where(target.abs() <= 65504.0, torch.from_numpy(signed).view(torch.float16), target.to(torch.float16))
    pattern = target.numpy().view(np.uint32)
    addend = np.where(np.abs(target.numpy()) <= torch.finfo(torch.bfloat16).max, bits >> np.uint32(16), np.uint32(0x8000))
    rounded = np.where(np.isfinite(target.numpy()), (pattern.astype(np.uint64) + addend) >> np.uint64(16), pattern >> 16)
    return torch.from_numpy(rounded.astype(np.uint16).view(np.int16)).view(torch.bfloat16)


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_kernel_cast_stochastic_rounding_uses_the_documented_draws(name):
    """bf16 / fp16 moments with betas (0, 0) are SR of the gradient (``m``) and of its square (``v``, zero-free) with
    the kernel's draws (16 bits each, four per splitmix64 output: ``cast_bits``), bit for bit, whether the vector
    (AVX-512, AVX2) or the scalar loop drew them (4,117 values: both run): bf16 adds its element's 16 bits to the fp32
    pattern and truncates (``bf16_stochastic``); fp16 adds 13 of them below its mantissa and truncates
    (``fp16_stochastic``). Values past the cast's range are stored as inf (the codes written in place), which the
    kernel reports as an overflow."""
    numel, seeds = 4096 + 21, (987654321, 123456789)
    grad = cast_rounding_inputs(numel)
    state = adam_state(get_format(name), get_format(name, signed=False), numel, 0)
    group = adam_group(betas=(0.0, 0.0), weight_decay=0.0)
    group["rounding"] = "stochastic"
    with pytest.raises(StateOverflowError):
        native_adam_steps([torch.zeros(numel)], [grad], [state], group, False, moment_seeds=[seeds])
    for key, target, seed, signed in (("exp_avg", grad, seeds[0], True), ("exp_avg_sq", grad * grad, seeds[1], False)):
        expected = get_format(name, signed=signed).lift_flushed(target, cast_stochastic_rounding(name, target, seed))
        stored = state[key].codes
        assert torch.equal(stored.view(torch.int16), expected.view(torch.int16)), (name, key)
    assert name == "bf16" or (torch.isinf(state["exp_avg"].codes[6]) and torch.isinf(state["exp_avg_sq"].codes[18]))  # past 65504


@pytest.mark.parametrize("v_name", ["int8", "int4"])
@pytest.mark.parametrize("name", ["int8", "int8_linear", "int6", "int4"])
def test_kernel_codebook_stochastic_rounding_uses_the_documented_draws(name, v_name):
    """SR codes of codebook moments are ``encode_codebook``'s with the kernel's draws (the U[0, 1) of element ``i``: the
    upper 24 bits of ``random_bits(seed, i)`` times 2^-24), bit for bit: with betas (0, 0) ``m`` is the gradient and
    ``v`` its square, divided by the stored scales. Blocks of 256 and 64 with a partial last block: 8-bit codebooks
    take the 64-value loop (VBMI: byte-permute lookups), then 16 values (AVX-512) or 8 (AVX2) and the scalar tail;
    ``v`` of another format puts ``m`` on the chunked pass, of the same on the register pass (8-bit pairs)."""
    numel, seeds = 256 * 9 + 64 + 37, (1234567, 7654321)
    generator = torch.Generator().manual_seed(5)
    grad = torch.randn(numel, generator=generator) * 10.0 ** (-2 * torch.rand(numel, generator=generator))
    m_format, v_format = get_format(name, block_size=256), get_format(v_name, signed=False, block_size=64)
    state = adam_state(m_format, v_format, numel, 0)
    group = adam_group(betas=(0.0, 0.0), weight_decay=0.0)
    group["rounding"] = "stochastic"
    rows = native_adam_steps([torch.zeros(numel)], [grad], [state], group, False, moment_seeds=[seeds])
    assert rows[0][:2] == [1, 1]
    for key, fmt, target, seed in (("exp_avg", m_format, grad, seeds[0]), ("exp_avg_sq", v_format, grad * grad, seeds[1])):
        q = state[key]
        uniform = splitmix64_uniforms(seed, numel)
        divisor = torch.where(q.scales > 0, q.scales, torch.ones_like(q.scales)).float().repeat_interleave(fmt.block_size)[:numel]
        expected = encode_codebook(target / divisor, fmt.index, "stochastic", uniform).clamp(min=fmt.min_code)
        assert torch.equal(unpack(q.codes, fmt.bits, numel).to(torch.int32), expected), key


@pytest.mark.parametrize(("name", "signed"), [("int8", True), ("int8", False), ("int8_linear", True), ("int6", True), ("int5", False)])
def test_kernel_codebook_stochastic_rounding_from_every_code(name, signed):
    """SR from every code of a codebook of more than 16 codes, its first and last included (with AVX2 each lane reads
    the 4 table values around its nearest code, held inside the table at its ends): each value, the floats either side
    of it and the midpoints, 4 times each (other draws), in blocks led by 1.0 (the scale), give ``encode_codebook``'s
    codes with the kernel's draws, as ``m`` (betas (0, 0): ``m`` is the gradient)."""
    fmt = get_format(name, signed=signed, block_size=256)
    values = fmt.codebook.float()
    points = torch.cat(
        [values, torch.nextafter(values, torch.tensor(2.0)), torch.nextafter(values, torch.tensor(-2.0)), (values[1:] + values[:-1]) / 2]
    )
    points = points.clamp(-1.0 if signed else 0.0, 1.0).repeat(4)
    blocks = torch.nn.functional.pad(points, (0, -points.numel() % 255)).view(-1, 255)
    grad = torch.cat([torch.ones(blocks.shape[0], 1), blocks], dim=1).flatten()
    numel, seed = grad.numel(), 97531
    state = adam_state(fmt, get_format("int8", signed=False), numel, 0)
    group = adam_group(betas=(0.0, 0.0), weight_decay=0.0)
    group["rounding"] = "stochastic"
    rows = native_adam_steps([torch.zeros(numel)], [grad], [state], group, False, moment_seeds=[(seed, 1)])
    assert rows[0][:2] == [1, 1] and bool((state["exp_avg"].scales == 1.0).all())
    uniform = splitmix64_uniforms(seed, numel)
    expected = encode_codebook(grad, fmt.index, "stochastic", uniform).clamp(min=fmt.min_code)
    codes = unpack(state["exp_avg"].codes, fmt.bits, numel).to(torch.int32)
    assert torch.equal(codes, expected)
    assert {fmt.min_code, fmt.codebook.numel() - 1} <= set(codes.tolist())  # the table's ends were reached


@pytest.mark.parametrize("states", ["int8", "int4", "int7", "fp8_e4m3", "bf16", {"exp_avg": "int8"}], ids=str)
def test_the_optimizer_steps_stochastic_rounding_on_the_native_path_and_resumes_exactly(states):
    """SR on the native path (seeds from the optimizer's seed and step count: ``_kernel_seeds(key, "moments", 2)``): a
    run resumed from a checkpoint after step 2 rounds steps 3-4 as the uninterrupted run does, also in an optimizer of
    another seed that stepped before it loaded the checkpoint, and the rounding is unbiased in effect (the states track
    the fp32 AdamW ones)."""

    def run(steps, resume_from=None, seed=3):
        weight = torch.nn.Parameter(torch.randn(70_000, generator=torch.Generator().manual_seed(0)))
        optimizer = lq.QAdamW(
            [weight], lr=1e-3, states=states, rounding="stochastic", min_quant_size=0, generator=torch.Generator().manual_seed(seed)
        )
        if seed != 3:  # its own seeds are made before it loads the checkpoint's
            weight.grad = torch.ones_like(weight)
            optimizer.step()
        if resume_from is not None:
            weight.data.copy_(resume_from[0])
            optimizer.load_state_dict(resume_from[1])
        for step in steps:
            weight.grad = torch.randn(70_000, generator=torch.Generator().manual_seed(step))
            optimizer.step()
        assert optimizer.step_paths() == {"param0": "native"}
        return weight, optimizer

    full_weight, full = run(range(4))
    half_weight, half = run(range(2))
    checkpoint = (half_weight.detach().clone(), half.state_dict())
    for seed in (3, 11):
        resumed_weight, resumed = run(range(2, 4), resume_from=copy.deepcopy(checkpoint), seed=seed)  # steps in place, as torch's
        assert torch.equal(full_weight, resumed_weight)
        for key in ("exp_avg", "exp_avg_sq"):
            ours, theirs = full.state[full_weight][key], resumed.state[resumed_weight][key]  # a plain fp32 v: its values
            assert same_bits(getattr(ours, "codes", ours), getattr(theirs, "codes", theirs)), key


@pytest.mark.parametrize("m_format", ["fp8_e4m3", "fp8_e5m2", "e3m2"])
def test_a_zero_that_changes_sign_counts_as_the_reference_path_counts_it(m_format):
    """A signed minifloat ``m`` going from +0 (code 0) to a value that rounds to -0 (its sign code) keeps its unit value
    (``formats.count_stalls``: -0 and +0 are one code's value): a stall on both paths. The C++ step compared the raw
    codes (255 of 256 moved entries stalled on the reference path, none natively)."""
    counts = []
    for native_path in (True, False):
        param = torch.nn.Parameter(torch.zeros(256))
        opt = lq.QAdamW([param], states={"exp_avg": m_format, "exp_avg_sq": "int8"}, min_quant_size=0, track_stalls=True)
        opt.cpu_compile = native_path
        param.grad = torch.full((256,), -1e-12)
        param.grad[0] = 1.0  # the block's absmax: the others round to -0 at its scale
        opt.step()
        assert opt.step_paths() == {"param0": "native" if native_path else "reference"}
        counts.append(opt.stall_counts()[param]["exp_avg"].tolist())
    assert counts[0] == counts[1] == [255, 256]
