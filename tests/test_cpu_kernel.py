"""The C++ CPU Adam kernel (``kernels/csrc/``, called by ``kernels/native.py``) against the torch references it must match.

Its encoder (``kernels.code_index.NearestCodeIndex``: one table lookup and integer compares) must give the codes of
``formats.rounding.encode_codebook`` for every fp32 input, and its step the codes and scales of
``kernels.adam_reference.adam_step_quantized``, on the AVX-512 body and on the scalar tail of every block. Its build is
said on stderr only when the extension is not cached yet.
"""

from __future__ import annotations

import copy
import re
import shutil
import types
import warnings

import pytest
import torch
from test_adam_reference import correctly_rounded_torch_sqrt, torch_rounds_once
from test_native_formats import cast_stochastic_rounding, reference_hyper
from torch.utils import cpp_extension

import lightning_qstate as lq
from lightning_qstate.formats import CodebookFormat, get_format
from lightning_qstate.formats.codebooks import nearest_thresholds
from lightning_qstate.formats.rounding import encode_codebook
from lightning_qstate.formats.weights import WeightGrid, get_weight_grid
from lightning_qstate.kernels import native
from lightning_qstate.kernels.adam_reference import ROOT_FLOOR, adam_hyper, adam_step_quantized, hold_moment
from lightning_qstate.kernels.bounds import MOMENT_BOUND_STATE, bound_square
from lightning_qstate.kernels.code_index import NearestCodeIndex, nearest_index, segment_table
from lightning_qstate.kernels.native import native_adam_steps, native_round_to_grid
from lightning_qstate.optim import ERROR_STATE, optimizers

needs_kernel = pytest.mark.skipif(not native.native_kernel_available(), reason="no C++ compiler here: the optimizer uses another path")

BYTE_FORMATS = {
    "int8": get_format("int8"),
    "int8 unsigned": get_format("int8", signed=False),
    "int8_linear": get_format("int8_linear"),
    "int8_linear unsigned": get_format("int8_linear", signed=False),
    # no zero code: the threshold between -1/255 and 1/255 is 0, which -0.0 and 0.0 both reach (256 codes: the kernel
    # takes byte codes; 5- to 7-bit codes are dense)
    "zero-free": CodebookFormat("zero-free", torch.linspace(-1, 1, 256, dtype=torch.float64), 64, signed=True),
}


def adam_group(betas=(0.9, 0.999), weight_decay=0.1, decoupled=True, maximize=False) -> dict:
    return {
        "lr": 1e-2, "betas": betas, "eps": 1e-8, "weight_decay": weight_decay, "decoupled_weight_decay": decoupled,
        "maximize": maximize, "amsgrad": False, "capturable": False, "differentiable": False, "fused": None, "rounding": "nearest",
    }  # fmt: skip


def adam_state(m_format, v_format, numel: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    m = m_format.quantize(torch.randn(numel, generator=generator) * 0.1)
    v = v_format.quantize(torch.rand(numel, generator=generator) * 0.01)
    return {"step": torch.tensor(3.0), "exp_avg": m, "exp_avg_sq": v}


def hard_inputs(fmt: CodebookFormat) -> torch.Tensor:
    """Every rounding threshold, its fp32 neighbours, every code value, zeros, ends, and random values in [-1, 1]."""
    thresholds = nearest_thresholds(fmt.codebook)
    generator = torch.Generator().manual_seed(0)
    values = torch.cat([
        thresholds,
        torch.nextafter(thresholds, torch.full_like(thresholds, -2.0)), torch.nextafter(thresholds, torch.full_like(thresholds, 2.0)),
        fmt.codebook.float(), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-45, -1e-45]),
        torch.rand(20_000, generator=generator) * 2 - 1, (torch.rand(2_000, generator=generator) * 2 - 1) * 1e-6,
    ])  # fmt: skip
    return values if fmt.signed else values.abs()


