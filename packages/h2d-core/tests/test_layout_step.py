"""``LayoutStep``'s count vocabulary beyond requests and tokens, against hand-computed values.

* ``PLAN_ROWS``: a member publishes the layout's published rows of the plan its rule
  names (``RequestLayout.plan_published[k]``), read by the compiled ``CountProgram``;
* ``OMITTED``: a member of the group the step leaves out (a count set earlier is dropped);
* ``STEP_COUNTS``: the step writes ``(n, P, t, T)`` into an int32 member and publishes
  those 4 entries (what a first consumer fused into the publication reads on the device);
* ``LayoutStep.plan_rows``: each plan's (real rows, published rows), grouped by
  ``plan_group``, the same tuple while the rows stay the same;
* ``RequestLayout``'s ``token_prefix`` output: ``0, 1, ..., t`` then ``t`` up to the padded
  tokens (every token its own query), nothing written past ``padded_tokens + 1``.

Every published member is checked byte for byte on the destination: the counted prefix is
the source's, the tail keeps the poison it started with.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from h2d_core import (
    DRAFTS,
    PADDED_REQS,
    PADDED_TOKENS,
    CountError,
    CountRule,
    DeclarationError,
    H2DRunnerState,
    LayoutPlan,
    LayoutStep,
    RequestLayout,
    StepCounts,
    StepSpec,
)
from h2d_core.count_program import CountProgram
from h2d_core.step import OMITTED, PLAN_ROWS, STEP_COUNTS
from h2d_core.step import TOKENS as TOKENS_WHAT

POISON = 0x5A
SOURCE_POISON = -3  # every source element starts as this: what the step leaves shows
TOKENS, REQUESTS = 16, 4
GROUP = "g"


class Setup:
    """A state with one producer group of a plan-carrying layout's members."""

    def __init__(self, num_slots: int = 1, plan_group: int = 2, joined: bool = False) -> None:
        st = H2DRunnerState("cpu", backend="packed", scatter="reference",
                            num_slots=num_slots)
        buf = st.buffer
        self.state = st
        self.pos = buf("pos", (TOKENS,), torch.int64, group=GROUP)
        self.owners = buf("owners", (TOKENS,), torch.int32, group=GROUP)
        self.lens = buf("lens", (REQUESTS,), torch.int32, group=GROUP)
        self.prefix = buf("prefix", (TOKENS + 1,), torch.int32, group=GROUP)
        # ratio 4 (compress rows): at most REQUESTS * ceil(q / 4) rows for q <= 4
        self.plan_a = buf("plan_a", (REQUESTS, 4), torch.int32, group=GROUP, unit="rows")
        # window 3 (tail rows): at most REQUESTS * 3 rows
        self.plan_b = buf("plan_b", (REQUESTS * 3, 4), torch.int32, group=GROUP,
                          unit="rows")
        self.extra = buf("extra", (8,), torch.int32, group=GROUP)
        st.bind()
        for b in st.buffers().values():
            b.gpu.view(-1).view(torch.uint8).fill_(POISON)
            for slot in range(num_slots):
                b.source(slot).view(-1).fill_(SOURCE_POISON)
        self.layouts = [self._layout(slot) for slot in range(num_slots)]
        rules = self.rules()
        if joined:  # two producers' parts, joined and bound: the same step
            self.step = (StepSpec(rules[:3]) + StepSpec(rules[3:])).bind(
                GROUP, st, self.layouts, plan_group=plan_group)
        else:
            self.step = LayoutStep(GROUP, st, self.layouts, None, (), rules,
                                   plan_group=plan_group)

    def _layout(self, slot: int) -> RequestLayout:
        def src(b: Any) -> np.ndarray:
            return b.source(slot).numpy()

        return RequestLayout(
            GROUP, 1, None, None, positions=src(self.pos), token_requests=src(self.owners),
            context_lens=src(self.lens), token_prefix=src(self.prefix),
            plans=[LayoutPlan("plan_a", src(self.plan_a), 4, 8),
                   LayoutPlan("plan_b", src(self.plan_b), 2, 3, tail=True)])

    def rules(self) -> list[CountRule]:
        return [CountRule(self.pos, PADDED_TOKENS), CountRule(self.owners, PADDED_TOKENS),
                CountRule(self.lens, PADDED_REQS), CountRule(self.prefix, PADDED_TOKENS, 1),
                CountRule(self.plan_a, PLAN_ROWS, plan=0),
                CountRule(self.plan_b, PLAN_ROWS, plan=1), CountRule(self.extra, OMITTED)]

    def run(self, q: list[int], ctx: list[int], padded: int) -> tuple[Any, ...]:
        return self.step.run(np.array(q, np.int32), np.array(ctx, np.int32), None, padded,
                             -1, ())


