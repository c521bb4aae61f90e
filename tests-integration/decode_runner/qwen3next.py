"""A transformers ``Qwen3NextForCausalLM`` (Gated DeltaNet hybrid) run from published metadata.

The model's own modules do the math: embedding, norms, ``in_proj_qkvz`` / ``in_proj_ba``,
``conv1d`` weights, ``A_log`` / ``dt_bias`` gating, the gated RMS norm, ``out_proj``, the
full-attention layers' gated ``q_proj`` / ``k_norm`` / ``q_norm`` / partial rotary /
``o_proj``, the (sparse MoE) MLPs, final norm and ``lm_head``; the gated delta rule and the
causal conv are transformers' own torch implementations (``torch_chunk_gated_delta_rule``
for a multi-token chunk, ``torch_recurrent_gated_delta_rule`` for one token, as the model
itself chooses; ``causal_conv1d_fn`` / ``causal_conv1d_update``).

Only the addressing is this module's:

* full-attention layers: a paged KV cache as :class:`~decode_runner.llama.LlamaPagedDecoder`
  (``slot_mapping``, ``kv_indptr`` / ``kv_indices``, ``context_lens``, the query prefix:
  :func:`~decode_runner.model.key_plan`);
* linear-attention layers: every request's causal-conv state (``conv_dim x (kernel - 1)``)
  and recurrent state (``v_heads x k_dim x v_dim``) of every GDN layer live in one row of a
  STATE POOL (float32 ``[slots + 1, D]``; the last row takes writes of padded rows). Each
  row's initial state is the pool row the library's first reader
  (:meth:`GdnStateInputs.gather_states`: ``non_spec_state_indices_in``) selected, passed in
  as :attr:`GdnDecoderInputs.initial_states`; the final state goes to the published
  ``non_spec_state_indices`` (:attr:`GdnDecoderInputs.state_write`). A row starts from zero
  state when it has no earlier tokens (``context_lens - query length == 0``, as a kernel's
  ``has_initial_state``), whatever its slot holds.

The pool starts as large garbage and :meth:`poison_slots` refills freed slots, so a wrong
read slot or a missed write changes the output.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    apply_rotary_pos_emb,
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from .model import DecoderInputs, key_plan

GARBAGE = 1.0e4


@dataclass(frozen=True)
class GdnDecoderInputs(DecoderInputs):
    """:class:`DecoderInputs` plus the GDN state addressing: ``initial_states`` float32
    ``[R, D]`` (each row's pool row as the first reader gathered it; 0 for padded rows) and
    ``state_write`` int32 ``[R]`` (the published slot each row's final state goes to;
    ``-1`` for padded rows)."""

    initial_states: torch.Tensor | None = None
    state_write: torch.Tensor | None = None


class Qwen3NextPagedDecoder:
    """``model`` (a ``Qwen3NextForCausalLM``, eval mode, float32) over a paged KV cache of
    ``num_pages`` pages of ``page_size`` slots and a state pool of ``num_state_slots``
    rows."""

    def __init__(self, model: torch.nn.Module, *, page_size: int, num_pages: int,
                 max_pages: int, num_state_slots: int) -> None:
        cfg = model.config
        self.model = model
        self.page_size = page_size
        self.max_pages = max_pages
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.vocab = cfg.vocab_size
        self.layer_types = list(cfg.layer_types)
        dev = next(model.parameters()).device
        self._gen = gen = torch.Generator().manual_seed(4321)
        slots = num_pages * page_size
        self.trash_slot = slots
        attn_layers = self.layer_types.count("full_attention")
        self.kv_cache = ((torch.rand(max(attn_layers, 1), 2, slots + 1, self.kv_heads,
                                     self.head_dim, generator=gen) * 2 - 1) * GARBAGE).to(dev)
        # the state row's layout: per GDN layer, (conv state, recurrent state) flattened
        self._state_parts: dict[int, tuple[int, tuple[int, ...], int, tuple[int, ...]]] = {}
        off = 0
        for i, kind in enumerate(self.layer_types):
            if kind != "linear_attention":
                continue
            la = model.model.layers[i].linear_attn
            conv = (la.conv_dim, la.conv_kernel_size - 1)
            rec = (la.num_v_heads, la.head_k_dim, la.head_v_dim)
            self._state_parts[i] = (off, conv, off + conv[0] * conv[1], rec)
            off += conv[0] * conv[1] + rec[0] * rec[1] * rec[2]
        self.state_width = off
        self.num_state_slots = num_state_slots
        self.state_trash = num_state_slots  # padded rows write here; no index names it
        self.state_pool = ((torch.rand(num_state_slots + 1, off, generator=gen) * 2 - 1)
                           * GARBAGE).to(dev)
        self._page_cols = torch.arange(max_pages, device=dev)
        self._slot_in_page = torch.arange(page_size, device=dev)
        self._key_pos = torch.arange(max_pages * page_size, device=dev)

    @property
    def embed(self) -> torch.Tensor:
        return self.model.model.embed_tokens.weight

    # -- state rows ------------------------------------------------------------------------
    def _split(self, rows: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        c_off, conv, r_off, rec = self._state_parts[layer]
        n = rows.shape[0]
        c = rows[:, c_off:c_off + conv[0] * conv[1]].reshape(n, *conv)
        r = rows[:, r_off:r_off + rec[0] * rec[1] * rec[2]].reshape(n, *rec)
        return c, r

    def poison_slots(self, slots: Iterable[int]) -> None:
        """Refill pool rows ``slots`` (freed state slots) with large garbage."""
        index = sorted(set(slots))
        if not index:
            return
        fill = (torch.rand(len(index), self.state_width, generator=self._gen) * 2 - 1) * GARBAGE
        self.state_pool.index_copy_(0, torch.tensor(index, device=self.state_pool.device),
                                    fill.to(self.state_pool))

    # -- the forward -----------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, inputs: GdnDecoderInputs,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        assert inputs.initial_states is not None and inputs.state_write is not None
        assert inputs.query_start is not None
        inner = self.model.model
        tokens = inputs.input_ids.shape[0]
        rows = inputs.num_rows
        ids = inputs.input_ids.long().clamp(0, self.vocab - 1)
        positions = inputs.positions.clamp(min=0)
        write = torch.where(inputs.slot_mapping >= 0, inputs.slot_mapping, self.trash_slot)
        key_slots, visible = key_plan(inputs, positions, self._page_cols, self._slot_in_page,
                                      self._key_pos)
        qs = inputs.query_start.long()
        qlen = qs[1:] - qs[:-1]
        # has_initial_state: the row ran tokens before this step (the metadata's lengths)
        has_initial = (inputs.context_lens.long() - qlen) > 0
        states = torch.where(has_initial[:, None], inputs.initial_states[:rows], 0.0)
        new_states = states.clone()
        bounds = qs.tolist()  # host copy of the query prefix: the test model's row loop
        one_token = tokens == rows and all(b - a == 1 for a, b in itertools.pairwise(bounds))
        h = inner.embed_tokens(ids)[None]
        cos, sin = inner.rotary_emb(h, positions[None])
        attn_index = 0
        for index, layer in enumerate(inner.layers):
            a = layer.input_layernorm(h)
            if self.layer_types[index] == "linear_attention":
                out = self._gdn(layer.linear_attn, index, a[0], bounds, one_token, states,
                                new_states, has_initial)
            else:
                out = self._attention(layer.self_attn, attn_index, a, cos, sin, write,
                                      key_slots, visible, tokens)
                attn_index += 1
            h = h + out[None]
            m = layer.mlp(layer.post_attention_layernorm(h))
            h = h + (m[0] if isinstance(m, tuple) else m)
        dst = torch.where(inputs.state_write[:rows] >= 0, inputs.state_write[:rows].long(),
                          self.state_trash)
        self.state_pool.index_copy_(0, dst, new_states)
        hidden = inner.norm(h)[0]
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        return self.compute_logits(hidden)

    __call__ = forward

    def _attention(self, attn: torch.nn.Module, index: int, a: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, write: torch.Tensor, key_slots: torch.Tensor,
                   visible: torch.Tensor, tokens: int) -> torch.Tensor:
        hd = self.head_dim
        q, gate = torch.chunk(attn.q_proj(a).view(1, tokens, -1, hd * 2), 2, dim=-1)
        gate = gate.reshape(1, tokens, -1)
        q = attn.q_norm(q).transpose(1, 2)
        k = attn.k_norm(attn.k_proj(a).view(1, tokens, -1, hd)).transpose(1, 2)
        v = attn.v_proj(a).view(1, tokens, -1, hd).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        cache_k, cache_v = self.kv_cache[index, 0], self.kv_cache[index, 1]
        cache_k.index_copy_(0, write, k[0].transpose(0, 1))
        cache_v.index_copy_(0, write, v[0].transpose(0, 1))
        group = self.heads // self.kv_heads
        gk = cache_k[key_slots].repeat_interleave(group, dim=2)
        gv = cache_v[key_slots].repeat_interleave(group, dim=2)
        scores = torch.einsum("thd,tlhd->thl", q[0].transpose(0, 1), gk) * attn.scaling
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        weights = torch.softmax(scores.float(), dim=-1).nan_to_num(0.0)
        out = torch.einsum("thl,tlhd->thd", weights, gv).reshape(1, tokens, -1)
        out = out * torch.sigmoid(gate)
        return attn.o_proj(out)[0]

    def _gdn(self, la: torch.nn.Module, index: int, a: torch.Tensor, bounds: list[int],
             one_token: bool, states: torch.Tensor, new_states: torch.Tensor,
             has_initial: torch.Tensor) -> torch.Tensor:
        """The GDN layer over ``a`` ``[T, hidden]``: each row's conv and recurrent state
        from ``states`` (its gathered pool row), the final ones into ``new_states``."""
        conv0, rec0 = self._split(states, index)
        conv_new, rec_new = self._split(new_states, index)  # views: written in place
        qkvz = la.in_proj_qkvz(a)[None]
        ba = la.in_proj_ba(a)[None]
        query, key, value, z, b, g_in = la.fix_query_key_value_ordering(qkvz, ba)
        query, key, value = (x.reshape(1, x.shape[1], -1) for x in (query, key, value))
        mixed = torch.cat((query, key, value), dim=-1)  # [1, T, C]
        weight = la.conv1d.weight.squeeze(1)
        beta = b.sigmoid()
        g = -la.A_log.float().exp() * torch.nn.functional.softplus(g_in.float() + la.dt_bias)
        kd, vd = la.head_k_dim, la.head_v_dim
        core = torch.empty(1, a.shape[0], la.num_v_heads, vd, dtype=a.dtype, device=a.device)
        if one_token:  # decode: every row one token, batched as the model's decode path
            rows = a.shape[0]
            x = mixed[0][:, :, None]  # [R, C, 1]
            conv_state = conv0.clone()
            y = causal_conv1d_update(x, conv_state, weight, la.conv1d.bias, la.activation)
            conv_new.copy_(conv_state)
            y = y[:, :, 0]
            q_, k_, v_ = torch.split(y, [la.key_dim, la.key_dim, la.value_dim], dim=-1)
            o, last = torch_recurrent_gated_delta_rule(
                q_.reshape(rows, 1, -1, kd), k_.reshape(rows, 1, -1, kd),
                v_.reshape(rows, 1, -1, vd), g=g[0][:, None], beta=beta[0][:, None],
                initial_state=rec0, output_final_state=True, use_qk_l2norm_in_kernel=True)
            core[0] = o[:, 0]
            rec_new.copy_(last)
        else:
            initial = has_initial.tolist()
            for r, (s, e) in enumerate(itertools.pairwise(bounds)):
                n = e - s
                if n == 0:
                    continue
                x = mixed[:, s:e].transpose(1, 2)  # [1, C, n]
                full = torch.cat([conv0[r:r + 1], x], dim=-1)  # zeros when no initial state
                conv_new[r] = full[0, :, -conv0.shape[-1]:]
                y = causal_conv1d_fn(full, weight, la.conv1d.bias,
                                     activation=la.activation)[:, :, -n:].transpose(1, 2)
                q_, k_, v_ = torch.split(y, [la.key_dim, la.key_dim, la.value_dim], dim=-1)
                rule = torch_recurrent_gated_delta_rule if (n == 1 and initial[r]) \
                    else torch_chunk_gated_delta_rule
                o, last = rule(
                    q_.reshape(1, n, -1, kd), k_.reshape(1, n, -1, kd),
                    v_.reshape(1, n, -1, vd), g=g[:, s:e], beta=beta[:, s:e],
                    initial_state=rec0[r:r + 1] if initial[r] else None,
                    output_final_state=True, use_qk_l2norm_in_kernel=True)
                core[0, s:e] = o[0]
                rec_new[r] = last[0]
        z_shape = z.shape
        out = la.norm(core.reshape(-1, vd), z.reshape(-1, vd)).reshape(z_shape)
        return la.out_proj(out.reshape(1, a.shape[0], -1))[0]

    @torch.no_grad()
    def run_tokens(self, ids: torch.Tensor, initial: torch.Tensor, has_initial: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """A verify step of a model whose layers are all ``linear_attention``: ``ids``
        ``[R, L]`` (each row's pending token and drafts) run token by token from each row's
        ``initial`` state row (zero where ``has_initial`` is False), through the model's
        one-token path (``causal_conv1d_update``, ``torch_recurrent_gated_delta_rule``).
        Returns the logits ``[R, L, vocab]`` and the state row after every token
        ``[R, L, D]``: the caller writes row ``j`` to the request's speculative slot ``j``."""
        assert set(self.layer_types) == {"linear_attention"}
        inner = self.model.model
        rows, length = ids.shape
        state = torch.where(has_initial[:, None], initial[:rows], 0.0).clone()
        after = torch.empty(rows, length, self.state_width, device=state.device)
        h = inner.embed_tokens(ids.long())  # [R, L, hidden]
        for index, layer in enumerate(inner.layers):
            la = layer.linear_attn
            a = layer.input_layernorm(h)
            conv, rec = self._split(state, index)  # views of ``state``: updated in place
            qkvz, ba = la.in_proj_qkvz(a), la.in_proj_ba(a)
            query, key, value, z, b, g_in = la.fix_query_key_value_ordering(qkvz, ba)
            query, key, value = (x.reshape(rows, length, -1) for x in (query, key, value))
            mixed = torch.cat((query, key, value), dim=-1)
            beta = b.sigmoid()
            g = -la.A_log.float().exp() * torch.nn.functional.softplus(g_in.float() + la.dt_bias)
            kd, vd = la.head_k_dim, la.head_v_dim
            core = torch.empty(rows, length, la.num_v_heads, vd, device=h.device)
            for j in range(length):
                conv_state = conv.clone()
                y = causal_conv1d_update(mixed[:, j, :, None], conv_state,
                                         la.conv1d.weight.squeeze(1), la.conv1d.bias,
                                         la.activation)[:, :, 0]
                conv.copy_(conv_state)
                q_, k_, v_ = torch.split(y, [la.key_dim, la.key_dim, la.value_dim], dim=-1)
                o, last = torch_recurrent_gated_delta_rule(
                    q_.reshape(rows, 1, -1, kd), k_.reshape(rows, 1, -1, kd),
                    v_.reshape(rows, 1, -1, vd), g=g[:, j:j + 1], beta=beta[:, j:j + 1],
                    initial_state=rec.clone(), output_final_state=True,
                    use_qk_l2norm_in_kernel=True)
                rec.copy_(last)
                core[:, j] = o[:, 0]
                c_off, cs, r_off, rs = self._state_parts[index]
                after[:, j, c_off:c_off + cs[0] * cs[1]] = conv.reshape(rows, -1)
                after[:, j, r_off:r_off + rs[0] * rs[1] * rs[2]] = rec.reshape(rows, -1)
            out = la.norm(core.reshape(-1, vd), z.reshape(-1, vd)).reshape(z.shape)
            h = h + la.out_proj(out.reshape(rows, length, -1))
            m = layer.mlp(layer.post_attention_layernorm(h))
            h = h + (m[0] if isinstance(m, tuple) else m)
        return self.compute_logits(inner.norm(h)), after

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(hidden).float()

    def move_pages(self, moves: Iterable[tuple[int, int]]) -> None:
        ps = self.page_size
        for src, dst in moves:
            self.kv_cache[:, :, dst * ps:(dst + 1) * ps] = self.kv_cache[:, :, src * ps:
                                                                         (src + 1) * ps]

    def poison_pages(self, pages: Iterable[int]) -> None:
        ps = self.page_size
        slots = [p * ps + s for p in pages for s in range(ps)]
        if not slots:
            return
        index = torch.tensor(slots, device=self.kv_cache.device)
        c = self.kv_cache
        fill = (torch.rand(c.shape[0], 2, len(slots), *c.shape[3:], generator=self._gen)
                * 2 - 1) * GARBAGE
        c.index_copy_(2, index, fill.to(c))
