"""MLA metadata against the formulas of the MLA module docstring. The fused MLA decode
step (:class:`MlaDecodeStepInputs`): one producer call, one group (one DMA, one scatter),
every member's published bytes (positions, KV slots, context lengths, KV page prefix,
last-page lengths ``(ctx - 1) % page + 1`` and 0 for padded requests, DSA's sparse prefix of
``min(ctx, index_topk)``, the query prefix, the block-table rows), packed and direct; and
prefill's last-page lengths (``PrefillInputs(last_page_lens=True)``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from adapter_helpers import scatter_for, sync

from block_tables import BlockTable
from h2d_core import DeclarationError, H2DRunnerState
from h2d_runner_adapters import (
    MLA_DECODE_STEP,
    BatchColumns,
    DecodeStepInputs,
    MlaDecodeStepInputs,
    PrefillInputs,
    ScheduledBatch,
    StepShape,
    TokenInputs,
)

PAGE, TOPK, MAX_REQS, MAX_PAGES = 4, 6, 4, 8
#: a decode step's capacities: one token per request
SHAPE = StepShape(max_reqs=MAX_REQS, max_tokens=MAX_REQS, max_pages_per_req=MAX_PAGES,
                  page_size=PAGE)


def _batch(ctx: list[int], tables: list[BlockTable]) -> ScheduledBatch:
    n = len(ctx)
    cols = BatchColumns(
        query_lens=np.ones(n, np.int32), context_lens=np.array(ctx, np.int32),
        temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
        top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
        token_ids=np.arange(11, 11 + n, dtype=np.int32), num_drafts=np.zeros(n, np.int32))
    return ScheduledBatch((), False, MAX_REQS, given_columns=cols, given_block_tables=tables)


def _want(ctx: list[int], tables: list[BlockTable], padded: int) -> dict[str, list[int]]:
    """The published values by the formulas (padded requests: no tokens written, no pages,
    last-page length 0; their prefixes repeat the total)."""
    n = len(ctx)
    pages = [-(-c // PAGE) for c in ctx]
    pos = [c - 1 for c in ctx]
    slots = [tables[i].tolist()[pos[i] // PAGE] * PAGE + pos[i] % PAGE for i in range(n)]
    pad = padded - n
    return {
        "positions": pos,
        "slot_mapping": slots,
        "context_lens": ctx + [0] * pad,
        "kv_indptr": np.concatenate([[0], np.cumsum(pages + [0] * pad)]).tolist(),
        "kv_last_page_lens": [(c - 1) % PAGE + 1 for c in ctx] + [0] * pad,
        "sparse_kv_indptr": np.concatenate(
            [[0], np.cumsum([min(c, TOPK) for c in ctx] + [0] * pad)]).tolist(),
        "cu_seqlens_q": list(range(n + 1)) + [n] * pad,
    }


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_fused_mla_step_publishes_the_formulas_in_one_publication(device: str,
                                                                  backend: str) -> None:
    st = H2DRunnerState(device, backend=backend, scatter=scatter_for(device))
    step = MlaDecodeStepInputs(st, SHAPE, index_topk=TOPK)
    st.bind()
    d, t = step.decode, step.tokens
    for buf in (d.positions, d.slot_mapping, d.context_lens, d.kv_indptr,
                d.kv_last_page_lens, d.sparse_kv_indptr, d.block_tables, t.cu_seqlens_q):
        buf.gpu.fill_(-9)  # stale bytes: every published element must be overwritten
    tables = [BlockTable([3, 4]), BlockTable([7, 8]), BlockTable([1, 2, 5])]
    for ctx in ([5, 4, 9], [6, 5, 10], [9, 6, 12]):  # row 0 crosses into a third page
        if ctx[0] == 9:
            tables[0].append_one(6)
        st.begin()
        plan = step.prepare(_batch(ctx, tables), 4)
        st.publish(MLA_DECODE_STEP)
        st.finish()
        sync(device)
        assert (plan.decode.num_reqs, plan.decode.padded_reqs) == (3, 4)
        for name, values in _want(ctx, tables, 4).items():
            buf = t.cu_seqlens_q if name == "cu_seqlens_q" else getattr(d, name)
            got = buf.gpu[: len(values)].cpu().tolist()
            assert got == values, (ctx, name, got, values)
        rows = d.block_tables.gpu[:3].cpu().numpy()
        for i, table in enumerate(tables):
            assert rows[i, : len(table)].tolist() == table.tolist(), (ctx, i)
    c = st.counters(MLA_DECODE_STEP)
    assert c.publications == 3
    if backend == "packed":
        assert (c.dmas, c.scatters, c.direct_copies) == (3, 3, 0)


def test_each_fused_step_takes_its_own_decode_adapter() -> None:
    st = H2DRunnerState("cpu")
    mha = DecodeStepInputs(st, SHAPE)
    with pytest.raises(DeclarationError, match=r"MlaDecodeStepInputs: the decode adapter "
                                               r"publishes 'mha_decode'; the fused step "
                                               r"produces the plain 'mla_decode' group"):
        MlaDecodeStepInputs.from_adapters(mha.sampling, mha.tokens, mha.decode,
                                          group="other_step")
    assert torch.int32 == mha.decode.context_lens.spec.dtype  # the MHA step stays declared


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_prefill_publishes_last_page_lengths_on_request(device: str, backend: str) -> None:
    """``PrefillInputs(last_page_lens=True)``: each request's last-page length after the
    chunk, ``(ctx - 1) % page + 1``, a chunk over a cached prefix included."""
    st = H2DRunnerState(device, backend=backend, scatter=scatter_for(device))
    tokens = TokenInputs(st, max_reqs=MAX_REQS, max_tokens=16)
    pre = PrefillInputs(st, replace(SHAPE, max_tokens=16), last_page_lens=True)
    st.bind()
    pre.kv_last_page_lens.gpu.fill_(-9)
    q, ctx = [3, 5, 1], [3, 8, 6]  # request 2: one new token over 5 cached
    tables = [BlockTable([3]), BlockTable([4, 5]), BlockTable([6, 7])]
    n = len(q)
    cols = BatchColumns(
        query_lens=np.array(q, np.int32), context_lens=np.array(ctx, np.int32),
        temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
        top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
        token_ids=np.arange(1, 1 + sum(q), dtype=np.int32), num_drafts=np.zeros(n, np.int32))
    batch = ScheduledBatch((), True, MAX_REQS, given_columns=cols, given_block_tables=tables)
    st.begin()
    tokens.prepare_ids(batch)
    pre.prepare(batch)
    st.publish(pre.group)
    st.finish()
    sync(device)
    assert pre.kv_last_page_lens.gpu[:n].cpu().tolist() == [(c - 1) % PAGE + 1 for c in ctx]
    assert pre.kv_last_page_lens.gpu[n:].cpu().tolist() == [-9] * (MAX_REQS - n)
