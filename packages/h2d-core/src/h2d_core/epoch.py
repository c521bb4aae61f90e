"""The runner state's per-step core, compiled: the epoch's fields, begin, the producer
entry, publish, finish and the checks every entry point runs.

Every step calls :meth:`EpochCore.begin`, one producer entry per producer,
:meth:`EpochCore.publish` per group and :meth:`EpochCore.finish`. Their state (slot,
epoch, the open flag, the owner thread, the publication routes) lives in C fields of this
base of :class:`~h2d_core.state.H2DRunnerState`, so a step reads no instance dictionary.
Its parts are held objects called through C: the slots' completion events
(:class:`~h2d_core.completions.SlotCompletions`) and the epoch's produced and published
groups (:class:`~h2d_core.epoch_groups.EpochGroups`); refusals are built by
:mod:`~h2d_core.epoch_refusals`, direct copies by :mod:`~h2d_core.direct_copies`.

Compiled by Cython as ``h2d_core._epoch_native`` when the package is built (required).
"""

from __future__ import annotations

from threading import get_ident
from typing import Any

import numpy as np
import torch

from . import epoch_refusals as refusals
from .direct_copies import copy_members
from .errors import (
    DeviceMismatchError,
    DuplicatePublicationError,
    EpochError,
    H2DError,
    MembershipError,
    PublicationEnqueueError,
    UnknownGroupError,
)

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op decorators
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]

if cython.compiled:
    # the calling thread's id as a C integer (threading.get_ident() makes an int per call);
    # the epoch's parts, called through C (_completions_native.pxd, _epoch_groups_native.pxd)
    from cython.cimports.cpython.pythread import PyThread_get_thread_ident
    from cython.cimports.h2d_core._completions_native import SlotCompletions
    from cython.cimports.h2d_core._epoch_groups_native import EpochGroups
else:  # interpreted, this module only hands over to its build (see the end)
    PyThread_get_thread_ident = get_ident
    from .completions import SlotCompletions
    from .epoch_groups import EpochGroups

# the raw C getters: torch.cuda.current_device() / current_stream() cost several times more
get_device: Any = getattr(torch._C, "_cuda_getDevice", None)
current_raw_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_profiler_enabled: Any = torch._C._autograd._profiler_enabled


