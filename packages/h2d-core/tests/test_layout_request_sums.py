"""``RequestLayout``'s generic outputs: :class:`RequestBound` and :class:`RampRows` over
:class:`RequestSum`, with bounded and distinct columns, stating Engram's rules as its
adapter does (``h2d_runner_adapters.engram``; no Engram code in h2d-core).

The oracle is written from the Engram spec's member layout:
request ``i`` owns its own row of a table of ``limit`` rows (distinct, in ``[0, limit)``),
its cursor satisfies ``0 <= cursor`` and ``cursor + q <= length``, its draft count
``0 <= d <= min(max_drafts, q - 1)``, and its ``max_drafts + 1`` candidates are
``cursor + q - d + a`` for ``a <= d``, then -1 (padded requests: all -1). Every batch is
checked against it to the byte: the outputs' real entries, the padded rows, the untouched
tails, the exact refusal (request, column, rule), a refusal changing nothing and the
layout planning the next batch as if the refusal never happened.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from h2d_core import (
    QUERY_LENS,
    LayoutColumn,
    RampRows,
    RequestBound,
    RequestLayout,
    RequestLayoutError,
    RequestSum,
)

MAX_REQS, MAX_DRAFTS, LENGTH = 6, 3, 30
WIDTH = MAX_DRAFTS + 1
SENTINEL = 99
#: a narrow row range (a stamp table) and a wide one (the sort)
LIMITS = (8, 1 << 20)


def layout(limit: int) -> tuple[RequestLayout, dict[str, np.ndarray]]:
    out = {"rows": np.full(MAX_REQS, SENTINEL, np.int32),
           "cursors": np.full(MAX_REQS, SENTINEL, np.int32),
           "candidates": np.full(MAX_REQS * WIDTH + 2, SENTINEL, np.int32)}
    cols = [LayoutColumn("rows", out["rows"], pad=None, low=0, high=limit - 1, distinct=True),
            LayoutColumn("cursors", out["cursors"], pad=None, low=0),
            LayoutColumn("num_drafts", low=0, high=MAX_DRAFTS)]
    end = RequestSum((("cursors", 1), (QUERY_LENS, 1)))
    lay = RequestLayout("eng", 1, None, None, columns=cols, outputs=[
        RequestBound(end, high=LENGTH, note="written into a history of LENGTH"),
        RequestBound(RequestSum((("num_drafts", 1), (QUERY_LENS, -1))), high=-1,
                     note="the last token is never a draft"),
        RampRows("candidates", out["candidates"][: MAX_REQS * WIDTH], WIDTH,
                 start=RequestSum((*end.terms, ("num_drafts", -1))),
                 count=RequestSum((("num_drafts", 1),), 1))])
    return lay, out


def refusal(q: list[int], rows: list[int], cur: list[int], d: list[int],
            limit: int) -> str | None:
    """The spec's first broken rule, in the layout's order: the columns' bounds (rows,
    cursors, draft counts), rows repeated, then the registered bounds in their order
    (cursor + q, drafts < q) (None: the batch is valid)."""
    for i, r in enumerate(rows):
        if not 0 <= r < limit:
            return f"eng: request {i} has rows={r}; rows must be in [0, {limit - 1}]"
    for i, c in enumerate(cur):
        if c < 0:
            return f"eng: request {i} has cursors={c}; cursors must be >= 0"
    for i, di in enumerate(d):
        if not 0 <= di <= MAX_DRAFTS:
            return f"eng: request {i} has num_drafts={di}; num_drafts must be in [0, {MAX_DRAFTS}]"
    for i, r in enumerate(rows):
        if r in rows[:i]:
            return (f"eng: request {i} has rows={r}, already request {rows.index(r)}'s; rows "
                    "must be distinct (each request owns its own value)")
    for i, (c, qi) in enumerate(zip(cur, q, strict=True)):
        if c + qi > LENGTH:
            return (f"eng: request {i} has cursors + query_lens = {c + qi} (cursors={c}, "
                    f"query_lens={qi}); cursors + query_lens must be <= {LENGTH} (written "
                    "into a history of LENGTH)")
    for i, (di, qi) in enumerate(zip(d, q, strict=True)):
        if di >= qi:
            return (f"eng: request {i} has num_drafts - query_lens = {di - qi} (num_drafts="
                    f"{di}, query_lens={qi}); num_drafts - query_lens must be <= -1 (the last "
                    "token is never a draft)")
    return None


def candidates(q: list[int], cur: list[int], d: list[int], p: int) -> list[int]:
    """The spec's sentence: ``cursor + q - d + a`` for ``a <= d``, -1 after; padded: -1."""
    out = []
    for qi, c, di in zip(q, cur, d, strict=True):
        out += [c + qi - di + a if a <= di else -1 for a in range(WIDTH)]
    return out + [-1] * (WIDTH * (p - len(q)))


