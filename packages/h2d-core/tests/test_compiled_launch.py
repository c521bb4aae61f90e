"""The compiled publication (h2d_kernels.PackedGroup through the state) and slot events.

On the CPU the driver is replaced by ctypes callbacks standing in for ``cuGraphLaunch``,
``cuStreamIsCapturing`` and the event calls. The fake ``cuGraphLaunch`` runs the arena's
own CPU publication of the launched bucket's size, as the captured graph would on the
GPU, so destinations show whether the compiled path packed the right bytes and chose the
right graph. The GPU suites run the same state through the real driver.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
import torch

from h2d_core import H2DRunnerState, PublicationEnqueueError
from h2d_core.native import native as core_native
from h2d_kernels import GraphLaunchTable
from h2d_kernels.graphs import bucket_index, bucket_sizes
from h2d_kernels.native import helper as kernels_native

pytestmark = pytest.mark.skipif(
    core_native is None or kernels_native is None,
    reason="H2D_NATIVE=0 or not built: the compiled helpers are off")

LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
EVENT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
EXEC_BASE = 0x1000  # fake CUgraphExec handle of bucket i: EXEC_BASE + i


def _address(fn: Any) -> int:
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)


class FakeDriver:
    """Stand-ins for the driver calls; the launch replays the arena's CPU publication."""

    def __init__(self, arena: Any) -> None:
        self.arena = arena
        self.sizes = bucket_sizes(arena.header_bytes, arena.total_bytes)
        self.launches: list[tuple[int, int]] = []
        self.capturing = 0
        self.launch_rc = 0
        self.capture_rc = 0
        self.launch_fn = LAUNCH(self._launch)
        self.capturing_fn = CAPTURING(self._is_capturing)

    def _launch(self, graph_exec: int | None, stream: int | None) -> int:
        if self.launch_rc:
            return self.launch_rc
        index = (graph_exec or 0) - EXEC_BASE
        self.launches.append((index, stream or 0))
        self.arena.publish(self.sizes[index])  # what the bucket's graph does
        return 0

    def _is_capturing(self, stream: int | None, status: Any) -> int:
        status[0] = self.capturing
        return self.capture_rc

    def table(self, covered: int | None = None) -> GraphLaunchTable:
        """Graphs for every bucket (or for the first ``covered`` bucket indices only)."""
        top = max(self.sizes)
        execs = tuple(EXEC_BASE + i if i in self.sizes and (covered is None or i < covered)
                      else 0 for i in range(top + 1))
        return GraphLaunchTable(execs, _address(self.launch_fn), _address(self.capturing_fn))


def _state(device: str = "cpu") -> tuple[H2DRunnerState, dict[str, Any]]:
    """A combined group with in-place, staged (64 KiB ids) and a ranged tail table."""
    st = H2DRunnerState(device, backend="packed",
                        scatter="reference" if device == "cpu" else "auto")
    b = {
        "temps": st.buffer("temps", (64,), torch.float32, group="tokens"),
        "ids": st.buffer("ids", (16384,), torch.int32, group="tokens"),
        "lens": st.buffer("lens", (64,), torch.int32, group="attn"),
        "table": st.buffer("table", (64, 512), torch.int32, group="attn", unit="rows",
                           max_ranges=8),
    }
    st.combine("step", ["tokens", "attn"])
    st.bind()
    for buf in b.values():
        buf.gpu.view(-1).view(torch.uint8).fill_(0x5A)
    return st, b


def _with_fake_driver(st: H2DRunnerState, monkeypatch: pytest.MonkeyPatch,
                      covered: int | None = None) -> FakeDriver:
    rec = st._slot_groups[0][st.plan("step").index]
    packed = rec.packed
    assert packed is not None and packed.compiled and not packed.launches_graphs  # CPU
    fake = FakeDriver(packed.arena)
    monkeypatch.setattr(packed.arena, "graph_launch_table", lambda: fake.table(covered))
    packed._binding = packed._bind_native()
    assert packed.launches_graphs
    return fake


def _step(st: H2DRunnerState, b: dict[str, Any], rng: np.random.Generator, k: int) -> None:
    st.begin()
    for name in ("temps", "ids", "lens", "table"):
        raw = b[name].cpu.view(-1).view(torch.uint8)
        raw.copy_(torch.from_numpy(rng.integers(0, 256, raw.numel(), dtype=np.uint8)))
    st.set_count(b["temps"], int(rng.integers(0, 65)))
    st.set_count(b["ids"], int(rng.integers(0, 16385)) if k % 3 else None)
    st.set_count(b["lens"], int(rng.integers(1, 65)))
    if k % 2:
        row = 512 * 4
        starts = sorted(rng.choice(64, size=int(rng.integers(1, 6)), replace=False).tolist())
        st.set_ranges(b["table"], [(r * row, r * row + 64) for r in starts])
    else:
        st.set_count(b["table"], int(rng.integers(0, 65)))
    st.publish("step")
    st.finish()


