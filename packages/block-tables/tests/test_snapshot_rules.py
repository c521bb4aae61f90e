"""The snapshot's write rules that final bytes cannot show, on every write path.

"Full-width rows are copied without clearing the bytes they replace; fully replaced
batches clear exposed tails in one bytewise pass." A clear-then-copy and a row-by-row
clear leave the same bytes as the rules do, so the writers are watched: the row-by-row
numpy writes of snapshot.py (a batch that replaces some rows, appends several pages,
shrinks) through :class:`TrackedStorage`, an int32 array that logs every numpy write made
through it or a view of it (positions and values); the compiled sweep of a fully replaced
batch (``write_replaced``, _snapshot.pyx) through what it reports: ``cleared_elements``
(the elements its tail clears changed to the fill value), its one call per batch, and no
numpy write beside it. Every batch must also equal the naive full-width rebuild, and the
revisions and history tests/oracle_snapshot.py gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from oracle_snapshot import OracleRow, OracleSnapshot

from block_tables import BlockTable, PageTableSnapshot, draw_version

WIDTH = 16
FILL = -1  # no page ID: every write of it is a clear


# --------------------------------------------------------------------------------------
# a storage that records its writers
# --------------------------------------------------------------------------------------


class WriteLog:
    """Every write to one storage: ``(flat positions, values)`` per numpy operation."""

    def __init__(self, root: np.ndarray) -> None:
        self.address = root.ctypes.data
        self.nbytes = root.nbytes
        self.positions = np.arange(root.size, dtype=np.int64)
        self.ops: list[tuple[np.ndarray, np.ndarray]] = []

    def of(self, view: np.ndarray) -> np.ndarray | None:
        """Flat storage positions of ``view``'s elements (same shape), or None when
        ``view`` is not inside the storage (a copy made by fancy indexing)."""
        start = view.ctypes.data - self.address
        if view.size == 0 or not 0 <= start < self.nbytes:
            return None
        strides = tuple(s // view.itemsize * self.positions.itemsize for s in view.strides)
        return np.lib.stride_tricks.as_strided(
            self.positions[start // view.itemsize:], shape=view.shape, strides=strides)

    def record(self, view: np.ndarray, where: Any = None) -> None:
        pos = self.of(view)
        if pos is None:
            return
        plain = view.view(np.ndarray)
        if where is None:
            self.ops.append((pos.ravel().copy(), plain.ravel().copy()))
        else:
            mask = np.broadcast_to(where, view.shape)
            self.ops.append((pos[mask].copy(), plain[mask].copy()))

    def fills(self) -> list[set[int]]:
        """Positions of each operation that wrote only the fill value."""
        return [set(p.tolist()) for p, v in self.ops if v.size and (v == FILL).all()]

    def written(self) -> set[int]:
        return {int(x) for p, _v in self.ops for x in p}


class TrackedStorage(np.ndarray):
    """int32 storage whose views log writes: item assignment, ``fill``, ``np.copyto`` and
    ufuncs with an ``out`` in it. Any other array function that takes an ``out`` fails
    the test, so no write goes unseen."""

    log: WriteLog | None

    @classmethod
    def zeros(cls, shape: tuple[int, int]) -> TrackedStorage:
        root = np.zeros(shape, dtype=np.int32)
        tracked = root.view(cls)
        tracked.log = WriteLog(root)
        return tracked

    def __array_finalize__(self, obj: Any) -> None:
        self.log = getattr(obj, "log", None)

    def __setitem__(self, key: Any, value: Any) -> None:
        plain = self.view(np.ndarray)
        plain[key] = value
        positions = None if self.log is None else self.log.of(self)
        if positions is not None:  # None: a copy (fancy indexing), not the storage
            self.log.ops.append((np.atleast_1d(positions[key]).ravel().copy(),  # type: ignore[union-attr]
                                 np.atleast_1d(plain[key]).ravel().copy()))

    def fill(self, value: Any) -> None:
        self.view(np.ndarray).fill(value)
        if self.log is not None:
            self.log.record(self)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if func is np.copyto:
            dst = args[0]
            where = kwargs.get("where", args[3] if len(args) > 3 else True)
            plain = [a.view(np.ndarray) if isinstance(a, TrackedStorage) else a for a in args]
            np.copyto(*plain, **kwargs)
            if isinstance(dst, TrackedStorage) and dst.log is not None:
                dst.log.record(dst, None if where is True else where)
            return None
        if any(isinstance(v, TrackedStorage) for k, v in kwargs.items() if k == "out"):
            raise AssertionError(f"unlogged write through {func.__name__}(out=...)")
        return super().__array_function__(func, types, args, kwargs)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        plain = [i.view(np.ndarray) if isinstance(i, TrackedStorage) else i for i in inputs]
        out = kwargs.get("out")
        if out:
            kwargs["out"] = tuple(o.view(np.ndarray) if isinstance(o, TrackedStorage) else o
                                  for o in out)
        result = getattr(ufunc, method)(*plain, **kwargs)
        for o in out or ():
            if isinstance(o, TrackedStorage) and o.log is not None:
                o.log.record(o)
        return result


def test_the_tracked_storage_sees_each_kind_of_write() -> None:
    """The recorder itself: slices, fancy indices, fill, copyto and ufunc outputs."""
    s = TrackedStorage.zeros((3, 4))
    log = s.log
    assert log is not None
    s[1, 1:3] = [5, 6]
    s.reshape(-1)[np.array([0, 11])] = 9
    s[2].fill(FILL)
    np.copyto(s[0], FILL, where=np.array([False, True, False, True]))
    np.add(s[1], 1, out=s[1])
    s[0, 0] = 3
    assert [sorted(p.tolist()) for p, _v in log.ops] == [
        [5, 6], [0, 11], [8, 9, 10, 11], [1, 3], [4, 5, 6, 7], [0]]
    assert log.fills() == [{8, 9, 10, 11}, {1, 3}]
    assert s.view(np.ndarray).tolist() == [[3, FILL, 0, FILL], [1, 6, 7, 1],
                                           [FILL] * 4]


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def naive(lengths_and_ids: Sequence[Sequence[int]], width: int = WIDTH) -> np.ndarray:
    table = np.full((len(lengths_and_ids), width), FILL, dtype=np.int32)
    for i, ids in enumerate(lengths_and_ids):
        table[i, : len(ids)] = ids
    return table


def tables(*lengths: int, start: int = 1) -> list[BlockTable]:
    out = []
    for length in lengths:
        out.append(BlockTable(range(start, start + length)))
        start += length
    return out


def tail_positions(old: Sequence[int], new: Sequence[int], width: int = WIDTH) -> set[int]:
    """Flat positions of the columns ``[new[i], old[i])`` of each row."""
    return {i * width + c for i, (o, n) in enumerate(zip(old, new, strict=True))
            for c in range(n, o)}


def full_rows(rows: Sequence[Any], width: int = WIDTH) -> set[int]:
    """Flat positions of the rows that hold ``width`` IDs."""
    return {i * width + c for i, r in enumerate(rows) if len(r) == width for c in range(width)}


# --------------------------------------------------------------------------------------
# fully replaced batches: one pass over the exposed tails
# --------------------------------------------------------------------------------------


def counted_sweeps(snap: PageTableSnapshot, monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The results of every ``write_replaced`` call ``snap`` makes, in order."""
    native = snap._native
    calls: list[Any] = []
    real = native.write_replaced

    def counted(*args: Any) -> Any:
        result = real(*args)
        calls.append(result)
        return result

    monkeypatch.setattr(native, "write_replaced", counted)
    return calls


