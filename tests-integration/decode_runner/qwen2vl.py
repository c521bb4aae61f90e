"""A transformers ``Qwen2VLForConditionalGeneration`` language model over a paged KV cache,
its rotary positions read only from the library's published ``[3, n]`` MRoPE planes.

The model's own modules do the arithmetic: ``language_model.embed_tokens``, each layer's
``input_layernorm``, ``q_proj`` / ``k_proj`` / ``v_proj`` (with their biases), ``o_proj``,
``post_attention_layernorm`` and MLP, the final ``norm``, ``lm_head``, and its rotary
embedding ``language_model.rotary_emb`` called with the three planes as its
``position_ids`` (it splits the frequencies by ``mrope_section`` over time, height and
width), applied by ``modeling_qwen2_vl.apply_rotary_pos_emb``. In transformers 5.24 there
is no ``apply_multimodal_rotary_pos_emb``: the section recomposition moved into the rotary
embedding's ``recomposition_frequencies``, so the planes go in whole.

What the library publishes decides everything else, as for
:class:`~decode_runner.llama.LlamaPagedDecoder` (whose cache handling this mirrors): KV
slots, each token's visible keys (its request's pages, its context length, the published
query prefix: :func:`~decode_runner.model.key_plan`), and the rotation (the planes; the 1-D
``positions`` member is not published for an MRoPE model and bounds nothing here).

The vision tower is not run: an image placeholder token (the published id equals the
config's ``image_token_id``) takes its row of the step's ``mm_embeds``, the engine's
stand-in features, as the model's own ``get_placeholder_mask`` / ``masked_scatter`` does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

from .model import DecoderInputError, DecoderInputs, key_plan

GARBAGE = 1.0e4


@dataclass(frozen=True)
class MropeDecoderInputs(DecoderInputs):
    """:class:`DecoderInputs` with the published MRoPE planes, which alone rotate.

    * ``mrope_positions``: int64 ``(3, T)``, the published planes viewed at the step's
      running width (axis stride ``T``); required;
    * ``mm_embeds`` (prefill steps with images): float ``[T, hidden]``, the image
      features of the step's placeholder tokens (other rows unread).

    ``query_start`` is required: keys are bounded by it and the context lengths, so the
    planes only rotate.
    """

    mrope_positions: torch.Tensor | None = None
    mm_embeds: torch.Tensor | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        p = self.mrope_positions
        t = self.input_ids.shape[0]
        if (not isinstance(p, torch.Tensor) or p.dtype != torch.int64
                or tuple(p.shape) != (3, t) or p.stride(1) != 1):
            got = f"{p.dtype} {tuple(p.shape)}" if isinstance(p, torch.Tensor) else repr(p)
            raise DecoderInputError(
                f"MropeDecoderInputs.mrope_positions must be the published int64 planes "
                f"viewed as (3, {t}), got {got}")
        if self.query_start is None:
            raise DecoderInputError(
                "MropeDecoderInputs.query_start is None; pass the published query prefix")
        e = self.mm_embeds
        if e is not None and (e.dim() != 2 or e.shape[0] != t):
            raise DecoderInputError(
                f"MropeDecoderInputs.mm_embeds must be [{t}, hidden], got {tuple(e.shape)}")


class Qwen2VLPagedDecoder:
    """``model`` (a ``Qwen2VLForConditionalGeneration``, eval mode) over a paged KV cache
    of ``num_pages`` pages of ``page_size`` slots; ``max_pages`` bounds the pages one
    request attends to. The :class:`~decode_runner.model.TinyDecoder` interface
    (``forward``, ``compute_logits``, ``move_pages``, ``kv_cache``), reading
    :class:`MropeDecoderInputs`."""

    def __init__(self, model: Any, *, page_size: int, num_pages: int,
                 max_pages: int) -> None:
        # ``model``: transformers' module, typed loosely (its attributes are modules)
        cfg = model.config.text_config
        self.model = model
        self.lm = model.model.language_model
        self.image_token = int(model.config.image_token_id)
        self.page_size = page_size
        self.max_pages = max_pages
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.hidden_size // self.heads  # Qwen2VLAttention's own rule
        self.vocab = cfg.vocab_size
        #: the rotary sections (time, height, width) the rotary embedding splits by
        self.sections = tuple(int(s) for s in self.lm.rotary_emb.mrope_section)
        dev = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        slots = num_pages * page_size
        self.trash_slot = slots  # slot -1 writes here; no page maps it
        self._gen = gen = torch.Generator().manual_seed(4321)
        self.kv_cache = ((torch.rand(cfg.num_hidden_layers, 2, slots + 1, self.kv_heads,
                                     self.head_dim, generator=gen) * 2 - 1) * GARBAGE).to(
            device=dev, dtype=dtype)
        self._page_cols = torch.arange(max_pages, device=dev)
        self._slot_in_page = torch.arange(page_size, device=dev)
        self._key_pos = torch.arange(max_pages * page_size, device=dev)
        #: the embedding module the runner's span measurement may call (TinyDecoder's name)
        self.embed = self.lm.embed_tokens.weight

    @torch.no_grad()
    def forward(self, inputs: MropeDecoderInputs,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        lm = self.lm
        tokens = inputs.input_ids.shape[0]
        ids = inputs.input_ids.long().clamp(0, self.vocab - 1)
        planes = inputs.mrope_positions
        assert planes is not None  # checked by MropeDecoderInputs
        write = torch.where(inputs.slot_mapping >= 0, inputs.slot_mapping, self.trash_slot)
        # visible keys: the request's pages, below its context length, causal by the
        # published query prefix (key_plan ignores positions when the prefix is given)
        key_slots, visible = key_plan(inputs, planes[0], self._page_cols, self._slot_in_page,
                                      self._key_pos)
        h = lm.embed_tokens(ids)
        if inputs.mm_embeds is not None:  # placeholders take the image features
            h = torch.where((ids == self.image_token)[:, None], inputs.mm_embeds.to(h), h)
        h = h[None]  # [1, T, hidden]: the model's batch of one
        # the model's rotary embedding over the three planes: position_ids (3, 1, T)
        cos, sin = lm.rotary_emb(h, planes[:, None, :])
        group = self.heads // self.kv_heads
        for index, layer in enumerate(lm.layers):
            attn = layer.self_attn
            a = layer.input_layernorm(h)
            q = attn.q_proj(a).view(1, tokens, self.heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(a).view(1, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(a).view(1, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
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
        """Refill ``pages`` (free ones) with large garbage: a read through a stale page
        index, slot or length cannot pass for a correct one."""
        ps = self.page_size
        slots = [p * ps + s for p in pages for s in range(ps)]
        if not slots:
            return
        index = torch.tensor(slots, device=self.kv_cache.device)
        c = self.kv_cache
        fill = (torch.rand(c.shape[0], 2, len(slots), *c.shape[3:], generator=self._gen)
                * 2 - 1) * GARBAGE
        c.index_copy_(2, index, fill.to(c))
