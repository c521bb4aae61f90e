"""PackedGroup: placement, sources, and the one publish call (header, packing, DMA, scatter).

Random counts and byte ranges over several publications of the same group: each
destination must hold exactly the published prefix or ranges on top of what it held, and
the compiled helper and the Python path must write the same destinations.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from h2d_kernels import INPLACE_LIMIT, GroupMember, PackedGroup, Placement, placement_of
from h2d_kernels.native import helper

POISON = 0x5A


def _members(device: str, borrowed: torch.Tensor) -> list[GroupMember]:
    def dst(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.full(shape, 0, dtype=dtype, device=device).view(torch.uint8).fill_(
            POISON).view(dtype)

    table = dst((64, 256), torch.int32)
    return [
        GroupMember("temps", dst((64,), torch.float32), 256, 4, 4),
        GroupMember("lens", dst((65,), torch.int32), 260, 4, 4),
        GroupMember("borrowed", dst((2048,), torch.int64), 2048 * 8, 8, 8, borrowed=True),
        GroupMember("ids", dst((20_000,), torch.int32), 80_000, 4, 4),
        GroupMember("table", table, table.numel() * 4, 256 * 4, 4, rows=True, max_ranges=8),
    ]


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).cpu().numpy().copy()


def _group(device: str, compiled: bool) -> tuple[PackedGroup, torch.Tensor]:
    borrowed = torch.zeros(2048, dtype=torch.int64, pin_memory=device == "cuda")
    group = PackedGroup.bind(_members(device, borrowed), device,
                             scatter="reference" if device == "cpu" else "auto",
                             pin=device == "cuda", borrowed_sources={"borrowed": borrowed})
    if not compiled:
        group._binding = None
        group._launch_table = None
    return group, borrowed


def test_placement_follows_size_unit_and_ranges() -> None:
    dst = torch.zeros(1)
    assert placement_of(GroupMember("a", dst, INPLACE_LIMIT, 4, 4)) is Placement.INPLACE
    assert placement_of(GroupMember("a", dst, INPLACE_LIMIT + 4, 4, 4)) is Placement.STAGED
    assert placement_of(GroupMember("a", dst, INPLACE_LIMIT + 4, 64, 4, rows=True)) \
        is Placement.TAIL
    assert placement_of(GroupMember("a", dst, 64, 4, 4, max_ranges=2)) is Placement.TAIL
    assert placement_of(GroupMember("a", dst, 64, 4, 4, borrowed=True)) is Placement.STAGED


@pytest.mark.parametrize("compiled", [
    pytest.param(True, marks=pytest.mark.skipif(helper is None, reason="helper not built")),
    False])
def test_publish_writes_exactly_the_counts_and_ranges(device: str, compiled: bool) -> None:
    group, borrowed = _group(device, compiled)
    assert group.compiled == compiled
    assert group.sources[2] is borrowed
    rng = np.random.default_rng(5)
    row = 256 * 4
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
    for step in range(10):
        for src in group.sources:
            raw = src.view(-1).view(torch.uint8)
            raw.copy_(torch.from_numpy(rng.integers(0, 256, raw.numel(), dtype=np.uint8)))
        before = [_bytes(m.destination) for m in group.members]
        counts: list[Any] = [int(rng.integers(0, 65)), None if step % 3 == 0 else 65,
                             int(rng.integers(0, 2049)), int(rng.integers(0, 20_001)), None]
        ranges: list[tuple[int, int, int]] = []
        if step % 2:
            rows = sorted(rng.choice(64, size=int(rng.integers(1, 6)), replace=False).tolist())
            ranges = [(4, r * row + 8, 64) for r in rows]
        else:
            counts[4] = int(rng.integers(0, 65))
        end = group.publish(counts, ranges, stream)
        if device == "cuda":
            torch.cuda.synchronize()
        assert group.arena.header_bytes <= end <= group.arena.total_bytes
        for i, (m, old) in enumerate(zip(group.members, before, strict=True)):
            want = old.copy()
            src = _bytes(group.sources[i])
            if counts[i]:
                n = counts[i] * m.unit_bytes
                want[:n] = src[:n]
            for j, off, nbytes in ranges:
                if j == i:
                    want[off : off + nbytes] = src[off : off + nbytes]
            assert np.array_equal(_bytes(m.destination), want), (step, m.name)
