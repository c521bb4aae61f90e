"""A snapshot's bookkeeping: its last batch and which rows each revision changed.

:class:`SnapshotBook` holds the fields a step changes as int64 entries the compiled step
writes (no int object per step). :class:`RevisionHistory` is its revision history:

a ring of the last ``length`` revisions, written by the compiled step
(``_snapshot.pyx``'s ``record_revision``) and read here: revision ``r``'s changed rows are
the first ``counts[r % length]`` items of ``rows[r % length]`` (-1: every row). Revisions
are consecutive, so the last ``length`` of them are always there.
"""

from __future__ import annotations

import numpy as np

from .spans import ChangedRows
from .validation import Int64Array


def row_ranges(rows: Int64Array) -> tuple[tuple[int, int], ...]:
    """Merge sorted unique row indices into half-open ranges."""
    if rows.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([rows[0]], rows[breaks])).tolist()
    stops = (np.concatenate((rows[breaks - 1], [rows[-1]])) + 1).tolist()
    return tuple(zip(starts, stops, strict=True))


class RevisionHistory:
    """The ring of a snapshot of ``capacity`` rows, keeping ``length`` revisions."""

    def __init__(self, length: int, capacity: int) -> None:
        self.length = int(length)
        self.counts: Int64Array = np.zeros(length, dtype=np.int64)
        self.rows: Int64Array = np.zeros((length, capacity), dtype=np.int64)

    def rows_since(self, revision: int, current: int, num_rows: int) -> ChangedRows:
        """Rows of ``[0, num_rows)`` changed after ``revision``, up to ``current``; all
        of them when the ring no longer (or never) held that revision, or one since
        changed every row."""
        if revision == current:
            return ChangedRows(())
        n = self.length
        if revision > current or revision < 0 or current - revision > n:
            return _all_rows(num_rows)
        parts: list[Int64Array] = []
        for rev in range(revision + 1, current + 1):
            count = int(self.counts[rev % n])
            if count < 0:
                return _all_rows(num_rows)
            parts.append(self.rows[rev % n, :count])
        merged = parts[0] if len(parts) == 1 else np.unique(np.concatenate(parts))
        return ChangedRows(row_ranges(merged[merged < num_rows]))

    def recorded(self, current: int) -> list[tuple[int, Int64Array | None]]:
        """The recorded revisions up to ``current``, oldest first: (revision, changed
        rows, or None for every row)."""
        n = self.length
        out: list[tuple[int, Int64Array | None]] = []
        for r in range(max(1, current - n + 1), current + 1):
            count = int(self.counts[r % n])
            out.append((r, None if count < 0 else self.rows[r % n, :count].copy()))
        return out


#: the entries of a snapshot's bookkeeping array (_snapshot.pyx: META_*)
REVISION, NUM_ROWS, ALL_VERSIONED, KEYS_VALID = range(4)


class SnapshotBook:
    """What a snapshot of ``capacity`` rows knows of its last batch and revisions:
    ``meta`` (int64: the revision, the batch's rows, whether every row of it was a
    BlockTable, whether :attr:`keys` describes it), the last handed-back batch's packed
    keys (the hit test of a batch the compiled step hands back) and the history of
    ``history`` revisions."""

    def __init__(self, history: int, capacity: int) -> None:
        self.meta: Int64Array = np.zeros(4, dtype=np.int64)
        self.revisions = RevisionHistory(history, capacity)
        self._key_list: list[int] | None = None

    @property
    def revision(self) -> int:
        return int(self.meta[REVISION])

    @property
    def num_rows(self) -> int:
        return int(self.meta[NUM_ROWS])

    @num_rows.setter
    def num_rows(self, n: int) -> None:
        self.meta[NUM_ROWS] = n

    @property
    def all_versioned(self) -> bool:
        """Every row of the last batch was a BlockTable: equal keys mean equal bytes."""
        return bool(self.meta[ALL_VERSIONED])

    @all_versioned.setter
    def all_versioned(self, value: bool) -> None:
        self.meta[ALL_VERSIONED] = bool(value)

    @property
    def keys(self) -> list[int] | None:
        return self._key_list if self.meta[KEYS_VALID] else None

    @keys.setter
    def keys(self, keys: list[int] | None) -> None:
        self._key_list = keys
        self.meta[KEYS_VALID] = keys is not None

    @property
    def history(self) -> list[tuple[int, Int64Array | None]]:
        """The recorded revisions, oldest first: (revision, changed rows or None)."""
        return self.revisions.recorded(self.revision)


def _all_rows(num_rows: int) -> ChangedRows:
    return ChangedRows(((0, num_rows),) if num_rows else (), all_rows=True)
