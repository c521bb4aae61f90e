"""The compiled paths of block_tables (``_snapshot.pyx``) against a plain-Python oracle.

Two compiled snapshots over separate storages of the same shape (as two pipeline slots'
tables share their BlockTables, and so their lineage proofs) receive the same batches.
``oracle_snapshot.OracleSnapshot`` (tests/) restates the documented rules plainly and
says what every accepted batch must leave: return value, revision, storage bytes,
recorded row state, change history, change spans and byte ranges; :func:`predict` says
which batches are rejected, with which error, and a rejected batch must change nothing.
Whenever the compiled step hands a batch back to snapshot.py, nothing may have been
written yet. Then the boundary of the compiled step, and :mod:`block_tables.native` (the
compiled core is required). numpy and hypothesis only: this file must not import torch.
"""

from __future__ import annotations

import array
import os
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from oracle_snapshot import OracleRow, OracleSnapshot

import block_tables.snapshot as snapshot_module
from block_tables import (
    BlockTable,
    BlockTableError,
    ChangedRows,
    MissingPagesError,
    PageIdRangeError,
    PageTableSnapshot,
    RowCountError,
    RowTypeError,
    RowWidthError,
)
from block_tables.native import FIX, NativeBuildError, require_extension
from block_tables.spans import ChangedSpans, changed_byte_ranges, changed_spans, row_keys

ROWS = 6
WIDTH = 20
ROW_BYTES = 4 * WIDTH
LIMIT = 30
HISTORY = 4  # short, so that changed_rows_since and changed_spans run past their horizon
INT32_MAX = 2**31 - 1


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------


def naive(contents: Sequence[Sequence[int]], width: int, fill: int) -> np.ndarray:
    """The full-width rebuild: each row cleared to ``fill``, then its IDs copied in."""
    table = np.full((len(contents), width), fill, dtype=np.int32)
    for i, ids in enumerate(contents):
        table[i, : len(ids)] = ids
    return table


def state_of(snap: PageTableSnapshot) -> tuple[Any, ...]:
    """Everything a rejected batch must leave unchanged, and the oracle must agree on."""
    return (
        snap.storage.tobytes(),
        snap.revision,
        snap.num_rows,
        snap.row_lengths.tolist(),
        snap._row_keys.tobytes(),
        snap._lengths.tobytes(),
        snap._book.all_versioned,
        [(rev, None if rows is None else rows.tolist()) for rev, rows in snap._book.history],
    )


def oracle_state(oracle: OracleSnapshot) -> tuple[Any, ...]:
    """:func:`state_of`'s tuple, from the oracle."""
    return (
        np.array(oracle.storage, dtype=np.int32).tobytes(),
        oracle.revision,
        oracle.num_rows,
        oracle.lengths[: oracle.num_rows],
        np.array(oracle.keys, dtype=np.int64).tobytes(),
        np.array(oracle.lengths, dtype=np.int64).tobytes(),
        oracle.all_versioned,
        [(rev, rows) for rev, rows in oracle.history],
    )


def oracle_rows(rows: Sequence[Any]) -> list[OracleRow]:
    """A batch as the oracle takes it: BlockTables versioned, anything else not."""
    return [OracleRow(tuple(r.tolist()), r.version) if isinstance(r, BlockTable)
            else OracleRow(tuple(int(x) for x in r)) for r in rows]


def oracle_of(storage: np.ndarray, fill: int = 0, history: int = 64) -> OracleSnapshot:
    return OracleSnapshot(storage.tolist(), fill=fill, history=history)


Outcome = tuple[str, Any, Any]


def outcome(call: Callable[[], Any]) -> Outcome:
    """("ok", result, None) or ("error", type, message) of ``call``."""
    try:
        return ("ok", call(), None)
    except Exception as exc:  # compared, not swallowed
        return ("error", type(exc), str(exc))


def apply_ranges(old: np.ndarray, new: np.ndarray, ranges: list[tuple[int, int]]) -> np.ndarray:
    """``old``'s bytes with the byte ranges ``ranges`` copied from ``new``."""
    dest = old.copy().reshape(-1).view(np.uint8)
    source = new.reshape(-1).view(np.uint8)
    for start, stop in ranges:
        dest[start:stop] = source[start:stop]
    return dest.view(np.int32).reshape(old.shape)


class BatchList(list):  # type: ignore[type-arg]
    """A list subclass: an ordered sequence that the compiled step does not take."""


# --------------------------------------------------------------------------------------
# batches: rows of several kinds built from tables, with the error each one predicts
# --------------------------------------------------------------------------------------

ROW_KINDS = ["table"] * 24 + [
    "list", "int32", "int64", "uint32", "strided", "float", "nested", "huge", "wide"
]
REQUIRED_KINDS = (
    ["none"] * 6
    + ["list", "int32", "int32", "int64", "int64", "uint32", "uint64", "longlong"]
    + ["array_q", "array_i", "strided", "float64", "long", "short", "2d", "scalar"]
)
REQUIRED_VALUES = ["exact", "exact", "less", "zero", "missing", "negative", "huge"]


def materialize(table: BlockTable, kind: str) -> Any:
    ids = table.tolist()
    if kind == "table":
        return table
    if kind == "list":
        return ids
    if kind in ("int32", "int64"):
        return np.array(ids, dtype=kind)
    if kind == "uint32":
        return np.array(ids, dtype=np.int64).astype(np.uint32)  # negative IDs wrap
    if kind == "strided":
        return np.repeat(np.array(ids, dtype=np.int32), 2)[::2]  # a non-contiguous view
    if kind == "float":
        return np.array(ids, dtype=np.float64)
    if kind == "nested":
        return [ids]
    if kind == "huge":
        return np.array([*ids, 2**33], dtype=np.int64)
    if kind == "wide":
        return [*ids, *([0] * (WIDTH + 1 - len(ids)))] if len(ids) <= WIDTH else ids
    raise AssertionError(kind)


def contents_of(table: BlockTable, kind: str) -> list[int]:
    """The page IDs the row hands over, as ``materialize`` built it (its extra IDs included:
    width and required-page checks see them before any ID's range is checked)."""
    ids = table.tolist()
    if kind == "wide" and len(ids) <= WIDTH:
        return [*ids, *([0] * (WIDTH + 1 - len(ids)))]
    if kind == "huge":
        return [*ids, 2**33]
    return ids


