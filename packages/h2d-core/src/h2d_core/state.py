"""The runner's publication owner: declarations, binding, slots, epochs, counts, publication.

One :class:`H2DRunnerState` per model runner (per device). Its life:

    state = H2DRunnerState("cuda", num_slots=1)          # reads ATOM_H2D_BACKEND once
    ids = state.buffer("input_ids", (N,), torch.int32, group="token_inputs")
    ...
    state.combine("decode", ["token_inputs", "mha_decode"])   # optional combined group
    state.bind()                                          # storage fixed from here on

    slot = state.begin()          # waits until this slot's previous DMA read its sources
    ids.np[:n] = ...; state.set_count(ids, n)             # producers write in place
    state.publish("decode")       # validate, then 1 DMA + 1 scatter (or direct copies)
    state.finish()                # records completion; never waits for the GPU

Every rejected call raises before anything is enqueued or changed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from threading import get_ident
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .buffer import BufferSpec, CountUnit, H2DBuffer, make_spec
from .config import Backend, resolve_backend
from .errors import (
    BindingError,
    CountError,
    DeclarationError,
    DeviceMismatchError,
    DuplicatePublicationError,
    EpochError,
    H2DError,
    MembershipError,
    NotBoundError,
    OwnerInvalidatedError,
    OwnerThreadError,
    PublicationEnqueueError,
    ReentryError,
    StreamMismatchError,
    UnknownGroupError,
)
from .group import GroupCounters, GroupPlan, SlotGroup, byte_span, find_overlap, unit_view
from .launch import SlotEvents, bind_publish
from .packing import arena_order, bind_packed_slot, native, pack

if TYPE_CHECKING:
    from .count_batch import CountBatch


def _omit(rec: SlotGroup, i: int) -> None:
    old = rec.counts[i]
    if old is not None:
        rec.counts[i] = None
        rec.active -= 1
        rec.count_bytes -= old * rec.plan.members[i].spec.unit_bytes
        if rec.packed is not None:
            rec.packed.header_nbytes[i] = 0
    if i in rec.ranged:
        rec.ranged.discard(i)
        rec.active -= 1
        rec.ranges = [r for r in rec.ranges if r[0] != i]
        rec.range_bytes = sum(n for _, _, n in rec.ranges)


def _store_count(recs: list[SlotGroup], homes: list[tuple[int, int]], unit_bytes: int,
                 n: int) -> None:
    """Record a validated count ``n`` in every record carrying the member."""
    nbytes = n * unit_bytes
    for gi, i in homes:
        rec = recs[gi]
        old = rec.counts[i]
        if old is None:
            rec.active += 1
            rec.count_bytes += nbytes
        else:
            rec.count_bytes += nbytes - old * unit_bytes
        rec.counts[i] = n
        if rec.header_nbytes is not None:
            rec.header_nbytes[i] = nbytes
            off = rec.inplace[i]
            if nbytes and off >= 0 and off + nbytes > rec.dma_end:
                rec.dma_end = off + nbytes


def _replace_ranges(rec: SlotGroup, i: int, new: list[tuple[int, int, int]],
                    nbytes: int | None = None) -> None:
    """Member ``i`` publishes exactly the ranges ``new`` (validated; ``nbytes`` their total
    when known) instead of a count."""
    if rec.counts[i] is not None or i in rec.ranged:
        _omit(rec, i)
    rec.active += 1
    rec.ranged.add(i)
    if rec.ranges:
        rec.ranges = [r for r in rec.ranges if r[0] != i] + new
        rec.range_bytes = sum(n for _, _, n in rec.ranges)
    else:
        rec.ranges = new
        rec.range_bytes = sum(n for _, _, n in new) if nbytes is None else nbytes


_profiler_enabled: Callable[[], bool] = torch._C._autograd._profiler_enabled
# the raw C getters: torch.cuda.current_device() / current_stream() cost several times more
_get_device: Callable[[], int] | None = getattr(torch._C, "_cuda_getDevice", None)
_current_raw_stream: Callable[[int], int] | None = getattr(
    torch._C, "_cuda_getCurrentRawStream", None)


class H2DRunnerState:
    """Owner of a runner's metadata buffers, publication groups and slots.

    Args:
        device: where destinations live (``"cuda"``, ``"cuda:1"`` or ``"cpu"``). CPU mode
            keeps the whole contract with plain tensors (no pinning, no streams/events).
        num_slots: runner slots; each owns its pinned sources, packed arenas and
            completion event. Pipeline parallelism rotates them.
        backend: ``"packed"`` or ``"direct"``; None reads ``ATOM_H2D_BACKEND`` now, once.
        scatter: how packed arenas scatter (passed to ``h2d_kernels.PackedArena``).
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        num_slots: int = 1,
        backend: Backend | str | None = None,
        scatter: str = "auto",
    ) -> None:
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu"
        )
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type not in ("cuda", "cpu"):
            raise DeclarationError(f"device {dev} is not supported; use a CUDA device or cpu")
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise DeclarationError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.device = dev
        self.backend = resolve_backend(backend)
        self.num_slots = num_slots
        self._cuda = dev.type == "cuda"
        self._device_index = dev.index if dev.index is not None else -1
        self._scatter = scatter
        self._owner = threading.get_ident()

        self._buffers: dict[str, H2DBuffer] = {}
        self._producer_groups: dict[str, list[H2DBuffer]] = {}
        self._combined: dict[str, tuple[str, ...]] = {}
        self._bound = False

        self._plans: dict[str, GroupPlan] = {}
        self._routes: dict[str, tuple[int, frozenset[str], tuple[H2DBuffer, ...],
                                      GroupCounters]] = {}
        self._slot_groups: list[list[SlotGroup]] = []
        self._counters: dict[str, GroupCounters] = {}
        self._events: list[Any] = []
        #: the slots' events through the driver (None: the torch events in _events)
        self._slot_events: SlotEvents | None = None
        self._event_recorded: list[bool] = [False] * num_slots

        self.current_slot = 0
        self.epoch = 0
        self._epoch_open = False
        self._resumable = False
        self._stream: Any = None
        self._stream_id = 0
        self._published: set[str] = set()
        self._produced: set[str] = set()
        # producer group lists already checked by enter_producer (the multi-group fast path)
        self._known_group_lists: set[tuple[str, ...]] = set()
        self._invalid: str | None = None
        #: host ns the last begin() blocked on its slot's previous DMA (source reuse); 0 when
        #: that DMA had completed (checking it is then ordinary host work)
        self.last_source_wait_ns = 0
        #: callbacks run once after a producer group's successful publication this epoch
        self._on_publish: dict[str, list[tuple[H2DBuffer, Callable[[], None], bool]]] = {}
        #: called by reset(): attached state that must forget what the GPU holds
        self._reset_hooks: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ declaration
    def buffer(
        self,
        name: str,
        shape: tuple[int, ...] | int,
        dtype: torch.dtype,
        *,
        group: str,
        unit: CountUnit | str = CountUnit.ELEMENTS,
        gpu: torch.Tensor | None = None,
        max_ranges: int = 0,
    ) -> H2DBuffer:
        """Declare a buffer of producer ``group`` counted in ``unit``.

        The destination is allocated now (zeroed) unless ``gpu`` supplies an existing one
        (same shape/dtype, on this state's device; a noncontiguous one makes its group
        publish with direct copies). Sources are allocated by :meth:`bind`.
        ``max_ranges`` > 0 lets one publication send up to that many byte ranges of this
        buffer (:meth:`set_ranges`; block tables publish their changed rows this way).
        """
        self._check_thread()
        if self._bound:
            raise DeclarationError(
                f"buffer {name!r}: the state is already bound; declare every buffer before bind()"
            )
        spec = make_spec(name, shape, dtype, group, unit)
        if isinstance(max_ranges, bool) or not isinstance(max_ranges, int) or max_ranges < 0:
            raise DeclarationError(f"buffer {name!r}: max_ranges must be an int >= 0")
        if name in self._buffers:
            raise DeclarationError(f"buffer {name!r} is already declared")
        if group in self._combined:
            raise DeclarationError(
                f"buffer {name!r}: {group!r} is a combined group; declare buffers with their "
                "producer group"
            )
        if gpu is None:
            gpu = torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)
        else:
            self._check_destination(spec, gpu)
            if max_ranges and not gpu.is_contiguous():
                raise BindingError(
                    f"buffer {name!r}: ranged publication (max_ranges={max_ranges}) needs a "
                    "contiguous destination"
                )
        buf = H2DBuffer(spec, gpu, self, max_ranges)
        self._buffers[name] = buf
        self._producer_groups.setdefault(group, []).append(buf)
        return buf

    def _check_destination(self, spec: BufferSpec, gpu: torch.Tensor) -> None:
        if tuple(gpu.shape) != spec.shape or gpu.dtype != spec.dtype:
            raise BindingError(
                f"buffer {spec.name!r}: destination has shape {tuple(gpu.shape)} dtype "
                f"{gpu.dtype}, declared {spec.shape} {spec.dtype}"
            )
        if gpu.device != self.device:
            raise BindingError(
                f"buffer {spec.name!r}: destination is on {gpu.device}, the state on {self.device}"
            )

    def combine(self, name: str, groups: Sequence[str]) -> None:
        """Declare a combined group publishing several producer groups with one DMA.

        The covered producer groups get no packed arena of their own; publishing one of them
        alone (a standalone caller) uses checked direct copies. A producer group may be
        covered by several combined groups (e.g. token inputs in both a ``decode`` and a
        ``prefill`` group): its sources live in the first such group's arena and the others
        copy its used bytes into their staging region when they publish.
        """
        self._check_thread()
        if self._bound:
            raise DeclarationError(f"combined group {name!r}: declare it before bind()")
        if name in self._combined or name in self._producer_groups:
            raise DeclarationError(f"group name {name!r} is already used")
        if len(groups) < 2:
            raise DeclarationError(f"combined group {name!r} needs at least two producer groups")
        for g in groups:
            if g not in self._producer_groups:
                raise UnknownGroupError(
                    f"combined group {name!r}: producer group {g!r} has no declared buffer"
                )
        if len(set(groups)) != len(groups):
            raise DeclarationError(f"combined group {name!r} lists a producer group twice")
        self._combined[name] = tuple(groups)

    # ------------------------------------------------------------------ binding
    def bind(self) -> None:
        """Fix all storage: plan groups, allocate per-slot sources/arenas, check overlaps."""
        self._check_thread()
        if self._bound:
            raise DeclarationError("bind() was already called; bound storage stays fixed")
        overlap = find_overlap([(*byte_span(b.gpu), b.name) for b in self._buffers.values()])
        if overlap:
            raise BindingError(
                f"buffers {overlap[0]!r} and {overlap[1]!r} share GPU bytes; give each member "
                "its own destination"
            )
        dst_units: dict[str, torch.Tensor] = {}
        for buf in self._buffers.values():
            try:
                dst_units[buf.name] = unit_view(buf.gpu, buf.spec.unit)
            except RuntimeError:
                raise BindingError(
                    f"buffer {buf.name!r}: its destination (strides {tuple(buf.gpu.stride())}) "
                    f"cannot be counted in {buf.spec.unit.value} without a copy; use unit='rows' "
                    "or a contiguous destination"
                ) from None
        covered = {g for gs in self._combined.values() for g in gs}
        publication: list[tuple[str, tuple[str, ...]]] = list(self._combined.items())
        publication += [(g, (g,)) for g in self._producer_groups if g not in covered]
        primary: dict[str, str] = {}  # producer group -> publication group holding its sources
        for name, groups in publication:
            for g in groups:
                primary.setdefault(g, name)
        for b in self._buffers.values():
            homes = sum(b.group in gs for _, gs in publication)
            if b.max_ranges and homes > 1:
                raise BindingError(
                    f"buffer {b.name!r}: a ranged buffer (max_ranges) must be carried by one "
                    f"publication group, but group {b.group!r} is covered by {homes}"
                )

        plans: dict[str, GroupPlan] = {}
        for index, (name, groups) in enumerate(publication):
            members = [b for g in groups for b in self._producer_groups[g]]
            borrowed = frozenset(b.name for b in members if primary[b.group] != name)
            why = ""
            if self.backend is Backend.DIRECT:
                why = "direct backend"
            else:
                bad = [b.name for b in members if not b.gpu.is_contiguous()]
                if bad:
                    why = f"noncontiguous destination(s) {bad}"
            packed = not why
            if packed:
                members = arena_order(members, borrowed)
            plans[name] = GroupPlan(name, index, tuple(members), groups, packed, why,
                                    borrowed=borrowed)

        slot_groups: list[list[SlotGroup]] = [[] for _ in range(self.num_slots)]
        sources: dict[str, list[torch.Tensor]] = {b: [] for b in self._buffers}
        try:
            for name, plan in list(plans.items()):
                for slot in range(self.num_slots):
                    rec, plan = self._bind_group(plan, sources, slot)
                    plans[name] = plan
                    slot_groups[slot].append(rec)
        except ValueError as exc:  # layout/destination rejections from h2d_kernels
            raise BindingError(f"cannot bind packed storage: {exc}") from exc

        for buf in self._buffers.values():
            buf._attach_sources(sources[buf.name])
            buf._dst_units = dst_units[buf.name]
            buf._src_units = [unit_view(s, buf.spec.unit) for s in sources[buf.name]]
            if buf.max_ranges:
                buf._dst_bytes = unit_view(buf.gpu, CountUnit.BYTES)
                buf._src_bytes = [unit_view(s, CountUnit.BYTES) for s in sources[buf.name]]
        for name, plan in plans.items():
            for i, buf in enumerate(plan.members):
                buf.homes.append((plan.index, i))
                if primary[buf.group] == name:
                    buf.publication_group = name
                    buf.member_index = i
            self._counters[name] = GroupCounters()
        for g in self._producer_groups:
            self._counters.setdefault(g, GroupCounters())
        self._plans = plans
        # publish(name) -> (record index, names it publishes, members copied directly when
        # it is a producer group covered by a combined one, counters): one lookup per call
        self._routes = {name: (plan.index, plan.names, (), self._counters[name])
                        for name, plan in plans.items()}
        for g in self._producer_groups:
            if g not in plans:
                self._routes[g] = (plans[primary[g]].index, frozenset((g,)),
                                   tuple(self._producer_groups[g]), self._counters[g])
        self._slot_groups = slot_groups
        for recs in slot_groups:
            for rec in recs:
                rec.clear_counts()
                if rec.packed is not None:
                    launch = bind_publish(rec.packed)
                    if launch is not None:  # it packs too: one binding per arena
                        rec.packed.launch = rec.packed.packer = launch
        if self._cuda:
            self._slot_events = SlotEvents.create(self.num_slots, self.device)
            if self._slot_events is None:
                self._events = [torch.cuda.Event() for _ in range(self.num_slots)]
            self._acquire_event = torch.cuda.Event()
        self._bound = True

    def _bind_group(
        self, plan: GroupPlan, sources: dict[str, list[torch.Tensor]], slot: int
    ) -> tuple[SlotGroup, GroupPlan]:
        own = [b for b in plan.members if b.name not in plan.borrowed]
        if not plan.packed:
            for buf in own:
                sources[buf.name].append(
                    torch.zeros(buf.spec.shape, dtype=buf.spec.dtype, pin_memory=self._cuda)
                )
            return SlotGroup(plan, None), plan
        # Primary groups are bound first (publication order), so borrowed sources exist.
        borrowed = {n: sources[n][slot] for n in plan.borrowed}
        packed, member_sources = bind_packed_slot(
            plan.members, self.device, self._scatter, self._cuda, borrowed
        )
        for buf, src in zip(plan.members, member_sources, strict=True):
            if buf.name not in plan.borrowed:
                sources[buf.name].append(src)
        if not plan.inplace_offsets:
            staged = {i for i, _, _ in packed.staged}
            inplace = tuple(
                -1 if i in staged else off for i, off in enumerate(packed.offsets)
            )
            plan = GroupPlan(
                plan.name, plan.index, plan.members, plan.producer_groups, True, "",
                inplace, packed.arena.layout.header_bytes,  # type: ignore[attr-defined]
                plan.borrowed,
            )
        return SlotGroup(plan, packed), plan

    # ------------------------------------------------------------------ introspection
    @property
    def bound(self) -> bool:
        return self._bound

    @property
    def invalidated(self) -> str | None:
        """Why the owner refuses work (None while valid)."""
        return self._invalid

    @property
    def epoch_open(self) -> bool:
        return self._epoch_open

    def buffers(self) -> Mapping[str, H2DBuffer]:
        return dict(self._buffers)

    def plan(self, group: str) -> GroupPlan:
        """The bound plan of a publication group (a combined or uncovered producer group)."""
        self._check_bound()
        if group not in self._plans:
            raise UnknownGroupError(self._unknown_group(group))
        return self._plans[group]

    def counters(self, group: str) -> GroupCounters:
        """Counters of a publication or producer group."""
        self._check_bound()
        if group not in self._counters:
            raise UnknownGroupError(self._unknown_group(group))
        return self._counters[group]

    def count(self, buffer: H2DBuffer) -> int | None:
        """The count set for ``buffer`` in the current epoch (None: omitted)."""
        self._check_member(buffer)
        gi, i = buffer.homes[0]
        return self._slot_groups[self.current_slot][gi].counts[i]

    def is_published(self, group: str) -> bool:
        """Whether ``group`` was published in the current (or last) epoch."""
        return group in self._published

    def _unknown_group(self, group: str) -> str:
        known = sorted(set(self._producer_groups) | set(self._combined))
        return f"unknown group {group!r}; declared groups are {known}"

    # ------------------------------------------------------------------ checks
    def _check_thread(self) -> None:
        if threading.get_ident() != self._owner:
            raise OwnerThreadError(
                "this H2DRunnerState belongs to another thread; call it from the thread that "
                "created it"
            )

    def _check_bound(self) -> None:
        if not self._bound:
            raise NotBoundError("call bind() after declaring buffers and before using the state")

    def _check_valid(self) -> None:
        if self._invalid is not None:
            raise OwnerInvalidatedError(
                f"the H2D owner was invalidated by an earlier enqueue failure ({self._invalid}); "
                "call reset() before further work"
            )

    def _check_ready(self, what: str) -> None:
        """Owner thread, bound, valid, inside an epoch."""
        if threading.get_ident() != self._owner:
            self._check_thread()
        if not self._bound:
            self._check_bound()
        if self._invalid is not None:
            self._check_valid()
        if not self._epoch_open:
            raise EpochError(f"{what} outside an epoch: call begin() (or resume()) first")

    def _check_device(self) -> None:
        # the raw C getter: torch.cuda.current_device() costs several times more per call
        if self._cuda and torch._C._cuda_getDevice() != self.device.index:
            raise DeviceMismatchError(
                f"current device is cuda:{torch.cuda.current_device()} but this state owns "
                f"{self.device}; switch with torch.cuda.device({self.device.index})"
            )

    def _check_stream(self, stream: Any) -> Any:
        """Check the publication stream is the epoch's; return what to enqueue on (None:
        the current stream, which is then the epoch's)."""
        if not self._cuda:
            return None
        raw = (torch._C._cuda_getCurrentRawStream(self.device.index) if stream is None
               else stream.cuda_stream)
        if raw != self._stream_id:
            raise StreamMismatchError(
                f"publication on stream {raw:#x} but the epoch's consumer stream is "
                f"{self._stream_id:#x}; publish on the stream current at begin()"
            )
        return stream

    def _check_member(self, buffer: H2DBuffer) -> None:
        if not isinstance(buffer, H2DBuffer) or self._buffers.get(buffer.name) is not buffer:
            raise MembershipError(f"{buffer!r} is not a buffer of this state")
        self._check_bound()

    # ------------------------------------------------------------------ epochs
    def begin(self, slot: int | None = None, *, stream: Any = None) -> int:
        """Start one forward epoch on ``slot`` (default: the next slot, rotating).

        Waits until this slot's previous completion event (its DMAs read the sources),
        then producers may write. The current stream (or ``stream``) becomes the epoch's
        consumer stream: every publication of the epoch must be enqueued on it.
        """
        if get_ident() != self._owner or not self._bound or self._invalid is not None:
            self._check_thread()
            self._check_bound()
            self._check_valid()
        if self._epoch_open:
            raise EpochError(f"epoch {self.epoch} on slot {self.current_slot} is still open; "
                             "call finish() first")
        if slot is None:
            slot = (self.current_slot + 1) % self.num_slots if self.epoch else 0
        elif isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise EpochError(f"slot {slot!r} is not in [0, {self.num_slots})")
        if self._cuda:
            if _get_device() != self._device_index:  # type: ignore[misc]
                self._check_device()
            if stream is not None:
                s = stream
                if s.device != self.device:
                    raise DeviceMismatchError(
                        f"stream is on {s.device}, the state on {self.device}; begin() on a "
                        "stream of the state's device"
                    )
            elif (self._stream is not None and _current_raw_stream(  # type: ignore[misc]
                    self._device_index) == self._stream_id):
                s = self._stream  # the same consumer stream as last epoch: no new object
            else:
                s = torch.cuda.current_stream(self.device)
        if self._event_recorded[slot]:
            # last_source_wait_ns counts only the blocking wait for a pending event: the
            # query of a completed one is host work like any other
            if self._slot_events is not None:
                self.last_source_wait_ns = self._slot_events.wait(slot)
            elif self._events[slot].query():
                self.last_source_wait_ns = 0
            else:
                t0 = time.perf_counter_ns()
                self._events[slot].synchronize()
                self.last_source_wait_ns = time.perf_counter_ns() - t0 or 1
        else:
            self.last_source_wait_ns = 0
        self.current_slot = slot
        self.epoch += 1
        if self._cuda:
            self._stream = s
            self._stream_id = s.cuda_stream
        for rec in self._slot_groups[slot]:
            rec.clear_counts()
        self._published.clear()
        self._produced.clear()
        self._on_publish.clear()
        self._epoch_open = True
        self._resumable = False
        return slot

    def finish(self) -> None:
        """Record this slot's completion after the epoch's uploads; never waits for the GPU."""
        if get_ident() != self._owner or self._invalid is not None:
            self._check_thread()
            self._check_valid()
        if not self._epoch_open:
            raise EpochError("finish() without an open epoch: call begin() first")
        if self._cuda:
            if self._slot_events is not None:
                self._slot_events.record(self.current_slot, self._stream_id)
            else:
                self._events[self.current_slot].record(self._stream)
            self._event_recorded[self.current_slot] = True
        self._epoch_open = False
        self._resumable = True

    def resume(self) -> int:
        """Reopen the epoch just finished (late two-batch-overlap preparation).

        Groups published earlier in the epoch stay published; ``finish()`` records the
        completion again after the late uploads.
        """
        self._check_thread()
        self._check_valid()
        if self._epoch_open:
            raise EpochError(f"epoch {self.epoch} is open; resume() follows finish()")
        if not self._resumable:
            raise EpochError("nothing to resume: resume() must follow finish() of this epoch")
        self._check_device()
        self._epoch_open = True
        self._resumable = False
        return self.current_slot

    # ------------------------------------------------------------------ counts
    def set_count(self, buffer: H2DBuffer, count: int | None) -> None:
        """Publish the first ``count`` units of ``buffer`` (padding included) this epoch.

        ``None`` omits the member; ``0`` is an explicit empty publication. The count is
        checked now (type, range, capacity); a rejected count changes nothing.
        """
        if self._invalid is not None or not self._epoch_open or get_ident() != self._owner:
            self._check_ready("set_count")
        if getattr(buffer, "_state", None) is not self:
            self._check_member(buffer)
        if buffer.group in self._published:
            raise DuplicatePublicationError(
                f"buffer {buffer.name!r}: group {buffer.group!r} was already published in "
                "this epoch; a second publication needs a reason (reopen())"
            )
        recs = self._slot_groups[self.current_slot]
        if count is None:
            for gi, i in buffer.homes:
                _omit(recs[gi], i)
            return
        # the common case without a call: a plain in-range int (bytes units take the full check)
        n = count if type(count) is int and 0 <= count <= buffer._fast_capacity else (
            buffer.check_count(count))
        if buffer.max_ranges and buffer.member_index in recs[buffer.homes[0][0]].ranged:
            raise CountError(
                f"buffer {buffer.name!r}: ranges were already set this epoch; publish either a "
                "count or ranges, not both"
            )
        _store_count(recs, buffer.homes, buffer._unit_bytes, n)

    def try_trusted_ranges(
        self, buffer: H2DBuffer, ranges: list[tuple[int, int]], total: int
    ) -> bool:
        """Set ``ranges`` (sorted, disjoint, element-aligned, in bounds: built by trusted
        code such as the block-table state) when they fit the buffer's ``max_ranges`` and
        the group's staging room; return False, changing nothing, when they do not."""
        i = buffer.homes[0][1]
        return self._try_trusted_triples(buffer, [(i, a, b - a) for a, b in ranges], total)

    def _try_trusted_triples(
        self, buffer: H2DBuffer, triples: list[tuple[int, int, int]], total: int
    ) -> bool:
        """:meth:`try_trusted_ranges` with the ranges already as the record's
        ``(member index, offset, bytes)`` triples (the list is kept, not copied)."""
        if self._invalid is not None or not self._epoch_open or get_ident() != self._owner:
            self._check_ready("set_ranges")
        if buffer.group in self._published or len(triples) > buffer.max_ranges:
            return False
        gi, i = buffer.homes[0]
        rec = self._slot_groups[self.current_slot][gi]
        if rec.packed is None or total + 16 * len(triples) > (
                self.range_room(buffer) if rec.ranges else rec.packed.range_capacity):
            return False
        _replace_ranges(rec, i, triples, total)
        return True

    def range_room(self, buffer: H2DBuffer) -> int:
        """Bytes of ranges :meth:`set_ranges` can still take for ``buffer`` this epoch
        (each range also costs 16 bytes of alignment); 0 when the group is not packed."""
        gi, i = buffer.homes[0]
        rec = self._slot_groups[self.current_slot][gi]
        if rec.packed is None:
            return 0
        others = sum(n + 16 for j, _, n in rec.ranges if j != i)
        return max(rec.packed.range_capacity - others, 0)

    def set_ranges(self, buffer: H2DBuffer, ranges: Sequence[tuple[int, int]]) -> None:
        """Publish only these byte ranges ``[start, stop)`` of ``buffer`` this epoch.

        For buffers declared with ``max_ranges``: sorted, disjoint, whole elements, within
        the buffer, at most ``max_ranges`` of them and within the group's staging room
        (about a quarter of the buffer). A packed group copies just these bytes into its
        staging region and scatters them (no extra transfer). A direct publication (direct
        backend, an ineligible group, a lone active member) copies the bytes from the first
        range's start to the last range's end in one copy, never one copy per range (the
        spec's bulk rule), so the source must be current over that whole span, as a
        block-table snapshot always is. Replaces any count or earlier ranges of this buffer
        for the epoch.
        """
        self._check_ready("set_ranges")
        if self._buffers.get(buffer.name) is not buffer:
            self._check_member(buffer)
        if buffer.group in self._published:
            raise DuplicatePublicationError(
                f"buffer {buffer.name!r}: group {buffer.group!r} was already published in "
                "this epoch; a second publication needs a reason (reopen())"
            )
        name, item, cap = buffer.name, buffer.spec.itemsize, buffer.spec.nbytes
        if len(ranges) > buffer.max_ranges:
            raise CountError(
                f"buffer {name!r}: {len(ranges)} ranges exceed its max_ranges="
                f"{buffer.max_ranges}; publish a count (whole rows) instead"
            )
        gi, i = buffer.homes[0]
        rec = self._slot_groups[self.current_slot][gi]
        used = 0
        prev = 0
        new: list[tuple[int, int, int]] = []
        for k, r in enumerate(ranges):
            start, stop = r
            if (isinstance(start, bool) or isinstance(stop, bool)
                    or not isinstance(start, (int, np.integer))
                    or not isinstance(stop, (int, np.integer))):
                raise CountError(f"buffer {name!r}: range {k} {r!r} must be two ints")
            if not prev <= start < stop <= cap:
                raise CountError(
                    f"buffer {name!r}: range {k} [{start}, {stop}) must be non-empty, sorted, "
                    f"disjoint from the previous one and inside [0, {cap})"
                )
            if start % item or stop % item:
                raise CountError(
                    f"buffer {name!r}: range {k} [{start}, {stop}) splits a {item}-byte element"
                )
            new.append((i, int(start), int(stop - start)))
            used += int(stop - start) + 16
            prev = stop
        room = self.range_room(buffer)
        if rec.packed is not None and used > room:
            raise CountError(
                f"buffer {name!r}: {used} range bytes exceed the group's staging room for "
                f"ranges ({room} bytes); publish a count (whole rows) instead"
            )
        _replace_ranges(rec, i, new)

    def count_batch(
        self, buffers: Sequence[H2DBuffer], *, native: bool | None = None
    ) -> CountBatch:
        """A :class:`CountBatch` for ``buffers``: a producer that sets the same members'
        counts every step validates them all and stores them in one call."""
        from .count_batch import CountBatch

        return CountBatch(self, buffers, native=native)

    def set_counts(
        self,
        counts: Mapping[H2DBuffer, int | None] | Iterable[tuple[H2DBuffer, int | None]],
    ) -> None:
        """Set several counts; all are validated before any is stored."""
        items = list(counts.items() if isinstance(counts, Mapping) else counts)
        self._check_ready("set_counts")
        recs = self._slot_groups[self.current_slot]
        for buf, c in items:
            self._check_member(buf)
            if c is not None:
                buf.check_count(c)
                if buf.max_ranges and buf.member_index in recs[buf.homes[0][0]].ranged:
                    raise CountError(
                        f"buffer {buf.name!r}: ranges were already set this epoch; publish "
                        "either a count or ranges, not both"
                    )
            if buf.group in self._published:
                raise DuplicatePublicationError(
                    f"buffer {buf.name!r}: group {buf.group!r} was already published in this "
                    "epoch; a second publication needs a reason (reopen())"
                )
        for buf, c in items:
            self.set_count(buf, c)

    # ------------------------------------------------------------------ publication
    def publish(self, group: str, *, stream: Any = None) -> None:
        """Publish ``group`` on the epoch's consumer stream.

        A packed group with two or more active members (or one member with several
        ranges): one DMA of the arena's header and used payload, then one scatter. One
        active member with a count or a single range, the direct backend, an ineligible
        group, or a producer group covered by a combined group: one direct copy per active
        member (per range). Validation happens first; a rejected publication enqueues
        nothing.
        """
        if self._invalid is not None or not self._epoch_open or get_ident() != self._owner:
            self._check_ready(f"publish({group!r})")
        route = self._routes.get(group)
        if route is None:
            raise UnknownGroupError(self._unknown_group(group))
        rec_index, names, covered_members, counters = route
        if self._cuda:  # _check_device and _check_stream inline: they raise on a mismatch
            device_index = self._device_index
            if _get_device() != device_index:  # type: ignore[misc]
                self._check_device()
            if (_current_raw_stream(device_index) if stream is None  # type: ignore[misc]
                    else stream.cuda_stream) != self._stream_id:
                self._check_stream(stream)
        if not names.isdisjoint(self._published):
            raise DuplicatePublicationError(
                f"group {group!r}: {sorted(names & self._published)} already published in "
                f"epoch {self.epoch}; supply a reason (reopen(group, reason)) for a deliberate "
                "second publication"
            )
        rec = self._slot_groups[self.current_slot][rec_index]
        try:
            if _profiler_enabled():
                with torch.autograd.profiler.record_function(f"h2d.publish/{group}"):
                    nbytes = self._enqueue(rec, covered_members, counters, stream)
            else:
                nbytes = self._enqueue(rec, covered_members, counters, stream)
        except H2DError:
            raise
        except Exception as exc:
            self._invalid = f"publish({group!r}) failed: {type(exc).__name__}: {exc}"
            raise PublicationEnqueueError(
                f"enqueueing publication of group {group!r} failed; the owner is invalidated "
                "and its storage retained; call reset() to recover"
            ) from exc
        counters.publications += 1
        counters.bytes += nbytes
        self._published |= names
        if self._on_publish:
            for g in names.intersection(self._on_publish):
                for buf, fn, only_if_sent in self._on_publish.pop(g):
                    if not only_if_sent or self._sent(buf):
                        fn()

    def _enqueue(self, rec: SlotGroup, covered: Sequence[H2DBuffer],
                 counters: GroupCounters, stream: Any) -> int:
        """Enqueue one publication (validated); return the payload bytes it moves."""
        if covered:
            return self._copy_direct(rec, [b.member_index for b in covered], counters)
        packed = rec.packed
        if packed is not None and (rec.active > 1 or len(rec.ranges) > 1):
            if packed.launch is not None:
                end = native.publish_packed(  # type: ignore[union-attr]
                    packed.launch, rec.counts, rec.ranges, rec.dma_end, self._stream_id)
                if end < 0:  # packed, but capturing (or no graph for the size): plain launch
                    packed.arena.publish(-end, stream)  # type: ignore[attr-defined]
            else:
                end = pack(packed, rec.counts, rec.ranges) if packed.staged or rec.ranges else 0
                packed.arena.publish(end if end > rec.dma_end else rec.dma_end, stream)  # type: ignore[attr-defined]
            counters.dmas += 1
            counters.scatters += 1
            return rec.count_bytes + rec.range_bytes
        nbytes = self._copy_direct(rec, range(len(rec.plan.members)), counters)
        if rec.plan.packed:
            counters.direct_fallbacks += 1
        return nbytes

    def on_publish(
        self, buffer: H2DBuffer, callback: Callable[[], None], *, only_if_sent: bool = True
    ) -> None:
        """Run ``callback`` once, right after ``buffer``'s group is published successfully
        in this epoch, and (``only_if_sent``) only if that publication carried ``buffer``
        (a count or ranges). A failed, reopened or never-made publication never runs it."""
        self._check_ready("on_publish")
        self._check_member(buffer)
        self._on_publish.setdefault(buffer.group, []).append((buffer, callback, only_if_sent))

    def _sent(self, buffer: H2DBuffer) -> bool:
        gi, i = buffer.homes[0]
        rec = self._slot_groups[self.current_slot][gi]
        return rec.counts[i] is not None or i in rec.ranged

    def _copy_direct(
        self, rec: SlotGroup, indices: Iterable[int], counters: GroupCounters
    ) -> int:
        members = rec.plan.members
        slot = self.current_slot
        total = 0
        for i in indices:
            buf = members[i]
            if i in rec.ranged:
                # The spec's bulk rule: a changed table is one transfer, never one per range.
                # The span from the first range to the last travels whole; the source holds
                # the whole CPU table, so the bytes between ranges are current too.
                own = [(off, nbytes) for j, off, nbytes in rec.ranges if j == i]
                start = own[0][0]
                stop = own[-1][0] + own[-1][1]
                buf._dst_bytes[start:stop].copy_(buf._src_bytes[slot][start:stop],
                                                 non_blocking=True)
                counters.direct_copies += 1
                total += stop - start
                continue
            n = rec.counts[i]
            if n is None:
                continue
            if n:
                buf._dst_units[:n].copy_(buf._src_units[slot][:n], non_blocking=True)
            counters.direct_copies += 1
            total += n * buf.spec.unit_bytes
        return total

    def copy_member_direct(self, buffer: H2DBuffer, n: int | None) -> torch.Tensor:
        """Checked direct copy of one buffer's first ``n`` units; returns the destination view.

        For standalone callers not yet producing through a group: it counts as the
        publication of ``buffer``'s producer group in this epoch (the group must not have
        been published yet, and rewriting the source afterwards needs ``reopen``), since the
        asynchronous copy reads the source until the slot's completion event.
        """
        self._check_ready(f"copy_to_gpu of {buffer.name!r}")
        self._check_member(buffer)
        count = buffer.spec.capacity if n is None else buffer.check_count(n)
        if buffer.group in self._published:
            raise DuplicatePublicationError(
                f"copy_to_gpu of {buffer.name!r}: group {buffer.group!r} was already published "
                "in this epoch; reopen(group, reason) before copying it again"
            )
        self._check_device()
        self._check_stream(None)
        dst = buffer._dst_units[:count]
        try:
            if count:
                dst.copy_(buffer._src_units[self.current_slot][:count], non_blocking=True)
        except Exception as exc:
            self._invalid = f"copy_to_gpu({buffer.name!r}) failed: {type(exc).__name__}: {exc}"
            raise PublicationEnqueueError(
                f"enqueueing the direct copy of {buffer.name!r} failed; the owner is "
                "invalidated; call reset() to recover"
            ) from exc
        self._published.add(buffer.group)
        c = self._counters[buffer.group]
        c.direct_copies += 1
        c.publications += 1
        c.bytes += count * buffer.spec.unit_bytes
        if buffer.spec.unit is CountUnit.ROWS:
            return dst
        return buffer.gpu.reshape(-1)[: count * buffer.spec.unit_bytes // buffer.spec.itemsize]

    def reopen(self, group: str, reason: str) -> None:
        """Allow a deliberate second publication of ``group`` in this epoch.

        Acquires the sources first: waits until every DMA already enqueued on the consumer
        stream (the earlier publication included) has completed, so rewriting them is safe.
        The group's counts are cleared; producers set them again before publishing. When the
        group went out inside a combined group, that whole publication is reopened: the
        sibling producer groups lose their counts and pending callbacks too, and must be
        produced again before the combined group is published again.
        """
        self._check_ready(f"reopen({group!r})")
        if not isinstance(reason, str) or not reason.strip():
            raise DuplicatePublicationError(
                f"reopen({group!r}): a second publication needs a non-empty reason string"
            )
        if group not in self._plans and group not in self._producer_groups:
            raise UnknownGroupError(self._unknown_group(group))
        self._acquire_sources()
        recs = self._slot_groups[self.current_slot]
        if group in self._plans:
            pubs = [self._plans[group]]
        else:  # a producer group: reopen whichever publication carried it
            pubs = [p for p in self._plans.values()
                    if group in p.producer_groups and p.name in self._published]
        groups = {g for p in pubs for g in p.producer_groups} or {group}
        for p in pubs:
            recs[p.index].clear_counts()
            self._published.discard(p.name)
        for g in groups:
            for b in self._producer_groups[g]:
                for gi, i in b.homes:
                    _omit(recs[gi], i)
            self._published.discard(g)
            self._produced.discard(g)
            self._on_publish.pop(g, None)
        self._counters[group].second_publications += 1

    def _acquire_sources(self) -> None:
        if self._cuda:
            self._acquire_event.record(self._stream)
            self._acquire_event.synchronize()

    # ------------------------------------------------------------------ producers
    def leave_producer_after_error(self, groups: Sequence[str]) -> None:
        """A producer of ``groups`` raised: it may run again (nothing was published)."""
        if not any(g in self._published for g in groups):
            self._produced.difference_update(groups)

    def enter_producer(self, groups: Sequence[str], reason: str | None) -> None:
        """The check ``@h2d_producer`` runs before entering a producer of ``groups``."""
        if self._invalid is not None or not self._epoch_open or get_ident() != self._owner:
            self._check_ready(f"producer of {list(groups)}")
        produced, published, known = self._produced, self._published, self._producer_groups
        if reason is None:
            if len(groups) == 1:
                g = groups[0]
                if g in known and g not in produced and g not in published:
                    produced.add(g)
                    return
            elif (type(groups) is tuple and groups in self._known_group_lists
                    and produced.isdisjoint(groups)
                    and published.isdisjoint(groups)):
                produced.update(groups)
                return
        for g in groups:
            if g not in self._producer_groups:
                raise UnknownGroupError(
                    f"producer declares {g!r}, which is not a producer group with buffers; "
                    + self._unknown_group(g)
                )
        self._known_group_lists.add(tuple(groups))  # every name checked: a fast path next time
        repeated = [g for g in groups if g in self._produced or g in self._published]
        if repeated and reason is None:
            raise ReentryError(
                f"producer of {list(groups)} entered again in epoch {self.epoch} on slot "
                f"{self.current_slot} ({repeated} already produced/published); pass "
                "h2d_reason='...' for a deliberate second publication"
            )
        for g in repeated:
            if g in self._published:
                self.reopen(g, reason or "")
            else:
                self._counters[g].second_publications += 1
        self._produced.update(groups)

    # ------------------------------------------------------------------ recovery
    def reset(self) -> None:
        """Recover an invalidated owner: wait for all enqueued work, then accept work again.

        Storage is never freed or rebound; it is reused only after the device drained.
        """
        self._check_thread()
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._invalid = None
        self._epoch_open = False
        self._resumable = False
        self._published.clear()
        self._produced.clear()
        self._on_publish.clear()
        self._event_recorded = [False] * self.num_slots
        # A failed enqueue may have left destinations half written: whatever tracked their
        # contents must forget it, so the next publication sends them whole.
        for hook in self._reset_hooks:
            hook()
