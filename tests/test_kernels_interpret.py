"""Triton kernels under the interpreter (CPU tensors) against the torch reference of the formats.

How it runs: ``TRITON_INTERPRET=1`` must be set before Triton is imported (``triton.jit``
reads it when a kernel is defined), and the ahead-of-time compile test needs it
unset, so this file never sets it in the test process. In a normal run
(``TRITON_INTERPRET`` unset) the file holds one test, ``test_interpreter_suite``,
which re-runs this same file with ``python -m pytest`` in a subprocess whose
environment has ``TRITON_INTERPRET=1``, and fails with the subprocess's report
if any case fails. In that subprocess (or when you run
``TRITON_INTERPRET=1 python -m pytest tests/test_kernels_interpret.py`` yourself)
the cases below are defined and run in-process.

Checked: round-to-nearest codes and scales identical to ``quantize_reference``
(every format, sizes 0/1/odd/partial block/several blocks, block sizes 32/128/256,
fp32/bf16/fp16 input, zeros, subnormals, huge values, ties, +-inf and NaN blocks);
dequantize identical to ``dequantize_reference`` in fp32/bf16/fp16; SR lands on the
two neighbours with the reference's per-value round-up probability and zero mean
error, and reproduces with a seed; the bf16/fp16 SR casts likewise; zero-free formats
(``signed=False``) never store a positive value as 0, RN and SR, block formats and casts; the
``TritonBackend`` behind the format API.
"""

from __future__ import annotations

import functools
import os

import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRET:
    from cases import run_under_interpreter

    def test_interpreter_suite():
        """Run this file's interpreter cases in a subprocess with ``TRITON_INTERPRET=1``."""
        run_under_interpreter(__file__)

