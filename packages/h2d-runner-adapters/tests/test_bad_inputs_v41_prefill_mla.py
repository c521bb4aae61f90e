"""Bad inputs to the V4.1, prefill and MLA adapters: each is refused with the library's
error before any write, and changes nothing (every slot's sources, the destinations, the
open epoch's counts, the table snapshot and its revisions, the published-table record and
the adapters' private caches); then a corrected call in the same epoch publishes, and its
destination bytes match a plain expectation written here.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import adapter_helpers as ah
import numpy as np
import pytest
import torch
from bad_inputs import Observed, refuse
from v4_helpers import (
    DUMMY_BLOCK,
    DUMMY_SLOT,
    MAX_BLOCKS,
    MAX_REQS,
    MAX_TOKENS,
    NUM_BLOCKS,
    V4_POISON,
    Population,
    check_published,
    v41_reference,
)

from block_tables import BlockTable, MissingPagesError, PageIdRangeError, ReservedPageError
from h2d_core import CountError, DeclarationError, H2DRunnerState
from h2d_runner_adapters import (
    V41_METADATA,
    BatchColumns,
    MlaDecodeInputs,
    PrefillInputs,
    RequestSpan,
    ScheduledBatch,
    SpanColumns,
    StepShape,
    V41MetadataInputs,
)
from h2d_runner_adapters.checks import AdapterInputError

Call = Callable[[], object]


def _scatter(device: str) -> str:
    return "reference" if device == "cpu" else "auto"


def _destinations(st: H2DRunnerState) -> dict[str, bytes]:
    return {name: b.gpu.cpu().numpy().tobytes() for name, b in st.buffers().items()}


def _published_record(tables: Any) -> tuple[Any, ...] | None:
    """The table state's published record, comparable with == (its keys as bytes)."""
    rec = tables.published
    return None if rec is None else (rec.slot, rec.revision, rec.rows, rec.keys.tobytes())


# ------------------------------------------------------------------------------ V4.1
def _v41(device: str) -> tuple[H2DRunnerState, V41MetadataInputs]:
    st = H2DRunnerState(device, scatter=_scatter(device))
    v4 = V41MetadataInputs(st, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS,
                           max_blocks_per_req=MAX_BLOCKS, dummy_state_slot=DUMMY_SLOT,
                           dummy_block=DUMMY_BLOCK, num_blocks=NUM_BLOCKS, fp8=True)
    st.bind()
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(V4_POISON)
    return st, v4


def _v41_seen(st: H2DRunnerState, v4: V41MetadataInputs) -> Observed:
    def extra() -> tuple[Any, ...]:
        snap = v4.tables.snapshot
        return (snap.revision, snap.num_rows, snap.storage.tobytes(),
                snap.row_lengths.tobytes(), _published_record(v4.tables))
    return Observed(st, extra=extra, groups=(V41_METADATA,))


def _replace(spans: list[RequestSpan], i: int, **fields: object) -> list[RequestSpan]:
    out = list(spans)
    out[i] = dataclasses.replace(out[i], **fields)  # no checks run in the dataclass
    return out


def _grown(row: BlockTable, page: int) -> BlockTable:
    """The row's lineage one page longer (the proven prefix is not read again)."""
    out = row.lineage_copy()
    out.append_one(page)
    return out


def _cols(spans: list[RequestSpan], **arrays: object) -> SpanColumns:
    return dataclasses.replace(SpanColumns.from_spans(spans), **arrays)


# (case, bad call's (spans, block_tables, padded) from the good ones, error, message)
V41Case = tuple[str, Callable[[list[RequestSpan], list[BlockTable]], tuple[Any, Any, Any]],
                type[Exception], str]
