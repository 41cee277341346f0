"""Lightning callbacks: quantizing optimizer states, measuring and resetting stale states, adaptive bit-widths, precision
advice for a planned run, a quantization-robustness probe; a run summary."""

try:
    import lightning.pytorch  # noqa: F401
except ModuleNotFoundError as error:
    raise ImportError(f"{__name__} needs Lightning: pip install 'lightning-qstate[lightning]'") from error

from .adaptive_bits import AdaptiveBitWidth
from .precision_advisor import PrecisionAdvisor
from .quantization_probe import ProbeResult, QuantizationProbe
from .quantized_states import QuantizedOptimizerStates, memory_metrics
from .stall_monitor import StallMonitor
from .state_reset import StateResetScheduler
from .summary import RunSummary

__all__ = [
    "AdaptiveBitWidth",
    "PrecisionAdvisor",
    "ProbeResult",
    "QuantizationProbe",
    "QuantizedOptimizerStates",
    "RunSummary",
    "StallMonitor",
    "StateResetScheduler",
    "memory_metrics",
]
