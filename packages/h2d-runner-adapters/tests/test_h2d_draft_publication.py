"""Draft (MTP/EAGLE) and GDN consumers.

* A verify step of MHA+MTP (and GDN+MTP) is one DMA and one scatter: the speculative
  verification indices and the GDN state indices ride in the step's group.
* The draft loop's per-step metadata (positions, context lengths, KV slots, KV prefix,
  query prefix, then KV indices) is derived on the GPU from the verify step's published
  members and the sampler's rejection counts: no upload, no readback per draft step.
* GDN state indices (non-speculative with forks, speculative with accepted counts, graph
  padding with PAD_SLOT_ID) and their first reader.

Exact values against host oracles, untouched tails, changing batch sizes and draft counts,
packed == direct, bad inputs refused with nothing changed, delayed source reuse (CUDA).
"""

from __future__ import annotations

import adapter_helpers as ah
import numpy as np
import pytest
import torch

from block_tables import BlockTable
from h2d_core import CountError, H2DRunnerState
from h2d_kernels import copy_counts, is_copy
from h2d_runner_adapters import (
    DECODE_STEP,
    GDN_STATE,
    BatchColumns,
    DecodeStepInputs,
    GdnStateInputs,
    MhaDraftLoop,
    ScheduledBatch,
    StepShape,
)
from h2d_runner_adapters.draft.step import advance_draft_step_reference
from h2d_runner_adapters.gdn.states import gather_gdn_states_reference

PAGE = 4
MAX_REQS, MAX_TOKENS, MAX_PAGES, NUM_PAGES = 8, 40, 16, 300
NUM_SLOTS = 64  # GDN state pool rows
WIDTH = 5  # GDN state width (floats)
POISON = -7