def blocks_led_by(values: torch.Tensor, lead: float) -> torch.Tensor:
    """Flat 64-value blocks, each ``lead`` then the next 63 of ``values`` (a last part of fewer than 63 dropped)."""
    rows = values[: values.numel() // 63 * 63].view(-1, 63)
    return torch.cat([torch.full((rows.shape[0], 1), lead), rows], dim=1).view(-1)


@pytest.mark.parametrize("name", list(BYTE_FORMATS))
def test_nearest_code_index_gives_the_reference_codes(name):
    """The codes of ``fmt.encode``: ``encode_codebook`` clamped up to ``min_code`` (zero-free unsigned formats)."""
    fmt = BYTE_FORMATS[name]
    index = nearest_index(fmt)
    assert index is not None
    x = hard_inputs(fmt)
    assert torch.equal(index.bucket_codes(x), fmt.encode(x, "nearest", None).to(torch.int64))  # the scalar and AVX2 encoders
    assert torch.equal(index.search_codes(x), fmt.encode(x, "nearest", None).to(torch.int64))  # the AVX-512 encoder's search
    assert (index.segments is not None) == (name in SEGMENTED)  # no zero code: no segments
    if index.segments is not None:  # the VBMI encoder's arithmetic
        assert torch.equal(index.segment_codes(x, fmt.min_code), fmt.encode(x, "nearest", None).to(torch.int64))
        assert torch.equal(index.segment_floors(x, fmt.codebook.numel() - 1), held_floors(fmt.codebook, x))
    if fmt.min_code:
        assert not torch.equal(index.bucket_entries, NearestCodeIndex.build(fmt.codebook).bucket_entries)
        assert bool((encode_codebook(x, fmt.index, "nearest") < fmt.min_code).any())  # the clamp is exercised


SEGMENTED = ["int8", "int8 unsigned", "int8_linear", "int8_linear unsigned"]


@pytest.mark.parametrize("name", ["int4", "int4_linear", "int5", "int6", "int7"])
@pytest.mark.parametrize("signed", [True, False])
def test_search_of_the_values_gives_the_floors_of_codebooks_up_to_128_codes(name, signed):
    """``NearestCodeIndex.search_codes(x, floors=True)``, held to ``last - 1``: stochastic rounding's floor (the
    AVX-512 kernel's for codebooks of at most 128 values), at and beside every threshold and value."""
    fmt = get_format(name, signed=signed)
    index = nearest_index(fmt)
    x = torch.cat([hard_inputs(fmt), torch.nextafter(fmt.codebook.float(), torch.tensor(-2.0))])
    floors = index.search_codes(x, floors=True).clamp(max=fmt.codebook.numel() - 2)
    assert index.depth <= 7 and torch.equal(floors, held_floors(fmt.codebook, x))


# Codebooks the AVX2 kernel rounds stochastically through floor windows (codes of more than 4 bits; int4's too: the
# table is built for every codebook)
FLOOR_WINDOW_FORMATS = {
    **BYTE_FORMATS,
    **{
        f"{name}{'' if signed else ' unsigned'}": get_format(name, signed=signed)
        for name in ("int4", "int5", "int6", "int7")
        for signed in (True, False)
    },
    "two codes": CodebookFormat("two codes", torch.tensor([-1.0, 1.0], dtype=torch.float64), 64, signed=True),  # no floor above the first
}


@pytest.mark.parametrize("name", list(FLOOR_WINDOW_FORMATS))
def test_floor_windows_give_the_floors_and_their_values(name):
    """``NearestCodeIndex.floor_window_reads``, as the AVX2 stochastic encoder reads them
    (``bucket_stochastic8``: one 16-byte window per value): the floor held to ``[0, last - 1]`` and the values of it and
    of the next code, at and beside every threshold and value (zero-free formats too: their key base is taken below
    their smallest value, which lies below their smallest threshold)."""
    fmt = FLOOR_WINDOW_FORMATS[name]
    index = nearest_index(fmt)
    values = fmt.codebook.float()
    x = torch.cat([hard_inputs(fmt), torch.nextafter(values, torch.tensor(-2.0)), torch.nextafter(values, torch.tensor(2.0))])
    x = x if fmt.signed else x.abs()
    floors = held_floors(fmt.codebook, x)
    codes, low, high = index.floor_window_reads(x)
    assert index.floor_windows.shape == (2 * index.half, 4)
    assert torch.equal(codes, floors)
    assert torch.equal(low, values[floors]) and torch.equal(high, values[floors + 1])


def held_floors(codebook: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The code of the largest ``codebook`` value ``<= x``, held to ``[0, last - 1]``: stochastic rounding's lower
    neighbour (``encode_codebook``'s ``low``)."""
    values = codebook.float()
    return (torch.searchsorted(values, x, right=True) - 1).clamp(0, values.numel() - 2)


@pytest.mark.parametrize("name", SEGMENTED)
def test_segment_codes_are_the_reference_codes_across_1_in_1009_floats(name):
    """``NearestCodeIndex.segment_codes`` and ``segment_floors`` on every 1009th fp32 pattern of [0, 1] (and its
    negative for a signed map): the reference codes and floors (the whole range, every 7th pattern, was checked once:
    none differs)."""
    fmt = BYTE_FORMATS[name]
    x = torch.arange(0, 0x3F800001, 1009, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = torch.cat([x, -x]) if fmt.signed else x
    index = nearest_index(fmt)
    assert torch.equal(index.segment_codes(x, fmt.min_code), fmt.encode(x, "nearest", None).to(torch.int64))
    assert torch.equal(index.segment_floors(x, fmt.codebook.numel() - 1), held_floors(fmt.codebook, x))


def test_segment_table_refuses_codebooks_it_cannot_encode_exactly():
    """No segments without a zero code, for magnitudes that do not mirror, beyond 1, in a run whose values are
    thousands of spacings from zero (the biased floor's margin would not cover the rounding of the position), or with a
    negative threshold's magnitude above the positive one's (its values' candidate could pass the code)."""
    linear = torch.linspace(0, 1, 256, dtype=torch.float64)
    assert segment_table(linear, nearest_thresholds(linear)) is not None
    for codebook in (
        torch.linspace(-1, 1, 256, dtype=torch.float64),  # no zero
        torch.cat([-linear[1:3].flip(0) * 0.9, linear[:254]]),  # negatives not a mirror
        linear * 2,  # beyond 1
        torch.cat([torch.zeros(1, dtype=torch.float64), 0.9 + 1e-4 * torch.arange(255, dtype=torch.float64)]),  # far run
    ):
        assert segment_table(codebook, nearest_thresholds(codebook)) is None
    mirrored = torch.cat([-linear[1:128].flip(0), linear[:128]])
    thresholds = nearest_thresholds(mirrored)
    assert segment_table(mirrored, thresholds) is not None
    thresholds[100] = torch.nextafter(thresholds[100], torch.tensor(-2.0))  # a negative threshold beyond the positive one
    assert segment_table(mirrored, thresholds) is None


@needs_kernel
@pytest.mark.parametrize("name", ["int8", "int8_linear"])
def test_kernel_never_stores_v_as_zero(name):
    """Zero-free ``v``: with betas (0, 0) the new ``v`` is ``grad * grad`` exactly, so the kernel's ``v`` codes and scales
    must be the reference's of it, which clamps codes up to ``min_code``: gradients spanning 1e-30..1 in every block,
    zeros and squares that underflow to 0 included, never leave a ``v`` code that reads 0 in a block with a nonzero scale."""
    generator = torch.Generator().manual_seed(0)
    numel = (1 << 12) + 77
    grad = 10.0 ** (-30 * torch.rand(numel, generator=generator)) * (torch.rand(numel, generator=generator) < 0.8)
    m_format, v_format = get_format(name), get_format(name, signed=False)
    assert v_format.min_code == 1
    state = adam_state(m_format, v_format, numel, seed=0)
    native_adam_steps([torch.zeros(numel)], [grad], [state], adam_group(betas=(0.0, 0.0), weight_decay=0.0), track_stalls=False)
    codes, scales = v_format.quantize_reference(grad * grad, "nearest", None)
    assert torch.equal(state["exp_avg_sq"].codes, codes) and torch.equal(state["exp_avg_sq"].scales, scales)
    assert int(codes.min()) == 1 and bool((grad * grad == 0).any())


@needs_kernel
@pytest.mark.parametrize("v_block", [64, 256], ids=["register pass", "chunked pass"])
@pytest.mark.parametrize("scale_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("absmax", [1.0, 0.3, 1.7e-3, 12345.678])
@pytest.mark.parametrize("name", list(BYTE_FORMATS))
def test_kernel_encodes_like_the_reference(name, absmax, scale_dtype, v_block):
    """With beta1 = 0 and no weight decay the new ``m`` is the gradient, so the kernel's codes of ``m`` are its encoder's
    codes of chosen values: each 64-value block holds ``absmax`` (its scale; for bf16 scales, ``absmax`` is first
    rounded to a bf16 value) and the inputs times it, which normalize to the inputs or their fp32 neighbours: codes
    equal only if the kernel's division is correctly rounded. Beside a ``v`` of 64-value blocks the register pass
    encodes ``m``, beside one of 256 the chunked pass."""
    fmt = BYTE_FORMATS[name]
    if scale_dtype == "bf16":
        absmax = float(torch.tensor(absmax).to(torch.bfloat16))
    grad = blocks_led_by(hard_inputs(fmt) * absmax, absmax)
    m_format = CodebookFormat(fmt.name, fmt.codebook, 64, fmt.signed, scale_dtype=scale_dtype)
    v_format = get_format("int8", signed=False, block_size=v_block)
    state = adam_state(m_format, v_format, grad.numel(), seed=0)
    param = torch.zeros(grad.numel())
    native_adam_steps([param], [grad], [state], adam_group(betas=(0.0, 0.999), weight_decay=0.0), track_stalls=False)
    codes, scales = m_format.quantize_reference(grad, "nearest", None)
    assert torch.equal(state["exp_avg"].codes, codes)
    assert torch.equal(state["exp_avg"].scales, scales)


@needs_kernel
@pytest.mark.parametrize("m_block", [64, 256], ids=["register pass", "chunked pass"])
@pytest.mark.parametrize("absmax", [1.0, 1.7e-3, 12345.678, 1e-40, 3e38], ids=["1", "1.7e-3", "12345.678", "subnormal", "2^127"])
@pytest.mark.parametrize("name", ["int8 unsigned", "int8_linear unsigned"])
def test_kernel_encodes_v_like_the_reference(name, absmax, m_block):
    """With betas (0, 0) and no weight decay the new ``v`` is ``grad * grad``: squares on or about an ulp from every
    rounding threshold of an unsigned map times each block's largest square give the reference's codes (the encoder of
    non-negative values), beside an ``m`` of the same 64-value blocks (register pass) or of 256 (chunked pass). Also
    for block scales whose reciprocal is not a normal float (a subnormal ``v``, from gradients of about 1e-20, and one
    beyond 2^126): the kernel divides as the reference does."""
    fmt = BYTE_FORMATS[name]
    grad = blocks_led_by(hard_inputs(fmt) * absmax, absmax).sqrt()
    v_format = CodebookFormat(fmt.name, fmt.codebook, 64, signed=False, scale_dtype="fp32")
    state = adam_state(get_format("int8", block_size=m_block), v_format, grad.numel(), seed=0)
    native_adam_steps([torch.zeros(grad.numel())], [grad], [state], adam_group(betas=(0.0, 0.0), weight_decay=0.0), track_stalls=False)
    codes, scales = v_format.quantize_reference(grad * grad, "nearest", None)
    assert torch.equal(state["exp_avg_sq"].codes, codes) and torch.equal(state["exp_avg_sq"].scales, scales)


@needs_kernel
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"decoupled": False},
        {"betas": (0.3, 0.99)},  # torch's lerp takes its other branch for weights >= 0.5
        {"maximize": True, "weight_decay": 0.0},
    ],
)
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_kernel_step_matches_the_reference_step(options, threads):
    """Several parameters in one call (formats, block sizes and scale dtypes differ, partial last blocks, one shorter than
    a vector): params, codes and scales equal the reference's bit for bit. Sizes reach the 64-code (VBMI), 16-code and
    scalar loops; the thread counts split the blocks at different places inside and between parameters."""
    layouts = [
        (get_format("int8"), get_format("int8", signed=False), (1 << 12) + 77),
        (get_format("int8"), get_format("int8", signed=False), 50 * 16 * 256 + 5),
        (get_format("int8_linear", block_size=64), get_format("int8", signed=False, block_size=64), 1000),
        (get_format("int8"), get_format("int8_linear", signed=False), 13),
        (get_format("int8", scale_dtype="fp32"), get_format("int8", signed=False, scale_dtype="fp32"), 3000),  # version-1 checkpoints
        (get_format("int8_linear", scale_dtype="fp32"), get_format("int8", signed=False), 700),
    ]
    group = adam_group(**options)
    params, grads, states, expected = [], [], [], []
    for seed, (m_format, v_format, numel) in enumerate(layouts):
        generator = torch.Generator().manual_seed(seed)
        param, grad = torch.randn(numel, generator=generator), torch.randn(numel, generator=generator) * 0.1
        state, reference = adam_state(m_format, v_format, numel, seed), adam_state(m_format, v_format, numel, seed)
        m, v = reference["exp_avg"], reference["exp_avg_sq"]
        reference_param = param.clone()
        hyper = reference_hyper(group, reference)
        adam_step_quantized(
            reference_param, grad, m.codes, m.scales, v.codes, v.scales, hyper, m_format, v_format, "nearest",
            group["decoupled_weight_decay"], group["maximize"], False,
        )  # fmt: skip
        params.append(param), grads.append(grad), states.append(state), expected.append((reference_param, m, v))
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = native_adam_steps(params, grads, states, group, track_stalls=False)
    finally:
        torch.set_num_threads(saved_threads)
    assert all(row[:2] == [1, 1] for row in rows)
    for param, state, (reference_param, m, v) in zip(params, states, expected, strict=False):
        assert float(state["step"]) == 4.0
        for name, reference in (("exp_avg", m), ("exp_avg_sq", v)):
            assert torch.equal(state[name].codes, reference.codes), name
            assert torch.equal(state[name].scales, reference.scales), name
        assert torch.equal(param, reference_param)


def step_like_the_reference(m_format, v_format, param: torch.Tensor, grads: list[torch.Tensor]) -> tuple[dict, list[int]]:
    """Steps 4, 5, ... of ``param`` (in place) with ``grads`` by the kernel and by ``adam_step_quantized`` from the same
    states: after each, params, codes and scales equal bit for bit (NaNs too), and the kernel reports an overflow
    (``StateOverflowError``) exactly where the reference stored a non-finite scale or cast value. Returns the kernel's
    state and the steps that overflowed."""
    state, reference = adam_state(m_format, v_format, param.numel(), 0), adam_state(m_format, v_format, param.numel(), 0)
    reference_param, group, overflows = param.clone(), adam_group(), []
    for step, grad in enumerate(grads, start=4):
        try:
            native_adam_steps([param], [grad], [state], group, track_stalls=False)
        except native.StateOverflowError:
            overflows.append(step)
        m, v = reference["exp_avg"], reference["exp_avg_sq"]
        adam_step_quantized(
            reference_param, grad, m.codes, m.scales, v.codes, v.scales, reference_hyper(group, reference), m_format, v_format,
            "nearest", True, False, False,
        )  # fmt: skip
        stored = [q.scales if q.scales is not None else q.codes for q in (m, v)]
        assert (step in overflows) == (not all(torch.isfinite(values).all() for values in stored)), step
        for key in ("exp_avg", "exp_avg_sq"):
            ours, theirs = state[key], reference[key]
            assert torch.equal(ours.codes.view(torch.uint8), theirs.codes.view(torch.uint8)), (key, step)
            if ours.scales is not None:
                assert torch.equal(ours.scales.view(torch.uint8), theirs.scales.view(torch.uint8)), (key, step)
        assert torch.equal(param.view(torch.int32), reference_param.view(torch.int32)), step
    return state, overflows


@needs_kernel
@pytest.mark.parametrize(("name", "large"), [("fp16", 1e4), ("bf16", 1e21)])
def test_kernel_steps_past_a_cast_v_that_overflows_like_the_reference(name, large):
    """Where the new ``v`` overflows a cast state (every 7th gradient ``large``: fp16 beyond 65504, bf16 beyond 3.4e38) it is
    stored as inf and the update there is ``m / inf = 0``: over two steps the kernel's params and stored moments equal
    the reference's bit for bit and stay finite (a reciprocal with a Newton step had made them NaN), and the kernel
    reports both steps as overflows (the optimizer raises ``StepOverflowError`` and zeroes those states)."""
    fmt = get_format(name)
    generator = torch.Generator().manual_seed(0)
    param = torch.randn(100, generator=generator)
    grads = [torch.randn(100, generator=generator) for _ in range(2)]
    for grad in grads:
        grad[::7] = large
    state, overflows = step_like_the_reference(fmt, fmt, param, grads)
    assert state["exp_avg_sq"].dequantize()[::7].isinf().all() and param.isfinite().all()
    assert overflows == [4, 5]


@needs_kernel
@pytest.mark.parametrize("scale", [1e-30, 1e-20, 1e-12, 1e15])
@pytest.mark.parametrize("name", ["int8", "int4", "int6", "int8_linear", "fp8_e4m3", "fp8_e5m2", "bf16", "fp16"])
def test_kernel_matches_the_reference_at_extreme_magnitudes(name, scale):
    """Gradients of ``scale`` spread over about e^±7: block scales far from 1 (subnormal ones for ``v`` below about
    1e-19), moments that underflow or overflow a cast (fp16's ``m`` and ``v`` at 1e15: the update inf / inf, a NaN
    param). Over three steps the kernel's params and stored moments equal the reference's bit for bit, NaNs too."""
    generator = torch.Generator().manual_seed(1)
    param = torch.randn(1000, generator=generator)
    grads = [torch.randn(1000, generator=generator) * scale * torch.exp(torch.randn(1000, generator=generator) * 2) for _ in range(3)]
    step_like_the_reference(get_format(name), get_format(name, signed=False), param, grads)


@needs_kernel
def test_kernel_holds_m_at_its_bound_like_the_reference():
    """The updated ``m`` held to ``|m| <= max(sqrt(v), 2^-63) * bound`` of the updated ``v`` (adam_reference.adam_math),
    put within a few ulps of the limit on both sides and far inside, beside ``v`` of every magnitude (0, subnormal, up
    to fp32's largest): codes, scales and params equal the reference's. A zero gradient makes the updated moments ``0.9 m`` and
    ``0.999 v``; fp32 scales, all-ones ``v`` codes and ``m`` codes of +-1.0 (or a random code) make the decoded moments
    the scales themselves."""
    m_format = get_format("int8", scale_dtype="fp32", block_size=64)
    v_format = get_format("int8", signed=False, scale_dtype="fp32", block_size=64)
    group = adam_group(weight_decay=0.0)
    hyper = adam_hyper(group, 4.0)  # the step after the 3 updates of adam_state's step counter
    v_scales = torch.tensor([0.0, 1e-44, 1e-38, 1e-30, 2.5e-9, 1.0, 3e4, 1e30, 3e38])
    updated_v = v_scales * hyper["beta2"]
    roots = torch.sqrt(updated_v.double()).float()  # correctly rounded, as the kernel's
    limits = roots.clamp(min=ROOT_FLOOR) * hyper["moment_bound"]  # v = 0 and subnormal: the floor
    ulps = torch.tensor([-(2**22), -(2**20), -64, -3, -1, 0, 1, 3, 64, 2**20], dtype=torch.int32)  # updated m: limit moved ~so many ulps
    targets = (limits.view(-1, 1).view(torch.int32) + ulps).clamp(min=0).view(torch.float32).view(-1)  # limit 0: 0 and subnormals
    m_scales = targets / (1 - hyper["lerp_weight"])
    blocks = m_scales.numel()
    v_scales = v_scales.repeat_interleave(ulps.numel())
    generator = torch.Generator().manual_seed(0)
    last = m_format.codebook.numel() - 1
    one = int((m_format.codebook == 1.0).nonzero())
    minus = int(m_format.codebook.argmin())  # its value is -0.99...: updates inside the limit or just past it
    choice = torch.randint(0, 4, (blocks * 64,), generator=generator)
    m_codes = torch.where(choice < 2, one, torch.where(choice == 2, minus, torch.randint(0, last + 1, (blocks * 64,), generator=generator)))
    states, param, grad = [], torch.randn(blocks * 64, generator=generator), torch.zeros(blocks * 64)
    for _ in range(2):
        state = adam_state(m_format, v_format, blocks * 64, seed=0)
        state[MOMENT_BOUND_STATE] = torch.tensor(bound_square(0.9, 0.999, 3.0), dtype=torch.float64)  # hyper's closed form
        state["exp_avg"].codes.copy_(m_codes.to(state["exp_avg"].codes.dtype))
        state["exp_avg"].scales.copy_(m_scales)
        state["exp_avg_sq"].codes.fill_(v_format.codebook.numel() - 1)
        state["exp_avg_sq"].scales.copy_(v_scales)
        states.append(state)
    reference_param, native_param = param.clone(), param.clone()
    m, v = states[0]["exp_avg"], states[0]["exp_avg_sq"]
    decoded = m.dequantize()
    updated = (decoded - hyper["lerp_weight"] * decoded).view(blocks, 64)  # the lerp to 0, up to an ulp of its rounding
    limit = limits.repeat_interleave(ulps.numel()).view(-1, 1)
    ratio = (updated.abs() / limit)[limit.view(-1) > 0]
    assert bool(((ratio > 1) & (ratio < 1 + 2**-20)).any()) and bool(((ratio <= 1) & (ratio > 1 - 2**-20)).any())  # both sides, ulps off
    assert bool((ratio > 1.01).any()) and bool((ratio < 0.5).any())  # far outside, far inside
    adam_step_quantized(
        reference_param, grad, m.codes, m.scales, v.codes, v.scales, hyper, m_format, v_format, "nearest", True, False, False,
    )  # fmt: skip
    rows = native_adam_steps([native_param], [grad], [states[1]], group, track_stalls=False)
    assert rows[0][:2] == [1, 1]
    for name, reference in (("exp_avg", m), ("exp_avg_sq", v)):
        assert torch.equal(states[1][name].codes, reference.codes), name
        assert torch.equal(states[1][name].scales, reference.scales), name
    torch.testing.assert_close(native_param, reference_param, rtol=3e-7, atol=2e-9)
    held = m.dequantize().view(blocks, 64).abs().amax(dim=1)  # each block's absmax: its limit where the hold acted
    assert bool((held <= limits.repeat_interleave(ulps.numel()) * (1 + 2**-7)).all())


@needs_kernel
def test_a_nonfinite_gradient_skips_only_its_parameter():
    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(5000)) for _ in range(2)]
    optimizer = lq.QAdamW(weights, states="int8", min_quant_size=0)
    for weight in weights:
        weight.grad = torch.randn_like(weight)
    optimizer.step()
    assert set(optimizer.step_paths().values()) == {"native"}
    before = [
        (w.detach().clone(), optimizer.state[w]["exp_avg"].codes.clone(), optimizer.state[w]["exp_avg_sq"].scales.clone()) for w in weights
    ]
    weights[0].grad[-3] = float("nan")  # in the partial last block
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        optimizer.step()
    assert optimizer.nonfinite_skips == 1
    skipped, stepped = optimizer.state[weights[0]], optimizer.state[weights[1]]
    assert torch.equal(weights[0].detach(), before[0][0]) and float(skipped["step"]) == 1.0
    assert torch.equal(skipped["exp_avg"].codes, before[0][1]) and torch.equal(skipped["exp_avg_sq"].scales, before[0][2])
    assert not torch.equal(weights[1].detach(), before[1][0]) and float(stepped["step"]) == 2.0
    assert torch.isfinite(stepped["exp_avg_sq"].scales).all()

    strict = lq.QAdamW([weights[0]], states="int8", min_quant_size=0, nonfinite="raise")
    with warnings.catch_warnings(), pytest.raises(FloatingPointError, match="nonfinite='raise'"):
        warnings.simplefilter("error")
        strict.step()


