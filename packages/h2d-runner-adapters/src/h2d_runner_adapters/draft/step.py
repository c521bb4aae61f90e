"""Draft-step metadata on the GPU: the MTP/EAGLE loop's per-step inputs, no upload.

After a verify step (request ``i`` ran ``q_i`` tokens ending at ``ctx_i``; rejection
sampling rejected ``r_i`` of its drafts, a device array), draft step ``k >= 1`` runs one
token per request at the anchor (the last accepted token, ``positions[cu_q[i+1] - 1] -
r_i``) plus ``k``. For ``i < num_reqs``::

    pos        = positions[cu_seqlens_q[i + 1] - 1] - num_rejected[i] + k
                 (an anchor index outside ``positions``, from a query prefix never
                 published for this step: the request becomes a padded row below, never
                 an out-of-bounds read nor a real KV slot)
    positions[i]    = pos
    context_lens[i] = pos + 1
    slot_mapping[i] = block_tables[i, pos // B] * B + pos % B     (-1 past the row width)
    kv_indptr[i+1]  = kv_indptr[i] + ceil((pos + 1) / B)
    cu_seqlens_q[i] = i

Padded rows ``num_reqs <= i < padded_reqs`` (a captured graph's batch): position 0,
context 0, slot -1, ``kv_indptr`` and ``cu_seqlens_q`` repeat their totals (they own no
pages and no tokens). Everything is read from the verify step's published members and the
sampler's output: the host passes only ints (the step, the counts), so the draft loop
uploads nothing and reads nothing back. The caller reserves the draft positions' pages
in the block table (as for the verify step's drafts).
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


class DraftStepMetadata(NamedTuple):
    """Device outputs of one draft step (preallocated, written in place)."""

    positions: torch.Tensor  # int64 [>= P]
    context_lens: torch.Tensor  # int32 [>= P]
    slot_mapping: torch.Tensor  # int64 [>= P]
    kv_indptr: torch.Tensor  # int32 [>= P + 1]
    cu_seqlens_q: torch.Tensor  # int32 [>= P + 1]


@triton.jit(do_not_specialize=["positions_numel", "num_reqs", "padded_reqs", "step",
                               "bt_columns"])
def _draft_step_kernel(  # type: ignore[no-untyped-def]
    positions_ptr,  # *i64 verify positions [positions_numel]
    positions_numel,
    cu_q_ptr,  # *i32 verify query prefix [>= n + 1]
    rejected_ptr,  # *i32 [>= n]
    bt_ptr,  # *i32 [S, B]
    bt_stride0,
    bt_stride1,
    bt_columns,
    out_pos_ptr,
    out_ctx_ptr,
    out_slot_ptr,
    out_indptr_ptr,
    out_cu_ptr,
    num_reqs,
    padded_reqs,
    step,
    PAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.arange(0, BLOCK)
    real = i < num_reqs
    rows = i < padded_reqs
    last = tl.load(cu_q_ptr + i + 1, mask=real, other=1) - 1
    # A query prefix that was never published for this step (or is stale) must neither
    # index outside the verify positions nor yield a KV slot a draft model would write:
    # such a request becomes a padded row (position 0, context 0, slot -1, no pages).
    valid = real & (last >= 0) & (last < positions_numel)
    anchor = tl.load(positions_ptr + last, mask=valid, other=0)
    rej = tl.load(rejected_ptr + i, mask=valid, other=0).to(tl.int64)
    pos = tl.where(valid, anchor - rej + step, 0)
    ctx = tl.where(valid, pos + 1, 0)
    col = pos // PAGE
    inside = valid & (col < bt_columns) & (pos >= 0)
    page = tl.load(bt_ptr + i.to(tl.int64) * bt_stride0 + col * bt_stride1, mask=inside,
                   other=0)
    slot = tl.where(inside, page.to(tl.int64) * PAGE + pos % PAGE, -1)
    pages = tl.where(valid, (ctx + PAGE - 1) // PAGE, 0).to(tl.int32)
    ends = tl.cumsum(pages, axis=0)
    tl.store(out_pos_ptr + i, pos, mask=rows)
    tl.store(out_ctx_ptr + i, ctx.to(tl.int32), mask=rows)
    tl.store(out_slot_ptr + i, slot, mask=rows)
    tl.store(out_indptr_ptr + i + 1, ends, mask=rows)
    tl.store(out_indptr_ptr + i, 0, mask=i == 0)
    tl.store(out_cu_ptr + i + 1, tl.minimum(i + 1, num_reqs), mask=rows)
    tl.store(out_cu_ptr + i, 0, mask=i == 0)


def advance_draft_step(
    positions: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    num_rejected: torch.Tensor,
    block_tables: torch.Tensor,
    out: DraftStepMetadata,
    *,
    num_reqs: int,
    padded_reqs: int,
    step: int,
    page_size: int,
) -> DraftStepMetadata:
    """Write draft step ``step``'s metadata into ``out`` (see the module docstring) from
    the verify step's ``positions`` (int64), ``cu_seqlens_q`` (int32), the sampler's
    ``num_rejected`` (int32) and the ``block_tables`` (int32 ``[S, B]``). One launch, no
    host sync, no allocation."""
    func = "advance_draft_step"
    n = check_count(func, "num_reqs", num_reqs)
    p = check_count(func, "padded_reqs", padded_reqs)
    k = check_count(func, "step", step)
    if p < n:
        raise ConsumerArgumentError(f"{func}: padded_reqs={p} is below num_reqs={n}")
    if k < 1:
        raise ConsumerArgumentError(
            f"{func}: step must be >= 1 (draft step 0 reuses the verify step's metadata)")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ConsumerArgumentError(f"{func}: page_size must be an int >= 1, got {page_size!r}")
    check_tensor(func, "positions", positions, dtype=torch.int64, ndim=1)
    check_tensor(func, "cu_seqlens_q", cu_seqlens_q, dtype=torch.int32, ndim=1,
                 min_numel=n + 1)
    check_tensor(func, "num_rejected", num_rejected, dtype=torch.int32, ndim=1, min_numel=n)
    check_tensor(func, "block_tables", block_tables, dtype=torch.int32, ndim=2, min_numel=n,
                 unit_stride=False)
    for name, dtype, rows in (("positions", torch.int64, p), ("context_lens", torch.int32, p),
                              ("slot_mapping", torch.int64, p),
                              ("kv_indptr", torch.int32, p + 1),
                              ("cu_seqlens_q", torch.int32, p + 1)):
        check_tensor(func, f"out.{name}", getattr(out, name), dtype=dtype, ndim=1,
                     min_numel=rows)
    check_devices(func, _draft_step_kernel, positions=positions, cu_seqlens_q=cu_seqlens_q,
                  num_rejected=num_rejected, block_tables=block_tables, **{
                      f"out.{f}": getattr(out, f) for f in DraftStepMetadata._fields})
    _draft_step_kernel[(1,)](
        positions, positions.numel(), cu_seqlens_q, num_rejected, block_tables,
        block_tables.stride(0), block_tables.stride(1), block_tables.shape[1],
        out.positions, out.context_lens,
        out.slot_mapping, out.kv_indptr, out.cu_seqlens_q, n, p, k, PAGE=page_size,
        BLOCK=next_power_of_two(max(p, 1)))
    return out


def advance_draft_step_reference(
    positions: list[int], cu_seqlens_q: list[int], num_rejected: list[int],
    rows: list[list[int]], *, num_reqs: int, padded_reqs: int, step: int, page_size: int,
    table_width: int,
) -> dict[str, list[int]]:
    """Plain-Python oracle of :func:`advance_draft_step` (the first ``P`` / ``P + 1``
    entries of each output)."""
    out: dict[str, list[int]] = {"positions": [], "context_lens": [], "slot_mapping": [],
                                 "kv_indptr": [0], "cu_seqlens_q": [0]}
    for i in range(padded_reqs):
        last = cu_seqlens_q[i + 1] - 1 if i < num_reqs else -1
        if 0 <= last < len(positions):
            pos = positions[last] - num_rejected[i] + step
            col = pos // page_size
            slot = (rows[i][col] * page_size + pos % page_size
                    if pos >= 0 and col < table_width else -1)
            ctx, pages = pos + 1, -(-(pos + 1) // page_size)
        else:
            pos, ctx, slot, pages = 0, 0, -1, 0
        out["positions"].append(pos)
        out["context_lens"].append(ctx)
        out["slot_mapping"].append(slot)
        out["kv_indptr"].append(out["kv_indptr"][-1] + pages)
        out["cu_seqlens_q"].append(min(i + 1, num_reqs))
    return out
