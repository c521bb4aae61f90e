"""The main job's DeepSeek-V4 family: transformers' real ``DeepseekV4ForCausalLM``.

Imported by ``decode_bench.py`` on use (it needs transformers), like ``llama_family.py``;
this module holds what is V4's own:

* the model: ``transformers.DeepseekV4ForCausalLM`` random-initialised from a
  ``DeepseekV4Config`` (no download), float32 (the paged decoder keeps its planes in
  float32 and reads them with the model's activations). On CUDA 8 layers: 2
  sliding-window (window 128), 5 compressed-sparse (rate 4, lightning indexer of 16 heads
  of 64 keeping the top 512) and 1 heavily-compressed (rate 128) layer (the decoder
  handles one HCA layer at most: the published HCA head is relative to the layer's view
  base); hidden 1024, 16 query heads of 128 over one shared-KV head (partial rope 64),
  q LoRA 512, 4 output groups of LoRA 256, hyper-connections x4, MoE of 16 routed experts
  (top 4, 512 wide) + 1 shared, the first 2 hash-routed; vocab 16384. On CPU a tiny one
  (3 layers, one of each kind, hidden 32, window 8) that only checks the loop runs. The
  experts run transformers' ``batched_mm`` implementation: its default expert loop reads
  the routing back to the host every layer (``nonzero``), which would put GPU time into
  the host's step;
* its decoder: :class:`~decode_runner.deepseek_v4.DeepseekV4PagedDecoder` (the model's own
  modules, paged V4 storage addressed only through the published ``token_inputs`` +
  ``v41_metadata`` and their first consumers) inside a
  :class:`~decode_runner.deepseek_v4_runner.DeepseekV4Runner`: eager, no CUDA graphs;
* :class:`DeepseekV4Decode`: the steady decode loop of one way (``steady_decode_batches``
  at 256-token blocks: one token per request per step, row ``r`` starting at
  ``context + r % 256``, so ``1/256`` of the rows cross into a new block each step, CSA
  windows close every 4 steps, HCA windows every 128; rows restart every
  :data:`RESTART` steps). Decode starts from garbage storage (no prefill: the figures are
  times, the values are not checked). The block tables, the requests' state slots and
  (ATOM-style) the page lists are built before each chunk, outside the timed work. The
  ATOM-style way plugs ``v41_step.AtomStyle``'s host step (every array built on the host,
  20 V4 fp8 copies + 4 token-core ones, its own production window 128 / top-k 1024 /
  envelope 66, sized by this batch and its contexts) in as the runner's
  ``metadata_hook``, in place of the publication and the first consumers; the model runs
  over the destinations as last published, so its values are not consumed.
"""

from __future__ import annotations

import argparse
from collections import deque
from typing import Any

import torch
from decode_runner.deepseek_v4 import DeepseekV4PagedDecoder
from decode_runner.deepseek_v4_runner import DeepseekV4Runner
from decode_runner.runner import RunnerConfig
from decode_runner.scheduler import steady_decode_batches, steady_decode_num_pages
from llama_family import LlamaDecode, step_rows

from h2d_runner_adapters import V4_BLOCK, ScheduledBatch

FAMILY = "deepseek_v4"
#: tokens per request at the first step: half a block before a boundary, so the timed
#: chunks see rows cross blocks at small batch sizes too
CONTEXT = {True: 8064, False: 509}
RESTART = 512  # steps before every row restarts at its starting context
SLIDING, CSA, HCA = ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention")

_MODELS: dict[str, torch.nn.Module] = {}


def deepseek_v4_config(cuda: bool) -> Any:
    """The CUDA model or the tiny CPU one (see the module docstring)."""
    import transformers

    common: dict[str, Any] = {"bos_token_id": None, "eos_token_id": None, "pad_token_id": 0,
                              "max_position_embeddings": 65536}
    if cuda:
        layers = [SLIDING, SLIDING, CSA, HCA, CSA, CSA, CSA, CSA]
        return transformers.DeepseekV4Config(
            vocab_size=16384, hidden_size=1024, moe_intermediate_size=512,
            num_hidden_layers=len(layers), layer_types=layers,
            mlp_layer_types=["hash_moe"] * 2 + ["moe"] * (len(layers) - 2),
            num_attention_heads=16, head_dim=128, partial_rotary_factor=0.5, q_lora_rank=512,
            num_experts_per_tok=4, n_routed_experts=16, n_shared_experts=1, hc_mult=4,
            sliding_window=128, o_groups=4, o_lora_rank=256, index_n_heads=16,
            index_head_dim=64, index_topk=512, **common)
    return transformers.DeepseekV4Config(
        vocab_size=128, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
        layer_types=[SLIDING, CSA, HCA], mlp_layer_types=["hash_moe", "moe", "moe"],
        num_attention_heads=2, head_dim=16, partial_rotary_factor=0.5, q_lora_rank=16,
        num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1, hc_mult=2,
        hc_sinkhorn_iters=3, sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=8,
        index_head_dim=8, index_topk=3, **common)


