"""KV-index generation: flatten block-table rows into ``kv_indices`` by ``kv_indptr``.

The first consumer of the ``mha_decode`` group (and the last step of prefill
attention preparation). For every row ``r < num_rows``::

    n = kv_indptr[r+1] - kv_indptr[r]
    kv_indices[kv_indptr[r] : kv_indptr[r] + n] = block_tables[r, :n]

Layout: ``block_tables`` int32 ``[S, B]`` (any strides), ``kv_indptr`` int32
``[>= num_rows + 1]``, ``kv_indices`` int32 (contiguous).

Writes nothing else: ``kv_indices`` past ``kv_indptr[num_rows]`` is untouched and
``kv_indptr`` past ``num_rows + 1`` is never read. Graph padding: a padded row
whose ``kv_indptr`` repeats the total owns no pages, so it reads no block-table
entry (its possibly stale row is never dereferenced) and writes nothing. A row
claiming more than ``B`` pages gets its ``B`` columns; a write that would land
outside ``kv_indices`` is dropped. Neither happens with a consistent indptr.

Work split: a 2-D grid of (row, column chunk); the number of chunks is fixed by
the table width ``B``, so the grid depends only on ``num_rows``.
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
)

BLOCK_COLUMNS = 1024
"""Block-table columns one program copies (4 KiB of page ids)."""


@triton.jit(do_not_specialize=["capacity", "num_rows", "header_row"])
def _kv_indices_kernel(  # type: ignore[no-untyped-def]
    block_tables_ptr,  # *i32 [S, B]
    bt_stride0,
    bt_stride1,
    bt_columns,  # B
    kv_indptr_ptr,  # *i32 [>= num_rows + 1]
    kv_indices_ptr,  # *i32 [capacity]
    capacity,
    num_rows,  # the rows, or (FROM_HEADER) the grid's largest
    header_ptr,  # *i64 [rows, 4]: the arena header the publication's DMA carried
    header_row,  # kv_indptr's row: column 1 holds its published bytes
    BLOCK: tl.constexpr,
    FROM_HEADER: tl.constexpr,
):
    row = tl.program_id(0)
    if FROM_HEADER:  # fused into the publication's graph: this step's rows, on the device
        indptr_bytes = tl.load(header_ptr + header_row * 4 + 1)
        num_rows = tl.minimum(tl.maximum(indptr_bytes // 4 - 1, 0), num_rows).to(tl.int32)
    live = row < num_rows
    start = tl.load(kv_indptr_ptr + row, mask=live, other=0)
    end = tl.load(kv_indptr_ptr + row + 1, mask=live, other=0)
    pages = tl.minimum(end - start, bt_columns)

    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dst = start + cols
    write = live & (cols < pages) & (dst >= 0) & (dst < capacity)
    src = row.to(tl.int64) * bt_stride0 + cols * bt_stride1
    ids = tl.load(block_tables_ptr + src, mask=write, other=0)
    tl.store(kv_indices_ptr + dst, ids, mask=write)


def launch_kv_indices(
    block_tables: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_rows: int,
) -> None:
    """Launch the kernel on arguments the caller has already checked."""
    _launch(block_tables, kv_indptr, kv_indices, num_rows, kv_indptr, 0, False)


def launch_kv_indices_from_header(
    block_tables: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    header: torch.Tensor,
    header_row: int,
) -> None:
    """The same kernel, fused into a publication: the row count is ``kv_indptr``'s
    published entries minus one, read from ``header[header_row, 1]`` (bytes) on the device;
    the grid covers every row ``kv_indptr`` can hold, so one captured launch serves every
    step. Arguments are checked once, by the adapter that declares the fusion."""
    _launch(block_tables, kv_indptr, kv_indices, kv_indptr.numel() - 1, header, header_row,
            True)


def _launch(block_tables: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
            rows: int, header: torch.Tensor, header_row: int, from_header: bool) -> None:
    grid = (bucket(rows), cdiv(max(block_tables.shape[1], 1), BLOCK_COLUMNS))
    _kv_indices_kernel[grid](
        block_tables,
        block_tables.stride(0),
        block_tables.stride(1),
        block_tables.shape[1],
        kv_indptr,
        kv_indices,
        kv_indices.numel(),
        rows,
        header,  # unread unless from_header
        header_row,
        BLOCK=BLOCK_COLUMNS,
        FROM_HEADER=from_header,
    )


def check_kv_index_arguments(
    func: str,
    block_tables: object,
    kv_indices: object,
    num_rows: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks shared by :func:`generate_kv_indices` and prefill preparation."""
    tables = check_tensor(
        func, "block_tables", block_tables, dtype=torch.int32, ndim=2,
        min_numel=num_rows, unit_stride=False,
    )
    indices = check_tensor(func, "kv_indices", kv_indices, dtype=torch.int32, ndim=1)
    return tables, indices


def generate_kv_indices(
    block_tables: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    num_rows: int,
) -> None:
    """Write ``kv_indices`` in place from ``block_tables`` rows and the ``kv_indptr`` prefix.

    ``num_rows`` is the host-side row count, graph padding included (see the module
    docstring). No host sync, no allocation; one launch.
    """
    func = "generate_kv_indices"
    num_rows = check_count(func, "num_rows", num_rows)
    check_kv_index_arguments(func, block_tables, kv_indices, num_rows)
    check_tensor(func, "kv_indptr", kv_indptr, dtype=torch.int32, ndim=1, min_numel=num_rows + 1)
    check_devices(
        func,
        _kv_indices_kernel,
        block_tables=block_tables,
        kv_indptr=kv_indptr,
        kv_indices=kv_indices,
    )
    launch_kv_indices(block_tables, kv_indptr, kv_indices, num_rows)
