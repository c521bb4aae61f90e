"""PackedGroup: placement, sources, and the one publish call (header, packing, DMA, scatter).

The header writes and packing exist only compiled (``_packed.pyx``): these tests check
what it writes into the host arena against the plain rule in ``oracle_packed.py`` and
against hand-written header rows, then check the destinations. On the CPU the driver is
replaced by ctypes callbacks standing in for the graph launch and the capture query, so
the launch half (bucket choice, hand-backs, driver errors) runs here too; the GPU suites
(RUN_H2D_GPU_TESTS=1) launch the real captured graphs.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch
from oracle_packed import expected_arena, source_bytes

from h2d_kernels import (
    INPLACE_LIMIT,
    GraphLaunchTable,
    GroupMember,
    PackedGroup,
    Placement,
    placement_of,
)
from h2d_kernels.graphs import bucket_index, bucket_sizes
from h2d_kernels.native import helper

POISON = 0x5A
ROW = 256 * 4  # bytes per row of the table member

LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
EXEC_BASE = 0x1000  # fake graph exec handle of bucket i: EXEC_BASE + i


def _members(device: str) -> list[GroupMember]:
    def dst(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.full(shape, 0, dtype=dtype, device=device).view(torch.uint8).fill_(
            POISON).view(dtype)

    table = dst((64, 256), torch.int32)
    return [
        GroupMember("temps", dst((64,), torch.float32), 256, 4, 4),
        GroupMember("lens", dst((65,), torch.int32), 260, 4, 4),
        GroupMember("borrowed", dst((2048,), torch.int64), 2048 * 8, 8, 8, borrowed=True),
        GroupMember("ids", dst((20_000,), torch.int32), 80_000, 4, 4),
        GroupMember("table", table, table.numel() * 4, ROW, 4, rows=True, max_ranges=8),
    ]


def _bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).cpu().numpy().copy()


def _group(device: str = "cpu") -> tuple[PackedGroup, torch.Tensor]:
    borrowed = torch.zeros(2048, dtype=torch.int64, pin_memory=device == "cuda")
    group = PackedGroup.bind(_members(device), device,
                             scatter="reference" if device == "cpu" else "auto",
                             pin=device == "cuda", borrowed_sources={"borrowed": borrowed})
    return group, borrowed


def _fill_sources(group: PackedGroup, rng: np.random.Generator) -> None:
    for src in group.sources:
        raw = src.view(-1).view(torch.uint8)
        raw.copy_(torch.from_numpy(rng.integers(0, 256, raw.numel(), dtype=np.uint8)))


def _random_publication(rng: np.random.Generator, step: int
                        ) -> tuple[list[int | None], list[tuple[int, int, int]]]:
    counts: list[int | None] = [int(rng.integers(0, 65)), None if step % 3 == 0 else 65,
                                int(rng.integers(0, 2049)), int(rng.integers(0, 20_001)), None]
    ranges: list[tuple[int, int, int]] = []
    if step % 2:
        rows = sorted(rng.choice(64, size=int(rng.integers(1, 9)), replace=False).tolist())
        ranges = [(4, r * ROW + 8, 64) for r in rows]
    else:
        counts[4] = int(rng.integers(0, 65))
    return counts, ranges


def test_placement_follows_size_unit_and_ranges() -> None:
    dst = torch.zeros(1)
    assert placement_of(GroupMember("a", dst, INPLACE_LIMIT, 4, 4)) is Placement.INPLACE
    assert placement_of(GroupMember("a", dst, INPLACE_LIMIT + 4, 4, 4)) is Placement.STAGED
    assert placement_of(GroupMember("a", dst, INPLACE_LIMIT + 4, 64, 4, rows=True)) \
        is Placement.TAIL
    assert placement_of(GroupMember("a", dst, 64, 4, 4, max_ranges=2)) is Placement.TAIL
    assert placement_of(GroupMember("a", dst, 64, 4, 4, borrowed=True)) is Placement.STAGED


def test_publish_writes_exactly_the_counts_and_ranges(device: str) -> None:
    """Random counts and byte ranges over several publications of the same group: the host
    arena holds the oracle's header and staging bytes, the DMA ends where the oracle says,
    and each destination holds exactly the published prefix or ranges on top of what it
    held."""
    group, borrowed = _group(device)
    assert group.compiled
    assert group.launches_graphs == (device == "cuda")
    assert group.sources[2] is borrowed
    rng = np.random.default_rng(5)
    stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
    for step in range(12):
        _fill_sources(group, rng)
        before = [_bytes(m.destination) for m in group.members]
        counts, ranges = _random_publication(rng, step)
        want_host, want_end = expected_arena(group, counts, ranges)
        end = group.publish(counts, ranges, stream)
        if device == "cuda":
            torch.cuda.synchronize()
        assert end == want_end, step
        assert np.array_equal(group.arena.host.numpy(), want_host), step
        assert group.arena.header_bytes <= end <= group.arena.total_bytes
        for i, (m, old) in enumerate(zip(group.members, before, strict=True)):
            want = old.copy()
            src = source_bytes(group, i)
            if counts[i]:
                n = counts[i] * m.unit_bytes  # type: ignore[operator]
                want[:n] = src[:n]
            for j, off, nbytes in ranges:
                if j == i:
                    want[off : off + nbytes] = src[off : off + nbytes]
            assert np.array_equal(_bytes(m.destination), want), (step, m.name)


def test_header_rows_by_hand() -> None:
    """A small group's header rows and staging bytes, written out: a staged member packs
    at the staging start, a range right after it (16-byte aligned), the unused range row
    scatters nothing; a later publication zeroes the range row it no longer uses."""
    members = [
        GroupMember("a", torch.zeros(16, dtype=torch.int32), 64, 4, 4),
        GroupMember("s", torch.zeros(9000, dtype=torch.int32), 36_000, 4, 4),
        GroupMember("t", torch.zeros(4, 16, dtype=torch.int32), 256, 64, 4, rows=True,
                    max_ranges=2),
    ]
    group = PackedGroup.bind(members, "cpu", scatter="reference", pin=False)
    assert [placement_of(m) for m in members] == [Placement.INPLACE, Placement.STAGED,
                                                  Placement.TAIL]
    off_a, off_t = group.offsets[0], group.offsets[2]
    staging = group.staging_offset
    assert group.offsets[1] == -1 and group.header.shape == (5, 4)
    for i, src in enumerate(group.sources):
        src.view(-1).view(torch.uint8).copy_(
            torch.arange(src.numel() * 4, dtype=torch.int64).remainder(251).to(torch.uint8)
            + i)
    host = group.arena.host.numpy()

    end = group.publish([3, 5, None], [(2, 64, 8)])
    assert end == staging + 48  # staged 20 bytes (aligned to 32), then the 8-byte range
    assert group.header.tolist() == [
        [off_a, 12, 0, 0],
        [staging, 20, 1, 0],
        [off_t, 0, 2, 0],
        [staging + 32, 8, 2, 64],
        [0, 0, 0, 0],
    ]
    assert host[staging : staging + 20].tobytes() == source_bytes(group, 1)[:20].tobytes()
    assert host[staging + 32 : staging + 40].tobytes() == \
        source_bytes(group, 2)[64:72].tobytes()
    assert members[1].destination[:5].tolist() == group.sources[1][:5].tolist()

    end = group.publish([16, 0, 2], [])
    assert end == off_t + 128  # the tail rows end the DMA; nothing staged
    assert group.header[:, 1].tolist() == [64, 0, 128, 0, 0]  # the range row is zeroed
    assert group.header[3].tolist() == [staging + 32, 0, 2, 64]

    # a staged count of 0 packs nothing: the DMA ends with the in-place bytes
    assert group.publish([1, 0, None], []) == off_a + 4
    assert group.header[:3, 1].tolist() == [4, 0, 0]


def test_counts_and_ranges_take_any_int_like() -> None:
    """Exact one-digit ints are read in line; everything else goes through CPython's own
    conversion (bools, numpy integers, int subclasses): the same bytes either way."""
    group, _ = _group()
    _fill_sources(group, np.random.default_rng(3))
    counts: list[Any] = [3, None, 1000, 7, None]
    ranges: list[Any] = [(4, 5 * ROW, 64), (4, 40 * ROW + 8, 1024)]
    want_host, want_end = expected_arena(group, counts, ranges)
    class Count(int):
        pass

    odd_counts = [np.int64(3), None, np.int32(1000), Count(7), None]
    odd_ranges = [(np.int64(4), Count(5 * ROW), np.uint16(64)), (4, 40 * ROW + 8, 1024)]
    assert group.publish(odd_counts, odd_ranges) == want_end
    assert np.array_equal(group.arena.host.numpy(), want_host)
    counts[0] = True
    want_host, want_end = expected_arena(group, counts, [])
    assert group.publish([True, None, 1000, 7, None], []) == want_end
    assert np.array_equal(group.arena.host.numpy(), want_host)


def _capsule(group: PackedGroup) -> object:
    return group._binding


@pytest.mark.parametrize(("args", "error", "match"), [
    (lambda b: (b, (1, 2, 3, 4, 5), [], 0), TypeError, r"counts \(one per member\)"),
    (lambda b: (b, [1, 2, 3, 4], [], 0), TypeError, r"counts \(one per member\)"),
    (lambda b: (b, [1] * 5, (), 0), TypeError, r"counts \(one per member\)"),
    (lambda b: (b, [1] * 5, [(4, 0)], 0), ValueError, "malformed count or range"),
    (lambda b: (b, [1] * 5, [[4, 0, 4]], 0), ValueError, "malformed count or range"),
    (lambda b: (b, [1] * 5, [(5, 0, 4)], 0), ValueError, "malformed count or range"),
    (lambda b: (b, [1] * 5, [(-1, 0, 4)], 0), ValueError, "malformed count or range"),
    (lambda b: (b, [1] * 5, [(4, 0, 4.0)], 0), TypeError, "cannot be interpreted as an int"),
    (lambda b: (b, [1, "2", 3, 4, 5], [], 0), TypeError, "cannot be interpreted as an int"),
    (lambda b: (b, [1, 2, 2**70, 4, 5], [], 0), OverflowError, "too big"),
    (lambda b: (b, [1] * 5, [], "s"), TypeError, "cannot be interpreted as an int"),
    (lambda b: (None, [1] * 5, [], 0), ValueError, "PyCapsule"),
    (lambda b: (b, [1] * 5, []), TypeError, "publish_packed"),
    (lambda b: (b, [1] * 5, [], 0, 1), TypeError, "publish_packed"),
])
def test_publish_packed_refuses_malformed_input(args: Any, error: type, match: str) -> None:
    group, _ = _group()
    with pytest.raises(error, match=match):
        helper.publish_packed(*args(_capsule(group)))


def _bind_args(group: PackedGroup) -> list[Any]:
    arena = group.arena
    return [group._host_base, group.header.ctypes.data, group.staging_offset,
            len(group.members), group._staged, group._src_base, arena.header_bytes,
            arena.total_bytes, (), 0, 0, arena, group._unit_bytes, group.offsets,
            group.header.shape[0]]


@pytest.mark.parametrize(("index", "value", "error", "match"), [
    (None, None, TypeError, "bind_publish takes 15 arguments"),
    (9, 1, ValueError, "null driver function address"),  # a launch without a query
    (10, 1, ValueError, "null driver function address"),  # a query without a launch
    (4, [], TypeError, "staged must be a tuple"),
    (4, ((2, 0),), ValueError, "malformed staged entry"),
    (4, ([2, 0, 8],), ValueError, "malformed staged entry"),
    (4, (("2", 0, 8),), TypeError, "cannot be interpreted as an int"),
    (5, [], TypeError, "src_base must be a tuple"),
    (8, [], TypeError, "execs must be a tuple"),
    (12, [], TypeError, "unit_bytes must be a tuple"),
    (13, [], TypeError, "inplace must be a tuple"),
    (13, (0, 0), ValueError, "unit_bytes and inplace differ in length"),
    (14, 4, ValueError, "header rows do not fit the members"),
    (3, 4, ValueError, "header rows do not fit the members"),
    (0, "x", TypeError, "cannot be interpreted as an int"),
])
def test_bind_publish_refuses_malformed_arguments(index: int | None, value: Any,
                                                  error: type, match: str) -> None:
    group, _ = _group()
    refs = sys.getrefcount(group.arena)
    args = _bind_args(group)
    if index is None:
        args = args[:-1]
    else:
        args[index] = value
    with pytest.raises(error, match=match):
        helper.bind_publish(*args)
    del args
    after = sys.getrefcount(group.arena)  # (not inside assert: its rewrite holds a ref)
    assert after == refs  # a refused binding keeps nothing


def test_a_binding_keeps_its_arena_alive_until_it_goes() -> None:
    group, _ = _group()
    arena = group.arena
    refs = sys.getrefcount(arena)
    binding = helper.bind_publish(*_bind_args(group))
    assert type(binding).__name__ == "PyCapsule"
    held = sys.getrefcount(arena)  # (not inside assert: its rewrite holds a ref)
    del binding
    released = sys.getrefcount(arena)
    assert (held, released) == (refs + 1, refs)


class FakeDriver:
    """ctypes stand-ins for the graph launch and the capture query."""

    def __init__(self, group: PackedGroup) -> None:
        arena = group.arena
        self.sizes = bucket_sizes(arena.header_bytes, arena.total_bytes)
        self.launches: list[tuple[int, int]] = []
        self.queries: list[int] = []
        self.capturing = 0
        self.launch_rc = 0
        self.capture_rc = 0
        self.launch_fn = LAUNCH(self._launch)
        self.capturing_fn = CAPTURING(self._is_capturing)

    def _launch(self, graph_exec: int | None, stream: int | None) -> int:
        if self.launch_rc:
            return self.launch_rc
        self.launches.append(((graph_exec or 0) - EXEC_BASE, stream or 0))
        return 0

    def _is_capturing(self, stream: int | None, status: Any) -> int:
        self.queries.append(stream or 0)
        status[0] = self.capturing
        return self.capture_rc

    def table(self, covered: int | None = None) -> GraphLaunchTable:
        """Graphs for every bucket (or for bucket indices below ``covered`` only)."""
        top = max(self.sizes) if covered is None else covered - 1
        execs = tuple(EXEC_BASE + i if i in self.sizes else 0 for i in range(top + 1))
        address = ctypes.cast(self.launch_fn, ctypes.c_void_p).value
        query = ctypes.cast(self.capturing_fn, ctypes.c_void_p).value
        return GraphLaunchTable(execs, int(address or 0), int(query or 0))


def _faked(monkeypatch: pytest.MonkeyPatch, covered: int | None = None
           ) -> tuple[PackedGroup, FakeDriver, list[int]]:
    """A CPU group whose binding launches through the fake driver; the list collects the
    DMA sizes handed to the arena's own publish."""
    group, _ = _group()
    assert not group.launches_graphs  # a CPU arena has no graphs: the binding only packs
    fake = FakeDriver(group)
    monkeypatch.setattr(group.arena, "graph_launch_table", lambda: fake.table(covered))
    group._binding = group._bind_native()
    assert group.launches_graphs
    handed: list[int] = []
    real = group.arena.publish
    monkeypatch.setattr(group.arena, "publish",
                        lambda n, stream=None: (handed.append(n), real(n, stream))[1])
    return group, fake, handed


