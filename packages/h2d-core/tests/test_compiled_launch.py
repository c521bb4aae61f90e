"""The compiled publication (h2d_kernels.PackedGroup through the state) and slot events.

On the CPU the driver is replaced by ctypes callbacks standing in for ``cuGraphLaunch``,
``cuStreamIsCapturing`` and the event calls. The fake ``cuGraphLaunch`` runs the arena's
own CPU publication of the launched bucket's size, as the captured graph would on the
GPU, so destinations show whether the compiled path packed the right bytes and chose the
right graph. The GPU suites run the same state through the real driver.

The slot events (``h2d_core._events_native``, ``_events.pyx``) are checked on the CPU
through ctypes callbacks too; addresses that are not functions are only ever given to
``bind_events`` calls that must refuse them before calling anything. On CUDA
(``RUN_H2D_GPU_TESTS=1``) the ``gpu`` tests record and wait on real driver events.
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import os
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import numpy as np
import pytest
import torch

import h2d_core.launch
from h2d_core import H2DRunnerState, PublicationEnqueueError
from h2d_core.launch import SlotEvents
from h2d_core.native import native as core_native
from h2d_kernels import GraphLaunchTable
from h2d_kernels.driver import CUDA, HIP, DriverSymbols
from h2d_kernels.graphs import bucket_index, bucket_sizes
from h2d_kernels.native import helper as kernels_native

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


UNIT_BYTES = {"temps": 4, "ids": 4, "lens": 4, "table": 512 * 4}


def _step(st: H2DRunnerState, b: dict[str, Any], rng: np.random.Generator, k: int,
          model: dict[str, bytearray] | None = None) -> None:
    """One epoch of random sources, counts and table ranges, published. ``model`` (the
    destinations' expected bytes) gets what the publication must write: the first
    ``count`` units of each member, the table's ranges, nothing for an omitted member."""
    st.begin()
    src: dict[str, bytes] = {}
    for name in ("temps", "ids", "lens", "table"):
        raw = b[name].cpu.view(-1).view(torch.uint8)
        raw.copy_(torch.from_numpy(rng.integers(0, 256, raw.numel(), dtype=np.uint8)))
        src[name] = raw.numpy().tobytes()
    counts: dict[str, int | None] = {
        "temps": int(rng.integers(0, 65)),
        "ids": int(rng.integers(0, 16385)) if k % 3 else None,
        "lens": int(rng.integers(1, 65)),
    }
    ranges: list[tuple[int, int]] = []
    if k % 2:
        row = 512 * 4
        starts = sorted(rng.choice(64, size=int(rng.integers(1, 6)), replace=False).tolist())
        ranges = [(r * row, r * row + 64) for r in starts]
        st.set_ranges(b["table"], ranges)
    else:
        counts["table"] = int(rng.integers(0, 65))
    for name, n in counts.items():
        st.set_count(b[name], n)
    st.publish("step")
    st.finish()
    if model is not None:
        for name, n in counts.items():
            if n is not None:
                end = n * UNIT_BYTES[name]
                model[name][:end] = src[name][:end]
        for a, z in ranges:
            model["table"][a:z] = src["table"][a:z]


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
    return {n: buf.gpu.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
            for n, buf in b.items()}


def _model(b: dict[str, Any]) -> dict[str, bytearray]:
    """The destinations' bytes now, to be updated by :func:`_step`."""
    return {n: bytearray(d) for n, d in _dest(b).items()}


def _as_bytes(model: dict[str, bytearray]) -> dict[str, bytes]:
    return {n: bytes(d) for n, d in model.items()}


def test_compiled_publish_writes_the_models_bytes_through_the_bucket_graph(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fast, fb = _state()
    ref, rb = _state()  # the same state, published by the arena's own launch
    fake = _with_fake_driver(fast, monkeypatch)
    model = _model(fb)
    rng_f, rng_r = np.random.default_rng(7), np.random.default_rng(7)
    for k in range(24):
        _step(fast, fb, rng_f, k, model)
        _step(ref, rb, rng_r, k)
        assert _dest(fb) == _as_bytes(model) == _dest(rb), f"step {k}"
        index, stream = fake.launches[-1]
        # the graph launched is the smallest one covering the bytes the publication needs
        assert index == bucket_index(_needed_end(fast))
        assert stream == fast._stream_id
    assert len(fake.launches) == 24
    assert fast.counters("step").dmas == ref.counters("step").dmas == 24
    assert fast.counters("step").bytes == ref.counters("step").bytes


def test_a_pack_only_binding_publishes_on_the_cpu_itself(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without graphs (the CPU) the compiled binding packs, then copies and scatters
    itself (the compiled CPU publication); that writes exactly the model's bytes, over
    steps that shrink counts and move ranges (stale range rows must scatter nothing), and
    the DMA ends where the model says."""
    st, b = _state()
    packed = st._slot_groups[0][st.plan("step").index].packed
    assert packed.compiled and not packed.launches_graphs
    ends: list[int] = []
    publish_step = packed.publish_step

    def spy(*args: Any) -> Any:
        recorded = publish_step(*args)
        # a CPU publication records no completion, finish() does
        ends.append(-packed.last_dma_bytes if not recorded else packed.last_dma_bytes)
        return recorded

    monkeypatch.setattr(packed, "publish_step", spy)
    model = _model(b)
    rng = np.random.default_rng(9)
    for k in range(16):
        _step(st, b, rng, k, model)
        assert _dest(b) == _as_bytes(model), f"step {k}"
        # negative: a CPU publication records no completion, finish() does
        assert ends[-1] == -_needed_end(st)
    assert len(ends) == 16


@pytest.mark.parametrize("why", ["capturing", "uncovered"])
def test_capture_or_an_uncovered_size_takes_the_arenas_own_launch(
        monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    fast, fb = _state()
    ref, rb = _state()
    fake = _with_fake_driver(fast, monkeypatch, covered=0 if why == "uncovered" else None)
    fake.capturing = int(why == "capturing")
    model = _model(fb)
    rng_f, rng_r = np.random.default_rng(3), np.random.default_rng(3)
    for k in range(6):
        _step(fast, fb, rng_f, k, model)
        _step(ref, rb, rng_r, k)
        assert _dest(fb) == _as_bytes(model) == _dest(rb), f"step {k}"
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


NOT_READY = 600  # CUDA_ERROR_NOT_READY / hipErrorNotReady: the event's work is pending
NOT_A_FUNCTION = 0x10  # given only to bind_events calls that must refuse before any call
TUPLE_MESSAGE = r"^bind_events\(events tuple, record_fn, query_fn, synchronize_fn, owner\)$"


class FakeEvents:
    """ctypes callbacks standing in for the driver's event record / query / synchronize."""

    def __init__(self) -> None:
        self.recorded: list[tuple[int, int]] = []
        self.queried: list[int] = []
        self.synchronized: list[int] = []
        self.query_rc = 0
        self.record_rc = 0
        self.sync_rc = 0
        self.record_fn = RECORD(self._record)
        self.query_fn = EVENT(self._query)
        self.sync_fn = EVENT(self._sync)

    def _record(self, event: int | None, stream: int | None) -> int:
        self.recorded.append((event or 0, stream or 0))
        return self.record_rc

    def _query(self, event: int | None) -> int:
        self.queried.append(event or 0)
        return self.query_rc

    def _sync(self, event: int | None) -> int:
        self.synchronized.append(event or 0)
        return self.sync_rc

    @property
    def addresses(self) -> tuple[int, int, int]:
        return _address(self.record_fn), _address(self.query_fn), _address(self.sync_fn)

    def bind(self, events: tuple[Any, ...], owner: object = None) -> Any:
        return core_native.bind_events(events, *self.addresses, owner)

    def calls(self) -> int:
        return len(self.recorded) + len(self.queried) + len(self.synchronized)


def test_slot_events_record_and_wait_through_the_driver() -> None:
    native = core_native
    fake = FakeEvents()
    cap = fake.bind((0x11, 0x22))
    assert native.event_record(cap, 1, 0xABC) is None
    assert fake.recorded == [(0x22, 0xABC)]
    assert native.event_wait(cap, 0) == 0  # completed: one query, no wait
    assert fake.queried == [0x11] and fake.synchronized == []
    fake.query_rc = NOT_READY  # pending: wait for it; the ns waited are never 0
    assert native.event_wait(cap, 1) >= 1
    assert fake.queried == [0x11, 0x22] and fake.synchronized == [0x22]
    # a pointer-sized stream handle (more than one digit of a Python int) arrives whole
    native.event_record(cap, 0, 0x7F12_3456_7890)
    assert fake.recorded[-1] == (0x11, 0x7F12_3456_7890)


@pytest.mark.parametrize("symbols", [CUDA, HIP, None], ids=["cuda", "hip", "no-symbols"])
@pytest.mark.parametrize("case", ["query", "sync", "record", "slot"])
def test_slot_event_errors_name_the_call(case: str, symbols: DriverSymbols | None) -> None:
    """A failed driver call is named by the runtime's own entry point (the owner's driver
    symbols: CUDA's or HIP's), or neutrally without them."""
    native = core_native
    fake = FakeEvents()
    cap = fake.bind((0x11,), symbols)

    def named(call: str) -> str:
        if symbols is None:
            return f"^{call} failed with driver error"
        return f"^{getattr(symbols, call)} failed with {symbols.runtime} error"

    if case == "query":
        fake.query_rc = 1
        with pytest.raises(RuntimeError, match=named("event_query") + " 1$"):
            native.event_wait(cap, 0)
        assert fake.synchronized == []
    elif case == "sync":
        fake.query_rc, fake.sync_rc = NOT_READY, 700
        with pytest.raises(RuntimeError, match=named("event_synchronize") + " 700$"):
            native.event_wait(cap, 0)
    elif case == "record":
        fake.record_rc = 400
        with pytest.raises(RuntimeError, match=named("event_record") + " 400$"):
            native.event_record(cap, 0, 1)
    else:
        with pytest.raises(IndexError, match=r"^slot 1 is not in \[0, 1\)$"):
            native.event_record(cap, 1, 1)
        assert fake.calls() == 0


F = NOT_A_FUNCTION
BAD_BINDS: dict[str, tuple[tuple[Any, ...], dict[str, Any], type[BaseException], str]] = {
    "events in a list": (([0x11], F, F, F, None), {}, TypeError, TUPLE_MESSAGE),
    "events in a tuple subclass": ((type("T", (tuple,), {})((0x11,)), F, F, F, None), {},
                                   TypeError, TUPLE_MESSAGE),
    "no events": ((None, F, F, F, None), {}, TypeError, TUPLE_MESSAGE),
    "null record": (((0x11,), 0, F, F, None), {}, ValueError,
                    "^bind_events: null driver function address$"),
    "null query": (((0x11,), F, 0, F, None), {}, ValueError, "null driver function address"),
    "null synchronize": (((0x11,), F, F, 0, None), {}, ValueError,
                         "null driver function address"),
    "a float address": (((0x11,), 1.5, F, F, None), {}, TypeError,
                        "'float' object cannot be interpreted as an integer"),
    "an address over 64 bits": (((0x11,), 2**64, F, F, None), {}, OverflowError,
                                "^int too big to convert$"),
    "a handle not an int": (((0x11, "x"), F, F, F, None), {}, TypeError,
                            "'str' object cannot be interpreted as an integer"),
    "a handle over 64 bits": (((-(2**63) - 1,), F, F, F, None), {}, OverflowError,
                              "^int too big to convert$"),
    # the arguments are checked in order: addresses, then their nullness, then handles
    "a bad address before a null one": (((0x11,), 0, "x", F, None), {}, TypeError,
                                        "cannot be interpreted as an integer"),
    "a null address before a bad handle": ((("x",), 0, F, F, None), {}, ValueError,
                                           "null driver function address"),
    "four arguments": (((0x11,), F, F, F), {}, TypeError, TUPLE_MESSAGE),
    "six arguments": (((0x11,), F, F, F, None, None), {}, TypeError, TUPLE_MESSAGE),
    "owner by keyword": (((0x11,), F, F, F), {"owner": None}, TypeError,
                         r"^h2d_core\._events_native\.bind_events\(\) takes no keyword "),
}


@pytest.mark.parametrize("case", list(BAD_BINDS))
def test_bind_events_refuses_bad_arguments_without_calling_anything(case: str) -> None:
    """Addresses that are not functions reach only calls that must fail in the checks:
    bind_events never calls the driver."""
    args, kwargs, error, match = BAD_BINDS[case]
    with pytest.raises(error, match=match):
        core_native.bind_events(*args, **kwargs)


def test_bind_events_takes_any_int_like_address_and_handle() -> None:
    """Integers are read as PyLong_AsLongLong reads them (``__index__``: numpy integers,
    bools; the full signed 64-bit range); no driver call at bind."""
    class Index:
        def __index__(self) -> int:
            return 0x20

    for events in ((), (2**63 - 1, -(2**63), 0), (np.int64(5), True)):
        assert type(core_native.bind_events(events, F, F, F, None)).__name__ == "PyCapsule"
    core_native.bind_events((0x11,), np.uint64(F), Index(), True, None)


def test_event_calls_refuse_bad_arguments_before_calling_the_driver() -> None:
    native = core_native
    fake = FakeEvents()
    cap = fake.bind((0x11, 0x22))
    refused: list[tuple[Any, type[BaseException], str]] = [
        (lambda: native.event_record(object(), 0, 1), ValueError, "invalid PyCapsule"),
        (lambda: native.event_wait(None, 0), ValueError, "invalid PyCapsule"),
        (lambda: native.event_wait(datetime.datetime_CAPI, 0), ValueError, "incorrect name"),
        (lambda: native.event_record(cap, -1, 1), IndexError, r"^slot -1 is not in \[0, 2\)$"),
        (lambda: native.event_wait(cap, 2), IndexError, r"^slot 2 is not in \[0, 2\)$"),
        (lambda: native.event_wait(cap, 2**70), OverflowError, "ssize_t"),
        (lambda: native.event_wait(cap, 1.0), TypeError, "an integer is required"),
        (lambda: native.event_record(cap, "0", 1), TypeError, "an integer is required"),
        (lambda: native.event_record(cap, 0, "s"), TypeError, "cannot be interpreted"),
        (lambda: native.event_record(cap, 0, 2**64), OverflowError, "int too big to convert"),
        # in the C module's order: the binding, the slot, then the stream
        (lambda: native.event_record(None, "x", "s"), ValueError, "invalid PyCapsule"),
        (lambda: native.event_record(cap, 5, "s"), IndexError, r"slot 5 is not in"),
        (lambda: native.event_record(cap, 0), TypeError,
         r"^event_record\(capsule, slot, stream\)$"),
        (lambda: native.event_record(cap, 0, stream=1), TypeError, "takes no keyword arguments"),
        (lambda: native.event_wait(cap, 0, 1), TypeError, r"^event_wait\(capsule, slot\)$"),
        (lambda: native.event_wait(cap, 0, timeout=1), TypeError, "takes no keyword arguments"),
    ]
    for call, error, match in refused:
        with pytest.raises(error, match=match):
            call()
    assert fake.calls() == 0


def test_a_binding_named_h2d_events_made_elsewhere_still_works() -> None:
    """events_slot knows its own capsules by their name pointer; any other capsule named
    "h2d_events" goes through PyCapsule_GetPointer, as it did in the C module."""
    fake = FakeEvents()
    cap = fake.bind((0x11, 0x22))
    api = ctypes.pythonapi
    api.PyCapsule_GetPointer.restype = ctypes.c_void_p
    api.PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    api.PyCapsule_New.restype = ctypes.py_object
    api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    name = ctypes.create_string_buffer(b"h2d_events")  # the same name at another address
    other = api.PyCapsule_New(api.PyCapsule_GetPointer(cap, b"h2d_events"), name, None)
    core_native.event_record(other, 1, 0x99)
    assert fake.recorded == [(0x22, 0x99)]
    with pytest.raises(IndexError, match=r"slot 2 is not in \[0, 2\)"):
        core_native.event_wait(other, 2)


def test_the_binding_keeps_its_owner_alive_and_releases_it() -> None:
    class Owner:
        pass

    fake = FakeEvents()
    owner = Owner()
    alive = weakref.ref(owner)
    cap = fake.bind((0x11,), owner)
    del owner
    gc.collect()
    assert alive() is not None
    del cap
    gc.collect()
    assert alive() is None
    owner = Owner()
    refs = sys.getrefcount(owner)
    with pytest.raises(TypeError):
        fake.bind((0x11, "x"), owner)  # refused: no reference kept
    assert sys.getrefcount(owner) == refs
    assert fake.calls() == 0


def test_a_pending_wait_releases_the_gil() -> None:
    """While begin() blocks on a pending event, other Python threads run: the driver's
    synchronize is called without the GIL. Here it is libc's usleep(handle µs)."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "usleep"):
        pytest.skip("no usleep in this C library")
    fake = FakeEvents()
    fake.query_rc = NOT_READY
    block_us = 1_500_000  # a wide margin: a loaded CI host may delay the thread
    cap = core_native.bind_events((block_us,), fake.addresses[0], fake.addresses[1],
                                  _address(libc.usleep), None)
    woke: list[float] = []

    def other() -> None:
        time.sleep(0.05)
        woke.append(time.monotonic())  # needs the GIL

    thread = threading.Thread(target=other)
    t0 = time.monotonic()
    thread.start()
    waited = core_native.event_wait(cap, 0)
    thread.join()
    assert waited >= block_us * 1000 * 0.9
    # with the GIL held the thread could only run after the whole wait
    assert woke and woke[0] - t0 < block_us / 1e6 / 2, (woke[0] - t0, waited)


class FakeDeviceDriver:
    """h2d_kernels.DeviceDriver's event part, over FakeEvents."""

    def __init__(self, fake: FakeEvents, fail_after: int | None = None) -> None:
        self.fake = fake
        self.created: list[int] = []
        self.destroyed: list[int] = []
        self.fail_after = fail_after
        self.symbols = HIP  # SlotEvents names its errors by these

    def address(self, name: str) -> int:
        record, query, sync = self.fake.addresses
        return {"event_record": record, "event_query": query, "event_synchronize": sync}[name]

    def event_create(self) -> int:
        if self.fail_after is not None and len(self.created) == self.fail_after:
            raise RuntimeError("event_create failed (injected)")
        self.created.append(0x100 + len(self.created))
        return self.created[-1]

    def event_destroy(self, event: int) -> int:
        self.destroyed.append(event)
        return 0


def test_slot_events_go_through_the_driver_table_and_destroy_their_events() -> None:
    fake = FakeEvents()
    driver = FakeDeviceDriver(fake)
    events = SlotEvents(driver, (0x11, 0x22))  # type: ignore[arg-type]
    events.record(1, 0xABC)
    assert fake.recorded == [(0x22, 0xABC)]
    assert events.wait(0) == 0 and type(events.wait(1)) is int
    fake.query_rc = NOT_READY
    assert events.wait(1) >= 1 and fake.synchronized == [0x22]
    with pytest.raises(IndexError, match=r"slot 2 is not in \[0, 2\)"):
        events.wait(2)
    fake.record_rc = 400  # named by the driver's own symbols (HIP's here)
    with pytest.raises(RuntimeError, match=r"^hipEventRecord failed with hip error 400$"):
        events.record(0, 1)
    fake.record_rc = 0
    assert driver.destroyed == []
    del events
    gc.collect()
    assert driver.destroyed == [0x11, 0x22]


def test_slot_events_create_binds_or_cleans_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """create() makes one event per slot in the device's context; when one cannot be
    made, the ones already made are destroyed."""
    import contextlib

    fake = FakeEvents()
    driver = FakeDeviceDriver(fake)
    monkeypatch.setattr(h2d_core.launch, "device_driver", lambda: driver)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    synced: list[torch.device] = []
    # the primary context is made current before the first event (nothing allocated yet)
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    events = SlotEvents.create(3, torch.device("cuda", 0))
    assert events is not None and driver.created == [0x100, 0x101, 0x102]
    assert synced == [torch.device("cuda", 0)]
    events.record(2, 7)
    assert fake.recorded == [(0x102, 7)]
    failing = FakeDeviceDriver(fake, fail_after=2)
    monkeypatch.setattr(h2d_core.launch, "device_driver", lambda: failing)
    with pytest.raises(RuntimeError, match="injected"):
        SlotEvents.create(3, torch.device("cuda", 0))
    assert failing.destroyed == [0x100, 0x101]


def test_without_the_driver_library_slot_events_are_none(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The one reason a CUDA state keeps torch events: the driver library did not load
    (h2d_kernels.device_driver() is None). create() then touches nothing."""
    monkeypatch.setattr(h2d_core.launch, "device_driver", lambda: None)
    monkeypatch.setattr(torch.cuda, "device", None)  # would fail if create used it
    assert SlotEvents.create(2, torch.device("cuda", 0)) is None


def test_the_event_calls_are_positional_builtins_of_the_extension() -> None:
    """As the C module's were: builtins (no Python frame, positional arguments only)."""
    for name in ("bind_events", "event_record", "event_wait"):
        fn = getattr(core_native, name)
        assert type(fn).__name__ == "builtin_function_or_method"
        assert fn.__module__ == "h2d_core._events_native" and fn.__name__ == name
    assert core_native.__name__ == "h2d_core._events_native"


def test_import_without_the_event_extension_fails_naming_the_fix() -> None:
    """No interpreted events: h2d_core does not import without h2d_core._events_native
    and says how to build it."""
    name = "h2d_core._events_native"
    script = (
        "import importlib.abc, sys\n"
        "class Refuse(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, fullname, path=None, target=None):\n"
        f"        if fullname == {name!r}:\n"
        "            raise ImportError(f'no module named {fullname!r} (refused by the test)')\n"
        "sys.meta_path.insert(0, Refuse())\n"
        "try:\n"
        "    import h2d_core\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__)\n"
        "    print(exc)\n"
        "else:\n"
        "    print('imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ),
                          capture_output=True, text=True, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    kind, message = done.stdout.split("\n", 1)
    assert kind == "NativeBuildError", done.stdout
    assert f"the compiled core {name} is not built" in message
    assert "refused by the test" in message and "tools/build_native.py" in message


@pytest.mark.gpu
def test_cuda_slot_events_wait_for_pending_work() -> None:
    """The real driver: a never-recorded event counts as completed, a recorded one behind
    a busy GPU is waited for (ns > 0), then costs one query (0)."""
    device = torch.device("cuda", torch.cuda.current_device())
    events = SlotEvents.create(2, device)
    assert events is not None  # libcuda loads on a CUDA machine
    stream = torch.cuda.current_stream(device)
    assert events.wait(0) == 0 and events.wait(1) == 0
    torch.cuda._sleep(100_000_000)  # tens of ms of GPU work ahead of the record
    before = torch.cuda.Event()
    before.record(stream)
    events.record(0, stream.cuda_stream)
    assert not before.query(), "the GPU finished the sleep before the test could wait"
    assert events.wait(0) > 0
    assert before.query()  # the wait covered everything enqueued before the record
    assert events.wait(0) == 0
    events.record(1, stream.cuda_stream)
    torch.cuda.synchronize(device)
    assert events.wait(1) == 0
    with pytest.raises(IndexError, match=r"slot 2 is not in \[0, 2\)"):
        events.record(2, stream.cuda_stream)


@pytest.mark.gpu
def test_cuda_state_without_the_driver_library_uses_torch_events(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch-event path a CUDA state keeps for a driver library that does not load:
    same publication, and begin() still waits for the slot's previous DMA."""
    monkeypatch.setattr(h2d_core.launch, "device_driver", lambda: None)
    st, b = _state("cuda")
    ref, rb = _state("cpu")
    assert (st.completions.driver_events is None
            and len(st.completions.torch_events) == st.num_slots)
    model = _model(b)
    rng, rng_r = np.random.default_rng(13), np.random.default_rng(13)
    for k in range(6):
        _step(st, b, rng, k, model)
        _step(ref, rb, rng_r, k)
        torch.cuda.synchronize()
        assert _dest(b) == _as_bytes(model) == _dest(rb), f"step {k}"
    assert st.completions.was_recorded(0)


def test_bind_publish_rejects_null_driver_addresses() -> None:
    with pytest.raises(ValueError, match="null driver function address"):
        kernels_native.bind_publish(0, 0, 0, 0, (), (), 0, 0, (), 0, 1, None, (), (), 0)


def test_cuda_states_use_the_compiled_launcher(device: str) -> None:
    """On the GPU every packed slot launches through the compiled path and the slots'
    events are driver events, so the GPU suites exercise them."""
    if device != "cuda":
        pytest.skip("the CPU state has no graphs or events; the fakes above cover them")
    st, b = _state("cuda")
    ref, rb = _state("cpu")
    assert isinstance(st.completions.driver_events, SlotEvents)
    assert all(rec.packed.launches_graphs for recs in st._slot_groups for rec in recs
               if rec.packed is not None)
    model = _model(b)
    rng, rng_r = np.random.default_rng(11), np.random.default_rng(11)
    for k in range(12):
        _step(st, b, rng, k, model)
        _step(ref, rb, rng_r, k)
        torch.cuda.synchronize()
        assert _dest(b) == _as_bytes(model) == _dest(rb), f"step {k}"
    assert st.counters("step").dmas == 12
