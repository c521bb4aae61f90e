"""Planning a batch the compiled step handed back: every check first, then what to write.

``PageTableSnapshot.prepare`` runs the common decode and prefill-chunk steps in one
compiled call (``_snapshot.pyx``). What that call hands back (lists or arrays as rows,
reordered or new lineages, multi-page appends, shrunk rows, errors to report) is planned
here, as :func:`block_tables.vectors.plan_vector_rows` plans the vector path: the whole
batch is read and checked, and a :class:`ChangedBatch` says what each row needs. Nothing
here writes the storage; the snapshot applies the plan (:mod:`block_tables.row_writes`)
and records it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .errors import PageIdRangeError, ReservedPageError, RowCountError, RowTypeError, RowWidthError
from .lineage import LENGTH_BITS, LENGTH_MASK, UNVERSIONED, BlockTable
from .validation import (
    Int32Array,
    Int64Array,
    check_page_range,
    check_required_pages,
    coerce_page_ids,
    raise_scalar_range_error,
)

UNKNOWN = -1
"""Stored version of a row whose bytes the snapshot does not know."""

_INCOMING_UNVERSIONED = -2  # never equal to a stored version, so such rows always compare

Rows = Sequence[BlockTable | np.ndarray | Sequence[int]]


def row_key(version: int, length: int) -> int:
    """A row's packed (version, length) key, as the snapshot stores it."""
    return (version << LENGTH_BITS) + length


class ChangedBatch(NamedTuple):
    """What a checked batch changes, row by row (all rows already validated)."""

    keys: Int64Array  # the batch's packed (version, length) keys
    lengths: Int64Array
    touched: int  # rows whose key differs from the stored one
    single: Int64Array  # rows that grew by exactly one page, ascending
    single_values: Int32Array | None  # each such row's new last page
    appends: list[tuple[int, int, int, Int32Array]]  # (row, start, stop, row IDs)
    shrunk: list[int]  # same lineage, shorter: clear the tail
    rewrites: list[tuple[int, Int32Array, int]]  # (row, IDs, length it replaces)
    key_fixes: list[tuple[int, int]]  # (row, key): unversioned rows' keys to store
    proofs: list[tuple[BlockTable, int]]  # (table, length) range-checked, to record


class StoredRows(NamedTuple):
    """What the storage holds, as a plan reads it (the snapshot's own arrays, unchanged)."""

    storage: np.ndarray
    keys: Int64Array
    lengths: Int64Array
    width: int
    pool_limit: int
    reserved: int  # -1: no reserved page
    ones: bytes  # int64 ones, as bytes: the one-page-append test


