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

Because every known row is kept in that form, no tail ever needs a full-width clear: a
full-width row is copied without clearing first, and a row replaced by a shorter one
clears only the columns its previous content occupied. Rows of unknown content (never
prepared, or after :meth:`PageTableSnapshot.invalidate`) are compared and cleared over the
whole width the first time a batch covers them. When a prepare replaces every row of its
batch (a new batch mapping), the rows' IDs are copied first and then every exposed tail
is cleared in one pass over the storage (one compiled sweep), not row by row.

A rejected batch (any :class:`~block_tables.errors.BlockTableError`) is rejected before the
first write and changes nothing. The revision counts byte changes: it advances by one
exactly when a prepare changed at least one storage byte.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import (
    PageIdRangeError,
    ReservedPageError,
    RowCountError,
    RowTypeError,
    RowWidthError,
    StorageError,
)
from .lineage import LENGTH_BITS, LENGTH_MASK, UNVERSIONED, BlockTable, _Lineage
from .native import require_extension
from .spans import ChangedRows, changed_byte_ranges
from .validation import (
    INT32_MAX,
    INT32_MIN,
    NO_POOL_LIMIT,
    Int32Array,
    Int64Array,
    check_page_range,
    check_required_pages,
    coerce_page_ids,
    raise_scalar_range_error,
)
from .vectors import plan_vector_rows

MAX_WIDTH = (1 << (LENGTH_BITS - 1)) - 1
"""Widest storage a snapshot accepts. Keeping widths below half the key's length field
means two row keys differ by at most ``width`` exactly when their versions are equal."""

UNKNOWN = -1
"""Stored version of a row whose bytes the snapshot does not know."""

_INCOMING_UNVERSIONED = -2  # never equal to a stored version, so such rows always compare

Rows = Sequence[BlockTable | np.ndarray | Sequence[int]]

# the compiled paths (_snapshot.pyx): the common decode step, the write of a fully
# replaced batch and the all-versioned key diffs; required (NativeBuildError without it)
_native = require_extension("block_tables._snapshot_native")
_native.configure(BlockTable, LENGTH_BITS, _Lineage)

# the fields of a snapshot's bookkeeping array (_snapshot.pyx: META_*)
_REVISION, _NUM_ROWS, _ALL_VERSIONED, _KEYS_VALID = range(4)
_META_SIZE = 4


def _key(version: int, length: int) -> int:
    return (version << LENGTH_BITS) + length


