"""DeepSeek-V4 indexer, prefill context parallelism, sparse prefill (Opus) and TBO.

Each at its own consumer boundary: exact values after the first consumer against the
host reference written from the context document, untouched tails, the ubatches' own
buffers. CPU cases run the kernels in Triton's interpreter.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from block_tables import BlockTable
from h2d_core import H2DRunnerState
from h2d_runner_adapters import V4_BLOCK, V41_METADATA, RequestSpan, V41MetadataInputs
from h2d_runner_adapters.consumers.v4_step_indptrs import (
    PrefillIndices,
    WindowGeometry,
    generate_v4_prefill_indptrs_reference,
    write_v4_indexer_rectangle,
    write_v4_indexer_rectangle_reference,
    write_v4_prefill_indices_reference,
)
from h2d_runner_adapters.v41_metadata import V4_RATIOS

sys.path.insert(0, str(Path(__file__).parent))
import adapter_helpers as ah
from v4_helpers import (
    DUMMY_BLOCK,
    DUMMY_SLOT,
    ENVELOPE,
    MAX_BLOCKS,
    MAX_REQS,
    MAX_TOKENS,
    NUM_BLOCKS,
    POISON,
    TOPK,
    V4_POISON,
    WINDOW,
    Population,
    check_published,
    v41_reference,
    v41_state,
)


@pytest.mark.parametrize("lens, rect_reqs, full_q", [
    ([1, 4, 2], 3, 4), ([4, 4], 5, 4), ([1], 1, 1), ([], 2, 3), ([2, 1, 3, 3], 4, 3),
])
def test_indexer_rectangle_right_aligns_each_request(dev: torch.device, lens: list[int],
                                                      rect_reqs: int, full_q: int) -> None:
    """FP8 DSpark ragged indexer: each request's committed counts, right-aligned in its
    full_q rows; rows of requests past the batch map to -1."""
    rng = random.Random(sum(lens) + rect_reqs)
    committed = [rng.randint(0, 500) for _ in range(sum(lens))]
    cu = [0]
    for x in lens:
        cu.append(cu[-1] + x)
    rows = rect_reqs * full_q
    rect = torch.full((rows + 3,), POISON, dtype=torch.int32, device=dev)
    batch = torch.full((rows + 3,), POISON, dtype=torch.int32, device=dev)
    write_v4_indexer_rectangle(torch.tensor(cu, dtype=torch.int32, device=dev),
                               torch.tensor([*committed, 0], dtype=torch.int32, device=dev),
                               rect, batch, num_reqs=len(lens), rect_reqs=rect_reqs,
                               full_q=full_q)
    want_rect, want_batch = write_v4_indexer_rectangle_reference(lens, committed, rect_reqs,
                                                                 full_q)
    assert rect.cpu().tolist() == want_rect + [POISON] * 3
    assert batch.cpu().tolist() == want_batch + [POISON] * 3


def test_v4_tbo_ubatches_keep_their_own_buffers_and_resume_the_epoch(device: str) -> None:
    """Two ubatches (``ub0_``/``ub1_`` adapters): each publishes into its own buffers and
    group; the second is prepared late, after finish(), by resuming the epoch; each
    ubatch's widest query comes from its CPU lengths; uneven widths are accepted."""
    ah.need_kernels(device)
    st_ = H2DRunnerState(device, num_slots=2, scatter=ah.scatter_for(device))
    ubs = [V41MetadataInputs(st_, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS,
                             max_blocks_per_req=MAX_BLOCKS, dummy_state_slot=DUMMY_SLOT,
                             dummy_block=DUMMY_BLOCK, num_blocks=NUM_BLOCKS, window=WINDOW,
                             index_topk=TOPK, envelope_rows=ENVELOPE, prefix=f"ub{k}_")
           for k in range(2)]
    st_.bind()
    for b in st_.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(V4_POISON)
    pops = [Population(30), Population(31)]
    views = [(ub.positions.gpu, ub.step_indptrs.swa_indptr) for ub in ubs]
    for step in range(6):
        plans, wants = [], []
        for k, (ub, pop) in enumerate(zip(ubs, pops, strict=True)):
            spans, rows = pop.step(1 + step % 3 + k, True, 1 + (step + k) % 4)
            if k == 0:
                st_.begin()
            else:
                st_.resume()  # late preparation of the second ubatch
            before = {n: b.gpu.cpu().numpy().tobytes() for n, b in st_.buffers().items()}
            plan = ub.begin_step(spans, block_tables=rows, padded=MAX_REQS // 2)
            st_.publish(ub.group)
            ub.generate_step_indptrs(plan)
            st_.finish()
            assert plan.max_query_len == max(s.num_tokens for s in spans)
            want = v41_reference(spans, [list(r) for r in rows], MAX_REQS // 2)
            plans.append(plan)
            wants.append((want, before))
        ah.sync(device)
        for k, (ub, (want, before)) in enumerate(zip(ubs, wants, strict=True)):
            prefixed = {f"ub{k}_{name}": v for name, v in want.items()}
            check_published(st_, prefixed, before)
            # the other ubatch's buffers were not touched by this one's publication
            other = ubs[1 - k]
            assert other.positions.gpu.data_ptr() != ub.positions.gpu.data_ptr()
        assert [(a.data_ptr(), b.data_ptr()) for a, b in views] == [
            (ub.positions.gpu.data_ptr(), ub.step_indptrs.swa_indptr.data_ptr()) for ub in ubs]


def test_v4_prefill_through_the_bound_buffers(device: str) -> None:
    """V4 prefill: chunks of any width, no padding, eager plans (real compression rows,
    the whole state-write array), chunk starts, then the prefill indptrs and the indexer's
    committed prefix on the GPU; decode steps in between omit the chunk starts."""
    ah.need_kernels(device)
    st_, v4 = v41_state(device)
    rng = random.Random(12)
    for step in range(6):
        n = rng.randint(1, 4)
        spans, rows = [], []
        for i in range(n):
            start = rng.randint(0, 2 * V4_BLOCK)
            width = rng.randint(1, 10)
            ctx = start + width
            rows.append(BlockTable(range(10 * i, 10 * i + -(-ctx // V4_BLOCK))))
            spans.append(RequestSpan(width, ctx, i, -1))
        st_.begin()
        if step % 2:  # a decode step in between: chunk starts are not published
            dec = [RequestSpan(1, s.context_len, s.state_slot) for s in spans]
            v4.begin_step(dec, block_tables=rows)
            assert st_.count(v4.chunk_starts) is None
            st_.publish(V41_METADATA)
            st_.finish()
            continue
        plan = v4.begin_prefill(spans, block_tables=rows)
        before = {name: b.gpu.cpu().numpy().tobytes() for name, b in st_.buffers().items()}
        st_.publish(V41_METADATA)
        out = v4.generate_prefill_indptrs(plan)
        st_.finish()
        ah.sync(device)
        t = sum(s.num_tokens for s in spans)
        assert (plan.num_tokens, plan.padded_tokens, plan.padded_reqs) == (t, t, n)
        want = v41_reference(spans, [list(r) for r in rows], n)
        del want["v41_qo_indptr"]  # decode only
        for name in ("v41_positions", "v41_token_batch_ids"):  # no padding in prefill
            want[name] = want[name][:t]
        want["v41_chunk_starts"] = [s.context_len - s.num_tokens for s in spans]
        for r, k in V4_RATIOS:  # the eager plans
            comp = [row for row in want[f"v41_compress_plan_{r}"] if row[0] >= 0]
            want[f"v41_compress_plan_{r}"] = comp
            real = [row for row in want[f"v41_write_plan_{r}"] if row[0] >= 0]
            cap = v4.write_plans[V4_RATIOS.index((r, k))].spec.capacity
            want[f"v41_write_plan_{r}"] = real + [[-1] * 4] * (cap - len(real))
        check_published(st_, want, before)
        ref = generate_v4_prefill_indptrs_reference(
            want["v41_positions"], want["v41_token_batch_ids"],
            [s.context_len for s in spans], want["v41_chunk_starts"], window=WINDOW,
            index_topk=TOPK)
        for name, expected in ref.items():
            got = getattr(out, name).cpu().tolist()
            assert got[: len(expected)] == expected, name
        # the sparse (Opus) prefill indices, from the indptrs just derived
        geometry = WindowGeometry(slot_rows=100, ring_positions=WINDOW + 3,
                                  classes=((0, WINDOW + 3, 1), (40, 4, 8), (70, 2, 6)))
        cu_q = [0]
        for sp in spans:
            cu_q.append(cu_q[-1] + sp.num_tokens)
        sizes = {name: ref[f"{key}_indptr"][-1] for name, key in (
            ("extend", "extend"), ("prefix_swa", "prefix_swa"), ("prefix_csa", "prefix_csa"),
            ("prefix_hca", "prefix_hca"))}
        outs = PrefillIndices(*(torch.full((sizes[f] + 4,), POISON, dtype=torch.int32,
                                           device=device) for f in PrefillIndices._fields))
        v4.write_prefill_indices(plan, torch.tensor(cu_q, dtype=torch.int32, device=device),
                                 geometry, outs)
        want_idx = write_v4_prefill_indices_reference(
            want["v41_positions"], want["v41_token_batch_ids"],
            [sp.context_len for sp in spans], want["v41_chunk_starts"],
            [sp.state_slot for sp in spans], cu_q, [list(r) for r in rows], geometry,
            window=WINDOW, index_topk=TOPK, envelope_rows=ENVELOPE)
        for name, expected in want_idx.items():
            got = getattr(outs, name).cpu().tolist()
            assert got == expected + [POISON] * 4, name
        # context parallelism: each rank's strided queries of the same publication
        for size in (2, 3):
            for rank in range(size):
                out = v4.generate_prefill_indptrs(plan, pcp_rank=rank, pcp_size=size)
                ref = generate_v4_prefill_indptrs_reference(
                    want["v41_positions"][rank::size], want["v41_token_batch_ids"][rank::size],
                    [s.context_len for s in spans], want["v41_chunk_starts"], window=WINDOW,
                    index_topk=TOPK)
                for name, expected in ref.items():
                    got = getattr(out, name).cpu().tolist()
                    assert got[: len(expected)] == expected, (size, rank, name)
