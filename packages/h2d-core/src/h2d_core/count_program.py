"""The count program: what each counted member of a fused step publishes, stored into its
group records in one compiled pass.

A :class:`CountProgram` is bound once per step from its :class:`~h2d_core.CountRule` rows;
each step it turns the layout's counts (requests, tokens, plan rows, drafts) into every
member's count and stores them through the records' own rules
(:meth:`~h2d_core.records.GroupRecord.store_count`, ``omit``), called through C.
"""

from __future__ import annotations

from typing import Any

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op decorators
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]

if cython.compiled:  # the records' rules through C (_records_native.pxd)
    from cython.cimports.h2d_core._records_native import GroupRecord
else:
    from .records import GroupRecord


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


# This source is compiled by Cython, as ``h2d_core._count_program_native``, when the
# package is built; run interpreted, it only hands over to that build (required:
# block_tables.native names the fix when it is missing).
if not cython.compiled:
    from block_tables.native import require_extension

    from . import records  # noqa: F401 - built first: cimported here

    _compiled = require_extension("h2d_core._count_program_native")
    CountProgram = _compiled.CountProgram  # type: ignore[misc]
