"""The compiled packing's own end check (``pack_into`` in ``_packed.pyx``).

Callers validate counts (capacity) and ranges (the staging room, RANGE_OVERHEAD each)
before publishing; the packing still refuses, before writing any byte, a staged member or
range that would land past the staging region (where the table's own pinned source
begins) and more ranges than the header has rows for. Each refusal leaves the whole host
arena and every source as they were, and a valid retry publishes exactly what the oracle
says. The refusing calls would write out of bounds without the check, so each runs in a
child process first when the check is missing (see ``_crashes``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from oracle_packed import expected_arena

from h2d_kernels import GroupMember, PackBoundsError, PackedGroup

TABLE = 4  # member index of the ranged table


def _group(device: str) -> PackedGroup:
    def dst(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    table = dst((64, 256), torch.int32)
    members = [
        GroupMember("temps", dst((64,), torch.float32), 256, 4, 4),
        GroupMember("lens", dst((65,), torch.int32), 260, 4, 4),
        GroupMember("pos", dst((4096,), torch.int32), 16384, 4, 4, borrowed=True),
        GroupMember("ids", dst((20_000,), torch.int32), 80_000, 4, 4),
        GroupMember("table", table, table.numel() * 4, 1024, 4, rows=True, max_ranges=8),
    ]
    pos = torch.zeros(4096, dtype=torch.int32, pin_memory=device == "cuda")
    group = PackedGroup.bind(members, device, scatter="reference" if device == "cpu" else "auto",
                             pin=device == "cuda", borrowed_sources={"pos": pos})
    rng = np.random.default_rng(3)
    for src in group.sources:
        raw = src.view(-1).view(torch.uint8)
        raw.copy_(torch.from_numpy(rng.integers(0, 256, raw.numel(), dtype=np.uint8)))
    return group


FULL = [64, 65, 4096, 20_000, None]  # every staged member at its capacity


def _state(group: PackedGroup) -> list[np.ndarray]:
    return [group.arena.host.numpy().copy()] + [
        s.reshape(-1).view(torch.uint8).cpu().numpy().copy() for s in group.sources]


def test_the_staging_room_is_what_the_check_allows(device: str) -> None:
    """With every staged member at full size, ranges whose aligned sizes add up to the
    range room exactly are packed; the region ends where the table's source begins."""
    group = _group(device)
    assert group.range_capacity == 16384 + 16 * 8
    staging_end = group.staging_offset + 16384 + 80_000 + group.range_capacity
    assert group.offsets[TABLE] == staging_end  # the table's own source follows
    ranges = [(TABLE, 0, 16384), (TABLE, 20_000, 128)]
    want, end = expected_arena(group, FULL, ranges)
    assert group.publish(FULL, ranges) == end == staging_end
    assert np.array_equal(group.arena.host.numpy(), want)


@pytest.mark.parametrize(("counts", "ranges", "match"), [
    # 16 bytes past the room: the second range would overwrite the table's first row
    (FULL, [(TABLE, 0, 16384), (TABLE, 20_000, 144)],
     r"range 1 of member 'table' \(144 bytes from destination offset 20000\) would be "
     r"packed at arena bytes \[\d+, \d+\), past the staging region's end at byte \d+"),
    ([64, 65, 4096, 20_000 + 4, None], [(TABLE, 0, 16384), (TABLE, 20_000, 128)],
     r"range 1 of member 'table'"),
    ([64, 65, 4096, 10**6, None], [],
     r"staged member 'ids' \(1000000 units, 4000000 bytes\) would be packed at arena "
     r"bytes \[\d+, \d+\), past the staging region's end"),
    ([1, 1, 1, 1, None], [(TABLE, 64 * k, 4) for k in range(9)],
     r"9 ranges, but the header has 8 range rows"),
], ids=["range-past-room", "staged-over-capacity", "staged-past-arena", "too-many-ranges"])
def test_packing_past_its_region_is_refused_before_any_write(
        device: str, counts: list[Any], ranges: list[Any], match: str) -> None:
    group = _group(device)
    before = _state(group)
    with pytest.raises(PackBoundsError, match=match + r".*nothing was written"):
        group.publish(counts, ranges)
    after = _state(group)
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    good = [(TABLE, 0, 4), (TABLE, 1024, 8)]
    want, end = expected_arena(group, [3, None, 7, 100, None], good)
    assert group.publish([3, None, 7, 100, None], good) == end  # a valid retry works
    assert np.array_equal(group.arena.host.numpy(), want)


@pytest.mark.parametrize("bad", [(TABLE, 0, -4), (TABLE, -4, 4)], ids=["bytes", "offset"])
def test_negative_range_fields_are_malformed_before_any_write(device: str,
                                                              bad: tuple[int, ...]) -> None:
    group = _group(device)
    before = _state(group)
    with pytest.raises(ValueError, match="malformed count or range"):
        group.publish([1, 1, 1, 1, None], [(TABLE, 0, 4), bad])
    assert all(np.array_equal(a, b) for a, b in zip(before, _state(group), strict=True))


def test_a_negative_staged_count_is_malformed_before_any_write(device: str) -> None:
    group = _group(device)
    before = _state(group)
    with pytest.raises(ValueError, match="malformed count or range"):
        group.publish([1, 1, 1, -1, None], [])
    assert all(np.array_equal(a, b) for a, b in zip(before, _state(group), strict=True))
