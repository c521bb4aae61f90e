"""The decode runner's plain parts: the scheduler simulation and the paged decoder.

CPU always; the ``cuda`` half of ``device`` tests and the ``gpu`` CUDA-graph test run with
RUN_H2D_GPU_TESTS=1.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch
from decode_runner.host_inputs import HostInputError, build_host_inputs
from decode_runner.model import (
    DecoderInputError,
    DecoderInputs,
    TinyDecoder,
    TinyDecoderConfig,
    greedy,
)
from decode_runner.scheduler import (
    DEFERRED_PLACEHOLDER,
    ArrivalPattern,
    FeedbackError,
    Scheduler,
    SchedulerConfig,
    SchedulerConfigError,
    padded_size,
    steady_decode_batches,
    steady_decode_num_pages,
)

from block_tables import BlockTable, PageTableSnapshot
from h2d_runner_adapters.batch import ScheduledBatch, ScheduledRequest


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # Tiny tensors: intra-op threads only add wake-up latency (tens of ms per op on some
    # 2-core machines).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# A small, busy configuration: a tight pool forces preemption, migrations and reorders
# happen often, chunks are small enough to split prompts.
BUSY = SchedulerConfig(
    seed=7,
    page_size=4,
    num_pages=40,
    max_batch=6,
    prefill_chunk_tokens=16,
    prompt_len=(1, 30),
    output_len=(1, 24),
    num_requests=30,
    arrival=ArrivalPattern(kind="poisson", initial=3, rate=0.4),
    vocab_size=97,
    graph_sizes=(1, 2, 4, 8),
    preempt_prob=0.03,
    migrate_prob=0.1,
    reorder_prob=0.15,
)


def _fake_sampler(batch: ScheduledBatch) -> list[int]:
    """Deterministic 'sampled' ids that depend on the step and row."""
    return [(batch.step * 31 + row * 7 + 3) % 97 for row in range(batch.num_reqs)]


Sampler = Callable[[ScheduledBatch], list[int]]


def _run(config: SchedulerConfig,
         sampler: Sampler = _fake_sampler) -> list[tuple[ScheduledBatch, list[int]]]:
    sched = Scheduler(config)
    out: list[tuple[ScheduledBatch, list[int]]] = []
    batch = sched.step(None)
    while batch is not None:
        sampled = sampler(batch)
        out.append((batch, sampled))
        batch = sched.step(sampled)
    assert sched.done
    return out


def _version(row: ScheduledRequest) -> int:
    assert isinstance(row.block_table, BlockTable)
    return row.block_table.version


def _shape(batch: ScheduledBatch, versions: dict[int, int]) -> tuple[object, ...]:
    """A batch without process-wide version numbers (renumbered by first appearance)."""
    rows = tuple(
        (r.req_id, r.num_tokens, r.context_len, tuple(r.block_table),
         versions.setdefault(_version(r), len(versions)), r.sampling,
         tuple(r.token_ids), r.prev_sample_row)
        for r in batch.requests
    )
    extras = tuple(sorted((k, v) for k, v in batch.extras.items()))
    return (batch.is_prefill, batch.padded_size, batch.step, rows, extras)


# -- scheduler ---------------------------------------------------------------------------


def test_scheduler_is_deterministic() -> None:
    a, b = _run(BUSY), _run(BUSY)
    va: dict[int, int] = {}
    vb: dict[int, int] = {}
    assert [_shape(x, va) for x, _ in a] == [_shape(y, vb) for y, _ in b]
    # Other sampled ids change token contents only, never the schedule.
    c = _run(BUSY, sampler=lambda batch: [5] * batch.num_reqs)
    assert [(x.is_prefill, [(r.req_id, r.context_len, r.num_tokens) for r in x.requests])
            for x, _ in a] == [
           (y.is_prefill, [(r.req_id, r.context_len, r.num_tokens) for r in y.requests])
           for y, _ in c]
    # A different seed gives a different run.
    d = _run(replace(BUSY, seed=8))
    assert [x.num_reqs for x, _ in a] != [y.num_reqs for y, _ in d]


def test_scheduler_page_accounting() -> None:
    sched = Scheduler(BUSY)
    batch = sched.step(None)
    steps = 0
    while batch is not None:
        owners = sched.page_owners()  # raises on a page held twice
        assert len(owners) + sched.free_page_count == BUSY.num_pages
        pages = [p for r in batch.requests for p in r.block_table]
        assert len(pages) == len(set(pages)), f"batch {batch.step} shares a page"
        assert all(0 <= p < BUSY.num_pages for p in pages)
        for r in batch.requests:
            assert len(r.block_table) * BUSY.page_size >= r.context_len
            assert owners[r.block_table[len(r.block_table) - 1]] == r.req_id
        batch = sched.step(_fake_sampler(batch))
        steps += 1
    assert steps > 50
    assert sched.free_page_count == BUSY.num_pages
    assert sched.page_owners() == {}
    assert sched.stats.finished == BUSY.num_requests
    assert sched.stats.preemptions > 0 and sched.stats.migrations > 0


def test_scheduler_tables_grow_by_lineage_and_replacements_draw_versions() -> None:
    last: dict[int, tuple[int, list[int]]] = {}
    events: dict[int, set[str]] = {}
    grew = replaced = 0
    for batch, _ in _run(BUSY):
        for kind in ("preempted", "migrated"):
            for req_id in batch.extras[kind]:  # type: ignore[attr-defined]
                events.setdefault(req_id, set()).add(kind)
        for r in batch.requests:
            ids = list(r.block_table)
            if r.req_id in last:
                version, old = last[r.req_id]
                happened = events.pop(r.req_id, set())
                if happened:
                    assert _version(r) != version, (
                        f"request {r.req_id}: {happened} kept version {version}")
                    replaced += 1
                else:
                    assert _version(r) == version
                    assert ids[: len(old)] == old and len(ids) >= len(old)
                    grew += len(ids) > len(old)
            last[r.req_id] = (_version(r), ids)
    assert grew > 20 and replaced > 5


def test_scheduler_older_batches_never_change() -> None:
    run = _run(BUSY)
    seen = [[(_version(r), list(r.block_table)) for r in b.requests] for b, _ in run]
    assert seen == [[(_version(r), list(r.block_table)) for r in b.requests]
                    for b, _ in run]


def test_scheduler_migrations_move_one_page() -> None:
    moves_seen = 0
    last: dict[int, list[int]] = {}
    for batch, _ in _run(BUSY):
        moves = batch.extras["kv_page_moves"]
        migrated = batch.extras["migrated"]
        assert len(moves) == len(migrated)  # type: ignore[arg-type]
        for (src, dst), req_id in zip(moves, migrated, strict=True):  # type: ignore[call-overload]
            assert src != dst
            moves_seen += 1
            row = next((r for r in batch.requests if r.req_id == req_id), None)
            if row is not None and req_id in last and not batch.extras["preempted"]:
                assert dst in list(row.block_table)
                assert src not in list(row.block_table)
        for r in batch.requests:
            last[r.req_id] = list(r.block_table)
    assert moves_seen > 5


def test_scheduler_batch_sizes_change_and_pad() -> None:
    run = _run(BUSY)
    decode = [b for b, _ in run if not b.is_prefill]
    sizes = [b.num_reqs for b in decode]
    assert len(set(sizes)) >= 4
    changes = sum(a != b for a, b in itertools.pairwise(sizes))
    assert changes >= len(sizes) // 10
    for b in decode:
        assert b.padded_size == padded_size(b.num_reqs, BUSY.graph_sizes)
        assert b.num_reqs <= BUSY.max_batch
    assert all(b.padded_size is None for b, _ in run if b.is_prefill)
    # order changes with membership unchanged happen too (reorders)
    reorders = sum(
        1 for a, b in itertools.pairwise(decode)
        if {r.req_id for r in a.requests} == {r.req_id for r in b.requests}
        and [r.req_id for r in a.requests] != [r.req_id for r in b.requests]
    )
    assert reorders > 0


def _check_snapshot(batches: list[ScheduledBatch], rows: int, width: int,
                    pool: int) -> int:
    """Prepare every batch into a PageTableSnapshot: its incremental bytes must equal the
    naive rebuild, so versions never promise content they do not have. Returns hits."""
    storage = np.full((rows, width), -7, dtype=np.int32)
    snap = PageTableSnapshot(storage, pool_limit=pool, fill_value=0)
    hits = 0
    for batch in batches:
        tables = [r.block_table for r in batch.requests]
        required = [-(-r.context_len // batch.page_size) for r in batch.requests]
        before = snap.revision
        snap.prepare(tables, required_pages=required)
        hits += snap.revision == before
        for i, table in enumerate(tables):
            ids = list(table)
            assert storage[i, : len(ids)].tolist() == ids
            assert (storage[i, len(ids):] == 0).all()
    return hits


def test_scheduler_batches_prepare_into_a_snapshot() -> None:
    run = [b for b, _ in _run(BUSY)]
    _check_snapshot(run, BUSY.max_batch, BUSY.max_pages_per_request, BUSY.num_pages)
    steady = steady_decode_batches(32, 40, 8, window=24)
    batches = [next(steady) for _ in range(60)]
    per_row = steady_decode_num_pages(1, 40, 8, window=24)
    hits = _check_snapshot(batches, 32, per_row, 32 * per_row)
    assert hits == 0  # 1/8 of the rows append every step


def test_padded_size() -> None:
    assert padded_size(1, (1, 2, 4, 8)) == 1
    assert padded_size(3, (8, 4, 2, 1)) == 4
    assert padded_size(8, (1, 2, 4, 8)) == 8
    assert padded_size(9, (1, 2, 4, 8)) is None
    assert padded_size(1, ()) is None


def test_scheduler_prefill_chunks_cover_prompts_and_inputs_follow_samples() -> None:
    """Rebuild every request's token sequence from the batches and the fed-back samples."""
    known: dict[int, list[int]] = {}  # req_id -> prompt + every sampled output
    progress: dict[int, int] = {}  # req_id -> tokens computed in its current prefill
    prompts_done: set[int] = set()
    prev: tuple[ScheduledBatch, list[int]] | None = None
    deferred = host = 0
    for batch, sampled in _run(BUSY):
        if prev is not None:
            pb, ps = prev
            for row, r in enumerate(pb.requests):
                if pb.extras["sample_rows"][row]:  # type: ignore[index]
                    known[r.req_id].append(ps[row])
        for kind in ("preempted",):
            for req_id in batch.extras[kind]:  # type: ignore[attr-defined]
                progress[req_id] = 0
        ids = list(batch.extras["input_ids"])  # type: ignore[call-overload]
        offset = 0
        if batch.is_prefill:
            assert batch.num_tokens <= BUSY.prefill_chunk_tokens
        for row, r in enumerate(batch.requests):
            span = ids[offset: offset + r.num_tokens]
            offset += r.num_tokens
            if batch.is_prefill:
                if r.req_id not in known:
                    known[r.req_id] = []
                    progress[r.req_id] = 0
                assert progress[r.req_id] == r.first_position
                seen = known[r.req_id][r.first_position:r.context_len]
                assert list(r.token_ids[: len(seen)]) == seen
                if r.req_id in prompts_done:
                    # a recompute: everything it prefills is known already
                    assert len(seen) == r.num_tokens
                else:
                    # the first prefill (maybe restarted): chunks are the prompt, in order
                    known[r.req_id].extend(r.token_ids[len(seen):])
                assert span == list(r.token_ids)
                progress[r.req_id] = r.context_len
                completes = batch.extras["sample_rows"][row]  # type: ignore[index]
                if completes:
                    prompts_done.add(r.req_id)
                    # a completed prefill covers everything known, exactly
                    assert r.context_len == len(known[r.req_id])
            else:
                assert r.num_tokens == 1 and r.req_id in prompts_done
                assert r.context_len == len(known[r.req_id])
                assert span == [known[r.req_id][-1]]
                if r.prev_sample_row >= 0:
                    deferred += 1
                    assert prev is not None
                    pb, ps = prev
                    assert pb.requests[r.prev_sample_row].req_id == r.req_id
                    assert pb.extras["sample_rows"][r.prev_sample_row]  # type: ignore[index]
                    assert ps[r.prev_sample_row] == known[r.req_id][-1]
                    assert tuple(r.token_ids) == (DEFERRED_PLACEHOLDER,)
                else:
                    host += 1
                    assert prev is None or r.req_id not in [
                        q.req_id for i, q in enumerate(prev[0].requests)
                        if prev[0].extras["sample_rows"][i]]  # type: ignore[index]
                    assert list(r.token_ids) == [known[r.req_id][-1]]
        assert offset == len(ids)
        prev = (batch, sampled)
    assert deferred > 50 and host > 10
    # every request produced exactly its output length
    assert len(prompts_done) == BUSY.num_requests


