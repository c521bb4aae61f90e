"""Direct copies: one ``copy_`` per active member of a group record, for publications the
packed path does not take (the direct backend, an ineligible group, a lone active member,
a producer group covered by a combined one published alone)."""

from __future__ import annotations

from collections.abc import Iterable

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
