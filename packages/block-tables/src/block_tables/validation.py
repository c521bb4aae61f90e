"""Read-only checks shared by BlockTable and PageTableSnapshot.

Nothing here writes to a snapshot: every function either returns a value or raises one of
the errors in :mod:`block_tables.errors`, so callers can run all checks before any write.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .errors import (
    MissingPagesError,
    PageIdRangeError,
    RowCountError,
    RowTypeError,
    StorageError,
)

INT32_MIN = -(2**31)
INT32_MAX = 2**31 - 1

NO_POOL_LIMIT = INT32_MAX + 1
"""The bound a snapshot without ``pool_limit`` checks page IDs against: ``[0, 2**31)``,
i.e. only the lower bound (int32 IDs never reach the upper one). -1 is never a page."""

Int32Array = npt.NDArray[np.int32]
Int64Array = npt.NDArray[np.int64]

_EMPTY_IDS: Int32Array = np.empty(0, dtype=np.int32)
_EMPTY_IDS.setflags(write=False)


def _where(row: int | None) -> str:
    return "page IDs" if row is None else f"row {row}"


def coerce_page_ids(value: object, *, row: int | None = None) -> Int32Array:
    """Return ``value`` as a 1-D int32 array, without copying an int32 array.

    Accepts a 1-D integer numpy array or a sequence of ints. The result may be a view of
    the caller's array: use it within the call and never keep it.
    """
    if isinstance(value, np.ndarray):
        arr: np.ndarray[Any, Any] = value
    elif isinstance(value, (list, tuple, range)):
        if len(value) == 0:
            return _EMPTY_IDS
        try:
            arr = np.asarray(value)
        except (ValueError, TypeError, OverflowError) as exc:
            raise RowTypeError(
                f"{_where(row)}: expected a flat list of ints ({exc}); pass page IDs as ints",
                row=row,
            ) from exc
    else:
        raise RowTypeError(
            f"{_where(row)}: expected a BlockTable, a 1-D integer numpy array or a list of "
            f"ints, got {type(value).__name__}",
            row=row,
        )
    if arr.ndim != 1:
        raise RowTypeError(
            f"{_where(row)}: expected a 1-D array of page IDs, got shape {arr.shape}", row=row
        )
    kind = arr.dtype.kind
    if kind == "O" and isinstance(value, (list, tuple)):
        # An object array: a non-int (None, an object) or a Python int beyond int64.
        for col, item in enumerate(value):
            if isinstance(item, bool) or not isinstance(item, (int, np.integer)):
                raise RowTypeError(
                    f"{_where(row)}: page IDs must be ints, got {type(item).__name__} at "
                    f"column {col}",
                    row=row,
                )
        raise PageIdRangeError(
            f"{_where(row)}: a page ID does not fit int32 [{INT32_MIN}, {INT32_MAX}]", row=row
        )
    if kind not in "iu":
        if arr.size == 0:
            return _EMPTY_IDS
        raise RowTypeError(
            f"{_where(row)}: page IDs must be integers, got dtype {arr.dtype}", row=row
        )
    if arr.dtype == np.int32:
        return arr
    if arr.size:
        lo = int(arr.min())
        hi = int(arr.max())
        if lo < INT32_MIN or hi > INT32_MAX:
            bad = lo if lo < INT32_MIN else hi
            col = int(np.flatnonzero(arr == bad)[0])
            raise PageIdRangeError(
                f"{_where(row)}: page ID {bad} at column {col} does not fit int32 "
                f"[{INT32_MIN}, {INT32_MAX}]",
                row=row,
            )
    return arr.astype(np.int32)


def coerce_page_id(value: object) -> int:
    """Return one page ID as a Python int, checking that it fits int32."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise RowTypeError(f"a page ID must be an int, got {type(value).__name__}")
    pid = int(value)
    if pid < INT32_MIN or pid > INT32_MAX:
        raise PageIdRangeError(f"page ID {pid} does not fit int32 [{INT32_MIN}, {INT32_MAX}]")
    return pid


def check_page_range(ids: Int32Array, *, row: int, start: int, pool_limit: int) -> None:
    """Raise PageIdRangeError unless every ID in ``ids`` lies in ``[0, pool_limit)``
    (``NO_POOL_LIMIT``: the lower bound only).

    ``start`` is the column of ``ids[0]`` in the row; it only serves the message. One
    unsigned comparison covers both bounds: a negative int32 reads as a huge uint32.
    """
    if ids.size == 0:
        return
    if int(ids.view(np.uint32).max()) < pool_limit:
        return
    bad = np.flatnonzero(ids.view(np.uint32) >= pool_limit)
    col = int(bad[0])
    raise PageIdRangeError(
        f"row {row}: page ID {int(ids[col])} at column {start + col} "
        + _range_rule(int(ids[col]), pool_limit), row=row)


def _range_rule(value: int, pool_limit: int) -> str:
    """Why ``value`` is refused and what to do, for a bound of ``pool_limit``."""
    if pool_limit >= NO_POOL_LIMIT:
        return ("is negative; page IDs are >= 0 (-1 is never a page: the library writes "
                "padding rows and the fill value itself); pass the pages allocated to the "
                "request, and num_pages= (pool_limit=) to check the pool's upper bound too")
    return (f"is outside [0, pool_limit={pool_limit}); pass page IDs allocated from this "
            "pool (padding rows and the fill value are the library's own)")


