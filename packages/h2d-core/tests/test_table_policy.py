"""Block-table publication policy: changed ranges (the default) against whole tables (the
spec's literal rule), the policy knobs' validation, and the staging-room bound of a
partial publication.

Every publishing test checks the bytes at the GPU destination (rows ``[0, n)`` equal the
snapshot, rows past ``n`` keep what they held) and, on the packed backend, what the arena
carried: the header's range rows and the table's own count row.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from block_tables import BlockTable
from h2d_core import (
    H2DRunnerState,
    StageResult,
    TablePolicyError,
    TablePublication,
    block_table_state,
)

ROWS, WIDTH = 32, 64
ROW_BYTES = WIDTH * 4


class Table:
    """A decode-like group (context lens + the table) and a mirror of what the GPU table
    must hold: rows ``[0, n)`` of the snapshot after each publication, the rest as it was."""

    def __init__(self, device: str, h: Any, backend: str = "packed", max_ranges: int = 16,
                 **policy: Any) -> None:
        st = H2DRunnerState(device, backend=backend, scatter=h.scatter_mode(device))
        self.lens = st.buffer("context_lens", (ROWS,), torch.int32, group="mha_decode")
        self.bt = st.buffer("block_tables", (ROWS, WIDTH), torch.int32, group="mha_decode",
                            unit="rows", max_ranges=max_ranges)
        st.bind()
        self.bt.gpu.fill_(-7)
        self.mirror = np.full((ROWS, WIDTH), -7, np.int32)
        self.st, self.device, self.h = st, device, h
        self.bts = block_table_state(self.bt, pool_limit=10_000, **policy)

    @property
    def rec(self) -> Any:
        return self.st._slot_groups[self.st.current_slot][self.st.plan("mha_decode").index]

    def publish(self, rows: list[Any], n: int | None = None) -> tuple[str, int, list[Any]]:
        """One step: (stage result, payload bytes moved, the record's ranges)."""
        st = self.st
        n = len(rows) if n is None else n
        st.begin()
        self.bts.prepare(rows)
        self.lens.np[:n] = n
        st.set_count(self.lens, n)
        how = self.bts.stage(n)
        ranges = list(self.rec.ranges)
        before = st.counters("mha_decode").bytes
        st.publish("mha_decode")
        st.finish()
        moved = st.counters("mha_decode").bytes - before - n * 4  # less context_lens
        self.mirror[:n] = self.bts.snapshot.storage[:n]
        self.h.sync(self.device)
        np.testing.assert_array_equal(self.bt.gpu.cpu().numpy(), self.mirror)
        return how, moved, ranges

    def arena_rows(self) -> tuple[int, list[tuple[int, int, int]]]:
        """What the last packed DMA carried for the table: its count row's byte count and
        the used range rows as (member, destination offset, bytes)."""
        packed = self.rec.packed
        header = packed.header
        member = self.bt.homes[0][1]
        extra = [(int(r[2]), int(r[3]), int(r[1])) for r in header[len(packed.members):]
                 if r[1]]
        return int(header[member, 1]), extra


def _tables() -> list[BlockTable]:
    return [BlockTable([3 * i, 3 * i + 1]) for i in range(16)]


# -- the two policies ------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_whole_policy_sends_the_published_rows_in_one_piece(device: str, h: Any,
                                                            backend: str) -> None:
    """publication="whole": the spec's literal rule. A table the GPU does not hold at this
    revision and row count travels as rows [0, n) in one piece of the group's DMA (one
    count row, no range rows), also when a single page changed or only the row count
    did; an unchanged one is omitted."""
    t = Table(device, h, backend, publication=TablePublication.WHOLE)
    assert t.bts.publication is TablePublication.WHOLE
    tables = _tables()
    steps: list[tuple[str, int]] = []
    assert t.publish(tables)[:2] == (StageResult.WHOLE, 16 * ROW_BYTES)
    assert t.publish(tables)[:2] == (StageResult.REUSED, 0)
    tables[3].append_one(77)  # one page: still the whole table
    how, moved, ranges = t.publish(tables)
    steps.append((how, moved))
    assert ranges == []
    if backend == "packed":
        assert t.arena_rows() == (16 * ROW_BYTES, [])
    tables[9] = BlockTable([5, 6, 7])
    steps.append(t.publish(tables)[:2])
    steps.append(t.publish(tables, n=12)[:2])  # fewer rows, same revision: not reused
    if backend == "packed":
        assert t.arena_rows() == (12 * ROW_BYTES, [])
    assert steps == [(StageResult.WHOLE, 16 * ROW_BYTES), (StageResult.WHOLE, 16 * ROW_BYTES),
                     (StageResult.WHOLE, 12 * ROW_BYTES)]
    tables += [BlockTable([1])] * 4
    assert t.publish(tables)[:2] == (StageResult.WHOLE, 20 * ROW_BYTES)


