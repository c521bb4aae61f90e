"""One launch per step: the publication graph records the slot's completion, so
``finish()`` enqueues nothing after it, and ``begin()`` asks the driver nothing for a slot
known complete.

On the CPU the state's CUDA control path runs against :class:`SimulatedGpu` (see
test_contract_rules.py). A packed group's compiled helper is rebound to launch through a
fake driver (the ctypes stand-ins of test_packed_group.py): each "graph launch" queues the
bucket's DMA + scatter on the simulated stream and then the slot event's record, as the
captured graph's event record node does. The rules:

1. ``finish()`` records nothing when the epoch's last enqueue was such a launch.
2. It records when anything else came after (a direct copy, a publication that did not
   launch the graph, a reopen's acquire, a resumed epoch), or when the state runs on
   torch events (the graphs record the driver events only).
3. ``begin()`` skips the driver when the slot's last record is known complete
   (``mark_synchronized()``, or a completed wait on the same stream that saw a later
   record); it waits otherwise.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
from test_contract_rules import RECORDS, SimulatedGpu

from h2d_core import H2DRunnerState
from h2d_kernels import GraphLaunchTable, PackedGroup
from h2d_kernels import _packed_native as _native
from h2d_kernels.graphs import bucket_sizes

LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
CAPTURING = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
EXEC_BASE = 0x1000  # fake graph exec handles: EXEC_BASE + bucket index


class GraphLaunches:
    """Rebinds every packed group of a simulated state to launch "graphs" through ctypes
    stand-ins of the driver: a launch queues the bucket's DMA + scatter on the simulated
    stream, then the slot event's record (the graph's last node)."""

    def __init__(self, gpu: SimulatedGpu, monkeypatch: pytest.MonkeyPatch,
                 records: bool = True) -> None:
        self.gpu = gpu
        self.records = records  # whether the graphs carry the slot event's record
        self.capturing = 0  # what the capture query answers
        self._keep: list[Any] = []  # the ctypes callbacks must outlive the bindings
        for slot, records in enumerate(gpu.state._slot_groups):
            for rec in records:
                if rec.packed is not None:
                    self._rebind(rec.packed, slot, monkeypatch)

    def _rebind(self, group: PackedGroup, slot: int, mp: pytest.MonkeyPatch) -> None:
        arena, gpu = group.arena, self.gpu
        sizes = bucket_sizes(arena.header_bytes, arena.total_bytes)
        queued = arena._publish  # SimulatedGpu's: runs when the stream reaches it

        def launch(graph_exec: int | None, stream: int | None) -> int:
            gpu.log.append("graph.launch")
            queued(sizes[(graph_exec or 0) - EXEC_BASE], None)
            events = gpu.state.completions.driver_events
            # driver events only (a torch-events state: the graphs record nothing it reads)
            if self.records and events is not None and hasattr(events, "marks"):
                events.marks[slot] = gpu.stream.enqueued
            return 0

        def capturing(stream: int | None, status: Any) -> int:
            status[0] = self.capturing
            return 0

        fns = LAUNCH(launch), CAPTURING(capturing)
        self._keep.append(fns)
        execs = tuple(EXEC_BASE + i if i in sizes else 0 for i in range(max(sizes) + 1))
        table = GraphLaunchTable(execs, int(ctypes.cast(fns[0], ctypes.c_void_p).value or 0),
                                 int(ctypes.cast(fns[1], ctypes.c_void_p).value or 0))
        mp.setattr(arena, "graph_launch_table", lambda: table)
        group._binding = group._bind_native()
        assert group.launches_graphs
        # what a CUDA arena bound with an event reports (False: the driver lacked the record)
        group._records_completion = self.records
        _native.set_records(group._binding, self.records)


def _simulated(h: Any, monkeypatch: pytest.MonkeyPatch, *, events: str = "driver",
               combined: bool = True, num_slots: int = 1, records: bool = True
               ) -> tuple[H2DRunnerState, dict[str, Any], SimulatedGpu, GraphLaunches]:
    setup = h.build_state("cpu", combined=combined, num_slots=num_slots)
    gpu = SimulatedGpu(setup.state, monkeypatch, events)
    return setup.state, setup.buffers, gpu, GraphLaunches(gpu, monkeypatch, records)


def _produce(st: H2DRunnerState, bufs: dict[str, Any], base: int,
             names: tuple[str, ...] = ("input_ids", "positions")) -> None:
    for name in names:
        b = bufs[name]
        b.np[:] = base + np.arange(b.np.shape[0])
        st.set_count(b, b.spec.capacity)


def _values(bufs: dict[str, Any], name: str, base: int) -> list[int]:
    return (base + np.arange(bufs[name].np.shape[0])).tolist()


# ---------------------------------------------------------------------------- rule 1

def test_finish_records_nothing_after_the_recording_graph_and_begin_still_waits(
        h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graph's own record is the slot's completion: finish() adds none, and the next
    begin() on the slot waits for it (the DMA reads the first values, not the rewrite)."""
    st, bufs, gpu, _ = _simulated(h, monkeypatch)
    reads = []
    for base in (100, 200):
        st.begin()
        _produce(st, bufs, base)
        st.publish("decode")
        reads.append(gpu.read(bufs["input_ids"].gpu))
        st.finish()
    gpu.sync()
    assert reads[0].tolist() == _values(bufs, "input_ids", 100), "the DMA read the rewrite"
    assert reads[1].tolist() == _values(bufs, "input_ids", 200)
    assert gpu.log.count("graph.launch") == 2
    assert not RECORDS & set(gpu.log), gpu.log  # one launch a step, no record of its own
    assert gpu.log.count("slot.wait") == 1  # the second begin() waited for the graph's


