"""DeepSeek-V4/V4.1 window rows: where a request's window rings live in the KV row space
(:class:`WindowGeometry`, in view rows) and the decode window tails
(:func:`write_v4_decode_window_indices`), a first consumer of ``v41_metadata``.

Kernel, launcher and plain-Python oracle sit together; host counts are Python ints.
"""

from __future__ import annotations

from dataclasses import dataclass
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
from h2d_runner_adapters.v4.decode_steps import BLOCK_COLUMNS, StepIndptrs


@dataclass(frozen=True)
class WindowGeometry:
    """Where a request's window ring rows live in the KV row space (one allocation).

    The row of position ``p`` in class ``c`` of physical state slot ``s`` is
    ``s * slot_rows + ring_start_c + (r // stride_c) * run_rows_c + r % stride_c`` with
    ``r = p % ring_positions``; ``classes`` holds ``(ring_start, stride, run_rows)`` for the
    dense (SWA), CSA and HCA classes, in that order.

    Every row the V4 consumers write into a slice or a ``dest`` (these window rows, and
    the compressed rows ``block * envelope_rows + e % (256 / ratio)`` of the HCA head) is a
    VIEW ROW: relative to the reading layer's view base, the row that layer's view of the
    KV pool starts at (a compressed layer's: its offset in the block envelope). A layer
    reads and writes row ``view_base + cell``, so one published slice serves every layer
    of its class: ``ring_start_c`` is relative to the view base of the class's first layer,
    and ``run_rows_c = layers_in_class * stride_c`` interleaves the layers' rings (for a
    compressed class ``stride_c`` is its rows per block, so the view bases interleave
    both). With one layer per class at view base 0 view rows are absolute rows.
    """

    slot_rows: int
    ring_positions: int
    classes: tuple[tuple[int, int, int], tuple[int, int, int], tuple[int, int, int]]

    def row(self, cls: int, slot: int, position: int) -> int:
        start, stride, run = self.classes[cls]
        r = position % self.ring_positions
        return slot * self.slot_rows + start + (r // stride) * run + r % stride


@triton.jit
def _window_row(slot, pos, slot_rows, ring, start, stride, run):  # type: ignore[no-untyped-def]
    r = pos % ring
    return slot * slot_rows + start + (r // stride) * run + r % stride


class DecodeWindowIndices(NamedTuple):
    """The window outputs of :func:`write_v4_decode_window_indices` (int32 tensors):
    per class (dense/SWA, CSA, HCA) the index buffer whose slices the step indptrs give,
    and the row each token's own KV goes to (``dest``)."""

    swa_indices: torch.Tensor
    csa_indices: torch.Tensor
    hca_indices: torch.Tensor
    dest_dense: torch.Tensor
    dest_csa: torch.Tensor
    dest_hca: torch.Tensor


@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "window", "slot_rows", "ring",
                               "d_start", "d_stride", "d_run", "c_start", "c_stride",
                               "c_run", "h_start", "h_stride", "h_run"])
def _decode_window_kernel(  # type: ignore[no-untyped-def]
    positions_ptr, batch_ids_ptr, slots_ptr, slots_in_ptr, swa_ptr, csa_ptr, hca_ptr,
    swa_out, csa_out, hca_out, dest_d, dest_c, dest_h,
    num_tokens, num_reqs, window, slot_rows, ring,
    d_start, d_stride, d_run, c_start, c_stride, c_run, h_start, h_stride, h_run,
    BLOCK: tl.constexpr,
    QMAX: tl.constexpr,  # >= the widest query, a power of two
):
    t = tl.program_id(0)
    live = t < num_tokens
    b = tl.load(batch_ids_ptr + t, mask=live, other=-1)
    real = live & (b >= 0) & (b < num_reqs)
    p = tl.load(positions_ptr + t, mask=real, other=0).to(tl.int32)
    slot = tl.load(slots_ptr + b, mask=real, other=0)
    slot_in = tl.load(slots_in_ptr + b, mask=real, other=0)
    # j: the token's index in its request's query (its tokens are contiguous, at most
    # QMAX), so the step's first position is p - j: positions before it are state
    # earlier steps left in state_slot_in (a fork source), the others this step's rows
    back = t - 1 - tl.arange(0, QMAX)
    prev = tl.load(batch_ids_ptr + back, mask=real & (back >= 0), other=-1)
    first_pos = p - tl.sum((prev == b).to(tl.int32), axis=0)
    n = tl.minimum(p + 1, window)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    w = real & (i < n)
    pos_i = p - n + 1 + i
    slot_i = tl.where(pos_i < first_pos, slot_in, slot)
    # the window at each slice's tail: [ptr[t+1] - n, ptr[t+1])
    e = tl.load(swa_ptr + t + 1, mask=real, other=0) - n
    tl.store(swa_out + e + i,
             _window_row(slot_i, pos_i, slot_rows, ring, d_start, d_stride, d_run),
             mask=w)
    e = tl.load(csa_ptr + t + 1, mask=real, other=0) - n
    tl.store(csa_out + e + i,
             _window_row(slot_i, pos_i, slot_rows, ring, c_start, c_stride, c_run),
             mask=w)
    e = tl.load(hca_ptr + t + 1, mask=real, other=0) - n
    tl.store(hca_out + e + i,
             _window_row(slot_i, pos_i, slot_rows, ring, h_start, h_stride, h_run),
             mask=w)
    first = real & (i < 1)  # one lane writes the token's own rows
    zero = i * 0
    tl.store(dest_d + t + zero,
             _window_row(slot, p + zero, slot_rows, ring, d_start, d_stride, d_run),
             mask=first)
    tl.store(dest_c + t + zero,
             _window_row(slot, p + zero, slot_rows, ring, c_start, c_stride, c_run),
             mask=first)
    tl.store(dest_h + t + zero,
             _window_row(slot, p + zero, slot_rows, ring, h_start, h_stride, h_run),
             mask=first)


