"""A transformers ``DeepseekV4ForCausalLM`` run over paged, slot-addressed V4 storage.

transformers keeps V4's attention state per request and dense: a sliding window of keys
(K = V, one shared head), each compressor's unfinished window and overlap, and the list of
compressed entries. This decoder keeps it the way a paged V4 engine does, in one KV ROW
SPACE (float32 rows of ``head_dim``) plus per-slot compressor rings:

* compressed rows at the low end, one ENVELOPE per 256-token block: every compressed
  layer's rows of the block (HCA layers first, 2 rows each, then CSA layers, 64 each); the
  CSA indexer's keys sit in a second plane at the same rows;
* window rows at the high end: per state slot a ring of ``sliding_window`` positions for
  each attention class (dense, CSA, HCA), where :class:`WindowGeometry` says;
* compressor rings (:mod:`.deepseek_v4_compress`) per state slot and compressed layer.

Each layer has a VIEW BASE (a compressed layer's offset in the envelope) and reads every
published cell as a view row, ``view_base + cell``: one HCA head and one window geometry
serve all layers of a class, any number of them (:meth:`DeepseekV4PagedDecoder._window_classes`).

Every address comes from what ``v41_metadata`` publishes and its consumers derive
(:class:`V4StepInputs`): decode reads the step indptrs, the per-token block tables and the
HCA index head (step indptr generation), the window tails and each token's own row
(``write_v4_decode_window_indices``); prefill reads the extend / prefix indices
(``generate_v4_prefill_indptrs`` + ``write_v4_prefill_indices``); both run the compressors
over the published plans and state slots. The CSA top-k head of each slice is this
decoder's to fill, as the engine's ``csa_translate_pack`` does: the indexer scores the
committed entries (``n_committed_per_token`` in decode, ``indexer_visible_end`` in
prefill) through the block table and its ``min(count, index_topk)`` best become rows.
Prefill's own window keys come from the step (the extend rows); its window ring writes
go through the published ``v41_window_write_plan`` rows, at the geometry's row of
``state_slot_out``. Decode steps of several tokens per request
(verify widths) run the same path: every token writes its own window row before any reads,
and the rings are ``k`` positions longer (``spec_tokens``).

The model's modules do all the math: embedding, hyper-connections (``attn_hc`` /
``ffn_hc`` / ``hc_head``), norms, the query LoRA and its norms, ``kv_proj`` / ``kv_norm``,
both rotaries, the sinks, the grouped output projection, the compressors and indexer
(projections, ``position_bias``, ``kv_norm``, scorer), the MoE (hash routing by input ids
included), final norm and ``lm_head``. Storage starts as large garbage and freed blocks
and slots are refilled with it, so a wrong row, slot or length changes the output.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

from h2d_runner_adapters.consumers import WindowGeometry

from .deepseek_v4_compress import PlanView, Ring, compressed_rows, run_compressor

GARBAGE = 1.0e4
SLIDING, CSA, HCA = ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention")
#: window class of each layer type in :class:`WindowGeometry` (dense, CSA, HCA)
CLASS = {SLIDING: 0, CSA: 1, HCA: 2}


@dataclass(frozen=True)
class V4StepInputs:
    """One step's published members and consumer outputs, sliced to the step.

    Decode fills ``swa_indptr``..``dest`` (step indptrs, per-token block tables, the HCA
    head, window indices); prefill fills ``extend``..``visible_end``."""

    input_ids: torch.Tensor  # int32 [T]
    positions: torch.Tensor  # int64 [T]
    batch_ids: torch.Tensor  # int32 [T], -1 for padded tokens
    seq_lens: torch.Tensor  # int32 [P]
    slot_in: torch.Tensor  # int32 [P]
    slot_out: torch.Tensor  # int32 [P]
    block_tables: torch.Tensor  # int32 [S, B]
    #: per ratio: (compress plan, write plan), the published rows
    plans: dict[int, tuple[torch.Tensor, torch.Tensor]]
    #: per class (dense, CSA, HCA): (indptr [T + 1], indices)
    slices: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    prefill: bool
    committed: torch.Tensor  # int32 [T]: CSA entries each token may score
    tables_per_token: torch.Tensor | None = None  # decode: int32 [T, B]
    dest: tuple[torch.Tensor, ...] | None = None  # decode: each token's own window rows
    extend: tuple[torch.Tensor, torch.Tensor] | None = None  # prefill: (indptr, rows)
    #: prefill: the published window-write rows ``[token, request, position, _]``
    window_writes: torch.Tensor | None = None


def _ranges(indptr: torch.Tensor, values: torch.Tensor, width: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's slice ``values[indptr[t]:indptr[t + 1]]`` as ``[T, width]`` cells (the
    cell index, its value, whether it lies in the slice)."""
    t = indptr.shape[0] - 1
    start = indptr[:t].long()
    length = indptr[1:].long() - start
    col = torch.arange(width, device=values.device)
    inside = col[None, :] < length[:, None]
    cell = (start[:, None] + col[None, :]).clamp(0, max(values.shape[0] - 1, 0))
    return cell, values[cell], inside