def history_of(snap: PageTableSnapshot) -> list[tuple[int, list[int] | None]]:
    return [(r, None if c is None else c.tolist()) for r, c in snap._book.history]


def test_fully_replaced_batch_is_one_compiled_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fully replaced batch is written by one ``write_replaced`` call and nothing else:
    no numpy write reaches the storage, the exposed tails (and only they) are cleared."""
    storage = TrackedStorage.zeros((8, WIDTH))
    log = storage.log
    assert log is not None
    snap = PageTableSnapshot(storage, fill_value=FILL)
    calls = counted_sweeps(snap, monkeypatch)
    first = tables(16, 9, 12, 3, 16, 7)
    snap.prepare(first)
    outside = storage.view(np.ndarray)[6:].copy()
    log.ops.clear()
    cleared = snap.cleared_elements
    second = tables(4, 16, 2, 3, 16, 0, start=300)  # every row a new version
    rev = snap.prepare(second)

    assert len(calls) == 2 and calls[-1] is not None
    assert log.ops == [], "a fully replaced batch is written by the compiled sweep alone"
    np.testing.assert_array_equal(storage.view(np.ndarray)[:6], naive(second))
    np.testing.assert_array_equal(storage.view(np.ndarray)[6:], outside)
    tails = tail_positions([16, 9, 12, 3, 16, 7], [4, 16, 2, 3, 16, 0])
    assert snap.cleared_elements - cleared == len(tails)
    assert snap.changed_rows_since(rev - 1).ranges == ((0, 6),)


def test_fully_replaced_batches_agree_with_the_oracle(monkeypatch: pytest.MonkeyPatch) -> None:
    storage = np.zeros((8, WIDTH), dtype=np.int32)
    snap = PageTableSnapshot(storage, fill_value=FILL)
    oracle = OracleSnapshot(storage.tolist(), fill=FILL, history=64)
    calls = counted_sweeps(snap, monkeypatch)
    first = tables(16, 9, 12, 3, 16, 7)
    second = tables(4, 16, 2, 3, 16, 0, start=300)
    for batch in (first, second, [BlockTable(r.tolist()) for r in second]):
        before = len(calls)
        rev = snap.prepare(batch)
        assert len(calls) == before + 1 and calls[-1] is not None  # the sweep wrote it
        assert rev == oracle.prepare([OracleRow(tuple(t.tolist()), t.version) for t in batch])
        assert storage.tolist() == oracle.storage
        assert history_of(snap) == list(oracle.history)
    np.testing.assert_array_equal(storage[:6], naive(second))
    np.testing.assert_array_equal(storage[6:], 0)  # never covered: untouched
    assert snap.cleared_elements == sum(WIDTH - len(t) for t in first) + len(
        tail_positions([16, 9, 12, 3, 16, 7], [4, 16, 2, 3, 16, 0]))
    # the same bytes under new versions: nothing written, no new revision
    assert len(snap._book.history) == 2


def test_a_strided_row_is_swept_from_a_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep reads C-contiguous int32 rows in place and hands back any other (None,
    nothing written); the snapshot then sweeps contiguous copies: the same bytes and
    counts as contiguous rows give."""
    results = []
    for strided in (False, True):
        storage = np.zeros((4, WIDTH), dtype=np.int32)
        snap = PageTableSnapshot(storage, fill_value=FILL)
        calls = counted_sweeps(snap, monkeypatch)
        snap.prepare(tables(10, 3, 16))
        ids = np.arange(50, 62, dtype=np.int32)
        rows: list[Any] = [np.repeat(ids, 2)[::2] if strided else ids, [7, 8], list(range(16))]
        calls.clear()
        rev = snap.prepare(rows)
        assert [c is None for c in calls] == ([True, False] if strided else [False])
        np.testing.assert_array_equal(storage[:3], naive([ids.tolist(), [7, 8], range(16)]))
        results.append((rev, storage.tolist(), snap.cleared_elements, history_of(snap)))
    assert results[0] == results[1]


