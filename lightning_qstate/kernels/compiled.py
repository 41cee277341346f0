"""The Adam step of ``kernels.adam_reference`` compiled by ``torch.compile`` for large CPU parameters.

``torch.compile`` turns ``adam_step_quantized`` into one C++ loop nest per parameter (per-block absmax reduction fused
with the elementwise work, codes written in place), which is where the speed comes from: eager torch would make a
dozen full-size temporaries. The learning rate and every hyperparameter enter as 0-d tensors, so LR schedulers and
changing betas never trigger a recompile, and the block count is dynamic, so one compile serves every parameter of a
model. The same function runs eagerly on the partial last block of a parameter, so the compiled and eager paths
share one definition of the step.
"""

from __future__ import annotations

import functools
import itertools
import sys
import types
import warnings
from collections.abc import Callable

import torch

from ..formats import BlockFormat, CastFormat, QuantizedTensor
from ..formats.packing import packed_numel
from ..formats.weights import WeightGrid
from .adam_reference import _lower_fma, adam_step_quantized, decoupled_decay

# Row length of the 2-D view of cast-format (unblocked) states on the compiled path.
CAST_ROW = 256


# Numbers the copies of ``adam_step_quantized`` that ``compiled_adam_step`` makes (each its own name).
_COPY_NUMBERS = itertools.count()


@functools.cache
def compiled_adam_step(options: tuple) -> Callable:
    """``adam_step_quantized`` compiled for one ``options`` tuple (formats, rounding, flags); the block count is marked
    dynamic. ``fma`` compiles to inductor's (``_lower_fma``), so the compiled step is the eager one bit for bit.

    Each tuple compiles its own copy of the function (a distinct code object): dynamo keeps its cache, and its limit
    of 8 recompilations, per code object, so one shared function would fail (``fullgraph``) once a process had
    compiled 8 format pairs, and would check every pair's guards at every call. Each copy also has its own name
    (``adam_step_quantized__<n>``, the n-th tuple compiled): dynamo keeps its automatic-dynamic state (the sizes and ints it
    has seen change, which it then compiles as symbols) per (file, first line, name) (``torch._dynamo.pgo.CodeId``),
    not per code object, so copies of one name shared it, and the second pair compiled in a process took the first
    pair's other block size and bit width for a change: its row length and format ints became symbols, a loop nest
    that does not vectorize, about 5x slower (issue #22).

    ``emulate_precision_casts``: inductor otherwise drops a cast to bf16 and back inside a fused kernel, and the
    bf16 block scales (``formats.block.round_up_to_bf16``) would normalize by the unrounded absmax.
    """
    _lower_fma()
    code = adam_step_quantized.__code__
    name = f"{code.co_name}__{next(_COPY_NUMBERS)}"
    renamed = code.replace(co_name=name, **({"co_qualname": name} if sys.version_info >= (3, 11) else {}))
    copy = types.FunctionType(renamed, adam_step_quantized.__globals__, name, adam_step_quantized.__defaults__)
    return torch.compile(copy, fullgraph=True, options={"emulate_precision_casts": True})


def _split(value: QuantizedTensor, count: int, block: int) -> tuple[tuple, tuple]:
    """(codes, scales) of the first ``count`` values as ``(count // block, -1)`` views, and of the rest (flat)."""
    fmt = value.format
    code_split = packed_numel(count, fmt.bits) if isinstance(fmt, BlockFormat) else count  # count: whole blocks, whole bytes
    head_codes = _dynamic_rows(value.codes[:code_split].view(count // block, -1))
    if isinstance(fmt, CastFormat):
        return (head_codes, None), (value.codes[count:], None)
    block_split = count // fmt.block_size
    return (head_codes, _dynamic_rows(value.scales[:block_split])), (value.codes[code_split:], value.scales[block_split:])


def _dynamic_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Mark dim 0 dynamic so one compiled kernel serves every parameter size."""
    torch._dynamo.mark_dynamic(tensor, 0)
    return tensor


# Option tuples whose compile failed: they take the eager step without retrying.
_COMPILE_FAILED: set[tuple] = set()


def compiled_cpu_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    m: QuantizedTensor,
    v: QuantizedTensor,
    hyper: dict,
    group: dict,
    track_stalls: bool,
    weights: WeightGrid | None = None,
) -> torch.Tensor:
    """Compiled Adam step on the whole blocks of ``param``, eager on the partial last block; returns stall counts.
    ``weights``: the cast-format grid ``param`` is kept on without master weights (``optim/weights.py``), or ``None``."""
    flat_param, flat_grad = param.view(-1), grad.reshape(-1)
    # Elements per block the fused path splits at: the format's block, CAST_ROW for cast formats (no blocks).
    block = max(state.format.block_size if isinstance(state.format, BlockFormat) else CAST_ROW for state in (m, v))
    whole = flat_param.numel() // block * block
    options = (m.format, v.format, group["rounding"], decoupled_decay(group), group["maximize"], track_stalls)
    if weights is not None:
        options += (weights.format, group["weight_rounding"], group["error_feedback"] == "eco")
    if whole == 0:  # a block larger than the parameter: no whole block to compile for
        return adam_step_quantized(flat_param, flat_grad, m.codes, m.scales, v.codes, v.scales, hyper, *options)
    (m_head, m_tail), (v_head, v_tail) = _split(m, whole, block), _split(v, whole, block)
    counts = None
    if options not in _COMPILE_FAILED:
        for fmt in (m.format, v.format):  # the tables the step reads, built before tracing (else a guard fails once)
            if isinstance(fmt, BlockFormat):
                fmt.tables(param.device)
        try:
            head_param, head_grad = _dynamic_rows(flat_param[:whole].view(-1, block)), _dynamic_rows(flat_grad[:whole].view(-1, block))
            counts = compiled_adam_step(options)(head_param, head_grad, *m_head, *v_head, hyper, *options)
        except Exception as error:  # no C++ compiler, an unsupported platform, ...: eager from now on, said once
            _COMPILE_FAILED.add(options)
            message = f"torch.compile of the quantized Adam step failed ({error!r}); using the eager step for these formats"
            warnings.warn(message, RuntimeWarning, stacklevel=4)
    if counts is None:
        counts = adam_step_quantized(flat_param[:whole], flat_grad[:whole], *m_head, *v_head, hyper, *options)
    if whole < flat_param.numel():
        counts = counts + adam_step_quantized(flat_param[whole:], flat_grad[whole:], *m_tail, *v_tail, hyper, *options)
    return counts
