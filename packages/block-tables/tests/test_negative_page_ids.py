"""Page IDs below 0 are refused by every snapshot, pool limit or not.

-1 is never a page: the library writes its own padding (empty rows, the fill value), so a
caller's row holding a negative ID is a scheduler bug. Without ``pool_limit`` the lower
bound is still checked (on the compiled single-page step as well as on the rewrite paths);
with it, both bounds. A refused batch changes nothing, and a corrected one prepares.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from block_tables import BlockTable, PageIdRangeError, PageTableSnapshot


def _state(snap: PageTableSnapshot) -> tuple[Any, ...]:
    return (snap.storage.tobytes(), snap.revision, snap.num_rows, snap._row_keys.tobytes(),
            snap._lengths.tobytes(), len(snap._book.history))


def _refused(snap: PageTableSnapshot, rows: Any, match: str, **kw: Any) -> None:
    before = _state(snap)
    with pytest.raises(PageIdRangeError, match=match) as info:
        snap.prepare(rows, **kw)
    assert info.value.row is not None
    assert _state(snap) == before


@pytest.mark.parametrize("kind", ["table", "list", "array", "vectors"])
def test_a_new_row_with_a_negative_id_is_refused_without_a_pool_limit(kind: str) -> None:
    snap = PageTableSnapshot(np.zeros((4, 8), np.int32))
    assert snap.pool_limit is None
    ids = [3, -1, 7]
    row: Any = {"table": BlockTable(ids), "list": ids,
                "array": np.array(ids, np.int32), "vectors": BlockTable(ids)}[kind]
    good = BlockTable([5])
    kw: dict[str, Any] = {}
    if kind == "vectors":
        kw = {"versions": np.array([good.version, row.version], np.int64),
              "lengths": np.array([1, 3], np.int64)}
    _refused(snap, [good, row], r"row 1: page ID -1 at column 1 is negative; page IDs are "
             r">= 0", **kw)
    fixed = [3, 4, 7]
    row = BlockTable(fixed) if kind in ("table", "vectors") else fixed
    if kind == "vectors":
        kw = {"versions": np.array([good.version, row.version], np.int64),
              "lengths": np.array([1, 3], np.int64)}
    snap.prepare([good, row], **kw)
    assert snap.storage[:2].tolist() == [[5, 0, 0, 0, 0, 0, 0, 0], [3, 4, 7, 0, 0, 0, 0, 0]]


@pytest.mark.parametrize("limit", [None, 30])
def test_an_appended_negative_id_is_refused_by_the_compiled_step(limit: int | None) -> None:
    """The common decode step (one page appended per row) runs compiled: its scalar check
    covers the lower bound with or without a pool limit."""
    snap = PageTableSnapshot(np.zeros((4, 8), np.int32), pool_limit=limit)
    rows = [BlockTable([1, 2]), BlockTable([3])]
    snap.prepare(rows)
    rows[0].append_one(9)
    rows[1].append_one(-4)
    rule = ("is negative; page IDs are >= 0" if limit is None
            else rf"is outside \[0, pool_limit={limit}\)")
    _refused(snap, rows, rf"row 1: appended page ID -4 at column 1 {rule}")
    rows[1].truncate(1)
    rows[1].append_one(4)
    snap.prepare(rows)
    assert snap.storage[:2, :3].tolist() == [[1, 2, 9], [3, 4, 0]]


def test_a_multi_page_append_with_a_negative_id_is_refused() -> None:
    snap = PageTableSnapshot(np.zeros((2, 8), np.int32))
    row = BlockTable([1])
    snap.prepare([row])
    row.append([2, -7])
    _refused(snap, [row], r"row 0: page ID -7 at column 2 is negative")


def test_the_fill_value_may_be_negative() -> None:
    """What the library writes itself (fill past a row's length) is not a caller's ID."""
    snap = PageTableSnapshot(np.zeros((2, 4), np.int32), fill_value=-1)
    snap.prepare([BlockTable([2]), []])
    assert snap.storage.tolist() == [[2, -1, -1, -1], [-1, -1, -1, -1]]