def test_fully_replaced_batch_exact_bytes() -> None:
    """Unknown rows (garbage) are cleared over the whole width, known rows only where the
    old content was, full rows stay intact, rows past the batch are never written, and a
    tail that already holds the fill value is not a change."""
    rng = np.random.default_rng(3)
    storage = rng.integers(0, 500, (8, WIDTH)).astype(np.int32)
    garbage = storage.copy()
    snap = PageTableSnapshot(storage, fill_value=FILL)
    first = [BlockTable(rng.integers(0, 500, n)) for n in (16, 3, 0, 10, 16)]
    assert snap.prepare(first) == 1
    np.testing.assert_array_equal(storage[:5], naive([t.tolist() for t in first]))
    np.testing.assert_array_equal(storage[5:], garbage[5:])
    # every unknown row's tail was garbage: cleared whole (the full rows have none)
    assert snap.cleared_elements == 13 + 16 + 6

    second = [BlockTable(rng.integers(0, 500, n)) for n in (5, 16, 0, 10)]
    rev = snap.prepare(second)
    np.testing.assert_array_equal(storage[:4], naive([t.tolist() for t in second]))
    np.testing.assert_array_equal(storage[4], naive([first[4].tolist()])[0])  # kept
    np.testing.assert_array_equal(storage[5:], garbage[5:])
    assert snap.cleared_elements == 35 + 11  # row 0's [5, 16); rows 2, 3 need none
    assert snap.changed_rows_since(rev - 1).rows().tolist() == [0, 1, 3]

    # The vector path, fully replaced too: the same rules.
    ids = [rng.integers(0, 500, n).astype(np.int32) for n in (1, 1, 1, 1)]
    vers = [draw_version() for _ in ids]
    snap.prepare(ids, versions=vers, lengths=[1, 1, 1, 1])
    np.testing.assert_array_equal(storage[:4], naive([i.tolist() for i in ids]))
    assert snap.cleared_elements == 46 + 4 + 15 + 0 + 9


# --------------------------------------------------------------------------------------
# full-width rows: copied, never cleared first
# --------------------------------------------------------------------------------------


