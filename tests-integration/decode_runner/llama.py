"""A transformers ``LlamaForCausalLM`` run over a paged KV cache from published metadata.

The model's own modules do everything but attention's bookkeeping: its embedding,
``input_layernorm``, ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``, its rotary embedding
(``model.model.rotary_emb`` at the published positions, applied by transformers'
``apply_rotary_pos_emb``), ``post_attention_layernorm``, MLP, final norm and ``lm_head``.
Where each token's key and value go (``slot_mapping``), which keys it sees (its request's
pages through ``kv_indptr`` / ``kv_indices``, up to its position and its request's context
length) and its rotary position come only from :class:`DecoderInputs`, the library's
published destinations and their first consumers' outputs. GQA: each key/value head
serves ``num_attention_heads / num_key_value_heads`` query heads.

Same interface as :class:`~decode_runner.model.TinyDecoder` (``forward``,
``compute_logits``, ``move_pages``, ``kv_cache``), so :class:`DecodeRunner` runs it as its
model. Unwritten and freed pages hold large garbage from the start, so a wrong page, slot
or length changes the output instead of reading zeros.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from .model import DecoderInputs, key_plan

GARBAGE = 1.0e4


class LlamaPagedDecoder:
    """``model`` (a ``LlamaForCausalLM``, eval mode) over a paged KV cache of ``num_pages``
    pages of ``page_size`` slots; ``max_pages`` bounds the pages one request attends to."""

    def __init__(self, model: torch.nn.Module, *, page_size: int, num_pages: int,
                 max_pages: int) -> None:
        cfg = model.config
        self._setup(model, model.model, cfg, page_size=page_size, num_pages=num_pages,
                    max_pages=max_pages,
                    head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size
                    // cfg.num_attention_heads, seed=1234)

    def _setup(self, model: torch.nn.Module, lm: torch.nn.Module, cfg: object, *,
               page_size: int, num_pages: int, max_pages: int, head_dim: int,
               seed: int) -> None:
        """The cache and index tables over ``lm`` (the model's decoder stack: embedding,
        layers, rotary embedding, norm) with ``cfg``'s head counts."""
        self.model = model
        self.lm = lm
        self.page_size = page_size
        self.max_pages = max_pages
        self.heads = cfg.num_attention_heads  # type: ignore[attr-defined]
        self.kv_heads = cfg.num_key_value_heads  # type: ignore[attr-defined]
        self.head_dim = head_dim
        self.vocab = cfg.vocab_size  # type: ignore[attr-defined]
        layers = cfg.num_hidden_layers  # type: ignore[attr-defined]
        dev = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        slots = num_pages * page_size
        self.trash_slot = slots  # slot -1 writes here; no page maps it
        self._gen = torch.Generator().manual_seed(seed)
        self.kv_cache = self._garbage_cache(
            (layers, 2, slots + 1, self.kv_heads, self.head_dim), dev, dtype, seed)
        self._page_cols = torch.arange(max_pages, device=dev)
        self._slot_in_page = torch.arange(page_size, device=dev)
        self._key_pos = torch.arange(max_pages * page_size, device=dev)

    def _garbage_cache(self, shape: tuple[int, ...], device: torch.device,
                       dtype: torch.dtype, seed: int) -> torch.Tensor:
        """The KV cache, every slot large garbage (drawn on the host: the same values on
        every device)."""
        return ((torch.rand(shape, generator=self._gen) * 2 - 1) * GARBAGE).to(
            device=device, dtype=dtype)

    # -- what a model variant changes: the embedded tokens and the rotation ---------------
    def _embed(self, inputs: DecoderInputs, ids: torch.Tensor) -> torch.Tensor:
        """The tokens' embeddings ``[T, hidden]``."""
        return self.lm.embed_tokens(ids)

    def _rotation(self, inputs: DecoderInputs, h: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's rotary embedding at the published positions."""
        return self.lm.rotary_emb(h, inputs.positions.clamp(min=0)[None])

    _apply_rotary = staticmethod(apply_rotary_pos_emb)

    @torch.no_grad()
    def forward(self, inputs: DecoderInputs,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        lm = self.lm
        tokens = inputs.input_ids.shape[0]
        ids = inputs.input_ids.long().clamp(0, self.vocab - 1)
        write = torch.where(inputs.slot_mapping >= 0, inputs.slot_mapping, self.trash_slot)
        # each token's visible keys: its request's pages, below its context length,
        # causal by the published query prefix (positions only rotate)
        key_slots, visible = key_plan(inputs, inputs.positions.clamp(min=0), self._page_cols,
                                      self._slot_in_page, self._key_pos)
        h = self._embed(inputs, ids)[None]  # [1, T, hidden]: the model's batch of one
        cos, sin = self._rotation(inputs, h)
        group = self.heads // self.kv_heads
        for index, layer in enumerate(lm.layers):
            attn = layer.self_attn
            a = layer.input_layernorm(h)
            q = attn.q_proj(a).view(1, tokens, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(a).view(1, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(a).view(1, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = self._apply_rotary(q, k, cos, sin)
            cache_k, cache_v = self.kv_cache[index, 0], self.kv_cache[index, 1]
            cache_k.index_copy_(0, write, k[0].transpose(0, 1))
            cache_v.index_copy_(0, write, v[0].transpose(0, 1))
            gk = cache_k[key_slots].repeat_interleave(group, dim=2)  # [T, L, H, D]
            gv = cache_v[key_slots].repeat_interleave(group, dim=2)
            scores = torch.einsum("thd,tlhd->thl", q[0].transpose(0, 1), gk) * attn.scaling
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            weights = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(gv.dtype)
            out = torch.einsum("thl,tlhd->thd", weights, gv).reshape(1, tokens, -1)
            h = h + attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        hidden = lm.norm(h)[0]
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        return self.compute_logits(hidden)

    __call__ = forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()

    def move_pages(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy KV pages ``src -> dst`` in order (a page migration)."""
        ps = self.page_size
        for src, dst in moves:
            self.kv_cache[:, :, dst * ps:(dst + 1) * ps] = self.kv_cache[:, :, src * ps:
                                                                         (src + 1) * ps]

    def poison_pages(self, pages: Iterable[int]) -> None:
        """Refill ``pages`` (free ones: no request holds them) with large garbage, so a
        read through a stale page index, slot or length cannot pass for a correct one."""
        ps = self.page_size
        slots = [p * ps + s for p in pages for s in range(ps)]
        if not slots:
            return
        index = torch.tensor(slots, device=self.kv_cache.device)
        c = self.kv_cache
        fill = (torch.rand(c.shape[0], 2, len(slots), *c.shape[3:], generator=self._gen)
                * 2 - 1) * GARBAGE
        c.index_copy_(2, index, fill.to(c))
