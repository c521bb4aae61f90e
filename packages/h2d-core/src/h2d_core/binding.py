"""Binding: the declared buffers and groups turned into fixed storage, once.

:func:`bind_groups` plans each publication group (which buffers travel together, packed or
direct, in the arena's order), allocates every slot's pinned sources and packed arenas (the
slots' driver events first: each slot's publication graphs end by recording its event),
and attaches the sources and homes to the buffers. It returns a :class:`BoundGroups`; the
state (:meth:`~h2d_core.state.H2DRunnerState.bind`) keeps it and opens for epochs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from h2d_kernels import GroupMember, PackedGroup, arena_order

from .buffer import CountUnit, H2DBuffer
from .config import Backend
from .errors import BindingError
from .fused import FusedConsumer
from .fused import place as place_consumers
from .group import GroupPlan, find_shared_bytes, unit_view
from .launch import SlotEvents
from .records import GroupCounters, GroupRecord

#: publish(name) -> (record index, names it publishes, members copied directly when it is
#: a producer group covered by a combined one, counters, the names again as a sorted tuple)
Route = tuple[int, frozenset[str], tuple[H2DBuffer, ...], GroupCounters, tuple[str, ...]]


@dataclass(frozen=True)
class BoundGroups:
    """What binding fixed: the plans, each slot's records, the counters and routes."""

    #: publication group -> its plan (combined groups, then uncovered producer groups)
    plans: dict[str, GroupPlan]
    #: per slot, one record per publication group (``GroupPlan.index``)
    slot_groups: list[list[GroupRecord]]
    #: publication and producer group -> its counters
    counters: dict[str, GroupCounters]
    routes: dict[str, Route]
    #: every name an epoch may produce or publish, sorted
    all_names: tuple[str, ...]
    #: the slots' driver events (None on CPU, or when the driver library did not load)
    slot_events: SlotEvents | None


@dataclass(frozen=True)
class Declared:
    """What the state declared before binding, and how it binds."""

    buffers: Mapping[str, H2DBuffer]
    producer_groups: Mapping[str, Sequence[H2DBuffer]]
    combined: Mapping[str, tuple[str, ...]]
    fused: Sequence[FusedConsumer]
    backend: Backend
    num_slots: int
    device: torch.device
    scatter: str
    cuda: bool


def bind_groups(d: Declared) -> BoundGroups:
    """Plan, allocate and attach (see the module); a refusal raises before anything is
    attached to a buffer."""
    dst_units = _checked_destinations(d.buffers)
    covered = {g for gs in d.combined.values() for g in gs}
    publication: list[tuple[str, tuple[str, ...]]] = list(d.combined.items())
    publication += [(g, (g,)) for g in d.producer_groups if g not in covered]
    primary: dict[str, str] = {}  # producer group -> publication group holding its sources
    for name, groups in publication:
        for g in groups:
            primary.setdefault(g, name)
    for b in d.buffers.values():
        homes = sum(b.group in gs for _, gs in publication)
        if b.max_ranges and homes > 1:
            raise BindingError(
                f"buffer {b.name!r}: a ranged buffer (max_ranges) must be carried by one "
                f"publication group, but group {b.group!r} is covered by {homes}")
    plans = _plans(d, publication, primary)

    slot_groups: list[list[GroupRecord]] = [[] for _ in range(d.num_slots)]
    sources: dict[str, list[torch.Tensor]] = {b: [] for b in d.buffers}
    fused = place_consumers(d.fused, plans)
    # The slots' events exist before the arenas: each slot's publication graphs end with a
    # record of its event, so finish() after such a launch enqueues nothing.
    slot_events = SlotEvents.create(d.num_slots, d.device) if d.cuda else None
    handles = slot_events.handles if slot_events is not None else (0,) * d.num_slots
    try:
        for plan in plans.values():
            for slot in range(d.num_slots):
                slot_groups[slot].append(_bind_group(
                    d, plan, sources, slot,
                    [c.bound(plan.name) for c in fused.get(plan.name, ())], handles[slot]))
    except ValueError as exc:  # layout/destination rejections from h2d_kernels
        raise BindingError(f"cannot bind packed storage: {exc}") from exc

    for buf in d.buffers.values():
        buf._attach_sources(sources[buf.name])
        buf._dst_units = dst_units[buf.name]
        buf._src_units = [unit_view(s, buf.spec.unit) for s in sources[buf.name]]
        if buf.max_ranges:
            buf._dst_bytes = unit_view(buf.gpu, CountUnit.BYTES)
            buf._src_bytes = [unit_view(s, CountUnit.BYTES) for s in sources[buf.name]]
    counters: dict[str, GroupCounters] = {}
    for name, plan in plans.items():
        for i, buf in enumerate(plan.members):
            buf.homes.append((plan.index, i))
            if primary[buf.group] == name:
                buf.publication_group = name
                buf.member_index = i
        counters[name] = GroupCounters()
    for g in d.producer_groups:
        counters.setdefault(g, GroupCounters())
    # one lookup per publish(name); the names as a sorted tuple are iterated per call
    # without a set iterator
    routes: dict[str, Route] = {
        name: (plan.index, plan.names, (), counters[name], tuple(sorted(plan.names)))
        for name, plan in plans.items()}
    for g in d.producer_groups:
        if g not in plans:
            routes[g] = (plans[primary[g]].index, frozenset((g,)),
                         tuple(d.producer_groups[g]), counters[g], (g,))
    for recs in slot_groups:
        for rec in recs:
            rec.clear_counts()
    return BoundGroups(plans, slot_groups, counters, routes,
                       tuple(sorted(set(plans) | set(d.producer_groups))), slot_events)