# q = [2, 1, 3], ctx = [5, 8, 4], padded to 4 requests: the graph grid is 4 * 3 = 12 tokens
Q, CTX, PADDED = [2, 1, 3], [5, 8, 4], 4
T, PT = 6, 12
WANT_POS = [3, 4, 7, 1, 2, 3] + [0] * (PT - T)
WANT_OWNERS = [0, 0, 1, 2, 2, 2] + [-1] * (PT - T)
WANT_LENS = [5, 8, 4, 0]
WANT_PREFIX = [0, 1, 2, 3, 4, 5, 6] + [6] * (PT - T)  # PT + 1 entries
# ratio 4: the tokens at positions 3, 7 and 3 close a block: [token, request, position,
# 8 - min(j + 1, 8)]; published 4 * ceil(3 / 4) = 4 rows, the fourth -1
WANT_A = [[0, 0, 3, 7], [2, 1, 7, 7], [5, 2, 3, 5], [-1] * 4]
# window 3: every token is among its request's last 3 positions: [.., 3 - min(j + 1, 3)];
# published 4 * min(3, 3) = 12 rows
WANT_B = ([[0, 0, 3, 2], [1, 0, 4, 1], [2, 1, 7, 2], [3, 2, 1, 2], [4, 2, 2, 1],
           [5, 2, 3, 0]] + [[-1] * 4] * 6)


def _published_bytes(b: Any, want: list[Any], dtype: Any) -> None:
    """The destination holds ``want`` (as ``dtype``) then the poison, byte for byte."""
    dest = b.gpu.reshape(-1).view(torch.uint8).numpy().tobytes()
    head = np.array(want, dtype=dtype).tobytes()
    assert dest[: len(head)] == head, b.name
    assert dest[len(head):] == bytes([POISON]) * (len(dest) - len(head)), b.name


@pytest.mark.parametrize("joined", [False, True], ids=["direct", "joined-specs"])
def test_plan_rows_counts_omitted_and_token_prefix_publish_exact_bytes(joined: bool) -> None:
    s = Setup(joined=joined)
    st = s.state
    st.begin()
    st.set_count(s.extra, 5)  # set earlier in the epoch: OMITTED drops it
    n, p, q, t, pt, total, stage, _, column_sum = s.run(Q, CTX, PADDED).astuple()
    # no table: the pages of one-token pages are the contexts' sum
    assert (n, p, q, t, pt, total, stage, column_sum) == (3, 4, 3, T, PT, 17, "", 0)
    counts = {b.name: st.count(b) for b in (s.pos, s.owners, s.lens, s.prefix, s.plan_a,
                                            s.plan_b, s.extra)}
    assert counts == {"pos": PT, "owners": PT, "lens": 4, "prefix": PT + 1, "plan_a": 4,
                      "plan_b": 12, "extra": None}
    assert s.step.plan_rows == ((3, 4, 6, 12),)
    assert [s.layouts[0].plan_rows(k) for k in (0, 1)] == [(3, 4), (6, 12)]
    # the sources: written up to the padded counts, untouched after them
    prefix = s.prefix.source(0).numpy()
    assert prefix.tolist() == WANT_PREFIX + [SOURCE_POISON] * (TOKENS - PT)
    assert s.plan_a.source(0).numpy().tolist() == WANT_A
    st.publish(GROUP)
    st.finish()
    _published_bytes(s.pos, WANT_POS, np.int64)
    _published_bytes(s.owners, WANT_OWNERS, np.int32)
    _published_bytes(s.lens, WANT_LENS, np.int32)
    _published_bytes(s.prefix, WANT_PREFIX, np.int32)
    _published_bytes(s.plan_a, WANT_A, np.int32)
    _published_bytes(s.plan_b, WANT_B, np.int32)
    _published_bytes(s.extra, [], np.int32)  # omitted: nothing sent