V41_CASES: list[V41Case] = [
    ("float_num_tokens", lambda s, r: (_replace(s, 1, num_tokens=1.5), r, 4),
     AdapterInputError, r"request 1 has RequestSpan\.num_tokens=1\.5 \(float\); it must be an int"),
    ("integral_float_context", lambda s, r: (_replace(s, 2, context_len=float(s[2].context_len)),
                                             r, 4),
     AdapterInputError, r"request 2 has RequestSpan\.context_len=\d+\.0 \(float\)"),
    ("bool_state_slot", lambda s, r: (_replace(s, 0, state_slot=True), r, 4),
     AdapterInputError, r"request 0 has RequestSpan\.state_slot=True \(bool\)"),
    ("numpy_float_fork", lambda s, r: (_replace(s, 1, fork_source=np.float32(3)), r, 4),
     AdapterInputError, r"request 1 has RequestSpan\.fork_source=.*3.*float32"),
    ("context_2_31", lambda s, r: (_replace(s, 1, context_len=2**31), r, 4),
     AdapterInputError,
     r"request 1 has RequestSpan\.context_len=2147483648; it must be in \[1, 2147483647\]"),
    ("fork_beyond_int64", lambda s, r: (_replace(s, 2, fork_source=2**70), r, 4),
     AdapterInputError, rf"request 2 has RequestSpan\.fork_source={2**70}; it must be in"),
    ("fork_below_minus_one", lambda s, r: (_replace(s, 1, fork_source=-2), r, 4),
     AdapterInputError, r"request 1 has RequestSpan\.fork_source=-2; it must be in \[-1, "),
    ("negative_state_slot", lambda s, r: (_replace(s, 2, state_slot=-1), r, 4),
     AdapterInputError, r"request 2 has RequestSpan\.state_slot=-1; it must be in \[0, "),
    ("zero_tokens", lambda s, r: (_replace(s, 1, num_tokens=0), r, 4),
     AdapterInputError, r"request 1 has RequestSpan\.num_tokens=0; it must be in \[1, "),
    ("context_shorter_than_query", lambda s, r: (_replace(s, 0, num_tokens=2, context_len=1),
                                                 r, 4),
     AdapterInputError, r"request 0 has context_len 1, shorter than its 2 query tokens"),
    ("dummy_state_slot", lambda s, r: (_replace(s, 1, state_slot=DUMMY_SLOT), r, 4),
     AdapterInputError, r"request 1 has state_slot_out=99, the adapter's private dummy state "
                        r"slot .*RequestSpan\.state_slot"),
    ("dummy_fork_source", lambda s, r: (_replace(s, 2, fork_source=DUMMY_SLOT), r, 4),
     AdapterInputError, r"request 2 has state_slot_in=99, the adapter's private .*fork_source"),
    ("dummy_block_in_a_new_row",
     lambda s, r: (s, [r[0], r[1], BlockTable([DUMMY_BLOCK, *list(r[2])])], 4),
     ReservedPageError, r"row 2: page ID 199 at column 0 is the table's reserved page"),
    ("dummy_block_appended_to_a_proven_row",
     lambda s, r: (s, [_grown(r[0], DUMMY_BLOCK), r[1], r[2]], 4),
     ReservedPageError, r"row 0: page ID 199 at column \d+ is the table's reserved page"),
    ("dummy_block_pages_appended_to_a_proven_row",
     lambda s, r: (s, [r[0], _grown(_grown(r[1], 3), DUMMY_BLOCK), r[2]], 4),
     ReservedPageError, r"row 1: page ID 199 at column \d+ is the table's reserved page"),
    ("dummy_block_in_a_list_row",
     lambda s, r: (s, [r[0], [*list(r[1]), DUMMY_BLOCK], r[2]], 4),
     ReservedPageError, r"row 1: page ID 199"),
    ("dummy_block_in_reordered_rows",
     lambda s, r: ([s[1], s[0], s[2]], [r[1], r[0], _grown(r[2], DUMMY_BLOCK)], 4),
     ReservedPageError, r"row 2: page ID 199"),
    ("span_not_a_request_span", lambda s, r: ([s[0], (1, 300, 1, -1), s[2]], r, 4),
     AdapterInputError, r"spans\[1\] is tuple, not a RequestSpan"),
    ("spans_not_a_sequence", lambda s, r: (iter(s), r, 4),
     AdapterInputError, r"spans must be a sequence of RequestSpan"),
    ("columns_int64", lambda s, r: (_cols(s, context_lens=np.array(
        [x.context_len for x in s], np.int64)), r, 4),
     AdapterInputError, r"SpanColumns\.context_lens must be a 1-D C-contiguous int32 numpy "
                        r"array .* got an int64 array"),
    ("columns_a_list", lambda s, r: (_cols(s, query_lens=[x.num_tokens for x in s]), r, 4),
     AdapterInputError, r"SpanColumns\.query_lens must be a 1-D C-contiguous int32 numpy "
                        r"array .* got list"),
    ("columns_short", lambda s, r: (_cols(s, state_slots_in=np.array([1, 2], np.int32)), r, 4),
     AdapterInputError, r"SpanColumns\.state_slots_in has 2 entries but the batch has 3 "
                        r"requests"),
    ("columns_strided", lambda s, r: (_cols(s, state_slots_out=np.arange(6, dtype=np.int32)[
        ::2]), r, 4),
     AdapterInputError, r"column 'state_slot_out' must be a 1-D C-contiguous aligned"),
    ("columns_strided_query", lambda s, r: (_cols(s, query_lens=np.ones(6, np.int32)[::2]),
                                            r, 4),
     AdapterInputError, r"query_lens must be a 1-D C-contiguous"),
    ("columns_negative_slot_in", lambda s, r: (_cols(s, state_slots_in=np.array(
        [0, -5, 2], np.int32)), r, 4),
     AdapterInputError, r"request 1 has state_slot_in=-5; state_slot_in must be >= 0"),
    ("columns_dummy_slot_out", lambda s, r: (_cols(s, state_slots_out=np.array(
        [DUMMY_SLOT, 1, 2], np.int32)), r, 4),
     AdapterInputError, r"request 0 has state_slot_out=99, the adapter's private"),
    ("rows_count", lambda s, r: (s, r[:2], 4),
     AdapterInputError, r"2 block_tables rows for 3 spans; pass one row per span"),
    ("rows_iterator", lambda s, r: (s, iter(r), 4),
     AdapterInputError, r"block_tables must be a list of rows .* got list_iterator"),
    ("padded_below", lambda s, r: (s, r, 2),
     AdapterInputError, r"padded=2 must be an int >= the batch's 3 requests"),
    ("padded_float", lambda s, r: (s, r, 4.0),
     AdapterInputError, r"padded=4.0 must be an int >= the batch's 3 requests"),
    ("padded_over_capacity", lambda s, r: (s, r, MAX_REQS + 1),
     AdapterInputError, r"9 padded requests for 3 requests; .* \[3, 8\]"),
    ("too_many_tokens", lambda s, r: (_cols(s, query_lens=np.full(3, MAX_TOKENS, np.int32),
                                            context_lens=np.full(3, MAX_TOKENS, np.int32)),
                                      r, 4),
     AdapterInputError, r"v41_metadata: 120 tokens"),
    ("row_missing_pages", lambda s, r: (_replace(s, 1, context_len=len(r[1]) * 256 + 1), r, 4),
     MissingPagesError, r"row 1: the request span needs"),
    ("page_outside_the_pool", lambda s, r: (s, [r[0], BlockTable([NUM_BLOCKS + 5] * len(r[1])),
                                                r[2]], 4),
     PageIdRangeError, r"row 1: page ID 205"),
]


