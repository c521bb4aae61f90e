"""A block table's per-step rule as compiled state, bound once: prepare and stage.

:class:`TableStager` holds what one :class:`~h2d_core.BlockTableState` decides each step,
as C fields made when the state is built: which snapshot, revision and rows its GPU
destination holds (the *published* record), what the epoch's stage would publish (the
*pending* record, committed only once the group's publication succeeded), the two row-key
buffers those records name, the partial-publication limits per row count, the member's
homes in its group records and each slot snapshot's compiled binding. A steady step
(:meth:`TableStager.prepare` then :meth:`TableStager.stage`) reads and builds no Python
record: the snapshot's compiled step writes the rows, the compiled diff of row keys
gives the changed byte ranges, and those go into the group record as they are.

The rule itself (reuse, changed spans as ranges, or whole rows) is unchanged from
:class:`~h2d_core.BlockTableState`'s documentation; this module is where it runs.
Compiled by Cython as ``h2d_core._table_stage_native`` when the package is built
(required).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from block_tables import _snapshot_native as _snap  # type: ignore[attr-defined]
from block_tables.spans import row_keys
from h2d_kernels import RANGE_OVERHEAD

from .errors import CountError, DuplicatePublicationError

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op decorators
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]

REUSED = "reused"
PARTIAL = "partial"
WHOLE = "whole"

_prepare_step = _snap.prepare_step
_changed_ranges_into = _snap.changed_ranges_into
# RANGE_OVERHEAD as a C integer (a Python int in C arithmetic would box every sum)
_OVERHEAD = cython.declare(cython.longlong, RANGE_OVERHEAD)


class PublishedTable(NamedTuple):
    """What the GPU destination holds: slot's snapshot, its revision, rows, row keys."""

    slot: int
    revision: int
    rows: int
    keys: Any


