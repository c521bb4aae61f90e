"""A plain-Python model of PageTableSnapshot's documented rules: the test oracle.

The snapshot runs its rules compiled (``_snapshot.pyx``) with Python for the batches the
compiled step hands back; this module restates what they must produce, from the module
docstrings of ``snapshot.py`` and ``spans.py`` and the package README, written plainly:
lists of ints, no numpy, no shortcut. Production code never imports it.

Only accepted batches are modelled: which batch is rejected, and with which error, is
predicted by the tests themselves, and a rejected batch must change nothing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

LENGTH_BITS = 24  # a row key is (version << LENGTH_BITS) + length
UNKNOWN = -1  # the stored version of a row whose bytes the snapshot does not know
UNVERSIONED = 0  # the stored version of a row last written from a list or array


def key(version: int, length: int) -> int:
    return (version << LENGTH_BITS) + length


def key_length(k: int) -> int:
    return k & ((1 << LENGTH_BITS) - 1)


def key_version(k: int) -> int:
    return k >> LENGTH_BITS


@dataclass(frozen=True)
class OracleRow:
    """One row of a batch: its page IDs and, for a BlockTable, its version (None for an
    unversioned list or array)."""

    ids: tuple[int, ...]
    version: int | None = None


def merge(rows: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Sorted unique row indices as half-open ranges."""
    ranges: list[list[int]] = []
    for r in rows:
        if ranges and ranges[-1][1] == r:
            ranges[-1][1] = r + 1
        else:
            ranges.append([r, r + 1])
    return tuple((a, b) for a, b in ranges)


class OracleSnapshot:
    def __init__(self, storage: Sequence[Sequence[int]], *, fill: int, history: int) -> None:
        self.width = len(storage[0])
        self.fill = fill
        self.storage = [list(row) for row in storage]
        self.keys = [key(UNKNOWN, self.width)] * len(storage)
        self.lengths = [self.width] * len(storage)
        self.num_rows = 0
        self.revision = 0
        self.all_versioned = False
        self.history: deque[tuple[int, list[int] | None]] = deque(maxlen=history)

    # -- preparing ------------------------------------------------------------------------

    def prepare(self, batch: Sequence[OracleRow]) -> int:
        """An accepted batch: rows [0, n) become the naive full-width rebuild."""
        changed = []
        for i, row in enumerate(batch):
            new = list(row.ids) + [self.fill] * (self.width - len(row.ids))
            same_bytes = self.storage[i][: len(row.ids)] == list(row.ids)
            if row.version is not None:
                self.keys[i] = key(row.version, len(row.ids))
            elif not (key_version(self.keys[i]) != UNKNOWN and self.lengths[i] == len(row.ids)
                      and same_bytes):
                # an unversioned row keeps the stored key only when that key still
                # describes the bytes (same length, same IDs, known content)
                self.keys[i] = key(UNVERSIONED, len(row.ids))
            self.lengths[i] = len(row.ids)
            if self.storage[i] != new:
                self.storage[i] = new
                changed.append(i)
        self.num_rows = len(batch)
        self.all_versioned = all(row.version is not None for row in batch)
        if changed:  # the revision counts byte changes
            self.revision += 1
            self.history.append((self.revision, changed))
        return self.revision

    def invalidate(self) -> None:
        self.keys = [key(UNKNOWN, self.width)] * len(self.storage)
        self.lengths = [self.width] * len(self.storage)
        self.all_versioned = False
        self.num_rows = 0
        self.revision += 1
        self.history.append((self.revision, None))

    # -- reading --------------------------------------------------------------------------

    def changed_rows_since(self, revision: int) -> tuple[tuple[tuple[int, int], ...], bool]:
        """(ranges, all_rows), as ChangedRows holds them."""
        everything = (((0, self.num_rows),) if self.num_rows else (), True)
        if revision == self.revision:
            return (), False
        if revision > self.revision or revision < 0:
            return everything
        kept = {rev for rev, _ in self.history}
        if any(rev not in kept for rev in range(revision + 1, self.revision + 1)):
            return everything  # the history no longer reaches back that far
        rows: set[int] = set()
        for rev, changed in self.history:
            if rev > revision:
                if changed is None:
                    return everything  # invalidated since
                rows.update(changed)
        return merge(sorted(r for r in rows if r < self.num_rows)), False

    def spans(
        self, keys_then: Sequence[int], num_rows: int, revision: int | None
    ) -> tuple[list[int], list[int], list[int]] | None:
        """changed_spans: (rows, starts, stops), or None when the history cannot tell."""
        limit = min(num_rows, len(keys_then))
        now = self.keys[:limit]
        if self.all_versioned:
            # equal versioned keys mean equal bytes
            candidates = [r for r in range(limit) if now[r] != keys_then[r]]
        elif revision is not None:
            ranges, all_rows = self.changed_rows_since(revision)
            if all_rows:
                return None
            candidates = [r for a, b in ranges for r in range(a, b) if r < limit]
        else:
            # keys alone: unversioned rows are always treated as changed
            candidates = [r for r in range(limit)
                          if now[r] != keys_then[r] or key_version(now[r]) == UNVERSIONED]
        rows, starts, stops = [], [], []
        for r in candidates:
            then, w = keys_then[r], now[r]
            len_then, len_now = key_length(then), key_length(w)
            if (key_version(then) == key_version(w) and key_version(w) > UNVERSIONED
                    and len_now >= len_then):
                start, stop = len_then, len_now  # an append in the same lineage
            else:
                start, stop = 0, max(len_then, len_now)  # either content's columns
            if stop > start:
                rows.append(r)
                starts.append(start)
                stops.append(stop)
        return rows, starts, stops

    def byte_ranges(
        self, keys_then: Sequence[int], num_rows: int, row_bytes: int, revision: int | None,
        max_ranges: int, max_bytes: int,
    ) -> tuple[list[tuple[int, int]], int] | None:
        """changed_byte_ranges: merged [start, stop) byte ranges and their total, or None
        (the history cannot tell, or more than the limits would travel)."""
        spans = self.spans(keys_then, num_rows, revision)
        if spans is None:
            return None
        rows, starts, stops = spans
        pieces = [(r * row_bytes + 4 * a, r * row_bytes + 4 * b)
                  for r, a, b in zip(rows, starts, stops, strict=True)]
        if num_rows > len(keys_then):  # rows the destination never held travel whole
            pieces.append((len(keys_then) * row_bytes, num_rows * row_bytes))
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
