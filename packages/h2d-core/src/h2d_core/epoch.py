"""The runner state's per-step core, compiled: the epoch's fields, begin, the producer
entry, publish, finish and the checks every entry point runs.

Every step calls :meth:`EpochCore.begin`, one producer entry per producer,
:meth:`EpochCore.publish` per group and :meth:`EpochCore.finish`. Their state (slot,
epoch, the open flag, the owner thread, the slots' recorded events, the epoch's produced
and published groups, the publication routes) lives in C fields of this base of
:class:`~h2d_core.state.H2DRunnerState`, so a step reads no instance dictionary and runs
no interpreter frame for them. The declaration, binding, counts and ranges, direct copies
and recovery stay Python (:mod:`~h2d_core.state`, :mod:`~h2d_core.publish`,
:mod:`~h2d_core.slot`) and read the same fields through their descriptors.

Compiled by Cython as ``h2d_core._epoch_native`` when the package is built (required).
"""

from __future__ import annotations

import time
from threading import get_ident
from typing import Any

import numpy as np
import torch

from .errors import (
    DeviceMismatchError,
    DuplicatePublicationError,
    EpochError,
    H2DError,
    MembershipError,
    NotBoundError,
    OwnerInvalidatedError,
    OwnerThreadError,
    PublicationEnqueueError,
    ReentryError,
    StreamMismatchError,
    UnknownGroupError,
)

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op decorators
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]

if cython.compiled:
    # the calling thread's id as a C integer: threading.get_ident() makes a new int per call
    from cython.cimports.cpython.pythread import PyThread_get_thread_ident
else:  # interpreted, this module only hands over to its build (see the end)
    PyThread_get_thread_ident = get_ident

# the raw C getters: torch.cuda.current_device() / current_stream() cost several times more
get_device: Any = getattr(torch._C, "_cuda_getDevice", None)
current_raw_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_profiler_enabled: Any = torch._C._autograd._profiler_enabled

#: slots whose completion begin() can know without asking the driver (see begin); a slot
#: past them is always checked (sound, only slower)
TRACKED_SLOTS = 64
_TRACKED = cython.declare(cython.Py_ssize_t, 64)  # the same, as a C constant



# set.update / set.isdisjoint over a tuple make a tuple iterator per call (48 bytes): a
# compiled index loop over the tuple makes none
@cython.cfunc
def _add_all(into: set, names: tuple) -> None:
    for g in names:
        into.add(g)


@cython.cfunc
def _discard_all(names_set: set, names: tuple) -> None:
    """Empty ``names_set`` of ``names`` one by one: set.clear() frees a table grown past
    its inline one, so the next epoch's adds would allocate it again."""
    if not names_set:
        return
    for g in names:
        names_set.discard(g)
    if names_set:  # a name outside ``names`` (none is expected): the whole set
        names_set.clear()


@cython.cfunc
def _disjoint(names_set: set, names: tuple) -> cython.bint:
    for g in names:  # noqa: SIM110 - a C loop when compiled (all() makes a generator)
        if g in names_set:
            return False
    return True


