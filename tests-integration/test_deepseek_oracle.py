"""A real MLA client: transformers' ``DeepseekV3ForCausalLM`` decoded through the library's
``MlaDecodeInputs``, every request's greedy tokens against its own ``generate(do_sample=False)``.

The model is random-initialised from a small ``DeepseekV3Config``, no download: MLA with a
query LoRA (``q_a_proj`` / ``q_b_proj``), a 32-wide compressed KV plus an 8-wide roped key
part, interleaved YaRN rope with mscale in the softmax scale, one dense layer then one MoE
layer (8 routed experts in 2 groups, top-2, a shared expert). :class:`~decode_runner.
deepseek.DeepseekV3PagedDecoder` caches the 40-wide latent per token in pages of MLA's page
size (4 here, so last-page lengths take every value and pages are crossed often), at slots,
pages, positions and lengths that come only from what the library publishes: prefill
through ``PrefillInputs`` (chunked), decode through ``TokenStepInputs`` + ``MlaDecodeInputs``
(each decode row's visible length from its page count and ``kv_last_page_lens``, the pages
from KV-index generation), see :class:`~decode_runner.mla_runner.MlaDecodeRunner`.

The workload is the Llama oracle's scheduler (14 requests: arrivals and finishes, varying
prompt and output lengths, page migrations, batch reordering, recompute preemption) over a
pool small enough that freed pages are handed out again and the scheduler preempts to
make room.
Every page starts as large garbage and every free page is refilled with garbage before each
step, so reading a freed or unwritten page changes the output. Packed (the decode step's
two groups combined into one publication) and direct (``token_inputs`` and ``mla_decode``
published apart) both run, with decode steps padded to the graph sizes (eager on CPU;
CUDA graphs on the GPU) and unpadded, so padded rows are published and read too. Each
request's tokens must equal ``generate``'s (the same model, its dense latent cache) and
every sampled step's logits the dense forward's (float32, 1e-4).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from decode_runner.oracle import Logits, assert_equals_generate, run_workload
from decode_runner.runner import RunnerConfig
from decode_runner.scheduler import SamplingMix, Scheduler, SchedulerConfig
from kernel_mode import needs_kernels

if os.environ.get("H2D_REQUIRE_TRANSFORMERS") == "1":  # nox -s tests installs it
    import transformers
else:  # e.g. the lent GPU machine, where transformers travels as a carried wheel
    transformers = pytest.importorskip("transformers")

from decode_runner.deepseek import DeepseekV3PagedDecoder
from decode_runner.mla_runner import MlaDecodeRunner

# 40 pages of 4: the pool wraps (freed pages are handed out again) and runs short (the
# scheduler preempts to make room), besides its random preemptions
PAGE, PAGES, VOCAB = 4, 40, 128
STEPS = int(os.environ.get("H2D_DEEPSEEK_STEPS", "400"))


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=2, topk_group=1, num_mtp_layers=0,
        max_position_embeddings=512, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 128, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0},
        bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval().to(device)
    # the experts as batched matmuls: the default grouped GEMM copies host offsets, which
    # a CUDA graph capture refuses (the model's own math either way)
    model.set_experts_implementation("batched_mm")
    with torch.no_grad():
        # wider logits and router scores than the default init: greedy choices and expert
        # routing far from ties, so float32 rounding never flips either
        model.lm_head.weight.mul_(8.0)
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.weight.mul_(8.0)
    return model




@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: the model's matrices are tiny, and on CI's two cores a second
    thread costs more than it gives (several times more when other work shares them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(device: str, backend: str, pad: bool, combine: bool
         ) -> tuple[dict[int, tuple[list[int], list[int]]], dict, Logits]:
    """The finished requests' (prompt, generated), the scheduler's counters (and how
    often a freed page was handed out again), and every sampled row's logits by (request,
    the position they predict)."""
    sched_cfg = SchedulerConfig(
        seed=5, page_size=PAGE, num_pages=PAGES, max_batch=6, prefill_chunk_tokens=24,
        prompt_len=(1, 30), output_len=(3, 24), num_requests=14, vocab_size=VOCAB,
        graph_sizes=(1, 2, 4, 8), preempt_prob=0.03, migrate_prob=0.1, reorder_prob=0.2,
        sampling=SamplingMix(greedy_fraction=1.0))
    decoder = DeepseekV3PagedDecoder(_model(device), page_size=PAGE, num_pages=PAGES,
                                     max_pages=sched_cfg.max_pages_per_request)
    runner = MlaDecodeRunner(
        RunnerConfig(max_reqs=8, max_tokens=64, max_pages_per_req=sched_cfg.max_pages_per_request,
                     page_size=PAGE, num_pages=PAGES, vocab=VOCAB,
                     graph_sizes=(1, 2, 4, 8) if device == "cuda" and pad else (),
                     scatter="auto" if device == "cuda" else "triton"),
        device, backend, model=decoder, pad_eager=pad, combine=combine)
    return run_workload(runner, decoder, Scheduler(sched_cfg), PAGES, STEPS)


@pytest.mark.parametrize("backend, pad, combine", [
    ("packed", True, True),  # one combined group a decode step, padded to the graph sizes
    ("direct", False, False),  # token_inputs and mla_decode apart, eager
    ("direct", True, False),
])
def test_deepseek_v3_greedy_tokens_equal_generate(device: str, backend: str, pad: bool,
                                                  combine: bool) -> None:
    needs_kernels(device)
    done, stats, logits = _run(device, backend, pad, combine)
    assert len(done) >= 12, stats  # the workload ran to its end
    assert stats["preemptions"] >= 1 and stats["migrations"] >= 1, stats
    assert stats["reused_pages"] >= 1 and stats["reorders"] >= 1, stats
    assert_equals_generate(_model(device), done, logits, device)
