"""``RequestLayout``: positions, KV slots, prefixes and token owners of a batch, in one pass.

Every output is checked against a plain per-token oracle, for the compiled class and the
same source run interpreted; a rejected batch must leave every bound array unchanged.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from h2d_core import (
    LayoutColumn,
    LayoutPlan,
    RequestLayout,
    RequestLayoutError,
    TokenPlanes,
    VerifyRows,
    request_layout,
)

CLASSES = [request_layout.RequestLayout]  # the compiled class: there is no other mode
ROWS, WIDTH, TOKENS = 6, 12, 40


def bound(cls: Any, page: int, **skip: bool) -> tuple[Any, dict[str, np.ndarray]]:
    arrays = {
        "table": np.arange(ROWS * WIDTH, dtype=np.int32).reshape(ROWS, WIDTH) * 7 + 3,
        "required_pages": np.full(ROWS, 99, dtype=np.int32),
        "positions": np.full(TOKENS, 99, dtype=np.int64),
        "slot_mapping": np.full(TOKENS, 99, dtype=np.int64),
        "token_requests": np.full(TOKENS, 99, dtype=np.int32),
        "cu_query": np.full(ROWS + 1, 99, dtype=np.int32),
        "kv_page_indptr": np.full(ROWS + 1, 99, dtype=np.int32),
        "context_lens": np.full(ROWS, 99, dtype=np.int32),
    }
    for name in skip:
        del arrays[name]
    table, required = arrays["table"], arrays["required_pages"]
    optional = {k: v for k, v in arrays.items() if k not in ("table", "required_pages")}
    return cls("layout", page, table, required, **optional), arrays


def oracle(q: list[int], c: list[int], page: int, p: int, pt: int,
           table: np.ndarray) -> dict[str, np.ndarray]:
    pos, slots, owners = [], [], []
    for i, (qi, ci) in enumerate(zip(q, c, strict=True)):
        for x in range(ci - qi, ci):
            pos.append(x)
            slots.append(int(table[i, x // page]) * page + x % page)
            owners.append(i)
    pad = pt - len(pos)
    req = [-(-ci // page) for ci in c] + [0] * (p - len(q))
    cu = np.concatenate(([0], np.cumsum(q, dtype=np.int64), [sum(q)] * (p - len(q))))
    return {
        "positions": np.array(pos + [0] * pad, dtype=np.int64),
        "slot_mapping": np.array(slots + [-1] * pad, dtype=np.int64),
        "token_requests": np.array(owners + [-1] * pad, dtype=np.int32),
        "cu_query": cu.astype(np.int32),
        "kv_page_indptr": np.concatenate(([0], np.cumsum(req))).astype(np.int32),
        "context_lens": np.array(list(c) + [0] * (p - len(c)), dtype=np.int32),
        "required_pages": np.array(req, dtype=np.int32),
    }


@st.composite
def batches(draw: Any) -> tuple[int, list[int], list[int], int, int]:
    page = draw(st.sampled_from([1, 3, 4, 16]))
    n = draw(st.integers(0, ROWS))
    q = draw(st.lists(st.integers(1, 5), min_size=n, max_size=n))
    c = [qi + draw(st.integers(0, WIDTH * page - qi)) for qi in q]
    p = draw(st.integers(n, ROWS))
    pt = draw(st.integers(sum(q), TOKENS))
    return page, q, c, p, pt


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
@settings(max_examples=60, deadline=None)
@given(batch=batches())
def test_outputs_match_the_oracle(cls: Any, batch: tuple[int, list[int], list[int], int, int]
                                  ) -> None:
    page, q, c, p, pt = batch
    layout, arrays = bound(cls, page)
    t = layout.plan(np.array(q, dtype=np.int32), np.array(c, dtype=np.int32), p, pt)
    assert t == sum(q)
    assert (layout.min_query_len, layout.max_query_len) == ((min(q), max(q)) if q else (0, 0))
    # Python ints in both modes: the consumers refuse numpy scalars as counts
    for value in (layout.min_query_len, layout.max_query_len, layout.num_tokens,
                  layout.padded_tokens, layout.num_reqs, layout.padded_reqs):
        assert type(value) is int, type(value)
    want = oracle(q, c, page, p, pt, arrays["table"])
    np.testing.assert_array_equal(layout.required_pages, want["required_pages"])
    assert layout.write() is None
    assert layout.kv_pages == int(want["kv_page_indptr"][-1])
    for name, expected in want.items():
        if name == "required_pages":
            continue
        size = expected.size
        np.testing.assert_array_equal(arrays[name][:size], expected, err_msg=name)
        assert (arrays[name][size:] == 99).all(), f"{name}: the tail past the padding moved"


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_optional_outputs_are_not_written(cls: Any) -> None:
    layout, arrays = bound(cls, 4, positions=True, token_requests=True, cu_query=True)
    layout.plan(np.array([2, 1], np.int32), np.array([5, 9], np.int32), 3, 4)
    layout.write()
    assert set(layout.arrays) == {"table", "required_pages", "slot_mapping",
                                  "kv_page_indptr", "context_lens"}
    want = oracle([2, 1], [5, 9], 4, 3, 4, arrays["table"])
    for name in ("slot_mapping", "kv_page_indptr", "context_lens"):
        np.testing.assert_array_equal(arrays[name][: want[name].size], want[name])


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_the_lengths_are_copied_at_plan(cls: Any) -> None:
    """The table's preparation runs between plan and write: a caller that reuses its
    arrays then must not change what write produces."""
    layout, arrays = bound(cls, 4)
    q, c = np.array([1, 1], np.int32), np.array([5, 9], np.int32)
    layout.plan(q, c, 2, 2)
    q[:], c[:] = 3, 12
    layout.write()
    np.testing.assert_array_equal(arrays["positions"][:2], [4, 8])
    np.testing.assert_array_equal(arrays["context_lens"][:2], [5, 9])


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_read_only_inputs_are_accepted(cls: Any) -> None:
    layout, arrays = bound(cls, 4)
    q, c = np.array([1, 2], np.int32), np.array([5, 9], np.int32)
    q.flags.writeable = c.flags.writeable = False
    assert layout.plan(q, c, 2, 3) == 3
    layout.write()
    np.testing.assert_array_equal(arrays["positions"][:3], [4, 7, 8])


BAD = [
    ("int64 query_lens", lambda: (np.array([1], np.int64), np.array([4], np.int32), 1, 1),
     r"layout: query_lens must be a 1-D C-contiguous aligned native int32 array"),
    ("list context_lens", lambda: (np.array([1], np.int32), [4], 1, 1),
     r"layout: context_lens must be a 1-D .* int32 array .* got list"),
    ("2-D query_lens", lambda: (np.ones((1, 1), np.int32), np.array([4], np.int32), 1, 1),
     r"query_lens must be a 1-D"),
    ("length mismatch", lambda: (np.array([1, 1], np.int32), np.array([4], np.int32), 2, 2),
     r"context_lens has 1 entries but query_lens has 2"),
    ("padding below n", lambda: (np.array([1, 1], np.int32), np.array([4, 4], np.int32), 1, 2),
     r"1 padded requests for 2 requests; .* \[2, 6\]"),
    ("padding past capacity", lambda: (np.array([1], np.int32), np.array([4], np.int32), 7, 1),
     r"7 padded requests .* \[1, 6\]"),
    ("zero query", lambda: (np.array([1, 0], np.int32), np.array([4, 4], np.int32), 2, 2),
     r"request 1 runs 0 query tokens"),
    ("short context", lambda: (np.array([3], np.int32), np.array([2], np.int32), 1, 3),
     r"request 0 has context_len 2, shorter than its 3 query tokens"),
    ("token padding below t", lambda: (np.array([3], np.int32), np.array([4], np.int32), 1, 2),
     r"2 padded tokens for 3 tokens"),
    ("token padding past capacity",
     lambda: (np.array([3], np.int32), np.array([4], np.int32), 1, TOKENS + 1),
     rf"{TOKENS + 1} padded tokens for 3 tokens; .* \[3, {TOKENS}\]"),
    ("row too narrow", lambda: (np.array([1], np.int32),
                                np.array([WIDTH * 4 + 1], np.int32), 1, 1),
     rf"request 0 has context_len {WIDTH * 4 + 1}, which needs {WIDTH + 1} pages of 4 "
     rf"tokens; the table holds {WIDTH} per row"),
]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_a_bad_batch_changes_nothing(cls: Any, case: Any) -> None:
    layout, arrays = bound(cls, 4)
    layout.plan(np.array([1], np.int32), np.array([6], np.int32), 1, 1)  # a planned batch
    before = {k: v.copy() for k, v in arrays.items()}
    q, c, p, pt = case[1]()
    with pytest.raises(RequestLayoutError, match=case[2]):
        layout.plan(q, c, p, pt)
    for name, value in arrays.items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    layout.write()  # the earlier plan still stands
    assert arrays["positions"][0] == 5


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_write_needs_a_plan(cls: Any) -> None:
    layout, _ = bound(cls, 4)
    with pytest.raises(RequestLayoutError, match=r"layout: write\(\) needs a planned batch"):
        layout.write()
    layout.plan(np.array([1], np.int32), np.array([1], np.int32), 1, 1)
    layout.write()
    with pytest.raises(RequestLayoutError, match=r"call plan\(\) first"):
        layout.write()


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
@pytest.mark.parametrize("kwargs, match", [
    ({"page_size": 0}, r"lay: page_size must be an int in \[1, 2\*\*31\), got 0"),
    ({"page_size": 4.0}, r"page_size must be an int"),
    ({"table": np.zeros((2, 2), np.int64)}, r"lay: table must be a writeable C-contiguous "
                                            r"2-D int32 array, got an int64 array"),
    ({"positions": np.zeros(4, np.int32)}, r"positions must be .* int64 array"),
    ({"required_pages": None}, r"table and required_pages go together"),
])
def test_bad_bindings(cls: Any, kwargs: dict[str, Any], match: str) -> None:
    args = {"page_size": 4, "table": np.zeros((2, 2), np.int32),
            "required_pages": np.zeros(2, np.int32)} | kwargs
    with pytest.raises(RequestLayoutError, match=match):
        cls("lay", args.pop("page_size"), args.pop("table"), args.pop("required_pages"),
            **args)


def test_the_compiled_class_replaces_the_interpreted_one() -> None:
    assert RequestLayout is request_layout.RequestLayout
    assert RequestLayout.__module__ == "h2d_core._request_layout_native"


def with_columns(cls: Any) -> tuple[Any, dict[str, np.ndarray]]:
    outs = {
        "ids": np.full(TOKENS, 99, np.int32),
        "temps": np.full(ROWS, 99, np.float32),
        "rows": np.full(ROWS, 99, np.int32),
        "big": np.full(ROWS, 99, np.int64),
        "eager": np.full(ROWS, 99, np.int32),
    }
    columns = [LayoutColumn("ids", outs["ids"], per_token=True),
               LayoutColumn("temps", outs["temps"], pad=1.0, minimum=0.5),
               LayoutColumn("rows", outs["rows"], pad=-1),
               LayoutColumn("big", outs["big"], pad=7),
               LayoutColumn("eager", outs["eager"], pad=None)]
    layout = cls("cols", 4, np.zeros((ROWS, WIDTH), np.int32), np.zeros(ROWS, np.int32),
                 positions=np.zeros(TOKENS, np.int64), columns=columns)
    return layout, outs


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_columns_are_copied_clamped_and_padded(cls: Any) -> None:
    layout, outs = with_columns(cls)
    q, c = np.array([2, 1], np.int32), np.array([5, 3], np.int32)
    values = (np.array([11, 12, 13], np.int32),
              np.array([np.nan, 0.25], np.float32),
              np.array([4, 4], np.int32),
              np.array([2**40, 2**40], np.int64),
              np.array([5, 6], np.int32))
    assert layout.plan(q, c, 4, 6, values) == 3
    assert layout.uniform_mask == 0b01100  # rows and big hold one value; ids is per token
    assert (outs["ids"] == 99).all()  # plan writes nothing
    layout.write()
    np.testing.assert_array_equal(outs["ids"][:7], [11, 12, 13, 0, 0, 0, 99])
    np.testing.assert_array_equal(outs["temps"][:5], [np.nan, 0.5, 1.0, 1.0, 99])
    np.testing.assert_array_equal(outs["rows"][:5], [4, 4, -1, -1, 99])
    np.testing.assert_array_equal(outs["big"][:5], [2**40, 2**40, 7, 7, 99])
    np.testing.assert_array_equal(outs["eager"][:3], [5, 6, 99])  # no padding


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
@pytest.mark.parametrize("k, bad, match", [
    (0, np.array([1, 2], np.int32), r"cols: column 'ids' has 2 values but the batch has 3 "
                                    r"tokens; pass one per token"),
    (1, np.array([1.0, 2.0], np.float64), r"cols: column 'temps' must be a 1-D C-contiguous "
                                          r"aligned native "
                                          r"float32 array, got a float64 array"),
    (2, [4, 4], r"column 'rows' must be .* int32 array, got list"),
    (2, np.ones(3, np.int32), r"cols: column 'rows' has 3 values but the batch has 2 "
                              r"requests; pass one per request"),
    (3, np.zeros((2, 1), np.int64), r"column 'big' must be a 1-D"),
    (3, np.zeros(4, np.int64)[::2], r"column 'big' must be a 1-D C-contiguous"),
])
def test_bad_column_values_change_nothing(cls: Any, k: int, bad: Any, match: str) -> None:
    layout, outs = with_columns(cls)
    good: list[Any] = [np.array([1, 2, 3], np.int32), np.ones(2, np.float32),
                       np.ones(2, np.int32), np.ones(2, np.int64), np.ones(2, np.int32)]
    q, c = np.array([2, 1], np.int32), np.array([5, 3], np.int32)
    layout.plan(q, c, 2, 3, tuple(good))
    good[k] = bad
    before = {name: v.copy() for name, v in outs.items()}
    with pytest.raises(RequestLayoutError, match=match):
        layout.plan(q, c, 2, 3, tuple(good))
    with pytest.raises(RequestLayoutError, match=r"4 column values for 5 bound columns"):
        layout.plan(q, c, 2, 3, tuple(good[:4]))
    for name, value in outs.items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_bad_column_bindings(cls: Any) -> None:
    table, req = np.zeros((2, 2), np.int32), np.zeros(2, np.int32)
    with pytest.raises(RequestLayoutError, match=r"column 'x' needs a unique name and an "
                                                 r"int32, float32 or int64 array, got a uint8"):
        cls("b", 4, table, req, columns=[LayoutColumn("x", np.zeros(2, np.uint8))])
    with pytest.raises(RequestLayoutError, match=r"column 'table' needs a unique name"):
        cls("b", 4, table, req, columns=[LayoutColumn("table", np.zeros(2, np.int32))])
    with pytest.raises(RequestLayoutError, match=r"a minimum applies to float32 columns"):
        cls("b", 4, table, req, columns=[LayoutColumn("x", np.zeros(2, np.int32), minimum=1)])
    layout = cls("b", 4, table, req, columns=[LayoutColumn("x", np.zeros(1, np.int32))])
    assert layout.max_reqs == 1  # a column bounds the capacity like any output


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_the_query_prefix_goes_to_each_array_of_a_tuple(cls: Any) -> None:
    a, b = np.full(5, 99, np.int32), np.full(4, 99, np.int32)
    layout = cls("cu", 4, np.zeros((4, 4), np.int32), np.zeros(4, np.int32), cu_query=(a, b))
    assert layout.max_reqs == 3  # the shorter copy bounds it
    layout.plan(np.array([2, 1], np.int32), np.array([5, 3], np.int32), 3, 3)
    layout.write()
    assert a.tolist() == [0, 2, 3, 3, 99] and b.tolist() == [0, 2, 3, 3]
    with pytest.raises(RequestLayoutError, match=r"cu: cu_query\[1\] must be a writeable"):
        cls("cu", 4, np.zeros((4, 4), np.int32), np.zeros(4, np.int32),
            cu_query=(a, b.astype(np.int64)))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
@pytest.mark.parametrize("bits, uniform", [
    ([0x3F800000] * 3, True),
    ([0, 0x80000000, 0], False),  # 0.0 and -0.0 differ
    ([0x7FC00000, 0x7FC00000, 0x7FC00000], True),  # one NaN
    ([0x7FC00000, 0xFFC00001, 0x7FC00000], False),  # two NaN payloads
])
def test_float_columns_are_uniform_bit_for_bit(cls: Any, bits: list[int], uniform: bool
                                               ) -> None:
    out = np.zeros(3, np.float32)
    layout = cls("u", 4, np.zeros((3, 2), np.int32), np.zeros(3, np.int32),
                 columns=[LayoutColumn("f", out)])
    values = np.array(bits, np.uint32).view(np.float32)
    layout.plan(np.ones(3, np.int32), np.ones(3, np.int32), 3, 3, (values,))
    assert layout.uniform_mask == int(uniform)
    layout.write()
    assert out.tobytes() == values.tobytes()


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_byte_swapped_or_misaligned_inputs_are_refused(cls: Any) -> None:
    layout, _ = bound(cls, 4)
    swapped = np.array([1], dtype=">i4")
    with pytest.raises(RequestLayoutError, match=r"query_lens must be .* native int32"):
        layout.plan(swapped, np.array([4], np.int32), 1, 1)
    raw = np.zeros(5, np.uint8)[1:].view(np.int32)  # 4 bytes at an odd address
    assert not raw.flags.aligned
    with pytest.raises(RequestLayoutError, match=r"context_lens must be .* aligned"):
        layout.plan(np.array([1], np.int32), raw, 1, 1)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_a_column_without_output_is_checked_and_summed(cls: Any) -> None:
    layout = cls("s", 4, np.zeros((3, 2), np.int32), np.zeros(3, np.int32),
                 columns=[LayoutColumn("drafts"), LayoutColumn("ids", per_token=True)])
    assert layout.plan(np.array([1, 2], np.int32), np.array([3, 3], np.int32), 3, 3,
                       (np.array([2, 5], np.int32), np.array([7, 8, 9], np.int32))) == 3
    assert (layout.column_sum(0), layout.column_sum(1)) == (7, 24)
    assert layout.uniform_mask == 0
    layout.write()
    with pytest.raises(RequestLayoutError, match=r"column 'drafts' must be .* int32 array, "
                                                 r"got an int64"):
        layout.plan(np.array([1], np.int32), np.array([3], np.int32), 1, 1,
                    (np.array([2], np.int64), np.array([7], np.int32)))
    with pytest.raises(RequestLayoutError, match=r"takes no minimum"):
        cls("s", 4, np.zeros((3, 2), np.int32), np.zeros(3, np.int32),
            columns=[LayoutColumn("drafts", minimum=0.0)])


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
@pytest.mark.parametrize("q, p, want", [([2, 3], -1, (2, 2, 5, 6)), ([2, 3], 4, (2, 4, 5, 12)),
                                        ([], 3, (0, 3, 0, 3))])
def test_default_padding_is_the_graph_grid(cls: Any, q: list[int], p: int,
                                           want: tuple[int, int, int, int]) -> None:
    layout, _ = bound(cls, 4)
    c = [8] * len(q)
    layout.plan(np.array(q, np.int32), np.array(c, np.int32), p, -1)
    assert (layout.num_reqs, layout.padded_reqs, layout.num_tokens,
            layout.padded_tokens) == want
    layout.write()


def plan_oracle(q: list[int], c: list[int], ratio: int, window: int, tail: bool,
                count: int) -> list[list[int]]:
    rows, t = [], 0
    for i, (qi, ci) in enumerate(zip(q, c, strict=True)):
        for j in range(qi):
            x = ci - qi + j
            if (x >= max(0, ci - window)) if tail else ((x + 1) % ratio == 0):
                rows.append([t, i, x, window - min(j + 1, window)])
            t += 1
    return rows + [[-1] * 4] * (count - len(rows))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
@settings(max_examples=40, deadline=None)
@given(batch=batches())
def test_plans_match_the_oracle(cls: Any, batch: tuple[int, list[int], list[int], int, int]
                                ) -> None:
    page, q, c, p, _ = batch
    specs = [(4, 8, False), (4, 8, True), (128, 128, False), (3, 5, True)]
    outs = [np.full((64, 4), 99, np.int32) for _ in specs]
    layout = cls("plans", page, np.zeros((ROWS, WIDTH), np.int32), np.zeros(ROWS, np.int32),
                 plans=[LayoutPlan(f"p{k}", o, r, w, tail)
                        for k, (o, (r, w, tail)) in enumerate(zip(outs, specs, strict=True))])
    layout.plan(np.array(q, np.int32), np.array(c, np.int32), p, -1)
    layout.write()
    width = max(q, default=1)
    for k, (out, (r, w, tail)) in enumerate(zip(outs, specs, strict=True)):
        count = p * (min(width, w) if tail else -(-width // r))
        want = plan_oracle(q, c, r, w, tail, count)
        assert out[:count].tolist() == want, k
        assert (out[count:] == 99).all(), f"plan {k}: rows past the count moved"
        real = sum(1 for row in want if row[0] >= 0)
        assert layout.plan_rows(k) == (real, count)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_plan_capacity_and_bindings(cls: Any) -> None:
    out = np.full((3, 4), 99, np.int32)
    layout = cls("pc", 4, np.zeros((4, 4), np.int32), np.zeros(4, np.int32),
                 plans=[LayoutPlan("w", out, 4, 8, tail=True)])
    with pytest.raises(RequestLayoutError, match=r"pc: plan 'w' needs 4 rows \(2 requests of "
                                                 r"up to 2 tokens\), more than its 3"):
        layout.plan(np.array([2, 1], np.int32), np.array([5, 3], np.int32), 2, -1)
    assert (out == 99).all()
    with pytest.raises(RequestLayoutError, match=r"plan 'x' needs a unique name and a "
                                                 r"writeable C-contiguous int32 \[rows, 4\]"):
        cls("pc", 4, np.zeros((4, 4), np.int32), np.zeros(4, np.int32),
            plans=[LayoutPlan("x", np.zeros((3, 3), np.int32), 4, 8)])
    with pytest.raises(RequestLayoutError, match=r"ratio and window must be ints >= 1"):
        cls("pc", 4, np.zeros((4, 4), np.int32), np.zeros(4, np.int32),
            plans=[LayoutPlan("x", np.zeros((3, 4), np.int32), 0, 8)])


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_a_layout_without_pages(cls: Any) -> None:
    """Token inputs: query prefixes and columns, no table (any context length)."""
    cu, ids = np.full(4, 99, np.int32), np.full(6, 99, np.int32)
    layout = cls("tok", 16, None, None, cu_query=cu,
                 columns=[LayoutColumn("ids", ids, per_token=True)])
    assert layout.max_reqs == 3
    layout.plan(np.array([2, 1], np.int32), np.array([2**30, 5], np.int32), 3, -1,
                (np.array([7, 8, 9], np.int32),))
    layout.write()
    assert cu.tolist() == [0, 2, 3, 3] and ids.tolist() == [7, 8, 9, 0, 0, 0]
    with pytest.raises(RequestLayoutError, match=r"tok: a layout without a table has no "
                                                 r"pages"):
        layout.required_pages  # noqa: B018
    with pytest.raises(RequestLayoutError, match=r"slot_mapping and kv_page_indptr need "
                                                 r"them"):
        cls("tok", 16, None, None, slot_mapping=np.zeros(4, np.int64))
    with pytest.raises(RequestLayoutError, match=r"table and required_pages go together"):
        cls("tok", 16, np.zeros((2, 2), np.int32), None)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_eager_plans_publish_the_real_rows_or_the_whole_array(cls: Any) -> None:
    comp, write = np.full((6, 4), 99, np.int32), np.full((12, 4), 99, np.int32)
    layout = cls("eager", 16, np.zeros((4, 4), np.int32), np.zeros(4, np.int32),
                 plans=[LayoutPlan("c", comp, 4, 8, graph=False),
                        LayoutPlan("w", write, 4, 8, tail=True, graph=False)])
    q, c = [9, 3], [9, 20]  # 9 + 3 tokens: more than the graph form would allow
    layout.plan(np.array(q, np.int32), np.array(c, np.int32), 2, 12)
    layout.write()
    want_c = plan_oracle(q, c, 4, 8, False, 0)
    want_w = plan_oracle(q, c, 4, 8, True, 12)
    assert layout.plan_rows(0) == (len(want_c), len(want_c))
    assert comp[: len(want_c)].tolist() == want_c and (comp[len(want_c):] == 99).all()
    assert layout.plan_rows(1) == (11, 12)
    assert write.tolist() == want_w
    small = cls("eager", 16, np.zeros((4, 4), np.int32), np.zeros(4, np.int32),
                plans=[LayoutPlan("w", np.zeros((10, 4), np.int32), 4, 8, tail=True,
                                  graph=False)])
    with pytest.raises(RequestLayoutError, match=r"eager: plan 'w' needs 11 rows, more than "
                                                 r"its 10"):
        small.plan(np.array(q, np.int32), np.array(c, np.int32), 2, 12)


def bounded(cls: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """A layout whose columns carry value bounds (the sampling and token columns' kinds)."""
    outs = {"temps": np.full(ROWS, 99, np.float32), "top_p": np.full(ROWS, 99, np.float32),
            "top_k": np.full(ROWS, 99, np.int32), "ids": np.full(TOKENS, 99, np.int32),
            "big": np.full(ROWS, 99, np.int64)}
    columns = [LayoutColumn("temps", outs["temps"], finite=True),
               LayoutColumn("top_p", outs["top_p"], low=0, low_open=True, high=1),
               LayoutColumn("top_k", outs["top_k"], low=-1),
               LayoutColumn("ids", outs["ids"], per_token=True, low=0, high=2**31 - 1),
               LayoutColumn("big", outs["big"], high=2**40),
               LayoutColumn("drafts", low=0)]
    layout = cls("bnd", 4, np.zeros((ROWS, WIDTH), np.int32), np.zeros(ROWS, np.int32),
                 columns=columns)
    return layout, outs


def bounded_values(**bad: Any) -> tuple[Any, ...]:
    good = {"temps": np.array([0.0, -1.5], np.float32), "top_p": np.array([1.0, 1e-30],
                                                                         np.float32),
            "top_k": np.array([-1, 0], np.int32), "ids": np.array([0, 5, 2**31 - 1], np.int32),
            "big": np.array([2**40, -(2**62)], np.int64), "drafts": np.array([3, 4], np.int32)}
    return tuple((good | bad).values())


BOUND_CASES = [
    ("nan temperature", {"temps": np.array([0.5, np.nan], np.float32)},
     r"^bnd: request 1 has temps=nan; temps must be finite$"),
    ("+inf temperature", {"temps": np.array([np.inf, 1], np.float32)},
     r"^bnd: request 0 has temps=inf; temps must be finite$"),
    ("-inf temperature", {"temps": np.array([1, -np.inf], np.float32)},
     r"^bnd: request 1 has temps=-inf; temps must be finite$"),
    ("top_p zero", {"top_p": np.array([0.0, 1], np.float32)},
     r"^bnd: request 0 has top_p=0.0; top_p must be in \(0, 1\]$"),
    ("top_p -0.0", {"top_p": np.array([1, -0.0], np.float32)},
     r"^bnd: request 1 has top_p=-0.0; top_p must be in \(0, 1\]$"),
    ("top_p above one", {"top_p": np.array([1.0000001, 1], np.float32)},
     r"^bnd: request 0 has top_p=1.0000001; top_p must be in \(0, 1\]$"),
    ("top_p nan (no finite flag)", {"top_p": np.array([np.nan, 1], np.float32)},
     r"^bnd: request 0 has top_p=nan; top_p must be in \(0, 1\]$"),
    ("top_k below -1", {"top_k": np.array([0, -2], np.int32)},
     r"^bnd: request 1 has top_k=-2; top_k must be >= -1$"),
    ("negative token id", {"ids": np.array([0, -1, 3], np.int32)},
     r"^bnd: token 1 has ids=-1; ids must be in \[0, 2147483647\]$"),
    ("int64 past its bound, not wrapped", {"big": np.array([2**41, 0], np.int64)},
     r"^bnd: request 0 has big=2199023255552; big must be <= 1099511627776$"),
    ("negative draft count (no output)", {"drafts": np.array([0, -3], np.int32)},
     r"^bnd: request 1 has drafts=-3; drafts must be >= 0$"),
]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
@pytest.mark.parametrize("case", BOUND_CASES, ids=[c[0] for c in BOUND_CASES])
def test_column_bounds_refuse_values_and_change_nothing(cls: Any, case: Any) -> None:
    """A value outside its column's bounds is refused naming the request (or token), the
    column and the rule; the outputs, the earlier plan and its column sums stand."""
    layout, outs = bounded(cls)
    q, c = np.array([2, 1], np.int32), np.array([5, 3], np.int32)
    assert layout.plan(q, c, 2, 3, bounded_values()) == 3
    assert layout.column_sum(5) == 7
    before = {k: v.copy() for k, v in outs.items()}
    with pytest.raises(RequestLayoutError, match=case[2]):
        layout.plan(q, c, 2, 3, bounded_values(**case[1]))
    for name, value in outs.items():
        assert value.tobytes() == before[name].tobytes(), name
    assert layout.column_sum(5) == 7  # the refused batch's sums never replace the plan's
    layout.write()  # the earlier plan still stands, its values in range
    assert outs["temps"][:2].tolist() == [0.0, -1.5]
    assert outs["top_p"][:2].tobytes() == np.array([1.0, 1e-30], np.float32).tobytes()
    assert outs["big"][:2].tolist() == [2**40, -(2**62)]
    assert outs["ids"][:3].tolist() == [0, 5, 2**31 - 1]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_a_refused_column_keeps_the_earlier_plans_sums(cls: Any) -> None:
    """The summed column passes and is summed, a later column is refused: column_sum
    still reports the planned batch."""
    layout = cls("s", 4, np.zeros((3, 2), np.int32), np.zeros(3, np.int32),
                 columns=[LayoutColumn("drafts"), LayoutColumn("k", low=0)])
    q, c = np.array([1, 1], np.int32), np.array([3, 3], np.int32)
    layout.plan(q, c, 2, 2, (np.array([2, 5], np.int32), np.zeros(2, np.int32)))
    with pytest.raises(RequestLayoutError, match=r"s: request 0 has k=-1; k must be >= 0"):
        layout.plan(q, c, 2, 2, (np.array([50, 50], np.int32), np.array([-1, 0], np.int32)))
    assert layout.column_sum(0) == 7
    layout.plan(q, c, 2, 2, (np.array([50, 50], np.int32), np.zeros(2, np.int32)))
    assert layout.column_sum(0) == 100


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_bounds_keep_what_they_do_not_mention(cls: Any) -> None:
    """Without ``finite`` a float column bounded only above takes -inf (NaN never passes
    a bound); a column without bounds takes anything of its dtype (NaN included)."""
    out, free = np.zeros(2, np.float32), np.zeros(2, np.float32)
    layout = cls("keep", 4, np.zeros((2, 2), np.int32), np.zeros(2, np.int32),
                 columns=[LayoutColumn("hi", out, high=2.0), LayoutColumn("any", free)])
    q = np.ones(2, np.int32)
    layout.plan(q, q, 2, 2, (np.array([-np.inf, 2.0], np.float32),
                             np.array([np.nan, np.inf], np.float32)))
    with pytest.raises(RequestLayoutError, match=r"keep: request 1 has hi=nan; hi must be "
                                                 r"<= 2.0$"):
        layout.plan(q, q, 2, 2, (np.array([0, np.nan], np.float32), np.zeros(2, np.float32)))


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
@pytest.mark.parametrize("column, match", [
    (LayoutColumn("k", np.zeros(2, np.int32), finite=True),
     r"b: column 'k': finite applies to float32 columns only"),
    (LayoutColumn("k", low=0.5), r"column 'k': an integer column takes int bounds in int64, "
                                 r"got 0.5"),
    (LayoutColumn("k", np.zeros(2, np.int64), high=2**63),
     r"column 'k': an integer column takes int bounds in int64"),
    (LayoutColumn("f", np.zeros(2, np.float32), low=float("nan")),
     r"column 'f': bounds must be numbers \(not NaN\) or None, got nan"),
    (LayoutColumn("f", np.zeros(2, np.float32), high=True),
     r"column 'f': bounds must be numbers"),
    (LayoutColumn("f", np.zeros(2, np.float32), low=1, low_open=True, high=1),
     r"column 'f': no value passes low=1, high=1"),
    (LayoutColumn("k", np.zeros(2, np.int32), low=3, high=2),
     r"column 'k': no value passes low=3, high=2"),
])
def test_bad_column_bounds(cls: Any, column: Any, match: str) -> None:
    with pytest.raises(RequestLayoutError, match=match):
        cls("b", 4, np.zeros((2, 2), np.int32), np.zeros(2, np.int32), columns=[column])


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_unsigned_values_are_refused_by_dtype_not_called_negative(cls: Any) -> None:
    """A uint32 array (4294967295 reads as -1 through an int32 view) is refused for its
    dtype, naming the argument or the column; never read as a negative value."""
    layout, _ = with_columns(cls)
    q, c = np.array([2, 1], np.int32), np.array([5, 3], np.int32)
    huge = np.array([2**32 - 1, 1], np.uint32)
    with pytest.raises(RequestLayoutError, match=r"cols: query_lens must be a 1-D .* int32 "
                                                 r"array .*got a uint32 array") as info:
        layout.plan(huge, c, 2, 3, ())
    assert "-1" not in str(info.value) and "negative" not in str(info.value)
    values: list[Any] = [np.array([1, 2, 3], np.int32), np.ones(2, np.float32), huge,
                         np.ones(2, np.int64), np.ones(2, np.int32)]
    with pytest.raises(RequestLayoutError, match=r"cols: column 'rows' must be a 1-D .* "
                                                 r"int32 array, got a uint32 array") as info:
        layout.plan(q, c, 2, 3, tuple(values))
    assert "-1" not in str(info.value) and "negative" not in str(info.value)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__module__)
