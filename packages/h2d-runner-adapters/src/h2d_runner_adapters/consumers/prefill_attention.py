"""Attention preparation for prefill: token owners, the KV page prefix, KV indices.

The first consumer of the ``prefill_inputs`` group. Inputs (int32, one device):

* ``cu_seqlens_q[>= R+1]``, ``cu_seqlens_k[>= R+1]``: exclusive prefixes of the
  query and key (cached + new) lengths of the ``R = num_reqs`` requests, graph
  padding included; ``cu[0]`` is 0 and both are non-decreasing.
* ``block_tables[>= R, B]``: request ``r``'s page ids in columns ``0..``.

Outputs, written in place:

* ``token_request[T]`` (``T = token_request.numel()``; every element written):
  ``token_request[t] = r`` for ``cu_seqlens_q[r] <= t < cu_seqlens_q[r+1]``,
  ``r < R``; ``-1`` for ``t >= cu_seqlens_q[R]`` (past the last real token, up
  to the tensor's end). Empty and padded requests own no token.
* ``kv_indptr[0 : R+1]``: ``kv_indptr[0] = 0`` and
  ``kv_indptr[r+1] = kv_indptr[r] + ceil((cu_seqlens_k[r+1] - cu_seqlens_k[r]) / page_size)``
  (a negative length counts as 0 pages). Entries past ``R+1`` are untouched.
* ``kv_indices[kv_indptr[r] : kv_indptr[r+1]] = block_tables[r, :pages_r]``,
  as :mod:`kv_indices` does; entries past ``kv_indptr[R]`` are untouched.

Two launches, both with grids fixed by the buffers' capacities and ``R``: the
first writes ``token_request`` (a binary search per token over
``cu_seqlens_q``) while its program 0 scans the page counts into ``kv_indptr``
(one program covers up to ``MAX_SCAN_REQUESTS`` requests); the second generates
``kv_indices`` from the fresh ``kv_indptr``. No host sync, no allocation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2d_runner_adapters.consumers._launch import (
    cdiv,
    check_count,
    check_devices,
    check_tensor,
    next_power_of_two,
)
from h2d_runner_adapters.consumers.errors import ConsumerArgumentError
from h2d_runner_adapters.mha.kv_indices import check_kv_index_arguments, launch_kv_indices

BLOCK_TOKENS = 1024
"""Tokens one program assigns to their requests."""

MAX_SCAN_REQUESTS = 8192
"""The most requests (+1) one program's page-count scan covers."""


@triton.jit(do_not_specialize=["num_reqs", "num_tokens"])
def _prefill_prepare_kernel(  # type: ignore[no-untyped-def]
    cu_q_ptr,  # *i32 [>= num_reqs + 1]
    cu_k_ptr,  # *i32 [>= num_reqs + 1]
    num_reqs,
    page_size,
    token_request_ptr,  # *i32 [num_tokens]
    num_tokens,
    kv_indptr_ptr,  # *i32 [>= num_reqs + 1]
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,  # >= num_reqs + 1, fixed by cu_seqlens_k's capacity
    SEARCH_STEPS: tl.constexpr,  # >= log2(num_reqs + 1), fixed by cu_seqlens_q's capacity
):
    pid = tl.program_id(0)
    if pid == 0:
        reqs = tl.arange(0, BLOCK_R)
        live = reqs < num_reqs
        k_start = tl.load(cu_k_ptr + reqs, mask=live, other=0)
        k_end = tl.load(cu_k_ptr + reqs + 1, mask=live, other=0)
        length = tl.maximum(k_end - k_start, 0)
        pages = tl.where(live, (length + page_size - 1) // page_size, 0)
        tl.store(kv_indptr_ptr + reqs + 1, tl.cumsum(pages, axis=0), mask=live)
        tl.store(kv_indptr_ptr + reqs, tl.zeros_like(reqs), mask=reqs == 0)

    tokens = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    live_t = tokens < num_tokens
    first = tl.load(cu_q_ptr)
    total = tl.load(cu_q_ptr + num_reqs)
    # Largest r in [0, num_reqs] with cu_q[r] <= t: the invariant keeps cu_q[lo] <= t
    # and the answer in [lo, hi]; each step halves hi - lo.
    lo = tl.zeros((BLOCK_T,), tl.int32)
    hi = lo + num_reqs
    for _ in range(SEARCH_STEPS):
        open_range = lo < hi
        mid = (lo + hi + 1) // 2
        value = tl.load(cu_q_ptr + mid, mask=open_range & live_t, other=0)
        lo = tl.where(open_range & (value <= tokens), mid, lo)
        hi = tl.where(open_range & (value > tokens), mid - 1, hi)
    owner = tl.where((tokens >= first) & (tokens < total), lo, -1)
    tl.store(token_request_ptr + tokens, owner, mask=live_t)


def prepare_prefill_attention(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_tables: torch.Tensor,
    page_size: int,
    num_reqs: int,
    token_request: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """Write ``token_request``, ``kv_indptr[:num_reqs+1]`` and ``kv_indices`` in place.

    See the module docstring for the exact definitions and what stays untouched.
    ``page_size`` (tokens per block-table page) and ``num_reqs`` (graph padding
    included) are host-side ints.
    """
    func = "prepare_prefill_attention"
    num_reqs = check_count(func, "num_reqs", num_reqs)
    page_size = check_count(func, "page_size", page_size)
    if page_size == 0:
        raise ConsumerArgumentError(f"{func}: page_size must be >= 1 token per page, got 0")
    check_tensor(func, "cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, ndim=1,
                 min_numel=num_reqs + 1)
    check_tensor(func, "cu_seqlens_k", cu_seqlens_k, dtype=torch.int32, ndim=1,
                 min_numel=num_reqs + 1)
    check_tensor(func, "token_request", token_request, dtype=torch.int32, ndim=1)
    check_tensor(func, "kv_indptr", kv_indptr, dtype=torch.int32, ndim=1, min_numel=num_reqs + 1)
    check_kv_index_arguments(func, block_tables, kv_indices, num_reqs)
    scan_width = min(next_power_of_two(cu_seqlens_k.numel()), MAX_SCAN_REQUESTS)
    if num_reqs + 1 > scan_width:
        raise ConsumerArgumentError(
            f"{func}: num_reqs={num_reqs} exceeds the {MAX_SCAN_REQUESTS - 1} requests one "
            "program scans; split the prefill batch"
        )
    check_devices(
        func,
        _prefill_prepare_kernel,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k,
        block_tables=block_tables,
        token_request=token_request,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
    )
    num_tokens = token_request.numel()
    grid = (max(cdiv(num_tokens, BLOCK_TOKENS), 1),)
    _prefill_prepare_kernel[grid](
        cu_seqlens_q,
        cu_seqlens_k,
        num_reqs,
        page_size,
        token_request,
        num_tokens,
        kv_indptr,
        BLOCK_T=BLOCK_TOKENS,
        BLOCK_R=scan_width,
        SEARCH_STEPS=cu_seqlens_q.numel().bit_length(),
    )
    launch_kv_indices(block_tables, kv_indptr, kv_indices, num_reqs)
