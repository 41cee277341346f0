"""lightning_qstate: low-bit optimizer states for PyTorch and PyTorch Lightning.

Formats (``lightning_qstate.formats``), kernels (``lightning_qstate.kernels``) and
optimizers (this namespace) need only torch.
"""

from . import formats, kernels  # noqa: F401  (importing kernels registers the Triton backend for CUDA tensors)
from .formats import get_format
from .optim import (
    QSGD,
    QAdam,
    QAdamW,
    QMuon,
    QuantizationPolicy,
    QuantizedOptimizerWrapper,
    StepOverflowError,
    quantize_optimizer,
    state_nbytes,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "QAdam",
    "QAdamW",
    "QMuon",
    "QSGD",
    "QuantizationPolicy",
    "QuantizedOptimizerWrapper",
    "StepOverflowError",
    "get_format",
    "quantize_optimizer",
    "state_nbytes",
]