def plan_changed_rows(
    rows: Rows,
    keys: list[int] | None,
    required_pages: Sequence[int] | np.ndarray | None,
    real_rows: int,
    stored: StoredRows,
) -> ChangedBatch:
    """Check ``rows`` whole against ``stored`` and plan their writes; rows
    ``[0, real_rows)`` are real (the only ones checked against the reserved page).
    ``keys`` are the rows' packed keys when every row is a :class:`BlockTable`."""
    if type(rows) not in (list, tuple) and not isinstance(rows, (Sequence, np.ndarray)):
        raise RowTypeError(
            f"rows must be an ordered sequence (list or tuple), got {type(rows).__name__}"
        )
    n = len(rows)
    capacity = stored.keys.shape[0]
    if n > capacity:
        raise RowCountError(
            f"the batch has {n} rows but the storage holds {capacity}; split the "
            "batch or allocate a larger block table"
        )
    limit, width, reserved = stored.pool_limit, stored.width, stored.reserved
    unversioned, packed = _read_keys(rows, keys, n)
    lengths = packed & LENGTH_MASK
    if n and int(lengths.max()) > width:
        row_index = int(np.flatnonzero(lengths > width)[0])
        raise RowWidthError(
            f"row {row_index}: {int(lengths[row_index])} page IDs exceed the table width "
            f"of {width} columns; allocate a wider block table",
            row=row_index,
        )
    if required_pages is not None:
        check_required_pages(required_pages, lengths, lengths.view(np.uint64))
    if isinstance(unversioned, PageIdRangeError):
        raise unversioned
    # With width < 2**23, a key difference within [-width, width] means the same version,
    # and the difference is the length change.
    stored_lengths = stored.lengths[:n]
    delta = packed - stored.keys[:n]
    touched = np.flatnonzero(delta)
    touched_delta = delta[touched]
    moved: list[int] = []
    shrunk: list[int] = []
    appends: list[tuple[int, int, int, Int32Array]] = []
    if touched_delta.tobytes() == stored.ones[: 8 * touched.size]:
        single = touched  # the common step: every changed row grew by exactly one page
    else:
        same = np.abs(touched_delta) <= width
        moved = touched[~same].tolist()
        grown = same & (touched_delta > 0)
        single = touched[grown & (touched_delta == 1)]
        shrunk = touched[same & (touched_delta < 0)].tolist()
        for i in touched[grown & (touched_delta > 1)].tolist():
            table: BlockTable = rows[i]
            start, stop = int(stored_lengths[i]), int(lengths[i])
            ids = table._lin.ids
            checked = max(start, proven_length(table, limit))
            check_page_range(ids[checked:stop], row=i, start=checked, pool_limit=limit)
            if i < real_rows:
                check_reserved(ids[start:stop], i, start, reserved)
            appends.append((i, start, stop, ids))
    single_values = _single_values(rows, single, n, stored_lengths, limit, reserved,
                                   real_rows)
    rewrites: list[tuple[int, Int32Array, int]] = []
    key_fixes: list[tuple[int, int]] = []
    proofs: list[tuple[BlockTable, int]] = []
    if moved:
        _plan_moved(rows, moved, unversioned, packed, lengths, stored, real_rows,
                    rewrites, key_fixes, proofs)
    return ChangedBatch(packed, lengths, int(touched.size), single, single_values, appends,
                        shrunk, rewrites, key_fixes, proofs)


def _read_keys(
    rows: Rows, keys: list[int] | None, n: int,
) -> tuple[dict[int, Int32Array] | PageIdRangeError | None, Int64Array]:
    """The batch's packed keys and its unversioned rows' IDs (or the first ID error, to
    report after every row's type and width checks)."""
    if keys is not None:
        return None, np.fromiter(keys, dtype=np.int64, count=n)
    unversioned: dict[int, Int32Array] = {}
    deferred: PageIdRangeError | None = None
    keys_read: list[int] = []
    for i, row in enumerate(rows):
        if isinstance(row, BlockTable):
            keys_read.append(row._key)
            continue
        try:
            ids = coerce_page_ids(row, row=i)
        except PageIdRangeError as exc:
            deferred = deferred or exc
            ids = np.zeros(len(row), dtype=np.int32)
        unversioned[i] = ids
        keys_read.append(row_key(_INCOMING_UNVERSIONED, ids.shape[0]))
    packed = np.array(keys_read, dtype=np.int64)
    return (deferred if deferred is not None else unversioned), packed


def _single_values(rows: Rows, single: Int64Array, n: int, stored_lengths: Int64Array,
                   limit: int, reserved: int, real_rows: int) -> Int32Array | None:
    """Single-page suffixes: one scalar per row, checked at once."""
    if not single.size:
        return None
    if single.size == n:
        lasts = [table._last for table in rows]  # type: ignore[union-attr]
    else:
        lasts = [rows[i]._last for i in single.tolist()]
    values = np.fromiter(lasts, dtype=np.int32, count=single.size)
    if int(values.view(np.uint32).max()) >= limit:
        raise_scalar_range_error(values, single, stored_lengths[single], limit)
    if reserved >= 0:
        hit = np.flatnonzero((values == reserved) & (single < real_rows))
        if hit.size:
            k = int(hit[0])
            refuse_reserved(int(single[k]), int(stored_lengths[single[k]]), reserved)
    return values


