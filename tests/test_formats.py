"""Storage formats: configuration errors, codebooks, error bounds, SR bias, byte accounting, special values."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_qstate.formats import (
    BlockFormat,
    CastFormat,
    MinifloatFormat,
    NonFiniteError,
    dynamic_map,
    get_format,
    linear_map,
)
from lightning_qstate.formats.block import round_up_to_bf16
from lightning_qstate.formats.cast import FP16_SPEC
from lightning_qstate.formats.rounding import encode_minifloat
from lightning_qstate.formats.weights import get_weight_grid
from lightning_qstate.optim.weights import grid_units

from cases import BLOCK_FORMATS, FORMAT_IDS

CAST_FORMATS = ["fp32", "bf16", "fp16"]


def sample(fmt: BlockFormat, numel: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen) * torch.exp(torch.randn(numel, generator=gen) * 2)
    return x.abs() if not fmt.signed else x


def nearest_distance(normalized: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Distance from each normalized value to the nearest codebook value (float64, brute force)."""
    out = torch.empty_like(normalized, dtype=torch.float64)
    for chunk in range(0, normalized.numel(), 4096):
        part = normalized[chunk : chunk + 4096].double()
        out[chunk : chunk + 4096] = (part[:, None] - values.double()[None, :]).abs().amin(dim=1)
    return out


# --- configuration errors --------------------------------------------------------------------------


def test_unknown_format_names_valid_ones():
    with pytest.raises(ValueError, match="unknown format 'int3'.*int8.*eXmY"):
        get_format("int3")


@pytest.mark.parametrize("block_size", [0, 3, 100, -4, 1])
def test_block_size_must_be_power_of_two(block_size):
    with pytest.raises(ValueError, match="block_size=.*power of two"):
        get_format("int8", block_size=block_size)


def test_other_bad_options():
    with pytest.raises(ValueError, match="e9m2.*exponent bits"):
        get_format("e9m2")
    with pytest.raises(ValueError, match="at most 16 bits"):
        get_format("e5m11")
    with pytest.raises(ValueError, match="nonfinite='drop'.*raise"):
        get_format("int8", nonfinite="drop")
    for name in ("int8", "bf16"):  # casts ignore these options, and still refuse values that are none
        with pytest.raises(ValueError, match="signed='false' must be True or False"):
            get_format(name, signed="false")  # a non-empty string would read as True
        with pytest.raises(ValueError, match="nonfinite='skip' is not a policy"):
            get_format(name, nonfinite="skip")
        with pytest.raises(ValueError, match="scale_dtype='fp64' is not a scale type"):
            get_format(name, scale_dtype="fp64")
        with pytest.raises(ValueError, match=r"scale_dtype=\['bf16'\] is not a scale type"):  # unhashable: the cache's TypeError
            get_format(name, scale_dtype=["bf16"])
        with pytest.raises(ValueError, match=r"nonfinite=\{'m': 'raise'\} is not a policy"):
            get_format(name, nonfinite={"m": "raise"})
        with pytest.raises(ValueError, match="block_size=3 must be a power of two"):
            get_format(name, block_size=3)
    for name in (5, None, b"int8"):
        with pytest.raises(TypeError, match=r"a format name must be a string, got .*; valid formats: fp32, bf16"):
            get_format(name)
    get_format("int8", signed=True, block_size=256)  # cached: an equal argument of another type must not take it
    with pytest.raises(ValueError, match="signed=1 must be True or False"):
        get_format("int8", signed=1)
    with pytest.raises(ValueError, match=r"block_size=256.0 must be a power of two"):
        get_format("int8", block_size=256.0)
    with pytest.raises(ValueError, match="rounding='up'.*nearest.*stochastic"):
        get_format("int8").quantize(torch.ones(4), rounding="up")
    with pytest.raises(TypeError, match="float32, bfloat16 or float16.*int64"):
        get_format("bf16").quantize(torch.ones(4, dtype=torch.int64))


