"""Checks of index option values, shared by every index kind: a bad value raises ValueError
naming the option before any index structure, FAISS's included, sees it (FAISS answers some
values, e.g. an HNSW degree of 0, with a C++ assertion that ends the process)."""

from __future__ import annotations

import math


def check_int(name: str, value: object, low: int, high: int) -> int:
    """`value` as an int in `[low, high]` (booleans and integral floats such as 8.0 refused)."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{name}: expected an integer from {low} to {high}, got {value!r}")
    return value


def check_positive(name: str, value: object, high: float = 1e12) -> float:
    """`value` as a finite float in `(0, high]`."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not 0 < value <= high
    ):
        raise ValueError(f"{name}: expected a finite number in (0, {high:g}], got {value!r}")
    return float(value)


def check_fraction(name: str, value: object) -> float:
    """`value` as a float in `[0, 1)`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ValueError(f"{name}: expected a number in [0, 1), got {value!r}")
    return float(value)


def check_optional_bool(name: str, value: object) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}: expected true, false or null, got {value!r}")
    return value