def _plan_moved(rows: Rows, moved: list[int], unversioned: object, packed: Int64Array,
                lengths: Int64Array, stored: StoredRows, real_rows: int,
                rewrites: list[tuple[int, Int32Array, int]], key_fixes: list[tuple[int, int]],
                proofs: list[tuple[BlockTable, int]]) -> None:
    """Changed mapping: new version, reordered, unversioned or unknown rows."""
    limit, reserved = stored.pool_limit, stored.reserved
    unproven: list[tuple[int, int, Int32Array, int]] = []
    stored_length_list = stored.lengths[: len(rows)].tolist()
    length_list = lengths.tolist()
    for i in moved:
        old_length = stored_length_list[i]
        if isinstance(unversioned, dict) and i in unversioned:
            ids = unversioned[i]
            length = ids.shape[0]
            if i < real_rows:  # the same bytes may have been a padding row's
                check_reserved(ids, i, 0, reserved)
            stored_key = int(stored.keys[i])
            if (
                stored_key >> LENGTH_BITS != UNKNOWN
                and old_length == length
                and stored.storage[i, :length].tobytes() == ids.tobytes()
            ):
                key_fixes.append((i, stored_key))  # same bytes: the stored key holds
                continue
            check_page_range(ids, row=i, start=0, pool_limit=limit)
            rewrites.append((i, ids, old_length))
            key_fixes.append((i, row_key(UNVERSIONED, length)))
            continue
        table: BlockTable = rows[i]  # type: ignore[assignment]
        length = length_list[i]
        ids = table._lin.ids[:length]
        if i < real_rows:
            check_reserved(ids, i, 0, reserved)
        proven = min(proven_length(table, limit), length)
        if proven < length:
            unproven.append((i, proven, ids, length))
        proofs.append((table, length))
        rewrites.append((i, ids, old_length))
    if unproven:
        _check_unproven(unproven, packed, stored)


def _check_unproven(unproven: list[tuple[int, int, Int32Array, int]], packed: Int64Array,
                    stored: StoredRows) -> None:
    """Range-check moved rows past what their lineage proof covers.

    A prefix of the same lineage already held by any storage row was validated when it
    was written (under this snapshot's pool limit), so checking resumes after the longest
    such prefix: this is how the proof follows a lineage across reordering.
    """
    stored_versions = stored.keys >> LENGTH_BITS
    order = np.lexsort((stored.lengths, stored_versions))
    sorted_versions = stored_versions[order]
    sorted_lengths = stored.lengths[order]
    index = np.array([item[0] for item in unproven], dtype=np.int64)
    query = packed[index] >> LENGTH_BITS
    position = np.searchsorted(sorted_versions, query, side="right") - 1
    safe = np.maximum(position, 0)
    held = np.where(
        (position >= 0) & (sorted_versions[safe] == query), sorted_lengths[safe], 0
    ).tolist()
    for (i, proven, ids, length), known in zip(unproven, held, strict=True):
        start = max(proven, min(known, length))
        check_page_range(ids[start:length], row=i, start=start, pool_limit=stored.pool_limit)


def check_reserved(ids: Int32Array, row: int, start: int, reserved: int) -> None:
    """Refuse real row ``row`` when ``ids`` (its columns from ``start``) hold the
    reserved page (``reserved`` < 0: none)."""
    if reserved >= 0 and ids.size:
        hit = np.flatnonzero(ids == reserved)
        if hit.size:
            refuse_reserved(row, start + int(hit[0]), reserved)


def refuse_reserved(row: int, column: int, reserved: int) -> None:
    raise ReservedPageError(
        f"row {row}: page ID {reserved} at column {column} is the table's reserved page "
        "(padding storage: only graph padding rows hold it); allocate the request's pages "
        "elsewhere", row=row)


def proven_length(table: BlockTable, limit: int) -> int:
    """Length of the prefix of ``table``'s lineage known to lie in ``[0, limit)``."""
    lin = table._lin
    return lin.proof_len if 0 < lin.proof_limit <= limit else 0


def record_proof(table: BlockTable, length: int, limit: int) -> None:
    """Remember that ``table``'s first ``length`` IDs lie in ``[0, limit)``."""
    lin = table._lin
    if 0 < lin.proof_limit <= limit and lin.proof_len >= length:
        return  # the existing proof is at least as strong
    lin.proof_len = length
    lin.proof_limit = limit
