"""Arena plan: a header of range descriptors, then one fixed payload region per member.

The plan is made once at init. Per publication only the descriptors change:
each says which arena bytes go where, so counts (and therefore the bytes that
travel) are runtime values while every address stays fixed.

Header row ``k`` holds four int64 values ``(src_offset, nbytes, member_index,
dst_offset)``: ``src_offset`` is an absolute byte offset in the arena and the
bytes land at ``destination[member_index] + dst_offset``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from h2d_kernels.errors import ArenaLayoutError

DESCRIPTOR_FIELDS = 4
"""int64 values per range descriptor: (src_offset, nbytes, member_index, dst_offset)."""

DESCRIPTOR_BYTES = DESCRIPTOR_FIELDS * 8

PAYLOAD_ALIGN = 16
"""Payload regions start on 16-byte boundaries so the scatter can use 16-byte accesses."""

_ITEMSIZES = (1, 2, 4, 8, 16)


@dataclass(frozen=True)
class ArenaMember:
    """One destination's payload region in the arena.

    ``capacity_bytes`` is the most bytes this member can publish (its region's
    size); ``itemsize`` is the destination dtype's size, used for the
    alignment rule at bind time.
    """

    name: str
    capacity_bytes: int
    itemsize: int


@dataclass(frozen=True)
class MemberRegion:
    """Where a member's payload lives in the arena."""

    index: int
    name: str
    offset: int
    capacity_bytes: int
    itemsize: int

    @property
    def end(self) -> int:
        """One past the region's last byte."""
        return self.offset + self.capacity_bytes


@dataclass(frozen=True)
class ArenaLayout:
    """A planned arena: ``num_ranges`` descriptors, then the member regions in order."""

    members: tuple[ArenaMember, ...]
    regions: tuple[MemberRegion, ...]
    num_ranges: int
    header_bytes: int
    total_bytes: int
    #: an unnamed region for bytes the caller packs per publication (0 bytes when unused)
    staging_offset: int = 0
    staging_bytes: int = 0

    def payload_offset(self, index: int) -> int:
        """Absolute arena offset of member ``index``'s payload region."""
        return self.regions[index].offset

    def region(self, index: int) -> MemberRegion:
        """Member ``index``'s region (offset, capacity, itemsize)."""
        return self.regions[index]

    def member_index(self, name: str) -> int:
        """Index of the member called ``name``."""
        for region in self.regions:
            if region.name == name:
                return region.index
        known = ", ".join(r.name for r in self.regions)
        raise ArenaLayoutError(f"no member named {name!r} in this arena (members: {known})")

    def source_offset(self, index: int, dst_offset: int = 0) -> int:
        """Arena offset where bytes bound for ``destination[index] + dst_offset`` are staged.

        A member's payload region mirrors its destination byte for byte, so a
        range that starts inside the destination (a block-table row, say) is
        staged at the same offset inside the region.
        """
        return self.regions[index].offset + dst_offset


def _round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def _check_member(index: int, member: object, seen: set[str]) -> ArenaMember:
    if not isinstance(member, ArenaMember):
        raise ArenaLayoutError(
            f"member {index} is a {type(member).__name__}, not an ArenaMember: "
            "build each member with ArenaMember(name, capacity_bytes, itemsize)"
        )
    name = member.name
    if not isinstance(name, str) or not name:
        raise ArenaLayoutError(
            f"member {index} has no name: give every member a non-empty str name"
        )
    if name in seen:
        raise ArenaLayoutError(
            f"member {name!r} appears twice: member names must be unique within one arena"
        )
    if not isinstance(member.itemsize, int) or member.itemsize not in _ITEMSIZES:
        raise ArenaLayoutError(
            f"member {name!r} has itemsize {member.itemsize!r}: itemsize must be the destination "
            f"dtype's size, one of {_ITEMSIZES}"
        )
    cap = member.capacity_bytes
    if not isinstance(cap, int) or cap < 0:
        raise ArenaLayoutError(
            f"member {name!r} has capacity_bytes {cap!r}: capacity must be an int >= 0"
        )
    if cap % member.itemsize:
        raise ArenaLayoutError(
            f"member {name!r} has capacity_bytes {cap} that is not a whole number of "
            f"{member.itemsize}-byte items: size the region as numel * itemsize"
        )
    return member


def plan_arena(
    members: Sequence[ArenaMember],
    *,
    num_ranges: int | None = None,
    staging_bytes: int = 0,
    staging_before: int | None = None,
) -> ArenaLayout:
    """Plan an arena for ``members``: header first, then aligned payload regions in order.

    ``num_ranges`` is the number of descriptors in the header (default: one per
    member). Extra descriptors let one member publish several ranges in one
    publication. ``staging_bytes`` reserves an unnamed, 16-byte aligned region placed
    before member ``staging_before`` (default: after the last member): descriptors may
    point into it, so a caller can pack bytes of any member there per publication.
    Raises :class:`ArenaLayoutError` naming the member at fault.
    """
    checked: list[ArenaMember] = []
    seen: set[str] = set()
    for index, member in enumerate(members):
        checked.append(_check_member(index, member, seen))
        seen.add(member.name)
    if not checked:
        raise ArenaLayoutError("an arena needs at least one member: pass the members to publish")
    ranges = len(checked) if num_ranges is None else num_ranges
    if isinstance(ranges, bool) or not isinstance(ranges, int) or ranges < 1:
        raise ArenaLayoutError(
            f"num_ranges={num_ranges!r}: the header needs at least one descriptor "
            "(leave it unset for one per member)"
        )
    if isinstance(staging_bytes, bool) or not isinstance(staging_bytes, int) or staging_bytes < 0:
        raise ArenaLayoutError(f"staging_bytes={staging_bytes!r}: must be an int >= 0")
    before = len(checked) if staging_before is None else staging_before
    if isinstance(before, bool) or not isinstance(before, int) or not 0 <= before <= len(checked):
        raise ArenaLayoutError(
            f"staging_before={staging_before!r}: must be a member index in [0, {len(checked)}]"
        )
    header_bytes = ranges * DESCRIPTOR_BYTES
    regions: list[MemberRegion] = []
    cursor = _round_up(header_bytes, PAYLOAD_ALIGN)
    staging_offset = cursor
    for index, member in enumerate(checked):
        if index == before:
            staging_offset = _round_up(cursor, PAYLOAD_ALIGN)
            cursor = staging_offset + staging_bytes
        offset = _round_up(cursor, max(PAYLOAD_ALIGN, member.itemsize))
        regions.append(
            MemberRegion(index, member.name, offset, member.capacity_bytes, member.itemsize)
        )
        cursor = offset + member.capacity_bytes
    if before == len(checked):
        staging_offset = _round_up(cursor, PAYLOAD_ALIGN)
        cursor = staging_offset + staging_bytes
    # Rounded so a 16-byte access at the arena's end never leaves the allocation.
    total = _round_up(cursor, PAYLOAD_ALIGN)
    return ArenaLayout(
        tuple(checked), tuple(regions), ranges, header_bytes, total, staging_offset, staging_bytes
    )
