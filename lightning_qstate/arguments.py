"""Checks of arguments shared by every layer (plain Python: no torch, no Lightning), and the error a rejected
configuration raises where it can only be checked against the model or the optimizer (when a run starts)."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any


class ConfigurationError(ValueError):
    """An option, or a combination of options, that this library rejects once it meets the model, the optimizer or the
    Trainer: an ``overrides`` pattern that matches no parameter, a ``states=`` name the optimizer does not have, a
    strategy a callback does not support. ``lightning-qstate`` reports it as a usage error (exit status 2)."""


def is_positive_int(value: Any) -> bool:
    """An integer >= 1: a Python or numpy one (``True`` is not one)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def whole_number(value: object) -> int | None:
    """``value`` as a Python int where it is an integer (``int``, numpy's, a 0-d integer tensor) and not a bool, else ``None``."""
    try:
        return None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        return None


def finite_real(value: object) -> bool:
    """A finite real number (numpy's too), not a bool."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)


def short_list(items: Sequence[str], limit: int) -> str:
    """The first ``limit`` of ``items``, comma-separated, and how many more there are: ``"a, b, ... (3 more)"``."""
    more = f", ... ({len(items) - limit} more)" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def check_flags(owner: str | None, **flags: Any) -> None:
    """Raise ``ValueError`` (prefixed ``owner: ``, where given) for a flag that is not ``True`` or ``False`` (``"no"``
    would read as true, ``0`` pass unnoticed)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{owner + ': ' if owner else ''}{name}={value!r} must be True or False")
