"""Lightning precision plugins that quantize optimizer states, and strategy helpers."""

try:
    import lightning.pytorch  # noqa: F401
except ModuleNotFoundError as error:
    raise ImportError(f"{__name__} needs Lightning: pip install 'lightning-qstate[lightning]'") from error

from .precision import QStateFSDPPrecision, QStateHalfPrecision, QStateMixedPrecision, QStatePolicyMixin, QStatePrecision
from .strategies import CPUFSDPStrategy

__all__ = ["CPUFSDPStrategy", "QStateFSDPPrecision", "QStateHalfPrecision", "QStateMixedPrecision", "QStatePolicyMixin", "QStatePrecision"]
