"""DeepSeek-V4 indexer, prefill context parallelism, sparse prefill (Opus) and TBO.

Each at its own consumer boundary: exact values after the first consumer against the
host reference written from the context document, untouched tails, the ubatches' own
buffers. CPU cases run the kernels in Triton's interpreter.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import adapter_helpers as ah
import pytest
import torch
from publication_checks import check_tails, dest_copies, published_counts
from torch.overrides import TorchFunctionMode
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
    V4_POISON,
    WINDOW,
    Population,
    check_published,
    token_batch,
    v41_reference,
)

from block_tables import BlockTable
from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    TOKEN_INPUTS,
    V4_BLOCK,
    V41_METADATA,
    RequestSpan,
    TokenInputs,
    V41MetadataInputs,
    V41Plan,
)
from h2d_runner_adapters.v4.metadata import V4_RATIOS
from h2d_runner_adapters.v4.step_indptrs import (
    DecodeWindowIndices,
    PrefillIndices,
    PrefillIndptrs,
    WindowGeometry,
    expand_v4_token_tables_reference,
    generate_v4_prefill_indptrs_reference,
    generate_v4_step_indptrs_reference,
    write_v4_decode_window_indices_reference,
    write_v4_indexer_rectangle,
    write_v4_indexer_rectangle_reference,
    write_v4_prefill_indices_reference,
)


def v41_token_state(device: str, num_slots: int = 1
                    ) -> tuple[H2DRunnerState, TokenInputs, V41MetadataInputs]:
    """The V4.1 adapter of ``v41_state`` plus the token inputs (one ``token_inputs``
    group): the indexer's query prefix comes from their publication."""
    st_ = H2DRunnerState(device, num_slots=num_slots, scatter=ah.scatter_for(device))
    tokens = TokenInputs(st_, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS)
    st_.combine(TOKEN_INPUTS, list(tokens.producer_groups))
    v4 = V41MetadataInputs(st_, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS,
                           max_blocks_per_req=MAX_BLOCKS, dummy_state_slot=DUMMY_SLOT,
                           dummy_block=DUMMY_BLOCK, num_blocks=NUM_BLOCKS, window=WINDOW,
                           index_topk=TOPK, fp8=True, envelope_rows=ENVELOPE, max_ranges=4)
    st_.bind()
    for b in st_.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(V4_POISON)
    return st_, tokens, v4


