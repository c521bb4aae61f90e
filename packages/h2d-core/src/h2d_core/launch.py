"""Compiled launches: a packed publication's pack + graph launch, and the slots' events.

On the H200 host, ``PackedArena.publish`` through Python and ctypes costs ~6-7 µs for a
graph launch the driver does in ~1-2 µs, and ``torch.cuda.Event.record`` /
``synchronize`` ~1 µs each (docs/benchmarks.md, "cuda call costs"). The state has already
checked what those layers check (owner thread, epoch, device, the epoch's stream), so the
step's common path calls the driver from C (``_core_native.c``) with handles fixed at
bind time:

* :func:`bind_publish`: per slot and packed group, the arena's graph handles and packing
  plan; ``publish_packed`` then packs and launches in one call. A stream under capture or
  a size without a graph hands back to ``PackedArena.publish`` (the capturable launch).
* :class:`SlotEvents`: one driver event per slot, recorded by ``finish`` and waited on by
  ``begin`` (a completed event costs one ``cuEventQuery``).

Without the compiled helpers (``H2D_NATIVE=0``, no compiler) or ``libcuda``, the state
uses ``PackedArena.publish`` and torch events: the same work, slower.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from h2d_kernels import DeviceDriver, device_driver

from .packing import PackedSlot, bind_native, native


def bind_publish(slot: PackedSlot) -> Any | None:
    """The compiled launcher of one slot's packed arena, or None (the arena's publish)."""
    if native is None:
        return None
    table = slot.arena.graph_launch_table()  # type: ignore[attr-defined]
    return None if table is None else bind_native(slot, table)


def _destroy(driver: DeviceDriver, events: tuple[int, ...]) -> None:
    for event in events:
        driver.event_destroy(event)


class SlotEvents:
    """One completion event per slot, recorded and waited on through the driver.

    Create with :meth:`create` (None when the compiled helpers or ``libcuda`` are missing).
    The events are destroyed when this object is collected; work already recorded on them
    completes normally.
    """

    def __init__(self, driver: DeviceDriver, events: tuple[int, ...]) -> None:
        assert native is not None
        self._bound = native.bind_events(
            events, driver.address("event_record"), driver.address("event_query"),
            driver.address("event_synchronize"), None)
        self._finalizer = weakref.finalize(self, _destroy, driver, events)

    @classmethod
    def create(cls, num_slots: int, device: torch.device) -> SlotEvents | None:
        """Events for ``num_slots`` slots in ``device``'s context, or None (torch events)."""
        driver = device_driver()
        if native is None or driver is None:
            return None
        with torch.cuda.device(device):  # the device's context is current: bind allocated there
            events: list[int] = []
            try:
                for _ in range(num_slots):
                    events.append(driver.event_create())
            except BaseException:
                _destroy(driver, tuple(events))
                raise
        return cls(driver, tuple(events))

    def record(self, slot: int, stream: int) -> None:
        """Record ``slot``'s event on the raw stream handle ``stream``."""
        native.event_record(self._bound, slot, stream)  # type: ignore[union-attr]

    def wait(self, slot: int) -> int:
        """Block until ``slot``'s last recorded event completed; return the host ns waited
        (0 when it already had). An event never recorded counts as completed."""
        return int(native.event_wait(self._bound, slot))  # type: ignore[union-attr]
