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
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from .snapshot import PageTableSnapshot


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


def prepare_vectors(
    snap: PageTableSnapshot,
    rows: Sequence[object],
    versions: object,
    lengths: object,
    required_pages: Sequence[int] | np.ndarray | None,
) -> int:
    """``snap.prepare(rows, versions=versions, lengths=lengths)`` (module docstring)."""
    n = len(rows)
    if n > snap._rows:
        raise RowCountError(
            f"the batch has {n} rows but the storage holds {snap._rows}; split the batch or "
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
        if int(lens.view(np.uint64).max()) > snap._width:
            bad = int(np.flatnonzero(lens.view(np.uint64) > snap._width)[0])
            raise RowWidthError(
                f"row {bad}: length {int(lens[bad])} is outside [0, {snap._width}] (the table "
                "width); allocate a wider block table",
                row=bad,
            )
    if required_pages is not None:
        check_required_pages(required_pages, lens, lens.view(np.uint64))
    keys = (vers << LENGTH_BITS) | lens
    stored = snap._row_keys[:n]
    delta = keys - stored
    touched = np.flatnonzero(delta)
    if touched.size == 0:  # a hit: no row is read
        snap._num_rows = n
        snap._keys = None
        snap._all_versioned = True
        return snap._revision

    # ---- check every touched row before the first write: the snapshot's write lists -----
    width, limit = snap._width, snap._check_limit  # no pool limit: IDs still >= 0
    appends: list[tuple[int, int, int, Int32Array]] = []  # (row, start, stop, row IDs)
    shrunk: list[int] = []
    rewrites: list[tuple[int, Int32Array, int]] = []  # (row, IDs, length it replaces)
    stored_lengths = snap._lengths
    for i, d in zip(touched.tolist(), delta[touched].tolist(), strict=True):
        old = int(stored_lengths[i])
        new = int(lens[i])
        if abs(d) <= width and d < 0:
            shrunk.append(i)  # same lineage, shorter: clear the tail
            continue
        ids = _row_ids(rows[i], i, new)
        start = old if abs(d) <= width else 0  # same lineage, grown: only the added IDs
        check_page_range(ids[start:new], row=i, start=start, pool_limit=limit)
        if start:
            appends.append((i, start, new, ids))
        else:
            rewrites.append((i, ids, old))

    # ---- write (compare first: only changed bytes count as changes) -----------------------
    changed = snap._write_rows(appends, shrunk, stored_lengths, lens, rewrites)
    stored[...] = keys
    stored_lengths[:n] = lens
    snap._num_rows = n
    snap._keys = None
    snap._all_versioned = True
    if changed:
        return snap._bump(np.array(sorted(changed), dtype=np.int64))
    return snap._revision