def _checked_destinations(buffers: Mapping[str, H2DBuffer]) -> dict[str, torch.Tensor]:
    # element addresses, not spans: disjoint interleaved views of one tensor are fine
    # (their noncontiguous destinations make the group publish with direct copies)
    overlap = find_shared_bytes([(b.gpu, b.name) for b in buffers.values()])
    if overlap:
        raise BindingError(
            f"buffers {overlap[0]!r} and {overlap[1]!r} share GPU bytes; give each member "
            "its own destination")
    dst_units: dict[str, torch.Tensor] = {}
    for buf in buffers.values():
        try:
            dst_units[buf.name] = unit_view(buf.gpu, buf.spec.unit)
        except RuntimeError:
            raise BindingError(
                f"buffer {buf.name!r}: its destination (strides {tuple(buf.gpu.stride())}) "
                f"cannot be counted in {buf.spec.unit.value} without a copy; use unit='rows' "
                "or a contiguous destination") from None
    return dst_units


def _plans(d: Declared, publication: list[tuple[str, tuple[str, ...]]],
           primary: dict[str, str]) -> dict[str, GroupPlan]:
    plans: dict[str, GroupPlan] = {}
    for index, (name, groups) in enumerate(publication):
        members = [b for g in groups for b in d.producer_groups[g]]
        borrowed = frozenset(b.name for b in members if primary[b.group] != name)
        why = ""
        if d.backend is Backend.DIRECT:
            why = "direct backend"
        else:
            bad = [b.name for b in members if not b.gpu.is_contiguous()]
            if bad:
                why = f"noncontiguous destination(s) {bad}"
        packed = not why
        if packed:
            by_name = {b.name: b for b in members}
            members = [by_name[m.name] for m in arena_order(
                [group_member(b, b.name in borrowed) for b in members])]
        plans[name] = GroupPlan(name, index, tuple(members), groups, packed, why,
                                borrowed=borrowed)
    return plans


def _bind_group(
    d: Declared, plan: GroupPlan, sources: dict[str, list[torch.Tensor]], slot: int,
    consumers: Sequence[Callable[[torch.Tensor], None]], completion_event: int,
) -> GroupRecord:
    own = [b for b in plan.members if b.name not in plan.borrowed]
    if not plan.packed:
        for buf in own:
            sources[buf.name].append(
                torch.zeros(buf.spec.shape, dtype=buf.spec.dtype, device="cpu",
                            pin_memory=d.cuda))
        return GroupRecord(plan, None)
    # Primary groups are bound first (publication order), so borrowed sources exist.
    packed = PackedGroup.bind(
        [group_member(b, b.name in plan.borrowed) for b in plan.members], d.device,
        d.scatter, d.cuda, {n: sources[n][slot] for n in plan.borrowed},
        consumers, completion_event)
    for buf, src in zip(plan.members, packed.sources, strict=True):
        if buf.name not in plan.borrowed:
            sources[buf.name].append(src)
    record = GroupRecord(plan, packed)
    # its consumers read the arena's header: every publication goes through the arena
    record.fused = bool(consumers)
    return record


def group_member(buf: H2DBuffer, borrowed: bool) -> GroupMember:
    """``buf`` as a member of a packed group (``borrowed``: its sources live in another
    group's arena)."""
    spec = buf.spec
    return GroupMember(spec.name, buf.gpu, spec.nbytes, spec.unit_bytes, spec.itemsize,
                       spec.unit is CountUnit.ROWS, buf.max_ranges, borrowed)