# --- codebooks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("signed,bits", [(True, 8), (False, 8), (True, 4)])
def test_dynamic_maps_sorted_with_peer_endpoints(signed, bits):
    table = dynamic_map(signed, bits)
    assert table.numel() == 2**bits
    assert bool((table[1:] > table[:-1]).all()), "codebook must be strictly increasing"
    assert table[-1] == 1.0 and 0.0 in table.tolist()
    assert (table[0] < 0) == signed
    if signed:  # the peers' signed map has 0 and +1 but not -1
        assert -1.0 < table[0] < -0.99 if bits == 8 else -1.0 < table[0] < -0.7


def test_dynamic_maps_match_torchao():
    quant_utils = pytest.importorskip("torchao.optim.quant_utils")
    for signed, bits, exponent_bits in [(True, 8, 7), (False, 8, 7), (True, 4, 3)]:
        peer = torch.tensor(quant_utils.create_dynamic_map(signed, exponent_bits, bits), dtype=torch.float64)
        torch.testing.assert_close(dynamic_map(signed, bits), peer, rtol=1e-6, atol=1e-9)


def test_v_map_of_int4_is_zero_free():
    fmt = get_format("int4", signed=False)
    values = fmt.decode_values()
    assert values.numel() == 16 and float(values.min()) == 1 / 16 and float(values.max()) == 1.0
    assert bool((values[1:] > values[:-1]).all())
    assert torch.equal(fmt.codebook, linear_map(False, 4, zero_free=True))
    # m keeps the signed dynamic map, which does contain zero
    assert 0.0 in get_format("int4").decode_values().tolist()


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("name, smallest", [("e2m2", 0.25 / 7), ("fp8_e4m3", 2.0**-9 / 448)])
def test_minifloats_for_nonnegative_states_are_zero_free(name, smallest, rounding):
    """A v flushed to zero beside a nonzero m would blow Adam's step up to m/eps."""
    fmt = get_format(name, signed=False)
    x = torch.tensor([1.0, 1e-3 * smallest, 1e-9, 0.0] + [0.5] * 124)
    q = fmt.quantize(x, rounding=rounding, generator=torch.Generator().manual_seed(0))
    assert float(fmt.decode_values()[1]) == pytest.approx(smallest)
    assert torch.equal(q.dequantize()[1:4], torch.full((3,), float(fmt.decode_values()[1])))
    assert bool((fmt.quantize(torch.zeros(128)).dequantize() == 0).all())  # an all-zero block stays zero
    assert get_format(name, signed=True).quantize(x).dequantize()[2] == 0  # m keeps its zero


def test_linear_maps_symmetric_and_sorted():
    for bits in (4, 8):
        table = linear_map(True, bits)
        assert table[0] == -1 and table[-1] == 1 and 0.0 in table.tolist()
        torch.testing.assert_close(table, -table.flip(0))
        assert bool((table[1:] > table[:-1]).all())


@pytest.mark.parametrize("name,max_value", [("fp8_e4m3", 448.0), ("fp8_e5m2", 57344.0), ("e2m2", 7.0), ("e3m0", 16.0), ("e4m3", 480.0)])
def test_minifloat_ranges(name, max_value):
    fmt = get_format(name, signed=name != "e3m0")
    assert isinstance(fmt, MinifloatFormat)
    assert fmt.max_value == max_value
    magnitudes = fmt.spec.values()[: 2 ** (fmt.spec.exponent_bits + fmt.spec.mantissa_bits)]
    assert bool((magnitudes[1:] >= magnitudes[:-1]).all())


# --- exactness against torch's own casts ---------------------------------------------------------