def test_plan_rows_follow_each_slots_last_step() -> None:
    """Each slot keeps its last run's plan rows (C integers; a tuple built when read):
    ``plan_rows`` is the last run's, ``plan_rows_of(slot)`` a slot's, unchanged by the
    other slot's steps."""
    s = Setup(num_slots=2, plan_group=1)
    st = s.state
    seen = []
    for q, ctx, padded in ((Q, CTX, PADDED), (Q, CTX, PADDED), (Q, CTX, 3), ([1], [4], 2),
                           ([1], [4], 2)):
        st.begin()
        s.run(q, ctx, padded)
        seen.append((s.step.plan_rows, s.step.plan_rows_of(0), s.step.plan_rows_of(1)))
        st.publish(GROUP)
        st.finish()
    assert seen[0][0] == seen[0][1] == ((3, 4), (6, 12))
    assert seen[1][0] == seen[1][2] == seen[1][1] == ((3, 4), (6, 12))
    # the same real rows padded to 3 requests (slot 0): only the published counts change;
    # slot 1 keeps its own
    assert seen[2] == (((3, 3), (6, 9)), ((3, 3), (6, 9)), ((3, 4), (6, 12)))
    # one request at position 3 (closes a ratio-4 block), padded to 2: ceil(1/4) * 2 = 2
    # compress rows, min(1, 3) * 2 = 2 tail rows (slot 1, then slot 0)
    assert seen[3] == (((1, 2), (1, 2)), ((3, 3), (6, 9)), ((1, 2), (1, 2)))
    assert seen[4] == (((1, 2), (1, 2)),) * 3
    with pytest.raises(IndexError, match=r"slot 2 out of range"):
        s.step.plan_rows_of(2)


def test_each_slot_has_one_counts_record_refreshed_by_its_next_step() -> None:
    """``run`` returns its slot's record, the same object every step of that slot: the
    next step of the slot rewrites it (the documented validity), the other slot's does
    not; a hand-built record equal in value compares equal."""
    s = Setup(num_slots=2)
    st = s.state
    seen = []
    for q, ctx, padded in ((Q, CTX, PADDED), ([1], [4], 2), ([2, 1], [2, 9], 3)):
        st.begin()
        seen.append(s.run(q, ctx, padded))
        st.publish(GROUP)
        st.finish()
    assert seen[0] is seen[2] is s.step.counts(0)
    assert seen[1] is s.step.counts(1) and seen[1] is not seen[0]
    assert seen[0].astuple()[:5] == (2, 3, 2, 3, 6)  # slot 0: the third step (3 x 2 padded)
    assert seen[1].astuple()[:5] == (1, 2, 1, 1, 2)  # slot 1 kept the second step's
    assert seen[1] == StepCounts(*seen[1].astuple())
    assert seen[1] != StepCounts(*seen[0].astuple())
    with pytest.raises(TypeError):
        StepCounts(num_reqs=1.5)


