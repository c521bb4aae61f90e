"""What every part of the runner state shares: its fields, and the checks each call makes.

:class:`~h2d_core.state.H2DRunnerState` is assembled from one class per concern, all on
this base: :mod:`~h2d_core.slot` (resume and recovery) and :mod:`~h2d_core.publish`
(counts, ranges, a standalone direct copy). The fields a step touches, the epoch's
``begin``, producer entry, ``publish`` and ``finish``, and the checks every entry point
runs (owner thread, bound, valid, epoch, device, stream) are compiled, in
:class:`~h2d_core.epoch.EpochCore`; this base adds the declaration-time fields and the
membership check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .buffer import H2DBuffer
from .config import Backend
from .epoch import EpochCore
from .errors import MembershipError
from .group import GroupPlan
from .records import GroupCounters, GroupRecord

if TYPE_CHECKING:
    from .completions import SlotCompletions
    from .epoch_groups import EpochGroups
    from .errors import UnknownGroupError
    from .source_guard import SourceGuard


class StateOwner(EpochCore):
    """Fields and checks shared by the parts of :class:`~h2d_core.state.H2DRunnerState`."""

    device: torch.device
    backend: Backend
    num_slots: int
    current_slot: int
    epoch: int
    last_source_wait_ns: int
    owner_thread: int
    completions: SlotCompletions
    groups: EpochGroups
    _cuda: bool
    _device_index: int
    _bound: bool
    _invalid: str | None
    _guard: SourceGuard | None
    _buffers: dict[str, H2DBuffer]
    _producer_groups: dict[str, list[H2DBuffer]]
    _combined: dict[str, tuple[str, ...]]
    _plans: dict[str, GroupPlan]
    #: publish(name) -> (record index, names it publishes, members copied directly when it
    #: is a producer group covered by a combined one, counters)
    _routes: dict[str, tuple[int, frozenset[str], tuple[H2DBuffer, ...], GroupCounters,
                             tuple[str, ...]]]
    #: per slot, one record per publication group (``GroupPlan.index``)
    _slot_groups: list[list[GroupRecord]]
    _counters: dict[str, GroupCounters]
    _acquire_event: Any
    _epoch_open: bool
    _resumable: bool
    _stream: Any
    _stream_id: int
    _reset_hooks: list[Callable[[], None]]

    if TYPE_CHECKING:  # compiled in EpochCore (epoch.py)
        def require_ready(self, what: str) -> None: ...
        def require_owner(self) -> None: ...
        def require_bound(self) -> None: ...
        def require_valid(self) -> None: ...
        def require_device(self) -> None: ...
        def require_stream(self, stream: Any) -> None: ...
        def unknown_group(self, group: str) -> UnknownGroupError: ...

    def require_member(self, buffer: H2DBuffer) -> None:
        """Refuse a buffer that is not one of this state's, or any before ``bind()``."""
        if not isinstance(buffer, H2DBuffer) or self._buffers.get(buffer.name) is not buffer:
            raise MembershipError(f"{buffer!r} is not a buffer of this state")
        self.require_bound()
