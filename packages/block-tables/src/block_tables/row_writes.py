"""Writing checked rows into a snapshot's storage, comparing first.

Every write here compares before it writes, so only rows whose bytes really changed are
reported as changed (the snapshot's revision counts byte changes). Rows keep the byte
rule of :mod:`block_tables.snapshot`: IDs in ``[0, length)``, the fill value after; a row
replaced by a shorter one clears only what its previous content held.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .validation import Int32Array, Int64Array


class RowWriter:
    """The write side of one snapshot's storage: compare-then-write row updates and the
    tail clears, counted (``cleared``) as the snapshot's diagnostic."""

    def __init__(self, storage: np.ndarray, fill_value: int, native: Any, bound: object) -> None:
        rows, width = storage.shape
        self.storage = storage
        self.fill = int(fill_value)
        self._flat = storage.reshape(-1)  # fixed flat view for single-page scatters
        self._row_base: Int64Array = np.arange(rows, dtype=np.int64) * width
        # Byte comparisons (tobytes) beat numpy reductions several times on row slices.
        self._fill_row = np.full(width, fill_value, dtype=np.int32)
        self._no_bytes = bytes(rows)
        self._native = native
        self._bound = bound
        #: elements tail clears changed to the fill value, since creation
        self.cleared = 0

    def write_single(self, rows: Int64Array, columns: Int64Array,
                     values: Int32Array) -> Int64Array:
        """Scatter one page ID per row; return the rows whose byte changed."""
        flat_index = self._row_base[rows] + columns
        equal = self._flat[flat_index] == values
        if equal.tobytes() == self._no_bytes[: rows.size]:
            self._flat[flat_index] = values
            return rows
        differs = ~equal
        self._flat[flat_index[differs]] = values[differs]
        return rows[differs]

    def write_rows(
        self,
        appends: list[tuple[int, int, int, Int32Array]],
        shrunk: list[int],
        stored_lengths: Int64Array,
        lengths: Int64Array,
        rewrites: list[tuple[int, Int32Array, int]],
    ) -> list[int]:
        """Row-wise writes; return the rows whose bytes changed.

        ``rewrites`` lists rows in ascending order, each once; when it holds every row of
        the batch (``len(lengths)``), the batch is fully replaced: :meth:`write_replaced`.
        """
        if rewrites and len(rewrites) == lengths.shape[0] and not appends and not shrunk:
            return self.write_replaced(rewrites)
        storage = self.storage
        changed: list[int] = []
        for i, start, stop, ids in appends:
            target = storage[i, start:stop]
            source = ids[start:stop]
            if target.tobytes() != source.tobytes():
                target[...] = source
                changed.append(i)
        for i in shrunk:
            if self.clear_tail(i, int(lengths[i]), int(stored_lengths[i])):
                changed.append(i)
        for i, ids, old_length in rewrites:
            # Copy without clearing first; then clear only what the old content occupied.
            length = ids.shape[0]
            row_changed = False
            target = storage[i, :length]
            if target.tobytes() != ids.tobytes():
                target[...] = ids
                row_changed = True
            if old_length > length and self.clear_tail(i, length, old_length):
                row_changed = True
            if row_changed:
                changed.append(i)
        return changed

    def clear_tail(self, row: int, start: int, stop: int) -> bool:
        """Set columns ``[start, stop)`` of ``row`` to the fill value; False when they
        already held it (nothing written)."""
        tail = self.storage[row, start:stop]
        if tail.tobytes() == self._fill_row[: stop - start].tobytes():
            return False
        self.cleared += int(np.count_nonzero(tail != self.fill))
        tail.fill(self.fill)
        return True

    def write_replaced(self, rewrites: list[tuple[int, Int32Array, int]]) -> list[int]:
        """Write a fully replaced batch: ``rewrites`` holds rows ``0..n-1`` in order.

        One compiled call (``write_replaced``): each row's IDs are copied without clearing
        first (compared first); then every exposed tail (columns ``[new length, stored
        length)``, the part of the old content the new one no longer covers) is cleared in
        one sweep over the storage. Only elements that differ from the fill value are
        written and counted.
        """
        ids = [r[1] for r in rewrites]
        done = self._native.write_replaced(self._bound, ids, self.fill)
        if done is None:
            # An ID array the sweep does not read in place: a strided or misaligned view
            # of the caller's array (coerce_page_ids keeps int32 arrays as they are). The
            # same sweep over contiguous copies, made before any write.
            done = self._native.write_replaced(self._bound, [a.copy() for a in ids], self.fill)
        rows, cleared = done
        self.cleared += cleared
        return list(rows.tolist())
