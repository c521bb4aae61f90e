"""Counts, ranges and publication: what a group sends, and the packed or direct enqueue.

Producers set counts (``set_count``, a :class:`~h2d_core.count_batch.CountBatch`) or byte
ranges (``set_ranges``) on the current slot's group records; ``publish(group)`` (compiled,
in :class:`~h2d_core.epoch.EpochCore`) validates the epoch, device, stream and duplicates,
then enqueues one DMA + one scatter (packed group, two or more active members or several
ranges) or the direct copies here (direct backend, ineligible group, a lone active member,
a producer group covered by a combined one). A rejected call changes nothing; an enqueue
failure invalidates the owner.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from h2d_kernels import RANGE_OVERHEAD

from .buffer import CountUnit, H2DBuffer
from .count_batch import CountBatch
from .errors import (
    CountError,
    DuplicatePublicationError,
    MembershipError,
    PublicationEnqueueError,
    UnknownGroupError,
)
from .owner import StateOwner
from .records import GroupCounters, GroupRecord

_profiler_enabled: Callable[[], bool] = torch._C._autograd._profiler_enabled


class Publication(StateOwner):
    """The counts and publication half of :class:`~h2d_core.state.H2DRunnerState`."""

    def count(self, buffer: H2DBuffer) -> int | None:
        """The count set for ``buffer`` in the current epoch (None: omitted)."""
        self._check_member(buffer)
        gi, i = buffer.homes[0]
        return self._slot_groups[self.current_slot][gi].counts[i]

    def is_published(self, group: str) -> bool:
        """Whether ``group`` was published in the current (or last) epoch."""
        return group in self._published

    # ------------------------------------------------------------------ counts
    def set_count(self, buffer: H2DBuffer, count: int | None) -> None:
        """Publish the first ``count`` units of ``buffer`` (padding included) this epoch.

        ``None`` omits the member; ``0`` is an explicit empty publication. The count is
        checked now (type, range, capacity); a rejected count changes nothing.
        """
        self.require_ready("set_count")
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
                recs[gi].omit(i)
            return
        # the common case without a call: a plain in-range int (bytes units take the full check)
        n = count if type(count) is int and 0 <= count <= buffer._fast_capacity else (
            buffer.check_count(count))
        if buffer.max_ranges and buffer.member_index in recs[buffer.homes[0][0]].ranged:
            raise CountError(
                f"buffer {buffer.name!r}: ranges were already set this epoch; publish either a "
                "count or ranges, not both"
            )
        homes = buffer.homes
        if len(homes) == 1:  # a Python for loop would make an iterator object per call
            gi, i = homes[0]
            recs[gi].store_count(i, n, buffer._unit_bytes)
            return
        for gi, i in homes:
            recs[gi].store_count(i, n, buffer._unit_bytes)

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
        ``(member index, offset, bytes)`` triples (copied into the record's range table)."""
        self.require_ready("set_ranges")
        if buffer.group in self._published or len(triples) > buffer.max_ranges:
            return False
        gi, i = buffer.homes[0]
        rec = self._slot_groups[self.current_slot][gi]
        if rec.packed is None or total + RANGE_OVERHEAD * len(triples) > (
                self.range_room(buffer) if rec.num_ranges else rec.packed.range_capacity):
            return False
        rec.replace_ranges(i, triples)
        return True

    def range_room(self, buffer: H2DBuffer) -> int:
        """Bytes of ranges :meth:`set_ranges` can still take for ``buffer`` this epoch
        (each range also costs 16 bytes of alignment); 0 when the group is not packed."""
        gi, i = buffer.homes[0]
        return self._slot_groups[self.current_slot][gi].range_room(i)

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
        if not isinstance(ranges, (list, tuple)):
            raise CountError(
                f"buffer {name!r}: ranges must be a list of (start, stop) byte pairs, got "
                f"{type(ranges).__name__}")
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
            if not isinstance(r, (list, tuple)) or len(r) != 2:
                raise CountError(
                    f"buffer {name!r}: range {k} {r!r} must be a (start, stop) pair of byte "
                    "offsets")
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
            used += int(stop - start) + RANGE_OVERHEAD
            prev = int(stop)
        room = self.range_room(buffer)
        if rec.packed is not None and used > room:
            raise CountError(
                f"buffer {name!r}: {used} range bytes exceed the group's staging room for "
                f"ranges ({room} bytes); publish a count (whole rows) instead"
            )
        rec.replace_ranges(i, new)

    def count_batch(self, buffers: Sequence[H2DBuffer]) -> CountBatch:
        """A :class:`CountBatch` for ``buffers``: a producer that sets the same members'
        counts every step validates them all and stores them in one call."""
        return CountBatch(self, buffers)

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
        return self._slot_groups[self.current_slot][gi].sent(i)

    def _copy_direct(
        self, rec: GroupRecord, indices: Iterable[int], counters: GroupCounters
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
        self._graph_recorded = False  # a direct copy after it: finish() records
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

    def _check_covered(self, group: str) -> None:
        """Refuse publishing producer group ``group``, covered by a combined group, alone
        while another producer group of that combined group was produced in this epoch
        and is not published: the step's producers wrote the combined group, so ``group``
        alone would send part of the step and silently leave the rest behind. A covered
        group produced on its own (a standalone caller) publishes alone, with checked
        direct copies of its own members only."""
        left = {name: sorted(g for g in gs if g != group and g in self._produced
                             and g not in self._published)
                for name, gs in self._combined.items() if group in gs}
        left = {name: gs for name, gs in left.items() if gs}
        if left:
            name, others = next(iter(left.items()))
            raise MembershipError(
                f"group {group!r} is covered by the combined group {name!r}, whose producer "
                f"groups {others} were produced in epoch {self.epoch} and are not published: "
                f"publishing {group!r} alone sends only its own members and leaves them "
                f"behind; publish {name!r} (one DMA of the whole step), or produce "
                f"{group!r} on its own to publish it alone")

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
                    recs[gi].omit(i)
            self._published.discard(g)
            self._produced.discard(g)
            self._on_publish.pop(g, None)
            for stager in self._stagers.get(g, ()):
                stager.clear_pending()
        if self._guard:  # guard_sources: the acquired sources are writable again
            self._guard_published(groups, True)  # type: ignore[attr-defined]
        self._counters[group].second_publications += 1

    def _acquire_sources(self) -> None:
        self._graph_recorded = False  # an enqueue (the acquire record): finish() records
        if self._cuda:
            self._acquire_event.record(self._stream)
            self._acquire_event.synchronize()