def test_ranges_policy_sends_only_changed_bytes(device: str, h: Any) -> None:
    """The default (publication="ranges") on the packed backend: the same steps send the
    appended page, the replaced row's columns and nothing for fewer rows, as range rows
    of the one DMA (the table's count row stays 0)."""
    t = Table(device, h)
    assert t.bts.publication is TablePublication.RANGES
    member = t.bt.homes[0][1]
    tables = _tables()
    assert t.publish(tables)[:2] == (StageResult.WHOLE, 16 * ROW_BYTES)
    assert t.publish(tables)[:2] == (StageResult.REUSED, 0)
    tables[3].append_one(77)
    how, moved, ranges = t.publish(tables)
    assert (how, moved) == (StageResult.PARTIAL, 4)
    assert ranges == [(member, 3 * ROW_BYTES + 8, 4)]
    assert t.arena_rows() == (0, [(member, 3 * ROW_BYTES + 8, 4)])
    tables[9] = BlockTable([5, 6, 7])  # a new lineage: columns [0, 3) of row 9
    assert t.publish(tables)[:2] == (StageResult.PARTIAL, 12)
    assert t.arena_rows() == (0, [(member, 9 * ROW_BYTES, 12)])
    assert t.publish(tables, n=12)[:2] == (StageResult.PARTIAL, 0)  # nothing to send
    assert t.bts.published.rows == 12


def test_direct_backend_sends_whole_tables_under_either_policy(device: str, h: Any) -> None:
    """Without a packed group there are no ranges to send: both policies publish whole."""
    for publication in ("ranges", "whole"):
        t = Table(device, h, "direct", publication=publication)
        tables = _tables()
        t.publish(tables)
        tables[3].append_one(77)
        assert t.publish(tables)[:2] == (StageResult.WHOLE, 16 * ROW_BYTES)


# -- the knobs -------------------------------------------------------------------------------


@pytest.mark.parametrize(("knob", "value", "match"), [
    ("publication", "bulk", r"publication='bulk' is not a known .*'ranges', 'whole'"),
    ("publication", 1, r"publication=1 is not a known"),
    ("publication", None, r"publication=None is not a known"),
    ("partial_max_ranges", True, r"partial_max_ranges=True: must be None or an int"),
    ("partial_max_ranges", 2.0, r"partial_max_ranges=2.0: must be None or an int"),
    ("partial_max_ranges", "4", r"partial_max_ranges='4': must be None or an int"),
    ("partial_max_ranges", -1, r"partial_max_ranges=-1: must be in \[0, 16\]"),
    ("partial_max_ranges", 17, r"partial_max_ranges=17: must be in \[0, 16\] "
                               r"\(buffer 'block_tables' max_ranges=16;"),
    ("partial_max_share", True, r"partial_max_share=True: must be a real number"),
    ("partial_max_share", "0.5", r"partial_max_share='0.5': must be a real number"),
    ("partial_max_share", None, r"partial_max_share=None: must be a real number"),
    ("partial_max_share", -0.25, r"partial_max_share=-0.25: must be in \[0, 1\]"),
    ("partial_max_share", 1.5, r"partial_max_share=1.5: must be in \[0, 1\]"),
    ("partial_max_share", math.nan, r"partial_max_share=nan: must be in \[0, 1\]"),
    ("partial_max_share", math.inf, r"partial_max_share=inf: must be in \[0, 1\]"),
])
def test_bad_knobs_are_refused_and_change_nothing(device: str, h: Any, knob: str,
                                                  value: Any, match: str) -> None:
    st = H2DRunnerState(device, scatter=h.scatter_mode(device))
    bt = st.buffer("block_tables", (ROWS, WIDTH), torch.int32, group="g", unit="rows",
                   max_ranges=16)
    st.bind()
    hooks = list(st._reset_hooks)
    with pytest.raises(TablePolicyError, match=f"buffer 'block_tables': {match}"):
        block_table_state(bt, **{knob: value})
    assert getattr(bt, "_page_map", None) is None and st._reset_hooks == hooks
    bts = block_table_state(bt)  # a valid retry works
    if knob == "publication":
        return
    before = (getattr(bts, knob), bts._limit_table())
    with pytest.raises(TablePolicyError, match=f"buffer 'block_tables': {match}"):
        setattr(bts, knob, value)
    assert (getattr(bts, knob), bts._limit_table()) == before
    setattr(bts, knob, 0)
    assert getattr(bts, knob) == 0


def test_numpy_knob_values_are_taken_as_numbers(device: str, h: Any) -> None:
    t = Table(device, h, partial_max_ranges=np.int64(3), partial_max_share=np.float32(0.25))
    assert type(t.bts.partial_max_ranges) is int and t.bts.partial_max_ranges == 3
    assert type(t.bts.partial_max_share) is float and t.bts.partial_max_share == 0.25