def _batches() -> list[tuple[str, list[Any], list[Any]]]:
    """(case, first batch, second batch): each second batch writes full-width rows over
    rows that held other IDs, through each write path, with no tail left to clear."""
    kept = tables(16, 5, 16, 0)
    partly: list[Any] = list(kept)
    partly[1] = BlockTable(range(100, 116))  # a 5-ID row becomes a full one
    partly[2] = BlockTable(range(200, 216))  # a full row replaced by another
    return [
        # every row new: the fully replaced path
        ("fully replaced", tables(16, 5, 16, 0),
         [*tables(16, 16, start=500), BlockTable([1] * 16), BlockTable(range(40, 56))]),
        # two rows new among kept ones: the row-by-row path
        ("two rows", kept, partly),
        # unversioned full rows over versioned ones (fully replaced)
        ("unversioned", tables(3, 16),
         [np.arange(60, 76, dtype=np.int32), list(range(80, 96))]),
    ]


@pytest.mark.parametrize("case", [c for c, _f, _s in _batches()])
def test_full_width_rows_are_never_cleared(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row-by-row (numpy, watched write by write) or in the compiled sweep (which reports
    every element its tail clears changed): replacing rows by full-width ones, over rows
    with no exposed tail, clears nothing."""
    _case, first, second = next(c for c in _batches() if c[0] == case)
    storage = TrackedStorage.zeros((6, WIDTH))
    log = storage.log
    assert log is not None
    snap = PageTableSnapshot(storage, fill_value=FILL)
    calls = counted_sweeps(snap, monkeypatch)
    snap.prepare(first)
    log.ops.clear()
    calls.clear()
    cleared = snap.cleared_elements
    assert snap.prepare(second) == 2
    plain = storage.view(np.ndarray)
    np.testing.assert_array_equal(plain[: len(second)], naive([list(map(int, r)) for r in second]))
    assert snap.cleared_elements == cleared, f"{case}: a full-width row was cleared"
    if case == "two rows":  # the row-by-row path: numpy writes only
        assert calls == []
        cleared_full = set().union(*log.fills()) & full_rows(second)
        assert not cleared_full, f"{case}: full-width rows cleared before their copy"
        # and the full rows were written (a copy), so the check above watched real writes
        assert full_rows(second) & log.written()
    else:  # fully replaced: the compiled sweep alone
        assert len(calls) == 1 and calls[0] is not None and log.ops == []


def test_random_batches_agree_with_the_naive_rebuild() -> None:
    """Random batches (full replacements, partial ones, appends, shrinking, unversioned
    rows): the bytes equal the naive rebuild, and ``cleared_elements`` grows by exactly
    the exposed tail elements that held something else than the fill value."""
    rng = np.random.default_rng(11)
    storage = rng.integers(0, 50, (10, WIDTH)).astype(np.int32)
    snap = PageTableSnapshot(storage, fill_value=FILL)
    held: list[list[int] | None] = [None] * 10  # what each storage row is known to hold
    live = [BlockTable(rng.integers(0, 50, rng.integers(0, WIDTH + 1))) for _ in range(6)]
    for _step in range(150):
        op = int(rng.integers(0, 5))
        if op == 0:  # a new batch mapping
            live = [BlockTable(rng.integers(0, 50, rng.integers(0, WIDTH + 1)))
                    for _ in range(int(rng.integers(1, 11)))]
        elif op == 1:
            k = int(rng.integers(0, len(live)))
            live[k] = BlockTable(rng.integers(0, 50, rng.integers(0, WIDTH + 1)))
        elif op == 2:
            for t in live:
                if len(t) < WIDTH and rng.random() < 0.5:
                    t.append_one(int(rng.integers(0, 50)))
        elif op == 3:
            k = int(rng.integers(0, len(live)))
            live[k].truncate(int(rng.integers(0, len(live[k]) + 1)))
        else:
            live = live[::-1]
        rows: list[Any] = [t.tolist() if rng.random() < 0.2 else t for t in live]
        before = storage.copy()
        expected = 0
        for i, r in enumerate(rows):
            old = held[i]
            start, stop = len(r), WIDTH if old is None else len(old)
            expected += int(np.count_nonzero(before[i, start:stop] != FILL))
        cleared = snap.cleared_elements
        snap.prepare(rows)
        contents = [list(map(int, r)) for r in rows]
        np.testing.assert_array_equal(storage[: len(rows)], naive(contents))
        np.testing.assert_array_equal(storage[len(rows):], before[len(rows):])
        assert snap.cleared_elements - cleared == expected
        held[: len(rows)] = contents