def _ranges(rows: Int64Array) -> tuple[tuple[int, int], ...]:
    """Merge sorted unique row indices into half-open ranges."""
    if rows.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate(([rows[0]], rows[breaks])).tolist()
    stops = (np.concatenate((rows[breaks - 1], [rows[-1]])) + 1).tolist()
    return tuple(zip(starts, stops, strict=True))


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
        _check_arguments(storage, pool_limit, fill_value, history, reserved_page)
        rows, width = storage.shape
        self._storage = storage
        self._flat = storage.reshape(-1)  # fixed flat view for single-page scatters
        self._rows = int(rows)
        self._width = int(width)
        self._limit = None if pool_limit is None else int(pool_limit)
        # the bound every ID is checked against: the pool limit, or [0, 2**31) without one
        self._check_limit = NO_POOL_LIMIT if pool_limit is None else int(pool_limit)
        self._fill = int(fill_value)
        # -1: no reserved page (a page ID is >= 0)
        self._reserved = -1 if reserved_page is None else int(reserved_page)
        # Byte comparisons (tobytes) beat numpy reductions several times on row slices.
        self._fill_row = np.full(width, fill_value, dtype=np.int32)
        self._unknown_key = _key(UNKNOWN, width)
        # Per storage row: packed (version, length) of the content it holds, and the
        # length alone. Unknown rows count as dirty over the full width.
        self._row_keys: Int64Array = np.full(rows, self._unknown_key, dtype=np.int64)
        self._lengths: Int64Array = np.full(rows, width, dtype=np.int64)
        self._lengths_u = self._lengths.view(np.uint64)
        self._row_base: Int64Array = np.arange(rows, dtype=np.int64) * width
        self._ones = np.ones(rows, dtype=np.int64).tobytes()
        self._no_bytes = bytes(rows)
        # packed keys of the last batch prepared by _prepare_changed: its hit test for
        # batches the compiled step hands back (valid while _meta says so)
        self._key_list: list[int] | None = None
        # The bookkeeping a step changes, as int64 fields the compiled step writes (no int
        # object per step): revision, rows of the last batch, whether every row of it was
        # a BlockTable (equal keys then mean equal bytes), whether _key_list describes it.
        self._meta = np.zeros(_META_SIZE, dtype=np.int64)
        # The history ring: revision r's changed rows are the first _hist_count[r % history]
        # items of _hist_rows[r % history] (-1: every row); revisions are consecutive, so
        # the last `history` of them are always there.
        self._history_len = int(history)
        self._hist_count = np.zeros(history, dtype=np.int64)
        self._hist_rows = np.zeros((history, rows), dtype=np.int64)
        # the compiled paths, bound once to the arrays above and their own scratch
        # (changed rows, new keys)
        self._changed_out = np.empty(rows, dtype=np.int64)
        self._limit_arg = self._check_limit
        self._native = _native
        self._bound = _native.bind(
            self._row_keys, self._lengths, self._flat, self._changed_out,
            np.empty(3 * rows, dtype=np.int64), int(width), self._meta, self._hist_count,
            self._hist_rows, self._reserved)
        self._cleared = 0  # elements tail clears changed to the fill value (diagnostic)
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
        return self._limit_arg

    @property
    def all_versioned(self) -> bool:
        """Whether every row of the last prepared batch came from a BlockTable: equal keys
        then mean equal bytes, and a key diff needs no history."""
        return bool(self._meta[_ALL_VERSIONED])

    # -- the bookkeeping, as the Python paths read and write it -----------------------------

    @property
    def _revision(self) -> int:
        return int(self._meta[_REVISION])

    @property
    def _num_rows(self) -> int:
        return int(self._meta[_NUM_ROWS])

    @_num_rows.setter
    def _num_rows(self, n: int) -> None:
        self._meta[_NUM_ROWS] = n

    @property
    def _all_versioned(self) -> bool:
        return bool(self._meta[_ALL_VERSIONED])

    @_all_versioned.setter
    def _all_versioned(self, value: bool) -> None:
        self._meta[_ALL_VERSIONED] = bool(value)

    @property
    def _keys(self) -> list[int] | None:
        return self._key_list if self._meta[_KEYS_VALID] else None

    @_keys.setter
    def _keys(self, keys: list[int] | None) -> None:
        self._key_list = keys
        self._meta[_KEYS_VALID] = keys is not None

    def _bump(self, rows: Int64Array | None) -> int:
        """The next revision changed ``rows`` (sorted, distinct) or every row (None):
        advance the revision and record it in the history; return it."""
        return int(self._native.record_revision(
            self._bound, None if rows is None else np.ascontiguousarray(rows, np.int64)))

    @property
    def _history(self) -> list[tuple[int, Int64Array | None]]:
        """The recorded revisions, oldest first: (revision, changed rows or None)."""
        rev, n = self._revision, self._history_len
        out: list[tuple[int, Int64Array | None]] = []
        for r in range(max(1, rev - n + 1), rev + 1):
            count = int(self._hist_count[r % n])
            out.append((r, None if count < 0 else self._hist_rows[r % n, :count].copy()))
        return out

    # -- reading --------------------------------------------------------------------------

    @property
    def storage(self) -> np.ndarray:
        """The caller's storage (the same object that was passed in)."""
        return self._storage

    @property
    def revision(self) -> int:
        """Prepared revision: advances by one exactly when a prepare changes storage bytes."""
        return self._revision

    @property
    def num_rows(self) -> int:
        """Rows of the last prepared batch: the snapshot is storage rows ``[0, num_rows)``."""
        return self._num_rows

    @property
    def row_lengths(self) -> Int64Array:
        """Page counts of rows ``[0, num_rows)`` (a read-only copy)."""
        lengths = self._lengths[: self._num_rows].copy()
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
        return self._cleared

    @property
    def meta_address(self) -> int:
        """Address of the snapshot's int64 bookkeeping fields, for compiled readers that
        must not box them: the prepared revision at index 0, the last batch's rows at 1,
        and at 2 whether every row of it was a :class:`BlockTable`. Valid while the
        snapshot lives; read-only for callers."""
        return int(self._meta.ctypes.data)

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
        if self._all_versioned:
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
        current = self._revision
        if revision == current:
            return ChangedRows(())
        # Revisions are consecutive, one ring entry each: the last `history` are recorded.
        n = self._history_len
        if revision > current or revision < 0 or current - revision > n:
            return self._all_rows()
        parts: list[Int64Array] = []
        for rev in range(revision + 1, current + 1):
            count = int(self._hist_count[rev % n])
            if count < 0:
                return self._all_rows()
            parts.append(self._hist_rows[rev % n, :count])
        merged = parts[0] if len(parts) == 1 else np.unique(np.concatenate(parts))
        return ChangedRows(_ranges(merged[merged < self._num_rows]))

    def _all_rows(self) -> ChangedRows:
        n = self._num_rows
        return ChangedRows(((0, n),) if n else (), all_rows=True)

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
        if type(rows) not in (list, tuple) and not isinstance(rows, (Sequence, np.ndarray)):
            # refused on every path, hits included (an iterator would be consumed by the
            # hit test and then read as empty)
            raise RowTypeError(
                f"rows must be an ordered sequence (list or tuple), got {type(rows).__name__}"
            )
        if padding and (type(padding) is not int or not 0 <= padding <= len(rows)):
            raise RowCountError(
                f"padding={padding!r} must be an int in [0, {len(rows)}] (the batch's last "
                "rows that are graph padding)")
        if versions is not None or lengths is not None:
            if versions is None or lengths is None:
                raise RowTypeError("pass versions and lengths together (one of them is None)")
            if self._reserved >= 0:
                raise RowTypeError(
                    "a snapshot with a reserved page checks each row's pages as they "
                    "arrive; prepare it from rows, without versions and lengths")
            return self._prepare_vectors(rows, versions, lengths, required_pages)
        # The common decode and prefill-chunk steps (hits and appends of versioned rows)
        # in one compiled call; None means "not covered", and nothing was written.
        # It records the revision and the bookkeeping itself.
        if self._native.prepare_step(self._bound, rows, self._limit_arg, required_pages) >= 0:
            return self._revision
        # Handed back: another container or row kind, an unset or odd slot, a change other
        # than a one-page append, required pages the compiled step does not read, or an
        # error to report. The checks, messages and other write paths live here.
        try:
            keys = [row._key for row in rows]  # type: ignore[union-attr]
        except AttributeError:
            keys = None
        if keys is not None and keys == self._keys:
            # Hit: same ordered versions and lengths, so the same bytes; no page ID is read.
            if required_pages is not None:
                n = self._num_rows
                check_required_pages(required_pages, self._lengths[:n], self._lengths_u[:n])
            return self._revision
        return self._prepare_changed(rows, keys, required_pages, len(rows) - padding)

    def invalidate(self) -> None:
        """Forget what the storage holds, after something wrote it outside ``prepare``.

        Advances the revision and empties the snapshot (``num_rows`` becomes 0); the next
        prepare compares every row it covers against the whole width.
        """
        self._row_keys.fill(self._unknown_key)
        self._lengths.fill(self._width)
        self._keys = None
        self._all_versioned = False
        self._num_rows = 0
        self._bump(None)

    def _prepare_changed(
        self,
        rows: Rows,
        keys: list[int] | None,
        required_pages: Sequence[int] | np.ndarray | None,
        real: int | None = None,
    ) -> int:
        """Prepare a batch the compiled step handed back; rows ``[0, real)`` are real
        (None: all), the only ones checked against the reserved page."""
        if type(rows) not in (list, tuple) and not isinstance(rows, (Sequence, np.ndarray)):
            raise RowTypeError(
                f"rows must be an ordered sequence (list or tuple), got {type(rows).__name__}"
            )
        n = len(rows)
        if n > self._rows:
            raise RowCountError(
                f"the batch has {n} rows but the storage holds {self._rows}; split the "
                "batch or allocate a larger block table"
            )
        limit = self._check_limit
        width = self._width
        reserved = self._reserved
        real_rows = n if real is None else real

        # ---- read the batch: packed (version, length) keys, unversioned IDs -------------
        unversioned: dict[int, Int32Array] | None = None
        deferred: PageIdRangeError | None = None
        if keys is None:
            unversioned = {}
            keys_read: list[int] = []
            for i, row in enumerate(rows):
                if isinstance(row, BlockTable):
                    keys_read.append(row._key)
                else:
                    try:
                        ids = coerce_page_ids(row, row=i)
                    except PageIdRangeError as exc:
                        # an ID error: reported after every row's type and width checks
                        deferred = deferred or exc
                        ids = np.zeros(len(row), dtype=np.int32)
                    unversioned[i] = ids
                    keys_read.append(_key(_INCOMING_UNVERSIONED, ids.shape[0]))
            packed = np.array(keys_read, dtype=np.int64)
        else:
            packed = np.fromiter(keys, dtype=np.int64, count=n)
        lengths = packed & LENGTH_MASK
        if n and int(lengths.max()) > width:
            row_index = int(np.flatnonzero(lengths > width)[0])
            raise RowWidthError(
                f"row {row_index}: {int(lengths[row_index])} page IDs exceed the table width "
                f"of {width} columns; allocate a wider block table",
                row=row_index,
            )
        if required_pages is not None:
            check_required_pages(required_pages, lengths, lengths.view(np.uint64))
        if deferred is not None:
            raise deferred

        # ---- classify against the stored rows --------------------------------------------
        # With width < 2**23, a key difference within [-width, width] means the same
        # version, and the difference is the length change.
        stored_lengths = self._lengths[:n]
        delta = packed - self._row_keys[:n]
        touched = np.flatnonzero(delta)
        touched_delta = delta[touched]
        single: Int64Array
        moved: list[int] = []
        shrunk: list[int] = []
        multi: list[tuple[int, int, int, Int32Array]] = []
        if touched_delta.tobytes() == self._ones[: 8 * touched.size]:
            # The common step: every changed row grew by exactly one page.
            single = touched
        else:
            same = np.abs(touched_delta) <= width
            moved = touched[~same].tolist()
            grown = same & (touched_delta > 0)
            single = touched[grown & (touched_delta == 1)]
            shrunk = touched[same & (touched_delta < 0)].tolist()
            for i in touched[grown & (touched_delta > 1)].tolist():
                table: BlockTable = rows[i]
                start = int(stored_lengths[i])
                stop = int(lengths[i])
                ids = table._lin.ids
                checked = max(start, _proof(table, limit))
                check_page_range(ids[checked:stop], row=i, start=checked, pool_limit=limit)
                if i < real_rows:
                    _check_reserved(ids[start:stop], i, start, reserved)
                multi.append((i, start, stop, ids))

        single_values: Int32Array | None = None
        if single.size:
            # Single-page suffixes: one scalar per row, checked and scattered at once.
            if single.size == n:
                lasts = [table._last for table in rows]  # type: ignore[union-attr]
            else:
                lasts = [rows[i]._last for i in single.tolist()]
            single_values = np.fromiter(lasts, dtype=np.int32, count=single.size)
            if int(single_values.view(np.uint32).max()) >= limit:
                raise_scalar_range_error(single_values, single, stored_lengths[single], limit)
            if reserved >= 0:
                hit = np.flatnonzero((single_values == reserved) & (single < real_rows))
                if hit.size:
                    k = int(hit[0])
                    _refuse_reserved(int(single[k]), int(stored_lengths[single[k]]),
                                     reserved)

        # Changed mapping: new version, reordered, unversioned or unknown rows.
        rewrites: list[tuple[int, Int32Array, int]] = []
        key_fixes: list[tuple[int, int]] = []
        proofs: list[tuple[BlockTable, int]] = []
        if moved:
            unproven: list[tuple[int, int, Int32Array, int]] = []
            stored_length_list = stored_lengths.tolist()
            length_list = lengths.tolist()
            for i in moved:
                old_length = stored_length_list[i]
                if unversioned is not None and i in unversioned:
                    ids = unversioned[i]
                    length = ids.shape[0]
                    if i < real_rows:  # the same bytes may have been a padding row's
                        _check_reserved(ids, i, 0, reserved)
                    stored_key = int(self._row_keys[i])
                    if (
                        stored_key >> LENGTH_BITS != UNKNOWN
                        and old_length == length
                        and self._storage[i, :length].tobytes() == ids.tobytes()
                    ):
                        # Same bytes: the stored key still describes them; keep it.
                        key_fixes.append((i, stored_key))
                        continue
                    check_page_range(ids, row=i, start=0, pool_limit=limit)
                    rewrites.append((i, ids, old_length))
                    key_fixes.append((i, _key(UNVERSIONED, length)))
                    continue
                table = rows[i]  # type: ignore[assignment]
                length = length_list[i]
                ids = table._lin.ids[:length]
                if i < real_rows:
                    _check_reserved(ids, i, 0, reserved)
                proven = min(_proof(table, limit), length)
                if proven < length:
                    unproven.append((i, proven, ids, length))
                proofs.append((table, length))
                rewrites.append((i, ids, old_length))
            if unproven:
                self._check_unproven(unproven, packed, limit)

        # ---- write: every check has passed ----------------------------------------------
        changed_arrays: list[Int64Array] = []
        if single_values is not None:
            written = self._write_single(single, stored_lengths[single], single_values)
            if written.size:
                changed_arrays.append(written)
        changed = self._write_rows(multi, shrunk, stored_lengths, lengths, rewrites)

        # ---- record ----------------------------------------------------------------------
        if touched.size:
            self._row_keys[:n] = packed
            self._lengths[:n] = lengths
            for i, key in key_fixes:
                self._row_keys[i] = key
        for table, length in proofs:
            _record_proof(table, length, limit)
        for i, _start, stop, _ids in multi:
            _record_proof(rows[i], stop, limit)  # type: ignore[arg-type]
        self._keys = keys
        self._all_versioned = keys is not None
        self._num_rows = n
        if changed:
            changed_arrays.append(np.array(changed, dtype=np.int64))
        if changed_arrays:
            rows_changed = (
                changed_arrays[0]
                if len(changed_arrays) == 1 and not changed
                else np.unique(np.concatenate(changed_arrays))
            )
            return self._bump(rows_changed)
        return self._revision

    def _write_single(
        self, rows: Int64Array, columns: Int64Array, values: Int32Array
    ) -> Int64Array:
        """Scatter one page ID per row; return the rows whose byte changed."""
        flat_index = self._row_base[rows] + columns
        equal = self._flat[flat_index] == values
        if equal.tobytes() == self._no_bytes[: rows.size]:
            self._flat[flat_index] = values
            return rows
        differs = ~equal
        self._flat[flat_index[differs]] = values[differs]
        return rows[differs]

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
            changed = self._write_rows(plan.appends, plan.shrunk, self._lengths, plan.lengths,
                                       plan.rewrites)
            self._row_keys[:n] = plan.keys
            self._lengths[:n] = plan.lengths
        self._num_rows = n
        self._keys = None
        self._all_versioned = True
        if changed:
            return self._bump(np.array(sorted(changed), dtype=np.int64))
        return self._revision

    def _write_rows(
        self,
        multi: list[tuple[int, int, int, Int32Array]],
        shrunk: list[int],
        stored_lengths: Int64Array,
        lengths: Int64Array,
        rewrites: list[tuple[int, Int32Array, int]],
    ) -> list[int]:
        """Row-wise writes; each compares first so only changed bytes count as changes.

        ``rewrites`` lists rows in ascending order, each once; when it holds every row of
        the batch (``len(lengths)``), the batch is fully replaced: :meth:`_write_replaced`.
        """
        if rewrites and len(rewrites) == lengths.shape[0] and not multi and not shrunk:
            return self._write_replaced(rewrites)
        storage = self._storage
        changed: list[int] = []
        for i, start, stop, ids in multi:
            target = storage[i, start:stop]
            source = ids[start:stop]
            if target.tobytes() != source.tobytes():
                target[...] = source
                changed.append(i)
        for i in shrunk:
            if self._clear_tail(i, int(lengths[i]), int(stored_lengths[i])):
                changed.append(i)
        for i, ids, old_length in rewrites:
            # Copy without clearing first; then clear only what the old content occupied.
            length = ids.shape[0]
            row_changed = False
            target = storage[i, :length]
            if target.tobytes() != ids.tobytes():
                target[...] = ids
                row_changed = True
            if old_length > length and self._clear_tail(i, length, old_length):
                row_changed = True
            if row_changed:
                changed.append(i)
        return changed

    def _clear_tail(self, row: int, start: int, stop: int) -> bool:
        """Set columns ``[start, stop)`` of ``row`` to the fill value; False when they
        already held it (nothing written)."""
        tail = self._storage[row, start:stop]
        if tail.tobytes() == self._fill_row[: stop - start].tobytes():
            return False
        self._cleared += int(np.count_nonzero(tail != self._fill))
        tail.fill(self._fill)
        return True

    def _write_replaced(self, rewrites: list[tuple[int, Int32Array, int]]) -> list[int]:
        """Write a fully replaced batch: ``rewrites`` holds rows ``0..n-1`` in order.

        One compiled call (``write_replaced``): each row's IDs are copied without clearing
        first (compared first); then every exposed tail (columns ``[new length, stored
        length)``, the part of the old content the new one no longer covers) is cleared in
        one sweep over the storage. Only elements that differ from the fill value are
        written and counted.
        """
        ids = [r[1] for r in rewrites]
        done = self._native.write_replaced(self._bound, ids, self._fill)
        if done is None:
            # An ID array the sweep does not read in place: a strided or misaligned view
            # of the caller's array (coerce_page_ids keeps int32 arrays as they are). The
            # same sweep over contiguous copies, made before any write.
            done = self._native.write_replaced(self._bound, [a.copy() for a in ids],
                                               self._fill)
        rows, cleared = done
        self._cleared += cleared
        return rows.tolist()

    def _check_unproven(
        self,
        unproven: list[tuple[int, int, Int32Array, int]],
        packed: Int64Array,
        limit: int,
    ) -> None:
        """Range-check moved rows past what their lineage proof covers.

        A prefix of the same lineage already held by any storage row was validated when it
        was written (under this snapshot's pool limit), so checking resumes after the
        longest such prefix: this is how the proof follows a lineage across reordering.
        """
        stored_versions = self._row_keys >> LENGTH_BITS
        order = np.lexsort((self._lengths, stored_versions))
        sorted_versions = stored_versions[order]
        sorted_lengths = self._lengths[order]
        index = np.array([item[0] for item in unproven], dtype=np.int64)
        query = packed[index] >> LENGTH_BITS
        position = np.searchsorted(sorted_versions, query, side="right") - 1
        safe = np.maximum(position, 0)
        held = np.where(
            (position >= 0) & (sorted_versions[safe] == query), sorted_lengths[safe], 0
        ).tolist()
        for (i, proven, ids, length), known in zip(unproven, held, strict=True):
            start = max(proven, min(known, length))
            check_page_range(ids[start:length], row=i, start=start, pool_limit=limit)