def run(lay: RequestLayout, q: list[int], rows: list[int], cur: list[int], d: list[int],
        p: int) -> None:
    qa = np.array(q, np.int32)
    lay.plan(qa, qa, p, -2, (np.array(rows, np.int32), np.array(cur, np.int32),
                             np.array(d, np.int32)))
    lay.write()


def snapshot(out: dict[str, np.ndarray]) -> dict[str, bytes]:
    return {k: v.tobytes() for k, v in out.items()}


def check_written(out: dict[str, np.ndarray], before: dict[str, bytes], q: list[int],
                  rows: list[int], cur: list[int], d: list[int], p: int) -> None:
    n = len(q)
    old = {k: np.frombuffer(v, np.int32) for k, v in before.items()}
    # the columns: the batch's values, then what was there (no graph padding)
    assert out["rows"].tolist() == rows + old["rows"][n:].tolist()
    assert out["cursors"].tolist() == cur + old["cursors"][n:].tolist()
    want = candidates(q, cur, d, p)
    assert out["candidates"].tolist() == want + old["candidates"][len(want):].tolist()
    assert out["candidates"][-2:].tolist() == [SENTINEL, SENTINEL]  # never bound


request = st.tuples(st.integers(1, 5), st.integers(-1, 9), st.integers(-2, LENGTH + 1),
                    st.integers(-1, MAX_DRAFTS + 1))


@settings(max_examples=150, deadline=None)
@given(limit=st.sampled_from(LIMITS),
       batches=st.lists(st.tuples(st.lists(request, max_size=MAX_REQS), st.integers(0, 3)),
                        min_size=1, max_size=5))
def test_batches_match_the_spec_or_are_refused_changing_nothing(
        limit: int, batches: list[tuple[list[tuple[int, int, int, int]], int]]) -> None:
    lay, out = layout(limit)
    for reqs, extra in batches:
        q = [r[0] for r in reqs]
        rows = [r[1] if limit == LIMITS[0] else r[1] * 100_003 for r in reqs]
        cur, d = [r[2] for r in reqs], [r[3] for r in reqs]
        p = min(len(reqs) + extra, MAX_REQS)
        before = snapshot(out)
        want = refusal(q, rows, cur, d, limit)
        if want is None:
            run(lay, q, rows, cur, d, p)
            check_written(out, before, q, rows, cur, d, p)
            continue
        with pytest.raises(RequestLayoutError, match=f"^{re.escape(want)}$"):
            run(lay, q, rows, cur, d, p)
        assert snapshot(out) == before
        # a corrected batch (distinct rows, cursors and drafts in bounds) then plans normally
        fixed = (list(range(len(q))),
                 [min(max(c, 0), LENGTH - qi) for c, qi in zip(cur, q, strict=True)],
                 [min(max(x, 0), MAX_DRAFTS, qi - 1) for x, qi in zip(d, q, strict=True)])
        run(lay, q, *fixed, p)
        check_written(out, before, q, *fixed, p)


@pytest.mark.parametrize("limit", LIMITS)
def test_distinct_rows_name_the_first_repeat_and_its_owner(limit: int) -> None:
    """The first request (in order) whose row an earlier request holds, and that request;
    a row reused across batches is no repeat (each plan checks its own batch)."""
    lay, out = layout(limit)
    top = limit - 1
    q, cur, d = [2, 2, 2, 2], [0, 0, 0, 0], [1, 1, 1, 1]
    with pytest.raises(RequestLayoutError, match=rf"^eng: request 2 has rows={top}, already "
                                                 r"request 0's; rows must be distinct"):
        run(lay, q, [top, 1, top, 1], cur, d, 4)
    assert out["rows"].tolist() == [SENTINEL] * MAX_REQS
    for rows in ([top, 1, 0, 2], [2, 0, 1, top], [top, 1, 0, 2]):  # rows move, then repeat
        before = snapshot(out)
        run(lay, q, rows, cur, d, 4)
        check_written(out, before, q, rows, cur, d, 4)
    with pytest.raises(RequestLayoutError, match=r"request 3 has rows=0, already request 1's"):
        run(lay, q, [5, 0, 3, 0], cur, d, 4)


