"""Sampling, token inputs, query prefixes and speculative indices: published values, their
first consumers (token assembly, draft-ID gather, sampler), padding, untouched tails,
changing batch sizes, delayed source reuse and packed == direct."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import adapter_helpers as ah

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
