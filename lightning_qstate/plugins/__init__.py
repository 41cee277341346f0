"""Lightning precision plugins that quantize optimizer states, and strategy helpers."""

from .precision import QStateFSDPPrecision, QStateHalfPrecision, QStateMixedPrecision, QStatePolicyMixin, QStatePrecision
from .strategies import CPUFSDPStrategy

__all__ = ["CPUFSDPStrategy", "QStateFSDPPrecision", "QStateHalfPrecision", "QStateMixedPrecision", "QStatePolicyMixin", "QStatePrecision"]