def raise_scalar_range_error(
    values: Int32Array, rows: Int64Array, cols: Int64Array, pool_limit: int
) -> None:
    """Raise PageIdRangeError for the first out-of-range single-page suffix."""
    bad = np.flatnonzero(values.view(np.uint32) >= pool_limit)
    k = int(bad[0])
    row = int(rows[k])
    raise PageIdRangeError(
        f"row {row}: appended page ID {int(values[k])} at column {int(cols[k])} "
        + _range_rule(int(values[k]), pool_limit), row=row)


def check_required_pages(
    required: Sequence[int] | np.ndarray, lengths: Int64Array, lengths_u: np.ndarray
) -> None:
    """Raise unless ``0 <= required[i] <= lengths[i]`` for every row ``i``.

    ``lengths_u`` is ``lengths`` viewed as uint64: a negative requirement then reads as a
    huge count, so one comparison covers both bounds.
    """
    req = required if isinstance(required, np.ndarray) else np.asarray(required)
    n = lengths.shape[0]
    if req.shape != (n,):
        raise RowCountError(
            f"required_pages has shape {req.shape} but the batch has {n} rows; pass one "
            "required page count per row"
        )
    if n == 0:
        return
    if req.dtype != np.int64:
        if req.dtype.kind not in "iu":
            raise RowTypeError(
                f"required_pages must hold integers, got dtype {req.dtype}; pass page counts"
            )
        req = req.astype(np.int64)
    if not (req.view(np.uint64) > lengths_u).any():
        return
    row = int(np.flatnonzero(req.view(np.uint64) > lengths_u)[0])
    need = int(req[row])
    if need < 0:
        raise MissingPagesError(
            f"row {row}: required_pages is {need}; a request span needs a page count >= 0",
            row=row,
        )
    raise MissingPagesError(
        f"row {row}: the request span needs {need} pages but the row holds "
        f"{int(lengths[row])}; allocate the missing pages before preparing this step",
        row=row,
    )


def check_snapshot_arguments(
    storage: object, pool_limit: object, fill_value: object, history: int,
    reserved_page: object, max_width: int,
) -> None:
    """Refuse a :class:`~block_tables.PageTableSnapshot`'s bad constructor arguments."""
    if not isinstance(storage, np.ndarray):
        raise StorageError(f"storage must be a numpy int32 array, got {type(storage).__name__}")
    if storage.dtype != np.int32 or storage.ndim != 2:
        raise StorageError(
            f"storage must be 2-D int32, got {storage.ndim}-D {storage.dtype}; pass the CPU "
            "half of the block-table buffer as a [rows, width] int32 array"
        )
    if not storage.flags.c_contiguous or not storage.flags.writeable:
        raise StorageError(
            "storage must be C-contiguous and writeable: pass the buffer itself, not a "
            "transposed, strided or read-only view"
        )
    if storage.shape[1] > max_width:
        raise StorageError(f"storage width {storage.shape[1]} exceeds {max_width} columns")
    if pool_limit is not None and (
        isinstance(pool_limit, bool)
        or not isinstance(pool_limit, (int, np.integer))
        or not 1 <= int(pool_limit) <= INT32_MAX + 1
    ):
        raise StorageError(f"pool_limit must be None or an int in [1, 2**31], got {pool_limit!r}")
    if (
        isinstance(fill_value, bool)
        or not isinstance(fill_value, (int, np.integer))
        or not INT32_MIN <= int(fill_value) <= INT32_MAX
    ):
        raise StorageError(f"fill_value must be an int32, got {fill_value!r}")
    if history < 1:
        raise StorageError(f"history must keep at least 1 revision, got {history}")
    if reserved_page is not None:
        top = INT32_MAX if pool_limit is None else int(pool_limit) - 1
        if (isinstance(reserved_page, bool) or not isinstance(reserved_page, (int, np.integer))
                or not 0 <= int(reserved_page) <= top):
            raise StorageError(
                f"reserved_page must be None or a page ID in [0, {top}], got "
                f"{reserved_page!r}")


def check_prepare_arguments(rows: Sequence[Any] | np.ndarray, padding: object,
                            versions: object, lengths: object,
                            reserved: bool) -> bool:
    """Refuse :meth:`~block_tables.PageTableSnapshot.prepare`'s bad arguments (a snapshot
    with a ``reserved`` page refuses vectors); return whether the batch comes as vectors
    (``versions`` and ``lengths``)."""
    if type(rows) not in (list, tuple) and not isinstance(rows, (Sequence, np.ndarray)):
        # refused on every path, hits included (an iterator would be consumed by the hit
        # test and then read as empty)
        raise RowTypeError(
            f"rows must be an ordered sequence (list or tuple), got {type(rows).__name__}")
    if padding and (type(padding) is not int or not 0 <= padding <= len(rows)):
        raise RowCountError(
            f"padding={padding!r} must be an int in [0, {len(rows)}] (the batch's last rows "
            "that are graph padding)")
    if versions is None and lengths is None:
        return False
    if versions is None or lengths is None:
        raise RowTypeError("pass versions and lengths together (one of them is None)")
    if reserved:
        raise RowTypeError(
            "a snapshot with a reserved page checks each row's pages as they arrive; prepare "
            "it from rows, without versions and lengths")
    return True