def test_scheduler_rejects_bad_feedback_and_changes_nothing() -> None:
    good = Scheduler(BUSY)
    bad = Scheduler(BUSY)
    with pytest.raises(FeedbackError, match="first call"):
        bad.step([1])
    bg, bb = good.step(None), bad.step(None)
    versions_g: dict[int, int] = {}
    versions_b: dict[int, int] = {}
    for _ in range(30):
        assert bg is not None and bb is not None
        with pytest.raises(FeedbackError, match="one sampled id per row"):
            bad.step(None)
        with pytest.raises(FeedbackError, match="one id per row"):
            bad.step([0] * (bb.num_reqs + 1))
        with pytest.raises(FeedbackError, match="outside the vocabulary"):
            bad.step([BUSY.vocab_size] * bb.num_reqs)
        assert _shape(bg, versions_g) == _shape(bb, versions_b)
        bg, bb = good.step(_fake_sampler(bg)), bad.step(_fake_sampler(bb))


def test_scheduler_config_errors() -> None:
    with pytest.raises(SchedulerConfigError, match="num_pages"):
        SchedulerConfig(num_pages=2, page_size=4, prompt_len=(1, 30), output_len=(1, 4))
    with pytest.raises(SchedulerConfigError, match="preempt_prob"):
        SchedulerConfig(preempt_prob=1.5)
    with pytest.raises(SchedulerConfigError, match=r"arrival\.rate"):
        SchedulerConfig(arrival=ArrivalPattern(rate=0.0))


