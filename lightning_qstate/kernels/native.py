"""The C++ CPU Adam(W) step (``kernels/cpu_kernel.py``) over a whole param group: per-format tables and the call."""

from __future__ import annotations

import functools

import torch

from ..formats import CodebookFormat, QuantizedTensor
from . import cpu_kernel
from .bounds import moment_bound


@functools.cache
def _native_layout(m_format: CodebookFormat, v_format: CodebookFormat) -> tuple[list[torch.Tensor], list[int]]:
    """The kernel's per-parameter tables ``[m_decode, m_entries, m_planes, v_decode, v_entries, v_planes]`` (planes:
    ``(4, 256)`` uint8, byte ``j`` of every decode value in row ``j``, for the VBMI decoder) and integers
    ``[block, m_base, m_shift, m_half, v_base, v_shift, v_half]`` for a pair of moment formats."""
    m_index, v_index = m_format.nearest_index, v_format.nearest_index
    tables = [
        table
        for index in (m_index, v_index)
        for table in (index.decode, index.bucket_entries, index.decode.view(torch.uint8).view(256, 4).t().contiguous())
    ]
    return tables, [
        m_format.block_size,
        m_index.key_base,
        m_index.key_shift,
        m_index.half,
        v_index.key_base,
        v_index.key_shift,
        v_index.half,
    ]


def native_adam_steps(
    params: list[torch.Tensor], grads: list[torch.Tensor], states: list[dict], group: dict, track_stalls: bool
) -> list[list[int]]:
    """The Adam step of every parameter of ``group`` given (each ``native_eligible``, or ``native_plain_eligible``: fp32
    moments) in one C++ call (``cpu_kernel``), in place.

    Each ``step`` counter goes up by one, in the kernel, which also derives the step's bias corrections from it (as
    ``adam_hyper`` does for coded params, as torch's AdamW for fp32 ones); parameters whose gradient holds inf/NaN
    are left untouched (their ``step`` too). Returns per parameter, in order,
    ``[grad_finite, moments_finite, stalled_m, moved_m, stalled_v, moved_v]`` (stalls 0 unless tracked or fp32).
    """
    coded = [k for k, state in enumerate(states) if isinstance(state["exp_avg"], QuantizedTensor)]
    plain = [k for k, state in enumerate(states) if not isinstance(state["exp_avg"], QuantizedTensor)]
    order = coded + plain  # the kernel's parameter order
    beta1, beta2 = group["betas"]
    tables, ints, moments = [], [], [(states[k]["exp_avg"], states[k]["exp_avg_sq"]) for k in coded]
    for m, v in moments:
        layout = _native_layout(m.format, v.format)
        tables += layout[0]
        ints.append(layout[1])
    rows = cpu_kernel.kernel()(
        [params[k] for k in coded], [grads[k].contiguous() for k in coded],
        [m.codes for m, _ in moments], [m.scales for m, _ in moments], [v.codes for _, v in moments], [v.scales for _, v in moments],
        tables, torch.tensor(ints, dtype=torch.int64).view(-1, 7),
        torch.tensor([moment_bound(float(beta1), float(beta2), float(states[k]["step"])) for k in coded], dtype=torch.float32),
        [t for k in plain for t in (params[k], grads[k].contiguous(), states[k]["exp_avg"], states[k]["exp_avg_sq"])],
        [states[k]["step"] for k in order],
        float(group["lr"]), float(group["weight_decay"]), float(beta1), float(beta2), float(group["eps"]),
        group["decoupled_weight_decay"], group["maximize"], track_stalls,
    ).tolist()  # fmt: skip
    if not all(row[1] for row in rows if row[0]):
        raise FloatingPointError("an Adam moment overflowed to inf/NaN during the step; its packed codes were not trusted")
    by_param = [None] * len(states)
    for k, row in zip(order, rows, strict=False):
        by_param[k] = row
    return by_param


def native_kernel_available() -> bool:
    """Whether the C++ kernel is built here (built on first call; ``False`` without a C++ compiler)."""
    return cpu_kernel.kernel() is not None


def native_formats(m_format: CodebookFormat, v_format: CodebookFormat) -> bool:
    """Whether the kernel codes this pair of moment formats: byte-coded codebooks (5-8 bits) of one block size whose
    round-to-nearest encoder has a ``NearestCodeIndex``."""
    formats = (m_format, v_format)
    return (
        all(isinstance(f, CodebookFormat) and 4 < f.bits <= 8 and f.nearest_index is not None for f in formats)
        and m_format.block_size == v_format.block_size
    )
