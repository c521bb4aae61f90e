"""Compiled hot paths of block_tables (``block_tables.native``) against the numpy path.

Two snapshots over separate storages of the same shape, one ``native=True`` and one
``native=False``, receive the same batches and must agree on everything: return values,
revisions, storage bytes, recorded row state, change history, errors (type and message)
and change spans. Every expectation is also checked against the naive full-width rebuild.
numpy and hypothesis only: this file must not import torch.
"""

from __future__ import annotations

import array
import contextlib
import os
import subprocess
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import block_tables.snapshot as snapshot_module
from block_tables import (
    BlockTable,
    BlockTableError,
    MissingPagesError,
    PageIdRangeError,
    PageTableSnapshot,
    RowCountError,
    RowTypeError,
    RowWidthError,
)
from block_tables import native as native_module
from block_tables.native import (
    NativeBuildError,
    NativeUnavailableWarning,
    load_extension,
    native_mode,
    select,
)
from block_tables.spans import ChangedSpans, changed_byte_ranges, changed_spans, row_keys

ROWS = 6
WIDTH = 20
ROW_BYTES = 4 * WIDTH
LIMIT = 30
HISTORY = 4  # short, so that changed_rows_since and changed_spans run past their horizon
INT32_MAX = 2**31 - 1

requires_native = pytest.mark.skipif(
    native_mode() == "0", reason="H2D_NATIVE=0: the compiled helpers are switched off"
)


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
    """Everything a rejected batch must leave unchanged, and both paths must agree on."""
    return (
        snap.storage.tobytes(),
        snap.revision,
        snap.num_rows,
        snap.row_lengths.tolist(),
        snap._row_keys.tobytes(),
        snap._lengths.tobytes(),
        snap._all_versioned,
        [(rev, None if rows is None else rows.tolist()) for rev, rows in snap._history],
    )


def twins(
    storage: np.ndarray, **kwargs: Any
) -> tuple[PageTableSnapshot, PageTableSnapshot]:
    """A compiled-path snapshot and a numpy-path snapshot over copies of ``storage``."""
    compiled = PageTableSnapshot(storage.copy(), native=True, **kwargs)
    python = PageTableSnapshot(storage.copy(), native=False, **kwargs)
    assert compiled._native is not None and python._native is None
    return compiled, python


Outcome = tuple[str, Any, Any]


def outcome(call: Callable[[], Any]) -> Outcome:
    """("ok", result, None) or ("error", type, message) of ``call``."""
    try:
        return ("ok", call(), None)
    except Exception as exc:  # compared, not swallowed: both paths must raise the same
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
    return None


# --------------------------------------------------------------------------------------
# 1 + 2: the compiled snapshot and the numpy snapshot side by side
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