def test_scheduler_burst_arrivals_and_sampling_mix() -> None:
    config = replace(BUSY, arrival=ArrivalPattern(kind="burst", initial=0, burst_size=5,
                                                  burst_every=10), preempt_prob=0.0,
                     migrate_prob=0.0, num_pages=200)
    run = _run(config)
    params = {r.req_id: r.sampling for b, _ in run for r in b.requests}
    assert len(params) == config.num_requests
    greedy_count = sum(p.greedy for p in params.values())
    per_request = sum(not p.greedy and p.top_k != -1 for p in params.values())
    uniform = sum(not p.greedy and p.top_k == -1 and p.top_p == 1.0 for p in params.values())
    assert greedy_count > 0 and per_request > 0 and uniform > 0
    # no random events and a pool that never runs short: every table keeps its lineage
    assert all(not b.extras["preempted"] and not b.extras["migrated"] for b, _ in run)
    versions: dict[int, int] = {}
    for b, _ in run:
        for r in b.requests:
            assert versions.setdefault(r.req_id, _version(r)) == _version(r)


def test_steady_decode_batches() -> None:
    bs, ctx, every = 64, 100, 16
    gen = steady_decode_batches(bs, ctx, every, window=40, graph_sizes=(32, 64, 128))
    batches = [next(gen) for _ in range(81)]
    first = batches[0]
    assert first.padded_size == 64 and not first.is_prefill and first.page_size == every
    assert [r.context_len for r in first.requests] == [ctx + r % every for r in range(bs)]
    assert all(r.prev_sample_row == -1 for r in first.requests)
    pool = steady_decode_num_pages(bs, ctx, every, window=40)
    for prev, cur in itertools.pairwise(batches):
        assert all(r.prev_sample_row == i and tuple(r.token_ids) == (DEFERRED_PLACEHOLDER,)
                   for i, r in enumerate(cur.requests))
        pages = [p for r in cur.requests for p in r.block_table]
        assert len(pages) == len(set(pages)) and max(pages) < pool
        restart = cur.step % 40 == 0
        appended = 0
        for a, b in zip(prev.requests, cur.requests, strict=True):
            assert len(b.block_table) == -(-b.context_len // every)
            if restart:
                assert b.context_len == ctx + b.req_id % every
                if len(b.block_table) < len(a.block_table):
                    assert _version(b) != _version(a)
            else:
                assert b.context_len == a.context_len + 1
                assert _version(b) == _version(a)
                assert list(b.block_table)[: len(a.block_table)] == list(a.block_table)
                appended += len(b.block_table) - len(a.block_table)
        if not restart:
            assert appended == bs // every


# -- model -------------------------------------------------------------------------------

MODEL = TinyDecoderConfig(vocab=97, hidden=32, layers=2, heads=2, head_dim=8, page_size=4,
                          num_pages=40)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double().cpu() - ref).norm() / ref.norm())