def test_token_prefix_eager_and_empty_batches() -> None:
    s = Setup()
    st = s.state
    st.begin()
    # eager with uneven widths: exactly the real tokens, no padding entry
    out = s.step.run(np.array([2, 1], np.int32), np.array([2, 9], np.int32), None, -1, -1, ())
    assert (out.num_reqs, out.padded_reqs, out.num_tokens, out.padded_tokens) == (2, 2, 3, 3)
    assert st.count(s.prefix) == 4
    assert s.prefix.source(0).numpy().tolist() == [0, 1, 2, 3] + [SOURCE_POISON] * 13
    # graph plans: no position closes a ratio-4 block, 2 * ceil(2 / 4) published; every
    # token is a tail row, 2 * min(2, 3) published
    assert s.step.plan_rows == ((0, 2, 3, 4),)
    st.finish()
    st.begin()
    s.step.run(np.zeros(0, np.int32), np.zeros(0, np.int32), None, 2, -1, ())
    # no tokens, two padded requests of one (the widest query is at least 1): 0, then 0
    assert s.prefix.source(0).numpy()[:4].tolist() == [0, 0, 0, 3]  # [3] left from before
    assert st.count(s.prefix) == 3
    st.finish()


def test_a_refused_batch_changes_no_source_and_no_count() -> None:
    s = Setup()
    st = s.state
    st.begin()
    s.run(Q, CTX, PADDED)
    before = {b.name: b.source(0).clone() for b in st.buffers().values()}
    counts = {b.name: st.count(b) for b in st.buffers().values()}
    with pytest.raises(CountError, match=r"request 1 has context_len 0, shorter than its 1"):
        s.run([3, 1], [6, 0], 2)
    with pytest.raises(CountError, match=r"17 padded tokens for 4 tokens"):
        s.step.run(np.array([4], np.int32), np.array([9], np.int32), None, 1, 17, ())
    for b in st.buffers().values():
        assert torch.equal(b.source(0), before[b.name]), b.name
        assert st.count(b) == counts[b.name], b.name
    assert s.step.plan_rows == ((3, 4, 6, 12),)
    st.finish()


def test_declarations_name_the_plan_and_the_grouping() -> None:
    s = Setup()
    rules = s.rules()
    bad = [*rules[:4], CountRule(s.plan_a, PLAN_ROWS, plan=2), *rules[5:]]
    with pytest.raises(DeclarationError, match=r"buffer 'plan_a' counts the rows of plan 2; "
                                               r"the layouts bind 2 plans"):
        LayoutStep(GROUP, s.state, s.layouts, None, (), bad)
    with pytest.raises(DeclarationError, match=r"counts 9; use REQS, PADDED_REQS, TOKENS, "
                                               r"PADDED_TOKENS, PLAN_ROWS, OMITTED, "
                                               r"STEP_COUNTS or DRAFTS"):
        LayoutStep(GROUP, s.state, s.layouts, None, (), [CountRule(s.pos, 9)])
    with pytest.raises(DeclarationError, match=r"buffer 'extra' counts DRAFTS, the sum of the "
                                               r"layout's summed column; pass sum_column"):
        LayoutStep(GROUP, s.state, s.layouts, None, (), [CountRule(s.extra, DRAFTS)])
    with pytest.raises(DeclarationError, match=r"bind \[2\] plans, grouped by 3"):
        LayoutStep(GROUP, s.state, s.layouts, None, (), rules, plan_group=3)


