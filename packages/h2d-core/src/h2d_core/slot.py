"""Slots and epochs off the step's path: resume and recovery.

Each slot owns its pinned sources, packed arenas and completion event. ``begin()`` waits
until the slot's previous DMAs read its sources, then opens one forward epoch;
``finish()`` records completion and never waits for the GPU (both compiled, in
:class:`~h2d_core.epoch.EpochCore`); PP rotates the slots; late TBO preparation
``resume()``s the epoch. An enqueue failure invalidates the owner until ``reset()``.
"""

from __future__ import annotations

import torch

from .errors import EpochError
from .owner import StateOwner


class SlotLifecycle(StateOwner):
    """The slot and epoch half of :class:`~h2d_core.state.H2DRunnerState`."""

    # ------------------------------------------------------------------ epochs
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
        if self._guard:  # writable again, but for the groups already published
            self._guard_slot(self.current_slot, True)
            self._guard_published(self._published, False)
        self._epoch_open = True
        self._resumable = False
        self._graph_recorded = False  # finish() records again unless a graph launch does
        return self.current_slot

    def _guard_published(self, groups: frozenset[str] | set[str], writeable: bool) -> None:
        """guard_sources: make the current slot's numpy views of ``groups``' members
        read-only (published) or writable again (reopened)."""
        slot = self.current_slot
        for g in groups:
            for buf in self._producer_groups.get(g, ()):
                buf._set_writeable(slot, writeable)  # type: ignore[attr-defined]

    def _guard_slot(self, slot: int, writeable: bool) -> None:
        """guard_sources: make ``slot``'s numpy views writable (its epoch opened) or
        read-only (closed)."""
        for buf in self._buffers.values():
            buf._set_writeable(slot, writeable)  # type: ignore[attr-defined]

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
        for stagers in self._stagers.values():
            for stager in stagers:
                stager.clear_pending()
        self._event_recorded = [False] * self.num_slots
        if self._guard:
            for slot in range(self.num_slots):
                self._guard_slot(slot, False)
        # A failed enqueue may have left destinations half written: whatever tracked their
        # contents must forget it, so the next publication sends them whole.
        for hook in self._reset_hooks:
            hook()