@cython.cclass
class TableStager:
    """One block table's prepare-and-stage state (see the module docstring).

    ``table`` is the :class:`~h2d_core.BlockTableState` (its buffer, state and snapshots
    are read once here); ``limits`` the ``(most ranges, most bytes)`` of a partial
    publication for every row count ``0..rows``; ``ranged`` whether changed spans may
    travel as ranges (packed backend, a packed group, ``max_ranges > 0``).
    """

    #: the last stage's result ("" before the first)
    last_stage = cython.declare(str, visibility="readonly")
    _table = cython.declare(object)
    _buffer = cython.declare(object)
    _group = cython.declare(str)
    _state = cython.declare(object)
    _snapshots = cython.declare(tuple)
    _bounds = cython.declare(tuple)
    _pool_limits = cython.declare(tuple)
    _stored_keys = cython.declare(tuple)  # per slot: the snapshot's read-only row keys
    _homes = cython.declare(list)
    _home_group = cython.declare(cython.Py_ssize_t)
    _member = cython.declare(cython.Py_ssize_t)
    _single_home = cython.declare(cython.bint)
    _unit_bytes = cython.declare(cython.longlong)
    _max_ranges = cython.declare(cython.Py_ssize_t)
    _ranged = cython.declare(cython.bint)
    _keys = cython.declare(tuple)
    # per slot, the address of its snapshot's int64 bookkeeping (revision at 0, all
    # versioned at 2), read in C: a revision past 256 read as an attribute boxes an int
    _metas = cython.declare(cython.Py_ssize_t[::1])
    # the range diff's parameters (block_tables changed_ranges_into), written in place
    _params_obj = cython.declare(object)
    _params = cython.declare(cython.longlong[::1])
    _limit_ranges = cython.declare(cython.longlong[::1])
    _limit_bytes = cython.declare(cython.longlong[::1])
    # the published record (valid: the GPU holds it) and the pending one of this epoch
    _pub_valid = cython.declare(cython.bint)
    _pub_slot = cython.declare(cython.Py_ssize_t)
    _pub_revision = cython.declare(cython.longlong)
    _pub_rows = cython.declare(cython.Py_ssize_t)
    _pub_spare = cython.declare(cython.Py_ssize_t)
    _pend_slot = cython.declare(cython.Py_ssize_t)
    _pend_revision = cython.declare(cython.longlong)
    _pend_rows = cython.declare(cython.Py_ssize_t)
    # the pending stage sends nothing (the GPU holds these bytes): it commits even when
    # the publication did not carry the member
    _pend_unchanged = cython.declare(cython.bint)
    _spare = cython.declare(cython.Py_ssize_t)
    # the PublishedTable last handed out (kept while the record does not move)
    _pub_object = cython.declare(object)

    def __init__(self, table: Any, limits: Any, ranged: bool) -> None:
        buffer = table.buffer
        self._table = table
        self._buffer = buffer
        self._group = buffer.group
        self._state = table.state
        self._snapshots = tuple(table.snapshots)
        self._bounds = tuple([s._bound for s in self._snapshots])
        self._pool_limits = tuple([s._limit_arg for s in self._snapshots])
        self._stored_keys = tuple([s.stored_keys for s in self._snapshots])
        self._metas = np.array([s.meta_address for s in self._snapshots], dtype=np.intp)
        self._params_obj = np.zeros(8, dtype=np.int64)
        self._params = self._params_obj
        self._homes = list(buffer.homes)
        self._home_group = buffer.homes[0][0]
        self._member = buffer.homes[0][1]
        self._single_home = len(buffer.homes) == 1
        self._unit_bytes = buffer._unit_bytes
        self._max_ranges = buffer.max_ranges
        self._ranged = ranged
        rows = buffer.spec.shape[0]
        # Row keys remembered per upload, in two reused arrays: a stage writes the one the
        # published record does not name (no allocation per step).
        self._keys = (np.empty(rows, np.int64), np.empty(rows, np.int64))
        self.set_limits(limits)
        self._pub_valid = False
        self._pub_object = None
        self._spare = 0
        self._pend_slot = -1
        self._pend_unchanged = False
        self.last_stage = ""

    def set_limits(self, limits: Any) -> None:
        """``limits[n]`` = (most ranges, most bytes) of a partial publication of ``n``
        rows, for every ``n`` the table holds."""
        arr = np.ascontiguousarray(limits, dtype=np.int64).reshape(-1, 2)
        self._limit_ranges = np.ascontiguousarray(arr[:, 0])
        self._limit_bytes = np.ascontiguousarray(arr[:, 1])

    # -- the published record, as Python reads it ----------------------------------------
    @property
    def published(self) -> PublishedTable | None:
        """What the GPU destination holds (None: unknown, the next stage sends it whole).
        The same object is returned while the record does not move."""
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
        """Drop this epoch's stage uncommitted (a new epoch, a reopened group, a reset)."""
        self._pend_slot = -1

    @cython.ccall
    def after_publish(self) -> None:
        """The table's group was published successfully: commit the pending stage when
        that publication carried the member (or the stage sent nothing), at most once."""
        if self._pend_slot < 0:
            return
        if self._pend_unchanged:
            self._commit()
            return
        records: list = self._state._slot_groups[self._pend_slot]
        rec = records[self._home_group]
        if rec.sent(self._member):
            self._commit()
        else:
            self._pend_slot = -1

    @cython.ccall
    def _commit(self) -> None:
        # idempotent: a stage repeated before its publication registers a second entry
        if self._pend_slot < 0:
            return
        self._pub_valid = True
        self._pub_slot = self._pend_slot
        self._pub_revision = self._pend_revision
        self._pub_rows = self._pend_rows
        self._pub_spare = self._spare
        self._spare = 1 - self._spare
        self._pend_slot = -1
        self._pub_object = None

    # -- one step ---------------------------------------------------------------------------
    @cython.ccall
    def prepare(self, slot: cython.Py_ssize_t, rows: Any, required_pages: Any,
                pad_row: Any = None, pad: cython.Py_ssize_t = 0,
                padding: cython.Py_ssize_t = 0) -> None:
        """Bring slot ``slot``'s snapshot to ``rows`` followed by ``pad`` times
        ``pad_row`` (validated whole before any write); ``padding`` says how many of
        ``rows``' own last rows are graph padding (when the caller appended them itself:
        ``pad`` 0). The common decode step runs the
        snapshot's compiled step here, with no Python frame (it keeps the snapshot's
        revision and history itself); everything else is
        :meth:`block_tables.PageTableSnapshot.prepare`'s."""
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
    def stage(self, slot: cython.Py_ssize_t, num_rows: cython.Py_ssize_t) -> str:
        """Decide and set what the table publishes this epoch for rows ``[0, num_rows)`` of
        slot ``slot``'s snapshot: ``REUSED`` (member omitted: the GPU already holds these
        rows at this revision), ``PARTIAL`` (changed spans as ranges, or nothing when none
        changed) or ``WHOLE`` (a row count). The published record moves only once the
        group's publication succeeded. The caller checked the epoch and ``num_rows``."""
        st = self._state
        if self._group in st._published:
            raise DuplicatePublicationError(
                f"buffer {self._buffer.name!r}: group {self._group!r} was already published "
                "in this epoch; a second publication needs a reason (reopen())")
        snap = self._snapshots[slot]
        meta: cython.pointer[cython.longlong] = cython.cast(
            cython.pointer[cython.longlong], self._metas[slot])
        rev: cython.longlong = meta[0]
        records: list = st._slot_groups[slot]
        if (self._pub_valid and self._pub_slot == slot and self._pub_revision == rev
                and self._pub_rows == num_rows):
            self._omit(records)
            self.last_stage = REUSED
            return REUSED
        spare: cython.Py_ssize_t = self._spare
        keys = self._keys[spare]
        # the ranges found: -1 none (send whole rows), else how many (0: nothing changed)
        count: cython.Py_ssize_t = -1
        total: cython.longlong = 0
        found: Any = None
        if self._ranged and self._pub_valid:
            then = self._keys[self._pub_spare]
            most_ranges: cython.longlong = self._limit_ranges[num_rows]
            most_bytes: cython.longlong = self._limit_bytes[num_rows]
            count = -2
            if meta[2]:  # all versioned: equal keys mean equal bytes, the compiled diff
                rec = records[self._home_group]
                p = self._params
                p[0] = self._pub_rows
                p[1] = num_rows
                p[2] = self._unit_bytes
                p[3] = most_ranges if most_ranges < self._max_ranges else self._max_ranges
                p[4] = most_bytes
                p[5] = self._member  # each range tagged with the record's member index
                p[6] = rec.num_ranges
                count = _changed_ranges_into(self._stored_keys[slot], then, self._params_obj, keys,
                                             rec.range_table)
                total = p[7]
            if count == -2:
                # Unversioned rows, or another slot's table on this destination: the
                # snapshot's rule (its history when the slot is the same).
                found = snap.changed_byte_ranges(
                    then[: self._pub_rows], num_rows, self._unit_bytes, most_ranges,
                    most_bytes, keys, self._member,
                    self._pub_revision if self._pub_slot == slot else None)
                count = -1 if found is None else len(found[0])
        else:
            row_keys(snap, num_rows, out=keys)
        stage: str
        unchanged: cython.bint = False
        if count == 0:
            self._omit(records)
            stage = PARTIAL
            unchanged = True
        elif count > 0 and (self._try_take(records, count, total) if found is None
                            else self._try_ranges(records, found[0], found[1])):
            stage = PARTIAL
        else:
            self._store(records, num_rows)
            stage = WHOLE
        self._pend_slot = slot
        self._pend_revision = rev
        self._pend_rows = num_rows
        self._pend_unchanged = unchanged
        self.last_stage = stage
        # The record moves only once the group's publication succeeded: the state calls
        # after_publish then (this stager is in its _stagers), and clear_pending at the
        # next begin, so an unpublished stage never commits.
        return stage

    @cython.cfunc
    def _omit(self, records: list) -> cython.void:
        if self._single_home:
            records[self._home_group].omit(self._member)
            return
        for gi, i in self._homes:
            records[gi].omit(i)

    @cython.cfunc
    def _store(self, records: list, n: cython.longlong) -> cython.void:
        for gi, i in self._homes:
            if i in records[gi].ranged:
                raise CountError(
                    f"buffer {self._buffer.name!r}: ranges were already set this epoch; "
                    "publish either a count or ranges, not both")
        for gi, i in self._homes:
            records[gi].store_count(i, n, self._unit_bytes)

    @cython.cfunc
    def _room(self, rec: Any, count: cython.Py_ssize_t, total: cython.longlong) -> cython.bint:
        """Whether ``count`` ranges of ``total`` bytes fit the member's ``max_ranges`` and
        the group's staging room."""
        if count > self._max_ranges:
            return False
        packed = rec.packed
        if packed is None:
            return False
        room: cython.longlong = (rec.range_room(self._member) if rec.num_ranges
                                 else packed.range_capacity)
        return total + _OVERHEAD * count <= room

    @cython.cfunc
    def _try_take(self, records: list, count: cython.Py_ssize_t,
                  total: cython.longlong) -> cython.bint:
        """Take the ``count`` ranges the compiled diff wrote past the record's own as the
        member's ranges when they fit (:meth:`_room`); False, changing nothing,
        otherwise."""
        rec = records[self._home_group]
        if not self._room(rec, count, total):
            rec.end_ranges()  # the rows written past its ranges are not taken
            return False
        rec.take_ranges(self._member, rec.num_ranges, count, total)
        return True

    @cython.cfunc
    def _try_ranges(self, records: list, triples: list,
                    total: cython.longlong) -> cython.bint:
        """Set ``triples`` (trusted ``(member, offset, bytes)`` ranges) as the member's
        ranges when they fit (:meth:`_room`); False, changing nothing, otherwise."""
        rec = records[self._home_group]
        if not self._room(rec, len(triples), total):
            return False
        rec.replace_ranges(self._member, triples)
        return True


# This source is compiled by Cython, as ``h2d_core._table_stage_native``, when the package
# is built; run interpreted, it only hands over to that build (required).
if not cython.compiled:
    from block_tables.native import require_extension

    _compiled = require_extension("h2d_core._table_stage_native")
    TableStager = _compiled.TableStager  # type: ignore[misc]
    PublishedTable = _compiled.PublishedTable  # type: ignore[misc]
