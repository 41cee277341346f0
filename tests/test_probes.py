"""The quantization-robustness probes (``lightning_qstate.probes``): fake quantization, ``ptq``'s exact restore, the ABC
decomposition against its closed form for linear chains, and the outlier metrics against known values."""

from __future__ import annotations

import doctest
import importlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from lightning_qstate.probes import (
    RECIPES,
    abc_decomposition,
    default_units,
    fake_quantize,
    kurtosis,
    linear_input_statistics,
    linear_modules,
    mmr,
    ptq,
    sqnr,
)

transformers = pytest.importorskip("transformers")


def gpt(n_layer: int = 2) -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=n_layer, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))


def gpt_forward(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, use_cache=False).logits


def int_grid(x: torch.Tensor, levels: int, dim: int = -1) -> torch.Tensor:
    """Symmetric absmax rounding to ``k / levels`` of the absmax along ``dim`` (the paper's PTQ), by hand."""
    scale = x.abs().amax(dim=dim, keepdim=True) / levels
    return torch.round(x / scale) * scale


@pytest.mark.parametrize("module", ["fake_quant", "metrics", "ptq", "abc"])
def test_docstring_examples(module):
    assert doctest.testmod(importlib.import_module(f"lightning_qstate.probes.{module}"), optionflags=doctest.ELLIPSIS).failed == 0


# --- fake quantization -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "levels"), [("int4", 7), ("int8", 127)])
def test_integer_names_are_the_symmetric_absmax_grids_per_row(fmt, levels):
    x = torch.randn(6, 40, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(fake_quantize(x, fmt), int_grid(x, levels), rtol=0, atol=1e-6)
    assert torch.allclose(fake_quantize(x, fmt, dim=0), int_grid(x, levels, dim=0), rtol=0, atol=1e-6)
    blocks = fake_quantize(x, fmt, block=8).view(6, 5, 8)
    assert torch.allclose(blocks, int_grid(x.view(6, 5, 8), levels), rtol=0, atol=1e-6)
    assert torch.equal(fake_quantize(fake_quantize(x, fmt), fmt), fake_quantize(x, fmt))  # grid values stay


def test_fake_quantize_keeps_dtype_shape_and_takes_any_format():
    x = torch.randn(4, 16, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    for fmt in ("int4", "int8_dynamic", "fp8_e4m3", "e2m1", "bf16"):
        y = fake_quantize(x, fmt)
        assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.equal(fake_quantize(x, "bf16"), x) and fake_quantize(x, None) is x
    e2m1 = fake_quantize(torch.tensor([[6.0, 1.2, -2.6, 0.2]]), "e2m1")  # FP4: max 6, values 0, .5, 1, 1.5, 2, 3, 4, 6
    assert e2m1.tolist() == [[6.0, 1.0, -3.0, 0.0]]
    for empty in (torch.empty(0), torch.empty(3, 0)):
        assert fake_quantize(empty, "int4").shape == empty.shape


@pytest.mark.parametrize("fmt", ["int4", "int8", "int8_dynamic", "fp8_e4m3"])
def test_a_non_finite_value_makes_its_scale_group_non_finite(fmt):
    """As a cast does (and an fp16 overflow in an activation): the group of an inf or NaN comes out non-finite, the
    others as without it (the codebook grids used to index past their tables: IndexError)."""
    x = torch.tensor([[1.0, math.nan, 0.5], [1.0, 2.0, 3.0], [math.inf, 1.0, 2.0]])
    y = fake_quantize(x, fmt)
    assert not y[0].isfinite().any() and not y[2].isfinite().any()
    assert torch.equal(y[1], fake_quantize(x[1:2], fmt)[0])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x: fake_quantize(x, "int3"), r"PTQ format 'int3'.*PTQ names: int4, int8"),
        (lambda x: fake_quantize(x, 4), "must be a format name"),
        (lambda x: fake_quantize(x, "int4", block=12), "^block=12 is not valid"),  # not weight_block
        (lambda x: fake_quantize(x, "int4", block=32), "block=32 does not divide the 16 values"),
        (lambda x: fake_quantize(x, "int4", rounding="up"), "rounding='up' is not valid"),
    ],
)
def test_fake_quantize_refuses_bad_options(call, message):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(2, 16))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_fake_quantize_refuses_tensors_that_are_not_floating_point(dtype):
    with pytest.raises(TypeError, match=f"fake_quantize rounds floating-point tensors, got one of dtype {dtype}"):
        fake_quantize(torch.ones(2, 16, dtype=dtype), "int4")


