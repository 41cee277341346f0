"""Quantization-robustness probes (pure torch): how much a trained model loses under post-training quantization, and
why (arXiv 2509.23500; ``docs/algorithms.md``, "Quantization-robustness probe").

- :func:`fake_quantize`, :data:`RECIPES`: any project format as a PTQ grid, symmetric absmax per row or per block.
- :func:`ptq`: a context manager that quantizes a model's linear layers (weights and inputs) and restores it exactly.
- :func:`abc_decomposition`: the layer-wise error split into propagated (A), local (B) and cross (C) parts, ``R_L``.
- :func:`mmr`, :func:`kurtosis`, :func:`sqnr`, :func:`linear_input_statistics`: outlier and error metrics.

The Lightning callback is :class:`lightning_qstate.callbacks.QuantizationProbe`.
"""

from .abc import ABCResult, ABCRow, abc_decomposition, default_units
from .fake_quant import FORMAT_ALIASES, RECIPES, fake_quantize, probe_grid
from .metrics import KURTOSIS_VARIANTS, InputStatistics, call_model, kurtosis, linear_input_statistics, mmr, sqnr
from .ptq import is_linear, linear_modules, ptq

__all__ = [
    "FORMAT_ALIASES",
    "KURTOSIS_VARIANTS",
    "RECIPES",
    "ABCResult",
    "ABCRow",
    "InputStatistics",
    "abc_decomposition",
    "call_model",
    "default_units",
    "fake_quantize",
    "is_linear",
    "kurtosis",
    "linear_input_statistics",
    "linear_modules",
    "mmr",
    "probe_grid",
    "ptq",
    "sqnr",
]