def test_the_graph_of_the_covering_bucket_is_launched(monkeypatch: pytest.MonkeyPatch) -> None:
    group, fake, handed = _faked(monkeypatch)
    rng = np.random.default_rng(7)
    for step in range(10):
        _fill_sources(group, rng)
        counts, ranges = _random_publication(rng, step)
        want_host, want_end = expected_arena(group, counts, ranges)
        assert group.publish(counts, ranges, 0xABC0 + step) == want_end
        assert np.array_equal(group.arena.host.numpy(), want_host)
        assert fake.launches[-1] == (bucket_index(want_end), 0xABC0 + step)
        assert fake.queries[-1] == 0xABC0 + step
    assert len(fake.launches) == 10 and handed == []
    # a stream handle of several int digits (a real one is an address) arrives whole
    big = 0x7F3A_1234_5670
    assert group.publish([1, None, None, None, None], [], big) > 0
    assert fake.launches[-1][1] == big and fake.queries[-1] == big
    # DMA ends right at a bucket's size and just past it (ids is staged: its bytes end the
    # DMA): 2**k takes bucket k, 2**k + 16 bucket k + 1
    for k in range(12, 17):
        for extra in (0, 16):
            n = (2**k + extra - group.staging_offset) // 4
            assert group.publish([None, None, None, n, None], [], 3) == 2**k + extra
            assert fake.launches[-1] == (k + (extra > 0), 3)
    launched = len(fake.launches)
    # a binding asked not to launch graphs launches none; on a CPU arena it copies and
    # scatters itself (the compiled CPU publication), so nothing is handed to the arena
    group._binding = group._bind_native(graphs=False)
    assert not group.launches_graphs
    assert group.publish([None] * 5, [], 7) == group.arena.header_bytes
    assert len(fake.launches) == launched and handed == []


