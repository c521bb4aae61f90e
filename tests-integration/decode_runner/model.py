"""A small paged-attention decoder whose attention reads published metadata.

Pre-norm transformer (RMSNorm, RoPE, multi-head attention, gated SiLU MLP) with random
weights and a paged KV cache. Its inputs (:class:`DecoderInputs`) are exactly the metadata
a runner publishes: input ids, positions, slot mapping, the request row of each token, the
CSR page lists ``kv_indptr``/``kv_indices`` from KV-index generation, and context lengths.

:meth:`TinyDecoder.forward` has static shapes and never reads a device value on the host,
so a decode step at a padded batch size can be captured in a CUDA graph. Each layer

1. writes every token's K/V to its slot (slot ``-1``: written to a trash slot that no page
   maps, so nothing real changes), then
2. lets each token attend to the keys of its request's pages at key positions
   ``<= its position`` and ``< its request's context length`` (causal over the cached prefix
   plus the current chunk). Pages are gathered through a fixed ``max_pages`` bound per
   request; a token with no valid key gets a zero attention output, not NaN.

:meth:`TinyDecoder.forward_reference` (Python loops, float64, its own KV cache) and
:meth:`TinyDecoder.reference_sequence_logits` (dense causal attention, no paging) are the
oracles the tests compare against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "DecoderInputError",
    "DecoderInputs",
    "TinyDecoder",
    "TinyDecoderConfig",
    "greedy",
    "key_plan",
]


class DecoderInputError(ValueError):
    """A :class:`DecoderInputs` tensor has the wrong dtype, shape or device."""


@dataclass(frozen=True)
class TinyDecoderConfig:
    """Model and KV-pool shape. ``dtype`` is the weight/KV dtype (fp32 on CPU, fp16/bf16
    on GPU as the caller chooses)."""

    vocab: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    head_dim: int = 16
    page_size: int = 16
    num_pages: int = 64
    dtype: torch.dtype = torch.float32
    rope_theta: float = 10000.0

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "layers", "heads", "head_dim", "page_size",
                     "num_pages"):
            if getattr(self, name) < 1:
                raise ValueError(f"TinyDecoderConfig.{name} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.head_dim % 2:
            raise ValueError(f"TinyDecoderConfig.head_dim must be even for RoPE, got "
                             f"{self.head_dim}")

    @property
    def num_slots(self) -> int:
        """KV slots the pages map (``num_pages * page_size``)."""
        return self.num_pages * self.page_size

    @property
    def intermediate(self) -> int:
        return 2 * self.hidden


_INPUT_DTYPES: dict[str, torch.dtype] = {
    "input_ids": torch.int32,
    "positions": torch.int64,
    "slot_mapping": torch.int64,
    "token_request": torch.int32,
    "kv_indptr": torch.int32,
    "kv_indices": torch.int32,
    "context_lens": torch.int32,
}


@dataclass(frozen=True)
class DecoderInputs:
    """One step's metadata as device tensors (``T`` tokens, ``R`` request rows).

    * ``input_ids`` int32 ``[T]``, ``positions`` int64 ``[T]``;
    * ``slot_mapping`` int64 ``[T]``: KV slot of each token, ``-1`` = do not write;
    * ``token_request`` int32 ``[T]``: request row of each token (padded tokens point at a
      padded row);
    * ``kv_indptr`` int32 ``[R+1]`` and ``kv_indices`` int32 ``[>= 1]``: CSR pages per row;
      padded rows own no pages (their indptr repeats the total);
    * ``context_lens`` int32 ``[R]``: tokens in KV after this step (0 for padded rows);
    * ``query_start`` (optional) int32 ``[R+1]``: the published query prefix
      (``cu_seqlens_q``). Given, each token's visible keys are bounded as a paged kernel
      bounds them, by its row's context length and the query prefix (causal within the
      step's query), and positions only rotate; without it, by its position too.

    Shapes, dtypes and devices are checked here, once, so a runner builds this over its
    fixed published destinations at init and the hot path checks nothing.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    token_request: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    context_lens: torch.Tensor
    query_start: torch.Tensor | None = None

    def __post_init__(self) -> None:
        device = self.input_ids.device
        for name, dtype in _INPUT_DTYPES.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1:
                got = (f"{t.dtype} with {t.dim()} dims" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise DecoderInputError(
                    f"DecoderInputs.{name} must be a 1-D {dtype} tensor, got {got}; "
                    "publish it with the declared dtype"
                )
            if t.device != device:
                raise DecoderInputError(
                    f"DecoderInputs.{name} lies on {t.device} but input_ids on {device}; "
                    "put every member on the model's device"
                )
        tokens = self.input_ids.shape[0]
        for name in ("positions", "slot_mapping", "token_request"):
            if getattr(self, name).shape[0] != tokens:
                raise DecoderInputError(
                    f"DecoderInputs.{name} has {getattr(self, name).shape[0]} elements for "
                    f"{tokens} tokens; every per-token member needs one per token"
                )
        if self.kv_indptr.shape[0] != self.context_lens.shape[0] + 1:
            raise DecoderInputError(
                f"DecoderInputs.kv_indptr has {self.kv_indptr.shape[0]} elements for "
                f"{self.context_lens.shape[0]} rows; it needs rows + 1"
            )
        q = self.query_start
        if q is not None and (q.dtype != torch.int32 or q.dim() != 1 or q.device != device
                              or q.shape[0] != self.context_lens.shape[0] + 1):
            raise DecoderInputError(
                "DecoderInputs.query_start must be a 1-D int32 tensor of rows + 1 elements "
                "on the model's device (the published query prefix)")
        if self.kv_indices.shape[0] < 1:
            raise DecoderInputError(
                "DecoderInputs.kv_indices is empty; give it at least one element (its "
                "capacity, not its used length)"
            )

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_rows(self) -> int:
        return int(self.context_lens.shape[0])


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Greedy token ids (int32 ``[T]``) of logits ``[T, vocab]``; ties take the lowest id."""
    return torch.argmax(logits, dim=-1).to(torch.int32)


def key_plan(inputs: DecoderInputs, positions: torch.Tensor, page_cols: torch.Tensor,
             slot_in_page: torch.Tensor, key_pos: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's candidate key slots ``[T, max_pages * page_size]`` (its request's pages
    through ``kv_indptr`` / ``kv_indices``, ``page_cols`` = ``arange(max_pages)``,
    ``slot_in_page`` = ``arange(page_size)``, ``key_pos`` = ``arange(max_pages * page_size)``)
    and which of them it may see: a page of the request, below the request's context
    length, and causal within the step's query: with ``inputs.query_start``, token ``t`` of
    row ``r`` sees keys ``<= context[r] - query_start[r + 1] + t`` (a paged kernel's bound;
    ``positions`` then play no part here), else keys ``<=`` its position. Static shapes:
    capturable."""
    tokens, max_pages, page = positions.shape[0], page_cols.shape[0], slot_in_page.shape[0]
    keys = max_pages * page
    req = inputs.token_request.long()
    start = inputs.kv_indptr.index_select(0, req).long()
    count = inputs.kv_indptr.index_select(0, req + 1).long() - start
    context = inputs.context_lens.index_select(0, req).long()
    if inputs.query_start is not None:
        ends = inputs.query_start.index_select(0, req + 1).long()
        positions = context - ends + torch.arange(tokens, device=context.device)
    last = inputs.kv_indices.shape[0] - 1
    flat = (start[:, None] + page_cols[None, :]).clamp(0, last)
    page_ok = page_cols[None, :] < count[:, None]
    pages = torch.where(page_ok, inputs.kv_indices[flat].long(), 0)
    key_slots = (pages[:, :, None] * page + slot_in_page).reshape(tokens, keys)
    visible = (
        # expand + reshape, not repeat_interleave: no output-size sync under capture
        page_ok[:, :, None].expand(tokens, max_pages, page).reshape(tokens, keys)
        & (key_pos[None, :] <= positions[:, None])
        & (key_pos[None, :] < context[:, None])
    )
    return key_slots, visible


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


class _Layer:
    __slots__ = ("norm1", "norm2", "w_down", "w_gate_up", "w_o", "w_qkv")

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.norm1 = tensors["norm1"]
        self.w_qkv = tensors["w_qkv"]
        self.w_o = tensors["w_o"]
        self.norm2 = tensors["norm2"]
        self.w_gate_up = tensors["w_gate_up"]
        self.w_down = tensors["w_down"]


class TinyDecoder:
    """Random-weight paged-attention decoder; see the module docstring.

    Weights are drawn in fp32 on the CPU from ``seed`` (so every device and dtype starts
    from the same numbers) and cast to ``config.dtype`` on ``device``. ``max_pages`` bounds
    the pages one request's tokens can attend to (default: the whole pool); keys of pages
    past it are ignored, so size it to the longest context the run can have.
    """

    def __init__(self, config: TinyDecoderConfig, device: torch.device | str = "cpu",
                 seed: int = 0, *, max_pages: int | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        self.max_pages = config.num_pages if max_pages is None else max_pages
        if self.max_pages < 1:
            raise ValueError(f"TinyDecoder max_pages must be >= 1, got {self.max_pages}")
        cfg = config
        gen = torch.Generator().manual_seed(seed)
        qkv = cfg.heads * cfg.head_dim

        def rand(*shape: int, scale: float) -> torch.Tensor:
            w = torch.randn(*shape, generator=gen, dtype=torch.float32, device="cpu") * scale
            return w.to(device=self.device, dtype=cfg.dtype)

        def norm_weight() -> torch.Tensor:
            w = 1.0 + 0.1 * torch.randn(cfg.hidden, generator=gen, dtype=torch.float32,
                                     device="cpu")
            return w.to(device=self.device, dtype=cfg.dtype)

        self.embed = rand(cfg.vocab, cfg.hidden, scale=1.0)
        self.layers = [
            _Layer({
                "norm1": norm_weight(),
                "w_qkv": rand(cfg.hidden, 3 * qkv, scale=cfg.hidden ** -0.5),
                "w_o": rand(qkv, cfg.hidden, scale=qkv ** -0.5),
                "norm2": norm_weight(),
                "w_gate_up": rand(cfg.hidden, 2 * cfg.intermediate, scale=cfg.hidden ** -0.5),
                "w_down": rand(cfg.intermediate, cfg.hidden, scale=cfg.intermediate ** -0.5),
            })
            for _ in range(cfg.layers)
        ]
        self.final_norm = norm_weight()
        self.lm_head = rand(cfg.hidden, cfg.vocab, scale=cfg.hidden ** -0.5)

        # The last slot is the trash slot: tokens with slot -1 write there, no page maps it.
        self.trash_slot = cfg.num_slots
        self.kv_cache = torch.zeros(cfg.layers, 2, cfg.num_slots + 1, cfg.heads, cfg.head_dim,
                                    dtype=cfg.dtype, device=self.device)
        half = cfg.head_dim // 2
        # host tables (device="cpu": the runner may be built under a CUDA default device)
        inv_freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64, device="cpu") * 2
                                      / cfg.head_dim)
        angles = (torch.arange(cfg.num_slots, dtype=torch.float64, device="cpu")[:, None]
                  * inv_freq[None, :])
        self._cos = angles.cos().to(device=self.device, dtype=torch.float32)
        self._sin = angles.sin().to(device=self.device, dtype=torch.float32)
        # Index vectors every forward uses, made once.
        self._page_cols = torch.arange(self.max_pages, device=self.device, dtype=torch.int64)
        self._slot_in_page = torch.arange(cfg.page_size, device=self.device, dtype=torch.int64)
        self._key_pos = torch.arange(self.max_pages * cfg.page_size, device=self.device,
                                     dtype=torch.int64)
        self._scale = cfg.head_dim ** -0.5
        self._reference_kv: torch.Tensor | None = None

    # -- fast path (static shapes, capturable) --------------------------------------------

    def forward(self, inputs: DecoderInputs,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (float32 ``[T, vocab]``, or ``[len(logits_indices), vocab]``).

        Writes this step's K/V into :attr:`kv_cache`. ``logits_indices`` (int64 token
        indices) picks the tokens to score, e.g. the last token of each prefill row.
        """
        hidden = self.hidden_states(inputs)
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        return self.compute_logits(hidden)

    __call__ = forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of final hidden states ``[T, hidden]``."""
        return (hidden @ self.lm_head).float()

    def hidden_states(self, inputs: DecoderInputs) -> torch.Tensor:
        """Final (normed) hidden states ``[T, hidden]``; writes K/V like :meth:`forward`."""
        return self.final_hidden(self.run_layers(inputs, range(self.config.layers)))

    def final_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm of the last layer's output (a pipeline's last stage)."""
        return _rms_norm(h, self.final_norm)

    def run_layers(self, inputs: DecoderInputs, layers: range,
                   hidden: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``layers`` (a pipeline stage's share) from ``hidden``, or from the token
        embeddings when None; return the un-normed hidden states and write those layers'
        K/V."""
        cfg = self.config
        tokens = inputs.input_ids.shape[0]

        # Clamps keep stale padded values inside the tables; real values are in range.
        ids = inputs.input_ids.long().clamp(0, cfg.vocab - 1)
        positions = inputs.positions.clamp(0, cfg.num_slots - 1)
        write_slots = torch.where(inputs.slot_mapping >= 0, inputs.slot_mapping,
                                  self.trash_slot)
        cos = self._cos.index_select(0, positions)[:, None, :]
        sin = self._sin.index_select(0, positions)[:, None, :]

        # Key plan shared by every layer: the slots of each token's request pages, and which
        # of them it may see.
        key_slots, key_ok = key_plan(inputs, positions, self._page_cols, self._slot_in_page,
                                     self._key_pos)
        masked = ~key_ok[:, None, :]  # [T, 1, L], broadcast over heads

        h = self.embed.index_select(0, ids) if hidden is None else hidden
        for index in layers:
            layer = self.layers[index]
            a = _rms_norm(h, layer.norm1)
            q, k, v = (a @ layer.w_qkv).view(tokens, 3, cfg.heads, cfg.head_dim).unbind(1)
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
            cache_k = self.kv_cache[index, 0]
            cache_v = self.kv_cache[index, 1]
            cache_k.index_copy_(0, write_slots, k)
            cache_v.index_copy_(0, write_slots, v)
            gathered_k = cache_k[key_slots]  # [T, L, H, D]
            gathered_v = cache_v[key_slots]
            scores = torch.einsum("thd,tlhd->thl", q, gathered_k).float() * self._scale
            scores = scores.masked_fill(masked, float("-inf"))
            # A row with no visible key has max -inf; the clamp keeps exp() at 0, not NaN.
            peak = scores.amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).min)
            weights = torch.exp(scores - peak)
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-30)
            out = torch.einsum("thl,tlhd->thd", weights.to(cfg.dtype), gathered_v)
            h = h + out.reshape(tokens, -1) @ layer.w_o
            a = _rms_norm(h, layer.norm2)
            gate, up = (a @ layer.w_gate_up).chunk(2, dim=-1)
            h = h + (torch.nn.functional.silu(gate) * up) @ layer.w_down
        return h

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        x1 = x[..., :half].float()
        x2 = x[..., half:].float()
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    # -- cache management (host side, never captured) -------------------------------------

    def move_pages(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy KV pages ``src -> dst`` in order (page migration), in both caches."""
        ps = self.config.page_size
        for src, dst in moves:
            self.kv_cache[:, :, dst * ps:(dst + 1) * ps] = self.kv_cache[:, :, src * ps:
                                                                         (src + 1) * ps]
            if self._reference_kv is not None:
                self._reference_kv[:, :, dst * ps:(dst + 1) * ps] = (
                    self._reference_kv[:, :, src * ps:(src + 1) * ps])

    def reset_cache(self) -> None:
        """Zero the KV cache and drop the reference cache."""
        self.kv_cache.zero_()
        self._reference_kv = None

    # -- oracles (float64, CPU, loops) ----------------------------------------------------

    def _f64(self) -> tuple[torch.Tensor, list[dict[str, torch.Tensor]], torch.Tensor,
                            torch.Tensor]:
        def c(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to(device="cpu", dtype=torch.float64)

        layers = [{name: c(getattr(layer, name)) for name in _Layer.__slots__}
                  for layer in self.layers]
        return c(self.embed), layers, c(self.final_norm), c(self.lm_head)

    def _ref_rope(self, x: torch.Tensor, positions: Sequence[int]) -> torch.Tensor:
        """RoPE of float64 ``x [n, H, D]``, angles computed afresh in float64."""
        cfg = self.config
        half = cfg.head_dim // 2
        inv_freq = torch.tensor([cfg.rope_theta ** (-2.0 * i / cfg.head_dim)
                                 for i in range(half)], dtype=torch.float64)
        angles = torch.tensor(list(positions), dtype=torch.float64)[:, None] * inv_freq
        c, s = angles.cos()[:, None, :], angles.sin()[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)

    @staticmethod
    def _ref_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                    scale: float) -> torch.Tensor:
        """q ``[H, D]``, keys/values ``[n, H, D]`` -> ``[H, D]``; zeros when ``n == 0``."""
        if keys.shape[0] == 0:
            return torch.zeros_like(q)
        scores = torch.einsum("hd,nhd->hn", q, keys) * scale
        return torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), values)

    def forward_reference(self, inputs: DecoderInputs) -> torch.Tensor:
        """float64 CPU logits ``[T, vocab]`` of the same step, by loops over tokens.

        Keeps its own float64 KV cache across calls (:meth:`move_pages` and
        :meth:`reset_cache` apply to it too), so a run of steps can be checked step by step.
        Attends to every page of a row, so a row with more than ``max_pages`` pages is an
        error here (the fast path would silently ignore the extra pages).
        """
        cfg = self.config
        ps = cfg.page_size
        if self._reference_kv is None:
            self._reference_kv = torch.zeros(cfg.layers, 2, cfg.num_slots, cfg.heads,
                                             cfg.head_dim, dtype=torch.float64)
        kv = self._reference_kv
        ids = inputs.input_ids.cpu().tolist()
        positions = inputs.positions.cpu().tolist()
        slots = inputs.slot_mapping.cpu().tolist()
        reqs = inputs.token_request.cpu().tolist()
        indptr = inputs.kv_indptr.cpu().tolist()
        indices = inputs.kv_indices.cpu().tolist()
        contexts = inputs.context_lens.cpu().tolist()
        for row in range(len(contexts)):
            if indptr[row + 1] - indptr[row] > self.max_pages:
                raise DecoderInputError(
                    f"row {row} has {indptr[row + 1] - indptr[row]} pages but the model "
                    f"attends to at most max_pages={self.max_pages}; raise max_pages"
                )
        embed, layers, final_norm, lm_head = self._f64()
        h = embed[torch.tensor([min(max(i, 0), cfg.vocab - 1) for i in ids],
                               dtype=torch.int64)]
        for index, layer in enumerate(layers):
            a = _rms_norm(h, layer["norm1"])
            qkv = (a @ layer["w_qkv"]).view(len(ids), 3, cfg.heads, cfg.head_dim)
            q = self._ref_rope(qkv[:, 0], positions)
            k = self._ref_rope(qkv[:, 1], positions)
            v = qkv[:, 2]
            for t, slot in enumerate(slots):
                if slot >= 0:
                    kv[index, 0, slot] = k[t]
                    kv[index, 1, slot] = v[t]
            out = torch.zeros(len(ids), cfg.heads, cfg.head_dim, dtype=torch.float64)
            for t in range(len(ids)):
                row = reqs[t]
                visible = [
                    page * ps + s
                    for j, page in enumerate(indices[indptr[row]:indptr[row + 1]])
                    for s in range(ps)
                    if j * ps + s <= positions[t] and j * ps + s < contexts[row]
                ]
                sel = torch.tensor(visible, dtype=torch.int64)
                out[t] = self._ref_attend(q[t], kv[index, 0, sel], kv[index, 1, sel],
                                          self._scale)
            h = h + out.reshape(len(ids), -1) @ layer["w_o"]
            a = _rms_norm(h, layer["norm2"])
            gate, up = (a @ layer["w_gate_up"]).chunk(2, dim=-1)
            h = h + (torch.nn.functional.silu(gate) * up) @ layer["w_down"]
        return _rms_norm(h, final_norm) @ lm_head

    def reference_sequence_logits(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float64 logits ``[n, vocab]`` of one whole sequence at positions ``0..n-1``, by
        dense causal attention: no pages, no cache. The ground truth for a request."""
        cfg = self.config
        n = len(token_ids)
        embed, layers, final_norm, lm_head = self._f64()
        h = embed[torch.tensor(list(token_ids), dtype=torch.int64)]
        for layer in layers:
            a = _rms_norm(h, layer["norm1"])
            qkv = (a @ layer["w_qkv"]).view(n, 3, cfg.heads, cfg.head_dim)
            q = self._ref_rope(qkv[:, 0], range(n))
            k = self._ref_rope(qkv[:, 1], range(n))
            v = qkv[:, 2]
            out = torch.stack([self._ref_attend(q[t], k[:t + 1], v[:t + 1], self._scale)
                               for t in range(n)])
            h = h + out.reshape(n, -1) @ layer["w_o"]
            a = _rms_norm(h, layer["norm2"])
            gate, up = (a @ layer["w_gate_up"]).chunk(2, dim=-1)
            h = h + (torch.nn.functional.silu(gate) * up) @ layer["w_down"]
        return _rms_norm(h, final_norm) @ lm_head
