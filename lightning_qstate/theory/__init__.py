"""Theory of low-precision optimizer states: stall model, reset periods, bit-width budgets (no Lightning imports)."""

from .stall import MOMENTS, Moment, half_staleness_age, moment_of, relative_gaps, reset_period, stall_probability, state_decay

__all__ = ["MOMENTS", "Moment", "half_staleness_age", "moment_of", "relative_gaps", "reset_period", "stall_probability", "state_decay"]
from .bits import (  # noqa: E402  (adaptive bit-widths, STQuant reconstruction)
    REFERENCES,
    ZONES,
    AnnealedThreshold,
    BudgetError,
    ZoneHysteresis,
    budget_ladder,
    budget_order,
    check_zone_formats,
    classify_zone,
    ema,
    fit_budget,
    format_nbytes,
    gradient_statistics,
    model_statistics,
    resolved_nbytes,
    zone_ladder,
)

__all__ += [
    "REFERENCES",
    "ZONES",
    "AnnealedThreshold",
    "BudgetError",
    "ZoneHysteresis",
    "budget_ladder",
    "budget_order",
    "check_zone_formats",
    "classify_zone",
    "ema",
    "fit_budget",
    "format_nbytes",
    "gradient_statistics",
    "model_statistics",
    "resolved_nbytes",
    "zone_ladder",
]
