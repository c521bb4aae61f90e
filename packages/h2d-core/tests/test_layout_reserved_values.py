"""A layout column's ``reserved`` value: an engine's padding state slot, say. A real
request holding it is refused, naming the request, the column and the note; padded entries
hold it."""

from __future__ import annotations

import numpy as np
import pytest

from h2d_core import LayoutColumn, RequestLayout, RequestLayoutError

DUMMY = 7


def _slots_layout(out: np.ndarray) -> RequestLayout:
    column = LayoutColumn("slot", out, pad=DUMMY, low=0, reserved=DUMMY,
                          reserved_note="the dummy slot (padding only); give it another")
    return RequestLayout("lay", 4, np.zeros((4, 2), np.int32), np.zeros(4, np.int32),
                         columns=[column])


def test_a_reserved_column_value_is_refused_in_real_entries_and_pads_the_rest() -> None:
    out = np.full(4, -9, np.int32)
    layout = _slots_layout(out)
    q, c = np.ones(2, np.int32), np.array([3, 4], np.int32)
    layout.plan(q, c, 4, -1, [np.array([1, 2], np.int32)])
    layout.write()
    assert out.tolist() == [1, 2, DUMMY, DUMMY]
    with pytest.raises(RequestLayoutError,
                       match=r"lay: request 1 has slot=7, the dummy slot \(padding only\)"):
        layout.plan(q, c, 4, -1, [np.array([1, DUMMY], np.int32)])
    assert out.tolist() == [1, 2, DUMMY, DUMMY]
    with pytest.raises(RequestLayoutError, match=r"reserved takes an int in int64 on an "
                                                 r"integer column, got 1.5"):
        RequestLayout("lay", 4, np.zeros((4, 2), np.int32), np.zeros(4, np.int32),
                      columns=[LayoutColumn("x", np.zeros(4, np.float32), reserved=1.5)])
