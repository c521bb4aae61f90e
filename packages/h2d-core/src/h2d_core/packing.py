"""Where a packed group's members live in its arena, and what one publication packs.

Three placements, chosen once at bind time:

* ``INPLACE``: small members (capacity <= ``INPLACE_LIMIT``). The buffer's pinned source
  *is* its arena payload region: producers write in place and publication packs nothing.
  The DMA carries the unused rest of each small region; that costs a little bus time and no
  host time.
* ``STAGED``: large element/byte members (token-sized arrays with N-element capacity). They
  have their own pinned source; publication copies only their used bytes into the staging
  region (one ``memmove`` each), so their unused capacity never travels.
* ``TAIL``: large row members (block tables). In place at the end of the arena, so a whole
  table publication copies nothing on the host and the DMA ends where the used rows end.
  Partial publications (changed row ranges) copy just those ranges into the staging region,
  which sits *before* the tail, so unchanged rows never travel.

Arena order: header | in-place regions (ascending) | staging | tail regions (ascending).
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from block_tables.native import load_extension

from .buffer import CountUnit, H2DBuffer

#: compiled hot paths of this package (block_tables.native), or None: the Python bodies
native = load_extension("h2d_core._h2d_core_native")

#: members up to this many bytes are written in place in the arena
INPLACE_LIMIT = 32 * 1024
#: staging reserved for a ranged member's partial publications, as a fraction of its size;
#: above it a whole-table publication is cheaper anyway (see docs/benchmarks.md)
SPAN_STAGING_DIVISOR = 4
_ALIGN = 16

_memmove = ctypes.memmove


class Placement(enum.IntEnum):
    INPLACE = 0
    STAGED = 1
    TAIL = 2


def placement_of(buf: H2DBuffer, borrowed: bool = False) -> Placement:
    """The placement rule (see the module docstring). A *borrowed* member (its source lives
    in another group's arena: a producer group carried by several combined groups) is
    always staged."""
    if borrowed:
        return Placement.STAGED
    if buf.max_ranges or (buf.spec.unit is CountUnit.ROWS and buf.spec.nbytes > INPLACE_LIMIT):
        return Placement.TAIL
    if buf.spec.nbytes <= INPLACE_LIMIT:
        return Placement.INPLACE
    return Placement.STAGED


def arena_order(
    members: Sequence[H2DBuffer], borrowed: frozenset[str] = frozenset()
) -> list[H2DBuffer]:
    """Members in arena order: placement first, then ascending size."""
    return sorted(members, key=lambda b: (placement_of(b, b.name in borrowed), b.spec.nbytes))


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


def staging_bytes(
    members: Sequence[H2DBuffer], borrowed: frozenset[str] = frozenset()
) -> tuple[int, int]:
    """(bytes for staged members at full size, bytes for ranged members' partial shares).

    Publication packs staged members first and ranges right after them, so the DMA carries
    no gap; ranges are checked against their own share only. Since the staged members'
    used bytes never exceed their full size, the two together always fit, whatever order
    counts and ranges were set in.
    """
    staged = ranges = 0
    for b in members:
        if placement_of(b, b.name in borrowed) is Placement.STAGED:
            staged += _align(b.spec.nbytes)
        if b.max_ranges:
            ranges += _align(b.spec.nbytes // SPAN_STAGING_DIVISOR) + _ALIGN * b.max_ranges
    return staged, ranges


@dataclass(eq=False)
class PackedSlot:
    """One slot's arena for one packed group, with everything publication needs precomputed."""

    arena: object  # h2d_kernels.PackedArena
    header: np.ndarray  # int64 [num_ranges, 4]
    header_nbytes: np.ndarray  # header[:, 1]
    host_base: int
    #: fixed arena offset of each member's payload (in-place and tail members)
    offsets: tuple[int, ...]
    #: (member index, source address, bytes per unit) of each staged member
    staged: tuple[tuple[int, int, int], ...]
    #: source base address of every member (for copying ranges into staging)
    src_base: tuple[int, ...]
    #: staged members' bytes, then the ranges, are packed from here
    staging_offset: int
    #: the ranges' share of the staging region (16 bytes of alignment per range included)
    range_capacity: int
    first_extra: int
    header_addr: int = field(init=False)
    #: the compiled packing plan of this arena (None: pack_python); the launcher's binding
    #: once the state binds one (it packs the same way)
    packer: object | None = field(init=False)
    #: the compiled pack + graph launch of this arena (launch.bind_publish), or None
    launch: object | None = None

    def __post_init__(self) -> None:
        self.header_addr = self.header.ctypes.data
        self.packer = bind_native(self)


def bind_native(slot: PackedSlot, table: object | None = None) -> object | None:
    """The compiled helper's binding of ``slot``'s packing plan (None without the helper).
    With ``table`` (an ``h2d_kernels.GraphLaunchTable``) it also launches the arena's
    graphs (``publish_packed``); without, it only packs."""
    if native is None:
        return None
    arena = slot.arena
    execs, launch, capturing = (
        (table.execs, table.graph_launch, table.stream_is_capturing)  # type: ignore[attr-defined]
        if table is not None else ((), 0, 0))
    return native.bind_publish(
        slot.host_base, slot.header_addr, slot.staging_offset, slot.first_extra, slot.staged,
        slot.src_base, arena.header_bytes, arena.total_bytes,  # type: ignore[attr-defined]
        execs, launch, capturing, arena)


def bind_packed_slot(
    members: Sequence[H2DBuffer],
    device: torch.device,
    scatter: str,
    pin: bool,
    borrowed: dict[str, torch.Tensor] | None = None,
) -> tuple[PackedSlot, list[torch.Tensor]]:
    """Plan and allocate one slot's arena for ``members`` (already in arena order).

    ``borrowed`` maps members whose source lives elsewhere to that source. Returns the slot
    and each member's pinned source tensor (an arena view, its own allocation for staged
    members, or the borrowed source).
    """
    from h2d_kernels import ArenaMember, PackedArena, plan_arena

    borrowed = borrowed or {}
    names = frozenset(borrowed)
    places = [placement_of(b, b.name in names) for b in members]
    first_tail = next((i for i, p in enumerate(places) if p is Placement.TAIL), len(members))
    extra = sum(b.max_ranges for b in members)
    layout = plan_arena(
        [
            ArenaMember(b.name, 0 if p is Placement.STAGED else b.spec.nbytes, b.spec.itemsize)
            for b, p in zip(members, places, strict=True)
        ],
        num_ranges=len(members) + extra,
        staging_bytes=sum(staging_bytes(members, names)),
        staging_before=first_tail,
    )
    arena = PackedArena(layout, [b.gpu for b in members], device=device,
                        scatter=scatter)  # type: ignore[arg-type]
    header = arena.header_np
    header[:] = 0
    sources: list[torch.Tensor] = []
    offsets = []
    staged = []
    for i, (b, p) in enumerate(zip(members, places, strict=True)):
        off = layout.payload_offset(i)
        header[i, 0] = off
        header[i, 2] = i
        offsets.append(off)
        if b.name in borrowed:
            src = borrowed[b.name]
            staged.append((i, src.data_ptr(), b.spec.unit_bytes))
        elif p is Placement.STAGED:
            src = torch.zeros(b.spec.shape, dtype=b.spec.dtype, pin_memory=pin)
            staged.append((i, src.data_ptr(), b.spec.unit_bytes))
        else:
            src = arena.payload_host(i)[: b.spec.nbytes].view(b.spec.dtype).view(b.spec.shape)
        sources.append(src)
    slot = PackedSlot(
        arena=arena,
        header=header,
        header_nbytes=header[:, 1],
        host_base=arena.host.data_ptr(),
        offsets=tuple(offsets),
        staged=tuple(staged),
        src_base=tuple(s.data_ptr() for s in sources),
        staging_offset=layout.staging_offset,
        range_capacity=staging_bytes(members, names)[1],
        first_extra=len(members),
    )
    return slot, sources


def pack(
    slot: PackedSlot,
    counts: Sequence[int | None],
    ranges: Sequence[tuple[int, int, int]],
) -> int:
    """Copy staged members' used bytes and pending ranges into staging; return the end of
    what was copied (0 when nothing was).

    ``ranges`` are (member index, byte offset in the destination, byte count), already
    validated against capacity and ``range_capacity`` by the caller; counts are validated
    against capacity, and each staged member has its full size reserved.
    """
    if slot.packer is not None:
        return native.pack(slot.packer, counts, ranges)  # type: ignore[union-attr]
    return pack_python(slot, counts, ranges)


def pack_python(
    slot: PackedSlot,
    counts: Sequence[int | None],
    ranges: Sequence[tuple[int, int, int]],
) -> int:
    """:func:`pack` without the compiled helper (the same bytes and header rows)."""
    base = slot.host_base
    header = slot.header
    end = 0
    off = slot.staging_offset
    for i, src, unit_bytes in slot.staged:
        n = counts[i]
        if not n:
            continue
        nbytes = n * unit_bytes
        _memmove(base + off, src, nbytes)
        header[i, 0] = off
        off = _align(off + nbytes)
        end = off
    row = slot.first_extra
    for i, dst_off, nbytes in ranges:
        _memmove(base + off, slot.src_base[i] + dst_off, nbytes)
        header[row] = (off, nbytes, i, dst_off)
        row += 1
        off = _align(off + nbytes)
        end = off
    return end