def make_required(kind: str, value: str, lengths: list[int], pick: int) -> Any:
    n = len(lengths)
    if kind == "none":
        return None
    need = list(lengths)
    if value == "less":
        need = [max(0, q - 1) for q in need]
    elif value == "zero":
        need = [0] * n
    elif n and value == "missing":
        need[pick % n] += 1
    elif n and value == "negative":
        need[pick % n] = -1
    elif n and value == "huge":
        need[pick % n] = INT32_MAX
    as64 = np.array(need, dtype=np.int64)
    if kind == "list":
        return need
    if kind in ("int32", "int64", "uint32", "uint64", "longlong"):
        return as64.astype(kind)  # negative counts wrap in the unsigned kinds
    if kind == "array_q":
        return array.array("q", need)
    if kind == "array_i":
        return array.array("i", need)
    if kind == "strided":
        return np.repeat(as64, 2)[::2]
    if kind == "float64":
        return as64.astype(np.float64)
    if kind == "long":
        return np.append(as64, 0)
    if kind == "short":
        return as64[:-1] if n else np.zeros(1, dtype=np.int64)
    if kind == "2d":
        return as64.reshape(n, 1)
    if kind == "scalar":
        return np.int64(n)
    raise AssertionError(kind)


@dataclass(frozen=True)
class Expected:
    error: type[BlockTableError]
    fragment: str
    rows: frozenset[int] | None = None  # for range errors: any of these rows may be named


def predict(
    batch: Sequence[tuple[BlockTable, str]], required: Any, limit: int | None
) -> Expected | None:
    """The error the documented checks give, in their documented order, or None."""
    n = len(batch)
    if n > ROWS:
        return Expected(RowCountError, f"the batch has {n} rows but the storage holds {ROWS}")
    for i, (table, kind) in enumerate(batch):
        ids = table.tolist()
        if kind == "float" and ids:
            return Expected(RowTypeError, f"row {i}: page IDs must be integers")
        if kind == "nested":
            return Expected(RowTypeError, f"row {i}: expected a 1-D array of page IDs")
    contents = [contents_of(t, kind) for t, kind in batch]
    for i, ids in enumerate(contents):
        if len(ids) > WIDTH:
            return Expected(
                RowWidthError,
                f"row {i}: {len(ids)} page IDs exceed the table width of {WIDTH} columns",
            )
    if required is not None:
        req = np.asarray(required)
        if req.shape != (n,):
            return Expected(
                RowCountError, f"required_pages has shape {req.shape} but the batch has {n} rows"
            )
        if n and req.dtype.kind not in "iu":
            return Expected(
                RowTypeError, f"required_pages must hold integers, got dtype {req.dtype}"
            )
        for k, need in enumerate(req.astype(np.int64).tolist() if n else []):
            if need < 0:
                return Expected(MissingPagesError, f"row {k}: required_pages is {need}")
            if need > len(contents[k]):
                return Expected(
                    MissingPagesError,
                    f"row {k}: the request span needs {need} pages but the row holds "
                    f"{len(contents[k])}",
                )
    # IDs last: first a page ID that does not fit int32, then the pool limit
    for i, (table, kind) in enumerate(batch):
        ids = table.tolist()
        if kind == "huge":
            return Expected(
                PageIdRangeError, f"row {i}: page ID {2**33} at column {len(ids)} does not fit"
            )
        if kind == "uint32" and any(x < 0 for x in ids):
            return Expected(PageIdRangeError, f"row {i}: page ID {max(x % 2**32 for x in ids)}")
    if limit is not None:
        bad = frozenset(
            i for i, ids in enumerate(contents) if any(x < 0 or x >= limit for x in ids)
        )
        if bad:
            return Expected(PageIdRangeError, f"[0, pool_limit={limit})", bad)
    else:  # no pool limit: the lower bound alone (-1 is never a page)
        bad = frozenset(i for i, ids in enumerate(contents) if any(x < 0 for x in ids))
        if bad:
            return Expected(PageIdRangeError, "is negative; page IDs are >= 0", bad)
    return None


# --------------------------------------------------------------------------------------
# the compiled snapshots against the oracle
# --------------------------------------------------------------------------------------

page = st.integers(0, LIMIT - 1)
bad_page = st.sampled_from([LIMIT, LIMIT + 7, -1, -9, INT32_MAX, -(2**31)])
some_page = st.one_of(page, page, page, page, page, page, bad_page)
MODES = st.sampled_from(
    ["fresh", "again", "again", "swap", "reverse", "drop", "extend", "latest", "sibling",
     "too_many"]
)
PICKS = st.lists(st.tuples(st.integers(0, 99), st.sampled_from(ROW_KINDS)), max_size=ROWS)
CONTAINERS = st.sampled_from(["list", "list", "list", "tuple", "subclass"])
STEP_PLAN = st.lists(
    st.sampled_from(["one"] * 30 + ["hit"] * 8 + ["two", "bad"]), min_size=ROWS, max_size=ROWS
)
STEP_CONTAINERS = st.sampled_from(["list"] * 6 + ["tuple", "subclass"])
STEP_REQUIRED = st.sampled_from(
    ["none"] * 12 + ["int32", "int64", "uint32", "uint64", "longlong", "array_q", "array_i", "list",
                    "strided", "float64", "long", "2d"]
)
STEP_VALUES = st.sampled_from(
    ["exact"] * 8 + ["less", "less", "zero", "missing", "negative", "huge"]
)
SPAN_LIMITS = [(10**6, 10**9), (1, 10**9), (2, 10**9), (0, 10**9), (10**6, ROW_BYTES),
               (10**6, 4), (10**6, 0)]


@dataclass(frozen=True)
class Upload:
    """What a publisher kept when it uploaded rows ``[0, rows)``: revision, keys, bytes."""

    revision: int
    keys: np.ndarray
    storage: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.keys.size)


class CompiledSnapshotMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tables: list[BlockTable] = []
        self.last_batch: list[tuple[BlockTable, str]] = []
        self.revisions: list[int] = [0]
        self.uploads: list[Upload] = []
        self.limit: int | None = None
        self.fill = 0
        self.fallbacks = 0
        self.saved: list[tuple[BlockTable, str]] = []
        self.entry_state: dict[int, tuple[Any, ...]] = {}

    @initialize(
        limit=st.sampled_from([None, LIMIT]),
        fill=st.sampled_from([0, -1]),
        garbage=st.booleans(),
        first=st.lists(st.lists(page, max_size=8), min_size=1, max_size=ROWS),
    )
    def setup(self, limit: int | None, fill: int, garbage: bool, first: list[list[int]]) -> None:
        if garbage:
            storage = np.random.default_rng(7).integers(-3, 60, (ROWS, WIDTH)).astype(np.int32)
        else:
            storage = np.full((ROWS, WIDTH), fill, dtype=np.int32)
        self.limit = limit
        self.fill = fill
        self.snaps = tuple(
            PageTableSnapshot(storage.copy(), pool_limit=limit, fill_value=fill, history=HISTORY)
            for _ in range(2)
        )
        self.first = self.snaps[0]
        self.oracle = oracle_of(storage, fill, HISTORY)
        self.tables = [BlockTable(ids) for ids in first]
        self.last_batch = [(t, "table") for t in self.tables]
        # Whenever the compiled step hands a batch back, it must not have written anything.
        for snap in self.snaps:
            self.guard(snap)
        self.run_all(self.last_batch, "list", "none", "exact", 0)

    def guard(self, snap: PageTableSnapshot) -> None:
        original = snap._prepare_changed

        def guarded(rows: Any, keys: Any, required: Any, real: Any = None) -> int:
            self.fallbacks += 1
            entry = self.entry_state.get(id(snap))
            assert entry is not None
            assert state_of(snap) == entry, "written before fallback"
            result: int = original(rows, keys, required, real)
            return result

        snap._prepare_changed = guarded  # type: ignore[method-assign]

    def pick(self, index: int) -> BlockTable:
        """Three in four picks take a table of the last batch, where changes matter most."""
        if index % 4 and self.last_batch:
            return self.last_batch[index % len(self.last_batch)][0]
        return self.tables[index % len(self.tables)]

    # -- table changes ------------------------------------------------------------------

    @rule(ids=st.lists(some_page, max_size=7))
    def new_table(self, ids: list[int]) -> None:
        self.tables.append(BlockTable(ids))

    @rule(index=st.integers(0, 99), value=some_page)
    def append_one(self, index: int, value: int) -> None:
        table = self.pick(index)
        table.append_one(value)
        assert table.tolist()[-1] == value

    @rule(index=st.integers(0, 99), ids=st.lists(page, min_size=2, max_size=4))
    def append_several(self, index: int, ids: list[int]) -> None:
        table = self.pick(index)
        before = table.tolist()
        table.append(np.array(ids, dtype=np.int64))
        assert table.tolist() == before + ids

    @rule(index=st.integers(0, 99))
    def grow_wider_than_storage(self, index: int) -> None:
        table = self.pick(index)
        if index % 5 == 0:  # rare: a too-wide row rejects every batch holding it
            table.append(range(WIDTH + 1 - len(table)) if len(table) <= WIDTH else [1])

    @rule(index=st.integers(0, 99), length=st.integers(0, 99))
    def truncate(self, index: int, length: int) -> None:
        table = self.pick(index)
        if len(table):
            before = table.version
            table.truncate(length % len(table))
            assert table.version != before

    @rule(index=st.integers(0, 99), position=st.integers(0, 99), value=page)
    def overwrite(self, index: int, position: int, value: int) -> None:
        table = self.pick(index)
        if len(table):
            table[position % len(table)] = value

    @rule(index=st.integers(0, 99))
    def lineage_copy(self, index: int) -> None:
        table = self.pick(index)
        copy = table.lineage_copy()
        assert copy.version == table.version
        self.tables.append(copy)

    @rule(index=st.integers(0, 99))
    def independent_copy(self, index: int) -> None:
        self.tables.append(self.pick(index).copy())

    @rule()
    def checkpoint(self) -> None:
        """Keep lineage copies of the batch (as speculative decoding does before it
        appends draft pages) for a later rollback."""
        self.saved = [(t.lineage_copy(), "table") for t, _ in self.last_batch]

    @precondition(lambda self: bool(self.saved))
    @rule(required=st.sampled_from(REQUIRED_KINDS), pick=st.integers(0, 99))
    def rollback(self, required: str, pick: int) -> None:
        """Prepare the checkpointed copies again: the same lineages, usually shorter."""
        self.run_all(list(self.saved), "list", required, "exact", pick)

    @rule(
        plan=STEP_PLAN,
        ids=st.lists(page, min_size=ROWS, max_size=ROWS),
        required=STEP_REQUIRED,
        pick=st.integers(0, 99),
    )
    def speculate_and_roll_back(
        self, plan: list[str], ids: list[int], required: str, pick: int
    ) -> None:
        """Checkpoint, a few decode steps, then the checkpointed copies again."""
        self.checkpoint()
        self.run_step(plan, ids, LIMIT, "list", required, "exact", pick)
        self.run_all(list(self.saved), "list", "none", "exact", pick)

    @rule(row=st.integers(0, ROWS - 1), column=st.integers(0, WIDTH - 1), value=st.integers())
    def write_behind_and_invalidate(self, row: int, column: int, value: int) -> None:
        if value % 5:
            return  # rare: it sends every row back through the full-width path
        for snap in self.snaps:
            snap.storage[row, column] = value % 97
            snap.invalidate()
        self.oracle.storage[row][column] = value % 97
        self.oracle.invalidate()
        for snap in self.snaps:
            assert state_of(snap) == oracle_state(self.oracle)
        self.revisions.append(self.oracle.revision)

    # -- prepare --------------------------------------------------------------------------

    @rule(
        mode=MODES,
        picks=PICKS,
        container=CONTAINERS,
        required=st.sampled_from(REQUIRED_KINDS),
        value=st.sampled_from(REQUIRED_VALUES),
        pick=st.integers(0, 99),
    )
    def prepare(
        self, mode: str, picks: list[tuple[int, str]], container: str, required: str,
        value: str, pick: int,
    ) -> None:
        chosen = [(self.tables[index % len(self.tables)], kind) for index, kind in picks]
        last = self.last_batch
        if mode == "again":
            chosen = list(last)
        elif mode == "swap" and len(last) > 1:
            a, b = pick % len(last), (pick // 7) % len(last)
            chosen = list(last)
            chosen[a], chosen[b] = chosen[b], chosen[a]
        elif mode == "reverse":
            chosen = last[::-1]
        elif mode == "drop":
            chosen = last[: len(last) - 1 - pick % 2]
        elif mode == "extend":
            chosen = last + chosen[: 1 + pick % 2]
        elif mode == "latest" and last:
            chosen = list(last)
            chosen[pick % len(chosen)] = (self.tables[-1], "table")
        elif mode == "sibling" and last:
            # Another member of a slot's lineage (older or newer copy) takes that slot.
            chosen = list(last)
            slot = pick % len(chosen)
            current = chosen[slot][0]
            kin = [t for t in self.tables if t.version == current.version and t is not current]
            if kin:
                chosen[slot] = (kin[pick % len(kin)], "table")
        elif mode == "too_many":
            chosen = [(self.tables[(pick + k) % len(self.tables)], "table")
                      for k in range(ROWS + 1)]
        self.run_all(chosen, container, required, value, pick)

    @rule(
        plan=STEP_PLAN,
        ids=st.lists(page, min_size=ROWS, max_size=ROWS),
        bad=bad_page,
        container=STEP_CONTAINERS,
        required=STEP_REQUIRED,
        value=STEP_VALUES,
        pick=st.integers(0, 99),
    )
    def decode_step(
        self, plan: list[str], ids: list[int], bad: int, container: str, required: str,
        value: str, pick: int,
    ) -> None:
        """The steady decode step: the same tables, most of them one page longer."""
        self.run_step(plan, ids, bad, container, required, value, pick)

    @rule(
        plan=STEP_PLAN,
        ids=st.lists(page, min_size=ROWS, max_size=ROWS),
        bad=bad_page,
        container=STEP_CONTAINERS,
        required=STEP_REQUIRED,
        value=STEP_VALUES,
        pick=st.integers(0, 99),
    )
    def decode_step_b(
        self, plan: list[str], ids: list[int], bad: int, container: str, required: str,
        value: str, pick: int,
    ) -> None:
        """The same rule again, so that decode steps are as likely as table changes."""
        self.run_step(plan, ids, bad, container, required, value, pick)

    def run_step(
        self, plan: list[str], ids: list[int], bad: int, container: str, required: str,
        value: str, pick: int,
    ) -> None:
        for repeat in range(1 + pick % 3):  # a few consecutive steps of one batch
            batch = [(t, "table") for t, _ in self.last_batch]
            seen: set[int] = set()
            for k, (table, _) in enumerate(batch):
                if id(table) in seen:
                    continue
                seen.add(id(table))
                how = plan[(k + repeat) % ROWS]
                if how == "one":
                    table.append_one(ids[(k + repeat) % ROWS])
                elif how == "two":
                    table.append([ids[k % ROWS], ids[(k + 1) % ROWS]])
                elif how == "bad":
                    table.append_one(bad)
            self.run_all(batch, container, required, value, pick)

    def run_all(
        self, chosen: list[tuple[BlockTable, str]], container: str, required_kind: str,
        value: str, pick: int,
    ) -> None:
        rows: Any = [materialize(t, kind) for t, kind in chosen]
        if container == "tuple":
            rows = tuple(rows)
        elif container == "subclass":
            rows = BatchList(rows)
        lengths = [len(contents_of(t, kind)) for t, kind in chosen]
        required = make_required(required_kind, value, lengths, pick)
        expected = predict(chosen, required, self.limit)

        before = [state_of(snap) for snap in self.snaps]
        assert before[0] == before[1] == oracle_state(self.oracle)
        old_storage = self.first.storage.copy()
        old_revision = self.first.revision
        # Lineage proofs are shared through the tables: vary which snapshot goes first.
        order = self.snaps if pick % 2 else self.snaps[::-1]
        results: dict[int, Outcome] = {}
        for snap, state in zip(self.snaps, before, strict=True):
            self.entry_state[id(snap)] = state
        for snap in order:
            results[id(snap)] = outcome(
                lambda snap=snap: snap.prepare(rows, required_pages=required)
            )
        self.entry_state.clear()
        got = [results[id(snap)] for snap in self.snaps]
        assert got[0] == got[1]

        if expected is not None:
            status, error, message = got[0]
            assert status == "error", f"expected {expected}, got {got[0]}"
            assert error is expected.error, message
            assert expected.fragment in message
            if expected.rows is not None:
                assert any(f"row {r}:" in message for r in expected.rows), message
            for snap, state in zip(self.snaps, before, strict=True):
                assert state_of(snap) == state
            self.repair(chosen)
            return

        n = len(rows)
        contents = [contents_of(t, k) for t, k in chosen]
        revision = self.oracle.prepare(
            [OracleRow(tuple(ids), t.version if kind == "table" else None)
             for (t, kind), ids in zip(chosen, contents, strict=True)])
        assert got[0] == ("ok", revision, None), got[0]
        for snap in self.snaps:
            assert state_of(snap) == oracle_state(self.oracle)
            assert snap.num_rows == n
            assert snap.row_lengths.tolist() == lengths
            np.testing.assert_array_equal(snap.storage[:n], naive(contents, WIDTH, self.fill))
            np.testing.assert_array_equal(snap.storage[n:], old_storage[n:])
        changed_bytes = not np.array_equal(self.first.storage, old_storage)
        assert revision == old_revision + int(changed_bytes)
        differing = np.flatnonzero((self.first.storage != old_storage).any(axis=1))
        since_last = self.first.changed_rows_since(old_revision)
        if not since_last.all_rows:
            assert since_last.rows().tolist() == differing.tolist()
        if revision != self.revisions[-1]:
            self.revisions.append(revision)
            del self.revisions[:-8]
        for since in [*self.revisions, -1, revision + 1]:
            expect = ChangedRows(*self.oracle.changed_rows_since(since))
            for snap in self.snaps:
                assert snap.changed_rows_since(since) == expect, since
        self.last_batch = list(chosen)
        self.repair(chosen)

    def repair(self, chosen: list[tuple[BlockTable, str]]) -> None:
        """Truncate bad and too-wide tables (halving those past the width) so later steps
        reach the other paths. Full-width tables stay: their next append is too wide."""
        for table, _ in chosen:
            ids = table.tolist()
            bad = [k for k, x in enumerate(ids) if x < 0 or x >= LIMIT]
            keep = min([len(ids) // 2 if len(ids) > WIDTH else len(ids), *bad])
            if keep < len(table):
                table.truncate(keep)

    # -- change spans ---------------------------------------------------------------------

    @rule()
    def upload(self) -> None:
        """A publisher uploads rows ``[0, num_rows)`` and keeps their keys."""
        keys = row_keys(self.first)
        np.testing.assert_array_equal(keys, row_keys(self.snaps[1]))
        assert keys.tolist() == self.oracle.keys[: self.oracle.num_rows]
        assert keys.dtype == np.int64 and keys.size == self.first.num_rows
        np.testing.assert_array_equal(row_keys(self.first, 2), keys[:2])
        self.uploads.append(Upload(self.first.revision, keys, self.first.storage.copy()))
        del self.uploads[:-5]

    @precondition(lambda self: bool(self.uploads))
    @rule(which=st.integers(0, 99))
    def compare_spans(self, which: int) -> None:
        up = self.uploads[which % len(self.uploads)]
        now = self.first.num_rows
        then = up.keys.tolist()
        choices = {0, max(up.rows - 1, 0), min(up.rows, now), now, min(up.rows + 1, now)}
        for num_rows in sorted(choices | {ROWS}):
            exact = num_rows <= now  # past num_rows only agreement is defined
            for revision in (up.revision, None):
                expect = self.oracle.spans(then, num_rows, revision)
                for snap in self.snaps:
                    spans = changed_spans(snap, up.keys, num_rows, revision)
                    assert spans == (None if expect is None else ChangedSpans(*expect))
                    if spans is not None and exact:
                        self.check_spans_cover(up, spans, num_rows)
                for max_ranges, max_bytes in SPAN_LIMITS:
                    expected = self.oracle.byte_ranges(then, num_rows, ROW_BYTES, revision,
                                                       max_ranges, max_bytes)
                    for snap in self.snaps:
                        got = changed_byte_ranges(
                            snap, up.keys, num_rows, ROW_BYTES, revision=revision,
                            max_ranges=max_ranges, max_bytes=max_bytes,
                        )
                        assert got == expected, (num_rows, revision, max_ranges, max_bytes)
                    if max_ranges == 10**6 and max_bytes == 10**9:
                        if revision is None:
                            assert expected is not None
                        if expected is not None and exact:
                            self.check_ranges(up, expected, num_rows)

    def check_spans_cover(self, up: Upload, spans: ChangedSpans, num_rows: int) -> None:
        """Every cell of rows ``[0, min(num_rows, up.rows))`` that differs is covered."""
        limit = min(num_rows, up.rows)
        assert spans.rows == sorted(set(spans.rows))
        covered = np.zeros((limit, WIDTH), dtype=bool)
        for r, a, b in zip(spans.rows, spans.starts, spans.stops, strict=True):
            assert 0 <= r < limit and 0 <= a < b <= WIDTH
            covered[r, a:b] = True
        assert spans.num_ids == int(covered.sum())
        differs = self.first.storage[:limit] != up.storage[:limit]
        assert not (differs & ~covered).any()

    def check_ranges(
        self, up: Upload, result: tuple[list[tuple[int, int]], int], num_rows: int
    ) -> None:
        """Applying the ranges to what the destination held gives rows ``[0, num_rows)``."""
        ranges, total = result
        assert total == sum(b - a for a, b in ranges)
        flat = [x for pair in ranges for x in pair]
        assert all(a < b for a, b in ranges)
        assert flat == sorted(flat) and len(set(flat)) == len(flat)  # ascending and merged
        assert not ranges or ranges[-1][1] <= num_rows * ROW_BYTES
        rebuilt = apply_ranges(up.storage, self.first.storage, ranges)
        np.testing.assert_array_equal(rebuilt[:num_rows], self.first.storage[:num_rows])

    @invariant()
    def snapshots_agree_with_the_oracle(self) -> None:
        if self.tables:
            for snap in self.snaps:
                assert state_of(snap) == oracle_state(self.oracle)


CompiledSnapshotMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# (was test_native_and_python_snapshots_agree, against the removed numpy twin)
test_compiled_snapshots_agree_with_the_oracle = CompiledSnapshotMachine.TestCase




# --------------------------------------------------------------------------------------
# the boundary of the compiled step (what it covers, what it hands back untouched)
# --------------------------------------------------------------------------------------


@pytest.fixture
def counted() -> Iterator[tuple[PageTableSnapshot, list[int]]]:
    """A snapshot whose hand-backs to snapshot.py are counted (and checked to see no
    write)."""
    snap = PageTableSnapshot(np.zeros((4, 8), dtype=np.int32), pool_limit=LIMIT)
    calls: list[int] = []
    original = snap._prepare_changed
    entry: list[tuple[Any, ...]] = []

    def counting(rows: Any, keys: Any, required: Any, real: Any = None) -> int:
        calls.append(1)
        assert state_of(snap) == entry[-1]
        result: int = original(rows, keys, required, real)
        return result

    snap._prepare_changed = counting  # type: ignore[method-assign]
    real_prepare = snap.prepare

    def prepare(rows: Any, *, required_pages: Any = None) -> int:
        entry.append(state_of(snap))
        return real_prepare(rows, required_pages=required_pages)

    snap.prepare = prepare  # type: ignore[method-assign]
    yield snap, calls


def test_compiled_step_covers_hits_and_single_page_appends(
    counted: tuple[PageTableSnapshot, list[int]],
) -> None:
    snap, calls = counted
    rows = [BlockTable([1, 2]), BlockTable([3]), BlockTable()]
    assert snap.prepare(rows) == 1
    assert len(calls) == 1  # unknown rows: snapshot.py
    for t, page_id in zip(rows, (4, 5, 6), strict=True):
        t.append_one(page_id)
    assert snap.prepare(rows) == 2
    assert snap.prepare(tuple(rows), required_pages=np.array([3, 2, 1], dtype=np.uint32)) == 2
    assert snap.prepare(rows[:2], required_pages=np.array([0, 0], dtype=np.int32)) == 2
    rows[0].append_one(0)  # lands where the fill value is: no byte changes
    assert snap.prepare(rows) == 2
    assert len(calls) == 1
    assert snap.row_lengths.tolist() == [4, 2, 1]
    np.testing.assert_array_equal(snap.storage[:3], naive([[1, 2, 4, 0], [3, 5], [6]], 8, 0))
    assert snap.changed_rows_since(1).rows().tolist() == [0, 1, 2]


def test_compiled_step_covers_appends_of_several_pages(
    counted: tuple[PageTableSnapshot, list[int]],
) -> None:
    """A prefill chunk's rows grow by several pages of their lineage (copies included):
    the compiled step reads them from the lineage's array, writes only differing bytes,
    and matches the oracle."""
    snap, calls = counted
    rows = [BlockTable([1, 2]), BlockTable([3]), BlockTable([4])]
    snap.prepare(rows)
    oracle = oracle_of(np.zeros((4, 8), dtype=np.int32))
    oracle.prepare(oracle_rows(rows))
    calls.clear()
    grown = [rows[0].lineage_copy(), rows[1], rows[2]]
    grown[0].append([5, 6, 7])  # the copy extends the shared lineage
    grown[1].append([8, 0])  # the 0 lands on the fill value: bytes change anyway (the 8)
    rev = snap.prepare(grown)
    assert calls == []
    assert rev == oracle.prepare(oracle_rows(grown))
    assert state_of(snap) == oracle_state(oracle)
    np.testing.assert_array_equal(snap.storage[:3],
                                  naive([[1, 2, 5, 6, 7], [3, 8, 0], [4]], 8, 0))
    assert snap.changed_rows_since(rev - 1).rows().tolist() == [0, 1]
    # the original row (shorter, same lineage) comes back: a shrink, snapshot.py's
    assert snap.prepare(rows) == rev + 1 and calls == [1]


class OddInt(int):
    """An int subclass: a slot value the compiled step does not read."""


def test_compiled_step_hands_back_slots_that_are_not_exact_ints(
    counted: tuple[PageTableSnapshot, list[int]],
) -> None:
    """The compiled step reads a row's ``_key`` and ``_last`` slots only when they hold
    exact ints; anything else (here set by hand) goes to snapshot.py, with its result."""
    snap, calls = counted
    rows = [BlockTable([1, 2]), BlockTable([3])]
    snap.prepare(rows)
    rows[0].append_one(7)
    rows[1]._key = OddInt(rows[1]._key)  # the same key, not an exact int
    calls.clear()
    assert snap.prepare(rows) == 2 and calls == [1]
    rows[1].append_one(8)
    rows[1]._last = np.int64(8)  # the appended ID as a numpy scalar
    assert snap.prepare(rows) == 3 and calls == [1, 1]
    np.testing.assert_array_equal(snap.storage[:2], naive([[1, 2, 7], [3, 8]], 8, 0))
    assert snap._row_keys[:2].tolist() == [rows[0]._key, rows[1]._key]
    assert snap.row_lengths.tolist() == [3, 2]


@pytest.mark.parametrize(
    ("change", "required", "error", "fragment"),
    [
        ("two_pages_one_outside", None, PageIdRangeError,
         f"row 1: page ID {LIMIT} at column 2 is outside [0, pool_limit={LIMIT})"),
        ("unversioned", None, None, ""),
        ("list_subclass", None, None, ""),
        ("new_version", None, None, ""),
        ("one_page", np.array([1, 1], dtype=np.int16), None, ""),
        ("one_page", [3, 2], None, ""),
        ("one_page", np.array([3, 2], dtype=np.float64), RowTypeError,
         "required_pages must hold integers"),
        ("one_page", np.array([4, 2], dtype=np.int64), MissingPagesError,
         "row 0: the request span needs 4 pages but the row holds 3"),
        ("one_page", np.array([-1, 2], dtype=np.int32), MissingPagesError,
         "row 0: required_pages is -1"),
        ("one_page", np.array([3], dtype=np.int64), RowCountError,
         "required_pages has shape (1,) but the batch has 2 rows"),
        ("one_page", np.array([[3, 2]], dtype=np.int64), RowCountError,
         "required_pages has shape (1, 2)"),
        ("bad_page", None, PageIdRangeError,
         f"row 1: appended page ID {LIMIT} at column 1 is outside [0, pool_limit={LIMIT})"),
        ("negative_page", None, PageIdRangeError,
         f"row 1: appended page ID -4 at column 1 is outside [0, pool_limit={LIMIT})"),
        ("too_many", None, RowCountError, "the batch has 5 rows but the storage holds 4"),
    ],
)
def test_compiled_step_hands_back_without_writing(
    counted: tuple[PageTableSnapshot, list[int]],
    change: str,
    required: Any,
    error: type[BlockTableError] | None,
    fragment: str,
) -> None:
    """Cases the compiled step does not cover reach snapshot.py with nothing written
    (checked on entry by the fixture), and give the oracle's result, or the error."""
    snap, calls = counted
    rows: Any = [BlockTable([1, 2]), BlockTable([3])]
    snap.prepare(rows)
    oracle = oracle_of(np.zeros((4, 8), dtype=np.int32))
    oracle.prepare(oracle_rows(rows))
    rows[0].append_one(7)
    if change == "two_pages_one_outside":
        rows[1].append([8, LIMIT])
    elif change == "unversioned":
        rows = [rows[0], [3, 8]]
    elif change == "list_subclass":
        rows[1].append_one(8)
        rows = BatchList(rows)
    elif change == "new_version":
        rows[1][0] = 11
    elif change == "one_page":
        rows[1].append_one(8)
    elif change == "bad_page":
        rows[1].append_one(LIMIT)
    elif change == "negative_page":
        rows[1].append_one(-4)
    elif change == "too_many":
        rows = rows + [BlockTable([1]) for _ in range(3)]
    calls.clear()
    before = state_of(snap)
    got = outcome(lambda: snap.prepare(rows, required_pages=required))
    assert calls == [1]
    if error is None:
        assert got == ("ok", oracle.prepare(oracle_rows(rows)), None)
        assert state_of(snap) == oracle_state(oracle)
    else:
        assert got[0] == "error" and got[1] is error
        assert fragment in got[2]
        assert state_of(snap) == before


def test_compiled_spans_on_an_all_versioned_batch() -> None:
    snap = PageTableSnapshot(np.full((4, 6), -1, dtype=np.int32), fill_value=-1)
    rows = [BlockTable([1, 2]), BlockTable([3, 4, 5]), BlockTable([6])]
    snap.prepare(rows)
    keys = row_keys(snap)
    old = snap.storage.copy()
    rows[0].append_one(7)  # an append: only column 2 of row 0
    rows[1].truncate(1)  # a new version: columns [0, 3) of row 1
    rows.append(BlockTable([8, 9]))  # a row the destination never held
    snap.prepare(rows)
    assert snap._book.all_versioned
    assert changed_spans(snap, keys, 4) == ChangedSpans([0, 1], [2, 0], [3, 3])
    result = changed_byte_ranges(snap, keys, 4, 24, max_ranges=3, max_bytes=100)
    assert result == ([(8, 12), (24, 36), (72, 96)], 40)
    assert changed_byte_ranges(snap, keys, 4, 24, max_ranges=2, max_bytes=100) is None
    assert changed_byte_ranges(snap, keys, 4, 24, max_ranges=3, max_bytes=39) is None
    assert changed_byte_ranges(snap, keys, 2, 24, max_ranges=2, max_bytes=16) == (
        [(8, 12), (24, 36)], 16
    )
    assert changed_byte_ranges(snap, keys, 2, 24, max_ranges=1, max_bytes=100) is None
    assert changed_byte_ranges(snap, keys, 1, 24, max_ranges=1, max_bytes=4) == ([(8, 12)], 4)
    ranges, _ = result
    np.testing.assert_array_equal(apply_ranges(old, snap.storage, ranges)[:4], snap.storage[:4])


def _column(keys: np.ndarray) -> np.ndarray:
    table = np.zeros((keys.size, 3), dtype=np.int64)
    table[:, 1] = keys
    return table[:, 1]  # keys kept as a column of a 2-D array: stride 24 bytes


KEY_LAYOUTS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "column": _column,
    "reversed": lambda keys: np.ascontiguousarray(keys[::-1])[::-1],  # negative stride
    "read_only": lambda keys: np.frombuffer(keys.tobytes(), dtype=np.int64),
    "uint64": lambda keys: keys.view(np.uint64),
    "big_endian": lambda keys: keys.astype(">i8"),
}
HANDED_BACK = {"uint64", "big_endian"}  # not native signed int64: spans.py's own lines


@pytest.mark.parametrize("layout", sorted(KEY_LAYOUTS))
def test_spans_accept_other_key_layouts(layout: str) -> None:
    """Keys that are not the contiguous native int64 array ``row_keys`` returns (a column
    of a 2-D array, a reversed view, read-only, unsigned or big-endian) give the same
    answer: the compiled diff reads the int64 views in place and hands the others back to
    spans.py."""
    snap = PageTableSnapshot(np.zeros((4, 8), dtype=np.int32))
    rows = [BlockTable([1, 2]), BlockTable([3]), BlockTable([4, 5])]
    snap.prepare(rows)
    keys = KEY_LAYOUTS[layout](row_keys(snap))
    rows[0].append_one(5)
    rows[2].truncate(1)
    snap.prepare(rows)
    assert snap._book.all_versioned
    handed_back = snap._native.key_spans(snap._row_keys[:3], keys, 3) is NotImplemented
    assert handed_back == (layout in HANDED_BACK)
    assert changed_spans(snap, keys, 3) == ChangedSpans([0, 2], [2, 0], [3, 2])
    oracle = oracle_of(np.zeros((4, 8), dtype=np.int32))
    oracle.keys[:3] = snap._row_keys[:3].tolist()
    oracle.all_versioned = True
    for num_rows in (2, 3, 4):
        got = changed_byte_ranges(snap, keys, num_rows, 32, max_ranges=4, max_bytes=999)
        assert got == oracle.byte_ranges(keys.tolist(), num_rows, 32, None, 4, 999)
    assert got == ([(8, 12), (64, 72), (96, 128)], 44)


def test_compiled_step_reads_a_strided_required_array(
    counted: tuple[PageTableSnapshot, list[int]],
) -> None:
    """A strided integer view of required pages is read in place by the compiled step (no
    hand-back); a count the row does not hold is handed back, and reported."""
    snap, calls = counted
    rows = [BlockTable([1, 2]), BlockTable([3])]
    snap.prepare(rows)
    oracle = oracle_of(np.zeros((4, 8), dtype=np.int32))
    oracle.prepare(oracle_rows(rows))
    rows[0].append_one(7)
    rows[1].append_one(8)
    required = np.array([3, 9, 2, 9], dtype=np.int64)[::2]
    calls.clear()
    got = outcome(lambda: snap.prepare(rows, required_pages=required))
    assert got == ("ok", oracle.prepare(oracle_rows(rows)), None) and calls == []
    assert state_of(snap) == oracle_state(oracle)
    short = np.array([3, 9, 9, 9], dtype=np.int64)[::2]  # row 1 needs 9 pages, holds 2
    before = state_of(snap)
    got = outcome(lambda: snap.prepare(rows, required_pages=short))
    assert got[0] == "error" and got[1] is MissingPagesError and calls == [1]
    assert "row 1: the request span needs 9 pages but the row holds 2" in got[2]
    assert state_of(snap) == before


@pytest.mark.parametrize("max_ranges", [3, 0])
def test_keys_out_receives_the_keys_to_remember(max_ranges: int) -> None:
    """``changed_byte_ranges(keys_out=)`` writes ``row_keys(snap, n)`` into the caller's
    array whatever the result (ranges or None), compiled and through spans.py alike, and
    touches nothing past ``n``; ``row_keys(out=)`` returns a view of ``out``."""
    snap = PageTableSnapshot(np.full((5, 6), -1, dtype=np.int32), fill_value=-1)
    rows = [BlockTable([1, 2]), BlockTable([3, 4, 5]), BlockTable([6]), BlockTable([7])]
    snap.prepare(rows)
    keys = row_keys(snap)
    rows[0].append_one(9)
    snap.prepare(rows)
    out = np.full(5, -123, dtype=np.int64)
    result = changed_byte_ranges(snap, keys, 3, 24, max_ranges=max_ranges, max_bytes=100,
                                 keys_out=out)
    assert result == (([(8, 12)], 4) if max_ranges else None)
    np.testing.assert_array_equal(out[:3], row_keys(snap, 3))
    assert out[3:].tolist() == [-123, -123]
    # a keys_out the compiled diff does not write (int32): handed back to spans.py, which
    # casts the same keys into it
    cast = np.full(5, -7, dtype=np.int32)
    assert snap._native.changed_byte_ranges(snap._row_keys, keys, keys.size, 3, 24, 8, 100,
                                            cast) is NotImplemented
    assert changed_byte_ranges(snap, keys, 3, 24, max_ranges=max_ranges, max_bytes=100,
                               keys_out=cast) == result
    # (numpy's int64 -> int32 assignment: the version counter is process-wide, so a key
    # may pass int32 after other tests made BlockTables)
    assert cast[:3].tolist() == row_keys(snap, 3).astype(np.int32).tolist()
    assert cast[3:].tolist() == [-7, -7]
    again = np.full(5, -5, dtype=np.int64)
    view = row_keys(snap, 2, out=again)
    assert view.base is again and view.tolist() == row_keys(snap, 2).tolist()
    assert again[2:].tolist() == [-5, -5, -5]
    # spans.py alone (a snapshot whose last batch was not all versioned)
    plain = PageTableSnapshot(np.full((5, 6), -1, dtype=np.int32), fill_value=-1)
    plain.prepare([[1, 2], [3]])
    then = row_keys(plain)
    plain.prepare([[1, 2, 4], [3]])
    out = np.zeros(5, dtype=np.int64)
    assert changed_byte_ranges(plain, then, 2, 24, revision=None, max_ranges=4,
                               max_bytes=100, keys_out=out) is not None
    np.testing.assert_array_equal(out[:2], row_keys(plain, 2))


def test_tagged_ranges_are_the_pairs_as_record_triples() -> None:
    """The compiled ``changed_byte_ranges`` with a tag returns each range as
    ``(tag, start, nbytes)``: the same ranges, total and None cases as without it."""
    snap = PageTableSnapshot(np.full((6, 8), -1, dtype=np.int32), fill_value=-1)
    native = snap._native
    rows = [BlockTable([1, 2]), BlockTable([3, 4, 5]), BlockTable([6]), BlockTable([7])]
    snap.prepare(rows)
    keys = row_keys(snap)
    rows[0].append_one(9)
    rows[2].append_one(10)
    rows.append(BlockTable([11]))
    snap.prepare(rows)
    now = snap._row_keys
    for max_ranges, max_bytes in ((8, 1000), (1, 1000), (8, 4)):
        pairs = native.changed_byte_ranges(now, keys, keys.size, 5, 32, max_ranges, max_bytes)
        triples = native.changed_byte_ranges(now, keys, keys.size, 5, 32, max_ranges,
                                             max_bytes, None, 3)
        if pairs is None:
            assert triples is None
            continue
        assert pairs[0] == [(8, 12), (68, 72), (128, 160)]
        assert triples == ([(3, a, b - a) for a, b in pairs[0]], pairs[1])
    with pytest.raises(ValueError, match="tag must be >= 0"):
        native.changed_byte_ranges(now, keys, keys.size, 5, 32, 8, 100, None, -1)


@pytest.mark.parametrize("keys_kind", ["int64", "uint64", "unversioned"])
def test_snapshot_method_gives_the_module_function_s_ranges(keys_kind: str) -> None:
    """``PageTableSnapshot.changed_byte_ranges``: (offset, nbytes) pairs, or tagged
    triples, equal to the module function's (start, stop) ranges and to hand-written
    ones, whether the compiled diff answers (int64 keys of an all-versioned batch) or
    hands back to spans.py (uint64 keys; a batch with an unversioned row, its revision
    given); None past the limits; ``keys_out`` filled either way."""
    snap = PageTableSnapshot(np.full((6, 8), -1, dtype=np.int32), fill_value=-1)
    rows: list[Any] = [BlockTable([1, 2]), BlockTable([3, 4, 5]), BlockTable([6]),
                       BlockTable([7])]
    snap.prepare(rows)
    keys = row_keys(snap)
    revision = snap.revision
    if keys_kind == "uint64":
        keys = keys.view(np.uint64)
    rows[0].append_one(9)
    rows[2].append_one(10)
    rows.append(BlockTable([11]) if keys_kind != "unversioned" else [11])
    snap.prepare(rows)
    assert snap._book.all_versioned == (keys_kind != "unversioned")
    got = []
    for max_ranges, max_bytes, tag in ((8, 1000, None), (8, 1000, 2), (1, 1000, None),
                                       (8, 4, 5)):
        out = np.full(6, -9, dtype=np.int64)
        found = snap.changed_byte_ranges(keys, 5, 32, max_ranges, max_bytes, out, tag,
                                         revision)
        assert out[:5].tolist() == snap._row_keys[:5].tolist()
        got.append(found)
    reference = changed_byte_ranges(snap, keys, 5, 32, revision=revision, max_ranges=8,
                                    max_bytes=1000)
    assert reference == ([(8, 12), (68, 72), (128, 160)], 40)
    assert got[0] == ([(8, 4), (68, 4), (128, 32)], 40)
    assert got[1] == ([(2, 8, 4), (2, 68, 4), (2, 128, 32)], 40)
    assert got[2] is None and got[3] is None


# --------------------------------------------------------------------------------------
# block_tables.native: the compiled core is required, built with the wheel, never compiled
# at import
# --------------------------------------------------------------------------------------

NATIVE_NAME = "block_tables._snapshot_native"

# A finder that refuses the compiled snapshot core: the package as installed without it.
BLOCK_NATIVE = (
    "import importlib.abc, sys\n"
    "class Refuse(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    f"        if name == {NATIVE_NAME!r}:\n"
    "            raise ImportError(f'no module named {name!r} (refused by the test)')\n"
    "sys.meta_path.insert(0, Refuse())\n"
)


def run_python(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script], env={**os.environ, **env},
                          capture_output=True, text=True, check=False)


def test_require_extension_names_the_module_and_the_fix() -> None:
    with pytest.raises(NativeBuildError) as info:
        require_extension("block_tables._no_such_native")
    message = str(info.value)
    assert isinstance(info.value, ImportError) and isinstance(info.value, BlockTableError)
    assert message.startswith("the compiled core block_tables._no_such_native is not built")
    assert FIX in message and "tools/build_native.py" in message and "pip install" in message
    assert require_extension(NATIVE_NAME) is snapshot_module._native


def test_the_snapshot_runs_the_compiled_core_and_takes_no_mode() -> None:
    """The compiled core is the only mode: a snapshot binds the built extension, and the
    removed ``native=`` argument is not accepted."""
    storage = np.arange(12, dtype=np.int32).reshape(3, 4)
    with pytest.raises(TypeError, match="native"):
        PageTableSnapshot(storage, native=True)  # type: ignore[call-arg]
    np.testing.assert_array_equal(storage, np.arange(12).reshape(3, 4))
    snap = PageTableSnapshot(storage)
    assert snap._native is snapshot_module._native
    assert snap._native.__file__.endswith(sysconfig.get_config_var("EXT_SUFFIX") or ".so")
    rows = [BlockTable([5, 6]), BlockTable([7])]
    first = snap.prepare(rows)
    rows[0].append_one(8)
    assert snap.prepare(rows) == first + 1
    np.testing.assert_array_equal(storage[:2], naive([[5, 6, 8], [7]], 4, 0))


def test_import_runs_no_compiler_and_writes_nothing(tmp_path: Path) -> None:
    """The extension comes from the wheel (or an in-place build): importing with no
    compiler on PATH, an unusable CC and an unwritable HOME still loads it."""
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o500)
    script = "import block_tables.snapshot as s; print(s._native.__file__)"
    done = run_python(script, PATH="", CC="/nonexistent/cc", HOME=str(home),
                      XDG_CACHE_HOME=str(home / "cache"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(sysconfig.get_config_var("EXT_SUFFIX") or ".so")
    assert list(home.iterdir()) == []


def test_import_without_the_extension_fails_naming_the_fix() -> None:
    """No interpreted mode: importing the package without its compiled core raises
    NativeBuildError (an ImportError) naming the module and how to build it."""
    script = BLOCK_NATIVE + (
        "try:\n"
        "    import block_tables\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__)\n"
        "    print(exc)\n"
        "else:\n"
        "    print('imported')\n"
    )
    done = run_python(script)
    assert done.returncode == 0, done.stderr
    name, message = done.stdout.split("\n", 1)
    assert name == "NativeBuildError", done.stdout
    assert f"the compiled core {NATIVE_NAME} is not built" in message
    assert "refused by the test" in message and "tools/build_native.py" in message
    plain = run_python(BLOCK_NATIVE + "import block_tables.snapshot")
    assert plain.returncode != 0 and "NativeBuildError" in plain.stderr
