"""Rows an engine might hand over by mistake: each refused with the documented error, in
the documented check order (count, type, width, required pages, IDs), nothing changed."""

from __future__ import annotations

import numpy as np
import pytest

from block_tables import (
    BlockTable,
    PageIdRangeError,
    PageTableSnapshot,
    RowTypeError,
    RowWidthError,
)


def _snapshot() -> tuple[PageTableSnapshot, list[BlockTable]]:
    snap = PageTableSnapshot(np.zeros((4, 8), np.int32), pool_limit=100)
    rows = [BlockTable([1, 2]), BlockTable([3])]
    snap.prepare(rows)
    return snap, rows


def _state(snap: PageTableSnapshot) -> tuple[bytes, int, int]:
    return snap.storage.tobytes(), snap.revision, snap.num_rows


@pytest.mark.parametrize("bad, rule", [
    ([1, None], "ints, got NoneType at column 1"), ([object(), 4], "ints, got object at column 0"),
    ([5, "6"], "integers, got dtype <U")])
def test_a_non_int_page_id_is_a_row_type_error(bad: list[object], rule: str) -> None:
    snap, rows = _snapshot()
    before = _state(snap)
    with pytest.raises(RowTypeError, match=rf"row 1: page IDs must be {rule}"):
        snap.prepare([rows[0], bad])
    assert _state(snap) == before


def test_width_is_checked_before_ids() -> None:
    """An int32 overflow in row 0 and a too-wide row 1: the width error comes first (the
    documented order); the overflow alone is a PageIdRangeError."""
    snap, _ = _snapshot()
    before = _state(snap)
    with pytest.raises(RowWidthError, match=r"row 1: 9 page IDs exceed the table width"):
        snap.prepare([[2**40], list(range(9))])
    with pytest.raises(PageIdRangeError, match=r"row 0: .*does not fit int32"):
        snap.prepare([[2**40], [1]])
    with pytest.raises(PageIdRangeError, match=r"row 1: .*100"):
        snap.prepare([[1], [100]])  # past the pool
    assert _state(snap) == before


def test_an_iterator_of_rows_is_refused_hit_or_not() -> None:
    snap, rows = _snapshot()
    before = _state(snap)
    for batch in (iter(rows), iter([BlockTable([9])]), (r for r in rows)):
        with pytest.raises(RowTypeError, match=r"rows must be an ordered sequence"):
            snap.prepare(batch)  # type: ignore[arg-type]
        assert _state(snap) == before
    assert snap.prepare(list(rows)) == before[1]  # the same rows as a list: a hit
