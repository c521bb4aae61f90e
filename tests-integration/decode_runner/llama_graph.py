"""The Llama decoder at benchmark size: paged attention that reads only the keys it uses.

:class:`~decode_runner.llama.LlamaPagedDecoder` is capturable (static shapes, no host
reads), but its attention gathers ``max_pages * page_size`` candidate keys per token and
repeats them per query head. That is right for the oracle (small tables) and wrong for the
main job: with 128K-capable tables (8192 pages of 16) one decode token would gather 128K
keys, and even a bound at the workload's contexts makes the gather, not the model, the
step's GPU time. Its KV cache is also drawn on the host (``torch.rand`` on the CPU), which
takes minutes and tens of GiB of host memory at benchmark size.

:class:`LlamaGraphDecoder` keeps everything else of the parent (the model's own embedding,
norms, projections, rotary embedding, MLP, ``lm_head``; the same KV write through
``slot_mapping``; the same :class:`~decode_runner.model.DecoderInputs`) and changes two
things:

* attention is :func:`paged_attention`, a Triton kernel per (token, key/value head) that
  walks its request's pages through ``kv_indptr`` / ``kv_indices`` up to
  ``min(position + 1, context_len)`` keys (online softmax, GQA: the head's query group in
  one tile, no repeated keys), split over the keys when few tokens run (flash-decoding)
  and combined by a second kernel. Its work follows the real contexts, not the table's
  capacity; the grid depends only on the token count, so a padded decode step is
  captured in a CUDA graph like the parent's;
* the KV cache is allocated on the device and filled there with large garbage (unwritten
  pages must not read as zeros, as in the parent).

Its outputs equal the parent's forward over the same cache within float32 tolerance
(``tests-integration/test_llama_graph.py``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .llama import GARBAGE, LlamaPagedDecoder
from .model import DecoderInputs

__all__ = ["LlamaGraphDecoder", "paged_attention"]

BLOCK_N = 64  # keys per inner iteration
MAX_SPLITS = 16
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _attend_block(q, k_ptr, v_ptr, kv_indices_ptr, start, kv_last, j0, hi, kvh, scale,
                  cache_stride_s, cache_stride_h, m_i, l_i, acc,
                  D: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    """Keys ``[j0, min(j0 + BLOCK, hi))`` of the request into the online softmax."""
    j = j0 + tl.arange(0, BLOCK)
    d = tl.arange(0, D)
    valid = j < hi
    page = tl.load(kv_indices_ptr + tl.minimum(start + j // PAGE, kv_last), mask=valid,
                   other=0).to(tl.int64)
    off = ((page * PAGE + j % PAGE)[:, None] * cache_stride_s + kvh * cache_stride_h
           + d[None, :])
    k = tl.load(k_ptr + off, mask=valid[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + off, mask=valid[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_ml_ptr, part_acc_ptr,
    token_request_ptr, positions_ptr, kv_indptr_ptr, kv_indices_ptr, context_lens_ptr,
    scale, kv_last, q_stride_t, q_stride_h, cache_stride_s, cache_stride_h,
    out_stride_t, out_stride_h, num_kv_heads,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK: tl.constexpr, SPLITS: tl.constexpr, WHILE: tl.constexpr,
):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(token_request_ptr + t).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    ctx = tl.load(context_lens_ptr + req).to(tl.int64)
    start = tl.load(kv_indptr_ptr + req).to(tl.int64)
    count = tl.load(kv_indptr_ptr + req + 1).to(tl.int64) - start
    # the keys this token sees: its request's pages, up to its position and the context
    n_keys = tl.maximum(tl.minimum(tl.minimum(pos + 1, ctx), count * PAGE), 0)
    per_split = tl.cdiv(tl.cdiv(n_keys, SPLITS), BLOCK) * BLOCK
    lo = split * per_split
    hi = tl.minimum(lo + per_split, n_keys)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    gmask = g < GROUP
    head = kvh * GROUP + g
    q = tl.load(q_ptr + t * q_stride_t + head[:, None] * q_stride_h + d[None, :],
                mask=gmask[:, None], other=0.0)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    if WHILE:  # the interpreter (numpy 2) cannot take a loaded bound in range()
        j0 = lo
        while j0 < hi:
            m_i, l_i, acc = _attend_block(q, k_ptr, v_ptr, kv_indices_ptr, start, kv_last,
                                          j0, hi, kvh, scale, cache_stride_s, cache_stride_h,
                                          m_i, l_i, acc, D, PAGE, BLOCK)
            j0 += BLOCK
    else:  # a counted loop: the compiler pipelines its loads
        for j0 in range(lo, hi, BLOCK):
            m_i, l_i, acc = _attend_block(q, k_ptr, v_ptr, kv_indices_ptr, start, kv_last,
                                          j0, hi, kvh, scale, cache_stride_s, cache_stride_h,
                                          m_i, l_i, acc, D, PAGE, BLOCK)
    if SPLITS == 1:
        out = tl.where(l_i[:, None] > 0, acc / tl.maximum(l_i, 1e-30)[:, None], 0.0)
        tl.store(out_ptr + t * out_stride_t + head[:, None] * out_stride_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=gmask[:, None])
    else:
        base = ((t * num_kv_heads + kvh) * SPLITS + split) * GP
        tl.store(part_ml_ptr + (base + g) * 2, m_i)
        tl.store(part_ml_ptr + (base + g) * 2 + 1, l_i)
        tl.store(part_acc_ptr + (base + g)[:, None] * D + d[None, :], acc)


@triton.jit
def _combine_kernel(
    out_ptr, part_ml_ptr, part_acc_ptr, out_stride_t, out_stride_h, num_kv_heads,
    GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
):
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.arange(0, SPLITS)
    g = tl.arange(0, GP)
    d = tl.arange(0, D)
    row = ((t * num_kv_heads + kvh) * SPLITS + s[:, None]) * GP + g[None, :]  # [S, GP]
    m = tl.load(part_ml_ptr + row * 2)
    lsum = tl.load(part_ml_ptr + row * 2 + 1)
    acc = tl.load(part_acc_ptr + row[:, :, None] * D + d[None, None, :])  # [S, GP, D]
    top = tl.max(m, 0)  # [GP]
    top = tl.where(top == float("-inf"), 0.0, top)  # no split saw a key: weights 0, no NaN
    w = tl.exp(m - top[None, :])
    total = tl.sum(lsum * w, 0)
    num = tl.sum(acc * w[:, :, None], 0)
    out = tl.where(total[:, None] > 0, num / tl.maximum(total, 1e-30)[:, None], 0.0)
    head = kvh * GROUP + g
    tl.store(out_ptr + t * out_stride_t + head[:, None] * out_stride_h + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(g < GROUP)[:, None])


def paged_attention(q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                    inputs: DecoderInputs, positions: torch.Tensor, scale: float, *,
                    page_size: int, target_programs: int = 256) -> torch.Tensor:
    """Attention of ``q`` (``[heads, T, head_dim]``, any strides with a unit last one) over
    the paged cache (``cache_k`` / ``cache_v``: ``[slots, kv_heads, head_dim]``) as
    ``inputs`` address it; ``positions`` are the tokens' positions clamped at 0. Returns
    ``[T, heads, head_dim]`` in ``q``'s dtype; a token with no visible key gets zeros.

    The key range of each (token, key/value head) is split in up to ``MAX_SPLITS`` parts
    when fewer than ``target_programs`` such pairs run (a decode step at a small batch):
    the split count depends on ``T`` alone, a static shape, so a graph replays it."""
    heads, tokens, dim = q.shape
    kv_heads = cache_k.shape[1]
    group = heads // kv_heads
    if q.stride(2) != 1 or cache_k.stride(2) != 1 or cache_k.stride() != cache_v.stride():
        raise ValueError("paged_attention needs unit-stride head dims and K/V of one layout")
    gp = max(16, triton.next_power_of_2(group))  # tl.dot needs 16 rows
    splits = 1
    while splits < MAX_SPLITS and tokens * kv_heads * splits * 2 <= target_programs:
        splits *= 2
    out = torch.empty(tokens, heads, dim, dtype=q.dtype, device=q.device)
    if splits > 1:
        ml = torch.empty(tokens * kv_heads * splits * gp * 2, dtype=torch.float32,
                         device=q.device)
        part = torch.empty(tokens * kv_heads * splits * gp * dim, dtype=torch.float32,
                           device=q.device)
    else:
        ml = part = out  # unused
    _attention_kernel[(tokens, kv_heads, splits)](
        q, cache_k, cache_v, out, ml, part,
        inputs.token_request, positions, inputs.kv_indptr, inputs.kv_indices,
        inputs.context_lens, scale, inputs.kv_indices.shape[0] - 1, q.stride(1), q.stride(0),
        cache_k.stride(0), cache_k.stride(1), out.stride(0), out.stride(1), kv_heads,
        GROUP=group, GP=gp, D=dim, PAGE=page_size, BLOCK=BLOCK_N, SPLITS=splits,
        WHILE=INTERPRETED)
    if splits > 1:
        _combine_kernel[(tokens, kv_heads)](
            out, ml, part, out.stride(0), out.stride(1), kv_heads,
            GROUP=group, GP=gp, D=dim, SPLITS=splits)
    return out


class LlamaGraphDecoder(LlamaPagedDecoder):
    """``model`` (a ``LlamaForCausalLM``, eval mode, on its device) over a device-drawn
    garbage KV cache of ``num_pages`` pages, attention by :func:`paged_attention`.
    ``max_pages`` only bounds the parent's reference forward (``LlamaPagedDecoder.forward
    (self, ...)`` runs on the same cache); this class's attention reads what the tables
    hold. ``embed`` is the embedding matrix (the runner's GPU-span pass gathers from it as
    the model's first kernel)."""

    def __init__(self, model: torch.nn.Module, *, page_size: int, num_pages: int,
                 max_pages: int, target_programs: int | None = None, seed: int = 1234
                 ) -> None:
        cfg = model.config
        self._setup(model, model.model, cfg, page_size=page_size, num_pages=num_pages,
                    max_pages=max_pages,
                    head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size
                    // cfg.num_attention_heads, seed=seed)
        dev = self.kv_cache.device
        self.embed = model.model.embed_tokens.weight
        self.target_programs = target_programs or (
            4 * torch.cuda.get_device_properties(dev).multi_processor_count
            if dev.type == "cuda" else 16)

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache.numel() * self.kv_cache.element_size()

    def _garbage_cache(self, shape: tuple[int, ...], device: torch.device,
                       dtype: torch.dtype, seed: int) -> torch.Tensor:
        # drawn on the device: a host draw takes minutes and tens of GiB at this size
        gen = torch.Generator(device=device).manual_seed(seed)
        cache = torch.empty(shape, device=device, dtype=dtype)
        return cache.uniform_(-GARBAGE, GARBAGE, generator=gen)

    @torch.no_grad()
    def forward(self, inputs: DecoderInputs,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        inner = self.model.model
        tokens = inputs.input_ids.shape[0]
        ids = inputs.input_ids.long().clamp(0, self.vocab - 1)
        positions = inputs.positions.clamp(min=0)
        write = torch.where(inputs.slot_mapping >= 0, inputs.slot_mapping, self.trash_slot)
        h = inner.embed_tokens(ids)[None]  # [1, T, hidden]: the model's batch of one
        cos, sin = inner.rotary_emb(h, positions[None])
        for index, layer in enumerate(inner.layers):
            attn = layer.self_attn
            a = layer.input_layernorm(h)
            q = attn.q_proj(a).view(1, tokens, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(a).view(1, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(a).view(1, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            cache_k, cache_v = self.kv_cache[index, 0], self.kv_cache[index, 1]
            cache_k.index_copy_(0, write, k[0].transpose(0, 1))
            cache_v.index_copy_(0, write, v[0].transpose(0, 1))
            out = paged_attention(q[0], cache_k, cache_v, inputs, positions, attn.scaling,
                                  page_size=self.page_size,
                                  target_programs=self.target_programs)
            h = h + attn.o_proj(out.reshape(1, tokens, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        hidden = inner.norm(h)[0]
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        return self.compute_logits(hidden)

    __call__ = forward
