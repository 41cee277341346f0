"""The compiled CPU step (``kernels/compiled.py``) with several format pairs in one process (issue #22).

dynamo keeps its automatic-dynamic state (which sizes and ints turned out to vary, ``torch._dynamo.pgo.CodeId``) per
(file, first line, function name), not per code object: the copies of ``adam_step_quantized`` that
``compiled_adam_step`` makes per format pair used to share it, so the second pair compiled in a process saw the
first pair's block size and bit width as "changed" and compiled them as symbols (a dynamic inner loop, about 5x
slower steps). Each copy now has its own name; the format tables are built before tracing, so no guard on their
cache fails and each pair compiles once.
"""

from __future__ import annotations

import pytest
import torch

from lightning_qstate.formats import get_format
from lightning_qstate.kernels import compiled
from lightning_qstate.kernels.adam_reference import adam_hyper, adam_step_quantized

GROUP = {
    "lr": 1e-3,
    "weight_decay": 1e-2,
    "betas": (0.9, 0.999),
    "eps": 1e-8,
    "decoupled_weight_decay": True,
    "maximize": False,
    "rounding": "nearest",
}
PAIRS = [("int4", "int4"), ("fp8_e4m3", "fp8_e4m3")]  # different block sizes (128, 256) and bit widths


def _state(name: str, signed: bool, param: torch.Tensor):
    return get_format(name, signed=signed).quantize(torch.zeros(param.numel()))


def _step(pair: tuple[str, str], param: torch.Tensor, seed: int) -> tuple:
    generator = torch.Generator().manual_seed(seed)
    grad = torch.randn(param.shape, generator=generator) * 1e-2
    m, v = _state(pair[0], True, param), _state(pair[1], False, param)
    reference = [t.clone() for t in (param, m.codes, m.scales, v.codes, v.scales)]
    hyper = adam_hyper(GROUP, 1.0)
    compiled.compiled_cpu_step(param.data, grad, m, v, hyper, GROUP, False)
    options = (m.format, v.format, "nearest", True, False, False)
    adam_step_quantized(reference[0].view(-1), grad.view(-1), *reference[1:], hyper, *options)
    return (param, m.codes, m.scales, v.codes, v.scales), reference


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_two_format_pairs_compile_once_each_with_their_own_dynamic_state() -> None:
    """Two pairs in one process: each compiles one graph (steps of other parameter shapes and block counts reuse it:
    no recompiles), the copies have distinct dynamo code identities, and the second pair's automatic-dynamic state
    has only the block count dynamic; the steps equal the eager reference bit for bit."""
    shapes = [(64, 160), (96, 128), (40, 257)]  # different bases and block counts; the last has a partial block
    codes = []
    for number, pair in enumerate(PAIRS):
        before = _graphs()
        for seed, shape in enumerate(shapes):
            param = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
            got, want = _step(pair, param, seed)
            for a, b in zip(got, want, strict=True):
                assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), (pair, shape)
        assert _graphs() - before == 1, f"{pair}: {_graphs() - before} graphs for one format pair"
        m, v = get_format(pair[0], signed=True), get_format(pair[1], signed=False)
        function = compiled.compiled_adam_step((m, v, "nearest", True, False, False))
        codes.append(function._torchdynamo_orig_callable.__code__)
        if number == 1:
            pgo = pytest.importorskip("torch._dynamo.pgo")
            state = pgo.get_code_state().get(pgo.CodeId.make(codes[-1]))
            assert state is not None
            for name, entry in state.automatic_dynamic.items():  # what dynamo saw change: no row length, no format int
                if isinstance(entry.size, tuple):
                    assert not any(entry.is_size_dynamic(dim) for dim in range(1, len(entry.size))), (name, entry.render())
                elif entry.size is pgo.auto_unset:  # an int (bits, block size, ...)
                    assert entry.scalar is not pgo.auto_dynamic, (name, entry.render())
    identities = {(code.co_filename, code.co_firstlineno, code.co_name) for code in codes}
    assert len(identities) == len(PAIRS)


def test_a_block_larger_than_the_parameter_steps_eagerly() -> None:
    """A valid block size above the parameter's size leaves no whole block to compile for: the parameter steps eagerly
    (it raised reshaping the empty head), with the reference's codes."""
    pair = ("int8", "int8")
    param = torch.randn(1000)
    generator = torch.Generator().manual_seed(0)
    grad = torch.randn(param.shape, generator=generator) * 1e-2
    m, v = (
        get_format(name, signed=signed, block_size=2048).quantize(torch.zeros(1000))
        for name, signed in zip(pair, (True, False), strict=True)
    )
    reference = [t.clone() for t in (param, m.codes, m.scales, v.codes, v.scales)]
    hyper = adam_hyper(GROUP, 1.0)
    compiled.compiled_cpu_step(param, grad, m, v, hyper, GROUP, False)
    adam_step_quantized(reference[0], grad, *reference[1:], hyper, m.format, v.format, "nearest", True, False, False)
    for ours, theirs in zip((param, m.codes, m.scales, v.codes, v.scales), reference, strict=True):
        assert torch.equal(ours, theirs)
