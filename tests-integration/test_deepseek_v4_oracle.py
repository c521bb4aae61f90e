"""A real V4 client: transformers' ``DeepseekV4ForCausalLM`` decoded through the library's
``token_inputs`` and ``v41_metadata``, every request's greedy tokens against ``generate()``.

The model is random-initialised from a small ``DeepseekV4Config``, no download: three
layers, one of each attention kind (sliding window of 8; compressed-sparse at the config's
rate 4, with a lightning indexer keeping the top 3 entries; heavily-compressed at rate
128), shared-KV MQA with partial interleaved rope, sinks, the grouped output projection,
hyper-connections, hash-routed then top-k MoE. The compressors' position biases and the
sinks are drawn at random (the default init zeroes them), so both matter.

:class:`~decode_runner.deepseek_v4_runner.DeepseekV4Runner` publishes prefill (chunked) and
decode (q = 1, padded to the graph sizes or not) and runs the groups' consumers;
:class:`~decode_runner.deepseek_v4.DeepseekV4PagedDecoder` keeps window KV in per-slot
rings, compressor state in per-slot rings and compressed KV in 256-token blocks, all
addressed through what was published. The scheduler's workload (prompts up to 270 tokens,
so HCA windows close and requests cross into their second block, in prefill and in
decode) has arrivals and finishes, preemptions (recompute), block migrations and
reordering over a pool of 5 blocks; freed blocks and freed state slots are refilled with
garbage before they are read again. Each request's tokens must equal ``generate``'s (the
model's own dense caches) and every sampled step's logits the dense forward's (float32,
1e-4). The indexer has 8 heads: with fewer, ``ReLU`` scores of exactly 0 tie often enough
that transformers' own top-k breaks ties differently between a prefix and a longer
sequence (its dense forward then disagrees with itself by up to 4e-2).

The second test runs DSpark-style verify steps (query widths 1..4, ragged or rectangular,
padded, drafts partly wrong) through :meth:`DeepseekV4Runner.verify`: every row's logits
against the dense forward, the accepted tokens against ``generate``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from decode_runner.oracle import Logits, assert_equals_generate, run_workload
from decode_runner.runner import RunnerConfig
from decode_runner.scheduler import SamplingMix, Scheduler, SchedulerConfig
from kernel_mode import needs_kernels

from h2d_runner_adapters import SamplingParams, ScheduledBatch, ScheduledRequest

if os.environ.get("H2D_REQUIRE_TRANSFORMERS") == "1":  # nox -s tests installs it
    import transformers
else:
    transformers = pytest.importorskip("transformers")

from decode_runner.deepseek_v4 import DeepseekV4PagedDecoder
from decode_runner.deepseek_v4_runner import DeepseekV4Runner

BLOCKS, VOCAB, SLOTS = 5, 128, 6
LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
STEPS = int(os.environ.get("H2D_DEEPSEEK_V4_STEPS", "400"))


def _model(device: str, layers: list[str] = LAYERS) -> torch.nn.Module:
    """The tiny random model (``layers``: its attention kinds, the first MoE hash-routed)."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16,
        num_hidden_layers=len(layers), layer_types=layers,
        mlp_layer_types=["hash_moe"] + ["moe"] * (len(layers) - 1),
        num_attention_heads=2, head_dim=16, partial_rotary_factor=0.5, q_lora_rank=16,
        num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1, hc_mult=2,
        hc_sinkhorn_iters=3, sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=8,
        index_head_dim=8, index_topk=3, max_position_embeddings=1024,
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = transformers.DeepseekV4ForCausalLM(cfg).eval().to(device)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # wider logits and router scores: greedy choices and routing far from ties
        model.lm_head.weight.mul_(8.0)
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(8.0)
            attn = layer.self_attn
            attn.sinks.copy_(torch.randn(attn.sinks.shape, generator=gen))
            if layer.mlp.is_hash:
                ids = torch.randint(0, cfg.n_routed_experts, layer.mlp.gate.tid2eid.shape,
                                    generator=gen)
                layer.mlp.gate.tid2eid.copy_(ids)
            comp = attn.compressor
            for m in (comp, getattr(comp, "indexer", None)):
                if m is not None:
                    m.position_bias.copy_(torch.randn(m.position_bias.shape, generator=gen))
    return model


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the model's matrices are tiny (see test_deepseek_oracle)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(device: str, backend: str, pad: bool
         ) -> tuple[dict[int, tuple[list[int], list[int]]], dict, Logits]:
    sched_cfg = SchedulerConfig(
        seed=180, page_size=256, num_pages=BLOCKS, max_batch=4, prefill_chunk_tokens=64,
        prompt_len=(1, 270), output_len=(3, 12), num_requests=8, vocab_size=VOCAB,
        graph_sizes=(1, 2, 4, 8), preempt_prob=0.04, migrate_prob=0.1, reorder_prob=0.2,
        sampling=SamplingMix(greedy_fraction=1.0))
    blocks = sched_cfg.max_pages_per_request
    decoder = DeepseekV4PagedDecoder(_model(device), num_blocks=BLOCKS + 1,
                                     max_blocks=blocks, num_state_slots=SLOTS)
    runner = DeepseekV4Runner(
        RunnerConfig(max_reqs=8, max_tokens=64, max_pages_per_req=blocks, page_size=256,
                     num_pages=BLOCKS, vocab=VOCAB,
                     scatter="auto" if device == "cuda" else "triton"),
        device, backend, model=decoder, num_state_slots=SLOTS, pad_eager=pad)
    done, stats, logits = run_workload(runner, decoder, Scheduler(sched_cfg), BLOCKS, STEPS)
    stats |= {"reused_slots": runner.reused_slots, "padded_steps": runner.padded_steps,
              "decode_compress_rows": runner.decode_compress_rows}
    return done, stats, logits


