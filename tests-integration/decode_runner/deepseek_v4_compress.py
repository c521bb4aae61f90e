"""DeepSeek-V4's compressors driven by the published plans: state rings and compressed rows.

transformers' ``DeepseekV4CSACompressor`` / ``DeepseekV4HCACompressor`` / ``DeepseekV4Indexer``
keep each request's unfinished window in a dense per-request buffer and concatenate the
compressed entries onto a per-request list. A paged engine keeps instead, per request and
layer, a RING of the last ``K`` tokens' projected ``kv`` and ``gate + position_bias`` (the
compressor state, in the request's state slot) and writes every compressed entry into the
request's 256-token blocks. Which rows do what comes only from the ``v41_metadata`` plans:

* a COMPRESS row ``[ragged_id, batch_id, position, window_len]`` closes the window ending at
  ``position``: iteration ``k' < K`` pools source position ``position - K + 1 + k'``, read
  from the ring of ``state_slot_in[batch_id]`` for ``k' < window_len`` (the tokens of
  earlier steps) and from this step's token ``ragged_id - (K - 1 - k')`` otherwise;
  overlapping (CSA, ``K = 2r``) takes the first column half (the model's ``Ca``) for
  ``k' < r`` and the second (``Cb``) after; a negative source position has weight 0 (the
  model's ``-inf`` gate of window 0). The pooled entry goes through the module's own
  ``kv_norm`` and compress rotary at ``(position // r) * r`` to entry ``position // r``:
  row ``block_tables[batch_id, e // (256 / r)] * envelope_rows + base + e % (256 / r)``.
* a WRITE row stores its token's ``kv`` and ``gate + position_bias[position % r]`` at ring
  index ``position % (K + k)`` of ``state_slot_out[batch_id]`` (``k`` draft tokens a step),
  after every compress row read the ring (the order ``update_compressor_states`` keeps).

Negative rows (padding) do nothing: their reads are masked, their writes go to a trash
slot (rings) or the pool's last row (compressed rows). No step reads anything back to the
host (no mask indexing). The math is the module's (its ``kv_proj``, ``gate_proj``,
``position_bias``, ``kv_norm``, ``rotary_emb`` and transformers' ``apply_rotary_pos_emb``);
the softmax pools the same ``2r`` (CSA) or ``r`` (HCA) slots in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

V4_BLOCK = 256


@dataclass
class Ring:
    """One compressor's state over every state slot: ``kv`` and ``score`` float32
    ``[slots + 2, K + k, width]`` (the adapter's dummy slot, then a trash slot last)."""

    kv: torch.Tensor
    score: torch.Tensor

    @property
    def trash(self) -> int:
        return self.kv.shape[0] - 1


@dataclass(frozen=True)
class PlanView:
    """What one compressor reads of a step: the ratio's two plans (published rows), the
    state slots, the block table and where its compressed rows live."""

    compress: torch.Tensor  # int32 [rows, 4]
    write: torch.Tensor  # int32 [rows, 4]
    slot_in: torch.Tensor  # int32 [P]
    slot_out: torch.Tensor  # int32 [P]
    block_tables: torch.Tensor  # int32 [S, B]
    envelope_rows: int
    base: int  # the layer's first row inside a block's envelope


def compressed_rows(tables: torch.Tensor, batch: torch.Tensor, entries: torch.Tensor,
                    ratio: int, envelope_rows: int, base: int) -> torch.Tensor:
    """Row of compressed entry ``entries`` of request ``batch`` (broadcast), through the
    published block table: the paged address every compressed plane shares."""
    per_block = V4_BLOCK // ratio
    block = tables[batch.long(), (entries // per_block).long()]
    return block.long() * envelope_rows + base + entries.long() % per_block


def run_compressor(module: Any, x: torch.Tensor, ring: Ring, plan: PlanView,
                   pool: torch.Tensor, *, ratio: int, overlap: bool) -> None:
    """Close this step's windows into ``pool`` (compress rows), then update the ring (write
    rows): see the module docstring. ``x`` is the layer's normed input ``[T, hidden]``."""
    kv = module.kv_proj(x).float()  # [T, width]
    score = module.gate_proj(x).float()
    ape = module.position_bias.float()  # [r, width]
    d = module.head_dim
    k = 2 * ratio if overlap else ratio
    c = plan.compress.long()
    # every row, the dead ones (padding, position -1) computed over clamped indices and
    # written to the pool's last row, its trash row: no mask indexing or ``any()``, so
    # the step never makes the host wait on the GPU
    live = c[:, 2] >= 0
    rid, b, pos, wlen = c[:, 0], c[:, 1].clamp(min=0), c[:, 2].clamp(min=0), c[:, 3]
    kk = torch.arange(k, device=x.device)
    src = pos[:, None] - k + 1 + kk  # [R, K] source positions
    from_ring = kk[None, :] < wlen[:, None]
    slot = plan.slot_in.long()[b][:, None].expand(-1, k)
    ring_kv = ring.kv[slot, src.remainder(ring.kv.shape[1])]
    ring_score = ring.score[slot, src.remainder(ring.kv.shape[1])]
    tok = (rid[:, None] - (k - 1 - kk)).clamp(0, x.shape[0] - 1)
    in_kv = kv[tok]
    in_score = score[tok] + ape[kk % ratio]
    kv_k = torch.where(from_ring[..., None], ring_kv, in_kv)  # [R, K, width]
    score_k = torch.where(from_ring[..., None], ring_score, in_score)
    if overlap:  # Ca (first half) of the previous window, Cb (second) of this one
        first = (kk < ratio)[None, :, None]
        kv_k = torch.where(first, kv_k[..., :d], kv_k[..., d:])
        score_k = torch.where(first, score_k[..., :d], score_k[..., d:])
    score_k = score_k.masked_fill((src < 0)[..., None], float("-inf"))
    pooled = (kv_k * score_k.softmax(dim=1)).sum(dim=1)
    pooled = module.kv_norm(pooled)
    start = (pos // ratio) * ratio
    cos, sin = module.rotary_emb(pooled, position_ids=start[None],
                                 layer_type=module.rope_layer_type)
    pooled = apply_rotary_pos_emb(pooled[None, None], cos, sin)[0, 0]
    rows = compressed_rows(plan.block_tables, b, pos // ratio, ratio,
                           plan.envelope_rows, plan.base)
    pool.index_copy_(0, torch.where(live, rows, pool.shape[0] - 1), pooled.to(pool.dtype))
    w = plan.write.long()
    wlive = w[:, 2] >= 0
    tok = w[:, 0].clamp(0, x.shape[0] - 1)
    pos = w[:, 2].clamp(min=0)
    slot = torch.where(wlive, plan.slot_out.long()[w[:, 1].clamp(min=0)], ring.trash)
    at = pos.remainder(ring.kv.shape[1])
    ring.kv[slot, at] = kv[tok]
    ring.score[slot, at] = score[tok] + ape[pos % ratio]
