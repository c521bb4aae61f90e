"""Random sequences over the model-family adapters, packed against direct (differential).

Two runner states with the same adapters: a speculative MHA step with GDN state indices
(`DecodeStepInputs` with drafts, `GdnStateInputs` riding along) and Engram cursors. One
uses the packed backend, the other the direct backend, and both get the same operations:

* epochs: `begin`, `finish`, `resume`, a slot rotating over two;
* producers with valid or bad batches (uneven widths, padding, drafts);
* publications, repeated publications, `reopen` with a reason.

After every operation, the two backends must agree: the same outcome (value or error type)
and the same bytes in every destination. `nox -s stress` raises the number of sequences.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from block_tables import BlockTable
from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    DECODE_STEP,
    ENGRAM,
    GDN_STATE,
    BatchColumns,
    DecodeStepInputs,
    EngramInputs,
    GdnStateInputs,
    ScheduledBatch,
)

PAGE, REQS, TOKENS = 4, 4, 12


class Side:
    def __init__(self, backend: str) -> None:
        st_ = self.state = H2DRunnerState("cpu", backend=backend, num_slots=2,
                                          scatter="reference")
        self.gdn = GdnStateInputs(st_, max_reqs=REQS, num_spec=2, num_state_slots=12)
        self.engram = EngramInputs(st_, max_reqs=REQS, max_drafts=2, history_rows=4,
                                   history_len=64)
        self.step = DecodeStepInputs(st_, max_reqs=REQS, max_tokens=TOKENS,
                                     max_pages_per_req=8, page_size=PAGE, num_pages=64,
                                     max_drafts=2, extra_groups=[GDN_STATE, ENGRAM])
        st_.bind()

    def destinations(self) -> dict[str, bytes]:
        return {n: b.gpu.numpy().tobytes() for n, b in self.state.buffers().items()}


def outcome(fn: Any) -> tuple[str, object]:
    try:
        value = fn()
    except Exception as exc:  # the two sides must fail alike
        return "error", type(exc).__name__
    return "ok", value


class BackendsAgree(RuleBasedStateMachine):
    @initialize()
    def setup(self) -> None:
        self.sides = [Side("packed"), Side("direct")]
        self.rows = [BlockTable([1, 2, 3]), BlockTable([4, 5]), BlockTable([6]),
                     BlockTable([7, 8, 9, 10])]

    def both(self, op: Any) -> list[tuple[str, object]]:
        results = [outcome(lambda s=s: op(s)) for s in self.sides]
        assert results[0][0] == results[1][0], results
        if results[0][0] == "error":
            assert results[0][1] == results[1][1], results
        return results

    @rule()
    def begin(self) -> None:
        self.both(lambda s: s.state.begin())

    @rule()
    def finish(self) -> None:
        self.both(lambda s: s.state.finish())

    @rule()
    def resume(self) -> None:
        self.both(lambda s: s.state.resume())

    @rule(n=st.integers(0, 4), drafts=st.lists(st.integers(0, 3), min_size=4, max_size=4),
          grow=st.integers(0, 2), padded=st.sampled_from([None, 3, 4]))
    def prepare_step(self, n: int, drafts: list[int], grow: int, padded: int | None) -> None:
        d = np.asarray(drafts[:n], np.int32)
        q = np.minimum(d + 1, 3).astype(np.int32)  # a draft count of 3 is refused (>= q)
        ctx = np.asarray([len(self.rows[i]) * PAGE - grow for i in range(n)], np.int32)
        cols = BatchColumns(
            query_lens=q, context_lens=ctx, temperatures=np.ones(n, np.float32),
            top_k=np.full(n, -1, np.int32), top_p=np.ones(n, np.float32),
            prev_sample_rows=np.full(n, -1, np.int32),
            token_ids=np.arange(int(q.sum()), dtype=np.int32), num_drafts=d)
        batch = ScheduledBatch((), False, PAGE, given_columns=cols,
                               given_block_tables=self.rows[:n])

        def op(s: Side) -> object:
            plan = s.step.prepare(batch, padded)
            s.step.tokens.prepare_spec_indices(batch)
            return plan

        self.both(op)

    @rule(n=st.integers(0, 4), accepted=st.integers(0, 3))
    def prepare_gdn(self, n: int, accepted: int) -> None:
        acc = np.full(n, accepted, np.int32)  # 0 is refused
        self.both(lambda s: s.gdn.prepare(np.arange(n, dtype=np.int32), num_accepted=acc))

    @rule(n=st.integers(0, 3), cursor=st.integers(0, 70))
    def prepare_engram(self, n: int, cursor: int) -> None:
        q = np.full(n, 2, np.int32)
        cols = BatchColumns(
            query_lens=q, context_lens=q + 5, temperatures=np.ones(n, np.float32),
            top_k=np.full(n, -1, np.int32), top_p=np.ones(n, np.float32),
            prev_sample_rows=np.full(n, -1, np.int32), token_ids=np.zeros(2 * n, np.int32),
            num_drafts=np.ones(n, np.int32))
        batch = ScheduledBatch((), False, PAGE, given_columns=cols)
        self.both(lambda s: s.engram.prepare(batch, np.arange(n, dtype=np.int32),
                                             np.full(n, cursor, np.int32)))

    @rule(reason=st.booleans())
    def publish(self, reason: bool) -> None:
        def op(s: Side) -> object:
            if reason:
                s.state.reopen(DECODE_STEP, "a deliberate second publication")
            return s.state.publish(DECODE_STEP)
        self.both(op)

    @rule()
    def append_page(self) -> None:
        row = self.rows[0].lineage_copy()
        row.append_one(20 + len(row))
        self.rows[0] = row

    @invariant()
    def destinations_agree(self) -> None:
        if hasattr(self, "sides"):
            a, b = (s.destinations() for s in self.sides)
            assert a == b


BackendsAgree.TestCase.settings = settings(
    max_examples=int(os.environ.get("H2D_STATEFUL_EXAMPLES", "60")),
    stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBackendsAgree = BackendsAgree.TestCase


def test_the_machine_reaches_publications() -> None:
    """The operations are not all refused: a fixed valid sequence publishes on both."""
    sides = [Side("packed"), Side("direct")]
    rows = [BlockTable([1, 2]), BlockTable([3])]
    cols = BatchColumns(
        query_lens=np.array([2, 1], np.int32), context_lens=np.array([6, 3], np.int32),
        temperatures=np.ones(2, np.float32), top_k=np.full(2, -1, np.int32),
        top_p=np.ones(2, np.float32), prev_sample_rows=np.full(2, -1, np.int32),
        token_ids=np.arange(3, dtype=np.int32), num_drafts=np.array([1, 0], np.int32))
    batch = ScheduledBatch((), False, PAGE, given_columns=cols, given_block_tables=rows)
    for s in sides:
        s.state.begin()
        s.step.prepare(batch, 4)
        s.step.tokens.prepare_spec_indices(batch)
        s.gdn.prepare(np.arange(2, dtype=np.int32), num_accepted=np.array([2, 1], np.int32))
        s.state.publish(DECODE_STEP)
        s.state.finish()
    assert sides[0].destinations() == sides[1].destinations()
    assert sides[0].state.counters(DECODE_STEP).dmas == 1
    assert torch.equal(sides[0].step.decode.slot_mapping.gpu[:3],
                       torch.tensor([8, 9, 14]))  # positions 4, 5 in page 2; 2 in page 3
