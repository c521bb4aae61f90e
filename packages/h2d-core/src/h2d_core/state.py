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

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from h2d_kernels import GroupMember, PackedGroup, arena_order

from .buffer import BufferSpec, CountUnit, GuardedH2DBuffer, H2DBuffer, make_spec
from .completions import SlotCompletions
from .config import Backend, resolve_backend
from .epoch_groups import EpochGroups
from .errors import BindingError, DeclarationError, DeviceUnavailableError, UnknownGroupError
from .fused import ConsumerFn, FusedConsumer
from .fused import declare as declare_consumer
from .fused import place as place_consumers
from .group import GroupPlan, find_shared_bytes, unit_view
from .launch import SlotEvents
from .publish import Publication
from .records import GroupCounters, GroupRecord
from .slot import SlotLifecycle
from .source_guard import SourceGuard


class H2DRunnerState(SlotLifecycle, Publication):
    """Owner of a runner's metadata buffers, publication groups and slots.

    Args:
        device: where destinations live (``"cuda"``, ``"cuda:1"`` or ``"cpu"``). CPU mode
            keeps the whole contract with plain tensors (no pinning, no streams/events).
        num_slots: runner slots; each owns its pinned sources, packed arenas and
            completion event. Pipeline parallelism rotates them.
        backend: ``"packed"`` or ``"direct"``; None reads ``ATOM_H2D_BACKEND`` now, once.
        scatter: how packed arenas scatter (passed to ``h2d_kernels.PackedArena``).
        guard_sources: a debug mode (None reads ``H2D_GUARD_SOURCES=1``): ``.cpu`` / ``.np``
            refuse outside an epoch and every slot's numpy views are read-only except the
            open epoch's, so a write before ``begin()`` or through a reference kept across
            steps raises (:class:`~h2d_core.buffer.GuardedH2DBuffer`). Off, it costs nothing.
    """

    def __init__(
        self,
        device: torch.device | str | None = None,
        *,
        num_slots: int = 1,
        backend: Backend | str | None = None,
        scatter: str = "auto",
        guard_sources: bool | None = None,
    ) -> None:
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu"
        )
        if dev.type == "cuda" and not torch.cuda.is_available():
            why = ("this torch build has no CUDA" if torch.version.cuda is None
                   and torch.version.hip is None else "no CUDA device is visible")
            raise DeviceUnavailableError(
                f"H2DRunnerState({str(device)!r}): {why} (torch {torch.__version__}); "
                "install a CUDA build of torch on a machine with a GPU, or pass "
                "device='cpu' (the whole contract with plain tensors)")
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
        if guard_sources is None:
            guard_sources = os.environ.get("H2D_GUARD_SOURCES", "") == "1"
        if not isinstance(guard_sources, bool):
            raise DeclarationError(f"guard_sources must be a bool or None, got {guard_sources!r}")
        self.owner_thread = threading.get_ident()
        self._buffers: dict[str, H2DBuffer] = {}
        self._producer_groups: dict[str, list[H2DBuffer]] = {}
        self._guard = (SourceGuard(self._buffers, self._producer_groups) if guard_sources
                       else None)
        self._combined: dict[str, tuple[str, ...]] = {}
        self._bound = False
        self._plans: dict[str, GroupPlan] = {}
        self._routes = {}
        self._slot_groups = []
        self._counters: dict[str, GroupCounters] = {}
        self.completions = SlotCompletions(num_slots)
        self.groups = EpochGroups(self._producer_groups, self._counters)

        self.current_slot = 0
        self.epoch = 0
        self._epoch_open = False
        self._resumable = False
        self._stream: Any = None
        self._stream_id = 0
        self._invalid: str | None = None
        #: host ns the last begin() blocked on its slot's previous DMA (source reuse); 0 when
        #: that DMA had completed (checking it is then ordinary host work)
        self.last_source_wait_ns = 0
        #: called by reset(): attached state that must forget what the GPU holds
        self._reset_hooks: list[Callable[[], None]] = []
        self._fused: list[FusedConsumer] = []

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
        self.require_owner()
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
        kind = GuardedH2DBuffer if self._guard is not None else H2DBuffer
        buf = kind(spec, gpu, self, max_ranges)
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
        self.require_owner()
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

    def fuse_consumer(self, name: str, members: Sequence[H2DBuffer],
                      fn: ConsumerFn) -> FusedConsumer:
        """Declare a first consumer the publication of ``members``' group enqueues itself,
        right after its scatter (inside its CUDA graphs): ``fn(header, rows)`` with the
        device arena's header and the members' header rows (see :mod:`h2d_core.fused`).
        After ``bind()``, the returned handle's ``fused`` says whether it was fused (the
        members travel in one packed group); if not, the caller launches the consumer."""
        self.require_owner()
        if self._bound:
            raise DeclarationError(f"fused consumer {name!r}: declare it before bind()")
        consumer = declare_consumer(name, members, fn, self._buffers)
        self._fused.append(consumer)
        return consumer

    # ------------------------------------------------------------------ binding
    def bind(self) -> None:
        """Fix all storage: plan groups, allocate per-slot sources/arenas, check overlaps."""
        self.require_owner()
        if self._bound:
            raise DeclarationError("bind() was already called; bound storage stays fixed")
        # element addresses, not spans: disjoint interleaved views of one tensor are fine
        # (their noncontiguous destinations make the group publish with direct copies)
        overlap = find_shared_bytes([(b.gpu, b.name) for b in self._buffers.values()])
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
                by_name = {b.name: b for b in members}
                members = [by_name[m.name] for m in arena_order(
                    [_group_member(b, b.name in borrowed) for b in members])]
            plans[name] = GroupPlan(name, index, tuple(members), groups, packed, why,
                                    borrowed=borrowed)

        slot_groups: list[list[GroupRecord]] = [[] for _ in range(self.num_slots)]
        sources: dict[str, list[torch.Tensor]] = {b: [] for b in self._buffers}
        fused = place_consumers(self._fused, plans)
        # The slots' events exist before the arenas: each slot's publication graphs end
        # with a record of its event, so finish() after such a launch enqueues nothing.
        slot_events = SlotEvents.create(self.num_slots, self.device) if self._cuda else None
        handles = slot_events.handles if slot_events is not None else (0,) * self.num_slots
        try:
            for plan in plans.values():
                for slot in range(self.num_slots):
                    slot_groups[slot].append(self._bind_group(
                        plan, sources, slot, [c.bound(plan.name) for c in fused.get(plan.name, ())],
                        handles[slot]))
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
        # it is a producer group covered by a combined one, counters, the names again as a
        # sorted tuple: iterated per call without a set iterator): one lookup per call
        self._routes = {name: (plan.index, plan.names, (), self._counters[name],
                               tuple(sorted(plan.names)))
                        for name, plan in plans.items()}
        for g in self._producer_groups:
            if g not in plans:
                self._routes[g] = (plans[primary[g]].index, frozenset((g,)),
                                   tuple(self._producer_groups[g]), self._counters[g], (g,))
        # every group name begin() takes out of the epoch's sets (discarded one by one: a
        # set cleared whole frees its table, and the next epoch's adds allocate it again)
        self.groups.bound(tuple(sorted(set(plans) | set(self._producer_groups))))
        self._slot_groups = slot_groups
        for recs in slot_groups:
            for rec in recs:
                rec.clear_counts()
        if self._guard is not None:  # no epoch open yet: every slot read-only
            self._guard.close_all(self.num_slots)
        if self._cuda:
            self.completions.attach(slot_events, [] if slot_events is not None else [
                torch.cuda.Event() for _ in range(self.num_slots)])
            self._acquire_event = torch.cuda.Event()
        self._bound = True

    def _bind_group(
        self, plan: GroupPlan, sources: dict[str, list[torch.Tensor]], slot: int,
        consumers: Sequence[Callable[[torch.Tensor], None]] = (),
        completion_event: int = 0,
    ) -> GroupRecord:
        own = [b for b in plan.members if b.name not in plan.borrowed]
        if not plan.packed:
            for buf in own:
                sources[buf.name].append(
                    torch.zeros(buf.spec.shape, dtype=buf.spec.dtype, device="cpu",
                                pin_memory=self._cuda)
                )
            return GroupRecord(plan, None)
        # Primary groups are bound first (publication order), so borrowed sources exist.
        packed = PackedGroup.bind(
            [_group_member(b, b.name in plan.borrowed) for b in plan.members], self.device,
            self._scatter, self._cuda, {n: sources[n][slot] for n in plan.borrowed},
            consumers, completion_event)
        for buf, src in zip(plan.members, packed.sources, strict=True):
            if buf.name not in plan.borrowed:
                sources[buf.name].append(src)
        record = GroupRecord(plan, packed)
        # its consumers read the arena's header: every publication goes through the arena
        record.fused = bool(consumers)
        return record

    def buffers(self) -> Mapping[str, H2DBuffer]:
        return dict(self._buffers)

    def plan(self, group: str) -> GroupPlan:
        """The bound plan of a publication group (a combined or uncovered producer group)."""
        self.require_bound()
        if group not in self._plans:
            raise self.unknown_group(group)
        return self._plans[group]

    def counters(self, group: str) -> GroupCounters:
        """Counters of a publication or producer group: the live object, which keeps
        counting (``counters(g).snapshot()`` copies it, for a before/after difference)."""
        self.require_bound()
        if group not in self._counters:
            raise self.unknown_group(group)
        return self._counters[group]


def _group_member(buf: H2DBuffer, borrowed: bool) -> GroupMember:
    spec = buf.spec
    return GroupMember(spec.name, buf.gpu, spec.nbytes, spec.unit_bytes, spec.itemsize,
                       spec.unit is CountUnit.ROWS, buf.max_ranges,
                       borrowed)
