"""Sampling, token inputs, query prefixes and speculative indices: published values, their
first consumers (token assembly, draft-ID gather, sampler), padding, untouched tails,
changing batch sizes, delayed source reuse and packed == direct."""

from __future__ import annotations

from typing import Any

import adapter_helpers as ah
import numpy as np
import pytest
import torch

from h2d_runner_adapters import GREEDY_TEMPERATURE
from h2d_runner_adapters.consumers.reference import sample_tokens_reference

LAYOUTS = ["combined", "groups"]


def _prepare_decode(r: ah.Runner, batch: Any, padded: int | None) -> tuple[Any, Any, Any]:
    sp = r.sampling.prepare(batch)
    tp = r.tokens.prepare_ids(batch, padded)
    r.tokens.prepare_query_prefix(batch, padded)
    dp = r.decode.prepare(batch, padded)
    return sp, tp, dp


def _poisoned_tail(t: torch.Tensor, start: int) -> bool:
    return bool((t.reshape(-1).view(torch.uint8)[start * t.element_size():].cpu()
                 == ah.POISON).all())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_inputs_padding_and_tails(device: str, layout: str) -> None:
    r = ah.build_runner(device, layout=layout)
    reqs = ah.Requests(1)
    for c in (5, 9, 14):
        reqs.add(c)
    batch = reqs.decode_batch(deferred=True, padded=8)
    st = r.state
    st.begin()
    _sp, tp, _dp = _prepare_decode(r, batch, 8)
    ah.publish_step(r, "decode")
    st.finish()
    ah.sync(device)
    cols = batch.columns
    t = r.tokens
    assert t.cu_seqlens_q.gpu[:9].tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]
    assert _poisoned_tail(t.cu_seqlens_q.gpu, 9)
    assert t.decode_cu.gpu[:9].tolist() == [0, 1, 2, 3, 3, 3, 3, 3, 3]
    assert t.decode_src.gpu[:8].tolist() == cols.prev_sample_rows.tolist() + [-1] * 5
    assert t.input_ids.gpu[:8].tolist() == cols.token_ids.tolist() + [0] * 5
    assert _poisoned_tail(t.input_ids.gpu, 8)
    assert (tp.padded_reqs, tp.padded_tokens, tp.num_tokens) == (8, 8, 3)
    # sampling is never padded
    temps = r.sampling.temperatures.gpu[:3].cpu().numpy()
    assert np.array_equal(temps, np.maximum(cols.temperatures, GREEDY_TEMPERATURE))
    assert _poisoned_tail(r.sampling.temperatures.gpu, 3)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_token_assembly_fills_deferred_ids(device: str, layout: str) -> None:
    ah.need_kernels(device)
    r = ah.build_runner(device, layout=layout)
    reqs = ah.Requests(2)
    for c in (3, 4, 8, 11, 2):
        reqs.add(c)
    prev = torch.arange(100, 100 + 5 * 3, dtype=torch.int32, device=device).view(5, 3)
    for step, (deferred, padded) in enumerate([(True, 8), (False, None), (True, 5)]):
        batch = reqs.decode_batch(deferred=deferred, padded=padded)
        r.state.begin()
        _sp, tp, _dp = _prepare_decode(r, batch, padded)
        ah.publish_step(r, "decode")
        ids = r.tokens.assemble(tp, prev)
        r.state.finish()
        ah.sync(device)
        cols = batch.columns
        expect = cols.token_ids.copy()
        if deferred:
            expect = prev[:, 0].cpu().numpy()[cols.prev_sample_rows]
        pad = tp.padded_tokens - tp.num_tokens
        assert ids.tolist() == expect.tolist() + [0] * pad, step
        reqs.grow(1)


