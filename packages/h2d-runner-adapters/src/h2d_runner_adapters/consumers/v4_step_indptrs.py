"""DeepSeek-V4/V4.1 prefill indptrs, prefill and decode-window indices, the indexer
rectangle: the later first consumers of ``v41_metadata``.

The decode step's own first consumers (step indptrs and the per-token expansion) live in
:mod:`~h2d_runner_adapters.consumers.v4_decode_steps`, the window geometry and the decode
window tails in :mod:`~h2d_runner_adapters.consumers.v4_window_rows`; both are re-exported
here. Each kernel here sits beside its launcher and a plain-Python oracle written from the
context document; host-side counts are Python ints, and the blocks are powers of two, so a
kernel compiles once per size bucket, not per batch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from h2d_runner_adapters.consumers._launch import (
    check_count,
    check_devices,
    check_tensor,
    next_power_of_two,
)
from h2d_runner_adapters.consumers.errors import ConsumerArgumentError
from h2d_runner_adapters.consumers.v4_decode_steps import (
    BLOCK_COLUMNS,
    StepIndptrs,
    _step_indptrs_kernel,
    _token_tables_kernel,
    expand_v4_token_tables,
    expand_v4_token_tables_reference,
    generate_v4_step_indptrs,
    generate_v4_step_indptrs_reference,
    launch_v4_decode_steps_from_counts,
)
from h2d_runner_adapters.consumers.v4_window_rows import (
    DecodeWindowIndices,
    WindowGeometry,
    _window_row,
    write_v4_decode_window_indices,
    write_v4_decode_window_indices_reference,
)

__all__ = [
    "BLOCK_COLUMNS",
    "DecodeWindowIndices",
    "PrefillIndices",
    "PrefillIndptrs",
    "StepIndptrs",
    "WindowGeometry",
    "_step_indptrs_kernel",
    "_token_tables_kernel",
    "expand_v4_token_tables",
    "expand_v4_token_tables_reference",
    "generate_v4_prefill_indptrs",
    "generate_v4_prefill_indptrs_reference",
    "generate_v4_step_indptrs",
    "generate_v4_step_indptrs_reference",
    "launch_v4_decode_steps_from_counts",
    "write_v4_decode_window_indices",
    "write_v4_decode_window_indices_reference",
    "write_v4_indexer_rectangle",
    "write_v4_indexer_rectangle_reference",
    "write_v4_prefill_indices",
    "write_v4_prefill_indices_reference",
]


class PrefillIndptrs(NamedTuple):
    """The outputs of :func:`generate_v4_prefill_indptrs` (int32 device tensors)."""

    extend_indptr: torch.Tensor
    prefix_swa_indptr: torch.Tensor
    prefix_csa_indptr: torch.Tensor
    prefix_hca_indptr: torch.Tensor
    indexer_cu_committed: torch.Tensor
    #: per local query: ``cu_committed[b]``, ``min((p+1)//4, ctx_b//4)`` and their sum
    #: (the indexer's gather and logits ranges; 0 for dummy queries)
    indexer_seq_base: torch.Tensor
    indexer_visible_end: torch.Tensor
    indexer_cu_ends: torch.Tensor


@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "window", "topk", "rank", "ranks"])
def _prefill_indptrs_kernel(  # type: ignore[no-untyped-def]
    positions_ptr,  # *i64 [>= num_tokens]
    batch_ids_ptr,  # *i32 [>= num_tokens]
    seq_lens_ptr,  # *i32 [>= num_reqs]
    chunk_starts_ptr,  # *i32 [>= num_reqs]
    ext_ptr,  # *i32 [>= num_tokens + 1]
    swa_ptr,
    csa_ptr,
    hca_ptr,
    cu_committed_ptr,  # *i32 [>= num_reqs + 1]
    seq_base_ptr,  # *i32 [>= local tokens]
    visible_ptr,
    cu_ends_ptr,
    num_tokens,
    num_reqs,
    window,
    topk,
    rank,
    ranks,
    TOKENS: tl.constexpr,
    REQS: tl.constexpr,
):
    # local query t is global token rank + t * ranks (context parallel striping); past
    # the step's tokens it is a dummy query that owns nothing
    t = tl.arange(0, TOKENS)
    local = (num_tokens + ranks - 1 - rank) // ranks
    live = t < local
    g = rank + t * ranks
    b = tl.load(batch_ids_ptr + g, mask=live, other=-1)
    real = live & (b >= 0) & (b < num_reqs)
    p = tl.load(positions_ptr + g, mask=real, other=0).to(tl.int32)
    ctx = tl.load(seq_lens_ptr + b, mask=real, other=0)
    start = tl.load(chunk_starts_ptr + b, mask=real, other=0)
    swa_low = tl.maximum(p - window + 1, 0)
    ext = tl.where(real, tl.minimum(p - start + 1, window), 0)
    prefix = tl.where(real, tl.maximum(start - swa_low, 0), 0)
    csa = prefix + tl.where(real, tl.minimum(tl.minimum((p + 1) // 4, ctx // 4), topk), 0)
    hca = prefix + tl.where(real, tl.minimum((p + 1) // 128, ctx // 128), 0)
    head = t < 1
    zero = tl.zeros([TOKENS], dtype=tl.int32)
    tl.store(ext_ptr + t + 1, tl.cumsum(ext, axis=0), mask=live)
    tl.store(swa_ptr + t + 1, tl.cumsum(prefix, axis=0), mask=live)
    tl.store(csa_ptr + t + 1, tl.cumsum(csa, axis=0), mask=live)
    tl.store(hca_ptr + t + 1, tl.cumsum(hca, axis=0), mask=live)
    tl.store(ext_ptr + t, zero, mask=head)
    tl.store(swa_ptr + t, zero, mask=head)
    tl.store(csa_ptr + t, zero, mask=head)
    tl.store(hca_ptr + t, zero, mask=head)
    # the indexer's committed prefix over requests, its last entry raised to >= 1 (a
    # zero-row launch is avoided; the extra row is never read)
    r = tl.arange(0, REQS)
    rlive = r < num_reqs
    rctx = tl.load(seq_lens_ptr + r, mask=rlive, other=0)
    cu = tl.cumsum(tl.where(rlive, rctx // 4, 0), axis=0)
    cu = tl.where(r == num_reqs - 1, tl.maximum(cu, 1), cu)
    tl.store(cu_committed_ptr + r + 1, cu, mask=rlive)
    tl.store(cu_committed_ptr + r, tl.zeros([REQS], dtype=tl.int32), mask=r < 1)
    tl.debug_barrier()  # the prefix above is read back per query below
    base = tl.load(cu_committed_ptr + b, mask=real, other=0)
    visible = tl.where(real, tl.minimum((p + 1) // 4, ctx // 4), 0)
    tl.store(seq_base_ptr + t, base, mask=live)
    tl.store(visible_ptr + t, visible, mask=live)
    tl.store(cu_ends_ptr + t, base + visible, mask=live)


def generate_v4_prefill_indptrs(
    positions: torch.Tensor,
    batch_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    chunk_starts: torch.Tensor,
    out: PrefillIndptrs,
    *,
    num_tokens: int,
    num_reqs: int,
    window: int,
    index_topk: int,
    pcp_rank: int = 0,
    pcp_size: int = 1,
) -> PrefillIndptrs:
    """V4 prefill's per-token KV prefixes and the indexer's committed prefix, on the GPU
    (what an engine computes on the host and uploads from pageable arrays today).

    For a token at position ``p`` of request ``b`` (chunk start ``s = chunk_starts[b]``,
    committed length ``ctx = seq_lens[b]``): ``swa_low = max(p - W + 1, 0)``,
    ``extend = min(p - s + 1, W)``, ``prefix_swa = max(s - swa_low, 0)``,
    ``csa = min((p + 1) // 4, ctx // 4, Kt)``, ``hca = min((p + 1) // 128, ctx // 128)``
    (causal per token). The four ``[T + 1]`` indptrs are the exclusive prefixes of
    ``extend``, ``prefix_swa``, ``prefix_swa + csa`` and ``prefix_swa + hca``;
    ``indexer_cu_committed`` ``[n + 1]`` is ``[0, cumsum(ctx // 4)]`` with its last entry
    raised to at least 1, and per query the indexer's ``seq_base = cu_committed[b]``,
    ``visible_end = min((p + 1) // 4, ctx // 4)`` and ``cu_ends = seq_base + visible_end``.
    Tokens with batch id -1 count 0. One launch, no sync.

    Prefill context parallelism (``pcp_size`` ranks): the published metadata stays the
    whole step's (every rank writes every token's KV); this rank's queries are the global
    tokens ``pcp_rank + i * pcp_size``, so the indptrs cover ``ceil((T - rank) / size)``
    local queries, gathered here by stride: no reindexed upload, no ``.item()``.
    """
    func = "generate_v4_prefill_indptrs"
    t = check_count(func, "num_tokens", num_tokens)
    n = check_count(func, "num_reqs", num_reqs)
    window = check_count(func, "window", window)
    topk = check_count(func, "index_topk", index_topk)
    if window < 1:
        raise ConsumerArgumentError(f"{func}: window must be >= 1, got {window}")
    rank = check_count(func, "pcp_rank", pcp_rank)
    size = check_count(func, "pcp_size", pcp_size)
    if not rank < size:
        raise ConsumerArgumentError(
            f"{func}: pcp_rank={rank} must lie in [0, pcp_size={size})")
    check_tensor(func, "positions", positions, dtype=torch.int64, ndim=1, min_numel=t)
    check_tensor(func, "batch_ids", batch_ids, dtype=torch.int32, ndim=1, min_numel=t)
    check_tensor(func, "seq_lens", seq_lens, dtype=torch.int32, ndim=1, min_numel=n)
    check_tensor(func, "chunk_starts", chunk_starts, dtype=torch.int32, ndim=1, min_numel=n)
    local = (t + size - 1 - rank) // size
    for name in ("extend_indptr", "prefix_swa_indptr", "prefix_csa_indptr",
                 "prefix_hca_indptr"):
        check_tensor(func, name, getattr(out, name), dtype=torch.int32, ndim=1,
                     min_numel=local + 1)
    check_tensor(func, "indexer_cu_committed", out.indexer_cu_committed, dtype=torch.int32,
                 ndim=1, min_numel=n + 1)
    for name in ("indexer_seq_base", "indexer_visible_end", "indexer_cu_ends"):
        check_tensor(func, name, getattr(out, name), dtype=torch.int32, ndim=1,
                     min_numel=local)
    check_devices(func, _prefill_indptrs_kernel, positions=positions, batch_ids=batch_ids,
                  seq_lens=seq_lens, chunk_starts=chunk_starts,
                  extend_indptr=out.extend_indptr, prefix_swa_indptr=out.prefix_swa_indptr,
                  prefix_csa_indptr=out.prefix_csa_indptr,
                  prefix_hca_indptr=out.prefix_hca_indptr,
                  indexer_cu_committed=out.indexer_cu_committed)
    _prefill_indptrs_kernel[(1,)](
        positions, batch_ids, seq_lens, chunk_starts, out.extend_indptr,
        out.prefix_swa_indptr, out.prefix_csa_indptr, out.prefix_hca_indptr,
        out.indexer_cu_committed, out.indexer_seq_base, out.indexer_visible_end,
        out.indexer_cu_ends, t, n, window, topk, rank, size,
        TOKENS=max(next_power_of_two(local), 16), REQS=max(next_power_of_two(n), 16),
    )
    return out


def generate_v4_prefill_indptrs_reference(
    positions: list[int],
    batch_ids: list[int],
    seq_lens: list[int],
    chunk_starts: list[int],
    *,
    window: int,
    index_topk: int,
) -> dict[str, list[int]]:
    """Plain-Python oracle, written from the formulas of the context document (§2, §3.2)."""
    names = ("extend_indptr", "prefix_swa_indptr", "prefix_csa_indptr", "prefix_hca_indptr")
    out = {name: [0] for name in names}
    for p, b in zip(positions, batch_ids, strict=True):
        if b < 0:
            segs = (0, 0, 0, 0)
        else:
            ctx, s = seq_lens[b], chunk_starts[b]
            low = max(p - window + 1, 0)
            prefix = max(s - low, 0)
            segs = (min(p - s + 1, window), prefix,
                    prefix + min((p + 1) // 4, ctx // 4, index_topk),
                    prefix + min((p + 1) // 128, ctx // 128))
        for name, seg in zip(names, segs, strict=True):
            out[name].append(out[name][-1] + seg)
    cu = [0]
    for ctx in seq_lens:
        cu.append(cu[-1] + ctx // 4)
    if len(cu) > 1:
        cu[-1] = max(cu[-1], 1)
    out["indexer_cu_committed"] = cu
    base = [cu[b] if b >= 0 else 0 for b in batch_ids]
    visible = [min((p + 1) // 4, seq_lens[b] // 4) if b >= 0 else 0
               for p, b in zip(positions, batch_ids, strict=True)]
    out["indexer_seq_base"] = base
    out["indexer_visible_end"] = visible
    out["indexer_cu_ends"] = [x + y for x, y in zip(base, visible, strict=True)]
    return out


class PrefillIndices(NamedTuple):
    """The index outputs of :func:`write_v4_prefill_indices` (int32 device tensors)."""

    extend: torch.Tensor
    prefix_swa: torch.Tensor
    prefix_csa: torch.Tensor
    prefix_hca: torch.Tensor


@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "window", "slot_rows", "ring",
                               "envelope", "d_start", "d_stride", "d_run", "c_start",
                               "c_stride", "c_run", "h_start", "h_stride", "h_run"])
def _prefill_indices_kernel(  # type: ignore[no-untyped-def]
    positions_ptr, batch_ids_ptr, seq_lens_ptr, chunk_starts_ptr,
    slots_ptr,  # state_slot_in: every window row here precedes the chunk
    cu_q_ptr, tables_ptr, tables_stride,
    ext_ptr, swa_ptr, csa_ptr, hca_ptr,  # the indptrs of generate_v4_prefill_indptrs
    ext_out, swa_out, csa_out, hca_out,
    num_tokens, num_reqs, window, slot_rows, ring, envelope,
    d_start, d_stride, d_run, c_start, c_stride, c_run, h_start, h_stride, h_run,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0)
    live = t < num_tokens
    b = tl.load(batch_ids_ptr + t, mask=live, other=-1)
    real = live & (b >= 0) & (b < num_reqs)
    p = tl.load(positions_ptr + t, mask=real, other=0).to(tl.int32)
    start = tl.load(chunk_starts_ptr + b, mask=real, other=0)
    slot = tl.load(slots_ptr + b, mask=real, other=0)
    cu = tl.load(cu_q_ptr + b, mask=real, other=0)
    ctx = tl.load(seq_lens_ptr + b, mask=real, other=0)
    low = tl.maximum(p - window + 1, 0)
    ext_n = tl.minimum(p - start + 1, window)
    prefix = tl.maximum(start - low, 0)
    csa_k = tl.load(csa_ptr + t + 1, mask=real, other=0) - tl.load(csa_ptr + t, mask=real,
                                                                     other=0) - prefix
    hca_n = tl.minimum((p + 1) // 128, ctx // 128)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    # extend rows: this chunk's own keys in the per-forward K
    e0 = tl.load(ext_ptr + t, mask=real, other=0)
    tl.store(ext_out + e0 + i, cu + (p - start) - ext_n + 1 + i, mask=real & (i < ext_n))
    # window rows before the chunk: SWA head, CSA tail (after the top-k head), HCA head
    w = i < prefix
    pos_i = low + i
    s0 = tl.load(swa_ptr + t, mask=real, other=0)
    tl.store(swa_out + s0 + i,
             _window_row(slot, pos_i, slot_rows, ring, d_start, d_stride, d_run),
             mask=real & w)
    c0 = tl.load(csa_ptr + t, mask=real, other=0)
    tl.store(csa_out + c0 + i, tl.full([BLOCK], -1, tl.int32), mask=real & (i < csa_k))
    tl.store(csa_out + c0 + csa_k + i,
             _window_row(slot, pos_i, slot_rows, ring, c_start, c_stride, c_run),
             mask=real & w)
    h0 = tl.load(hca_ptr + t, mask=real, other=0)
    tl.store(hca_out + h0 + i,
             _window_row(slot, pos_i, slot_rows, ring, h_start, h_stride, h_run),
             mask=real & w)
    # HCA compressed rows after the window part (prefill: SWA head, compress tail)
    blk = tl.load(tables_ptr + b.to(tl.int64) * tables_stride + i // 2,
                  mask=real & (i < hca_n), other=0)
    tl.store(hca_out + h0 + prefix + i, blk * envelope + i % 2, mask=real & (i < hca_n))


def write_v4_prefill_indices(
    positions: torch.Tensor,
    batch_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    chunk_starts: torch.Tensor,
    state_slots_in: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    block_tables: torch.Tensor,
    indptrs: PrefillIndptrs,
    out: PrefillIndices,
    geometry: WindowGeometry,
    *,
    num_tokens: int,
    num_reqs: int,
    window: int,
    index_topk: int,
    envelope_rows: int,
) -> PrefillIndices:
    """The sparse (Opus) prefill indices of every token, after
    :func:`generate_v4_prefill_indptrs` (whose indptrs give each slice):

    * ``extend[ext[t] + i]``: the chunk's own rows in the per-forward K,
      ``cu_seqlens_q[b] + (p - start_b) - extend + 1 + i``;
    * ``prefix_swa``: the window rows before the chunk (``swa_low + i``, dense class);
    * ``prefix_csa``: ``-1`` for the top-k head a later kernel fills, then the window rows
      (CSA class) at the tail;
    * ``prefix_hca``: the window rows (HCA class) at the head, then the compressed rows
      ``block_tables[b, e // 2] * envelope_rows + e % 2`` for ``e < min((p+1)//128,
      ctx_b//128)`` (prefill: SWA head, compress tail).

    Every window and compressed row is a view row (:class:`WindowGeometry`). The window
    rows all precede the chunk: they are state the chunk reads, so they lie in each
    request's ``state_slots_in`` (``v41_state_slot_in``: a fork source, else its own slot),
    as the compressor rings the plans read do; the chunk's own keys are extend rows.

    One program per token; no host work, no sync.
    """
    func = "write_v4_prefill_indices"
    t = check_count(func, "num_tokens", num_tokens)
    n = check_count(func, "num_reqs", num_reqs)
    window = check_count(func, "window", window)
    envelope = check_count(func, "envelope_rows", envelope_rows)
    topk = check_count(func, "index_topk", index_topk)
    for name, tensor, dtype, need in (
        ("positions", positions, torch.int64, t), ("batch_ids", batch_ids, torch.int32, t),
        ("seq_lens", seq_lens, torch.int32, n), ("chunk_starts", chunk_starts, torch.int32, n),
        ("state_slots_in", state_slots_in, torch.int32, n),
        ("cu_seqlens_q", cu_seqlens_q, torch.int32, n + 1),
    ):
        check_tensor(func, name, tensor, dtype=dtype, ndim=1, min_numel=need)
    tables = check_tensor(func, "block_tables", block_tables, dtype=torch.int32, ndim=2,
                          min_numel=n)
    for name in PrefillIndices._fields:
        check_tensor(func, name, getattr(out, name), dtype=torch.int32, ndim=1)
    check_devices(func, _prefill_indices_kernel, positions=positions, batch_ids=batch_ids,
                  block_tables=tables, extend=out.extend, prefix_hca=out.prefix_hca)
    (ds, dst, dr), (cs, cst, cr), (hs, hst, hr) = geometry.classes
    widest = max(window, 2 * tables.shape[1], topk, 1)
    grid = (next_power_of_two(t), -(-widest // BLOCK_COLUMNS))
    _prefill_indices_kernel[grid](
        positions, batch_ids, seq_lens, chunk_starts, state_slots_in, cu_seqlens_q,
        tables, tables.stride(0), indptrs.extend_indptr, indptrs.prefix_swa_indptr,
        indptrs.prefix_csa_indptr, indptrs.prefix_hca_indptr, out.extend, out.prefix_swa,
        out.prefix_csa, out.prefix_hca, t, n, window, geometry.slot_rows,
        geometry.ring_positions, envelope, ds, dst, dr, cs, cst, cr, hs, hst, hr,
        BLOCK=BLOCK_COLUMNS,
    )
    return out


def write_v4_prefill_indices_reference(
    positions: list[int],
    batch_ids: list[int],
    seq_lens: list[int],
    chunk_starts: list[int],
    state_slots_in: list[int],
    cu_seqlens_q: list[int],
    block_tables: list[list[int]],
    geometry: WindowGeometry,
    *,
    window: int,
    index_topk: int,
    envelope_rows: int,
) -> dict[str, list[int]]:
    """Plain-Python oracle of the four index arrays, from the context document (§2)."""
    out: dict[str, list[int]] = {name: [] for name in PrefillIndices._fields}
    for p, b in zip(positions, batch_ids, strict=True):
        if b < 0:
            continue
        ctx, s, slot = seq_lens[b], chunk_starts[b], state_slots_in[b]
        low = max(p - window + 1, 0)
        ext = min(p - s + 1, window)
        prefix = max(s - low, 0)
        csa_k = min((p + 1) // 4, ctx // 4, index_topk)
        hca_n = min((p + 1) // 128, ctx // 128)
        out["extend"] += [cu_seqlens_q[b] + (p - s) - ext + 1 + i for i in range(ext)]
        win = [low + i for i in range(prefix)]
        out["prefix_swa"] += [geometry.row(0, slot, x) for x in win]
        out["prefix_csa"] += [-1] * csa_k + [geometry.row(1, slot, x) for x in win]
        out["prefix_hca"] += [geometry.row(2, slot, x) for x in win] + [
            block_tables[b][e // 2] * envelope_rows + e % 2 for e in range(hca_n)]
    return out


@triton.jit(do_not_specialize=["rows", "num_reqs", "full_q"])
def _indexer_rectangle_kernel(  # type: ignore[no-untyped-def]
    cu_q_ptr, committed_ptr, rect_ptr, rect_batch_ptr, rows, num_reqs, full_q,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = r < rows
    i = r // full_q
    req = live & (i < num_reqs)
    start = tl.load(cu_q_ptr + i, mask=req, other=0)
    length = tl.load(cu_q_ptr + i + 1, mask=req, other=0) - start
    j = r % full_q - (full_q - length)  # right-aligned in the request's full_q rows
    own = req & (j >= 0) & (j < length)
    value = tl.load(committed_ptr + start + j, mask=own, other=0)
    tl.store(rect_ptr + r, tl.where(own, value, 0), mask=live)
    tl.store(rect_batch_ptr + r, tl.where(req, i, -1), mask=live)


def write_v4_indexer_rectangle(
    cu_seqlens_q: torch.Tensor,
    n_committed_per_token: torch.Tensor,
    rectangle: torch.Tensor,
    rectangle_batch: torch.Tensor,
    *,
    num_reqs: int,
    rect_reqs: int,
    full_q: int,
) -> None:
    """The FP8 DSpark ragged indexer rectangle, from the step's outputs: ``rect_reqs *
    full_q`` rows; token ``j`` of request ``i`` (``L_i`` tokens) lands on row ``i * full_q
    + (full_q - L_i) + j`` with its committed count (right-aligned), other rows hold 0;
    ``rectangle_batch`` maps rows of the ``num_reqs`` requests to them and later rows to
    -1. Reads ``cu_seqlens_q`` (token inputs) and ``n_committed_per_token`` (step indptr
    generation). One launch, no sync."""
    func = "write_v4_indexer_rectangle"
    n = check_count(func, "num_reqs", num_reqs)
    rect = check_count(func, "rect_reqs", rect_reqs)
    fq = check_count(func, "full_q", full_q)
    if fq < 1 or rect < n:
        raise ConsumerArgumentError(
            f"{func}: full_q={fq} must be >= 1 and rect_reqs={rect} >= num_reqs={n}")
    rows = rect * fq
    check_tensor(func, "cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, ndim=1,
                 min_numel=n + 1)
    check_tensor(func, "n_committed_per_token", n_committed_per_token, dtype=torch.int32,
                 ndim=1)
    check_tensor(func, "rectangle", rectangle, dtype=torch.int32, ndim=1, min_numel=rows)
    check_tensor(func, "rectangle_batch", rectangle_batch, dtype=torch.int32, ndim=1,
                 min_numel=rows)
    check_devices(func, _indexer_rectangle_kernel, cu_seqlens_q=cu_seqlens_q,
                  rectangle=rectangle, rectangle_batch=rectangle_batch)
    _indexer_rectangle_kernel[(max(-(-rows // BLOCK_COLUMNS), 1),)](
        cu_seqlens_q, n_committed_per_token, rectangle, rectangle_batch, rows, n, fq,
        BLOCK=BLOCK_COLUMNS)


def write_v4_indexer_rectangle_reference(
    query_lens: list[int], committed: list[int], rect_reqs: int, full_q: int
) -> tuple[list[int], list[int]]:
    """Plain-Python oracle of the rectangle and its row-to-request map."""
    rect = [0] * (rect_reqs * full_q)
    batch = [i if i < len(query_lens) else -1 for i in range(rect_reqs) for _ in range(full_q)]
    t = 0
    for i, length in enumerate(query_lens):
        for j in range(length):
            rect[i * full_q + (full_q - length) + j] = committed[t]
            t += 1
    return rect, batch
