"""Triton kernels for the storage formats of :mod:`lightning_qstate.formats`.

Importing this package registers :class:`TritonBackend` for ``"cuda"`` tensors
when Triton can be imported (it is optional: some platforms have no Triton, and
then the formats keep their pure-torch reference). From then on
``BlockFormat.quantize`` / ``dequantize`` and the SR ``CastFormat.quantize`` of CUDA
tensors run these kernels; round-to-nearest gives the reference's codes bit for
bit, stochastic rounding the reference's distribution.

Layout:

* :mod:`.triton_formats`: ``@triton.jit`` device functions (block absmax and
  normalization, codebook and minifloat encoders, nibble packing, block decode,
  bf16/fp16 SR casts) for these kernels and for fused optimizer kernels.
* :mod:`.triton_adam`: the fused Adam(W) step over block-quantized moments (one
  pass per block: decode, update, requantize), which the optimizers use for CUDA
  parameters.
* :mod:`.triton_kernels`: the kernels, :data:`KERNELS` (every kernel by name) and
  :func:`aot_variants` (the specializations ``tests/test_kernels_compile.py``
  compiles ahead of time for sm_80 and sm_90).
* :mod:`.launch`: launchers (``triton_quantize_blocks``, ``triton_dequantize_blocks``,
  ``triton_stochastic_cast``, ``triton_adam_step``) that also run on CPU tensors under
  ``TRITON_INTERPRET=1``.

This package imports :mod:`lightning_qstate.formats` only (never the optimizers
or Lightning); ``formats`` does not import it.
"""

from __future__ import annotations

import torch

from ..formats import BlockFormat, CastFormat, QuantizedTensor, Rounding, StorageFormat, register_kernel_backend

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - depends on the platform
    TRITON_AVAILABLE = False
else:
    TRITON_AVAILABLE = True

__all__ = ["TRITON_AVAILABLE", "TritonBackend"]

if TRITON_AVAILABLE:
    from .launch import draw_seed, triton_adam_step, triton_dequantize_blocks, triton_quantize_blocks, triton_stochastic_cast
    from .triton_kernels import KERNELS, KernelVariant, adam_step_supported, aot_variants, block_supported

    __all__ += [
        "KERNELS",
        "KernelVariant",
        "adam_step_supported",
        "aot_variants",
        "draw_seed",
        "triton_adam_step",
        "triton_dequantize_blocks",
        "triton_quantize_blocks",
        "triton_stochastic_cast",
    ]

    class TritonBackend:
        """The :class:`~lightning_qstate.formats.KernelBackend` of Triton devices (registered for ``"cuda"``)."""

        def quantize_blocks(
            self, fmt: StorageFormat, flat: torch.Tensor, rounding: Rounding, generator: torch.Generator | None
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if not isinstance(fmt, BlockFormat):
                raise TypeError(f"quantize_blocks takes a block format, got {fmt!r}")
            if not block_supported(fmt):  # a block the kernels would hold in spilled registers
                return fmt.quantize_reference(flat, rounding, generator)
            seed = draw_seed(generator, flat.device) if rounding == "stochastic" else None
            return triton_quantize_blocks(fmt, flat, rounding, seed)

        def dequantize_blocks(self, fmt: StorageFormat, q: QuantizedTensor, dtype: torch.dtype) -> torch.Tensor:
            if not isinstance(fmt, BlockFormat):
                raise TypeError(f"dequantize_blocks takes a block format, got {fmt!r}")
            if not block_supported(fmt):
                return fmt.dequantize_reference(q.codes, q.scales, q.numel).to(dtype)
            return triton_dequantize_blocks(fmt, q.codes, q.scales, q.numel, dtype)

        def stochastic_cast(self, fmt: StorageFormat, flat: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
            if not isinstance(fmt, CastFormat):
                raise TypeError(f"stochastic_cast takes a cast format, got {fmt!r}")
            return triton_stochastic_cast(fmt, flat, draw_seed(generator, flat.device))

        def __repr__(self) -> str:
            return "TritonBackend()"

    register_kernel_backend("cuda", TritonBackend())

else:  # pragma: no cover - depends on the platform

    class TritonBackend:  # type: ignore[no-redef]
        """Placeholder: Triton is not installed, so no backend is registered and formats use the torch reference."""

        def __init__(self) -> None:
            raise ImportError("lightning_qstate.kernels.TritonBackend needs Triton (pip install 'lightning-qstate[triton]')")