def deepseek_v4_model(device: str, cuda: bool) -> torch.nn.Module:
    """The run's one model (built on ``device`` at first use): its weights are shared by
    every way and batch size, each decoder has its own storage."""
    if device not in _MODELS:
        import transformers

        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.DeepseekV4ForCausalLM(deepseek_v4_config(cuda))
        model.set_experts_implementation("batched_mm")  # no host readback (docstring)
        _MODELS[device] = model.float().eval()
    return _MODELS[device]


def _shape(bs: int, cuda: bool) -> tuple[int, int, int]:
    """(context, blocks per request, blocks in the pool) of the steady decode."""
    ctx = CONTEXT[cuda]
    pool = steady_decode_num_pages(bs, ctx, V4_BLOCK, RESTART)
    return ctx, pool // bs, pool


def describe(args: argparse.Namespace, sizes: list[int]) -> dict[str, Any]:
    """The model and workload shape, for the output's ``meta``."""
    cfg = deepseek_v4_config(args.cuda)
    return {"layers": list(cfg.layer_types), "mlp": list(cfg.mlp_layer_types),
            "hidden": cfg.hidden_size, "heads": cfg.num_attention_heads,
            "head_dim": cfg.head_dim, "window": cfg.sliding_window,
            "compress_rates": dict(cfg.compress_rates), "index_topk": cfg.index_topk,
            "experts": cfg.n_routed_experts, "vocab": cfg.vocab_size, "dtype": "fp32",
            "context": CONTEXT[args.cuda], "restart_steps": RESTART, "graphs": False,
            "blocks_per_request": {bs: _shape(bs, args.cuda)[1] for bs in sizes}}


class DeepseekV4Decode(LlamaDecode):
    """One way's steady V4 decode of ``bs`` requests (see the module docstring): the Llama
    family's step, timing and GPU busy figures over :class:`DeepseekV4Runner`;
    ``decode_bench`` wraps it in its ``Loop``."""

    def __init__(self, way: str, bs: int, args: argparse.Namespace) -> None:
        ctx, per_row, pool = _shape(bs, args.cuda)
        model = deepseek_v4_model(args.device, args.cuda)
        decoder = DeepseekV4PagedDecoder(model, num_blocks=pool + 1, max_blocks=per_row,
                                         num_state_slots=bs)
        cfg = RunnerConfig(
            max_reqs=bs, max_tokens=bs, max_pages_per_req=per_row, page_size=V4_BLOCK,
            num_pages=pool, vocab=decoder.vocab, seed=1,
            num_slots=2)  # two slots: the host prepares step N+1 while the GPU runs N
        # the ATOM-style way's one library step (the destinations) goes out direct
        self.runner = DeepseekV4Runner(cfg, args.device, "direct" if way == "atom" else way,
                                       model=decoder, num_state_slots=bs)
        self.sync = False  # deferred ids: the host may run ahead of the GPU
        self.way = way
        self._batches = steady_decode_batches(bs, ctx, V4_BLOCK, window=RESTART,
                                              graph_sizes=(bs,), vocab_size=decoder.vocab)
        self._queue: deque[ScheduledBatch] = deque()
        self.last_host_step_ns = 0
        self.end_event: torch.cuda.Event | None = None
        self.hooked = way == "atom"
        if self.hooked:
            import v41_step

            self.atom = v41_step.AtomStyle(bs, ctx + RESTART + V4_BLOCK, args.device)
            self.runner.step(self._next())  # the destinations, once
            self.runner.metadata_hook = self.atom.step

    def _next(self) -> ScheduledBatch:
        b = super()._next()
        # the scheduler's side, built ahead: the state slots, the ATOM-style page lists
        b.extras["spans"] = self.runner.slot_spans(b)
        if self.hooked:
            b.extras["page_lists"] = [list(row) for row in b.block_tables]
        return b

    def wait_ns(self) -> int:
        """The last step's wait for source reuse: the library's, or the ATOM-style step's
        for a free pinned source set."""
        return self.atom.last_wait_ns if self.hooked else self.runner.state.last_source_wait_ns


def table(results: list[dict[str, Any]], cuda: bool) -> str:
    """The family's printed table."""
    rows = [r for r in results if r["family"] == FAMILY]
    if not rows:
        return ""
    model = ("8 layers (2 sliding, 5 CSA rate 4, 1 HCA rate 128), hidden 1024, fp32" if cuda
             else "the tiny CPU model")
    return "\n".join([
        f"\n{FAMILY}: transformers DeepseekV4ForCausalLM, {model}; eager, no CUDA graphs; "
        "deferred ids, host up to 2 steps ahead. tokens/s, ms per step, host µs per step: "
        "metadata p50 (x = way / packed) and the whole step's host work p50, metadata's "
        "share of it; GPU busy µs per step (events, step queued behind a sleep) and GPU "
        "idle µs per step (wall - busy); H2D + kernels per step (profiler). atom: "
        "v41_step.AtomStyle's host step and copies, its values not consumed",
        *step_rows(rows)])