@pytest.mark.parametrize("knob", ["partial_max_ranges", "partial_max_share"])
def test_zero_means_no_ranges(device: str, h: Any, knob: str) -> None:
    """partial_max_ranges=0 (and partial_max_share=0) allow no range: a table whose bytes
    changed travels whole; one whose bytes did not (fewer rows) still sends nothing."""
    t = Table(device, h, **{knob: 0})
    tables = _tables()
    t.publish(tables)
    tables[3].append_one(77)
    assert t.publish(tables)[:2] == (StageResult.WHOLE, 16 * ROW_BYTES)
    assert t.arena_rows() == (16 * ROW_BYTES, [])
    assert t.publish(tables, n=10)[:2] == (StageResult.PARTIAL, 0)
    setattr(t.bts, knob, None if knob == "partial_max_ranges" else 0.5)  # back to ranges
    tables[4].append_one(78)
    assert t.publish(tables)[:2] == (StageResult.PARTIAL, 6 * ROW_BYTES + 4)


# -- the staging room ------------------------------------------------------------------------


@pytest.mark.parametrize(("extra_pages", "expected"), [
    (1, StageResult.PARTIAL),  # payload + 16 bytes per range == the room exactly
    (2, StageResult.WHOLE),    # 4 bytes over: the ranges do not fit, the table goes whole
])
def test_ranges_that_fill_the_staging_room_exactly(device: str, h: Any, extra_pages: int,
                                                   expected: str) -> None:
    """Three changed ranges: rows [0, 8) replaced (2048 bytes), 3 pages appended to row 20
    (12 bytes) and ``extra_pages`` to row 26. Each range costs RANGE_OVERHEAD (16) staging
    bytes beyond its payload, so with 1 extra page they take 2064 + 48 = 2112 bytes, the
    room of a 4-range table of 8 KiB (2048 + 16 * 4); with 2 they take 2116."""
    t = Table(device, h, max_ranges=4)
    room = t.rec.packed.range_capacity
    assert room == 2112  # the case this pins
    tables = [BlockTable([i]) for i in range(ROWS)]
    t.publish(tables)
    for i in range(8):
        tables[i] = BlockTable(list(range(100 * i, 100 * i + WIDTH)))
    tables[20].append([1, 2, 3])
    tables[26].append(list(range(extra_pages)))
    how, moved, ranges = t.publish(tables)
    payload = 8 * ROW_BYTES + 12 + 4 * extra_pages
    assert how == expected
    if expected == StageResult.PARTIAL:
        assert len(ranges) == 3 and moved == payload
        assert payload + 16 * len(ranges) == room
        assert [r[2] for r in t.arena_rows()[1]] == [8 * ROW_BYTES, 12, 4]
    else:
        assert ranges == [] and moved == ROWS * ROW_BYTES
        assert t.arena_rows() == (ROWS * ROW_BYTES, [])


@pytest.mark.parametrize(("extra_pages", "expected"), [
    (12, StageResult.PARTIAL),  # exactly the room the other table's range left
    (13, StageResult.WHOLE),
])
def test_ranges_fill_the_room_another_tables_ranges_left(device: str, h: Any,
                                                        extra_pages: int,
                                                        expected: str) -> None:
    """Two ranged tables share the group's staging room: table ``a``'s one 4-byte range
    takes 4 + 16 bytes of the 2 * 2112, so table ``b``'s three ranges (rows [0, 16)
    replaced, 3 pages appended to row 20 and ``extra_pages`` to row 26, share 1.0) fit
    exactly with 12 extra pages: 4096 + 12 + 48 + 48 = 4204 = 4224 - 20."""
    st = H2DRunnerState(device, scatter=h.scatter_mode(device))
    lens = st.buffer("context_lens", (ROWS,), torch.int32, group="g")
    bufs = [st.buffer(name, (ROWS, WIDTH), torch.int32, group="g", unit="rows", max_ranges=4)
            for name in ("a", "b")]
    st.bind()
    a, b = (block_table_state(buf, partial_max_share=1.0) for buf in bufs)
    rows_a = [BlockTable([i]) for i in range(ROWS)]
    rows_b = [BlockTable([i]) for i in range(ROWS)]

    def step() -> str:
        st.begin()
        a.prepare(rows_a)
        b.prepare(rows_b)
        st.set_count(lens, ROWS)
        a.stage(ROWS)
        how = b.stage(ROWS)
        st.publish("g")
        st.finish()
        return how

    step()
    rec = st._slot_groups[0][st.plan("g").index]
    assert rec.packed.range_capacity == 2 * 2112  # the case this pins
    rows_a[5].append_one(9)
    for i in range(16):
        rows_b[i] = BlockTable(list(range(100 * i, 100 * i + WIDTH)))
    rows_b[20].append([1, 2, 3])
    rows_b[26].append(list(range(extra_pages)))
    assert step() == expected
    assert a.last_stage == StageResult.PARTIAL
    h.sync(device)
    for buf, state in ((bufs[0], a), (bufs[1], b)):
        np.testing.assert_array_equal(buf.gpu.cpu().numpy(), state.snapshot.storage)
