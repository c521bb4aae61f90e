"""Group records: one publication group's counts and ranges for one slot and epoch.

A record is what a publication reads: which members are active, each member's count (in
its unit) or byte ranges, and their byte totals. A packed record hands its counts and
ranges to its slot's :class:`h2d_kernels.PackedGroup`, which writes the arena's header. Every
rule that changes a record is a method here, so the state, fused count stores
(:class:`~h2d_core.count_batch.CountBatch`) and block-table staging change records the
same way.
"""

from __future__ import annotations

from typing import Any

from h2d_kernels import RANGE_OVERHEAD, PackedGroup

from .group import GroupPlan

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op decorators
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]



# RANGE_OVERHEAD as a C integer (a Python int in C arithmetic would box every sum)
_OVERHEAD = cython.declare(cython.longlong, RANGE_OVERHEAD)

#: GroupCounters' fields, in order (its constructor's keywords, ``as_dict``'s keys)
COUNTER_FIELDS = ("publications", "bytes", "dmas", "scatters", "direct_copies",
                  "direct_fallbacks", "second_publications")


@cython.cclass
class GroupCounters:
    """Per-group observability counters (cumulative since the state was created).

    ``publications``; ``bytes``: payload bytes published (the sum of the members' counted
    bytes); ``dmas``: packed DMAs issued (each followed by exactly one scatter);
    ``scatters``; ``direct_copies``: direct member copies issued (direct backend,
    single-member groups, covered groups); ``direct_fallbacks``: publications of a
    packed-eligible group that used direct copies instead; ``second_publications``:
    deliberate second publications (a reason was given).

    The counts are C fields, so a step's increments (by byte totals past CPython's cached
    small ints) create no int object; reading a field makes one.
    """

    publications: int
    bytes: int
    dmas: int
    scatters: int
    direct_copies: int
    direct_fallbacks: int
    second_publications: int

    def __init__(self, publications: int = 0, bytes: int = 0, dmas: int = 0,
                 scatters: int = 0, direct_copies: int = 0, direct_fallbacks: int = 0,
                 second_publications: int = 0) -> None:
        self.publications = publications
        self.bytes = bytes
        self.dmas = dmas
        self.scatters = scatters
        self.direct_copies = direct_copies
        self.direct_fallbacks = direct_fallbacks
        self.second_publications = second_publications

    def as_dict(self) -> dict[str, int]:
        """Every count by field name."""
        return {f: getattr(self, f) for f in COUNTER_FIELDS}

    def snapshot(self) -> GroupCounters:
        """A copy of the counts now (this object keeps counting as the state publishes)."""
        return GroupCounters(**self.as_dict())

    def __sub__(self, earlier: GroupCounters) -> GroupCounters:
        """What was counted since ``earlier`` (a :meth:`snapshot`)."""
        mine, theirs = self.as_dict(), earlier.as_dict()
        return GroupCounters(**{f: mine[f] - theirs[f] for f in COUNTER_FIELDS})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GroupCounters):
            return NotImplemented
        return self.as_dict() == other.as_dict()

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value

    def __repr__(self) -> str:
        return "GroupCounters(" + ", ".join(f"{k}={v}" for k, v in self.as_dict().items()) + ")"

    @cython.ccall
    def count_packed(self, rec: GroupRecord) -> None:
        """One packed publication of ``rec``: a DMA, a scatter and its bytes, in C."""
        self.publications += 1
        self.dmas += 1
        self.scatters += 1
        self.bytes += rec.count_bytes + rec.range_bytes

    @cython.ccall
    def count_publication(self, nbytes: cython.longlong) -> None:
        """One publication of ``nbytes`` payload bytes (its copies counted by the caller)."""
        self.publications += 1
        self.bytes += nbytes