@pytest.mark.parametrize("case", V41_CASES, ids=[c[0] for c in V41_CASES])
def test_v41_bad_input_is_refused_then_a_retry_publishes(device: str, case: V41Case) -> None:
    _, bad, error, match = case
    st, v4 = _v41(device)
    pop = Population(23)
    spans, rows = pop.step(3, False, 1)  # a first step: the snapshot and proofs hold rows
    st.begin()
    v4.begin_step(spans, block_tables=rows, padded=4)
    st.publish(V41_METADATA)
    st.finish()
    ah.sync(device)
    spans, rows = pop.step(3, True, 2)
    st.begin()
    bad_spans, bad_rows, bad_padded = bad(spans, rows)
    refuse(_v41_seen(st, v4),
           lambda: v4.begin_step(bad_spans, block_tables=bad_rows, padded=bad_padded),
           error, match)
    plan = v4.begin_step(spans, block_tables=rows, padded=4)  # the same epoch
    before = _destinations(st)
    st.publish(V41_METADATA)
    st.finish()
    ah.sync(device)
    assert st.counters(V41_METADATA).publications == 2
    assert (plan.num_reqs, plan.padded_reqs) == (3, 4)
    check_published(st, v41_reference(spans, [list(r) for r in rows], 4), before)


PREFILL_V41_CASES: list[V41Case] = [
    ("float_context", lambda s, r: (_replace(s, 0, context_len=0.5 + s[0].context_len), r,
                                    None),
     AdapterInputError, r"request 0 has RequestSpan\.context_len=.*\(float\)"),
    ("dummy_state_slot", lambda s, r: (_replace(s, 1, state_slot=DUMMY_SLOT), r, None),
     AdapterInputError, r"request 1 has state_slot_out=99, the adapter's private"),
    ("dummy_block", lambda s, r: (s, [r[0], r[1], [DUMMY_BLOCK] * len(r[2])], None),
     ReservedPageError, r"row 2: page ID 199 at column 0 is the table's reserved page"),
    ("columns_int64", lambda s, r: (_cols(s, query_lens=np.array(
        [x.num_tokens for x in s], np.int64)), r, None),
     AdapterInputError, r"SpanColumns\.query_lens must be a 1-D C-contiguous int32"),
    ("rows_count", lambda s, r: (s, r[1:], None),
     AdapterInputError, r"2 block_tables rows for 3 spans"),
]


