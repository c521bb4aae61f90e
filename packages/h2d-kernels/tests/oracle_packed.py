"""Test oracle: the packing rule of ``publish_packed`` (``_packed.pyx``), written plainly.

Production code never imports this: the compiled module is the only implementation. The
tests compare what the compiled publication writes into the host arena (header rows and
staging bytes) and the DMA end it returns against :func:`expected_arena`, which works on
copies of the bytes (numpy slices), not on raw addresses.

The rule:

* member ``i``'s header row ``i`` gets ``counts[i] * unit_bytes`` published bytes
  (None: 0); an in-place or tail member's bytes are already in the arena, so the DMA must
  reach ``offset + nbytes``;
* staged members with a nonzero count, in member order, have their first ``nbytes``
  source bytes copied back to back from ``staging_offset`` on, each start 16-byte
  aligned; their header row's source offset is where they landed;
* then each range ``(member, dst_offset, nbytes)`` is copied from the member's source at
  ``dst_offset`` into staging the same way and gets the next header row past the members'
  rows: ``(staging offset, nbytes, member, dst_offset)``;
* every header row past the used range rows gets 0 bytes (a stale range scatters
  nothing);
* the DMA ends at the largest of the header's end, the in-place ends and the aligned
  staging end.
"""

from __future__ import annotations

import numpy as np
import torch

from h2d_kernels import PackedGroup, Placement, placement_of

ALIGN = 16


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def source_bytes(group: PackedGroup, index: int) -> np.ndarray:
    """Member ``index``'s pinned source as bytes (a copy)."""
    src = group.sources[index]
    return src.reshape(-1).view(torch.uint8).cpu().numpy().copy()


def expected_arena(group: PackedGroup, counts: list[int | None],
                   ranges: list[tuple[int, int, int]]) -> tuple[np.ndarray, int]:
    """The host arena's bytes after packing ``counts`` and ``ranges`` into the arena as it
    is now, and where the DMA must end."""
    arena = group.arena
    host = arena.host.numpy().copy()
    header = host[: arena.header_bytes].view(np.int64).reshape(-1, 4)
    sources = [source_bytes(group, i) for i in range(len(group.members))]
    end = arena.header_bytes
    staged = []
    for i, member in enumerate(group.members):
        nbytes = (counts[i] or 0) * member.unit_bytes
        header[i, 1] = nbytes
        if placement_of(member) is Placement.STAGED:
            staged.append(i)
        elif nbytes:
            end = max(end, group.offsets[i] + nbytes)
    off = group.staging_offset
    for i in staged:
        if not counts[i]:
            continue
        nbytes = counts[i] * group.members[i].unit_bytes  # type: ignore[operator]
        host[off : off + nbytes] = sources[i][:nbytes]
        header[i, 0] = off
        off = _align(off + nbytes)
        end = max(end, off)
    row = len(group.members)
    for i, dst_off, nbytes in ranges:
        host[off : off + nbytes] = sources[i][dst_off : dst_off + nbytes]
        header[row] = (off, nbytes, i, dst_off)
        row += 1
        off = _align(off + nbytes)
        end = max(end, off)
    header[row:, 1] = 0
    return host, end