# ---------------------------------------------------------------------------- rule 2

@pytest.mark.parametrize("last", ["direct copy", "captured", "reopen", "resume"])
def test_finish_records_when_the_graph_was_not_the_last_enqueue(
        h: Any, monkeypatch: pytest.MonkeyPatch, last: str) -> None:
    st, bufs, gpu, launches = _simulated(h, monkeypatch, combined=False)
    st.begin()
    if last == "captured":  # the helper hands the publication back: no graph, no record
        launches.capturing = 1
    _produce(st, bufs, 100, ("slot_mapping", "positions"))
    st.publish("mha_decode")
    read = gpu.read(bufs["positions"].gpu)
    if last == "direct copy":  # one active member: a direct copy, after the graph
        _produce(st, bufs, 7, ("input_ids",))
        st.publish("token_inputs")
    elif last == "reopen":  # its acquire is an enqueue after the graph
        st.reopen("mha_decode", "test: rewrite after the publication")
    elif last == "resume":  # late preparation reopens the epoch: finish() records again
        st.finish()
        assert not RECORDS & set(gpu.log)
        st.resume()
    st.finish()
    assert gpu.log.count("slot.record") == 1, gpu.log
    assert gpu.log.count("graph.launch") == (last != "captured")
    st.begin()  # waits for the record finish() made
    bufs["positions"].np[:] = -1  # rewriting the source is safe now
    st.finish()
    gpu.sync()
    if last != "reopen":  # (reopen acquired the sources: the DMA had run)
        assert read.tolist() == _values(bufs, "positions", 100)