def _check_reserved(ids: Int32Array, row: int, start: int, reserved: int) -> None:
    """Refuse real row ``row`` when ``ids`` (its columns from ``start``) hold the
    reserved page (``reserved`` < 0: none)."""
    if reserved >= 0 and ids.size:
        hit = np.flatnonzero(ids == reserved)
        if hit.size:
            _refuse_reserved(row, start + int(hit[0]), reserved)


def _refuse_reserved(row: int, column: int, reserved: int) -> None:
    raise ReservedPageError(
        f"row {row}: page ID {reserved} at column {column} is the table's reserved page "
        "(padding storage: only graph padding rows hold it); allocate the request's pages "
        "elsewhere", row=row)


def _check_arguments(
    storage: object, pool_limit: object, fill_value: object, history: int,
    reserved_page: object = None,
) -> None:
    if not isinstance(storage, np.ndarray):
        raise StorageError(f"storage must be a numpy int32 array, got {type(storage).__name__}")
    if storage.dtype != np.int32 or storage.ndim != 2:
        raise StorageError(
            f"storage must be 2-D int32, got {storage.ndim}-D {storage.dtype}; pass the CPU "
            "half of the block-table buffer as a [rows, width] int32 array"
        )
    if not storage.flags.c_contiguous or not storage.flags.writeable:
        raise StorageError(
            "storage must be C-contiguous and writeable: pass the buffer itself, not a "
            "transposed, strided or read-only view"
        )
    if storage.shape[1] > MAX_WIDTH:
        raise StorageError(f"storage width {storage.shape[1]} exceeds {MAX_WIDTH} columns")
    if pool_limit is not None and (
        isinstance(pool_limit, bool)
        or not isinstance(pool_limit, (int, np.integer))
        or not 1 <= int(pool_limit) <= INT32_MAX + 1
    ):
        raise StorageError(f"pool_limit must be None or an int in [1, 2**31], got {pool_limit!r}")
    if (
        isinstance(fill_value, bool)
        or not isinstance(fill_value, (int, np.integer))
        or not INT32_MIN <= int(fill_value) <= INT32_MAX
    ):
        raise StorageError(f"fill_value must be an int32, got {fill_value!r}")
    if history < 1:
        raise StorageError(f"history must keep at least 1 revision, got {history}")
    if reserved_page is not None:
        top = INT32_MAX if pool_limit is None else int(pool_limit) - 1
        if (isinstance(reserved_page, bool) or not isinstance(reserved_page, (int, np.integer))
                or not 0 <= int(reserved_page) <= top):
            raise StorageError(
                f"reserved_page must be None or a page ID in [0, {top}], got "
                f"{reserved_page!r}")


def _proof(table: BlockTable, limit: int) -> int:
    """Length of the prefix of ``table``'s lineage known to lie in ``[0, limit)``."""
    lin = table._lin
    return lin.proof_len if 0 < lin.proof_limit <= limit else 0


def _record_proof(table: BlockTable, length: int, limit: int) -> None:
    lin = table._lin
    if 0 < lin.proof_limit <= limit and lin.proof_len >= length:
        return  # the existing proof is at least as strong
    lin.proof_len = length
    lin.proof_limit = limit
