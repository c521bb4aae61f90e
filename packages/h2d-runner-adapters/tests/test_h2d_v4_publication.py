"""DeepSeek-V4/V4.1 decode metadata: the first consumer, step indptr generation.

Exact values against the plain-Python oracle written from the context document (per-token
SWA/CSA/HCA lengths, committed counts, padded rows), untouched tails, changing batch
sizes and padding. CPU cases run the kernel in Triton's interpreter.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import adapter_helpers as ah
import numpy as np
import pytest
import torch
from v4_helpers import (
    DUMMY_BLOCK,
    DUMMY_SLOT,
    ENVELOPE,
    GEOMETRY,
    MAX_BLOCKS,
    MAX_REQS,
    MAX_TOKENS,
    NUM_BLOCKS,
    POISON,
    TOPK,
    WINDOW,
    Population,
    check_published,
    v41_reference,
    v41_state,
)

from block_tables import BlockTable, MissingPagesError, ReservedPageError
from h2d_core import CountError, H2DRunnerState
from h2d_kernels import copy_counts, is_copy
from h2d_runner_adapters import (
    SAMPLING,
    TOKEN_INPUTS,
    V4_BLOCK,
    V41_METADATA,
    BatchColumns,
    RequestSpan,
    SamplingInputs,
    ScheduledBatch,
    SpanColumns,
    TokenInputs,
    TokenStepInputs,
    V41MetadataInputs,
)
from h2d_runner_adapters.consumers import ConsumerArgumentError
from h2d_runner_adapters.v4.step_indptrs import (
    DecodeWindowIndices,
    StepIndptrs,
    expand_v4_token_tables_reference,
    generate_v4_step_indptrs,
    generate_v4_step_indptrs_reference,
    write_v4_decode_window_indices_reference,
)


def outputs(dev: torch.device, tokens: int, reqs: int, extra: int = 5) -> StepIndptrs:
    def buf(k: int) -> torch.Tensor:
        return torch.full((k + extra,), POISON, dtype=torch.int32, device=dev)
    return StepIndptrs(buf(tokens + 1), buf(tokens + 1), buf(tokens + 1), buf(tokens),
                       buf(reqs))


def decode_batch(rng: random.Random, n: int, padded: int, q: int, ragged: bool
                 ) -> tuple[list[int], list[int], list[int]]:
    """Positions, batch ids (the graph grid: padded * q tokens, -1 for padding) and the
    committed context lengths of a DSpark-style decode step."""
    seq_lens, positions, bids = [], [], []
    for i in range(n):
        width = rng.randint(1, q) if ragged else q
        ctx = rng.randint(width, 300_000)
        seq_lens.append(ctx)
        for j in range(width):
            positions.append(ctx - width + j)
            bids.append(i)
    pad = padded * q - len(positions)
    return positions + [0] * pad, bids + [-1] * pad, seq_lens


def run(dev: torch.device, positions: list[int], bids: list[int], seq_lens: list[int],
        n: int, p: int) -> None:
    t = len(positions)
    out = outputs(dev, t, p)
    generate_v4_step_indptrs(
        torch.tensor(positions, dtype=torch.int64, device=dev),
        torch.tensor(bids, dtype=torch.int32, device=dev),
        torch.tensor([*seq_lens, 0], dtype=torch.int32, device=dev),
        out, num_tokens=t, num_reqs=n, padded_reqs=p, window=WINDOW, index_topk=TOPK)
    want = generate_v4_step_indptrs_reference(positions, bids, seq_lens, num_reqs=n,
                                              padded_reqs=p, window=WINDOW, index_topk=TOPK)
    for name, expected in want.items():
        got = getattr(out, name).cpu().tolist()
        assert got[: len(expected)] == expected, name
        assert got[len(expected):] == [POISON] * 5, f"{name}: the tail was written"


@pytest.mark.parametrize("n, padded, q, ragged", [
    (1, 1, 1, False), (3, 4, 1, False), (5, 8, 2, False), (7, 8, 4, True), (0, 2, 2, False),
])
def test_step_indptrs_match_the_reference(dev: torch.device, n: int, padded: int, q: int,
                                          ragged: bool) -> None:
    positions, bids, seq_lens = decode_batch(random.Random(n * 31 + q), n, padded, q, ragged)
    run(dev, positions, bids, seq_lens, n, padded)


def test_step_indptrs_across_changing_sizes(dev: torch.device) -> None:
    """Batch sizes that change between steps, across size buckets and back."""
    rng = random.Random(7)
    for n, q in ((259, 2), (3, 1), (513, 1), (40, 3)):
        positions, bids, seq_lens = decode_batch(rng, n, n + 2, q, ragged=q > 1)
        run(dev, positions, bids, seq_lens, n, n + 2)


def test_short_contexts_and_the_window(dev: torch.device) -> None:
    """Contexts shorter than the window, one CSA block or one HCA block: the caps apply."""
    seq_lens = [1, 4, 5, 127, 128, 129, 100_000]
    positions = [c - 1 for c in seq_lens]
    bids = list(range(len(seq_lens)))
    run(dev, positions, bids, seq_lens, len(seq_lens), len(seq_lens) + 1)


def test_bad_arguments_are_refused(dev: torch.device) -> None:
    out = outputs(dev, 4, 2, extra=0)
    pos = torch.zeros(5, dtype=torch.int64, device=dev)
    bids = torch.zeros(5, dtype=torch.int32, device=dev)
    lens = torch.ones(2, dtype=torch.int32, device=dev)

    def call(**kw: object) -> None:
        args = {"num_tokens": 4, "num_reqs": 2, "padded_reqs": 2, "window": WINDOW,
                "index_topk": TOPK} | kw
        generate_v4_step_indptrs(pos, bids, lens, out, **args)  # type: ignore[arg-type]

    with pytest.raises(ConsumerArgumentError, match=r"padded_reqs=1 is below num_reqs=2"):
        call(padded_reqs=1)
    with pytest.raises(ConsumerArgumentError, match=r"num_tokens must be a Python int"):
        call(num_tokens=torch.tensor(4))
    with pytest.raises(ConsumerArgumentError, match=r"swa_indptr has 5 elements, needs at "
                                                    r"least 6"):
        call(num_tokens=5)
    with pytest.raises(ConsumerArgumentError, match=r"window must be >= 1"):
        call(window=0)
    with pytest.raises(ConsumerArgumentError, match=r"positions must have dtype torch.int64"):
        generate_v4_step_indptrs(bids, bids, lens, out, num_tokens=4, num_reqs=2,
                                 padded_reqs=2, window=WINDOW, index_topk=TOPK)


# ------------------------------------------------------------- the v41_metadata group
@pytest.mark.parametrize(("backend", "fuse"), [("packed", False), ("direct", False),
                                               ("packed", True), ("direct", True)])
def test_v41_metadata_exact_values_over_steps(device: str, backend: str, fuse: bool) -> None:
    """Every member and the first consumer's outputs against the context document's
    formulas; with ``fuse`` the consumer runs inside the packed publication (counts read on
    the device), and on the direct backend, where nothing can fuse, it is launched."""
    ah.need_kernels(device)
    st_, v4 = v41_state(device, backend, fuse=fuse)
    if fuse:
        assert v4.step_indptrs_consumer is not None
        assert v4.step_indptrs_consumer.fused is (backend == "packed")
    pop = Population(3)
    schedule = [(3, False, 1, None), (3, False, 1, 4), (5, True, 4, 8), (2, True, 3, 2),
                (6, False, 2, None), (1, False, 1, 8), (0, False, 1, 2), (4, True, 4, 4)]
    for n, ragged, q, padded in schedule:
        spans, rows = pop.step(n, ragged, q)
        p = n if padded is None else padded
        st_.begin()
        plan = v4.begin_step(spans, block_tables=rows, padded=padded)
        before = {name: b.gpu.cpu().numpy().tobytes() for name, b in st_.buffers().items()}
        st_.publish(V41_METADATA)
        indptrs = v4.generate_step_indptrs(plan)
        st_.finish()
        ah.sync(device)
        want = v41_reference(spans, [list(r) for r in rows], p)
        check_published(st_, want, before)
        # the first consumer, from the published rows
        ref = generate_v4_step_indptrs_reference(
            want["v41_positions"], want["v41_token_batch_ids"],
            [s.context_len for s in spans], num_reqs=n, padded_reqs=p, window=WINDOW,
            index_topk=TOPK)
        for name, expected in ref.items():
            assert getattr(indptrs, name).cpu().tolist()[: len(expected)] == expected, name
        # ... and the per-token expansion: tables and the HCA index head
        rows_want, cells_want = expand_v4_token_tables_reference(
            want["v41_positions"], want["v41_token_batch_ids"], [s.context_len for s in spans],
            [list(r) for r in rows], ref["hca_indptr"], MAX_BLOCKS, ENVELOPE)
        assert v4.block_tables_per_token is not None and v4.hca_indices is not None
        assert v4.block_tables_per_token[: len(rows_want)].cpu().tolist() == rows_want
        assert v4.hca_indices[: len(cells_want)].cpu().tolist() == cells_want
        # ... and the window tails and own rows (the HCA slices are then complete)
        t_pad = plan.padded_tokens
        win = DecodeWindowIndices(
            torch.full((ref["swa_indptr"][-1] + 3,), POISON, dtype=torch.int32, device=device),
            torch.full((ref["csa_indptr"][-1] + 3,), POISON, dtype=torch.int32, device=device),
            v4.hca_indices,
            *(torch.full((t_pad + 3,), POISON, dtype=torch.int32, device=device)
              for _ in range(3)))
        v4.write_decode_window_indices(plan, GEOMETRY, win)
        cells = write_v4_decode_window_indices_reference(
            want["v41_positions"], want["v41_token_batch_ids"], want["v41_state_slot_out"],
            want["v41_state_slot_in"], ref, GEOMETRY, window=WINDOW)
        for name, written in cells.items():
            got = getattr(win, name).cpu().tolist()
            for index, value in written.items():
                assert got[index] == value, (name, index)
            if name != "hca_indices":  # everything else kept its poison
                assert all(v == POISON for k, v in enumerate(got) if k not in written), name
        hca_final = win.hca_indices[: ref["hca_indptr"][-1]].cpu().tolist()
        assert -1 not in hca_final  # compressed head + window tail: nothing left unset
        c = st_.counters(V41_METADATA)
        if backend == "packed":
            assert (c.dmas, c.scatters) == (c.publications, c.publications)


def test_v41_packed_and_direct_publish_the_same_bytes(device: str) -> None:
    ah.need_kernels(device)
    sides = [v41_state(device, b, num_slots=2) for b in ("packed", "direct")]
    pops = [Population(11), Population(11)]
    for step in range(12):
        n = 1 + step % MAX_REQS
        padded = MAX_REQS if step % 3 == 0 else None
        for (st_, v4), pop in zip(sides, pops, strict=True):
            spans, rows = pop.step(n, step % 2 == 1, 1 + step % 4)
            st_.begin()
            v4.begin_step(SpanColumns.from_spans(spans), block_tables=rows, padded=padded)
            st_.publish(V41_METADATA)
            st_.finish()
        ah.sync(device)
        a, b = (s[0].buffers() for s in sides)
        for name in a:
            assert a[name].gpu.cpu().numpy().tobytes() == b[name].gpu.cpu().numpy().tobytes(), (
                step, name)


def test_v41_with_token_inputs_is_two_dmas_and_two_scatters(device: str) -> None:
    ah.need_kernels(device)
    st_ = H2DRunnerState(device, backend="packed", scatter=ah.scatter_for(device))
    sampling = SamplingInputs(st_, MAX_REQS)
    # DSpark verify: the speculative verification indices ride in the token inputs
    tokens = TokenInputs(st_, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS, max_drafts=3)
    st_.combine(TOKEN_INPUTS, [SAMPLING, *tokens.producer_groups])
    v4 = V41MetadataInputs(st_, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS,
                           max_blocks_per_req=MAX_BLOCKS, dummy_state_slot=DUMMY_SLOT,
                           dummy_block=DUMMY_BLOCK, num_blocks=NUM_BLOCKS, fp8=True)
    st_.bind()
    pop = Population(5)
    steps = 6
    for _ in range(steps):
        spans, rows = pop.step(4, True, 4)
        q = max(s.num_tokens for s in spans)
        cols = BatchColumns(
            query_lens=np.array([s.num_tokens for s in spans], np.int32),
            context_lens=np.array([s.context_len for s in spans], np.int32),
            temperatures=np.ones(4, np.float32), top_k=np.full(4, -1, np.int32),
            top_p=np.ones(4, np.float32), prev_sample_rows=np.full(4, -1, np.int32),
            token_ids=np.arange(sum(s.num_tokens for s in spans), dtype=np.int32),
            num_drafts=np.array([s.num_tokens - 1 for s in spans], np.int32))
        batch = ScheduledBatch((), False, V4_BLOCK, padded_size=MAX_REQS, given_columns=cols)
        st_.begin()
        sampling.prepare(batch)
        tokens.prepare_ids(batch, MAX_REQS)
        tokens.prepare_query_prefix(batch, MAX_REQS)
        tokens.prepare_spec_indices(batch)
        v4.begin_step(spans, block_tables=rows, padded=MAX_REQS)
        st_.publish(TOKEN_INPUTS)
        st_.publish(V41_METADATA)
        st_.finish()
        assert q <= 4  # DSpark widths up to full_q = 4
    ah.sync(device)
    for group in (TOKEN_INPUTS, V41_METADATA):
        c = st_.counters(group)
        assert (c.publications, c.dmas, c.scatters, c.direct_copies) == (steps, steps, steps, 0)


@pytest.mark.parametrize("case", ["short_row", "short_context", "padded_below", "rows_count",
                                  "too_many_tokens", "bad_dtype"])
def test_v41_rejected_step_changes_nothing(device: str, case: str) -> None:
    ah.need_kernels(device)
    st_, v4 = v41_state(device)
    pop = Population(8)
    spans, rows = pop.step(3, False, 2)
    st_.begin()
    v4.begin_step(spans, block_tables=rows, padded=4)
    st_.publish(V41_METADATA)
    st_.finish()
    ah.sync(device)
    spans, rows = pop.step(3, False, 2)
    cols = SpanColumns.from_spans(spans)
    padded: int | None = None
    err: type[Exception] = CountError
    if case == "short_row":
        rows = [*rows[:2], BlockTable([1])]
        spans[2] = RequestSpan(1, 3 * V4_BLOCK, 2)
        cols = SpanColumns.from_spans(spans)
        err = MissingPagesError
    elif case == "short_context":
        cols = dataclasses.replace(cols, context_lens=np.array([1, 1, 1], np.int32))
    elif case == "padded_below":
        padded = 2
    elif case == "rows_count":
        rows = rows[:2]
    elif case == "too_many_tokens":
        cols = dataclasses.replace(cols, query_lens=np.full(3, MAX_TOKENS, np.int32),
                                   context_lens=np.full(3, MAX_TOKENS, np.int32))
    else:
        cols = dataclasses.replace(cols, state_slots_in=cols.state_slots_in.astype(np.int64))
    sources = {n: b.np.tobytes() for n, b in st_.buffers().items()}
    revision = v4.tables.prepared_revision
    st_.begin()
    with pytest.raises(err):
        v4.begin_step(cols, block_tables=rows, padded=padded)
    assert {n: b.np.tobytes() for n, b in st_.buffers().items()} == sources
    assert v4.tables.prepared_revision == revision
    st_.publish(V41_METADATA)  # nothing counted: an empty publication
    st_.finish()
    assert st_.counters(V41_METADATA).publications == 2


@pytest.mark.parametrize("padded", [None, MAX_REQS])
def test_token_step_equals_the_separate_token_producers(device: str, padded: int | None
                                                        ) -> None:
    """TokenStepInputs (one producer, one layout pass) writes and counts exactly what
    SamplingInputs + TokenInputs write, ragged widths included."""
    ah.need_kernels(device)
    fused_state = H2DRunnerState(device, scatter=ah.scatter_for(device))
    fused = TokenStepInputs(fused_state, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS)
    fused_state.bind()
    sep_state = H2DRunnerState(device, scatter=ah.scatter_for(device))
    sampling = SamplingInputs(sep_state, MAX_REQS)
    tokens = TokenInputs(sep_state, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS)
    sep_state.combine(TOKEN_INPUTS, [SAMPLING, *tokens.producer_groups])
    sep_state.bind()
    rng = np.random.default_rng(4)
    for step in range(10):
        n = int(rng.integers(0, 6))
        q = rng.integers(1, 5, n).astype(np.int32)
        same = step % 2 == 0
        cols = BatchColumns(
            query_lens=q, context_lens=q + rng.integers(0, 900, n).astype(np.int32),
            temperatures=rng.choice([0.0, 0.7, 1.0], n).astype(np.float32),
            top_k=np.full(n, 5, np.int32) if same else rng.integers(-1, 9, n).astype(np.int32),
            top_p=np.full(n, 0.9, np.float32) if same else rng.random(n).astype(np.float32),
            prev_sample_rows=rng.integers(-1, 4, n).astype(np.int32),
            token_ids=rng.integers(0, 1000, int(q.sum())).astype(np.int32),
            num_drafts=(q - 1).astype(np.int32))
        batch = ScheduledBatch((), False, V4_BLOCK, given_columns=cols)
        fused_state.begin()
        plan = fused.prepare(batch, padded)
        fused_state.publish(TOKEN_INPUTS)
        fused_state.finish()
        sep_state.begin()
        sp = sampling.prepare(batch)
        tp = tokens.prepare_ids(batch, padded)
        tokens.prepare_query_prefix(batch, padded)
        sep_state.publish(TOKEN_INPUTS)
        sep_state.finish()
        assert (plan.sampling, plan.tokens) == (sp, tp), step
        a, b = fused_state.buffers(), sep_state.buffers()
        assert a.keys() == b.keys()
        for name in a:
            assert fused_state.count(a[name]) == sep_state.count(b[name]), (step, name)
            assert a[name].np.tobytes() == b[name].np.tobytes(), (step, name)
    ah.sync(device)
    for name in a:
        assert a[name].gpu.cpu().numpy().tobytes() == b[name].gpu.cpu().numpy().tobytes(), name


def test_v41_decode_is_two_h2d_copies_and_two_kernels_in_a_profiler_trace(device: str) -> None:
    """Spec: an ordinary V4.1 decode step is two H2Ds and two scatters (token inputs, V4.1
    metadata), graph padding included; counted from a torch.profiler trace."""
    if device != "cuda":
        pytest.skip("a CUDA profiler trace")
    from torch.profiler import ProfilerActivity, profile

    st_ = H2DRunnerState("cuda", num_slots=2)
    tok = TokenStepInputs(st_, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS, max_drafts=3)
    v4 = V41MetadataInputs(st_, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS,
                           max_blocks_per_req=MAX_BLOCKS, dummy_state_slot=DUMMY_SLOT,
                           dummy_block=DUMMY_BLOCK, num_blocks=NUM_BLOCKS, fp8=True)
    st_.bind()
    pop = Population(21)

    def step() -> None:
        spans, rows = pop.step(5, True, 4)
        q = np.array([s.num_tokens for s in spans], np.int32)
        cols = BatchColumns(
            query_lens=q, context_lens=np.array([s.context_len for s in spans], np.int32),
            temperatures=np.ones(5, np.float32), top_k=np.full(5, -1, np.int32),
            top_p=np.ones(5, np.float32), prev_sample_rows=np.full(5, -1, np.int32),
            token_ids=np.zeros(int(q.sum()), np.int32), num_drafts=q - 1)
        st_.begin()
        batch = ScheduledBatch((), False, V4_BLOCK, given_columns=cols)
        tok.prepare(batch, MAX_REQS)
        tok.tokens.prepare_spec_indices(batch)  # the DSpark verify trio, same group
        v4.begin_step(spans, block_tables=rows, padded=MAX_REQS)
        st_.publish(TOKEN_INPUTS)
        st_.publish(V41_METADATA)
        st_.finish()

    for _ in range(4):  # warm up: compilation, graph capture, both slots
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()
             if e.device_type.name == "CUDA" and not e.name.startswith("h2d.")]
    # copies by the runtime's kind (ROCm's HIP kind=1 even where the name says DtoD)
    assert copy_counts(prof) == Counter({"H2D": 2}), names
    kernels = [n for n in names if not is_copy(n) and "Memset" not in n]
    # two scatters; the step indptrs, fused by default, run inside the second's graph
    assert [n for n in kernels if "scatter" in n] == ["_scatter_kernel"] * 2, names
    fused = v4.step_indptrs_consumer is not None and v4.step_indptrs_consumer.fused
    assert fused and sorted(kernels) == sorted(["_scatter_kernel"] * 2
                                                + ["_step_indptrs_kernel"]), names


@pytest.mark.parametrize(("backend", "fuse"), [("packed", False), ("direct", False),
                                               ("packed", True)])
def test_v41_delayed_source_reuse_keeps_what_each_step_published(device: str, backend: str,
                                                                  fuse: bool) -> None:
    """Two slots; each publication queues behind a busy GPU while the host runs ahead and
    rewrites the sources: a GPU-side copy taken right after each publication (and the
    first consumer's outputs, fused into the publication or launched) still hold what that
    step published."""
    if device != "cuda":
        pytest.skip("delayed source reuse needs asynchronous copies (CUDA)")
    st_, v4 = v41_state(device, backend, num_slots=2, fuse=fuse)
    pop = Population(40)
    taken = []
    for index in range(8):
        spans, rows = pop.step(1 + index % MAX_REQS, index % 2 == 1, 1 + index % 4)
        slot = st_.begin()
        assert slot == index % 2
        plan = v4.begin_step(spans, block_tables=rows, padded=MAX_REQS)
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU work the DMA queues behind
        st_.publish(V41_METADATA)
        ind = v4.generate_step_indptrs(plan)
        copies = {name: b.gpu.clone() for name, b in st_.buffers().items()}
        taken.append((spans, [list(r) for r in rows], copies, ind.hca_indptr.clone()))
        st_.finish()
    torch.cuda.synchronize()
    for index, (spans, rows, copies, hca) in enumerate(taken):
        want = v41_reference(spans, rows, MAX_REQS)
        for name, values in want.items():
            if name not in copies:  # v41_step_counts: declared only when fused
                continue
            got = copies[name].cpu()
            if name.endswith("v41_block_tables"):
                for i, row in enumerate(values):
                    assert got[i, : len(row)].tolist() == row, (index, name, i)
            else:
                assert got[: len(values)].tolist() == values, (index, name)
        ref = generate_v4_step_indptrs_reference(
            want["v41_positions"], want["v41_token_batch_ids"],
            [s.context_len for s in spans], num_reqs=len(spans), padded_reqs=MAX_REQS,
            window=WINDOW, index_topk=TOPK)
        assert hca[: len(ref["hca_indptr"])].tolist() == ref["hca_indptr"], index


# ------------------------------------------------------------------ dummy isolation
def _dummy_rows(slot: int) -> range:
    """The KV rows of one physical state slot (every window class)."""
    return range(slot * GEOMETRY.slot_rows, (slot + 1) * GEOMETRY.slot_rows)


def test_v41_padded_rows_use_only_the_private_dummy_slot_and_block(device: str) -> None:
    """Padded requests point only at the private dummy state slot and dummy block (and own
    no tokens, no plan rows, no visible context); real requests never reach either, in the
    published destinations nor in what the first consumers derive from them. Batch sizes
    change so that rows move between real and padded."""
    ah.need_kernels(device)
    st_, v4 = v41_state(device)
    pop = Population(17)
    assert v4.block_tables_per_token is not None and v4.hca_indices is not None
    dummy_rows = _dummy_rows(DUMMY_SLOT)
    dummy_cells = {DUMMY_BLOCK * ENVELOPE + k for k in range(2)}
    for n, q, padded in [(2, 1, 8), (5, 3, 8), (1, 2, 4), (0, 1, 2), (6, 4, 8), (3, 1, 4)]:
        spans, rows = pop.step(n, True, q)
        st_.begin()
        plan = v4.begin_step(spans, block_tables=rows, padded=padded)
        st_.publish(V41_METADATA)
        ind = v4.generate_step_indptrs(plan)
        pt = plan.padded_tokens
        win = DecodeWindowIndices(*(torch.full((k,), POISON, dtype=torch.int32, device=device)
                                    for k in (4096, 4096, 4096, pt, pt, pt)))
        v4.write_decode_window_indices(plan, GEOMETRY, win)
        st_.finish()
        ah.sync(device)
        t = plan.num_tokens
        slots_out = v4.state_slot_out.gpu[:padded].tolist()
        slots_in = v4.state_slot_in.gpu[:padded].tolist()
        assert slots_out[n:] == slots_in[n:] == [DUMMY_SLOT] * (padded - n)
        assert DUMMY_SLOT not in slots_out[:n] + slots_in[:n]
        assert v4.seq_lens.gpu[n:padded].tolist() == [0] * (padded - n)  # nothing visible
        table = v4.block_tables.gpu[:padded].cpu().tolist()
        assert table[n:] == [[DUMMY_BLOCK] + [0] * (MAX_BLOCKS - 1)] * (padded - n)
        for i, row in enumerate(rows):
            assert table[i][: len(row)] == list(row) and DUMMY_BLOCK not in table[i], i
        bids = v4.token_batch_ids.gpu[:pt].tolist()
        assert bids[t:] == [-1] * (pt - t) and all(0 <= b < n for b in bids[:t])
        for plans in (v4.compress_plans, v4.write_plans):
            for b in plans:
                for r in b.gpu[: st_.count(b) or 0].tolist():  # real rows, then -1 rows
                    assert r == [-1] * 4 or 0 <= r[1] < n, (b.name, r)
        # the first consumers: padded tokens own no cells and write no KV row
        per_token = v4.block_tables_per_token[:pt].cpu().tolist()
        assert per_token[t:] == [[0] * MAX_BLOCKS] * (pt - t)
        assert all(DUMMY_BLOCK not in r for r in per_token[:t])
        hca = ind.hca_indptr[: pt + 1].tolist()
        assert hca[t:] == [hca[t]] * (pt + 1 - t)
        assert not dummy_cells & set(v4.hca_indices[: hca[t]].tolist())
        for dest in (win.dest_dense, win.dest_csa, win.dest_hca):
            got = dest.tolist()
            assert got[t:] == [POISON] * (pt - t)
            assert not any(r in dummy_rows for r in got[:t])
        for cells, end in ((win.swa_indices, ind.swa_indptr[t]),
                           (win.csa_indices, ind.csa_indptr[t])):
            assert not any(r in dummy_rows for r in cells[: int(end)].tolist())


@pytest.mark.parametrize("case", ["state_slot", "fork_source", "block", "appended_block"])
def test_v41_real_requests_cannot_reach_the_dummy_storage(device: str, case: str) -> None:
    """The dummy slot and block stay private: a real request naming either (as its state
    slot, its fork source, in its row, or appended to a row accepted the step before) is
    refused before any write, and a valid retry in the same epoch then publishes."""
    from bad_inputs import Observed, refuse

    ah.need_kernels(device)
    st_, v4 = v41_state(device)
    spans, rows = Population(19).step(3, False, 1)
    if case == "appended_block":  # the row's lineage was accepted once already
        st_.begin()
        v4.begin_step(spans, block_tables=rows, padded=4)
        st_.publish(V41_METADATA)
        st_.finish()
        rows[1].append_one(DUMMY_BLOCK)
    elif case == "state_slot":
        spans[1] = RequestSpan(1, spans[1].context_len, DUMMY_SLOT)
    elif case == "fork_source":
        spans[1] = RequestSpan(1, spans[1].context_len, spans[1].state_slot, DUMMY_SLOT)
    elif case == "block":
        rows[1] = BlockTable([*list(rows[1])[:-1], DUMMY_BLOCK])
    st_.begin()
    seen = Observed(st_, extra=lambda: v4.tables.prepared_revision)
    if case in ("block", "appended_block"):  # the table's reserved page
        refuse(seen, lambda: v4.begin_step(spans, block_tables=rows, padded=4),
               ReservedPageError, rf"row 1: page ID {DUMMY_BLOCK} .* reserved page")
    else:
        refuse(seen, lambda: v4.begin_step(spans, block_tables=rows, padded=4), CountError,
               r"request 1 .*dummy")
    good_spans, good_rows = Population(19).step(3, False, 1)
    plan = v4.begin_step(good_spans, block_tables=good_rows, padded=4)
    st_.publish(V41_METADATA)
    st_.finish()
    ah.sync(device)
    want = v41_reference(good_spans, [list(r) for r in good_rows], plan.padded_reqs)
    assert v4.state_slot_out.gpu[:4].tolist() == want["v41_state_slot_out"]