def test_a_direct_copy_before_the_graph_needs_no_record(
        h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stream order: the graph's record follows the earlier direct copy too."""
    st, bufs, gpu, _ = _simulated(h, monkeypatch, combined=False)
    st.begin()
    _produce(st, bufs, 7, ("input_ids",))
    st.publish("token_inputs")  # one active member: a direct copy
    _produce(st, bufs, 100, ("slot_mapping", "positions"))
    st.publish("mha_decode")
    st.finish()
    assert gpu.log.count("graph.launch") == 1 and not RECORDS & set(gpu.log), gpu.log


def test_graphs_without_the_record_leave_it_to_finish(
        h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver without cuEventRecordWithFlags: graphs launch, finish() records, and the
    next begin() still waits for the DMA."""
    st, bufs, gpu, _ = _simulated(h, monkeypatch, records=False)
    st.begin()
    _produce(st, bufs, 100)
    st.publish("decode")
    read = gpu.read(bufs["input_ids"].gpu)
    st.finish()
    assert gpu.log.count("graph.launch") == 1 and gpu.log.count("slot.record") == 1
    st.begin()
    bufs["input_ids"].np[:] = -1
    st.finish()
    gpu.sync()
    assert read.tolist() == _values(bufs, "input_ids", 100)


def test_torch_events_are_recorded_by_finish(h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The graphs record the driver events; a state on torch events records its own."""
    st, bufs, gpu, _ = _simulated(h, monkeypatch, events="torch")
    st.begin()
    _produce(st, bufs, 100)
    st.publish("decode")
    st.finish()
    assert gpu.log.count("graph.launch") == 1 and gpu.log.count("event.record") == 1


# ---------------------------------------------------------------------------- rule 3

class LoggedEvents:
    """Slot events that log what begin() and finish() ask of the driver."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []

    def record(self, slot: int, stream: int) -> None:
        self.log.append(("record", slot, stream))

    def wait(self, slot: int) -> int:
        self.log.append(("wait", slot))
        return 0

    def waits(self) -> list[int]:
        return [e[1] for e in self.log if e[0] == "wait"]


def _events_only(h: Any, monkeypatch: pytest.MonkeyPatch, num_slots: int = 1
                 ) -> tuple[H2DRunnerState, SimulatedGpu, LoggedEvents]:
    setup = h.build_state("cpu", num_slots=num_slots)
    gpu = SimulatedGpu(setup.state, monkeypatch)
    events = LoggedEvents()
    setup.state.completions.attach(events, [])
    return setup.state, gpu, events


def test_begin_waits_unless_the_slot_is_known_complete(
        h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    st, _, events = _events_only(h, monkeypatch)
    st.begin()  # never recorded: nothing to ask
    st.finish()
    assert events.waits() == [] and st.source_checks_skipped == 0
    assert not st.slot_known_complete(0)
    st.begin()  # recorded, nothing known: the driver is asked
    st.finish()
    assert events.waits() == [0]
    st.mark_synchronized()  # the caller's promise: every record so far completed
    assert st.slot_known_complete(0)
    st.begin()
    assert events.waits() == [0] and st.source_checks_skipped == 1
    assert st.last_source_wait_ns == 0
    st.finish()  # a new record, after the promise
    assert not st.slot_known_complete(0)
    st.begin()
    assert events.waits() == [0, 0] and st.source_checks_skipped == 1
    st.mark_synchronized()  # made inside an epoch: its record comes later
    st.finish()
    st.begin()
    assert events.waits() == [0, 0, 0]
    st.finish()


def test_a_completed_wait_proves_earlier_records_on_its_stream_only(
        h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    st, gpu, events = _events_only(h, monkeypatch, num_slots=2)
    for same_stream in (True, False):
        st.reset()  # no records
        if same_stream:
            st.begin(0)
        else:
            st.begin(0, stream=gpu.side)  # slot 0's record goes to another stream
        st.finish()
        st.begin(1)
        st.finish()
        st.begin(1)  # waits for slot 1's record, made after slot 0's
        assert events.waits()[-1] == 1
        st.finish()
        before = len(events.waits())
        st.begin(0)
        st.finish()
        asked = len(events.waits()) > before
        assert asked == (not same_stream), (same_stream, events.log)


def test_mark_synchronized_belongs_to_the_owner_thread(
        h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from h2d_core import OwnerThreadError

    st, _, _ = _events_only(h, monkeypatch)
    errors: list[BaseException] = []
    t = threading.Thread(target=lambda: _catch(st.mark_synchronized, errors))
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], OwnerThreadError)


def _catch(fn: Any, errors: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as exc:  # handed to the test's thread
        errors.append(exc)


def test_replaced_driver_events_stay_alive() -> None:
    """The publication graphs record the slot events bound first: replacing them (the
    torch-event fallback, a test's simulated driver) must not destroy them under the
    graphs (a destroyed event recorded by a graph aborts the process)."""
    import weakref

    from h2d_core.completions import SlotCompletions

    class Events:  # stands in for launch.SlotEvents: its finalizer destroys the events
        pass

    completions = SlotCompletions(2)
    first = Events()
    alive = weakref.ref(first)
    completions.attach(first, [])
    completions.attach(None, [object(), object()])
    del first
    assert alive() is not None, "replaced driver events were released"
    assert completions.driver_events is None and len(completions.torch_events) == 2
