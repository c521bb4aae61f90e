"""DeepSeek-V4/V4.1's FP8 ragged indexer rectangle, from the step's query prefix and
committed counts: kernel, launcher and plain-Python oracle."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2d_runner_adapters.consumers._launch import (
    check_count,
    check_devices,
    check_tensor,
)
from h2d_runner_adapters.consumers.errors import ConsumerArgumentError
from h2d_runner_adapters.v4.decode_steps import (
    BLOCK_COLUMNS,
)


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