# --- ptq -------------------------------------------------------------------------------------------------------------
def test_ptq_is_w4a4_on_every_linear_layer_and_restores_exactly():
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    before = {name: (param, param.detach().clone()) for name, param in model.named_parameters()}
    expected = F.linear(
        int_grid(F.relu(F.linear(int_grid(x, 7), int_grid(model[0].weight, 7), model[0].bias)), 7),
        int_grid(model[2].weight, 7),
        model[2].bias,
    )
    with torch.no_grad(), ptq(model) as layers:
        assert list(layers) == ["0", "2"]
        assert torch.allclose(model(x), expected, atol=1e-5)
    for name, param in model.named_parameters():
        assert param is before[name][0] and torch.equal(param, before[name][1])
    assert not model[0]._forward_pre_hooks and not model[2]._forward_pre_hooks
    with pytest.raises(RuntimeError, match="inside"), ptq(model):
        raise RuntimeError("inside")
    assert all(param is before[name][0] for name, param in model.named_parameters())  # restored after an error too


def test_ptq_refuses_what_it_would_quantize_wrongly_before_changing_anything():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"modules=\[\] selects no linear layer"), ptq(model, modules=[]):
        pass
    with pytest.raises(ValueError, match="rounding='up' is not valid"), ptq(model, None, "int8", rounding="up"):
        pass
    torch.nn.utils.parametrizations.weight_norm(model[2])
    with pytest.raises(ValueError, match=r"the weights of \['2'\] are parametrized"), ptq(model):
        pass
    assert not model[0]._forward_pre_hooks and isinstance(model[0]._parameters["weight"], torch.nn.Parameter)
    with ptq(model, modules=["0"]):  # leaving it out works
        model(torch.randn(2, 4))


def test_ptq_warns_where_a_layer_runs_only_through_its_weight():
    """nn.MultiheadAttention calls F.linear on out_proj's weight: its weight is quantized, its input cannot be."""
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match=r"inputs of \['layers.0.self_attn.out_proj'\] were not quantized"), ptq(encoder):
        encoder(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with ptq(encoder, activations=None):  # weights only: nothing is missed
            encoder(x)
        with ptq(encoder):  # no forward: nothing to say
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert abc_decomposition(encoder, x, layers=False).R_L > 0


def test_abc_leaves_out_layers_that_run_only_through_their_weight():
    """torch's transformer layers: out_proj (used by nn.MultiheadAttention through its weight) has no row, the other
    layers do; ``modules=`` without it decomposes without a warning (both raised "did not run as modules", so the
    callback could not probe such a model at all)."""
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    encoder = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="out_proj"):
        everything = abc_decomposition(encoder, x)
    expected = [name for unit in ("layers.0", "layers.1") for name in (unit, f"{unit}.linear1", f"{unit}.linear2")]
    assert [row.name for row in everything.rows] == expected and everything.R_L > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        selected = abc_decomposition(encoder, x, modules=["*linear1", "*linear2"])
    assert [row.name for row in selected.rows] == expected and encoder.training


