"""Theory of low-precision optimizer states: the stall model and reset periods (no Lightning imports).

The adaptive bit-width planner is :mod:`lightning_qstate.adaptive`.
"""

from .stall import MOMENTS, Moment, half_staleness_age, moment_of, relative_gaps, reset_period, stall_probability, state_decay

__all__ = ["MOMENTS", "Moment", "half_staleness_age", "moment_of", "relative_gaps", "reset_period", "stall_probability", "state_decay"]