def test_batches_past_the_capacity_say_so(cls: Any) -> None:
    layout, arrays = bound(cls, 4)
    before = {k: v.copy() for k, v in arrays.items()}
    with pytest.raises(RequestLayoutError, match=rf"layout: {ROWS + 1} requests exceed the "
                                                 rf"bound arrays' capacity of {ROWS} "
                                                 r"requests; split the batch"):
        layout.plan(np.ones(ROWS + 1, np.int32), np.ones(ROWS + 1, np.int32), -1, -1)
    with pytest.raises(RequestLayoutError, match=rf"layout: 42 tokens exceed the bound "
                                                 rf"arrays' capacity of {TOKENS} tokens"):
        layout.plan(np.array([21, 21], np.int32), np.array([21, 21], np.int32), -1, -1)
    for name, value in arrays.items():
        assert value.tobytes() == before[name].tobytes(), name


@given(batches(), st.integers(1, 40))
@settings(max_examples=60, deadline=None)
def test_last_page_lens_and_the_capped_context_prefix_match_the_oracle(
        batch: tuple[int, list[int], list[int], int, int], cap: int) -> None:
    """MLA's per-request members: the tokens in each request's last page and the prefix of
    ``min(context_len, cap)``, padded requests owning none, from the definitions."""
    page, q, c, p, pt = batch
    last, prefix = np.full(ROWS, 99, np.int32), np.full(ROWS + 2, 99, np.int32)
    layout = RequestLayout("mla", page, np.zeros((ROWS, WIDTH), np.int32),
                           np.zeros(ROWS, np.int32), last_page_lens=last,
                           context_prefix=prefix, context_cap=cap)
    layout.plan(np.array(q, np.int32), np.array(c, np.int32), p, pt)
    layout.write()
    want_last = [(ci - 1) % page + 1 for ci in c] + [0] * (p - len(c))
    assert last.tolist() == want_last + [99] * (ROWS - p)
    capped = [min(ci, cap) for ci in c] + [0] * (p - len(c))
    assert prefix.tolist() == ([0, *np.cumsum(capped, dtype=np.int64).tolist()]
                               + [99] * (ROWS + 1 - p))


