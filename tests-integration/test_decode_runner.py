"""The packages composed: a paged-attention decode runner driven by the scheduler.

Packed and direct publication must give bit-identical logits and tokens over a few hundred
steps of chunked prefill, deferred decode, growing and replaced block tables, changing and
padded batch sizes (CUDA graphs on the GPU), pipeline slot rotation with a delayed GPU, and
two-batch overlap. Every step's published metadata, after its first consumers, equals a
plain host-side oracle.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from decode_runner.host_inputs import build_host_inputs
from decode_runner.runner import DecodeRunner, RunnerConfig
from decode_runner.scheduler import (
    Scheduler,
    SchedulerConfig,
    steady_decode_batches,
    steady_decode_num_pages,
)
from kernel_mode import needs_kernels

STEPS = int(os.environ.get("H2D_INTEGRATION_STEPS", "200"))


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # tiny ops on a 2-core CPU are much slower with a thread pool than without
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _configs(device: str, **over: object) -> tuple[SchedulerConfig, RunnerConfig]:
    sched = SchedulerConfig(seed=3, page_size=8, num_pages=160, max_batch=8,
                            prefill_chunk_tokens=48, prompt_len=(1, 40), output_len=(4, 40),
                            num_requests=400, vocab_size=512, graph_sizes=(1, 2, 4, 8),
                            preempt_prob=0.02, migrate_prob=0.05)
    cuda = device == "cuda"
    run = RunnerConfig(max_reqs=8, max_tokens=64, max_pages_per_req=sched.max_pages_per_request,
                       page_size=8, num_pages=160, vocab=512, hidden=64, layers=2, heads=4,
                       head_dim=16, dtype=torch.float16 if cuda else torch.float32,
                       graph_sizes=(1, 2, 4, 8) if cuda else (),
                       scatter="auto" if cuda else "triton", **over)  # type: ignore[arg-type]
    return sched, run


def _run(device: str, backend: str, steps: int, *, check_oracle: bool = False,
         tbo: bool = False, **over: object) -> tuple[list[torch.Tensor], list[list[int]], dict]:
    sched_cfg, run_cfg = _configs(device, **over)
    runner = DecodeRunner(run_cfg, device, backend, tbo=tbo)
    sched = Scheduler(sched_cfg)
    logits, tokens = [], []
    sampled: list[int] | None = None
    prev: list[int] = [0] * run_cfg.max_reqs
    kinds = {"prefill": 0, "decode": 0, "padded": 0, "tbo": 0}
    for _ in range(steps):
        batch = sched.step(sampled)
        if batch is None:
            break
        use_tbo = tbo and not batch.is_prefill and batch.num_reqs >= 2
        res = runner.step(batch, tbo=use_tbo)
        kinds["prefill" if batch.is_prefill else "decode"] += 1
        kinds["padded"] += int((batch.padded_size or 0) > batch.num_reqs)
        kinds["tbo"] += int(use_tbo)
        if check_oracle and res.decoder_inputs is not None:
            _check_inputs(runner, batch, res.decoder_inputs, prev)
        logits.append(res.logits.float().cpu())
        sampled = res.sampled.cpu().tolist()
        # blocking reads on the stream every epoch runs on, after finish(): as an engine
        # that reads its ids back says so, begin() then asks the driver nothing
        runner.state.mark_synchronized()
        tokens.append(sampled)
        prev = sampled + [0] * (run_cfg.max_reqs - len(sampled))
    return logits, tokens, kinds


def _check_inputs(runner: DecodeRunner, batch: object, got: object, prev: list[int]) -> None:
    """The published + consumed metadata equals the host-side oracle."""
    rows = got.num_rows  # type: ignore[attr-defined]
    want = build_host_inputs(batch, "cpu", prev_sampled=prev,  # type: ignore[arg-type]
                             padded_rows=None if batch.is_prefill else rows).inputs  # type: ignore[attr-defined]
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    for name in ("input_ids", "positions", "slot_mapping", "token_request", "kv_indptr",
                 "context_lens"):
        g, w = getattr(got, name).cpu(), getattr(want, name)
        assert g.tolist() == w.tolist(), name
    total = int(want.kv_indptr[-1])
    assert got.kv_indices[:total].cpu().tolist() == want.kv_indices[:total].tolist()  # type: ignore[attr-defined]


def test_packed_and_direct_are_bit_identical(device: str) -> None:
    needs_kernels(device)
    # the CPU interpreter is ~0.4 s a step: a shorter schedule there (CI's time budget)
    steps = STEPS if device == "cuda" else min(STEPS, 100)
    lp, tp, kinds = _run(device, "packed", steps, check_oracle=True)
    ld, td, _ = _run(device, "direct", steps)
    assert len(lp) == len(ld) == steps, "the schedule ended early"
    assert kinds["prefill"] > steps // 40 and kinds["decode"] > steps // 4, kinds
    if device == "cuda":
        assert kinds["padded"] > 5, kinds
    assert tp == td
    mismatched = [i for i, (a, b) in enumerate(zip(lp, ld, strict=True)) if not torch.equal(a, b)]
    assert mismatched == []


def test_the_runner_fuses_its_first_consumers_by_default(device: str) -> None:
    """By default (``fuse_consumers=None``, where the kernels can run at publication) the
    decode and prefill publications run token assembly and KV-index generation: no
    consumer graph, a step is one publication launch then the model. Tokens and logits
    equal the unfused runner's, step for step."""
    needs_kernels(device)
    _, cfg = _configs(device)
    runner = DecodeRunner(cfg, device, "packed")
    assert runner.fuse_consumers and runner.consumers_in_publication
    assembly = runner.tokens.assembly_consumer
    assert assembly is not None and sorted(assembly.groups) == ["decode_step", "prefill_step"]
    assert runner.consumer_graphs == {}
    unfused = DecodeRunner(replace(cfg, fuse_consumers=False), device, "packed")
    assert not unfused.consumers_in_publication
    assert set(unfused.consumer_graphs) == set(cfg.graph_sizes)
    steps = 60 if device == "cuda" else 24
    lf, tf, kinds = _run(device, "packed", steps)
    lu, tu, _ = _run(device, "packed", steps, fuse_consumers=False)
    assert kinds["prefill"] and kinds["decode"], kinds
    assert tf == tu
    assert all(torch.equal(a, b) for a, b in zip(lf, lu, strict=True))


