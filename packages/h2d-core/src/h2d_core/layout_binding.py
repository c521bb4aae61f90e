"""Binding a :class:`~h2d_core.RequestLayout`: its arrays, columns, plans and registered
outputs checked once and turned into the specs the compiled layout keeps.

Plain Python, run at bind (and by nothing per step): each function refuses a bad
declaration with a :class:`~h2d_core.errors.RequestLayoutError` naming the layout and the
column or output, before the layout holds anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import RequestLayoutError, describe_value
from .layout_arrays import checked_array
from .layout_outputs import (
    RampRowsOutput,
    RequestBoundOutput,
    RequestSums,
    RequestValuesOutput,
    TokenPlanesOutput,
    VerifyRowsOutput,
)
from .layout_records import (
    QUERY_LENS,
    LayoutColumn,
    RampRows,
    RequestBound,
    RequestValues,
    TokenPlanes,
    VerifyRows,
)
from .layout_sum_binding import SumBinder, request_column

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
#: a column's dtype as the compiled layout switches on it
KINDS = {np.dtype(np.int32): 0, np.dtype(np.float32): 1, np.dtype(np.int64): 2}
#: the widest value range a distinct column checks with a stamp table (64K entries of 8
#: bytes); wider ones sort the batch's values
STAMP_SPAN = 1 << 16


def bind_token_planes(name: str, bound: list, outputs: Sequence[Any], arrays: dict,
                       tok_caps: list) -> tuple:
    """Each registered :class:`TokenPlanes` checked and bound."""
    names = [spec[5] for spec in bound]  # no output may take a column's name
    specs = []
    for out in outputs:
        if isinstance(out, RequestBound | RampRows | RequestValues | VerifyRows):
            continue
        if not isinstance(out, TokenPlanes):
            raise RequestLayoutError(
                f"{name}: outputs takes TokenPlanes, RequestBound, RampRows, RequestValues "
                f"and VerifyRows records, got {type(out).__name__}")
        if isinstance(out.planes, bool) or not isinstance(out.planes, int) or out.planes < 1:
            raise RequestLayoutError(
                f"{name}: output {out.name!r}: planes must be an int >= 1, got "
                f"{out.planes!r}")
        if out.name in arrays or out.name in names:
            raise RequestLayoutError(f"{name}: output {out.name!r} needs a unique name")
        checked_array(name, f"output {out.name!r}", out.out, np.int64, 1)
        k = request_column(bound, out.column)
        if k < 0:
            raise RequestLayoutError(
                f"{name}: output {out.name!r} reads column {out.column!r}, which must be a "
                "bound int32 per-request LayoutColumn; declare it in columns")
        arrays[out.name] = out.out
        tok_caps.append(out.out.size // out.planes)
        specs.append(TokenPlanesOutput(out.out, k, out.planes))
    return tuple(specs)


def bind_verify_rows(name: str, bound: list, outputs: Sequence[Any], arrays: dict,
                      req_caps: list) -> tuple:
    """The registered :class:`VerifyRows` (at most one) checked and bound."""
    found = [out for out in outputs if isinstance(out, VerifyRows)]
    if not found:
        return ()
    out = found[0]
    k = request_column(bound, out.drafts)
    if len(found) > 1 or k < 0:
        raise RequestLayoutError(
            f"{name}: VerifyRows needs drafts naming a bound int32 per-request column; one "
            "VerifyRows per layout")
    for key, arr, dtype in (("draft_targets", out.targets, np.int64),
                            ("draft_prefix", out.prefix, np.int32),
                            ("draft_bonus", out.bonus, np.int64)):
        checked_array(name, f"VerifyRows {key}", arr, dtype, 1)
        arrays[key] = arr
    req_caps.extend((out.prefix.size, out.bonus.size))
    return (VerifyRowsOutput(k, out.targets, out.prefix, out.bonus),)


def bind_request_bounds(name: str, sums: SumBinder, outputs: Sequence[Any]) -> tuple:
    """Each registered :class:`RequestBound` checked and bound (one its columns' bounds
    already keep is checked at bind only)."""
    specs = []
    for out in outputs:
        if not isinstance(out, RequestBound):
            continue
        low, high = out.low, out.high
        if (any(b is not None and (type(b) is not int or not INT64_MIN <= b <= INT64_MAX)
                for b in (low, high)) or (low is None and high is None)
                or (low is not None and high is not None and low > high)
                or not isinstance(out.note, str)):
            raise RequestLayoutError(
                f"{name}: RequestBound needs low and/or high, ints in int64 with low <= "
                f"high, and a str note; got low={low!r}, high={high!r}")
        rule = (f"in [{low}, {high}]" if low is not None and high is not None
                else f">= {low}" if low is not None else f"<= {high}")
        sums.check(out.value, "RequestBound value")
        low, high = INT64_MIN if low is None else low, INT64_MAX if high is None else high
        least, most = sums.value_range(out.value)
        if not low <= least <= most <= high:
            specs.append(RequestBoundOutput(sums.bind(out.value, "RequestBound value"), low,
                                            high, rule, out.note))
    return tuple(specs)


def bind_ramp_rows(name: str, sums: SumBinder, outputs: Sequence[Any], arrays: dict,
                   req_caps: list) -> tuple:
    """Each registered :class:`RampRows` checked and bound (rows whose counts and entries
    the columns' bounds keep in range are checked at bind only)."""
    names = [spec[5] for spec in sums.bound]
    specs = []
    for out in outputs:
        if not isinstance(out, RampRows):
            continue
        width, fill = out.width, out.fill
        if (not isinstance(out.name, str) or out.name in arrays or out.name in names
                or out.out is None or type(width) is not int or not 1 <= width <= INT32_MAX
                or type(fill) is not int or not -INT32_MAX - 1 <= fill <= INT32_MAX):
            raise RequestLayoutError(
                f"{name}: RampRows {out.name!r} needs a unique name, an out array, width an "
                f"int in [1, 2**31) and fill an int32; got width={width!r}, fill={fill!r}")
        checked_array(name, f"RampRows {out.name!r}", out.out, np.int32, 1)
        what = f"RampRows {out.name!r}"
        start = sums.bind(out.start, f"{what} start")
        count = sums.bind(out.count, f"{what} count")
        (s_lo, s_hi), (c_lo, c_hi) = sums.value_range(out.start), sums.value_range(out.count)
        in_range = (c_lo >= 0 and c_hi <= width and s_lo >= -INT32_MAX - 1
                    and s_hi + c_hi - 1 <= INT32_MAX)
        arrays[out.name] = out.out
        req_caps.append(out.out.size // width)
        specs.append(RampRowsOutput(out.name, out.out, width, start, count, fill,
                                    not in_range))
    return tuple(specs)


def bind_request_values(name: str, sums: SumBinder, outputs: Sequence[Any], arrays: dict,
                        req_caps: list) -> tuple:
    """Each registered :class:`RequestValues` checked and bound (values the columns' bounds
    keep within int32 are checked at bind only)."""
    names = [spec[5] for spec in sums.bound]
    specs = []
    for out in outputs:
        if not isinstance(out, RequestValues):
            continue
        fill = out.fill
        if (not isinstance(out.name, str) or out.name in arrays or out.name in names
                or out.out is None or (fill is not None and (
                    type(fill) is not int or not -INT32_MAX - 1 <= fill <= INT32_MAX))):
            raise RequestLayoutError(
                f"{name}: RequestValues {out.name!r} needs a unique name, an out array and "
                f"fill None or an int32; got fill={fill!r}")
        what = f"RequestValues {out.name!r}"
        checked_array(name, what, out.out, np.int32, 1)
        value = sums.bind(out.value, f"{what} value")
        least, most = sums.value_range(out.value)
        arrays[out.name] = out.out
        req_caps.append(out.out.size)
        specs.append(RequestValuesOutput(
            out.name, out.out, value, 0 if fill is None else fill, fill is None,
            not -INT32_MAX - 1 <= least <= most <= INT32_MAX))
    return tuple(specs)


def bind_outputs(name: str, bound: list, outputs: Sequence[Any], arrays: dict,
                 req_caps: list, tok_caps: list) -> tuple:
    """Every registered output checked and bound (:mod:`h2d_core.layout_outputs`), in the
    order the layout checks and writes them; their arrays join ``arrays`` and their sizes
    the capacities."""
    sums = SumBinder(name, bound)
    bound_outputs = (bind_verify_rows(name, bound, outputs, arrays, req_caps)
                     + bind_token_planes(name, bound, outputs, arrays, tok_caps)
                     + bind_request_bounds(name, sums, outputs)
                     + bind_ramp_rows(name, sums, outputs, arrays, req_caps)
                     + bind_request_values(name, sums, outputs, arrays, req_caps))
    # the sums first: each evaluated once per batch, before the outputs that read them
    return ((RequestSums(tuple(sums.sums.values())),) if sums.sums else ()) + bound_outputs


def distinct_columns(name: str, columns: Sequence[LayoutColumn], bound: list) -> tuple:
    """Per distinct column: (column index, its lowest value, its stamp table or None)."""
    out = []
    for k, col in enumerate(columns):
        if not getattr(col, "distinct", False):
            continue
        spec = bound[k]
        if spec[0] != 0 or spec[2] or col.low is None or col.high is None:
            raise RequestLayoutError(
                f"{name}: column {col.name!r}: distinct applies to int32 per-request columns "
                "with both bounds (low and high)")
        lo, hi = spec[6][0], spec[6][1]
        table = np.zeros(hi - lo + 1, np.int64) if hi - lo < STAMP_SPAN else None
        out.append((k, lo, table))
    return tuple(out)


def reserved_value(name: str, col: Any, kind: int) -> tuple[int, str] | None:
    """Column ``col``'s reserved value and its note, or None."""
    value = getattr(col, "reserved", None)
    if value is None:
        return None
    if kind == 1 or type(value) is not int or not INT64_MIN <= value <= INT64_MAX:
        raise RequestLayoutError(
            f"{name}: column {col.name!r}: reserved takes an int in int64 on an integer "
            f"column, got {value!r}")
    return value, str(getattr(col, "reserved_note", ""))


def column_bounds(name: str, col: Any, kind: int) -> tuple[Any, Any, bool, str] | None:
    """Column ``col``'s value check as (low, high, low_open, rule), in the column's kind
    (ints for int32/int64, floats for float32); None when every value passes."""
    low, high = getattr(col, "low", None), getattr(col, "high", None)
    is_open, finite = bool(getattr(col, "low_open", False)), bool(getattr(col, "finite", False))
    where = f"{name}: column {col.name!r}"
    if kind != 1:
        if finite:
            raise RequestLayoutError(f"{where}: finite applies to float32 columns only")
        for b in (low, high):
            if b is not None and (type(b) is not int or not INT64_MIN <= b <= INT64_MAX):
                raise RequestLayoutError(
                    f"{where}: an integer column takes int bounds in int64, got {b!r}")
        if low is None and high is None:
            return None
        lo = INT64_MIN if low is None else low + is_open
        hi = INT64_MAX if high is None else high
        if lo > hi:
            raise RequestLayoutError(f"{where}: no value passes low={low!r}, high={high!r}")
        return lo, hi, False, _rule(low, high, is_open, False)
    for b in (low, high):
        if b is not None and (isinstance(b, bool) or not isinstance(b, int | float)
                              or b != b):
            raise RequestLayoutError(
                f"{where}: bounds must be numbers (not NaN) or None, got {b!r}")
    if low is None and high is None and not finite:
        return None
    flo = -np.inf if low is None else float(low)
    fhi = np.inf if high is None else float(high)
    if finite:  # float32 infinities lie past the largest finite float32
        if flo < -FLOAT32_MAX:
            flo, is_open = -FLOAT32_MAX, False
        fhi = min(fhi, FLOAT32_MAX)
    if flo > fhi or (flo == fhi and is_open):
        raise RequestLayoutError(f"{where}: no value passes low={low!r}, high={high!r}")
    return flo, fhi, is_open, _rule(low, high, is_open, finite)


def _rule(low: Any, high: Any, is_open: bool, finite: bool) -> str:
    """The bounds as a message says them: ">= -1", "in (0, 1]", "finite"."""
    if low is not None and high is not None:
        bounds = f"in {'(' if is_open else '['}{low}, {high}]"
    elif low is not None:
        bounds = f"{'>' if is_open else '>='} {low}"
    elif high is not None:
        bounds = f"<= {high}"
    else:
        return "finite"
    return f"finite and {bounds}" if finite else bounds


def bind_columns(name: str, columns: Sequence[LayoutColumn], arrays: dict,
                 req_caps: list, tok_caps: list) -> list:
    """Each :class:`LayoutColumn` checked and bound: (kind, out, per_token, pad, minimum,
    name, bounds, reserved); its array joins ``arrays`` and its size the capacities."""
    bound: list[tuple[Any, ...]] = []
    names = [getattr(col, "name", None) for col in columns]
    for col in columns:  # a sum's term names one column, never the query lengths
        if names.count(col.name) > 1 or col.name == QUERY_LENS:
            raise RequestLayoutError(
                f"{name}: column {col.name!r} needs a unique name, not {QUERY_LENS!r} (a "
                "RequestSum's term for the query lengths)")
    for col in columns:
        out = col.out
        if out is None:  # checked and summed only
            if col.minimum is not None or col.name in arrays:
                raise RequestLayoutError(
                    f"{name}: column {col.name!r} needs a unique name; a column without "
                    "an output array takes no minimum")
            bound.append((0, None, bool(col.per_token), None, None, col.name,
                          column_bounds(name, col, 0), reserved_value(name, col, 0)))
            continue
        kind = KINDS.get(getattr(out, "dtype", None), -1)
        if kind < 0 or col.name in arrays:
            raise RequestLayoutError(
                f"{name}: column {col.name!r} needs a unique name and an int32, float32 "
                f"or int64 array, got {describe_value(out)}")
        checked_array(name, f"column {col.name!r}", out, out.dtype, 1)
        if col.minimum is not None and kind != 1:
            raise RequestLayoutError(
                f"{name}: column {col.name!r}: a minimum applies to float32 columns only")
        arrays[col.name] = out
        (tok_caps if col.per_token else req_caps).append(out.size)
        bound.append((kind, out, bool(col.per_token),
                      None if col.pad is None else out.dtype.type(col.pad),
                      None if col.minimum is None else float(col.minimum), col.name,
                      column_bounds(name, col, kind), reserved_value(name, col, kind)))
    return bound