@needs_kernel
@pytest.mark.parametrize("weights", ["bf16", "fp16", "fp32"])
def test_a_nonfinite_gradient_of_a_grid_parameter_with_fp32_moments_is_skipped(weights):
    """A parameter on a weight grid whose moments are fp32 (under min_quant_size: biases, norms) joins the C++ call;
    a non-finite gradient there raised KeyError('moment_bound_sq') after the other parameters had stepped (no bound is
    advanced for fp32 moments, so none is to be restored): it is skipped and counted, and the rest step once."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[weights]
    torch.manual_seed(0)
    small, large, other = (torch.nn.Parameter(torch.randn(n).to(dtype)) for n in (8, 5000, 5000))
    optimizer = lq.QAdamW([small, large], states="int8", weights=weights)
    optimizer.add_param_group({"params": [other]})
    for param in (small, large, other):
        param.grad = torch.randn_like(param)
    small.grad[3] = float("nan")
    before = [param.detach().clone() for param in (small, large, other)]
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        optimizer.step()
    assert optimizer.step_paths()["param0"] == "native" and optimizer.nonfinite_skips == 1
    assert torch.equal(small.detach(), before[0]) and float(optimizer.state[small]["step"]) == 0.0
    assert MOMENT_BOUND_STATE not in optimizer.state[small]
    for param, previous in zip((large, other), before[1:], strict=True):
        assert not torch.equal(param.detach(), previous) and float(optimizer.state[param]["step"]) == 1.0


@needs_kernel
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_a_nonfinite_value_anywhere_in_a_gradient_is_found(value):
    """The vector check reads eight far-apart parts of a gradient side by side, then the rest one by one: a non-finite
    value at either end of every part, and in the rest, skips the parameter (9000 values: parts of 1120, rest 40)."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(9000))
    optimizer = lq.QAdamW([param], states="int8", min_quant_size=0)
    part = 9000 // 8 // 8 * 8
    positions = [index for k in range(8) for index in (k * part, k * part + part - 1)] + [8 * part, 8999]
    for position in positions:
        param.grad = torch.randn_like(param)
        param.grad[position] = value
        with pytest.warns(RuntimeWarning, match="non-finite gradient"):
            optimizer.step()
    assert optimizer.nonfinite_skips == len(positions) and set(optimizer.step_paths().values()) == {"native"}


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_nonfinite_gradients_skip_their_parameters_in_a_batch_and_across_threads(threads):
    """The kernel checks the gradients of parameters a thread steps whole a batch at a time, and those cut between
    the threads' parts first: a NaN in a batched parameter and one in the second thread's part of the parameter cut
    between parts (int8 chunks of 1024 values: 15 + 40 + 15 chunks, cut at the 35th) skip exactly those two; every
    other parameter steps bit for bit as without them."""
    sizes = [5000, 5000, 5000, 40_000, 5000, 5000, 5000]
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(n, generator=generator) for n in sizes]
    grads = [[torch.randn(n, generator=generator) for n in sizes] for _ in range(2)]
    bad = {1: 2, 3: 30_000}  # parameter: element with a NaN gradient at the second step

    def run(indices: list[int]) -> tuple[list[torch.nn.Parameter], lq.QAdamW]:
        params = [torch.nn.Parameter(values[k].clone()) for k in indices]
        optimizer = lq.QAdamW(params, states="int8", min_quant_size=0)
        for step in range(2):
            for param, k in zip(params, indices, strict=True):
                param.grad = grads[step][k].clone()
                if step == 1 and k in bad:
                    param.grad[bad[k]] = float("nan")
            optimizer.step()
        return params, optimizer

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with pytest.warns(RuntimeWarning, match="non-finite gradient"):
            params, optimizer = run(list(range(len(sizes))))
        finite = [k for k in range(len(sizes)) if k not in bad]
        alone, alone_optimizer = run(finite)
    finally:
        torch.set_num_threads(saved)
    assert set(optimizer.step_paths().values()) == {"native"}
    assert optimizer.nonfinite_skips == 2
    for k in bad:
        assert float(optimizer.state[params[k]]["step"]) == 1.0
    for param, reference in zip([params[k] for k in finite], alone, strict=True):
        assert torch.equal(param.detach(), reference.detach())
        for name in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[param][name].codes, alone_optimizer.state[reference][name].codes)


