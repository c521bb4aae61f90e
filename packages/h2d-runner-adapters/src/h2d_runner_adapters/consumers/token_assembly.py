"""Token assembly: fill deferred decode ids from the previous step's sampled tokens.

The first consumer of the ``token_inputs`` group. After publication,
``input_ids`` holds the host-staged ids of every token of the step. A request
whose ids the host did not know when it staged them (a carried-over decode
request, whose previous token is still being sampled on the GPU) has
placeholders in its span; this kernel overwrites them from ``prev_sampled``.

Layout (all int32, all on one device):

* ``input_ids[N+1]``: token ``t`` of the step lives at ``input_ids[t]``.
* ``decode_cu[R+1]``: exclusive prefix of per-request token counts; request
  ``r`` owns ``input_ids[decode_cu[r]:decode_cu[r+1]]``.
* ``decode_src[R]``: ``-1`` means the request's ids were staged from the host
  (nothing is written); ``s >= 0`` means token ``j`` of the span takes
  ``prev_sampled[s, j]``.
* ``prev_sampled[R_prev, W]``: the previous step's sampled tokens per request
  (``W`` = most tokens sampled per request, 1, or ``k+1`` with speculation).

Writes exactly the deferred spans, nothing else: host-staged spans, tokens past
``decode_cu[num_reqs]`` and the rest of ``input_ids`` keep their contents.
Graph padding: padded requests repeat the last prefix value (an empty span) and
carry ``decode_src = -1``; either alone makes them write nothing. A source row
outside ``[0, R_prev)`` writes nothing (there is nothing valid to read, and the
placeholder stays): :class:`~h2d_runner_adapters.TokenInputs` refuses such a row on the
host first (its producers against ``prev_rows``, its ``assemble`` against a smaller
``prev_sampled``), so a device-side guard only keeps a bad launch in bounds; a span
longer than ``W`` gets its first ``W`` tokens and keeps the staged rest, since
the previous step sampled no more than ``W`` tokens for it.

Fused into the publication (:func:`launch_assembly_from_header`), the request count is
``decode_cu``'s published entries minus one, read from the arena header on the device, over
a grid of every request ``decode_cu`` can hold: one captured launch serves every step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2d_runner_adapters.consumers._launch import (
    bucket,
    cdiv,
    check_count,
    check_devices,
    check_tensor,
    next_power_of_two,
)

REQUESTS_PER_PROGRAM = 128
"""Requests one program handles: decode spans are short, so many share a program."""


@triton.jit(do_not_specialize=["num_ids", "prev_rows", "num_reqs", "header_row"])
def _assemble_kernel(  # type: ignore[no-untyped-def]
    input_ids_ptr,  # *i32 [num_ids]
    num_ids,  # i32: elements of input_ids (writes stay below it)
    decode_cu_ptr,  # *i32 [>= num_reqs + 1]
    decode_src_ptr,  # *i32 [>= num_reqs]
    prev_ptr,  # *i32 [prev_rows, width]
    prev_rows,
    prev_stride0,
    prev_stride1,
    width,  # i32: W, columns of prev_sampled
    num_reqs,  # i32: requests to process, graph padding included (FROM_HEADER: the most)
    header_ptr,  # *i64 [rows, 4]: the arena header the publication's DMA carried
    header_row,  # decode_cu's row: column 1 holds its published bytes
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    FROM_HEADER: tl.constexpr,
):
    if FROM_HEADER:  # fused into the publication's graph: this step's requests, on the device
        cu_bytes = tl.load(header_ptr + header_row * 4 + 1)
        num_reqs = tl.minimum(tl.maximum(cu_bytes // 4 - 1, 0), num_reqs).to(tl.int32)
    reqs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = reqs < num_reqs
    src = tl.load(decode_src_ptr + reqs, mask=live, other=-1)
    start = tl.load(decode_cu_ptr + reqs, mask=live, other=0)
    end = tl.load(decode_cu_ptr + reqs + 1, mask=live, other=0)
    deferred = live & (src >= 0) & (src < prev_rows)

    cols = tl.arange(0, BLOCK_W)
    pos = start[:, None] + cols[None, :]
    write = (
        deferred[:, None]
        & (cols[None, :] < width)
        & (pos < end[:, None])
        & (pos >= 0)
        & (pos < num_ids)
    )
    src_offset = src.to(tl.int64)[:, None] * prev_stride0 + cols[None, :] * prev_stride1
    tokens = tl.load(prev_ptr + src_offset, mask=write, other=0)
    tl.store(input_ids_ptr + pos, tokens, mask=write)


def assemble_token_ids(
    input_ids: torch.Tensor,
    decode_cu: torch.Tensor,
    decode_src: torch.Tensor,
    prev_sampled: torch.Tensor,
    num_reqs: int,
) -> None:
    """Fill the deferred spans of ``input_ids`` in place from ``prev_sampled``.

    ``num_reqs`` is the host-side request count, graph padding included (see the
    module docstring for layouts and padding). No host sync, no allocation; one
    launch whose grid depends only on ``num_reqs``.
    """
    func = "assemble_token_ids"
    num_reqs = check_count(func, "num_reqs", num_reqs)
    check_tensor(func, "input_ids", input_ids, dtype=torch.int32, ndim=1)
    check_tensor(func, "decode_cu", decode_cu, dtype=torch.int32, ndim=1, min_numel=num_reqs + 1)
    check_tensor(func, "decode_src", decode_src, dtype=torch.int32, ndim=1, min_numel=num_reqs)
    check_tensor(func, "prev_sampled", prev_sampled, dtype=torch.int32, ndim=2, unit_stride=False)
    check_devices(
        func,
        _assemble_kernel,
        input_ids=input_ids,
        decode_cu=decode_cu,
        decode_src=decode_src,
        prev_sampled=prev_sampled,
    )
    _launch(input_ids, decode_cu, decode_src, prev_sampled, num_reqs, decode_cu, 0, False)


def launch_assembly_from_header(
    input_ids: torch.Tensor,
    decode_cu: torch.Tensor,
    decode_src: torch.Tensor,
    prev_sampled: torch.Tensor,
    header: torch.Tensor,
    header_row: int,
) -> None:
    """The same kernel, fused into a publication: the request count is ``decode_cu``'s
    published entries minus one, read from ``header[header_row, 1]`` (bytes) on the device;
    the grid covers every request ``decode_cu`` can hold. Arguments are checked once, by
    the adapter that declares the fusion."""
    _launch(input_ids, decode_cu, decode_src, prev_sampled, decode_cu.numel() - 1, header,
            header_row, True)


def _launch(input_ids: torch.Tensor, decode_cu: torch.Tensor, decode_src: torch.Tensor,
            prev_sampled: torch.Tensor, num_reqs: int, header: torch.Tensor, header_row: int,
            from_header: bool) -> None:
    prev_rows, width = prev_sampled.shape
    grid = (cdiv(bucket(num_reqs), REQUESTS_PER_PROGRAM),)
    _assemble_kernel[grid](
        input_ids,
        input_ids.numel(),
        decode_cu,
        decode_src,
        prev_sampled,
        prev_rows,
        prev_sampled.stride(0),
        prev_sampled.stride(1),
        width,
        num_reqs,
        header,  # unread unless from_header
        header_row,
        BLOCK_R=REQUESTS_PER_PROGRAM,
        BLOCK_W=next_power_of_two(width),
        FROM_HEADER=from_header,
    )