@cython.cclass
class EpochCore:
    """The fields a step touches and the calls that open, enter and close its epoch.

    Subclassed by :class:`~h2d_core.owner.StateOwner`; see
    :class:`~h2d_core.state.H2DRunnerState` for the life of a state."""

    device = cython.declare(object, visibility="public")
    num_slots = cython.declare(cython.Py_ssize_t, visibility="public")
    current_slot = cython.declare(cython.Py_ssize_t, visibility="public")
    epoch = cython.declare(cython.longlong, visibility="public")
    #: host ns the last begin() blocked on its slot's previous DMA (source reuse); 0 when
    #: that DMA had completed (checking it is then ordinary host work)
    last_source_wait_ns = cython.declare(cython.longlong, visibility="public")
    # the owner thread's id: as created (the ``_owner`` property) and as a C integer, which
    # the entry points compare with the caller's without making an int
    _owner_id = cython.declare(object)
    _owner_c = cython.declare(cython.ulong)
    _bound = cython.declare(cython.bint, visibility="public")
    _invalid = cython.declare(object, visibility="public")
    _epoch_open = cython.declare(cython.bint, visibility="public")
    _resumable = cython.declare(cython.bint, visibility="public")
    _cuda = cython.declare(cython.bint, visibility="public")
    _device_index = cython.declare(cython.int, visibility="public")
    _stream = cython.declare(object, visibility="public")
    _stream_id = cython.declare(object, visibility="public")
    _events = cython.declare(list, visibility="public")
    _slot_events = cython.declare(object, visibility="public")
    _event_recorded = cython.declare(list, visibility="public")
    _slot_groups = cython.declare(list, visibility="public")
    _producer_groups = cython.declare(dict, visibility="public")
    _counters = cython.declare(dict, visibility="public")
    _published = cython.declare(set, visibility="public")
    _produced = cython.declare(set, visibility="public")
    # producer group lists already checked by enter_producer (the multi-group fast path)
    _known_group_lists = cython.declare(set, visibility="public")
    _on_publish = cython.declare(dict, visibility="public")
    #: producer group -> its block tables' TableStagers: told after each publication of
    #: the group (they commit what it carried), cleared at begin (registered at build)
    _stagers = cython.declare(dict, visibility="public")
    #: publish(name) -> (record index, names it publishes, members copied directly when it
    #: is a producer group covered by a combined one, counters): one lookup per call
    _routes = cython.declare(dict, visibility="public")
    _all_names = cython.declare(tuple, visibility="public")
    #: guard_sources (a debug mode): only the open epoch's slot has writable numpy views
    _guard = cython.declare(cython.bint, visibility="public")
    _last_groups = cython.declare(object)  # the groups enter_producer checked last
    #: the epoch's last enqueue was a publication graph that recorded the slot's event
    #: (set by such a publish, cleared by every other enqueue, begin, resume and reopen):
    #: finish() then records nothing itself
    _graph_recorded = cython.declare(cython.bint, visibility="public")
    #: begin() calls that asked the driver nothing: the slot was known complete
    source_checks_skipped = cython.declare(cython.longlong, visibility="public")
    # What is known complete without asking the driver. Every completion record (finish)
    # draws a sequence number; per tracked slot, the number and stream of its last record.
    # _synced_seq: records up to it are complete (mark_synchronized, the caller's
    # promise); _done_seq on stream _done_stream: records on that stream up to it are
    # complete (a wait that returned proves every earlier record on its stream: one
    # stream runs its work in order).
    _record_seq = cython.declare(cython.longlong)
    _synced_seq = cython.declare(cython.longlong)
    _done_seq = cython.declare(cython.longlong)
    _done_stream = cython.declare(cython.longlong)
    _slot_seq = cython.declare(cython.longlong[64])
    _slot_stream = cython.declare(cython.longlong[64])

    # ------------------------------------------------------------------ state
    @property
    def _owner(self) -> Any:
        """The owner thread's ``threading.get_ident()`` (set once, by the state)."""
        return self._owner_id

    @_owner.setter
    def _owner(self, ident: Any) -> None:
        self._owner_id = ident
        self._owner_c = ident

    @cython.ccall
    @cython.always_allow_keywords(False)  # METH_O: a one-argument call as cheap as none
    def require_ready(self, what: str) -> None:
        """Refuse work outside the owner's open epoch, naming ``what`` (made once: no object)."""
        if (self._invalid is not None or not self._epoch_open
                or PyThread_get_thread_ident() != self._owner_c):
            self._check_ready(what)

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

    # ------------------------------------------------------------------ epochs
    def begin(self, slot: Any = None, *, stream: Any = None) -> int:
        """Start one forward epoch on ``slot`` (default: the next slot, rotating).

        Waits until this slot's previous completion event (its DMAs read the sources),
        then producers may write. The current stream (or ``stream``) becomes the epoch's
        consumer stream: every publication of the epoch must be enqueued on it.
        """
        if (PyThread_get_thread_ident() != self._owner_c or not self._bound
                or self._invalid is not None):
            self._check_thread()
            self._check_bound()
            self._check_valid()
        if self._epoch_open:
            raise EpochError(f"epoch {self.epoch} on slot {self.current_slot} is still open; "
                             "call finish() first")
        s: cython.Py_ssize_t
        if slot is None:
            s = (self.current_slot + 1) % self.num_slots if self.epoch else 0
        else:
            if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
                raise EpochError(f"slot must be an int in [0, {self.num_slots}) or None, got "
                                 f"{type(slot).__name__} {slot!r}")
            if not 0 <= int(slot) < self.num_slots:  # numpy integers are fine
                raise EpochError(f"slot {int(slot)} is not in [0, {self.num_slots})")
            s = int(slot)
        consumer: Any = None
        if self._cuda:
            if get_device() != self._device_index:
                self._check_device()
            if stream is not None:
                if stream.device != self.device:
                    raise DeviceMismatchError(
                        f"stream is on {stream.device}, the state on {self.device}; begin() "
                        "on a stream of the state's device"
                    )
                consumer = stream
            elif (self._stream is not None
                    and current_raw_stream(self._device_index) == self._stream_id):
                consumer = self._stream  # the same consumer stream as last epoch
            else:
                consumer = torch.cuda.current_stream(self.device)
        if self._event_recorded[s] and self._known_complete(s):
            self.last_source_wait_ns = 0  # nothing to ask the driver: see _known_complete
            self.source_checks_skipped += 1
        elif self._event_recorded[s]:
            # last_source_wait_ns counts only the blocking wait for a pending event: the
            # query of a completed one is host work like any other
            if self._slot_events is not None:
                self.last_source_wait_ns = self._slot_events.wait(s)
            # torch events: the driver library did not load (h2d_core.launch says when)
            elif self._events[s].query():
                self.last_source_wait_ns = 0
            else:
                t0 = time.perf_counter_ns()
                self._events[s].synchronize()
                self.last_source_wait_ns = time.perf_counter_ns() - t0 or 1
            self._waited(s)
        else:
            self.last_source_wait_ns = 0
        self.current_slot = s
        self.epoch += 1
        if self._guard:
            self._guard_slot(s, True)  # type: ignore[attr-defined]
        if self._cuda:
            self._stream = consumer
            self._stream_id = consumer.cuda_stream
        for rec in self._slot_groups[s]:
            rec.clear_counts()
        _discard_all(self._published, self._all_names)
        _discard_all(self._produced, self._all_names)
        self._on_publish.clear()
        if self._stagers:  # a stage not published last epoch commits nothing now
            for stagers in self._stagers.values():
                for stager in stagers:
                    stager.clear_pending()
        self._epoch_open = True
        self._resumable = False
        self._graph_recorded = False
        return s

    def finish(self) -> None:
        """Record this slot's completion after the epoch's uploads; never waits for the GPU."""
        if PyThread_get_thread_ident() != self._owner_c or self._invalid is not None:
            self._check_thread()
            self._check_valid()
        if not self._epoch_open:
            raise EpochError("finish() without an open epoch: call begin() first")
        if self._cuda:
            if self._graph_recorded and self._slot_events is not None:
                pass  # the epoch's last enqueue, a publication graph, recorded the event
            elif self._slot_events is not None:
                self._slot_events.record(self.current_slot, self._stream_id)
            else:  # torch events: the driver library did not load
                self._events[self.current_slot].record(self._stream)
            self._event_recorded[self.current_slot] = True
            self._recorded(self.current_slot)
        if self._guard:
            self._guard_slot(self.current_slot, False)  # type: ignore[attr-defined]
        self._epoch_open = False
        self._resumable = True

    def mark_synchronized(self) -> None:
        """The caller's promise that every completion recorded so far has completed: the
        host has synchronized with all work enqueued before this call on every stream
        the state's epochs used (``torch.cuda.synchronize()``, or a blocking read, e.g. of
        the step's sampled tokens, on the one consumer stream every epoch runs on, made
        after ``finish()``). The next ``begin()`` of a slot recorded before the call then
        asks the driver nothing. A false promise lets producers overwrite pinned sources
        a DMA may still read: when unsure, do not call it (begin() then checks)."""
        if get_ident() != self._owner:
            self._check_thread()
        self._synced_seq = self._record_seq

    def slot_known_complete(self, slot: int) -> bool:
        """Whether ``begin(slot)`` would skip the driver: the slot's last recorded
        completion is known complete (or none was recorded)."""
        s: cython.Py_ssize_t = slot
        if not 0 <= s < self.num_slots:
            raise EpochError(f"slot {s} is not in [0, {self.num_slots})")
        return not self._event_recorded[s] or self._known_complete(s)

    @cython.cfunc
    @cython.inline
    def _known_complete(self, s: cython.Py_ssize_t) -> cython.bint:
        """Slot ``s``'s last record is known complete (it must have one): recorded before
        the last mark_synchronized(), or on the stream of a completed wait, no later than
        the record that wait saw (that stream ran it first)."""
        if s >= _TRACKED:
            return False
        seq: cython.longlong = self._slot_seq[s]
        return seq <= self._synced_seq or (
            self._slot_stream[s] == self._done_stream and seq <= self._done_seq)

    @cython.cfunc
    @cython.inline
    def _recorded(self, s: cython.Py_ssize_t) -> cython.void:
        """finish() recorded slot ``s``'s completion on the epoch's stream."""
        self._record_seq += 1
        if s < _TRACKED:
            self._slot_seq[s] = self._record_seq
            self._slot_stream[s] = self._stream_id

    @cython.cfunc
    @cython.inline
    def _waited(self, s: cython.Py_ssize_t) -> cython.void:
        """begin()'s wait found slot ``s``'s last record complete."""
        if s >= _TRACKED:
            return
        if self._slot_stream[s] != self._done_stream:
            self._done_stream = self._slot_stream[s]  # knowledge of one stream at a time
            self._done_seq = 0
        if self._slot_seq[s] > self._done_seq:
            self._done_seq = self._slot_seq[s]

    # ------------------------------------------------------------------ producers
    def enter_producer(self, groups: tuple, reason: Any) -> None:
        """The check ``@h2d_producer`` runs before entering a producer of ``groups``."""
        if (self._invalid is not None or not self._epoch_open
                or PyThread_get_thread_ident() != self._owner_c):
            self._check_ready(f"producer of {list(groups)}")
        produced: set = self._produced
        published: set = self._published
        if reason is None:
            if groups is self._last_groups and not produced and not published:
                # the epoch's first producer, again the one checked last: a decorator passes
                # the same tuple every call, so no name is hashed twice
                _add_all(produced, groups)
                return
            if len(groups) == 1:
                g = groups[0]
                if g in self._producer_groups and g not in produced and g not in published:
                    produced.add(g)
                    return
            elif (groups in self._known_group_lists and _disjoint(produced, groups)
                    and _disjoint(published, groups)):
                _add_all(produced, groups)
                return
        for g in groups:
            if g not in self._producer_groups:
                raise UnknownGroupError(
                    f"producer declares {g!r}, which is not a producer group with buffers; "
                    + self._unknown_group(g)
                )
        self._known_group_lists.add(tuple(groups))  # every name checked: a fast path next time
        if type(groups) is tuple:  # immutable: the identity check above stays sound
            self._last_groups = groups
        repeated = [g for g in groups if g in produced or g in published]
        if repeated and reason is None:
            raise ReentryError(
                f"producer of {list(groups)} entered again in epoch {self.epoch} on slot "
                f"{self.current_slot} ({repeated} already produced/published); pass "
                "h2d_reason='...' for a deliberate second publication"
            )
        for g in repeated:
            if g in published:
                self.reopen(g, reason or "")  # type: ignore[attr-defined]
            else:
                self._counters[g].second_publications += 1
        produced.update(groups)

    def leave_producer_after_error(self, groups: tuple) -> None:
        """A producer of ``groups`` raised: it may run again (nothing was published)."""
        if not any(g in self._published for g in groups):
            self._produced.difference_update(groups)

    # ------------------------------------------------------------------ publication
    def publish(self, group: str, *, stream: Any = None) -> None:
        """Publish ``group`` on the epoch's consumer stream.

        A packed group with two or more active members (or one member with several
        ranges): one DMA of the arena's header and used payload, then one scatter. One
        active member with a count or a single range, the direct backend, an ineligible
        group, or a producer group covered by a combined group: one direct copy per active
        member (per range). Validation happens first; a rejected publication enqueues
        nothing.
        """
        if (self._invalid is not None or not self._epoch_open
                or PyThread_get_thread_ident() != self._owner_c):
            self._check_ready(f"publish({group!r})")
        route = self._routes.get(group)
        if route is None:
            raise UnknownGroupError(self._unknown_group(group))
        rec_index, names, covered_members, counters, name_list = route
        if self._cuda:  # _check_device and _check_stream inline: they raise on a mismatch
            if get_device() != self._device_index:
                self._check_device()
            if (current_raw_stream(self._device_index) if stream is None
                    else stream.cuda_stream) != self._stream_id:
                self._check_stream(stream)
        if not names.isdisjoint(self._published):
            raise DuplicatePublicationError(
                f"group {group!r}: {sorted(names & self._published)} already published in "
                f"epoch {self.epoch}; supply a reason (reopen(group, reason)) for a deliberate "
                "second publication"
            )
        rec = self._slot_groups[self.current_slot][rec_index]
        try:
            if _profiler_enabled():
                with torch.autograd.profiler.record_function(f"h2d.publish/{group}"):
                    self._enqueue(rec, covered_members, counters, stream)
            else:
                self._enqueue(rec, covered_members, counters, stream)
        except H2DError:
            raise
        except Exception as exc:
            self._invalid = f"publish({group!r}) failed: {type(exc).__name__}: {exc}"
            raise PublicationEnqueueError(
                f"enqueueing publication of group {group!r} failed; the owner is invalidated "
                "and its storage retained; call reset() to recover"
            ) from exc
        # one by one: a set merge resizes by its fill, which counts the slots begin()
        # emptied; an add takes the slot its name left
        _add_all(self._published, name_list)
        if self._guard:  # debug mode: the published sources are read-only until finish()
            self._guard_published(names, False)  # type: ignore[attr-defined]
        if self._stagers:  # the block tables commit what this publication carried
            for g in name_list:
                stagers = self._stagers.get(g)
                if stagers is not None:
                    for stager in stagers:
                        stager.after_publish()
        if self._on_publish:
            for g in names.intersection(self._on_publish):
                for buf, fn, only_if_sent in self._on_publish.pop(g):
                    if not only_if_sent or self._sent(buf):  # type: ignore[attr-defined]
                        fn()

    def _enqueue(self, rec: Any, covered: tuple, counters: Any, stream: Any) -> None:
        """Enqueue one publication (validated) and count it (``counters``: its payload
        bytes, copies, DMA and scatter, in C fields)."""
        if covered:
            # not part of a step whose producers wrote the combined group (validation:
            # raised before anything is enqueued; the more specific refusal first)
            self._check_covered(covered[0].group)  # type: ignore[attr-defined]
            if rec.fused:
                raise MembershipError(
                    f"group {covered[0].group!r} is published by {rec.plan.name!r}, whose "
                    "publication runs fused first consumers: publish "
                    f"{rec.plan.name!r} (a direct copy of part of it would skip them)")
            self._graph_recorded = False
            counters.count_publication(self._copy_direct(  # type: ignore[attr-defined]
                rec, [b.member_index for b in covered], counters))
            return
        packed = rec.packed
        if packed is not None and (rec.active > 1 or rec.num_ranges > 1 or rec.fused):
            # True only for a graph launch that recorded the slot's event (finish skips it)
            self._graph_recorded = packed.publish_step(rec.counts, rec.range_table_address,
                                                       self._stream_id, stream)
            counters.count_packed(rec)
            return
        self._graph_recorded = False
        counters.count_publication(self._copy_direct(  # type: ignore[attr-defined]
            rec, range(len(rec.plan.members)), counters))
        if rec.plan.packed:
            counters.direct_fallbacks += 1

    # ------------------------------------------------------------------ checks
    def _unknown_group(self, group: str) -> str:
        known = sorted(set(self._producer_groups) | set(self._combined))  # type: ignore[attr-defined]
        return f"unknown group {group!r}; declared groups are {known}"

    def _check_thread(self) -> None:
        if get_ident() != self._owner:
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
        self._check_thread()
        self._check_bound()
        self._check_valid()
        if not self._epoch_open:
            raise EpochError(f"{what} outside an epoch: call begin() (or resume()) first")

    def _check_device(self) -> None:
        if self._cuda and get_device() != self._device_index:
            raise DeviceMismatchError(
                f"current device is cuda:{torch.cuda.current_device()} but this state owns "
                f"{self.device}; switch with torch.cuda.device({self.device.index})"
            )

    def _check_stream(self, stream: Any) -> Any:
        """Check the publication stream is the epoch's; return what to enqueue on (None:
        the current stream, which is then the epoch's)."""
        if not self._cuda:
            return None
        raw = (current_raw_stream(self._device_index) if stream is None
               else stream.cuda_stream)
        if raw != self._stream_id:
            raise StreamMismatchError(
                f"publication on stream {raw:#x} but the epoch's consumer stream is "
                f"{self._stream_id:#x}; publish on the stream current at begin()"
            )
        return stream


# This source is compiled by Cython, as ``h2d_core._epoch_native``, when the package is
# built; run interpreted, it only hands over to that build (required).
if not cython.compiled:
    from block_tables.native import require_extension

    _compiled = require_extension("h2d_core._epoch_native")
    EpochCore = _compiled.EpochCore  # type: ignore[misc]
