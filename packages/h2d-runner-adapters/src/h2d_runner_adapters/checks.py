"""Input checks the adapters run on a whole argument before their first write.

Every check looks at the value as the caller handed it: its type, dtype, integrality,
length, and its range in its own type, before any conversion. So an int64 of ``2**32`` or
a uint64 of ``2**63`` bound for an int32 source is refused, never wrapped; a float where
the rule needs an integer is refused, never truncated; a NaN is refused where a finite
value is needed. A refusal raises :class:`AdapterInputError` (a
:class:`h2d_core.CountError`) naming the group, the argument, the first offending request
(or token) and the rule, and the adapter has written nothing.

The checks return the caller's array unconverted: the adapter copies it into its pinned
source (numpy's cast is exact once the range is known to fit).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from h2d_core import CountError, describe_value

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class AdapterInputError(CountError):
    """An adapter refused its input before writing any source: nothing changed.

    The message names the group, the argument (and the request or token at fault) and
    the rule; a corrected call in the same epoch then publishes normally.
    """


def refuse_page_size(group: str, batch_page_size: object, page_size: int) -> None:
    """Raise: the batch was scheduled for pages of ``batch_page_size`` tokens, the adapter
    computes KV slots with ``page_size`` (call only when they differ)."""
    raise AdapterInputError(
        f"{group}: the batch has page_size={batch_page_size!r} but the adapter was built "
        f"with page_size={page_size}; KV slots (page * page_size + offset) would be "
        f"computed with {page_size}: schedule the batch with the adapter's page size, or "
        "build the adapter with the KV cache's")


def sub_plan(group: str, method: str, plan: Any, cls: type, field: str) -> Any:
    """The ``cls`` plan a first consumer reads: a step plan's ``field`` (a fused step's
    plan, e.g. :class:`DecodeStepPlan`'s ``.decode``), or ``plan`` itself. Anything else
    is refused naming ``group``, ``method`` and what to pass. Called only when ``type(plan)
    is not cls`` (the consumer's fast path)."""
    sub = getattr(plan, field, None)
    if type(sub) is cls:
        return sub
    if isinstance(plan, cls):
        return plan
    raise AdapterInputError(
        f"{group}: {method} takes the {cls.__name__} of a step (or the step plan holding "
        f"it as .{field}), got {describe_value(plan)}; pass what prepare() returned, or its "
        f".{field}")


def int_value(group: str, name: str, value: object, lo: int = INT32_MIN,
              hi: int = INT32_MAX) -> int:
    """``value`` as a Python int in ``[lo, hi]``: an int or numpy integer, never a bool or
    a float (integral or not)."""
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise AdapterInputError(
            f"{group}: {name} must be an int, got {describe_value(value)} {value!r}")
    v = int(value)
    if not lo <= v <= hi:
        raise AdapterInputError(f"{group}: {name}={v} must be in [{lo}, {hi}]")
    return v


def int_array(group: str, name: str, values: object, *, lo: int = INT32_MIN,
              hi: int = INT32_MAX, size: int | None = None, what: str = "request",
              rule: str = "") -> np.ndarray:
    """``values`` as a 1-D integer numpy array (of ``size`` entries when given) whose every
    entry lies in ``[lo, hi]``, compared in its own dtype (no wrap). ``what`` names an entry
    in messages; ``rule`` is appended to a range refusal (what to do)."""
    if not isinstance(values, np.ndarray) or values.ndim != 1 or values.dtype.kind not in "iu":
        kind = "integers" if isinstance(values, np.ndarray) and values.ndim == 1 else "a 1-D array"
        raise AdapterInputError(
            f"{group}: {name} must be a 1-D integer numpy array, got {describe_value(values)} "
            f"(it must hold {kind} of one entry per {what})")
    check_size(group, name, values, size, what)
    if values.size:
        # min/max in the array's own dtype, then exact Python ints: no cast can wrap
        low, high = int(values.min()), int(values.max())
        if low < lo or high > hi:
            # numpy compares with out-of-range Python ints exactly (uint64 < -1 is False)
            i = int(np.flatnonzero((values < lo) | (values > hi))[0])
            raise AdapterInputError(
                f"{group}: {what} {i} has {name}={int(values[i])}; it must be in "
                f"[{lo}, {hi}]{'; ' + rule if rule else ''}")
    return values


def bool_mask(group: str, name: str, values: object, *, size: int | None = None,
              what: str = "token") -> np.ndarray:
    """``values`` as a 1-D boolean numpy array: a 0/1 integer array is refused (``~`` of it
    is -1/-2, not a mask)."""
    if not isinstance(values, np.ndarray) or values.ndim != 1 or values.dtype != np.bool_:
        raise AdapterInputError(
            f"{group}: {name} must be a 1-D bool numpy array with one entry per {what}, got "
            f"{describe_value(values)}; pass values.astype(bool) for a 0/1 array")
    check_size(group, name, values, size, what)
    return values


def check_size(group: str, name: str, values: Any, size: int | None, what: str) -> None:
    """``values`` holds exactly ``size`` entries (when given)."""
    if size is not None and values.size != size:
        raise AdapterInputError(
            f"{group}: {name} has {values.size} entries but the batch has {size} {what}s; "
            f"pass one per {what}")


def padded_count(group: str, n: int, padded: object, capacity: int | None = None) -> int:
    """The published request count: ``padded`` (a CUDA-graph size: a Python int in
    ``[n, capacity]``) or ``n`` when it is None. A refusal raises
    :class:`AdapterInputError`."""
    if padded is None:
        return n
    if isinstance(padded, bool) or not isinstance(padded, int) or padded < n:
        raise AdapterInputError(
            f"{group}: padded={padded!r} must be an int >= the batch's {n} requests (pad up to "
            "a captured graph size, never down)")
    if capacity is not None and padded > capacity:
        raise AdapterInputError(f"{group}: padded={padded} exceeds max_reqs={capacity}")
    return padded


def refuse_column(group: str, name: str, values: np.ndarray, bad: np.ndarray, rule: str,
                  what: str = "request") -> None:
    """Raise the refusal of column ``name``'s first ``bad`` entry (a mask), worded as the
    compiled request layout words it."""
    i = int(np.flatnonzero(bad)[0])
    shown = str(values[i])  # numpy's shortest form of a float32 ("1.0000001")
    raise AdapterInputError(f"{group}: {what} {i} has {name}={shown}; {name} must be {rule}")


_INT32_DTYPE = np.dtype(np.int32)


def length_column(group: str, cols: Any, name: str) -> np.ndarray:
    """The batch's ``name`` lengths: a 1-D int32 numpy array (the layout pass checks the
    values and that it is C-contiguous and aligned; reading ``flags`` here would build an
    object per step)."""
    a = getattr(cols, name, None)
    if not isinstance(a, np.ndarray) or a.ndim != 1 or a.dtype != _INT32_DTYPE:
        raise AdapterInputError(
            f"{group}: batch.columns.{name} must be a 1-D C-contiguous int32 numpy array "
            f"with one entry per request, got {describe_value(a)}; build it with "
            "np.ascontiguousarray(values, dtype=np.int32)")
    return a


def page_rows(group: str, rows: object, n: int) -> Sequence[Any] | np.ndarray:
    """``batch.block_tables`` checked as one row per request (``n``): a list, tuple or other
    sequence of rows (not text). Returns it."""
    if type(rows) is not list and type(rows) is not tuple and (
            isinstance(rows, (str, bytes)) or not isinstance(rows, (Sequence, np.ndarray))):
        raise AdapterInputError(f"{group}: batch.block_tables must hold one row per request "
                                f"({n}), got {describe_value(rows)}")
    if len(rows) != n:
        raise AdapterInputError(f"{group}: batch.block_tables must hold one row per request "
                                f"({n}), got {len(rows)}")
    return rows
