"""A block table's publication state, over its slots' snapshots: what the GPU holds, and
what one step must send.

A publisher keeps one :class:`TableStaging` per block table whose slots each prepare
their own :class:`~block_tables.PageTableSnapshot` into one GPU destination. Per step:

1. :meth:`TableStaging.prepare` brings slot ``s``'s snapshot to the batch's rows (the
   common decode step in the snapshot's compiled step, anything else through
   :meth:`~block_tables.PageTableSnapshot.prepare`);
2. :meth:`TableStaging.decide` says what rows ``[0, n)`` of that snapshot need on the GPU:

   * :data:`REUSED`: nothing, the GPU holds these rows of this snapshot at this revision;
   * :data:`RANGES`: the changed byte ranges of the row-major table, written as
     ``(tag, offset, bytes)`` rows into the caller's range table (:attr:`result` holds
     their count and bytes; a count of 0: the bytes are equal, nothing to send), or, when
     the keys alone cannot tell, as a list of triples (:attr:`found`);
   * :data:`WHOLE`: rows ``[0, n)`` whole (the table moved too much, or ranges are off);

3. once the publication that carried the decision succeeded, :meth:`TableStaging.commit`
   makes it what the GPU holds; :meth:`clear_pending` drops it unpublished.

How few ranges still beat whole rows (``limits``: most ranges and bytes per row count) is
the caller's policy; which ranges changed, and what the GPU holds, is this module's. It
reads the snapshots' public state and the compiled diffs of ``_snapshot.pyx`` only.
Compiled by Cython as ``block_tables._staging_native`` (required).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from .spans import row_keys

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op stand-ins
    from . import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]

#: what :meth:`TableStaging.decide` returns
REUSED, RANGES, WHOLE = 0, 1, 2
#: the fields of :attr:`TableStaging.result`
RESULT_COUNT, RESULT_BYTES = 0, 1


class PublishedTable(NamedTuple):
    """What the GPU destination holds: slot's snapshot, its revision, rows, row keys."""

    slot: int
    revision: int
    rows: int
    keys: Any


