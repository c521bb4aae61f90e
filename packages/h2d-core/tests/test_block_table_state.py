"""Block-table state: prepared vs published revisions, reuse, partial and whole publication,
failed publications, slots, and the GPU table == CPU snapshot invariant."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from block_tables import BlockTable
from h2d_core import (
    CountError,
    DuplicatePublicationError,
    EpochError,
    H2DRunnerState,
    PublicationEnqueueError,
    StageResult,
    block_table_state,
)

ROWS, WIDTH = 32, 64


def _setup(device: str, h: Any, backend: str = "packed", num_slots: int = 1,
           max_ranges: int = 16) -> Any:
    st = H2DRunnerState(device, backend=backend, num_slots=num_slots,
                        scatter=h.scatter_mode(device))
    lens = st.buffer("context_lens", (ROWS,), torch.int32, group="mha_decode")
    bt = st.buffer("block_tables", (ROWS, WIDTH), torch.int32, group="mha_decode",
                   unit="rows", max_ranges=max_ranges)
    st.bind()
    bt.gpu.fill_(-7)
    return st, lens, bt, block_table_state(bt, pool_limit=10_000)


def _publish(st: Any, lens: Any, bts: Any, rows: list[Any], n: int | None = None) -> str:
    st.begin()
    bts.prepare(rows)
    n = len(rows) if n is None else n
    lens.np[:n] = n
    st.set_count(lens, n)
    how = bts.stage(n)
    st.publish("mha_decode")
    st.finish()
    return how


def _check_gpu(device: str, h: Any, bts: Any, n: int) -> None:
    h.sync(device)
    snap = bts.snapshot
    assert np.array_equal(bts.buffer.gpu[:n].cpu().numpy(), snap.storage[:n]), "GPU != snapshot"


def test_reuse_partial_and_whole(device: str, h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    st, lens, _bt, bts = _setup(device, h)
    rng = np.random.default_rng(0)
    tables = [BlockTable(rng.integers(0, 10_000, rng.integers(1, 20))) for _ in range(16)]
    assert _publish(st, lens, bts, tables) == StageResult.WHOLE
    _check_gpu(device, h, bts, 16)
    assert bts.published.rows == 16 and bts.published.revision == bts.prepared_revision

    # Same rows, same revision: the member is omitted and the GPU view stays valid.
    dmas = st.counters("mha_decode").bytes
    assert _publish(st, lens, bts, tables) == StageResult.REUSED
    assert st.counters("mha_decode").bytes - dmas == 16 * 4  # context_lens only
    _check_gpu(device, h, bts, 16)

    # One page appended on 1/16 of the rows: only those page IDs travel.
    tables[3].append_one(77)
    before = st.counters("mha_decode").bytes
    assert _publish(st, lens, bts, tables) == StageResult.PARTIAL
    assert st.counters("mha_decode").bytes - before == 16 * 4 + 4
    _check_gpu(device, h, bts, 16)

    # A replaced (new-version, shorter) row clears its old columns on the GPU too.
    tables[5] = BlockTable([1, 2])
    assert _publish(st, lens, bts, tables) == StageResult.PARTIAL
    _check_gpu(device, h, bts, 16)

    # Growing the batch sends the new rows whole; most rows new => whole table.
    tables += [BlockTable([9] * 30) for _ in range(4)]
    assert _publish(st, lens, bts, tables) == StageResult.PARTIAL
    _check_gpu(device, h, bts, 20)
    fresh = [BlockTable(rng.integers(0, 10_000, 40)) for _ in range(20)]
    assert _publish(st, lens, bts, fresh) == StageResult.WHOLE
    _check_gpu(device, h, bts, 20)

    # Fewer rows at the same revision: nothing to send, record follows the request.
    assert _publish(st, lens, bts, fresh, n=12) == StageResult.PARTIAL
    assert bts.published.rows == 12


def test_direct_backend_publishes_whole_tables(device: str, h: Any) -> None:
    st, lens, _bt, bts = _setup(device, h, backend="direct")
    tables = [BlockTable([i, i + 1]) for i in range(8)]
    assert _publish(st, lens, bts, tables) == StageResult.WHOLE
    assert _publish(st, lens, bts, tables) == StageResult.REUSED
    tables[0].append_one(5)
    assert _publish(st, lens, bts, tables) == StageResult.WHOLE
    _check_gpu(device, h, bts, 8)


def test_prefill_prepares_without_uploading(device: str, h: Any) -> None:
    st, lens, _bt, bts = _setup(device, h)
    tables = [BlockTable([i]) for i in range(4)]
    _publish(st, lens, bts, tables)
    published = bts.published
    st.begin()
    tables[1].append([3, 4])
    rev = bts.prepare(tables)
    st.finish()
    assert rev != published.revision and bts.published is published
    assert _publish(st, lens, bts, tables) == StageResult.PARTIAL
    _check_gpu(device, h, bts, 4)


def test_failed_publication_never_marks_published(device: str, h: Any,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    st, lens, bt, bts = _setup(device, h)
    tables = [BlockTable([i, 2 * i]) for i in range(6)]
    _publish(st, lens, bts, tables)
    good = bts.published
    good_keys = good.keys.copy()
    st.begin()
    tables[2].append_one(99)
    bts.prepare(tables)
    st.set_count(lens, 6)
    bts.stage(6)
    rec = st._slot_groups[0][st.plan("mha_decode").index]
    if rec.packed is not None:
        h.break_publication(monkeypatch, rec.packed)
    else:
        monkeypatch.setattr(bt, "_dst_units", None)
    with pytest.raises(PublicationEnqueueError):
        st.publish("mha_decode")
    assert bts.published is good
    # the failed stage remembered its keys elsewhere: the record's keys are intact
    np.testing.assert_array_equal(good.keys, good_keys)
    monkeypatch.undo()
    st.reset()
    assert bts.published is None  # the GPU table may be half written: forget it
    assert _publish(st, lens, bts, tables) == StageResult.WHOLE
    _check_gpu(device, h, bts, 6)


def test_stage_errors_change_nothing(device: str, h: Any) -> None:
    st, lens, bt, bts = _setup(device, h)
    st.begin()
    bts.prepare([BlockTable([1])] * 3)
    with pytest.raises(CountError, match="'block_tables': 4 rows requested but slot 0's "
                                         "snapshot prepared 3"):
        bts.stage(4)
    with pytest.raises(CountError, match="num_rows must be an int"):
        bts.stage(True)
    assert st.count(bt) is None and bts.published is None
    with pytest.raises(Exception, match="2-D int32 buffer counted in rows"):
        block_table_state(lens)


@pytest.mark.parametrize("backend", ["packed", "direct"])
@pytest.mark.parametrize("num_slots", [1, 2])
def test_random_steps_gpu_table_equals_snapshot(device: str, h: Any, backend: str,
                                                num_slots: int) -> None:
    st, lens, _bt, bts = _setup(device, h, backend=backend, num_slots=num_slots, max_ranges=6)
    rng = np.random.default_rng(7 + num_slots)
    live = [BlockTable(rng.integers(0, 10_000, rng.integers(0, 10))) for _ in range(10)]
    stages = set()
    for _step in range(40):
        op = rng.integers(0, 6)
        if op == 0 and live:
            for t in live:
                if rng.random() < 0.2 and len(t) < WIDTH:
                    t.append_one(int(rng.integers(0, 10_000)))
        elif op == 1 and len(live) > 2:
            i, j = rng.choice(len(live), 2, replace=False)
            live[i], live[j] = live[j], live[i]
        elif op == 2 and len(live) < ROWS:
            live.insert(int(rng.integers(0, len(live) + 1)),
                        BlockTable(rng.integers(0, 10_000, rng.integers(0, 20))))
        elif op == 3 and len(live) > 1:
            live.pop(int(rng.integers(0, len(live))))
        elif op == 4 and live:
            k = int(rng.integers(0, len(live)))
            live[k] = live[k].lineage_copy()
            if len(live[k]) < WIDTH:
                live[k].append_one(1)
        rows: list[Any] = list(live)
        if rng.random() < 0.3:
            rows = [np.asarray(r.tolist(), dtype=np.int32) if rng.random() < 0.5 else r
                    for r in rows]
        n = len(rows) if rng.random() < 0.8 else int(rng.integers(0, len(rows) + 1))
        stages.add(_publish(st, lens, bts, rows, n=n))
        _check_gpu(device, h, bts, n)
    assert StageResult.WHOLE in stages
    if backend == "packed":
        assert StageResult.PARTIAL in stages


@pytest.mark.parametrize(("width", "changed", "expected"), [
    (WIDTH, 8, StageResult.PARTIAL),     # up to 8 ranges: partial
    (WIDTH, 9, StageResult.WHOLE),       # a small table: the whole table is cheaper
    (16384, 20, StageResult.PARTIAL),    # a 4 MiB table: up to 32 ranges stay partial
    (16384, 33, StageResult.WHOLE),
])
def test_partial_policy_follows_the_measured_crossover(device: str, h: Any, width: int,
                                                      changed: int, expected: str) -> None:
    st = H2DRunnerState(device, scatter=h.scatter_mode(device))
    rows = 72
    lens = st.buffer("context_lens", (rows,), torch.int32, group="mha_decode")
    bt = st.buffer("block_tables", (rows, width), torch.int32, group="mha_decode",
                   unit="rows", max_ranges=64)
    st.bind()
    bts = block_table_state(bt)
    tables = [BlockTable([i]) for i in range(rows)]
    _publish(st, lens, bts, tables)
    for i in range(0, 2 * changed, 2):  # non-adjacent rows: one range each
        tables[i].append_one(7)
    assert _publish(st, lens, bts, tables) == expected
    _check_gpu(device, h, bts, rows)


def test_one_state_per_buffer(device: str, h: Any) -> None:
    _st, _lens, bt, bts = _setup(device, h)
    with pytest.raises(Exception, match="'block_tables' already has block-table state"):
        block_table_state(bt)
    assert bt._page_map is bts


def test_omitted_table_is_not_recorded_as_published(device: str, h: Any) -> None:
    st, lens, bt, bts = _setup(device, h)
    tables = [BlockTable([i]) for i in range(4)]
    _publish(st, lens, bts, tables)
    good = bts.published
    st.begin()
    tables[0].append_one(9)
    bts.prepare(tables)
    st.set_count(lens, 4)
    bts.stage(4)
    st.set_count(bt, None)  # the caller drops the table after staging it
    st.publish("mha_decode")
    st.finish()
    assert bts.published is good  # the GPU never received the new revision
    assert _publish(st, lens, bts, tables) != StageResult.REUSED
    _check_gpu(device, h, bts, 4)


def test_staged_counts_set_after_ranges_never_overwrite_the_table(device: str,
                                                                  h: Any) -> None:
    """Ranges are checked against their own staging share, so a large staged member whose
    count comes later cannot push the range bytes into the table's pinned source."""
    st = H2DRunnerState(device, scatter=h.scatter_mode(device))
    ids = st.buffer("input_ids", (16384,), torch.int32, group="g")  # staged (64 KB)
    bt = st.buffer("block_tables", (64, 512), torch.int32, group="g", unit="rows",
                   max_ranges=8)
    st.bind()
    bts = block_table_state(bt)
    rng = np.random.default_rng(5)
    tables = [BlockTable(rng.integers(0, 1000, 400)) for _ in range(64)]
    st.begin()
    bts.prepare(tables)
    st.set_count(ids, 1)
    bts.stage(64)
    st.publish("g")
    st.finish()
    for step in range(3):
        st.begin()
        for i in (3, 20, 41):
            tables[i] = BlockTable(rng.integers(0, 1000, 500))
        bts.prepare(tables)
        assert bts.stage(64) == StageResult.PARTIAL
        ids.np[:] = rng.integers(0, 1000, 16384)
        st.set_count(ids, 16384)  # the full staged member, after the ranges
        before = bt.cpu.clone()
        st.publish("g")
        st.finish()
        h.sync(device)
        assert torch.equal(bt.cpu, before), step
        _check_gpu(device, h, bts, 64)
        assert torch.equal(ids.gpu.cpu(), ids.cpu)