@pytest.mark.gpu
def test_a_steady_decode_step_is_one_publication_launch_then_the_model_graph() -> None:
    """A steady padded decode step of the default runner in a profiler trace: on the host
    no kernel launch and no memcpy call (the publication's graph is launched by the
    compiled core, the model's by its replay); on the device one H2D copy, and every
    device activity enqueued by at most two calls (two correlation ids: the publication
    graph with its scatter and both first consumers, then the model's graph)."""
    import json
    import tempfile
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from h2d_kernels import copy_counts

    bs = 4
    cfg = RunnerConfig(max_reqs=bs, max_tokens=bs, max_pages_per_req=16, page_size=16,
                       num_pages=steady_decode_num_pages(bs, 64, 16, 64), vocab=512,
                       graph_sizes=(bs,), num_slots=2, dtype=torch.float16)
    runner = DecodeRunner(cfg, "cuda", "packed")
    assert runner.consumers_in_publication and runner.consumer_graphs == {}
    batches = steady_decode_batches(bs, 64, 16, window=64, graph_sizes=(bs,), vocab_size=512)
    for _ in range(5):
        runner.step(next(batches))
    batch = next(batches)
    batch.columns, batch.block_tables  # noqa: B018  (the scheduler's side)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        runner.step(batch)
        torch.cuda.synchronize()
    host = Counter(e.name for e in prof.events() if e.device_type.name == "CPU")
    launches = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                "cuLaunchKernelEx", "cudaMemcpyAsync", "cuMemcpyHtoDAsync_v2")
    assert not any(host[n] for n in launches), {n: host[n] for n in launches}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    # one DMA (the model's graph has device-to-device copies of its own)
    assert copy_counts(trace)["H2D"] == 1
    work = [e for e in trace["traceEvents"]
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    calls = {e["args"].get("correlation") for e in work}
    assert None not in calls and len(calls) <= 2, calls


def test_two_batch_overlap_packed_equals_direct(device: str) -> None:
    needs_kernels(device)
    steps = 60 if device == "cuda" else 40
    lp, tp, kinds = _run(device, "packed", steps, tbo=True)
    ld, td, _ = _run(device, "direct", steps, tbo=True)
    assert kinds["tbo"] > 10, kinds
    assert tp == td
    assert all(torch.equal(a, b) for a, b in zip(lp, ld, strict=True))


@pytest.mark.gpu
def test_pipeline_slots_with_a_delayed_gpu_match_one_slot() -> None:
    """Two rotating slots, the GPU kept busy before every publication: a premature rewrite
    of a slot's sources would change the inputs and so the logits."""
    steps = 80
    l1, t1, _ = _run("cuda", "packed", steps)
    l2, t2, _ = _run("cuda", "packed", steps, num_slots=2, gpu_delay_cycles=2_000_000)
    assert t1 == t2
    assert all(torch.equal(a, b) for a, b in zip(l1, l2, strict=True))


def _steady_logits(slots: int, steps: int, delay_seed: int | None) -> list[torch.Tensor]:
    """Steady decode (deferred token ids: the host never reads a token back, so it runs
    ahead as far as its slots let it), each step's logits cloned on the GPU. With a delay
    seed, a random ``torch.cuda._sleep`` (0-2 ms) precedes every publication."""
    import random

    bs, context, page = 8, 256, 16
    cfg = RunnerConfig(max_reqs=bs, max_tokens=bs, max_pages_per_req=-(-(context + 1100) // page),
                       page_size=page, num_pages=steady_decode_num_pages(bs, context, page),
                       vocab=512, hidden=64, layers=2, heads=4, head_dim=16,
                       dtype=torch.float16, graph_sizes=(bs,), num_slots=slots, seed=2)
    runner = DecodeRunner(cfg, "cuda", "packed")
    batches = steady_decode_batches(bs, context, page, graph_sizes=(bs,))
    rng = random.Random(delay_seed)
    out = []
    for _ in range(steps):
        if delay_seed is not None:
            torch.cuda._sleep(rng.randint(0, 4_000_000))
        out.append(runner.step(next(batches)).logits.clone())
    torch.cuda.synchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [2, 3, 4])
def test_delayed_gpu_stress_never_corrupts_a_step(slots: int) -> None:
    """Pipeline slots under a randomly delayed GPU, the host running ahead: every step's
    logits equal those of one slot with no delay (a premature source rewrite would show)."""
    steps = int(os.environ.get("H2D_DELAYED_STEPS", "1000"))
    ref = _steady_logits(1, steps, None)
    got = _steady_logits(slots, steps, delay_seed=slots)
    corrupted = [i for i, (a, b) in enumerate(zip(ref, got, strict=True))
                 if not torch.equal(a, b)]
    print(f"{slots} slots, {steps} delayed steps: {len(corrupted)} corrupted")
    assert not corrupted, corrupted[:10]


def test_steps_run_without_a_default_device_mode(device: str) -> None:
    """The engine pattern: a default device set for GPU initialization (as ATOM does), the
    implicit CPU default restored when the runner is built, so no step dispatches through
    a DeviceContext."""
    from h2d_core import device_context_active

    needs_kernels(device)
    sched_cfg, run_cfg = _configs(device)
    # CPU runs use "meta": a host allocation that forgot device="cpu" has no storage there
    torch.set_default_device(device if device == "cuda" else "meta")
    try:
        runner = DecodeRunner(run_cfg, device, "packed")
        assert not device_context_active()
        seen: list[bool] = []
        begin = runner.state.begin

        def probe() -> int:
            seen.append(device_context_active())
            return begin()

        runner.state.begin = probe  # type: ignore[method-assign]
        sched, sampled = Scheduler(sched_cfg), None
        for _ in range(6):
            batch = sched.step(sampled)
            assert batch is not None
            sampled = runner.step(batch).sampled.cpu().tolist()
        assert seen and not any(seen)
    finally:
        torch.set_default_device(None)


def _steady_run(device: str, backend: str, steps: int, *, padded: bool,
                delay_seed: int | None = None) -> list[torch.Tensor]:
    import random

    bs, context, page = 6, 40, 8
    graphs = (8,) if padded else ()
    cfg = RunnerConfig(max_reqs=8, max_tokens=8, max_pages_per_req=-(-(context + 1100) // page),
                       page_size=page, num_pages=steady_decode_num_pages(bs, context, page),
                       vocab=256, hidden=32, layers=1, heads=2, head_dim=16,
                       dtype=torch.float16 if device == "cuda" else torch.float32,
                       graph_sizes=graphs if device == "cuda" else (), num_slots=2, seed=4,
                       scatter="auto" if device == "cuda" else "triton")
    runner = DecodeRunner(cfg, device, backend)
    batches = steady_decode_batches(bs, context, page, graph_sizes=graphs)
    rng = random.Random(delay_seed)
    out = []
    for _ in range(steps):
        if delay_seed is not None:
            torch.cuda._sleep(rng.randint(0, 2_000_000))
        out.append(runner.step(next(batches)).logits.clone())
    return out


@pytest.mark.parametrize("padded", [False, True])
def test_atom_style_way_equals_packed(device: str, padded: bool) -> None:
    """The main job's ATOM-style baseline publishes into the same destinations: its steps'
    logits equal the packed steps' bit for bit (padded rows included; with a randomly
    delayed GPU on CUDA, so its two source sets are reused only once their copies ran)."""
    needs_kernels(device)
    steps = 40 if device == "cpu" else 200
    delay = 7 if device == "cuda" else None
    ref = _steady_run(device, "packed", steps, padded=padded)
    got = _steady_run(device, "atom", steps, padded=padded, delay_seed=delay)
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))


