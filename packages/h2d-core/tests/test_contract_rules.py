"""Lifetime and publication rules whose loss no other suite would notice.

1. A reasoned second publication acquires its sources before the producer rewrites them.
2. Packing adds no synchronization event: one completion record per ``finish()``, none
   per ``publish()``.
3. A single active member uses a direct copy: it neither borrows the packed arena nor
   releases an earlier packed read.
4. Late TBO preparation (``resume()``) records the completion again, so the next
   ``begin()`` on the slot waits for the resumed upload.
5. The direct backend sends a changed block table as one bulk copy.

On CUDA the ordering rules run against a consumer stream held back by ``torch.cuda._sleep``.
A CPU state has no streams or events (its copies are synchronous), so on the CPU those
rules drive the state's CUDA control path against :class:`SimulatedGpu`: a consumer
stream that runs nothing until an event wait reaches it. A wait or record missing from
the state then leaves a packed DMA queued while the host rewrites its source, exactly the
hazard the GPU shows, but without depending on how long anything takes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest
import torch

import h2d_core._epoch_native as epoch_module  # the compiled begin/finish read these getters
from h2d_core import (
    H2DRunnerState,
    StageResult,
    StreamMismatchError,
    block_table_state,
    h2d_producer,
)
from h2d_kernels import PackedArena, copy_counts

#: GPU cycles of torch.cuda._sleep queued ahead of a publication (tens of ms on an H200):
#: the host reaches its next step long before the DMA behind it runs.
HOLD_CYCLES = 100_000_000

#: what every event-related call logs (SimulatedGpu, RealGpu.watch_events)
RECORDS = {"slot.record", "event.record"}
WAITS = {"slot.wait", "event.query", "event.synchronize"}


class Reading:
    """A consumer read of a destination enqueued on the consumer stream (its value once the
    stream ran it)."""

    def __init__(self, value: torch.Tensor | None = None) -> None:
        self.value = value

    def tolist(self) -> list[Any]:
        assert self.value is not None, "the consumer read never ran"
        return self.value.tolist()


# ---------------------------------------------------------------------------- GPU stand-ins

class _SimStream:
    """A consumer stream that never runs ahead of the host: work runs only when a wait
    (or the final drain) reaches it."""

    device = torch.device("cpu")

    def __init__(self, cuda_stream: int = 0x5151) -> None:
        self.cuda_stream = cuda_stream
        self.ops: list[Callable[[], None]] = []
        self.done = 0

    @property
    def enqueued(self) -> int:
        return len(self.ops)

    def run_until(self, mark: int) -> bool:
        """Run queued work up to ``mark``; whether anything had to run (a real wait)."""
        ran = self.done < mark
        while self.done < mark:
            self.ops[self.done]()
            self.done += 1
        return ran

    def drain(self) -> None:
        self.run_until(len(self.ops))


class SimulatedGpu:
    """Drives a CPU state through its CUDA branches (events, streams, source waits).

    Packed publications (the arena's DMA + scatter) and consumer reads are queued on a
    :class:`_SimStream`; slot events, the acquire event and any ``torch.cuda.Event`` are
    marks in that queue, and waiting on one runs the queue up to it. Direct copies stay
    synchronous, so the tests below never let one race a queued packed write of the same
    destination.
    """

    def __init__(self, state: H2DRunnerState, monkeypatch: pytest.MonkeyPatch,
                 events: str = "driver") -> None:
        self.state = state
        self.stream = _SimStream()
        #: a second stream (never the consumer's), and whichever of the two is current
        self.side = _SimStream(0x6262)
        self.current = self.stream
        self.log: list[str] = []
        sim = self

        class Event:
            """Stands in for torch.cuda.Event (the fallback slot events, the acquire event
            and any event a change to the state would add)."""

            def __init__(self, *args: object, **kwargs: object) -> None:
                sim.log.append("event.new")
                self.mark: int | None = None

            def record(self, stream: object = None) -> None:
                sim.log.append("event.record")
                self.mark = sim.stream.enqueued

            def query(self) -> bool:
                sim.log.append("event.query")
                return self.mark is None or sim.stream.done >= self.mark

            def synchronize(self) -> None:
                sim.log.append("event.synchronize")
                if self.mark is not None:
                    sim.stream.run_until(self.mark)

            def wait(self, stream: object = None) -> None:
                sim.log.append("event.wait")

        class SlotEvents:
            """Stands in for h2d_core.launch.SlotEvents (driver events per slot)."""

            def __init__(self, n: int) -> None:
                self.marks: list[int | None] = [None] * n

            def record(self, slot: int, stream: int) -> None:
                sim.log.append("slot.record")
                assert stream == sim.stream.cuda_stream, "recorded off the consumer stream"
                self.marks[slot] = sim.stream.enqueued

            def wait(self, slot: int) -> int:
                sim.log.append("slot.wait")
                mark = self.marks[slot]
                return int(mark is not None and sim.stream.run_until(mark))

        mp = monkeypatch
        mp.setattr(torch.cuda, "Event", Event)
        mp.setattr(torch.cuda, "current_stream", lambda *a, **k: self.current)
        mp.setattr(torch.cuda, "synchronize", self._device_synchronize)
        mp.setattr(epoch_module, "get_device", lambda: state._device_index)
        mp.setattr(epoch_module, "current_raw_stream", lambda index: self.current.cuda_stream)
        mp.setattr(torch._C, "_cuda_getDevice", lambda: state.device.index, raising=False)
        mp.setattr(torch._C, "_cuda_getCurrentRawStream",
                   lambda index: self.current.cuda_stream, raising=False)
        mp.setattr(state, "_cuda", True)
        mp.setattr(state, "_acquire_event", Event(), raising=False)  # CUDA states bind one
        if events == "driver":
            state.completions.attach(SlotEvents(state.num_slots), [])
        else:
            state.completions.attach(None, [Event() for _ in range(state.num_slots)])
        # a CPU arena's compiled publication copies at once (the reference scatter without
        # first consumers); rebound without it, every packed publication goes through the
        # arena's own _publish, which the simulated stream queues
        mp.setattr(PackedArena, "cpu_publish_binding", property(lambda arena: None))
        for records in state._slot_groups:
            for rec in records:
                if rec.packed is not None:
                    arena = rec.packed.arena
                    rec.packed._binding = rec.packed._bind_native()
                    mp.setattr(arena, "_publish", self._queued(arena._publish))
        self.log.clear()

    def _device_synchronize(self, *args: object, **kwargs: object) -> None:
        self.log.append("device.synchronize")
        self.stream.drain()

    def _queued(self, publish: Callable[[int, Any], None]) -> Callable[[int, Any], None]:
        def queued(dma_bytes: int, stream: Any) -> None:
            # the DMA reads the host arena when the stream reaches it, not now
            self.stream.ops.append(lambda: publish(dma_bytes, stream))
        return queued

    @property
    def pending(self) -> int:
        return self.stream.enqueued - self.stream.done

    def hold(self) -> None:
        """Nothing to do: the simulated stream runs nothing until a wait reaches it."""

    def read(self, tensor: torch.Tensor) -> Reading:
        reading = Reading()

        def run() -> None:
            reading.value = tensor.clone()

        self.stream.ops.append(run)
        return reading

    def sync(self) -> None:
        self.stream.drain()

    @contextmanager
    def side_stream(self) -> Iterator[_SimStream]:
        """Make the second stream current (as ``torch.cuda.stream(side)`` would)."""
        self.current = self.side
        try:
            yield self.side
        finally:
            self.current = self.stream


class RealGpu:
    """The CUDA device: a stream held back by torch.cuda._sleep, real events."""

    def __init__(self, state: H2DRunnerState, monkeypatch: pytest.MonkeyPatch,
                 events: str = "driver") -> None:
        self.state = state
        self.monkeypatch = monkeypatch
        self.log: list[str] = []
        assert state.completions.driver_events is not None, "CUDA states bind driver slot events"
        if events == "torch":  # what a state without the compiled helpers or libcuda uses
            state.completions.attach(None, [torch.cuda.Event() for _ in range(state.num_slots)])

    def watch_events(self) -> None:
        """Log every event record, wait and synchronization made through Python."""
        mp, log = self.monkeypatch, self.log

        def logged(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                log.append(name)
                return fn(*args, **kwargs)
            return wrapper

        slot_events = self.state.completions.driver_events
        if slot_events is not None:
            mp.setattr(slot_events, "record", logged("slot.record", slot_events.record))
            mp.setattr(slot_events, "wait", logged("slot.wait", slot_events.wait))
        for attr in ("record", "query", "synchronize", "wait"):
            mp.setattr(torch.cuda.Event, attr,
                       logged(f"event.{attr}", getattr(torch.cuda.Event, attr)))
        for attr in ("synchronize", "wait_event", "wait_stream"):
            mp.setattr(torch.cuda.Stream, attr,
                       logged(f"stream.{attr}", getattr(torch.cuda.Stream, attr)))
        mp.setattr(torch.cuda, "synchronize", logged("device.synchronize", torch.cuda.synchronize))

    def hold(self) -> None:
        torch.cuda._sleep(HOLD_CYCLES)

    def read(self, tensor: torch.Tensor) -> Reading:
        return Reading(tensor.clone())  # enqueued on the consumer (current) stream

    def sync(self) -> None:
        torch.cuda.synchronize()

    @contextmanager
    def side_stream(self) -> Iterator[torch.cuda.Stream]:
        side = torch.cuda.Stream(self.state.device)
        with torch.cuda.stream(side):
            yield side


Gpu = SimulatedGpu | RealGpu


def gpu_for(device: str, state: H2DRunnerState, monkeypatch: pytest.MonkeyPatch,
            events: str = "driver") -> Gpu:
    if device == "cuda":
        return RealGpu(state, monkeypatch, events)
    return SimulatedGpu(state, monkeypatch, events)


def _graph_recorded(st: H2DRunnerState) -> bool:
    """Whether the epoch's last enqueue was a publication graph that recorded the slot's
    driver event (finish() then records nothing; see test_completion_launch.py)."""
    return bool(st.completions.graph_recorded and st.completions.driver_events is not None)


def _values(base: int, n: int) -> list[int]:
    return (base + np.arange(n)).tolist()


@pytest.mark.parametrize("scatter", ["reference", "triton"])
def test_the_simulated_gpu_queues_every_cpu_publication(
        h: Any, monkeypatch: pytest.MonkeyPatch, scatter: str) -> None:
    """The rules below hold only if a simulated packed publication waits in the queue: with
    the reference scatter a CPU arena's compiled publication would copy at once (as on a
    CUDA machine, where the CPU cases take it), so the simulation must route it too."""
    if scatter == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton scatter on CPU tensors needs TRITON_INTERPRET=1")
    setup = h.build_state("cpu", scatter=scatter)
    st = setup.state
    gpu = SimulatedGpu(st, monkeypatch)
    ids = setup.buffers["input_ids"]
    before = ids.gpu.clone()
    st.begin()
    ids.np[:] = _values(100, ids.np.shape[0])
    st.set_count(ids, ids.np.shape[0])
    st.set_count(setup.buffers["positions"], 1)
    st.publish("decode")
    assert gpu.pending and torch.equal(ids.gpu, before), "published before the queue ran"
    gpu.sync()
    assert ids.gpu.tolist() == _values(100, ids.np.shape[0])
    st.finish()


# ---------------------------------------------------------------------------- rule 1

@pytest.mark.parametrize("spelling", ["reopen", "h2d_reason"])
def test_reasoned_second_publication_waits_for_the_first_dma(
        device: str, h: Any, monkeypatch: pytest.MonkeyPatch, spelling: str) -> None:
    """The first publication's DMA still queued: the deliberate second one must wait for it
    before the producer rewrites the (in-arena) sources, so each publication's consumer
    sees its own values."""
    setup = h.build_state(device)
    st = setup.state
    gpu = gpu_for(device, st, monkeypatch)
    ids, pos = setup.buffers["input_ids"], setup.buffers["positions"]

    class Producer:
        h2d_state = st

        @h2d_producer("token_inputs", "mha_decode")
        def produce(self, base: int) -> None:
            ids.np[:] = _values(base, 65)
            pos.np[:] = _values(10 * base, 64)
            st.set_count(ids, 65)
            st.set_count(pos, 64)

    producer = Producer()
    st.begin()
    producer.produce(100)
    gpu.hold()
    st.publish("decode")
    first = gpu.read(ids.gpu), gpu.read(pos.gpu)
    if spelling == "reopen":
        st.reopen("decode", "test: rewrite after the first publication")
        producer.produce(200)
    else:
        producer.produce(200, h2d_reason="test: rewrite after the first publication")
    st.publish("decode")
    second = gpu.read(ids.gpu), gpu.read(pos.gpu)
    st.finish()
    gpu.sync()
    assert first[0].tolist() == _values(100, 65), "the first DMA read the rewritten source"
    assert first[1].tolist() == _values(1000, 64), "the first DMA read the rewritten source"
    assert second[0].tolist() == _values(200, 65)
    assert second[1].tolist() == _values(2000, 64)
    assert st.counters("decode").dmas == 2


def test_publication_off_the_epoch_stream_is_refused_and_a_retry_works(
        device: str, h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The epoch's consumer stream is the one current at begin(): a packed publication or a
    direct copy with another stream current, or given another stream, enqueues nothing
    (no DMA, no copy, no count, destinations untouched) and a retry on the right stream
    publishes the same sources."""
    setup = h.build_state(device)
    st = setup.state
    gpu = gpu_for(device, st, monkeypatch)
    ids, pos = setup.buffers["input_ids"], setup.buffers["positions"]
    before = {name: h.dest_bytes(b) for name, b in setup.buffers.items()}
    st.begin()
    ids.np[:8] = _values(100, 8)
    pos.np[:8] = _values(1000, 8)
    st.set_count(ids, 8)
    st.set_count(pos, 8)
    with gpu.side_stream() as side:
        with pytest.raises(StreamMismatchError, match="consumer stream"):
            st.publish("decode")
        with pytest.raises(StreamMismatchError, match="consumer stream"):
            ids.copy_to_gpu(8)
    with pytest.raises(StreamMismatchError, match="consumer stream"):
        st.publish("decode", stream=side)
    counters = st.counters("decode")
    assert (counters.publications, counters.dmas, counters.direct_copies) == (0, 0, 0)
    assert st.counters("token_inputs").direct_copies == 0
    gpu.sync()
    for name, b in setup.buffers.items():
        assert torch.equal(h.dest_bytes(b), before[name]), f"{name} written off-stream"
    assert ids.np[:8].tolist() == _values(100, 8), "a refused publication touched the source"
    st.publish("decode")
    st.finish()
    gpu.sync()
    assert ids.gpu[:8].tolist() == _values(100, 8)
    assert pos.gpu[:8].tolist() == _values(1000, 8)
    assert st.counters("decode").dmas == 1