def write_v4_decode_window_indices(
    positions: torch.Tensor,
    batch_ids: torch.Tensor,
    state_slots_out: torch.Tensor,
    state_slots_in: torch.Tensor,
    indptrs: StepIndptrs,
    out: DecodeWindowIndices,
    geometry: WindowGeometry,
    *,
    num_tokens: int,
    num_reqs: int,
    window: int,
    max_query_len: int,
) -> DecodeWindowIndices:
    """The window part of each decode token's index slices, after
    :func:`generate_v4_step_indptrs`: for a real token at position ``p`` of request ``b``
    (``n = min(p + 1, W)``), the last ``n`` entries of its SWA, CSA and HCA slices are the
    window rows of positions ``p - n + 1 .. p`` in the dense, CSA and HCA classes, and
    ``dest_c[t]`` is the row of ``p`` itself. A position this step writes (``>= p - j``
    for the ``j``-th token of the request's query) lies in ``state_slots_out[b]``, an
    earlier one in ``state_slots_in[b]`` (a fork source, else the same slot): a fork's
    step reads its source's window. Rows are view rows (:class:`WindowGeometry`). The
    slice heads (HCA compressed rows, CSA top-k) are not touched. Padded tokens write
    nothing. ``max_query_len`` bounds every request's tokens this step (a host int).
    """
    func = "write_v4_decode_window_indices"
    t = check_count(func, "num_tokens", num_tokens)
    n = check_count(func, "num_reqs", num_reqs)
    window = check_count(func, "window", window)
    qmax = check_count(func, "max_query_len", max_query_len)
    check_tensor(func, "positions", positions, dtype=torch.int64, ndim=1, min_numel=t)
    check_tensor(func, "batch_ids", batch_ids, dtype=torch.int32, ndim=1, min_numel=t)
    check_tensor(func, "state_slots_out", state_slots_out, dtype=torch.int32, ndim=1,
                 min_numel=n)
    check_tensor(func, "state_slots_in", state_slots_in, dtype=torch.int32, ndim=1,
                 min_numel=n)
    for name in DecodeWindowIndices._fields:
        check_tensor(func, name, getattr(out, name), dtype=torch.int32, ndim=1,
                     min_numel=t if name.startswith("dest") else 0)
    check_devices(func, _decode_window_kernel, positions=positions, batch_ids=batch_ids,
                  state_slots_out=state_slots_out, state_slots_in=state_slots_in,
                  swa_indices=out.swa_indices, dest_dense=out.dest_dense)
    (ds, dst, dr), (cs, cst, cr), (hs, hst, hr) = geometry.classes
    grid = (next_power_of_two(t), -(-max(window, 1) // BLOCK_COLUMNS))
    _decode_window_kernel[grid](
        positions, batch_ids, state_slots_out, state_slots_in, indptrs.swa_indptr,
        indptrs.csa_indptr, indptrs.hca_indptr, out.swa_indices, out.csa_indices,
        out.hca_indices, out.dest_dense, out.dest_csa, out.dest_hca, t, n, window,
        geometry.slot_rows, geometry.ring_positions, ds, dst, dr, cs, cst, cr, hs, hst, hr,
        BLOCK=BLOCK_COLUMNS, QMAX=max(next_power_of_two(qmax), 2),
    )
    return out


def write_v4_decode_window_indices_reference(
    positions: list[int],
    batch_ids: list[int],
    state_slots_out: list[int],
    state_slots_in: list[int],
    indptrs: dict[str, list[int]],
    geometry: WindowGeometry,
    *,
    window: int,
) -> dict[str, dict[int, int]]:
    """Plain-Python oracle: the cells written (index -> value) per output."""
    out: dict[str, dict[int, int]] = {name: {} for name in DecodeWindowIndices._fields}
    j = 0  # the token's index in its request's query
    for t, (p, b) in enumerate(zip(positions, batch_ids, strict=True)):
        j = j + 1 if t and batch_ids[t - 1] == b else 0
        if b < 0:
            continue
        s = state_slots_out[b]
        n = min(p + 1, window)
        for cls, (idx, ptr, dest) in enumerate((("swa_indices", "swa_indptr", "dest_dense"),
                                               ("csa_indices", "csa_indptr", "dest_csa"),
                                               ("hca_indices", "hca_indptr", "dest_hca"))):
            end = indptrs[ptr][t + 1]
            for i in range(n):
                x = p - n + 1 + i  # before the step's first position: the slot read
                out[idx][end - n + i] = geometry.row(
                    cls, state_slots_in[b] if x < p - j else s, x)
            out[dest][t] = geometry.row(cls, s, p)
    return out