def test_atom_style_way_refuses_what_it_does_not_model() -> None:
    from decode_runner.atom_style import AtomStyleError

    from h2d_runner_adapters import BatchColumns, ScheduledBatch

    cfg = RunnerConfig(max_reqs=2, max_tokens=4, max_pages_per_req=4, page_size=8,
                       num_pages=16, vocab=64, hidden=16, layers=1, heads=1, head_dim=16)
    runner = DecodeRunner(cfg, "cpu", "atom")
    assert runner.atom is not None
    cols = BatchColumns(
        query_lens=np.array([2, 1], np.int32), context_lens=np.array([5, 3], np.int32),
        temperatures=np.zeros(2, np.float32), top_k=np.full(2, -1, np.int32),
        top_p=np.ones(2, np.float32), prev_sample_rows=np.full(2, -1, np.int32),
        token_ids=np.zeros(3, np.int32), num_drafts=np.zeros(2, np.int32))
    batch = ScheduledBatch((), False, 8, given_columns=cols,
                           given_block_tables=[[1], [2]])
    before = runner.decode.positions.gpu.clone()
    runner.atom.sync_lists(batch)
    with pytest.raises(AtomStyleError, match="one token per request"):
        runner.atom.publish(batch, None)
    assert torch.equal(before, runner.decode.positions.gpu)