# ---------------------------------------------------------------------------- rule 2

def _delta(log: list[str], start: int) -> list[str]:
    return log[start:]


@pytest.mark.parametrize("events", ["driver", "torch"])
def test_packing_adds_no_synchronization_event(
        device: str, h: Any, monkeypatch: pytest.MonkeyPatch, events: str) -> None:
    """Across slots and steps: publish() (packed, combined or a lone member's direct copy)
    records, waits on and creates no event; finish() records exactly one; begin() only
    waits."""
    setup = h.build_state(device, num_slots=2, combined=False)
    st = setup.state
    gpu = gpu_for(device, st, monkeypatch, events)
    if isinstance(gpu, RealGpu):
        gpu.watch_events()
    log = gpu.log
    rng = np.random.default_rng(20)
    b = setup.buffers
    steps: list[dict[str, int | None]] = [
        {"input_ids": 65, "top_ks": 16, "positions": 64, "block_tables": 7},  # both packed
        {"input_ids": 9, "positions": 3, "context_lens": 0},                  # one direct
        {"temperatures": 16, "cu_seqlens_q": 17, "slot_mapping": 64, "kv_indptr": 17},
    ]
    for step in range(6):
        counts = steps[step % len(steps)]
        mark = len(log)
        st.begin()
        begun = _delta(log, mark)
        assert set(begun) <= WAITS, f"step {step}: begin() did {begun}"
        for name, buf in b.items():
            h.fill_random(buf, rng)
            st.set_count(buf, counts.get(name))
        for group in ("token_inputs", "mha_decode"):
            mark = len(log)
            st.publish(group)
            assert _delta(log, mark) == [], f"step {step}: publish({group!r}) did {log[mark:]}"
        mark = len(log)
        by_graph = _graph_recorded(st)
        st.finish()
        finished = _delta(log, mark)
        if by_graph:  # the last publication's graph recorded the slot's event itself
            assert finished == [], f"step {step}: finish() did {finished} after the graph's"
        else:
            assert len(finished) == 1 and finished[0] in RECORDS, (
                f"step {step}: finish() did {finished}, not one completion record")
    gpu.sync()
    # per cycle of the three steps: two packed groups, then one (a lone member), then two
    assert st.counters("token_inputs").dmas + st.counters("mha_decode").dmas == 10


