"""Step indptrs and the per-token expansion: the first consumers of DeepSeek-V4/V4.1 decode.

From what the ``v41_metadata`` group publishes per token (positions, token batch IDs, ``-1``
for padded tokens) and per request (committed context lengths), one program derives what
the attention kernels read, with no host cumsum and no host per-token table:

For a real token ``t`` (``b = batch_ids[t] >= 0``, ``p = positions[t]``, ``ctx = seq_lens[b]``)::

    swa_t     = min(p + 1, window)
    csa_vis_t = min((p + 1) // 4, ctx // 4)        # n_committed_per_token
    csa_k_t   = min(csa_vis_t, index_topk)
    hca_t     = min((p + 1) // 128, ctx // 128)     # HCA entries closed at or before p

and a padded token (``b < 0``) has every length 0. Both committed counts are per token, as in
prefill: in a verify step (several tokens per request) an entry the step itself closes is
hidden from the tokens before its window's last position (the model's causal mask).

The outputs, for ``T`` padded tokens and ``P`` padded requests (``n`` real ones):

* ``swa_indptr``, ``csa_indptr``, ``hca_indptr`` ``[T + 1]``: exclusive prefixes of
  ``swa_t``, ``swa_t + csa_k_t`` and ``swa_t + hca_t`` (padded tokens repeat the total);
* ``n_committed_per_token`` ``[T]``: ``csa_vis_t`` (0 for padded tokens);
* ``n_committed_csa_per_seq`` ``[P]``: ``ctx // 4`` for real requests and ``index_topk`` for
  padded ones, so that a top-k row length computed from it cannot go negative.

Entries past ``T + 1`` / ``T`` / ``P`` are untouched. One program holds every token (a
decode step has at most ``S * (1 + k)``, a few thousand); the block is the next power of
two, so the kernel compiles once per size bucket, not per batch.

Fused into the ``v41_metadata`` publication (:func:`launch_v4_decode_steps_from_counts`),
both kernels read the step's counts on the device: the ``STEP_COUNTS`` member the same DMA
carried (``(n, P, t, T)``, valid when the arena header says it was published this step),
over a grid of every token the buffers hold, so one captured launch serves every step.
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


class StepIndptrs(NamedTuple):
    """The outputs of :func:`generate_v4_step_indptrs` (int32 device tensors)."""

    swa_indptr: torch.Tensor
    csa_indptr: torch.Tensor
    hca_indptr: torch.Tensor
    n_committed_per_token: torch.Tensor
    n_committed_csa_per_seq: torch.Tensor


@triton.jit
def _device_count(counts_ptr, header_ptr, header_row, k, cap):  # type: ignore[no-untyped-def]
    """Entry ``k`` of the step's counts, clamped to ``[0, cap]``; 0 when the counts member
    was not published this step (its header row's published bytes below 16)."""
    sent = tl.load(header_ptr + header_row * 4 + 1) >= 16
    v = tl.load(counts_ptr + k)
    return tl.where(sent, tl.minimum(tl.maximum(v, 0), cap), 0).to(tl.int32)


@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "padded_reqs", "window", "topk",
                               "header_row"])
