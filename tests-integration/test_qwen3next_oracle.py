"""A real GDN client: transformers' ``Qwen3NextForCausalLM`` decoded through the library's GDN
state indices, every request's greedy tokens against the model's own ``generate()``.

The model is random-initialised from a small ``Qwen3NextConfig``, no download: 4 layers
(``linear_attention``, ``full_attention``, ``linear_attention``, ``full_attention``), hidden
64, Gated DeltaNet layers of 2 key heads / 4 value heads of 8 dims with a causal conv of
kernel 4, gated full attention (4 query heads over 2 key/value heads, head_dim 16, partial
rotary), a sparse MoE (4 experts, top 2, a shared expert) on every layer, float32.

:class:`~decode_runner.qwen3next_runner.Qwen3NextRunner` publishes prefill (chunked) and
decode (fused, padded to the graph size) with :class:`GdnStateInputs` in the same group;
:class:`~decode_runner.qwen3next.Qwen3NextPagedDecoder` keeps every request's conv and
recurrent states in one state pool, reads each row's initial state only through the first
reader of ``non_spec_state_indices_in`` and writes its final state only to
``non_spec_state_indices``; full attention runs over a paged KV cache. The scheduler's
workload has arrivals and finishes, varying prompt and output lengths, chunked prefills
(state carried across chunks), preemptions (recompute from zero state), migrations and
reordering; state groups are freed on finish and handed out again; every free page and
every freed state slot is refilled with large garbage. The oracle: each request's tokens
equal ``generate(do_sample=False)`` (the model's own dense cache), every sampled step's
logits the dense forward's at that position (float32, 1e-4: the chunked and recurrent
delta rules agree to ~1e-6 on these sizes: the worst seen is 2.6e-6), packed and direct.

Two more tests: a prefix fork (the forked row reads the source's slot through the
published fork source, writes its own) and speculative verify steps on an all-GDN model
(``spec_state_indices`` / ``num_accepted_tokens``: the state after every draft in its own
slot, the next step reading the last accepted one).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from decode_runner.oracle import assert_equals_generate
from decode_runner.runner import RunnerConfig
from decode_runner.scheduler import SamplingMix, Scheduler, SchedulerConfig
from kernel_mode import needs_kernels

from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    GDN_STATE,
    GdnPlan,
    GdnStateInputs,
    SamplingParams,
    ScheduledBatch,
    ScheduledRequest,
)

if os.environ.get("H2D_REQUIRE_TRANSFORMERS") == "1":  # nox -s tests installs it
    import transformers
else:
    transformers = pytest.importorskip("transformers")

from decode_runner.qwen3next import Qwen3NextPagedDecoder
from decode_runner.qwen3next_runner import Qwen3NextRunner

PAGE, PAGES, VOCAB, GROUPS = 4, 40, 128, 6
LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        layer_types=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        decoder_sparse_step=1, max_position_embeddings=512, pad_token_id=0,
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=False)
    model = transformers.Qwen3NextForCausalLM(cfg).eval().to(device)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # wider logits: greedy choices far from ties
    return model


Logits = dict[tuple[int, int], torch.Tensor]
_RUNS: dict[tuple[str, str], tuple] = {}


def _run(device: str, backend: str) -> tuple:
    if (device, backend) not in _RUNS:
        _RUNS[(device, backend)] = _run_once(device, backend)
    return _RUNS[(device, backend)]


def _run_once(device: str, backend: str) -> tuple:
    sched_cfg = SchedulerConfig(
        seed=5, page_size=PAGE, num_pages=PAGES, max_batch=4, prefill_chunk_tokens=16,
        prompt_len=(1, 28), output_len=(3, 14), num_requests=8, vocab_size=VOCAB,
        graph_sizes=(1, 2, 4), preempt_prob=0.03, migrate_prob=0.1, reorder_prob=0.2,
        sampling=SamplingMix(greedy_fraction=1.0))
    decoder = Qwen3NextPagedDecoder(_model(device), page_size=PAGE, num_pages=PAGES,
                                    max_pages=sched_cfg.max_pages_per_request,
                                    num_state_slots=GROUPS)
    runner = Qwen3NextRunner(
        RunnerConfig(max_reqs=8, max_tokens=64, max_pages_per_req=sched_cfg.max_pages_per_request,
                     page_size=PAGE, num_pages=PAGES, vocab=VOCAB,
                     scatter="auto" if device == "cuda" else "triton"),
        device, backend, model=decoder, num_state_groups=GROUPS, pad_eager=True)
    sched = Scheduler(sched_cfg)
    sampled: list[int] | None = None
    logits: Logits = {}
    chunks = 0  # prefill rows that continued a request's earlier tokens
    for _ in range(400):
        batch = sched.step(sampled)
        if batch is None:
            break
        runner.release(sched.finished_sequences().keys())
        sources = {src for src, _ in batch.extras["kv_page_moves"]}
        decoder.poison_pages(set(range(PAGES)) - set(sched.page_owners()) - sources)
        if batch.is_prefill:
            chunks += sum(r.context_len > r.num_tokens for r in batch.requests)
        res = runner.step(batch)
        sampled = res.sampled.cpu().tolist()
        rows = res.logits.float().cpu()
        for r, (req, samples) in enumerate(zip(batch.requests, batch.extras["sample_rows"],
                                               strict=True)):
            if samples:
                logits[(req.req_id, req.context_len)] = rows[r]
    stats = {**vars(sched.stats), "continued_chunks": chunks,
             "reused_groups": runner.reused_groups, "padded_steps": runner.padded_steps}
    return sched.finished_sequences(), stats, logits


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_qwen3next_greedy_tokens_equal_generate(device: str, backend: str) -> None:
    needs_kernels(device)
    done, stats, logits = _run(device, backend)
    assert len(done) >= 6, stats
    lengths = {(len(p), len(g)) for p, g in done.values()}
    assert len({p for p, _ in lengths}) >= 4 and len({g for _, g in lengths}) >= 3, lengths
    assert stats["continued_chunks"] >= 1, stats  # a state carried across prefill chunks
    assert stats["reused_groups"] >= 1, stats  # a freed state slot was handed out again
    assert stats["padded_steps"] >= 1, stats  # padded rows (state index -1) ran
    assert_equals_generate(_model(device), done, logits, device)


def _greedy_request(req_id: int, tokens: list[int], context: int, pages: list[int]
                    ) -> ScheduledRequest:
    return ScheduledRequest(req_id, len(tokens), context, pages[: -(-context // PAGE)],
                            SamplingParams(temperature=0.0), token_ids=tokens)


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_qwen3next_prefix_fork_reads_the_source_state(device: str, backend: str) -> None:
    """A prefix fork: request 0 prefills ``P`` (two full pages); request 1 then prefills
    only its suffix ``X`` over request 0's pages of ``P`` (a prefix-cache hit) and starts
    from request 0's recurrent and conv state through the published fork source
    (``non_spec_state_indices_in`` = the source's slot, ``non_spec_state_indices`` its own,
    which holds garbage). Both then decode together, padded; each request's tokens equal
    ``generate()`` over its whole prompt, so the forked row read exactly the source's state
    after ``P`` and the source's later steps were not disturbed by the fork's writes."""
    needs_kernels(device)
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(1, VOCAB, (2 * PAGE,), generator=gen).tolist()
    suffix = torch.randint(1, VOCAB, (3,), generator=gen).tolist()
    new = 6
    tables = {0: [0, 1, 3, 4, 6], 1: [0, 1, 2, 5, 7]}  # pages 0 and 1: the shared prefix
    decoder = Qwen3NextPagedDecoder(_model(device), page_size=PAGE, num_pages=PAGES,
                                    max_pages=8, num_state_slots=GROUPS)
    runner = Qwen3NextRunner(
        RunnerConfig(max_reqs=4, max_tokens=32, max_pages_per_req=8, page_size=PAGE,
                     num_pages=PAGES, vocab=VOCAB,
                     scatter="auto" if device == "cuda" else "triton"),
        device, backend, model=decoder, num_state_groups=GROUPS, pad_eager=True)
    seqs = {0: list(prompt), 1: prompt + suffix}
    out: dict[int, list[int]] = {0: [], 1: []}
    res = runner.step(ScheduledBatch(
        [_greedy_request(0, prompt, len(prompt), tables[0])], True, PAGE, step=0))
    out[0].append(int(res.sampled[0]))
    runner.forks[1] = 0
    res = runner.step(ScheduledBatch(
        [_greedy_request(1, suffix, len(seqs[1]), tables[1])], True, PAGE, step=1))
    assert runner.groups[1] != runner.groups[0] and not runner.forks
    out[1].append(int(res.sampled[0]))
    for step in range(2, new + 1):
        reqs = [_greedy_request(i, [out[i][-1]], len(seqs[i]) + len(out[i]), tables[i])
                for i in (1, 0)]  # reordered against the prefills
        res = runner.step(ScheduledBatch(reqs, False, PAGE, padded_size=4, step=step))
        for row, i in enumerate((1, 0)):
            out[i].append(int(res.sampled[row]))
    assert runner.padded_steps == new - 1
    model = _model(device)
    for i, seq in seqs.items():
        ids = torch.tensor([seq], device=device)
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new, min_new_tokens=new,
                              pad_token_id=0)[0, len(seq):].tolist()
        assert out[i] == want, i


@pytest.mark.parametrize("backend", ["packed", "direct"])
@pytest.mark.parametrize("k", [1, 3])
def test_qwen3next_speculative_state_rows(device: str, k: int, backend: str) -> None:
    """Speculative (MTP-style) verify steps on a Qwen3-Next whose layers are all Gated
    DeltaNet: ``GdnStateInputs(num_spec=k)`` publishes each request's ``k + 1`` state slots
    (``spec_state_indices``) and ``num_accepted_tokens``. A verify step runs each row's
    pending token and ``k`` drafts token by token from the state row the first reader picks
    (slot ``num_accepted - 1`` of the row's group: the state after the last accepted token
    of the previous step) and writes the state after token ``j`` to slot ``j``; the rejected
    slots keep stale states. Drafts are the target's greedy tokens, some replaced by random
    ones, so drafts are both accepted and rejected. Every request's committed tokens equal
    the model's own greedy tokens (repeated full forwards: ``generate()`` refuses a model
    without an attention layer)."""
    needs_kernels(device)
    model = _gdn_only_model(device)
    gen = torch.Generator().manual_seed(7 + k)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 2)]
    iters, rows = 6, len(prompts)
    # the oracle: greedy by repeated full forwards (generate() of transformers 5.24 refuses
    # a cache of linear-attention layers only: get_seq_length needs an attention layer)
    want = []
    for p in prompts:
        seq = list(p)
        with torch.no_grad():
            for _ in range(iters * (k + 1) + 1):
                seq.append(int(model(torch.tensor([seq], device=device), use_cache=False)
                               .logits[0, -1].argmax()))
        want.append(seq[len(p):])
    groups = np.array([2, 0, 1], np.int32)  # not the batch order
    slots = rows * (k + 1)
    decoder = Qwen3NextPagedDecoder(model, page_size=PAGE, num_pages=1, max_pages=1,
                                    num_state_slots=slots)
    st = H2DRunnerState(torch.device(device), backend=backend,
                        scatter="auto" if device == "cuda" else "triton")
    gdn = GdnStateInputs(st, max_reqs=4, num_spec=k, num_state_slots=slots)
    st.bind()
    pool, buf = decoder.state_pool, torch.zeros(4, decoder.state_width, device=device)
    view = pool[:slots]

    def publish(**kw: object) -> GdnPlan:
        st.begin()
        plan = gdn.prepare(groups, **kw)  # type: ignore[arg-type]
        st.publish(GDN_STATE)
        st.finish()
        return plan

    # prefill (non-speculative: slot 0 of each group), one row at a time (ragged prompts)
    plan = publish()
    initial = gdn.gather_states(plan, view, buf)
    pending, committed = [], [[] for _ in prompts]
    for i, p in enumerate(prompts):
        logits, after = decoder.run_tokens(torch.tensor([p], device=device), initial[i:i + 1],
                                           torch.tensor([False], device=device))
        pool[int(gdn.non_spec.gpu[i])] = after[0, -1]
        pending.append(int(logits[0, -1].argmax()))
    accepted = np.ones(rows, np.int32)
    total = 0
    for _ in range(iters):
        drafts = []
        for i in range(rows):
            nxt = want[i][len(committed[i]) + 1:len(committed[i]) + 1 + k]
            noise = torch.randint(1, VOCAB, (k,), generator=gen).tolist()
            keep = torch.rand(k, generator=gen) < 0.6
            drafts.append([t if keep[j] else noise[j] for j, t in enumerate(nxt)])
        plan = publish(num_accepted=accepted)
        initial = gdn.gather_states(plan, view, buf)
        ids = torch.tensor([[pending[i], *drafts[i]] for i in range(rows)], device=device)
        has_initial = torch.ones(rows, dtype=torch.bool, device=device)
        logits, after = decoder.run_tokens(ids, initial, has_initial)
        assert gdn.spec is not None
        dst = gdn.spec.gpu[:rows].reshape(-1).long()
        pool.index_copy_(0, dst, after.reshape(-1, decoder.state_width))
        target = logits.argmax(-1).tolist()
        for i in range(rows):
            a = 0
            while a < k and drafts[i][a] == target[i][a]:
                a += 1
            committed[i] += [pending[i], *drafts[i][:a]]
            pending[i] = target[i][a]
            accepted[i] = a + 1
            total += a
    assert 0 < total < iters * rows * k, total  # drafts of both kinds
    for i in range(rows):
        assert committed[i] + [pending[i]] == want[i][:len(committed[i]) + 1], i


def _gdn_only_model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        layer_types=["linear_attention"] * 2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        max_position_embeddings=512, pad_token_id=0, bos_token_id=None, eos_token_id=None,
        tie_word_embeddings=False)
    model = transformers.Qwen3NextForCausalLM(cfg).eval().to(device)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model