@pytest.mark.parametrize("case", PREFILL_V41_CASES, ids=[c[0] for c in PREFILL_V41_CASES])
def test_v4_prefill_bad_input_is_refused_then_a_retry_publishes(device: str, case: V41Case
                                                                ) -> None:
    _, bad, error, match = case
    st, v4 = _v41(device)
    rows = [BlockTable([3, 4]), BlockTable([5]), BlockTable([6, 7, 8])]
    spans = [RequestSpan(5, 300, 0), RequestSpan(4, 4, 1), RequestSpan(7, 600, 2, 30)]
    st.begin()
    v4.begin_prefill(spans[:1], block_tables=rows[:1])  # an earlier chunk
    st.publish(V41_METADATA)
    st.finish()
    ah.sync(device)
    st.begin()
    bad_spans, bad_rows, _ = bad(spans, rows)
    refuse(_v41_seen(st, v4), lambda: v4.begin_prefill(bad_spans, block_tables=bad_rows),
           error, match)
    plan = v4.begin_prefill(spans, block_tables=rows)
    st.publish(V41_METADATA)
    st.finish()
    ah.sync(device)
    assert (plan.num_reqs, plan.num_tokens) == (3, 16)
    bufs = st.buffers()
    assert bufs["v41_positions"].gpu[:16].tolist() == [
        *range(295, 300), *range(0, 4), *range(593, 600)]
    assert bufs["v41_token_batch_ids"].gpu[:16].tolist() == [0] * 5 + [1] * 4 + [2] * 7
    assert bufs["v41_seq_lens"].gpu[:3].tolist() == [300, 4, 600]
    assert bufs["v41_chunk_starts"].gpu[:3].tolist() == [295, 0, 593]
    assert bufs["v41_state_slot_out"].gpu[:3].tolist() == [0, 1, 2]
    assert bufs["v41_state_slot_in"].gpu[:3].tolist() == [0, 1, 30]
    table = bufs["v41_block_tables"].gpu[:3].tolist()
    assert [row[: len(r)] for row, r in zip(table, rows, strict=True)] == [[3, 4], [5], [6, 7, 8]]


def test_v41_declaration_refuses_padding_storage_outside_the_pool() -> None:
    for kwargs, match in (({"dummy_block": NUM_BLOCKS}, r"dummy_block must be an int in "
                                                         r"\[0, 199\]"),
                          ({"dummy_block": -1}, r"dummy_block must be an int"),
                          ({"dummy_state_slot": 1.0}, r"dummy_state_slot must be an int"),
                          ({"dummy_state_slot": True}, r"dummy_state_slot must be an int")):
        st = H2DRunnerState("cpu", scatter="reference")
        args = {"dummy_state_slot": DUMMY_SLOT, "dummy_block": DUMMY_BLOCK, **kwargs}
        with pytest.raises(DeclarationError, match=match):
            V41MetadataInputs(st, max_reqs=4, max_tokens=8, max_blocks_per_req=4,
                              num_blocks=NUM_BLOCKS, **args)
        assert st.buffers() == {}  # refused before any buffer was declared


# --------------------------------------------------------------------------- prefill
PAGE = 4
P_TABLES = [[10, 11], [20, 21, 22], [30]]
P_CTX = [7, 12, 3]
P_CHUNK = [7, 5, 3]  # request 1 has a cached prefix of 7 tokens