def test_the_build_is_said_on_stderr_only_when_not_cached(monkeypatch, tmp_path, capsys):
    """``build_extension`` prints its one line before a build, not when the extension's library is already in torch's
    extension directory (``load`` faked: no compiler runs)."""
    calls = []
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace(adam_steps_u8=None))
    name = native.extension_name()
    native.build_extension()
    said = capsys.readouterr().err
    assert "building the C++ CPU Adam kernel once for this install" in said and str(tmp_path) in said
    (tmp_path / (name + cpp_extension.LIB_EXT)).touch()
    native.build_extension()
    assert capsys.readouterr().err == ""
    assert [call["name"] for call in calls] == [name, name] and calls[0]["build_directory"] == str(tmp_path)
    assert calls[0]["extra_include_paths"] == [str(native.CSRC)] and calls[0]["extra_cflags"] == native.build_flags()
    assert calls[0]["sources"] == [str(native.CSRC / "adam_cpu.cpp"), str(native.CSRC / "bindings.cpp")]  # compiled in parallel


def test_no_x86_vector_type_outside_the_simd_sections():
    """Outside the ``#if``/``#ifdef`` sections on AVX-512 or AVX2 (``QSTATE_AVX512``, ``QSTATE_VBMI``, ``QSTATE_AVX2``),
    the kernel names no x86 vector type or intrinsic: elsewhere (Arm) ``immintrin.h`` is not there. An x86 build
    without AVX2 (``make kernel-check``'s ``x86-64``) sees such a name only where torch's headers happen to include it;
    the fallback lambdas once took ``__m512`` parameters that way."""
    simd = re.compile(r"QSTATE_AVX|QSTATE_VBMI|__AVX")
    x86 = re.compile(r"__m(128|256|512)|_mm(256|512)?_|_pdep_|_pext_")
    found = []
    for path in (native.CSRC / "adam_cpu.h", native.CSRC / "adam_cpu.cpp"):
        guarded: list[bool] = []  # per open #if: whether its current branch is a SIMD one
        for number, line in enumerate(path.read_text().splitlines(), 1):
            text = line.strip()
            if text.startswith("#if"):
                guarded.append(bool(simd.search(text)))
            elif text.startswith("#elif"):
                guarded[-1] = bool(simd.search(text))
            elif text.startswith("#else"):
                guarded[-1] = False
            elif text.startswith("#endif"):
                guarded.pop()
            elif not any(guarded) and not text.startswith("//") and x86.search(text.split("//")[0]):
                found.append(f"{path.name}:{number}: {text}")
    assert not found, "\n".join(found)


