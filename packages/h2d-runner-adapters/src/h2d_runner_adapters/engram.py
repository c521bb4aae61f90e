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
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from h2d_core import CountError, H2DRunnerState, h2d_producer

from .batch import ScheduledBatch
from .consumers.engram import commit_engram_cursors, write_engram_tentative

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
        self._offsets = np.arange(max_drafts + 1, dtype=np.int64)

    @h2d_producer(lambda self: self.group)
    def prepare(self, batch: ScheduledBatch, rows: np.ndarray, cursors: np.ndarray
                ) -> EngramPlan:
        """Write and count the snapshot (``cursors``: each request's committed history
        length), its history rows and the cursor candidates. Checked before any write."""
        g = self.group
        cols = batch.columns
        q = cols.query_lens.astype(np.int64)
        d = cols.num_drafts.astype(np.int64)
        n = q.size
        for name, v in (("rows", rows), ("cursors", cursors)):
            if not isinstance(v, np.ndarray) or v.ndim != 1 or v.size != n \
                    or v.dtype.kind not in "iu":
                raise CountError(f"{g}: {name} must be a 1-D integer numpy array with one "
                                 f"entry per request ({n})")
        if n > self.rows.spec.capacity:
            raise CountError(f"{g}: {n} requests exceed max_reqs={self.rows.spec.capacity}")
        if n:
            c = cursors.astype(np.int64)
            checks = (
                ((rows < 0) | (rows >= self.history_rows),
                 f"a history row outside [0, {self.history_rows})"),
                (c < 0, "a negative cursor"),
                (c + q > self.history_len,
                 f"cursor + query tokens past the history length {self.history_len}"),
                ((d < 0) | (d > self.max_drafts) | (d >= q),
                 f"drafts outside [0, min(max_drafts={self.max_drafts}, query tokens - 1)]"),
            )
            for bad, rule in checks:
                if bad.any():
                    i = int(np.argmax(bad))
                    raise CountError(f"{g}: request {i} has {rule}")
            self.rows.np[:n] = rows
            self.snapshot.np[:n] = cursors
            cand = self.candidates.np
            first = (c + q - d)[:, None] + self._offsets[None, :]
            cand[:n] = np.where(self._offsets[None, :] <= d[:, None], first, -1)
        st = self.h2d_state
        st.set_count(self.rows, n)
        st.set_count(self.snapshot, n)
        st.set_count(self.candidates, n)
        return EngramPlan(n, int(q.max()) if n else 0)

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