def _p_columns(q: list[int], c: list[int]) -> BatchColumns:
    n = len(q)
    return BatchColumns(
        query_lens=np.asarray(q, np.int32), context_lens=np.asarray(c, np.int32),
        temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
        top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
        token_ids=np.arange(sum(q), dtype=np.int32), num_drafts=np.zeros(n, np.int32))


def _changed(cols: BatchColumns, **arrays: object) -> BatchColumns:
    """``cols`` with columns swapped after construction: BatchColumns checks its structure
    once, when built, and the producers check what they read again every step (a
    persistent batch's arrays may be replaced; any object with the fields may be given)."""
    out = copy.copy(cols)
    for name, value in arrays.items():
        object.__setattr__(out, name, value)
    return out


def _p_batch(q: list[int] = P_CHUNK, c: list[int] = P_CTX, rows: Any = None,
             **arrays: object) -> ScheduledBatch:
    return ScheduledBatch((), True, PAGE, given_columns=_changed(_p_columns(q, c), **arrays),
                          given_block_tables=[BlockTable(r) for r in P_TABLES]
                          if rows is None else rows)


def _owns_even(slots: np.ndarray) -> np.ndarray:
    return slots % 2 == 0


def _boom(slots: np.ndarray) -> np.ndarray:
    raise ValueError("owns_slot failed")


PrefillCase = tuple[str, Callable[[], dict[str, Any]], type[Exception], str]
PREFILL_CASES: list[PrefillCase] = [
    ("mask_short", lambda: {"owns_slot": lambda s: np.ones(3, bool)},
     AdapterInputError, r"owns_slot\(slots\) has 3 entries but the batch has 15 tokens"),
    ("mask_of_int_zeros_and_ones", lambda: {"owns_slot": lambda s: (s % 2 == 0).astype(np.int64)},
     AdapterInputError, r"owns_slot\(slots\) must be a 1-D bool numpy array .* got an int64 "
                        r"array of shape \(15,\); pass values\.astype\(bool\)"),
    ("mask_uint8", lambda: {"owns_slot": lambda s: (s % 2 == 0).view(np.uint8)},
     AdapterInputError, r"owns_slot\(slots\) must be a 1-D bool numpy array .* uint8"),
    ("mask_2d", lambda: {"owns_slot": lambda s: (s % 2 == 0)[:, None]},
     AdapterInputError, r"owns_slot\(slots\) must be a 1-D bool .* shape \(15, 1\)"),
    ("mask_a_list", lambda: {"owns_slot": lambda s: [True] * s.size},
     AdapterInputError, r"owns_slot\(slots\) must be a 1-D bool numpy array .* got list"),
    ("owns_slot_raises", lambda: {"owns_slot": _boom}, ValueError, r"owns_slot failed"),
    ("owns_slot_not_callable", lambda: {"owns_slot": np.ones(15, bool)},
     AdapterInputError, r"owns_slot must be a function of the KV slots"),
    ("publish_tables_not_bool", lambda: {"publish_tables": np.array([True])},
     AdapterInputError, r"publish_tables must be a bool, got a bool array"),
    ("batch_not_scheduled", lambda: {"batch": _p_columns(P_CHUNK, P_CTX)},
     AdapterInputError, r"batch must be a ScheduledBatch, got BatchColumns"),
    ("query_lens_int64", lambda: {"batch": _p_batch(query_lens=np.array(P_CHUNK, np.int64))},
     AdapterInputError, r"batch\.columns\.query_lens must be a 1-D C-contiguous int32"),
    ("context_lens_short", lambda: {"batch": _p_batch(context_lens=np.array(P_CTX[:2],
                                                                              np.int32))},
     AdapterInputError, r"context_lens has 2 entries but query_lens 3"),
    ("token_ids_short", lambda: {"batch": _p_batch(token_ids=np.zeros(14, np.int32))},
     AdapterInputError, r"token_ids must be a 1-D array of the chunk's 15 query tokens"),
    ("token_ids_long", lambda: {"batch": _p_batch(token_ids=np.zeros(16, np.int32))},
     AdapterInputError, r"token_ids must be a 1-D array of the chunk's 15 query tokens"),
    ("rows_count", lambda: {"batch": _p_batch(rows=[BlockTable(r) for r in P_TABLES[:2]])},
     AdapterInputError, r"batch\.block_tables must hold one row per request \(3\), got 2"),
    ("zero_query", lambda: {"batch": _p_batch(query_lens=np.array([7, 0, 3], np.int32),
                                              token_ids=np.zeros(10, np.int32))},
     AdapterInputError, r"request 1 runs 0 query tokens"),
    ("row_missing_pages_with_owns_slot",
     lambda: {"batch": _p_batch(rows=[BlockTable(r) for r in P_TABLES[:2]] + [BlockTable()]),
              "owns_slot": _owns_even},
     MissingPagesError, r"row 2: the request span needs 1 pages"),
    ("page_outside_the_pool_with_owns_slot",
     lambda: {"batch": _p_batch(rows=[BlockTable(r) for r in P_TABLES[:2]] + [[500]]),
              "owns_slot": _owns_even},
     PageIdRangeError, r"row 2: page ID 500"),
    ("mrope_positions_without_planes", lambda: {"mrope_positions": [None] * 3},
     CountError, r"mrope_positions given but the adapter has no MRoPE planes"),
]