@pytest.mark.gpu
def test_packed_publication_issues_no_event_call_in_the_profiler_trace(h: Any) -> None:
    """What Python wrappers cannot see (the compiled launch, the driver DMA): the runtime
    and driver calls a packed publication makes include no event record, event wait or
    synchronization."""
    from torch.profiler import ProfilerActivity, profile, record_function

    setup = h.build_state("cuda")
    st = setup.state
    packed = st._slot_groups[0][0].packed
    # the torch DMA path's pinned copy records the host allocator's own event; the driver
    # DMA (the default wherever libcuda loads) records none
    assert packed.arena.dma == "driver", packed.arena.dma
    rng = np.random.default_rng(21)
    for _ in range(3):  # warm up: compilation and graph capture happen before the trace
        st.begin()
        for buf in setup.buffers.values():
            h.fill_random(buf, rng)
            st.set_count(buf, buf.spec.capacity)
        st.publish("decode")
        st.finish()
    torch.cuda.synchronize()
    st.begin()
    with (profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
          record_function("publication-window")):
            for buf in setup.buffers.values():
                st.set_count(buf, buf.spec.capacity)
            st.publish("decode")
    st.finish()
    torch.cuda.synchronize()
    events = list(prof.events())
    window = next(e for e in events if e.name == "publication-window")
    inside = [e.name for e in events if e.device_type.name == "CPU"
              and window.time_range.start <= e.time_range.start <= window.time_range.end]
    # a positive control: the trace does see the publication's own DMA, so an empty list
    # below means "no event call", not "nothing traced". On the device, not in the host
    # window: the compiled launch calls the driver's entry point, which the trace does not
    # list, and a GPU shared with other processes may start the DMA after the window.
    assert copy_counts(prof)["H2D"] == 1, [e.name for e in events]
    syncing = [n for n in inside if any(k in n.lower() for k in (
        "eventrecord", "waitevent", "synchronize", "eventcreate"))]
    assert syncing == [], inside