@pytest.mark.parametrize("name,dtype", [("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)])
def test_fp8_codes_are_ocp_bit_patterns(name, dtype):
    fmt = get_format(name)
    x = sample(fmt, 1 << 14)
    q = fmt.quantize(x)
    normalized = x.view(-1, fmt.block_size) / q.scales[:, None]
    torch_codes = (normalized * fmt.max_value).to(dtype).view(torch.uint8).view(-1)
    assert torch.equal(q.codes, torch_codes)


def test_minifloat_encoder_matches_torch_fp16_cast():
    x = torch.randn(1 << 16) * torch.exp(torch.randn(1 << 16) * 6)
    x = x[x.abs() <= 65504]
    codes = encode_minifloat(x.abs(), FP16_SPEC, "nearest")
    assert torch.equal(codes, x.abs().half().view(torch.int16).to(torch.int32))


# --- error bounds ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name,options", BLOCK_FORMATS, ids=FORMAT_IDS)
def test_rn_picks_the_nearest_code_within_half_a_spacing(name, options):
    fmt = get_format(name, **options)
    x = sample(fmt, 3 * fmt.block_size + 17)
    q = fmt.quantize(x)
    scales = q.scales.repeat_interleave(fmt.block_size)[: x.numel()].double()
    error = (q.dequantize().double() - x.double()).abs()
    values = fmt.decode_values().double().unique()
    if fmt.zero_free:  # 0 is never stored (values below the smallest positive code take it)
        values = values[values > 0] if not fmt.signed else values[values.abs() > 0]
    normalized = x.double() / scales
    distance = nearest_distance(normalized, values)
    # RN error == distance to the nearest codebook value (times the block scale), up to fp32 rounding
    torch.testing.assert_close(error / scales, distance, atol=2e-7, rtol=0)
    # ... which is at most half the local code spacing wherever the value lies inside the codebook's range
    upper = torch.searchsorted(values, normalized.clamp(values[0], values[-1]), right=False).clamp(1, values.numel() - 1)
    spacing = values[upper] - values[upper - 1]
    inside = (normalized >= values[0]) & (normalized <= values[-1])
    bound = 0.5 * spacing * scales * (1 + 1e-5) + 1e-30
    assert bool((error[inside] <= bound[inside]).all())


@pytest.mark.parametrize("name,options", BLOCK_FORMATS + [(n, {}) for n in ("bf16", "fp16")], ids=FORMAT_IDS + ["bf16", "fp16"])
def test_sr_is_unbiased(name, options):
    fmt = get_format(name, **options)
    block = 256 if isinstance(fmt, CastFormat) else fmt.block_size
    gen = torch.Generator().manual_seed(1)
    lowest = float(fmt.decode_values().clamp(min=0).min()) if isinstance(fmt, BlockFormat) else 0.0
    base = lowest + (1 - lowest) * (torch.rand(block, generator=gen) * 0.9 + 0.05)  # strictly inside the range
    base[0] = 1.0  # fixes the block absmax so every copy has the same scale
    if isinstance(fmt, BlockFormat) and fmt.signed:  # negatives stay inside the (possibly shorter) negative range
        base[1::2] *= float(fmt.decode_values().min())
    copies = 4000
    x = base.repeat(copies)
    deq = fmt.quantize(x, rounding="stochastic", generator=gen).dequantize().view(copies, block).double()
    rn = fmt.quantize(base).dequantize().double()
    mean = deq.mean(dim=0)
    # 5.5 standard errors, plus the resolution of a mean of `copies` draws for values within a hair of a code
    tolerance = 5.5 * deq.std(dim=0) / math.sqrt(copies) + 2e-4
    assert bool(((mean - base.double()).abs() <= tolerance).all()), "SR mean differs from the input beyond statistical tolerance"
    rn_bias = (rn - base.double()).abs().mean()
    assert float((mean - base.double()).abs().mean()) < 0.25 * float(rn_bias) + 1e-9


def test_sr_reproduces_with_the_same_generator_seed():
    fmt = get_format("int4")
    x = torch.randn(5000)
    first = fmt.quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    second = fmt.quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(7))
    assert torch.equal(first.codes, second.codes)


def test_bf16_sr_lands_on_a_neighbour():
    x = torch.randn(10000)
    sr = get_format("bf16").quantize(x, rounding="stochastic").dequantize().float()
    down = (x.view(torch.int32) & -65536).view(torch.float32)
    up = ((x.view(torch.int32) & -65536) + 65536).view(torch.float32)
    assert bool(((sr == down) | (sr == up)).all())


@pytest.mark.parametrize("name", ["bf16", "fp16"])
def test_sr_casts_past_the_largest_value_are_the_rn_cast(name):
    """Finite values past the dtype's largest: stochastic rounding gives the RN cast (the largest value below the
    midpoint to inf, inf above it); bf16's SR had rounded values RN keeps finite up to inf."""
    fmt = get_format(name)
    x = torch.tensor([3.39e38, -3.3925e38, 3.397e38] if name == "bf16" else [65519.0, -65515.0, 65530.0]).repeat(4096)
    assert bool(torch.isfinite(x).all() and (x.abs() > torch.finfo(fmt.dtype).max).all())
    sr = fmt.quantize(x, rounding="stochastic", generator=torch.Generator().manual_seed(0)).dequantize()
    assert torch.equal(sr, x.to(fmt.dtype).float()) and int(torch.isinf(sr).sum()) == 4096


# --- block scales -----------------------------------------------------------------------------------


def test_scale_dtype_follows_the_state_by_default():
    for name in ("int8", "int4", "int8_linear", "fp8_e4m3", "e2m2"):
        assert get_format(name).scale_dtype == torch.bfloat16  # first moments
        assert get_format(name, signed=False).scale_dtype == torch.float32  # second moments
        assert get_format(name, signed=False, scale_dtype="bf16").scale_dtype == torch.bfloat16
        assert get_format(name, scale_dtype="fp32").config["scale_dtype"] == "fp32"
    assert get_format("int8").config["scale_dtype"] == "bf16"  # recorded resolved, for checkpoints
    assert get_format("int8").nbytes(1000) == 1000 + 2 * 4 and get_format("int8", signed=False).nbytes(1000) == 1000 + 4 * 4
    with pytest.raises(ValueError, match="scale_dtype='fp16'.*bf16.*fp32"):
        get_format("int8", scale_dtype="fp16")


@pytest.mark.parametrize("name", ["int8", "int4", "fp8_e4m3", "int8_linear"])
def test_bf16_scales_are_block_absmax_rounded_up(name):
    fmt = get_format(name, scale_dtype="bf16", block_size=64)
    x = torch.randn(64 * 300, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 30, 64 * 300)
    q = fmt.quantize(x)
    absmax = x.view(-1, 64).abs().amax(dim=1)
    scales = q.scales.float()
    assert q.scales.dtype == torch.bfloat16
    assert bool((scales >= absmax).all()) and bool((scales < absmax * (1 + 2**-7)).all())
    below = (scales.view(torch.int32) - 0x10000).view(torch.float32)  # the bf16 value under each scale
    assert bool((below < absmax).all())
    assert bool((q.dequantize().abs().view(-1, 64).amax(dim=1) <= scales).all())
    huge = fmt.quantize(torch.tensor([3.4e38, -1.0]))  # above bf16's largest finite value: saturates, stays finite
    assert bool(torch.isfinite(huge.scales).all()) and float(huge.dequantize()[0]) == float(torch.finfo(torch.bfloat16).max)


def test_round_up_to_bf16_is_the_kernels_bit_pattern_rounding():
    """The torch reference rounds up with float operations (they vectorize under torch.compile); the C++ and Triton
    kernels add 0xFFFF to the fp32 bit pattern and clear the low half. Both must agree on every input."""
    patterns = torch.randint(0, 0x7F800000, (1 << 20,), generator=torch.Generator().manual_seed(0), dtype=torch.int64).to(torch.int32)
    edges = torch.tensor([0.0, 1e-45, 2.0**-133, 2.0**-126, 1.0, 1.0 + 2.0**-23, 1.00390625, 3.3895e38, 3.4e38, math.inf, math.nan])
    values = torch.cat([patterns.view(torch.float32), edges, torch.nextafter(edges, torch.zeros_like(edges))])
    by_pattern = ((values.view(torch.int32) + 0xFFFF) & -65536).view(torch.float32)
    by_pattern = torch.where(torch.isfinite(values), by_pattern.clamp(max=torch.finfo(torch.bfloat16).max), values)
    rounded = round_up_to_bf16(values)
    assert torch.equal(rounded.nan_to_num(nan=-1.0), by_pattern.nan_to_num(nan=-1.0))
    assert torch.equal(rounded[torch.isfinite(rounded)], rounded[torch.isfinite(rounded)].to(torch.bfloat16).float())


def test_bf16_scales_would_ratchet_a_second_moment():
    """Why second moments keep fp32 scales: Adam's v of unit-variance noise at beta2 = 0.999, stored int8 with RN.
    Its block absmax moves by ~0.1 % a step, under the bf16 grid, so a bf16 scale stalls and only ratchets up."""
    means = {}
    for scale_dtype in ("bf16", "fp32"):
        fmt = get_format("int8", signed=False, scale_dtype=scale_dtype)
        generator = torch.Generator().manual_seed(0)
        v = fmt.quantize(torch.ones(16384))
        for _ in range(3000):
            v = fmt.quantize(v.dequantize() * 0.999 + 0.001 * torch.randn(16384, generator=generator).square())
        means[scale_dtype] = float(v.dequantize().mean())
    assert means["fp32"] < 1.1 < 1.2 < means["bf16"], means


# --- byte accounting --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,options,limit",
    [
        ("int8", {}, 1.02),
        ("int4", {}, 0.54),
        ("int4", {"signed": False}, 0.54),
        ("bf16", {}, 2.0),
        ("fp16", {}, 2.0),
        ("fp8_e4m3", {}, 1.02),
        ("e2m2", {"signed": False}, 0.54),
    ],
)
def test_bytes_per_value(name, options, limit):
    fmt = get_format(name, **options)
    q = fmt.quantize(torch.randn(1 << 16).abs())
    assert q.nbytes / q.numel <= limit
    assert q.nbytes == fmt.nbytes(q.numel)
    assert q.bits_per_value == 8 * q.nbytes / q.numel
    if name == "bf16":
        assert q.nbytes / q.numel == 2.0


def test_odd_sizes_pack_nibbles_without_loss():
    fmt = get_format("int4")
    for numel in (1, 2, 127, 129, 255):
        x = torch.randn(numel)
        q = fmt.quantize(x)
        assert q.codes.numel() == (numel + 1) // 2
        assert q.scales.numel() == -(-numel // 128)
        assert q.dequantize().shape == x.shape


# --- shapes, dtypes, layouts -----------------------------------------------------------------------


@pytest.mark.parametrize("name,options", BLOCK_FORMATS[:4] + [("fp8_e4m3", {}), ("bf16", {}), ("fp16", {}), ("fp32", {})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dtype_shape_and_noncontiguous_inputs(name, options, dtype):
    fmt = get_format(name, **options)
    x = torch.randn(37, 29).t().to(dtype)  # non-contiguous
    if options.get("signed") is False:
        x = x.abs()
    assert not x.is_contiguous()
    q = fmt.quantize(x)
    y = q.dequantize()
    assert y.shape == x.shape and y.dtype == dtype
    assert q.dequantize(torch.float32).dtype == torch.float32
    reference = fmt.quantize(x.contiguous()).dequantize()
    assert torch.equal(y, reference)


def test_quantized_tensor_moves_and_reports():
    q = get_format("int8").quantize(torch.randn(300))
    moved = q.to("cpu")
    assert torch.equal(moved.dequantize(), q.dequantize())
    assert "int8" in repr(q) and q.device.type == "cpu"
    for moved in (q.to(torch.device("cpu")), q.to(device="cpu", non_blocking=True), q.to(None, copy=True)):  # how Lightning moves state
        assert torch.equal(moved.codes, q.codes) and moved.codes.dtype == torch.uint8 and moved.scales.dtype == q.scales.dtype


@pytest.mark.parametrize(
    "args,kwargs",
    [
        ((torch.float32,), {}),
        (("cpu", torch.float16), {}),
        ((), {"dtype": torch.bfloat16}),
        ((), {"device": "cpu", "dtype": torch.float32}),
        ((torch.zeros(2),), {}),
    ],
    ids=["dtype", "device-dtype", "dtype=", "device=-dtype=", "tensor"],
)
def test_quantized_tensor_to_refuses_to_cast_codes(args, kwargs):
    """Casting the codes would silently turn them into other values: ``.to`` takes a device only and says to dequantize."""
    q = get_format("int8").quantize(torch.randn(300))
    with pytest.raises(TypeError, match=r"takes a device only.*\.dequantize\(dtype\)"):
        q.to(*args, **kwargs)


# --- property tests (hypothesis) ------------------------------------------------------------------

SPECIAL = [0.0, -0.0, 1e-45, -1e-45, 1e-40, 1.17549435e-38, 1e-20, 1.0, -1.0, 3e38, -3e38, 1e30, 65504.0, 70000.0]
NONFINITE = [float("inf"), float("-inf"), float("nan")]
ALL_FORMATS = [(n, o) for n, o in BLOCK_FORMATS] + [(n, {}) for n in CAST_FORMATS]


@st.composite
def tensors(draw, allow_nonfinite: bool):
    numel = draw(st.one_of(st.integers(0, 600), st.sampled_from([1023, 4097, 65537, 1_000_003])))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(numel, generator=gen) * 10.0 ** draw(st.integers(-30, 30))
    pool = SPECIAL + (NONFINITE if allow_nonfinite else [])
    specials = draw(st.lists(st.tuples(st.integers(0, max(numel - 1, 0)), st.sampled_from(pool)), max_size=8 if numel else 0))
    for position, value in specials:
        x[position] = value
    return x


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), format_index=st.integers(0, len(ALL_FORMATS) - 1), rounding=st.sampled_from(["nearest", "stochastic"]))
def test_finite_inputs_round_trip_finite_and_bounded(data, format_index, rounding):
    name, options = ALL_FORMATS[format_index]
    fmt = get_format(name, **options)
    x = data.draw(tensors(allow_nonfinite=False))
    if isinstance(fmt, BlockFormat) and not fmt.signed:
        x = x.abs()
    q = fmt.quantize(x, rounding=rounding)
    y = q.dequantize()
    assert y.shape == x.shape
    if isinstance(fmt, CastFormat) and fmt.name != "fp32":
        finite_range = x.abs() <= torch.finfo(fmt.dtype).max
        assert bool(torch.isfinite(y[finite_range]).all())
        return
    assert bool(torch.isfinite(y).all())
    if isinstance(fmt, BlockFormat) and x.numel():
        scales = q.scales.repeat_interleave(fmt.block_size)[: x.numel()].double()
        values = fmt.decode_values().double()
        gap = (values[1:] - values[:-1]).max() if rounding == "nearest" else 2 * (values[1:] - values[:-1]).max()
        assert bool(((y.double() - x.double()).abs() <= gap * scales * (1 + 1e-5) + 1e-38).all())


@pytest.mark.parametrize("name", ["int8", "int4", "fp8_e4m3", "e2m2", "int8_linear", "bf16"])
def test_fp16_inputs_at_the_top_of_their_range_come_back_finite(name):
    """A bf16 block scale is the absmax rounded up (65504 -> 65536) and a bf16 cast rounds 65504 to 65536: dequantized
    to fp16 such values saturate at 65504 instead of turning inf; inf and NaN of a cast stay."""
    x = torch.tensor([65504.0, -65504.0, 1.0, -3.0], dtype=torch.float16)
    for rounding in ("nearest", "stochastic"):
        for seed in range(8):  # SR may round the top value (65504 / 65536 of the scale) down a code: finite either way
            y = get_format(name).quantize(x, rounding=rounding, generator=torch.Generator().manual_seed(seed)).dequantize()
            assert y.dtype == torch.float16 and bool(torch.isfinite(y).all()) and y.abs().max() <= 65504.0, (rounding, y)
            assert rounding == "stochastic" or y.abs().max() == 65504.0, y
    special = torch.tensor([float("inf"), -float("inf"), float("nan"), 65504.0], dtype=torch.float16)
    if name == "bf16":
        y = get_format(name).quantize(special).dequantize()
        assert y[:2].tolist() == [float("inf"), -float("inf")] and bool(y[2].isnan()) and y[3] == 65504.0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), format_index=st.integers(0, len(ALL_FORMATS) - 1), rounding=st.sampled_from(["nearest", "stochastic"]))
