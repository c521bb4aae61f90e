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

    publications = cython.declare(cython.longlong, visibility="public")
    bytes = cython.declare(cython.longlong, visibility="public")
    dmas = cython.declare(cython.longlong, visibility="public")
    scatters = cython.declare(cython.longlong, visibility="public")
    direct_copies = cython.declare(cython.longlong, visibility="public")
    direct_fallbacks = cython.declare(cython.longlong, visibility="public")
    second_publications = cython.declare(cython.longlong, visibility="public")

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
    """

    plan = cython.declare(object, visibility="public")
    packed = cython.declare(object, visibility="public")
    #: per member: its count this epoch (None: omitted)
    counts = cython.declare(list, visibility="public")
    # per member, the last count stored, kept across epochs: the same count next epoch
    # stores this object again (a count above 256 would be a new int each epoch)
    _kept = cython.declare(list)
    #: the ranges' table (see the class docstring) and how many of its rows are set
    range_table = cython.declare(object, visibility="readonly")
    num_ranges = cython.declare(cython.Py_ssize_t, visibility="readonly")
    #: the table's data address (an int made once: what a packed publication reads)
    range_table_address = cython.declare(object, visibility="readonly")
    _rt = cython.declare(cython.longlong[:, ::1])
    #: members with ranges set (they count as active)
    ranged = cython.declare(set, visibility="public")
    range_bytes = cython.declare(cython.longlong, visibility="public")
    #: payload bytes of the counts set (the ranges' bytes are in ``range_bytes``)
    count_bytes = cython.declare(cython.longlong, visibility="public")
    active = cython.declare(cython.longlong, visibility="public")
    #: the arena runs fused first consumers: every publication goes through it
    fused = cython.declare(cython.bint, visibility="public")

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


#: what a counted member publishes (:class:`CountProgram`): real requests, padded requests,
#: real tokens, padded tokens (each plus a fixed offset, e.g. a prefix of ``padded + 1``),
#: the layout's published rows of one plan (the rule names the plan: ``RequestLayout``'s
#: ``plan_published[k]``), or nothing (a member of the group the step leaves out, e.g. a
#: prefill-only member of a decode step's group), or the step's four counts themselves
#: (``STEP_COUNTS``: ``(n, p, t, pt)`` as int32, which a :class:`~h2d_core.LayoutStep`
#: writes into the member's source, so first consumers fused into the publication read the
#: real request count on the device)
REQS = 0
PADDED_REQS = 1
TOKENS = 2
PADDED_TOKENS = 3
PLAN_ROWS = 4
OMITTED = 5
STEP_COUNTS = 6
#: the step's draft tokens: the sum of its layout's summed column (``sum_column``)
DRAFTS = 7


@cython.cclass
class CountProgram:
    """A fused producer's count rules for one group record, bound once: row ``k`` of
    ``rules`` is ``(member index, unit bytes, largest count stored here or -1, what, plus,
    omit_if_uniform, plan[, times])``: member ``k`` publishes ``times`` (default 1) times
    ``what`` (``REQS``, ``PADDED_REQS``, ``TOKENS``, ``PADDED_TOKENS`` or ``PLAN_ROWS``: the
    published rows of plan ``plan``) plus ``plus`` units, or nothing when ``what`` is
    ``OMITTED`` or the step's uniform mask has a bit of ``omit_if_uniform`` set.
    :meth:`store_homes` reads C ints only (and the plan row counts from the layout's list): no
    tuple, list or int object is made per step but the counts the record keeps.

    A ninth column names the row's record: an index into the list :meth:`store_homes`
    takes (0 when the rules give none), so members that sit in several records (a buffer
    shared by two combined groups, e.g. a decode step's and a prefill step's token inputs)
    have one row per home; rows of one record are best kept together (one record lookup
    per run of them)."""

    _rules = cython.declare(cython.longlong[:, ::1])
    _size = cython.declare(cython.Py_ssize_t)
    # bind_counts' int64 [n, p, t, pt, uniform, drafts], read by store_bound
    _bound = cython.declare(cython.longlong[::1])

    def __init__(self, rules: object) -> None:
        import numpy as np

        array = np.asarray(rules, dtype=np.int64)
        array = array.reshape(-1, array.shape[-1] if array.size else 7)
        if array.shape[1] == 7:  # no multiplier given: 1
            array = np.concatenate([array, np.ones((array.shape[0], 1), np.int64)], axis=1)
        if array.shape[1] == 8:  # no record given: the list's first
            array = np.concatenate([array, np.zeros((array.shape[0], 1), np.int64)], axis=1)
        array = np.ascontiguousarray(array.reshape(-1, 9))
        self._rules = array
        self._size = array.shape[0]

    def bind_counts(self, counts: Any) -> None:
        """Bind an int64 array ``[n, p, t, pt, uniform, drafts]`` (at least 6 items) that
        :meth:`store_bound` reads: a compiled caller passes its counts through it, so a
        count above 256 never becomes an int object on the way."""
        self._bound = counts

    @cython.ccall
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def store_bound(self, records: list, plans: list | None = None) -> cython.bint:
        """:meth:`store_homes` with the counts of the array :meth:`bind_counts` bound."""
        c = self._bound
        return self.store_homes(records, c[0], c[1], c[2], c[3], c[4], plans, c[5])

    @cython.ccall
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def store_homes(self, records: list, n: cython.longlong, p: cython.longlong,
                    t: cython.longlong, pt: cython.longlong, uniform: cython.longlong,
                    plans: list | None = None, drafts: cython.longlong = 0) -> cython.bint:
        """Store every rule's count for ``n`` / ``p`` requests, ``t`` / ``pt`` tokens,
        ``plans`` (the layout's published rows per plan, ints; None without ``PLAN_ROWS``
        rules) and ``drafts`` draft tokens, each row into ``records[its record column]``.
        Returns False, storing nothing in any record, when a count exceeds its member's
        largest (the caller then raises the specific error the slow way)."""
        if not self._fits(n, p, t, pt, uniform, plans, drafts):
            return False
        rules = self._rules
        if self._size == 0:
            return True
        k: cython.Py_ssize_t
        at: cython.longlong = rules[0, 8]
        record: GroupRecord = records[at]
        for k in range(self._size):
            if rules[k, 8] != at:  # rows grouped by record: one lookup per record
                at = rules[k, 8]
                record = records[at]
            self._store_row(record, k, n, p, t, pt, uniform, plans, drafts)
        return True

    @cython.cfunc
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _fits(self, n: cython.longlong, p: cython.longlong, t: cython.longlong,
              pt: cython.longlong, uniform: cython.longlong, plans: list | None,
              drafts: cython.longlong) -> cython.bint:
        rules = self._rules
        k: cython.Py_ssize_t
        v: cython.longlong
        for k in range(self._size):
            if rules[k, 3] == 5 or uniform & rules[k, 5]:  # OMITTED, or a uniform filter
                continue
            v = rules[k, 4] + rules[k, 7] * _counted(rules[k, 3], n, p, t, pt, plans,
                                                     rules[k, 6], drafts)
            if v < 0 or v > rules[k, 2]:
                return False
        return True

    @cython.cfunc
    @cython.inline
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _store_row(self, record: GroupRecord, k: cython.Py_ssize_t, n: cython.longlong,
                   p: cython.longlong, t: cython.longlong, pt: cython.longlong,
                   uniform: cython.longlong, plans: list | None,
                   drafts: cython.longlong) -> cython.void:
        rules = self._rules
        if rules[k, 3] == 5 or uniform & rules[k, 5]:
            if record.counts[rules[k, 0]] is not None:
                record.omit(rules[k, 0])
            return
        v: cython.longlong = rules[k, 4] + rules[k, 7] * _counted(
            rules[k, 3], n, p, t, pt, plans, rules[k, 6], drafts)
        record.store_count(rules[k, 0], v, rules[k, 1])

    def values(self, n: int, p: int, t: int, pt: int, uniform: int,
               plans: list | None = None, drafts: int = 0) -> tuple[int | None, ...]:
        """The counts :meth:`store_homes` would store (None: omitted), for the slow path."""
        out: list[int | None] = []
        for row in range(self._size):
            if self._rules[row, 3] == OMITTED or uniform & self._rules[row, 5]:
                out.append(None)
                continue
            out.append(int(self._rules[row, 4]) + int(self._rules[row, 7]) * int(_counted(
                self._rules[row, 3], n, p, t, pt, plans, self._rules[row, 6], drafts)))
        return tuple(out)


@cython.cfunc
@cython.inline
@cython.boundscheck(False)
@cython.wraparound(False)
def _counted(what: cython.longlong, n: cython.longlong, p: cython.longlong,
             t: cython.longlong, pt: cython.longlong, plans: list | None,
             plan: cython.longlong, drafts: cython.longlong) -> cython.longlong:
    """The quantity ``what`` names; literals, as the module's ``REQS`` ... are Python
    objects (comparing a C int with one costs a call). A plan index outside ``plans``
    (or no ``plans``) counts -1: out of range, so the caller takes the slow path, which
    raises."""
    if what == 0:  # REQS
        return n
    if what == 1:  # PADDED_REQS
        return p
    if what == 2:  # TOKENS
        return t
    if what == 3:  # PADDED_TOKENS
        return pt
    if what == 6:  # STEP_COUNTS: (n, p, t, pt)
        return 4
    if what == 7:  # DRAFTS
        return drafts
    if plans is None or not 0 <= plan < len(plans):  # PLAN_ROWS
        return -1
    return plans[plan]


# This source is compiled by Cython, as ``h2d_core._records_native``, when the package is
# built; run interpreted, it only hands over to that build (required: block_tables.native
# names the fix when it is missing), so every caller gets the compiled record rules.
if not cython.compiled:
    from block_tables.native import require_extension

    _compiled = require_extension("h2d_core._records_native")
    GroupRecord = _compiled.GroupRecord  # type: ignore[misc]
    CountProgram = _compiled.CountProgram  # type: ignore[misc]
    GroupCounters = _compiled.GroupCounters  # type: ignore[misc]
