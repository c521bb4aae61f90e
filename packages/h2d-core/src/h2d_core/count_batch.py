"""``CountBatch``: one validated call that sets a fixed list of members' counts.

A fused producer (one call writing many members) would otherwise call
:meth:`H2DRunnerState.set_count` once per member, paying the epoch, ownership and
duplicate checks each time. A batch checks them once, validates every count, and only
then stores any: a rejected call changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .buffer import H2DBuffer
from .errors import CountError, DeclarationError, DuplicatePublicationError

if TYPE_CHECKING:
    from .state import H2DRunnerState


class CountBatch:
    """Counts of a fixed member list, set together: ``batch.set(n_a, None, n_c, ...)``.

    Made by :meth:`H2DRunnerState.count_batch` after ``bind()``. Members must be distinct
    buffers of the state without ``max_ranges`` (ranged members go through
    ``set_count``/``set_ranges``). ``None`` omits a member, as in ``set_count``.
    When one group record carries every member, the record stores them all in one compiled
    call; otherwise (or for byte-unit members) each member is checked and stored in turn,
    with the same state and errors.
    """

    def __init__(self, state: H2DRunnerState, buffers: Sequence[H2DBuffer]) -> None:
        state.require_owner()
        state.require_bound()
        seen: set[str] = set()
        for b in buffers:
            state.require_member(b)
            if b.name in seen:
                raise DeclarationError(f"CountBatch: buffer {b.name!r} is listed twice")
            if b.max_ranges:
                raise DeclarationError(
                    f"CountBatch: buffer {b.name!r} is ranged (max_ranges={b.max_ranges}); "
                    "publish it with set_count or set_ranges"
                )
            seen.add(b.name)
        self._state = state
        self._published = state.groups.published  # the epoch's (one live set)
        self.buffers = tuple(buffers)
        self._groups = frozenset(b.group for b in buffers)
        # (buffer, homes, unit bytes, fast capacity): fixed after bind
        self._entries = tuple((b, b.homes, b._unit_bytes, b._fast_capacity) for b in buffers)
        # One record carries every member (the usual case: one fused producer, one group):
        # the record stores all counts in one call (compiled with records.py).
        gis = {gi for b in buffers for gi, _ in b.homes}
        single = len(gis) == 1 and all(len(b.homes) == 1
                                                               for b in buffers)
        self._record = gis.pop() if single else -1
        self._fused = tuple((b.homes[0][1], b._unit_bytes, b._fast_capacity) for b in buffers)

    def set(self, *counts: int | None) -> None:
        """Set every member's count (in member order); all are checked before any is
        stored, exactly as :meth:`H2DRunnerState.set_count` checks one."""
        st = self._state
        st.require_ready("CountBatch.set")
        entries = self._entries
        if len(counts) != len(entries):
            raise CountError(
                f"CountBatch.set got {len(counts)} counts for {len(entries)} buffers "
                f"{[b.name for b in self.buffers]}"
            )
        published = self._published
        if published and not self._groups.isdisjoint(published):
            for b in self.buffers:
                if b.group in published:
                    raise DuplicatePublicationError(
                        f"buffer {b.name!r}: group {b.group!r} was already published in this "
                        "epoch; a second publication needs a reason (reopen())"
                    )
        recs = st.slot_records[st.current_slot]
        if self._record >= 0 and recs[self._record].store_counts(self._fused, counts):
            return
        values: Sequence[int | None] = counts
        for k, ((b, _, _, cap), c) in enumerate(zip(entries, counts, strict=True)):
            if c is not None and not (type(c) is int and 0 <= c <= cap):
                if values is counts:
                    values = list(counts)
                values[k] = b.check_count(c)  # type: ignore[index]  # raises when invalid
        for (_, homes, unit_bytes, _), c in zip(entries, values, strict=True):
            if c is None:
                for gi, i in homes:
                    recs[gi].omit(i)
            else:
                for gi, i in homes:
                    recs[gi].store_count(i, c, unit_bytes)