def _step_indptrs_kernel(  # type: ignore[no-untyped-def]
    positions_ptr,  # *i64 [>= num_tokens]
    batch_ids_ptr,  # *i32 [>= num_tokens]
    seq_lens_ptr,  # *i32 [>= num_reqs]
    swa_ptr,  # *i32 [>= num_tokens + 1]
    csa_ptr,
    hca_ptr,
    committed_ptr,  # *i32 [>= num_tokens]
    ncsa_ptr,  # *i32 [>= padded_reqs]
    num_tokens,
    num_reqs,
    padded_reqs,
    window,
    topk,
    counts_ptr,  # *i32 [4]: (n, P, t, T), read when FROM_DEVICE
    header_ptr,  # *i64 [rows, 4]: the arena header (column 1: published bytes)
    header_row,  # the counts member's header row
    TOKENS: tl.constexpr,  # >= num_tokens, a power of two
    REQS: tl.constexpr,  # >= padded_reqs, a power of two
    FROM_DEVICE: tl.constexpr,  # counts from counts_ptr; the arguments are capacities
):
    if FROM_DEVICE:
        num_tokens = _device_count(counts_ptr, header_ptr, header_row, 3, num_tokens)
        padded_reqs = _device_count(counts_ptr, header_ptr, header_row, 1, padded_reqs)
        num_reqs = tl.minimum(_device_count(counts_ptr, header_ptr, header_row, 0, num_reqs),
                              padded_reqs)
    t = tl.arange(0, TOKENS)
    live = t < num_tokens
    b = tl.load(batch_ids_ptr + t, mask=live, other=-1)
    real = live & (b >= 0)
    p = tl.load(positions_ptr + t, mask=real, other=0).to(tl.int32)
    ctx = tl.load(seq_lens_ptr + b, mask=real & (b < num_reqs), other=0)
    swa = tl.where(real, tl.minimum(p + 1, window), 0)
    vis = tl.where(real, tl.minimum((p + 1) // 4, ctx // 4), 0)
    csa = swa + tl.minimum(vis, topk)
    hca = swa + tl.where(real, tl.minimum((p + 1) // 128, ctx // 128), 0)
    # inclusive prefixes land one entry later: indptr[t + 1]; indptr[0] = 0
    tl.store(swa_ptr + t + 1, tl.cumsum(swa, axis=0), mask=live)
    tl.store(csa_ptr + t + 1, tl.cumsum(csa, axis=0), mask=live)
    tl.store(hca_ptr + t + 1, tl.cumsum(hca, axis=0), mask=live)
    head = t < 1
    tl.store(swa_ptr + t, tl.zeros([TOKENS], dtype=tl.int32), mask=head)
    tl.store(csa_ptr + t, tl.zeros([TOKENS], dtype=tl.int32), mask=head)
    tl.store(hca_ptr + t, tl.zeros([TOKENS], dtype=tl.int32), mask=head)
    tl.store(committed_ptr + t, vis, mask=live)
    r = tl.arange(0, REQS)
    rlive = r < padded_reqs
    rctx = tl.load(seq_lens_ptr + r, mask=rlive & (r < num_reqs), other=0)
    tl.store(ncsa_ptr + r, tl.where(r < num_reqs, rctx // 4, topk), mask=rlive)


def generate_v4_step_indptrs(
    positions: torch.Tensor,
    batch_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    out: StepIndptrs,
    *,
    num_tokens: int,
    num_reqs: int,
    padded_reqs: int,
    window: int,
    index_topk: int,
) -> StepIndptrs:
    """Derive the step's per-token KV prefixes into ``out`` (see the module docstring).

    ``num_tokens`` is the padded token count ``T``; ``num_reqs`` / ``padded_reqs`` the real
    and padded request counts: host-side ints, never GPU scalars. One launch, no host sync,
    no allocation.
    """
    func = "generate_v4_step_indptrs"
    t = check_count(func, "num_tokens", num_tokens)
    n = check_count(func, "num_reqs", num_reqs)
    p = check_count(func, "padded_reqs", padded_reqs)
    window = check_count(func, "window", window)
    topk = check_count(func, "index_topk", index_topk)
    if p < n:
        raise ConsumerArgumentError(
            f"{func}: padded_reqs={p} is below num_reqs={n}; pad up, never down")
    if window < 1:
        raise ConsumerArgumentError(f"{func}: window must be >= 1, got {window}")
    check_tensor(func, "positions", positions, dtype=torch.int64, ndim=1, min_numel=t)
    check_tensor(func, "batch_ids", batch_ids, dtype=torch.int32, ndim=1, min_numel=t)
    check_tensor(func, "seq_lens", seq_lens, dtype=torch.int32, ndim=1, min_numel=n)
    for name in ("swa_indptr", "csa_indptr", "hca_indptr"):
        check_tensor(func, name, getattr(out, name), dtype=torch.int32, ndim=1,
                     min_numel=t + 1)
    check_tensor(func, "n_committed_per_token", out.n_committed_per_token,
                 dtype=torch.int32, ndim=1, min_numel=t)
    check_tensor(func, "n_committed_csa_per_seq", out.n_committed_csa_per_seq,
                 dtype=torch.int32, ndim=1, min_numel=p)
    check_devices(func, _step_indptrs_kernel, positions=positions, batch_ids=batch_ids,
                  seq_lens=seq_lens, swa_indptr=out.swa_indptr, csa_indptr=out.csa_indptr,
                  hca_indptr=out.hca_indptr,
                  n_committed_per_token=out.n_committed_per_token,
                  n_committed_csa_per_seq=out.n_committed_csa_per_seq)
    _step_indptrs_kernel[(1,)](
        positions, batch_ids, seq_lens, out.swa_indptr, out.csa_indptr, out.hca_indptr,
        out.n_committed_per_token, out.n_committed_csa_per_seq, t, n, p, window, topk,
        seq_lens, seq_lens, 0,  # unread: the counts are the host's
        TOKENS=max(next_power_of_two(t), 16), REQS=max(next_power_of_two(p), 16),
        FROM_DEVICE=False,
    )
    return out


def generate_v4_step_indptrs_reference(
    positions: list[int],
    batch_ids: list[int],
    seq_lens: list[int],
    *,
    num_reqs: int,
    padded_reqs: int,
    window: int,
    index_topk: int,
) -> dict[str, list[int]]:
    """Plain-Python oracle, written from the formulas of the context document."""
    swa, csa, hca, committed = [0], [0], [0], []
    for p, b in zip(positions, batch_ids, strict=True):
        if b < 0:
            lens = (0, 0, 0)
            vis = 0
        else:
            ctx = seq_lens[b]
            s = min(p + 1, window)
            vis = min((p + 1) // 4, ctx // 4)
            lens = (s, s + min(vis, index_topk), s + min((p + 1) // 128, ctx // 128))
        swa.append(swa[-1] + lens[0])
        csa.append(csa[-1] + lens[1])
        hca.append(hca[-1] + lens[2])
        committed.append(vis)
    ncsa = [seq_lens[i] // 4 for i in range(num_reqs)] + [index_topk] * (padded_reqs - num_reqs)
    return {"swa_indptr": swa, "csa_indptr": csa, "hca_indptr": hca,
            "n_committed_per_token": committed, "n_committed_csa_per_seq": ncsa}


BLOCK_COLUMNS = 512
"""Columns (table entries or HCA cells) one program writes."""


@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "columns", "envelope",
                               "header_row"])
def _token_tables_kernel(  # type: ignore[no-untyped-def]
    positions_ptr,  # *i64 [>= num_tokens]
    batch_ids_ptr,  # *i32 [>= num_tokens]
    seq_lens_ptr,  # *i32 [>= num_reqs]
    tables_ptr,  # *i32 [S, B]
    tables_stride,
    hca_indptr_ptr,  # *i32 [>= num_tokens + 1]
    per_token_ptr,  # *i32 [>= num_tokens, B]
    per_token_stride,
    hca_ptr,  # *i32 [>= hca_indptr[num_tokens]]
    num_tokens,
    num_reqs,
    columns,  # B
    envelope,
    counts_ptr,  # *i32 [4]: (n, P, t, T), read when FROM_DEVICE
    header_ptr,  # *i64 [rows, 4]: the arena header (column 1: published bytes)
    header_row,
    BLOCK: tl.constexpr,
    FROM_DEVICE: tl.constexpr,  # counts from counts_ptr; the arguments are capacities
):
    if FROM_DEVICE:
        num_tokens = _device_count(counts_ptr, header_ptr, header_row, 3, num_tokens)
        num_reqs = _device_count(counts_ptr, header_ptr, header_row, 0, num_reqs)
    t = tl.program_id(0)
    live = t < num_tokens
    b = tl.load(batch_ids_ptr + t, mask=live, other=-1)
    real = live & (b >= 0) & (b < num_reqs)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = b.to(tl.int64) * tables_stride
    # the token's own copy of its request's block-table row (zero rows for padding)
    in_row = cols < columns
    ids = tl.load(tables_ptr + row + cols, mask=in_row & real, other=0)
    tl.store(per_token_ptr + t.to(tl.int64) * per_token_stride + cols, ids,
             mask=in_row & live)
    # HCA index head: the compressed rows (2 per block) this token's position may see
    # (as the step indptrs count them), then -1 for the window tail the window kernel fills
    ctx = tl.load(seq_lens_ptr + b, mask=real, other=0)
    p = tl.load(positions_ptr + t, mask=real, other=0).to(tl.int32)
    n_hca = tl.minimum((p + 1) // 128, ctx // 128)
    start = tl.load(hca_indptr_ptr + t, mask=real, other=0)
    end = tl.load(hca_indptr_ptr + t + 1, mask=real, other=0)
    head = cols < n_hca
    block = tl.load(tables_ptr + row + cols // 2, mask=head & real, other=0)
    cell = tl.where(head, block * envelope + cols % 2, -1)
    tl.store(hca_ptr + start + cols, cell, mask=real & (cols < end - start))


def expand_v4_token_tables(
    positions: torch.Tensor,
    batch_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    hca_indptr: torch.Tensor,
    block_tables_per_token: torch.Tensor,
    hca_indices: torch.Tensor,
    *,
    num_tokens: int,
    num_reqs: int,
    window: int,
    envelope_rows: int,
) -> None:
    """The per-token expansion, on the GPU instead of a host gather.

    For each of the ``num_tokens`` (padded) tokens: ``block_tables_per_token[t]`` is its
    request's block-table row (a zero row for a padded token), and its HCA slice
    ``hca_indices[hca_indptr[t] : hca_indptr[t+1]]`` is the compressed head
    ``block_tables[b, e // 2] * envelope_rows + e % 2`` for
    ``e < min((positions[t] + 1) // 128, ctx_b // 128)`` (rows relative to the HCA layer's
    view base: see :class:`~h2d_runner_adapters.consumers.WindowGeometry`), then
    ``-1`` for the window tail (decode HCA layout: compress head, SWA tail). Padded tokens
    own no HCA cells. Run after :func:`generate_v4_step_indptrs`; one launch, no sync.
    """
    func = "expand_v4_token_tables"
    t = check_count(func, "num_tokens", num_tokens)
    n = check_count(func, "num_reqs", num_reqs)
    envelope = check_count(func, "envelope_rows", envelope_rows)
    window = check_count(func, "window", window)
    check_tensor(func, "positions", positions, dtype=torch.int64, ndim=1, min_numel=t)
    check_tensor(func, "batch_ids", batch_ids, dtype=torch.int32, ndim=1, min_numel=t)
    check_tensor(func, "seq_lens", seq_lens, dtype=torch.int32, ndim=1, min_numel=n)
    tables = check_tensor(func, "block_tables", block_tables, dtype=torch.int32, ndim=2,
                          min_numel=n)
    check_tensor(func, "hca_indptr", hca_indptr, dtype=torch.int32, ndim=1, min_numel=t + 1)
    per_token = check_tensor(func, "block_tables_per_token", block_tables_per_token,
                             dtype=torch.int32, ndim=2, min_numel=t)
    check_tensor(func, "hca_indices", hca_indices, dtype=torch.int32, ndim=1)
    if per_token.shape[1] < tables.shape[1]:
        raise ConsumerArgumentError(
            f"{func}: block_tables_per_token has {per_token.shape[1]} columns, the block "
            f"table {tables.shape[1]}; allocate at least as many")
    check_devices(func, _token_tables_kernel, positions=positions, batch_ids=batch_ids,
                  seq_lens=seq_lens, block_tables=tables, hca_indptr=hca_indptr,
                  block_tables_per_token=per_token, hca_indices=hca_indices)
    # the widest HCA slice: the window plus 2 compressed rows per block of a full row
    widest = max(tables.shape[1], window + 2 * tables.shape[1], 1)
    grid = (next_power_of_two(t), -(-widest // BLOCK_COLUMNS))
    _token_tables_kernel[grid](
        positions, batch_ids, seq_lens, tables, tables.stride(0), hca_indptr, per_token,
        per_token.stride(0), hca_indices, t, n, tables.shape[1], envelope,
        seq_lens, seq_lens, 0,  # unread: the counts are the host's
        BLOCK=BLOCK_COLUMNS, FROM_DEVICE=False,
    )


def expand_v4_token_tables_reference(
    positions: list[int],
    batch_ids: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    hca_indptr: list[int],
    width: int,
    envelope_rows: int,
) -> tuple[list[list[int]], list[int]]:
    """Plain-Python oracle: the per-token rows and the HCA cells up to ``hca_indptr[T]``."""
    rows, cells = [], []
    for t, (p, b) in enumerate(zip(positions, batch_ids, strict=True)):
        if b < 0:
            rows.append([0] * width)
            continue
        row = block_tables[b]
        rows.append(list(row) + [0] * (width - len(row)))
        n_hca = min((p + 1) // 128, seq_lens[b] // 128)
        seg = hca_indptr[t + 1] - hca_indptr[t]
        cells += [row[e // 2] * envelope_rows + e % 2 for e in range(n_hca)]
        cells += [-1] * (seg - n_hca)
    return rows, cells


def launch_v4_decode_steps_from_counts(
    positions: torch.Tensor,
    batch_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    out: StepIndptrs,
    counts: torch.Tensor,
    header: torch.Tensor,
    header_row: int,
    *,
    max_tokens: int,
    max_reqs: int,
    window: int,
    index_topk: int,
    expansion: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
) -> None:
    """:func:`generate_v4_step_indptrs`, then (``expansion`` = ``(block_tables,
    block_tables_per_token, hca_indices, envelope_rows)``) :func:`expand_v4_token_tables`,
    fused into a publication: the counts come from ``counts`` (int32 ``(n, P, t, T)``, the
    ``STEP_COUNTS`` member) on the device, valid when ``header[header_row, 1]`` says it was
    published this step (else every count is 0 and nothing but ``indptr[0]`` is written).
    The launches cover ``max_tokens`` tokens and ``max_reqs`` requests, the buffers'
    capacities, so one captured launch serves every step. Arguments are checked once, by
    the adapter that declares the fusion."""
    _step_indptrs_kernel[(1,)](
        positions, batch_ids, seq_lens, out.swa_indptr, out.csa_indptr, out.hca_indptr,
        out.n_committed_per_token, out.n_committed_csa_per_seq, max_tokens, max_reqs,
        max_reqs, window, index_topk, counts, header, header_row,
        TOKENS=max(next_power_of_two(max_tokens), 16),
        REQS=max(next_power_of_two(max_reqs), 16), FROM_DEVICE=True,
    )
    if expansion is None:
        return
    tables, per_token, hca_indices, envelope = expansion
    widest = max(tables.shape[1], window + 2 * tables.shape[1], 1)
    grid = (next_power_of_two(max_tokens), -(-widest // BLOCK_COLUMNS))
    _token_tables_kernel[grid](
        positions, batch_ids, seq_lens, tables, tables.stride(0), out.hca_indptr, per_token,
        per_token.stride(0), hca_indices, max_tokens, max_reqs, tables.shape[1], envelope,
        counts, header, header_row, BLOCK=BLOCK_COLUMNS, FROM_DEVICE=True,
    )