class Verify:
    """Requests verifying ``k`` drafts a step (q = 1 + drafts, ragged when asked), with
    pages reserved for the draft loop's positions."""

    def __init__(self, seed: int, k: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.k = k
        self.next_page = 0
        self.ctx: list[int] = []
        self.rows: list[BlockTable] = []
        self.groups: list[int] = []

    def _pages(self, n: int) -> list[int]:
        out = [(self.next_page + i) % NUM_PAGES for i in range(n)]
        self.next_page += n
        return out

    def step(self, n: int, ragged: bool, padded: int | None
             ) -> tuple[ScheduledBatch, list[int], np.ndarray]:
        rng = self.rng
        while len(self.ctx) < n:
            c = int(rng.integers(2, 20))
            self.ctx.append(c)
            self.rows.append(BlockTable(self._pages(-(-(c + 2 * self.k + 2) // PAGE))))
            self.groups.append(len(self.groups) % (NUM_SLOTS // (self.k + 1)))
        self.ctx, self.rows, self.groups = self.ctx[:n], self.rows[:n], self.groups[:n]
        drafts = (rng.integers(0, self.k + 1, n) if ragged else np.full(n, self.k)).astype(
            np.int32)
        q = drafts + 1
        for i in range(n):
            self.ctx[i] += int(q[i])
            need = -(-(self.ctx[i] + self.k + 1) // PAGE) - len(self.rows[i])
            if need > 0:  # pages for the verify tokens and the draft loop's positions
                row = self.rows[i].lineage_copy()
                row.append(self._pages(need))
                self.rows[i] = row
        cols = BatchColumns(
            query_lens=q, context_lens=np.asarray(self.ctx, np.int32),
            temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
            top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
            token_ids=rng.integers(1, 900, int(q.sum())).astype(np.int32), num_drafts=drafts)
        batch = ScheduledBatch((), False, PAGE, padded_size=padded, given_columns=cols,
                               given_block_tables=list(self.rows))
        return batch, list(self.ctx), drafts


def build(device: str, backend: str, k: int, *, gdn: bool = True, num_slots: int = 1
          ) -> tuple[H2DRunnerState, DecodeStepInputs, GdnStateInputs | None, MhaDraftLoop]:
    st = H2DRunnerState(device, backend=backend, num_slots=num_slots,
                        scatter=ah.scatter_for(device))
    g = GdnStateInputs(st, max_reqs=MAX_REQS, num_spec=k, num_state_slots=NUM_SLOTS) \
        if gdn else None
    step = DecodeStepInputs(st,
                            StepShape(max_reqs=MAX_REQS, max_tokens=MAX_TOKENS,
                                      max_pages_per_req=MAX_PAGES, page_size=PAGE,
                                      num_pages=NUM_PAGES),
                            max_drafts=k, extra_groups=[GDN_STATE] if gdn else ())
    st.bind()
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(0x5A)
    return st, step, g, MhaDraftLoop(step.decode, step.tokens)


def spec_reference(q: np.ndarray, d: np.ndarray) -> tuple[list[int], list[int], list[int]]:
    target, cu, bonus, start, total = [], [], [], 0, 0
    for qi, di in zip(q.tolist(), d.tolist(), strict=True):
        target += [start + j for j in range(di)]
        total += di
        cu.append(total)
        bonus.append(start + di)
        start += qi
    return target, cu, bonus


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_verify_then_draft_loop(device: str, backend: str, k: int) -> None:
    """Each verify step: one publication of the whole step (speculative indices and GDN
    state indices included; packed: one DMA and one scatter); then ``k`` draft steps whose
    metadata and KV indices come from the GPU alone (no publication, no upload)."""
    ah.need_kernels(device)
    st, step, gdn, loop = build(device, backend, k)
    assert gdn is not None
    pop = Verify(10 + k, k)
    rng = np.random.default_rng(k)
    schedule = [(3, False, None), (5, True, 8), (1, False, 2), (6, True, None), (0, False, 2),
                (4, True, 4)]
    for index, (n, ragged, padded) in enumerate(schedule):
        batch, ctx, drafts = pop.step(n, ragged, padded)
        q = drafts + 1
        acc = np.asarray([int(rng.integers(0, d + 1)) for d in drafts.tolist()], np.int32)
        st.begin()
        plan = step.prepare(batch, padded)
        step.tokens.prepare_spec_indices(batch)
        gplan = gdn.prepare(np.asarray(pop.groups, np.int32), padded=padded,
                            num_accepted=acc + 1)
        st.publish(DECODE_STEP)
        before = st.counters(DECODE_STEP).publications
        # the sampler's output: rejected drafts per request, a device array
        rejected = torch.tensor([*(drafts - acc).tolist(), 0], dtype=torch.int32,
                                device=device)
        p = plan.decode.padded_reqs
        metas = []
        for s in range(1, k + 1):
            meta = loop.advance(plan.decode, rejected, s)
            metas.append(({f: getattr(meta, f).clone() for f in meta._fields},
                          loop.kv_indices.clone()))
        st.finish()
        ah.sync(device)
        assert st.counters(DECODE_STEP).publications == before  # the loop published nothing
        c = st.counters(DECODE_STEP)
        if backend == "packed":
            assert (c.dmas, c.scatters, c.direct_copies) == (index + 1, index + 1, 0)
        # the verify step's speculative indices, from the one publication
        target, cu, bonus = spec_reference(q, drafts)
        t = step.tokens
        assert t.target_logits_indices.gpu[: len(target)].tolist() == target
        assert t.cu_num_draft_tokens.gpu[:n].tolist() == cu
        assert t.bonus_logits_indices.gpu[:n].tolist() == bonus
        # GDN: speculative rows, padded with -1, accepted counts padded with 1
        assert gplan.astuple() == (n, p, True)
        assert gdn.spec is not None and gdn.num_accepted is not None
        want_rows = [[g * (k + 1) + j for j in range(k + 1)] for g in pop.groups]
        want_rows += [[-1] * (k + 1)] * (p - n)
        assert gdn.spec.gpu[:p].tolist() == want_rows
        assert gdn.num_accepted.gpu[:p].tolist() == (acc + 1).tolist() + [1] * (p - n)
        # the draft loop, against the oracle written from the verify step's batch
        positions = [c - int(w) + j for c, w in zip(ctx, q, strict=True) for j in range(int(w))]
        cu_q = [0, *np.cumsum(q).tolist()]
        rows = [list(r) for r in pop.rows]
        for s, (got, kv) in enumerate(metas, start=1):
            want = advance_draft_step_reference(
                positions, cu_q, (drafts - acc).tolist(), rows, num_reqs=n, padded_reqs=p,
                step=s, page_size=PAGE, table_width=MAX_PAGES)
            for name, values in want.items():
                assert got[name][: len(values)].tolist() == values, (index, s, name)
            assert -1 not in want["slot_mapping"][:n]  # the reserved pages hold every draft
            kv_want = [x for r, c in zip(rows, want["context_lens"], strict=False)
                       for x in r[: -(-c // PAGE)]]
            assert kv[: len(kv_want)].tolist() == kv_want, (index, s)


def test_draft_loop_uploads_nothing_and_never_syncs(device: str) -> None:
    """CUDA: a profiler trace of three draft steps holds no host-to-device copy, and the
    loop runs under ``set_sync_debug_mode("error")``."""
    if device != "cuda":
        pytest.skip("a CUDA profiler trace")
    from torch.profiler import ProfilerActivity, profile

    st, step, _, loop = build("cuda", "packed", 3, gdn=False)
    pop = Verify(4, 3)
    batch, _, _ = pop.step(5, True, 8)
    st.begin()
    plan = step.prepare(batch, 8)
    step.tokens.prepare_spec_indices(batch)
    st.publish(DECODE_STEP)
    st.finish()
    rejected = torch.zeros(8, dtype=torch.int32, device="cuda")
    for s in (1, 2, 3):  # compile
        loop.advance(plan.decode, rejected, s)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for s in (1, 2, 3):
                loop.advance(plan.decode, rejected, s)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert not copy_counts(prof) and not [n for n in names if is_copy(n)], names
    assert len(names) == 6, names  # two kernels per draft step


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_gdn_non_speculative_indices_forks_and_first_reader(device: str, backend: str) -> None:
    ah.need_kernels(device)
    st = H2DRunnerState(device, backend=backend, scatter=ah.scatter_for(device))
    gdn = GdnStateInputs(st, max_reqs=MAX_REQS, num_spec=2, num_state_slots=NUM_SLOTS)
    st.bind()
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(0x5A)
    pool = torch.arange(NUM_SLOTS * WIDTH, dtype=torch.float32, device=device).view(
        NUM_SLOTS, WIDTH)
    out = torch.full((MAX_REQS + 2, WIDTH), -3.0, device=device)
    rng = np.random.default_rng(2)
    for n, padded, forks in ((3, None, False), (5, 8, True), (0, 2, False), (8, None, True),
                             (2, 6, True)):
        groups = rng.choice(NUM_SLOTS // 3, n, replace=False).astype(np.int32)
        fork = (np.where(rng.random(n) < 0.5, rng.integers(0, NUM_SLOTS // 3, n), -1)
                .astype(np.int32) if forks else None)
        st.begin()
        plan = gdn.prepare(groups, padded=padded, fork_sources=fork)
        assert st.count(gdn.spec) is None and st.count(gdn.num_accepted) is None  # type: ignore[arg-type]
        st.publish(GDN_STATE)
        got = gdn.gather_states(plan, pool, out)
        st.finish()
        ah.sync(device)
        p = n if padded is None else padded
        base = (groups * 3).tolist()
        src = base if fork is None else [f * 3 if f >= 0 else b
                                         for f, b in zip(fork.tolist(), base, strict=True)]
        assert gdn.non_spec.gpu[:p].tolist() == base + [-1] * (p - n)
        assert gdn.non_spec_in.gpu[:p].tolist() == src + [-1] * (p - n)
        want = gather_gdn_states_reference(pool.cpu().tolist(), [[x] for x in src + [-1] * (
            p - n)], p)
        assert got.cpu().tolist() == want
        assert out[p:].cpu().unique().tolist() == [-3.0]  # rows past the batch: untouched
        out.fill_(-3.0)


@pytest.mark.parametrize("case", ["negative_group", "past_pool", "accepted_range",
                                  "spec_fork", "dtype", "no_spec", "size", "padded_over"])
def test_gdn_bad_inputs_change_nothing(device: str, case: str) -> None:
    st = H2DRunnerState(device, scatter="reference" if device == "cpu" else "auto")
    gdn = GdnStateInputs(st, max_reqs=4, num_spec=1, num_state_slots=8)
    plain = GdnStateInputs(st, max_reqs=4, group="gdn_plain")
    st.bind()
    st.begin()
    gdn.prepare(np.array([0, 1], np.int32), num_accepted=np.array([1, 2], np.int32))
    st.publish(GDN_STATE)
    st.finish()
    st.begin()
    sources = {name: b.np.tobytes() for name, b in st.buffers().items()}
    g = np.array([0, 1], np.int32)
    acc = np.array([1, 2], np.int32)
    calls = {
        "negative_group": (lambda: gdn.prepare(np.array([0, -1], np.int32)),
                           r"request 1 has a negative state group"),
        "past_pool": (lambda: gdn.prepare(np.array([0, 4], np.int32)),
                      r"request 1's state group 4 needs slots up to 9, past the pool's 8"),
        "accepted_range": (lambda: gdn.prepare(g, num_accepted=np.array([1, 3], np.int32)),
                           r"request 1 has num_accepted=3; it must be in \[1, 2\]"),
        "spec_fork": (lambda: gdn.prepare(g, num_accepted=acc,
                                          fork_sources=np.array([-1, 2], np.int32)),
                      r"speculative steps take no fork sources"),
        "dtype": (lambda: gdn.prepare(g.astype(np.float32)),
                  r"state_groups must be a 1-D integer numpy array"),
        "no_spec": (lambda: plain.prepare(g, num_accepted=acc),
                    r"num_spec=0; pass num_spec=k"),
        "size": (lambda: gdn.prepare(g, num_accepted=np.array([1], np.int32)),
                 r"num_accepted must be .*2 entries, one per request"),
        "padded_over": (lambda: gdn.prepare(g, padded=5), r"padded=5 exceeds max_reqs=4"),
    }
    call, match = calls[case]
    with pytest.raises(CountError, match=match):
        call()
    assert {name: b.np.tobytes() for name, b in st.buffers().items()} == sources
    # the producer was not entered: it runs again in the same epoch
    (plain if case == "no_spec" else gdn).prepare(g)


def test_spec_indices_bad_inputs_change_nothing(device: str) -> None:
    st, step, _, _ = build(device, "packed", 2, gdn=False)
    pop = Verify(7, 2)
    batch, _, _ = pop.step(3, False, None)
    st.begin()
    step.prepare(batch)
    t = step.tokens
    sources = {name: b.np.tobytes() for name, b in st.buffers().items()}
    cols = batch.columns
    for drafts, match in ((np.array([2, 3, 0], np.int32), r"request 1 verifies 3 drafts "
                                                         r"with 3 query tokens"),
                          (np.array([0, -1, 0], np.int32), r"request 1 verifies -1 drafts")):
        bad = ScheduledBatch((), False, PAGE, given_columns=BatchColumns(
            **{**vars(cols), "num_drafts": drafts}))
        with pytest.raises(CountError, match=match):
            t.prepare_spec_indices(bad)
        assert {name: b.np.tobytes() for name, b in st.buffers().items()} == sources
    t.prepare_spec_indices(batch)  # the producer runs again in the same epoch


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_verify_step_delayed_source_reuse(device: str, backend: str) -> None:
    """Two slots; each publication queues behind a busy GPU while the host runs ahead and
    rewrites the sources: GPU-side copies taken right after each publication hold what
    that step published (speculative and GDN indices included)."""
    if device != "cuda":
        pytest.skip("delayed source reuse needs asynchronous copies (CUDA)")
    st, step, gdn, _ = build(device, backend, 2, num_slots=2)
    assert gdn is not None and gdn.spec is not None
    pop = Verify(9, 2)
    taken = []
    for index in range(8):
        n = 1 + index % 6
        batch, _, drafts = pop.step(n, index % 2 == 1, None)
        acc = np.minimum(drafts, 1).astype(np.int32) + 1
        st.begin()
        step.prepare(batch)
        step.tokens.prepare_spec_indices(batch)
        gdn.prepare(np.asarray(pop.groups, np.int32), num_accepted=acc)
        torch.cuda._sleep(20_000_000)
        st.publish(DECODE_STEP)
        taken.append((batch.columns.query_lens.copy(), drafts, list(pop.groups), acc,
                      step.tokens.bonus_logits_indices.gpu[:n].clone(),
                      gdn.spec.gpu[:n].clone(), step.decode.context_lens.gpu[:n].clone(),
                      list(pop.ctx)))
        st.finish()
    torch.cuda.synchronize()
    for q, drafts, groups, _acc, bonus, spec, ctx_gpu, ctx in taken:
        assert bonus.tolist() == spec_reference(q, drafts)[2]
        assert spec.tolist() == [[g * 3 + j for j in range(3)] for g in groups]
        assert ctx_gpu.tolist() == ctx


@pytest.mark.parametrize("policy", ["uniform", "per_request"])
def test_speculative_sampling_keeps_uniform_filters_on_the_host(device: str,
                                                                policy: str) -> None:
    """A verify step's sampling: the bonus rows through the ordinary sampler (uniform
    top-k/top-p as host scalars, never uploaded; per-request ones uploaded), greedy rows
    corrected on the GPU, acceptance against the target's argmax, then the draft loop from
    the rejection counts: all on the device (CUDA: under sync-debug "error")."""
    ah.need_kernels(device)
    from h2d_runner_adapters import accept_draft_tokens
    from h2d_runner_adapters.consumers.reference import sample_tokens_reference
    from h2d_runner_adapters.draft.acceptance import accept_draft_tokens_reference

    k, vocab = 3, 64
    st, step, _, loop = build(device, "packed", k, gdn=False)
    pop = Verify(31, k)
    rng = np.random.default_rng(4)
    for index in range(3):
        batch, _, drafts = pop.step(5, True, None)
        cols = batch.columns
        n = drafts.size
        uniform = policy == "uniform"
        top_k = np.full(n, 5, np.int32) if uniform else rng.integers(-1, 9, n).astype(np.int32)
        top_p = np.full(n, 0.9, np.float32) if uniform else rng.random(n).astype(np.float32)
        temps = rng.choice([0.0, 0.8], n).astype(np.float32)  # greedy and sampled rows
        batch = ScheduledBatch((), False, PAGE, given_columns=BatchColumns(
            **{**vars(cols), "top_k": top_k, "top_p": top_p, "temperatures": temps}),
            given_block_tables=batch.block_tables)
        st.begin()
        plan = step.prepare(batch)
        step.tokens.prepare_spec_indices(batch)
        st.publish(DECODE_STEP)
        st.finish()
        assert (plan.sampling.per_request_top_k, plan.sampling.per_request_top_p) == (
            not uniform, not uniform)
        if uniform:  # host scalars: the filters' members were not published
            assert (plan.sampling.top_k, plan.sampling.top_p) == (5, pytest.approx(0.9))
            assert st.count(step.sampling.top_ks) is None
        # the model's logits: drafts made the target's argmax with probability 0.6
        ids = cols.token_ids
        total = int(drafts.sum())
        logits_np = rng.standard_normal((int(cols.query_lens.sum()), vocab)).astype(np.float32)
        t = step.tokens
        target_rows = t.target_logits_indices.gpu[:total].cpu().tolist()
        for row in target_rows:
            if rng.random() < 0.6:
                logits_np[row, int(ids[row + 1]) % vocab] = 50.0
        logits = torch.from_numpy(logits_np).to(device)
        draft_vocab = torch.from_numpy(ids % vocab).to(device)
        noise = torch.from_numpy(rng.gumbel(size=(n, vocab)).astype(np.float32)).to(device)
        outs = (torch.full((n, k + 1), POISON, dtype=torch.int32, device=device),
                torch.full((n,), POISON, dtype=torch.int32, device=device),
                torch.full((n + 1,), 0, dtype=torch.int32, device=device))
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            draft_ids = torch.empty(total, dtype=torch.int32, device=device)
            from h2d_runner_adapters import gather_draft_ids
            gather_draft_ids(torch.cat((draft_vocab, draft_vocab[:1])),
                             t.target_logits_indices.gpu[:total], draft_ids)
            target_argmax = torch.argmax(logits.index_select(0, t.target_logits_indices.gpu[
                :total]), dim=-1)
            bonus_logits = logits.index_select(0, t.bonus_logits_indices.gpu[:n])
            bonus = step.sampling.sample(bonus_logits, plan.sampling, noise)
            accept_draft_tokens(draft_ids, target_argmax, t.cu_num_draft_tokens.gpu, bonus,
                                *outs, num_reqs=n)
            meta = loop.advance(plan.decode, outs[2], 1)
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(0)
        ah.sync(device)
        want_bonus = sample_tokens_reference(
            bonus_logits, step.sampling.temperatures.gpu,
            top_k=step.sampling.top_ks.gpu if not uniform else 5,
            top_p=step.sampling.top_ps.gpu if not uniform else 0.9, noise=noise)
        assert bonus.cpu().tolist() == want_bonus.tolist(), index
        rows, acc, rej = accept_draft_tokens_reference(
            draft_ids.cpu().tolist(), target_argmax.cpu().tolist(), drafts.tolist(),
            bonus.cpu().tolist(), k + 1)
        assert outs[0].cpu().tolist() == rows, index
        assert outs[1].cpu().tolist() == acc and outs[2][:n].cpu().tolist() == rej, index
        ctx = cols.context_lens.tolist()
        assert meta.context_lens[:n].cpu().tolist() == [c - r + 1 for c, r in zip(
            ctx, rej, strict=True)], index
        assert 0 < sum(acc) < total, (index, acc)  # both outcomes occur


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_spec_indices_repeat_the_slots_bytes_only_for_the_same_batch_shape(
        device: str, backend: str) -> None:
    """Steady MTP steps (same query and draft counts) reuse what the slot's sources hold;
    any change of shape recomputes; every publication holds the right indices, whichever
    slot it ran on."""
    from h2d_runner_adapters import SPEC_INDICES, TokenInputs

    st = H2DRunnerState(device, backend=backend, num_slots=2, scatter=ah.scatter_for(device))
    t = TokenInputs(st, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS, max_drafts=3)
    st.bind()
    shapes = [[3, 3, 3], [3, 3, 3], [3, 3, 3], [1, 3, 2], [3, 3, 3], [0, 0], [3, 3, 3, 3],
              [3, 3, 3]]
    for step, drafts in enumerate(shapes):
        d = np.asarray(drafts, np.int32)
        q = d + 1
        cols = BatchColumns(
            query_lens=q, context_lens=q + 10, temperatures=np.ones(d.size, np.float32),
            top_k=np.full(d.size, -1, np.int32), top_p=np.ones(d.size, np.float32),
            prev_sample_rows=np.full(d.size, -1, np.int32),
            token_ids=np.zeros(int(q.sum()), np.int32), num_drafts=d)
        st.begin()
        t.prepare_spec_indices(ScheduledBatch((), False, PAGE, given_columns=cols))
        st.publish(SPEC_INDICES)
        st.finish()
        ah.sync(device)
        target, cu, bonus = spec_reference(q, d)
        n = d.size
        assert t.target_logits_indices.gpu[: len(target)].tolist() == target, step
        assert t.cu_num_draft_tokens.gpu[:n].tolist() == cu, step
        assert t.bonus_logits_indices.gpu[:n].tolist() == bonus, step


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_gdn_speculative_rows_are_rewritten_only_when_the_requests_change(
        device: str, backend: str) -> None:
    """Two slots: steps with the same state groups reuse the slot's speculative rows and
    write only the accepted counts; new groups, padding or a bad count are handled as on
    a first step. Every publication holds exact rows and counts."""
    st = H2DRunnerState(device, backend=backend, num_slots=2, scatter=ah.scatter_for(device))
    gdn = GdnStateInputs(st, max_reqs=MAX_REQS, num_spec=2, num_state_slots=NUM_SLOTS)
    st.bind()
    rng = np.random.default_rng(9)
    plan_groups = [[1, 4, 2]] * 4 + [[5, 0]] * 3 + [[1, 4, 2]] * 2
    for step, groups in enumerate(plan_groups):
        g = np.asarray(groups, np.int32)
        acc = rng.integers(1, 4, g.size).astype(np.int32)
        padded = 6 if step == 5 else None
        st.begin()
        if step == 2:  # a bad count on a cached shape is still refused, nothing written
            before = {k: b.np.tobytes() for k, b in st.buffers().items()}
            with pytest.raises(CountError, match=r"num_accepted=4; it must be in \[1, 3\]"):
                gdn.prepare(g, num_accepted=np.array([1, 4, 1], np.int32))
            assert {k: b.np.tobytes() for k, b in st.buffers().items()} == before
        plan = gdn.prepare(g, padded=padded, num_accepted=acc)
        st.publish(GDN_STATE)
        st.finish()
        ah.sync(device)
        p = plan.padded_reqs
        assert gdn.spec is not None and gdn.num_accepted is not None
        want = [[x * 3 + j for j in range(3)] for x in groups] + [[-1] * 3] * (p - g.size)
        assert gdn.spec.gpu[:p].tolist() == want, step
        assert gdn.num_accepted.gpu[:p].tolist() == acc.tolist() + [1] * (p - g.size), step


def test_draft_step_never_reads_outside_the_verify_positions(dev: torch.device) -> None:
    """A query prefix that indexes outside ``positions`` (never published for this step:
    zeros, or stale and too long) makes that request a padded row (position 0, context 0,
    slot -1: nothing a draft model would write) instead of an out-of-bounds read; the
    oracle agrees."""
    from h2d_runner_adapters.draft.step import DraftStepMetadata, advance_draft_step

    n, page = 3, 4
    positions = torch.arange(10, 16, dtype=torch.int64, device=dev)  # 6 verify tokens
    cu = torch.tensor([0, 0, 2, 99], dtype=torch.int32, device=dev)  # -1, 1, 98
    rejected = torch.zeros(n, dtype=torch.int32, device=dev)
    tables = torch.arange(n * 8, dtype=torch.int32, device=dev).reshape(n, 8)

    def zeros(k: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(k, dtype=dtype, device=dev)

    out = DraftStepMetadata(zeros(n, torch.int64), zeros(n, torch.int32),
                            zeros(n, torch.int64), zeros(n + 1, torch.int32),
                            zeros(n + 1, torch.int32))
    advance_draft_step(positions, cu, rejected, tables, out, num_reqs=n, padded_reqs=n,
                       step=1, page_size=page)
    want = advance_draft_step_reference(
        positions.tolist(), cu.tolist(), rejected.tolist(), tables.tolist(), num_reqs=n,
        padded_reqs=n, step=1, page_size=page, table_width=8)
    assert out.positions.tolist() == want["positions"] == [0, 12, 0]
    assert out.slot_mapping.tolist() == want["slot_mapping"] == [-1, 44, -1]
    assert out.kv_indptr.tolist() == want["kv_indptr"] == [0, 0, 4, 4]
    for name in DraftStepMetadata._fields:
        assert getattr(out, name).tolist() == want[name], name