class DeepseekV4PagedDecoder:
    """``model`` (a ``DeepseekV4ForCausalLM``, eval, float32) over ``num_blocks`` blocks of
    compressed rows and ``num_state_slots`` state slots (the adapter's dummy slot after
    them); ``max_blocks`` bounds one request's table. ``spec_tokens`` (``k``: the draft
    tokens a verify step adds to each query) lengthens every ring by ``k`` positions, so a
    step's writes never overwrite a position another of its tokens still reads, and
    rejected drafts never overwrite an accepted one."""

    def __init__(self, model: torch.nn.Module, *, num_blocks: int, max_blocks: int,
                 num_state_slots: int, spec_tokens: int = 0) -> None:
        # transformers' modules: attributes mypy cannot see through nn.Module
        net: Any = model
        self.model = net
        cfg: Any = net.config
        self.types: list[str] = list(cfg.layer_types)
        self.rates: dict[str, int] = dict(cfg.compress_rates)
        self.window: int = cfg.sliding_window
        self.topk: int = cfg.index_topk
        self.head_dim: int = cfg.head_dim
        self.heads: int = cfg.num_attention_heads
        self.vocab: int = cfg.vocab_size
        self.max_blocks = max_blocks
        self.num_blocks = num_blocks
        dev = next(model.parameters()).device
        # the garbage is drawn where the storage lives (a GPU's planes, no host detour);
        # on CPU the same draws as ever
        self._gen = torch.Generator(device=dev).manual_seed(4242)
        #: the embedding table: the model's first kernel gathers the step's ids from it
        #: (what the main job's span runs eagerly, as for the other decoders)
        self.embed: torch.Tensor = net.model.embed_tokens.weight
        # the envelope: HCA layers first, then CSA (the row-space order of the context doc)
        self.bases: dict[int, int] = {}
        rows = 0
        for kind in (HCA, CSA):
            for i, t in enumerate(self.types):
                if t == kind:
                    self.bases[i] = rows
                    rows += 256 // self.rates[t]
        self.envelope_rows = rows
        r = self.window + spec_tokens
        self.spec_tokens = spec_tokens
        self.slots = num_state_slots + 1  # + the adapter's dummy slot
        self.win_base = num_blocks * rows
        self.view, classes, slot_rows = self._window_classes(r)
        #: window rings: one class after the other inside a slot, all above the blocks
        self.geometry = WindowGeometry(slot_rows=slot_rows, ring_positions=r, classes=classes)
        self.trash_row = self.win_base + self.slots * slot_rows
        self.kv = self._garbage((self.trash_row + 1, cfg.head_dim))
        self.index_kv = self._garbage((self.trash_row + 1, cfg.index_head_dim))
        self.rings: dict[tuple[int, str], Ring] = {}
        for i, t in enumerate(self.types):
            if t == SLIDING:
                continue
            comp = net.model.layers[i].self_attn.compressor
            k = (2 * self.rates[t] if t == CSA else self.rates[t]) + spec_tokens
            width = 2 * cfg.head_dim if t == CSA else cfg.head_dim
            self.rings[(i, "main")] = self._ring(k, width)
            if t == CSA:
                self.rings[(i, "index")] = self._ring(k, 2 * comp.indexer.head_dim)

    def _window_classes(self, r: int) -> tuple[dict[int, int], Any, int]:
        """Each layer's VIEW BASE and the window classes, in view rows.

        Every cell the consumers publish for a layer (compressed rows of the HCA head,
        window rows of the tails, ``dest``) is a view row: relative to the reading layer's
        view base, so that one published slice serves every layer of its class. A
        compressed layer's view base is its offset in the block envelope (the HCA head's
        ``block * envelope_rows + e % 2`` then lands on that layer's rows); a sliding
        layer's is ``j * r`` for the ``j``-th. Inside a slot each class interleaves its
        layers, ``stride`` rows each (``run_rows = layers * stride``: the envelope's
        rows per layer for compressed classes), so view base + window row is the layer's
        own ring row, and each class's ring start is given relative to its first layer's
        view base."""
        view: dict[int, int] = {}
        classes = []
        at = self.win_base
        for kind, stride in ((SLIDING, r), (CSA, 64), (HCA, 2)):
            layers = [i for i, t in enumerate(self.types) if t == kind]
            for j, i in enumerate(layers):
                view[i] = j * stride if kind == SLIDING else self.bases[i]
            run = max(len(layers), 1) * stride
            classes.append((at - (view[layers[0]] if layers else 0), stride, run))
            at += -(-r // stride) * run
        return view, tuple(classes), at - self.win_base

    def _garbage(self, shape: tuple[int, ...]) -> torch.Tensor:
        rand = torch.rand(shape, generator=self._gen, device=self._gen.device)
        return (rand * 2 - 1) * GARBAGE

    def _ring(self, k: int, width: int) -> Ring:
        return Ring(self._garbage((self.slots + 1, k, width)),
                    self._garbage((self.slots + 1, k, width)))

    # -- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, inputs: V4StepInputs,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        inner = self.model.model
        ids = inputs.input_ids.long().clamp(0, self.vocab - 1)
        pos = inputs.positions.clamp(min=0)
        e = inner.embed_tokens(ids)[None]  # [1, T, hidden]: the model's batch of one
        h = e.unsqueeze(2).expand(-1, -1, self.model.config.hc_mult, -1).contiguous()
        rope = {kind: inner.rotary_emb(e, position_ids=pos[None], layer_type=kind)
                for kind in ("main", "compress")}
        for i, layer in enumerate(inner.layers):
            post, comb, collapsed = layer.attn_hc(h)
            out = self._attention(i, layer.self_attn, layer.input_layernorm(collapsed)[0],
                                  inputs, rope)
            h = post.unsqueeze(-1) * out[None].unsqueeze(-2) + torch.matmul(
                comb.transpose(-1, -2), h)
            post, comb, collapsed = layer.ffn_hc(h)
            mlp = layer.mlp(layer.post_attention_layernorm(collapsed), input_ids=ids[None])
            h = post.unsqueeze(-1) * mlp.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), h)
        hidden = inner.norm(inner.hc_head(h))[0]
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        return self.model.lm_head(hidden).float()

    __call__ = forward

    def _attention(self, i: int, attn: Any, x: torch.Tensor,
                   inputs: V4StepInputs, rope: dict[str, tuple[torch.Tensor, torch.Tensor]]
                   ) -> torch.Tensor:
        kind = self.types[i]
        cos, sin = rope[attn.rope_layer_type]
        t = x.shape[0]
        q_res = attn.q_a_norm(attn.q_a_proj(x))
        q = attn.q_b_norm(attn.q_b_proj(q_res).view(1, t, self.heads, -1).transpose(1, 2))
        q = apply_rotary_pos_emb(q, cos, sin)[0]  # [H, T, D]
        kv = attn.kv_norm(attn.kv_proj(x)).view(1, t, 1, -1).transpose(1, 2)
        kv = apply_rotary_pos_emb(kv, cos, sin)[0, 0]  # [T, D]
        if kind != SLIDING:  # close windows into the blocks, update the rings
            self._compress(i, attn.compressor, x, inputs)
        cls = CLASS[kind]
        view = self.view[i]  # every published cell is a view row: this layer adds its base
        real = inputs.batch_ids >= 0
        if not inputs.prefill:  # the token's own window row first: it sees itself
            assert inputs.dest is not None
            self.kv.index_copy_(
                0, torch.where(real, inputs.dest[cls].long() + view, self.trash_row), kv)
        indptr, cells = inputs.slices[cls]
        if kind == CSA:
            self._fill_topk(i, attn.compressor.indexer, x, q_res, inputs, indptr, cells)
        width = self.window + max(self.topk, 2 * self.max_blocks)
        _, rows, inside = _ranges(indptr, cells, width)
        inside &= rows >= 0
        keys = self.kv[torch.where(inside, rows.long() + view, self.trash_row)]  # [T, L, D]
        if inputs.prefill:  # the chunk's own keys: the extend rows of the step
            assert inputs.extend is not None
            _, ext, ext_in = _ranges(*inputs.extend, self.window)
            keys = torch.cat([kv[ext.clamp(0, t - 1).long()], keys], dim=1)
            inside = torch.cat([ext_in, inside], dim=1)
            self._write_window(cls, view, kv, inputs)
        out = self._softmax_with_sinks(attn, q, keys, inside)  # [T, H, D]
        out = apply_rotary_pos_emb(out.transpose(0, 1)[None], cos, -sin)[0].transpose(0, 1)
        grouped = out.reshape(1, t, self.model.config.o_groups, -1)
        return attn.o_b_proj(attn.o_a_proj(grouped).flatten(2))[0]

    @staticmethod
    def _softmax_with_sinks(attn: Any, q: torch.Tensor, keys: torch.Tensor,
                            inside: torch.Tensor) -> torch.Tensor:
        """transformers' eager V4 attention over each token's gathered keys (K = V): the
        per-head sink joins the softmax and is dropped after it."""
        scores = torch.einsum("htd,tld->thl", q, keys) * attn.scaling
        scores = scores.masked_fill(~inside[:, None, :], float("-inf"))
        sinks = attn.sinks.float().view(1, -1, 1).expand(scores.shape[0], -1, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return torch.einsum("thl,tld->thd", probs, keys)

    def _compress(self, i: int, comp: Any, x: torch.Tensor,
                  inputs: V4StepInputs) -> None:
        kind = self.types[i]
        ratio = self.rates[kind]
        compress, write = inputs.plans[ratio]
        view = PlanView(compress, write, inputs.slot_in, inputs.slot_out,
                        inputs.block_tables, self.envelope_rows, self.bases[i])
        run_compressor(comp, x, self.rings[(i, "main")], view, self.kv, ratio=ratio,
                       overlap=kind == CSA)
        if kind == CSA:
            run_compressor(comp.indexer, x, self.rings[(i, "index")], view, self.index_kv,
                           ratio=ratio, overlap=True)

    def _fill_topk(self, i: int, indexer: Any, x: torch.Tensor,
                   q_res: torch.Tensor, inputs: V4StepInputs, indptr: torch.Tensor,
                   cells: torch.Tensor) -> None:
        """The CSA slice heads: each token's ``min(committed, index_topk)`` best committed
        entries by the model's indexer, as compressed rows (``csa_translate_pack``)."""
        t = x.shape[0]
        ratio = self.rates[CSA]
        width = self.max_blocks * (256 // ratio)
        entries = torch.arange(width, device=x.device)
        b = inputs.batch_ids.clamp(min=0).long()
        if inputs.tables_per_token is not None:  # decode: each token's own table row
            tables, who = inputs.tables_per_token, torch.arange(t, device=x.device)
        else:
            tables, who = inputs.block_tables, b
        rows = compressed_rows(tables, who[:, None], entries[None, :], ratio,
                               self.envelope_rows, self.bases[i])  # [T, E]
        committed = torch.where(inputs.batch_ids >= 0, inputs.committed, 0).long()
        seen = entries[None, :] < committed[:, None]
        keys = self.index_kv[torch.where(seen, rows, self.trash_row)]
        cos, sin = indexer.rotary_emb(x, position_ids=inputs.positions.clamp(min=0)[None],
                                      layer_type=indexer.rope_layer_type)
        q = indexer.q_b_proj(q_res).view(1, t, -1, indexer.head_dim).transpose(1, 2)
        q = apply_rotary_pos_emb(q, cos, sin).transpose(1, 2)[0]  # [T, H, d]
        scores = indexer.scorer(q[:, None], keys, x[:, None])[:, 0]  # [T, E]
        scores = scores.masked_fill(~seen, float("-inf"))
        k = min(self.topk, width)
        best = scores.topk(k, dim=-1).indices  # [T, k]
        count = committed.clamp(max=self.topk)
        value = (rows.gather(1, best) - self.view[i]).to(cells.dtype)  # view rows
        # every cell finds its token (the slice it lies in) and column: the first
        # ``count`` columns of a slice take the best rows, the others keep what they hold.
        # No mask indexing (its nonzero would make the host wait on the GPU every layer)
        cell = torch.arange(cells.shape[0], device=x.device, dtype=indptr.dtype)
        owner = (torch.searchsorted(indptr[: t + 1], cell, right=True) - 1).clamp(0, t - 1)
        col = cell.long() - indptr[owner].long()
        keep = (col >= 0) & (col < count[owner]) & (col < k)
        cells.copy_(torch.where(keep, value[owner, col.clamp(0, k - 1)], cells))

    def _write_window(self, cls: int, view: int, kv: torch.Tensor,
                      inputs: V4StepInputs) -> None:
        """Prefill's window ring writes, through the published window-write rows: each
        live row's token at the geometry's row of (``state_slot_out``, position), plus the
        layer's view base; ``-1`` rows write the trash row."""
        assert inputs.window_writes is not None
        w = inputs.window_writes.long()
        live = w[:, 2] >= 0
        pos = w[:, 2].clamp(min=0)
        start, stride, run = self.geometry.classes[cls]
        r = pos % self.geometry.ring_positions
        slot = inputs.slot_out.long()[w[:, 1].clamp(min=0)]
        row = view + slot * self.geometry.slot_rows + start + (r // stride) * run + r % stride
        tok = w[:, 0].clamp(0, kv.shape[0] - 1)
        self.kv.index_copy_(0, torch.where(live, row, self.trash_row), kv[tok])

    # -- storage events ---------------------------------------------------------------------
    def _block_rows(self, block: int) -> slice:
        return slice(block * self.envelope_rows, (block + 1) * self.envelope_rows)

    def move_pages(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy blocks ``src -> dst`` in order (a migration): every compressed plane."""
        for src, dst in moves:
            for plane in (self.kv, self.index_kv):
                plane[self._block_rows(dst)] = plane[self._block_rows(src)]

    def poison_pages(self, blocks: Iterable[int]) -> None:
        """Refill free blocks' compressed rows with garbage."""
        for block in blocks:
            for plane in (self.kv, self.index_kv):
                rows = self._block_rows(block)
                plane[rows] = self._garbage(tuple(plane[rows].shape)).to(plane)

    def poison_slots(self, slots: Iterable[int]) -> None:
        """Refill freed state slots (window rings and compressor rings) with garbage."""
        g = self.geometry
        for s in slots:
            rows = slice(self.win_base + s * g.slot_rows,
                         self.win_base + (s + 1) * g.slot_rows)
            self.kv[rows] = self._garbage(tuple(self.kv[rows].shape)).to(self.kv)
            for ring in self.rings.values():
                for t in (ring.kv, ring.score):
                    t[s] = self._garbage(tuple(t[s].shape)).to(t)
