"""DeepSeek-V4/V4.1 prefill indices: the KV rows behind each chunk token's indptrs
(:mod:`.prefill_indptrs`): kernel, launcher and plain-Python oracle."""

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
from h2d_runner_adapters.v4.decode_steps import (
    BLOCK_COLUMNS,
)
from h2d_runner_adapters.v4.prefill_indptrs import PrefillIndptrs
from h2d_runner_adapters.v4.window_rows import (
    WindowGeometry,
    _window_row,
)


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