def _prefill(device: str, **kw: Any) -> tuple[H2DRunnerState, PrefillInputs]:
    st = H2DRunnerState(device, scatter=_scatter(device))
    pre = PrefillInputs(st,
                        StepShape(max_reqs=4, max_tokens=32, max_pages_per_req=8, page_size=PAGE,
                                  num_pages=64),
                        **kw)
    st.bind()
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(ah.POISON)
    return st, pre


def _prefill_seen(st: H2DRunnerState, pre: PrefillInputs) -> Observed:
    def extra() -> tuple[Any, ...]:
        snap = pre.tables.snapshot
        return (snap.revision, snap.num_rows, snap.storage.tobytes(),
                _published_record(pre.tables))
    return Observed(st, extra=extra, groups=(pre.group,))


@pytest.mark.parametrize("case", PREFILL_CASES, ids=[c[0] for c in PREFILL_CASES])
def test_prefill_bad_input_is_refused_then_a_retry_publishes(device: str, case: PrefillCase
                                                             ) -> None:
    _, bad, error, match = case
    st, pre = _prefill(device)
    st.begin()
    pre.prepare(_p_batch(q=[3, 7, 3], c=[3, 7, 3]))  # an earlier chunk: the table holds rows
    st.publish(pre.group)
    st.finish()
    ah.sync(device)
    st.begin()
    kwargs: dict[str, Any] = {"batch": _p_batch(), **bad()}
    refuse(_prefill_seen(st, pre), lambda: pre.prepare(**kwargs), error, match)
    plan = pre.prepare(_p_batch(), owns_slot=_owns_even)  # the same epoch
    st.publish(pre.group)
    st.finish()
    ah.sync(device)
    assert (plan.num_reqs, plan.num_tokens) == (3, 15)
    positions, slots = [], []
    for row, c, q in zip(P_TABLES, P_CTX, P_CHUNK, strict=True):
        for x in range(c - q, c):
            slot = row[x // PAGE] * PAGE + x % PAGE
            positions.append(x)
            slots.append(slot if slot % 2 == 0 else -1)
    assert pre.positions.gpu[:15].tolist() == positions
    assert pre.slot_mapping.gpu[:15].tolist() == slots
    assert pre.cu_seqlens_k.gpu[:4].tolist() == [0, 7, 19, 22]
    assert pre.context_lens.gpu[:3].tolist() == P_CTX
    table = pre.block_tables.gpu[:3].tolist()
    assert [row[: len(r)] for row, r in zip(table, P_TABLES, strict=True)] == P_TABLES
    # the untouched tails keep their poison
    assert set(pre.slot_mapping.gpu[15:].view(torch.uint8).tolist()) == {ah.POISON}
    assert set(pre.cu_seqlens_k.gpu[4:].view(torch.uint8).tolist()) == {ah.POISON}


def test_prefill_key_prefix_that_would_wrap_int32_is_refused(device: str) -> None:
    """Three contexts of 2**30 keys sum past int32 (cu_seqlens_k); refused before any write,
    then a batch of 2**29 each publishes."""
    page = 2**20
    st = H2DRunnerState(device, scatter=_scatter(device))
    pre = PrefillInputs(st,
                        StepShape(max_reqs=4, max_tokens=8, max_pages_per_req=1024, page_size=page))
    st.bind()
    rows = [BlockTable(range(k * 1024, (k + 1) * 1024)) for k in range(3)]
    st.begin()
    big = ScheduledBatch((), True, page, given_columns=_p_columns([1, 1, 1], [2**30] * 3),
                         given_block_tables=rows)
    refuse(_prefill_seen(st, pre), lambda: pre.prepare(big), AdapterInputError,
           r"prefill_inputs: the batch's context prefix \(the sum of context_len over its "
           r"requests\) is 3221225472, more than its int32 array holds")
    ok = ScheduledBatch((), True, page, given_columns=_p_columns([1, 1, 1], [2**29] * 3),
                        given_block_tables=rows)
    pre.prepare(ok)
    st.publish(pre.group)
    st.finish()
    ah.sync(device)
    assert pre.cu_seqlens_k.gpu[:4].tolist() == [0, 2**29, 2**30, 3 * 2**29]
    assert pre.positions.gpu[:3].tolist() == [2**29 - 1] * 3
    assert pre.slot_mapping.gpu[:3].tolist() == [
        (k * 1024 + 511) * page + page - 1 for k in range(3)]


# ------------------------------------------------------------------------------- MLA
def _mla(device: str, *, max_pages_per_req: int = 8, page_size: int = PAGE,
         index_topk: int | None = 6) -> tuple[H2DRunnerState, MlaDecodeInputs]:
    st = H2DRunnerState(device, scatter=_scatter(device))
    shape = StepShape(max_reqs=4, max_tokens=4, max_pages_per_req=max_pages_per_req,
                      page_size=page_size)
    mla = MlaDecodeInputs(st, shape, index_topk=index_topk)
    st.bind()
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(ah.POISON)
    return st, mla


def _mla_batch(ctx: list[int], rows: list[Any], page: int = PAGE, **arrays: object
               ) -> ScheduledBatch:
    cols = _changed(_p_columns([1] * len(ctx), ctx), **arrays)
    return ScheduledBatch((), False, page, given_columns=cols, given_block_tables=rows)


def _mla_seen(st: H2DRunnerState, mla: MlaDecodeInputs) -> Observed:
    def extra() -> tuple[Any, ...]:
        snap = mla.tables.snapshot
        return (snap.revision, snap.num_rows, snap.storage.tobytes(),
                _published_record(mla.tables))
    return Observed(st, extra=extra, groups=(mla.group,))


MLA_SHAPE: dict[str, Any] = {"max_reqs": 4, "max_tokens": 4, "max_pages_per_req": 8,
                             "page_size": PAGE}


@pytest.mark.parametrize("shape, kwargs, match", [
    ({}, {"index_topk": 2**31}, r"index_topk must be an int in \[1, 2147483647\] or None, "
                                r"got 2147483648"),
    ({}, {"index_topk": 0}, r"index_topk must be an int in \[1, "),
    ({}, {"index_topk": True}, r"index_topk must be an int .* got True"),
    ({}, {"index_topk": 8.0}, r"index_topk must be an int .* got 8\.0"),
    # the page size is the shape's: refused when the StepShape is made
    ({"page_size": 4.0}, {}, r"page_size must be an int in \[1, 2147483647\], got 4\.0"),
    ({"page_size": 0}, {}, r"page_size must be an int in \[1, "),
    (None, {}, r"mla_decode: shape must be a StepShape, got dict"),
])
def test_mla_declaration_refuses_bad_arguments_before_declaring(
        shape: dict[str, Any] | None, kwargs: dict[str, Any], match: str) -> None:
    st = H2DRunnerState("cpu", scatter="reference")
    with pytest.raises(DeclarationError, match=match):
        MlaDecodeInputs(st, MLA_SHAPE if shape is None  # type: ignore[arg-type]
                        else StepShape(**{**MLA_SHAPE, **shape}), **kwargs)
    assert st.buffers() == {}  # nothing declared: the state binds as if never asked
    MlaDecodeInputs(st, StepShape(**MLA_SHAPE))
    st.bind()


MLA_ROWS = [[1, 2], [3], [4, 5, 6]]
MLA_CTX = [6, 3, 10]

MlaCase = tuple[str, Callable[[], tuple[ScheduledBatch, Any, dict[str, Any]]],
                type[Exception], str]
MLA_CASES: list[MlaCase] = [
    ("padded_below", lambda: (_mla_batch(MLA_CTX, [BlockTable(r) for r in MLA_ROWS]), 2, {}),
     CountError, r"padded=2"),
    ("padded_float", lambda: (_mla_batch(MLA_CTX, [BlockTable(r) for r in MLA_ROWS]), 4.0, {}),
     CountError, r"padded"),
    ("mrope_deltas_without_planes",
     lambda: (_mla_batch(MLA_CTX, [BlockTable(r) for r in MLA_ROWS]), None,
              {"mrope_deltas": np.zeros(3, np.int64)}),
     CountError, r"mrope_deltas given but the adapter has no MRoPE planes"),
    ("row_missing_pages",
     lambda: (_mla_batch([6, 3, 13], [BlockTable(r) for r in MLA_ROWS]), None, {}),
     MissingPagesError, r"row 2"),
    ("query_lens_int64",
     lambda: (_mla_batch(MLA_CTX, [BlockTable(r) for r in MLA_ROWS],
                         query_lens=np.ones(3, np.int64)), None, {}),
     CountError, r"query_lens"),
]


@pytest.mark.parametrize("case", MLA_CASES, ids=[c[0] for c in MLA_CASES])
def test_mla_bad_input_is_refused_then_a_retry_publishes(device: str, case: MlaCase) -> None:
    _, bad, error, match = case
    st, mla = _mla(device)
    rows = [BlockTable(r) for r in MLA_ROWS]
    st.begin()
    mla.prepare(_mla_batch([5, 2, 9], rows), 4)  # an earlier step
    st.publish(mla.group)
    st.finish()
    ah.sync(device)
    st.begin()
    batch, padded, kw = bad()
    refuse(_mla_seen(st, mla), lambda: mla.prepare(batch, padded, **kw), error, match)
    mla.prepare(_mla_batch(MLA_CTX, rows), 4)
    st.publish(mla.group)
    st.finish()
    ah.sync(device)
    _check_mla(mla, MLA_CTX, MLA_ROWS, PAGE, 6, 4)


def _check_mla(mla: MlaDecodeInputs, ctx: list[int], rows: list[list[int]], page: int,
               topk: int, p: int) -> None:
    n = len(ctx)
    assert mla.kv_last_page_lens.gpu[:p].tolist() == [(c - 1) % page + 1 for c in ctx] + [
        0] * (p - n)
    sparse = [0]
    for c in ctx:
        sparse.append(sparse[-1] + min(c, topk))
    assert mla.sparse_kv_indptr is not None
    assert mla.sparse_kv_indptr.gpu[: p + 1].tolist() == sparse + [sparse[-1]] * (p - n)
    assert mla.context_lens.gpu[:p].tolist() == ctx + [0] * (p - n)
    assert mla.slot_mapping.gpu[:n].tolist() == [
        r[(c - 1) // page] * page + (c - 1) % page for r, c in zip(rows, ctx, strict=True)]


def test_mla_sparse_prefix_that_would_wrap_int32_is_refused(device: str) -> None:
    """Three contexts of 2**30 tokens under the widest top-k: the sparse KV prefix would
    pass int32; refused before any write, then contexts of 2**29 publish."""
    page = 2**20
    topk = 2**31 - 1
    st, mla = _mla(device, max_pages_per_req=1024, page_size=page, index_topk=topk)
    rows = [BlockTable(range(k * 1024, (k + 1) * 1024)) for k in range(3)]
    st.begin()
    refuse(_mla_seen(st, mla), lambda: mla.prepare(_mla_batch([2**30] * 3, rows, page)),
           CountError, r"mla_decode: the batch's context prefix \(the sum of context_len "
                       r"over its requests\) is 3221225472, more than its int32 array")
    mla.prepare(_mla_batch([2**29] * 3, rows, page))
    st.publish(mla.group)
    st.finish()
    ah.sync(device)
    _check_mla(mla, [2**29] * 3, [list(r) for r in rows], page, topk, 3)
