"""Preparation from the caller's own version and length vectors.

An engine that keeps its page mapping in its own per-row storage (arrays, lists) can keep
an append-lineage version per row itself: a version drawn from
:func:`block_tables.draw_version` when a row is created or changed other than by
appending, kept while it only grows. ``PageTableSnapshot.prepare(rows, versions=...,
lengths=...)`` then identifies the batch mapping from the two vectors alone, as the spec
puts it ("ordered version and length vectors identify the batch mapping without reading
page IDs"):

* a hit (every row's version and length as stored) costs a few array operations over
  the vectors, whatever the batch size, and reads no row;
* a row whose version is unchanged and whose length grew copies only the added IDs;
* a row whose version changed is rewritten from its IDs (tail cleared as usual);
* a row whose version is unchanged and whose length shrank clears its tail.

Only changed rows are read, and each one read must hold ``lengths[i]`` IDs. All rows are
validated before any write; a rejected batch changes nothing. The versions share the
process's version space with :class:`~block_tables.BlockTable` (draw them with
``draw_version``): two different contents under one version would pass as a hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from .errors import RowCountError, RowTypeError, RowWidthError
from .lineage import LENGTH_BITS, MAX_VERSION, BlockTable
from .validation import (
    Int32Array,
    Int64Array,
    check_page_range,
    check_required_pages,
    coerce_page_ids,
)


class VectorRows(NamedTuple):
    """What a batch given by version and length vectors changes, checked whole and not yet
    written: the snapshot applies it (``PageTableSnapshot.prepare(rows, versions=...,
    lengths=...)``). No touched row is a hit."""

    keys: Int64Array  # the batch's packed (version, length) keys
    lengths: Int64Array
    touched: int  # rows whose key differs from the stored one
    appends: list[tuple[int, int, int, Int32Array]]  # (row, start, stop, row IDs)
    shrunk: list[int]  # same lineage, shorter: clear the tail
    rewrites: list[tuple[int, Int32Array, int]]  # (row, IDs, length it replaces)


def _vector(name: str, value: object, n: int) -> Int64Array:
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.shape != (n,) or arr.dtype.kind not in "iu":
        raise RowTypeError(
            f"{name} must be a 1-D integer array with one entry per row ({n}), got "
            f"shape {arr.shape} dtype {arr.dtype}"
        )
    return arr.astype(np.int64, copy=False)


def _row_ids(row: object, i: int, length: int) -> Int32Array:
    ids = row.page_ids_view() if isinstance(row, BlockTable) else coerce_page_ids(row, row=i)
    if ids.shape[0] != length:
        raise RowWidthError(
            f"row {i}: lengths[{i}]={length} but the row holds {ids.shape[0]} page IDs; "
            "pass each row's current length",
            row=i,
        )
    return ids


def plan_vector_rows(
    rows: Sequence[object],
    versions: object,
    lengths: object,
    required_pages: Sequence[int] | np.ndarray | None,
    *,
    capacity: int,
    width: int,
    pool_limit: int,
    stored_keys: Int64Array,
    stored_lengths: Int64Array,
) -> VectorRows:
    """Check a batch given by version and length vectors (module docstring) against a
    table of ``capacity`` rows of ``width`` IDs holding ``stored_keys`` /
    ``stored_lengths``, and say what it changes; reads only the touched rows, writes
    nothing."""
    n = len(rows)
    if n > capacity:
        raise RowCountError(
            f"the batch has {n} rows but the storage holds {capacity}; split the batch or "
            "allocate a larger block table"
        )
    vers = _vector("versions", versions, n)
    lens = _vector("lengths", lengths, n)
    if n:
        if int(vers.min()) < 1 or int(vers.max()) > MAX_VERSION:
            bad = int(np.flatnonzero((vers < 1) | (vers > MAX_VERSION))[0])
            raise RowTypeError(
                f"row {bad}: version {int(vers[bad])} is outside [1, {MAX_VERSION}]; draw "
                "versions with block_tables.draw_version()",
                row=bad,
            )
        if int(lens.view(np.uint64).max()) > width:
            bad = int(np.flatnonzero(lens.view(np.uint64) > width)[0])
            raise RowWidthError(
                f"row {bad}: length {int(lens[bad])} is outside [0, {width}] (the table "
                "width); allocate a wider block table",
                row=bad,
            )
    if required_pages is not None:
        check_required_pages(required_pages, lens, lens.view(np.uint64))
    keys = (vers << LENGTH_BITS) | lens
    delta = keys - stored_keys[:n]
    touched = np.flatnonzero(delta)
    appends: list[tuple[int, int, int, Int32Array]] = []
    shrunk: list[int] = []
    rewrites: list[tuple[int, Int32Array, int]] = []
    for i, d in zip(touched.tolist(), delta[touched].tolist(), strict=True):
        old = int(stored_lengths[i])
        new = int(lens[i])
        if abs(d) <= width and d < 0:
            shrunk.append(i)
            continue
        ids = _row_ids(rows[i], i, new)
        start = old if abs(d) <= width else 0  # same lineage, grown: only the added IDs
        check_page_range(ids[start:new], row=i, start=start, pool_limit=pool_limit)
        if start:
            appends.append((i, start, new, ids))
        else:
            rewrites.append((i, ids, old))
    return VectorRows(keys, lens, int(touched.size), appends, shrunk, rewrites)