def test_only_the_bindings_include_torchs_python_headers():
    """The kernel's files include ATen's tensor headers, not ``torch/extension.h`` or pybind11 (whose parsing alone took
    30 s of the build): those are ``bindings.cpp``'s, which compiles beside the kernel."""
    includes = {path.name: re.findall(r"#include [<\"](.+?)[>\"]", path.read_text()) for path in native.SOURCES}
    python_headers = {name for name, found in includes.items() if any(h.startswith(("torch/", "pybind11", "Python")) for h in found)}
    assert python_headers == {"bindings.cpp"}
    assert "steps.h" in includes["bindings.cpp"] and "steps.h" in includes["adam_cpu.cpp"]


def test_the_extension_name_hashes_sources_and_flags(monkeypatch):
    name = native.extension_name()
    assert re.fullmatch(r"lightning_qstate_cpu_adam_[0-9a-f]{12}", name)
    assert {path.name for path in native.SOURCES} == {path.name for path in native.CSRC.iterdir()}  # every file in csrc/
    monkeypatch.setattr(native, "CFLAGS", [*native.CFLAGS, "-DQSTATE_TEST"])
    assert native.extension_name() != name


def test_another_directorys_sources_build_under_their_own_name(tmp_path):
    """``extension_name(csrc)`` of a copy of the sources (another revision's: benchmarks/kernel_ab.py) differs from the
    package's, so that its build never replaces the package's; an edit to the copy changes it again."""
    for path in native.SOURCES:
        shutil.copy(path, tmp_path / path.name)
    copied = native.extension_name(tmp_path)
    assert re.fullmatch(r"lightning_qstate_cpu_adam_[0-9a-f]{12}", copied) and copied != native.extension_name()
    assert native.extension_name(native.CSRC) == native.extension_name()
    (tmp_path / "steps.h").write_text((tmp_path / "steps.h").read_text() + "\n// edited\n")
    assert native.extension_name(tmp_path) != copied


def test_two_installs_of_the_same_sources_build_apart(tmp_path, monkeypatch):
    """Another install's or checkout's package (its own ``CSRC``, equal sources) had this one's name, so the two shared
    a build directory whose ninja file names one's paths: each rebuilt it (~75 s) after the other had loaded it."""
    for path in native.SOURCES:
        shutil.copy(path, tmp_path / path.name)
    own = native.extension_name()
    monkeypatch.setattr(native, "CSRC", tmp_path)
    assert native.extension_name(tmp_path) != own


def test_two_paths_to_one_install_build_alike(monkeypatch, tmp_path):
    """A symlinked checkout or venv: one name (the resolved path's) must come with one build file, so the sources and
    include path handed to the build are the resolved ones too (``load`` faked: no compiler runs)."""
    calls = []
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace())
    (tmp_path / "csrc_link").symlink_to(native.CSRC)
    native.build_extension(native.CSRC)
    native.build_extension(tmp_path / "csrc_link")
    assert calls[0] == calls[1]


def test_an_emulated_build_has_its_own_flags_and_name(monkeypatch, tmp_path):
    """LIGHTNING_QSTATE_KERNEL_EMULATE (``make kernel-emulate``): each emulation's flags replace ``-march=native``
    (the AVX-512 ones with SIMDe's include directory) under their own extension name; an unknown emulation, or an
    AVX-512 one without SIMDe's headers, raises naming what to set."""
    monkeypatch.delenv("LIGHTNING_QSTATE_KERNEL_EMULATE", raising=False)
    assert native.build_flags() == native.CFLAGS
    names = {native.extension_name()}
    (tmp_path / "simde" / "x86").mkdir(parents=True)
    (tmp_path / "simde" / "x86" / "avx512.h").touch()
    monkeypatch.setenv("LIGHTNING_QSTATE_SIMDE", str(tmp_path))
    for emulation, defines in native.EMULATIONS.items():
        monkeypatch.setenv("LIGHTNING_QSTATE_KERNEL_EMULATE", emulation)
        flags = native.build_flags()
        assert [flag for flag in flags if flag.startswith("-march=")] == [defines[0]] and set(defines) <= set(flags)
        assert (f"-I{tmp_path}" in flags) == (emulation != "portable")
        names.add(native.extension_name())
    assert len(names) == 1 + len(native.EMULATIONS)
    monkeypatch.setenv("LIGHTNING_QSTATE_KERNEL_EMULATE", "avx1024")
    with pytest.raises(ValueError, match="valid values are avx512, avx512-vbmi, avx512-vbmi-dq, portable"):
        native.build_flags()
    monkeypatch.setenv("LIGHTNING_QSTATE_KERNEL_EMULATE", "avx512")
    monkeypatch.setenv("LIGHTNING_QSTATE_SIMDE", str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="needs SIMDe's headers: set LIGHTNING_QSTATE_SIMDE"):
        native.build_flags()


def test_a_failed_build_warns_and_leaves_no_kernel(monkeypatch, tmp_path):
    def fail(**kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fail)
    with pytest.warns(RuntimeWarning, match="building the C\\+\\+ CPU Adam kernel failed"):
        assert native._kernel.__wrapped__() is None


# ---- Parameters on a weight grid (no fp32 master weights: optim/weights.py), with ECO's feedback ----

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def grid_group(eco: bool, weight_rounding: str = "nearest", **options) -> dict:
    return {**adam_group(**options), "weight_rounding": weight_rounding, "error_feedback": "eco" if eco else None}


def reference_grid_step(param, grad, state, group, grid, weight_rounding="nearest", eco=False, track=False) -> list[int]:
    """``adam_step_quantized`` with the weight grid, in place on ``param`` and ``state`` (``step`` counted); returns its
    stall counts ``[stalled_m, moved_m, stalled_v, moved_v]`` (zeros unless ``track``)."""
    m, v = state["exp_avg"], state["exp_avg_sq"]
    hyper = reference_hyper(group, state)
    return adam_step_quantized(
        param, grad, m.codes, m.scales, v.codes, v.scales, hyper, m.format, v.format, "nearest", group["decoupled_weight_decay"],
        group["maximize"], track, weight_format=grid.format, weight_rounding=weight_rounding, eco=eco,
    ).tolist()  # fmt: skip


