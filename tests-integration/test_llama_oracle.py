"""A real client: transformers' ``LlamaForCausalLM`` decoded through the library, every
request's greedy tokens against the model's own ``generate(do_sample=False)``.

The model is random-initialised from a small ``LlamaConfig`` (GQA: 4 query heads over 2
key/value heads, RoPE), no download. :class:`~decode_runner.llama.LlamaPagedDecoder` runs its
modules over a paged KV cache whose slots, pages, positions and lengths come only from what
the library publishes (prefill through ``PrefillInputs``, chunked; decode through the fused
``DecodeStepInputs``) and from the first consumers (token assembly, KV-index generation,
prefill attention preparation). The scheduler's workload has arrivals and finishes, prompt
and output lengths that vary, page boundaries crossed, pages freed and reused, page
migrations (lineage copies), batch reordering and recompute preemptions; every page starts
as large garbage and every free page is refilled with garbage before each step, and each
token's keys are bounded by its row's context length and the published query prefix, as
a paged kernel bounds them (positions only rotate), so a wrong page, slot, length or
prefix changes the output. Packed and direct backends both run; each request's tokens must equal
``generate``'s, which runs the same model with its dense cache, and every sampled step's
logits the dense forward's at the same position (float32, 1e-4).
"""

from __future__ import annotations

import os

import pytest
import torch
from decode_runner.oracle import Logits, assert_equals_generate, run_workload
from decode_runner.runner import DecodeRunner, RunnerConfig
from decode_runner.scheduler import SamplingMix, Scheduler, SchedulerConfig
from kernel_mode import needs_kernels

if os.environ.get("H2D_REQUIRE_TRANSFORMERS") == "1":  # nox -s tests installs it
    import transformers
else:  # e.g. the lent GPU machine, where transformers travels as a carried wheel
    transformers = pytest.importorskip("transformers")

from decode_runner.llama import LlamaPagedDecoder

# 40 pages of 4: the pool wraps (freed pages are handed out again) and runs short (the
# scheduler preempts)
PAGE, PAGES, VOCAB = 4, 40, 128
MTP_PAGE, MTP_PAGES = 8, 96  # the speculative runner's own pool (3 requests, no scheduler)
STEPS = int(os.environ.get("H2D_LLAMA_STEPS", "400"))


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        rope_theta=10000.0, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = transformers.LlamaForCausalLM(cfg).eval().to(device)
    # wider logits than the default init: greedy choices far from ties
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model




def _run(device: str, backend: str, greedy: float = 1.0
         ) -> tuple[dict[int, tuple[list[int], list[int]]], dict, Logits]:
    """The finished requests' (prompt, generated), the scheduler's counters, and every
    sampled row's logits by (request, the position they predict)."""
    sched_cfg = SchedulerConfig(
        seed=5, page_size=PAGE, num_pages=PAGES, max_batch=6, prefill_chunk_tokens=24,
        prompt_len=(1, 30), output_len=(3, 24), num_requests=14, vocab_size=VOCAB,
        graph_sizes=(1, 2, 4, 8), preempt_prob=0.03, migrate_prob=0.1, reorder_prob=0.2,
        sampling=SamplingMix(greedy_fraction=greedy))
    model = _model(device)
    runner = DecodeRunner(
        RunnerConfig(max_reqs=8, max_tokens=64, max_pages_per_req=sched_cfg.max_pages_per_request,
                     page_size=PAGE, num_pages=PAGES, vocab=VOCAB,
                     graph_sizes=(1, 2, 4, 8) if device == "cuda" else (),
                     scatter="auto" if device == "cuda" else "triton"),
        device, backend,
        model=LlamaPagedDecoder(model, page_size=PAGE, num_pages=PAGES,
                                max_pages=sched_cfg.max_pages_per_request))
    return run_workload(runner, runner.model, Scheduler(sched_cfg), PAGES, STEPS)


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_llama_greedy_tokens_equal_generate(device: str, backend: str) -> None:
    needs_kernels(device)
    done, stats, logits = _run(device, backend)
    assert len(done) >= 12, stats  # the workload ran to its end
    assert stats["preemptions"] >= 1 and stats["migrations"] >= 1, stats
    assert stats["reused_pages"] >= 1, stats  # freed pages were handed out again
    assert_equals_generate(_model(device), done, logits, device)


@pytest.mark.parametrize("k", [1, 3])
def test_llama_speculative_decoding_equals_generate(device: str, k: int) -> None:
    """Speculative decoding on the same Llama: the library's verify step
    (``prepare_verify``: one publication with the verification indices), acceptance and
    the draft loop (a second decoder over the model's weights, with its own KV cache and a
    fixed bias on its proposals so drafts are both accepted and rejected). Every request's
    committed tokens equal the target's greedy ``generate()``, whatever the drafts were."""
    needs_kernels(device)
    from decode_runner.mtp import MtpConfig, MtpRunner

    model = _model(device)
    cfg = MtpConfig(k=k, num_reqs=3, vocab=VOCAB, page_size=MTP_PAGE, num_pages=MTP_PAGES,
                    max_pages_per_req=24, draft_bias=0.3, scatter="auto" if device == "cuda"
                    else "triton")
    decoders = tuple(LlamaPagedDecoder(model, page_size=MTP_PAGE, num_pages=MTP_PAGES,
                                       max_pages=cfg.max_pages_per_req) for _ in range(2))
    runner = MtpRunner(cfg, device, "packed", models=decoders)  # type: ignore[arg-type]
    accepted = 0
    for _ in range(8 if device == "cpu" else 40):
        runner.iterate()
        accepted += int(runner.last_accepted.sum())
    assert 0 < accepted < runner.iterations * cfg.num_reqs * k  # some drafts of each kind
    for seq in runner.sequences:
        ids = torch.tensor([seq[:1]], device=device)
        want = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=len(seq) - 1, min_new_tokens=len(seq) - 1,
                              pad_token_id=0)[0].tolist()
        assert seq == want


def test_llama_seeded_sampling_packed_equals_direct(device: str) -> None:
    """Half the requests sample (seeded noise, per-request and uniform top-k / top-p): the
    packed and direct backends give the same tokens and bit-identical logits."""
    needs_kernels(device)
    packed, direct = _run(device, "packed", greedy=0.5), _run(device, "direct", greedy=0.5)
    assert packed[0] == direct[0] and len(packed[0]) >= 12
    assert packed[2].keys() == direct[2].keys()
    for key, got in packed[2].items():
        assert torch.equal(got, direct[2][key]), key