@cython.cclass
class EpochCore:
    """The fields a step touches and the calls that open, enter and close its epoch.

    Subclassed by :class:`~h2d_core.state.H2DRunnerState` (its Python calls); see
    :class:`~h2d_core.state.H2DRunnerState` for the life of a state. It holds its
    parts rather than calling its subclasses: the slots' completion record
    (:attr:`completions`), the epoch's groups (:attr:`groups`) and the debug mode's
    source guard."""

    device = cython.declare(object, visibility="public")
    num_slots = cython.declare(cython.Py_ssize_t, visibility="public")
    current_slot = cython.declare(cython.Py_ssize_t, visibility="public")
    epoch = cython.declare(cython.longlong, visibility="public")
    #: host ns the last begin() blocked on its slot's previous DMA (source reuse); 0 when
    #: that DMA had completed (checking it is then ordinary host work)
    last_source_wait_ns = cython.declare(cython.longlong, visibility="public")
    #: each slot's completion event and what is known complete (made by the state)
    completions = cython.declare(SlotCompletions, visibility="public")
    #: the owner thread's id (``threading.get_ident()`` of the state's creator), a C
    #: integer the entry points compare with the caller's without making an int
    owner_thread = cython.declare(cython.ulong, visibility="public")
    _bound = cython.declare(cython.bint, visibility="public")
    _invalid = cython.declare(object, visibility="public")
    _epoch_open = cython.declare(cython.bint, visibility="public")
    _resumable = cython.declare(cython.bint, visibility="public")
    _cuda = cython.declare(cython.bint, visibility="public")
    _device_index = cython.declare(cython.int, visibility="public")
    _stream = cython.declare(object, visibility="public")
    _stream_id = cython.declare(object, visibility="public")
    _slot_groups = cython.declare(list, visibility="public")
    _producer_groups = cython.declare(dict, visibility="public")
    _combined = cython.declare(dict, visibility="public")
    _plans = cython.declare(dict, visibility="public")
    _counters = cython.declare(dict, visibility="public")
    #: what the epoch produced and published, and what a publication triggers
    groups = cython.declare(EpochGroups, visibility="public")
    #: publish(name) -> (record index, names it publishes, members copied directly when it
    #: is a producer group covered by a combined one, counters): one lookup per call
    _routes = cython.declare(dict, visibility="public")
    #: guard_sources (a debug mode): a SourceGuard, or None
    _guard = cython.declare(object, visibility="public")
    _acquire_event = cython.declare(object, visibility="public")

    # ------------------------------------------------------------------ state
    @cython.ccall
    @cython.always_allow_keywords(False)  # METH_O: a one-argument call as cheap as none
    def require_ready(self, what: str) -> None:
        """Refuse work outside the owner's open epoch, naming ``what`` (made once: no object)."""
        if (self._invalid is not None or not self._epoch_open
                or PyThread_get_thread_ident() != self.owner_thread):
            self.require_owner()
            self.require_bound()
            self.require_valid()
            if not self._epoch_open:
                raise refusals.outside_epoch(what)

    @cython.ccall
    def require_owner(self) -> None:
        """Refuse a call from a thread other than the state's creator."""
        if PyThread_get_thread_ident() != self.owner_thread:
            raise refusals.other_thread()

    @cython.ccall
    def require_bound(self) -> None:
        """Refuse work before :meth:`~h2d_core.H2DRunnerState.bind`."""
        if not self._bound:
            raise refusals.not_bound()

    @cython.ccall
    def require_valid(self) -> None:
        """Refuse work after an enqueue failure, until ``reset()``."""
        if self._invalid is not None:
            raise refusals.invalidated(self._invalid)

    @cython.ccall
    def require_device(self) -> None:
        """Refuse a call while another CUDA device is current."""
        if self._cuda and get_device() != self._device_index:
            raise refusals.wrong_device(self.device)

    def require_stream(self, stream: Any) -> None:
        """Refuse a publication on a stream other than the epoch's (``stream`` None: the
        current one)."""
        if self._cuda:
            raw = (current_raw_stream(self._device_index) if stream is None
                   else stream.cuda_stream)
            if raw != self._stream_id:
                raise refusals.wrong_stream(raw, self._stream_id)

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

    @property
    def source_checks_skipped(self) -> int:
        """begin() calls that asked the driver nothing: the slot was known complete."""
        return self.completions.checks_skipped

    @property
    def slot_records(self) -> list:
        """Per slot, its group records (``GroupPlan.index`` order): fixed at bind, so a
        bound reader may keep this list."""
        return self._slot_groups

    def is_published(self, group: str) -> bool:
        """Whether ``group`` was published in the current (or last) epoch."""
        return group in self.groups.published

    # ------------------------------------------------------------------ epochs
    def begin(self, slot: Any = None, *, stream: Any = None) -> int:
        """Start one forward epoch on ``slot`` (default: the next slot, rotating).

        Waits until this slot's previous completion event (its DMAs read the sources),
        then producers may write. The current stream (or ``stream``) becomes the epoch's
        consumer stream: every publication of the epoch must be enqueued on it.
        """
        if (PyThread_get_thread_ident() != self.owner_thread or not self._bound
                or self._invalid is not None):
            self.require_owner()
            self.require_bound()
            self.require_valid()
        if self._epoch_open:
            raise EpochError(f"epoch {self.epoch} on slot {self.current_slot} is still open; "
                             "call finish() first")
        s: cython.Py_ssize_t
        if slot is None:
            s = (self.current_slot + 1) % self.num_slots if self.epoch else 0
        else:
            if (isinstance(slot, bool) or not isinstance(slot, (int, np.integer))
                    or not 0 <= int(slot) < self.num_slots):  # numpy integers are fine
                raise refusals.bad_slot(slot, self.num_slots)
            s = int(slot)
        consumer: Any = None
        if self._cuda:
            if get_device() != self._device_index:
                self.require_device()
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
        self.last_source_wait_ns = self.completions.wait(s)
        self.current_slot = s
        self.epoch += 1
        if self._guard is not None:
            self._guard.open_slot(s)
        if self._cuda:
            self._stream = consumer
            self._stream_id = consumer.cuda_stream
        for rec in self._slot_groups[s]:
            rec.clear_counts()
        self.groups.open()
        self._epoch_open = True
        self._resumable = False
        self.completions.graph_recorded = False
        return s

    def finish(self) -> None:
        """Record this slot's completion after the epoch's uploads; never waits for the GPU."""
        if PyThread_get_thread_ident() != self.owner_thread or self._invalid is not None:
            self.require_owner()
            self.require_valid()
        if not self._epoch_open:
            raise EpochError("finish() without an open epoch: call begin() first")
        if self._cuda:
            self.completions.record(self.current_slot, self._stream_id, self._stream)
        if self._guard is not None:
            self._guard.open_slot(self.current_slot, False)
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
        self.require_owner()
        self.completions.mark_synchronized()

    def slot_known_complete(self, slot: int) -> bool:
        """Whether ``begin(slot)`` would skip the driver: the slot's last recorded
        completion is known complete (or none was recorded)."""
        return self.completions.known_complete(slot)

    # ------------------------------------------------------------------ producers
    def enter_producer(self, groups: tuple, reason: Any) -> None:
        """The check ``@h2d_producer`` runs before entering a producer of ``groups``."""
        if (self._invalid is not None or not self._epoch_open
                or PyThread_get_thread_ident() != self.owner_thread):
            self.require_ready(f"producer of {list(groups)}")
        again = self.groups.enter(groups, reason, self.epoch, self.current_slot)
        if again is not None:  # published already, entered with a reason
            for g in again:
                self.reopen(g, reason)
            self.groups.entered(groups)

    def leave_producer_after_error(self, groups: tuple) -> None:
        """A producer of ``groups`` raised: it may run again (nothing was published)."""
        self.groups.left_after_error(groups)

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
                or PyThread_get_thread_ident() != self.owner_thread):
            self.require_ready(f"publish({group!r})")
        route = self._routes.get(group)
        if route is None:
            raise self.unknown_group(group)
        rec_index, names, covered_members, counters, name_list = route
        if self._cuda:  # require_device and require_stream inline: they raise on a mismatch
            if get_device() != self._device_index:
                self.require_device()
            if (current_raw_stream(self._device_index) if stream is None
                    else stream.cuda_stream) != self._stream_id:
                self.require_stream(stream)
        self.groups.require_unpublished(group, names, self.epoch)
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
        if self._guard is not None:  # debug mode: published sources read-only until finish()
            self._guard.seal(self.current_slot, names)
        self.groups.published_now(names, name_list, self._slot_groups[self.current_slot])

    def _enqueue(self, rec: Any, covered: tuple, counters: Any, stream: Any) -> None:
        """Enqueue one publication (validated) and count it (``counters``: its payload
        bytes, copies, DMA and scatter, in C fields)."""
        if covered:
            # not part of a step whose producers wrote the combined group (validation:
            # raised before anything is enqueued; the more specific refusal first)
            refused = refusals.covered_alone(covered[0].group, self._combined,
                                             self.groups.produced, self.groups.published,
                                             self.epoch)
            if refused is not None:
                raise refused
            if rec.fused:
                raise MembershipError(
                    f"group {covered[0].group!r} is published by {rec.plan.name!r}, whose "
                    "publication runs fused first consumers: publish "
                    f"{rec.plan.name!r} (a direct copy of part of it would skip them)")
            self.completions.graph_recorded = False
            counters.count_publication(copy_members(
                rec, [b.member_index for b in covered], counters, self.current_slot))
            return
        packed = rec.packed
        if packed is not None and (rec.active > 1 or rec.num_ranges > 1 or rec.fused):
            # True only for a graph launch that recorded the slot's event (finish skips it)
            self.completions.graph_recorded = packed.publish_step(
                rec.counts, rec.range_table_address, self._stream_id, stream)
            counters.count_packed(rec)
            return
        self.completions.graph_recorded = False
        counters.count_publication(copy_members(
            rec, range(len(rec.plan.members)), counters, self.current_slot))
        if rec.plan.packed:
            counters.direct_fallbacks += 1

    # ------------------------------------------------------------------ second publications
    def reopen(self, group: str, reason: str) -> None:
        """Allow a deliberate second publication of ``group`` in this epoch.

        Acquires the sources first: waits until every DMA already enqueued on the consumer
        stream (the earlier publication included) has completed, so rewriting them is safe.
        The group's counts are cleared; producers set them again before publishing. When the
        group went out inside a combined group, that whole publication is reopened: the
        sibling producer groups lose their counts and pending callbacks too, and must be
        produced again before the combined group is published again.
        """
        self.require_ready(f"reopen({group!r})")
        if not isinstance(reason, str) or not reason.strip():
            raise DuplicatePublicationError(
                f"reopen({group!r}): a second publication needs a non-empty reason string")
        if group not in self._plans and group not in self._producer_groups:
            raise self.unknown_group(group)
        self.acquire_sources()
        groups = self.groups.reopen(group, self._plans, self._slot_groups[self.current_slot])
        if self._guard is not None:  # the acquired sources are writable again
            self._guard.seal(self.current_slot, groups, True)
        self._counters[group].second_publications += 1

    def acquire_sources(self) -> None:
        """Wait until every DMA enqueued on the epoch's stream completed (its sources may
        then be rewritten)."""
        self.completions.graph_recorded = False  # an enqueue (this record): finish records
        if self._cuda:
            self._acquire_event.record(self._stream)
            self._acquire_event.synchronize()

    def unknown_group(self, group: str) -> UnknownGroupError:
        """The refusal of a name that is no declared group."""
        return refusals.unknown_group(group, set(self._producer_groups) | set(self._combined))


# This source is compiled by Cython, as ``h2d_core._epoch_native``, when the package is
# built; run interpreted, it only hands over to that build (required).
if not cython.compiled:
    from block_tables.native import require_extension

    from . import completions, epoch_groups  # noqa: F401 - built first: cimported here

    _compiled = require_extension("h2d_core._epoch_native")
    EpochCore = _compiled.EpochCore  # type: ignore[misc]
