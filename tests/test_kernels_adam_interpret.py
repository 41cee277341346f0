"""The fused Adam(W) Triton kernel under the interpreter (CPU tensors) against the torch definition of the step.

Same mechanism as ``tests/test_kernels_interpret.py``: in a normal run this file holds one
test, ``test_interpreter_suite``, which re-runs it in a subprocess with ``TRITON_INTERPRET=1``
(``TRITON_INTERPRET=1 python -m pytest tests/test_kernels_adam_interpret.py`` runs the cases
directly).

The reference is ``kernels.adam_reference.adam_step_quantized`` (decode -> ``adam_math`` -> requantize), whose
rounding contract the kernel shares: every operation rounded once, explicit FMAs where torch's CPU
kernels fuse, a correctly rounded ``sqrt``. The interpreter computes ``sqrt_rn``, ``div_rn`` and the
arithmetic with numpy's IEEE fp32 operations (correctly rounded on every CPU); its ``tl.fma`` rounds
twice, so the ``exact_fma`` fixture makes it round once, with the reference's ``adam_reference.fma``, as the
GPU's ``fma.rn``. So the kernel must match the reference bit for bit, on any CPU.

Checked: round-to-nearest over several steps (int8 signed m / unsigned v, int4, fp8_e4m3, mixed
block sizes, partial last blocks, decoupled and L2 weight decay, maximize, both lerp branches, a
bf16 gradient): parameter, codes, scales and stall counts equal to the reference's; stochastic
rounding: the parameter and scales of the RN step, every code one of the two neighbours of the
exact moment, no mean error, reproducible from a seed; the optimizer dispatch of ``kernels/dispatch.py``
for a Triton device.

Without master weights (a weight grid, ECO's error feedback into ``m``): round-to-nearest on bf16, fp16 and fp32
parameters and grids, with and without ECO, both weight decays, 4-bit and fp8 moments, partial last blocks:
parameter, codes, scales and stall counts equal to ``adam_step_quantized``'s; SR of the weights: reproducible from
its seed, every value one of the two grid neighbours of the fp32 update, unbiased over many draws, ECO fed with
the error of the drawn value; ``QAdamW(weights="bf16", error_feedback="eco")`` on a Triton device takes the
``triton`` path and equals the reference path bit for bit.
"""

from __future__ import annotations

import os

import pytest

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

if not INTERPRET:
    from cases import run_under_interpreter

    def test_interpreter_suite():
        """Run this file's interpreter cases in a subprocess with ``TRITON_INTERPRET=1``."""
        run_under_interpreter(__file__)