def test_the_extremes_of_the_cursor_bound_and_the_candidates() -> None:
    """A cursor at 0 and one whose tokens end exactly at the length (its last candidate is
    the length); a request of one token (no draft: one candidate); every draft of the
    widest request."""
    lay, out = layout(8)
    q, rows, cur, d = [1, 4, 3], [7, 0, 3], [0, LENGTH - 4, 5], [0, MAX_DRAFTS, 2]
    before = snapshot(out)
    run(lay, q, rows, cur, d, 3)
    check_written(out, before, q, rows, cur, d, 3)
    assert out["candidates"][: 3 * WIDTH].tolist() == [1, -1, -1, -1, 27, 28, 29, 30,
                                                       6, 7, 8, -1]
    before = snapshot(out)
    with pytest.raises(RequestLayoutError, match=r"request 1 has cursors \+ query_lens = 31 "
                                                 r"\(cursors=27, query_lens=4\)"):
        run(lay, q, rows, [0, LENGTH - 3, 5], d, 3)
    with pytest.raises(RequestLayoutError, match=r"request 0 has num_drafts - query_lens = 0 "
                                                 r"\(num_drafts=1, query_lens=1\)"):
        run(lay, q, rows, cur, [1, 0, 0], 3)
    # more drafts than the candidates hold, though fewer than the query tokens
    with pytest.raises(RequestLayoutError, match=rf"request 1 has num_drafts={WIDTH}; "
                                                 rf"num_drafts must be in \[0, {MAX_DRAFTS}\]"):
        run(lay, [1, WIDTH + 1, 3], rows, [0, 0, 5], [0, WIDTH, 2], 3)
    assert snapshot(out) == before
    run(lay, [], [], [], [], 0)  # an empty batch writes nothing
    assert snapshot(out) == before


def test_request_sums_describe_themselves() -> None:
    assert RequestSum((("cursors", 1), (QUERY_LENS, 1), ("d", -1))).describe() == (
        "cursors + query_lens - d")
    assert RequestSum((("d", 1),), 1).describe() == "d + 1"
    assert RequestSum((("a", -2), ("b", 3)), -4).describe() == "-2 * a + 3 * b - 4"
    assert RequestSum((), 5).describe() == "5"


def test_ramp_rows_refuse_a_count_outside_the_width_and_entries_past_int32() -> None:
    """RampRows' own checks, with no column bound in front of them: a count below 0 or
    above the width; entries that would leave int32. Nothing is written."""
    out = np.full(2 * 3, SENTINEL, np.int32)
    lay = RequestLayout("r", 1, None, None, columns=[LayoutColumn("s"), LayoutColumn("k")],
                        outputs=[RampRows("ramp", out, 3, start=RequestSum((("s", 1),)),
                                          count=RequestSum((("k", 1), (QUERY_LENS, 1))))])

    def plan(s: list[int], k: list[int]) -> None:
        q = np.ones(len(s), np.int32)
        lay.plan(q, q, len(s), -2, (np.array(s, np.int32), np.array(k, np.int32)))

    with pytest.raises(RequestLayoutError, match=r"^r: output 'ramp': request 1 has k \+ "
                                                 r"query_lens = 4 \(k=3, query_lens=1\); k \+ "
                                                 r"query_lens must lie in \[0, 3\]"):
        plan([0, 0], [0, 3])
    with pytest.raises(RequestLayoutError, match=r"request 0 has k \+ query_lens = -1"):
        plan([0], [-2])
    with pytest.raises(RequestLayoutError, match=r"request 0's entries 2147483646\.\.2147483648 "
                                                 r"\(s = 2147483646, s=2147483646\) leave int32"):
        plan([2**31 - 2], [2])
    assert out.tolist() == [SENTINEL] * 6
    plan([2**31 - 3, -5], [2, -1])  # the last entry int32's largest; a count of 0
    lay.write()
    assert out.tolist() == [2**31 - 3, 2**31 - 2, 2**31 - 1, -1, -1, -1]