def test_model_follows_scheduler_against_references(device: str) -> None:
    """A whole scheduled run: chunked prefill, deferred decode, padded graph rows, page
    migration and preemption; every step against forward_reference, decode rows against
    the dense whole-sequence oracle."""
    config = replace(BUSY, num_requests=14, prompt_len=(1, 20), output_len=(1, 12))
    model = TinyDecoder(MODEL, device, seed=1, max_pages=config.max_pages_per_request)
    sched = Scheduler(config)
    batch = sched.step(None)
    prev: list[int] | None = None
    tokens: dict[int, list[int]] = {}
    worst = worst_dense = 0.0
    checked_dense = padded_steps = 0
    while batch is not None:
        model.move_pages(batch.extras["kv_page_moves"])  # type: ignore[arg-type]
        step = build_host_inputs(batch, device, prev_sampled=prev)
        assert step.input_ids == batch.extras["input_ids"]
        logits = model.forward(step.inputs)
        ref = model.forward_reference(step.inputs)
        worst = max(worst, _rel(logits, ref))
        assert torch.isfinite(logits).all()
        real_tokens = batch.num_tokens
        padded_steps += step.inputs.num_tokens > real_tokens
        offset = 0
        for r in batch.requests:
            known = tokens.setdefault(r.req_id, [])
            del known[r.first_position:]
            known.extend(step.input_ids[offset: offset + r.num_tokens])
            offset += r.num_tokens
            if not batch.is_prefill and checked_dense < 40:
                dense = model.reference_sequence_logits(known)[-1]
                worst_dense = max(worst_dense, _rel(logits[offset - 1], dense))
                checked_dense += 1
        picked = greedy(logits.index_select(0, step.logits_indices)).cpu().tolist()
        prev = picked
        batch = sched.step(picked[: batch.num_reqs])
    assert worst < 1e-4, worst
    assert worst_dense < 1e-4, worst_dense
    assert checked_dense == 40 and padded_steps > 5
    assert sched.stats.migrations > 0 and sched.stats.preemptions > 0