def test_a_context_prefix_past_int32_is_refused_and_changes_nothing() -> None:
    prefix = np.full(4, 99, np.int32)
    layout = RequestLayout("mla", 1 << 20, np.zeros((3, 4096), np.int32),
                           np.zeros(3, np.int32), context_prefix=prefix)
    ctx = np.array([2**31 - 1, 1], np.int32)
    with pytest.raises(RequestLayoutError, match=r"mla: the batch's context prefix \(the "
                                                 r"sum of context_len over its requests\) "
                                                 r"is 2147483648, more than its int32 array"):
        layout.plan(np.ones(2, np.int32), ctx, 2, -1)
    assert prefix.tolist() == [99] * 4
    layout.plan(np.ones(2, np.int32), np.array([2**31 - 2, 1], np.int32), 2, -1)  # fits
    layout.write()
    assert prefix.tolist()[:3] == [0, 2**31 - 2, 2**31 - 1]
    with pytest.raises(RequestLayoutError, match=r"context_cap must be None or an int"):
        RequestLayout("mla", 16, None, None, context_prefix=prefix, context_cap=0)


def test_mrope_planes_from_their_definition() -> None:
    """MRoPE's three planes at stride ``padded_tokens`` (position + delta, 0 for padding),
    hand-computed; entries past the padded counts keep what they held."""
    planes = np.full(3 * 6, 99, np.int64)
    mrope = RequestLayout("vl", 16, np.zeros((2, 4), np.int32), np.zeros(2, np.int32),
                          columns=[LayoutColumn("deltas")],
                          outputs=[TokenPlanes("planes", planes, "deltas", planes=3)])
    # request 0: 2 tokens at positions 8, 9 (delta -3); request 1: 1 token at 4 (delta 7)
    mrope.plan(np.array([2, 1], np.int32), np.array([10, 5], np.int32), 2, 5,
               (np.array([-3, 7], np.int32),))
    mrope.write()
    plane = [5, 6, 11, 0, 0]
    assert planes.tolist() == plane * 3 + [99] * 3
    for columns, output, rule in [
        ([], TokenPlanes("planes", planes, "deltas", 3), "reads column 'deltas', which must"),
        ([LayoutColumn("deltas", per_token=True, out=np.zeros(6, np.int32))],
         TokenPlanes("planes", planes, "deltas", 3), "reads column 'deltas', which must"),
        ([LayoutColumn("deltas")], TokenPlanes("planes", planes, "deltas", 0),
         "planes must be an int >= 1"),
        ([LayoutColumn("deltas")], TokenPlanes("planes", planes.astype(np.int32), "deltas"),
         "output 'planes' must be a writeable C-contiguous 1-D int64"),
        ([LayoutColumn("deltas")], TokenPlanes("deltas", planes, "deltas"),
         "output 'deltas' needs a unique name"),
    ]:
        with pytest.raises(RequestLayoutError, match=rule):
            RequestLayout("vl", 16, None, None, columns=columns, outputs=[output])
    # a layout's token capacity counts each output's planes: 18 entries, 3 planes, 6 tokens
    assert RequestLayout("vl", 16, None, None, columns=[LayoutColumn("deltas")],
                         outputs=[TokenPlanes("p", planes, "deltas", 3)]).max_tokens == 6


