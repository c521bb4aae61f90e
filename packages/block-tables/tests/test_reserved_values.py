"""Reserved values: a snapshot's ``reserved_page``.

An engine pads a CUDA-graph batch with a private dummy block; a real request naming it
would share padding storage. The snapshot refuses a real row bringing its reserved page,
on the compiled step and on every Python path, before any write; the last ``padding`` rows
may hold it. (A layout column's ``reserved`` value: h2d-core's
``test_layout_reserved_values.py``.)
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from block_tables import (
    BlockTable,
    PageIdRangeError,
    PageTableSnapshot,
    ReservedPageError,
    RowCountError,
    RowTypeError,
    StorageError,
)

DUMMY = 7


def _snapshot(rows: int = 4, width: int = 6) -> PageTableSnapshot:
    return PageTableSnapshot(np.zeros((rows, width), np.int32), pool_limit=16,
                             reserved_page=DUMMY)


def _state(snap: PageTableSnapshot) -> tuple[Any, ...]:
    return (snap.revision, snap.num_rows, snap.storage.tobytes(),
            snap.row_lengths.tobytes())


def _grown(row: BlockTable, *pages: int) -> BlockTable:
    out = row.lineage_copy()
    for p in pages:
        out.append_one(p)
    return out


def _bad_batches(real: list[BlockTable]) -> list[tuple[str, list[Any], int]]:
    """(case, batch, row refused): each brings the reserved page in a real row."""
    return [
        ("one page appended (the compiled step hands it back)",
         [_grown(real[0], DUMMY), real[1]], 0),
        ("pages appended", [real[0], _grown(real[1], 3, DUMMY)], 1),
        ("a new lineage", [real[0], BlockTable([DUMMY, 2])], 1),
        ("a list row", [[1, DUMMY], real[1]], 0),
        ("an array row", [real[0], np.array([4, DUMMY], np.int32)], 1),
        ("reordered rows", [real[1], _grown(real[0], DUMMY)], 1),
    ]


@pytest.mark.parametrize("case", range(6))
def test_a_real_row_bringing_the_reserved_page_is_refused_and_changes_nothing(case: int
                                                                              ) -> None:
    snap = _snapshot()
    pad = BlockTable([DUMMY])
    real = [BlockTable([1]), BlockTable([2, 3])]
    snap.prepare([*real, pad], padding=1)
    before = _state(snap)
    name, batch, row = _bad_batches(real)[case]
    with pytest.raises(ReservedPageError, match=rf"row {row}: page ID {DUMMY} at column \d+ "
                                                r"is the table's reserved page"):
        snap.prepare([*batch, pad], padding=1)
    assert _state(snap) == before, name
    assert issubclass(ReservedPageError, PageIdRangeError)
    # a retry without it prepares
    grown = [_grown(real[0], 4), real[1]]
    snap.prepare([*grown, pad], padding=1)
    assert snap.storage[0, :2].tolist() == [1, 4]


def test_padding_rows_hold_the_reserved_page_real_rows_never() -> None:
    snap = _snapshot()
    pad = BlockTable([DUMMY])
    rows = [BlockTable([1]), BlockTable([2])]
    snap.prepare([*rows, pad, pad], padding=2)
    assert snap.storage[:4, 0].tolist() == [1, 2, DUMMY, DUMMY]
    # the same padding row as a real row (no padding declared) is refused
    fresh = _snapshot()
    with pytest.raises(ReservedPageError, match=r"row 2: page ID 7 at column 0"):
        fresh.prepare([*rows, pad], padding=0)
    # the steady step: every row grows by one page through the compiled step
    grown = [_grown(rows[0], 5), _grown(rows[1], 6)]
    snap.prepare([*grown, pad, pad], padding=2)
    assert snap.storage[:2, :2].tolist() == [[1, 5], [2, 6]]


def test_the_reserved_page_is_checked_and_its_paths_refused() -> None:
    storage = np.zeros((2, 2), np.int32)
    for bad, match in ((16, r"reserved_page must be None or a page ID in \[0, 15\]"),
                       (-1, r"in \[0, 15\]"), (True, r"got True"), (1.0, r"got 1.0")):
        with pytest.raises(StorageError, match=match):
            PageTableSnapshot(storage, pool_limit=16, reserved_page=bad)
    snap = PageTableSnapshot(storage, reserved_page=0)
    assert snap.reserved_page == 0
    assert PageTableSnapshot(storage).reserved_page is None
    with pytest.raises(RowTypeError, match=r"reserved page .* without versions and lengths"):
        snap.prepare([[1]], versions=[1], lengths=[1])
    with pytest.raises(RowCountError, match=r"padding=3 must be an int in \[0, 1\]"):
        snap.prepare([[1]], padding=3)