@pytest.mark.parametrize("why", ["capturing", "uncovered", "past the table"])
def test_capture_or_an_uncovered_size_hands_the_launch_back(
        monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    group, fake, handed = _faked(monkeypatch, covered={"capturing": None, "uncovered": 0,
                                                       "past the table": 12}[why])
    if why == "uncovered":
        assert group._launch_table is not None and group._launch_table.execs == ()
    fake.capturing = int(why == "capturing")
    counts: list[int | None] = [None, None, None, 20_000, None]  # past 64 KiB: bucket > 11
    want_host, want_end = expected_arena(group, counts, [])
    assert bucket_index(want_end) >= 12
    assert group.publish(counts, [], 5) == want_end
    assert np.array_equal(group.arena.host.numpy(), want_host)
    assert handed == [want_end] and fake.launches == []
    assert fake.queries == ([5] if why == "capturing" else [])
    assert np.array_equal(_bytes(group.members[3].destination), source_bytes(group, 3))


@pytest.mark.parametrize(("call", "rc"), [("graph launch", 719), ("stream capture query", 900)])
def test_a_driver_error_raises_naming_the_call_and_status(
        monkeypatch: pytest.MonkeyPatch, call: str, rc: int) -> None:
    group, fake, handed = _faked(monkeypatch)
    if call == "graph launch":
        fake.launch_rc = rc
    else:
        fake.capture_rc = rc
    with pytest.raises(RuntimeError, match=f"^{call} failed with driver error {rc}$"):
        group.publish([3, None, None, None, None], [], 1)
    assert fake.launches == [] and handed == []
    fake.launch_rc = fake.capture_rc = 0
    assert group.publish([3, None, None, None, None], [], 1) > 0
    assert len(fake.launches) == 1


def test_importing_without_the_compiled_core_fails_naming_the_fix() -> None:
    script = (
        "import importlib.abc, sys\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'h2d_kernels._packed_native':\n"
        "            raise ImportError(f'no module named {name!r} (hidden by the test)')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "try:\n"
        "    import h2d_kernels\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, isinstance(exc, ImportError), exc)\n"
        "else:\n"
        "    print('imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("NativeBuildError True "), out
    assert "h2d_kernels._packed_native is not built" in out
    assert "tools/build_native.py" in out and "pip install" in out