def test_speculative_indices_and_draft_gather(device: str) -> None:
    ah.need_kernels(device)
    r = ah.build_runner(device, layout="groups")
    reqs = ah.Requests(3)
    for c in (6, 7, 12):
        reqs.add(c)
    batch = reqs.decode_batch(q=3, deferred=False, drafts=2)
    st = r.state
    st.begin()
    _prepare_decode(r, batch, None)
    r.tokens.prepare_spec_indices(batch)
    ah.publish_step(r, "decode")
    st.finish()
    ah.sync(device)
    t = r.tokens
    assert t.target_logits_indices.gpu[:6].tolist() == [0, 1, 3, 4, 6, 7]
    assert t.cu_num_draft_tokens.gpu[:3].tolist() == [2, 4, 6]
    assert t.bonus_logits_indices.gpu[:3].tolist() == [2, 5, 8]
    assert _poisoned_tail(t.target_logits_indices.gpu, 6)
    from h2d_runner_adapters import TokenPlan

    out = torch.full((8,), -5, dtype=torch.int32, device=device)
    drafts = t.gather_drafts(TokenPlan(3, 3, 9, 9, 6), out)
    ids = batch.columns.token_ids
    assert drafts.tolist() == [int(ids[1 + i]) for i in [0, 1, 3, 4, 6, 7]]
    assert out[6:].tolist() == [-5, -5]


@pytest.mark.parametrize("policy", ["uniform", "off", "mixed"])
def test_sampling_policy_uploads_only_per_request_filters(device: str, policy: str) -> None:
    r = ah.build_runner(device, layout="groups")
    reqs = ah.Requests(4)
    for c in range(4):
        reqs.add(3 + c)
    batch = reqs.decode_batch(sampling=policy)
    st = r.state
    st.begin()
    sp = r.sampling.prepare(batch)
    st.publish("token_inputs")
    st.finish()
    uploaded = st.counters("token_inputs").bytes
    if policy == "mixed":
        assert sp.per_request_top_k and sp.per_request_top_p
        assert uploaded == 3 * 4 * 4
    else:
        assert not sp.per_request_top_k and not sp.per_request_top_p
        assert uploaded == 4 * 4  # temperatures only
        assert (sp.top_k, sp.top_p) == ((5, pytest.approx(0.9)) if policy == "uniform"
                                        else (None, None))


@pytest.mark.parametrize("policy", ["uniform", "mixed"])
def test_sampler_greedy_rows_exact_and_matches_reference(device: str, policy: str) -> None:
    ah.need_kernels(device)
    r = ah.build_runner(device, layout="groups")
    reqs = ah.Requests(5)
    for c in range(6):
        reqs.add(3 + c)
    batch = reqs.decode_batch(sampling=policy)
    st = r.state
    st.begin()
    sp = r.sampling.prepare(batch)
    st.publish("token_inputs")
    st.finish()
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(6, 50, generator=g, device=device)
    noise = -torch.log(-torch.log(torch.rand(6, 50, generator=g, device=device)))
    if device == "cuda":
        torch.cuda.set_sync_debug_mode("error")
    try:
        out = r.sampling.sample(logits, sp, noise)
    finally:
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    cols = batch.columns
    greedy = cols.temperatures <= 0
    argmax = logits.argmax(dim=1).cpu().numpy()
    assert np.array_equal(out.cpu().numpy()[greedy], argmax[greedy])
    temps = torch.from_numpy(np.maximum(cols.temperatures, GREEDY_TEMPERATURE)).to(device)
    top_k = (torch.from_numpy(cols.top_k).to(device) if sp.per_request_top_k else sp.top_k)
    top_p = (torch.from_numpy(cols.top_p).to(device) if sp.per_request_top_p else sp.top_p)
    ref = sample_tokens_reference(logits, temps, top_k=top_k, top_p=top_p, noise=noise)
    assert out.tolist() == ref.tolist()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_equals_direct_over_changing_batches(device: str, layout: str) -> None:
    runners = [ah.build_runner(device, backend=b, layout=layout) for b in ("packed", "direct")]
    pops = [ah.Requests(6), ah.Requests(6)]
    for p in pops:
        for c in (2, 5, 9):
            p.add(c)
    for step in range(10):
        for r, p in zip(runners, pops, strict=True):
            if step % 3 == 2:
                p.add(int(p.rng.integers(1, 20)))
            batch = p.decode_batch(padded=8 if step % 2 else None)
            r.state.begin()
            _prepare_decode(r, batch, batch.padded_size)
            ah.publish_step(r, "decode")
            r.state.finish()
            p.grow(1)
        ah.sync(device)
        a, b = (r.state.buffers() for r in runners)
        for name in a:
            assert torch.equal(a[name].gpu.cpu().view(-1).view(torch.uint8),
                               b[name].gpu.cpu().view(-1).view(torch.uint8)), (step, name)


