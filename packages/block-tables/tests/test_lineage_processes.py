"""Lineage across process boundaries: pickling and forked workers.

A version is drawn per process, so it must never be trusted alone once a table crosses a
process boundary: two diverging copies must never pass as a hit, while a worker that
receives a growing row every step keeps preparing it as an append.
"""

from __future__ import annotations

import multiprocessing
import pickle
import sys
from typing import Any

import numpy as np
import pytest

from block_tables import BlockTable, PageTableSnapshot
from block_tables import lineage as lineage_module


def _snapshot() -> tuple[PageTableSnapshot, np.ndarray]:
    storage = np.full((4, 8), -7, dtype=np.int32)
    return PageTableSnapshot(storage), storage


def test_round_trip_copies_that_diverge_are_not_a_hit() -> None:
    t = BlockTable([1, 2, 3])
    u = pickle.loads(pickle.dumps(t))
    assert u.tolist() == t.tolist()
    assert u.version != t.version  # the original may go on appending under its own
    t.append_one(5)
    u.append_one(6)
    snap, storage = _snapshot()
    snap.prepare([t])
    assert storage[0, :4].tolist() == [1, 2, 3, 5]
    snap.prepare([u])
    assert storage[0, :4].tolist() == [1, 2, 3, 6]


def test_two_receipts_of_one_pickle_diverge_safely() -> None:
    data = pickle.dumps(BlockTable([4, 5]))
    a, b = pickle.loads(data), pickle.loads(data)
    assert a.version == b.version  # one received lineage
    a.append_one(8)
    b.append_one(9)
    assert a.version != b.version  # neither extends the received lineage in place
    snap, storage = _snapshot()
    snap.prepare([a])
    snap.prepare([b])
    assert storage[0, :3].tolist() == [4, 5, 9]


def test_received_growing_row_keeps_its_lineage() -> None:
    sender = BlockTable([10, 11])
    first = pickle.loads(pickle.dumps(sender))
    sender.append_one(12)
    second = pickle.loads(pickle.dumps(sender))
    assert second.version == first.version  # the decoder preserves the growing row's lineage
    snap, storage = _snapshot()
    rev = snap.prepare([first])
    snap.prepare([second])
    assert storage[0, :3].tolist() == [10, 11, 12]
    assert snap.changed_rows_since(rev).rows().tolist() == [0]
    # a changed row on the sender's side draws a new version there, so a new one here
    sender[0] = 99
    third = pickle.loads(pickle.dumps(sender))
    assert third.version != second.version
    snap.prepare([third])
    assert storage[0, :3].tolist() == [99, 11, 12]


def test_received_lineages_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lineage_module, "RECEIVED_LINEAGES", 4)
    lineage_module._received.clear()
    tables = [BlockTable([i]) for i in range(6)]
    for t in tables:
        pickle.loads(pickle.dumps(t))
    assert len(lineage_module._received) == 4


def _child(conn: Any, parent_next: int) -> None:
    # The child continues the parent's counter: its next version equals the parent's next.
    collided = BlockTable([7, 8])
    growing = BlockTable([20])
    conn.send((collided.version == parent_next, pickle.dumps(collided), pickle.dumps(growing)))
    growing.append_one(21)
    conn.send(pickle.dumps(growing))
    conn.close()


@pytest.mark.skipif(sys.platform == "win32", reason="needs the fork start method")
def test_forked_worker_versions_never_pass_as_the_parents() -> None:
    probe = BlockTable([0])
    parent_next = probe.version + 1
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(send, parent_next))
    proc.start()
    send.close()
    mine = BlockTable([3, 4])  # drawn after the fork: the same number as the child's row
    same_number, collided_bytes, growing_bytes = recv.recv()
    grown_bytes = recv.recv()
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert same_number and mine.version == parent_next  # the counters really collided
    theirs = pickle.loads(collided_bytes)
    snap, storage = _snapshot()
    snap.prepare([mine])
    snap.prepare([theirs])
    assert storage[0, :2].tolist() == [7, 8]  # no false hit on the shared number
    growing, grown = pickle.loads(growing_bytes), pickle.loads(grown_bytes)
    assert grown.version == growing.version
    snap.prepare([growing])
    snap.prepare([grown])
    assert storage[0, :2].tolist() == [20, 21]


def _worker(conn: Any, worker: int, rows: int) -> None:
    """A forked worker's rows: each sent pickled with its pages, then grown once and
    sent again (the RPC decoder case: a row crosses the boundary every step)."""
    rng = np.random.default_rng(1000 + worker)
    out = []
    for _ in range(rows):
        pages = rng.integers(0, 10_000, size=int(rng.integers(1, 6))).tolist()
        table = BlockTable(pages)
        out.append((worker, table.version, pickle.dumps(table), pages))
        extra = int(rng.integers(0, 10_000))
        table.append_one(extra)
        out.append((worker, table.version, pickle.dumps(table), [*pages, extra]))
    conn.send(out)
    conn.close()


@pytest.mark.skipif(sys.platform == "win32", reason="needs the fork start method")
def test_many_forked_workers_never_alias() -> None:
    """Workers forked from one parent draw the same version numbers as each other (and
    as the parent's rows after the fork). Received pickled, rows that shared a number at
    their senders must map to distinct lineages: prepared back to back into one snapshot
    row, none is mistaken for a hit. (A fork that did not renew the process's lineage
    origin would alias them.) Prints the figure (``H2D_LINEAGE_WORKERS`` x
    ``H2D_LINEAGE_ROWS``; ``nox -s stress`` raises them)."""
    import os

    workers = int(os.environ.get("H2D_LINEAGE_WORKERS", "3"))
    rows = int(os.environ.get("H2D_LINEAGE_ROWS", "40"))
    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    for w in range(workers):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(send, w, rows))
        proc.start()
        send.close()
        pipes.append(recv)
        procs.append(proc)
    items = []
    rng = np.random.default_rng(7)
    for _ in range(rows):  # the parent's own rows, drawn after the forks
        pages = rng.integers(0, 10_000, size=int(rng.integers(1, 7))).tolist()
        t = BlockTable(pages)
        items.append((-1, t.version, t, pages))
    for w, recv in enumerate(pipes):
        assert recv.poll(120), f"worker {w} sent nothing in 120 s"
        items += [(w, v, pickle.loads(b), pages) for w, v, b, pages in recv.recv()]
    for proc in procs:
        proc.join(timeout=120)
        assert proc.exitcode == 0
    origins: dict[int, set[int]] = {}
    for w, v, _, _ in items:
        origins.setdefault(v, set()).add(w)
    shared = sum(len(o) - 1 for o in origins.values())
    snap, storage = _snapshot()
    wrong = 0
    # rows that shared a number at their senders back to back, in a random order within
    # each number: had receipt mapped them to one lineage, each after the first would hit
    keys = rng.random(len(items))
    for i in sorted(range(len(items)), key=lambda k: (items[k][1], keys[k])):
        _, _, table, pages = items[i]
        snap.prepare([table])
        wrong += storage[0, : len(pages)].tolist() != pages
    print(f"{workers} forked workers x {rows} rows (+ grown copies) and {rows} parent rows: "
          f"{len(items)} rows prepared, {shared} sender-side version numbers shared across "
          f"processes, {wrong} mistaken for a hit")
    assert shared > 0  # the counters really collided: the test can fail
    assert wrong == 0