def test_nonfinite_inputs_never_become_finite_codes(data, format_index, rounding):
    name, options = ALL_FORMATS[format_index]
    x = data.draw(tensors(allow_nonfinite=True))
    bad = ~torch.isfinite(x)
    fmt = get_format(name, **options)
    if isinstance(fmt, CastFormat):
        y = fmt.quantize(x, rounding=rounding).dequantize()
        assert bool((torch.isnan(y) == torch.isnan(x)).all())
        assert bool((y[torch.isinf(x)] == x[torch.isinf(x)]).all())
        return
    if bool(bad.any()):
        with pytest.raises(NonFiniteError, match="inf or NaN.*nan_block"):
            fmt.quantize(x, rounding=rounding)
    poisoned = get_format(name, nonfinite="nan_block", **options)
    y = poisoned.quantize(x, rounding=rounding).dequantize()
    block_of = torch.arange(x.numel()) // fmt.block_size
    bad_blocks = torch.zeros(-(-x.numel() // fmt.block_size), dtype=torch.bool)
    bad_blocks[block_of[bad]] = True
    assert bool(torch.isnan(y[bad_blocks[block_of]]).all()), "a block holding inf/NaN must dequantize to NaN"
    assert bool(torch.isfinite(y[~bad_blocks[block_of]]).all())


@pytest.mark.parametrize("name,options", ALL_FORMATS + [("int6", {}), ("int5", {"block_size": 8})])
@pytest.mark.parametrize("shape", [(64, 257), (3, 5), (1,)])
def test_allocate_lays_out_storage_as_quantize_does(name, options, shape):
    """``allocate``: zero codes and scales of ``quantize``'s sizes and dtypes, the shape and dtype asked for."""
    fmt = get_format(name, **options)
    blank, stored = fmt.allocate(shape, torch.float64), fmt.quantize(torch.randn(shape))
    assert blank.shape == stored.shape and blank.dtype == torch.float64 and blank.nbytes == stored.nbytes
    for made, reference in ((blank.codes, stored.codes), (blank.scales, stored.scales)):
        if reference is None:
            assert made is None
        else:
            assert made.shape == reference.shape and made.dtype == reference.dtype and not made.view(torch.uint8).any()


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("block", ["row", "tensor", 4])
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_finite_group_at_the_edge_of_fp32_stays_finite(fmt, block, rounding):
    """A finite group whose scale would pass fp32's range (signed dynamic maps end at -0.993 / -0.8875: -3.4e38 over
    that overflows) came out all NaN (0 * inf); it takes the largest finite scale, its extreme rounding inwards."""
    x = torch.tensor([[-torch.finfo(torch.float32).max, 1.0, 2.0, 3.0]])
    y = get_weight_grid(fmt, block).round(x, rounding, torch.Generator().manual_seed(0))
    assert y.isfinite().all() and -torch.finfo(torch.float32).max <= y[0, 0] < -3.0e38
    assert torch.equal(grid_units(get_weight_grid(fmt, block), y).isfinite(), torch.ones(4, dtype=torch.bool))
