"""Group records: one publication group's counts and ranges for one slot and epoch.

A record is what a publication reads: which members are active, each member's count (in
its unit) or byte ranges, and their byte totals. A packed record hands its counts and
ranges to its slot's :class:`h2d_kernels.PackedGroup`, which writes the arena's header. Every
rule that changes a record is a method here, so the state, fused count stores
(:class:`~h2d_core.count_batch.CountBatch`) and block-table staging change records the
same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from h2d_kernels import RANGE_OVERHEAD, PackedGroup

from .group import GroupPlan


@dataclass(eq=False)
class GroupRecord:
    """One publication group's per-slot, per-epoch state: counts, ranges and the arena."""

    plan: GroupPlan
    packed: PackedGroup | None
    counts: list[int | None] = field(default_factory=list)
    #: pending byte ranges this epoch: (member index, destination byte offset, byte count)
    ranges: list[tuple[int, int, int]] = field(default_factory=list)
    #: members with ranges set (they count as active)
    ranged: set[int] = field(default_factory=set)
    range_bytes: int = 0
    #: payload bytes of the counts set (the ranges' bytes are in ``range_bytes``)
    count_bytes: int = 0
    active: int = 0

    def clear_counts(self) -> None:
        """Forget every count and range (a new epoch or a reopened group)."""
        self.counts = [None] * len(self.plan.members)
        self.ranges = []
        self.ranged.clear()
        self.range_bytes = 0
        self.count_bytes = 0
        self.active = 0

    def omit(self, i: int) -> None:
        """Member ``i`` publishes nothing this epoch (its count or ranges are dropped)."""
        old = self.counts[i]
        if old is not None:
            self.counts[i] = None
            self.active -= 1
            self.count_bytes -= old * self.plan.members[i].spec.unit_bytes
        if i in self.ranged:
            self.ranged.discard(i)
            self.active -= 1
            self.ranges = [r for r in self.ranges if r[0] != i]
            self.range_bytes = sum(n for _, _, n in self.ranges)

    def store_count(self, i: int, n: int, unit_bytes: int) -> None:
        """Member ``i`` publishes its first ``n`` units (validated by the caller)."""
        nbytes = n * unit_bytes
        old = self.counts[i]
        if old is None:
            self.active += 1
            self.count_bytes += nbytes
        else:
            self.count_bytes += nbytes - old * unit_bytes
        self.counts[i] = n

    def replace_ranges(self, i: int, new: list[tuple[int, int, int]],
                       nbytes: int | None = None) -> None:
        """Member ``i`` publishes exactly the ranges ``new`` (validated ``(i, offset,
        bytes)`` triples; ``nbytes`` their total when known) instead of a count."""
        if self.counts[i] is not None or i in self.ranged:
            self.omit(i)
        self.active += 1
        self.ranged.add(i)
        if self.ranges:
            self.ranges = [r for r in self.ranges if r[0] != i] + new
            self.range_bytes = sum(n for _, _, n in self.ranges)
        else:
            self.ranges = new
            self.range_bytes = sum(n for _, _, n in new) if nbytes is None else nbytes

    def sent(self, i: int) -> bool:
        """Whether member ``i`` publishes anything (a count or ranges) this epoch."""
        return self.counts[i] is not None or i in self.ranged

    def range_room(self, i: int) -> int:
        """Staging bytes member ``i``'s ranges may still take (0 when not packed)."""
        if self.packed is None:
            return 0
        others = sum(n + RANGE_OVERHEAD for j, _, n in self.ranges if j != i)
        return max(self.packed.range_capacity - others, 0)
