"""PrefillStepInputs: one producer call and one publication for a prefill chunk.

* Over a sequence of chunks (a cached prefix, appended pages, per-request and uniform
  filters): the step publishes, member for member, the bytes the hand-combined way
  publishes (SamplingInputs, TokenInputs and PrefillInputs produced one call each into one
  combined group), its published KV page prefix and token owners equal, over the chunk's
  entries, what the device derivation (``prepare_prefill_attention`` on the published
  query and key prefixes) gives, everything matches a numpy oracle of the definitions
  (query prefix, positions, KV slots, token owners, key prefix, KV page prefix, KV
  indices), each chunk is one publication (one DMA and one scatter on packed), and the
  direct backend leaves the same destinations.
* The prefill adapter's options through the step (MRoPE planes, last-page lengths,
  ``owns_slot``, an omitted table) against the same adapter produced by hand.
* Rejected chunks: the library's specific error naming the group, the request or column
  and the rule; sources, destinations, counts and counters unchanged; a retry in the same
  epoch publishes. KV-index generation after a chunk that left its table out is refused
  (the GPU table is an earlier chunk's), through the step and the adapter alike.
* Composition: sampling and token inputs shared with the decode step, extra groups, and
  the refusals of adapters the step cannot publish.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import adapter_helpers as ah
import numpy as np
import pytest
import torch
from bad_inputs import Observed, refuse

from block_tables import BlockTable, MissingPagesError, PageIdRangeError
from h2d_core import CountError, DeclarationError, EpochError, H2DRunnerState
from h2d_runner_adapters import (
    DECODE_STEP,
    GDN_STATE,
    GREEDY_TEMPERATURE,
    PREFILL_INPUTS,
    PREFILL_STEP,
    QUERY_PREFIX,
    SAMPLING,
    TOKEN_IDS,
    AdapterInputError,
    BatchColumns,
    DecodeStepInputs,
    GdnStateInputs,
    MhaDecodeInputs,
    PrefillInputs,
    PrefillPlan,
    PrefillStepInputs,
    PrefillStepPlan,
    SamplingInputs,
    ScheduledBatch,
    StepShape,
    TokenInputs,
    prepare_prefill_attention,
)

MAX_REQS = 4
MAX_TOKENS = 32
MAX_PAGES = 8
NUM_PAGES = 64
PAGE = 4
SHAPE = StepShape(max_reqs=MAX_REQS, max_tokens=MAX_TOKENS, max_pages_per_req=MAX_PAGES,
                  page_size=PAGE, num_pages=NUM_PAGES)
PREV = 3  # rows of the previous step's sampled ids (one id each)


# ---------------------------------------------------------------------------------- sides
@dataclass
class Side:
    """One way of producing a prefill chunk: ``step`` (PrefillStepInputs) or ``hand`` (the
    three adapters, one producer call each, published through one combined group; its
    attention preparation also derives the page prefix and token owners on the device,
    into ``derived``, from the published query and key prefixes)."""

    kind: str
    state: H2DRunnerState
    sampling: SamplingInputs
    tokens: TokenInputs
    prefill: PrefillInputs
    step: PrefillStepInputs | None
    #: the device derivation's token owners, page prefix and KV indices (hand sides)
    derived: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def prepare(self, batch: ScheduledBatch, **kw: Any) -> PrefillStepPlan:
        if self.step is not None:
            return self.step.prepare(batch, **kw)
        sp = self.sampling.prepare(batch)
        tp = self.tokens.prepare_ids(batch)
        self.tokens.prepare_query_prefix(batch)
        return PrefillStepPlan(sp, tp, self.prefill.prepare(batch, **kw))

    def attention(self, plan: PrefillStepPlan) -> torch.Tensor:
        if self.step is not None:
            return self.step.prepare_attention(plan)
        pf = self.prefill
        kv = pf.prepare_attention(plan.prefill)
        if self.derived is None:  # whole tensors, poisoned: the derivation writes every
            self.derived = (torch.full_like(pf.token_request.gpu, -7),  # token entry
                            torch.full_like(pf.kv_indptr.gpu, -7), torch.full_like(kv, -7))
        owners, indptr, indices = self.derived
        prepare_prefill_attention(self.tokens.cu_seqlens_q.gpu, pf.cu_seqlens_k.gpu,
                                  pf.block_tables.gpu, PAGE, plan.prefill.num_reqs, owners,
                                  indptr, indices)
        return kv

    def owners(self) -> torch.Tensor:
        return self.prefill.token_request.gpu

    def indptr(self) -> torch.Tensor:
        return self.prefill.kv_indptr.gpu


def _scatter(device: str) -> str:
    # CPU: the reference scatter (the h2d-kernels suites cover the interpreted Triton one,
    # which the equivalence test below runs too), unless a test asks for the kernel
    return "reference" if device == "cpu" else "auto"


def build(kind: str, device: str, *, backend: str = "packed", scatter: str | None = None,
          **options: Any) -> Side:
    """``kind`` "step" or "hand". ``options``: PrefillInputs' ``mrope`` and
    ``last_page_lens``."""
    st = H2DRunnerState(device, backend=backend, scatter=scatter or _scatter(device))
    caps: dict[str, Any] = {"max_reqs": MAX_REQS, "max_tokens": MAX_TOKENS}
    shape = replace(SHAPE, max_ranges=8)
    step: PrefillStepInputs | None = None
    if kind == "step":
        step = PrefillStepInputs(st, shape, **options)
        sampling, tokens, prefill = step.sampling, step.tokens, step.prefill
    else:
        sampling = SamplingInputs(st, MAX_REQS)
        tokens = TokenInputs(st, **caps)
        prefill = PrefillInputs(st, shape, **options)
        st.combine(PREFILL_STEP, [SAMPLING, *tokens.producer_groups, PREFILL_INPUTS])
    st.bind()
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(ah.POISON)
    return Side(kind, st, sampling, tokens, prefill, step)


# -------------------------------------------------------------------------------- chunks
def columns(q: list[int], ctx: list[int], *, seed: int = 0, **arrays: Any) -> BatchColumns:
    n = len(q)
    rng = np.random.default_rng(seed)
    cols = BatchColumns(
        query_lens=np.asarray(q, np.int32), context_lens=np.asarray(ctx, np.int32),
        temperatures=rng.choice(np.array([0.0, 0.7, 1.3], np.float32), n),
        top_k=np.full(n, -1, np.int32), top_p=np.ones(n, np.float32),
        prev_sample_rows=np.full(n, -1, np.int32),
        token_ids=rng.integers(1, 30_000, sum(q)).astype(np.int32),
        num_drafts=np.zeros(n, np.int32))
    for name, value in arrays.items():  # swapped after BatchColumns' structural check
        object.__setattr__(cols, name, value)
    return cols


def chunk(q: list[int], ctx: list[int], rows: list[Any], *, prefill: bool = True,
          **arrays: Any) -> ScheduledBatch:
    return ScheduledBatch((), prefill, PAGE, given_columns=columns(q, ctx, **arrays),
                          given_block_tables=list(rows))


def chunks() -> list[tuple[ScheduledBatch, list[list[int]]]]:
    """Three chunks over growing append lineages, each with the page IDs its rows held:
    a cached prefix (request 1 runs 5 new tokens after 7), per-request top-k and a
    deferred source; then pages appended, a new request, uniform filters (CPU scalars);
    then one request whose context spans many pages."""
    a, b, c = BlockTable([10, 11]), BlockTable([20, 21, 22]), BlockTable([30])
    out = []
    first = chunk([7, 5, 3], [7, 12, 3], [a, b, c], top_k=np.array([3, -1, 7], np.int32),
                  prev_sample_rows=np.array([-1, 2, -1], np.int32))
    out.append((first, [a.tolist(), b.tolist(), c.tolist()]))
    a = a.lineage_copy()
    a.append([12, 13])  # 7 + 6 tokens: pages 3 and 4
    c = c.lineage_copy()
    c.append_one(31)
    d = BlockTable([40, 41, 42])
    second = chunk([6, 2, 9], [13, 5, 9], [a, c, d], top_k=np.full(3, 5, np.int32),
                   top_p=np.full(3, 0.9, np.float32))
    out.append((second, [a.tolist(), c.tolist(), d.tolist()]))
    e = BlockTable([50, 51, 52, 53, 54, 55, 56, 57])
    third = chunk([8], [31], [e], top_p=np.array([0.8], np.float32))
    out.append((third, [e.tolist()]))
    return out


# -------------------------------------------------------------------------------- oracle
def oracle(batch: ScheduledBatch, row_ids: list[list[int]]) -> dict[str, list[int]]:
    """The chunk's metadata from the definitions: ``cu_seqlens_q`` the exclusive prefix of
    the query lengths; request ``r``'s tokens are positions ``ctx_r - q_r .. ctx_r - 1``,
    each owned by ``r`` and written to KV slot ``row_r[x // page] * page + x % page``;
    ``cu_seqlens_k`` the prefix of the context lengths; ``kv_indptr`` the prefix of each
    request's pages ``ceil(ctx_r / page)``; ``kv_indices`` those pages of each row, back
    to back."""
    cols = batch.columns
    q = cols.query_lens.tolist()
    ctx = cols.context_lens.tolist()
    pages = [-(-c // PAGE) for c in ctx]
    out: dict[str, list[int]] = {
        "cu_seqlens_q": np.concatenate(([0], np.cumsum(q))).tolist(),
        "cu_seqlens_k": np.concatenate(([0], np.cumsum(ctx))).tolist(),
        "context_lens": ctx,
        "kv_indptr": np.concatenate(([0], np.cumsum(pages))).tolist(),
        "kv_indices": [x for ids, k in zip(row_ids, pages, strict=True) for x in ids[:k]],
        "positions": [], "slot_mapping": [], "token_request": []}
    for r, (qr, cr) in enumerate(zip(q, ctx, strict=True)):
        for x in range(cr - qr, cr):
            out["positions"].append(x)
            out["slot_mapping"].append(row_ids[r][x // PAGE] * PAGE + x % PAGE)
            out["token_request"].append(r)
    return out


def check_oracle(side: Side, batch: ScheduledBatch, row_ids: list[list[int]],
                 kv: torch.Tensor, plan: PrefillStepPlan, prev: torch.Tensor) -> None:
    want = oracle(batch, row_ids)
    cols = batch.columns
    n, t = len(want["context_lens"]), len(want["positions"])
    pf, tok, s = side.prefill, side.tokens, side.sampling
    got = {"cu_seqlens_q": tok.cu_seqlens_q.gpu[: n + 1],
           "cu_seqlens_k": pf.cu_seqlens_k.gpu[: n + 1],
           "context_lens": pf.context_lens.gpu[:n], "kv_indptr": side.indptr()[: n + 1],
           "kv_indices": kv[: plan.prefill.num_pages], "positions": pf.positions.gpu[:t],
           "slot_mapping": pf.slot_mapping.gpu[:t], "token_request": side.owners()[:t]}
    if pf.mrope_positions is not None:  # a text-only chunk: its positions on every plane
        got["positions"] = pf.mrope_planes(plan.prefill)
        want["positions"] = [want["positions"]] * 3
    for name, values in want.items():
        assert got[name].tolist() == values, (side.kind, name)
    assert plan.prefill.num_pages == want["kv_indptr"][-1]
    assert (plan.prefill.num_reqs, plan.prefill.num_tokens) == (n, t)
    # token assembly: deferred requests take their row of the previous step's ids
    ids = cols.token_ids.tolist()
    start = 0
    for qr, src in zip(cols.query_lens.tolist(), cols.prev_sample_rows.tolist(), strict=True):
        if src >= 0:
            ids[start] = int(prev[src, 0])
        start += qr
    assert tok.input_ids.gpu[:t].tolist() == ids
    temps = np.maximum(cols.temperatures, np.float32(GREEDY_TEMPERATURE))
    assert s.temperatures.gpu[:n].cpu().numpy().tobytes() == temps.tobytes()


# ----------------------------------------------------------------------- 1. equivalence
def test_step_publishes_the_hand_combined_bytes_in_one_publication(device: str) -> None:
    ah.need_kernels(device)
    sides = {
        "hand": build("hand", device),                        # today's way: the reference
        # packed with the Triton scatter itself (interpreted on CPU), and direct
        "step": build("step", device, scatter=ah.scatter_for(device)),
        "direct": build("step", device, backend="direct"),
    }
    prev = torch.arange(100, 100 + PREV, dtype=torch.int32, device=device).view(PREV, 1)
    filters, stages = [], []
    for index, (batch, row_ids) in enumerate(chunks()):
        plans: dict[str, PrefillStepPlan] = {}
        counts: dict[str, dict[str, int | None]] = {}
        for name, side in sides.items():
            st = side.state
            st.begin()
            plans[name] = side.prepare(batch)
            counts[name] = {k: st.count(b) for k, b in st.buffers().items()}
            st.publish(PREFILL_STEP)
            side.tokens.assemble(plans[name].tokens, prev)
            kv = side.attention(plans[name])
            st.finish()
            ah.sync(device)
            check_oracle(side, batch, row_ids, kv, plans[name], prev)
        hand, step = sides["hand"], sides["step"]
        assert plans["hand"] == plans["step"], index
        # member for member, today's counts and destination bytes (tails included)
        bufs = {k: b.gpu.cpu().view(-1).view(torch.uint8) for k, b in
                step.state.buffers().items()}
        for name, b in hand.state.buffers().items():
            assert counts["step"][name] == counts["hand"][name], (index, name)
            assert torch.equal(b.gpu.cpu().view(-1).view(torch.uint8), bufs[name]), (index,
                                                                                    name)
        # the KV page prefix and token owners, published (the chunk's entries: counted
        # exactly), equal what the device derivation gives from the published query and
        # key prefixes, and give the same KV indices; past the chunk's tokens the
        # derivation writes -1 where the members are undefined (not published)
        n, t = plans["step"].prefill.num_reqs, plans["step"].prefill.num_tokens
        assert (counts["step"]["prefill_kv_indptr"], counts["step"]["prefill_token_request"]
                ) == (n + 1, t)
        assert set(bufs) == set(hand.state.buffers()) >= {"prefill_kv_indptr",
                                                          "prefill_token_request"}
        assert hand.derived is not None
        owners, indptr, indices = (x.cpu() for x in hand.derived)
        assert torch.equal(step.indptr()[: n + 1].cpu(), indptr[: n + 1])
        assert torch.equal(step.owners()[:t].cpu(), owners[:t])
        assert set(owners[t:].tolist()) <= {-1}
        pages = plans["step"].prefill.num_pages
        assert torch.equal(step.prefill.kv_indices[:pages].cpu(), indices[:pages])
        assert torch.equal(step.prefill.kv_indices.cpu(), hand.prefill.kv_indices.cpu())
        # the direct backend: every buffer holds the step's bytes (changed table spans
        # travel only inside a packed DMA: direct copies the staged rows whole)
        table = step.prefill.block_tables.name
        assert counts["direct"] | {table: counts["step"][table]} == counts["step"], index
        for name, b in sides["direct"].state.buffers().items():
            assert torch.equal(b.gpu.cpu().view(-1).view(torch.uint8), bufs[name]), (index,
                                                                                    name)
        # one publication a chunk: one DMA and one scatter packed, copies direct
        c = step.state.counters(PREFILL_STEP)
        assert (c.publications, c.dmas, c.scatters, c.direct_copies) == (
            index + 1, index + 1, index + 1, 0), index
        d = sides["direct"].state.counters(PREFILL_STEP)
        assert (d.publications, d.dmas, d.scatters) == (index + 1, 0, 0), index
        sp = plans["step"].sampling
        filters.append((sp.per_request_top_k, sp.top_k, sp.per_request_top_p, sp.top_p))
        stages.append((plans["step"].prefill.table_stage, plans["direct"].prefill.table_stage))
    # per-request top-k first; then uniform filters as CPU scalars (one request: uniform)
    assert filters == [(True, None, False, None), (False, 5, False, pytest.approx(0.9)),
                       (False, None, False, pytest.approx(0.8))]
    assert stages[0] == ("whole", "whole") and stages[1][0] == "partial", stages


# ---------------------------------------------------------- 2. the prefill adapter's options
def _planes(ctx: int) -> np.ndarray:
    """An image prompt's MRoPE positions: three planes that differ (t, h, w)."""
    base = np.arange(ctx, dtype=np.int64)
    return np.stack([base, base // 2, base % 3 + 100])


OPTIONS: dict[str, tuple[dict[str, Any], Callable[[], dict[str, Any]]]] = {
    "mrope": ({"mrope": True},
              lambda: {"mrope_positions": [None, _planes(12), None],
                       "mrope_deltas": np.array([0, -4, 0], np.int32)}),
    "last_page_lens": ({"last_page_lens": True}, dict),
    "owns_slot_without_tables": ({}, lambda: {"owns_slot": lambda s: s % 2 == 0,
                                              "publish_tables": False}),
}


@pytest.mark.parametrize("option", list(OPTIONS))
def test_step_takes_the_prefill_adapters_options(device: str, option: str) -> None:
    """MRoPE planes, last-page lengths, ``owns_slot`` and an omitted table through the step:
    the bytes and counts of the same adapter produced by hand, in one publication."""
    declared, given = OPTIONS[option]
    sides = [build("step", device, **declared), build("hand", device, **declared)]
    batch, row_ids = chunks()[0]
    plans, counts = [], []
    for side in sides:
        st = side.state
        st.begin()
        plans.append(side.prepare(batch, **given()))
        counts.append({k: st.count(b) for k, b in st.buffers().items()})
        st.publish(PREFILL_STEP)
        st.finish()
        ah.sync(device)
        c = st.counters(PREFILL_STEP)
        assert (c.publications, c.dmas, c.scatters) == (1, 1, 1)
    counted_step, counted_hand = counts
    assert plans[0] == plans[1]
    assert counted_step == counted_hand
    a, b = (s.state for s in sides)
    assert {k: a.count(x) for k, x in a.buffers().items()} == counted_step
    for name, x in a.buffers().items():
        assert torch.equal(x.gpu.cpu(), b.buffers()[name].gpu.cpu()), name
    pf = sides[0].prefill
    want = oracle(batch, row_ids)
    t = len(want["positions"])
    if option == "mrope":
        assert pf.mrope_positions is not None and counted_step["prefill_positions"] is None
        planes = pf.mrope_planes(plans[0].prefill).tolist()
        pos = want["positions"]  # request 1's chunk: prompt columns 7..11
        assert planes == [pos[:7] + list(range(7, 12)) + pos[12:],
                          pos[:7] + [x // 2 for x in range(7, 12)] + pos[12:],
                          pos[:7] + [x % 3 + 100 for x in range(7, 12)] + pos[12:]]
    elif option == "last_page_lens":
        assert pf.kv_last_page_lens is not None
        assert pf.kv_last_page_lens.gpu[:3].tolist() == [(c - 1) % PAGE + 1
                                                         for c in want["context_lens"]]
    else:  # odd slots belong to another rank; the table stays off this publication
        assert pf.slot_mapping.gpu[:t].tolist() == [x if x % 2 == 0 else -1
                                                    for x in want["slot_mapping"]]
        assert counted_step["prefill_block_tables"] is None
        assert set(pf.block_tables.gpu.view(-1).view(torch.uint8).tolist()) == {ah.POISON}
        assert sides[0].indptr()[:4].tolist() == want["kv_indptr"]


# -------------------------------------------------------------------- 3. rejected chunks
ROWS = [[10, 11], [20, 21, 22], [30]]


def _bad(rows: list[Any] | None = None, q: list[int] = [7, 5, 3],  # noqa: B006
         ctx: list[int] = [7, 12, 3], **arrays: Any) -> ScheduledBatch:  # noqa: B006
    return chunk(q, ctx, [BlockTable(r) for r in ROWS] if rows is None else rows, **arrays)


Case = tuple[Callable[[], dict[str, Any]], type[Exception], str]
#: each refusal: the call's arguments, the error and what its message names (the group,
#: the request or token, the column or argument, the rule)
BAD: dict[str, Case] = {
    "temperature_nan": (
        lambda: {"batch": _bad(temperatures=np.array([1, np.nan, 1], np.float32))},
        AdapterInputError, r"prefill_step: request 1 has temperatures=nan; temperatures "
                           r"must be finite"),
    "top_p_zero": (
        lambda: {"batch": _bad(top_p=np.array([1, 0, 1], np.float32))},
        AdapterInputError, r"prefill_step: request 1 has top_p=0\.0; top_p must be in "
                           r"\(0, 1\]"),
    "top_k_below_minus_one": (
        lambda: {"batch": _bad(top_k=np.array([-1, -1, -3], np.int32))},
        AdapterInputError, r"prefill_step: request 2 has top_k=-3; top_k must be >= -1"),
    "prev_sample_row_below_minus_one": (
        lambda: {"batch": _bad(prev_sample_rows=np.array([-1, -2, -1], np.int32))},
        AdapterInputError, r"prefill_step: request 1 has prev_sample_rows=-2"),
    "context_shorter_than_query": (
        lambda: {"batch": _bad(ctx=[7, 4, 3])},
        AdapterInputError, r"prefill_step: request 1 has context_len 4, shorter than its 5 "
                           r"query tokens"),
    "zero_query": (
        lambda: {"batch": _bad(q=[7, 0, 3], token_ids=np.zeros(10, np.int32))},
        AdapterInputError, r"prefill_step: request 1 runs 0 query tokens"),
    "token_ids_short": (
        lambda: {"batch": _bad(token_ids=np.zeros(14, np.int32))},
        AdapterInputError, r"prefill_step: column 'token_ids' has 14 values but the batch "
                           r"has 15 tokens"),
    "query_lens_int64": (
        lambda: {"batch": _bad(query_lens=np.array([7, 5, 3], np.int64))},
        AdapterInputError, r"prefill_step: batch\.columns\.query_lens must be a 1-D "
                           r"C-contiguous int32"),
    "tokens_over_max_tokens": (
        lambda: {"batch": _bad(rows=[BlockTable(range(k)) for k in (2, 3, 5)], q=[7, 12, 20],
                               ctx=[7, 12, 20], token_ids=np.zeros(39, np.int32))},
        AdapterInputError, r"prefill_step: 39 tokens exceed the bound arrays' capacity of 32"),
    "requests_over_max_reqs": (
        lambda: {"batch": _bad(rows=[BlockTable([i]) for i in range(5)], q=[1] * 5,
                               ctx=[1] * 5, token_ids=np.zeros(5, np.int32))},
        AdapterInputError, r"prefill_step: 5 requests exceed the bound arrays' capacity of 4"),
    "rows_count": (
        lambda: {"batch": _bad(rows=[BlockTable(r) for r in ROWS[:2]])},
        AdapterInputError, r"prefill_step: batch\.block_tables must hold one row per request "
                           r"\(3\), got 2"),
    "row_missing_pages": (
        lambda: {"batch": _bad(rows=[BlockTable(r) for r in ROWS[:2]] + [BlockTable()])},
        MissingPagesError, r"row 2: the request span needs 1 pages but the row holds 0"),
    "page_outside_the_pool": (
        lambda: {"batch": _bad(rows=[BlockTable(r) for r in ROWS[:2]] + [[500]])},
        PageIdRangeError, r"row 2: page ID 500 .* pool_limit=64"),
    "owns_slot_mask_short": (
        lambda: {"batch": _bad(), "owns_slot": lambda s: np.ones(3, bool)},
        AdapterInputError, r"prefill_step: owns_slot\(slots\) has 3 entries but the batch "
                           r"has 15 tokens"),
    "publish_tables_not_bool": (
        lambda: {"batch": _bad(), "publish_tables": np.array([True])},
        AdapterInputError, r"prefill_step: publish_tables must be a bool"),
    "batch_not_scheduled": (
        lambda: {"batch": columns([7, 5, 3], [7, 12, 3])},
        AdapterInputError, r"prefill_step: batch must be a ScheduledBatch, got BatchColumns"),
    "mrope_positions_without_planes": (
        lambda: {"batch": _bad(), "mrope_positions": [None] * 3},
        CountError, r"prefill_step: mrope_positions given but the adapter has no MRoPE "
                    r"planes"),
    # a prefill chunk verifies nothing: drafts would count draft tokens no step verifies
    "num_drafts_nonzero": (
        lambda: {"batch": _bad(num_drafts=np.array([0, 3, 0], np.int32))},
        AdapterInputError, r"prefill_step: request 1 has num_drafts=3; num_drafts must be "
                           r"in \[0, 0\]"),
    # the planned-chunk check's MRoPE branch (a step declared with mrope=True: DECLARED)
    "mrope_positions_wrong_shape": (
        lambda: {"batch": _bad(), "mrope_positions": [None, _planes(12)[:2], None]},
        AdapterInputError, r"prefill_step: mrope_positions of request 1 must be an integer "
                           r"array of shape \(3, L\) with L >= its context length 12"),
}
#: the cases whose step is declared with PrefillInputs' options (the rest: none)
DECLARED: dict[str, dict[str, Any]] = {"mrope_positions_wrong_shape": {"mrope": True}}


@pytest.mark.parametrize("case", list(BAD))
def test_rejected_chunk_changes_nothing_then_a_retry_publishes(device: str, case: str) -> None:
    ah.need_kernels(device)
    side = build("step", device, **DECLARED.get(case, {}))
    step = side.step
    assert step is not None
    st = side.state
    (first, _), (retry, retry_ids) = chunks()[:2]
    st.begin()
    step.prepare(first)  # an earlier chunk: the table's state holds rows, counters count
    st.publish(PREFILL_STEP)
    st.finish()
    ah.sync(device)
    st.begin()

    def extra() -> tuple[Any, ...]:
        tables = step.prefill.tables
        rec = tables.published
        return (tables.prepared_revision, tables.snapshot.storage.tobytes(),
                None if rec is None else (rec.revision, rec.rows, rec.keys.tobytes()))

    args, error, match = BAD[case]
    refuse(Observed(st, extra=extra, groups=(PREFILL_STEP, SAMPLING, PREFILL_INPUTS)),
           lambda: step.prepare(**args()), error, match)
    plan = step.prepare(retry)  # the same epoch
    st.publish(PREFILL_STEP)
    prev = torch.zeros(PREV, 1, dtype=torch.int32, device=device)
    step.tokens.assemble(plan.tokens, prev)
    kv = step.prepare_attention(plan)
    st.finish()
    ah.sync(device)
    check_oracle(side, retry, retry_ids, kv, plan, prev)
    c = st.counters(PREFILL_STEP)
    assert (c.publications, c.dmas, c.scatters) == (2, 2, 2)


@pytest.mark.parametrize("via", ["step", "adapter"])
def test_kv_indices_after_an_omitted_table_are_refused(device: str, via: str) -> None:
    """A chunk prepared with ``publish_tables=False`` leaves the GPU table an earlier
    chunk's: KV-index generation (the step's, or the prefill adapter's used alone) refuses
    it naming the group and the rule, and changes nothing; the next chunk, with its table,
    prepares."""
    ah.need_kernels(device)
    side = build("step" if via == "step" else "hand", device)
    st, pf = side.state, side.prefill
    group = PREFILL_STEP if via == "step" else PREFILL_INPUTS

    def attention(plan: PrefillStepPlan) -> torch.Tensor:
        if side.step is not None:
            return side.step.prepare_attention(plan)
        return pf.prepare_attention(plan.prefill)

    def run(row: int, **kw: Any) -> PrefillStepPlan:
        st.begin()
        plan = side.prepare(chunk([2], [2], [BlockTable([row])]), **kw)
        st.publish(PREFILL_STEP)
        return plan

    first = run(1)  # the GPU table's row 0 now holds page 1
    assert attention(first)[:1].tolist() == [1]
    st.finish()
    omitted = run(9, publish_tables=False)  # page 9 stays on the host
    assert omitted.prefill.table_stage == ""
    pf.kv_indices.fill_(-5)  # any write of the refused call shows (even a stale [1])
    seen = Observed(st, extra=lambda: pf.kv_indices.cpu().numpy().tobytes(),
                    groups=(PREFILL_STEP,))
    refuse(seen, lambda: attention(omitted), AdapterInputError,
           rf"{group}: prepare_attention reads the published block tables, but this chunk "
           r"was prepared with publish_tables=False.*prepare the chunk with "
           r"publish_tables=True")
    st.finish()
    again = run(9)  # the same rows with their table: page 9
    assert again.prefill.table_stage != ""
    assert attention(again)[:1].tolist() == [9]
    st.finish()
    ah.sync(device)


def test_an_unknown_option_is_refused_before_anything_is_declared() -> None:
    """``PrefillStepInputs`` passes ``PrefillInputs``' options on; any other keyword is
    refused naming it, before any of the three adapters declares a buffer (the state
    stays as it was, and a corrected construction works)."""
    st = H2DRunnerState("cpu", backend="packed", scatter="reference")
    with pytest.raises(DeclarationError, match=r"prefill_step: unknown keyword\(s\) "
                       r"\['mrop'\].*\['last_page_lens', 'mrope'\]"):
        PrefillStepInputs(st, SHAPE, mrop=True)  # type: ignore[call-arg]
    assert dict(st.buffers()) == {}
    step = PrefillStepInputs(st, SHAPE, mrope=True)
    assert step.prefill.mrope_positions is not None


def test_run_chunk_outside_a_producer_entry_is_refused() -> None:
    """``PrefillInputs.run_chunk`` (the body the fused step runs) writes prefill sources:
    called with no entry of ``prefill_inputs`` open this epoch (none made yet, or the
    group published already) it raises ``EpochError`` naming the group and changes
    nothing; inside the fused step's entry it runs, and that chunk publishes."""
    side = build("step", "cpu")
    st, step = side.state, side.step
    assert step is not None
    (first, _), (second, _) = chunks()[:2]
    st.begin()
    pf = side.prefill
    # a step over the adapter's own spec, as a fused step binds one
    layout_step = pf.step_spec().bind(PREFILL_INPUTS, st, pf.request_layouts(PREFILL_INPUTS))
    seen = Observed(st, groups=(PREFILL_STEP, PREFILL_INPUTS))
    match = (r"prefill_inputs: a prefill chunk writes prefill_inputs's sources, but no "
             r"producer entry of that group is open this epoch")
    refuse(seen, lambda: pf.run_chunk(layout_step, second, (), True, None, None, None,
                                      PREFILL_INPUTS), EpochError, match)
    plan = step.prepare(first)  # the fused step's entry runs it
    st.publish(PREFILL_STEP)
    assert plan.prefill.num_tokens == 15
    # published: the entry is closed again
    refuse(seen, lambda: pf.run_chunk(layout_step, second, (), True, None, None, None,
                                      PREFILL_INPUTS), EpochError, match)
    st.finish()


def test_prefill_plan_needs_its_page_count() -> None:
    """``num_pages`` has no default: a plan without it would claim an empty chunk."""
    with pytest.raises(TypeError, match="num_pages"):
        PrefillPlan(1, 2, "whole")  # type: ignore[call-arg]
    assert PrefillPlan(1, 2, "whole", 1).num_pages == 1


# -------------------------------------------------------------------------- 4. composition
def test_shared_adapters_serve_a_decode_and_a_prefill_step(device: str) -> None:
    """Sampling and token inputs shared by the decode step and the prefill step (GDN state
    indices riding in both): a prefill chunk, then a decode step, one publication each."""
    ah.need_kernels(device)
    st = H2DRunnerState(device, scatter=_scatter(device))
    caps: dict[str, Any] = {"max_reqs": MAX_REQS, "max_tokens": MAX_TOKENS}
    gdn = GdnStateInputs(st, max_reqs=MAX_REQS, num_state_slots=8)
    sampling, tokens = SamplingInputs(st, MAX_REQS), TokenInputs(st, **caps)
    decode = DecodeStepInputs.from_adapters(
        sampling, tokens, MhaDecodeInputs(st, SHAPE), extra_groups=[GDN_STATE])
    prefill = PrefillStepInputs.from_adapters(
        sampling, tokens, PrefillInputs(st, SHAPE),
        group="chunk", extra_groups=[GDN_STATE])
    st.bind()
    assert st.plan("chunk").producer_groups == (SAMPLING, TOKEN_IDS, QUERY_PREFIX,
                                                PREFILL_INPUTS, GDN_STATE)
    batch, row_ids = chunks()[0]
    st.begin()
    plan = prefill.prepare(batch)
    gdn.prepare(np.array([0, 1, 2], np.int32))
    st.publish("chunk")
    kv = prefill.prepare_attention(plan)
    st.finish()
    ah.sync(device)
    want = oracle(batch, row_ids)
    assert kv[: plan.prefill.num_pages].tolist() == want["kv_indices"]
    assert prefill.token_request.gpu[:15].tolist() == want["token_request"]
    assert gdn.non_spec.gpu[:3].tolist() == [0, 1, 2]
    dbatch = chunk([1, 1, 1], [8, 13, 4], [BlockTable(r) for r in (
        [10, 11], [20, 21, 22, 23], [30])], prefill=False)
    st.begin()
    dplan = decode.prepare(dbatch)
    gdn.prepare(np.array([0, 1, 2], np.int32))
    st.publish(DECODE_STEP)
    st.finish()
    ah.sync(device)
    assert decode.decode.kv_indptr.gpu[:4].tolist() == [0, 2, 6, 7]
    assert dplan.decode.num_pages == 7
    for group in ("chunk", DECODE_STEP):
        c = st.counters(group)
        assert (c.publications, c.dmas, c.scatters) == (1, 1, 1), group


def test_shared_members_are_counted_in_both_records_by_one_compiled_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampling and token inputs shared by the decode and the prefill step sit in both
    groups' records: a decode step stores each shared member's count in both, through the
    step's compiled count program (the per-member Python count batch is the error path
    only: a steady step that reaches it fails here)."""
    from h2d_core.count_batch import CountBatch

    st = H2DRunnerState("cpu", scatter="reference")
    caps: dict[str, Any] = {"max_reqs": MAX_REQS, "max_tokens": MAX_TOKENS}
    sampling, tokens = SamplingInputs(st, MAX_REQS), TokenInputs(st, **caps)
    decode = DecodeStepInputs.from_adapters(
        sampling, tokens, MhaDecodeInputs(st, SHAPE))
    PrefillStepInputs.from_adapters(sampling, tokens, PrefillInputs(st, SHAPE),
                                    group="chunk")
    st.bind()
    shared = [sampling.temperatures, tokens.input_ids, tokens.cu_seqlens_q]
    assert all(len(b.homes) == 2 for b in shared)

    def slow(*_: object) -> None:
        raise AssertionError("a steady step took the per-member count batch")

    monkeypatch.setattr(CountBatch, "set", slow)
    dbatch = chunk([1, 1, 1], [8, 13, 4], [BlockTable(r) for r in (
        [10, 11], [20, 21, 22, 23], [30])], prefill=False)
    st.begin()
    decode.prepare(dbatch)
    records = st._slot_groups[st.current_slot]
    for b, want in zip(shared, (3, 3, 4), strict=True):
        assert [records[gi].counts[i] for gi, i in b.homes] == [want, want], b.name
    st.publish(DECODE_STEP)
    st.finish()
    assert decode.decode.kv_indptr.gpu[:4].tolist() == [0, 2, 6, 7]


def test_assembly_fused_into_both_steps_that_carry_the_shared_token_inputs(
        device: str) -> None:
    """Token assembly fused on token inputs shared by a decode and a prefill step runs in
    each step's publication, at that arena's header rows: a deferred request's first id
    is the previous step's sampled id after either publication, with no launch by the
    caller (the oracle: ``prev[src, 0]`` at the request's first token)."""
    ah.need_kernels(device)
    st = H2DRunnerState(device, scatter=_scatter(device))
    caps: dict[str, Any] = {"max_reqs": MAX_REQS, "max_tokens": MAX_TOKENS}
    sampling, tokens = SamplingInputs(st, MAX_REQS), TokenInputs(st, **caps)
    prev = torch.arange(100, 100 + MAX_REQS, dtype=torch.int32,
                        device=device).reshape(MAX_REQS, 1)
    consumer = tokens.fuse_assembly(prev)
    decode = DecodeStepInputs.from_adapters(
        sampling, tokens, MhaDecodeInputs(st, SHAPE))
    prefill = PrefillStepInputs.from_adapters(
        sampling, tokens, PrefillInputs(st, SHAPE), group="chunk")
    st.bind()
    assert consumer.fused and sorted(consumer.groups) == ["chunk", DECODE_STEP]
    assert consumer.group is None  # several groups run it
    rows = [BlockTable(r) for r in ([10, 11], [20, 21, 22, 23], [30])]
    steps = [("chunk", prefill, chunk([7, 5, 3], [7, 12, 3], rows,
                                      prev_sample_rows=np.array([-1, 2, -1], np.int32))),
             (DECODE_STEP, decode, chunk([1, 1, 1], [8, 13, 4], rows, prefill=False,
                                         prev_sample_rows=np.array([3, -1, 0], np.int32)))]
    for group, step, batch in steps:
        tokens.input_ids.gpu.fill_(-5)
        st.begin()
        step.prepare(batch)
        st.publish(group)
        st.finish()
        ah.sync(device)
        cols = batch.columns
        ids, start = cols.token_ids.tolist(), 0
        for qr, src in zip(cols.query_lens.tolist(), cols.prev_sample_rows.tolist(),
                           strict=True):
            if src >= 0:
                ids[start] = 100 + src
            start += qr
        assert tokens.input_ids.gpu[: len(ids)].tolist() == ids, group


def test_from_adapters_refuses_adapters_of_another_state() -> None:
    one, other = H2DRunnerState("cpu"), H2DRunnerState("cpu")
    caps: dict[str, Any] = {"max_reqs": MAX_REQS, "max_tokens": MAX_TOKENS}
    sampling, tokens = SamplingInputs(one, MAX_REQS), TokenInputs(one, **caps)
    prefill = PrefillInputs(one, SHAPE)
    with pytest.raises(DeclarationError, match=r"PrefillStepInputs: the sampling, token and "
                                               r"prefill adapters must be declared on the "
                                               r"same H2DRunnerState"):
        PrefillStepInputs.from_adapters(SamplingInputs(other, MAX_REQS), tokens, prefill)
    with pytest.raises(DeclarationError, match=r"must be declared on the same H2DRunnerState"):
        PrefillStepInputs.from_adapters(sampling, TokenInputs(other, **caps), prefill)
    # neither refusal combined anything: the hand-combined group is still free
    one.combine(PREFILL_STEP, [SAMPLING, TOKEN_IDS, QUERY_PREFIX, PREFILL_INPUTS])
    one.bind()
    assert one.plan(PREFILL_STEP).producer_groups == (SAMPLING, TOKEN_IDS, QUERY_PREFIX,
                                                      PREFILL_INPUTS)