def grid_param(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values around 1 (updates of lr = 1e-2 are a few ulps of bf16 there), small ones, fp16 subnormals and signed zeros."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator)
    values[::7] *= 1e-3
    values[3::11] = torch.randn(values[3::11].shape, generator=generator) * 1e-6
    values[5::13] = 0.0
    values[6::17] = -0.0
    return values.to(dtype)


def grid_layouts(m_name: str) -> list:
    """Two coded parameters: a partial last block (and a short one, all of it the scalar loop)."""
    return [
        (get_format(m_name), get_format("int8", signed=False), (1 << 12) + 77),
        (get_format(m_name), get_format("int8", signed=False), 13),
    ]


@needs_kernel
@pytest.mark.parametrize("options", [{}, {"decoupled": False}, {"maximize": True}], ids=["decoupled", "l2", "maximize"])
@pytest.mark.parametrize("eco", [False, True], ids=["plain", "eco"])
@pytest.mark.parametrize("grid_name", list(DTYPES))
@pytest.mark.parametrize("param_name", list(DTYPES))
@pytest.mark.parametrize("m_name", ["int8", "int8_linear"])
def test_kernel_weight_grid_step_is_the_reference_bit_for_bit(m_name, param_name, grid_name, eco, options):
    """Round to nearest on a cast-format weight grid: over 3 steps the kernel's params (in their dtype), ``m`` (with
    ECO's feedback) and ``v`` codes and scales equal ``adam_step_quantized``'s bit for bit, and so do its stall counts."""
    group, grid, dtype = grid_group(eco, **options), get_weight_grid(grid_name), DTYPES[param_name]
    params, states, references = [], [], []
    for seed, (m_format, v_format, numel) in enumerate(grid_layouts(m_name)):
        params.append(grid_param(numel, dtype, seed))
        states.append(adam_state(m_format, v_format, numel, seed))
        references.append((params[-1].clone(), adam_state(m_format, v_format, numel, seed)))
    for step in range(3):
        grads = [
            (torch.randn(p.numel(), generator=torch.Generator().manual_seed(10 * step + k)) * 0.1).to(dtype) for k, p in enumerate(params)
        ]
        rows = native_adam_steps(params, grads, states, group, track_stalls=True, weights=[grid] * len(params))
        assert all(row[:2] == [1, 1] for row in rows)
        for row, (reference_param, reference_state), grad in zip(rows, references, grads, strict=True):
            assert row[2:] == reference_grid_step(reference_param, grad, reference_state, group, grid, eco=eco, track=True)
        for k, (param, state, (reference_param, reference_state)) in enumerate(zip(params, states, references, strict=True)):
            assert param.dtype == dtype and torch.equal(
                param.view(-1, 1).view(torch.uint8), reference_param.view(-1, 1).view(torch.uint8)
            ), (step, k)
            assert float(state["step"]) == float(reference_state["step"]) == 4.0 + step
            for name in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[name].codes, reference_state[name].codes), (step, k, name)
                assert torch.equal(state[name].scales, reference_state[name].scales), (step, k, name)


@pytest.mark.parametrize("cpu_compile", [True, False], ids=["fused steps", "reference path"])
@pytest.mark.parametrize("feedback", ["eco", "eco_exact"])
@pytest.mark.parametrize("optimizer", ["QAdamW", "QSGD"])
def test_a_weight_pushed_past_its_grids_range_saturates(optimizer, feedback, cpu_compile):
    """Finite gradients that push fp32 weights on the fp16 grid past 65504 leave them at 65504 on every path, and the
    momentum finite: the cast made them inf, ECO then fed ``θ̃ − inf`` into the momentum and the next steps made the
    weights NaN. ``eco_exact``'s weights plus error stay master-weight SGD-momentum's iterate, bit for bit."""
    param = torch.nn.Parameter(torch.full((4096 + 21,), 65000.0))  # 16- and 8-value passes and the scalar tail
    master = torch.nn.Parameter(param.detach().clone())
    options = {"lr": 200.0, "weight_decay": 0.0} if optimizer == "QAdamW" else {"lr": 100.0, "momentum": 0.9}
    opt = getattr(lq, optimizer)([param], **options, states="fp32", min_quant_size=0, weights="fp16", error_feedback=feedback)
    opt.cpu_compile = cpu_compile
    reference = (torch.optim.AdamW if optimizer == "QAdamW" else torch.optim.SGD)([master], **options)
    for _ in range(4):
        param.grad, master.grad = torch.full_like(param, -1.0), torch.full_like(master, -1.0)
        opt.step()
        reference.step()
    assert float(master.detach().min()) > 65520  # past fp16's rounding to inf
    assert torch.equal(param.detach(), torch.full_like(param, 65504.0)), opt.step_paths()
    assert all(bool(torch.isfinite(value).all()) for value in opt.state[param].values() if isinstance(value, torch.Tensor))
    if feedback == "eco_exact" and optimizer == "QSGD":
        assert torch.equal(param.detach() + opt.state[param][ERROR_STATE], master.detach())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_skips_a_nonfinite_16_bit_gradient(dtype):
    """A bf16/fp16 gradient with an inf (in the partial last block) leaves its parameter, moments and step untouched;
    the other parameter of the call steps."""
    grid = get_weight_grid("bf16" if dtype == torch.bfloat16 else "fp16")
    numel = (1 << 12) + 77
    params = [grid_param(numel, dtype, seed) for seed in range(2)]
    states = [adam_state(get_format("int8"), get_format("int8", signed=False), numel, seed) for seed in range(2)]
    before = [(p.clone(), s["exp_avg"].codes.clone(), s["exp_avg_sq"].scales.clone()) for p, s in zip(params, states, strict=True)]
    grads = [torch.randn(numel, generator=torch.Generator().manual_seed(k)).to(dtype) for k in range(2)]
    grads[0][-5] = float("inf")
    rows = native_adam_steps(params, grads, states, grid_group(True), track_stalls=False, weights=[grid, grid])
    assert rows[0][0] == 0 and rows[1][:2] == [1, 1]
    assert torch.equal(params[0], before[0][0]) and float(states[0]["step"]) == 3.0
    assert torch.equal(states[0]["exp_avg"].codes, before[0][1]) and torch.equal(states[0]["exp_avg_sq"].scales, before[0][2])
    assert not torch.equal(params[1], before[1][0]) and float(states[1]["step"]) == 4.0


@needs_kernel
def test_kernel_eco_changes_m_and_the_grid_holds_the_params():
    """The ECO runs of the test above are not vacuous: with bf16 weights the feedback changes ``m``'s codes, and every
    param is a bf16 value (also in an fp32 parameter)."""
    results = {}
    for eco in (False, True):
        state = adam_state(get_format("int8"), get_format("int8", signed=False), 5000, seed=0)
        param = grid_param(5000, torch.float32, seed=0)
        grad = torch.randn(5000, generator=torch.Generator().manual_seed(1)) * 0.1
        native_adam_steps([param], [grad], [state], grid_group(eco), track_stalls=False, weights=[get_weight_grid("bf16")])
        assert torch.equal(param, param.bfloat16().float())
        results[eco] = (param, state["exp_avg"].codes)
    assert torch.equal(results[False][0], results[True][0])
    assert (results[False][1] != results[True][1]).sum() > 100


def fp16_hard_inputs() -> torch.Tensor:
    """Every finite fp16 value, the midpoints between neighbours and their fp32 neighbours, the overflow edge, fp32
    subnormals, infinities, and random fp32 patterns of every exponent."""
    values = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    midpoints = (values[:-1] + values[1:]) / 2  # exact in fp32
    edge = torch.tensor([65504.0, 65519.996, 65520.0, 65536.0, 1e6, 2.0**-24, 2.0**-25, 2.0**-26, 3 * 2.0**-26, 1e-45, 1e-40])
    near = torch.cat([midpoints, edge])
    patterns = torch.randint(0, 1 << 31, (200_000,), generator=torch.Generator().manual_seed(0), dtype=torch.int64).to(torch.int32)
    positive = torch.cat(
        [values, near, torch.nextafter(near, torch.zeros_like(near)), torch.nextafter(near, near * 2 + 1), patterns.view(torch.float32)]
    )
    positive = positive[torch.isfinite(positive)]
    return torch.cat([positive, -positive, torch.tensor([float("inf"), float("-inf")])])


