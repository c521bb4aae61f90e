"""Draft acceptance on the GPU: compare drafts with the target's argmax, no readback.

After a verify step, request ``i`` proposed ``d_i`` drafts (rows ``cu[i-1] .. cu[i] - 1``
of ``draft_ids`` / ``target_argmax``, ``cu`` = the published inclusive
``cu_num_draft_tokens``). Acceptance ignores temperature and filters (the target's argmax
decides, as engines do); the bonus row is sampled by the ordinary sampler beforehand
(``bonus_tokens``, so uniform top-k/top-p stay host scalars there too). For ``i <
num_reqs``::

    a = the number of leading j with draft_ids[cu[i-1] + j] == target_argmax[cu[i-1] + j]
    out_tokens[i, :a]  = the accepted drafts
    out_tokens[i, a]   = target_argmax[cu[i-1] + a] if a < d_i else bonus_tokens[i]
    out_tokens[i, a+1:] = -1
    num_accepted[i] = a;  num_rejected[i] = d_i - a

All outputs stay on the device (the draft loop reads ``num_rejected``; GDN and Engram the
accepted counts); nothing is read back.
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
from h2d_runner_adapters.consumers.errors import ConsumerArgumentError


@triton.jit(do_not_specialize=["num_reqs", "out_stride"])
def _accept_kernel(  # type: ignore[no-untyped-def]
    drafts_ptr,  # *i32 [total drafts]
    argmax_ptr,  # *i64 / *i32 [total drafts]
    cu_ptr,  # *i32 [n] inclusive draft prefix
    bonus_ptr,  # *i32 [n]
    out_ptr,  # *i32 [n, K + 1]
    out_stride,
    accepted_ptr,  # *i32 [n]
    rejected_ptr,  # *i32 [n]
    num_reqs,
    K1: tl.constexpr,  # K + 1 columns
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    live = i < num_reqs
    end = tl.load(cu_ptr + i, mask=live, other=0)
    start = tl.load(cu_ptr + i - 1, mask=live & (i > 0), other=0)
    d = end - start
    j = tl.arange(0, BLOCK)
    is_draft = live & (j < d)
    draft = tl.load(drafts_ptr + start + j, mask=is_draft, other=0)
    target = tl.load(argmax_ptr + start + j, mask=is_draft, other=0).to(tl.int32)
    miss = is_draft & (draft != target)
    # the first mismatch (d when every draft matches)
    a = tl.min(tl.where(miss, j, d), axis=0)
    fix = tl.sum(tl.where(j == a, target, 0), axis=0)  # the target's token at the mismatch
    bonus = tl.load(bonus_ptr + i, mask=live, other=0)
    last = tl.where(a < d, fix, bonus)
    tok = tl.where(j < a, draft, tl.where(j == a, last, -1))
    tl.store(out_ptr + i.to(tl.int64) * out_stride + j, tok, mask=live & (j < K1))
    tl.store(accepted_ptr + i, a, mask=live)
    tl.store(rejected_ptr + i, d - a, mask=live)


def accept_draft_tokens(
    draft_ids: torch.Tensor,
    target_argmax: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    out_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    num_rejected: torch.Tensor,
    *,
    num_reqs: int,
) -> None:
    """Accept each request's leading drafts that match the target's argmax and emit its
    tokens (see the module docstring). ``draft_ids`` int32, ``target_argmax`` int64 or
    int32 (one per draft row), ``cu_num_draft_tokens``/``bonus_tokens`` int32 ``[>= n]``,
    ``out_tokens`` int32 ``[>= n, K + 1]`` (K = the most drafts a request has),
    ``num_accepted``/``num_rejected`` int32 ``[>= n]``. One launch, no host sync."""
    func = "accept_draft_tokens"
    n = check_count(func, "num_reqs", num_reqs)
    check_tensor(func, "draft_ids", draft_ids, dtype=torch.int32, ndim=1)
    if not isinstance(target_argmax, torch.Tensor) or target_argmax.dtype not in (
            torch.int64, torch.int32) or target_argmax.dim() != 1:
        raise ConsumerArgumentError(
            f"{func}: target_argmax must be a 1-D int64 or int32 tensor (torch.argmax output)")
    check_tensor(func, "cu_num_draft_tokens", cu_num_draft_tokens, dtype=torch.int32,
                 ndim=1, min_numel=n)
    check_tensor(func, "bonus_tokens", bonus_tokens, dtype=torch.int32, ndim=1, min_numel=n)
    check_tensor(func, "out_tokens", out_tokens, dtype=torch.int32, ndim=2, min_numel=n)
    check_tensor(func, "num_accepted", num_accepted, dtype=torch.int32, ndim=1, min_numel=n)
    check_tensor(func, "num_rejected", num_rejected, dtype=torch.int32, ndim=1, min_numel=n)
    check_devices(func, _accept_kernel, draft_ids=draft_ids, target_argmax=target_argmax,
                  cu_num_draft_tokens=cu_num_draft_tokens, bonus_tokens=bonus_tokens,
                  out_tokens=out_tokens, num_accepted=num_accepted, num_rejected=num_rejected)
    if n:
        k1 = out_tokens.shape[1]
        _accept_kernel[(n,)](draft_ids, target_argmax, cu_num_draft_tokens, bonus_tokens,
                             out_tokens, out_tokens.stride(0), num_accepted, num_rejected, n,
                             K1=k1, BLOCK=next_power_of_two(k1))


def accept_draft_tokens_reference(draft_ids: list[int], target_argmax: list[int],
                                  num_drafts: list[int], bonus_tokens: list[int], width: int
                                  ) -> tuple[list[list[int]], list[int], list[int]]:
    """Plain-Python oracle: (out_tokens rows, num_accepted, num_rejected)."""
    rows, acc, rej, start = [], [], [], 0
    for d, bonus in zip(num_drafts, bonus_tokens, strict=True):
        a = 0
        while a < d and draft_ids[start + a] == target_argmax[start + a]:
            a += 1
        last = target_argmax[start + a] if a < d else bonus
        row = [*draft_ids[start : start + a], last]
        rows.append(row + [-1] * (width - len(row)))
        acc.append(a)
        rej.append(d - a)
        start += d
    return rows, acc, rej