def _random_step(gen: torch.Generator, cfg: TinyDecoderConfig, device: str,
                 pad_rows: int = 0) -> tuple[DecoderInputs, list[int]]:
    """Random rows over disjoint random pages: each row a chunk at the end of a random
    context; some real tokens have slot -1 (their K/V already cached); ``pad_rows`` padded
    rows of one token each. Returns the inputs and the valid slots."""
    perm = torch.randperm(cfg.num_pages, generator=gen).tolist()
    rows = 3
    ids, pos, slots, treq, indptr, indices, ctxs = [], [], [], [], [0], [], []
    for row in range(rows):
        ctx = int(torch.randint(1, 6 * cfg.page_size, (1,), generator=gen))
        n = int(torch.randint(1, ctx + 1, (1,), generator=gen))
        npages = -(-ctx // cfg.page_size)
        table = [perm.pop() for _ in range(npages)]
        for p in range(ctx - n, ctx):
            ids.append(int(torch.randint(0, cfg.vocab, (1,), generator=gen)))
            pos.append(p)
            skip = torch.rand(1, generator=gen).item() < 0.25
            slots.append(-1 if skip else table[p // cfg.page_size] * cfg.page_size
                         + p % cfg.page_size)
            treq.append(row)
        indices.extend(table)
        indptr.append(len(indices))
        ctxs.append(ctx)
    for row in range(rows, rows + pad_rows):
        ids.append(3)
        pos.append(0)
        slots.append(-1)
        treq.append(row)
        indptr.append(len(indices))
        ctxs.append(0)
    indices.extend([0] * 5)  # capacity past the used length

    def t(v: list[int], dt: torch.dtype) -> torch.Tensor:
        return torch.tensor(v, dtype=dt, device=device)

    inputs = DecoderInputs(t(ids, torch.int32), t(pos, torch.int64), t(slots, torch.int64),
                           t(treq, torch.int32), t(indptr, torch.int32),
                           t(indices, torch.int32), t(ctxs, torch.int32))
    return inputs, [s for s in slots if s >= 0]


def _warm_cache(model: TinyDecoder, seed: int) -> None:
    """Fill both caches with the same random K/V so cached-prefix keys matter."""
    gen = torch.Generator().manual_seed(seed)
    fill = torch.randn(model.kv_cache.shape, generator=gen, dtype=torch.float64)
    fill[:, :, model.trash_slot] = 0
    model.kv_cache.copy_(fill.to(model.kv_cache.dtype))
    model.forward_reference(_random_step(gen, model.config, "cpu")[0])  # creates the ref cache
    assert model._reference_kv is not None
    model._reference_kv.copy_(fill[:, :, : model.trash_slot])


def test_model_random_steps_match_reference(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    model = TinyDecoder(MODEL, device, seed=2, max_pages=8)
    _warm_cache(model, 5)
    for _ in range(6):
        inputs, _ = _random_step(gen, MODEL, device, pad_rows=int(torch.randint(0, 3, (1,),
                                                                               generator=gen)))
        out = model.forward(inputs)
        ref = model.forward_reference(inputs)
        assert _rel(out, ref) < 1e-4
    assert model._reference_kv is not None
    assert _rel(model.kv_cache[:, :, : model.trash_slot], model._reference_kv) < 1e-5


def test_model_writes_kv_only_at_valid_slots(device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    model = TinyDecoder(MODEL, device, seed=3, max_pages=8)
    _warm_cache(model, 6)
    inputs, valid = _random_step(gen, MODEL, device, pad_rows=2)
    assert 0 < len(valid) < inputs.num_tokens
    before = model.kv_cache.clone()
    model.forward(inputs)
    model.forward_reference(inputs)
    after = model.kv_cache
    changed = (before != after).flatten(3).any(-1).any(1).any(0)  # per slot
    changed[model.trash_slot] = False
    changed_slots = set(torch.nonzero(changed).flatten().tolist())
    assert changed_slots == set(valid)
    keep = torch.ones(after.shape[2], dtype=torch.bool, device=after.device)
    keep[torch.tensor(valid, device=after.device)] = False
    keep[model.trash_slot] = False
    assert torch.equal(before[:, :, keep].view(torch.int32), after[:, :, keep].view(torch.int32))
    ref = model._reference_kv
    assert ref is not None
    idx = torch.tensor(valid)
    assert _rel(after[:, :, idx.to(after.device)], ref[:, :, idx]) < 1e-5


def test_model_padded_rows_are_finite_and_isolated(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    plain, _ = _random_step(gen, MODEL, device, pad_rows=0)
    gen = torch.Generator().manual_seed(2)
    padded, _ = _random_step(gen, MODEL, device, pad_rows=5)
    real = plain.num_tokens
    # stale values in padded tokens must not matter: ids, positions point anywhere
    padded.input_ids[real:] = MODEL.vocab + 7
    padded.positions[real:] = 10**6
    a = TinyDecoder(MODEL, device, seed=4, max_pages=8)
    b = TinyDecoder(MODEL, device, seed=4, max_pages=8)
    _warm_cache(a, 7)
    _warm_cache(b, 7)
    out_plain = a.forward(plain)
    out_padded = b.forward(padded)
    assert torch.isfinite(out_padded).all()
    torch.testing.assert_close(out_padded[:real], out_plain, rtol=1e-5, atol=1e-5)
    trash = a.trash_slot
    assert torch.equal(a.kv_cache[:, :, :trash], b.kv_cache[:, :, :trash])


def test_model_row_without_keys_gives_zero_attention(device: str) -> None:
    model = TinyDecoder(MODEL, device, seed=5, max_pages=4)
    t = lambda v, dt: torch.tensor(v, dtype=dt, device=device)  # noqa: E731
    # row 0 has one page but context 0; row 1 owns no pages at all
    inputs = DecoderInputs(t([1, 2], torch.int32), t([0, 0], torch.int64),
                           t([-1, -1], torch.int64), t([0, 1], torch.int32),
                           t([0, 1, 1], torch.int32), t([3], torch.int32),
                           t([0, 0], torch.int32))
    out = model.forward(inputs)
    ref = model.forward_reference(inputs)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 1e-4


def test_model_low_precision(device: str) -> None:
    dtypes = [torch.bfloat16] if device == "cpu" else [torch.float16, torch.bfloat16]
    gen = torch.Generator().manual_seed(3)
    inputs, _ = _random_step(gen, MODEL, device, pad_rows=1)
    for dtype in dtypes:
        model = TinyDecoder(replace(MODEL, dtype=dtype), device, seed=6, max_pages=8)
        out = model.forward(inputs)
        ref = model.forward_reference(inputs)
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        assert _rel(out, ref) < 5e-2


def test_decoder_inputs_are_checked() -> None:
    t = torch.zeros
    good = {
        "input_ids": t(2, dtype=torch.int32), "positions": t(2, dtype=torch.int64),
        "slot_mapping": t(2, dtype=torch.int64), "token_request": t(2, dtype=torch.int32),
        "kv_indptr": t(3, dtype=torch.int32), "kv_indices": t(1, dtype=torch.int32),
        "context_lens": t(2, dtype=torch.int32),
    }
    DecoderInputs(**good)
    with pytest.raises(DecoderInputError, match=r"slot_mapping must be a 1-D torch\.int64"):
        DecoderInputs(**{**good, "slot_mapping": t(2, dtype=torch.int32)})
    with pytest.raises(DecoderInputError, match="positions has 3 elements for 2 tokens"):
        DecoderInputs(**{**good, "positions": t(3, dtype=torch.int64)})
    with pytest.raises(DecoderInputError, match="rows \\+ 1"):
        DecoderInputs(**{**good, "kv_indptr": t(2, dtype=torch.int32)})
    with pytest.raises(DecoderInputError, match="kv_indices is empty"):
        DecoderInputs(**{**good, "kv_indices": t(0, dtype=torch.int32)})
    model = TinyDecoder(MODEL, "cpu", max_pages=1)
    too_many = DecoderInputs(**{**good, "kv_indptr": torch.tensor([0, 2, 2], dtype=torch.int32),
                                "kv_indices": t(2, dtype=torch.int32)})
    with pytest.raises(DecoderInputError, match="max_pages=1"):
        model.forward_reference(too_many)


def test_host_inputs_errors() -> None:
    sched = Scheduler(BUSY)
    batch = sched.step(None)
    assert batch is not None and batch.is_prefill
    with pytest.raises(HostInputError, match="padding applies"):
        build_host_inputs(batch, padded_rows=batch.num_reqs + 1)
    with pytest.raises(HostInputError, match="pad up"):
        build_host_inputs(batch, padded_rows=0)
    # a deferred row needs the previous sampled ids
    while batch is not None and not any(r.prev_sample_row >= 0 for r in batch.requests):
        batch = sched.step(_fake_sampler(batch))
    assert batch is not None
    with pytest.raises(HostInputError, match="defers to previous row"):
        build_host_inputs(batch)


@pytest.mark.gpu
def test_decode_cuda_graph_replay_matches_eager() -> None:
    device = "cuda"
    cfg = replace(MODEL, dtype=torch.float16)
    config = replace(BUSY, num_requests=10, prompt_len=(1, 20), output_len=(4, 12),
                     preempt_prob=0.0, migrate_prob=0.0)
    model = TinyDecoder(cfg, device, seed=7, max_pages=config.max_pages_per_request)
    graph_rows = max(config.graph_sizes)
    capacity = graph_rows * config.max_pages_per_request
    sched = Scheduler(config)
    batch = sched.step(None)
    prev: list[int] | None = None
    static: DecoderInputs | None = None
    graph: torch.cuda.CUDAGraph | None = None
    static_out: torch.Tensor | None = None
    replays = 0
    trash = model.trash_slot
    while batch is not None:
        padded = None if batch.is_prefill else graph_rows
        step = build_host_inputs(batch, device, prev_sampled=prev, padded_rows=padded,
                                 kv_capacity=capacity)
        if batch.is_prefill:
            logits = model.forward(step.inputs)
        else:
            if static is None:
                static = DecoderInputs(**{k: None if v is None else v.clone()
                                         for k, v in vars(step.inputs).items()})
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                saved = model.kv_cache.clone()
                with torch.cuda.stream(side):
                    model.forward(static)  # warm-up outside capture
                torch.cuda.current_stream().wait_stream(side)
                model.kv_cache.copy_(saved)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_out = model.forward(static)
                model.kv_cache.copy_(saved)
            for name, value in vars(step.inputs).items():
                if value is not None:  # optional inputs the host builder leaves out
                    getattr(static, name).copy_(value)
            saved = model.kv_cache.clone()
            eager = model.forward(step.inputs)
            eager_kv = model.kv_cache[:, :, :trash].clone()
            model.kv_cache.copy_(saved)
            assert graph is not None and static_out is not None
            graph.replay()
            assert torch.equal(static_out, eager)
            assert torch.equal(model.kv_cache[:, :, :trash], eager_kv)
            logits = static_out.clone()
            replays += 1
        picked = greedy(logits.index_select(0, step.logits_indices)).cpu().tolist()
        prev = picked
        batch = sched.step(picked[: batch.num_reqs])
    assert replays > 10


def test_host_inputs_layout_for_a_padded_decode() -> None:
    sched = Scheduler(replace(BUSY, preempt_prob=0.0, migrate_prob=0.0))
    batch = sched.step(None)
    prev = None
    while batch is not None and (batch.is_prefill or batch.padded_size == batch.num_reqs):
        prev = _fake_sampler(batch)
        batch = sched.step(prev)
    assert batch is not None and batch.padded_size is not None
    step = build_host_inputs(batch, prev_sampled=prev)
    x = step.inputs
    rows, pad = batch.num_reqs, batch.padded_size
    assert x.num_tokens == x.num_rows == pad
    assert x.context_lens[rows:].tolist() == [0] * (pad - rows)
    assert x.slot_mapping[rows:].tolist() == [-1] * (pad - rows)
    total = x.kv_indptr[rows].item()
    assert x.kv_indptr[rows:].tolist() == [total] * (pad - rows + 1)
    assert x.token_request.tolist() == list(range(pad))
    for row, r in enumerate(batch.requests):
        table = list(r.block_table)
        lo, hi = x.kv_indptr[row].item(), x.kv_indptr[row + 1].item()
        assert x.kv_indices[lo:hi].tolist() == table[: -(-r.context_len // BUSY.page_size)]
        p = r.context_len - 1
        assert x.slot_mapping[row].item() == table[p // BUSY.page_size] * BUSY.page_size + (
            p % BUSY.page_size)
        assert x.positions[row].item() == p
    assert np.array_equal(step.logits_indices.numpy(), np.arange(pad))