def _needed_end(st: H2DRunnerState) -> int:
    """Where the last published byte of the current epoch's arena lies."""
    rec = st._slot_groups[st.current_slot][st.plan("step").index]
    packed = rec.packed
    end = packed.arena.header_bytes
    for row, (off, nbytes, _, _) in enumerate(packed.header.tolist()):
        if not nbytes:
            continue
        if row < len(packed.members) and packed.offsets[row] >= 0:
            end = max(end, off + nbytes)  # in place: the DMA ends where its bytes end
        else:
            end = max(end, (off + nbytes + 15) // 16 * 16)  # staged or a range
    return int(end)


def _dest(b: dict[str, Any]) -> dict[str, bytes]:
    return {n: buf.gpu.reshape(-1).view(torch.uint8).numpy().tobytes() for n, buf in b.items()}


def test_compiled_publish_writes_the_python_paths_bytes_through_the_bucket_graph(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fast, fb = _state()
    ref, rb = _state()
    fake = _with_fake_driver(fast, monkeypatch)
    rng_f, rng_r = np.random.default_rng(7), np.random.default_rng(7)
    for k in range(24):
        _step(fast, fb, rng_f, k)
        _step(ref, rb, rng_r, k)
        assert _dest(fb) == _dest(rb), f"step {k}"
        index, stream = fake.launches[-1]
        # the graph launched is the smallest one covering the bytes the publication needs
        assert index == bucket_index(_needed_end(fast))
        assert stream == fast._stream_id
    assert len(fake.launches) == 24
    assert fast.counters("step").dmas == ref.counters("step").dmas == 24
    assert fast.counters("step").bytes == ref.counters("step").bytes


@pytest.mark.parametrize("why", ["capturing", "uncovered"])
def test_capture_or_an_uncovered_size_takes_the_arenas_own_launch(
        monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    fast, fb = _state()
    ref, rb = _state()
    fake = _with_fake_driver(fast, monkeypatch, covered=0 if why == "uncovered" else None)
    fake.capturing = int(why == "capturing")
    rng_f, rng_r = np.random.default_rng(3), np.random.default_rng(3)
    for k in range(6):
        _step(fast, fb, rng_f, k)
        _step(ref, rb, rng_r, k)
        assert _dest(fb) == _dest(rb), f"step {k}"
    assert fake.launches == []
    assert fast.counters("step").dmas == 6


@pytest.mark.parametrize("call", ["graph launch", "stream capture query"])
def test_a_driver_error_invalidates_the_owner_and_publishes_nothing(
        monkeypatch: pytest.MonkeyPatch, call: str) -> None:
    st, b = _state()
    fake = _with_fake_driver(st, monkeypatch)
    rng = np.random.default_rng(5)
    _step(st, b, rng, 0)
    before = _dest(b)
    if call == "graph launch":
        fake.launch_rc = 719
    else:
        fake.capture_rc = 900
    st.begin()
    st.set_count(b["temps"], 3)
    st.set_count(b["lens"], 4)
    with pytest.raises(PublicationEnqueueError, match="call reset"):
        st.publish("step")
    assert f"{call} failed with driver error" in (st.invalidated or "")
    assert not st.is_published("step")
    assert st.counters("step").dmas == 1
    assert _dest(b) == before
    st.reset()
    fake.launch_rc = fake.capture_rc = 0
    _step(st, b, rng, 2)
    assert len(fake.launches) == 2


class FakeEvents:
    def __init__(self) -> None:
        self.recorded: list[tuple[int, int]] = []
        self.synchronized: list[int] = []
        self.query_rc = 0
        self.record_rc = 0
        self.sync_rc = 0
        self.record_fn = RECORD(self._record)
        self.query_fn = EVENT(lambda ev: self.query_rc)
        self.sync_fn = EVENT(self._sync)

    def _record(self, event: int | None, stream: int | None) -> int:
        self.recorded.append((event or 0, stream or 0))
        return self.record_rc

    def _sync(self, event: int | None) -> int:
        self.synchronized.append(event or 0)
        return self.sync_rc

    def bind(self, events: tuple[int, ...]) -> Any:
        return core_native.bind_events(  # type: ignore[union-attr]
            events, _address(self.record_fn), _address(self.query_fn),
            _address(self.sync_fn), None)


def test_slot_events_record_and_wait_through_the_driver() -> None:
    native = core_native
    fake = FakeEvents()
    cap = fake.bind((0x11, 0x22))
    native.event_record(cap, 1, 0xABC)
    assert fake.recorded == [(0x22, 0xABC)]
    assert native.event_wait(cap, 0) == 0  # completed: one query, no wait
    assert fake.synchronized == []
    fake.query_rc = 600  # CUDA_ERROR_NOT_READY: wait for it
    assert native.event_wait(cap, 1) > 0
    assert fake.synchronized == [0x22]


@pytest.mark.parametrize("case", ["query", "sync", "record", "slot"])
def test_slot_event_errors_name_the_call(case: str) -> None:
    native = core_native
    fake = FakeEvents()
    cap = fake.bind((0x11,))
    if case == "query":
        fake.query_rc = 1
        with pytest.raises(RuntimeError, match="cuEventQuery failed with CUDA error 1"):
            native.event_wait(cap, 0)
    elif case == "sync":
        fake.query_rc, fake.sync_rc = 600, 700
        with pytest.raises(RuntimeError, match="cuEventSynchronize failed with CUDA error 700"):
            native.event_wait(cap, 0)
    elif case == "record":
        fake.record_rc = 400
        with pytest.raises(RuntimeError, match="cuEventRecord failed with CUDA error 400"):
            native.event_record(cap, 0, 1)
    else:
        with pytest.raises(IndexError, match=r"slot 1 is not in \[0, 1\)"):
            native.event_record(cap, 1, 1)
        assert fake.recorded == []


def test_a_pack_only_binding_writes_the_python_paths_header_and_bytes() -> None:
    """Without graphs (the CPU) the compiled binding only packs: ``publish_packed`` writes
    the header and staging exactly as ``PackedGroup``'s Python path and hands the launch
    back (a negative DMA size), also zeroing the range rows of an earlier publication."""
    st, b = _state()
    packed = st._slot_groups[0][st.plan("step").index].packed
    assert packed.compiled and not packed.launches_graphs
    rng = np.random.default_rng(9)
    for buf in b.values():
        raw = buf.source(0).view(-1).view(torch.uint8)
        raw.copy_(torch.from_numpy(rng.integers(0, 256, raw.numel(), dtype=np.uint8)))
    members = {m.name: i for i, m in enumerate(packed.members)}
    row = 512 * 4
    steps = [
        ({"temps": 5, "ids": 300, "lens": 2}, [(3 * row, 3 * row + 64), (9 * row, 9 * row + 8)]),
        ({"temps": 1, "ids": None, "lens": 64, "table": 7}, []),
        ({"ids": 16384}, [(0, 4)]),
    ]
    for counts_by_name, byte_ranges in steps:
        counts: list[int | None] = [None] * len(packed.members)
        for name, n in counts_by_name.items():
            counts[members[name]] = n
        ranges = [(members["table"], a, z - a) for a, z in byte_ranges]
        end_python = packed._pack_python(counts, ranges)
        header, arena = packed.header.copy(), packed.arena.host.clone()
        packed.header[: len(packed.members), 1] = -1  # a member row left unwritten shows
        end = kernels_native.publish_packed(packed._binding, counts, ranges, 0)
        assert end == -end_python
        assert np.array_equal(packed.header, header)
        assert torch.equal(packed.arena.host, arena)


def test_bind_rejects_null_driver_addresses() -> None:
    with pytest.raises(ValueError, match="null driver function address"):
        core_native.bind_events((1,), 0, 1, 1, None)
    with pytest.raises(ValueError, match="null driver function address"):
        kernels_native.bind_publish(0, 0, 0, 0, (), (), 0, 0, (), 0, 1, None, (), (), 0)


def test_cuda_states_use_the_compiled_launcher(device: str) -> None:
    """On the GPU every packed slot launches through the compiled path and the slots'
    events are driver events, so the GPU suites exercise them."""
    if device != "cuda":
        pytest.skip("the CPU state has no graphs or events; the fakes above cover the C path")
    st, b = _state("cuda")
    ref, rb = _state("cpu")
    assert st._slot_events is not None
    assert all(rec.packed.launches_graphs for recs in st._slot_groups for rec in recs
               if rec.packed is not None)
    rng, rng_r = np.random.default_rng(11), np.random.default_rng(11)
    for k in range(12):
        _step(st, b, rng, k)
        _step(ref, rb, rng_r, k)
        torch.cuda.synchronize()
        got = {n: buf.gpu.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
               for n, buf in b.items()}
        assert got == _dest(rb), f"step {k}"
    assert st.counters("step").dmas == 12
