"""Counts and ranges: what each member of a group sends this epoch.

Producers set counts (``set_count``, a :class:`~h2d_core.count_batch.CountBatch`) or byte
ranges (``set_ranges``) on the current slot's group records; ``publish(group)`` (compiled,
in :class:`~h2d_core.epoch.EpochCore`) then sends them: one DMA + one scatter (packed
group) or direct copies (:mod:`~h2d_core.direct_copies`). A :class:`MemberCounts` holds
its state; the state's counting methods are its bound methods (no frame added). A
rejected call changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from h2d_kernels import RANGE_OVERHEAD

from .buffer import H2DBuffer
from .count_batch import CountBatch
from .errors import CountError, DuplicatePublicationError
from .records import GroupRecord


class OnPublish(Protocol):
    """:meth:`MemberCounts.on_publish`'s signature (the state's ``on_publish``)."""

    def __call__(self, buffer: H2DBuffer, callback: Callable[[], None], *,
                 only_if_sent: bool = True) -> None: ...


class MemberCounts:
    """The current epoch's counts and byte ranges of ``state``'s members (the state's
    ``count``, ``set_count``, ``set_counts``, ``count_batch``, ``set_ranges``,
    ``try_trusted_ranges``, ``range_room`` and ``on_publish``: its bound methods are
    these)."""

    def __init__(self, state: Any, buffers: Mapping[str, H2DBuffer]) -> None:
        self._state = state
        self._groups = state.groups
        self._buffers = buffers  # the state's declared buffers (the live dict)
        #: per slot, the group records (``bound``)
        self._records: list[list[GroupRecord]] = []

    def bound(self, records: list[list[GroupRecord]]) -> None:
        """Bind time: the records the counts are stored in, one list per slot."""
        self._records = records

    def count(self, buffer: H2DBuffer) -> int | None:
        """The count set for ``buffer`` in the current epoch (None: omitted)."""
        self._state.require_member(buffer)
        gi, i = buffer.homes[0]
        return self._records[self._state.current_slot][gi].counts[i]

    # ------------------------------------------------------------------ counts
    def set_count(self, buffer: H2DBuffer, count: int | None) -> None:
        """Publish the first ``count`` units of ``buffer`` (padding included) this epoch.

        ``None`` omits the member; ``0`` is an explicit empty publication. The count is
        checked now (type, range, capacity); a rejected count changes nothing.
        """
        self._state.require_ready("set_count")
        if getattr(buffer, "_state", None) is not self._state:
            self._state.require_member(buffer)
        if buffer.group in self._groups.published:
            raise DuplicatePublicationError(
                f"buffer {buffer.name!r}: group {buffer.group!r} was already published in "
                "this epoch; a second publication needs a reason (reopen())"
            )
        recs = self._records[self._state.current_slot]
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
        self._state.require_ready("set_ranges")
        if buffer.group in self._groups.published or len(triples) > buffer.max_ranges:
            return False
        gi, i = buffer.homes[0]
        rec = self._records[self._state.current_slot][gi]
        if rec.packed is None or total + RANGE_OVERHEAD * len(triples) > (
                self.range_room(buffer) if rec.num_ranges else rec.packed.range_capacity):
            return False
        rec.replace_ranges(i, triples)
        return True

    def range_room(self, buffer: H2DBuffer) -> int:
        """Bytes of ranges :meth:`set_ranges` can still take for ``buffer`` this epoch
        (each range also costs 16 bytes of alignment); 0 when the group is not packed."""
        gi, i = buffer.homes[0]
        return self._records[self._state.current_slot][gi].range_room(i)

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
        self._state.require_ready("set_ranges")
        if self._buffers.get(buffer.name) is not buffer:
            self._state.require_member(buffer)
        if buffer.group in self._groups.published:
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
        rec = self._records[self._state.current_slot][gi]
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
        return CountBatch(self._state, buffers)

    def set_counts(
        self,
        counts: Mapping[H2DBuffer, int | None] | Iterable[tuple[H2DBuffer, int | None]],
    ) -> None:
        """Set several counts; all are validated before any is stored."""
        items = list(counts.items() if isinstance(counts, Mapping) else counts)
        self._state.require_ready("set_counts")
        recs = self._records[self._state.current_slot]
        for buf, c in items:
            self._state.require_member(buf)
            if c is not None:
                buf.check_count(c)
                if buf.max_ranges and buf.member_index in recs[buf.homes[0][0]].ranged:
                    raise CountError(
                        f"buffer {buf.name!r}: ranges were already set this epoch; publish "
                        "either a count or ranges, not both"
                    )
            if buf.group in self._groups.published:
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
        self._state.require_ready("on_publish")
        self._state.require_member(buffer)
        self._groups.on_publish(buffer.group, (buffer, callback, only_if_sent))