else:
    import torch

    from lightning_qstate import kernels
    from lightning_qstate.formats import (
        BlockFormat,
        CastFormat,
        MinifloatFormat,
        NonFiniteError,
        QuantizedTensor,
        get_format,
        kernel_backend,
    )
    from lightning_qstate.formats import base as formats_base
    from lightning_qstate.formats.cast import fp16_stochastic
    from lightning_qstate.formats.packing import unpack
    from lightning_qstate.formats.rounding import bf16_stochastic
    from lightning_qstate.kernels import (
        KERNELS,
        TritonBackend,
        adam_step_supported,
        triton_dequantize_blocks,
        triton_kernels,
        triton_quantize_blocks,
        triton_stochastic_cast,
    )

    # The interpreter runs casts in numpy, which warns when fp32 -> fp16 overflows to inf (as the tests ask it to).
    pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

    from cases import BLOCK_FORMATS, FORMAT_IDS

    DTYPES = [torch.float32, torch.bfloat16, torch.float16]
    # Kernels this file exercises, and adam_step_kernel (tests/test_kernels_adam_interpret.py); a new kernel in
    # triton_kernels.KERNELS must get a test here.
    COVERED_KERNELS = {"quantize_blocks_kernel", "dequantize_blocks_kernel", "stochastic_cast_kernel", "adam_step_kernel"}

    def block_format(name: str, options: dict, block_size: int) -> BlockFormat:
        return get_format(name, block_size=block_size, nonfinite="nan_block", **options)

    def same_bits(actual: torch.Tensor, expected: torch.Tensor) -> bool:
        """Equal dtype and shape, same NaN positions, and bit-identical elsewhere (so -0.0 != 0.0)."""
        if actual.dtype != expected.dtype or actual.shape != expected.shape:
            return False
        if not actual.is_floating_point():
            return torch.equal(actual, expected)
        nan = torch.isnan(expected)
        if not torch.equal(torch.isnan(actual), nan):
            return False
        int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[actual.element_size()]
        return torch.equal(actual[~nan].view(int_dtype), expected[~nan].view(int_dtype))

    def random_values(numel: int, seed: int) -> torch.Tensor:
        """fp32 values spread over many binades, both signs."""
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(numel, generator=gen) * torch.exp(torch.randn(numel, generator=gen) * 3)

    def decode_table(fmt: BlockFormat) -> torch.Tensor:
        """``fmt.decode_values()`` on the CPU, from the format's table cache."""
        return fmt.tables(torch.device("cpu"))["decode"]

    @functools.cache
    def tie_values(fmt: BlockFormat) -> torch.Tensor:
        """1.0 (so the block absmax is 1 and normalization is exact) then midpoints of adjacent decode values."""
        decoded = torch.unique(decode_table(fmt))  # sorted
        midpoints = (decoded[:-1] + decoded[1:]) / 2
        if isinstance(fmt, MinifloatFormat):  # also exact midpoints in format units
            units = torch.unique(fmt.spec.values().abs())
            midpoints = torch.cat([midpoints, ((units[:-1] + units[1:]) / 2 / fmt.max_value).float()])
        return torch.cat([torch.ones(1), midpoints])

    def special_blocks(fmt: BlockFormat, dtype: torch.dtype, seed: int) -> torch.Tensor:
        """Whole blocks of: zeros, subnormals, huge + tiny, +inf, -inf, NaN, ties; then a partial random block."""
        bs = fmt.block_size
        info = torch.finfo(dtype)
        gen = torch.Generator().manual_seed(seed)
        smallest_subnormal = info.tiny * info.eps  # 2**-149 (fp32), 2**-133 (bf16), 2**-24 (fp16)

        def block(values: torch.Tensor) -> torch.Tensor:
            values = values.float().reshape(-1)
            reps = -(-bs // max(1, values.numel()))
            picked = values.repeat(reps)[:bs]
            if values.numel() > bs:  # a random subset, first value (e.g. the absmax) kept
                picked = torch.cat([values[:1], values[1:][torch.randperm(values.numel() - 1, generator=gen)[: bs - 1]]])
            return picked

        normal = random_values(bs, seed)
        zeros = torch.zeros(bs)
        zeros[1::3] = -0.0
        subnormal = torch.randint(-64, 64, (bs,), generator=gen).float() * smallest_subnormal
        huge_and_tiny = normal.clone()
        huge_and_tiny[0], huge_and_tiny[1], huge_and_tiny[2:6] = info.max, -info.max, smallest_subnormal
        with_inf, with_neg_inf, with_nan = normal.clone(), normal.clone(), normal.clone()
        with_inf[3], with_neg_inf[bs - 1], with_nan[bs // 2] = float("inf"), float("-inf"), float("nan")
        both = normal.clone()
        both[0], both[1] = float("nan"), float("inf")
        ties = block(tie_values(fmt))
        exact_codes = block(decode_table(fmt))  # every code value exactly (normalized by the block's absmax 1)
        partial = random_values(bs // 2 + 1, seed + 1)
        x = torch.cat([zeros, subnormal, huge_and_tiny, with_inf, with_neg_inf, with_nan, both, ties, exact_codes, normal, partial])
        x = torch.where(torch.isfinite(x), x.clamp(-info.max, info.max), x)  # random values stay finite in fp16
        return x.to(dtype)

    def check_round_to_nearest(fmt: BlockFormat, x: torch.Tensor, out_dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
        codes, scales = triton_quantize_blocks(fmt, x, "nearest")
        ref_codes, ref_scales = fmt.quantize_reference(x, "nearest", None)
        where = f"{fmt.name} bits={fmt.bits} block={fmt.block_size} dtype={x.dtype} n={x.numel()}"
        assert codes.dtype == ref_codes.dtype and codes.shape == ref_codes.shape, where
        if not torch.equal(codes, ref_codes):
            bad = (codes != ref_codes).nonzero().flatten()[:8].tolist()
            raise AssertionError(f"{where}: RN codes differ at {bad}: {codes[bad].tolist()} vs reference {ref_codes[bad].tolist()}")
        assert same_bits(scales, ref_scales), f"{where}: scales {scales} vs reference {ref_scales}"
        for out_dtype in out_dtypes:
            values = triton_dequantize_blocks(fmt, ref_codes, ref_scales, x.numel(), out_dtype)
            expected = fmt.dequantize_reference(ref_codes, ref_scales, x.numel()).to(out_dtype)
            assert same_bits(values, expected), f"{where}: dequantize to {out_dtype} differs from the reference"

    # ----------------------------------------------------------------------------------- coverage

    def test_every_kernel_is_listed_and_covered():
        assert triton_kernels.defined_kernels() == set(KERNELS), "every @triton.jit kernel of triton_kernels must be in KERNELS"
        assert set(KERNELS) == COVERED_KERNELS, f"add interpreter tests for {set(KERNELS) - COVERED_KERNELS}"

    # ----------------------------------------------------------------------------------- RN, block formats

    @pytest.mark.parametrize("block_size", [32, 128, 256])
    @pytest.mark.parametrize(("name", "options"), BLOCK_FORMATS, ids=FORMAT_IDS)
    def test_round_to_nearest_matches_reference_bit_for_bit(name, options, block_size):
        """Random fp32 sizes, then the special blocks in one input dtype (each format meets every dtype once
        over the three block sizes), dequantized to fp32, bf16, fp16 and float64 (a float64 parameter's states: it raised)."""
        fmt = block_format(name, options, block_size)
        for size in (0, 1, 7, block_size - 1, block_size + 3, 3 * block_size):
            check_round_to_nearest(fmt, random_values(size, seed=size))
        index = [32, 128, 256].index(block_size)
        dtype = DTYPES[(index + BLOCK_FORMATS.index((name, options))) % len(DTYPES)]
        check_round_to_nearest(fmt, special_blocks(fmt, dtype, seed=index), out_dtypes=(*DTYPES, torch.float64))

    def test_odd_sizes_pad_the_last_nibble_with_zero():
        fmt = block_format("int4", {}, 32)  # the code of 0 is not 0
        codes, _ = triton_quantize_blocks(fmt, torch.zeros(5), "nearest")
        assert codes.numel() == 3 and int(codes[2]) >> 4 == 0 and int(codes[2]) & 0xF != 0

    def test_noncontiguous_input():
        fmt = block_format("fp8_e4m3", {}, 32)
        x = random_values(200, seed=3)[::2]
        codes, scales = triton_quantize_blocks(fmt, x, "nearest")
        ref_codes, ref_scales = fmt.quantize_reference(x, "nearest", None)
        assert torch.equal(codes, ref_codes) and same_bits(scales, ref_scales)

    # ----------------------------------------------------------------------------------- SR, block formats

    SR_REPEATS = 48

    def neighbours(fmt: BlockFormat, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per value of one block ``x``, from the reference: the two SR candidate codes (toward zero / lower value
        first), P(second), and whether the value is representable (between two codes or on one, not clamped)."""
        normalized = (x.float() / x.float().abs().amax()).view(1, -1)
        never = torch.full_like(normalized, 1.0 - 2.0**-24)  # uniform that never rounds up
        always = torch.zeros_like(normalized)  # uniform that rounds up whenever the value is not on a code
        low = fmt.encode(normalized, "stochastic", never).view(-1)
        high = fmt.encode(normalized, "stochastic", always).view(-1)
        decoded = decode_table(fmt).double()
        value = normalized.view(-1).double()
        gap = decoded[high] - decoded[low]
        p_high = torch.where(high == low, 0.0, (value - decoded[low]) / torch.where(gap == 0, 1.0, gap))
        representable = (high != low) | (decoded[low] == value)
        return low, high, p_high, representable

    def check_frequencies(name: str, samples: torch.Tensor, low: torch.Tensor, high: torch.Tensor, p_high: torch.Tensor) -> torch.Tensor:
        """``samples`` ``(repeats, n)``: every sample is ``low`` or ``high``; frequency of ``high`` matches ``p_high``."""
        repeats = samples.shape[0]
        assert bool(((samples == low) | (samples == high)).all()), f"{name}: SR result is not one of the two neighbours"
        moving = high != low
        frequency = (samples == high).double().mean(dim=0)
        p = p_high.clamp(0, 1)
        sigma = (p * (1 - p) / repeats).sqrt()
        worst = ((frequency - p).abs() - 1.0 / repeats)[moving] / sigma[moving].clamp(min=1e-12)
        assert float(worst.max()) < 6.0, f"{name}: a round-up frequency is {float(worst.max()):.1f} sigma off"
        interior = moving & (p > 0.02) & (p < 0.98)
        chi2 = (((frequency - p) / sigma) ** 2)[interior].mean()
        assert 0.75 < float(chi2) < 1.3, f"{name}: chi2/dof {float(chi2):.3f} (round-up frequencies do not follow p)"
        bias = ((frequency - p)[moving].sum() * repeats) / (p * (1 - p) * repeats)[moving].sum().sqrt()
        assert abs(float(bias)) < 5.0, f"{name}: rounding up is biased, z = {float(bias):.1f}"
        return frequency

    def sr_input(fmt: BlockFormat, seed: int) -> torch.Tensor:
        """One block of distinct values (first one = absmax 1), repeated SR_REPEATS times."""
        gen = torch.Generator().manual_seed(seed)
        magnitude = torch.rand(fmt.block_size, generator=gen) ** 4
        sign = torch.where(torch.rand(fmt.block_size, generator=gen) < 0.5, -1.0, 1.0) if fmt.signed else 1.0
        base = magnitude * sign
        base[0] = 1.0
        return base.repeat(SR_REPEATS)

    @pytest.mark.parametrize(("name", "options"), BLOCK_FORMATS, ids=FORMAT_IDS)
    def test_stochastic_rounding_matches_reference_distribution(name, options):
        fmt = block_format(name, options, 1024)
        x = sr_input(fmt, seed=11)
        low, high, p_high, representable = neighbours(fmt, x[: fmt.block_size])
        codes, scales = triton_quantize_blocks(fmt, x, "stochastic", seed=1234)
        _, ref_scales = fmt.quantize_reference(x, "nearest", None)
        assert same_bits(scales, ref_scales)
        numel = x.numel()
        kernel_codes = unpack(codes, fmt.bits, numel).view(SR_REPEATS, -1)
        ref_packed, _ = fmt.quantize_reference(x, "stochastic", torch.Generator().manual_seed(99))
        reference_codes = unpack(ref_packed, fmt.bits, numel).view(SR_REPEATS, -1)
        kernel_freq = check_frequencies(f"{fmt.name} kernel", kernel_codes, low, high, p_high)
        reference_freq = check_frequencies(f"{fmt.name} reference", reference_codes, low, high, p_high)
        # The two frequency vectors agree with each other (two-sample test, same per-value bound).
        p = p_high.clamp(0, 1)
        sigma = (2 * p * (1 - p) / SR_REPEATS).sqrt().clamp(min=1e-12)
        moving = high != low
        assert float((((kernel_freq - reference_freq).abs() - 2.0 / SR_REPEATS) / sigma)[moving].max()) < 6.0
        # Mean error ~ 0: dequantized SR values are unbiased estimates of x (values the codebook clamps excluded).
        values = triton_dequantize_blocks(fmt, codes, scales, numel).double().view(SR_REPEATS, -1)[:, representable]
        error = (values - x.double().view(SR_REPEATS, -1)[:, representable]).mean(dim=0)
        spread = (values.var(dim=0) / SR_REPEATS).sum().sqrt()
        message = f"{fmt.name}: SR mean error {float(error.sum())} vs spread {float(spread)}"
        assert abs(float(error.sum())) < 5 * float(spread) + 1e-12, message

    @pytest.mark.parametrize(("name", "options"), [("int4", {}), ("fp8_e5m2", {}), ("e5m10", {})])
    def test_stochastic_rounding_reproduces_with_a_seed(name, options):
        fmt = block_format(name, options, 128)
        x = random_values(300, seed=5)
        first = triton_quantize_blocks(fmt, x, "stochastic", seed=7)
        again = triton_quantize_blocks(fmt, x, "stochastic", seed=torch.tensor([7]))
        other = triton_quantize_blocks(fmt, x, "stochastic", seed=8)
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
        assert not torch.equal(first[0], other[0])

    SR_SPECIAL_FORMATS = [("int8", {}), ("int4", {"signed": False}), ("fp8_e4m3", {}), ("e2m2", {"signed": False})]

    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize(("name", "options"), SR_SPECIAL_FORMATS)
    def test_stochastic_rounding_special_values(name, options, dtype):
        """Non-finite blocks give NaN scales and the codes of 0; exact code values never move under SR."""
        fmt = block_format(name, options, 32)
        x = special_blocks(fmt, dtype, seed=2)
        codes, scales = triton_quantize_blocks(fmt, x, "stochastic", seed=3)
        ref_codes, ref_scales = fmt.quantize_reference(x, "nearest", None)
        assert same_bits(scales, ref_scales)
        got = unpack(codes, fmt.bits, x.numel()).view(-1)
        expected = unpack(ref_codes, fmt.bits, x.numel()).view(-1)
        padded = torch.nn.functional.pad(x.float(), (0, scales.numel() * fmt.block_size - x.numel())).view(-1, fmt.block_size)
        absmax = padded.abs().amax(dim=1, keepdim=True)
        normalized = (padded / torch.where(absmax > 0, absmax, 1.0)).view(-1)[: x.numel()]
        on_code = torch.isin(normalized, decode_table(fmt)) | ~torch.isfinite(scales).repeat_interleave(fmt.block_size)[: x.numel()]
        assert torch.equal(got[on_code], expected[on_code])

    # ----------------------------------------------------------------------------------- zero-free formats

    ZERO_FREE_FORMATS = [(name, options) for name, options in BLOCK_FORMATS if options.get("signed") is False]
    ZERO_FREE_FORMATS += [("int4_linear", {"signed": False})]

    @pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
    @pytest.mark.parametrize(("name", "options"), ZERO_FREE_FORMATS, ids=[f"{n}-{o}" for n, o in ZERO_FREE_FORMATS])
    def test_zero_free_formats_never_store_zero(name, options, rounding):
        """Blocks of absmax 1 with values down to 1e-30 and exact zeros (16 copies), then an all-zero block: the kernel
        writes no code that reads 0 where the scale is not 0, and ``min_code`` for every value below the smallest
        positive code, as the reference (RN: the reference's codes exactly)."""
        fmt = block_format(name, options, 128)
        one = torch.logspace(-30, 0, 128)
        one[1:40:7] = 0.0
        x = torch.cat([one.repeat(16), torch.zeros(128)])
        codes, scales = triton_quantize_blocks(fmt, x, rounding, seed=3)
        ref_codes, ref_scales = fmt.quantize_reference(x, rounding, torch.Generator().manual_seed(0))
        assert same_bits(scales, ref_scales)
        if rounding == "nearest":
            assert torch.equal(codes, ref_codes)
        got = unpack(codes, fmt.bits, x.numel())
        units = decode_table(fmt)[got.long()]
        assert bool((units[:-128] > 0).all()), f"{fmt.name}: a code that reads 0 in a block of absmax 1"
        smallest = float(decode_table(fmt)[fmt.min_code])
        below = x[:-128] < smallest
        assert bool(below.any()) and bool((got[:-128][below] == fmt.min_code).all())
        assert bool((triton_dequantize_blocks(fmt, codes, scales, x.numel())[-128:] == 0).all())  # scale 0: reads 0

    # ----------------------------------------------------------------------------------- SR casts

    CAST_REPEATS = 64

    def cast_neighbours(fmt: CastFormat, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The two SR candidates of fp32 ``x`` (toward zero first, as fp64) and P(second), from the reference
        (zero-free formats: with ``lift_flushed``, so that a positive value's lower candidate is never 0)."""
        if fmt.dtype == torch.bfloat16:
            low = bf16_stochastic(x, torch.zeros_like(x, dtype=torch.int32))
            high = bf16_stochastic(x, torch.full_like(x, 0xFFFF, dtype=torch.int32))
        else:
            low = fp16_stochastic(x, torch.full_like(x, 1.0 - 2.0**-24))
            high = fp16_stochastic(x, torch.zeros_like(x))
        low, high = fmt.lift_flushed(x, low).double(), fmt.lift_flushed(x, high).double()
        p_high = torch.where(high == low, 0.0, (x.double() - low) / torch.where(high == low, 1.0, high - low))
        return low, high, p_high

    def cast_input(dtype: torch.dtype, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(2048, generator=gen) * torch.exp(torch.randn(2048, generator=gen) * 4)
        if dtype == torch.float16:
            sign = torch.where(torch.rand(512, generator=gen) < 0.5, -1.0, 1.0)
            x[:512] = torch.rand(512, generator=gen) * 2**-14 * sign  # the fp16 subnormal range
            x[512:600] = 65504 + torch.rand(88, generator=gen) * 31  # rounds up to inf or stays at the max
        return x

    @pytest.mark.parametrize("target", ["bf16", "fp16"])
    def test_stochastic_cast_matches_reference_distribution(target):
        fmt = get_format(target)
        base = cast_input(fmt.dtype, seed=4)
        x = base.repeat(CAST_REPEATS)
        low, high, p_high = cast_neighbours(fmt, base)
        got = triton_stochastic_cast(fmt, x, seed=21).double().view(CAST_REPEATS, -1)
        reference = fmt.stochastic_reference(x, torch.Generator().manual_seed(5)).double().view(CAST_REPEATS, -1)
        finite = torch.isfinite(low) & torch.isfinite(high)
        check_frequencies(f"{target} kernel", got[:, finite], low[finite], high[finite], p_high[finite])
        check_frequencies(f"{target} reference", reference[:, finite], low[finite], high[finite], p_high[finite])
        assert bool(((got == low) | (got == high)).all())
        representable = finite & ((high != low) | (low == base.double()))  # not an RN-cast lane past 65504
        error = (got - base.double())[:, representable].mean(dim=0)
        spread = (got[:, representable].var(dim=0) / CAST_REPEATS).sum().sqrt()
        assert abs(float(error.sum())) < 5 * float(spread), f"{target}: SR cast mean error {float(error.sum())} vs spread {float(spread)}"

    @pytest.mark.parametrize("input_dtype", DTYPES)
    @pytest.mark.parametrize("target", ["bf16", "fp16"])
    def test_stochastic_cast_special_values_and_reproducibility(target, input_dtype):
        fmt = get_format(target)
        info = torch.finfo(fmt.dtype)
        specials = [0.0, -0.0, 1.0, -2.5, float("inf"), float("-inf"), float("nan"), info.max, -info.max, info.tiny, info.tiny * info.eps]
        specials += [65504.0, 65519.0, 65520.0, -70000.0, 1e30, 3.0e38, -3.0e38, 1e-40, 3.39e38, -3.3965e38, 3.4e38]  # past bf16's largest
        x = torch.tensor(specials).to(input_dtype)
        x = torch.cat([x, random_values(1001, seed=9).to(input_dtype)])
        out = triton_stochastic_cast(fmt, x, seed=3)
        assert out.dtype == fmt.dtype and out.shape == x.shape
        xf = x.float()
        low, high, _ = cast_neighbours(fmt, xf)
        assert bool(((out.double() == low) | (out.double() == high) | (torch.isnan(out) & torch.isnan(xf))).all())
        # Deterministic lanes: non-finite and (fp16) out-of-range values take the RN cast; exact values stay put.
        fixed = (low == high) | torch.isnan(low)
        expected = fmt.stochastic_reference(xf, torch.Generator().manual_seed(0))
        assert same_bits(out[fixed], expected[fixed])
        past = xf.abs() > info.max  # the RN cast, never rounded up to inf where RN stays finite
        assert bool(past.any()) and same_bits(out[past], xf[past].to(fmt.dtype))
        assert torch.equal(out[:2].float().view(torch.int32), torch.tensor([0.0, -0.0]).view(torch.int32))  # the sign of zero is kept
        assert same_bits(out, triton_stochastic_cast(fmt, x, seed=torch.tensor([3])))
        if input_dtype != fmt.dtype:  # else the cast is exact, whatever the draws
            assert not same_bits(out, triton_stochastic_cast(fmt, x, seed=4))
        assert triton_stochastic_cast(fmt, x[:0], seed=1).numel() == 0

    @pytest.mark.parametrize(("target", "input_dtype"), [("bf16", torch.float32), ("fp16", torch.float32), ("fp16", torch.bfloat16)])
    def test_zero_free_stochastic_cast(target, input_dtype):
        """``signed=False`` casts: a positive value the SR cast would flush to 0 is stored as the smallest subnormal (so
        values below it always are), zeros and negatives are cast as by the plain format; elsewhere the kernel follows
        the reference's distribution."""
        fmt, plain = get_format(target, signed=False), get_format(target)
        spread = torch.rand(1000, generator=torch.Generator().manual_seed(7)) * 64 * fmt.smallest_positive  # the subnormals and below
        base = torch.cat([torch.logspace(-44, 0, 500), spread, torch.tensor([0.0, -0.0, -1e-30, -1e-44])]).to(input_dtype)
        x = base.repeat(CAST_REPEATS)
        got = triton_stochastic_cast(fmt, x, seed=5)
        reference = fmt.stochastic_reference(x.float(), torch.Generator().manual_seed(6))
        positive = x > 0
        assert bool((got[positive] > 0).all()) and bool((reference[positive] > 0).all())
        below = positive & (x.float() < fmt.smallest_positive)
        assert bool(below.any()) and bool((got[below] == fmt.smallest_positive).all())
        unlifted = ~positive
        assert same_bits(got[unlifted], triton_stochastic_cast(plain, x, seed=5)[unlifted])
        low, high, p_high = cast_neighbours(fmt, base.float())  # zero-free neighbours: the lower one is never 0
        check_frequencies(f"{target} zero-free kernel", got.double().view(CAST_REPEATS, -1), low, high, p_high)
        check_frequencies(f"{target} zero-free reference", reference.double().view(CAST_REPEATS, -1), low, high, p_high)

    # ----------------------------------------------------------------------------------- the backend

    def test_backend_is_registered_for_cuda():
        assert isinstance(kernel_backend(torch.device("cuda")), TritonBackend)

    def test_backend_through_the_format_api(monkeypatch):
        """Route CPU tensors to TritonBackend (the interpreter runs them) and use quantize/dequantize as a user would."""
        monkeypatch.setitem(formats_base._KERNEL_BACKENDS, "cpu", TritonBackend())
        x = random_values(777, seed=8).view(7, 111).to(torch.bfloat16)
        for name, options in [("int4", {}), ("fp8_e5m2", {}), ("e5m10", {})]:
            fmt = get_format(name, block_size=64, **options)
            q = fmt.quantize(x)
            assert isinstance(q, QuantizedTensor) and q.shape == x.shape and q.dtype == x.dtype
            ref_codes, ref_scales = fmt.quantize_reference(x.reshape(-1), "nearest", None)
            assert torch.equal(q.codes, ref_codes) and torch.equal(q.scales, ref_scales)
            assert same_bits(q.dequantize(), fmt.dequantize_reference(ref_codes, ref_scales, x.numel()).to(x.dtype).view(x.shape))
            gen = torch.Generator().manual_seed(1)
            first = fmt.quantize(x, "stochastic", gen)
            second = fmt.quantize(x, "stochastic", torch.Generator().manual_seed(1))
            assert torch.equal(first.codes, second.codes)
        fp16 = get_format("fp16")
        a = fp16.quantize(x.float(), "stochastic", torch.Generator().manual_seed(2))
        b = fp16.quantize(x.float(), "stochastic", torch.Generator().manual_seed(2))
        assert a.codes.dtype == torch.float16 and torch.equal(a.codes, b.codes)
        with pytest.raises(TypeError):
            TritonBackend().quantize_blocks(fp16, x.reshape(-1), "nearest", None)
        with pytest.raises(NonFiniteError):  # the kernel's NaN scale feeds the format's nonfinite="raise" check
            get_format("int8").quantize(torch.tensor([1.0, float("inf"), 2.0]))

    def test_blocks_the_kernels_would_spill_take_the_reference(monkeypatch):
        """Past 2048 values a block program spills registers (block 4096: 120 B in the SR Adam step on sm_80), and so does
        the Adam step with more than 32 sub-blocks: the backend quantizes such formats with the torch reference, and the
        dispatcher keeps the Adam step off the kernel (aot_variants compiles the limits without spills)."""
        from lightning_qstate.kernels.triton_kernels import MAX_BLOCK, MAX_SUB_BLOCKS

        monkeypatch.setitem(formats_base._KERNEL_BACKENDS, "cpu", TritonBackend())
        called = []
        monkeypatch.setattr(kernels, "triton_quantize_blocks", lambda *args: called.append(args))
        fmt = get_format("int8", block_size=2 * MAX_BLOCK)
        x = random_values(3 * MAX_BLOCK, seed=3)
        q = fmt.quantize(x)
        assert not called and torch.equal(q.codes, fmt.quantize_reference(x, "nearest", None)[0])
        assert same_bits(q.dequantize(torch.float64), fmt.dequantize_reference(q.codes, q.scales, x.numel()).double())
        unsigned = lambda block: get_format("int8", signed=False, block_size=block)  # noqa: E731
        assert adam_step_supported(get_format("int8", block_size=MAX_BLOCK // MAX_SUB_BLOCKS), unsigned(MAX_BLOCK))
        assert not adam_step_supported(get_format("int8", block_size=MAX_BLOCK // MAX_SUB_BLOCKS // 2), unsigned(MAX_BLOCK))
        assert not adam_step_supported(get_format("int8", block_size=2 * MAX_BLOCK), unsigned(2 * MAX_BLOCK))

    import triton
    import triton.language as tl

    from lightning_qstate.kernels.triton_formats import container_numel

    @triton.jit
    def count_kernel(out_ptr, numel, BITS: tl.constexpr):
        tl.store(out_ptr, container_numel(numel, BITS))

    @pytest.mark.parametrize("bits", [4, 6, 8])
    def test_the_code_container_count_of_a_parameter_near_2_31_values(bits):
        """``container_numel`` of an int32 ``numel`` near 2**31 wrapped (``numel + 7``): every code of such a parameter
        (4-7-bit states) was masked off, never loaded nor stored. The count is taken in int64 (a kernel that stores it:
        such a parameter does not fit here)."""
        numel, out = 2**31 - 1, torch.zeros(1, dtype=torch.int64)
        count_kernel[(1,)](out, numel, BITS=bits)
        assert int(out) == (numel + 1) // 2 if bits <= 4 else int(out) == ((numel + 7) // 8 * bits if bits < 8 else numel)
