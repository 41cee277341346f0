"""The C++ CPU Adam kernel (``kernels/csrc/``, called by ``kernels/native.py``) against the torch references it must match.

Its encoder (``kernels.code_index.NearestCodeIndex``: one table lookup and integer compares) must give the codes of
``formats.rounding.encode_codebook`` for every fp32 input, and its step the codes and scales of
``kernels.adam_reference.adam_step_quantized``, on the AVX-512 body and on the scalar tail of every block. Its build is
said on stderr only when the extension is not cached yet.
"""

from __future__ import annotations

import re
import types
import warnings

import pytest
import torch
from torch.utils import cpp_extension

import lightning_qstate as lq
from lightning_qstate.formats import CodebookFormat, get_format
from lightning_qstate.formats.codebooks import nearest_thresholds
from lightning_qstate.formats.rounding import encode_codebook
from lightning_qstate.kernels import native
from lightning_qstate.kernels.adam_reference import adam_hyper, adam_step_quantized
from lightning_qstate.kernels.code_index import NearestCodeIndex, nearest_index
from lightning_qstate.kernels.native import native_adam_steps

needs_kernel = pytest.mark.skipif(not native.native_kernel_available(), reason="no C++ compiler here: the optimizer uses another path")

BYTE_FORMATS = {
    "int8": get_format("int8"),
    "int8 unsigned": get_format("int8", signed=False),
    "int8_linear": get_format("int8_linear"),
    "int8_linear unsigned": get_format("int8_linear", signed=False),
    # no zero code: the threshold between -1/63 and 1/63 is 0, which -0.0 and 0.0 both reach
    "zero-free": CodebookFormat("zero-free", torch.linspace(-1, 1, 64, dtype=torch.float64), 64, signed=True),
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


@pytest.mark.parametrize("name", list(BYTE_FORMATS))
def test_nearest_code_index_gives_the_reference_codes(name):
    """The codes of ``fmt.encode``: ``encode_codebook`` clamped up to ``min_code`` (zero-free unsigned formats)."""
    fmt = BYTE_FORMATS[name]
    index = nearest_index(fmt)
    assert index is not None
    x = hard_inputs(fmt)
    magnitude = x.abs().view(torch.int32).to(torch.int64)
    key = ((magnitude - index.key_base) >> index.key_shift).clamp(0, index.half - 1)
    negative = x < 0
    entry = index.bucket_entries[torch.where(negative, index.half - 1 - key, index.half + key)].to(torch.int64)
    threshold = index.key_base + (key << index.key_shift) + (entry >> 9)
    up = (entry & 0x100).bool() & torch.where(negative, magnitude <= threshold, magnitude >= threshold)
    assert torch.equal((entry & 0xFF) + up.to(torch.int64), fmt.encode(x, "nearest", None).to(torch.int64))
    if fmt.min_code:
        assert not torch.equal(index.bucket_entries, NearestCodeIndex.build(fmt.codebook).bucket_entries)
        assert bool((encode_codebook(x, fmt.index, "nearest") < fmt.min_code).any())  # the clamp is exercised


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
@pytest.mark.parametrize("scale_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("absmax", [1.0, 0.3, 1.7e-3, 12345.678])
@pytest.mark.parametrize("name", list(BYTE_FORMATS))
def test_kernel_encodes_like_the_reference(name, absmax, scale_dtype):
    """With beta1 = 0 and no weight decay the new ``m`` is the gradient, so the kernel's codes of ``m`` are its encoder's
    codes of chosen values: each 64-value block holds ``absmax`` (its scale; for bf16 scales, ``absmax`` is first
    rounded to a bf16 value) and the inputs times it, which normalize to the inputs or their fp32 neighbours: codes
    equal only if the kernel's division is correctly rounded."""
    fmt = BYTE_FORMATS[name]
    if scale_dtype == "bf16":
        absmax = float(torch.tensor(absmax).to(torch.bfloat16))
    values = hard_inputs(fmt) * absmax
    values = values[: values.numel() // 63 * 63].view(-1, 63)
    grad = torch.cat([torch.full((values.shape[0], 1), absmax), values], dim=1).view(-1)
    m_format = CodebookFormat(fmt.name, fmt.codebook, 64, fmt.signed, scale_dtype=scale_dtype)
    v_format = get_format("int8", signed=False, block_size=64)
    state = adam_state(m_format, v_format, grad.numel(), seed=0)
    param = torch.zeros(grad.numel())
    native_adam_steps([param], [grad], [state], adam_group(betas=(0.0, 0.999), weight_decay=0.0), track_stalls=False)
    codes, scales = m_format.quantize_reference(grad, "nearest", None)
    assert torch.equal(state["exp_avg"].codes, codes)
    assert torch.equal(state["exp_avg"].scales, scales)


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
    a vector): codes and scales equal the reference's; params within about two ulps of the update, which is about lr = 1e-2 (the
    kernel multiplies by reciprocals where the reference divides, and torch's CPU sqrt is not always correctly
    rounded). Sizes reach the 64-code (VBMI), 16-code and scalar loops; the thread counts split the blocks at different
    places inside and between parameters."""
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
        hyper = adam_hyper(group, 4.0)
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
        torch.testing.assert_close(param, reference_param, rtol=3e-7, atol=2e-9)


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


def test_the_build_is_said_on_stderr_only_when_not_cached(monkeypatch, tmp_path, capsys):
    """``build_extension`` prints its one line before a build, not when the extension's library is already in torch's
    extension directory (``load`` faked: no compiler runs)."""
    calls = []
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace(adam_steps_u8=None))
    name = native.extension_name()
    native.build_extension()
    said = capsys.readouterr().err
    assert "building the C++ CPU Adam kernel once for this machine" in said and str(tmp_path) in said
    (tmp_path / (name + cpp_extension.LIB_EXT)).touch()
    native.build_extension()
    assert capsys.readouterr().err == ""
    assert [call["name"] for call in calls] == [name, name] and calls[0]["build_directory"] == str(tmp_path)
    assert calls[0]["extra_include_paths"] == [str(native.CSRC)] and calls[0]["extra_cflags"] == native.CFLAGS


def test_the_extension_name_hashes_sources_and_flags(monkeypatch):
    name = native.extension_name()
    assert re.fullmatch(r"lightning_qstate_cpu_adam_[0-9a-f]{12}", name)
    assert {path.name for path in native.SOURCES} == {path.name for path in native.CSRC.iterdir()}  # every file in csrc/
    monkeypatch.setattr(native, "CFLAGS", [*native.CFLAGS, "-DQSTATE_TEST"])
    assert native.extension_name() != name


def test_a_failed_build_warns_and_leaves_no_kernel(monkeypatch, tmp_path):
    def fail(**kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fail)
    with pytest.warns(RuntimeWarning, match="building the C\\+\\+ CPU Adam kernel failed"):
        assert native._kernel.__wrapped__() is None