@cython.cclass
class GroupRecord:
    """One publication group's per-slot, per-epoch state: counts, ranges and the arena.

    Compiled by Cython when the package is built (required): its methods are the count
    and range rules, and :meth:`store_counts` stores a fused producer's counts in one call.

    The byte ranges live in :attr:`range_table`, an int64 ``(k, 3)`` array of ``(member
    index, destination byte offset, byte count)`` rows bound once: its first
    :attr:`num_ranges` rows are this epoch's ranges and the row after them has member -1
    (the end a publication reads up to, from :attr:`range_table_address`). A block
    table's stage writes its ranges there in place (:meth:`take_ranges`), so a steady
    step makes no tuple or int for them.

    Fields (declared in ``_records_native.pxd``): ``counts``, per member its count this
    epoch (None: omitted); ``ranged``, the members with ranges set (they count as active);
    ``count_bytes`` and ``range_bytes``, the payload bytes of the counts and of the ranges;
    ``active``; ``fused``, whether the arena runs fused first consumers (every publication
    then goes through it).
    """

    plan: GroupPlan
    packed: PackedGroup | None
    counts: Any  # list, None until the first clear
    _kept: list[Any]
    range_table: Any
    num_ranges: int
    range_table_address: int
    _rt: Any
    ranged: set[int]
    range_bytes: int
    count_bytes: int
    active: int
    fused: bool

    def __init__(self, plan: GroupPlan, packed: PackedGroup | None) -> None:
        import numpy as np

        self.plan = plan
        self.packed = packed
        self.fused = False
        self.ranged = set()
        self.counts = None
        # every member's max_ranges, twice (a stage writes its new ranges after the ones
        # it replaces before dropping those), and the end row
        most = sum([getattr(m, "max_ranges", 0) for m in plan.members])
        table = np.zeros((2 * most + 1, 3), dtype=np.int64)
        self.range_table = table
        self._rt = table
        self.range_table_address = int(table.ctypes.data)
        self.num_ranges = 0
        self.clear_counts()

    @property
    def ranges(self) -> list[tuple[int, int, int]]:
        """This epoch's ranges as ``(member index, offset, bytes)`` triples (a new list: a
        reader's view, not the per-step path)."""
        return [(int(self._rt[k, 0]), int(self._rt[k, 1]), int(self._rt[k, 2]))
                for k in range(self.num_ranges)]

    @cython.ccall
    def clear_counts(self) -> None:
        """Forget every count and range (a new epoch or a reopened group)."""
        k: cython.Py_ssize_t
        if self.counts is None:
            self.counts = [None] * len(self.plan.members)
            self._kept = [-1] * len(self.plan.members)
        elif self.count_bytes or self.active:  # in place: no new list per epoch
            counts = self.counts
            for k in range(len(counts)):
                counts[k] = None
        self.num_ranges = 0
        self._rt[0, 0] = -1
        if self.ranged:
            self.ranged.clear()
        self.range_bytes = 0
        self.count_bytes = 0
        self.active = 0

    @cython.ccall
    def omit(self, i: cython.Py_ssize_t) -> None:
        """Member ``i`` publishes nothing this epoch (its count or ranges are dropped)."""
        old = self.counts[i]
        if old is not None:
            self.counts[i] = None
            self.active -= 1
            self.count_bytes -= old * self.plan.members[i].spec.unit_bytes
        if i in self.ranged:
            self.ranged.discard(i)
            self.active -= 1
            self._drop_ranges(i)

    @cython.cfunc
    def _drop_ranges(self, i: cython.Py_ssize_t) -> cython.void:
        """Remove member ``i``'s rows from the table, keeping the others' order."""
        rt = self._rt
        k: cython.Py_ssize_t
        kept: cython.Py_ssize_t = 0
        for k in range(self.num_ranges):
            if rt[k, 0] == i:
                self.range_bytes -= rt[k, 2]
                continue
            if kept != k:
                rt[kept, 0] = rt[k, 0]
                rt[kept, 1] = rt[k, 1]
                rt[kept, 2] = rt[k, 2]
            kept += 1
        if kept != self.num_ranges:  # (unchanged: a stage's new rows may follow them)
            self.num_ranges = kept
            rt[kept, 0] = -1

    @cython.ccall
    def store_count(self, i: cython.Py_ssize_t, n: cython.longlong,
                    unit_bytes: cython.longlong) -> None:
        """Member ``i`` publishes its first ``n`` units (validated by the caller)."""
        old = self.counts[i]
        was: cython.longlong
        if old is None:
            self.active += 1
            self.count_bytes += n * unit_bytes
        else:
            was = old
            if was == n:  # the same count again: keep its int (one above 256 is an object)
                return
            self.count_bytes += (n - was) * unit_bytes
        kept = self._kept[i]
        was = kept
        if was == n:  # the count an earlier epoch stored: store that int object again
            self.counts[i] = kept
        else:
            box = n  # the one int made for a new count
            self._kept[i] = box
            self.counts[i] = box

    @cython.ccall
    def store_counts(self, entries: tuple, values: tuple) -> cython.bint:
        """A fused producer's counts in one call: ``entries[k]`` is ``(member index, unit
        bytes, largest count taken here or -1)`` for ``values[k]`` (an int or None). Returns
        False, storing nothing, when a value is not a plain int in range: the caller then
        checks it the slow way and raises the specific error."""
        k: cython.Py_ssize_t
        count = len(entries)
        if len(values) != count:
            return False
        for k in range(count):
            v = values[k]
            if v is not None and (type(v) is not int or not 0 <= v <= entries[k][2]):
                return False
        for k in range(count):
            v = values[k]
            i, unit = entries[k][0], entries[k][1]
            if v is None:
                if self.counts[i] is not None:
                    self.omit(i)
            else:
                self.store_count(i, v, unit)
        return True

    def replace_ranges(self, i: int, new: list[tuple[int, int, int]]) -> None:
        """Member ``i`` publishes exactly the ranges ``new`` (validated ``(i, offset,
        bytes)`` triples, at most the member's ``max_ranges``) instead of a count."""
        start: cython.Py_ssize_t = self.num_ranges
        if start + len(new) >= self._rt.shape[0]:
            raise ValueError(f"replace_ranges: {len(new)} ranges do not fit the record's "
                             f"table of {self._rt.shape[0] - 1} rows")
        k: cython.Py_ssize_t
        total: cython.longlong = 0
        for k in range(len(new)):
            self._rt[start + k, 0] = new[k][0]
            self._rt[start + k, 1] = new[k][1]
            self._rt[start + k, 2] = new[k][2]
            total += new[k][2]
        self.take_ranges(i, start, len(new), total)

    @cython.ccall
    def take_ranges(self, i: cython.Py_ssize_t, start: cython.Py_ssize_t,
                    count: cython.Py_ssize_t, total: cython.longlong) -> None:
        """Member ``i`` publishes exactly the ``count`` ranges written at rows ``[start,
        start + count)`` of :attr:`range_table` (``start`` was :attr:`num_ranges` when they
        were written; ``total`` their bytes), instead of a count or its earlier ranges."""
        rt = self._rt
        k: cython.Py_ssize_t
        if self.counts[i] is not None or i in self.ranged:
            self.omit(i)  # may move the rows below start down
        at: cython.Py_ssize_t = self.num_ranges
        if at != start:
            for k in range(count):
                rt[at + k, 0] = rt[start + k, 0]
                rt[at + k, 1] = rt[start + k, 1]
                rt[at + k, 2] = rt[start + k, 2]
        self.num_ranges = at + count
        rt[at + count, 0] = -1
        self.active += 1
        self.ranged.add(i)
        self.range_bytes += total

    @cython.ccall
    def end_ranges(self) -> None:
        """Mark the end of the ranges again: rows a diff wrote past them and that were not
        taken (:meth:`take_ranges`) are not published."""
        self._rt[self.num_ranges, 0] = -1

    @cython.ccall
    def sent(self, i: cython.Py_ssize_t) -> cython.bint:
        """Whether member ``i`` publishes anything (a count or ranges) this epoch."""
        return self.counts[i] is not None or i in self.ranged

    @cython.ccall
    def range_room(self, i: cython.Py_ssize_t) -> cython.longlong:
        """Staging bytes member ``i``'s ranges may still take (0 when not packed)."""
        if self.packed is None:
            return 0
        rt = self._rt
        k: cython.Py_ssize_t
        others: cython.longlong = 0
        for k in range(self.num_ranges):
            if rt[k, 0] != i:
                others += rt[k, 2] + _OVERHEAD
        room: cython.longlong = self.packed.range_capacity - others
        return room if room > 0 else 0


# This source is compiled by Cython, as ``h2d_core._records_native``, when the package is
# built; run interpreted, it only hands over to that build (required: block_tables.native
# names the fix when it is missing), so every caller gets the compiled record rules.
if not cython.compiled:
    from block_tables.native import require_extension

    _compiled = require_extension("h2d_core._records_native")
    GroupRecord = _compiled.GroupRecord  # type: ignore[misc]
    GroupCounters = _compiled.GroupCounters  # type: ignore[misc]