else:
    import numpy as np
    import torch
    from test_adam_reference import correctly_rounded_torch_sqrt, torch_rounds_once
    from triton.runtime import interpreter

    from lightning_qstate import QAdamW
    from lightning_qstate.formats import BlockFormat, CastFormat, QuantizedTensor, get_format
    from lightning_qstate.formats.packing import as_blocks, unpack
    from lightning_qstate.kernels import adam_reference, adam_step_supported, dispatch, triton_adam_step
    from lightning_qstate.kernels.adam_reference import adam_hyper, adam_step_quantized

    @pytest.fixture(autouse=True)
    def exact_fma(monkeypatch):
        """``tl.fma`` rounding once, as the GPU's ``fma.rn``: ``adam_reference.fma`` (``tests/test_adam_reference.py`` checks it)."""

        def create_fma(self, x, y, z):
            exact = adam_reference.fma(*(torch.from_numpy(np.asarray(h.data, dtype=np.float32)) for h in (x, y, z)))
            return interpreter.TensorHandle(exact.numpy(), z.dtype.scalar)

        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fma", create_fma)

    def moment_format(spec: tuple[str, dict]) -> BlockFormat:
        name, options = spec
        return get_format(name, **options)

    def group_options(lr=1e-3, betas=(0.9, 0.999), weight_decay=1e-2, eps=1e-8, decoupled_weight_decay=True) -> dict:
        """The options ``adam_hyper`` reads (``decoupled_weight_decay`` only for ``eco_coefficient``)."""
        return {"lr": lr, "betas": betas, "weight_decay": weight_decay, "eps": eps, "decoupled_weight_decay": decoupled_weight_decay}

    def unheld(hyper: dict) -> dict:
        """``hyper`` with no hold of ``m``, as ECO's parameters take it (``kernels.bounds.held_moment_bound``)."""
        return {**hyper, "moment_bound": torch.tensor(float("inf"))}

    def quiet(numel: int) -> torch.Tensor:
        """Every fourth entry: parameter and moments start at 0 and gradients are tiny there, so that updates
        (also with L2 weight decay) stall at the code of 0."""
        return torch.arange(numel) % 4 == 0

    def initial_state(m_format: BlockFormat, v_format: BlockFormat, numel: int, seed: int):
        """fp32 param and quantized moments of mixed magnitudes, 0 at the ``quiet`` entries."""
        gen = torch.Generator().manual_seed(seed)
        spread = torch.exp(torch.randn(numel, generator=gen))
        param = torch.randn(numel, generator=gen).masked_fill(quiet(numel), 0.0)
        m = torch.randn(numel, generator=gen) * 1e-2 * spread
        v = torch.rand(numel, generator=gen) * 1e-4 * spread
        return param, m_format.quantize(m.masked_fill(quiet(numel), 0.0)), v_format.quantize(v.masked_fill(quiet(numel), 0.0))

    def gradient(numel: int, seed: int) -> torch.Tensor:
        """Gradients over several binades, tiny (1e-9 x) at the ``quiet`` entries."""
        gen = torch.Generator().manual_seed(seed)
        grad = torch.randn(numel, generator=gen) * 1e-2 * torch.exp(torch.randn(numel, generator=gen))
        return torch.where(quiet(numel), grad * 1e-9, grad)

    def clone(q: QuantizedTensor) -> QuantizedTensor:
        return QuantizedTensor(q.format, q.codes.clone(), q.scales.clone(), q.shape, q.dtype)

    def code_agreement(a: QuantizedTensor, b: QuantizedTensor) -> tuple[float, int]:
        """Fraction of equal (unpacked) codes, and the number of differing ones."""
        codes_a = unpack(a.codes, a.format.bits, a.numel)
        codes_b = unpack(b.codes, b.format.bits, b.numel)
        differing = int((codes_a != codes_b).sum())
        return 1.0 - differing / a.numel, differing

    # ----------------------------------------------------------------------------------- RN against the reference

    S8, U8 = ("int8", {}), ("int8", {"signed": False})
    S4, U4 = ("int4", {}), ("int4", {"signed": False})
    E4M3 = ("fp8_e4m3", {})
    RN_CASES = [
        # (m format, v format, numel, decoupled, maximize, group options, grad dtype)
        pytest.param(S8, U8, 3 * 256 + 77, True, False, group_options(), torch.float32, id="int8-adamw"),
        pytest.param(S4, U4, 5 * 128 + 33, False, True, group_options(weight_decay=0.1), torch.float32, id="int4-l2-maximize"),
        pytest.param(E4M3, E4M3, 2 * 256 + 1, True, True, group_options(betas=(0.3, 0.99)), torch.float32, id="fp8-large-lerp-weight"),
        pytest.param(S8, U4, 4 * 256 + 130, False, False, group_options(), torch.bfloat16, id="int8-int4-sub-blocks-bf16-grad"),
        pytest.param(S4, ("int6", {"signed": False}), 3 * 256 + 77, False, False, group_options(), torch.float32, id="int4-int6-dense-v"),
        pytest.param(("int5", {}), ("e3m3", {"signed": False}), 2 * 256 + 9, True, False, group_options(), torch.float32, id="dense-m-v"),
        pytest.param(
            ("fp8_e4m3", {"block_size": 32}),
            ("int8", {"signed": False, "block_size": 128}),
            3 * 128 + 45,
            True,
            False,
            group_options(lr=3e-2),
            torch.float32,
            id="fp8-32-int8-128",
        ),  # fmt: skip
        pytest.param(
            ("int8", {"scale_dtype": "fp32"}),
            ("int4", {"signed": False, "scale_dtype": "bf16"}),
            2 * 256 + 3,
            True,
            False,
            group_options(),
            torch.float32,
            id="fp32-m-scales-bf16-v-sub-block-scales",
        ),  # fmt: skip
    ]

    @pytest.mark.parametrize(("m_spec", "v_spec", "numel", "decoupled", "maximize", "options", "grad_dtype"), RN_CASES)
    def test_round_to_nearest_matches_reference(m_spec, v_spec, numel, decoupled, maximize, options, grad_dtype):
        m_format, v_format = moment_format(m_spec), moment_format(v_spec)
        param, m, v = initial_state(m_format, v_format, numel, seed=numel)
        ref_param, ref_m, ref_v = param.clone(), clone(m), clone(v)
        stalled = torch.zeros(4, dtype=torch.int64)
        for step in range(1, 4):
            grad = gradient(numel, seed=100 * step + numel).to(grad_dtype)
            hyper = adam_hyper(options, float(step))
            counts = triton_adam_step(param, grad, m, v, hyper, "nearest", decoupled, maximize, track_stalls=True)
            ref_counts = adam_step_quantized(
                ref_param, grad.float(), ref_m.codes, ref_m.scales, ref_v.codes, ref_v.scales, hyper,
                m_format, v_format, "nearest", decoupled, maximize, True,
            )  # fmt: skip
            where = f"step {step}"
            assert torch.equal(param, ref_param), f"{where}: parameters differ"
            assert code_agreement(m, ref_m) == (1.0, 0) and code_agreement(v, ref_v) == (1.0, 0), f"{where}: codes differ"
            assert torch.equal(m.scales, ref_m.scales) and torch.equal(v.scales, ref_v.scales), f"{where}: scales differ"
            assert torch.equal(counts, ref_counts), f"{where}: stall counts {counts.tolist()} vs {ref_counts.tolist()}"
            assert int(counts[1]) > 0 and int(counts[3]) > 0
            stalled += ref_counts
        assert int(stalled[0]) > 0, "the case should exercise stalled entries"

    def test_hold_of_m_matches_reference():
        """The updated ``m`` held to ``max(sqrt(v), 2^-63) * K`` (``adam_reference.hold_moment``) as the reference holds
        it: a zero gradient makes the updated moments ``0.9 m`` and ``0.999 v``, with ``m`` from far inside the limit to
        past it and ``v`` of every magnitude (0 and subnormal: the floor; up to 3e38). fp32 scales, ``v`` codes of 1.0
        and ``m`` codes of 1.0 (or random) make the decoded moments the scales."""
        m_format = get_format("int8", scale_dtype="fp32", block_size=64)
        v_format = get_format("int8", signed=False, scale_dtype="fp32", block_size=64)
        hyper = adam_hyper(group_options(weight_decay=0.0), 4.0)
        v_scales = torch.tensor([0.0, 1e-44, 1e-38, 1e-30, 2.5e-9, 1.0, 3e38]).repeat_interleave(4)
        roots = torch.sqrt((v_scales * hyper["beta2"]).double()).float().clamp(min=adam_reference.ROOT_FLOOR)
        m_scales = roots * hyper["moment_bound"] / 0.9 * torch.tensor([0.5, 1.0, 1.0 + 2**-22, 1.2]).repeat(7)
        numel = 64 * v_scales.numel()
        gen = torch.Generator().manual_seed(0)
        one = int((m_format.codebook == 1.0).nonzero())
        m_codes = torch.where(torch.rand(numel, generator=gen) < 0.5, one, torch.randint(0, 256, (numel,), generator=gen))
        m = QuantizedTensor(m_format, m_codes.to(torch.uint8), m_scales.clone(), (numel,), torch.float32)
        v_codes = torch.full((numel,), v_format.codebook.numel() - 1, dtype=torch.uint8)
        v = QuantizedTensor(v_format, v_codes, v_scales.clone(), (numel,), torch.float32)
        param, grad = torch.randn(numel, generator=gen), torch.zeros(numel)
        ref_param, ref_m, ref_v = param.clone(), clone(m), clone(v)
        triton_adam_step(param, grad, m, v, hyper, "nearest", True, False, track_stalls=False)
        adam_step_quantized(
            ref_param, grad, ref_m.codes, ref_m.scales, ref_v.codes, ref_v.scales, hyper, m_format, v_format, "nearest",
            True, False, False,
        )  # fmt: skip
        assert torch.equal(param, ref_param)
        assert code_agreement(m, ref_m) == (1.0, 0) and code_agreement(v, ref_v) == (1.0, 0)
        assert torch.equal(m.scales, ref_m.scales) and torch.equal(v.scales, ref_v.scales)
        limits = roots * hyper["moment_bound"]
        assert bool((ref_m.scales <= limits).all()) and bool((ref_m.scales == limits).sum() >= 14)  # held where past it

    def test_changed_hyperparameters_take_effect():
        """A new learning rate or beta takes effect at once (the kernel reads them from its coefficient vector)."""
        fmt_m, fmt_v = moment_format(S8), moment_format(U8)
        param, m, v = initial_state(fmt_m, fmt_v, 300, seed=1)
        grad = gradient(300, seed=2)
        results = []
        for options in (group_options(lr=1e-3), group_options(lr=1e-2), group_options(lr=1e-2, betas=(0.8, 0.99))):
            p, mm, vv = param.clone(), clone(m), clone(v)
            triton_adam_step(p, grad, mm, vv, adam_hyper(options, 2.0), "nearest", True, False)
            ref_p, ref_m, ref_v = param.clone(), clone(m), clone(v)
            adam_step_quantized(
                ref_p, grad, ref_m.codes, ref_m.scales, ref_v.codes, ref_v.scales, adam_hyper(options, 2.0),
                fmt_m, fmt_v, "nearest", True, False, False,
            )  # fmt: skip
            assert torch.equal(p, ref_p)
            results.append(p)
        assert not torch.equal(results[0], results[1]) and not torch.equal(results[1], results[2])

    # ----------------------------------------------------------------------------------- SR

    def exact_moments(param, grad, m, v, hyper, decoupled):
        """The fp32 moments of the step before quantization (the reference's math on decoded moments)."""
        exp_avg = m.format.dequantize_reference(m.codes, m.scales, m.numel)
        exp_avg_sq = v.format.dequantize_reference(v.codes, v.scales, v.numel)
        adam_reference.adam_math(param.clone(), grad, exp_avg, exp_avg_sq, hyper, decoupled, False)
        return exp_avg, exp_avg_sq

    def check_stochastic(name: str, fmt: BlockFormat, stored: QuantizedTensor, exact: torch.Tensor) -> None:
        """Every code is one of the two SR neighbours of the exact value, and the stored values have no mean error."""
        numel = exact.numel()
        blocks = as_blocks(exact, fmt.block_size)
        scale = fmt.stored_scale(blocks.abs().amax(dim=1, keepdim=True))
        normalized = (blocks / torch.where(scale > 0, scale, 1.0)).view(-1)[:numel]
        low = fmt.encode(normalized, "stochastic", torch.full_like(normalized, 1.0 - 2.0**-24))
        high = fmt.encode(normalized, "stochastic", torch.zeros_like(normalized))
        codes = unpack(stored.codes, fmt.bits, numel)
        assert bool(((codes == low) | (codes == high)).all()), f"{name}: an SR code is not a neighbour of the exact value"
        decode = fmt.tables(torch.device("cpu"))["decode"].double()
        scale = torch.repeat_interleave(stored.scales.double(), fmt.block_size)[:numel]
        value, low_value, high_value = exact.double(), decode[low] * scale, decode[high] * scale
        values = decode[codes] * scale
        moving = high != low
        assert int(moving.sum()) > numel // 3, name  # zero-free int4 v holds every value under 1/15 of the scale at 1/15
        error = (values - value)[moving].sum()
        spread = ((high_value - value) * (value - low_value))[moving].clamp(min=0).sum().sqrt()
        assert abs(float(error)) < 5 * float(spread), f"{name}: SR mean error {float(error):.3g} vs spread {float(spread):.3g}"
        assert int((codes != low)[moving].sum()) > 0 and int((codes != high)[moving].sum()) > 0, f"{name}: SR never/always rounds up"

    SR_CASES = [pytest.param(S8, U8, id="int8"), pytest.param(S4, U4, id="int4"), pytest.param(E4M3, E4M3, id="fp8_e4m3")]

    @pytest.mark.parametrize(("m_spec", "v_spec"), SR_CASES)
    def test_stochastic_rounding_is_unbiased(m_spec, v_spec):
        m_format, v_format = moment_format(m_spec), moment_format(v_spec)
        numel = 16 * 256 + 100
        param, m, v = initial_state(m_format, v_format, numel, seed=7)
        grad = gradient(numel, seed=8)
        hyper = adam_hyper(group_options(), 3.0)
        exact_m, exact_v = exact_moments(param, grad, m, v, hyper, True)
        rn = (param.clone(), clone(m), clone(v))
        triton_adam_step(rn[0], grad, rn[1], rn[2], hyper, "nearest", True, False)
        sr = (param.clone(), clone(m), clone(v))
        triton_adam_step(sr[0], grad, sr[1], sr[2], hyper, "stochastic", True, False, seed=torch.tensor([11, 12]))
        assert torch.equal(sr[0], rn[0]), "the parameter update does not depend on the rounding of the stored moments"
        assert torch.equal(sr[1].scales, rn[1].scales) and torch.equal(sr[2].scales, rn[2].scales)
        check_stochastic(f"{m_format.name} m", m_format, sr[1], exact_m)
        check_stochastic(f"{v_format.name} v", v_format, sr[2], exact_v)
        assert code_agreement(sr[1], rn[1])[0] < 1.0 and code_agreement(sr[2], rn[2])[0] < 1.0
        again = (param.clone(), clone(m), clone(v))
        triton_adam_step(again[0], grad, again[1], again[2], hyper, "stochastic", True, False, seed=torch.tensor([11, 12]))
        assert torch.equal(again[1].codes, sr[1].codes) and torch.equal(again[2].codes, sr[2].codes)

    def test_stochastic_streams_of_m_and_v_differ():
        """m and v draw from different seeds: given the same values in the same format, they round differently.

        With ``betas=(0.5, 0.5)``, no weight decay, a gradient of ones and ``m == v``, both new moments are
        ``(1 + old) / 2`` (up to an ulp).
        """
        fmt = moment_format(U8)
        numel = 2048
        param, _, v = initial_state(fmt, fmt, numel, seed=3)
        m = clone(v)
        hyper = adam_hyper(group_options(betas=(0.5, 0.5), weight_decay=0.0), 50.0)  # late: |m| <= sqrt(v) never binds
        rn_m, rn_v = clone(m), clone(v)
        triton_adam_step(param.clone(), torch.ones(numel), rn_m, rn_v, hyper, "nearest", True, False)
        assert code_agreement(rn_m, rn_v)[0] > 0.99
        triton_adam_step(param, torch.ones(numel), m, v, hyper, "stochastic", True, False, seed=5)
        assert code_agreement(m, v)[0] < 0.9

    # ----------------------------------------------------------------------------------- the optimizer dispatch

    def test_optimizer_steps_triton_devices_with_the_kernel(monkeypatch):
        """With "cpu" taken for a Triton device, QAdamW's step runs triton_adam_step and matches the reference."""
        monkeypatch.setattr(dispatch, "TRITON_DEVICE_TYPES", ("cuda", "cpu"))
        monkeypatch.setattr(dispatch, "native_kernel_available", lambda: False)  # the C++ step would come first on "cpu"
        calls = []
        launcher = dispatch.triton_adam_step

        def spy(*args, **kwargs):
            calls.append(args[0].shape)
            return launcher(*args, **kwargs)

        monkeypatch.setattr(dispatch, "triton_adam_step", spy)
        gen = torch.Generator().manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(40, 130, generator=gen))  # 5200 values: a partial last block
        opt = QAdamW([weight], lr=1e-2, states={"exp_avg": "int8", "exp_avg_sq": "int4"}, track_stalls=True)
        ref_param = weight.detach().clone()
        ref_m = ref_v = None
        group = opt.param_groups[0]
        for step in range(1, 4):
            weight.grad = torch.randn(40, 130, generator=gen) * 1e-2
            opt.step()
            state = opt.state[weight]
            if ref_m is None:  # the states as created at the first step: zeros
                ref_m = state["exp_avg"].format.quantize(torch.zeros(weight.numel()))
                ref_v = state["exp_avg_sq"].format.quantize(torch.zeros(weight.numel()))
            adam_step_quantized(
                ref_param.view(-1), weight.grad.view(-1), ref_m.codes, ref_m.scales, ref_v.codes, ref_v.scales,
                adam_hyper(group, float(step)), ref_m.format, ref_v.format, "nearest", True, False, False,
            )  # fmt: skip
            assert torch.equal(weight.detach(), ref_param)
            assert code_agreement(state["exp_avg"], ref_m)[0] == 1.0 and code_agreement(state["exp_avg_sq"], ref_v)[0] == 1.0
        assert len(calls) == 3 and float(state["step"]) == 3.0
        stats = opt.stall_stats()
        assert set(next(iter(stats.values()))) == {"exp_avg", "exp_avg_sq"}

    def test_cast_format_moments_fall_back_to_the_eager_step(monkeypatch):
        monkeypatch.setattr(dispatch, "TRITON_DEVICE_TYPES", ("cuda", "cpu"))
        monkeypatch.setattr(dispatch, "native_kernel_available", lambda: False)  # the C++ step would come first on "cpu"
        assert adam_step_supported(get_format("int8"), get_format("fp8_e5m2"))
        assert not adam_step_supported(get_format("bf16"), get_format("int8"))
        weight = torch.nn.Parameter(torch.randn(80, 80))
        opt = QAdamW([weight], states={"exp_avg": "bf16", "exp_avg_sq": "int8"})
        weight.grad = torch.randn(80, 80)
        opt.step()
        state = opt.state[weight]
        assert opt.step_paths() == {"param0": "reference"}
        assert state["exp_avg"].format.name == "bf16" and float(state["step"]) == 1.0

    # ----------------------------------------------------------------------------------- without master weights (ECO)

    F8, F8_32, E5M2 = ("fp8_e4m3", {}), ("fp8_e4m3", {"block_size": 32}), ("fp8_e5m2", {})
    WEIGHT_CASES = [
        # (m format, v format, numel, decoupled, group options, parameter (and gradient) dtype, grid, eco)
        pytest.param(S8, U8, 3 * 256 + 77, True, group_options(), torch.bfloat16, "bf16", True, id="int8-bf16-eco"),
        pytest.param(S4, U4, 5 * 128 + 33, False, group_options(weight_decay=0.1), torch.float16, "fp16", True, id="int4-fp16-l2-eco"),
        pytest.param(F8, E5M2, 2 * 256 + 1, True, group_options(betas=(0.3, 0.99)), torch.float32, "bf16", True, id="fp8-fp32-param-eco"),
        pytest.param(S8, U4, 4 * 256 + 130, False, group_options(), torch.bfloat16, "bf16", False, id="int8-int4-bf16-no-feedback"),
        pytest.param(F8_32, U8, 3 * 256 + 45, True, group_options(lr=3e-2), torch.float16, "bf16", True, id="fp8-32-fp16-param-bf16-eco"),
        pytest.param(S8, U8, 2 * 256 + 3, False, group_options(), torch.float32, "fp16", False, id="int8-fp32-param-fp16-grid"),
        pytest.param(S4, U4, 2 * 128 + 7, True, group_options(), torch.float16, "fp32", True, id="int4-fp16-param-fp32-grid-eco"),
        pytest.param(S8, U8, 256 + 9, True, group_options(), torch.bfloat16, None, False, id="int8-bf16-param-no-grid"),
    ]

    @pytest.mark.parametrize(("m_spec", "v_spec", "numel", "decoupled", "options", "dtype", "grid", "eco"), WEIGHT_CASES)
    def test_weight_grid_round_to_nearest_matches_reference(m_spec, v_spec, numel, decoupled, options, dtype, grid, eco):
        """Param (in its dtype), codes, scales and stall counts of three steps equal ``adam_step_quantized``'s; the
        parameter stays on the grid; ECO changes the stored ``m`` (against the reference without it, nor the hold of
        ``m`` that ECO's parameters skip)."""
        m_format, v_format = moment_format(m_spec), moment_format(v_spec)
        weight_format = get_format(grid) if grid is not None else None
        options = {**options, "decoupled_weight_decay": decoupled}  # eco_coefficient reads it
        fp32_param, m, v = initial_state(m_format, v_format, numel, seed=numel)
        param = (weight_format.quantize_reference(fp32_param, "nearest", None)[0] if grid else fp32_param).to(dtype)
        initial, ref_param, ref_m, ref_v = param.clone(), param.clone(), clone(m), clone(v)
        plain_param, plain_m, plain_v = param.clone(), clone(m), clone(v)  # the reference without ECO
        for step in range(1, 4):
            grad = gradient(numel, seed=100 * step + numel).to(dtype)
            hyper = adam_hyper(options, float(step))
            weights = (weight_format, "nearest", eco)
            counts = triton_adam_step(param, grad, m, v, hyper, "nearest", decoupled, False, True, None, *weights)
            ref_counts = adam_step_quantized(
                ref_param, grad, ref_m.codes, ref_m.scales, ref_v.codes, ref_v.scales, hyper,
                m_format, v_format, "nearest", decoupled, False, True, *weights,
            )  # fmt: skip
            adam_step_quantized(
                plain_param, grad, plain_m.codes, plain_m.scales, plain_v.codes, plain_v.scales, unheld(hyper) if eco else hyper,
                m_format, v_format, "nearest", decoupled, False, False, weight_format, "nearest", False,
            )  # fmt: skip
            where = f"step {step}"
            assert param.dtype == dtype and torch.equal(param, ref_param), f"{where}: parameters differ"
            assert code_agreement(m, ref_m) == (1.0, 0) and code_agreement(v, ref_v) == (1.0, 0), f"{where}: codes differ"
            assert torch.equal(m.scales, ref_m.scales) and torch.equal(v.scales, ref_v.scales), f"{where}: scales differ"
            assert torch.equal(counts, ref_counts), f"{where}: stall counts {counts.tolist()} vs {ref_counts.tolist()}"
            if grid is not None and dtype in (torch.float32, weight_format.dtype):  # a parameter that holds every grid value
                on_grid = weight_format.quantize_reference(param.float(), "nearest", None)[0].float()
                assert torch.equal(on_grid, param.float()), f"{where}: off the grid"
        assert not torch.equal(param, initial) and int(counts[1]) > 0
        if eco and grid != "fp32":
            assert code_agreement(m, plain_m)[1] > 0, "ECO's feedback should change some codes of m"
        else:  # no feedback, or the error of the fp32 grid: 0
            assert code_agreement(m, plain_m) == (1.0, 0) and torch.equal(param, plain_param)

    def test_eco_coefficient_is_read_from_the_vector():
        """ECO reads its coefficient from the coefficient vector: 0 gives the step without feedback (nor the hold of ``m``,
        which ECO's parameters skip)."""
        m_format, v_format = moment_format(S8), moment_format(U8)
        fp32_param, m, v = initial_state(m_format, v_format, 700, seed=4)
        param, grad = fp32_param.bfloat16(), gradient(700, seed=5).bfloat16()
        hyper = adam_hyper(group_options(), 1.0)
        bf16 = get_format("bf16")
        results = []
        for coefficient in (hyper["eco_coefficient"], torch.tensor(0.0)):
            p, mm, vv = param.clone(), clone(m), clone(v)
            options = ("nearest", True, False, False, None, bf16, "nearest", True)  # ..., weight grid, its rounding, eco
            triton_adam_step(p, grad, mm, vv, {**hyper, "eco_coefficient": coefficient}, *options)
            results.append((p, mm))
        p, mm, vv = param.clone(), clone(m), clone(v)
        triton_adam_step(p, grad, mm, vv, unheld(hyper), "nearest", True, False, False, None, bf16, "nearest", False)
        assert torch.equal(results[1][0], p) and code_agreement(results[1][1], mm) == (1.0, 0)
        assert torch.equal(results[0][0], p) and code_agreement(results[0][1], mm)[1] > 0

    def test_weight_grid_arguments_are_checked():
        m_format, v_format = moment_format(S8), moment_format(U8)
        param, m, v = initial_state(m_format, v_format, 300, seed=1)
        hyper = adam_hyper(group_options(), 1.0)
        with pytest.raises(ValueError, match="only with a grid"):
            triton_adam_step(param, gradient(300, 2), m, v, hyper, "nearest", True, False, False, None, None, "nearest", True)
        with pytest.raises(TypeError, match="cast format"):
            triton_adam_step(param, gradient(300, 2), m, v, hyper, "nearest", True, False, False, None, get_format("int8"))
        with pytest.raises(TypeError, match="zero-free"):
            triton_adam_step(param, gradient(300, 2), m, v, hyper, "nearest", True, False, False, None, get_format("bf16", signed=False))
        with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
            triton_adam_step(param.double(), gradient(300, 2), m, v, hyper)

    # ----------------------------------------------------------------------------------- SR of the weights

    def grid_neighbours(fmt: CastFormat, exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The grid values just below and just above fp32 ``exact`` (equal where it is on the grid), as fp32: the SR cast
        with a draw that never / always rounds the magnitude up."""
        if fmt.dtype == torch.bfloat16:
            from lightning_qstate.formats.rounding import bf16_stochastic

            down, up = (bf16_stochastic(exact, torch.full_like(exact, bits, dtype=torch.int32)).float() for bits in (0, 0xFFFF))
        else:
            from lightning_qstate.formats.cast import fp16_stochastic

            down, up = (fp16_stochastic(exact, torch.full_like(exact, uniform)).float() for uniform in (1.0 - 2.0**-24, 0.0))
        return torch.minimum(down, up), torch.maximum(down, up)

    @pytest.mark.parametrize("grid", ["bf16", "fp16"])
    def test_weight_stochastic_rounding(grid):
        """32 copies of one block: every stored value one of the two grid neighbours of the fp32 update, the average
        over the copies unbiased (chi-square per value near 1), reproducible from the seeds, ``m`` fed with the error
        of the value drawn, and the moments' RN codes otherwise those of the reference."""
        fmt = get_format(grid)
        m_format, v_format = moment_format(S8), moment_format(U8)
        copies, block = 32, 256
        base_param, base_m, base_v = initial_state(m_format, v_format, block, seed=21)
        dtype = fmt.dtype
        param = (base_param * 1e-2).to(dtype).repeat(copies)  # small values: wide relative steps, fp16 subnormals too
        m = m_format.quantize(m_format.dequantize(base_m).repeat(copies))
        v = v_format.quantize(v_format.dequantize(base_v).repeat(copies))
        grad = gradient(block, seed=22).repeat(copies).to(dtype)
        hyper = adam_hyper(group_options(lr=1e-2), 2.0)
        exact_m = m_format.dequantize_reference(m.codes, m.scales, m.numel)
        exact_v = v_format.dequantize_reference(v.codes, v.scales, v.numel)
        exact = adam_reference.adam_math(param.float(), grad.float(), exact_m, exact_v, unheld(hyper), True, False)  # ECO: no hold

        seeds = torch.tensor([0, 0, 12345])
        runs = []
        for seed in (seeds, seeds, torch.tensor([0, 0, 777])):
            p, mm, vv = param.clone(), clone(m), clone(v)
            triton_adam_step(p, grad, mm, vv, hyper, "nearest", True, False, False, seed, fmt, "stochastic", True)
            runs.append((p, mm, vv))
        (stored, sm, sv), again, other = runs
        assert torch.equal(again[0], stored) and torch.equal(again[1].codes, sm.codes), "not reproducible from the seed"
        assert not torch.equal(other[0], stored), "another weight seed should draw other values"

        values = stored.float()
        low, high = grid_neighbours(fmt, exact)
        assert bool(((values == low) | (values == high)).all()), "a stored weight is not a grid neighbour of the update"
        moving = (high != low).view(copies, block)[0]
        assert int(moving.sum()) > block // 2
        gap = (high - low).view(copies, block)[0]
        p_up = ((exact - low).view(copies, block)[0] / torch.where(gap > 0, gap, 1.0)).double()
        frequency = (values == high).view(copies, block).double().mean(dim=0)
        middle = moving & (p_up > 0.05) & (p_up < 0.95)
        assert int(middle.sum()) > block // 4
        chi2 = ((frequency - p_up) ** 2 * copies / (p_up * (1 - p_up)))[middle].mean()
        assert float(chi2) < 1.6, f"SR of the weights is biased: chi-square per value {float(chi2):.2f}"
        assert float(chi2) > 0.4, f"SR draws look correlated across copies: chi-square per value {float(chi2):.2f}"

        # m: the RN codes of the updated m plus ECO's feedback of the error of the drawn values; v: untouched by it.
        expected_m = adam_reference.eco_feedback(exact_m, adam_reference.adam_denominator(exact_v, hyper), exact - values, hyper)
        codes, scales = m_format.quantize_reference(expected_m, "nearest", None)
        assert torch.equal(sm.codes, codes) and torch.equal(sm.scales, scales)
        codes, scales = v_format.quantize_reference(exact_v, "nearest", None)
        assert torch.equal(sv.codes, codes) and torch.equal(sv.scales, scales)

    @pytest.mark.parametrize("grid", ["bf16", "fp16"])
    @pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
    def test_weight_grid_saturates(grid, rounding):
        """fp32 weights pushed past the grid's largest value (both signs) stay at it, RN and SR, with ECO's ``m`` finite
        (``CastFormat.round_saturated``: the cast made them inf); RN gives the reference's weights and codes."""
        fmt = get_format(grid)
        largest = torch.finfo(fmt.dtype).max
        m_format, v_format = moment_format(S8), moment_format(U8)
        numel = 2 * 256 + 7
        m, v = m_format.quantize(torch.zeros(numel)), v_format.quantize(torch.zeros(numel))
        outward = torch.where(torch.arange(numel) % 2 == 0, 1.0, -1.0)
        param, grad = outward * largest, -outward
        ref_param, ref_m, ref_v = param.clone(), clone(m), clone(v)
        hyper = adam_hyper(group_options(lr=largest / 256, weight_decay=0.0), 1.0)  # the first step moves each weight by lr: to inf
        triton_adam_step(param, grad, m, v, hyper, "nearest", True, False, False, torch.tensor([0, 0, 5]), fmt, rounding, True)
        assert torch.equal(param, outward * largest) and bool(torch.isfinite(m.scales).all())
        if rounding == "nearest":
            adam_step_quantized(
                ref_param, grad, ref_m.codes, ref_m.scales, ref_v.codes, ref_v.scales, hyper,
                m_format, v_format, "nearest", True, False, False, fmt, "nearest", True,
            )  # fmt: skip
            assert torch.equal(param, ref_param) and code_agreement(m, ref_m) == (1.0, 0) and torch.equal(m.scales, ref_m.scales)

    # ----------------------------------------------------------------------------------- dispatch without master weights

    def test_eco_optimizer_takes_the_kernel_and_equals_the_reference_path(monkeypatch):
        """``QAdamW(weights="bf16", error_feedback="eco")`` on a bf16 parameter: the ``triton`` path on a Triton device,
        bit for bit the reference path's parameter and moments (``cpu_compile=False`` on the CPU; torch's ``sqrt``
        made correctly rounded, as ``adam_math`` is)."""
        if not torch_rounds_once():
            pytest.skip("torch's CPU kernels round a * b + c twice here: the reference path is not adam_math")
        gen = torch.Generator().manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(40, 130, generator=gen).bfloat16())  # 5200 values: a partial last block
        twin = torch.nn.Parameter(weight.detach().clone())
        options = {"lr": 1e-2, "states": {"exp_avg": "int8", "exp_avg_sq": "int8"}, "weights": "bf16", "error_feedback": "eco"}
        opt = QAdamW([weight], weight_rounding="nearest", **options)
        reference = QAdamW([twin], weight_rounding="nearest", **options)
        opt.cpu_compile = reference.cpu_compile = False  # no native (C++) path for "cpu" parameters
        calls = []
        launcher = dispatch.triton_adam_step
        monkeypatch.setattr(dispatch, "triton_adam_step", lambda *args, **kwargs: calls.append(args[-1]) or launcher(*args, **kwargs))
        for step in range(1, 4):
            weight.grad = (torch.randn(40, 130, generator=gen) * 1e-2).bfloat16()
            twin.grad = weight.grad.clone()
            with monkeypatch.context() as patch:
                patch.setattr(dispatch, "TRITON_DEVICE_TYPES", ("cuda", "cpu"))
                patch.setattr(dispatch, "native_kernel_available", lambda: False)  # the C++ step would come first on "cpu"
                opt.step()
            with monkeypatch.context() as patch:
                correctly_rounded_torch_sqrt(patch)
                reference.step()
            assert opt.step_paths() == {"param0": "triton"} and reference.step_paths() == {"param0": "reference"}
            assert weight.dtype == torch.bfloat16 and torch.equal(weight, twin), f"step {step}: parameters differ"
            for name in ("exp_avg", "exp_avg_sq"):
                ours, theirs = opt.state[weight][name], reference.state[twin][name]
                assert code_agreement(ours, theirs) == (1.0, 0) and torch.equal(ours.scales, theirs.scales), f"step {step}: {name} differs"
        assert calls == [True] * 3, "the kernel ran with ECO"

    def test_weight_grid_dispatch(monkeypatch):
        """The ``triton`` row takes cast-format grids with ``error_feedback`` None or "eco" (with stall counts too:
        ECO's are counted on copies); block-scaled grids and "eco_exact" take the reference path; weight SR draws
        reproducible seeds."""
        monkeypatch.setattr(dispatch, "TRITON_DEVICE_TYPES", ("cuda", "cpu"))
        monkeypatch.setattr(dispatch, "native_kernel_available", lambda: False)  # the C++ step would come first on "cpu"
        cases = [
            ({"weights": "bf16", "error_feedback": "eco", "track_stalls": True}, "triton"),
            ({"weights": "fp8_e4m3", "error_feedback": "eco"}, "reference"),
            ({"weights": "bf16", "error_feedback": "eco_exact"}, "reference"),
            ({"weights": "bf16", "track_stalls": True}, "triton"),
        ]
        for options, path in cases:
            weight = torch.nn.Parameter(torch.randn(64, 80, generator=torch.Generator().manual_seed(1)).bfloat16())
            opt = QAdamW([weight], lr=1e-2, **options)
            opt.cpu_compile = False  # no native (C++) path for "cpu" parameters
            weight.grad = torch.full_like(weight, 1e-3)
            opt.step()
            assert opt.step_paths() == {"param0": path}, options
        results = []
        for _ in range(2):  # weight SR (the default weight_rounding): the same seeds from the optimizer's generator
            weight = torch.nn.Parameter(torch.randn(64, 80, generator=torch.Generator().manual_seed(1)).bfloat16())
            opt = QAdamW([weight], lr=1e-2, weights="bf16", error_feedback="eco", generator=torch.Generator().manual_seed(5))
            opt.cpu_compile = False
            weight.grad = torch.full_like(weight, 1e-3)
            opt.step()
            assert opt.step_paths() == {"param0": "triton"}
            results.append((weight.detach().clone(), opt.state[weight]["exp_avg"].codes.clone()))
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])

    def test_stall_counts_of_a_parameter_with_2_31_moved_entries(monkeypatch):
        """The launcher summed the slots' packed ``stalled + (moved << 32)`` before unpacking: from 2**31 moved entries the
        sum overflowed int64 and ``moved`` came back negative. A stand-in kernel leaves what the real one's atomics would
        for such a parameter (8 GiB: not run here): every slot 2**26 moved, 3 stalled, per moment."""
        from lightning_qstate.kernels import launch

        class Kernel:  # kernel[grid](*args): the counts are the second last argument
            def __getitem__(self, grid):
                def run(*args, **kwargs):
                    args[-2][:] = ((2**31 // int(launch.STALL_SLOTS)) << 32) + 3

                return run

        monkeypatch.setattr(launch, "adam_step_kernel", Kernel())
        m, v = get_format("int8").quantize(torch.zeros(300)), get_format("int8", signed=False).quantize(torch.zeros(300))
        hyper = adam_hyper(group_options(), 1.0)
        counts = launch.triton_adam_step(torch.randn(300), torch.randn(300), m, v, hyper, "nearest", True, False, track_stalls=True)
        assert counts.tolist() == [3 * int(launch.STALL_SLOTS), 2**31] * 2
