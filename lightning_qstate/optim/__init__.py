"""Quantized optimizers, the wrapper for arbitrary optimizers, and state_dict I/O (no Lightning imports)."""

from .base import NONFINITE_GRAD_POLICIES, NonFiniteGradPolicy, QuantizedStates, dequantized, state_nbytes, state_summary
from .optimizers import QSGD, QAdam, QAdamW, QMuon
from .policy import NONNEGATIVE_STATES, POLICY_DEFAULTS, StatesSpec, resolve_format
from .serialization import STATE_FORMAT_VERSION
from .wrap import (
    QUANTIZED_EQUIVALENTS,
    QuantizationPolicy,
    QuantizedOptimizerWrapper,
    check_optimizer_parameters,
    clean_parameter_name,
    quantize_optimizer,
)

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
    "QuantizationPolicy",
    "QuantizedOptimizerWrapper",
    "QuantizedStates",
    "StatesSpec",
    "check_optimizer_parameters",
    "clean_parameter_name",
    "dequantized",
    "quantize_optimizer",
    "resolve_format",
    "state_nbytes",
    "state_summary",
]