def test_repeated_stages_and_reopen_keep_the_record_exact(device: str, h: Any) -> None:
    """The row keys of the published record survive any number of stages that never
    published (the stage writes a reused spare array), and a publication after a repeated
    stage records the last one."""
    st, lens, _bt, bts = _setup(device, h)
    tables = [BlockTable([i, i + 1]) for i in range(8)]
    assert _publish(st, lens, bts, tables) == StageResult.WHOLE
    for step in range(6):
        kept = bts.published
        kept_keys = kept.keys.copy()
        st.begin()
        tables[step].append_one(100 + step)
        bts.prepare(tables)
        st.set_count(lens, 8)
        assert bts.stage(8) == StageResult.PARTIAL
        assert bts.stage(6) == StageResult.PARTIAL  # the caller changed its mind
        np.testing.assert_array_equal(bts.published.keys, kept_keys)
        if step % 2:
            st.reopen("mha_decode", "test: drop the staged table")
            st.set_count(lens, 8)
            np.testing.assert_array_equal(bts.published.keys, kept_keys)
            assert bts.stage(8) == StageResult.PARTIAL
        st.publish("mha_decode")
        st.finish()
        rows = 8 if step % 2 else 6
        assert bts.published.rows == rows
        assert bts.published.revision == bts.prepared_revision
        _check_gpu(device, h, bts, rows)


