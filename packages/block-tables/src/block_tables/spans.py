"""Column-exact change spans between a remembered snapshot state and the current one.

A publisher that uploaded rows ``[0, n)`` of a snapshot at some revision, and kept the
row keys of that moment (:func:`row_keys`), can ask which columns of which rows differ
now. An append in the same lineage differs only in its new columns; any other change
(new version, reorder, unversioned or unknown content) differs at most over the columns
either content occupied, because the snapshot keeps every column past a row's length
at the fill value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .lineage import LENGTH_BITS, LENGTH_MASK, UNVERSIONED
from .native import require_extension
from .validation import Int64Array

if TYPE_CHECKING:  # the snapshot calls into this module; this one reads its public state
    from .snapshot import PageTableSnapshot

_native = require_extension("block_tables._snapshot_native")


@dataclass(frozen=True)
class ChangedRows:
    """Rows whose bytes changed since a revision, as sorted, merged half-open ranges.

    ``all_rows`` is True when the snapshot cannot tell (the revision is too old, unknown,
    or the storage was invalidated since); ``ranges`` is then ``((0, num_rows),)``.
    Ranges never reach past the current ``num_rows``.
    """

    ranges: tuple[tuple[int, int], ...]
    all_rows: bool = False

    def __bool__(self) -> bool:
        return bool(self.ranges)

    @property
    def count(self) -> int:
        """Number of rows covered."""
        return sum(stop - start for start, stop in self.ranges)

    def rows(self) -> Int64Array:
        """The covered row indices, ascending."""
        if not self.ranges:
            return np.empty(0, dtype=np.int64)
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self.ranges])


@dataclass(frozen=True)
class ChangedSpans:
    """``rows[k]`` changed in columns ``[starts[k], stops[k])``; rows ascending."""

    rows: list[int]
    starts: list[int]
    stops: list[int]

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def num_ids(self) -> int:
        """Page-ID cells covered."""
        return sum(b - a for a, b in zip(self.starts, self.stops, strict=True))


def row_keys(
    snapshot: PageTableSnapshot, rows: int | None = None, *, out: Int64Array | None = None
) -> Int64Array:
    """A copy of the packed (version, length) keys of rows ``[0, rows)`` (default: the
    snapshot's ``num_rows``): remember it with the revision at upload time and pass it to
    :func:`changed_spans` later. With ``out`` (an int64 array of at least that many rows,
    reused across uploads) the keys are written to ``out[:n]`` and that view returned."""
    n = snapshot.num_rows if rows is None else min(rows, snapshot.num_rows)
    if out is None:
        return snapshot.stored_keys[:n].copy()
    view = out[:n]
    view[...] = snapshot.stored_keys[:n]
    return view


def changed_spans(
    snapshot: PageTableSnapshot,
    keys_then: Int64Array,
    num_rows: int,
    revision: int | None = None,
) -> ChangedSpans | None:
    """Spans of rows ``[0, min(num_rows, len(keys_then)))`` that differ from what a
    publisher uploaded when the row keys were ``keys_then`` (:func:`row_keys`).

    With ``revision`` (the snapshot's revision at that upload; the same snapshot), the
    snapshot's history says exactly which rows changed. Without it (``keys_then`` came from
    another snapshot, e.g. another pipeline slot's table uploaded to the same destination),
    the keys alone decide: equal versioned keys mean equal bytes, and unversioned rows are
    treated as changed. Returns None when the history no longer reaches ``revision``: the
    caller then re-sends whole rows. Rows at or past ``len(keys_then)`` are not covered.
    """
    limit = min(num_rows, keys_then.size)
    now_all = snapshot.stored_keys[:limit]
    if snapshot.all_versioned:
        # The last batch was all versioned: equal keys mean equal bytes, so comparing the
        # keys finds every changed row without the history (compiled: key_spans).
        found = _native.key_spans(now_all, keys_then, limit)
        if found is not NotImplemented:
            return ChangedSpans(*found)
        # keys it does not read (not native int64: unsigned, byte-swapped): the same rule
        # over the rows whose keys differ, below
        rows = np.flatnonzero(now_all != keys_then[:limit])
    elif revision is not None:
        changed = snapshot.changed_rows_since(revision)
        if changed.all_rows:
            return None
        rows = changed.rows()
        rows = rows[rows < limit]
    else:
        differs = (now_all != keys_then[:limit]) | ((now_all >> LENGTH_BITS) == UNVERSIONED)
        rows = np.flatnonzero(differs)
    # Typically a handful of rows: plain ints beat a dozen small numpy calls.
    starts: list[int] = []
    stops: list[int] = []
    kept: list[int] = []
    for r, t, w in zip(rows.tolist(), keys_then[rows].tolist(), now_all[rows].tolist(),
                       strict=True):
        len_then, len_now = t & LENGTH_MASK, w & LENGTH_MASK
        version = w >> LENGTH_BITS
        # versions above UNVERSIONED (0) are real lineages; UNKNOWN is -1
        if (t >> LENGTH_BITS) == version and version > UNVERSIONED and len_now >= len_then:
            start, stop = len_then, len_now  # an append in the same lineage
        else:
            start, stop = 0, max(len_then, len_now)
        if stop > start:
            kept.append(r)
            starts.append(start)
            stops.append(stop)
    return ChangedSpans(kept, starts, stops)


def changed_byte_ranges(
    snapshot: PageTableSnapshot,
    keys_then: Int64Array,
    num_rows: int,
    row_bytes: int,
    *,
    revision: int | None = None,
    max_ranges: int,
    max_bytes: int,
    keys_out: Int64Array | None = None,
) -> tuple[list[tuple[int, int]], int] | None:
    """What to send so a destination holding rows ``[0, len(keys_then))`` with those keys
    holds rows ``[0, num_rows)`` of the snapshot: ``(ranges, total bytes)``, byte ranges
    ``[start, stop)`` of the row-major int32 table (``row_bytes`` per row), ascending, with
    byte-adjacent pieces merged; rows the destination never held travel whole.

    None when :func:`changed_spans` cannot tell (history too short) or when more than
    ``max_ranges`` ranges or ``max_bytes`` bytes would travel: send whole rows instead.

    ``keys_out`` (int64, at least ``num_rows`` long), when given, receives the keys of rows
    ``[0, num_rows)`` whatever the result, as :func:`row_keys` would return them: what to
    remember for this upload, in the same call. ``num_rows`` must not exceed the
    snapshot's ``num_rows`` then.
    """
    rows_then = keys_then.size
    if snapshot.all_versioned:
        found = _native.changed_byte_ranges(
            snapshot.stored_keys, keys_then, rows_then, num_rows, row_bytes, max_ranges,
            max_bytes, keys_out)
        if found is not NotImplemented:
            return found
    # Not all versioned (changed_spans asks the history, or treats unversioned rows as
    # changed), or keys the compiled diff hands back (not native int64, or a read-only
    # keys_out): the same ranges from changed_spans.
    if keys_out is not None:
        keys_out[:num_rows] = snapshot.stored_keys[:num_rows]
    spans = changed_spans(snapshot, keys_then, num_rows, revision)
    if spans is None:
        return None
    pieces = [(r * row_bytes + a * 4, r * row_bytes + b * 4)
              for r, a, b in zip(spans.rows, spans.starts, spans.stops, strict=True)]
    if num_rows > rows_then:
        pieces.append((rows_then * row_bytes, num_rows * row_bytes))
    ranges: list[tuple[int, int]] = []
    for start, stop in pieces:
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], stop)
        else:
            ranges.append((start, stop))
    total = sum(b - a for a, b in ranges)
    if len(ranges) > max_ranges or total > max_bytes:
        return None
    return ranges, total
