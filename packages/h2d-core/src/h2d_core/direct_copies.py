"""Direct copies: one ``copy_`` per active member of a group record, for publications the
packed path does not take (the direct backend, an ineligible group, a lone active member,
a producer group covered by a combined one published alone), and a standalone caller's
checked copy of one buffer (:func:`copy_alone`, ``H2DBuffer.copy_to_gpu``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .buffer import CountUnit, H2DBuffer
from .errors import DuplicatePublicationError, PublicationEnqueueError
from .records import GroupCounters, GroupRecord


def copy_members(rec: GroupRecord, indices: Iterable[int], counters: GroupCounters,
                 slot: int) -> int:
    """Enqueue slot ``slot``'s copies of ``rec``'s members ``indices`` (their counts or
    ranges); count them in ``counters``; return the bytes sent."""
    members = rec.plan.members
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


def copy_alone(state: Any, buffer: H2DBuffer, n: int | None) -> torch.Tensor:
    """``state``'s checked direct copy of ``buffer``'s first ``n`` units (all when None),
    for standalone callers not yet producing through a group; returns the destination
    view.

    It counts as the publication of ``buffer``'s producer group in this epoch (the group
    must not have been published yet, and rewriting the source afterwards needs
    ``reopen``), since the asynchronous copy reads the source until the slot's completion
    event. An enqueue failure invalidates the state (``reset()`` recovers)."""
    state.require_ready(f"copy_to_gpu of {buffer.name!r}")
    state.require_member(buffer)
    count = buffer.spec.capacity if n is None else buffer.check_count(n)
    if buffer.group in state.groups.published:
        raise DuplicatePublicationError(
            f"copy_to_gpu of {buffer.name!r}: group {buffer.group!r} was already published "
            "in this epoch; reopen(group, reason) before copying it again"
        )
    state.require_device()
    state.require_stream(None)
    dst = buffer._dst_units[:count]
    state.completions.graph_recorded = False  # a direct copy after it: finish() records
    try:
        if count:
            dst.copy_(buffer._src_units[state.current_slot][:count], non_blocking=True)
    except Exception as exc:
        state.invalidate(f"copy_to_gpu({buffer.name!r}) failed: {type(exc).__name__}: {exc}")
        raise PublicationEnqueueError(
            f"enqueueing the direct copy of {buffer.name!r} failed; the owner is "
            "invalidated; call reset() to recover"
        ) from exc
    state.groups.copied_alone(buffer.group)
    c = state.counters(buffer.group)
    c.direct_copies += 1
    c.publications += 1
    c.bytes += count * buffer.spec.unit_bytes
    if buffer.spec.unit is CountUnit.ROWS:
        return dst
    return buffer.gpu.reshape(-1)[: count * buffer.spec.unit_bytes // buffer.spec.itemsize]