@pytest.mark.gpu
def test_delayed_source_reuse_through_adapters() -> None:
    r = ah.build_runner("cuda")
    reqs = ah.Requests(7)
    for c in (4, 8, 12, 16):
        reqs.add(c)
    for step in range(3):
        batch = reqs.decode_batch(deferred=False)
        r.state.begin()
        torch.cuda._sleep(50_000_000)
        _prepare_decode(r, batch, None)
        ah.publish_step(r, "decode")
        r.state.finish()
        expect = batch.columns.token_ids.tolist()
        r.state.begin()  # must wait: the DMA has not read the sources yet
        r.tokens.input_ids.np[:] = -1
        r.decode.positions.np[:] = -1
        r.state.finish()
        torch.cuda.synchronize()
        assert r.tokens.input_ids.gpu[:4].tolist() == expect, step
        assert r.decode.positions.gpu[:4].tolist() == [c - 1 for c in reqs.ctx], step
        reqs.grow(1)


# ------------------------------------------------------------------------------ Engram
def _engram_state(device: str, backend: str, num_slots: int) -> tuple[Any, Any, Any, Any]:
    from h2d_core import H2DRunnerState
    from h2d_runner_adapters import (
        ENGRAM,
        QUERY_PREFIX,
        SAMPLING,
        TOKEN_IDS,
        EngramInputs,
        SamplingInputs,
        TokenInputs,
    )

    st = H2DRunnerState(device, backend=backend, num_slots=num_slots,
                        scatter=ah.scatter_for(device))
    sampling = SamplingInputs(st, 8)
    tokens = TokenInputs(st, max_reqs=8, max_tokens=40)
    eng = EngramInputs(st, max_reqs=8, max_drafts=3, history_rows=12, history_len=200)
    st.combine("token_inputs", [SAMPLING, TOKEN_IDS, QUERY_PREFIX, ENGRAM])
    st.bind()
    return st, sampling, tokens, eng


def _engram_batch(rng: np.random.Generator, n: int) -> Any:
    from h2d_runner_adapters import BatchColumns, ScheduledBatch

    d = rng.integers(0, 4, n).astype(np.int32)
    q = d + 1
    cols = BatchColumns(
        query_lens=q, context_lens=np.full(n, 100, np.int32),
        temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
        top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
        token_ids=rng.integers(1, 5000, int(q.sum())).astype(np.int32), num_drafts=d)
    return ScheduledBatch((), False, 16, given_columns=cols)


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_engram_rejected_tentative_steps_keep_every_accepted_prefix(device: str,
                                                                    backend: str) -> None:
    """Verify steps write their tokens tentatively from the published snapshot; the commit
    selects the cursor candidate of the accepted count on the GPU. After every step each
    request's history holds exactly its accepted tokens below the committed cursor, with
    fully rejected steps (nothing but the first token kept) among them."""
    ah.need_kernels(device)
    st, sampling, tokens, eng = _engram_state(device, backend, 1)
    rng = np.random.default_rng(3)
    rows = np.array([5, 2, 9, 0, 11, 7], np.int32)
    accepted_tokens: list[list[int]] = [[] for _ in rows]
    for step in range(10):
        n = int(rng.integers(1, rows.size + 1))
        batch = _engram_batch(rng, n)
        cols = batch.columns
        cursors = np.asarray([len(a) for a in accepted_tokens[:n]], np.int32)
        # all drafts rejected on even steps: only the non-draft token commits
        acc = (np.zeros(n, np.int32) if step % 2 == 0
               else np.asarray([int(rng.integers(0, d + 1)) for d in cols.num_drafts],
                               np.int32))
        st.begin()
        sampling.prepare(batch)
        tokens.prepare_ids(batch)
        tokens.prepare_query_prefix(batch)
        plan = eng.prepare(batch, rows[:n], cursors)
        st.publish("token_inputs")
        eng.write_tentative(plan, tokens.cu_seqlens_q.gpu, tokens.input_ids.gpu)
        committed = eng.commit(plan, torch.from_numpy(acc).to(device))
        st.finish()
        ah.sync(device)
        start = 0
        for i, (q, d, a) in enumerate(zip(cols.query_lens.tolist(), cols.num_drafts.tolist(),
                                          acc.tolist(), strict=True)):
            accepted_tokens[i] += cols.token_ids[start : start + q - d + a].tolist()
            start += q
        assert committed.tolist() == [len(a) for a in accepted_tokens[:n]], step
        hist = eng.history.cpu()
        for i, toks in enumerate(accepted_tokens):
            assert hist[int(rows[i]), : len(toks)].tolist() == toks, (step, i)


