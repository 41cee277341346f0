"""Theory of low-precision optimizer states: the stall model, reset periods and the precision advisor (no Lightning imports).

The adaptive bit-width planner is :mod:`lightning_qstate.adaptive`.
"""

from .precision import COMPONENTS, DEFAULT_CONSTANTS, AdviceRow, PrecisionReport, advise, mantissa_bits, required_mantissa_bits
from .stall import MOMENTS, Moment, half_staleness_age, moment_of, relative_gaps, reset_period, stall_probability, state_decay, state_input

__all__ = [
    "COMPONENTS",
    "DEFAULT_CONSTANTS",
    "MOMENTS",
    "AdviceRow",
    "Moment",
    "PrecisionReport",
    "advise",
    "half_staleness_age",
    "mantissa_bits",
    "moment_of",
    "relative_gaps",
    "required_mantissa_bits",
    "reset_period",
    "stall_probability",
    "state_decay",
    "state_input",
]