def test_per_token_ratios_leave_out_tokens_whose_state_is_zero():
    """A padding token (all zeros) has no relative error: the per-token ratios average over the others (0/0 made the
    unit's R, A, B, C and every R_in NaN)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    padded = torch.cat([x, torch.zeros(1, 8)])
    result, reference = abc_decomposition(model, padded, per_token=True), abc_decomposition(model, x, per_token=True)
    for row, expected in zip(result.rows, reference.rows, strict=True):
        assert (row.R, row.A, row.B, row.C, row.R_in) == pytest.approx((expected.R, expected.A, expected.B, expected.C, expected.R_in))


def test_float64_values_beyond_fp32s_range_keep_their_grid():
    """float64 rows are scaled in float64: a power-of-two multiple of a row past fp32's range (or below its smallest
    subnormal) rounds to the same multiple of its grid values (they came back NaN and 0)."""
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for fmt in ("int4", "int8", "fp8_e4m3"):
        for factor in (2.0**400, 2.0**-400):
            assert torch.equal(fake_quantize(x * factor, fmt), fake_quantize(x, fmt) * factor), (fmt, factor)


def test_ptq_recipes_patterns_and_conv1d_output_channels():
    model = gpt()
    batch = tokens()
    with torch.no_grad():
        clean = gpt_forward(model, batch)
        with ptq(model, **RECIPES["W4A16"], modules=["*.mlp.c_fc"]) as layers:
            assert list(layers) == ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp.c_fc"]
            conv = model.transformer.h[0].mlp.c_fc  # Conv1D: weight (in, out), one scale per output column
            assert torch.allclose(conv.weight, int_grid(layers["transformer.h.0.mlp.c_fc"]._parameters["weight"], 7, dim=0), atol=1e-6)
            assert not torch.equal(gpt_forward(model, batch), clean)
        with ptq(model) as layers:
            assert "lm_head" in layers and len(layers) == 9
            assert model.lm_head.weight is not model.transformer.wte.weight  # the tied embedding stays clean
        assert model.lm_head.weight is model.transformer.wte.weight
        assert torch.equal(gpt_forward(model, batch), clean)
    with pytest.raises(ValueError, match=r"modules=\['\*.mlp.typo'\] match no linear layer"):
        with ptq(model, modules=["*.mlp.typo"]):
            pass
    with pytest.raises(ValueError, match="PTQ format 'int9'"):
        with ptq(model, activations="int9"):
            pass
    with pytest.raises(ValueError, match="no linear layers"):
        linear_modules(torch.nn.Sequential(torch.nn.ReLU()))


# --- the ABC decomposition -------------------------------------------------------------------------------------
@pytest.mark.parametrize("per_token", [False, True])
def test_abc_matches_the_closed_form_of_a_linear_chain(per_token):
    """Bias-free linear units, weights quantized only: a = ½(Wq + W)(hq − h), b = ½(Wq − W)(hq + h)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(24, 24, bias=False) for _ in range(3)))
    x = torch.randn(10, 24)
    result = abc_decomposition(model, x, activations=None, per_token=per_token, layers=False)
    h, hq = x.double(), x.double()
    previous_r = 0.0
    for index, row in enumerate(result.rows):
        w = model[index].weight.double()
        wq = int_grid(model[index].weight, 7).double()
        out, out_q = h @ w.T, hq @ wq.T
        a, b = (hq - h) @ ((wq + w) / 2).T, (hq + h) @ ((wq - w) / 2).T

        def ratio(t, out=out):
            if per_token:
                return (t.square().sum(-1) / out.square().sum(-1)).mean().item()
            return (t.square().sum() / out.square().sum()).item()

        assert row.name == str(index) and row.kind == "unit"
        assert row.R == pytest.approx(ratio(out_q - out), rel=1e-4)
        assert row.A == pytest.approx(ratio(a), rel=1e-4, abs=1e-12) and row.B == pytest.approx(ratio(b), rel=1e-4)
        assert row.A + row.B + row.C == pytest.approx(row.R, rel=1e-12)
        assert row.R_in == pytest.approx(previous_r, rel=1e-9, abs=1e-15)  # a chain: the input's error is the last R
        assert math.isnan(row.G) if index == 0 else row.G == pytest.approx(row.A / previous_r)
        h, hq, previous_r = out, out_q, row.R
    assert result.R_L == result.rows[-1].R and result.units == result.rows


