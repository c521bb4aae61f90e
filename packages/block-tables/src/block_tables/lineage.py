"""BlockTable: one request's page IDs plus an append-lineage version.

A *lineage* is a sequence of page IDs that only ever grows at its end. Every table in a
lineage carries the lineage's version, and the version promises one thing to a snapshot:
two tables with the same version agree on their common prefix. So ordered versions and
lengths identify a batch's page mapping without reading a single page ID.

* Appending keeps the version.
* Modifying, truncating or popping draws a new version from the process-wide monotonic
  source.
* :meth:`BlockTable.lineage_copy` shares the lineage (and, copy-on-write, the buffer): the
  copy and the original keep the version. Whichever appends first extends the lineage in
  place; the other, if it later appends too, would diverge, so it draws a new version and
  a private buffer instead.
* :meth:`BlockTable.copy` is independent: same IDs, new version, private buffer.

Versions are drawn per process, so a version alone means nothing outside the process that
drew it: a forked worker continues the parent's counter and draws the same numbers for
different rows. A pickled table therefore travels as (origin, version, IDs), where the
origin is a random 128-bit tag of the drawing process (redrawn in every forked child), and
the receiving process translates each (origin, version) into a version of its own:

* the rows of one sender's lineage keep one local version however often they arrive, so
  a worker decoding a growing row every step prepares it as an append (the spec's "the
  decoder copies a growing row while preserving that lineage");
* a received table never extends that lineage itself: its first append or change draws a
  new version, so two copies received from the same bytes (or a round trip through pickle
  in one process) that then diverge never pass as a hit;
* a same-process round trip also gets a local version distinct from the original's, since
  the original may go on appending under its own.

The translation table keeps the last ``RECEIVED_LINEAGES`` lineages; a forgotten one only
costs a row comparison when it arrives again.

The version and length are packed into one int (``_key``) so a snapshot reads a whole
batch's mapping in one attribute access per row.
"""

from __future__ import annotations

import itertools
import operator
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any, SupportsIndex, overload

import numpy as np

from .errors import RowWidthError, VersionExhaustedError
from .validation import Int32Array, coerce_page_id, coerce_page_ids

LENGTH_BITS = 24
"""Bits of ``_key`` that hold a table's length; the rest hold its version."""

MAX_ROW_LENGTH = (1 << LENGTH_BITS) - 1
"""Most page IDs one BlockTable can hold (16,777,215)."""

MAX_VERSION = (1 << (63 - LENGTH_BITS)) - 1
"""Largest version the packed int64 key can encode (about 5.5e11 versions per process)."""

LENGTH_MASK = MAX_ROW_LENGTH
UNVERSIONED = 0  # a row's version when written from an array or list (below any drawn)

_MIN_CAPACITY = 16


class _VersionSource:
    """Process-wide monotonic version counter; versions start at 1 and never repeat."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)
        self._lock = threading.Lock()

    def draw(self) -> int:
        with self._lock:
            version = next(self._counter)
        if version > MAX_VERSION:
            raise VersionExhaustedError(
                f"the block-table version source passed {MAX_VERSION}; restart the process"
            )
        return version


_VERSIONS = _VersionSource()


def draw_version() -> int:
    """Draw a fresh version from the process-wide monotonic source."""
    return _VERSIONS.draw()


RECEIVED_LINEAGES = 1 << 16
"""How many received (origin, version) lineages a process remembers (see the docstring)."""

_origin = os.urandom(16)
_received: dict[tuple[bytes, int], int] = {}
_received_lock = threading.Lock()


def _new_origin() -> None:
    # A forked child continues the parent's version counter: its versions must not be
    # confused with the parent's once either side pickles a table.
    global _origin
    _origin = os.urandom(16)
    _received.clear()
    _VERSIONS._lock = threading.Lock()  # the parent's lock may have been held at fork


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_origin)


def _local_version(origin: bytes, version: int) -> int:
    """This process's version for a received lineage (the same one for every arrival)."""
    key = (origin, version)
    with _received_lock:
        local = _received.get(key)
        if local is None:
            if len(_received) >= RECEIVED_LINEAGES:
                del _received[next(iter(_received))]  # the oldest: dicts keep insertion order
            local = _received[key] = draw_version()
    return local


def _received_table(origin: bytes, version: int, ids: np.ndarray) -> BlockTable:
    """Unpickle a :class:`BlockTable` (see "Versions are drawn per process" above)."""
    ids = coerce_page_ids(ids)
    n = ids.shape[0]
    _check_length(n)
    lin = _Lineage(_local_version(origin, version), _buffer(ids, n), n)
    # Shared, and never the one that appended last: the first append or change by this
    # process draws a new version instead of extending the sender's lineage.
    lin.shared = True
    lin.used = -1
    return BlockTable._from_lineage(lin, n)


