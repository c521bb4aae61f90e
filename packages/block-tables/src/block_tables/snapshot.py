"""PageTableSnapshot: incremental preparation of a fixed page-table buffer.

The snapshot owns the bytes of caller-supplied storage (in the runner: the pinned CPU half
of the GPU block-table buffer) and keeps, for every storage row, the version and length of
the content it holds. ``prepare(rows)`` brings rows ``[0, len(rows))`` to the batch's page
IDs while writing only bytes that differ.

Byte rule (what the storage holds after every successful ``prepare``):

* each row ``i < num_rows`` holds its page IDs in columns ``[0, len(row i))`` and
  ``fill_value`` in columns ``[len(row i), width)``: exactly the naive full-width rebuild
  (clear the row to ``fill_value``, copy the IDs in). Uploading rows ``[0, num_rows)`` at
  full width is therefore deterministic.
* rows ``>= num_rows`` are not part of the snapshot, and a prepare never writes a row
  outside its batch. They keep what an earlier prepare gave them (in the same full-width
  form) or, if no prepare ever covered them, the caller's initial bytes. Consumers must
  not read them; a later batch that covers them again reuses what they hold.

Every known row is kept in that form, so a row replaced by a shorter one clears only the
columns its previous content held; a row of unknown content (never prepared, or after
:meth:`PageTableSnapshot.invalidate`) is compared and cleared over the whole width the
first time a batch covers it. A prepare that replaces every row of its batch copies the
IDs, then clears every exposed tail in one compiled sweep.

A rejected batch (any :class:`~block_tables.errors.BlockTableError`) is rejected before the
first write and changes nothing. The revision counts byte changes: it advances by one
exactly when a prepare changed at least one storage byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .lineage import LENGTH_BITS, BlockTable, _Lineage
from .native import require_extension
from .revisions import SnapshotBook
from .row_plan import UNKNOWN, Rows, StoredRows, plan_changed_rows, record_proof, row_key
from .row_writes import RowWriter
from .spans import ChangedRows, changed_byte_ranges
from .validation import (
    NO_POOL_LIMIT,
    Int64Array,
    check_prepare_arguments,
    check_required_pages,
    check_snapshot_arguments,
)
from .vectors import plan_vector_rows

MAX_WIDTH = (1 << (LENGTH_BITS - 1)) - 1
"""Widest storage a snapshot accepts. Keeping widths below half the key's length field
means two row keys differ by at most ``width`` exactly when their versions are equal."""

# the compiled paths (_snapshot.pyx): the common decode step, the write of a fully
# replaced batch and the all-versioned key diffs; required (NativeBuildError without it)
_native = require_extension("block_tables._snapshot_native")
_native.configure(BlockTable, LENGTH_BITS, _Lineage)

class PageTableSnapshot:
    """Incrementally prepared page table over fixed 2-D int32 storage.

    ``storage`` is never reallocated or replaced; the snapshot writes only through it.
    Every page ID a row brings is checked to be >= 0 (-1 is never a page: padding and the
    fill value are the snapshot's own); ``pool_limit`` (optional) makes it checked against
    ``[0, pool_limit)``;
    ``fill_value`` is what columns past a row's length hold; ``history`` is how many
    byte-changing revisions :meth:`changed_rows_since` can look back over.
    ``reserved_page`` (optional) is a page only padding rows hold (an engine's dummy
    block for graph padding): a real row that brings it is refused
    (:class:`~block_tables.errors.ReservedPageError`); the last ``padding`` rows of a
    :meth:`prepare` are the padding rows. Each row's new pages are checked as they
    arrive, so padding rows must be private lineages that no real row grows from. Not
    thread-safe: prepare one snapshot from one thread, and do not mutate rows while they
    are being prepared.
    """

    def __init__(
        self,
        storage: np.ndarray,
        *,
        pool_limit: int | None = None,
        fill_value: int = 0,
        history: int = 64,
        reserved_page: int | None = None,
    ) -> None:
        check_snapshot_arguments(storage, pool_limit, fill_value, history, reserved_page,
                                 MAX_WIDTH)
        rows, width = storage.shape
        self._storage = storage
        self._rows = int(rows)
        self._width = int(width)
        self._limit = None if pool_limit is None else int(pool_limit)
        # the bound every ID is checked against: the pool limit, or [0, 2**31) without one
        self._check_limit = NO_POOL_LIMIT if pool_limit is None else int(pool_limit)
        self._fill = int(fill_value)
        # -1: no reserved page (a page ID is >= 0)
        self._reserved = -1 if reserved_page is None else int(reserved_page)
        self._unknown_key = row_key(UNKNOWN, width)
        # Per storage row: packed (version, length) of the content it holds, and the
        # length alone. Unknown rows count as dirty over the full width.
        self._row_keys: Int64Array = np.full(rows, self._unknown_key, dtype=np.int64)
        self._lengths: Int64Array = np.full(rows, width, dtype=np.int64)
        self._lengths_u = self._lengths.view(np.uint64)
        self._book = book = SnapshotBook(history, rows)  # the compiled step writes it
        # the compiled paths, bound once to the arrays above and their own scratch
        self._native = _native
        self._bound = _native.bind(
            self._row_keys, self._lengths, storage.reshape(-1), np.empty(rows, np.int64),
            np.empty(3 * rows, dtype=np.int64), int(width), book.meta,
            book.revisions.counts, book.revisions.rows, self._reserved)
        self._writer = RowWriter(storage, fill_value, _native, self._bound)
        # what a plan of a handed-back batch reads (the arrays above, never copied)
        self._stored = StoredRows(storage, self._row_keys, self._lengths, int(width),
                                  self._check_limit, self._reserved,
                                  np.ones(rows, dtype=np.int64).tobytes())
        self._keys_read_only = self._row_keys.view()
        self._keys_read_only.flags.writeable = False

    # -- what the key diffs (spans.py) and a table's stager read -----------------------------

    @property
    def stored_keys(self) -> Int64Array:
        """The packed (version, length) key of every storage row, as a read-only view of
        the snapshot's own array (the same object each time): what a publisher remembers
        at upload (:func:`block_tables.spans.row_keys`) and diffs later."""
        return self._keys_read_only

    @property
    def step_binding(self) -> object:
        """The snapshot's binding for the compiled step (``_snapshot.pyx``'s
        ``prepare_step``), made once: what :class:`~block_tables.staging.TableStaging`
        hands it."""
        return self._bound

    @property
    def step_pool_limit(self) -> int:
        """The pool limit as the compiled step takes it (no limit: a sentinel)."""
        return self._check_limit

    @property
    def all_versioned(self) -> bool:
        """Every row of the last batch came from a BlockTable (a key diff needs no history)."""
        return self._book.all_versioned

    def _bump(self, rows: Int64Array | None) -> int:
        """Record the next revision as changing ``rows`` (sorted; None: all); return it."""
        return int(self._native.record_revision(
            self._bound, None if rows is None else np.ascontiguousarray(rows, np.int64)))

    # -- reading --------------------------------------------------------------------------

    @property
    def storage(self) -> np.ndarray:
        """The caller's storage (the same object that was passed in)."""
        return self._storage

    @property
    def revision(self) -> int:
        """Prepared revision: advances by one exactly when a prepare changes storage bytes."""
        return self._book.revision

    @property
    def num_rows(self) -> int:
        """Rows of the last prepared batch: the snapshot is storage rows ``[0, num_rows)``."""
        return self._book.num_rows

    @property
    def row_lengths(self) -> Int64Array:
        """Page counts of rows ``[0, num_rows)`` (a read-only copy)."""
        lengths = self._lengths[: self._book.num_rows].copy()
        lengths.setflags(write=False)
        return lengths

    @property
    def pool_limit(self) -> int | None:
        """Exclusive upper bound of page IDs, or None when only their lower bound (0) is
        checked."""
        return self._limit

    @property
    def reserved_page(self) -> int | None:
        """The page only padding rows may hold (None: every page is a real row's)."""
        return None if self._reserved < 0 else self._reserved

    @property
    def fill_value(self) -> int:
        """Value of every column past a row's length."""
        return self._fill

    @property
    def cleared_elements(self) -> int:
        """Storage elements that tail clears have changed to ``fill_value``, since creation.

        A diagnostic of the byte rule, on every write path: a full-width row never adds
        to it (it is copied without clearing), a row replaced by a shorter one adds only
        the columns its previous content held that were not already the fill value.
        """
        return self._writer.cleared

    @property
    def meta_address(self) -> int:
        """Address of the snapshot's int64 bookkeeping fields, for compiled readers that
        must not box them: the prepared revision at index 0, the last batch's rows at 1,
        and at 2 whether every row of it was a :class:`BlockTable`. Valid while the
        snapshot lives; read-only for callers."""
        return int(self._book.meta.ctypes.data)

    @property
    def capacity(self) -> int:
        """Storage rows: the largest batch ``prepare`` accepts."""
        return self._rows

    @property
    def width(self) -> int:
        """Storage columns: the longest row ``prepare`` accepts."""
        return self._width

    def changed_byte_ranges(
        self,
        keys_then: Int64Array,
        num_rows: int,
        row_bytes: int,
        max_ranges: int,
        max_bytes: int,
        keys_out: Int64Array | None = None,
        tag: int | None = None,
        revision: int | None = None,
    ) -> tuple[list[Any], int] | None:
        """What to send so a destination holding rows ``[0, len(keys_then))`` with those
        row keys holds rows ``[0, num_rows)`` of this snapshot: ``(ranges, total bytes)``
        with ranges ``(offset, nbytes)`` of the row-major table, ascending, or None when
        more than ``max_ranges`` ranges or ``max_bytes`` bytes would travel (or the history
        no longer tells): send whole rows then. See :func:`block_tables.spans.changed_byte_ranges`
        for ``revision`` and ``keys_out``. Called once per step by a publisher: pass the
        arguments by position there (keywords cost a few hundred ns per call).

        ``tag`` (an int >= 0), when given, is put first in every range (``(tag, offset,
        nbytes)``), so a caller collecting several tables' ranges in one list (a publication
        record) needs no second pass.
        """
        if self._book.all_versioned:
            found = self._native.changed_byte_ranges(
                self._row_keys, keys_then, keys_then.size, num_rows, row_bytes, max_ranges,
                max_bytes, keys_out, tag)
            if found is not NotImplemented:
                if found is None or tag is not None:
                    return found
                return [(a, b - a) for a, b in found[0]], found[1]
        # Not all versioned (the history or the unversioned rows decide), or keys the
        # compiled diff hands back (not native int64, or a read-only keys_out): spans.py.
        pairs = changed_byte_ranges(self, keys_then, num_rows, row_bytes, revision=revision,
                                    max_ranges=max_ranges, max_bytes=max_bytes,
                                    keys_out=keys_out)
        if pairs is None:
            return None
        if tag is None:
            return [(a, b - a) for a, b in pairs[0]], pairs[1]
        return [(tag, a, b - a) for a, b in pairs[0]], pairs[1]

    def changed_rows_since(self, revision: int) -> ChangedRows:
        """Rows of ``[0, num_rows)`` whose bytes changed after ``revision``.

        Empty when ``revision`` is the current one. ``all_rows`` when the snapshot no
        longer (or never) knew that revision, or the storage was invalidated since.
        """
        book = self._book
        return book.revisions.rows_since(revision, book.revision, book.num_rows)

    # -- preparing ------------------------------------------------------------------------

    def prepare(
        self,
        rows: Rows,
        *,
        required_pages: Sequence[int] | np.ndarray | None = None,
        versions: Sequence[int] | np.ndarray | None = None,
        lengths: Sequence[int] | np.ndarray | None = None,
        padding: int = 0,
    ) -> int:
        """Make storage rows ``[0, len(rows))`` hold ``rows``; return the prepared revision.

        ``rows`` is an ordered sequence of :class:`BlockTable`, 1-D integer arrays or lists
        of ints. ``required_pages[i]``, if given, is how many pages row ``i``'s request
        span needs this step; it is checked on every call, hits included. Nothing of
        ``rows`` is retained after the call.

        ``versions`` and ``lengths`` (given together: one integer per row) are the caller's
        own append-lineage versions and row lengths (:mod:`block_tables.vectors`): the
        batch mapping is then identified from the two vectors, and only rows whose version
        or length changed are read.

        ``padding`` is how many of the last rows are graph padding: the only rows that may
        hold :attr:`reserved_page` (checked only with a reserved page).
        """
        if check_prepare_arguments(rows, padding, versions, lengths, self._reserved >= 0):
            return self._prepare_vectors(rows, versions, lengths, required_pages)
        # The common decode and prefill-chunk steps (hits and appends of versioned rows)
        # in one compiled call; None means "not covered", and nothing was written.
        # It records the revision and the bookkeeping itself.
        if self._native.prepare_step(self._bound, rows, self._check_limit, required_pages) >= 0:
            return self._book.revision
        # Handed back: another container or row kind, an unset or odd slot, a change other
        # than a one-page append, required pages the compiled step does not read, or an
        # error to report. The checks, messages and other write paths live here.
        try:
            keys = [row._key for row in rows]  # type: ignore[union-attr]
        except AttributeError:
            keys = None
        if keys is not None and keys == self._book.keys:
            # Hit: same ordered versions and lengths, so the same bytes; no page ID is read.
            if required_pages is not None:
                n = self._book.num_rows
                check_required_pages(required_pages, self._lengths[:n], self._lengths_u[:n])
            return self._book.revision
        return self._prepare_changed(rows, keys, required_pages, len(rows) - padding)

    def invalidate(self) -> None:
        """Forget what the storage holds, after something wrote it outside ``prepare``.

        Advances the revision and empties the snapshot (``num_rows`` becomes 0); the next
        prepare compares every row it covers against the whole width.
        """
        self._row_keys.fill(self._unknown_key)
        self._lengths.fill(self._width)
        self._book.keys = None
        self._book.all_versioned = False
        self._book.num_rows = 0
        self._bump(None)

    def _prepare_changed(
        self,
        rows: Rows,
        keys: list[int] | None,
        required_pages: Sequence[int] | np.ndarray | None,
        real: int | None = None,
    ) -> int:
        """Prepare a batch the compiled step handed back: planned whole (every check) by
        :func:`~block_tables.row_plan.plan_changed_rows`, then written and recorded; rows
        ``[0, real)`` are real (None: all), the only ones checked against the reserved
        page."""
        n = len(rows)
        plan = plan_changed_rows(rows, keys, required_pages, n if real is None else real,
                                 self._stored)
        writer = self._writer
        changed_arrays: list[Int64Array] = []
        if plan.single_values is not None:
            written = writer.write_single(plan.single, self._lengths[:n][plan.single],
                                          plan.single_values)
            if written.size:
                changed_arrays.append(written)
        changed = writer.write_rows(plan.appends, plan.shrunk, self._lengths[:n],
                                    plan.lengths, plan.rewrites)
        if plan.touched:
            self._row_keys[:n] = plan.keys
            self._lengths[:n] = plan.lengths
            for i, key in plan.key_fixes:
                self._row_keys[i] = key
        limit = self._check_limit
        for table, length in plan.proofs:
            record_proof(table, length, limit)
        for i, _start, stop, _ids in plan.appends:
            record_proof(rows[i], stop, limit)  # type: ignore[arg-type]
        self._book.keys = keys
        self._book.all_versioned = keys is not None
        self._book.num_rows = n
        if changed:
            changed_arrays.append(np.array(changed, dtype=np.int64))
        if changed_arrays:
            rows_changed = (
                changed_arrays[0]
                if len(changed_arrays) == 1 and not changed
                else np.unique(np.concatenate(changed_arrays))
            )
            return self._bump(rows_changed)
        return self._book.revision

    def _prepare_vectors(self, rows: Sequence[object], versions: object, lengths: object,
                         required_pages: Sequence[int] | np.ndarray | None) -> int:
        """``prepare(rows, versions=, lengths=)``: the batch checked whole and planned
        (:func:`~block_tables.vectors.plan_vector_rows`), then written (compared first:
        only changed bytes count as changes)."""
        plan = plan_vector_rows(rows, versions, lengths, required_pages,
                                capacity=self._rows, width=self._width,
                                pool_limit=self._check_limit, stored_keys=self._row_keys,
                                stored_lengths=self._lengths)
        n = len(rows)
        changed: Any = ()
        if plan.touched:
            changed = self._writer.write_rows(plan.appends, plan.shrunk, self._lengths,
                                              plan.lengths, plan.rewrites)
            self._row_keys[:n] = plan.keys
            self._lengths[:n] = plan.lengths
        self._book.num_rows = n
        self._book.keys = None
        self._book.all_versioned = True
        if changed:
            return self._bump(np.array(sorted(changed), dtype=np.int64))
        return self._book.revision
