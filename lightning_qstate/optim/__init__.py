"""Quantized optimizers, the wrapper for arbitrary optimizers, and state_dict I/O (no Lightning imports)."""

from .base import NONFINITE_GRAD_POLICIES, NonFiniteGradPolicy, QuantizedStates, dequantized, state_nbytes
from .optimizers import QAdam, QAdamW, QMuon, QSGD
from .policy import NONNEGATIVE_STATES, POLICY_DEFAULTS, StatesSpec, resolve_format
from .serialization import STATE_FORMAT_VERSION
from .wrap import QUANTIZED_EQUIVALENTS, QuantizedOptimizerWrapper, quantize_optimizer

__all__ = [
    "NONFINITE_GRAD_POLICIES",
    "NONNEGATIVE_STATES",
    "POLICY_DEFAULTS",
    "QUANTIZED_EQUIVALENTS",
    "STATE_FORMAT_VERSION",
    "NonFiniteGradPolicy",
    "QAdam",
    "QAdamW",
    "QMuon",
    "QSGD",
    "QuantizedOptimizerWrapper",
    "QuantizedStates",
    "StatesSpec",
    "dequantized",
    "quantize_optimizer",
    "resolve_format",
    "state_nbytes",
]