def spans_of_widths(rng: random.Random, widths: list[int]
                    ) -> tuple[list[RequestSpan], list[BlockTable]]:
    """One request per width, a random context and its own blocks (never the dummy)."""
    spans, rows = [], []
    for i, w in enumerate(widths):
        ctx = rng.randint(w, MAX_BLOCKS * V4_BLOCK)
        rows.append(BlockTable(range(10 * i, 10 * i + -(-ctx // V4_BLOCK))))
        spans.append(RequestSpan(w, ctx, i))
    return spans, rows


@pytest.mark.parametrize("lens, rect_reqs, full_q", [
    ([1, 4, 2], 3, 4), ([4, 4], 5, 4), ([1], 1, 1), ([], 2, 3), ([2, 1, 3, 3], 4, 3),
])
def test_indexer_rectangle_right_aligns_each_request(dev: torch.device, lens: list[int],
                                                      rect_reqs: int, full_q: int) -> None:
    """FP8 DSpark ragged indexer: each request's committed counts, right-aligned in its
    full_q rows; rows of requests past the batch map to -1. Fed from the step's own
    publications: the token inputs' query prefix and the committed counts that step indptr
    generation derived from the published V4.1 metadata (graph-padded to rect_reqs)."""
    st_, tokens, v4 = v41_token_state(str(dev))
    spans, rows = spans_of_widths(random.Random(sum(lens) + rect_reqs), lens)
    batch = token_batch(spans, prefill=False)
    st_.begin()
    tokens.prepare_ids(batch, rect_reqs)
    tokens.prepare_query_prefix(batch, rect_reqs)
    plan = v4.begin_step(spans, block_tables=rows, padded=rect_reqs)
    st_.publish(TOKEN_INPUTS)
    st_.publish(V41_METADATA)
    ind = v4.generate_step_indptrs(plan)
    n_rows = rect_reqs * full_q
    rect = torch.full((n_rows + 3,), POISON, dtype=torch.int32, device=dev)
    rect_batch = torch.full((n_rows + 3,), POISON, dtype=torch.int32, device=dev)
    write_v4_indexer_rectangle(tokens.cu_seqlens_q.gpu, ind.n_committed_per_token, rect,
                               rect_batch, num_reqs=len(lens), rect_reqs=rect_reqs,
                               full_q=full_q)
    st_.finish()
    ah.sync(str(dev))
    want = v41_reference(spans, [list(r) for r in rows], rect_reqs)
    committed = generate_v4_step_indptrs_reference(
        want["v41_positions"], want["v41_token_batch_ids"], [s.context_len for s in spans],
        num_reqs=len(lens), padded_reqs=rect_reqs, window=WINDOW,
        index_topk=TOPK)["n_committed_per_token"][: sum(lens)]
    if sum(lens) > 1:
        assert len(set(committed)) > 1  # distinct counts: a misaligned row shows
    want_rect, want_batch = write_v4_indexer_rectangle_reference(lens, committed, rect_reqs,
                                                                 full_q)
    assert rect.cpu().tolist() == want_rect + [POISON] * 3
    assert rect_batch.cpu().tolist() == want_batch + [POISON] * 3


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
    st_, tokens, v4 = v41_token_state(device)
    rng = random.Random(12)
    for step in range(6):
        n = rng.randint(1, 4)
        spans, rows = [], []
        for i in range(n):
            start = rng.randint(0, 2 * V4_BLOCK)
            width = rng.randint(1, 10)
            ctx = start + width
            rows.append(BlockTable(range(10 * i, 10 * i + -(-ctx // V4_BLOCK))))
            # some chunks fork: their window rows come from the source's slot
            spans.append(RequestSpan(width, ctx, i, 20 + i if rng.random() < 0.5 else -1))
        st_.begin()
        if step % 2:  # a decode step in between: chunk starts are not published
            dec = [RequestSpan(1, s.context_len, s.state_slot) for s in spans]
            v4.begin_step(dec, block_tables=rows)
            assert st_.count(v4.chunk_starts) is None
            st_.publish(V41_METADATA)
            st_.finish()
            continue
        plan = v4.begin_prefill(spans, block_tables=rows)
        batch = token_batch(spans, prefill=True)
        tokens.prepare_ids(batch)
        tokens.prepare_query_prefix(batch)  # the sparse indices' cu_seqlens_q
        before = {name: b.gpu.cpu().numpy().tobytes() for name, b in st_.buffers().items()}
        st_.publish(TOKEN_INPUTS)
        st_.publish(V41_METADATA)
        out = v4.generate_prefill_indptrs(plan)
        st_.finish()
        ah.sync(device)
        t = sum(s.num_tokens for s in spans)
        assert (plan.num_tokens, plan.padded_tokens, plan.padded_reqs) == (t, t, n)
        want = v41_reference(spans, [list(r) for r in rows], n)
        del want["v41_qo_indptr"]  # decode only
        want.pop("v41_step_counts", None)  # the fused decode consumer's: a prefill omits it
        for name in ("v41_positions", "v41_token_batch_ids"):  # no padding in prefill
            want[name] = want[name][:t]
        want["v41_chunk_starts"] = [s.context_len - s.num_tokens for s in spans]
        for r, k in V4_RATIOS:  # the eager plans
            comp = [row for row in want[f"v41_compress_plan_{r}"] if row[0] >= 0]
            want[f"v41_compress_plan_{r}"] = comp
            real = [row for row in want[f"v41_write_plan_{r}"] if row[0] >= 0]
            cap = v4.write_plans[V4_RATIOS.index((r, k))].spec.capacity
            want[f"v41_write_plan_{r}"] = real + [[-1] * 4] * (cap - len(real))
        # the window-write rows: each token among its request's last WINDOW positions
        win, tok = [], 0
        for i, sp in enumerate(spans):
            for j in range(sp.num_tokens):
                pos = sp.context_len - sp.num_tokens + j
                if pos >= sp.context_len - WINDOW:
                    win.append([tok, i, pos, WINDOW - min(j + 1, WINDOW)])
                tok += 1
        cap = v4.window_write_plan.spec.capacity
        assert plan.window_rows == (len(win), cap)
        want["v41_window_write_plan"] = win + [[-1] * 4] * (cap - len(win))
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
        assert tokens.cu_seqlens_q.gpu[: len(cu_q)].tolist() == cu_q
        v4.write_prefill_indices(plan, tokens.cu_seqlens_q.gpu, geometry, outs)
        want_idx = write_v4_prefill_indices_reference(
            want["v41_positions"], want["v41_token_batch_ids"],
            [sp.context_len for sp in spans], want["v41_chunk_starts"],
            [sp.fork_source if sp.fork_source >= 0 else sp.state_slot for sp in spans], cu_q,
            [list(r) for r in rows], geometry,
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


# ------------------------------------------------------------------ TBO consumers
def _tbo_ubatches(device: str) -> tuple[H2DRunnerState, list[V41MetadataInputs]]:
    st_ = H2DRunnerState(device, num_slots=2, scatter=ah.scatter_for(device))
    ubs = [V41MetadataInputs(st_, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS,
                             max_blocks_per_req=MAX_BLOCKS, dummy_state_slot=DUMMY_SLOT,
                             dummy_block=DUMMY_BLOCK, num_blocks=NUM_BLOCKS, window=WINDOW,
                             index_topk=TOPK, envelope_rows=ENVELOPE, prefix=f"ub{k}_")
           for k in range(2)]
    st_.bind()
    for b in st_.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(V4_POISON)
    return st_, ubs


def _consume(ub: V41MetadataInputs, plan: V41Plan, device: str) -> DecodeWindowIndices:
    """The ubatch's consumers: step indptrs, the per-token expansion, the window tails."""
    assert ub.hca_indices is not None
    ub.generate_step_indptrs(plan)
    def poisoned(k: int) -> torch.Tensor:
        return torch.full((k,), POISON, dtype=torch.int32, device=device)

    pt = plan.padded_tokens
    win = DecodeWindowIndices(poisoned(4096), poisoned(4096), ub.hca_indices, poisoned(pt),
                              poisoned(pt), poisoned(pt))
    return ub.write_decode_window_indices(plan, GEOMETRY, win)


def _check_consumers(ub: V41MetadataInputs, plan: V41Plan, spans: list[RequestSpan],
                     rows: list[list[int]], win: DecodeWindowIndices, where: str) -> None:
    """The ubatch's consumer outputs equal the plain reference of its own step."""
    p = plan.padded_reqs
    want = v41_reference(spans, rows, p)
    ctx = [s.context_len for s in spans]
    ref = generate_v4_step_indptrs_reference(
        want["v41_positions"], want["v41_token_batch_ids"], ctx, num_reqs=len(spans),
        padded_reqs=p, window=WINDOW, index_topk=TOPK)
    for name, expected in ref.items():
        got = getattr(ub.step_indptrs, name).cpu().tolist()[: len(expected)]
        assert got == expected, (where, name)
    per_token, cells = expand_v4_token_tables_reference(
        want["v41_positions"], want["v41_token_batch_ids"], ctx, rows, ref["hca_indptr"],
        MAX_BLOCKS, ENVELOPE)
    assert ub.block_tables_per_token is not None
    assert ub.block_tables_per_token[: len(per_token)].cpu().tolist() == per_token, where
    written = write_v4_decode_window_indices_reference(
        want["v41_positions"], want["v41_token_batch_ids"], want["v41_state_slot_out"],
        want["v41_state_slot_in"], ref, GEOMETRY, window=WINDOW)
    for i, v in written["hca_indices"].items():
        cells[i] = v  # the window kernel completes the HCA slices the expansion began
    assert win.hca_indices[: len(cells)].cpu().tolist() == cells, where
    for name, cells_written in written.items():
        if name == "hca_indices":
            continue
        got = getattr(win, name).cpu().tolist()
        assert {i: got[i] for i in cells_written} == cells_written, (where, name)


def test_v4_tbo_consumers_read_their_own_ubatch_buffers(device: str) -> None:
    """Two ubatches whose metadata differ every step (sizes, widths, contexts, padding):
    each ubatch's consumers (step indptrs, per-token tables, HCA head and window tails)
    produce exactly the plain reference of its own step, whether each runs right after its
    own publication or both run after both publications, and the second ubatch's consumers
    leave the first's outputs as they were."""
    ah.need_kernels(device)
    st_, ubs = _tbo_ubatches(device)
    pops = [Population(50), Population(51)]
    for step in range(6):
        late = step % 2 == 1  # consumers after both publications
        steps: list[tuple[V41Plan, list[RequestSpan], list[list[int]]]] = []
        wins: list[DecodeWindowIndices] = []
        for k, (ub, pop) in enumerate(zip(ubs, pops, strict=True)):
            n, q = (1 + step % 3, 1 + step % 4) if k == 0 else (4 - step % 3, 4 - step % 4)
            spans, rows = pop.step(n, True, q)
            if k == 0:
                st_.begin()
            else:
                st_.resume()  # late preparation of the second ubatch
            plan = ub.begin_step(spans, block_tables=rows, padded=[4, 3][k] if step % 3 else
                                 None)
            st_.publish(ub.group)
            if not late:
                wins.append(_consume(ub, plan, device))
            st_.finish()
            steps.append((plan, spans, [list(r) for r in rows]))
        if late:
            st_.resume()
            wins = [_consume(ub, s[0], device) for ub, s in zip(ubs, steps, strict=True)]
            st_.finish()
        ah.sync(device)
        assert steps[0][1] != steps[1][1]  # the ubatches' metadata differ
        for k, (ub, (plan, spans, ids), win) in enumerate(zip(ubs, steps, wins,
                                                               strict=True)):
            _check_consumers(ub, plan, spans, ids, win, f"step {step} ubatch {k}")


# ------------------------------------------------------- the widest query, host-side
#: torch calls that reduce a tensor or read one back to the host
_READBACKS = frozenset({
    "max", "amax", "aminmax", "argmax", "max_", "maximum", "item", "tolist", "__int__",
    "__index__", "__float__", "__bool__", "cpu", "numpy", "to", "__array__", "_local_scalar_dense",
})
#: calls that read a tensor's metadata only
_METADATA = frozenset({"__get__", "size", "dim", "stride", "numel", "data_ptr",
                       "is_contiguous", "element_size", "untyped_storage"})


class _DeviceCalls(TorchFunctionMode):
    """Every torch call made inside it on a device tensor (a destination, a consumer output,
    or anything on CUDA) and every reduction or readback on any tensor."""

    def __init__(self, device_storages: set[int]) -> None:
        super().__init__()
        self.device_storages = device_storages
        self.bad: list[str] = []

    def _on_device(self, t: torch.Tensor) -> bool:
        return t.device.type != "cpu" or t.untyped_storage().data_ptr() in self.device_storages

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", repr(func))
        flat = [*args, *kwargs.values()]
        flat += [x for a in flat if isinstance(a, list | tuple) for x in a]
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        with torch._C.DisableTorchFunction():
            device = name not in _METADATA and any(self._on_device(t) for t in tensors)
        if name in _READBACKS and (device or name != "numpy"):
            self.bad.append(f"{name} (reduction or readback)")
        elif device:
            self.bad.append(f"{name} (on a device tensor)")
        return func(*args, **kwargs)


@contextmanager
def _no_device_reduction(st_: H2DRunnerState, ubs: list[V41MetadataInputs]
                         ) -> Iterator[_DeviceCalls]:
    """Records what ``_DeviceCalls`` forbids; on CUDA a device synchronization (a readback)
    also raises (``torch.cuda.set_sync_debug_mode("error")``)."""
    storages = {b.gpu.untyped_storage().data_ptr() for b in st_.buffers().values()}
    for ub in ubs:
        outs = [*ub.step_indptrs, *ub.prefill_indptrs, ub.block_tables_per_token,
                ub.hca_indices]
        storages |= {t.untyped_storage().data_ptr() for t in outs if t is not None}
    cuda = st_.device.type == "cuda"
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with _DeviceCalls(storages) as calls:
            yield calls
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(0)


def test_v4_tbo_and_prefill_widest_query_comes_from_cpu_lengths(device: str) -> None:
    """Spec: V4 TBO consumers retain views of their own ubatch buffers; CPU query lengths
    supply the maximum query width without a device reduction or readback. Uneven TBO
    ubatches (decode, graph-padded and eager) and V4 prefill chunks report the widest query
    of their own CPU lengths, and their producers make no torch call on a device tensor and
    no reduction or readback at all (on CUDA: no synchronization either)."""
    ah.need_kernels(device)
    st_, ubs = _tbo_ubatches(device)
    rng = random.Random(33)
    pops = [Population(60), Population(61)]
    for step in range(6):
        prefill = step % 3 == 2
        st_.begin()
        for k, (ub, pop) in enumerate(zip(ubs, pops, strict=True)):
            if k:
                st_.resume()
            if prefill:
                widths = [rng.randint(1, 9) for _ in range(1 + k + step % 2)]
                spans, rows = spans_of_widths(rng, widths)
            else:
                spans, rows = pop.step(2 + k, True, 2 + (step + k) % 3)
            q = max(s.num_tokens for s in spans)
            padded = None if prefill or step % 2 else 4
            with _no_device_reduction(st_, ubs) as calls:
                if prefill:
                    plan = ub.begin_prefill(spans, block_tables=rows)
                else:
                    plan = ub.begin_step(spans, block_tables=rows, padded=padded)
            assert calls.bad == [], (step, k, calls.bad)
            assert plan.max_query_len == q, (step, k)
            if not prefill and padded is not None:
                assert plan.padded_tokens == padded * q  # the graph grid of that width
            st_.publish(ub.group)
            if prefill:
                ub.generate_prefill_indptrs(plan)
            else:
                ub.generate_step_indptrs(plan)
            st_.finish()
        ah.sync(device)


# ------------------------------------------------- delayed source reuse, untouched tails
def _expected_counts(plan: V41Plan, prefill: bool, v4: V41MetadataInputs
                     ) -> dict[str, int | None]:
    """What a V4.1 step and its token inputs publish, from the plan (spec counts)."""
    n, p, pt = plan.num_reqs, plan.padded_reqs, plan.padded_tokens
    out: dict[str, int | None] = {
        "v41_positions": pt, "v41_token_batch_ids": pt, "v41_seq_lens": p,
        "v41_state_slot_out": p, "v41_state_slot_in": p,
        "v41_chunk_starts": n if prefill else None,
        "v41_window_write_plan": v4.window_write_plan.spec.capacity if prefill else None,
        "v41_qo_indptr": None if prefill else pt + 1,
        "cu_seqlens_q": p + 1, "decode_cu": p + 1, "decode_src": p,
        "input_ids": pt,
    }
    for (r, _), cb, wb, rows in zip(V4_RATIOS, v4.compress_plans, v4.write_plans,
                                     plan.plan_rows, strict=True):
        out[cb.name] = rows[1]
        out[wb.name] = wb.spec.capacity if prefill else rows[3]  # eager: the whole array
        if not prefill:
            assert rows[1] == p * -(-plan.max_query_len // r)
    return out


def test_v4_indexer_delayed_source_reuse_and_untouched_tails(device: str) -> None:
    """Two slots, decode (graph-padded, ragged) and prefill steps: on CUDA each step's
    publication queues behind a busy GPU while the host runs ahead and rewrites the
    sources; the destinations (copied on the GPU right after each publication) and the
    indexer's outputs still hold that step's values, and no byte past a member's count
    (nor of an omitted member) moved. The table's changed spans travel without a count:
    rows past the step's rows stay as they were."""
    ah.need_kernels(device)
    st_, tokens, v4 = v41_token_state(device, num_slots=2)
    pop = Population(70)
    taken = []
    for index in range(9):
        prefill = index % 3 == 2
        if prefill:
            spans, rows = spans_of_widths(random.Random(index), [3, 1, 6][: 1 + index % 3])
        else:
            spans, rows = pop.step(1 + index % 4, True, 1 + index % 4)
        padded = None if prefill else MAX_REQS // 2 + index % 2
        assert st_.begin() == index % 2
        batch = token_batch(spans, prefill)
        tokens.prepare_ids(batch, padded)
        tokens.prepare_query_prefix(batch, padded)
        plan = (v4.begin_prefill(spans, block_tables=rows) if prefill
                else v4.begin_step(spans, block_tables=rows, padded=padded))
        counted = published_counts(st_)
        want_counts = _expected_counts(plan, prefill, v4)
        assert {k: counted[k] for k in want_counts} == want_counts, index
        if device == "cuda":
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU work the DMA queues behind
        before = dest_copies(st_)
        st_.publish(TOKEN_INPUTS)
        st_.publish(V41_METADATA)
        after = dest_copies(st_)
        if prefill:
            out = [x.clone() for x in v4.generate_prefill_indptrs(plan)]  # fields
        else:
            ind = v4.generate_step_indptrs(plan)
            rect = torch.full((MAX_TOKENS + 3,), POISON, dtype=torch.int32, device=device)
            rect_batch = torch.full_like(rect, POISON)
            write_v4_indexer_rectangle(tokens.cu_seqlens_q.gpu, ind.n_committed_per_token,
                                       rect, rect_batch, num_reqs=plan.num_reqs,
                                       rect_reqs=plan.padded_reqs,
                                       full_q=plan.max_query_len)
            out = [ind.n_committed_per_token.clone(), rect, rect_batch]
        st_.finish()
        # a decode plan is valid until its slot's next step: keep a copy
        taken.append((spans, [list(r) for r in rows], V41Plan(*plan.astuple()), prefill,
                      before, after, counted, out))
    ah.sync(device)
    for index, (spans, ids, plan, prefill, before, after, counted, out) in enumerate(taken):
        p, t = plan.padded_reqs, plan.num_tokens
        check_tails(st_, before, after, counted, rows={"v41_block_tables": p})
        want = v41_reference(spans, ids, p)
        positions = want["v41_positions"][: plan.padded_tokens]
        bids = want["v41_token_batch_ids"][: plan.padded_tokens]
        assert after["v41_positions"][: len(positions)].tolist() == positions, index
        assert after["v41_token_batch_ids"][: len(bids)].tolist() == bids, index
        for name in ("v41_seq_lens", "v41_state_slot_out", "v41_state_slot_in"):
            assert after[name][:p].tolist() == want[name], (index, name)
        for i, row in enumerate(want["v41_block_tables"]):
            assert after["v41_block_tables"][i, : len(row)].tolist() == row, (index, i)
        cu = [0]
        for s in spans:
            cu.append(cu[-1] + s.num_tokens)
        cu += [cu[-1]] * (p - len(spans))
        assert after["cu_seqlens_q"][: p + 1].tolist() == cu, index
        ctx = [s.context_len for s in spans]
        if prefill:
            starts = [s.context_len - s.num_tokens for s in spans]
            assert after["v41_chunk_starts"][: len(spans)].tolist() == starts, index
            ref = generate_v4_prefill_indptrs_reference(positions, bids, ctx, starts,
                                                        window=WINDOW, index_topk=TOPK)
            fields = PrefillIndptrs._fields
            for name, expected in ref.items():
                got = out[fields.index(name)][: len(expected)].tolist()
                assert got == expected, (index, name)
            continue
        committed = generate_v4_step_indptrs_reference(
            positions, bids, ctx, num_reqs=len(spans), padded_reqs=p, window=WINDOW,
            index_topk=TOPK)["n_committed_per_token"]
        assert out[0][: len(committed)].tolist() == committed, index
        lens = [s.num_tokens for s in spans]
        want_rect, want_batch = write_v4_indexer_rectangle_reference(
            lens, committed[:t], p, plan.max_query_len)
        k = len(want_rect)
        assert out[1].tolist() == want_rect + [POISON] * (MAX_TOKENS + 3 - k), index
        assert out[2].tolist() == want_batch + [POISON] * (MAX_TOKENS + 3 - k), index
