"""A block table's member in its group records, bound once: prepare and stage.

What the GPU holds and which byte ranges changed is the block table's own state,
:class:`block_tables.TableStaging` (block-tables owns it: the published and pending
records, the row-key buffers, the range diff). :class:`TableStager` applies its decision
to the member's homes in the slot's group records: omit the member, take the ranges the
diff wrote into the record's range table (when they fit the member's ``max_ranges`` and
the group's staging room), or store a whole-row count; and, after the group's
publication, commits the decision when that publication carried the member. A steady
step builds no Python record.

The rule itself (reuse, changed spans as ranges, or whole rows) is
:class:`~h2d_core.BlockTableState`'s documentation. Compiled by Cython as
``h2d_core._table_stage_native`` when the package is built (required).
"""

from __future__ import annotations

from typing import Any

from block_tables.staging import RANGES as _RANGES
from block_tables.staging import REUSED as _REUSED
from block_tables.staging import PublishedTable
from h2d_kernels import RANGE_OVERHEAD

from .errors import CountError, DuplicatePublicationError

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op decorators
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]

if cython.compiled:  # the table's state through C (block_tables/_staging_native.pxd)
    from cython.cimports.block_tables._staging_native import TableStaging
else:
    from block_tables import TableStaging

__all__ = ["PARTIAL", "REUSED", "WHOLE", "PublishedTable", "TableStager"]

REUSED = "reused"
PARTIAL = "partial"
WHOLE = "whole"
# the block table's decisions as C integers
_DECIDED_REUSED = cython.declare(cython.int, _REUSED)
_DECIDED_RANGES = cython.declare(cython.int, _RANGES)
# RANGE_OVERHEAD as a C integer (a Python int in C arithmetic would box every sum)
_OVERHEAD = cython.declare(cython.longlong, RANGE_OVERHEAD)