# ---------------------------------------------------------------------------- rule 3

@pytest.mark.parametrize("member", ["temperatures", "block_tables", "positions", "range"])
def test_single_active_member_does_not_borrow_the_packed_arena(
        device: str, h: Any, monkeypatch: pytest.MonkeyPatch, member: str) -> None:
    """One active member (a count, or one byte range), the rest None: a direct copy of that
    member only. The arena's pinned header and payload, and its device copy, stay as they
    were; no DMA or scatter runs or is counted."""
    rng = np.random.default_rng(30)
    if member == "range":
        st = H2DRunnerState(device, scatter=h.scatter_mode(device))
        lens = st.buffer("context_lens", (16,), torch.int32, group="g")
        table = st.buffer("block_tables", (16, 24), torch.int32, group="g", unit="rows",
                          max_ranges=4)
        st.bind()
        buffers = {"context_lens": lens, "block_tables": table}
        for buf in buffers.values():
            buf.gpu.view(torch.uint8).fill_(h.POISON)
        group, target = "g", table
    else:
        setup = h.build_state(device)
        st, buffers, group, target = setup.state, setup.buffers, "decode", setup.buffers[member]
    packed = st._slot_groups[0][0].packed
    st.begin()
    for buf in buffers.values():
        h.fill_random(buf, rng)  # in-place members write into the arena's payload here
    before = {n: h.dest_bytes(b) for n, b in buffers.items()}
    if member == "range":
        st.set_ranges(target, [(96, 288)])  # rows 1..2 of a 96-byte row
    else:
        st.set_count(target, 3)
    host_before = packed.arena.host.clone()
    device_before = packed.arena.device_arena.cpu().clone()
    calls = h.spy_dma(monkeypatch, packed)
    c0 = dict(st.counters(group).as_dict())
    st.publish(group)
    st.finish()
    h.sync(device)
    assert calls == [], "a lone member went through the packed arena"
    assert torch.equal(packed.arena.host, host_before), "the arena's pinned bytes changed"
    assert torch.equal(packed.arena.device_arena.cpu(), device_before), "a DMA ran"
    c = st.counters(group).as_dict()
    assert (c["dmas"], c["scatters"]) == (c0["dmas"], c0["scatters"])
    assert (c["direct_copies"] - c0["direct_copies"],
            c["direct_fallbacks"] - c0["direct_fallbacks"]) == (1, 1)
    lo, hi = (96, 288) if member == "range" else (0, 3 * target.spec.unit_bytes)
    for name, buf in buffers.items():
        expected = before[name].clone()
        if buf is target:
            expected[lo:hi] = buf.cpu.reshape(-1).view(torch.uint8)[lo:hi]
        assert torch.equal(h.dest_bytes(buf), expected), name


