"""A transformers ``DeepseekV3ForCausalLM`` (MLA) run over a paged latent KV cache.

Multi-head latent attention caches one vector per token, not per-head keys and values:
the ``kv_a_layernorm``'d compressed KV (``kv_lora_rank`` wide) next to the roped shared
key part ``k_pe`` (``qk_rope_head_dim`` wide). That latent is what this decoder writes to
its paged cache at MLA's page size, in the same layout DeepSeek's dense cache keeps
(``DynamicCache`` stores exactly these two parts). Attention runs over the gathered
latents themselves, with the layer's ``kv_b_proj`` weight absorbed the way MLA decode
kernels do (the query's no-rope part taken into latent space, the latent output projected
to per-head values), where transformers expands the latents into per-head keys and values
after its cache read: the same product, another order.

The model's own modules do everything but attention's bookkeeping: its embedding,
``input_layernorm``, the query path (``q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``, or
``q_proj``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``'s weight, its rotary
embedding (YaRN included) applied by transformers' own rope function (interleaved or
not, as the config says), the softmax scale with YaRN's mscale (``attn.scaling``),
``o_proj``, ``post_attention_layernorm``, the dense MLP or MoE, final norm and ``lm_head``.

Where each token's latent goes (``slot_mapping``), which latents it sees and its rotary
position come only from :class:`MlaDecoderInputs`: the library's published destinations
and their first consumers' outputs. Which latents a token sees is bounded the way a paged
kernel bounds it, by lengths and the query prefix, never by positions (they only rotate):
a step's visible length is what an AITER-style MLA kernel derives from the published
MLA members, never the context lengths: ``(pages - 1) * page_size + kv_last_page_lens``,
pages from ``kv_indptr``, the pages themselves from ``kv_indices`` (KV-index generation
in decode, attention preparation in prefill; ``PrefillInputs(last_page_lens=True)``
publishes prefill's last-page lengths).

Same interface as :class:`~decode_runner.llama.LlamaPagedDecoder`, so a runner drives it
as its model. Unwritten pages hold large garbage from the start; :meth:`poison_pages`
refills freed ones, so a wrong page, slot or length changes the output.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import torch
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    apply_rotary_pos_emb,
    apply_rotary_pos_emb_interleave,
)

from .model import DecoderInputError, DecoderInputs, key_plan

GARBAGE = 1.0e4


@dataclasses.dataclass(frozen=True)
class MlaDecoderInputs(DecoderInputs):
    """:class:`DecoderInputs` plus what an MLA attention kernel reads besides them, and
    with ``query_start`` (the published query prefix) required: with each row's visible
    length it gives every token's causal bound, as a paged-attention kernel derives it
    (positions only rotate).

    * ``kv_last_page_lens`` (int32 ``[R]``): tokens in each row's last page, 0 for padded
      rows. Given, it and the page counts of ``kv_indptr`` set each row's visible length;
      None: the context lengths do.
    """

    kv_last_page_lens: torch.Tensor | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.query_start is None:
            raise DecoderInputError(
                "MlaDecoderInputs.query_start is None; pass the step's published query "
                "prefix (cu_seqlens_q) over its rows")
        t = self.kv_last_page_lens
        if t is None:
            return
        rows = self.context_lens.shape[0]
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 1
                or t.shape[0] != rows):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
            raise DecoderInputError(
                f"MlaDecoderInputs.kv_last_page_lens must be a 1-D int32 tensor of {rows} "
                f"elements, got {got}; pass the step's published kv_last_page_lens over "
                "its rows")
        if t.device != self.input_ids.device:
            raise DecoderInputError(
                f"MlaDecoderInputs.kv_last_page_lens lies on {t.device} but input_ids on "
                f"{self.input_ids.device}; put every member on the model's device")


class DeepseekV3PagedDecoder:
    """``model`` (a ``DeepseekV3ForCausalLM``, eval mode) over a paged latent cache of
    ``num_pages`` pages of ``page_size`` slots; ``max_pages`` bounds the pages one request
    attends to."""

    def __init__(self, model: torch.nn.Module, *, page_size: int, num_pages: int,
                 max_pages: int) -> None:
        cfg = model.config
        self.model = model
        self.page_size = page_size
        self.max_pages = max_pages
        self.heads = cfg.num_attention_heads
        self.kv_lora_rank = cfg.kv_lora_rank
        self.rope_dim = cfg.qk_rope_head_dim
        self.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        self.v_head_dim = cfg.v_head_dim
        self.vocab = cfg.vocab_size
        self._rope = (apply_rotary_pos_emb_interleave if cfg.rope_interleave
                      else apply_rotary_pos_emb)
        dev = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        slots = num_pages * page_size
        self.trash_slot = slots  # slot -1 writes here; no page maps it
        self._gen = torch.Generator().manual_seed(1234)
        #: [layers, slots + 1, kv_lora_rank + qk_rope_head_dim]: one latent per token
        self.kv_cache = self._garbage(
            (cfg.num_hidden_layers, slots + 1, self.kv_lora_rank + self.rope_dim)).to(
            device=dev, dtype=dtype)
        self._page_cols = torch.arange(max_pages, device=dev)
        self._slot_in_page = torch.arange(page_size, device=dev)
        self._key_pos = torch.arange(max_pages * page_size, device=dev)

    def _garbage(self, shape: tuple[int, ...]) -> torch.Tensor:
        return (torch.rand(shape, generator=self._gen) * 2 - 1) * GARBAGE

    def _visibility(self, inputs: MlaDecoderInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's candidate latent slots and which it sees, from lengths the way a
        paged MLA kernel bounds them: a row's visible length (MLA's page count and last-page
        length where published, else its context length) and the query prefix; token ``t``
        of row ``r`` sees keys ``< length[r] - query_start[r + 1] + t + 1`` (causal
        within the step's query: :func:`~decode_runner.model.key_plan`'s bound). Positions
        play no part: they only rotate."""
        last = inputs.kv_last_page_lens
        lengths = inputs.context_lens
        if last is not None:
            pages = inputs.kv_indptr[1:] - inputs.kv_indptr[:-1]
            # padded rows: no pages, last-page length 0 -> a negative length, nothing seen
            lengths = ((pages - 1) * self.page_size + last).to(torch.int32)
        positions = inputs.positions  # unused by key_plan: query_start is given
        return key_plan(dataclasses.replace(inputs, context_lens=lengths), positions,
                        self._page_cols, self._slot_in_page, self._key_pos)

    @torch.no_grad()
    def forward(self, inputs: MlaDecoderInputs,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        inner = self.model.model
        tokens = inputs.input_ids.shape[0]
        ids = inputs.input_ids.long().clamp(0, self.vocab - 1)
        positions = inputs.positions.clamp(min=0)
        write = torch.where(inputs.slot_mapping >= 0, inputs.slot_mapping, self.trash_slot)
        # each token's visible latents: its request's pages, up to its causal bound
        key_slots, visible = self._visibility(inputs)
        h = inner.embed_tokens(ids)[None]  # [1, T, hidden]: the model's batch of one
        cos, sin = inner.rotary_emb(h, positions[None])
        r, nope = self.kv_lora_rank, self.qk_head_dim - self.rope_dim
        for index, layer in enumerate(inner.layers):
            attn = layer.self_attn
            a = layer.input_layernorm(h)
            q = (attn.q_proj(a) if attn.q_proj is not None
                 else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(a))))
            q = q.view(1, tokens, self.heads, self.qk_head_dim).transpose(1, 2)
            q_pass, q_rot = torch.split(q, [nope, self.rope_dim], dim=-1)
            kv_nope, k_rot = torch.split(attn.kv_a_proj_with_mqa(a), [r, self.rope_dim], dim=-1)
            kv_nope = attn.kv_a_layernorm(kv_nope)
            q_rot, k_rot = self._rope(q_rot, k_rot.view(1, 1, tokens, self.rope_dim), cos, sin)
            cache = self.kv_cache[index]
            cache.index_copy_(0, write, torch.cat((kv_nope[0], k_rot[0, 0]), dim=-1))
            latents = cache[key_slots]  # [T, L, r + rope]: the gathered latents
            c_kv, k_pe = latents[..., :r], latents[..., r:]
            # kv_b_proj absorbed, as MLA decode kernels do: the query's no-rope part is
            # taken into latent space (W_UK), attention runs over the latents themselves
            # and the latent output goes out through W_UV
            w_kv = attn.kv_b_proj.weight.view(self.heads, nope + self.v_head_dim, r)
            w_uk, w_uv = w_kv[:, :nope], w_kv[:, nope:]
            q_lat = torch.einsum("thd,hdr->thr", q_pass[0].transpose(0, 1), w_uk)
            scores = (torch.einsum("thr,tlr->thl", q_lat, c_kv)
                      + torch.einsum("thd,tld->thl", q_rot[0].transpose(0, 1), k_pe)
                      ) * attn.scaling
            scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
            weights = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0).to(c_kv.dtype)
            out_lat = torch.einsum("thl,tlr->thr", weights, c_kv)
            out = torch.einsum("thr,hvr->thv", out_lat, w_uv).reshape(1, tokens, -1)
            h = h + attn.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        hidden = inner.norm(h)[0]
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        return self.compute_logits(hidden)

    __call__ = forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()

    def move_pages(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy latent pages ``src -> dst`` in order (a page migration)."""
        ps = self.page_size
        for src, dst in moves:
            self.kv_cache[:, dst * ps:(dst + 1) * ps] = self.kv_cache[:, src * ps:(src + 1) * ps]

    def poison_pages(self, pages: Iterable[int]) -> None:
        """Refill ``pages`` (free ones: no request holds them) with large garbage, so a
        read through a stale page index, slot or length cannot pass for a correct one."""
        ps = self.page_size
        slots = [p * ps + s for p in pages for s in range(ps)]
        if not slots:
            return
        index = torch.tensor(slots, device=self.kv_cache.device)
        fill = self._garbage((self.kv_cache.shape[0], len(slots), self.kv_cache.shape[2]))
        self.kv_cache.index_copy_(1, index, fill.to(self.kv_cache))
