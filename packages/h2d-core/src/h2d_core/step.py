"""The compiled step: one call per producer plans, prepares, writes, counts and stages.

A fused producer's step is always the same sequence over the same bound objects: plan a
:class:`h2d_core.RequestLayout` over the batch's columns (which checks every value),
prepare the block table's rows (which checks every row), write every member, store every
count, and stage the table for its group. :class:`LayoutStep` holds those objects per
slot, bound once after ``state.bind()``, and runs the sequence in one call, so a step
pays for no interpreter frames between the pieces. Adapters configure it (which members
count what) and keep their public API; nothing here knows a model family.

What a block table publishes (reused, changed ranges, whole rows) is its own decision
(:class:`block_tables.TableStaging`); :class:`~h2d_core.table_stage.TableStager` applies it.

Compiled by Cython as ``h2d_core._step_native`` when the package is built (required).
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import index as _index
from typing import Any, SupportsIndex

import numpy as np

from .count_program import (
    DRAFTS,
    OMITTED,
    PADDED_REQS,
    PADDED_TOKENS,
    PLAN_ROWS,
    REQS,
    STEP_COUNTS,
    TOKENS,
    CountProgram,
)
from .count_rules import CountRule, count_addresses
from .errors import CountError, DeclarationError, RequestLayoutError
from .request_layout import EXACT_TOKENS

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op decorators
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]

if cython.compiled:  # the table's state through C (block_tables/_staging_native.pxd)
    from cython.cimports.block_tables._staging_native import TableStaging
else:
    from block_tables import TableStaging


@cython.cclass
class StepCounts:
    """What one :meth:`LayoutStep.run` planned and wrote: ``num_reqs``, ``padded_reqs``,
    ``max_query_len`` (at least 1), ``num_tokens``, ``padded_tokens``, ``kv_pages`` (0
    without a table), ``table_stage`` (the block table's stage: "" without a table or
    unstaged), ``uniform_mask`` (the layout's bits of columns whose values are all equal)
    and ``column_sum`` (the summed column's sum, e.g. the step's draft tokens).

    A bound step refreshes one record per slot in place and returns it: it stays valid
    until the same slot's next step (read what you keep before then). The fields are C
    integers, so a step boxes none of them; reading one from Python makes the int then.
    Construct one directly for a hand-built plan (warm-up, tests)."""

    num_reqs = cython.declare(cython.Py_ssize_t, visibility="readonly")
    padded_reqs = cython.declare(cython.Py_ssize_t, visibility="readonly")
    max_query_len = cython.declare(cython.Py_ssize_t, visibility="readonly")
    num_tokens = cython.declare(cython.Py_ssize_t, visibility="readonly")
    padded_tokens = cython.declare(cython.Py_ssize_t, visibility="readonly")
    table_stage = cython.declare(str, visibility="readonly")
    uniform_mask = cython.declare(cython.longlong, visibility="readonly")
    column_sum = cython.declare(cython.longlong, visibility="readonly")
    # the page total: the bound layout's (read when asked: a page total above 256 would
    # box an int per step), or the constructor's for a hand-built record
    _layout = cython.declare(object)
    _kv_pages = cython.declare(cython.longlong)

    # SupportsIndex, not int: Cython would coerce an int-annotated float (1.5 -> 1)
    def __init__(self, num_reqs: SupportsIndex = 0, padded_reqs: SupportsIndex = 0,
                 max_query_len: SupportsIndex = 1, num_tokens: SupportsIndex = 0,
                 padded_tokens: SupportsIndex = 0, kv_pages: SupportsIndex = 0,
                 table_stage: str = "", uniform_mask: SupportsIndex = 0,
                 column_sum: SupportsIndex = 0) -> None:
        # operator.index: a float count is refused (TypeError), never truncated
        self.num_reqs = _index(num_reqs)
        self.padded_reqs = _index(padded_reqs)
        self.max_query_len = _index(max_query_len)
        self.num_tokens = _index(num_tokens)
        self.padded_tokens = _index(padded_tokens)
        self._kv_pages = _index(kv_pages)
        self._layout = None
        self.table_stage = table_stage
        self.uniform_mask = _index(uniform_mask)
        self.column_sum = _index(column_sum)

    @property
    def kv_pages(self) -> int:
        return self._kv_pages if self._layout is None else self._layout.kv_pages

    def astuple(self) -> tuple:
        """The fields in declaration order (a comparison's or a test's view; builds a
        tuple)."""
        return (self.num_reqs, self.padded_reqs, self.max_query_len, self.num_tokens,
                self.padded_tokens, self.kv_pages, self.table_stage, self.uniform_mask,
                self.column_sum)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StepCounts):
            return NotImplemented
        return self.astuple() == other.astuple()

    def __repr__(self) -> str:
        return ("StepCounts(num_reqs={}, padded_reqs={}, max_query_len={}, num_tokens={}, "
                "padded_tokens={}, kv_pages={}, table_stage={!r}, uniform_mask={}, "
                "column_sum={})").format(*self.astuple())


@cython.cclass
class LayoutStep:
    """A fused producer's step, bound once: ``run`` plans the layout over the batch's
    columns, prepares the block table's rows (padding rows appended), writes every bound
    member, stores every count and stages the table, in one call.

    ``layouts`` holds one :class:`h2d_core.RequestLayout` per slot, over that slot's
    sources and prepared table; ``table`` is the :class:`~h2d_core.BlockTableState` those
    layouts read (None: a layout without a table, whose ``run`` ignores ``rows``);
    ``pad_rows`` the empty rows padded requests take; ``counts`` one
    :class:`CountRule` per counted member (a :class:`~h2d_core.count_program.CountProgram` stores
    them in one call when one group record holds them all, a fused producer's usual case);
    ``sum_column`` a layout column whose sum ``run`` returns (-1: none). A rejected batch
    raises ``error`` (a :class:`~h2d_core.CountError` subclass) naming the request and
    column, before any source is written. ``check`` (optional) is called with the planned
    layout before anything is prepared or written: an adapter's checks that need the
    planned batch (e.g. per-token inputs against its token count) raise there and change
    nothing.

    Layouts with plans (:class:`h2d_core.LayoutPlan`, the same number in every slot's
    layout) publish their rows through ``PLAN_ROWS`` rules; :meth:`plan_rows_of` gives a
    slot's last written batch's rows of every plan, one tuple per ``plan_group``
    consecutive plans of each plan's (real rows, published rows), e.g.
    ``((real_0, pub_0, real_1, pub_1), ...)`` for ``plan_group=2``; :attr:`plan_rows`
    the last run's. A run keeps them as C integers (built into tuples when read: a
    steady step builds none).
    """

    name = cython.declare(str, visibility="readonly")
    _ready_what = cython.declare(str)  # what a refused entry is called (made once)
    _state = cython.declare(object)
    _layouts = cython.declare(tuple)
    _table = cython.declare(object)
    _stager = cython.declare(object)
    _staging = cython.declare(TableStaging)  # the table's own state: prepare, through C
    _pad_rows = cython.declare(list)
    # the padding rows' one object when they are all the same (the usual empty table)
    _pad_row = cython.declare(object)
    _error = cython.declare(object)
    _program = cython.declare(object)
    _values = cython.declare(object)
    _sum_column = cython.declare(cython.Py_ssize_t)
    _slow = cython.declare(object)
    _check = cython.declare(object)
    # plans per layout, plans per plan_rows entry, and per slot the last run's rows (real
    # and published per plan: 2 * num_plans items from slot * 2 * num_plans), the slot
    # of the last run (-1: none yet)
    _num_plans = cython.declare(cython.Py_ssize_t)
    _plan_group = cython.declare(cython.Py_ssize_t)
    _rows_seen = cython.declare(cython.longlong[::1])
    _last_slot = cython.declare(cython.Py_ssize_t)
    # per slot, the address of the STEP_COUNTS member's pinned source (empty: none)
    _count_addrs = cython.declare(cython.Py_ssize_t[::1])
    _has_counts = cython.declare(cython.bint)
    # per slot, the record run() refreshes and returns
    _results = cython.declare(tuple)
    # per slot, the address of its layout's int64 counts (RequestLayout.meta_address), and
    # the counts handed to the count program ([n, p, t, pt, uniform, drafts]): C reads and
    # writes, so a count above 256 never becomes an int object
    _metas = cython.declare(cython.Py_ssize_t[::1])
    _args = cython.declare(cython.longlong[::1])

    def __init__(self, name: str, state: Any, layouts: Sequence[Any], table: Any,
                 pad_rows: Sequence[Any], counts: Sequence[CountRule], *,
                 sum_column: int = -1, error: type[CountError] = CountError,
                 plan_group: int = 1, check: Any = None) -> None:
        if len(layouts) != state.num_slots:
            raise DeclarationError(
                f"LayoutStep {name!r}: {len(layouts)} layouts for {state.num_slots} slots")
        self.name = name
        self._ready_what = f"producer {name}"
        self._state = state
        self._layouts = tuple(layouts)
        self._table = table
        self._stager = None if table is None else table._stager
        self._staging = None if table is None else table._stager.staging
        self._pad_rows = list(pad_rows)
        self._pad_row = (self._pad_rows[0] if self._pad_rows and all(
            r is self._pad_rows[0] for r in self._pad_rows) else None)
        self._error = error
        self._check = check
        plans = sorted({len(layout.plan_published) for layout in self._layouts})
        num_plans = plans[0] if plans else 0
        if (len(plans) > 1 or type(plan_group) is not int or plan_group < 1
                or num_plans % plan_group):
            raise DeclarationError(
                f"LayoutStep {name!r}: the layouts bind {plans} plans, grouped by "
                f"{plan_group!r}; bind the same plans in every slot's layout and group them "
                "by a divisor of their number")
        for r in counts:
            if r.what not in (REQS, PADDED_REQS, TOKENS, PADDED_TOKENS, PLAN_ROWS, OMITTED,
                              STEP_COUNTS, DRAFTS):
                raise DeclarationError(
                    f"LayoutStep {name!r}: buffer {r.buffer.name!r} counts {r.what!r}; use "
                    "REQS, PADDED_REQS, TOKENS, PADDED_TOKENS, PLAN_ROWS, OMITTED, "
                    "STEP_COUNTS or DRAFTS")
            if type(r.times) is not int or r.times < 1:
                raise DeclarationError(
                    f"LayoutStep {name!r}: buffer {r.buffer.name!r} counts {r.times!r} times "
                    "its quantity; times must be an int >= 1")
            if r.what == DRAFTS and sum_column < 0:
                raise DeclarationError(
                    f"LayoutStep {name!r}: buffer {r.buffer.name!r} counts DRAFTS, the sum of "
                    "the layout's summed column; pass sum_column")
            if r.what == PLAN_ROWS and (type(r.plan) is not int
                                        or not 0 <= r.plan < num_plans):
                raise DeclarationError(
                    f"LayoutStep {name!r}: buffer {r.buffer.name!r} counts the rows of plan "
                    f"{r.plan!r}; the layouts bind {num_plans} plans")
        self._count_addrs = count_addresses(name, state, counts)
        self._has_counts = self._count_addrs.shape[0] > 0
        # One row per (member, record that carries it): a buffer shared by two combined
        # groups (a decode and a prefill step's token inputs) is counted in both records
        # by the same compiled call, every row checked before any record changes.
        self._program = CountProgram(sorted(
            [(i, r.buffer._unit_bytes, r.buffer._fast_capacity, r.what, r.plus,
              r.omit_if_uniform, r.plan if r.what == PLAN_ROWS else 0, r.times, gi)
             for r in counts for gi, i in r.buffer.homes], key=lambda row: row[8]))
        self._values = CountProgram([(r.buffer.homes[0][1], r.buffer._unit_bytes,
                                      r.buffer._fast_capacity, r.what, r.plus,
                                      r.omit_if_uniform,
                                      r.plan if r.what == PLAN_ROWS else 0, r.times)
                                     for r in counts])
        self._sum_column = sum_column
        # the specific error for a count out of range (none is, for a bound layout)
        self._slow = state.count_batch([r.buffer for r in counts])
        self._num_plans = num_plans
        self._plan_group = plan_group
        self._rows_seen = np.zeros(2 * num_plans * state.num_slots, dtype=np.int64)
        self._last_slot = -1
        self._results = tuple([StepCounts() for _ in range(state.num_slots)])
        self._metas = np.array([layout.meta_address for layout in self._layouts],
                               dtype=np.intp)
        args = np.zeros(6, dtype=np.int64)
        self._args = args
        self._program.bind_counts(args)
        record: StepCounts
        for slot in range(state.num_slots):
            record = self._results[slot]
            record._layout = self._layouts[slot]

    @property
    def plan_rows(self) -> tuple:
        """The last run's plan rows (see the class docstring; () before the first run)."""
        return () if self._last_slot < 0 else self.plan_rows_of(self._last_slot)

    def plan_rows_of(self, slot: int) -> tuple:
        """Slot ``slot``'s last written batch's plan rows (a new tuple of tuples; the
        slot's next run changes what the next read gives)."""
        if not 0 <= slot < self._state.num_slots:
            raise IndexError(f"LayoutStep {self.name!r}: slot {slot} out of range")
        g: cython.Py_ssize_t = self._plan_group
        base: cython.Py_ssize_t = 2 * self._num_plans * slot
        flat = [self._rows_seen[base + k] for k in range(2 * self._num_plans)]
        return tuple([tuple(flat[2 * g * j: 2 * g * (j + 1)])
                      for j in range(self._num_plans // g)])

    def counts(self, slot: int) -> StepCounts:
        """The record :meth:`run` refreshes in ``slot`` (an adapter binds its plans over
        it once)."""
        return self._results[slot]

    @cython.ccall
    def run(self, query_lens: Any, context_lens: Any, rows: Any,
            padded: cython.Py_ssize_t, tokens: cython.Py_ssize_t, values: Sequence[Any],
            stage: cython.bint = True) -> StepCounts:
        """One step: ``padded`` requests (-1: eager), ``tokens`` published tokens (-1: the
        graph grid of ``padded`` requests times the widest query, or exactly the real
        tokens when eager), ``values`` the layout's bound columns. Refreshes and returns
        the slot's :class:`StepCounts` (valid until the slot's next step) and sets
        :attr:`plan_rows`. ``stage=False``
        prepares the table's rows without staging them (the caller leaves the table out of
        this publication; ``table_stage`` ""). Call from inside the producer (its
        epoch)."""
        st = self._state
        st.require_ready(self._ready_what)
        slot: cython.Py_ssize_t = st.current_slot
        layout = self._layouts[slot]
        try:
            # -1 tokens: the graph grid of the padded requests; eager: exactly the tokens
            layout.plan_step(query_lens, context_lens, padded,
                             EXACT_TOKENS if tokens < 0 and padded < 0 else tokens, values)
        except RequestLayoutError as exc:
            raise self._error(str(exc)) from exc
        if self._check is not None:
            self._check(layout)
        meta: cython.pointer[cython.longlong] = cython.cast(
            cython.pointer[cython.longlong], self._metas[slot])
        n: cython.Py_ssize_t = meta[0]
        p: cython.Py_ssize_t = meta[1]
        t: cython.Py_ssize_t = meta[2]
        pt: cython.Py_ssize_t = meta[3]
        table = self._table
        if table is not None:
            # validates every row before writing the table; nothing below can fail
            if p <= n:
                self._staging.prepare(slot, rows, layout.required_pages)
            elif self._pad_row is not None:  # one padding row: no list built for it
                self._staging.prepare(slot, rows, layout.required_pages, self._pad_row, p - n)
            else:
                self._staging.prepare(slot, list(rows) + self._pad_rows[: p - n],
                                     layout.required_pages, None, 0, p - n)
        layout.write()
        uniform: cython.longlong = meta[6]
        summed: cython.longlong = (layout.column_sum(self._sum_column)
                                   if self._sum_column >= 0 else 0)
        # the written batch's published rows per plan: the layout's own list, read in place
        published: list | None = layout.plan_published if self._num_plans else None
        records: list = st.slot_records[slot]
        args = self._args
        args[0] = n
        args[1] = p
        args[2] = t
        args[3] = pt
        args[4] = uniform
        args[5] = summed
        if not self._program.store_bound(records, published):
            # a count out of range: the count batch raises the specific error
            self._slow.set(*self._values.values(n, p, t, pt, uniform, published, summed))
        if self._has_counts:  # the counts fused consumers read on the device
            out: cython.pointer[cython.int] = cython.cast(cython.pointer[cython.int],
                                                          self._count_addrs[slot])
            out[0] = cython.cast(cython.int, n)
            out[1] = cython.cast(cython.int, p)
            out[2] = cython.cast(cython.int, t)
            out[3] = cython.cast(cython.int, pt)
        staged = "" if table is None or not stage else self._stager.stage(slot, p)
        if published is not None:
            self._note_rows(slot, layout.plan_real, published)
        self._last_slot = slot
        q: cython.Py_ssize_t = meta[5]
        out_counts: StepCounts = self._results[slot]
        out_counts.num_reqs = n
        out_counts.padded_reqs = p
        out_counts.max_query_len = q if q > 0 else 1
        out_counts.num_tokens = t
        out_counts.padded_tokens = pt
        out_counts.table_stage = staged
        out_counts.uniform_mask = uniform
        out_counts.column_sum = summed
        return out_counts

    @cython.cfunc
    @cython.boundscheck(False)
    @cython.wraparound(False)
    def _note_rows(self, slot: cython.Py_ssize_t, real: list,
                   published: list) -> cython.void:
        """Keep the layout's real and published rows per plan as slot ``slot``'s."""
        seen = self._rows_seen
        base: cython.Py_ssize_t = 2 * self._num_plans * slot
        k: cython.Py_ssize_t
        for k in range(self._num_plans):
            seen[base + 2 * k] = real[k]
            seen[base + 2 * k + 1] = published[k]


# This source is compiled by Cython, as ``h2d_core._step_native``, when the package is
# built; run interpreted, it only hands over to that build (required).
if not cython.compiled:
    from block_tables.native import require_extension

    _compiled = require_extension("h2d_core._step_native")
    LayoutStep = _compiled.LayoutStep  # type: ignore[misc]
    StepCounts = _compiled.StepCounts  # type: ignore[misc]