class NativeTwinMachine(RuleBasedStateMachine):
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
        self.entry_state: tuple[Any, ...] | None = None

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
        self.compiled, self.python = twins(
            storage, pool_limit=limit, fill_value=fill, history=HISTORY
        )
        self.tables = [BlockTable(ids) for ids in first]
        self.last_batch = [(t, "table") for t in self.tables]
        # Whenever the compiled step hands a batch back, it must not have written anything.
        original = self.compiled._prepare_changed

        def guarded(rows: Any, keys: Any, required: Any) -> int:
            self.fallbacks += 1
            assert self.entry_state is not None
            assert state_of(self.compiled) == self.entry_state, "written before fallback"
            result: int = original(rows, keys, required)
            return result

        self.compiled._prepare_changed = guarded  # type: ignore[method-assign]
        self.run_both(self.last_batch, "list", "none", "exact", 0)

    @property
    def snaps(self) -> tuple[PageTableSnapshot, PageTableSnapshot]:
        return self.compiled, self.python

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
        self.run_both(list(self.saved), "list", required, "exact", pick)

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
        self.run_both(list(self.saved), "list", "none", "exact", pick)

    @rule(row=st.integers(0, ROWS - 1), column=st.integers(0, WIDTH - 1), value=st.integers())
    def write_behind_and_invalidate(self, row: int, column: int, value: int) -> None:
        if value % 5:
            return  # rare: it sends every row back through the full-width path
        for snap in self.snaps:
            snap.storage[row, column] = value % 97
            snap.invalidate()
        assert self.compiled.revision == self.python.revision
        assert state_of(self.compiled) == state_of(self.python)
        self.revisions.append(self.compiled.revision)

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
        self.run_both(chosen, container, required, value, pick)

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
            self.run_both(batch, container, required, value, pick)

    def run_both(
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
        assert before[0] == before[1]
        old_storage = self.compiled.storage.copy()
        old_revision = self.compiled.revision
        # Lineage proofs are shared through the tables: vary which snapshot goes first.
        order = self.snaps if pick % 2 else self.snaps[::-1]
        results: dict[int, Outcome] = {}
        for snap in order:
            if snap is self.compiled:
                self.entry_state = before[0]
            results[id(snap)] = outcome(
                lambda snap=snap: snap.prepare(rows, required_pages=required)
            )
            self.entry_state = None
        got_compiled, got_python = results[id(self.compiled)], results[id(self.python)]
        assert got_compiled == got_python

        if expected is not None:
            status, error, message = got_python
            assert status == "error", f"expected {expected}, got {got_python}"
            assert error is expected.error, message
            assert expected.fragment in message
            if expected.rows is not None:
                assert any(f"row {r}:" in message for r in expected.rows), message
            for snap, state in zip(self.snaps, before, strict=True):
                assert state_of(snap) == state
            self.repair(chosen)
            return

        status, revision, _ = got_python
        assert status == "ok", got_python
        n = len(rows)
        after = [state_of(snap) for snap in self.snaps]
        assert after[0] == after[1]
        for snap in self.snaps:
            assert snap.revision == revision
            assert snap.num_rows == n
            assert snap.row_lengths.tolist() == lengths
            np.testing.assert_array_equal(
                snap.storage[:n], naive([contents_of(t, k) for t, k in chosen], WIDTH, self.fill)
            )
            np.testing.assert_array_equal(snap.storage[n:], old_storage[n:])
        assert np.array_equal(self.compiled.storage, self.python.storage)
        changed_bytes = not np.array_equal(self.compiled.storage, old_storage)
        assert revision == old_revision + int(changed_bytes)
        differing = np.flatnonzero((self.compiled.storage != old_storage).any(axis=1))
        since_last = self.compiled.changed_rows_since(old_revision)
        if not since_last.all_rows:
            assert since_last.rows().tolist() == differing.tolist()
        if revision != self.revisions[-1]:
            self.revisions.append(revision)
            del self.revisions[:-8]
        for since in [*self.revisions, -1, revision + 1]:
            assert self.compiled.changed_rows_since(since) == self.python.changed_rows_since(
                since
            )
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
        keys = row_keys(self.compiled)
        np.testing.assert_array_equal(keys, row_keys(self.python))
        assert keys.dtype == np.int64 and keys.size == self.compiled.num_rows
        np.testing.assert_array_equal(row_keys(self.compiled, 2), keys[:2])
        self.uploads.append(Upload(self.compiled.revision, keys, self.compiled.storage.copy()))
        del self.uploads[:-5]

    @precondition(lambda self: bool(self.uploads))
    @rule(which=st.integers(0, 99))
    def compare_spans(self, which: int) -> None:
        up = self.uploads[which % len(self.uploads)]
        now = self.compiled.num_rows
        choices = {0, max(up.rows - 1, 0), min(up.rows, now), now, min(up.rows + 1, now)}
        for num_rows in sorted(choices | {ROWS}):
            exact = num_rows <= now  # past num_rows only agreement is defined
            for revision in (up.revision, None):
                spans = [changed_spans(s, up.keys, num_rows, revision) for s in self.snaps]
                assert spans[0] == spans[1]
                if spans[0] is not None and exact:
                    self.check_spans_cover(up, spans[0], num_rows)
                unlimited: tuple[list[tuple[int, int]], int] | None = None
                for max_ranges, max_bytes in SPAN_LIMITS:
                    got = [
                        changed_byte_ranges(
                            s, up.keys, num_rows, ROW_BYTES, revision=revision,
                            max_ranges=max_ranges, max_bytes=max_bytes,
                        )
                        for s in self.snaps
                    ]
                    assert got[0] == got[1], (num_rows, revision, max_ranges, max_bytes)
                    if max_ranges == 10**6 and max_bytes == 10**9:
                        unlimited = got[0]
                        if revision is None:
                            assert unlimited is not None
                        if unlimited is not None and exact:
                            self.check_ranges(up, unlimited, num_rows)
                    elif unlimited is not None:
                        ranges, total = unlimited
                        fits = len(ranges) <= max_ranges and total <= max_bytes
                        assert got[0] == (unlimited if fits else None)
                    else:
                        assert got[0] is None

    def check_spans_cover(self, up: Upload, spans: ChangedSpans, num_rows: int) -> None:
        """Every cell of rows ``[0, min(num_rows, up.rows))`` that differs is covered."""
        limit = min(num_rows, up.rows)
        assert spans.rows == sorted(set(spans.rows))
        covered = np.zeros((limit, WIDTH), dtype=bool)
        for r, a, b in zip(spans.rows, spans.starts, spans.stops, strict=True):
            assert 0 <= r < limit and 0 <= a < b <= WIDTH
            covered[r, a:b] = True
        assert spans.num_ids == int(covered.sum())
        differs = self.compiled.storage[:limit] != up.storage[:limit]
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
        rebuilt = apply_ranges(up.storage, self.compiled.storage, ranges)
        np.testing.assert_array_equal(rebuilt[:num_rows], self.compiled.storage[:num_rows])

    @invariant()
    def twins_agree(self) -> None:
        if self.tables:
            assert state_of(self.compiled) == state_of(self.python)


NativeTwinMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_native_and_python_snapshots_agree = requires_native(NativeTwinMachine.TestCase)


# --------------------------------------------------------------------------------------
# the boundary of the compiled step (what it covers, what it hands back untouched)
# --------------------------------------------------------------------------------------


@pytest.fixture
def counted() -> Iterator[tuple[PageTableSnapshot, list[int]]]:
    """A compiled snapshot whose numpy fallback is counted (and checked to see no write)."""
    snap = PageTableSnapshot(np.zeros((4, 8), dtype=np.int32), pool_limit=LIMIT,
                             native=True)
    calls: list[int] = []
    original = snap._prepare_changed
    entry: list[tuple[Any, ...]] = []

    def counting(rows: Any, keys: Any, required: Any) -> int:
        calls.append(1)
        assert state_of(snap) == entry[-1]
        result: int = original(rows, keys, required)
        return result

    snap._prepare_changed = counting  # type: ignore[method-assign]
    real_prepare = snap.prepare

    def prepare(rows: Any, *, required_pages: Any = None) -> int:
        entry.append(state_of(snap))
        return real_prepare(rows, required_pages=required_pages)

    snap.prepare = prepare  # type: ignore[method-assign]
    yield snap, calls


@requires_native
def test_compiled_step_covers_hits_and_single_page_appends(
    counted: tuple[PageTableSnapshot, list[int]],
) -> None:
    snap, calls = counted
    rows = [BlockTable([1, 2]), BlockTable([3]), BlockTable()]
    assert snap.prepare(rows) == 1
    assert len(calls) == 1  # unknown rows: the numpy path
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


@requires_native
@pytest.mark.parametrize(
    ("change", "required", "error", "fragment"),
    [
        ("two_pages", None, None, ""),
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
    """Cases the compiled step does not cover reach the numpy path with nothing written
    (checked on entry by the fixture), and give the numpy path's result or error."""
    snap, calls = counted
    rows: Any = [BlockTable([1, 2]), BlockTable([3])]
    snap.prepare(rows)
    python = PageTableSnapshot(np.zeros((4, 8), dtype=np.int32), pool_limit=LIMIT, native=False)
    python.prepare(rows)
    rows[0].append_one(7)
    if change == "two_pages":
        rows[1].append([8, 9])
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
    assert got == outcome(lambda: python.prepare(rows, required_pages=required))
    assert calls == [1]
    if error is None:
        assert got[0] == "ok"
        assert state_of(snap) == state_of(python)
    else:
        assert got[0] == "error" and got[1] is error
        assert fragment in got[2]
        assert state_of(snap) == before


@requires_native
def test_compiled_and_python_spans_on_an_all_versioned_batch() -> None:
    compiled, python = twins(np.full((4, 6), -1, dtype=np.int32), fill_value=-1)
    rows = [BlockTable([1, 2]), BlockTable([3, 4, 5]), BlockTable([6])]
    for snap in (compiled, python):
        snap.prepare(rows)
    keys = row_keys(compiled)
    old = compiled.storage.copy()
    rows[0].append_one(7)  # an append: only column 2 of row 0
    rows[1].truncate(1)  # a new version: columns [0, 3) of row 1
    rows.append(BlockTable([8, 9]))  # a row the destination never held
    for snap in (compiled, python):
        snap.prepare(rows)
    assert compiled._all_versioned and python._all_versioned
    for snap in (compiled, python):
        assert changed_spans(snap, keys, 4) == ChangedSpans([0, 1], [2, 0], [3, 3])
        result = changed_byte_ranges(snap, keys, 4, 24, max_ranges=3, max_bytes=100)
        assert result == ([(8, 12), (24, 36), (72, 96)], 40)
        assert changed_byte_ranges(snap, keys, 4, 24, max_ranges=2, max_bytes=100) is None
        assert changed_byte_ranges(snap, keys, 4, 24, max_ranges=3, max_bytes=39) is None
        assert changed_byte_ranges(snap, keys, 2, 24, max_ranges=2, max_bytes=16) == (
            [(8, 12), (24, 36)], 16
        )
        assert changed_byte_ranges(snap, keys, 2, 24, max_ranges=1, max_bytes=100) is None
        assert changed_byte_ranges(snap, keys, 1, 24, max_ranges=1, max_bytes=4) == (
            [(8, 12)], 4
        )
    ranges, _ = result
    np.testing.assert_array_equal(apply_ranges(old, compiled.storage, ranges)[:4],
                                  compiled.storage[:4])


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


@requires_native
@pytest.mark.parametrize("layout", sorted(KEY_LAYOUTS))
def test_spans_accept_other_key_layouts_on_both_paths(layout: str) -> None:
    """Keys that are not the contiguous native int64 array ``row_keys`` returns (a column
    of a 2-D array, a reversed view, read-only, unsigned or big-endian) give the same
    answer on both paths."""
    compiled, python = twins(np.zeros((4, 8), dtype=np.int32))
    rows = [BlockTable([1, 2]), BlockTable([3]), BlockTable([4, 5])]
    for snap in (compiled, python):
        snap.prepare(rows)
    keys = KEY_LAYOUTS[layout](row_keys(compiled))
    np.testing.assert_array_equal(keys, row_keys(python))
    rows[0].append_one(5)
    rows[2].truncate(1)
    for snap in (compiled, python):
        snap.prepare(rows)
        assert snap._all_versioned
    spans = [outcome(lambda s=s: changed_spans(s, keys, 3)) for s in (compiled, python)]
    assert spans[1] == ("ok", ChangedSpans([0, 2], [2, 0], [3, 2]), None)
    assert spans[0] == spans[1]
    for num_rows in (2, 3, 4):
        ranges = [
            outcome(lambda s=s, n=num_rows: changed_byte_ranges(s, keys, n, 32, max_ranges=4,
                                                                max_bytes=999))
            for s in (compiled, python)
        ]
        assert ranges[0] == ranges[1]
    assert ranges[1] == ("ok", ([(8, 12), (64, 72), (96, 128)], 44), None)


# --------------------------------------------------------------------------------------
# 3: native.py (extensions built with the wheel, loaded by import, never compiled)
# --------------------------------------------------------------------------------------

NATIVE_NAME = "block_tables._block_tables_native"

# A finder that refuses the compiled helpers: the package as installed without them.
BLOCK_NATIVE = (
    "import importlib.abc, sys\n"
    "class Refuse(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.rpartition('.')[2].endswith('_native'):\n"
    "            raise ModuleNotFoundError(f'no module named {name!r} (refused by the test)')\n"
    "sys.meta_path.insert(0, Refuse())\n"
)


@pytest.fixture
def fresh_loader(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The loader's per-process memory, emptied for the test and restored after it."""
    monkeypatch.setattr(native_module, "_loaded", {})
    monkeypatch.setattr(native_module, "_missing", {})
    yield


@contextlib.contextmanager
def no_warnings() -> Iterator[None]:
    """Assert that no warning is emitted inside the block."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield
    assert [str(w.message) for w in record] == []


def run_python(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script], env={**os.environ, **env},
                          capture_output=True, text=True, check=False)


@pytest.mark.parametrize(("value", "mode"), [("auto", "auto"), (" 1 ", "1"), ("0", "0"),
                                            ("AUTO", "auto"), ("", "auto")])
def test_native_mode_values(monkeypatch: pytest.MonkeyPatch, value: str, mode: str) -> None:
    monkeypatch.setenv("H2D_NATIVE", value)
    assert native_mode() == mode


def test_native_mode_rejects_unknown_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("H2D_NATIVE", "bogus")
    with pytest.raises(NativeBuildError, match=r"H2D_NATIVE='bogus' is not one of") as info:
        native_mode()
    assert "['auto', '0', '1']" in str(info.value)
    monkeypatch.delenv("H2D_NATIVE")
    assert native_mode() == "auto"


def test_select_resolves_the_per_object_choice() -> None:
    module = native_module  # any module object stands in for a compiled helper
    with pytest.raises(NativeBuildError, match=r"^X: native=True but the compiled helper"):
        select(None, True, "X")
    assert select(module, False, "X") is None
    assert select(None, False, "X") is None
    assert select(None, None, "X") is None
    assert select(module, None, "X") is module
    assert select(module, True, "X") is module


def test_missing_helpers_warn_once_under_auto(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("H2D_NATIVE", "auto")
    with pytest.warns(NativeUnavailableWarning, match="block_tables._no_such_native") as rec:
        assert load_extension("block_tables._no_such_native") is None
    assert len(rec) == 1
    assert "tools/build_native.py" in str(rec[0].message)
    # one warning per process: a second missing helper is recorded, not warned again
    with no_warnings():
        assert load_extension("block_tables._no_such_native") is None
        assert load_extension("block_tables._other_native") is None
    status = native_module.native_status()
    assert status["block_tables._other_native"].startswith("ModuleNotFoundError")


def test_missing_helper_raises_when_required(
    fresh_loader: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("H2D_NATIVE", "1")
    with pytest.raises(NativeBuildError, match=r"_no_such_native is required \(H2D_NATIVE=1\)"):
        load_extension("block_tables._no_such_native")
    assert "block_tables._no_such_native" not in native_module._loaded  # asked again next time


def test_switched_off_loads_nothing(fresh_loader: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("H2D_NATIVE", "0")
    with no_warnings():
        assert load_extension(NATIVE_NAME) is None
    assert native_module.native_status() == {NATIVE_NAME: "off"}


@requires_native
def test_import_runs_no_compiler_and_writes_nothing(tmp_path: Path) -> None:
    """The helper comes from the wheel (or an in-place build): importing with no compiler
    on PATH, an unusable CC and an unwritable HOME still loads it."""
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o500)
    script = (
        "import block_tables.snapshot as s, block_tables.native as n; "
        "assert s._native is not None, n.native_status(); print(s._native.__file__)"
    )
    done = run_python(script, PATH="", CC="/nonexistent/cc", HOME=str(home), H2D_NATIVE="1",
                      XDG_CACHE_HOME=str(home / "cache"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(sysconfig.get_config_var("EXT_SUFFIX") or ".so")
    assert list(home.iterdir()) == []


def test_package_works_without_its_helper_and_warns_once() -> None:
    script = BLOCK_NATIVE + (
        "import warnings\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as rec:\n"
        "    warnings.simplefilter('always')\n"
        "    import numpy as np\n"
        "    from block_tables import BlockTable, PageTableSnapshot\n"
        "    from block_tables.snapshot import _native\n"
        "    assert _native is None\n"
        "    storage = np.zeros((2, 4), np.int32)\n"
        "    snap = PageTableSnapshot(storage)\n"
        "    t = BlockTable([1, 2])\n"
        "    snap.prepare([t]); t.append_one(3); snap.prepare([t])\n"
        "    assert storage[0].tolist() == [1, 2, 3, 0], storage\n"
        "print(len(rec), rec[0].category.__name__)\n"
    )
    done = run_python(script, H2D_NATIVE="auto")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "NativeUnavailableWarning"]
    required = run_python(BLOCK_NATIVE + "import block_tables.snapshot", H2D_NATIVE="1")
    assert required.returncode != 0
    assert "NativeBuildError" in required.stderr and "is required" in required.stderr

# --------------------------------------------------------------------------------------
# 4: native=True without the compiled module
# --------------------------------------------------------------------------------------


def test_native_true_without_the_compiled_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(snapshot_module, "_native", None)
    storage = np.arange(12, dtype=np.int32).reshape(3, 4)
    with pytest.raises(NativeBuildError, match=r"^PageTableSnapshot: native=True but"):
        PageTableSnapshot(storage, native=True)
    np.testing.assert_array_equal(storage, np.arange(12).reshape(3, 4))
    for choice in (None, False):
        snap = PageTableSnapshot(storage, native=choice)
        assert snap._native is None
        rows = [BlockTable([5, 6]), BlockTable([7])]
        assert snap.prepare(rows) == 1
        rows[0].append_one(8)
        assert snap.prepare(rows) == 2
        np.testing.assert_array_equal(storage[:2], naive([[5, 6, 8], [7]], 4, 0))


@requires_native
def test_compiled_step_reads_a_strided_required_array(
    counted: tuple[PageTableSnapshot, list[int]],
) -> None:
    """A strided integer view of required pages is read in place by the compiled step (no
    hand-back), with the numpy path's result."""
    snap, calls = counted
    rows = [BlockTable([1, 2]), BlockTable([3])]
    snap.prepare(rows)
    python = PageTableSnapshot(np.zeros((4, 8), dtype=np.int32), pool_limit=LIMIT, native=False)
    python.prepare(rows)
    rows[0].append_one(7)
    rows[1].append_one(8)
    required = np.array([3, 9, 2, 9], dtype=np.int64)[::2]
    calls.clear()
    got = outcome(lambda: snap.prepare(rows, required_pages=required))
    assert got == outcome(lambda: python.prepare(rows, required_pages=required))
    assert got[0] == "ok" and calls == []
    assert state_of(snap) == state_of(python)
    short = np.array([3, 9, 9, 9], dtype=np.int64)[::2]  # row 1 needs 9 pages, holds 2
    calls.clear()
    got = outcome(lambda: snap.prepare(rows, required_pages=short))
    assert got == outcome(lambda: python.prepare(rows, required_pages=short))
    assert got[0] == "error" and got[1] is MissingPagesError


@requires_native
@pytest.mark.parametrize("max_ranges", [3, 0])
def test_keys_out_receives_the_keys_to_remember_on_both_paths(max_ranges: int) -> None:
    """``changed_byte_ranges(keys_out=)`` writes ``row_keys(snap, n)`` into the caller's
    array whatever the result (ranges or None), compiled and Python alike, and touches
    nothing past ``n``; ``row_keys(out=)`` returns a view of ``out``."""
    compiled, python = twins(np.full((5, 6), -1, dtype=np.int32), fill_value=-1)
    rows = [BlockTable([1, 2]), BlockTable([3, 4, 5]), BlockTable([6]), BlockTable([7])]
    for snap in (compiled, python):
        snap.prepare(rows)
    keys = row_keys(compiled)
    rows[0].append_one(9)
    for snap in (compiled, python):
        snap.prepare(rows)
    for snap in (compiled, python):
        out = np.full(5, -123, dtype=np.int64)
        result = changed_byte_ranges(snap, keys, 3, 24, max_ranges=max_ranges, max_bytes=100,
                                     keys_out=out)
        assert result == (([(8, 12)], 4) if max_ranges else None)
        np.testing.assert_array_equal(out[:3], row_keys(snap, 3))
        assert out[3:].tolist() == [-123, -123]
        again = np.full(5, -5, dtype=np.int64)
        view = row_keys(snap, 2, out=again)
        assert view.base is again and view.tolist() == row_keys(snap, 2).tolist()
        assert again[2:].tolist() == [-5, -5, -5]
    # the Python path alone (a snapshot whose last batch was not all versioned)
    plain = PageTableSnapshot(np.full((5, 6), -1, dtype=np.int32), fill_value=-1)
    plain.prepare([[1, 2], [3]])
    then = row_keys(plain)
    plain.prepare([[1, 2, 4], [3]])
    out = np.zeros(5, dtype=np.int64)
    assert changed_byte_ranges(plain, then, 2, 24, revision=None, max_ranges=4,
                               max_bytes=100, keys_out=out) is not None
    np.testing.assert_array_equal(out[:2], row_keys(plain, 2))


@requires_native
def test_tagged_ranges_are_the_pairs_as_record_triples() -> None:
    """The compiled ``changed_byte_ranges`` with a tag returns each range as
    ``(tag, start, nbytes)``: the same ranges, total and None cases as without it."""
    compiled, _ = twins(np.full((6, 8), -1, dtype=np.int32), fill_value=-1)
    native = compiled._native
    rows = [BlockTable([1, 2]), BlockTable([3, 4, 5]), BlockTable([6]), BlockTable([7])]
    compiled.prepare(rows)
    keys = row_keys(compiled)
    rows[0].append_one(9)
    rows[2].append_one(10)
    rows.append(BlockTable([11]))
    compiled.prepare(rows)
    now = compiled._row_keys
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


@requires_native
def test_snapshot_method_gives_the_same_ranges_on_both_paths() -> None:
    """``PageTableSnapshot.changed_byte_ranges``: (offset, nbytes) pairs, or tagged
    triples, identical with and without the compiled helper and equal to the module
    function's (start, stop) ranges; None past the limits; ``keys_out`` filled either way."""
    results = []
    for snap in twins(np.full((6, 8), -1, dtype=np.int32), fill_value=-1):
        rows = [BlockTable([1, 2]), BlockTable([3, 4, 5]), BlockTable([6]), BlockTable([7])]
        snap.prepare(rows)
        keys = row_keys(snap)
        rows[0].append_one(9)
        rows[2].append_one(10)
        rows.append(BlockTable([11]))
        snap.prepare(rows)
        got = []
        for max_ranges, max_bytes, tag in ((8, 1000, None), (8, 1000, 2), (1, 1000, None),
                                           (8, 4, 5)):
            out = np.full(6, -9, dtype=np.int64)
            found = snap.changed_byte_ranges(keys, 5, 32, max_ranges=max_ranges,
                                             max_bytes=max_bytes, keys_out=out, tag=tag)
            assert out[:5].tolist() == snap._row_keys[:5].tolist()
            got.append(found)
        reference = changed_byte_ranges(snap, keys, 5, 32, max_ranges=8, max_bytes=1000)
        assert reference is not None
        assert got[0] == ([(a, b - a) for a, b in reference[0]], reference[1])
        assert got[1] == ([(2, a, b - a) for a, b in reference[0]], reference[1])
        assert got[2] is None and got[3] is None
        results.append(got)
    assert results[0] == results[1]
