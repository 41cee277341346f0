"""Lightning callbacks: quantizing optimizer states and logging their memory."""

from .quantized_states import QuantizedOptimizerStates, memory_metrics

__all__ = ["QuantizedOptimizerStates", "memory_metrics"]
