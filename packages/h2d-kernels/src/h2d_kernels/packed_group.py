"""One packed publication group's arena per slot, and the one call that publishes it.

A :class:`PackedGroup` holds where each member lives in the arena, the members' pinned
sources, and the compiled binding of its publication (``_packed.pyx``, the only
implementation of the header writes and packing). ``publish(counts, ranges, ...)``
writes the header, packs what must be packed, issues the DMA and the scatter (or replays
the captured graph of both): the caller hands counts and byte ranges, never descriptor
columns or graph handles.

Three placements, chosen once at bind time:

* ``INPLACE``: small members (capacity <= ``INPLACE_LIMIT``). The member's pinned source
  *is* its arena payload region: producers write in place and publication packs nothing.
  The DMA carries the unused rest of each small region; that costs a little bus time and no
  host time.
* ``STAGED``: large element/byte members (token-sized arrays with N-element capacity), and
  members whose source lives in another group's arena (*borrowed*). They have their own
  pinned source; publication copies only their used bytes into the staging region (one
  ``memmove`` each), so their unused capacity never travels.
* ``TAIL``: large row members and ranged members (block tables). In place at the end of the
  arena, so a whole-table publication copies nothing on the host and the DMA ends where the
  used rows end. Partial publications (changed byte ranges) copy just those ranges into the
  staging region, which sits *before* the tail, so unchanged rows never travel.

Arena order: header | in-place regions (ascending) | staging | tail regions (ascending).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from h2d_kernels.arena import Consumer, PackedArena
from h2d_kernels.layout import ArenaMember, plan_arena
from h2d_kernels.native import helper as _native

#: members up to this many bytes are written in place in the arena
INPLACE_LIMIT = 32 * 1024
#: staging reserved for a ranged member's partial publications, as a fraction of its size;
#: above it a whole-table publication is cheaper anyway (see docs/benchmarks.md)
SPAN_STAGING_DIVISOR = 4
#: staging bytes each range costs beyond its payload (its alignment)
RANGE_OVERHEAD = 16
_ALIGN = 16


class Placement(enum.IntEnum):
    INPLACE = 0
    STAGED = 1
    TAIL = 2


@dataclass(frozen=True)
class GroupMember:
    """What a packed group needs to know of one member."""

    name: str
    destination: torch.Tensor
    #: capacity in bytes, bytes per counted unit, element size
    nbytes: int
    unit_bytes: int
    itemsize: int
    #: counted in rows of a 2-D (or wider) table
    rows: bool = False
    #: byte ranges one publication may carry (0: counts only)
    max_ranges: int = 0
    #: its pinned source lives in another group's arena (it is always staged here)
    borrowed: bool = False


def placement_of(member: GroupMember) -> Placement:
    """The placement rule (see the module docstring)."""
    if member.borrowed:
        return Placement.STAGED
    if member.max_ranges or (member.rows and member.nbytes > INPLACE_LIMIT):
        return Placement.TAIL
    if member.nbytes <= INPLACE_LIMIT:
        return Placement.INPLACE
    return Placement.STAGED


def arena_order(members: Sequence[GroupMember]) -> list[GroupMember]:
    """Members in arena order: placement first, then ascending size."""
    return sorted(members, key=lambda m: (placement_of(m), m.nbytes))


def _align(n: int) -> int:
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


def staging_bytes(members: Sequence[GroupMember]) -> tuple[int, int]:
    """(bytes for staged members at full size, bytes for ranged members' partial shares).

    Publication packs staged members first and ranges right after them, so the DMA carries
    no gap; ranges are checked against their own share only. Since the staged members'
    used bytes never exceed their full size, the two together always fit, whatever order
    counts and ranges were set in.
    """
    staged = ranges = 0
    for m in members:
        if placement_of(m) is Placement.STAGED:
            staged += _align(m.nbytes)
        if m.max_ranges:
            ranges += _align(m.nbytes // SPAN_STAGING_DIVISOR) + _ALIGN * m.max_ranges
    return staged, ranges


class PackedGroup:
    """One slot's arena for one packed group (members already in :func:`arena_order`).

    Build with :meth:`bind`. ``sources[i]`` is member ``i``'s pinned source (an arena view
    for in-place and tail members, its own pinned tensor for staged ones, the given one for
    borrowed ones). ``offsets[i]`` is the fixed arena offset of an in-place or tail member
    (-1 for a staged one, placed per publication from ``staging_offset`` on).
    ``range_capacity`` is the staging room for ranges.
    """

    def __init__(self, members: Sequence[GroupMember], device: torch.device, scatter: str,
                 pin: bool, borrowed_sources: Mapping[str, torch.Tensor],
                 consumers: Sequence[Consumer] = (), completion_event: int = 0) -> None:
        places = [placement_of(m) for m in members]
        first_tail = next((i for i, p in enumerate(places) if p is Placement.TAIL),
                          len(members))
        staged_room, range_room = staging_bytes(members)
        layout = plan_arena(
            [ArenaMember(m.name, 0 if p is Placement.STAGED else m.nbytes, m.itemsize)
             for m, p in zip(members, places, strict=True)],
            num_ranges=len(members) + sum(m.max_ranges for m in members),
            staging_bytes=staged_room + range_room,
            staging_before=first_tail,
        )
        arena = PackedArena(layout, [m.destination for m in members], device=device,
                            scatter=scatter, consumers=consumers,  # type: ignore[arg-type]
                            completion_event=completion_event)
        header = arena.header_np
        header[:] = 0
        sources: list[torch.Tensor] = []
        staged: list[tuple[int, int, int]] = []
        inplace: list[int] = []
        for i, (m, p) in enumerate(zip(members, places, strict=True)):
            off = layout.payload_offset(i)
            header[i, 0] = off
            header[i, 2] = i
            if m.borrowed:
                src = borrowed_sources[m.name]
            elif p is Placement.STAGED:
                dst = m.destination
                src = torch.zeros(dst.shape, dtype=dst.dtype, device="cpu", pin_memory=pin)
            else:
                dst = m.destination
                src = arena.payload_host(i)[: m.nbytes].view(dst.dtype).view(dst.shape)
            if p is Placement.STAGED:
                staged.append((i, src.data_ptr(), m.unit_bytes))
            inplace.append(-1 if p is Placement.STAGED else off)
            sources.append(src)
        self.arena = arena
        self.members = tuple(members)
        self.sources = sources
        self.header: np.ndarray = header
        self.range_capacity = range_room
        self._host_base = arena.host.data_ptr()
        self._staged = tuple(staged)
        self._src_base = tuple(s.data_ptr() for s in sources)
        self._unit_bytes = tuple(m.unit_bytes for m in members)
        self.offsets = tuple(inplace)
        self.staging_offset = layout.staging_offset
        self._first_extra = len(members)
        self._binding = self._bind_native()

    @classmethod
    def bind(cls, members: Sequence[GroupMember], device: torch.device | str,
             scatter: str = "auto", pin: bool = True,
             borrowed_sources: Mapping[str, torch.Tensor] | None = None,
             consumers: Sequence[Consumer] = (), completion_event: int = 0) -> PackedGroup:
        """Plan and allocate one slot's arena for ``members`` (in arena order);
        ``borrowed_sources`` maps each borrowed member's name to its pinned source;
        ``consumers`` run after every scatter, inside its graph (see
        :class:`~h2d_kernels.PackedArena`; member ``i``'s header row is ``i``).
        ``completion_event``: the slot's raw event handle (one group binds one slot, so
        one event), recorded at the end of every captured graph (see
        :attr:`records_completion`); the caller keeps it alive as long as the group."""
        return cls(members, torch.device(device), scatter, pin, borrowed_sources or {},
                   consumers, completion_event)

    @property
    def compiled(self) -> bool:
        """Always True: publications run the compiled helper (there is no Python path; kept
        for callers that read it)."""
        return True

    @property
    def launches_graphs(self) -> bool:
        """Whether the compiled helper launches the arena's captured graphs itself."""
        return self._launch_table is not None

    @property
    def records_completion(self) -> bool:
        """Whether a publication this helper launches as a graph also records the bound
        completion event (:meth:`publish_step` then returns True)."""
        return self._records_completion

    def _bind_native(self, graphs: bool = True) -> object:
        """The compiled binding of this group's publication (``bind_publish``): it launches
        the arena's captured graphs when the arena has a launch table and ``graphs`` is
        true, else it only packs and :meth:`publish` hands the launch to the arena."""
        arena = self.arena
        table = arena.graph_launch_table() if graphs else None
        self._launch_table = table
        self._records_completion = table is not None and arena.records_completion
        execs, launch, capturing = ((table.execs, table.graph_launch, table.stream_is_capturing)
                                    if table is not None else ((), 0, 0))
        binding = _native.bind_publish(
            self._host_base, self.header.ctypes.data, self.staging_offset,
            self._first_extra, self._staged, self._src_base, arena.header_bytes,
            arena.total_bytes, execs, launch, capturing, arena, self._unit_bytes,
            self.offsets, self.header.shape[0])
        cpu = arena.cpu_publish_binding
        if cpu is not None and table is None:  # a CPU arena: the compiled publish copies
            # and scatters too
            _native.attach_cpu(binding, cpu)
        _native.set_records(binding, self._records_completion)
        return binding

    def publish(
        self,
        counts: list[int | None],
        ranges: list[tuple[int, int, int]],
        stream_id: int = 0,
        stream: torch.cuda.Stream | None = None,
    ) -> int:
        """Publish member ``i``'s first ``counts[i]`` units (None: nothing) and the byte
        ``ranges`` ``(member, destination offset, bytes)``: one DMA of the header and used
        payload, one scatter. Returns the DMA size.

        Counts and ranges must be validated by the caller (capacity; ranges sorted per
        member, whole elements, within ``range_capacity`` with ``RANGE_OVERHEAD`` each).
        ``stream_id`` is the raw handle of ``stream`` (the current stream when None), for
        the compiled launch; on the CPU pass 0.
        """
        end: int = _native.publish_packed(self._binding, counts, ranges, stream_id)
        if end > 0:
            return end  # packed and published (the bucket's graph, or the CPU's copy)
        # Packed, not launched: the compiled helper hands back what it has no launcher for
        # (a CPU arena with first consumers, an arena without driver-launched graphs, a
        # stream under capture, a size no graph covers); the arena enqueues the DMA and
        # scatter (or raises PublishError for a size outside the arena).
        self.arena.publish(-end, stream)
        return -end

    def publish_step(
        self,
        counts: list[int | None],
        ranges: list[tuple[int, int, int]] | int,
        stream_id: int = 0,
        stream: torch.cuda.Stream | None = None,
    ) -> bool:
        """:meth:`publish` for a state's step: returns whether the publication recorded
        the bound completion event (True only when the compiled helper launched a bucket's
        graph and the graphs carry the record, :attr:`records_completion`; False when the
        caller must record completion after it: an eager, captured or CPU publication
        records nothing). Its DMA size is :attr:`last_dma_bytes`. ``ranges`` may also be
        the address of an int64 table of ``(member, offset, bytes)`` rows ended by a member
        of -1 (a state's group record keeps one, bound once): a step then makes no object.
        """
        return _native.publish_packed_step(
            self._binding, counts, ranges, stream_id, stream)

    @property
    def last_dma_bytes(self) -> int:
        """The DMA size of the last :meth:`publish_step` (header and used payload)."""
        return int(_native.last_dma_end(self._binding))
