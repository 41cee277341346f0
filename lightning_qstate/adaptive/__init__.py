"""Adaptive per-layer, per-state bit-widths (STQuant, arXiv 2604.06836): the planner and its pieces, without Lightning.

**A reconstruction.** The paper's claims are known (per-layer, per-state and per-step bit-widths at an
average of 5.1 bits, statistics all-reduced so every rank agrees, O(N/K) overhead), its method text is not;
``docs/algorithms.md`` ("Adaptive bit-widths") sets out the reconstruction implemented here. Every choice
below is an option of :class:`BitWidthPlanner` (and of the Lightning callback
:class:`~lightning_qstate.callbacks.AdaptiveBitWidth`, which drives it):

- statistics of a layer's gradient ``g``: ``N = RMS(g)`` and ``R = std(|g|) / mean(|g|)``, from sums
  that can be all-reduced over ranks (:func:`gradient_statistics`), smoothed by an EMA (:func:`ema`);
- four zones by comparing a layer's EMAs with the whole model's (:func:`model_statistics`), each scaled by a
  threshold (:func:`classify_zone`) that rises over training (:class:`AnnealedThreshold`);
- a zone changes only after the new zone was observed at ``persist`` consecutive checks (:class:`ZoneHysteresis`);
- a zone maps to one storage format per state; a memory budget caps the average bits, demoting layers
  deterministically until it fits (down to last-resort floor formats only where the zones' cannot meet the cap), then
  spends what is left under the cap promoting layers to higher zones' formats, the least precise first
  (:func:`zone_ladder`, :func:`budget_ladder`, :func:`floor_option`, :func:`fit_budget`).

Bytes are the formats' real stored bytes (codes plus block scales, :func:`format_nbytes`), never nominal bits.

``zones.py``: statistics, zones, annealing, hysteresis; ``budget.py``: bytes, ladders, the budget;
``planner.py``: :class:`BitWidthPlanner`, which tracks an optimizer's layers and re-encodes their states.
"""

from .budget import BudgetError, budget_ladder, budget_order, fit_budget, floor_option, format_nbytes, resolved_nbytes, zone_ladder
from .planner import ADAPTED_STATES, DEFAULT_FLOOR_FORMATS, DEFAULT_M_FORMATS, DEFAULT_V_FORMATS, STATE_DICT_VERSION, BitWidthPlanner
from .zones import (
    REFERENCES,
    ZONES,
    AnnealedThreshold,
    ZoneHysteresis,
    check_zone_formats,
    classify_zone,
    ema,
    gradient_statistics,
    model_statistics,
)

__all__ = [
    "ADAPTED_STATES",
    "DEFAULT_FLOOR_FORMATS",
    "DEFAULT_M_FORMATS",
    "DEFAULT_V_FORMATS",
    "REFERENCES",
    "STATE_DICT_VERSION",
    "ZONES",
    "AnnealedThreshold",
    "BitWidthPlanner",
    "BudgetError",
    "ZoneHysteresis",
    "budget_ladder",
    "budget_order",
    "check_zone_formats",
    "classify_zone",
    "ema",
    "fit_budget",
    "floor_option",
    "format_nbytes",
    "gradient_statistics",
    "model_statistics",
    "resolved_nbytes",
    "zone_ladder",
]