@cython.cclass
class TableStager:
    """One block table's member in its group records (see the module docstring).

    ``table`` is the :class:`~h2d_core.BlockTableState` (its buffer, state and snapshots
    are read once here); ``limits`` the ``(most ranges, most bytes)`` of a partial
    publication for every row count ``0..rows``; ``ranged`` whether changed spans may
    travel as ranges (packed backend, a packed group, ``max_ranges > 0``).
    """

    #: the last stage's result ("" before the first)
    last_stage = cython.declare(str, visibility="readonly")
    #: the block table's own publication state (block-tables)
    staging = cython.declare(object, visibility="readonly")
    _staging = cython.declare(TableStaging)
    _buffer = cython.declare(object)
    _group = cython.declare(str)
    _state = cython.declare(object)
    # the state's per-slot records and the epoch's published names (live; fixed at bind)
    _records = cython.declare(list)
    _published = cython.declare(set)
    _homes = cython.declare(list)
    _home_group = cython.declare(cython.Py_ssize_t)
    _member = cython.declare(cython.Py_ssize_t)
    _single_home = cython.declare(cython.bint)
    _unit_bytes = cython.declare(cython.longlong)
    _max_ranges = cython.declare(cython.Py_ssize_t)
    _result = cython.declare(cython.longlong[::1])

    def __init__(self, table: Any, limits: Any, ranged: bool) -> None:
        buffer = table.buffer
        self._buffer = buffer
        self._group = buffer.group
        self._state = table.state
        self._records = table.state.slot_records
        self._published = table.state.groups.published
        self._homes = list(buffer.homes)
        self._home_group = buffer.homes[0][0]
        self._member = buffer.homes[0][1]
        self._single_home = len(buffer.homes) == 1
        self._unit_bytes = buffer._unit_bytes
        self._max_ranges = buffer.max_ranges
        self._staging = TableStaging(table.snapshots, self._unit_bytes, limits,
                                     self._max_ranges, ranged)
        self.staging = self._staging
        self._result = self._staging.result
        self.last_stage = ""

    def set_limits(self, limits: Any) -> None:
        """``limits[n]`` = (most ranges, most bytes) of a partial publication of ``n``
        rows, for every ``n`` the table holds."""
        self._staging.set_limits(limits)

    @property
    def published(self) -> PublishedTable | None:
        """What the GPU destination holds (None: unknown, the next stage sends it whole)."""
        return self._staging.published

    @cython.ccall
    def forget(self) -> None:
        """Forget what the GPU table holds (after a failure or an outside write)."""
        self._staging.forget()

    @cython.ccall
    def clear_pending(self) -> None:
        """Drop this epoch's stage uncommitted (a new epoch, a reopened group, a reset)."""
        self._staging.clear_pending()

    @cython.ccall
    def after_publish(self) -> None:
        """The table's group was published successfully: commit the pending stage when
        that publication carried the member (or the stage sent nothing), at most once."""
        staging = self._staging
        slot: cython.Py_ssize_t = staging.pending_slot
        if slot < 0:
            return
        if staging.pending_unchanged:
            staging.commit()
            return
        records: list = self._records[slot]
        if records[self._home_group].sent(self._member):
            staging.commit()
        else:
            staging.clear_pending()

    # -- one step ---------------------------------------------------------------------------
    @cython.ccall
    def prepare(self, slot: cython.Py_ssize_t, rows: Any, required_pages: Any,
                pad_row: Any = None, pad: cython.Py_ssize_t = 0,
                padding: cython.Py_ssize_t = 0) -> None:
        """Bring slot ``slot``'s snapshot to ``rows`` (:meth:`TableStaging.prepare`)."""
        self._staging.prepare(slot, rows, required_pages, pad_row, pad, padding)

    @cython.ccall
    def stage(self, slot: cython.Py_ssize_t, num_rows: cython.Py_ssize_t) -> str:
        """Decide and set what the table publishes this epoch for rows ``[0, num_rows)`` of
        slot ``slot``'s snapshot: ``"reused"`` (member omitted: the GPU already holds these
        rows at this revision), ``"partial"`` (changed spans as ranges, or nothing when
        none changed) or ``"whole"`` (a row count). The published record moves only once
        the group's publication succeeded. The caller checked the epoch and
        ``num_rows``."""
        if self._group in self._published:
            raise DuplicatePublicationError(
                f"buffer {self._buffer.name!r}: group {self._group!r} was already published "
                "in this epoch; a second publication needs a reason (reopen())")
        records: list = self._records[slot]
        rec = records[self._home_group]
        staging = self._staging
        decision: cython.int = staging.decide(slot, num_rows, rec.range_table,
                                              rec.num_ranges, self._member)
        if decision == _DECIDED_REUSED:
            self._omit(records)
            self.last_stage = REUSED
            return REUSED
        stage: str = WHOLE
        if decision == _DECIDED_RANGES:
            count: cython.longlong = self._result[0]
            total: cython.longlong = self._result[1]
            found = staging.found
            if count == 0:
                self._omit(records)
                stage = PARTIAL
            elif (self._try_take(rec, count, total) if found is None
                  else self._try_ranges(rec, found, total)):
                stage = PARTIAL
        if stage == WHOLE:
            self._store(records, num_rows)
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
    def _try_take(self, rec: Any, count: cython.Py_ssize_t,
                  total: cython.longlong) -> cython.bint:
        """Take the ``count`` ranges the compiled diff wrote past the record's own as the
        member's ranges when they fit (:meth:`_room`); False, changing nothing,
        otherwise."""
        if not self._room(rec, count, total):
            rec.end_ranges()  # the rows written past its ranges are not taken
            return False
        rec.take_ranges(self._member, rec.num_ranges, count, total)
        return True

    @cython.cfunc
    def _try_ranges(self, rec: Any, triples: list, total: cython.longlong) -> cython.bint:
        """Set ``triples`` (trusted ``(member, offset, bytes)`` ranges) as the member's
        ranges when they fit (:meth:`_room`); False, changing nothing, otherwise."""
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
