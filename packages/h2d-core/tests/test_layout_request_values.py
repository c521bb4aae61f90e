"""``RequestLayout``'s :class:`RequestValues` and :class:`OrElse` terms, stating GDN's state
slots as its adapter does (``h2d_runner_adapters.gdn``; no GDN code in h2d-core), and the
binding's range proof (an output the columns' bounds keep within int32 checks nothing per
batch; one they do not is checked).

The oracle is GDN's own words: request ``i`` of state group ``g`` owns slots ``g * k ..
g * k + k - 1``; it reads ``f * k`` for a fork source ``f >= 0``, else ``g * k``; padded
requests hold -1. Batches are checked against it by a plain loop, to the byte: real and
padded entries, the untouched tails, refusals naming the rule and changing nothing.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from h2d_core import (
    QUERY_LENS,
    LayoutColumn,
    OrElse,
    RampRows,
    RequestBound,
    RequestLayout,
    RequestLayoutError,
    RequestSum,
    RequestValues,
)

SENTINEL, K, TOP = 99, 2, 9


def gdn_layout() -> tuple[RequestLayout, dict[str, np.ndarray]]:
    out = {"base": np.full(4, SENTINEL, np.int32), "read": np.full(4, SENTINEL, np.int32),
           "rows": np.full(4 * K, SENTINEL, np.int32)}
    first = RequestSum((("groups", K),))
    lay = RequestLayout(
        "gdn", 1, None, None,
        columns=[LayoutColumn("groups", low=0, high=TOP),
                 LayoutColumn("forks", low=-1, high=TOP)],
        outputs=[RequestValues("base", out["base"], first, fill=-1),
                 RequestValues("read", out["read"],
                               RequestSum(((OrElse("forks", "groups"), K),)), fill=-1),
                 RampRows("rows", out["rows"], K, start=first, count=RequestSum((), K))])
    return lay, out


def test_gdn_state_slots_from_their_definition() -> None:
    """Hand-computed: groups (3, 0), forks (none, 5), k = 2, three padded requests."""
    lay, out = gdn_layout()
    ones = np.ones(2, np.int32)
    lay.plan(ones, ones, 3, -1, (np.array([3, 0], np.int32), np.array([-1, 5], np.int32)))
    lay.write()
    assert out["base"].tolist() == [6, 0, -1, SENTINEL]
    assert out["read"].tolist() == [6, 10, -1, SENTINEL]
    assert out["rows"].tolist() == [6, 7, 0, 1, -1, -1, SENTINEL, SENTINEL]
    # the next batch's sums are its own (nothing of the last one's carried over)
    lay.plan(ones, ones, 2, -1, (np.array([1, 4], np.int32), np.array([2, -1], np.int32)))
    lay.write()
    assert out["base"].tolist() == [2, 8, -1, SENTINEL]
    assert out["read"].tolist() == [4, 8, -1, SENTINEL]
    assert out["rows"].tolist() == [2, 3, 8, 9, -1, -1, SENTINEL, SENTINEL]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(-2, TOP + 1), st.integers(-3, TOP + 1)), max_size=4),
       st.integers(0, 2))
def test_gdn_state_slots_match_the_plain_loop(reqs: list[tuple[int, int]], pad: int) -> None:
    """Any batch: written as the plain loop computes, or refused for its first value out of
    the columns' bounds (groups, then forks) with nothing written; the layout then plans
    the next batch as if the refusal never happened."""
    lay, out = gdn_layout()
    n = len(reqs)
    p = min(n + pad, 4)
    groups = [r[0] for r in reqs]
    forks = [r[1] for r in reqs]
    before = {k: v.copy() for k, v in out.items()}
    ones = np.ones(n, np.int32)
    values = (np.array(groups, np.int32), np.array(forks, np.int32))
    bad_group = next((i for i, g in enumerate(groups) if not 0 <= g <= TOP), None)
    bad_fork = next((i for i, f in enumerate(forks) if not -1 <= f <= TOP), None)
    if bad_group is not None or bad_fork is not None:
        col, i = ("groups", bad_group) if bad_group is not None else ("forks", bad_fork)
        with pytest.raises(RequestLayoutError, match=rf"^gdn: request {i} has {col}="):
            lay.plan(ones, ones, p, -1, values)
        assert all((out[k] == before[k]).all() for k in out)
        lay.plan(np.ones(1, np.int32), np.ones(1, np.int32), 1, -1,
                 (np.array([4], np.int32), np.array([-1], np.int32)))
        lay.write()
        assert out["base"][0] == out["read"][0] == 8
        return
    lay.plan(ones, ones, p, -1, values)
    lay.write()
    base = [g * K for g in groups] + [-1] * (p - n)
    read = [(f if f >= 0 else g) * K for g, f in zip(groups, forks, strict=True)] + [-1] * (p - n)
    rows = [g * K + j for g in groups for j in range(K)] + [-1] * (K * (p - n))
    assert out["base"].tolist() == base + before["base"].tolist()[p:]
    assert out["read"].tolist() == read + before["read"].tolist()[p:]
    assert out["rows"].tolist() == rows + before["rows"].tolist()[K * p:]


def test_values_past_int32_are_refused_naming_the_sum_and_write_nothing() -> None:
    """An unbounded column's sum is checked per batch: past int32 it is refused, naming
    the request, the sum and its terms (an OrElse by the value it took)."""
    out = np.full(3, SENTINEL, np.int32)
    lay = RequestLayout("v", 1, None, None,
                        columns=[LayoutColumn("f", low=-1), LayoutColumn("g")], outputs=[
        RequestValues("v", out, RequestSum(((OrElse("f", "g"), 1), (QUERY_LENS, 1))))])
    q = np.array([1, 2], np.int32)
    with pytest.raises(RequestLayoutError, match=r"^v: output 'v': request 1 has \(f if >= 0 "
                                                 r"else g\) \+ query_lens = 2147483649 \(\(f "
                                                 r"if >= 0 else g\)=2147483647, query_lens=2\), "
                                                 r"past int32$"):
        lay.plan(q, q, 2, -1, (np.array([3, -1], np.int32),
                               np.array([0, 2**31 - 1], np.int32)))
    assert out.tolist() == [SENTINEL] * 3
    lay.plan(q, q, 3, -1, (np.array([3, -1], np.int32), np.array([0, 2**31 - 3], np.int32)))
    lay.write()
    assert out.tolist() == [4, 2**31 - 1, SENTINEL]  # fill None: the padded entry is kept


def test_the_columns_bounds_decide_what_is_checked_per_batch() -> None:
    """The binding bounds each sum from its columns' bounds: an output those keep within
    int32 (or a RequestBound they always meet) checks nothing per batch; widen a bound
    and the check is there (an output marked proven when it is not would write a wrapped
    value here instead of refusing). Sums equal across outputs are bound once."""
    from h2d_core.layout_sum_binding import SumBinder

    bound = [(0, None, False, None, None, "g", (0, 2**30 - 1, False, ""), None)]
    sums = SumBinder("x", bound)
    assert sums.value_range(RequestSum((("g", 2),), 1)) == (1, 2**31 - 1)
    assert sums.value_range(RequestSum((("g", -2), (QUERY_LENS, 1)))) == (
        -(2**31) + 2, 2**31 - 1)
    assert sums.bind(RequestSum((("g", 2),)), "a") is sums.bind(RequestSum((("g", 2),)), "b")
    # an OrElse takes its column where >= 0, its fallback only where the column may be < 0
    forks = SumBinder("x", [(0, None, False, None, None, col, (lo, hi, False, ""), None)
                            for col, lo, hi in (("f", -1, 5), ("g", 10, 20), ("h", 0, 5))])
    assert forks.value_range(RequestSum(((OrElse("f", "g"), 1),))) == (0, 20)
    assert forks.value_range(RequestSum(((OrElse("h", "g"), 2),))) == (0, 10)

    def layout(high: int, bound_high: int) -> RequestLayout:
        return RequestLayout("x", 1, None, None, columns=[LayoutColumn("g", low=0, high=high)],
                             outputs=[RequestValues("v", np.zeros(2, np.int32),
                                                    RequestSum((("g", 2),))),
                                      RequestBound(RequestSum((("g", 2),)), high=bound_high)])

    ones = np.ones(1, np.int32)
    layout(2**30 - 1, 2**31).plan(ones, ones, 1, -1, (np.array([2**30 - 1], np.int32),))
    with pytest.raises(RequestLayoutError, match=r"request 0 has 2 \* g = 2147483648 \(g="
                                                 r"1073741824\), past int32"):
        layout(2**30, 2**31).plan(ones, ones, 1, -1, (np.array([2**30], np.int32),))
    with pytest.raises(RequestLayoutError, match=r"request 0 has 2 \* g = 8 \(g=4\); 2 \* g "
                                                 r"must be <= 7"):
        layout(2**30 - 1, 7).plan(ones, ones, 1, -1, (np.array([4], np.int32),))


def test_or_else_describes_itself_and_refuses_bad_columns() -> None:
    assert RequestSum(((OrElse("f", "g"), 3), (QUERY_LENS, -1))).describe() == (
        "3 * (f if >= 0 else g) - query_lens")
    cols = [LayoutColumn("c"), LayoutColumn("f", np.zeros(4, np.float32))]
    arr = np.zeros(4, np.int32)
    good = RequestSum((("c", 1),))
    for term in (OrElse("c", "missing"), OrElse("missing", "c"), OrElse("c", "f")):
        with pytest.raises(RequestLayoutError, match=r"RequestValues 'v' value must be a "
                                                     r"RequestSum .* an OrElse of two"):
            RequestLayout("x", 1, None, None, columns=cols,
                          outputs=[RequestValues("v", arr, RequestSum(((term, 1),)))])
    for name, fill in (("c", None), ("v", 0.5), ("v", 2**31)):
        with pytest.raises(RequestLayoutError, match=rf"RequestValues {name!r} needs a unique"):
            RequestLayout("x", 1, None, None, columns=cols, outputs=[
                RequestValues(name, arr, good, fill=fill)])  # type: ignore[arg-type]
    with pytest.raises(RequestLayoutError, match=r"RequestValues 'v' must be a writeable "
                                                 r"C-contiguous 1-D int32 array"):
        RequestLayout("x", 1, None, None, columns=cols,
                      outputs=[RequestValues("v", arr.astype(np.int64), good)])
    # values bound the requests a batch may hold
    assert RequestLayout("x", 1, None, None, columns=cols,
                         outputs=[RequestValues("v", arr[:3], good)]).max_reqs == 3