def test_verify_rows_from_their_definition() -> None:
    """A registered VerifyRows: each request's draft target rows back to back, the
    inclusive draft prefix and the bonus row, hand-computed; refusals name the rule."""
    targets, prefix = np.full(6, 99, np.int64), np.full(4, 99, np.int32)
    bonus = np.full(4, 99, np.int64)
    cu = np.zeros(5, np.int32)
    columns = [LayoutColumn("d", low=0)]
    layout = RequestLayout("mtp", 1, None, None, cu_query=cu, columns=columns,
                           outputs=[VerifyRows("d", targets, prefix, bonus)])
    # request 0: 3 tokens (2 drafts, the bonus last), request 1: 1 token (no draft),
    # request 2: 2 tokens (1 draft)
    q = np.array([3, 1, 2], np.int32)
    layout.plan(q, q + 4, 3, -1, (np.array([2, 0, 1], np.int32),))
    layout.write()
    assert cu[:4].tolist() == [0, 3, 4, 6]
    assert targets[:3].tolist() == [0, 1, 4] and targets[3:].tolist() == [99] * 3
    assert prefix[:3].tolist() == [2, 2, 3] and bonus[:3].tolist() == [2, 3, 5]
    with pytest.raises(RequestLayoutError, match=r"mtp: request 0 verifies 3 drafts with 3 query"):
        layout.plan(q, q + 4, 3, -1, (np.array([3, 0, 1], np.int32),))  # d == q
    for outputs in ([VerifyRows("missing", targets, prefix, bonus)],
                    [VerifyRows("d", targets, prefix, bonus)] * 2):
        with pytest.raises(RequestLayoutError, match=r"mtp: VerifyRows needs drafts naming"):
            RequestLayout("mtp", 1, None, None, columns=columns, outputs=outputs)
    with pytest.raises(RequestLayoutError, match=r"VerifyRows draft_targets must be a "
                                                 r"writeable C-contiguous 1-D int64"):
        RequestLayout("mtp", 1, None, None, columns=columns,
                      outputs=[VerifyRows("d", targets.astype(np.int32), prefix, bonus)])
