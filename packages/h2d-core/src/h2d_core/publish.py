"""Counts, ranges and publication: what a group sends, and the packed or direct enqueue.

Producers set counts (``set_count``, a :class:`~h2d_core.count_batch.CountBatch`) or byte
ranges (``set_ranges``) on the current slot's group records; ``publish(group)`` (compiled,
in :class:`~h2d_core.epoch.EpochCore`) validates the epoch, device, stream and duplicates,
then enqueues one DMA + one scatter (packed group, two or more active members or several
ranges) or direct copies (:mod:`~h2d_core.direct_copies`: direct backend, ineligible group,
a lone active member, a producer group covered by a combined one; a standalone caller's
``copy_member_direct`` is here). A rejected call changes nothing; an enqueue failure
invalidates the owner.
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
    PublicationEnqueueError,
)
from .owner import StateOwner


class Publication(StateOwner):
    """The counts and publication half of :class:`~h2d_core.state.H2DRunnerState`."""

    def count(self, buffer: H2DBuffer) -> int | None:
        """The count set for ``buffer`` in the current epoch (None: omitted)."""
        self.require_member(buffer)
        gi, i = buffer.homes[0]
        return self._slot_groups[self.current_slot][gi].counts[i]

    # ------------------------------------------------------------------ counts
    def set_count(self, buffer: H2DBuffer, count: int | None) -> None:
        """Publish the first ``count`` units of ``buffer`` (padding included) this epoch.

        ``None`` omits the member; ``0`` is an explicit empty publication. The count is
        checked now (type, range, capacity); a rejected count changes nothing.
        """
        self.require_ready("set_count")
        if getattr(buffer, "_state", None) is not self:
            self.require_member(buffer)
        if buffer.group in self.groups.published:
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
        if buffer.group in self.groups.published or len(triples) > buffer.max_ranges:
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
        self.require_ready("set_ranges")
        if self._buffers.get(buffer.name) is not buffer:
            self.require_member(buffer)
        if buffer.group in self.groups.published:
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
        self.require_ready("set_counts")
        recs = self._slot_groups[self.current_slot]
        for buf, c in items:
            self.require_member(buf)
            if c is not None:
                buf.check_count(c)
                if buf.max_ranges and buf.member_index in recs[buf.homes[0][0]].ranged:
                    raise CountError(
                        f"buffer {buf.name!r}: ranges were already set this epoch; publish "
                        "either a count or ranges, not both"
                    )
            if buf.group in self.groups.published:
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
        self.require_ready("on_publish")
        self.require_member(buffer)
        self.groups.on_publish(buffer.group, (buffer, callback, only_if_sent))

    def copy_member_direct(self, buffer: H2DBuffer, n: int | None) -> torch.Tensor:
        """Checked direct copy of one buffer's first ``n`` units; returns the destination view.

        For standalone callers not yet producing through a group: it counts as the
        publication of ``buffer``'s producer group in this epoch (the group must not have
        been published yet, and rewriting the source afterwards needs ``reopen``), since the
        asynchronous copy reads the source until the slot's completion event.
        """
        self.require_ready(f"copy_to_gpu of {buffer.name!r}")
        self.require_member(buffer)
        count = buffer.spec.capacity if n is None else buffer.check_count(n)
        if buffer.group in self.groups.published:
            raise DuplicatePublicationError(
                f"copy_to_gpu of {buffer.name!r}: group {buffer.group!r} was already published "
                "in this epoch; reopen(group, reason) before copying it again"
            )
        self.require_device()
        self.require_stream(None)
        dst = buffer._dst_units[:count]
        self.completions.graph_recorded = False  # a direct copy after it: finish() records
        try:
            if count:
                dst.copy_(buffer._src_units[self.current_slot][:count], non_blocking=True)
        except Exception as exc:
            self._invalid = f"copy_to_gpu({buffer.name!r}) failed: {type(exc).__name__}: {exc}"
            raise PublicationEnqueueError(
                f"enqueueing the direct copy of {buffer.name!r} failed; the owner is "
                "invalidated; call reset() to recover"
            ) from exc
        self.groups.copied_alone(buffer.group)
        c = self._counters[buffer.group]
        c.direct_copies += 1
        c.publications += 1
        c.bytes += count * buffer.spec.unit_bytes
        if buffer.spec.unit is CountUnit.ROWS:
            return dst
        return buffer.gpu.reshape(-1)[: count * buffer.spec.unit_bytes // buffer.spec.itemsize]
