"""``guard_sources`` (a debug mode): which slots' numpy views producers may write.

A state made with ``guard_sources=True`` holds one :class:`SourceGuard`: every slot's
numpy views are read-only but the open epoch's, and a group's become read-only again once
it is published (until a deliberate second publication reopens it), so a write through a
kept reference raises instead of landing in a source a DMA may still read. A normal state
holds none: the mode costs nothing when off.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any


class SourceGuard:
    """Sets the writeable flag of the guarded buffers' numpy views (``GuardedH2DBuffer``)."""

    def __init__(self, buffers: Mapping[str, Any], groups: Mapping[str, Sequence[Any]]) -> None:
        self._buffers = buffers  # the state's live dicts: buffers declared later count too
        self._groups = groups

    def open_slot(self, slot: int, writeable: bool = True) -> None:
        """``slot``'s epoch opened (every view writable) or closed (``writeable=False``)."""
        for buf in self._buffers.values():
            buf._set_writeable(slot, writeable)

    def close_all(self, num_slots: int) -> None:
        """No epoch is open: every slot read-only (bind, reset)."""
        for slot in range(num_slots):
            self.open_slot(slot, False)

    def seal(self, slot: int, groups: Iterable[str], writeable: bool = False) -> None:
        """``groups`` were published from ``slot`` (read-only) or reopened (writable)."""
        for g in groups:
            for buf in self._groups.get(g, ()):
                buf._set_writeable(slot, writeable)
