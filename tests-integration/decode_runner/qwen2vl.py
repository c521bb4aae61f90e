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
:class:`~decode_runner.llama.LlamaPagedDecoder` (whose cache and layer loop this reuses): KV
slots, each token's visible keys (its request's pages, its context length, the published
query prefix: :func:`~decode_runner.model.key_plan`), and the rotation (the planes; the 1-D
``positions`` member is not published for an MRoPE model and bounds nothing here).

The vision tower is not run: an image placeholder token (the published id equals the
config's ``image_token_id``) takes its row of the step's ``mm_embeds``, the engine's
stand-in features, as the model's own ``get_placeholder_mask`` / ``masked_scatter`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb

from .llama import LlamaPagedDecoder
from .model import DecoderInputError, DecoderInputs


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


class Qwen2VLPagedDecoder(LlamaPagedDecoder):
    """``model`` (a ``Qwen2VLForConditionalGeneration``, eval mode) over a paged KV cache
    of ``num_pages`` pages of ``page_size`` slots; ``max_pages`` bounds the pages one
    request attends to. :class:`~decode_runner.llama.LlamaPagedDecoder`'s cache, key plan
    and layer loop over the model's language model; what differs is the embedding (image
    placeholders take the step's features) and the rotation (the three published planes),
    reading :class:`MropeDecoderInputs`."""

    def __init__(self, model: Any, *, page_size: int, num_pages: int,
                 max_pages: int) -> None:
        # ``model``: transformers' module, typed loosely (its attributes are modules)
        cfg = model.config.text_config
        self._setup(model, model.model.language_model, cfg, page_size=page_size,
                    num_pages=num_pages, max_pages=max_pages,
                    head_dim=cfg.hidden_size // cfg.num_attention_heads,  # its own rule
                    seed=4321)
        self.image_token = int(model.config.image_token_id)
        #: the rotary sections (time, height, width) the rotary embedding splits by
        self.sections = tuple(int(s) for s in self.lm.rotary_emb.mrope_section)
        #: the embedding module the runner's span measurement may call (TinyDecoder's name)
        self.embed = self.lm.embed_tokens.weight

    def _embed(self, inputs: DecoderInputs, ids: torch.Tensor) -> torch.Tensor:
        h = self.lm.embed_tokens(ids)
        mm = getattr(inputs, "mm_embeds", None)
        if mm is not None:  # placeholders take the image features
            h = torch.where((ids == self.image_token)[:, None], mm.to(h), h)
        return h

    def _rotation(self, inputs: DecoderInputs, h: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        # the model's rotary embedding over the three planes: position_ids (3, 1, T)
        planes = getattr(inputs, "mrope_positions", None)
        if planes is None:
            raise DecoderInputError(
                "Qwen2VLPagedDecoder reads MropeDecoderInputs: pass the published planes")
        return self.lm.rotary_emb(h, planes[:, None, :])

    _apply_rotary = staticmethod(apply_rotary_pos_emb)