def test_atom_style_page_lists_follow_replaced_rows() -> None:
    """The ATOM-style way's page lists follow each row by version and length: a row
    replaced by one of the same length and last page is re-listed, an append extends."""
    from block_tables import BlockTable
    from h2d_runner_adapters import BatchColumns, ScheduledBatch

    cfg = RunnerConfig(max_reqs=2, max_tokens=2, max_pages_per_req=4, page_size=8,
                       num_pages=16, vocab=64, hidden=16, layers=1, heads=1, head_dim=16)
    runner = DecodeRunner(cfg, "cpu", "atom")
    assert runner.atom is not None
    cols = BatchColumns(
        query_lens=np.ones(1, np.int32), context_lens=np.array([20], np.int32),
        temperatures=np.zeros(1, np.float32), top_k=np.full(1, -1, np.int32),
        top_p=np.ones(1, np.float32), prev_sample_rows=np.full(1, -1, np.int32),
        token_ids=np.zeros(1, np.int32), num_drafts=np.zeros(1, np.int32))
    row = BlockTable([1, 2, 3])
    for table, want in ((row, [1, 2, 3]), (BlockTable([1, 9, 3]), [1, 9, 3])):
        runner.atom.sync_lists(ScheduledBatch((), False, 8, given_columns=cols,
                                              given_block_tables=[table]))
        assert runner.atom.lists == [want]
    grown = BlockTable([1, 9, 3])
    runner.atom.sync_lists(ScheduledBatch((), False, 8, given_columns=cols,
                                          given_block_tables=[grown]))
    grown.append_one(5)
    runner.atom.sync_lists(ScheduledBatch((), False, 8, given_columns=cols,
                                          given_block_tables=[grown]))
    assert runner.atom.lists == [[1, 9, 3, 5]]
