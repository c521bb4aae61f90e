"""Common attention consumers, page maps and PP/TBO buffers: MHA decode (slots, context
lengths, block tables, KV prefix, positions) and prefill mirrors, read by KV-index
generation and attention preparation."""

from __future__ import annotations

from typing import Any

import adapter_helpers as ah
import numpy as np
import pytest
import torch
from publication_checks import check_tails, dest_copies, published_counts

from block_tables import BlockTable
from h2d_core import CountError, H2DRunnerState, StageResult
from h2d_runner_adapters import (
    BatchColumns,
    MhaDecodeInputs,
    MlaDecodeInputs,
    PrefillInputs,
    ScheduledBatch,
    StepShape,
)
from h2d_runner_adapters.consumers import ConsumerArgumentError
from h2d_runner_adapters.consumers.reference import (
    generate_kv_indices_reference,
    prepare_prefill_attention_reference,
)
from h2d_runner_adapters.mrope.positions import (
    select_mrope_positions,
    select_mrope_positions_reference,
)


def _decode_step(r: ah.Runner, reqs: ah.Requests, padded: int | None, q: int = 1):  # type: ignore[no-untyped-def]
    batch = reqs.decode_batch(q=q, deferred=False, padded=padded)
    r.state.begin()
    r.sampling.prepare(batch)
    r.tokens.prepare_ids(batch, padded)
    r.tokens.prepare_query_prefix(batch, padded)
    plan = r.decode.prepare(batch, padded)
    ah.publish_step(r, "decode")
    return batch, plan


