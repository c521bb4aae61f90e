"""Random sequences over the model-family adapters, packed against direct (differential).

Two machines, each driving two runner states with the same adapters, one on the packed
backend and one on the direct backend:

* `BackendsAgree`: a speculative MHA step with GDN state indices (`DecodeStepInputs` with
  drafts, `GdnStateInputs` riding along) and Engram cursors, plus the MTP draft loop
  (`MhaDraftLoop.advance`: metadata and KV indices derived on the device, no upload);
* `V41BackendsAgree`: DeepSeek V4.1's two groups (`TokenStepInputs`,
  `V41MetadataInputs`: ragged spans, forked state slots, padding, growing and replaced block
  rows) and their first consumer (`generate_step_indptrs`).

Both get the same operations:

* epochs: `begin`, `finish`, `resume`, slots rotating over 1 to 4 (drawn per sequence);
* producers with valid or bad batches (uneven widths, padding, drafts);
* publications, repeated publications, `reopen` with a reason.

After every operation, the two backends must agree: the same outcome (value or error type)
and the same bytes in every destination; the consumer rules also compare the consumers'
device outputs and require them to succeed. A `full_step` rule runs a whole valid step, so
sequences reach publications often. The consumer rules run Triton kernels, so they need
the interpreter on CPU (`TRITON_INTERPRET=1`, as `nox -s tests` and `nox -s stress` set
it). `nox -s stress` raises the number of sequences.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from block_tables import BlockTable
from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    DECODE_STEP,
    ENGRAM,
    GDN_STATE,
    TOKEN_INPUTS,
    V4_BLOCK,
    V41_METADATA,
    BatchColumns,
    DecodePlan,
    DecodeStepInputs,
    EngramInputs,
    GdnStateInputs,
    MhaDraftLoop,
    RequestSpan,
    ScheduledBatch,
    TokenStepInputs,
    V41MetadataInputs,
    V41Plan,
)

PAGE, REQS, TOKENS = 4, 4, 12
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


class Side:
    def __init__(self, backend: str, slots: int = 2) -> None:
        st_ = self.state = H2DRunnerState("cpu", backend=backend, num_slots=slots,
                                          scatter="reference")
        self.gdn = GdnStateInputs(st_, max_reqs=REQS, num_spec=2, num_state_slots=12)
        self.engram = EngramInputs(st_, max_reqs=REQS, max_drafts=2, history_rows=4,
                                   history_len=64)
        self.step = DecodeStepInputs(st_, max_reqs=REQS, max_tokens=TOKENS,
                                     max_pages_per_req=8, page_size=PAGE, num_pages=64,
                                     max_drafts=2, extra_groups=[GDN_STATE, ENGRAM])
        st_.bind()
        self.loop = MhaDraftLoop(self.step.decode, self.step.tokens)
        self.plan: DecodePlan | None = None

    def destinations(self) -> dict[str, bytes]:
        return {n: b.gpu.numpy().tobytes() for n, b in self.state.buffers().items()}


def outcome(fn: Any) -> tuple[str, object]:
    try:
        value = fn()
    except Exception as exc:  # the two sides must fail alike
        return "error", type(exc).__name__
    return "ok", value


class _Differential(RuleBasedStateMachine):
    """The packed and direct sides (``self.sides``), the epoch rules and the invariant."""

    sides: list[Any]

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

    @invariant()
    def destinations_agree(self) -> None:
        if hasattr(self, "sides"):
            a, b = (s.destinations() for s in self.sides)
            assert a == b


class BackendsAgree(_Differential):
    @initialize(slots=st.integers(1, 4))
    def setup(self, slots: int) -> None:
        self.sides = [Side("packed", slots), Side("direct", slots)]
        self.rows = [BlockTable([1, 2, 3]), BlockTable([4, 5]), BlockTable([6]),
                     BlockTable([7, 8, 9, 10])]

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
            s.plan = plan.decode
            return plan

        self.both(op)

    @precondition(lambda self: INTERPRETED and self.sides[0].plan is not None)
    @rule(rejected=st.lists(st.integers(0, 2), min_size=4, max_size=4),
          step=st.integers(1, 2))
    def advance_draft_loop(self, rejected: list[int], step: int) -> None:
        """The draft loop over the destinations as last published: both backends derive
        the same draft-step metadata and KV indices on the device."""
        counts = torch.tensor(rejected, dtype=torch.int32)

        def op(s: Side) -> object:
            assert s.plan is not None
            meta = s.loop.advance(s.plan, counts, step)
            return [t.tolist() for t in meta] + [s.loop.kv_indices.tolist()]

        results = self.both(op)
        assert results[0][0] == "ok", results[0]  # a consumer never fails on these inputs
        assert results[0] == results[1]

    @rule(n=st.integers(1, 4), drafts=st.lists(st.integers(0, 2), min_size=4, max_size=4),
          padded=st.sampled_from([None, 4]))
    def full_step(self, n: int, drafts: list[int], padded: int | None) -> None:
        """A whole valid step (begin, producers, publish, finish) in one rule, so that
        sequences reach publications often; each call is still compared on both sides."""
        self.begin()
        self.prepare_step(n, drafts, 0, padded)
        self.prepare_gdn(n, 1)
        self.publish(False)
        self.finish()

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

class V41Side:
    def __init__(self, backend: str, slots: int) -> None:
        st_ = self.state = H2DRunnerState("cpu", backend=backend, num_slots=slots,
                                          scatter="reference")
        self.tokens = TokenStepInputs(st_, max_reqs=REQS, max_tokens=TOKENS)
        self.v4 = V41MetadataInputs(
            st_, max_reqs=REQS, max_tokens=TOKENS, max_blocks_per_req=4,
            dummy_state_slot=REQS * 2, dummy_block=0, num_blocks=40, window=8,
            index_topk=4, fp8=True, envelope_rows=3)
        st_.bind()
        self.plan: V41Plan | None = None

    def destinations(self) -> dict[str, bytes]:
        return {n: b.gpu.numpy().tobytes() for n, b in self.state.buffers().items()}


class V41BackendsAgree(_Differential):
    @initialize(slots=st.integers(1, 4))
    def setup(self, slots: int) -> None:
        self.sides = [V41Side("packed", slots), V41Side("direct", slots)]
        self.rows = [BlockTable([1]), BlockTable([2, 3]), BlockTable([4]),
                     BlockTable([5, 6, 7])]
        self.next_block = 8

    @rule(n=st.integers(0, 4), widths=st.lists(st.integers(0, 4), min_size=4, max_size=4),
          back=st.integers(-1, 300), forks=st.lists(st.integers(-1, 8), min_size=4,
                                                      max_size=4),
          padded=st.sampled_from([None, 3, 4]))
    def prepare_step(self, n: int, widths: list[int], back: int, forks: list[int],
                     padded: int | None) -> None:
        """Ragged spans ending ``back`` tokens before each row's capacity (-1: one past
        it, refused); a width of 0 and too many tokens are refused too."""
        spans = [RequestSpan(widths[i], len(self.rows[i]) * V4_BLOCK - back, i, forks[i])
                 for i in range(n)]
        q = np.asarray(widths[:n], np.int32)
        cols = BatchColumns(
            query_lens=q, context_lens=np.asarray([sp.context_len for sp in spans], np.int32),
            temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
            top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
            token_ids=np.arange(int(q.sum()), dtype=np.int32),
            num_drafts=np.maximum(q - 1, 0).astype(np.int32))
        batch = ScheduledBatch((), False, V4_BLOCK, given_columns=cols)

        def op(s: V41Side) -> object:
            tp = s.tokens.prepare(batch, padded)
            s.plan = s.v4.begin_step(spans, block_tables=self.rows[:n], padded=padded)
            return tp, s.plan

        self.both(op)

    @rule(group=st.sampled_from([TOKEN_INPUTS, V41_METADATA]), reason=st.booleans())
    def publish(self, group: str, reason: bool) -> None:
        def op(s: V41Side) -> object:
            if reason:
                s.state.reopen(group, "a deliberate second publication")
            return s.state.publish(group)
        self.both(op)

    @precondition(lambda self: INTERPRETED and self.sides[0].plan is not None)
    @rule()
    def step_indptrs(self) -> None:
        """The first consumer over the destinations as last published."""
        def op(s: V41Side) -> object:
            assert s.plan is not None
            out = s.v4.generate_step_indptrs(s.plan)
            extra = (s.v4.block_tables_per_token, s.v4.hca_indices)
            return [t.tolist() for t in (*out, *extra) if isinstance(t, torch.Tensor)]

        results = self.both(op)
        assert results[0][0] == "ok", results[0]  # a consumer never fails on these inputs
        assert results[0] == results[1]

    @rule(n=st.integers(1, 4), widths=st.lists(st.integers(1, 3), min_size=4, max_size=4),
          padded=st.sampled_from([None, 4]))
    def full_step(self, n: int, widths: list[int], padded: int | None) -> None:
        """A whole valid step (begin, both producers, both publications, finish) in one
        rule, so that sequences reach publications often; each call is still compared."""
        self.begin()
        self.prepare_step(n, widths, 0, [-1] * 4, padded)
        self.publish(TOKEN_INPUTS, False)
        self.publish(V41_METADATA, False)
        self.finish()

    @rule(row=st.integers(0, 3), replace=st.booleans())
    def change_row(self, row: int, replace: bool) -> None:
        """Append a block (a lineage copy), or replace the row by a new one."""
        if replace:
            self.rows[row] = BlockTable([self.next_block])
        elif len(self.rows[row]) < 4:
            r = self.rows[row].lineage_copy()
            r.append_one(self.next_block)
            self.rows[row] = r
        self.next_block = 8 + (self.next_block - 7) % 32


_SETTINGS = settings(
    max_examples=int(os.environ.get("H2D_STATEFUL_EXAMPLES", "60")),
    stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
BackendsAgree.TestCase.settings = _SETTINGS
V41BackendsAgree.TestCase.settings = _SETTINGS
TestBackendsAgree = BackendsAgree.TestCase
TestV41BackendsAgree = V41BackendsAgree.TestCase


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


def test_the_v41_machine_reaches_publications() -> None:
    """A fixed valid V4.1 sequence publishes both groups on both sides, with equal bytes
    (and equal step indptrs under the interpreter)."""
    sides = [V41Side("packed", 2), V41Side("direct", 2)]
    rows = [BlockTable([1, 2]), BlockTable([3])]
    spans = [RequestSpan(2, 300, 0, -1), RequestSpan(1, 100, 1, 0)]
    cols = BatchColumns(
        query_lens=np.array([2, 1], np.int32), context_lens=np.array([300, 100], np.int32),
        temperatures=np.ones(2, np.float32), top_k=np.full(2, -1, np.int32),
        top_p=np.ones(2, np.float32), prev_sample_rows=np.full(2, -1, np.int32),
        token_ids=np.arange(3, dtype=np.int32), num_drafts=np.array([1, 0], np.int32))
    batch = ScheduledBatch((), False, V4_BLOCK, given_columns=cols)
    for s in sides:
        s.state.begin()
        s.tokens.prepare(batch, 4)
        s.plan = s.v4.begin_step(spans, block_tables=rows, padded=4)
        s.state.publish(TOKEN_INPUTS)
        s.state.publish(V41_METADATA)
        s.state.finish()
    assert sides[0].destinations() == sides[1].destinations()
    assert sides[0].state.counters(V41_METADATA).dmas == 1
    assert sides[0].v4.positions.gpu[:3].tolist() == [298, 299, 99]
    if INTERPRETED:
        got = [[t.tolist() for t in s.v4.generate_step_indptrs(s.plan)
                if isinstance(t, torch.Tensor)] for s in sides if s.plan is not None]
        assert got[0] == got[1]