def test_single_active_member_keeps_the_earlier_packed_read_guarded(
        device: str, h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slot 0's packed DMA still queued; a lone member's direct copy on slot 1 must leave
    slot 0's completion guard in place, so begin() on slot 0 waits before producers rewrite
    the sources that DMA has yet to read."""
    setup = h.build_state(device, num_slots=2)
    st = setup.state
    gpu = gpu_for(device, st, monkeypatch)
    ids, pos, temps = (setup.buffers[n] for n in ("input_ids", "positions", "temperatures"))
    assert st.begin() == 0
    ids.np[:] = _values(100, 65)
    pos.np[:] = _values(1000, 64)
    st.set_count(ids, 65)
    st.set_count(pos, 64)
    gpu.hold()
    st.publish("decode")
    st.finish()
    assert st.begin() == 1
    temps.np[:] = np.arange(16, dtype=np.float32)
    st.set_count(temps, 16)
    st.publish("decode")  # the lone member: a direct copy
    assert st.counters("decode").direct_fallbacks == 1
    assert st.completions.was_recorded(0), "slot 0's packed read lost its completion guard"
    if isinstance(gpu, SimulatedGpu):
        assert gpu.pending, "the direct copy waited for slot 0's packed DMA"
    st.finish()
    assert st.begin() == 0
    ids.np[:] = -1  # the next step's producers
    pos.np[:] = -1
    st.finish()
    gpu.sync()
    assert ids.gpu.tolist() == _values(100, 65), "slot 0's DMA read the next step's source"
    assert pos.gpu.tolist() == _values(1000, 64), "slot 0's DMA read the next step's source"
    assert temps.gpu.tolist() == list(range(16))


# ---------------------------------------------------------------------------- rule 4

@pytest.mark.parametrize("events", ["driver", "torch"])
def test_resumed_epoch_records_completion_again_and_begin_waits_for_it(
        device: str, h: Any, monkeypatch: pytest.MonkeyPatch, events: str) -> None:
    """Late TBO preparation: resume() reopens the finished epoch, its upload is queued
    behind a busy stream, finish() records the completion again, and the next begin() on
    the slot waits for that upload before the producers rewrite its sources."""
    setup = h.build_state(device, combined=False)
    st = setup.state
    gpu = gpu_for(device, st, monkeypatch, events)
    if isinstance(gpu, RealGpu):
        gpu.watch_events()
    b = setup.buffers
    ids, cu, pos, slots = (b[n] for n in ("input_ids", "cu_seqlens_q", "positions",
                                          "slot_mapping"))
    st.begin()
    ids.np[:] = _values(1, 65)
    cu.np[:] = _values(2, 17)
    st.set_count(ids, 65)
    st.set_count(cu, 17)
    st.publish("token_inputs")
    st.finish()
    epoch = st.epoch
    assert st.resume() == 0 and st.epoch == epoch
    gpu.hold()
    pos.np[:] = _values(500, 64)
    slots.np[:] = _values(700, 64)
    st.set_count(pos, 64)
    st.set_count(slots, 64)
    st.publish("mha_decode")
    mark = len(gpu.log)
    by_graph = _graph_recorded(st)  # (the resumed upload's graph recorded it again)
    st.finish()
    finished = gpu.log[mark:]
    assert (finished == [] if by_graph else len(finished) == 1 and finished[0] in RECORDS), (
        f"finish() after resume() did {finished}, not a second completion record")
    assert st.completions.was_recorded(0)
    assert st.begin() == 0  # must wait for the resumed upload, not just the first one
    pos.np[:] = -1
    slots.np[:] = -1
    st.finish()
    gpu.sync()
    assert pos.gpu.tolist() == _values(500, 64), "the resumed DMA read the next step's source"
    assert slots.gpu.tolist() == _values(700, 64), "the resumed DMA read the next step's source"
    assert ids.gpu.tolist() == _values(1, 65)


# ---------------------------------------------------------------------------- rule 5

def _count_copies_into(monkeypatch: pytest.MonkeyPatch, target: torch.Tensor) -> list[int]:
    """Record (its byte count) every Tensor.copy_ that writes into ``target``'s storage."""
    lo = target.data_ptr()
    hi = lo + target.numel() * target.element_size()
    seen: list[int] = []
    real = torch.Tensor.copy_

    def copy_(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> Any:
        if lo <= self.data_ptr() < hi:
            seen.append(self.numel() * self.element_size())
        return real(self, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return seen


def test_direct_backend_sends_a_changed_block_table_in_one_copy(
        device: str, h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Block-table state on the direct backend: a step where several rows changed sends
    the table with exactly one copy (the other member its own one)."""
    st = H2DRunnerState(device, backend="direct")
    lens = st.buffer("context_lens", (32,), torch.int32, group="mha_decode")
    bt = st.buffer("block_tables", (32, 16), torch.int32, group="mha_decode", unit="rows",
                   max_ranges=8)
    st.bind()
    bt.gpu.fill_(-7)
    bts = block_table_state(bt, pool_limit=10_000)
    copies = _count_copies_into(monkeypatch, bt.gpu)
    rng = np.random.default_rng(50)
    rows = [rng.integers(0, 10_000, int(rng.integers(1, 16))) for _ in range(20)]
    for step in range(4):
        if step:
            for r in rng.choice(len(rows), 5, replace=False):  # several rows change
                rows[r] = rng.integers(0, 10_000, int(rng.integers(1, 16)))
        st.begin()
        bts.prepare(rows)
        lens.np[:20] = [len(r) for r in rows]
        st.set_count(lens, 20)
        assert bts.stage(20) == StageResult.WHOLE
        copies.clear()
        d0 = st.counters("mha_decode").direct_copies
        st.publish("mha_decode")
        st.finish()
        assert len(copies) == 1, f"step {step}: the table took {len(copies)} copies"
        assert st.counters("mha_decode").direct_copies - d0 == 2
        h.sync(device)
        assert np.array_equal(bt.gpu[:20].cpu().numpy(), bts.snapshot.storage[:20]), step


def test_direct_backend_sends_several_ranges_in_one_copy(
        device: str, h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """set_ranges on the direct backend: three changed spans travel as one copy from the
    first range's start to the last one's end; bytes outside that span stay untouched."""
    st = H2DRunnerState(device, backend="direct")
    lens = st.buffer("context_lens", (16,), torch.int32, group="g")
    bt = st.buffer("block_tables", (16, 24), torch.int32, group="g", unit="rows",
                   max_ranges=4)
    st.bind()
    bt.gpu.fill_(-7)
    copies = _count_copies_into(monkeypatch, bt.gpu)
    st.begin()
    bt.np[:] = np.arange(16 * 24, dtype=np.int32).reshape(16, 24)
    lens.np[:] = 5
    st.set_count(lens, 16)
    ranges = [(96, 192), (480, 520), (1000, 1200)]
    st.set_ranges(bt, ranges)
    st.publish("g")
    st.finish()
    h.sync(device)
    assert copies == [1200 - 96]
    got = bt.gpu.reshape(-1).view(torch.uint8).cpu()
    src = bt.cpu.reshape(-1).view(torch.uint8)
    assert torch.equal(got[96:1200], src[96:1200])
    assert (got[:96].view(torch.int32) == -7).all() and (got[1200:].view(torch.int32) == -7).all()