def test_default_units_find_blocks_in_an_inner_sequential():
    """timm keeps a ViT's blocks in an ``nn.Sequential`` (``blocks``), not a ModuleList: they are its units (the
    repository's own ViT example was refused: "has no transformer blocks")."""
    timm = pytest.importorskip("timm")
    vit = timm.models.vision_transformer.VisionTransformer(img_size=8, patch_size=4, embed_dim=16, depth=2, num_heads=2, num_classes=3)
    assert default_units(vit) == ["blocks.0", "blocks.1"]
    # a Sequential model: its own children, whatever one-class Sequential it holds
    nested = torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)), torch.nn.GELU(), torch.nn.Linear(4, 4))
    assert default_units(nested) == ["0", "1", "2"]

    class Staged(torch.nn.Module):  # a CNN's stages: blocks of one class in several Sequentials, no one chain of them
        def __init__(self) -> None:
            super().__init__()
            self.stage1 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
            self.stage2 = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))

    with pytest.raises(ValueError, match="pass units="):
        default_units(Staged())


def test_abc_on_gpt_blocks_and_their_linear_layers():
    model = gpt()
    result = abc_decomposition(model, tokens(), forward=gpt_forward)
    assert [row.name for row in result.units] == ["transformer.h.0", "transformer.h.1"] == default_units(model)
    assert [row.name for row in result.rows[1:5]] == [
        f"transformer.h.0.{name}" for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    for row in result.rows:
        assert row.R > 0 and row.A >= 0 and row.B > 0
        assert row.A + row.B + row.C == pytest.approx(row.R, rel=1e-9)
    assert result.units[1].R_in == pytest.approx(result.units[0].R, rel=1e-6)  # block 1 reads block 0's output
    assert result.units[1].A > result.units[1].B  # the paper's finding: propagated error dominates after block 0
    assert "transformer.h.1" in str(result) and model.training is False
    w8a8 = abc_decomposition(model, tokens(), **RECIPES["W8A8"], forward=gpt_forward)
    assert w8a8.R_L < result.R_L / 20  # 8 bits: ~16x less error per value, ~256x in squares
    model.train()
    assert abc_decomposition(model, tokens(), forward=gpt_forward, layers=False).R_L == pytest.approx(result.R_L) and model.training


def test_abc_refuses_what_is_not_a_chain():
    with pytest.raises(ValueError, match="pass units="):
        abc_decomposition(torch.nn.Linear(4, 4), torch.randn(2, 4))
    shared = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="ran more than once"):
        abc_decomposition(torch.nn.Sequential(shared, shared), torch.randn(2, 4), units=["0"])
    with pytest.raises(ValueError, match=r"did not run"):
        abc_decomposition(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.randn(2, 4), units=["0"], forward=lambda m, b: None)
    with pytest.raises(ValueError, match=r"units=\[\] gives no chain"):
        abc_decomposition(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.randn(2, 4), units=[])


def test_a_linear_layer_run_twice_in_a_unit_has_no_row():
    """A unit that applies one linear layer twice (a shared weight) aborted the whole decomposition ("ran more than
    once", naming the layer a unit); the layer's optional row is left out, as for a layer that does not run."""

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.out(torch.tanh(self.fc(torch.tanh(self.fc(x)))))

    torch.manual_seed(0)
    model = torch.nn.Sequential(Twice(), Twice())
    x = torch.randn(4, 8)
    result = abc_decomposition(model, x, units=["0", "1"])
    assert [row.name for row in result.rows] == ["0", "0.out", "1", "1.out"]
    assert result.R_L == abc_decomposition(model, x, units=["0", "1"], layers=False).R_L > 0


