"""Engram history cursors under speculative decoding: the ``engram`` producer group.

The spec's sentence: "Engram tentative preparation writes cursor candidates together with
its snapshot, preserving every accepted prefix. Committed in-place cursor updates remain
ordered after the snapshot." The member layout that implements it (int32, per request
``i`` of the step, ridden in the step's combined group):

* ``engram_history_rows[i]``: the request's row in the device history table;
* ``engram_cursor_snapshot[i]``: its committed history length as the host knows it when it
  prepares the step (the snapshot). The step's tokens are written tentatively from it
  (:meth:`EngramInputs.write_tentative`), never below it: every accepted prefix is kept;
* ``engram_cursor_candidates[i, a]`` (rows of ``max_drafts + 1``): the committed cursor if
  ``a`` of the request's ``d_i`` drafts are accepted, ``snapshot + q_i - d_i + a`` for
  ``a <= d_i`` (its non-draft tokens always commit), ``-1`` after. Written together with
  the snapshot, so the GPU commits without a host round trip.

The committed cursors live on the device only (``EngramInputs.committed``, never uploaded):
:meth:`EngramInputs.commit` selects each request's candidate by the sampler's accepted
counts, in place, after the step's tentative write on the same stream. The next step's
snapshot travels in its own member, so a later publication can never overtake a committed
update. Rejected tokens past the committed cursor are overwritten by the next step's
tentative write, which starts at the new snapshot.

:meth:`EngramInputs.prepare` checks every input whole, each in its own dtype (an int64 of
``2**32`` or a uint64 of ``2**63`` is refused, never wrapped; floats are refused), before
any write: ``rows`` distinct and inside the history table, ``cursors`` in
``[0, history_len]`` with ``cursor + q <= history_len``, the batch's ``query_lens`` >= 1
and ``num_drafts`` in ``[0, min(max_drafts, q - 1)]``, all of one length ``<= max_reqs``.
A step is one compiled :class:`h2d_core.LayoutStep` call over a
:class:`h2d_core.RequestLayout` whose generic vocabulary states these rules from this
module (bounded columns, a distinct rows column, two :class:`h2d_core.RequestBound` sums
and the candidates as :class:`h2d_core.RampRows`; no Engram code in h2d-core); an input
the layout cannot read in place (another integer dtype, a list) is checked here first, in
its own dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from h2d_core import (
    QUERY_LENS,
    REQS,
    CountRule,
    DeclarationError,
    H2DRunnerState,
    LayoutColumn,
    LayoutOutput,
    LayoutStep,
    RampRows,
    RequestBound,
    RequestLayout,
    RequestSum,
    StepSpec,
    describe_value,
    h2d_producer,
)

from ..batch import ScheduledBatch
from ..checks import INT32_MAX, AdapterInputError, int_array
from .cursors import commit_engram_cursors, write_engram_tentative

ENGRAM = "engram"


class EngramPlan(NamedTuple):
    num_reqs: int
    max_query_len: int


class EngramInputs:
    """Declares the Engram cursor members (producer group ``group``) over a device history
    table of ``history_rows`` rows of ``history_len`` tokens; produces them and runs the
    tentative write and the commit."""

    def __init__(
        self,
        state: H2DRunnerState,
        *,
        max_reqs: int,
        max_drafts: int,
        history_rows: int,
        history_len: int,
        group: str = ENGRAM,
    ) -> None:
        # max_drafts + 1 candidates per request: an int32 width
        for name, value, lo, hi in (("max_drafts", max_drafts, 0, INT32_MAX - 1),
                                    ("history_rows", history_rows, 1, INT32_MAX),
                                    ("history_len", history_len, 1, INT32_MAX)):
            if isinstance(value, bool) or not isinstance(value, int) \
                    or not lo <= value <= hi:
                raise DeclarationError(
                    f"{group}: {name} must be an int in [{lo}, {hi}], got {value!r}")
        self.h2d_state = state
        self.group = group
        self.max_drafts = max_drafts
        self.history_rows = history_rows
        self.history_len = history_len
        buf = state.buffer
        self.rows = buf(f"{group}_history_rows", (max_reqs,), torch.int32, group=group)
        self.snapshot = buf(f"{group}_cursor_snapshot", (max_reqs,), torch.int32, group=group)
        self.candidates = buf(f"{group}_cursor_candidates", (max_reqs, max_drafts + 1),
                              torch.int32, group=group, unit="rows")
        dev = state.device
        #: the device history table and the committed cursors (device only)
        self.history = torch.zeros(history_rows, history_len, dtype=torch.int32, device=dev)
        self.committed = torch.zeros(max_reqs, dtype=torch.int32, device=dev)
        self._step: LayoutStep | None = None  # bound on first use (after bind)

    def _bind(self) -> LayoutStep:
        st, g = self.h2d_state, self.group
        layouts = []
        for slot in range(st.num_slots):
            columns = [
                LayoutColumn("rows", self.rows.source(slot).numpy(), pad=None, low=0,
                             high=self.history_rows - 1, distinct=True),
                LayoutColumn("cursors", self.snapshot.source(slot).numpy(), pad=None, low=0),
                LayoutColumn("num_drafts", low=0, high=self.max_drafts),
            ]
            layouts.append(RequestLayout(g, 1, None, None, columns=columns,
                                         outputs=self._outputs(slot)))
        rules = [CountRule(b, REQS) for b in (self.rows, self.snapshot, self.candidates)]
        self._step = StepSpec(rules).bind(g, st, layouts, error=AdapterInputError)
        return self._step

    def _outputs(self, slot: int) -> list[LayoutOutput]:
        """The family's rules and its candidates, in the layout's generic vocabulary (no
        Engram code in h2d-core): ``cursor + q <= history_len``, ``d <= q - 1``, and
        request ``i``'s candidates ``cursor + q - d + a`` for ``a <= d``, then -1."""
        cursor_end = RequestSum((("cursors", 1), (QUERY_LENS, 1)))
        return [
            RequestBound(cursor_end, high=self.history_len,
                         note="the step's tokens are written from the cursor into a "
                              "history row of history_len tokens"),
            RequestBound(RequestSum((("num_drafts", 1), (QUERY_LENS, -1))), high=-1,
                         note="the last query token is never a draft"),
            RampRows("candidates", self.candidates.source(slot).numpy().reshape(-1),
                     self.max_drafts + 1,
                     start=RequestSum((*cursor_end.terms, ("num_drafts", -1))),
                     count=RequestSum((("num_drafts", 1),), 1)),
        ]

    @h2d_producer(lambda self: self.group)
    def prepare(self, batch: ScheduledBatch, rows: np.ndarray, cursors: np.ndarray
                ) -> EngramPlan:
        """Write and count the snapshot (``cursors``: each request's committed history
        length), its history rows and the cursor candidates. Every input is checked whole
        before any write (see :meth:`_check`); a refusal raises :class:`AdapterInputError`
        and changes nothing."""
        step = self._step
        if step is None:
            step = self._bind()
        cols = batch.columns
        q = cols.query_lens  # every request runs q tokens of a "context" of q
        try:  # every value checked, written and counted: one call
            out = step.run(q, q, None, -1, -1, (rows, cursors, cols.num_drafts))
        except AdapterInputError:
            # the specific message (which argument, which request, which rule) comes from
            # the checks in the caller's dtype; nothing was written
            self._check(batch, rows, cursors)
            # every rule holds: an input the layout cannot read in place (another integer
            # dtype, not contiguous) goes in as its exact int32 copy (the ranges fit)
            q = np.ascontiguousarray(q, np.int32)
            out = step.run(q, q, None, -1, -1, (
                np.ascontiguousarray(rows, np.int32),
                np.ascontiguousarray(cursors, np.int32),
                np.ascontiguousarray(cols.num_drafts, np.int32)))
        n = out.num_reqs
        return EngramPlan(n, out.max_query_len if n else 0)

    def _check(self, batch: ScheduledBatch, rows: object, cursors: object
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The step's query lengths, draft counts and cursors as int64 (exact), after
        checking, each in its own dtype: the batch's ``query_lens`` (>= 1) and
        ``num_drafts`` (``[0, min(max_drafts, q - 1)]``) of one length ``n <= max_reqs``;
        ``rows`` distinct rows of the history table; ``cursors`` in ``[0, history_len]``
        with ``cursor + q <= history_len``."""
        g = self.group
        cols = batch.columns
        q = int_array(g, "query_lens", cols.query_lens, lo=1,
                      rule="an Engram request runs at least one token")
        n = q.size
        cap = self.rows.spec.capacity
        if n > cap:
            raise AdapterInputError(f"{g}: {n} requests exceed max_reqs={cap}")
        d = int_array(g, "num_drafts", cols.num_drafts, lo=0, hi=self.max_drafts, size=n,
                      rule=f"drafts must lie in [0, min(max_drafts={self.max_drafts}, query "
                           "tokens - 1)]")
        for name, v in (("rows", rows), ("cursors", cursors)):
            if not isinstance(v, np.ndarray) or v.ndim != 1 or v.size != n \
                    or v.dtype.kind not in "iu":
                raise AdapterInputError(
                    f"{g}: {name} must be a 1-D integer numpy array with one entry per "
                    f"request ({n}), got {describe_value(v)}")
        assert isinstance(rows, np.ndarray) and isinstance(cursors, np.ndarray)
        q, d = q.astype(np.int64), d.astype(np.int64)  # exact: both ranges fit
        if not n:
            return q, d, cursors.astype(np.int64)
        bad = d >= q
        if bad.any():
            i = int(np.argmax(bad))
            raise AdapterInputError(
                f"{g}: request {i} has drafts outside [0, min(max_drafts={self.max_drafts}, "
                f"query tokens - 1)] (num_drafts={int(d[i])}, query_lens={int(q[i])})")
        self._check_rows(rows)
        # compared in the caller's dtype before any cast: 2**63 (uint64) is refused, never
        # wrapped to a negative cursor; after it, cursor + q cannot overflow int64
        if int(cursors.min()) < 0 or int(cursors.max()) > self.history_len:
            i = int(np.flatnonzero((cursors < 0) | (cursors > self.history_len))[0])
            v = int(cursors[i])
            rule = ("a negative cursor" if v < 0 else
                    f"cursor + query tokens past the history length {self.history_len}")
            raise AdapterInputError(f"{g}: request {i} has {rule} (cursors={v})")
        c = cursors.astype(np.int64)
        bad = c + q > self.history_len
        if bad.any():
            i = int(np.argmax(bad))
            raise AdapterInputError(
                f"{g}: request {i} has cursor + query tokens past the history length "
                f"{self.history_len} (cursors={int(c[i])}, query_lens={int(q[i])})")
        return q, d, c

    def _check_rows(self, rows: np.ndarray) -> None:
        """Rows inside the history table, one per request (two requests on one row would
        overwrite each other's tentative tokens)."""
        g, top = self.group, self.history_rows
        if int(rows.min()) < 0 or int(rows.max()) >= top:
            i = int(np.flatnonzero((rows < 0) | (rows >= top))[0])
            raise AdapterInputError(
                f"{g}: request {i} has a history row outside [0, {top}) (rows="
                f"{int(rows[i])})")
        order = np.argsort(rows, kind="stable")
        same = np.flatnonzero(rows[order[1:]] == rows[order[:-1]])
        if same.size:
            first, i = int(order[same[0]]), int(order[same[0] + 1])
            raise AdapterInputError(
                f"{g}: request {i} has history row {int(rows[i])}, already request "
                f"{first}'s (rows must be distinct: each request owns its own row)")

    def write_tentative(self, plan: EngramPlan, cu_seqlens_q: torch.Tensor,
                        input_ids: torch.Tensor) -> None:
        """First consumer: the step's tokens into the history rows from the snapshot
        (``cu_seqlens_q`` and ``input_ids``: the token inputs' published members)."""
        write_engram_tentative(self.history, self.rows.gpu, self.snapshot.gpu, cu_seqlens_q,
                               input_ids, num_reqs=plan.num_reqs,
                               max_query_len=plan.max_query_len)

    def commit(self, plan: EngramPlan, accepted: torch.Tensor) -> torch.Tensor:
        """The committed cursors from the sampler's accepted draft counts (int32, device),
        in place; call after :meth:`write_tentative` on the same stream."""
        commit_engram_cursors(self.candidates.gpu, accepted, self.committed,
                              num_reqs=plan.num_reqs)
        return self.committed[: plan.num_reqs]
