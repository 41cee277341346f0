"""Lightning callbacks: quantizing optimizer states and logging their memory; an end-of-fit run summary."""

from .quantized_states import QuantizedOptimizerStates, memory_metrics
from .summary import RunSummary

__all__ = ["QuantizedOptimizerStates", "RunSummary", "memory_metrics"]
