"""Checks of the callbacks' arguments, made when a callback is built: errors name the callback and the argument."""

from __future__ import annotations

import numbers
from typing import Any


def is_positive_int(value: Any) -> bool:
    """An integer >= 1: a Python or numpy one (``True`` is not one)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1


def check_flags(owner: str, **flags: Any) -> None:
    """Raise ``ValueError`` for a flag that is not ``True`` or ``False`` (``"no"`` would read as true, ``0`` pass unnoticed)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{owner}: {name}={value!r} must be True or False")
