"""GDN state-row selection: the first reader of the gated-delta-net state indices.

A stand-in for the causal-conv / recurrent kernels' first step: pick each request's
initial state row from the pool by its published index. For ``i < num_rows``::

    col = num_accepted[i] - 1        (speculative decode: the last accepted token's slot)
        | 0                          (non-speculative: ``indices`` is ``[S, 1]``)
    idx = indices[i, col]
    out[i, :] = pool[idx, :]         if 0 <= idx < pool rows, else 0 (PAD_SLOT_ID = -1)

Rows of ``out`` past ``num_rows`` are untouched. An accepted count outside
``[1, indices.shape[1]]`` selects nothing (the row becomes 0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2d_runner_adapters.consumers._launch import (
    bucket,
    check_count,
    check_devices,
    check_tensor,
    next_power_of_two,
)
from h2d_runner_adapters.consumers.errors import ConsumerArgumentError


@triton.jit(do_not_specialize=["num_rows", "pool_rows", "columns", "idx_stride"])
def _gdn_states_kernel(  # type: ignore[no-untyped-def]
    pool_ptr,  # *f32 [pool_rows, D] contiguous
    pool_rows,
    idx_ptr,  # *i32 [S, columns] (row stride idx_stride)
    idx_stride,
    columns,
    accepted_ptr,  # *i32 [S] (read only if HAS_ACCEPTED)
    out_ptr,  # *f32 [>= num_rows, D] contiguous
    num_rows,
    D: tl.constexpr,
    D_P2: tl.constexpr,
    HAS_ACCEPTED: tl.constexpr,
):
    row = tl.program_id(0)
    live = row < num_rows
    col = 0
    if HAS_ACCEPTED:
        col = tl.load(accepted_ptr + row, mask=live, other=1) - 1
    ok = live & (col >= 0) & (col < columns)
    idx = tl.load(idx_ptr + row.to(tl.int64) * idx_stride + col, mask=ok, other=-1)
    take = ok & (idx >= 0) & (idx < pool_rows)
    d = tl.arange(0, D_P2)
    vals = tl.load(pool_ptr + idx.to(tl.int64) * D + d, mask=take & (d < D), other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * D + d, vals, mask=live & (d < D))


def gather_gdn_states(
    pool: torch.Tensor,
    indices: torch.Tensor,
    out: torch.Tensor,
    num_rows: int,
    num_accepted: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write each row's initial state (see the module docstring); return ``out[:num_rows]``.

    ``pool`` float32 ``[slots, D]`` and ``out`` float32 ``[>= num_rows, D]`` contiguous;
    ``indices`` int32 ``[>= num_rows, C]`` (unit column stride); ``num_accepted`` int32
    ``[>= num_rows]`` for speculative rows. One launch, no host sync.
    """
    func = "gather_gdn_states"
    n = check_count(func, "num_rows", num_rows)
    check_tensor(func, "pool", pool, dtype=torch.float32, ndim=2)
    check_tensor(func, "indices", indices, dtype=torch.int32, ndim=2, min_numel=n)
    check_tensor(func, "out", out, dtype=torch.float32, ndim=2, min_numel=n)
    if not (pool.is_contiguous() and out.is_contiguous()) or out.shape[1] != pool.shape[1]:
        raise ConsumerArgumentError(
            f"{func}: pool {tuple(pool.shape)} and out {tuple(out.shape)} must be contiguous "
            "with the same state width")
    tensors = {"pool": pool, "indices": indices, "out": out}
    if num_accepted is not None:
        check_tensor(func, "num_accepted", num_accepted, dtype=torch.int32, ndim=1,
                     min_numel=n)
        tensors["num_accepted"] = num_accepted
    check_devices(func, _gdn_states_kernel, **tensors)
    if n:
        width = pool.shape[1]
        _gdn_states_kernel[(bucket(n),)](
            pool, pool.shape[0], indices, indices.stride(0), indices.shape[1],
            indices if num_accepted is None else num_accepted, out, n, D=width,
            D_P2=next_power_of_two(width), HAS_ACCEPTED=num_accepted is not None)
    return out[:n]


def gather_gdn_states_reference(pool: list[list[float]], indices: list[list[int]],
                                num_rows: int, num_accepted: list[int] | None = None
                                ) -> list[list[float]]:
    """Plain-Python oracle of :func:`gather_gdn_states`."""
    width = len(pool[0]) if pool else 0
    out = []
    for i in range(num_rows):
        col = 0 if num_accepted is None else num_accepted[i] - 1
        idx = indices[i][col] if 0 <= col < len(indices[i]) else -1
        out.append(list(pool[idx]) if 0 <= idx < len(pool) else [0.0] * width)
    return out
