"""What every part of the runner state shares: its fields, and the checks each call makes.

:class:`~h2d_core.state.H2DRunnerState` is assembled from one class per concern, all on
this base: :mod:`~h2d_core.slot` (slots, epochs, completion events, producer entry,
recovery) and :mod:`~h2d_core.publish` (counts, ranges, packed and direct publication).
The base declares the fields they share and the checks (owner thread, bound, valid,
epoch, device, stream, membership) every entry point runs before changing anything.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .buffer import H2DBuffer
from .config import Backend
from .errors import (
    DeviceMismatchError,
    EpochError,
    MembershipError,
    NotBoundError,
    OwnerInvalidatedError,
    OwnerThreadError,
    StreamMismatchError,
)
from .group import GroupCounters, GroupPlan
from .records import GroupRecord

if TYPE_CHECKING:
    from .launch import SlotEvents

# the raw C getters: torch.cuda.current_device() / current_stream() cost several times more
get_device: Callable[[], int] | None = getattr(torch._C, "_cuda_getDevice", None)
current_raw_stream: Callable[[int], int] | None = getattr(
    torch._C, "_cuda_getCurrentRawStream", None)


class StateOwner:
    """Fields and checks shared by the parts of :class:`~h2d_core.state.H2DRunnerState`."""

    device: torch.device
    backend: Backend
    num_slots: int
    current_slot: int
    epoch: int
    last_source_wait_ns: int
    _cuda: bool
    _device_index: int
    _owner: int
    _bound: bool
    _invalid: str | None
    _buffers: dict[str, H2DBuffer]
    _producer_groups: dict[str, list[H2DBuffer]]
    _combined: dict[str, tuple[str, ...]]
    _plans: dict[str, GroupPlan]
    #: publish(name) -> (record index, names it publishes, members copied directly when it
    #: is a producer group covered by a combined one, counters)
    _routes: dict[str, tuple[int, frozenset[str], tuple[H2DBuffer, ...], GroupCounters]]
    #: per slot, one record per publication group (``GroupPlan.index``)
    _slot_groups: list[list[GroupRecord]]
    _counters: dict[str, GroupCounters]
    _events: list[Any]
    _slot_events: SlotEvents | None
    _event_recorded: list[bool]
    _acquire_event: Any
    _epoch_open: bool
    _resumable: bool
    _stream: Any
    _stream_id: int
    _published: set[str]
    _produced: set[str]
    _known_group_lists: set[tuple[str, ...]]
    _on_publish: dict[str, list[tuple[H2DBuffer, Callable[[], None], bool]]]
    _reset_hooks: list[Callable[[], None]]

    if TYPE_CHECKING:  # provided by the parts, called across them
        def reopen(self, group: str, reason: str) -> None: ...

    # ------------------------------------------------------------------ state
    @property
    def bound(self) -> bool:
        return self._bound

    @property
    def invalidated(self) -> str | None:
        """Why the owner refuses work (None while valid)."""
        return self._invalid

    @property
    def epoch_open(self) -> bool:
        return self._epoch_open

    def _unknown_group(self, group: str) -> str:
        known = sorted(set(self._producer_groups) | set(self._combined))
        return f"unknown group {group!r}; declared groups are {known}"

    # ------------------------------------------------------------------ checks
    def _check_thread(self) -> None:
        if threading.get_ident() != self._owner:
            raise OwnerThreadError(
                "this H2DRunnerState belongs to another thread; call it from the thread that "
                "created it"
            )

    def _check_bound(self) -> None:
        if not self._bound:
            raise NotBoundError("call bind() after declaring buffers and before using the state")

    def _check_valid(self) -> None:
        if self._invalid is not None:
            raise OwnerInvalidatedError(
                f"the H2D owner was invalidated by an earlier enqueue failure ({self._invalid}); "
                "call reset() before further work"
            )

    def _check_ready(self, what: str) -> None:
        """Owner thread, bound, valid, inside an epoch."""
        if threading.get_ident() != self._owner:
            self._check_thread()
        if not self._bound:
            self._check_bound()
        if self._invalid is not None:
            self._check_valid()
        if not self._epoch_open:
            raise EpochError(f"{what} outside an epoch: call begin() (or resume()) first")

    def _check_device(self) -> None:
        # the raw C getter: torch.cuda.current_device() costs several times more per call
        if self._cuda and torch._C._cuda_getDevice() != self.device.index:
            raise DeviceMismatchError(
                f"current device is cuda:{torch.cuda.current_device()} but this state owns "
                f"{self.device}; switch with torch.cuda.device({self.device.index})"
            )

    def _check_stream(self, stream: Any) -> Any:
        """Check the publication stream is the epoch's; return what to enqueue on (None:
        the current stream, which is then the epoch's)."""
        if not self._cuda:
            return None
        raw = (torch._C._cuda_getCurrentRawStream(self.device.index) if stream is None
               else stream.cuda_stream)
        if raw != self._stream_id:
            raise StreamMismatchError(
                f"publication on stream {raw:#x} but the epoch's consumer stream is "
                f"{self._stream_id:#x}; publish on the stream current at begin()"
            )
        return stream

    def _check_member(self, buffer: H2DBuffer) -> None:
        if not isinstance(buffer, H2DBuffer) or self._buffers.get(buffer.name) is not buffer:
            raise MembershipError(f"{buffer!r} is not a buffer of this state")
        self._check_bound()
