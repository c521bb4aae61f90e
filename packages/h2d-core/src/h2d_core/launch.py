"""The slots' completion events through the driver.

On the H200 host ``torch.cuda.Event.record`` / ``synchronize`` cost ~1 µs each
(docs/benchmarks.md, "CUDA call costs"). The state has already checked what those layers
check (owner thread, epoch, device, the epoch's stream), so ``begin`` and ``finish`` wait
on and record one driver event per slot from Cython (``_events.pyx``, required at import
like the rest of the compiled core), with the driver's entry points fixed at bind time (a
completed event costs one query).

Torch events remain for one real reason: the driver library itself may not load
(:func:`h2d_kernels.device_driver` is None when ctypes cannot load the runtime's library
or find one of its entry points; with a CUDA build of torch, which needs ``libcuda``
itself, that should not happen, but the HIP table is untested). :meth:`SlotEvents.create`
then returns None and the state records and waits on ``torch.cuda.Event`` objects
instead: the same work, slower. A CPU state has no events at all.

The packed publication's own launch (header, packing, DMA, scatter or graph launch)
belongs to :class:`h2d_kernels.PackedGroup`.
"""

from __future__ import annotations

import weakref

import torch

from h2d_kernels import DeviceDriver, device_driver

from .native import native


def _destroy(driver: DeviceDriver, events: tuple[int, ...]) -> None:
    for event in events:
        driver.event_destroy(event)


class SlotEvents:
    """One completion event per slot, recorded and waited on through the driver.

    Create with :meth:`create` (None when the driver library cannot be loaded).
    The events are destroyed when this object is collected; work already recorded on them
    completes normally.
    """

    def __init__(self, driver: DeviceDriver, events: tuple[int, ...]) -> None:
        #: the raw event handles, by slot: each slot's publication graphs record theirs
        #: (h2d_kernels.PackedGroup.bind's completion_event); they live as long as this
        self.handles = events
        self._bound = native.bind_events(
            events, driver.address("event_record"), driver.address("event_query"),
            driver.address("event_synchronize"), driver.symbols)  # names its errors
        self._finalizer = weakref.finalize(self, _destroy, driver, events)

    @classmethod
    def create(cls, num_slots: int, device: torch.device) -> SlotEvents | None:
        """Events for ``num_slots`` slots in ``device``'s context, or None when the driver
        library cannot be loaded (the state then uses torch events)."""
        driver = device_driver()
        if driver is None:
            return None
        with torch.cuda.device(device):
            # The runtime creates the device's primary context lazily; a synchronize makes it
            # current even when nothing was allocated there yet (the driver's event calls
            # need it: without one, cuEventCreate fails with CUDA_ERROR_INVALID_CONTEXT).
            torch.cuda.synchronize(device)
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
        native.event_record(self._bound, slot, stream)

    def wait(self, slot: int) -> int:
        """Block until ``slot``'s last recorded event completed; return the host ns waited
        (0 when it already had). An event never recorded counts as completed."""
        return native.event_wait(self._bound, slot)  # an int already: no int() call
