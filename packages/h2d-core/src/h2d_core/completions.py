"""Each slot's completion record: the event a slot's epoch records when it finishes, and
what is known complete without asking the driver.

``begin(slot)`` must not let producers write a slot's pinned sources while a DMA of that
slot's last epoch may still read them; ``finish()`` records the slot's event after the
epoch's last enqueue. :class:`SlotCompletions` owns those events (driver events through
:class:`~h2d_core.launch.SlotEvents`, or torch events when the driver library did not
load; none on a CPU state), the per-slot recorded flags, and the sequence numbers that let
``begin`` skip the driver for a slot already known complete. The epoch
(:class:`~h2d_core.epoch.EpochCore`) holds one and calls it through C.

Compiled by Cython as ``h2d_core._completions_native`` when the package is built
(required).
"""

from __future__ import annotations

import time
from typing import Any

from .errors import EpochError

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op decorators
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]

#: slots whose completion begin() can know without asking the driver (see
#: :meth:`SlotCompletions.wait`); a slot past them is always checked (sound, only slower)
TRACKED_SLOTS = 64
_TRACKED = cython.declare(cython.Py_ssize_t, 64)  # the same, as a C constant


@cython.cclass
class SlotCompletions:
    """The completion events of ``num_slots`` slots and what is known of them.

    Every record (:meth:`record`) draws a sequence number; per tracked slot, the number and
    stream of its last record. Records up to ``_synced_seq`` are complete
    (:meth:`mark_synchronized`, the caller's promise); records on stream ``_done_stream``
    up to ``_done_seq`` are complete (a wait that returned proves every earlier record on
    its stream: one stream runs its work in order)."""

    # C fields: _completions_native.pxd (the epoch reads them through C); the C arrays
    # and sequence numbers start zeroed
    num_slots: int
    driver_events: Any
    torch_events: list[Any]
    checks_skipped: int
    graph_recorded: bool
    _recorded: list[bool]
    _replaced: list[Any]
    _record_seq: int
    _synced_seq: int
    _done_seq: int
    _done_stream: int
    _slot_seq: Any
    _slot_stream: Any

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.driver_events = None
        self.torch_events = []
        self._recorded = [False] * num_slots
        self.checks_skipped = 0
        self.graph_recorded = False
        self._replaced = []

    def attach(self, driver_events: Any, torch_events: list) -> None:
        """Bind time: the slots' events, through the driver (a
        :class:`~h2d_core.launch.SlotEvents`) or, when its library did not load, torch's.

        The publication graphs bound with driver events record their handles at their
        end: events replaced here stay alive as long as this object (destroying them
        under a graph that records them aborts the process)."""
        if self.driver_events is not None and driver_events is not self.driver_events:
            self._replaced.append(self.driver_events)
        self.driver_events = driver_events
        self.torch_events = torch_events

    def was_recorded(self, slot: int) -> bool:
        """Whether ``slot`` has a completion record not yet forgotten (see :meth:`forget`)."""
        return bool(self._recorded[slot])

    @cython.ccall
    @cython.exceptval(-1, check=True)
    def wait(self, s: cython.Py_ssize_t) -> cython.longlong:
        """Block until slot ``s``'s last record completed; return the host ns blocked (0
        when it had completed: querying it is host work like any other, and a slot known
        complete asks the driver nothing)."""
        if not self._recorded[s]:
            return 0
        if self._known_complete(s):
            self.checks_skipped += 1
            return 0
        waited: cython.longlong
        if self.driver_events is not None:
            waited = self.driver_events.wait(s)
        elif self.torch_events[s].query():  # torch events: the driver library did not load
            waited = 0
        else:
            t0 = time.perf_counter_ns()
            self.torch_events[s].synchronize()
            waited = time.perf_counter_ns() - t0 or 1
        self._waited(s)
        return waited

    @cython.ccall
    def record(self, s: cython.Py_ssize_t, stream_id: Any, stream: Any) -> None:
        """Record slot ``s``'s completion on the epoch's stream (``stream_id``, its raw
        handle), unless the epoch's last enqueue was a publication graph that recorded it
        (``graph_recorded``)."""
        if self.graph_recorded and self.driver_events is not None:
            pass  # the graph's own last node recorded the slot's event
        elif self.driver_events is not None:
            self.driver_events.record(s, stream_id)
        else:  # torch events: the driver library did not load
            self.torch_events[s].record(stream)
        self._recorded[s] = True
        self._record_seq += 1
        if s < _TRACKED:
            self._slot_seq[s] = self._record_seq
            self._slot_stream[s] = stream_id

    def mark_synchronized(self) -> None:
        """Every record made so far has completed (the caller's promise)."""
        self._synced_seq = self._record_seq

    def known_complete(self, slot: int) -> bool:
        """Whether waiting on ``slot`` would skip the driver (no record, or one known
        complete)."""
        s: cython.Py_ssize_t = slot
        if not 0 <= s < self.num_slots:
            raise EpochError(f"slot {s} is not in [0, {self.num_slots})")
        return not self._recorded[s] or self._known_complete(s)

    def forget(self) -> None:
        """Recovery, after the device drained: no slot has a record to wait on."""
        self._recorded = [False] * self.num_slots
        self.graph_recorded = False

    @cython.cfunc
    @cython.exceptval(check=False)
    def _known_complete(self, s: cython.Py_ssize_t) -> cython.bint:
        """Slot ``s``'s last record is known complete (it must have one): made before the
        last mark_synchronized(), or on the stream of a completed wait, no later than the
        record that wait saw (that stream ran it first)."""
        if s >= _TRACKED:
            return False
        seq: cython.longlong = self._slot_seq[s]
        return seq <= self._synced_seq or (
            self._slot_stream[s] == self._done_stream and seq <= self._done_seq)

    @cython.cfunc
    @cython.exceptval(check=False)
    def _waited(self, s: cython.Py_ssize_t) -> cython.void:
        """A wait found slot ``s``'s last record complete."""
        if s >= _TRACKED:
            return
        if self._slot_stream[s] != self._done_stream:
            self._done_stream = self._slot_stream[s]  # knowledge of one stream at a time
            self._done_seq = 0
        if self._slot_seq[s] > self._done_seq:
            self._done_seq = self._slot_seq[s]


# This source is compiled by Cython, as ``h2d_core._completions_native``, when the package
# is built; run interpreted, it only hands over to that build (required).
if not cython.compiled:
    from block_tables.native import require_extension

    _compiled = require_extension("h2d_core._completions_native")
    SlotCompletions = _compiled.SlotCompletions  # type: ignore[misc]
