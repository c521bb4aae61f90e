"""``RequestLayout``'s distinct rows, cursor + query-length bound and candidate rows.

The oracle is written from the Engram spec's member layout (``h2d_runner_adapters.engram``):
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

from h2d_core import Cursors, LayoutColumn, RequestLayout, RequestLayoutError

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
            LayoutColumn("cursors", out["cursors"], pad=None),
            LayoutColumn("num_drafts")]
    lay = RequestLayout("eng", 1, None, None, columns=cols, outputs=[Cursors(
        "cursors", LENGTH, drafts="num_drafts",
        candidates=out["candidates"][: MAX_REQS * WIDTH], width=WIDTH)])
    return lay, out


def refusal(q: list[int], rows: list[int], cur: list[int], d: list[int],
            limit: int) -> str | None:
    """The spec's first broken rule, in the layout's order: rows' range, rows repeated,
    the cursor bound, the draft counts (None: the batch is valid)."""
    for i, r in enumerate(rows):
        if not 0 <= r < limit:
            return f"eng: request {i} has rows={r}; rows must be in [0, {limit - 1}]"
    for i, r in enumerate(rows):
        if r in rows[:i]:
            return (f"eng: request {i} has rows={r}, already request {rows.index(r)}'s; rows "
                    "must be distinct (each request owns its own value)")
    for i, (c, qi) in enumerate(zip(cur, q, strict=True)):
        if c < 0:
            return f"eng: request {i} has a negative cursor (cursors={c}); cursors must be >= 0"
        if c + qi > LENGTH:
            return (f"eng: request {i} has cursors + query tokens past the length {LENGTH} "
                    f"(cursors={c}, query_lens={qi}); cursors + query_lens must be <= {LENGTH}")
    for i, (di, qi) in enumerate(zip(d, q, strict=True)):
        if not 0 <= di <= min(MAX_DRAFTS, qi - 1):
            return (f"eng: request {i} has num_drafts={di} with query_lens={qi}; num_drafts "
                    f"must lie in [0, min({MAX_DRAFTS}, query_lens - 1)] ({WIDTH} candidates "
                    "per request, the last query token never a draft)")
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
    with pytest.raises(RequestLayoutError, match=r"request 1 has cursors \+ query tokens past "
                                                 r"the length 30 \(cursors=27, query_lens=4\)"):
        run(lay, q, rows, [0, LENGTH - 3, 5], d, 3)
    with pytest.raises(RequestLayoutError, match=r"request 0 has num_drafts=1 with "
                                                 r"query_lens=1"):
        run(lay, q, rows, cur, [1, 0, 0], 3)
    # more drafts than the candidates hold, though fewer than the query tokens
    with pytest.raises(RequestLayoutError, match=rf"request 1 has num_drafts={WIDTH} with "
                                                 rf"query_lens={WIDTH + 1}; num_drafts must "
                                                 rf"lie in \[0, min\({MAX_DRAFTS}, "):
        run(lay, [1, WIDTH + 1, 3], rows, [0, 0, 5], [0, WIDTH, 2], 3)
    assert snapshot(out) == before
    run(lay, [], [], [], [], 0)  # an empty batch writes nothing
    assert snapshot(out) == before


def test_the_vocabulary_refuses_its_declaration_errors() -> None:
    cand = np.zeros(8, np.int32)
    base: dict[str, Any] = {"column": "c", "limit": 10}
    with pytest.raises(RequestLayoutError, match=r"column 'r': distinct applies to int32 "
                                                 r"per-request columns with both bounds"):
        RequestLayout("x", 1, None, None, columns=[LayoutColumn("r", low=0, distinct=True)])
    with pytest.raises(RequestLayoutError, match=r"distinct applies"):
        RequestLayout("x", 1, None, None, columns=[
            LayoutColumn("r", np.zeros(4, np.float32), low=0, high=3, distinct=True)])
    with pytest.raises(RequestLayoutError, match=r"distinct applies"):
        RequestLayout("x", 1, None, None, columns=[
            LayoutColumn("r", low=0, high=3, per_token=True, distinct=True)])
    bad = [dict(base, limit=None), dict(base, limit=2**31),
           dict(base, column="missing"), dict(base, drafts="d"),
           dict(base, candidates=cand), dict(base, drafts="d", candidates=cand, width=0),
           {"column": "d", "limit": 10, "drafts": "missing", "candidates": cand}]
    for kwargs in bad:
        with pytest.raises(RequestLayoutError, match=r"Cursors needs column naming a bound "
                                                     r"int32 per-request column"):
            RequestLayout("x", 1, None, None, columns=[LayoutColumn("c"), LayoutColumn("d")],
                          outputs=[Cursors(**kwargs)])
    with pytest.raises(RequestLayoutError, match=r"one Cursors per layout"):
        RequestLayout("x", 1, None, None, columns=[LayoutColumn("c"), LayoutColumn("d")],
                      outputs=[Cursors(**base), Cursors(**base)])
    # the candidates bound the requests a batch may hold: 8 entries of 4, two requests
    lay = RequestLayout("x", 1, None, None, columns=[LayoutColumn("c"), LayoutColumn("d")],
                        outputs=[Cursors(drafts="d", candidates=cand, width=4, **base)])
    assert lay.max_reqs == 2
