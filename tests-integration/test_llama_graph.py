"""The main job's Llama decoder (``decode_runner/llama_graph.py``) computes what the
oracle's decoder (``decode_runner/llama.py``) computes.

The benchmark decoder replaces only the attention (a Triton paged-attention kernel that
walks each request's pages, split over the keys at small batches) and the KV cache's
allocation. Its logits must equal the parent's forward over the same cache, for prefill
chunks, decode tokens and padded rows, split or not; and a runner driving it through a
scheduled workload (graph-captured on CUDA) must give the parent's logits and tokens,
though the two caches hold different garbage where nothing is written.
"""

from __future__ import annotations

import os

import pytest
import torch
from decode_runner.model import DecoderInputs
from decode_runner.runner import DecodeRunner, RunnerConfig
from decode_runner.scheduler import SamplingMix, Scheduler, SchedulerConfig
from kernel_mode import needs_kernels

if os.environ.get("H2D_REQUIRE_TRANSFORMERS") == "1":
    import transformers
else:
    transformers = pytest.importorskip("transformers")

from decode_runner.llama import LlamaPagedDecoder
from decode_runner.llama_graph import LlamaGraphDecoder

PAGE, PAGES, VOCAB = 8, 64, 128


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval().to(device)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # greedy choices far from ties
    return model


def _tol(device: str) -> dict[str, float]:
    # CUDA's float32 tl.dot runs in TF32
    return {"rtol": 1e-4, "atol": 1e-4} if device == "cpu" else {"rtol": 2e-2, "atol": 2e-2}


@pytest.mark.parametrize("target_programs", [1, 256])
def test_forward_equals_the_parent_forward(device: str, target_programs: int) -> None:
    """Prefill tokens (a chunk past a cached prefix), decode tokens and a padded token on a
    padded row; ``target_programs`` 1 runs unsplit, 256 splits the keys eight ways."""
    needs_kernels(device)
    model = _model(device)
    dec = LlamaGraphDecoder(model, page_size=PAGE, num_pages=PAGES, max_pages=16,
                            target_programs=target_programs)
    gen = torch.Generator().manual_seed(3)
    ctx, query = [5, 37, 100], [4, 1, 1]
    perm = torch.randperm(PAGES, generator=gen).tolist()
    pages: list[int] = []
    indptr = [0]
    for c in ctx:
        pages += perm[len(pages):len(pages) + -(-c // PAGE)]
        indptr.append(len(pages))
    pos, slot, row = [], [], []
    for r, (c, n) in enumerate(zip(ctx, query, strict=True)):
        for p in range(c - n, c):
            pos.append(p)
            row.append(r)
            slot.append(pages[indptr[r] + p // PAGE] * PAGE + p % PAGE)
    pos.append(-1)
    slot.append(-1)
    row.append(3)

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    inputs = DecoderInputs(
        input_ids=torch.randint(0, VOCAB, (len(pos),), generator=gen, dtype=torch.int32
                                ).to(device),
        positions=torch.tensor(pos, device=device),
        slot_mapping=torch.tensor(slot, device=device), token_request=i32(row),
        kv_indptr=i32([*indptr, indptr[-1]]), kv_indices=i32(pages + [0] * 8),
        context_lens=i32([*ctx, 0]))
    with torch.no_grad():
        dec.kv_cache.normal_()  # a cached prefix of sane values
    want = LlamaPagedDecoder.forward(dec, inputs)  # the oracle's attention, same cache
    got = dec.forward(inputs)
    torch.testing.assert_close(got, want, **_tol(device))


def test_runner_gives_the_parent_decoders_logits(device: str) -> None:
    needs_kernels(device)
    sched_cfg = SchedulerConfig(
        seed=5, page_size=PAGE, num_pages=PAGES, max_batch=3, prefill_chunk_tokens=8,
        prompt_len=(1, 12), output_len=(3, 8), num_requests=4, vocab_size=VOCAB,
        graph_sizes=(1, 2, 4), preempt_prob=0.0, migrate_prob=0.1, reorder_prob=0.2,
        sampling=SamplingMix(greedy_fraction=1.0))
    model = _model(device)
    steps = 12 if device == "cpu" else 60
    logits = []
    for cls in (LlamaPagedDecoder, LlamaGraphDecoder):
        decoder = cls(model, page_size=PAGE, num_pages=PAGES,
                      max_pages=sched_cfg.max_pages_per_request)
        runner = DecodeRunner(
            RunnerConfig(max_reqs=4, max_tokens=16, max_pages_per_req=8192, page_size=PAGE,
                         num_pages=PAGES, vocab=VOCAB,
                         graph_sizes=(1, 2, 4) if device == "cuda" else ()),
            device, "packed", model=decoder)
        sched = Scheduler(sched_cfg)
        sampled: list[int] | None = None
        seen = []
        for _ in range(steps):
            batch = sched.step(sampled)
            if batch is None:
                break
            res = runner.step(batch)
            sampled = res.sampled.cpu().tolist()
            seen.append((sampled, res.logits.float().cpu()))
        logits.append(seen)
    parent, graph = logits
    assert len(parent) == len(graph) >= 8
    for (ids_a, a), (ids_b, b) in zip(parent, graph, strict=True):
        assert ids_a == ids_b
        torch.testing.assert_close(b, a, **_tol(device))
