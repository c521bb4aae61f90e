"""``prepare(rows, versions=..., lengths=...)``: the caller's own version and length vectors.

Every expectation is checked against the naive full-width rebuild; a hit must not read a
single row, and a rejected batch must change nothing.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from block_tables import (
    BlockTable,
    MissingPagesError,
    PageIdRangeError,
    PageTableSnapshot,
    RowCountError,
    RowTypeError,
    RowWidthError,
    draw_version,
)

ROWS, WIDTH, FILL = 6, 10, -1


def naive(contents: list[list[int]]) -> np.ndarray:
    table = np.full((len(contents), WIDTH), FILL, dtype=np.int32)
    for i, row in enumerate(contents):
        table[i, : len(row)] = row
    return table


class Untouchable:
    """A row that fails the test if anything reads it."""

    def __len__(self) -> int:
        raise AssertionError("a hit read a row")

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise AssertionError("a hit read a row")


class Engine:
    """An engine's own row storage with a version and a length per row."""

    def __init__(self, rng: np.random.Generator, n: int) -> None:
        self.rng = rng
        self.rows = [list(rng.integers(0, 50, rng.integers(0, 5))) for _ in range(n)]
        self.versions = np.array([draw_version() for _ in range(n)], dtype=np.int64)

    def step(self) -> None:
        for i in range(len(self.rows)):
            r = self.rng.random()
            if r < 0.4 and len(self.rows[i]) < WIDTH:
                self.rows[i].append(int(self.rng.integers(0, 50)))  # append: same version
            elif r < 0.5:
                self.rows[i] = list(self.rng.integers(0, 50, self.rng.integers(0, WIDTH + 1)))
                self.versions[i] = draw_version()
            elif r < 0.55 and self.rows[i]:
                self.rows[i].pop()  # a change other than appending: a new version
                self.versions[i] = draw_version()

    def lengths(self) -> np.ndarray:
        return np.array([len(r) for r in self.rows], dtype=np.int32)


@pytest.mark.parametrize("seed", range(4))
def test_vectors_match_the_naive_rebuild(seed: int) -> None:
    rng = np.random.default_rng(seed)
    storage = rng.integers(-9, 99, (ROWS, WIDTH)).astype(np.int32)  # unknown garbage
    snap = PageTableSnapshot(storage, fill_value=FILL, pool_limit=50)
    engine = Engine(rng, ROWS)
    for step in range(30):
        n = int(rng.integers(1, ROWS + 1))
        before = snap.revision
        expected_changed = storage.copy()
        rev = snap.prepare([np.array(r, np.int32) for r in engine.rows[:n]],
                           versions=engine.versions[:n], lengths=engine.lengths()[:n])
        assert np.array_equal(storage[:n], naive(engine.rows[:n])), step
        changed_rows = np.flatnonzero((storage != expected_changed).any(axis=1))
        assert (rev == before) == (changed_rows.size == 0)
        if rev != before:
            assert snap.changed_rows_since(before).rows().tolist() == changed_rows.tolist()
        # the same vectors again: a hit that reads no row
        assert snap.prepare([Untouchable()] * n, versions=engine.versions[:n],
                            lengths=engine.lengths()[:n]) == rev
        engine.step()


def test_append_copies_only_the_added_ids() -> None:
    storage = np.full((2, WIDTH), FILL, dtype=np.int32)
    snap = PageTableSnapshot(storage, fill_value=FILL)
    v = np.array([draw_version(), draw_version()])
    snap.prepare([[1, 2], [3]], versions=v, lengths=[2, 1])
    storage[0, 0] = 77  # an append must not rewrite the prefix it already holds
    rev = snap.prepare([[1, 2, 4], Untouchable()], versions=v, lengths=[3, 1])
    assert storage[0, :3].tolist() == [77, 2, 4] and storage[1, 0] == 3
    assert snap.changed_rows_since(rev - 1).rows().tolist() == [0]


def test_vectors_and_block_tables_share_the_version_space() -> None:
    storage = np.full((1, WIDTH), FILL, dtype=np.int32)
    snap = PageTableSnapshot(storage, fill_value=FILL)
    table = BlockTable([5, 6])
    snap.prepare([table])
    # the same lineage handed over as vectors: a hit
    assert snap.prepare([Untouchable()], versions=[table.version], lengths=[2]) == snap.revision
    table.append_one(7)
    snap.prepare([table], versions=[table.version], lengths=[3])
    assert storage[0, :3].tolist() == [5, 6, 7]
    snap.prepare([table])  # and back to objects: still the same bytes
    assert storage[0, :4].tolist() == [5, 6, 7, FILL]


@pytest.mark.parametrize(
    ("versions", "lengths", "rows", "error", "match"),
    [
        ([1, 2], [1], [[1], [2]], RowTypeError, "lengths must be a 1-D integer array"),
        ([0, 2], [1, 1], [[1], [2]], RowTypeError, r"row 0: version 0 is outside \[1, "),
        ([1.0, 2.0], [1, 1], [[1], [2]], RowTypeError, "versions must be a 1-D integer"),
        ([None, None], [1, 1], [[1], [2]], RowTypeError, "versions must be a 1-D integer"),
        ([1, 2], [1, WIDTH + 1], [[1], [2]], RowWidthError, r"row 1: length 11 is outside"),
        ([1, 2], [1, -1], [[1], [2]], RowWidthError, r"row 1: length -1 is outside"),
        ([1, 2], [1, 2], [[1], [2]], RowWidthError, r"row 1: lengths\[1\]=2 but the row holds 1"),
        ([1, 2], [1, 1], [[1], [99]], PageIdRangeError, "row 1"),
        ([1, 2], [1, 1], [[1], ["x"]], RowTypeError, "row 1"),
        ([1] * 7, [0] * 7, [[]] * 7, RowCountError, "7 rows but the storage holds 6"),
        ([1, 2], None, [[1], [2]], RowTypeError, "pass versions and lengths together"),
    ],
)
def test_bad_vectors_are_rejected_and_nothing_changes(
    versions: Any, lengths: Any, rows: Any, error: type[Exception], match: str
) -> None:
    storage = np.full((ROWS, WIDTH), FILL, dtype=np.int32)
    snap = PageTableSnapshot(storage, fill_value=FILL, pool_limit=50)
    good = np.array([draw_version(), draw_version()])
    snap.prepare([[4], [5]], versions=good, lengths=[1, 1])
    before = (storage.copy(), snap.revision, snap.num_rows, snap._row_keys.copy())
    # fresh versions, so every row is read and checked
    fresh = [v + 10**9 if isinstance(v, int) else v for v in versions]
    with pytest.raises(error, match=match):
        snap.prepare(rows, versions=fresh if versions[0] != 0 else versions, lengths=lengths)
    assert np.array_equal(storage, before[0])
    assert (snap.revision, snap.num_rows) == before[1:3]
    assert np.array_equal(snap._row_keys, before[3])


def test_required_pages_are_checked_on_a_hit() -> None:
    storage = np.full((1, WIDTH), FILL, dtype=np.int32)
    snap = PageTableSnapshot(storage, fill_value=FILL)
    v = [draw_version()]
    snap.prepare([[1, 2]], versions=v, lengths=[2])
    with pytest.raises(MissingPagesError):
        snap.prepare([Untouchable()], versions=v, lengths=[2], required_pages=[3])
    assert snap.prepare([Untouchable()], versions=v, lengths=[2], required_pages=[2]) >= 0
