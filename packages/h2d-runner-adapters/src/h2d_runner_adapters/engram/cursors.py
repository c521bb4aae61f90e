"""Engram history cursors on the GPU: tentative writes from a snapshot, then the commit.

An Engram lookup hashes each request's recent tokens, kept in a device history table
(``history[row, :]``, one row per request, ``cursor`` tokens of it accepted so far). Under
speculative decoding a verify step's tokens are tentative. Two kernels:

* :func:`write_engram_tentative`: ``history[rows[i], snapshot[i] + j] = input_ids[cu_q[i]
  + j]`` for ``j < q_i``. It writes only at and after the snapshot cursor (the accepted
  prefix ``[0, snapshot)`` is never touched) and only inside the row.
* :func:`commit_engram_cursors`: ``committed[i] = candidates[i, accepted[i]]`` with the
  sampler's accepted draft counts (a device array): the committed cursor, in place, for
  the consumers that follow on the GPU (e.g. the draft loop's lookups). Enqueue it after
  the step's tentative write; the next step's snapshot travels in its own published
  member, so no later publication can overwrite (overtake) a committed cursor.

An accepted count outside its row's candidates leaves ``committed[i]`` unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2d_runner_adapters.consumers._launch import (
    check_count,
    check_devices,
    check_tensor,
    next_power_of_two,
)


@triton.jit(do_not_specialize=["num_reqs", "row_len", "hist_rows", "hist_stride",
                               "max_q"])
def _tentative_kernel(  # type: ignore[no-untyped-def]
    hist_ptr,  # *i32 [hist_rows, row_len]
    hist_rows,
    hist_stride,
    row_len,
    rows_ptr,  # *i32 [n]
    snap_ptr,  # *i32 [n]
    cu_ptr,  # *i32 [n + 1]
    ids_ptr,  # *i32 tokens
    num_reqs,
    max_q,
    BLOCK_Q: tl.constexpr,
):
    i = tl.program_id(0)
    live = i < num_reqs
    row = tl.load(rows_ptr + i, mask=live, other=-1)
    snap = tl.load(snap_ptr + i, mask=live, other=0)
    start = tl.load(cu_ptr + i, mask=live, other=0)
    end = tl.load(cu_ptr + i + 1, mask=live, other=0)
    j = tl.arange(0, BLOCK_Q)
    col = snap + j
    ok = live & (j < end - start) & (j < max_q) & (row >= 0) & (row < hist_rows) \
        & (snap >= 0) & (col < row_len)
    tok = tl.load(ids_ptr + start + j, mask=ok, other=0)
    tl.store(hist_ptr + row.to(tl.int64) * hist_stride + col, tok, mask=ok)


def write_engram_tentative(
    history: torch.Tensor,
    rows: torch.Tensor,
    snapshot: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    num_reqs: int,
    max_query_len: int,
) -> None:
    """Write each request's step tokens into its history row from its snapshot cursor
    (see the module docstring). ``history`` int32 ``[R, L]`` (unit column stride);
    ``rows``, ``snapshot`` int32 ``[>= n]``; ``cu_seqlens_q`` int32 ``[>= n + 1]``;
    ``input_ids`` int32. ``max_query_len`` is the host's widest query."""
    func = "write_engram_tentative"
    n = check_count(func, "num_reqs", num_reqs)
    q = check_count(func, "max_query_len", max_query_len)
    check_tensor(func, "history", history, dtype=torch.int32, ndim=2)
    check_tensor(func, "rows", rows, dtype=torch.int32, ndim=1, min_numel=n)
    check_tensor(func, "snapshot", snapshot, dtype=torch.int32, ndim=1, min_numel=n)
    check_tensor(func, "cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, ndim=1,
                 min_numel=n + 1)
    check_tensor(func, "input_ids", input_ids, dtype=torch.int32, ndim=1)
    check_devices(func, _tentative_kernel, history=history, rows=rows, snapshot=snapshot,
                  cu_seqlens_q=cu_seqlens_q, input_ids=input_ids)
    if n and q:
        _tentative_kernel[(n,)](history, history.shape[0], history.stride(0),
                                history.shape[1], rows, snapshot, cu_seqlens_q, input_ids, n,
                                q, BLOCK_Q=next_power_of_two(q))


@triton.jit(do_not_specialize=["num_reqs", "width", "cand_stride"])
def _commit_kernel(  # type: ignore[no-untyped-def]
    cand_ptr,  # *i32 [n, width]
    cand_stride,
    width,
    accepted_ptr,  # *i32 [n]
    committed_ptr,  # *i32 [n]
    num_reqs,
    BLOCK: tl.constexpr,
):
    i = tl.arange(0, BLOCK)
    live = i < num_reqs
    a = tl.load(accepted_ptr + i, mask=live, other=-1)
    ok = live & (a >= 0) & (a < width)
    c = tl.load(cand_ptr + i.to(tl.int64) * cand_stride + a, mask=ok, other=-1)
    tl.store(committed_ptr + i, c, mask=ok & (c >= 0))


def commit_engram_cursors(
    candidates: torch.Tensor,
    accepted: torch.Tensor,
    committed: torch.Tensor,
    *,
    num_reqs: int,
) -> None:
    """``committed[i] = candidates[i, accepted[i]]`` in place (see the module docstring):
    ``candidates`` int32 ``[>= n, W]``, ``accepted`` and ``committed`` int32 ``[>= n]``."""
    func = "commit_engram_cursors"
    n = check_count(func, "num_reqs", num_reqs)
    check_tensor(func, "candidates", candidates, dtype=torch.int32, ndim=2, min_numel=n)
    check_tensor(func, "accepted", accepted, dtype=torch.int32, ndim=1, min_numel=n)
    check_tensor(func, "committed", committed, dtype=torch.int32, ndim=1, min_numel=n)
    check_devices(func, _commit_kernel, candidates=candidates, accepted=accepted,
                  committed=committed)
    if n:
        _commit_kernel[(1,)](candidates, candidates.stride(0), candidates.shape[1], accepted,
                             committed, n, BLOCK=next_power_of_two(n))