@needs_kernel
def test_kernel_rounds_to_nearest_as_torch_casts():
    """The kernel's RN to fp16 (subnormals, ties to even) and bf16 give ``.to(dtype)``'s bits, saturating past the
    dtype's largest value (inf included) as ``CastFormat.round_saturated``; fp32 keeps every value; NaN stays NaN."""
    x = torch.cat([fp16_hard_inputs(), torch.tensor([3.39e38, -3.3965e38, 3.4e38])])  # past bf16's largest, both sides of the midpoint
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        rounded = native_round_to_grid(x, dtype, "nearest")
        expected = x if dtype == torch.float32 else x.clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max)
        assert rounded.dtype == dtype and torch.equal(rounded.view(torch.uint8), expected.to(dtype).view(torch.uint8)), dtype
        name = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
        assert torch.equal(rounded, get_format(name).round_saturated(x, "nearest", None)), dtype
        assert bool(native_round_to_grid(torch.tensor([float("nan"), -float("nan")]), dtype, "nearest").isnan().all())


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_stochastic_rounding_saturates_at_the_largest_value(dtype):
    """SR to a weight grid never leaves its range: values past the largest (inf included) and just below it come out
    as the largest value or its lower neighbour, never inf; NaN stays NaN."""
    largest = torch.finfo(dtype).max
    x = torch.tensor([largest, largest * 1.0001, 3.4e38, float("inf")]).repeat(1024)
    for sign in (1.0, -1.0):
        rounded = native_round_to_grid(sign * x, dtype, "stochastic", seed=7).float()
        assert torch.equal(rounded, torch.full_like(x, sign * largest)), dtype
    below = torch.full((4096,), (largest + float(torch.nextafter(torch.tensor(largest, dtype=dtype), torch.tensor(0.0, dtype=dtype)))) / 2)
    assert bool(torch.isfinite(native_round_to_grid(below, dtype, "stochastic", seed=7).float()).all())
    assert bool(native_round_to_grid(torch.tensor([float("nan")] * 16), dtype, "stochastic", seed=7).isnan().all())


def sr_inputs() -> dict[str, tuple[torch.dtype, float]]:
    """Values between two grid neighbours (normal, fp16-subnormal, negative, near a binade end) for each SR grid."""
    return {
        "bf16 normal": (torch.bfloat16, 1.0 + 0.3 * 2.0**-7),
        "bf16 negative": (torch.bfloat16, -(3.0 + 0.85 * 2.0**-6)),
        "bf16 tiny": (torch.bfloat16, 1.7e-30),
        "fp16 normal": (torch.float16, 1.0 + 0.3 * 2.0**-10),
        "fp16 negative": (torch.float16, -(1000.0 + 0.1 * 0.5)),
        "fp16 subnormal": (torch.float16, 3.3 * 2.0**-24),
        "fp16 below the smallest": (torch.float16, 0.2 * 2.0**-24),
        "fp16 top": (torch.float16, 65500.0),
    }


def grid_neighbours(value: float, dtype: torch.dtype) -> tuple[float, float]:
    """The two values of ``dtype`` around ``value`` (not one of them), smaller first."""
    nearest = torch.tensor([value]).to(dtype)
    other = torch.nextafter(nearest, torch.tensor([float("inf") if float(nearest) < value else float("-inf")], dtype=dtype))
    low, high = sorted((float(nearest), float(other)))
    assert low < value < high
    return low, high


@needs_kernel
@pytest.mark.parametrize("case", list(sr_inputs()))
def test_kernel_stochastic_rounding_is_unbiased(case):
    """Many SR draws of one value: each is one of its two grid neighbours, their mean is the value within 4 standard
    errors, the same seed gives the same draws (on 1 or 2 threads), another seed others."""
    dtype, value = sr_inputs()[case]
    n = 1 << 16
    x = torch.full((n,), value)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        draws = native_round_to_grid(x, dtype, "stochastic", seed=1234)
        torch.set_num_threads(1)
        assert torch.equal(native_round_to_grid(x, dtype, "stochastic", seed=1234).view(torch.int16), draws.view(torch.int16))
    finally:
        torch.set_num_threads(saved)
    low, high = grid_neighbours(value, dtype)
    values = draws.double()
    assert bool(((values == low) | (values == high)).all())
    fraction = (value - low) / (high - low)
    spread = (high - low) * (fraction * (1 - fraction) / n) ** 0.5
    assert abs(float(values.mean()) - value) < 4 * spread, (float(values.mean()), value, spread)
    assert not torch.equal(native_round_to_grid(x, dtype, "stochastic", seed=1235).view(torch.int16), draws.view(torch.int16))


@needs_kernel
@pytest.mark.parametrize("grid_name", ["bf16", "fp16"])
def test_kernel_stochastic_weights_step(grid_name):
    """SR of the weights in the step: each new param is the reference's fp32 update rounded with the kernel's draws of
    its seed (``cast_bits``: ``test_native_formats.cast_stochastic_rounding``), bit for bit (``m`` and ``v`` are the
    reference's, no ECO), so one of its two grid neighbours; the same on 1 or 2 threads, others with another seed."""
    group, grid, dtype = grid_group(False, "stochastic"), get_weight_grid(grid_name), DTYPES[grid_name]
    m_format, v_format, numel = get_format("int8"), get_format("int8", signed=False), 50_000
    start, grad = grid_param(numel, dtype, seed=0), (torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 0.1).to(dtype)
    updated, reference_state = start.float(), adam_state(m_format, v_format, numel, seed=0)
    reference_grid_step(updated, grad, reference_state, group, get_weight_grid("fp32"))  # the fp32 update itself
    runs = []
    saved = torch.get_num_threads()
    try:
        for threads, seed in ((2, 77), (1, 77), (2, 78)):
            torch.set_num_threads(threads)
            param, state = start.clone(), adam_state(m_format, v_format, numel, seed=0)
            native_adam_steps([param], [grad], [state], group, track_stalls=False, weights=[grid], seeds=[seed])
            runs.append(param)
            assert torch.equal(state["exp_avg"].codes, reference_state["exp_avg"].codes)
            assert torch.equal(state["exp_avg_sq"].codes, reference_state["exp_avg_sq"].codes)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(runs[0].view(torch.int16), runs[1].view(torch.int16))
    assert not torch.equal(runs[0].view(torch.int16), runs[2].view(torch.int16))
    assert torch.equal(runs[0].view(torch.int16), cast_stochastic_rounding(grid_name, updated, 77).view(torch.int16))
    nearest = updated.to(dtype)
    toward = torch.nextafter(nearest, torch.where(nearest.float() < updated, torch.inf, -torch.inf).to(dtype))
    param = runs[0]
    assert bool(((param == nearest) | ((param == toward) & (nearest.float() != updated))).all())
    assert 0.05 < float((param != nearest).float().mean()) < 0.5  # SR rounds away from the nearest value sometimes


@needs_kernel
def test_optimizer_takes_the_native_path_with_eco():
    """``QAdamW(weights="bf16", weight_rounding="nearest", error_feedback="eco")`` on bf16 params of 65536+ elements
    steps on the native path, and its step is the reference's bit for bit; SR weights reproduce from the optimizer's
    generator (their seed drawn from ``rounding_generator``), on 1 or 2 threads."""
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(256, 260).bfloat16())
    optimizer = lq.QAdamW([param], lr=1e-3, weights="bf16", weight_rounding="nearest", error_feedback="eco")
    param.grad = torch.randn_like(param)
    optimizer.step()
    assert optimizer.step_paths() == {"param0": "native"}
    group, state = optimizer.param_groups[0], optimizer.state[param]
    expected_param, expected_state = param.detach().clone().view(-1), copy.deepcopy(state)
    param.grad = torch.randn_like(param)
    optimizer.step()
    reference_grid_step(expected_param, param.grad.view(-1), expected_state, group, get_weight_grid("bf16"), eco=True)
    assert torch.equal(param.detach().view(-1).view(torch.int16), expected_param.view(torch.int16))
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(state[name].codes, expected_state[name].codes) and torch.equal(state[name].scales, expected_state[name].scales)

    def stochastic_run(threads: int) -> torch.Tensor:
        weight = torch.nn.Parameter(torch.randn(70_000, generator=torch.Generator().manual_seed(3)).bfloat16())
        generator = torch.Generator().manual_seed(5)
        sr = lq.QAdamW([weight], lr=1e-3, weights="bf16", error_feedback="eco", generator=generator)
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for step in range(3):
                weight.grad = torch.randn(70_000, generator=torch.Generator().manual_seed(step)).bfloat16()
                sr.step()
        finally:
            torch.set_num_threads(saved)
        assert sr.step_paths() == {"param0": "native"}
        return weight.detach().clone()

    assert torch.equal(stochastic_run(1).view(torch.int16), stochastic_run(2).view(torch.int16))


