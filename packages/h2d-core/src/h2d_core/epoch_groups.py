"""What one epoch produced and published, group by group.

The rules it keeps: a producer group is produced at most once per epoch and published at
most once, unless a reason reopens it; a publication tells the group's block-table stagers
and runs the callbacks registered for it; a new epoch (or a reset) forgets all of it.
:class:`EpochGroups` holds the two sets, the callbacks and stagers, and the producer-entry
fast paths; the epoch (:class:`~h2d_core.epoch.EpochCore`) holds one and calls it through
C.

Compiled by Cython as ``h2d_core._epoch_groups_native`` when the package is built
(required).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import DuplicatePublicationError, ReentryError, UnknownGroupError

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op decorators
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]


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
class EpochGroups:
    """The produced and published groups of the open (or last) epoch, and what their
    publication triggers. ``producer_groups`` and ``counters`` are the state's own dicts."""

    # C fields: _epoch_groups_native.pxd (the epoch reads them through C)
    producer_groups: dict[str, Any]
    counters: dict[str, Any]
    produced: set[str]
    published: set[str]
    all_names: tuple[str, ...]
    _known_lists: set[tuple[str, ...]]
    _last: Any
    _on_publish: dict[str, list[tuple[Any, Callable[[], None], bool]]]
    _stagers: dict[str, tuple[Any, ...]]

    def __init__(self, producer_groups: dict, counters: dict) -> None:
        self.producer_groups = producer_groups
        self.counters = counters
        self.produced = set()
        self.published = set()
        self.all_names = ()
        self._known_lists = set()
        self._last = None
        self._on_publish = {}
        self._stagers = {}

    def bound(self, all_names: tuple) -> None:
        """Bind time: every name an epoch may produce or publish."""
        self.all_names = all_names

    def add_stager(self, group: str, stager: Any) -> None:
        """``stager`` is told ``after_publish()`` after each publication of ``group`` and
        ``clear_pending()`` when the epoch's stage lapses."""
        self._stagers[group] = (*self._stagers.get(group, ()), stager)

    def on_publish(self, group: str, entry: tuple[Any, Callable[[], None], bool]) -> None:
        """Run ``entry``'s callback after ``group``'s next publication this epoch."""
        self._on_publish.setdefault(group, []).append(entry)

    @cython.ccall
    def open(self) -> None:
        """A new epoch: nothing produced or published, no callback or stage pending."""
        _discard_all(self.published, self.all_names)
        _discard_all(self.produced, self.all_names)
        self._on_publish.clear()
        if self._stagers:  # a stage not published last epoch commits nothing now
            for stagers in self._stagers.values():
                for stager in stagers:
                    stager.clear_pending()

    def clear(self) -> None:
        """Recovery: forget the epoch (sets emptied whole)."""
        self.published.clear()
        self.produced.clear()
        self.open()

    @cython.ccall
    def enter(self, groups: tuple, reason: Any, epoch: cython.longlong,
              slot: cython.Py_ssize_t) -> list | None:
        """A producer of ``groups`` enters: refuse unknown names and (without ``reason``) a
        group already produced or published this epoch. Returns None, or the published
        groups the caller must reopen before :meth:`entered`."""
        produced: set = self.produced
        published: set = self.published
        if reason is None:
            if groups is self._last and not produced and not published:
                # the epoch's first producer, again the one checked last: a decorator passes
                # the same tuple every call, so no name is hashed twice
                _add_all(produced, groups)
                return None
            if len(groups) == 1:
                g = groups[0]
                if g in self.producer_groups and g not in produced and g not in published:
                    produced.add(g)
                    return None
            elif (groups in self._known_lists and _disjoint(produced, groups)
                    and _disjoint(published, groups)):
                _add_all(produced, groups)
                return None
        for g in groups:
            if g not in self.producer_groups:
                raise UnknownGroupError(
                    f"producer declares {g!r}, which is not a producer group with buffers; "
                    f"declared producer groups are {sorted(self.producer_groups)}")
        self._known_lists.add(tuple(groups))  # every name checked: a fast path next time
        if type(groups) is tuple:  # immutable: the identity check above stays sound
            self._last = groups
        repeated = [g for g in groups if g in produced or g in published]
        if repeated and reason is None:
            raise ReentryError(
                f"producer of {list(groups)} entered again in epoch {epoch} on slot {slot} "
                f"({repeated} already produced/published); pass h2d_reason='...' for a "
                "deliberate second publication")
        for g in repeated:
            if g not in published:
                self.counters[g].second_publications += 1
        again = [g for g in repeated if g in published]
        if not again:
            produced.update(groups)
            return None
        return again

    def entered(self, groups: tuple) -> None:
        """The reopened producer's groups count as produced."""
        self.produced.update(groups)

    def left_after_error(self, groups: tuple) -> None:
        """A producer of ``groups`` raised: it may run again (nothing was published)."""
        if not any(g in self.published for g in groups):
            self.produced.difference_update(groups)

    @cython.ccall
    def require_unpublished(self, group: str, names: frozenset, epoch: cython.longlong) -> None:
        """Refuse publishing ``group`` (carrying ``names``) twice in one epoch."""
        if not names.isdisjoint(self.published):
            raise DuplicatePublicationError(
                f"group {group!r}: {sorted(names & self.published)} already published in "
                f"epoch {epoch}; supply a reason (reopen(group, reason)) for a deliberate "
                "second publication")

    @cython.ccall
    def published_now(self, names: frozenset, name_list: tuple, records: list) -> None:
        """``names`` went out (``records``: the slot's group records): mark them, let
        their block tables commit what it carried, run their callbacks."""
        # one by one: a set merge resizes by its fill, which counts the slots open()
        # emptied; an add takes the slot its name left
        _add_all(self.published, name_list)
        if self._stagers:
            for g in name_list:
                stagers = self._stagers.get(g)
                if stagers is not None:
                    for stager in stagers:
                        stager.after_publish()
        if self._on_publish:
            for g in names.intersection(self._on_publish):
                for buf, fn, only_if_sent in self._on_publish.pop(g):
                    # every home of a counted member holds the same count: ask the first
                    gi, i = buf.homes[0]
                    if not only_if_sent or records[gi].sent(i):
                        fn()

    def copied_alone(self, group: str) -> None:
        """A standalone direct copy of one of ``group``'s buffers counts as its publication
        (no stager or callback: it carried one buffer, not the group's stage)."""
        self.published.add(group)

    def reopen(self, group: str, plans: dict, records: list) -> set:
        """Take ``group``'s publication back (the whole combined one that carried it):
        its records' counts cleared, its producer groups neither produced nor published,
        their callbacks and stages dropped. Returns those producer groups."""
        if group in plans:
            pubs = [plans[group]]
        else:  # a producer group: reopen whichever publication carried it
            pubs = [p for p in plans.values()
                    if group in p.producer_groups and p.name in self.published]
        groups = {g for p in pubs for g in p.producer_groups} or {group}
        for p in pubs:
            records[p.index].clear_counts()
            self.published.discard(p.name)
        for g in groups:
            for b in self.producer_groups[g]:
                for gi, i in b.homes:
                    records[gi].omit(i)
            self.published.discard(g)
            self.produced.discard(g)
            self._on_publish.pop(g, None)
            for stager in self._stagers.get(g, ()):
                stager.clear_pending()
        return groups


# This source is compiled by Cython, as ``h2d_core._epoch_groups_native``, when the
# package is built; run interpreted, it only hands over to that build (required).
if not cython.compiled:
    from block_tables.native import require_extension

    _compiled = require_extension("h2d_core._epoch_groups_native")
    EpochGroups = _compiled.EpochGroups  # type: ignore[misc]
