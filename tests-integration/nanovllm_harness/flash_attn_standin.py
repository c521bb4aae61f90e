"""A stand-in for the two ``flash_attn`` functions nano-vllm's attention layer imports.

nano-vllm (``nanovllm/layers/attention.py``, line 6) does
``from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache`` at import time,
and no flash-attn wheel is usable here. It calls them (same file, lines 67-74) as::

    flash_attn_varlen_func(q, k, v, max_seqlen_q=, cu_seqlens_q=, max_seqlen_k=,
                           cu_seqlens_k=, softmax_scale=, causal=True, block_table=)
    flash_attn_with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=,
                            block_table=, softmax_scale=, causal=True)

Both are written here over torch's ``scaled_dot_product_attention`` with flash-attn's
semantics: packed variable-length sequences (``cu_seqlens``), a paged KV cache
(``[num_blocks, block_size, kv_heads, head_dim]`` addressed through a ``block_table`` whose
unused entries are -1), grouped-query attention (query head ``h`` reads key/value head
``h // (heads // kv_heads)``), and a causal mask aligned to the bottom right (a sequence's
last query sees its last key, so queries that follow a cached prefix see all of it). A
query row with no key to attend to (a padded row, or a zero length while a CUDA graph is
captured) yields zeros, as flash-attn's does.

Nothing here reads a device value on the host (no ``.item()``, ``.tolist()``, ``nonzero``
or boolean indexing): every shape comes from a tensor's shape or a Python int argument, so
the functions can be captured in a CUDA graph.

:func:`flash_attn_injected` puts a ``flash_attn`` module holding them into ``sys.modules``
for the length of a ``with`` block (nano-vllm's import) and takes it out after, so nothing
later (transformers' ``importlib.util.find_spec("flash_attn")``) mistakes it for the real
package; the module has a proper ``__spec__`` for whatever asks while it is there.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F


def _refuse(**options: Any) -> None:
    for name, (value, default) in options.items():
        if value != default:
            raise NotImplementedError(f"flash-attn stand-in: {name}={value!r} is not supported")


def _gather_paged(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """Each sequence's first ``length`` positions of a paged cache ``[blocks, block_size,
    kv_heads, head_dim]`` through its ``block_table`` row: ``[batch, length, kv_heads,
    head_dim]``. A -1 entry (a position past the sequence's end) reads block 0; the caller
    masks those positions."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    table = block_table.long()
    blocks = table.gather(1, (pos // block_size).unsqueeze(0).expand(table.shape[0], -1))
    slots = blocks.clamp_min(0) * block_size + pos % block_size
    return cache.flatten(0, 1)[slots]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            k_len: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """``q`` ``[batch, lq, heads, dim]`` over ``k``/``v`` ``[batch, lk, kv_heads, dim]``:
    query ``i`` of row ``b`` sits at key position ``q_pos[b, i]`` (-1: a padded query) and
    sees keys ``j < k_len[b]`` (and ``j <= q_pos[b, i]`` when causal).

    Keys and values past ``k_len[b]`` are zeroed first: they are whatever the gathered
    cache slots held (a paged cache is ``torch.empty``: unwritten slots may hold NaN or inf
    bit patterns), and SDPA's weighted sum multiplies a masked value by a zero weight, so a
    NaN there would reach the output (flash-attn never reads them)."""
    j = torch.arange(k.shape[1], device=q.device)
    seen = (j < k_len[:, None])[:, :, None, None]
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    k, v = torch.where(seen, k, zero), torch.where(seen, v, zero)
    mask = (j < k_len[:, None, None]) & (q_pos[:, :, None] >= 0)
    if causal:
        mask = mask & (j <= q_pos[:, :, None])
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None],
        scale=scale, enable_gqa=q.shape[2] != k.shape[2])
    out = out.transpose(1, 2)
    # a row with no key: zeros (flash-attn's output), never softmax's NaN over nothing
    return torch.where(mask.any(-1)[:, :, None, None], out, torch.zeros((), dtype=out.dtype,
                                                                          device=out.device))


def _scale(q: torch.Tensor, softmax_scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale


def flash_attn_varlen_func(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int, max_seqlen_k: int,
    dropout_p: float = 0.0, softmax_scale: float | None = None, causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None, deterministic: bool = False,
    return_attn_probs: bool = False, block_table: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed sequences: ``q`` ``[total_q, heads, dim]``; ``k``/``v`` either packed
    ``[total_k, kv_heads, dim]`` (``block_table`` None) or a paged cache ``[blocks,
    block_size, kv_heads, dim]`` read through ``block_table`` ``[batch, max_blocks]``.
    Sequence ``b``'s queries are rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``, the last
    ``seqlen_q`` of its ``seqlen_k`` positions. Returns ``[total_q, heads, dim]``."""
    _refuse(dropout_p=(dropout_p, 0.0), window_size=(tuple(window_size), (-1, -1)),
            softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None),
            return_attn_probs=(return_attn_probs, False))
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    total_q = q.shape[0]
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    i = torch.arange(max_seqlen_q, device=q.device)
    q_pad = q[(cu_q[:-1, None] + i).clamp_max(total_q - 1)]          # [batch, lq, heads, dim]
    q_pos = torch.where(i < len_q[:, None], i + (len_k - len_q)[:, None], -1)
    if block_table is None:
        jk = (cu_k[:-1, None] + torch.arange(max_seqlen_k, device=q.device)).clamp_max(
            k.shape[0] - 1)
        k_pad, v_pad = k[jk], v[jk]
    else:
        k_pad = _gather_paged(k, block_table, max_seqlen_k)
        v_pad = _gather_paged(v, block_table, max_seqlen_k)
    out = _attend(q_pad, k_pad, v_pad, q_pos, len_k, _scale(q, softmax_scale), causal)
    # back to packed rows: token t is query t - cu_q[b] of the sequence b it falls in
    t = torch.arange(total_q, device=q.device)
    b = torch.searchsorted(cu_q[1:], t, right=True)
    return out[b, t - cu_q[b]]


def flash_attn_with_kvcache(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    k: torch.Tensor | None = None, v: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None, rotary_sin: torch.Tensor | None = None,
    cache_seqlens: torch.Tensor | int | None = None,
    cache_batch_idx: torch.Tensor | None = None, cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None, softmax_scale: float | None = None,
    causal: bool = False, window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    rotary_interleaved: bool = True, alibi_slopes: torch.Tensor | None = None,
    num_splits: int = 0, return_softmax_lse: bool = False,
) -> torch.Tensor:
    """``q`` ``[batch, lq, heads, dim]`` over a cache already holding its keys: paged
    ``[blocks, block_size, kv_heads, dim]`` through ``block_table`` ``[batch, max_blocks]``,
    or ``[batch, max_len, kv_heads, dim]`` (``block_table`` None). Row ``b`` sees its first
    ``cache_seqlens[b]`` keys; its queries are the last ``lq`` of them. No new ``k``/``v``
    is appended here (nano-vllm stores them first). Returns ``[batch, lq, heads, dim]``."""
    _refuse(k=(k, None), v=(v, None), rotary_cos=(rotary_cos, None),
            rotary_sin=(rotary_sin, None), cache_batch_idx=(cache_batch_idx, None),
            cache_leftpad=(cache_leftpad, None), window_size=(tuple(window_size), (-1, -1)),
            softcap=(softcap, 0.0), alibi_slopes=(alibi_slopes, None),
            return_softmax_lse=(return_softmax_lse, False))
    batch, lq = q.shape[0], q.shape[1]
    if block_table is None:
        k_all, v_all = k_cache[:batch], v_cache[:batch]
    else:
        length = block_table.shape[1] * k_cache.shape[1]
        k_all = _gather_paged(k_cache, block_table, length)
        v_all = _gather_paged(v_cache, block_table, length)
    if cache_seqlens is None:
        k_len = torch.full((batch,), k_all.shape[1], dtype=torch.long, device=q.device)
    elif isinstance(cache_seqlens, int):
        k_len = torch.full((batch,), cache_seqlens, dtype=torch.long, device=q.device)
    else:
        k_len = cache_seqlens.long()
    i = torch.arange(lq, device=q.device)
    q_pos = k_len[:, None] - lq + i
    q_pos = torch.where(q_pos >= 0, q_pos, -1)
    return _attend(q, k_all, v_all, q_pos, k_len, _scale(q, softmax_scale), causal)


def standin_module() -> types.ModuleType:
    """A ``flash_attn`` module holding the two functions, with a proper ``__spec__``."""
    module = types.ModuleType("flash_attn", "stand-in: tests-integration/nanovllm_harness")
    module.__spec__ = importlib.machinery.ModuleSpec("flash_attn", loader=None)
    module.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
    module.flash_attn_with_kvcache = flash_attn_with_kvcache  # type: ignore[attr-defined]
    return module


@contextlib.contextmanager
def flash_attn_injected() -> Iterator[types.ModuleType]:
    """``sys.modules["flash_attn"]`` is the stand-in inside the block; after it, whatever
    was there before (usually nothing) is back. Import nano-vllm inside the block: its
    attention module keeps the two functions it imported."""
    previous = sys.modules.get("flash_attn")
    module = standin_module()
    sys.modules["flash_attn"] = module
    try:
        yield module
    finally:
        if previous is None:
            sys.modules.pop("flash_attn", None)
        else:
            sys.modules["flash_attn"] = previous


def import_nanovllm() -> types.ModuleType:
    """Import ``nanovllm`` with the stand-in as its ``flash_attn`` (nano-vllm's attention
    layer then holds the stand-in's functions); the stand-in leaves ``sys.modules`` after.
    transformers' pieces nano-vllm imports are imported first, outside the block, so their
    import-time checks never see the stand-in."""
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoTokenizer, Qwen3Config  # noqa: F401

    with flash_attn_injected():
        import nanovllm
        import nanovllm.layers.attention as attention
    if attention.flash_attn_varlen_func is not flash_attn_varlen_func:
        raise RuntimeError("nanovllm was imported before the flash-attn stand-in was injected")
    return nanovllm
