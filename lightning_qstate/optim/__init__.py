"""Quantized optimizers, the wrapper for arbitrary optimizers, and state_dict I/O (no Lightning imports)."""

from .base import QuantizedStates, dequantized, state_nbytes, state_summary
from .optimizers import QSGD, QAdam, QAdamW, QMuon
from .policy import (
    NONFINITE_GRAD_POLICIES,
    NONNEGATIVE_STATES,
    POLICY_DEFAULTS,
    POLICY_FIELDS,
    NonFiniteGradPolicy,
    QuantizationPolicy,
    StatesSpec,
    clean_parameter_name,
    resolve_format,
)
from .serialization import STATE_FORMAT_VERSION
from .wrap import (
    QUANTIZED_EQUIVALENTS,
    QuantizedOptimizerWrapper,
    check_optimizer_parameters,
    quantize_optimizer,
)

__all__ = [
    "NONFINITE_GRAD_POLICIES",
    "NONNEGATIVE_STATES",
    "POLICY_DEFAULTS",
    "POLICY_FIELDS",
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