@cython.cclass
class TableStaging:
    """One block table's publication state (see the module docstring).

    ``snapshots`` are the slots' snapshots (one GPU destination); ``row_bytes`` a row's
    bytes; ``limits`` the ``(most ranges, most bytes)`` of a partial publication for
    every row count ``0..rows``; ``max_ranges`` the most ranges the destination takes at
    once; ``ranged`` whether changed ranges may travel at all.
    """

    # The fields are declared in _staging_native.pxd (a compiled publisher reads them
    # through C): ``result`` (decide's count of ranges and their bytes, int64 [2]:
    # RESULT_COUNT, RESULT_BYTES), ``found`` (decide's ranges as ``(tag, offset, bytes)``
    # triples when the keys alone could not tell, else None), ``pending_slot`` (the slot
    # of the decision made and not yet committed or cleared; -1: none) and
    # ``pending_unchanged`` (it sends nothing: equal bytes, so it commits even when the
    # publication omitted the table), all read-only; the published and pending records,
    # the two row-key buffers and the limits, private.

    def __init__(self, snapshots: Sequence[Any], row_bytes: int, limits: Any,
                 max_ranges: int, ranged: bool) -> None:
        self._snapshots = tuple(snapshots)
        self._bounds = tuple([s.step_binding for s in self._snapshots])
        self._pool_limits = tuple([s.step_pool_limit for s in self._snapshots])
        self._stored_keys = tuple([s.stored_keys for s in self._snapshots])
        self._metas = np.array([s.meta_address for s in self._snapshots], dtype=np.intp)
        self._row_bytes = row_bytes
        self._max_ranges = max_ranges
        self._ranged = ranged
        rows = self._snapshots[0].storage.shape[0]
        # Row keys remembered per upload, in two reused arrays: a decision writes the one
        # the published record does not name (no allocation per step).
        self._keys = (np.empty(rows, np.int64), np.empty(rows, np.int64))
        self._params_obj = np.zeros(8, dtype=np.int64)
        self._params = self._params_obj
        self.result = np.zeros(2, dtype=np.int64)
        self._result = self.result
        self.found = None
        self.set_limits(limits)
        self._pub_valid = False
        self._pub_object: PublishedTable | None = None
        self._pub_slot = 0
        self._pub_revision = 0
        self._pub_rows = 0
        self._pub_spare = 0
        self._pend_revision = 0
        self._pend_rows = 0
        self._spare = 0
        self.pending_slot = -1
        self.pending_unchanged = False

    def set_limits(self, limits: Any) -> None:
        """``limits[n]`` = (most ranges, most bytes) of a partial publication of ``n``
        rows, for every ``n`` the table holds."""
        arr = np.ascontiguousarray(limits, dtype=np.int64).reshape(-1, 2)
        self._limit_ranges = np.ascontiguousarray(arr[:, 0])
        self._limit_bytes = np.ascontiguousarray(arr[:, 1])

    @property
    def published(self) -> PublishedTable | None:
        """What the GPU destination holds (None: unknown, the next decision sends it
        whole). The same object is returned while the record does not move."""
        if not self._pub_valid:
            return None
        if self._pub_object is None:
            self._pub_object = PublishedTable(
                self._pub_slot, self._pub_revision, self._pub_rows,
                self._keys[self._pub_spare][: self._pub_rows])
        return self._pub_object

    @cython.ccall
    def forget(self) -> None:
        """Forget what the GPU table holds (after a failure or an outside write)."""
        self._pub_valid = False
        self._pub_object = None

    @cython.ccall
    def clear_pending(self) -> None:
        """Drop the pending decision uncommitted (its publication did not carry it)."""
        self.pending_slot = -1

    @cython.ccall
    def commit(self) -> None:
        """The pending decision was published: the GPU now holds what it named (at most
        once; nothing when none is pending)."""
        if self.pending_slot < 0:
            return
        self._pub_valid = True
        self._pub_slot = self.pending_slot
        self._pub_revision = self._pend_revision
        self._pub_rows = self._pend_rows
        self._pub_spare = self._spare
        self._spare = 1 - self._spare
        self.pending_slot = -1
        self._pub_object = None

    @cython.ccall
    def prepare(self, slot: cython.Py_ssize_t, rows: Any, required_pages: Any,
                pad_row: Any = None, pad: cython.Py_ssize_t = 0,
                padding: cython.Py_ssize_t = 0) -> None:
        """Bring slot ``slot``'s snapshot to ``rows`` followed by ``pad`` times
        ``pad_row`` (validated whole before any write); ``padding`` says how many of
        ``rows``' own last rows are graph padding (when the caller appended them itself:
        ``pad`` 0). The common decode step runs the snapshot's compiled step here, with
        no Python frame; everything else is :meth:`PageTableSnapshot.prepare`'s."""
        if (type(rows) is list or type(rows) is tuple) and not padding:
            changed: cython.Py_ssize_t = _prepare_step(
                self._bounds[slot], rows, self._pool_limits[slot], required_pages, pad_row,
                pad)
            if changed >= 0:
                return
        # another kind of batch, or an error to report: the snapshot's own prepare
        if pad:
            rows = list(rows) + [pad_row] * pad
            padding = pad
        self._snapshots[slot].prepare(rows, required_pages=required_pages, padding=padding)

    @cython.ccall
    def decide(self, slot: cython.Py_ssize_t, num_rows: cython.Py_ssize_t,
               range_table: Any, first_row: cython.Py_ssize_t,
               tag: cython.Py_ssize_t) -> cython.int:
        """What rows ``[0, num_rows)`` of slot ``slot``'s prepared snapshot send (module
        docstring): :data:`REUSED`, :data:`RANGES` (written from row ``first_row`` of
        ``range_table``, the caller's int64 ``[rows, 3]`` table, each tagged ``tag``;
        count and bytes in :attr:`result`; or :attr:`found`) or :data:`WHOLE`. The
        decision is pending until :meth:`commit`; the caller checks ``num_rows``."""
        meta: cython.pointer[cython.longlong] = cython.cast(
            cython.pointer[cython.longlong], self._metas[slot])
        rev: cython.longlong = meta[0]
        self.found = None
        if (self._pub_valid and self._pub_slot == slot and self._pub_revision == rev
                and self._pub_rows == num_rows):
            return REUSED
        keys = self._keys[self._spare]
        # the ranges found: -1 none (send whole rows), else how many (0: nothing changed)
        count: cython.Py_ssize_t = -1
        total: cython.longlong = 0
        if self._ranged and self._pub_valid:
            then = self._keys[self._pub_spare]
            most_ranges: cython.longlong = self._limit_ranges[num_rows]
            most_bytes: cython.longlong = self._limit_bytes[num_rows]
            count = -2
            if meta[2]:  # all versioned: equal keys mean equal bytes, the compiled diff
                p = self._params
                p[0] = self._pub_rows
                p[1] = num_rows
                p[2] = self._row_bytes
                p[3] = most_ranges if most_ranges < self._max_ranges else self._max_ranges
                p[4] = most_bytes
                p[5] = tag
                p[6] = first_row
                count = _changed_ranges_into(self._stored_keys[slot], then, self._params_obj,
                                             keys, range_table)
                total = p[7]
            if count == -2:
                # Unversioned rows, or another slot's table on this destination: the
                # snapshot's rule (its history when the slot is the same).
                found = self._snapshots[slot].changed_byte_ranges(
                    then[: self._pub_rows], num_rows, self._row_bytes, most_ranges,
                    most_bytes, keys, tag,
                    self._pub_revision if self._pub_slot == slot else None)
                if found is not None:
                    self.found = found[0]
                    count = len(found[0])
                    total = found[1]
                else:
                    count = -1
        else:
            row_keys(self._snapshots[slot], num_rows, out=keys)
        self.pending_slot = slot
        self._pend_revision = rev
        self._pend_rows = num_rows
        self.pending_unchanged = count == 0
        if count < 0:
            return WHOLE
        self._result[0] = count
        self._result[1] = total
        return RANGES


# This source is compiled by Cython, as ``block_tables._staging_native``, when the package
# is built; run interpreted, it only hands over to that build (required).
if cython.compiled:
    from . import _snapshot_native as _snapshot  # type: ignore[attr-defined]

    _prepare_step = _snapshot.prepare_step
    _changed_ranges_into = _snapshot.changed_ranges_into
else:
    from .native import require_extension

    _compiled = require_extension("block_tables._staging_native")
    TableStaging = _compiled.TableStaging  # type: ignore[misc]
    PublishedTable = _compiled.PublishedTable  # type: ignore[misc]