def test_the_vocabulary_refuses_its_declaration_errors() -> None:
    cand = np.zeros(8, np.int32)
    cols = [LayoutColumn("c"), LayoutColumn("d"), LayoutColumn("f", np.zeros(4, np.float32))]
    with pytest.raises(RequestLayoutError, match=r"column 'r': distinct applies to int32 "
                                                 r"per-request columns with both bounds"):
        RequestLayout("x", 1, None, None, columns=[LayoutColumn("r", low=0, distinct=True)])
    with pytest.raises(RequestLayoutError, match=r"distinct applies"):
        RequestLayout("x", 1, None, None, columns=[
            LayoutColumn("r", np.zeros(4, np.float32), low=0, high=3, distinct=True)])
    with pytest.raises(RequestLayoutError, match=r"distinct applies"):
        RequestLayout("x", 1, None, None, columns=[
            LayoutColumn("r", low=0, high=3, per_token=True, distinct=True)])
    good = RequestSum((("c", 1),))
    bad_sums: list[Any] = [
        (("c", 1),), RequestSum((("missing", 1),)), RequestSum((("f", 1),)),
        RequestSum((("c", 0),)), RequestSum((("c", True),)), RequestSum((("c", 2**16 + 1),)),
        RequestSum((("c", 1),) * 9), RequestSum((("c", 1),), 2**62 + 1),
        RequestSum((("c", 1),), 0.5), RequestSum((("c",),))]  # type: ignore[arg-type]
    for value in bad_sums:
        with pytest.raises(RequestLayoutError, match=r"RequestBound value must be a "
                                                     r"RequestSum of at most 8"):
            RequestLayout("x", 1, None, None, columns=cols,
                          outputs=[RequestBound(value, high=3)])
        with pytest.raises(RequestLayoutError, match=r"RampRows 'r' count must be a "
                                                     r"RequestSum"):
            RequestLayout("x", 1, None, None, columns=cols,
                          outputs=[RampRows("r", cand, 4, start=good, count=value)])
    for low, high in ((None, None), (3, 2), (2**63, None), (None, 1.5)):
        with pytest.raises(RequestLayoutError, match=r"RequestBound needs low and/or high"):
            RequestLayout("x", 1, None, None, columns=cols,
                          outputs=[RequestBound(good, low=low, high=high)])
    for name, width, fill in (("c", 4, -1), ("r", 0, -1), ("r", 4, 2**31), ("r", True, -1)):
        with pytest.raises(RequestLayoutError, match=rf"RampRows {name!r} needs a unique name"):
            RequestLayout("x", 1, None, None, columns=cols, outputs=[
                RampRows(name, cand, width, start=good, count=good, fill=fill)])
    with pytest.raises(RequestLayoutError, match=r"RampRows 'r' must be a writeable "
                                                 r"C-contiguous 1-D int32 array"):
        RequestLayout("x", 1, None, None, columns=cols, outputs=[
            RampRows("r", cand.astype(np.int64), 4, start=good, count=good)])
    # the rows bound the requests a batch may hold: 8 entries of 4, two requests
    lay = RequestLayout("x", 1, None, None, columns=cols,
                        outputs=[RampRows("r", cand, 4, start=good, count=good)])
    assert lay.max_reqs == 2


def test_names_bind_one_column_each_and_never_shadow_the_query_lengths() -> None:
    """A sum binds its terms by name: two columns of one name, a column named
    ``query_lens`` (the query lengths' term), a term that is not a str, and a RampRows
    without an array are refused at bind."""
    cand = np.zeros(8, np.int32)
    ramp = [RampRows("r", cand, 4, start=RequestSum((("c", 1),)), count=RequestSum((), 1))]
    for cols in ([LayoutColumn("c"), LayoutColumn("c", low=5)],
                 [LayoutColumn("c", per_token=True), LayoutColumn("c")],
                 [LayoutColumn("c"), LayoutColumn(QUERY_LENS)]):
        with pytest.raises(RequestLayoutError, match=r"needs a unique name, not 'query_lens'"):
            RequestLayout("x", 1, None, None, columns=cols, outputs=ramp)
    with pytest.raises(RequestLayoutError, match=r"start must be a RequestSum"):
        RequestLayout("x", 1, None, None, columns=[LayoutColumn("c")], outputs=[
            RampRows("r", cand, 4, start=RequestSum(((np.array([1]), 1),)),  # type: ignore[arg-type]
                     count=RequestSum((), 1))])
    with pytest.raises(RequestLayoutError, match=r"RampRows 'r' needs a unique name, an out "
                                                 r"array"):
        RequestLayout("x", 1, None, None, columns=[LayoutColumn("c")], outputs=[
            RampRows("r", None, 4, start=RequestSum((("c", 1),)),  # type: ignore[arg-type]
                     count=RequestSum((), 1))])