class _Lineage:
    """State shared by the tables of one lineage.

    ``ids[:used]`` is the longest content any member appended; every member's IDs are a
    prefix of it, and those positions are never written again under this version.
    ``shared`` becomes True at the first lineage copy and stays True; a table whose lineage
    is not shared is its only holder and may modify it in place (drawing a new version).
    ``proof_len``/``proof_limit`` record that ``ids[:proof_len]`` lie in
    ``[0, proof_limit)``; snapshots use it to skip revalidating a prefix.
    """

    __slots__ = ("ids", "proof_len", "proof_limit", "shared", "used", "version")

    def __init__(self, version: int, ids: Int32Array, used: int) -> None:
        self.version = version
        self.ids = ids
        self.used = used
        self.shared = False
        self.proof_len = 0
        self.proof_limit = 0


def _buffer(ids: Int32Array, capacity: int) -> Int32Array:
    buf = np.empty(max(capacity, _MIN_CAPACITY), dtype=np.int32)
    buf[: ids.shape[0]] = ids
    return buf


class BlockTable:
    """One request's page IDs (int32) plus an append-lineage version.

    ``len(table)`` and ``table.version`` are plain attribute reads. Appends are amortised
    O(added). Page IDs are int32; their range against a KV pool is checked by the
    snapshot (``pool_limit``), not here.
    """

    __slots__ = ("__weakref__", "_key", "_last", "_len", "_lin")

    _key: int
    _last: int
    _len: int
    _lin: _Lineage

    def __init__(self, page_ids: Iterable[int] | np.ndarray = (), *, capacity: int = 0) -> None:
        ids = coerce_page_ids(page_ids if isinstance(page_ids, (np.ndarray, list, tuple, range))
                              else list(page_ids))
        n = ids.shape[0]
        _check_length(n)
        self._set(_Lineage(draw_version(), _buffer(ids, max(capacity, n)), n), n)

    # -- internal -------------------------------------------------------------------------

    def _set(self, lin: _Lineage, length: int) -> None:
        self._lin = lin
        self._len = length
        self._key = (lin.version << LENGTH_BITS) | length
        self._last = int(lin.ids[length - 1]) if length else 0

    @classmethod
    def _from_lineage(cls, lin: _Lineage, length: int) -> BlockTable:
        table = cls.__new__(cls)
        table._set(lin, length)
        return table

    def _writable_lineage(self, keep: int) -> _Lineage:
        """Lineage holding our first ``keep`` IDs, private and under a new version, for
        the caller to modify in place (a shared buffer is copied first)."""
        lin = self._lin
        n = keep
        if lin.shared:
            lin = _Lineage(draw_version(), _buffer(lin.ids[:n], lin.ids.shape[0]), n)
        else:
            lin.version = draw_version()
            lin.proof_len = 0
            lin.proof_limit = 0
            lin.used = n
        return lin

    def _extend_lineage(self, added: int) -> _Lineage:
        """Lineage whose buffer can take ``added`` IDs at ``self._len``, keeping the version
        unless another member of a shared lineage already appended past our end."""
        n = self._len
        new = n + added
        _check_length(new)
        lin = self._lin
        if lin.used != n:
            # Only a shared lineage gets here: another member appended past our end, and
            # our IDs would diverge from its under the same version.
            lin = _Lineage(draw_version(), _buffer(lin.ids[:n], 2 * new), n)
        elif new > lin.ids.shape[0]:
            # Growing the buffer in place keeps every member's view of its prefix valid.
            lin.ids = _buffer(lin.ids[:n], 2 * new)
        return lin

    # -- reading --------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Append-lineage version: kept by appends, redrawn by any other change."""
        return self._key >> LENGTH_BITS

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: SupportsIndex) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Int32Array: ...

    def __getitem__(self, index: SupportsIndex | slice) -> int | Int32Array:
        view = self._lin.ids[: self._len]
        if isinstance(index, slice):
            return view[index].copy()
        return int(view[_normalise(index, self._len)])

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def tolist(self) -> list[int]:
        """The page IDs as a new list of ints."""
        return self._lin.ids[: self._len].tolist()

    def to_numpy(self) -> Int32Array:
        """The page IDs as a new int32 array (a copy)."""
        return self._lin.ids[: self._len].copy()

    def page_ids_view(self) -> Int32Array:
        """Read-only int32 view of the page IDs, valid until this table next changes.

        For preparation code that copies IDs out immediately; never keep it.
        """
        view = self._lin.ids[: self._len]
        view.flags.writeable = False
        return view

    def __repr__(self) -> str:
        head = self._lin.ids[: min(self._len, 8)].tolist()
        more = ", ..." if self._len > 8 else ""
        return f"BlockTable(version={self.version}, len={self._len}, ids={head}{more})"

    # -- appending (keeps the version) ----------------------------------------------------

    def append(self, page_ids: Iterable[int] | np.ndarray) -> None:
        """Append page IDs at the end; keeps the version (see the module docstring)."""
        ids = coerce_page_ids(page_ids if isinstance(page_ids, (np.ndarray, list, tuple, range))
                              else list(page_ids))
        added = ids.shape[0]
        if added == 0:
            return
        n = self._len
        lin = self._extend_lineage(added)
        lin.ids[n : n + added] = ids
        lin.used = n + added
        self._lin = lin
        self._len = n + added
        self._key = (lin.version << LENGTH_BITS) | (n + added)
        self._last = int(ids[-1])

    def append_one(self, page_id: int) -> None:
        """Append one page ID; keeps the version."""
        pid = coerce_page_id(page_id)
        n = self._len
        lin = self._extend_lineage(1)
        lin.ids[n] = pid
        lin.used = n + 1
        self._lin = lin
        self._len = n + 1
        self._key = (lin.version << LENGTH_BITS) | (n + 1)
        self._last = pid

    # -- modifying (draws a new version) --------------------------------------------------

    def __setitem__(self, index: SupportsIndex | slice, value: Any) -> None:
        """Overwrite existing IDs (the length never changes); draws a new version."""
        n = self._len
        if isinstance(index, slice):
            targets = range(n)[index]
            ids = coerce_page_ids(value) if not isinstance(value, (int, np.integer)) else None
            if ids is not None and ids.shape[0] != len(targets):
                raise ValueError(
                    f"cannot assign {ids.shape[0]} page IDs to a slice of {len(targets)}; "
                    "use append or truncate to change the length"
                )
            scalar = coerce_page_id(value) if ids is None else 0
            lin = self._writable_lineage(n)
            lin.ids[:n][index] = scalar if ids is None else ids
        else:
            i = _normalise(index, n)
            pid = coerce_page_id(value)
            lin = self._writable_lineage(n)
            lin.ids[i] = pid
        self._set(lin, n)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` IDs; draws a new version unless nothing is removed."""
        length = operator.index(length)
        if length < 0 or length > self._len:
            raise IndexError(f"cannot truncate a BlockTable of length {self._len} to {length}")
        if length == self._len:
            return
        self._set(self._writable_lineage(length), length)

    def clear(self) -> None:
        """Remove every ID; draws a new version unless the table is already empty."""
        self.truncate(0)

    def pop(self, index: SupportsIndex = -1) -> int:
        """Remove and return the ID at ``index``; draws a new version."""
        n = self._len
        i = _normalise(index, n)
        lin = self._writable_lineage(n)
        value = int(lin.ids[i])
        lin.ids[i : n - 1] = lin.ids[i + 1 : n]
        lin.used = n - 1
        self._set(lin, n - 1)
        return value

    # -- copying --------------------------------------------------------------------------

    def lineage_copy(self) -> BlockTable:
        """A copy in the same lineage (same version); O(1), copy-on-write.

        Appending to either keeps both correct: the first to append extends the lineage,
        the other draws a new version when it appends too. Neither ever sees the other's
        later changes.
        """
        self._lin.shared = True
        return BlockTable._from_lineage(self._lin, self._len)

    def copy(self) -> BlockTable:
        """An independent copy: same IDs, a new version, a private buffer."""
        n = self._len
        lin = _Lineage(draw_version(), _buffer(self._lin.ids[:n], n), n)
        return BlockTable._from_lineage(lin, n)

    def __copy__(self) -> BlockTable:
        return self.copy()

    def __deepcopy__(self, memo: dict[int, Any]) -> BlockTable:
        return self.copy()

    def __reduce__(self) -> tuple[Any, tuple[bytes, int, Int32Array]]:
        """Pickle as (origin, version, IDs): the receiver keeps a growing row's lineage and
        never lets diverging copies share a version (module docstring)."""
        return _received_table, (_origin, self.version, self._lin.ids[: self._len].copy())


def _normalise(index: SupportsIndex, length: int) -> int:
    i = operator.index(index)
    if i < 0:
        i += length
    if i < 0 or i >= length:
        raise IndexError(f"page index {operator.index(index)} out of range for length {length}")
    return i


def _check_length(length: int) -> None:
    if length > MAX_ROW_LENGTH:
        raise RowWidthError(
            f"a BlockTable holds at most {MAX_ROW_LENGTH} page IDs, asked for {length}"
        )