def test_changing_the_partial_policy_takes_effect_on_the_next_stage(device: str,
                                                                    h: Any) -> None:
    """The partial-publication limits are cached per row count; setting either policy
    attribute must drop that cache, so the next stage follows the new policy."""
    st, lens, _bt, bts = _setup(device, h)
    tables = [BlockTable([i, i + 1]) for i in range(16)]
    assert _publish(st, lens, bts, tables) == StageResult.WHOLE
    tables[1].append_one(50)
    assert _publish(st, lens, bts, tables) == StageResult.PARTIAL
    bts.partial_max_share = 0.0  # no share of the table may travel as ranges
    tables[2].append_one(51)
    assert _publish(st, lens, bts, tables) == StageResult.WHOLE
    bts.partial_max_share = 1.0
    bts.partial_max_ranges = 1  # one range at most: two appended rows need two
    tables[3].append_one(52)
    tables[9].append_one(53)
    assert _publish(st, lens, bts, tables) == StageResult.WHOLE
    bts.partial_max_ranges = None
    tables[4].append_one(54)
    assert _publish(st, lens, bts, tables) == StageResult.PARTIAL
    _check_gpu(device, h, bts, 16)


def test_ranges_past_the_staging_room_send_the_whole_table(device: str, h: Any) -> None:
    """A policy that lets a partial publication carry most of the table (share 1.0) must
    still keep its ranges inside the packed group's staging room: 16 replaced full rows
    are one contiguous range of half the table, more than the room, so the table goes
    whole, and the GPU table equals the snapshot."""
    st, lens, _bt, bts = _setup(device, h)
    bts.partial_max_share = 1.0
    tables = [BlockTable(list(range(i * WIDTH, (i + 1) * WIDTH))) for i in range(ROWS)]
    assert _publish(st, lens, bts, tables) == StageResult.WHOLE
    for i in range(ROWS // 2):  # new lineages: every byte of rows [0, 16) changes
        tables[i] = BlockTable(list(range(5000 + i * WIDTH, 5000 + (i + 1) * WIDTH)))
    rec = st._slot_groups[0][0]
    assert rec.packed.range_capacity < (ROWS // 2) * WIDTH * 4  # the case this pins
    assert _publish(st, lens, bts, tables) == StageResult.WHOLE
    _check_gpu(device, h, bts, ROWS)
    tables[3] = BlockTable(list(range(7000, 7000 + WIDTH)))  # one row: fits the room
    assert _publish(st, lens, bts, tables) == StageResult.PARTIAL
    _check_gpu(device, h, bts, ROWS)


def test_unpublished_compiled_steps_stay_in_the_history(device: str, h: Any) -> None:
    """A step prepared by the compiled path and never published (prefill preparing without
    uploading) must stay in the snapshot's history: a later step of unversioned rows
    diffs against the published revision through that history, so both steps' rows
    travel and the GPU table equals the snapshot."""
    st, lens, _bt, bts = _setup(device, h)
    tables = [BlockTable([i * 3, i * 3 + 1]) for i in range(16)]
    assert _publish(st, lens, bts, tables) == StageResult.WHOLE
    published = bts.published.revision
    st.begin()
    tables[1].append_one(901)  # a one-page append: the compiled step
    bts.prepare(tables)
    st.finish()
    assert bts.prepared_revision == published + 1
    rows = [t.to_numpy() for t in tables]  # unversioned rows: no compiled diff
    rows[6] = np.array([600, 601, 602], np.int32)
    assert _publish(st, lens, bts, rows) == StageResult.PARTIAL
    _check_gpu(device, h, bts, 16)


def test_a_batch_seen_before_a_compiled_step_is_no_hit_after_it(device: str, h: Any) -> None:
    """The snapshot's hit test (same ordered row keys as the last batch it prepared itself
    means same bytes) must forget that batch once the compiled step wrote other rows:
    preparing the first batch again rewrites the row the compiled step changed."""
    st, lens, _bt, bts = _setup(device, h)
    first = [BlockTable([i * 4, i * 4 + 1]) for i in range(8)]
    assert _publish(st, lens, bts, first) == StageResult.WHOLE  # whole rows: not compiled
    second = list(first)
    second[2] = first[2].lineage_copy()
    second[2].append_one(700)  # a one-page append of a copy: the compiled step
    _publish(st, lens, bts, second)
    assert bts.snapshot.storage[2, 2] == 700
    _publish(st, lens, bts, first)  # the first batch again: row 2 loses page 700
    assert bts.snapshot.storage[2, 2] == 0
    _check_gpu(device, h, bts, 8)


# -- capture-time preparation ----------------------------------------------------------------


def _capture(st: Any, bts: Any, n: int) -> str:
    """What a runner's graph capture does for the table: one epoch that prepares the
    captured size's empty rows and publishes the table's group."""
    st.begin()
    how = bts.prepare_capture(n)
    st.publish("mha_decode")
    st.finish()
    return how


def _rows(tables: list[BlockTable], n: int) -> np.ndarray:
    out = np.zeros((n, WIDTH), dtype=np.int32)
    for i, t in enumerate(tables):
        out[i, : len(t)] = t.tolist()
    return out


@pytest.mark.parametrize("num_slots", [1, 2])
def test_capture_preparation_goes_through_the_state(device: str, h: Any,
                                                    num_slots: int) -> None:
    """After capture preparation the GPU holds the empty capture rows and the record says
    so; the next real step then sends what differs. Filling the GPU table directly would
    leave the record on the old revision: the step would reuse a table the GPU no longer
    holds."""
    st, lens, _bt, bts = _setup(device, h, num_slots=num_slots)
    tables = [BlockTable(range(10 * i + 1, 10 * i + 2 + i % 5)) for i in range(6)]
    for _ in range(num_slots):  # every slot's snapshot holds the batch
        _publish(st, lens, bts, tables)
    before = bts.published
    assert _capture(st, bts, 8) != StageResult.REUSED
    h.sync(device)
    assert not bts.buffer.gpu[:8].cpu().any(), "capture rows must be empty on the GPU"
    rec = bts.published
    assert rec is not before and rec.rows == 8
    assert rec.slot == st.current_slot
    assert rec.revision == bts.snapshots[rec.slot].revision != before.revision
    assert not bts.snapshots[rec.slot].storage[:8].any()

    hows = []
    for _step in range(2 * num_slots):  # each slot in turn, twice, after the capture
        hows.append(_publish(st, lens, bts, tables))
        h.sync(device)
        np.testing.assert_array_equal(bts.buffer.gpu[:6].cpu().numpy(), _rows(tables, 6))
        _check_gpu(device, h, bts, 6)
    # no slot's first step after the capture may take the GPU table as its own
    assert StageResult.REUSED not in hows[:num_slots], hows
    # a later capture of the same size: whatever the slot, the GPU ends up empty again
    _capture(st, bts, 8)
    h.sync(device)
    assert not bts.buffer.gpu[:8].cpu().any()
    if num_slots == 1:  # same slot, same revision, same rows: nothing to send
        assert _capture(st, bts, 8) == StageResult.REUSED


def test_failed_capture_publication_never_marks_it_published(
        device: str, h: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    st, lens, bt, bts = _setup(device, h)
    tables = [BlockTable([i + 1, 2 * i + 1]) for i in range(6)]
    _publish(st, lens, bts, tables)
    good = bts.published
    st.begin()
    bts.prepare_capture(8)
    rec = st._slot_groups[0][st.plan("mha_decode").index]
    if rec.packed is not None:
        h.break_publication(monkeypatch, rec.packed)
    else:
        monkeypatch.setattr(bt, "_dst_units", None)
    with pytest.raises(PublicationEnqueueError):
        st.publish("mha_decode")
    assert bts.published is good
    monkeypatch.undo()
    st.reset()
    assert _publish(st, lens, bts, tables) == StageResult.WHOLE
    _check_gpu(device, h, bts, 6)


def test_capture_preparation_rejects_bad_calls_and_changes_nothing(device: str,
                                                                   h: Any) -> None:
    st, lens, bt, bts = _setup(device, h)
    tables = [BlockTable([i + 1]) for i in range(4)]
    _publish(st, lens, bts, tables)
    snap = bts.snapshot

    def observed() -> tuple[Any, ...]:
        return (snap.storage.tobytes(), snap.revision, snap.num_rows, bts.published,
                st.count(bt))

    before = observed()
    with pytest.raises(EpochError, match="prepare_capture of 'block_tables' outside an epoch"):
        bts.prepare_capture(4)
    st.begin()
    before = observed()
    for bad, match in [
        (ROWS + 1, r"'block_tables': prepare_capture of 33 rows, but the table holds "
                   r"\[0, 32\] rows"),
        (-1, r"prepare_capture of -1 rows"),
        (2.0, r"prepare_capture num_rows must be an int, got float"),
        (True, r"prepare_capture num_rows must be an int, got bool"),
    ]:
        with pytest.raises(CountError, match=match):
            bts.prepare_capture(bad)  # type: ignore[arg-type]
        assert observed() == before
    st.set_count(lens, 4)
    st.publish("mha_decode")
    before = observed()
    with pytest.raises(DuplicatePublicationError,
                       match="group 'mha_decode' was already published in this epoch"):
        bts.prepare_capture(4)
    assert observed() == before
    st.finish()
    assert _capture(st, bts, np.int64(4)) != StageResult.REUSED  # a valid retry works
    h.sync(device)
    assert not bts.buffer.gpu[:4].cpu().any()


def test_a_reserved_page_is_padding_only_through_the_state() -> None:
    """``block_table_state(..., reserved_page=)``: ``prepare`` refuses a real row holding
    it (nothing written, the revision kept) and takes it in the last ``padding`` rows."""
    from block_tables import ReservedPageError

    st = H2DRunnerState("cpu", backend="direct")
    bt = st.buffer("block_tables", (4, 4), torch.int32, group="g", unit="rows")
    st.bind()
    bts = block_table_state(bt, pool_limit=16, reserved_page=15)
    pad = BlockTable([15])
    st.begin()
    rev = bts.prepare([BlockTable([1])])
    before = bt.source(0).numpy().copy()
    with pytest.raises(ReservedPageError, match=r"row 1: page ID 15 at column 0"):
        bts.prepare([BlockTable([1]), pad])
    assert bts.prepared_revision == rev
    np.testing.assert_array_equal(bt.source(0).numpy(), before)
    with pytest.raises(CountError, match=r"padding=3 must be an int in \[0, 2\]"):
        bts.prepare([BlockTable([1]), pad], padding=3)
    bts.prepare([BlockTable([1]), pad], padding=1)
    assert bt.source(0).numpy()[:2, 0].tolist() == [1, 15]
    st.finish()
