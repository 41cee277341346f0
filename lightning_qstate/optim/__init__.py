"""Quantized optimizers, the wrapper for arbitrary optimizers, and state_dict I/O (no Lightning imports)."""

from .base import FEEDBACK_STALLS, WEIGHT_STALLS, QuantizedStates, StepOverflowError, dequantized, state_nbytes, state_summary
from .optimizers import QSGD, QAdam, QAdamW, QMuon
from .policy import (
    ERROR_FEEDBACKS,
    NONFINITE_GRAD_POLICIES,
    NONNEGATIVE_STATES,
    POLICY_DEFAULTS,
    POLICY_FIELDS,
    ErrorFeedback,
    NonFiniteGradPolicy,
    QuantizationPolicy,
    StatesSpec,
    clean_parameter_name,
    resolve_format,
)
from .serialization import STATE_FORMAT_VERSION
from .weights import ERROR_STATE, block_linear_weight_names
from .wrap import (
    QUANTIZED_EQUIVALENTS,
    QuantizedOptimizerWrapper,
    check_optimizer_parameters,
    quantize_optimizer,
)

__all__ = [
    "ERROR_FEEDBACKS",
    "ERROR_STATE",
    "FEEDBACK_STALLS",
    "NONFINITE_GRAD_POLICIES",
    "NONNEGATIVE_STATES",
    "POLICY_DEFAULTS",
    "POLICY_FIELDS",
    "QUANTIZED_EQUIVALENTS",
    "STATE_FORMAT_VERSION",
    "WEIGHT_STALLS",
    "ErrorFeedback",
    "NonFiniteGradPolicy",
    "QAdam",
    "QAdamW",
    "QMuon",
    "QSGD",
    "QuantizationPolicy",
    "QuantizedOptimizerWrapper",
    "QuantizedStates",
    "StepOverflowError",
    "StatesSpec",
    "block_linear_weight_names",
    "check_optimizer_parameters",
    "clean_parameter_name",
    "dequantized",
    "quantize_optimizer",
    "resolve_format",
    "state_nbytes",
    "state_summary",
]