def test_abc_reads_modules_once_and_restores_every_modules_mode():
    """A generator for ``modules`` selects as its list does (it was read twice: the second read quantized nothing,
    R_L = 0); a submodule in eval inside a training model (a frozen norm) is in eval again afterwards."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    model[1].eval()
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    listed = abc_decomposition(model, x, modules=["0", "2"]).R_L
    assert listed > 0 and abc_decomposition(model, x, modules=(name for name in ["0", "2"])).R_L == listed
    assert model.training and model[0].training and not model[1].training


def test_abc_records_copies_that_in_place_operations_leave_alone():
    """A later in-place operation (``ReLU(inplace=True)``) overwrote the recorded output of the unit before it: unit 0,
    whose input is exact, got A > 0. Recorded inputs and outputs are copies now: the same rows as out of place."""

    def build(inplace: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(inplace=inplace), torch.nn.Linear(32, 8))

    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    assert abc_decomposition(build(True), x).rows == abc_decomposition(build(False), x).rows


class KeywordCall(torch.nn.Module):
    """A linear layer called with its input as a keyword (``layer(input=x)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(input=x)


def test_probes_take_a_linear_layers_input_given_as_a_keyword():
    """The input hooks read ``args[0]``: a layer called as ``layer(input=x)`` raised IndexError in ``ptq`` and
    ``linear_input_statistics``; they take the keyword now, and round it as a positional input."""
    model, x = KeywordCall(), torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with ptq(model, weights=None, activations="int4"):
        keyword = model(x)
    with ptq(model.fc, weights=None, activations="int4"):
        positional = model.fc(x)
    assert torch.equal(keyword, positional) and not torch.equal(keyword, model(x))
    assert linear_input_statistics(model, x).layers["fc"]["mmr"] == pytest.approx(mmr(x))


# --- metrics ---------------------------------------------------------------------------------------------------
def test_mmr_kurtosis_and_sqnr_known_values():
    assert mmr(torch.tensor([[1.0, 2.0, 3.0], [4.0, -4.0, 8.0]])) == pytest.approx((3 / 2 + 8 / 4) / 2)
    assert mmr(torch.tensor([[0.0, 0.0, 1.0]])) == math.inf
    assert mmr(torch.tensor([[1.0, 2.0], [3.0, 6.0]]), dim=0) == pytest.approx(1.5)
    generator = torch.Generator().manual_seed(0)
    assert kurtosis(torch.randn(400_000, generator=generator)) == pytest.approx(0.0, abs=0.05)
    assert kurtosis(torch.rand(400_000, generator=generator)) == pytest.approx(-1.2, abs=0.02)
    assert math.isnan(kurtosis(torch.ones(10)))
    activations = torch.randn(512, 64, generator=generator)
    activations[:, 3] *= 30  # one outlier channel, large for every token
    assert kurtosis(activations, "channel_rms") > 50 > kurtosis(torch.randn(512, 64, generator=generator), "channel_rms") + 40
    with pytest.raises(ValueError, match="variant='mean' is not valid"):
        kurtosis(activations, "mean")
    x = torch.randn(100, generator=generator)
    assert sqnr(x, x) == math.inf
    assert sqnr(x, x + 0.01 * x) == pytest.approx(40.0)
    with pytest.raises(ValueError, match=r"x \(100, 1\) and y \(1, 100\) must have the same shape"):
        sqnr(x.view(100, 1), x.view(1, 100))  # broadcasting would compare every pair
    for metric in (mmr, kurtosis):
        with pytest.raises(ValueError, match=r"x of shape \(0,\) has no values"):
            metric(torch.empty(0))


def test_linear_input_statistics_are_those_of_each_layers_input():
    model = gpt()
    captured = {}
    handle = model.transformer.h[1].mlp.c_proj.register_forward_pre_hook(lambda m, args: captured.setdefault("x", args[0]))
    stats = linear_input_statistics(model, tokens(), forward=gpt_forward)
    handle.remove()
    assert len(stats.layers) == 9 and "lm_head" in stats.layers
    layer = stats.layers["transformer.h.1.mlp.c_proj"]
    assert layer["mmr"] == pytest.approx(mmr(captured["x"])) and layer["kurtosis"] == pytest.approx(kurtosis(captured["x"]))
    assert layer["kurtosis_channel_rms"] == pytest.approx(kurtosis(captured["x"], "channel_rms"))
    assert stats.mmr == pytest.approx(sum(v["mmr"] for v in stats.layers.values()) / 9)
    assert not model.transformer.h[1].mlp.c_proj._forward_pre_hooks