@needs_kernel
@pytest.mark.skipif(not torch_rounds_once(), reason="torch's CPU kernels round a * b + c twice here: the reference path is not adam_math")
@pytest.mark.parametrize(
    ("weights", "dtype", "feedback", "states"),
    [
        ("bf16", torch.bfloat16, "eco", "int8"),
        ("fp16", torch.float16, None, "int8"),
        ("fp16", torch.float16, "eco", "int8"),
        ("fp32", torch.float32, "eco", "int8"),
        ("bf16", torch.bfloat16, "eco", "fp32"),  # no coded parameter in the group
    ],
)
def test_fp32_state_parameters_on_a_weight_grid_join_the_native_call(weights, dtype, feedback, states, monkeypatch):
    """Parameters kept in fp32 states (by ``min_quant_size``, or all of them with ``states="fp32"``) on a weight grid
    (``weights=``, ECO's feedback) take the native path (as coded ones with fp32 cast moments, unheld) instead of the
    reference path, and step as it does bit for bit (round to nearest): torch's Adam on their fp32 moments, the new
    values rounded to the grid, ECO's correction in ``m`` (the reference's ``sqrt`` made correctly rounded, as
    ``adam_math``'s)."""
    results = []
    for native_path in (True, False):
        generator = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(grid_param(numel, dtype, seed)) for seed, numel in enumerate((5000, 1000, 77, 16, 3))]
        options = {"weights": weights, "weight_rounding": "nearest", "error_feedback": feedback, "min_quant_size": 4096, "states": states}
        optimizer = lq.QAdamW(params, lr=1e-2, weight_decay=0.1, **options)
        optimizer.cpu_compile = native_path
        with monkeypatch.context() as patch:
            if not native_path:
                correctly_rounded_torch_sqrt(patch)
            for _ in range(3):
                for param in params:
                    param.grad = torch.randn(param.shape, generator=generator).to(dtype)
                optimizer.step()
        paths = set(optimizer.step_paths().values())
        assert paths == ({"native"} if native_path else {"reference"})
        plain = [optimizer.state[param] for param in params[1:]]
        assert all(type(state["exp_avg"]) is torch.Tensor and float(state["step"]) == 3 for state in plain)
        pairs = zip(params[1:], plain, strict=True)
        results.append([t.detach().clone() for param, state in pairs for t in (param, state["exp_avg"], state["exp_avg_sq"])])
    for native_result, reference_result in zip(*results, strict=True):
        assert torch.equal(native_result.view(torch.uint8), reference_result.view(torch.uint8))


@needs_kernel
@pytest.mark.parametrize(
    ("options", "dtype", "expected"),
    [
        ({"weights": "bf16", "error_feedback": "eco"}, torch.bfloat16, "native"),
        ({"weights": "fp16", "weight_rounding": "stochastic"}, torch.float16, "native"),
        ({"weights": "bf16"}, torch.float32, "native"),
        ({"error_feedback": "eco"}, torch.bfloat16, "native"),  # the parameter's dtype is its grid
        ({"weights": "bf16", "error_feedback": "eco", "track_stalls": True}, torch.bfloat16, "native"),  # counted on copies
        ({"weights": "bf16", "error_feedback": "eco_exact"}, torch.bfloat16, "reference"),
        ({"weights": "fp8_e4m3"}, torch.float32, "reference"),  # a block-scaled grid
        ({}, torch.bfloat16, "reference"),  # without a grid the kernel takes fp32 parameters only
    ],
)
def test_the_native_path_takes_what_the_kernel_supports(options, dtype, expected):
    """``dispatch.native_values`` and ``fused_weight_update``: which weight options a coded parameter steps with on the
    native path (a small one: the compiled path would not take it either)."""
    param = torch.nn.Parameter(torch.randn(5000).to(dtype))
    optimizer = lq.QAdamW([param], min_quant_size=0, **options)
    param.grad = torch.randn_like(param)
    optimizer.step()
    assert optimizer.step_paths() == {"param0": expected}


@needs_kernel
@pytest.mark.parametrize("states", ["int8", "fp32"])
def test_a_weight_grid_with_its_own_rounding_takes_the_reference_path(states):
    """A ``WeightGrid`` subclass's ``round`` (a synthetic quantizer) is called by the reference path only: the fused
    steps round to the cast grid themselves, so they would silently skip it."""

    class Jittered(WeightGrid):
        def round(self, values, rounding, generator=None):
            return values + 1e-3

    param = torch.nn.Parameter(torch.zeros(5000, dtype=torch.bfloat16))
    optimizer = lq.QAdamW([param], min_quant_size=0, states=states, weights="bf16")
    optimizer.weight_grid = lambda group, key, p=None: Jittered(get_weight_grid("bf16").format)
    param.grad = torch.zeros_like(param)
    optimizer.step()
    assert optimizer.step_paths() == {"param0": "reference"}
    assert torch.equal(param.detach(), torch.full_like(param, 1e-3))


@needs_kernel
def test_an_l2_decay_of_zero_adds_nothing(monkeypatch):
    """QAdam's default ``weight_decay=0`` adds no L2 term, as torch's Adam skips it: a parameter holding inf steps
    (``fma(p, 0, g)`` made that entry's gradient NaN: the native step raised an overflow and zeroed the states), its
    moments and params as the reference path's."""
    correctly_rounded_torch_sqrt(monkeypatch)
    results = []
    for native_path in (True, False):
        values = torch.linspace(-1, 1, 4096)
        values[7] = float("inf")
        param = torch.nn.Parameter(values)
        optimizer = lq.QAdam([param], lr=1e-3, states="int8", min_quant_size=0)
        optimizer.cpu_compile = native_path
        for step in range(2):
            param.grad = torch.linspace(-0.5, 0.5, 4096) * (step + 1)
            optimizer.step()
        assert optimizer.step_paths() == {"param0": "native" if native_path else "reference"}
        m, v = (optimizer.state[param][name] for name in ("exp_avg", "exp_avg_sq"))
        assert m.dequantize().abs().max() > 0 and int(torch.isfinite(param.detach()).sum()) == 4095
        results.append((param.detach().clone(), m.codes, v.codes))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


@needs_kernel
@pytest.mark.parametrize("states", [{"exp_avg": "int4", "exp_avg_sq": "int8"}, "fp8_e5m2", "int8"], ids=["int4-int8", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("torch_class", [lq.QAdamW, lq.QAdam])
@pytest.mark.parametrize("tensor_lr", [False, True])
def test_the_per_parameter_path_holds_m_as_the_native_path(states, torch_class, tensor_lr, monkeypatch):
    """The per-parameter step (torch's Adam, then the hold of the updated ``m`` and the parameter's value taken again
    where it acted) and the native step agree bit for bit over 12 steps of heavy-tailed gradients (the hold acts on
    tens to hundreds of values, mostly at the second step: after the first, every ``|m|`` meets Adam's bound, and
    storage rounds some past it), with torch's square root made correctly rounded; AdamW's decoupled decay and Adam's
    L2 term both; an fp32 tensor lr, which torch divides in fp32 (the native step had divided it in double: 1 ulp off
    on 3 % of the params)."""
    correctly_rounded_torch_sqrt(monkeypatch)
    acted = []

    def counting_hold(exp_avg, root, bound):
        held = hold_moment(exp_avg, root, bound)
        acted.append(int((held != exp_avg).sum()))
        return held

    monkeypatch.setattr(optimizers, "hold_moment", counting_hold)
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(4096, generator=generator) * torch.exp(3 * torch.randn(4096, generator=generator)) for _ in range(12)]
    results = []
    for native_path in (True, False):
        param = torch.nn.Parameter(torch.randn(4096, generator=torch.Generator().manual_seed(0)))
        lr = torch.tensor(1e-2) if tensor_lr else 1e-2
        optimizer = torch_class([param], lr=lr, weight_decay=0.1, states=states, min_quant_size=0)
        optimizer.cpu_compile = native_path
        for grad in grads:
            param.grad = grad.clone()
            optimizer.step()
        assert optimizer.step_paths() == {"param0": "native" if native_path else "reference"}
        results.append((param.detach().clone(), *(optimizer.state[param][name].codes for name in ("exp_avg", "exp_avg_sq"))))
    assert sum(acted) > 10, acted
    for ours, theirs in zip(*results, strict=True):
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))