def _expected_decode(reqs: ah.Requests, n: int, p: int, q: int) -> dict[str, list[int]]:
    ctx = np.asarray(reqs.ctx)
    pos = (np.repeat(ctx - q, q) + np.tile(np.arange(q), n)).tolist()
    slots = []
    for i in range(n):
        for j in range(q):
            x = ctx[i] - q + j
            slots.append(reqs.tables[i][x // ah.PAGE] * ah.PAGE + x % ah.PAGE)
    pages = -(-ctx // ah.PAGE)
    indptr = np.concatenate(([0], np.cumsum(pages))).tolist()
    return {
        "positions": pos + [0] * ((p - n) * q),
        "slot_mapping": slots + [-1] * ((p - n) * q),
        "context_lens": ctx.tolist() + [0] * (p - n),
        "kv_indptr": indptr + [indptr[-1]] * (p - n),
    }


@pytest.mark.parametrize("layout", ["combined", "groups"])
@pytest.mark.parametrize("q", [1, 3])
def test_decode_members_padding_and_kv_indices(device: str, layout: str, q: int) -> None:
    ah.need_kernels(device)
    r = ah.build_runner(device, layout=layout)
    reqs = ah.Requests(11)
    for c in (5, 9, 13, 30):
        reqs.add(c)
    for step, padded in enumerate([8, None, 6, 8, 16]):
        if step == 3:
            reqs.add(7)
        _batch, plan = _decode_step(r, reqs, padded, q)
        kv = r.decode.generate_kv_indices(plan)
        r.state.finish()
        ah.sync(device)
        n = len(reqs.ctx)
        p = plan.padded_reqs
        exp = _expected_decode(reqs, n, p, q)
        d = r.decode
        assert d.positions.gpu[: p * q].tolist() == exp["positions"], step
        assert d.slot_mapping.gpu[: p * q].tolist() == exp["slot_mapping"], step
        assert d.context_lens.gpu[:p].tolist() == exp["context_lens"], step
        assert d.kv_indptr.gpu[: p + 1].tolist() == exp["kv_indptr"], step
        # padded block-table rows are empty (cleared), real rows are the request tables
        bt = d.block_tables.gpu[:p].cpu().numpy()
        for i in range(n):
            row = reqs.tables[i].tolist()
            assert bt[i, : len(row)].tolist() == row and not bt[i, len(row):].any()
        assert not bt[n:p].any()
        ref = generate_kv_indices_reference(d.block_tables.gpu, d.kv_indptr.gpu,
                                            torch.full_like(kv, -3), p)
        total = exp["kv_indptr"][-1]
        assert kv[:total].tolist() == ref[:total].tolist()
        assert kv[:total].tolist() == [x for t in reqs.tables for x in t.tolist()]
        reqs.grow(q)


def test_block_tables_travel_incrementally(device: str) -> None:
    r = ah.build_runner(device, layout="combined")
    reqs = ah.Requests(12)
    for c in (4, 8, 12, 16, 20, 24, 28, 32):
        reqs.add(c)
    stages = []
    for _ in range(12):
        _, plan = _decode_step(r, reqs, None)
        r.state.finish()
        stages.append(plan.table_stage)
        reqs.grow(1)
    ah.sync(device)
    assert stages[0] == StageResult.WHOLE
    # every PAGE steps each row crosses a page boundary: partial steps and reuse steps
    assert StageResult.PARTIAL in stages[1:]
    assert StageResult.REUSED in stages[1:]
    bt = r.decode.block_tables.gpu[:8].cpu().numpy()
    assert np.array_equal(bt, r.decode.tables.snapshot.storage[:8])


def test_required_pages_are_checked(device: str) -> None:
    r = ah.build_runner(device)
    reqs = ah.Requests(13)
    reqs.add(9)
    reqs.ctx[0] = 40  # the span needs 10 pages, the table holds 3
    batch = reqs.decode_batch(deferred=False)
    r.state.begin()
    revision = r.decode.tables.prepared_revision
    with pytest.raises(Exception, match="row 0"):
        r.decode.prepare(batch)
    assert r.decode.tables.prepared_revision == revision
    assert r.state.count(r.decode.slot_mapping) is None


@pytest.mark.parametrize("layout", ["combined", "groups"])
def test_prefill_attention_preparation(device: str, layout: str) -> None:
    ah.need_kernels(device)
    r = ah.build_runner(device, layout=layout)
    reqs = ah.Requests(14)
    for c in (7, 12, 3):
        reqs.add(c)
    batch = reqs.prefill_batch([7, 5, 3])  # a cached prefix of 7 tokens for request 1
    st = r.state
    st.begin()
    r.sampling.prepare(batch)
    r.tokens.prepare_ids(batch)
    r.tokens.prepare_query_prefix(batch)
    plan = r.prefill.prepare(batch)
    ah.publish_step(r, "prefill")
    r.prefill.prepare_attention(plan)
    st.finish()
    ah.sync(device)
    pf = r.prefill
    assert pf.positions.gpu[:15].tolist() == list(range(7)) + list(range(7, 12)) + [0, 1, 2]
    slots = []
    for i, (c, q) in enumerate(zip(reqs.ctx, (7, 5, 3), strict=True)):
        for x in range(c - q, c):
            slots.append(reqs.tables[i][x // ah.PAGE] * ah.PAGE + x % ah.PAGE)
    assert pf.slot_mapping.gpu[:15].tolist() == slots
    assert pf.cu_seqlens_k.gpu[:4].tolist() == [0, 7, 19, 22]
    tr = torch.full((15,), -9, dtype=torch.int32, device=device)
    indptr = torch.full_like(pf.kv_indptr.gpu, -9)
    kv = torch.full_like(pf.kv_indices, -9)
    tr, indptr, kv = prepare_prefill_attention_reference(
        r.tokens.cu_seqlens_q.gpu, pf.cu_seqlens_k.gpu, pf.block_tables.gpu, ah.PAGE, 3, tr,
        indptr, kv)
    assert pf.token_request.gpu[:15].tolist() == tr.tolist() == [0] * 7 + [1] * 5 + [2] * 3
    assert pf.kv_indptr.gpu[:4].tolist() == indptr[:4].tolist() == [0, 2, 5, 6]
    assert pf.kv_indices[:6].tolist() == [x for t in reqs.tables for x in t.tolist()]


def test_pipeline_slots_keep_their_own_tables(device: str) -> None:
    """Two PP slots share the GPU table; each slot's CPU snapshot is its own."""
    r = ah.build_runner(device, num_slots=2)
    pops = [ah.Requests(15), ah.Requests(16)]
    for i, p in enumerate(pops):
        for c in (3 + i, 9, 17 + 2 * i):
            p.add(c)
    for step in range(8):
        p = pops[step % 2]
        _, _plan = _decode_step(r, p, None)
        r.state.finish()
        ah.sync(device)
        assert r.state.current_slot == step % 2
        snap = r.decode.tables.snapshots[step % 2]
        assert np.array_equal(r.decode.block_tables.gpu[:3].cpu().numpy(), snap.storage[:3])
        p.grow(1)
    assert r.decode.tables.snapshots[0] is not r.decode.tables.snapshots[1]


def test_two_batch_overlap_buffers_and_late_preparation(device: str) -> None:
    """TBO: each ubatch has its own decode buffers and block-table state; the second
    ubatch is prepared late, resuming the same epoch."""
    st = H2DRunnerState(device, scatter=ah.scatter_for(device))
    shape = StepShape(max_reqs=8, max_tokens=8, max_pages_per_req=16, page_size=ah.PAGE)
    ubs = [MhaDecodeInputs(st, shape, prefix=f"ub{i}_") for i in range(2)]
    st.bind()
    reqs = ah.Requests(17)
    for c in (5, 9, 14, 21):
        reqs.add(c)
    for _ in range(4):
        full = reqs.decode_batch(deferred=False)
        halves = [
            type(full)((), False, ah.PAGE, given_columns=type(full.columns)(
                **{k: v[s] for k, v in vars(full.columns).items()}),
                given_block_tables=full.block_tables[s])
            for s in (slice(0, 2), slice(2, 4))
        ]
        st.begin()
        epoch = st.epoch
        plans = [ubs[0].prepare(halves[0])]
        st.publish(ubs[0].group)
        st.finish()
        st.resume()  # late preparation of the second ubatch
        assert st.epoch == epoch
        plans.append(ubs[1].prepare(halves[1]))
        st.publish(ubs[1].group)
        st.finish()
        ah.sync(device)
        for i, ub in enumerate(ubs):
            rows = reqs.tables[2 * i: 2 * i + 2]
            gpu = ub.block_tables.gpu[:2].cpu().numpy()
            for k, t in enumerate(rows):
                assert gpu[k, : len(t)].tolist() == t.tolist()
            assert ub.context_lens.gpu[:2].tolist() == reqs.ctx[2 * i: 2 * i + 2]
        assert ubs[0].tables is not ubs[1].tables
        reqs.grow(1)


def test_uneven_tbo_ubatches_take_the_widest_query_from_cpu_lengths(device: str) -> None:
    """Uneven TBO: each ubatch's requests run different query widths (and the two ubatches
    different maxima); each publishes the graph grid of its own widest query, taken from
    the CPU lengths (``plan.max_query_len``), and KV-index generation reads it exactly."""
    ah.need_kernels(device)
    st = H2DRunnerState(device, scatter=ah.scatter_for(device))
    shape = StepShape(max_reqs=4, max_tokens=16, max_pages_per_req=16, page_size=ah.PAGE)
    ubs = [MhaDecodeInputs(st, shape, prefix=f"ub{i}_") for i in range(2)]
    st.bind()
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(ah.POISON)
    reqs = ah.Requests(23)
    for c in (6, 9, 13, 3, 17):
        reqs.add(c)
    rng = np.random.default_rng(5)
    split = (slice(0, 2), slice(2, 5))
    for step in range(5):
        widths = [int(x) for x in rng.integers(1, 4, 5)]
        widths[step % 5] = 3 if step % 2 else 1  # never all equal
        for i in range(5):
            reqs.ctx[i] += widths[i]
        reqs.grow(0)  # pages for the new tokens
        padded = [None, 4][step % 2]
        st.begin()
        plans = []
        for k, (ub, s) in enumerate(zip(ubs, split, strict=True)):
            if k:
                st.resume()  # late preparation of the second ubatch
            q = np.asarray(widths[s], np.int32)
            n = q.size
            cols = BatchColumns(
                query_lens=q, context_lens=np.asarray(reqs.ctx[s], np.int32),
                temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
                top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
                token_ids=np.zeros(int(q.sum()), np.int32), num_drafts=np.zeros(n, np.int32))
            batch = ScheduledBatch((), False, ah.PAGE, given_columns=cols,
                                   given_block_tables=reqs.tables[s])
            plans.append(ub.prepare(batch, padded))
            st.publish(ub.group)
            ub.generate_kv_indices(plans[-1])
            st.finish()
        ah.sync(device)
        for ub, s, plan in zip(ubs, split, plans, strict=True):
            w, ctx, tables = widths[s], reqs.ctx[s], reqs.tables[s]
            n, q = len(w), max(w)
            p = n if padded is None else padded
            assert (plan.max_query_len, plan.num_tokens) == (q, sum(w)), step
            pt = sum(w) if padded is None else p * q
            assert plan.padded_tokens == pt
            pos = [c - wi + j for c, wi in zip(ctx, w, strict=True) for j in range(wi)]
            slots = [int(tables[i][x // ah.PAGE]) * ah.PAGE + x % ah.PAGE
                     for i, (c, wi) in enumerate(zip(ctx, w, strict=True))
                     for x in range(c - wi, c)]
            pages = [-(-c // ah.PAGE) for c in ctx]
            indptr = np.concatenate(([0], np.cumsum(pages))).tolist()
            pad = pt - len(pos)
            assert ub.positions.gpu[:pt].tolist() == pos + [0] * pad
            assert ub.slot_mapping.gpu[:pt].tolist() == slots + [-1] * pad
            assert ub.kv_indptr.gpu[: p + 1].tolist() == indptr + [indptr[-1]] * (p - n)
            assert ub.context_lens.gpu[:p].tolist() == list(ctx) + [0] * (p - n)
            want = [int(x) for t, c in zip(tables, ctx, strict=True)
                    for x in t[: -(-c // ah.PAGE)]]
            assert ub.kv_indices[: plan.num_pages].tolist() == want


# ------------------------------------------------------------------------------ MRoPE
SECTIONS = (2, 3, 3)  # time, height, width rotary frequencies


def _columns(q: np.ndarray, ctx: list[int]) -> BatchColumns:
    n = q.size
    return BatchColumns(
        query_lens=q, context_lens=np.asarray(ctx, np.int32),
        temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
        top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
        token_ids=np.zeros(int(q.sum()), np.int32), num_drafts=np.zeros(n, np.int32))


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_mrope_decode_planes_use_the_running_width(device: str, backend: str) -> None:
    """MRoPE decode: three planes at the step's running width (graph padding included)
    replace the positions; widths change between steps (wide to narrow and back, eager
    and padded) and the first reader, viewing the planes at the width the step ran,
    always gets this step's positions."""
    ah.need_kernels(device)
    st = H2DRunnerState(device, backend=backend, scatter=ah.scatter_for(device))
    shape = StepShape(max_reqs=6, max_tokens=18, max_pages_per_req=16, page_size=ah.PAGE)
    dec = MhaDecodeInputs(st, shape, mrope=True)
    st.bind()
    assert dec.mrope_positions is not None
    dec.mrope_positions.gpu.fill_(-5)
    reqs = ah.Requests(29)
    for c in (6, 9, 13, 3, 17, 8):
        reqs.add(c)
    rng = np.random.default_rng(8)
    out = torch.full((18 + 2, 10), -9, dtype=torch.int64, device=device)
    schedule = [(6, 3, None), (2, 1, None), (3, 2, 6), (1, 1, 4), (6, 2, None), (2, 3, 3)]
    for n, q, padded in schedule:
        widths = rng.integers(1, q + 1, n).astype(np.int32)
        widths[0] = q
        ctx = [reqs.ctx[i] + int(w) for i, w in enumerate(widths)]
        for i in range(n):
            reqs.ctx[i] = ctx[i]
        reqs.grow(0)
        deltas = rng.integers(-40, 40, n).astype(np.int64)
        batch = ScheduledBatch((), False, ah.PAGE, given_columns=_columns(widths, ctx),
                               given_block_tables=reqs.tables[:n])
        st.begin()
        plan = dec.prepare(batch, padded, mrope_deltas=deltas)
        assert st.count(dec.positions) is None  # the planes replace the positions
        st.publish(dec.group)
        out.fill_(-9)
        got = dec.select_mrope_positions(plan, SECTIONS, out)
        st.finish()
        ah.sync(device)
        pt = plan.padded_tokens
        plane = [c - int(w) + j + int(d) for c, w, d in zip(ctx, widths, deltas, strict=True)
                 for j in range(int(w))]
        plane += [0] * (pt - len(plane))
        planes = dec.mrope_planes(plan)
        assert tuple(planes.shape) == (3, pt) and planes.stride() == (pt, 1)
        assert planes.cpu().tolist() == [plane] * 3
        assert got.cpu().tolist() == select_mrope_positions_reference([plane] * 3, SECTIONS, pt)
        assert out[pt:].cpu().unique().tolist() == [-9]  # rows past the width: untouched
        assert out[:, 8:].cpu().unique().tolist() == [-9]  # columns past sum(sections)


def test_mrope_prefill_planes_and_bad_inputs(device: str) -> None:
    """MRoPE prefill: a request's planes are its prompt positions' chunk columns, or its
    ordinary positions on every plane; bad MRoPE inputs are refused before any write."""
    ah.need_kernels(device)
    st = H2DRunnerState(device, scatter=ah.scatter_for(device))
    shape = StepShape(max_reqs=4, max_tokens=32, max_pages_per_req=16, page_size=ah.PAGE)
    pre = PrefillInputs(st, shape, mrope=True)
    dec = MhaDecodeInputs(st, shape)
    st.bind()
    reqs = ah.Requests(31)
    for c in (10, 7, 12):
        reqs.add(c)
    image = np.stack([np.arange(20) // 4, np.arange(20) % 4, np.arange(20) % 3 + 7])
    chunk = np.asarray([6, 7, 5], np.int32)
    batch = ScheduledBatch((), True, ah.PAGE, given_columns=_columns(chunk, reqs.ctx),
                           given_block_tables=reqs.tables)
    sources = [image.astype(np.int64), None, image[:, :12].astype(np.int32)]
    st.begin()
    snapshot = {k: b.np.tobytes() for k, b in st.buffers().items()}
    for bad, match in (([image], r"one entry per request \(3\)"),
                       ([image, None, image[:, :5]], r"request 2 .* context length 12"),
                       ([image.astype(np.float32), None, None], r"request 0 must be an int")):
        with pytest.raises(CountError, match=match):
            pre.prepare(batch, mrope_positions=bad)
        assert {k: b.np.tobytes() for k, b in st.buffers().items()} == snapshot
    with pytest.raises(CountError, match=r"no MRoPE planes; construct it with mrope=True"):
        dec.prepare(ScheduledBatch((), False, ah.PAGE,
                                   given_columns=_columns(np.ones(3, np.int32), reqs.ctx),
                                   given_block_tables=reqs.tables),
                    mrope_deltas=np.zeros(3, np.int64))
    plan = pre.prepare(batch, mrope_positions=sources)
    st.publish(pre.group)
    st.finish()
    ah.sync(device)
    t = int(chunk.sum())
    want: list[list[int]] = [[], [], []]
    for q, c, src in zip(chunk.tolist(), reqs.ctx, sources, strict=True):
        for a in range(3):
            want[a] += (list(range(c - q, c)) if src is None
                        else [int(x) for x in src[a, c - q : c]])
    assert pre.mrope_planes(plan).cpu().tolist() == want
    assert st.count(pre.positions) is None and plan.num_tokens == t


def test_mrope_reader_refuses_bad_arguments(device: str) -> None:
    ah.need_kernels(device)
    planes = torch.zeros(3, 4, dtype=torch.int64, device=device)
    out = torch.zeros(4, 8, dtype=torch.int64, device=device)
    with pytest.raises(ConsumerArgumentError, match=r"sections must be a tuple of three"):
        select_mrope_positions(planes, (2, 3), out, 4)  # type: ignore[arg-type]
    with pytest.raises(ConsumerArgumentError, match=r"shape \(3, n\) with n >= num_tokens=5"):
        select_mrope_positions(planes, SECTIONS, out, 5)
    with pytest.raises(ConsumerArgumentError, match=r"out has 8 columns, needs "
                                                    r"sum\(sections\)=9"):
        select_mrope_positions(planes, (3, 3, 3), out, 4)
    with pytest.raises(ConsumerArgumentError, match=r"planes must have dtype torch.int64"):
        select_mrope_positions(planes.int(), SECTIONS, out, 4)


# ------------------------------------------------------------------------------ MLA
@pytest.mark.parametrize("page, topk", [(1, None), (8, 12)])
def test_mla_decode_members_and_kv_indices(device: str, page: int, topk: int | None) -> None:
    """MLA decode at its page size: the MHA members plus the last-page lengths (and DSA's
    sparse KV prefix), graph padding included; KV-index generation reads them."""
    ah.need_kernels(device)
    st = H2DRunnerState(device, scatter=ah.scatter_for(device))
    shape = StepShape(max_reqs=6, max_tokens=6, max_pages_per_req=64, page_size=page)
    mla = MlaDecodeInputs(st, shape, index_topk=topk)
    st.bind()
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(ah.POISON)
    rng = np.random.default_rng(page)
    tables: list[BlockTable] = []
    ctx: list[int] = []
    next_page = 0
    for n, padded in ((3, None), (5, 6), (1, 4), (6, None)):
        while len(ctx) < n:
            c = int(rng.integers(1, 40))
            k = -(-c // page)
            tables.append(BlockTable(range(next_page, next_page + k)))
            next_page += k
            ctx.append(c)
        for i in range(n):
            ctx[i] += 1
            if -(-ctx[i] // page) > len(tables[i]):
                tables[i].append_one(next_page)
                next_page += 1
        batch = ScheduledBatch((), False, page, given_columns=_columns(
            np.ones(n, np.int32), ctx[:n]), given_block_tables=tables[:n])
        st.begin()
        plan = mla.prepare(batch, padded)
        st.publish(mla.group)
        mla.generate_kv_indices(plan)
        st.finish()
        ah.sync(device)
        p = n if padded is None else padded
        c = ctx[:n]
        assert mla.group == "mla_decode"
        assert mla.kv_last_page_lens.gpu[:p].tolist() == [(x - 1) % page + 1 for x in c] + [
            0] * (p - n)
        if topk is not None:
            assert mla.sparse_kv_indptr is not None
            want = np.concatenate(([0], np.cumsum(np.minimum(c, topk)))).tolist()
            assert mla.sparse_kv_indptr.gpu[: p + 1].tolist() == want + [want[-1]] * (p - n)
        else:
            assert mla.sparse_kv_indptr is None
        pages = [-(-x // page) for x in c]
        indptr = np.concatenate(([0], np.cumsum(pages))).tolist()
        assert mla.kv_indptr.gpu[: p + 1].tolist() == indptr + [indptr[-1]] * (p - n)
        want_kv = [int(x) for t, k in zip(tables, pages, strict=False) for x in list(t)[:k]]
        assert mla.kv_indices[: len(want_kv)].tolist() == want_kv
        assert mla.slot_mapping.gpu[:n].tolist() == [
            int(list(t)[(x - 1) // page]) * page + (x - 1) % page
            for t, x in zip(tables, c, strict=False)]


# ------------------------------------------------- delayed source reuse, untouched tails
def _want_decode(reqs: ah.Requests, n: int, p: int, q: int) -> dict[str, list[Any]]:
    """A decode step's members (graph padding included), its rows and its KV indices,
    computed now: the requests grow afterwards."""
    want: dict[str, list[Any]] = dict(_expected_decode(reqs, n, p, q))
    want["rows"] = [t.tolist() for t in reqs.tables]
    want["kv_indices"] = [x for t in reqs.tables for x in t.tolist()]
    return want


def _want_prefill(reqs: ah.Requests, chunk: list[int]) -> dict[str, list[Any]]:
    pos, slots, owners = [], [], []
    for i, (c, q) in enumerate(zip(reqs.ctx, chunk, strict=True)):
        for x in range(c - q, c):
            pos.append(x)
            slots.append(reqs.tables[i][x // ah.PAGE] * ah.PAGE + x % ah.PAGE)
            owners.append(i)
    return {"prefill_positions": pos, "prefill_slot_mapping": slots,
            "prefill_cu_seqlens_k": np.concatenate(([0], np.cumsum(reqs.ctx))).tolist(),
            "prefill_context_lens": list(reqs.ctx), "token_request": owners,
            "rows": [t.tolist() for t in reqs.tables],
            "kv_indices": [x for t in reqs.tables for x in t.tolist()]}


@pytest.mark.parametrize("layout", ["combined", "groups"])
def test_delayed_source_reuse_and_untouched_tails(device: str, layout: str) -> None:
    """Two slots, decode (eager and graph-padded, widths 1-3) and prefill steps, batches
    that grow: on CUDA each step's publications queue behind a busy GPU while the host
    runs ahead and rewrites the sources; the destinations (copied on the GPU right after
    the publications) and the first consumers' outputs still hold that step's values. The
    counts are the spec's, and no byte past a member's count (nor of an omitted member)
    moved; ranged tables keep every row past the step's rows."""
    ah.need_kernels(device)
    r = ah.build_runner(device, layout=layout, num_slots=2)
    reqs = ah.Requests(41)
    for c in (5, 9, 2):
        reqs.add(c)
    st = r.state
    taken = []
    for index in range(9):
        prefill = index % 3 == 2
        q = 1 + index % 3
        padded = None if prefill or index % 2 else 6
        if index == 4:
            reqs.add(11)
        n = len(reqs.ctx)
        assert st.begin() == index % 2
        if prefill:
            chunk = [min(c, 1 + i) for i, c in enumerate(reqs.ctx)]
            batch = reqs.prefill_batch(chunk)
        else:
            reqs.grow(q)
            batch = reqs.decode_batch(q=q, deferred=False, padded=padded)
        r.sampling.prepare(batch)
        r.tokens.prepare_ids(batch, padded)
        r.tokens.prepare_query_prefix(batch, padded)
        if prefill:
            plan = r.prefill.prepare(batch)
            p, pt = n, sum(chunk)
            want = _want_prefill(reqs, chunk)
            expected: dict[str, int | None] = {
                "prefill_positions": pt, "prefill_slot_mapping": pt,
                "prefill_cu_seqlens_k": n + 1, "prefill_context_lens": n,
                "prefill_kv_indptr": n + 1, "prefill_token_request": pt,
                "positions": None, "slot_mapping": None, "context_lens": None,
                "kv_indptr": None}
            table = r.prefill.block_tables.name
        else:
            dplan = r.decode.prepare(batch, padded)
            p, pt = dplan.padded_reqs, dplan.padded_tokens
            assert pt == p * q
            want = _want_decode(reqs, n, p, q)
            expected = {"positions": pt, "slot_mapping": pt, "context_lens": p,
                        "kv_indptr": p + 1, "prefill_positions": None,
                        "prefill_slot_mapping": None, "prefill_kv_indptr": None,
                        "prefill_token_request": None}
            table = r.decode.block_tables.name
        expected |= {"input_ids": pt, "decode_cu": p + 1, "decode_src": p,
                     "cu_seqlens_q": p + 1}
        counted = published_counts(st)
        assert {k: counted[k] for k in expected} == expected, index
        if device == "cuda":
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU work the DMAs queue behind
        before = dest_copies(st)
        ah.publish_step(r, "prefill" if prefill else "decode")
        after = dest_copies(st)
        if prefill:
            r.prefill.prepare_attention(plan)
            out = [r.prefill.token_request.gpu[:pt].clone(), r.prefill.kv_indices.clone()]
        else:
            out = [r.decode.generate_kv_indices(dplan).clone()]
        st.finish()
        taken.append((prefill, p, table, want, before, after, counted, out))
    ah.sync(device)
    for index, (prefill, p, table, want, before, after, counted, out) in enumerate(taken):
        check_tails(st, before, after, counted, rows={table: p})
        rows, kv = want.pop("rows"), want.pop("kv_indices")
        for i, row in enumerate(rows):
            assert after[table][i, : len(row)].tolist() == row, (index, i)
        owners = want.pop("token_request", None)
        for name, values in want.items():
            assert after[name][: len(values)].tolist() == values, (index, name)
        assert out[-1][: len(kv)].tolist() == kv, index
        if prefill:
            assert out[0].tolist() == owners, index
