"""Slots and epochs off the step's path: resume and recovery.

Each slot owns its pinned sources, packed arenas and completion event. ``begin()`` waits
until the slot's previous DMAs read its sources, then opens one forward epoch;
``finish()`` records completion and never waits for the GPU (both compiled, in
:class:`~h2d_core.epoch.EpochCore`); PP rotates the slots; late TBO preparation
``resume()``s the epoch. An enqueue failure invalidates the owner until ``reset()``.
"""

from __future__ import annotations

from collections.abc import Callable

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
        self.require_owner()
        self.require_valid()
        if self._epoch_open:
            raise EpochError(f"epoch {self.epoch} is open; resume() follows finish()")
        if not self._resumable:
            raise EpochError("nothing to resume: resume() must follow finish() of this epoch")
        self.require_device()
        if self._guard is not None:  # writable again, but for the groups already published
            self._guard.open_slot(self.current_slot)
            self._guard.seal(self.current_slot, self.groups.published)
        self._epoch_open = True
        self._resumable = False
        # finish() records again unless a graph launch does
        self.completions.graph_recorded = False
        return self.current_slot

    # ------------------------------------------------------------------ recovery
    def on_reset(self, hook: Callable[[], None]) -> None:
        """Bind time: ``hook()`` runs on each :meth:`reset`, for attached state that must
        forget what the GPU holds (a failed enqueue may have left destinations half
        written)."""
        self._reset_hooks.append(hook)

    def reset(self) -> None:
        """Recover an invalidated owner: wait for all enqueued work, then accept work again.

        Storage is never freed or rebound; it is reused only after the device drained.
        """
        self.require_owner()
        if self._cuda:
            torch.cuda.synchronize(self.device)
        self._invalid = None
        self._epoch_open = False
        self._resumable = False
        self.groups.clear()
        self.completions.forget()
        if self._guard is not None:
            self._guard.close_all(self.num_slots)
        # A failed enqueue may have left destinations half written: whatever tracked their
        # contents must forget it, so the next publication sends them whole.
        for hook in self._reset_hooks:
            hook()
