"""The specific refusals of a :class:`~h2d_core.RequestLayout`'s per-step checks.

The compiled checks find that a batch is bad; these say which request (or token), which
column and which rule, as a :class:`~h2d_core.errors.RequestLayoutError`. Only a refused
batch reaches them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .errors import RequestLayoutError, describe_value


def distinct_error(name: str, col: str, value: Any, n: int) -> None:
    """The refusal of the first request whose value an earlier request holds."""
    seen: dict[int, int] = {}
    for i in range(n):
        x = int(value[i])
        if x in seen:
            repeat_error(name, col, x, i, seen[x])
        seen[x] = i


def repeat_error(name: str, col: str, x: int, i: int, first: int) -> None:
    raise RequestLayoutError(
        f"{name}: request {i} has {col}={x}, already request {first}'s; {col} must be "
        "distinct (each request owns its own value)")


def column_input_error(name: str, spec: tuple, value: object, size: int) -> None:
    """The specific error for a column's values, which ``_size`` refused."""
    out = spec[1]
    dtype = np.dtype(np.int32) if out is None else out.dtype
    if (not isinstance(value, np.ndarray) or value.dtype != dtype or value.ndim != 1
            or not value.flags.c_contiguous or not value.flags.aligned
            or not value.dtype.isnative):
        raise RequestLayoutError(
            f"{name}: column {spec[5]!r} must be a 1-D C-contiguous aligned native {dtype} "
            f"array, got {describe_value(value)}")
    what = "token" if spec[2] else "request"
    raise RequestLayoutError(
        f"{name}: column {spec[5]!r} has {value.size} values but the batch has {size} "
        f"{what}s; pass one per {what}")


def value_error(name: str, spec: tuple, value: Any, i: int) -> None:
    """The specific error for the first value of a column outside its bounds."""
    what = "token" if spec[2] else "request"
    shown = str(value[i])  # numpy's shortest form of the float32 ("1.0000001")
    raise RequestLayoutError(
        f"{name}: {what} {i} has {spec[5]}={shown}; {spec[5]} must be {spec[6][3]}")


def reserved_error(name: str, spec: tuple, i: int) -> None:
    """The specific error for a request (or token) holding a column's reserved value."""
    what = "token" if spec[2] else "request"
    value, note = spec[7]
    raise RequestLayoutError(
        f"{name}: {what} {i} has {spec[5]}={value}, "
        + (note or "a reserved value (only padded entries hold it); pass another"))


def lengths_input_error(name: str, what: str, value: object) -> None:
    """The specific error for a length array ``_size`` refused."""
    raise RequestLayoutError(
        f"{name}: {what} must be a 1-D C-contiguous aligned native int32 array (one entry "
        f"per request), got {describe_value(value)}")