def test_engram_bad_inputs_change_nothing(device: str) -> None:
    from h2d_core import CountError

    st, _, _, eng = _engram_state(device, "packed", 1)
    rng = np.random.default_rng(1)
    batch = _engram_batch(rng, 3)
    st.begin()
    sources = {k: b.np.tobytes() for k, b in st.buffers().items()}
    for rows, cursors, match in (
            (np.array([0, 12, 1], np.int32), np.zeros(3, np.int32),
             r"request 1 has a history row outside \[0, 12\)"),
            (np.array([0, 1, 2], np.int32), np.array([0, -1, 0], np.int32),
             r"request 1 has a negative cursor"),
            (np.array([0, 1, 2], np.int32), np.array([0, 0, 199], np.int32),
             r"request 2 has cursor \+ query tokens past the history length 200"),
            (np.array([0, 1], np.int32), np.zeros(3, np.int32),
             r"rows must be a 1-D integer numpy array with one entry per request \(3\)")):
        with pytest.raises(CountError, match=match):
            eng.prepare(batch, rows, cursors)
        assert {k: b.np.tobytes() for k, b in st.buffers().items()} == sources
    eng.prepare(batch, np.arange(3, dtype=np.int32), np.zeros(3, np.int32))


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_engram_commit_is_never_overtaken_by_a_later_snapshot(device: str,
                                                              backend: str) -> None:
    """CUDA, two slots, the GPU delayed before every publication: the host prepares and
    publishes the next steps' snapshots while earlier commits have not run; each commit
    (read on the GPU right after it) is its own step's candidate, and the history keeps
    every accepted prefix."""
    if device != "cuda":
        pytest.skip("a delayed GPU needs asynchronous copies (CUDA)")
    st, sampling, tokens, eng = _engram_state(device, backend, 2)
    rng = np.random.default_rng(6)
    rows = np.array([3, 1, 8, 4], np.int32)
    accepted_tokens: list[list[int]] = [[] for _ in rows]
    seen = []
    for _ in range(8):
        batch = _engram_batch(rng, rows.size)
        cols = batch.columns
        cursors = np.asarray([len(a) for a in accepted_tokens], np.int32)
        acc = np.asarray([int(rng.integers(0, d + 1)) for d in cols.num_drafts], np.int32)
        st.begin()
        sampling.prepare(batch)
        tokens.prepare_ids(batch)
        tokens.prepare_query_prefix(batch)
        plan = eng.prepare(batch, rows, cursors)
        torch.cuda._sleep(10_000_000)
        st.publish("token_inputs")
        eng.write_tentative(plan, tokens.cu_seqlens_q.gpu, tokens.input_ids.gpu)
        seen.append(eng.commit(plan, torch.from_numpy(acc).to(device)).clone())
        st.finish()
        start = 0
        for i, (q, d, a) in enumerate(zip(cols.query_lens.tolist(), cols.num_drafts.tolist(),
                                          acc.tolist(), strict=True)):
            accepted_tokens[i] += cols.token_ids[start : start + q - d + a].tolist()
            start += q
        seen[-1] = (seen[-1], [len(a) for a in accepted_tokens])
    torch.cuda.synchronize()
    for got, want in seen:
        assert got.tolist() == want
    hist = eng.history.cpu()
    for i, toks in enumerate(accepted_tokens):
        assert hist[int(rows[i]), : len(toks)].tolist() == toks
