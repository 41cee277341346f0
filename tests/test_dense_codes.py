"""Dense 5- to 7-bit codes (issue #21): eight codes in ``bits`` bytes, real byte counts, and every path that stores them."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_qstate as lq
from lightning_qstate.formats import get_format
from lightning_qstate.formats.packing import pack, packed_numel, unpack

DENSE = [
    ("int5", True), ("int6", True), ("int7", True), ("int5", False), ("int6", False), ("int7", False),
    ("int5_linear", True), ("int6_linear", False), ("int7_linear", True),
    ("e2m2", True), ("e3m2", True), ("e2m3", False), ("e3m3", True), ("e4m2", False),
]  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 16), numel=st.integers(0, 300), seed=st.integers(0, 2**16))
def test_pack_round_trips_every_width_and_size(bits, numel, seed):
    codes = torch.randint(0, 2**bits, (numel,), generator=torch.Generator().manual_seed(seed))
    packed = pack(codes, bits)
    assert packed.numel() == packed_numel(numel, bits) and torch.equal(unpack(packed, bits, numel), codes.to(torch.int32))


@pytest.mark.parametrize("bits", [5, 6, 7])
def test_dense_layout_is_a_little_endian_bit_stream(bits):
    codes = torch.tensor([1, 0, 0, 0, 0, 0, 0, 2**bits - 1, 3])  # 9 codes: two groups, the second padded with zeros
    packed = pack(codes, bits)
    assert packed.numel() == 2 * bits and packed.dtype == torch.uint8
    word = sum(int(byte) << (8 * k) for k, byte in enumerate(packed[:bits].tolist()))
    assert word == 1 | ((2**bits - 1) << (7 * bits))
    assert packed[bits] == 3 and not packed[bits + 1 :].any()


@pytest.mark.parametrize(("name", "signed"), DENSE)
def test_bytes_are_the_real_ones(name, signed):
    fmt = get_format(name, signed=signed)
    assert 4 < fmt.bits < 8
    scale_bytes = 2 if signed else 4  # bf16 scales for signed states, fp32 for v
    numel = 10 * fmt.block_size + 3
    q = fmt.quantize(torch.randn(numel) if signed else torch.rand(numel))
    assert q.codes.numel() == -(-numel // 8) * fmt.bits and q.nbytes == q.codes.numel() + scale_bytes * 11
    assert q.bits_per_value == pytest.approx(8 * q.nbytes / numel)
    whole = fmt.quantize(torch.randn(4 * fmt.block_size).abs())
    assert whole.bits_per_value == fmt.bits + 8 * scale_bytes / fmt.block_size


@pytest.mark.parametrize(("name", "signed"), DENSE)
def test_round_to_nearest_and_stochastic_rounding(name, signed):
    fmt = get_format(name, signed=signed, block_size=64)
    x = torch.randn(64 * 50, generator=torch.Generator().manual_seed(0))
    x = x if signed else x.square()
    nearest = fmt.quantize(x).dequantize()
    grid = fmt.decode_values().double()
    scale = x.view(-1, 64).abs().amax(dim=1, keepdim=True).double()
    gaps = (grid[1:] - grid[:-1]).max()
    # zero-free formats store values below their smallest positive code as that code (RN and SR): bounds above it
    representable = (x.abs().view(-1, 64) / scale >= float(grid[grid > 0].min())) | signed
    assert float(((nearest.view(-1, 64) - x.view(-1, 64)).abs() / scale)[representable].max()) <= float(gaps) / 2 * 1.01 + 1e-6
    draws = torch.stack([fmt.quantize(x, "stochastic", torch.Generator().manual_seed(s)).dequantize() for s in range(64)])
    error = (draws.double().mean(0) - x.double()).view(-1, 64) / scale
    assert float(error[representable].abs().mean()) < float(gaps) / 16  # unbiased: the mean of 64 draws is close
    if not signed:
        assert bool((nearest > 0).all()), "zero-free: no positive value reads 0"


def test_small_blocks_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="block_size=4 is too small for 6-bit codes.*>= 8"):
        get_format("int6", block_size=4)
    assert get_format("int4", block_size=4).block_size == 4  # nibbles and bytes keep any power of two


def test_non_finite_input_follows_the_policy():
    x = torch.randn(512)
    x[300] = float("nan")
    with pytest.raises(lq.formats.NonFiniteError):
        get_format("int6").quantize(x)
    values = get_format("int6", nonfinite="nan_block").quantize(x).dequantize()
    assert bool(values[256:].isnan().all()) and bool(values[:256].isfinite().all())


def regression(states, steps: int = 150) -> tuple[float, lq.QAdamW]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
    x = torch.randn(256, 64)
    y = x[:, :1] * 0.5 + x[:, 1:2].sin()
    optimizer = lq.QAdamW(model.parameters(), lr=3e-3, states=states, min_quant_size=0)
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
    return float(loss.detach()), optimizer


def test_dense_states_train_like_int8_and_cost_their_bits():
    int8_loss, int8 = regression("int8")
    dense_loss, dense = regression({"exp_avg": "int4", "exp_avg_sq": "int6"})
    fp32_loss, _ = regression({})
    assert dense_loss < 1.5 * fp32_loss + 1e-3 and int8_loss < 1.5 * fp32_loss + 1e-3, (fp32_loss, int8_loss, dense_loss)
    weight = dense.param_groups[0]["params"][0]  # 64 x 128 = 8192 values: 32 blocks of v, 64 of m
    v, m = dense.state[weight]["exp_avg_sq"], dense.state[weight]["exp_avg"]
    assert v.nbytes == 8192 * 6 // 8 + 4 * 32 and m.nbytes == 8192 // 2 + 2 * 64
    assert lq.state_nbytes(dense) < 0.7 * lq.state_nbytes(int8)


def test_checkpoint_round_trip_keeps_codes_and_format():
    _, optimizer = regression({"exp_avg": "int5", "exp_avg_sq": "int7"}, steps=5)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    _, fresh = regression({"exp_avg": "int5", "exp_avg_sq": "int7"}, steps=1)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    for key, state in optimizer.state.items():
        loaded = fresh.state[dict(zip(optimizer.param_groups[0]["params"], fresh.param_groups[0]["params"], strict=True))[key]]
        for name in ("exp_avg", "exp_avg_sq"):
            fmt, saved = loaded[name].format, state[name].format
            assert (fmt.name, fmt.bits, fmt.block_size, fmt.signed, fmt.scale_dtype) == (
                saved.name, saved.bits, saved.block_size, saved.signed, saved.scale_dtype,
            )  # fmt: skip
            assert torch.equal(loaded[name].codes, state[name].codes) and torch.equal(loaded[name].scales, state[name].scales)