def test_count_program_plan_rows_from_c_values_and_the_slow_path() -> None:
    s = Setup()
    st = s.state
    st.begin()
    gi, ia = s.plan_a.homes[0]
    _, ib = s.plan_b.homes[0]
    _, ie = s.extra.homes[0]
    records = st._slot_groups[0]
    # (member, unit bytes, largest, what, plus, omit_if_uniform, plan, times, record)
    program = CountProgram([(ia, 16, 4, PLAN_ROWS, 0, 0, 1, 1, gi),
                            (ib, 16, 12, PLAN_ROWS, 1, 0, 0, 1, gi),
                            (ie, 4, 8, OMITTED, 0, 0, 0, 1, gi)])
    assert program.values(3, 4, 6, 12, 0, [2, 4]) == (4, 3, None)
    assert program.store_homes(records, 3, 4, 6, 12, 0, [2, 4])
    assert (st.count(s.plan_a), st.count(s.plan_b), st.count(s.extra)) == (4, 3, None)
    # a plan count past its member's largest, no plans, or a plan index outside them:
    # False, storing nothing (the caller raises the specific error the slow way)
    for plans in ([2, 5], None, [2]):
        assert not program.store_homes(records, 1, 1, 1, 1, 0, plans)
        assert (st.count(s.plan_a), st.count(s.plan_b)) == (4, 3)
    with pytest.raises(CountError, match=r"plan_a"):
        s.state.count_batch([s.plan_a, s.plan_b, s.extra]).set(
            *program.values(1, 1, 1, 1, 0, [2, 5]))
    st.finish()


def test_count_program_stores_each_row_in_its_record_and_checks_all_first() -> None:
    """The ninth column names the record a row stores into (a member in two groups' records
    has a row per home): every row is checked before any record changes."""
    st = H2DRunnerState("cpu", backend="packed", scatter="reference")
    a = st.buffer("a", (8,), torch.int32, group="shared")
    b = st.buffer("b", (8,), torch.int32, group="decode")
    st.buffer("c", (8,), torch.int32, group="prefill")
    st.combine("decode_step", ["shared", "decode"])
    st.combine("prefill_step", ["shared", "prefill"])
    st.bind()
    assert len(a.homes) == 2 and len(b.homes) == 1
    st.begin()
    records = st._slot_groups[0]
    rows = [(i, 4, 8, TOKENS_WHAT, 0, 0, 0, 1, gi) for gi, i in a.homes]
    rows += [(i, 4, 5, TOKENS_WHAT, 1, 0, 0, 1, gi) for gi, i in b.homes]
    program = CountProgram(rows)

    def counts() -> list[list[int | None]]:
        return [[records[gi].counts[i] for gi, i in m.homes] for m in (a, b)]

    assert program.store_homes(records, 2, 2, 4, 4, 0)
    assert counts() == [[4, 4], [5]]
    # b's count 7 + 1 is past its largest (5), a's row checked first fits: nothing stored
    assert not program.store_homes(records, 2, 2, 7, 7, 0)
    assert counts() == [[4, 4], [5]]
    st.finish()


def test_step_counts_member_carries_the_four_counts_and_nothing_more() -> None:
    s = Setup(num_slots=2)
    st = s.state
    rules = [*s.rules()[:-1], CountRule(s.extra, STEP_COUNTS)]
    step = LayoutStep(GROUP, st, s.layouts, None, (), rules, plan_group=2)
    # padded to the grid, then eager with uneven widths: exactly the real tokens
    for slot, (q, ctx, padded, want) in enumerate([(Q, CTX, PADDED, [3, 4, 6, 12]),
                                                   ([1, 2], [3, 4], -1, [2, 2, 3, 3])]):
        st.begin()
        assert st.current_slot == slot
        step.run(np.array(q, np.int32), np.array(ctx, np.int32), None, padded, -1, ())
        assert st.count(s.extra) == 4
        src = s.extra.source(slot).tolist()
        assert src == want + [SOURCE_POISON] * 4  # entries past the four are never written
        st.publish(GROUP)
        st.finish()
        _published_bytes(s.extra, want, np.int32)


def test_step_counts_declaration_names_the_member_and_the_rule() -> None:
    s = Setup()
    base = s.rules()[:-1]
    for bad in ([CountRule(s.pos, STEP_COUNTS)],  # int64
                [CountRule(s.extra, STEP_COUNTS), CountRule(s.lens, STEP_COUNTS)]):  # two
        with pytest.raises(DeclarationError, match=r"STEP_COUNTS names .*; name one "
                                                   r"contiguous int32 buffer of at least 4"):
            LayoutStep(GROUP, s.state, s.layouts, None, (), [*base, *bad], plan_group=2)