@pytest.mark.parametrize("backend, pad", [("packed", True), ("direct", False)])
def test_deepseek_v4_greedy_tokens_equal_generate(device: str, backend: str, pad: bool
                                                  ) -> None:
    needs_kernels(device)
    done, stats, logits = _run(device, backend, pad)
    assert len(done) == 8, stats  # the workload ran to its end
    assert max(len(p) + len(g) for p, g in done.values()) > 257, stats  # a second block
    assert stats["reused_slots"] >= 1 and stats["reused_pages"] >= 1, stats
    assert stats["preemptions"] >= 1 and stats["migrations"] >= 1, stats
    rows = stats["decode_compress_rows"]
    assert rows.get(4, 0) >= 1 and rows.get(128, 0) >= 1, stats  # windows closed in decode
    assert stats["padded_steps"] >= 1 if pad else stats["padded_steps"] == 0, stats
    assert_equals_generate(_model(device), done, logits, device)


# -- DSpark verify widths ---------------------------------------------------------------------
SPEC = 3  # drafts per verify step: full_q = 4
#: prompts whose verify steps cross CSA windows (every 4 tokens); a step across an HCA
#: boundary is test_deepseek_v4_semantics.py's
PROMPTS, NEW = (9, 61, 131), 14


def _verify_request(req_id: int, tokens: list[int], context_len: int, table: list[int]
                    ) -> ScheduledRequest:
    return ScheduledRequest(req_id, len(tokens), context_len, table, SamplingParams(0.0),
                            token_ids=tuple(tokens))


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_deepseek_v4_verify_widths_equal_dense(device: str, backend: str) -> None:
    """DSpark-style verify steps (q = 1..4 per request, ragged or rectangular, padded to 4
    requests): each request's first token and drafts (the greedy continuation, some drafts
    corrupted) go through one step of both groups; every row's logits must equal the dense
    forward's over the same tokens, greedy acceptance keeps the matched drafts plus a bonus
    token, and each request's accepted tokens equal ``generate``'s. Rejected drafts leave
    written ring positions and compressed rows behind that later steps overwrite."""
    needs_kernels(device)
    model: Any = _model(device)  # generate(): GenerationMixin, beyond nn.Module's type
    rng = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, VOCAB, (n,), generator=rng).tolist() for n in PROMPTS]
    truth = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        truth.append(model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=NEW + SPEC, min_new_tokens=NEW + SPEC,
                                    pad_token_id=0)[0, len(p):].tolist())
    decoder = DeepseekV4PagedDecoder(model, num_blocks=BLOCKS + 1, max_blocks=1,
                                     num_state_slots=SLOTS, spec_tokens=SPEC)
    runner = DeepseekV4Runner(
        RunnerConfig(max_reqs=4, max_tokens=64, max_pages_per_req=1, page_size=256,
                     num_pages=BLOCKS, vocab=VOCAB,
                     scatter="auto" if device == "cuda" else "triton"),
        device, backend, model=decoder, num_state_slots=SLOTS)
    seqs = [list(p) for p in prompts]
    for i, p in enumerate(prompts):  # chunked prefills; the first token is sampled there
        for s in range(0, len(p), 48):
            chunk = p[s:s + 48]
            res = runner.step(ScheduledBatch([_verify_request(i, chunk, s + len(chunk), [i])],
                                             True, 256, step=0))
        seqs[i].append(int(res.sampled[0]))
    rejected = ragged = 0
    live = list(range(len(prompts)))
    while live:
        widths = [int(torch.randint(1, SPEC + 2, (1,), generator=rng)) for _ in live]
        if bool(torch.rand(1, generator=rng) < 0.3):
            widths = [max(widths)] * len(widths)  # rectangular
        ragged += len(set(widths)) > 1
        reqs, steps = [], []
        for i, q in zip(live, widths, strict=True):
            g = len(seqs[i]) - len(prompts[i])
            drafts = list(truth[i][g:g + q - 1])
            for j in range(len(drafts)):
                if bool(torch.rand(1, generator=rng) < 0.3):
                    drafts[j] = (drafts[j] + 1) % VOCAB
            tokens = [seqs[i][-1], *drafts]
            reqs.append(_verify_request(i, tokens, len(seqs[i]) - 1 + q, [i]))
            steps.append(tokens)
        logits = runner.verify(ScheduledBatch(reqs, False, 256, step=1), padded=4).float().cpu()
        row = 0
        for i, tokens in zip(list(live), steps, strict=True):
            with torch.no_grad():
                dense = model(torch.tensor([seqs[i] + tokens[1:]], device=device)).logits[0]
            start = len(seqs[i]) - 1
            mine = logits[row:row + len(tokens)]
            row += len(tokens)
            torch.testing.assert_close(mine, dense[start:start + len(tokens)].float().cpu(),
                                       rtol=1e-4, atol=1e-4)
            for j, target in enumerate(mine.argmax(-1).tolist()):  # greedy acceptance
                seqs[i].append(target)
                if j + 1 == len(tokens) or tokens[j + 1] != target:
                    rejected += j + 1 < len(tokens)
                    break
            if len(seqs[i]) - len(prompts[i]) >= NEW:
                live.remove(i)
                runner.release([i])
    for i, p in enumerate(prompts):
        got = seqs[i][len(p):]
        assert got == truth[i][: len(got)], i
    assert rejected >= 1 and ragged >= 1 and runner.padded_steps >= 1
    assert runner.decode_compress_rows.get(4, 0) >= 1  # CSA windows closed in verify steps
