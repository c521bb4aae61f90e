"""Slots and epochs: begin, finish, resume, producer entry and recovery.

Each slot owns its pinned sources, packed arenas and completion event. ``begin()`` waits
until the slot's previous DMAs read its sources, then opens one forward epoch;
``finish()`` records completion and never waits for the GPU; PP rotates the slots; late
TBO preparation ``resume()``s the epoch. An enqueue failure invalidates the owner until
``reset()``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from threading import get_ident
from typing import Any

import numpy as np
import torch

from .errors import DeviceMismatchError, EpochError, ReentryError, UnknownGroupError
from .owner import StateOwner, current_raw_stream, get_device


class SlotLifecycle(StateOwner):
    """The slot and epoch half of :class:`~h2d_core.state.H2DRunnerState`."""

    # ------------------------------------------------------------------ epochs
    def begin(self, slot: int | None = None, *, stream: Any = None) -> int:
        """Start one forward epoch on ``slot`` (default: the next slot, rotating).

        Waits until this slot's previous completion event (its DMAs read the sources),
        then producers may write. The current stream (or ``stream``) becomes the epoch's
        consumer stream: every publication of the epoch must be enqueued on it.
        """
        if get_ident() != self._owner or not self._bound or self._invalid is not None:
            self._check_thread()
            self._check_bound()
            self._check_valid()
        if self._epoch_open:
            raise EpochError(f"epoch {self.epoch} on slot {self.current_slot} is still open; "
                             "call finish() first")
        if slot is None:
            slot = (self.current_slot + 1) % self.num_slots if self.epoch else 0
        else:
            if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
                raise EpochError(f"slot must be an int in [0, {self.num_slots}) or None, got "
                                 f"{type(slot).__name__} {slot!r}")
            slot = int(slot)  # numpy integers from a scheduler's arrays are fine
            if not 0 <= slot < self.num_slots:
                raise EpochError(f"slot {slot} is not in [0, {self.num_slots})")
        if self._cuda:
            if get_device() != self._device_index:  # type: ignore[misc]
                self._check_device()
            if stream is not None:
                s = stream
                if s.device != self.device:
                    raise DeviceMismatchError(
                        f"stream is on {s.device}, the state on {self.device}; begin() on a "
                        "stream of the state's device"
                    )
            elif (self._stream is not None and current_raw_stream(  # type: ignore[misc]
                    self._device_index) == self._stream_id):
                s = self._stream  # the same consumer stream as last epoch: no new object
            else:
                s = torch.cuda.current_stream(self.device)
        if self._event_recorded[slot]:
            # last_source_wait_ns counts only the blocking wait for a pending event: the
            # query of a completed one is host work like any other
            if self._slot_events is not None:
                self.last_source_wait_ns = self._slot_events.wait(slot)
            # torch events: the driver library did not load (h2d_core.launch says when)
            elif self._events[slot].query():
                self.last_source_wait_ns = 0
            else:
                t0 = time.perf_counter_ns()
                self._events[slot].synchronize()
                self.last_source_wait_ns = time.perf_counter_ns() - t0 or 1
        else:
            self.last_source_wait_ns = 0
        self.current_slot = slot
        self.epoch += 1
        if self._cuda:
            self._stream = s
            self._stream_id = s.cuda_stream
        for rec in self._slot_groups[slot]:
            rec.clear_counts()
        self._published.clear()
        self._produced.clear()
        self._on_publish.clear()
        self._epoch_open = True
        self._resumable = False
        return slot

    def finish(self) -> None:
        """Record this slot's completion after the epoch's uploads; never waits for the GPU."""
        if get_ident() != self._owner or self._invalid is not None:
            self._check_thread()
            self._check_valid()
        if not self._epoch_open:
            raise EpochError("finish() without an open epoch: call begin() first")
        if self._cuda:
            if self._slot_events is not None:
                self._slot_events.record(self.current_slot, self._stream_id)
            else:  # torch events: the driver library did not load
                self._events[self.current_slot].record(self._stream)
            self._event_recorded[self.current_slot] = True
        self._epoch_open = False
        self._resumable = True

    def resume(self) -> int:
        """Reopen the epoch just finished (late two-batch-overlap preparation).

        Groups published earlier in the epoch stay published; ``finish()`` records the
        completion again after the late uploads.
        """
        self._check_thread()
        self._check_valid()
        if self._epoch_open:
            raise EpochError(f"epoch {self.epoch} is open; resume() follows finish()")
        if not self._resumable:
            raise EpochError("nothing to resume: resume() must follow finish() of this epoch")
        self._check_device()
        self._epoch_open = True
        self._resumable = False
        return self.current_slot

    # ------------------------------------------------------------------ producers
    def leave_producer_after_error(self, groups: Sequence[str]) -> None:
        """A producer of ``groups`` raised: it may run again (nothing was published)."""
        if not any(g in self._published for g in groups):
            self._produced.difference_update(groups)

    def enter_producer(self, groups: Sequence[str], reason: str | None) -> None:
        """The check ``@h2d_producer`` runs before entering a producer of ``groups``."""
        if self._invalid is not None or not self._epoch_open or get_ident() != self._owner:
            self._check_ready(f"producer of {list(groups)}")
        produced, published, known = self._produced, self._published, self._producer_groups
        if reason is None:
            if len(groups) == 1:
                g = groups[0]
                if g in known and g not in produced and g not in published:
                    produced.add(g)
                    return
            elif (type(groups) is tuple and groups in self._known_group_lists
                    and produced.isdisjoint(groups)
                    and published.isdisjoint(groups)):
                produced.update(groups)
                return
        for g in groups:
            if g not in self._producer_groups:
                raise UnknownGroupError(
                    f"producer declares {g!r}, which is not a producer group with buffers; "
                    + self._unknown_group(g)
                )
        self._known_group_lists.add(tuple(groups))  # every name checked: a fast path next time
        repeated = [g for g in groups if g in self._produced or g in self._published]
        if repeated and reason is None:
            raise ReentryError(
                f"producer of {list(groups)} entered again in epoch {self.epoch} on slot "
                f"{self.current_slot} ({repeated} already produced/published); pass "
                "h2d_reason='...' for a deliberate second publication"
            )
        for g in repeated:
            if g in self._published:
                self.reopen(g, reason or "")
            else:
                self._counters[g].second_publications += 1
        self._produced.update(groups)

    # ------------------------------------------------------------------ recovery
    def reset(self) -> None:
        """Recover an invalidated owner: wait for all enqueued work, then accept work again.

        Storage is never freed or rebound; it is reused only after the device drained.
        """
        self._check_thread()
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._invalid = None
        self._epoch_open = False
        self._resumable = False
        self._published.clear()
        self._produced.clear()
        self._on_publish.clear()
        self._event_recorded = [False] * self.num_slots
        # A failed enqueue may have left destinations half written: whatever tracked their
        # contents must forget it, so the next publication sends them whole.
        for hook in self._reset_hooks:
            hook()
