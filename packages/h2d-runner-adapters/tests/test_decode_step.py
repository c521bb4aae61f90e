"""DecodeStepInputs: one fused producer (compiled or numpy body) for a plain decode step.

* Equivalence over random decode sequences: the compiled body, the numpy body and the
  separate adapters it composes (SamplingInputs, TokenInputs, MhaDecodeInputs, published
  through the same combined group) give the same plans, counts, pinned source bytes,
  block-table stages, counters, destinations and first-consumer outputs, and all match a
  host oracle computed from the batch.
* Single-step parity of the compiled and numpy bodies on arbitrary bit patterns.
* Rejected batches: the same error (type and message) on both bodies, nothing published,
  nothing changed, and the producer runs again in the same epoch.
* Reentry and epoch checks of the fused producer; a deliberate second publication.
* Delayed source reuse (CUDA only).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import adapter_helpers as ah
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from block_tables import BlockTable, MissingPagesError
from h2d_core import (
    CountError,
    DeclarationError,
    EpochError,
    H2DBuffer,
    H2DRunnerState,
    ReentryError,
    StageResult,
)
from h2d_runner_adapters import (
    DECODE_STEP,
    GREEDY_TEMPERATURE,
    MHA_DECODE,
    QUERY_PREFIX,
    SAMPLING,
    SPEC_INDICES,
    TOKEN_IDS,
    BatchColumns,
    DecodeStepInputs,
    DecodeStepPlan,
    MhaDecodeInputs,
    PageRow,
    SamplingInputs,
    ScheduledBatch,
    StepShape,
    TokenInputs,
)

MAX_REQS = 8
MAX_TOKENS = 20  # below 3 * MAX_REQS: q=3 batches are capped by tokens, not requests
MAX_PAGES = 6
NUM_PAGES = 256
PREV_ROWS = 6  # rows of the previous step's sampled ids (prev_sample_row in [0, 6))
PREV_WIDTH = 2  # sampled ids per row: a q=3 deferred span takes 2, keeps its 3rd staged
PAGE_SIZES = [16, 12]  # a power of two (shift) and not (division)
BACKENDS = ["packed", "direct"]
INT32 = np.iinfo(np.int32)

#: the fused producer's members, in one fixed order (block tables last)
MEMBERS = ("temperatures", "top_ks", "top_ps", "input_ids", "decode_cu", "decode_src",
           "cu_seqlens_q", "positions", "slot_mapping", "context_lens", "kv_indptr",
           "block_tables")


# ---------------------------------------------------------------------------------- runners
@dataclass
class Side:
    """One way of producing a decode step: ``native`` / ``numpy`` (DecodeStepInputs with
    that body) or ``separate`` (the composed adapters, one producer call each)."""

    kind: str
    state: H2DRunnerState
    sampling: SamplingInputs
    tokens: TokenInputs
    decode: MhaDecodeInputs
    fused: DecodeStepInputs | None

    def prepare(self, batch: ScheduledBatch, padded: int | None,
                h2d_reason: str | None = None) -> DecodeStepPlan:
        if self.fused is not None:  # @h2d_producer takes h2d_reason (None: a first entry)
            return self.fused.prepare(batch, padded, h2d_reason=h2d_reason)  # type: ignore[call-arg]
        assert h2d_reason is None
        sp = self.sampling.prepare(batch)
        tp = self.tokens.prepare_ids(batch, padded)
        self.tokens.prepare_query_prefix(batch, padded)
        return DecodeStepPlan(sp, tp, self.decode.prepare(batch, padded))

    def members(self) -> list[H2DBuffer]:
        s, t, d = self.sampling, self.tokens, self.decode
        return [s.temperatures, s.top_ks, s.top_ps, t.input_ids, t.decode_cu, t.decode_src,
                t.cu_seqlens_q, d.positions, d.slot_mapping, d.context_lens, d.kv_indptr,
                d.block_tables]

    def counts(self) -> list[int | None]:
        return [self.state.count(b) for b in self.members()]

    def sources(self) -> list[bytes]:
        """Every member's whole current-slot pinned source, as bytes."""
        return [b.np.tobytes() for b in self.members()]


def build_side(kind: str, device: str, *, backend: str = "packed", page: int = 16,
               num_slots: int = 1, num_pages: int | None = NUM_PAGES) -> Side:
    # CPU: the reference scatter (the interpreted Triton scatter is covered by the h2d-kernels
    # suites and costs ~1 s per publication here); CUDA: the compiled one
    st_ = H2DRunnerState(device, backend=backend, num_slots=num_slots,
                         scatter="reference" if device == "cpu" else "auto")
    fused: DecodeStepInputs | None = None
    shape = StepShape(max_reqs=MAX_REQS, max_tokens=MAX_TOKENS, max_pages_per_req=MAX_PAGES,
                      page_size=page, num_pages=num_pages)
    if kind == "separate":
        sampling = SamplingInputs(st_, MAX_REQS)
        tokens = TokenInputs(st_, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS)
        decode = MhaDecodeInputs(st_, shape)
        st_.combine(DECODE_STEP, [SAMPLING, TOKEN_IDS, QUERY_PREFIX, MHA_DECODE])
    else:
        fused = DecodeStepInputs(st_, shape)
        sampling, tokens, decode = fused.sampling, fused.tokens, fused.decode
    st_.bind()
    for b in st_.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(ah.POISON)
    side = Side(kind, st_, sampling, tokens, decode, fused)
    assert [b.name for b in side.members()] == list(MEMBERS)
    return side


# ---------------------------------------------------------------------------------- batches
@dataclass
class Step:
    """A batch, its padding, and the page IDs its rows held when it was built."""

    batch: ScheduledBatch
    padded: int | None
    row_ids: list[list[int]]


def make_step(
    page: int,
    ctx: Sequence[int],
    rows: Sequence[PageRow],
    *,
    q: int = 1,
    qlens: Sequence[int] | None = None,
    padded: int | None = None,
    temps: np.ndarray | None = None,
    top_k: np.ndarray | None = None,
    top_p: np.ndarray | None = None,
    prev: np.ndarray | None = None,
    tokens: np.ndarray | None = None,
    drafts: np.ndarray | None = None,
) -> Step:
    n = len(ctx)
    ql = np.asarray(qlens if qlens is not None else [q] * n, np.int32)
    cols = BatchColumns(
        query_lens=ql,
        context_lens=np.asarray(ctx, np.int32),
        temperatures=temps if temps is not None else np.full(n, 0.7, np.float32),
        top_k=top_k if top_k is not None else np.full(n, -1, np.int32),
        top_p=top_p if top_p is not None else np.ones(n, np.float32),
        prev_sample_rows=prev if prev is not None else np.full(n, -1, np.int32),
        token_ids=(tokens if tokens is not None
                   else np.arange(1, int(ql.sum()) + 1, dtype=np.int32) * 7),
        num_drafts=drafts if drafts is not None else np.zeros(n, np.int32),
    )
    batch = ScheduledBatch((), False, page, padded_size=padded, given_columns=cols,
                           given_block_tables=list(rows))
    return Step(batch, padded, [[int(x) for x in r] for r in rows])


class Population:
    """MAX_REQS requests whose page rows evolve over steps: BlockTable append lineages
    (most rows, a quarter of them appending a page each step, some through lineage
    copies), mappings replaced or modified in place (new versions), and unversioned
    list/array rows rebuilt on growth."""

    def __init__(self, seed: int, page: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.page = page
        self.ctx: list[int] = []
        self.rows: list[PageRow] = []
        for _ in range(MAX_REQS):
            c, r = self._fresh()
            self.ctx.append(c)
            self.rows.append(r)
        self.last: tuple[np.ndarray, np.ndarray, int | None] | None = None

    def _pages(self, k: int) -> list[int]:
        return [int(x) for x in self.rng.integers(0, NUM_PAGES, k)]

    def _row(self, ids: list[int]) -> PageRow:
        r = self.rng.random()
        if r < 0.7:
            return BlockTable(ids)
        if r < 0.85:
            return list(ids)
        return np.asarray(ids, np.int32)

    def _fresh(self) -> tuple[int, PageRow]:
        used = int(self.rng.integers(1, 4))
        # >= 3 tokens, so every q in 1..3 has non-negative positions
        ctx = int(self.rng.integers((used - 1) * self.page + 3, used * self.page + 1))
        return ctx, self._row(self._pages(used))

    def _append(self, i: int, k: int) -> None:
        row = self.rows[i]
        ids = self._pages(k)
        if isinstance(row, BlockTable):
            if self.rng.random() < 0.2:
                row = row.lineage_copy()  # a decoder copy that keeps the lineage
            row.append(ids)
            self.rows[i] = row
        elif isinstance(row, np.ndarray):
            self.rows[i] = np.concatenate((row, np.asarray(ids, np.int32)))
        else:
            self.rows[i] = [*row, *ids]

    def _grow(self, order: np.ndarray, qlens: np.ndarray, steady: bool) -> None:
        rng = self.rng
        for i, q in zip(order.tolist(), qlens.tolist(), strict=True):
            ctx = self.ctx[i] + q
            need = -(-ctx // self.page)
            if need > MAX_PAGES:  # finished: a new request takes the row
                self.ctx[i], self.rows[i] = self._fresh()
                continue
            if need > len(self.rows[i]):
                self._append(i, need - len(self.rows[i]))
            self.ctx[i] = ctx
        if steady:
            return
        for i in rng.choice(MAX_REQS, MAX_REQS // 4, replace=False).tolist():
            if len(self.rows[i]) < MAX_PAGES:
                self._append(i, 1)  # a page allocated ahead of need
        if rng.random() < 0.2:
            i = int(rng.integers(MAX_REQS))
            row = self.rows[i]
            if isinstance(row, BlockTable) and rng.random() < 0.5:
                row[int(rng.integers(len(row)))] = self._pages(1)[0]  # modified: new version
            else:
                self.rows[i] = self._row(self._pages(len(row)))  # replaced mapping

    def step(self, index: int) -> Step:
        rng = self.rng
        steady = self.last is not None and index % 5 == 4
        if steady:  # same shape as the last step: the table is often reusable
            assert self.last is not None
            qlens, order, padded = self.last
        else:
            q = 1 if index == 7 else int(rng.integers(1, 4))  # 7: a full batch
            cap = min(MAX_REQS, MAX_TOKENS // q)
            n = 0 if index == 3 else cap if index == 7 else int(rng.integers(0, cap + 1))
            order = rng.permutation(MAX_REQS)[:n] if rng.random() < 0.3 else np.arange(n)
            padded = None if rng.random() < 0.4 else int(rng.integers(n, cap + 1))
            if index in (5, 6):  # uneven widths, eager and padded, in every sequence
                q, n, padded = 3, MAX_TOKENS // 3, None if index == 5 else MAX_TOKENS // 3
                order = np.arange(n)
            # uneven widths (TBO ubatches, ragged verify) in a third of the steps
            qlens = (rng.integers(1, q + 1, n) if rng.random() < 0.35 or index in (5, 6)
                     else np.full(n, q)).astype(np.int32)
            if index in (5, 6):
                qlens[0] = 1 if qlens[1:].min(initial=3) > 1 else 3
        self.last = (qlens, order, padded)
        self._grow(order, qlens, steady)
        n = order.size
        if rng.random() < 0.5:  # uniform filters stay CPU scalars
            top_k = np.full(n, rng.choice([-1, 0, 5]), np.int32)
            top_p = np.full(n, rng.choice([1.0, 0.9]), np.float32)
        else:
            top_k = rng.choice([-1, 3, 7], n).astype(np.int32)
            top_p = rng.choice([1.0, 0.8, 0.95], n).astype(np.float32)
        # finite only (<= 0 is greedy): NaN and infinities are refused (test_bad_inputs_tokens)
        temps = rng.choice(np.array([0.0, 0.7, 1.3, -1.0], np.float32), n)
        deferred = rng.random(n) < 0.5
        # rows of the previous step's PREV_ROWS sampled ids (a row past them is refused:
        # test_first_hour_traps)
        prev = np.where(deferred, rng.integers(0, PREV_ROWS, n), -1).astype(np.int32)
        return make_step(
            self.page, [self.ctx[i] for i in order.tolist()],
            [self.rows[i] for i in order.tolist()], qlens=qlens, padded=padded, temps=temps,
            top_k=top_k, top_p=top_p, prev=prev,
            tokens=rng.integers(1, 50_000, int(qlens.sum())).astype(np.int32),
            drafts=rng.integers(0, 3, n).astype(np.int32))


# ----------------------------------------------------------------------------------- oracle
def expected(step: Step, page: int) -> dict[str, np.ndarray]:
    """Host oracle: the counted prefix of every member the step publishes (top-k/top-p
    only when per request), and the block-table rows ``[0, padded)``."""
    cols = step.batch.columns
    n = int(cols.query_lens.size)
    qlens = [int(x) for x in cols.query_lens]
    q = max(qlens, default=1)  # the graph grid's width: the widest query
    p = n if step.padded is None else step.padded
    ctx = [int(c) for c in cols.context_lens]
    t = cols.temperatures
    cu = [0]
    for x in qlens:
        cu.append(cu[-1] + x)
    pad_tokens = 0 if step.padded is None else p * q - cu[-1]
    out: dict[str, np.ndarray] = {
        # NaN stays NaN with its bits; everything at or below the greedy marker becomes it
        "temperatures": np.where(np.isnan(t) | (t > GREEDY_TEMPERATURE), t,
                                 np.float32(GREEDY_TEMPERATURE)).astype(np.float32),
        "input_ids": np.concatenate((cols.token_ids, np.zeros(pad_tokens, np.int32))),
        "decode_cu": np.asarray([cu[min(i, n)] for i in range(p + 1)], np.int32),
        "decode_src": np.concatenate((cols.prev_sample_rows, np.full(p - n, -1, np.int32))),
        "cu_seqlens_q": np.asarray([cu[min(i, n)] for i in range(p + 1)], np.int32),
    }
    if cols.top_k.tobytes() != cols.top_k[:1].tobytes() * n:
        out["top_ks"] = cols.top_k.copy()
    if cols.top_p.tobytes() != cols.top_p[:1].tobytes() * n:
        out["top_ps"] = cols.top_p.copy()
    pos: list[int] = []
    slots: list[int] = []
    pages: list[int] = []
    for i, (c, w) in enumerate(zip(ctx, qlens, strict=True)):
        pages.append(-(-c // page))
        for j in range(w):
            x = c - w + j
            pos.append(x)
            slots.append(step.row_ids[i][x // page] * page + x % page)
    out["positions"] = np.asarray(pos + [0] * pad_tokens, np.int64)
    out["slot_mapping"] = np.asarray(slots + [-1] * pad_tokens, np.int64)
    out["context_lens"] = np.asarray(ctx + [0] * (p - n), np.int32)
    indptr = [0]
    for k in pages:
        indptr.append(indptr[-1] + k)
    out["kv_indptr"] = np.asarray(indptr + [indptr[-1]] * (p - n), np.int32)
    table = np.zeros((p, MAX_PAGES), np.int32)
    for i, ids in enumerate(step.row_ids):
        table[i, : len(ids)] = ids
    out["block_tables"] = table
    return out


def expected_kv_indices(step: Step, page: int) -> list[int]:
    ctx = step.batch.columns.context_lens.tolist()
    return [x for ids, c in zip(step.row_ids, ctx, strict=True) for x in ids[: -(-c // page)]]


def expected_assembled(step: Step, prev: np.ndarray, page: int) -> list[int]:
    """``input_ids[:padded_tokens]`` after token assembly from ``prev`` [PREV_ROWS, W]."""
    cols = step.batch.columns
    ids = expected(step, page)["input_ids"].tolist()
    start = 0
    for q, s in zip(cols.query_lens.tolist(), cols.prev_sample_rows.tolist(), strict=True):
        if 0 <= s < prev.shape[0]:
            for j in range(min(q, prev.shape[1])):
                ids[start + j] = int(prev[s, j])
        start += q
    return ids


def check_sources(side: Side, step: Step, page: int) -> None:
    """Counts and pinned source bytes of the step, against the oracle."""
    exp = expected(step, page)
    counts = dict(zip(MEMBERS, side.counts(), strict=True))
    bufs = dict(zip(MEMBERS, side.members(), strict=True))
    for name in MEMBERS[:-1]:
        want = exp.get(name)
        assert counts[name] == (None if want is None else want.size), (side.kind, name)
        if want is not None:
            assert bufs[name].np[: want.size].tobytes() == want.tobytes(), (side.kind, name)
    table = exp["block_tables"]
    assert bufs["block_tables"].np[: len(table)].tobytes() == table.tobytes(), side.kind


def check_destinations(side: Side, step: Step, page: int, *, assembled: bool = False) -> None:
    """The published prefix of every member on the device (after sync), against the oracle.
    ``input_ids`` is checked as published unless token assembly ran (checked by the caller).
    """
    exp = expected(step, page)
    bufs = dict(zip(MEMBERS, side.members(), strict=True))
    for name, want in exp.items():
        if name == "input_ids" and assembled:
            continue
        got = bufs[name].gpu[: len(want)].cpu().numpy()
        assert got.tobytes() == want.tobytes(), (side.kind, name)


# ------------------------------------------------------------------------ 1. equivalence
@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_bodies_equal_separate_adapters_over_decode_sequences(
    device: str, backend: str, page: int
) -> None:
    ah.need_kernels(device)
    slots = 2 if page == 12 else 1  # pipeline slots: each has its own sources and snapshot
    sides = [build_side(k, device, backend=backend, page=page, num_slots=slots)
             for k in ("native", "separate")]
    pop = Population(seed=100 * page + len(backend), page=page)
    seen: dict[str, set[object]] = {"stage": set(), "q": set(), "n": set(), "pad": set(),
                                    "ragged": set()}
    for index in range(36):
        step = pop.step(index)
        prev_np = (np.arange(PREV_ROWS * PREV_WIDTH, dtype=np.int32).reshape(
            PREV_ROWS, PREV_WIDTH) + 1000 * (index + 1))
        plans: list[DecodeStepPlan] = []
        outputs: list[tuple[list[int], list[int]]] = []
        for side in sides:
            st_ = side.state
            assert st_.begin() == index % slots
            plan = side.prepare(step.batch, step.padded)
            plans.append(plan)
            check_sources(side, step, page)
            st_.publish(DECODE_STEP)
            prev = torch.from_numpy(prev_np).to(device)
            ids = side.tokens.assemble(plan.tokens, prev)
            kv = side.decode.generate_kv_indices(plan.decode)
            st_.finish()
            ah.sync(device)
            check_destinations(side, step, page, assembled=True)
            outputs.append((ids.tolist(), kv[: plan.decode.num_pages].tolist()))
        a, c = sides
        # plans: the fused plan equals the separate adapters' plans, stage included
        assert plans[0] == plans[1], index
        plan = plans[1]
        n = step.batch.num_reqs
        p = n if step.padded is None else step.padded
        qlens = step.batch.columns.query_lens
        q = int(qlens.max()) if n else 1
        # the widest query comes from the CPU lengths
        assert (plan.tokens.padded_reqs, plan.decode.max_query_len) == (p, q)
        assert plan.decode.num_tokens == int(qlens.sum())
        assert plan.decode.padded_tokens == (int(qlens.sum()) if step.padded is None
                                             else p * q)
        assert plan.tokens.num_draft_tokens == int(step.batch.columns.num_drafts.sum())
        # counts, pinned source bytes (counted prefixes and beyond), table state, counters
        assert a.counts() == c.counts(), index
        assert a.sources() == c.sources(), index
        revs = {s.decode.tables.prepared_revision for s in sides}
        assert len(revs) == 1, index
        recs = [s.decode.tables.published for s in sides]
        assert all(r is not None for r in recs)
        # row keys (version, length) of the batch rows; each side pads with its own row
        assert len({(r.revision, r.rows, r.keys[:n].tobytes()) for r in recs if r}) == 1, index
        counters = [s.state.counters(DECODE_STEP).as_dict() for s in sides]
        assert counters[0] == counters[1], index
        # destinations, whole (tails included), and the first consumers' outputs
        for name, x, z in zip(MEMBERS, a.members(), c.members(), strict=True):
            raw = [t.gpu.cpu().view(-1).view(torch.uint8) for t in (x, z)]
            assert torch.equal(raw[0], raw[1]), (index, name)
        assert outputs[0] == outputs[1], index
        assert outputs[0][0] == expected_assembled(step, prev_np, page), index
        assert outputs[0][1] == expected_kv_indices(step, page), index
        for s in sides:
            assert torch.equal(s.decode.kv_indices.cpu(), c.decode.kv_indices.cpu())
        seen["stage"].add(plan.decode.table_stage)
        seen["q"].add(q)
        seen["n"].add(n)
        seen["pad"].add(p > n)
        seen["ragged"].add((n > 0 and int(qlens.min()) != q, step.padded is None))
    # the sequence exercised what it is meant to (a table is reused only by the slot whose
    # snapshot the GPU holds; changed spans travel only inside a packed DMA)
    stages = {StageResult.WHOLE} | ({StageResult.REUSED} if slots == 1 else set())
    if backend == "packed":
        stages.add(StageResult.PARTIAL)
    assert stages <= seen["stage"], seen
    # uneven widths, eager and padded to the graph grid
    assert {(True, True), (True, False)} <= seen["ragged"], seen["ragged"]
    assert seen["q"] == {1, 2, 3} and {0, MAX_REQS} <= seen["n"] and seen["pad"] == {
        True, False}, seen


# ------------------------------------------------------------- single-step parity (bits)
def _f32(bits: list[int]) -> np.ndarray:
    return np.asarray(bits, np.uint32).view(np.float32)


@st.composite
def _steps(draw: st.DrawFn) -> tuple[int, int | None, list[Step]]:
    """A page size and two consecutive steps over the same rows (the second appends a page
    to lineage copies of some versioned rows): any finite float32 bit pattern (-0.0,
    subnormals, the greedy marker's neighbours) for temperatures, any float32 in (0, 1]
    for top-p, any int32 >= -1 for top-k and sources, any int32 for token ids (values
    outside those ranges are refused: test_bad_inputs_tokens)."""
    page = draw(st.sampled_from(PAGE_SIZES))
    # no pool limit: any non-negative int32 page ID (slots past int32 wrap as numpy's do)
    pool = draw(st.sampled_from([NUM_PAGES, NUM_PAGES, None]))
    ids_st = st.integers(0, NUM_PAGES - 1) if pool else st.integers(0, int(INT32.max))
    q = draw(st.integers(1, 3))
    cap = min(MAX_REQS, MAX_TOKENS // q)
    n = draw(st.integers(0, cap))
    padded = draw(st.none() | st.integers(n, cap))
    i32 = st.integers(int(INT32.min), int(INT32.max))
    from_minus_one = st.integers(-1, int(INT32.max))
    # bit patterns 1 .. 0x3F800000 are the positive float32s up to 1.0, in order
    unit = st.integers(1, 0x3F800000)
    rows: list[PageRow] = []
    lengths: list[int] = []
    for _ in range(n):
        length = draw(st.integers(1, MAX_PAGES - 1))
        ids = draw(st.lists(ids_st, min_size=length, max_size=length))
        kind = draw(st.sampled_from(["table", "table", "list", "array"]))
        rows.append(BlockTable(ids) if kind == "table" else
                    np.asarray(ids, np.int32) if kind == "array" else ids)
        lengths.append(length)
    grows = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    steps: list[Step] = []
    for k in range(2):
        if k:  # the decoder's copy of a growing row keeps its lineage; step 0 keeps its own
            rows = list(rows)
            for i, g in enumerate(grows):
                row = rows[i]
                if g and isinstance(row, BlockTable):
                    row = rows[i] = row.lineage_copy()
                    row.append_one(draw(ids_st))
                    lengths[i] += 1
        ctx = [draw(st.integers(q, length * page)) for length in lengths]
        finite = st.integers(0, 2**32 - 1).filter(lambda b: (b >> 23) & 0xFF != 0xFF)
        temps = _f32(draw(st.lists(st.one_of(
            finite, st.sampled_from([0, 0x80000000, 0x2EDBE6FF, 0x2EDBE6FE, 0x2EDBE700])),
            min_size=n, max_size=n)))
        if draw(st.booleans()):
            top_k = np.full(n, draw(from_minus_one), np.int32)
            top_p = _f32([draw(unit)] * n)
        else:
            top_k = np.asarray(draw(st.lists(from_minus_one, min_size=n, max_size=n)),
                               np.int32)
            top_p = _f32(draw(st.lists(unit, min_size=n, max_size=n)))
        steps.append(make_step(
            page, ctx, rows, q=q, padded=padded, temps=temps, top_k=top_k, top_p=top_p,
            prev=np.asarray(draw(st.lists(st.integers(-1, PREV_ROWS - 1), min_size=n,
                                          max_size=n)), np.int32),
            tokens=np.asarray(draw(st.lists(i32, min_size=n * q, max_size=n * q)), np.int32),
            drafts=np.asarray(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)),
                              np.int32)))
    return page, pool, steps


@settings(max_examples=200, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=_steps())
def test_fused_body_matches_separate_adapters_bit_for_bit(
    case: tuple[int, int | None, list[Step]],
) -> None:
    """Whole sources (so nothing is written outside the counted prefixes either), counts,
    plans and snapshot revisions are equal for the fused step and the three adapters it
    composes, run separately, and match the oracle (within a pool small enough that no KV
    slot passes int32)."""
    page, pool, steps = case
    sides = [build_side(k, "cpu", backend="packed", page=page, num_pages=pool)
             for k in ("native", "separate")]
    for step in steps:
        plans = []
        for side in sides:
            side.state.begin()
            plans.append(side.prepare(step.batch, step.padded))
            if pool is not None:
                check_sources(side, step, page)
            side.state.finish()
        a, b = sides
        assert plans[0] == plans[1]
        assert a.counts() == b.counts()
        assert a.sources() == b.sources()
        assert a.decode.tables.prepared_revision == b.decode.tables.prepared_revision


# ----------------------------------------------------------------- 2. rejected batches
def _rows(*lengths: int) -> list[PageRow]:
    return [BlockTable(range(10 * i, 10 * i + k)) for i, k in enumerate(lengths)]


def _bad_steps(page: int) -> dict[str, tuple[Step, type[Exception], str]]:
    """Each rejected batch, the exception type it must raise and a message fragment (a
    regular expression naming the rule, the row or the buffer)."""
    c = page  # one full page of context
    return {
        "padded_below_requests": (
            make_step(page, [c, c, c], _rows(1, 1, 1), padded=2),
            CountError, r"padded=2 must be an int >= the batch's 3 requests"),
        "padded_not_an_int": (
            make_step(page, [c, c], _rows(1, 1), padded=True),
            CountError, r"padded=True must be an int"),
        "missing_pages": (
            make_step(page, [c, 2 * c + 1, c], _rows(1, 1, 1)),
            MissingPagesError, r"row 1: the request span needs 3 pages but the row holds 1"),
        "requests_over_max_reqs": (
            make_step(page, [c] * (MAX_REQS + 1), _rows(*[1] * (MAX_REQS + 1))),
            CountError, r"temperatures|max_reqs|capacity"),
        "padded_over_max_reqs": (
            make_step(page, [c, c], _rows(1, 1), padded=MAX_REQS + 1),
            CountError, r"max_reqs|capacity"),
        "tokens_over_max_tokens": (
            make_step(page, [c] * 7, _rows(*[1] * 7), q=3),  # 21 tokens > MAX_TOKENS
            CountError, r"input_ids|max_tokens|capacity"),
    }


@dataclass(frozen=True)
class Observed:
    """What a rejected call must leave as it was."""

    publications: int
    published: bool
    counts: tuple[int | None, ...]
    sources: tuple[bytes, ...]
    revision: int
    record: tuple[int, int, int, bytes] | None


def observe(side: Side) -> Observed:
    st_ = side.state
    rec = side.decode.tables.published
    return Observed(
        st_.counters(DECODE_STEP).publications, st_.is_published(DECODE_STEP),
        tuple(side.counts()), tuple(side.sources()), side.decode.tables.prepared_revision,
        None if rec is None else (rec.slot, rec.revision, rec.rows, rec.keys.tobytes()))


def _good_steps(page: int) -> tuple[Step, Step]:
    first = make_step(page, [page + 1, 3, 2 * page], _rows(2, 1, 2), padded=4,
                      prev=np.asarray([-1, 2, -1], np.int32))
    retry = make_step(page, [2, page + 2], _rows(1, 2), q=2, padded=3,
                      top_k=np.asarray([3, 5], np.int32))
    return first, retry


def _reject(kind: str, device: str, case: str, page: int) -> tuple[Side, Exception, Observed,
                                                                   Observed, Step]:
    """Publish a good step, open the next epoch, feed the rejected batch; return the side,
    the error, what was observed before and after it, and the step to retry with."""
    side = build_side(kind, device, page=page)
    st_ = side.state
    first, retry = _good_steps(page)
    bad, _, _ = _bad_steps(page)[case]
    st_.begin()
    side.prepare(first.batch, first.padded)
    st_.publish(DECODE_STEP)
    st_.finish()
    st_.begin()
    before = observe(side)
    with pytest.raises(Exception) as info:
        side.prepare(bad.batch, bad.padded)
    return side, info.value, before, observe(side), retry


CASES = list(_bad_steps(16))


@pytest.mark.parametrize("case", CASES)
def test_rejected_step_same_error_nothing_published_then_retry(device: str, case: str) -> None:
    page = 12
    _, exc_type, fragment = _bad_steps(page)[case]
    errors: dict[str, Exception] = {}
    for kind in ("native",):
        side, err, before, after, retry = _reject(kind, device, case, page)
        errors[kind] = err
        assert (after.publications, after.published) == (before.publications, False), kind
        # the failed producer was rolled back: it runs again in the same epoch
        st_ = side.state
        plan = side.prepare(retry.batch, retry.padded)
        check_sources(side, retry, page)
        st_.publish(DECODE_STEP)
        st_.finish()
        ah.sync(device)
        assert st_.counters(DECODE_STEP).publications == before.publications + 1
        assert plan.decode.padded_reqs == 3 and plan.sampling.per_request_top_k
        check_destinations(side, retry, page)
    for kind, err in errors.items():
        assert isinstance(err, exc_type), (kind, type(err), err)
        assert re.search(fragment, str(err)), (kind, str(err))
    a = errors["native"]
    if isinstance(a, MissingPagesError):
        assert a.row == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["native"])
@pytest.mark.parametrize("case", CASES)
def test_rejected_step_changes_nothing(device: str, case: str, kind: str) -> None:
    """A rejected fused call leaves counts, pinned sources, the prepared table revision and
    the published-table record exactly as they were (one call, one validation)."""
    _, _, before, after, _ = _reject(kind, device, case, 12)
    assert after.counts == before.counts, [
        (m, x, y) for m, x, y in zip(MEMBERS, before.counts, after.counts, strict=True)
        if x != y]
    assert after.sources == before.sources, [
        m for m, x, y in zip(MEMBERS, before.sources, after.sources, strict=True) if x != y]
    assert (after.revision, after.record) == (before.revision, before.record)


# ------------------------------------------------------------------------- from_adapters
def test_from_adapters_composes_caller_declared_adapters(device: str) -> None:
    """Adapters the caller declared (token inputs with speculative buffers, which ride in
    the same group) produce and publish the same step under a group of the caller's name:
    one publication."""
    page = 16
    st_ = H2DRunnerState(device, backend="packed",
                         scatter="reference" if device == "cpu" else "auto")
    sampling = SamplingInputs(st_, MAX_REQS)
    tokens = TokenInputs(st_, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS, max_drafts=2)
    decode = MhaDecodeInputs(st_,
                             StepShape(max_reqs=MAX_REQS, max_tokens=MAX_TOKENS,
                                       max_pages_per_req=MAX_PAGES, page_size=page,
                                       num_pages=NUM_PAGES))
    fused = DecodeStepInputs.from_adapters(sampling, tokens, decode, group="plain_decode")
    st_.bind()
    assert fused.group == "plain_decode"
    assert st_.plan("plain_decode").producer_groups == (SAMPLING, TOKEN_IDS, QUERY_PREFIX,
                                                        SPEC_INDICES, MHA_DECODE)
    side = Side("native", st_, sampling, tokens, decode, fused)
    step = make_step(page, [5, page + 3, 40], _rows(1, 2, 3), q=3, padded=5,
                     drafts=np.full(3, 2, np.int32))
    st_.begin()
    plan = fused.prepare(step.batch, step.padded)
    check_sources(side, step, page)
    tokens.prepare_spec_indices(step.batch)
    st_.publish("plain_decode")
    st_.finish()
    ah.sync(device)
    assert (plan.tokens.num_draft_tokens, plan.decode.padded_tokens) == (6, 15)
    check_destinations(side, step, page)
    assert tokens.target_logits_indices.gpu[:6].tolist() == [0, 1, 3, 4, 6, 7]
    assert tokens.bonus_logits_indices.gpu[:3].tolist() == [2, 5, 8]
    c = st_.counters("plain_decode")
    assert (c.publications, c.dmas, c.scatters, c.direct_copies) == (1, 1, 1, 0)


def test_from_adapters_rejects_foreign_or_prefixed_adapters() -> None:
    one, other = H2DRunnerState("cpu"), H2DRunnerState("cpu")
    tokens = TokenInputs(one, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS)
    shape = StepShape(max_reqs=MAX_REQS, max_tokens=MAX_TOKENS, max_pages_per_req=MAX_PAGES,
                      page_size=16)
    decode = MhaDecodeInputs(one, shape)
    with pytest.raises(DeclarationError, match=r"must be declared on the same H2DRunnerState"):
        DecodeStepInputs.from_adapters(SamplingInputs(other, MAX_REQS), tokens, decode)
    sampling = SamplingInputs(one, MAX_REQS)
    ubatch = MhaDecodeInputs(one, shape, prefix="ub0_")
    with pytest.raises(DeclarationError, match=r"the decode adapter publishes "
                                               r"'ub0_mha_decode'; the fused step produces "
                                               r"the plain 'mha_decode' group"):
        DecodeStepInputs.from_adapters(sampling, tokens, ubatch)
    # neither rejected call combined anything: the name and the groups are still free
    one.combine(DECODE_STEP, [SAMPLING, TOKEN_IDS, QUERY_PREFIX, MHA_DECODE])
    one.bind()
    assert one.plan(DECODE_STEP).producer_groups == (SAMPLING, TOKEN_IDS, QUERY_PREFIX,
                                                     MHA_DECODE)


# ------------------------------------------------------------- 3. reentry and epochs
@pytest.mark.parametrize("kind", ["native"])
def test_second_prepare_in_an_epoch_needs_a_reason(device: str, kind: str) -> None:
    page = 16
    side = build_side(kind, device, page=page)
    st_ = side.state
    first, retry = _good_steps(page)
    st_.begin()
    side.prepare(first.batch, first.padded)
    before = observe(side)
    with pytest.raises(ReentryError, match=r"entered again in epoch 1 .*h2d_reason"):
        side.prepare(retry.batch, retry.padded)
    assert observe(side) == before  # rejected before the producer ran: sources intact
    st_.publish(DECODE_STEP)
    ah.sync(device)
    check_destinations(side, first, page)
    # after publication too, and a composed producer counts as the fused one's group
    with pytest.raises(ReentryError, match=r"entered again"):
        side.prepare(retry.batch, retry.padded)
    with pytest.raises(ReentryError, match=r"\['sampling'\] entered again"):
        side.sampling.prepare(retry.batch)
    assert st_.counters(DECODE_STEP).publications == 1
    # a deliberate second publication: acquire, rewrite, publish again
    plan = side.prepare(retry.batch, retry.padded, h2d_reason="replanned step")
    check_sources(side, retry, page)
    st_.publish(DECODE_STEP)
    st_.finish()
    ah.sync(device)
    assert plan.tokens.padded_reqs == 3
    counters = st_.counters(DECODE_STEP)
    assert (counters.publications, st_.counters(SAMPLING).second_publications) == (2, 1)
    check_destinations(side, retry, page)


@pytest.mark.parametrize("kind", ["native"])
def test_prepare_outside_an_epoch_is_rejected(device: str, kind: str) -> None:
    page = 16
    side = build_side(kind, device, page=page)
    first, retry = _good_steps(page)
    before = observe(side)
    with pytest.raises(EpochError, match=r"producer of \['sampling', 'token_ids', "
                                         r"'query_prefix', 'mha_decode'\] outside an epoch"):
        side.prepare(first.batch, first.padded)
    assert observe(side) == before
    st_ = side.state
    st_.begin()
    side.prepare(first.batch, first.padded)
    st_.publish(DECODE_STEP)
    st_.finish()
    after_finish = observe(side)
    with pytest.raises(EpochError, match=r"outside an epoch: call begin\(\)"):
        side.prepare(retry.batch, retry.padded)
    assert observe(side) == after_finish
    ah.sync(device)
    check_destinations(side, first, page)


# -------------------------------------------------------------- 4. delayed source reuse
@pytest.mark.parametrize("kind", ["native"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_delayed_source_reuse_keeps_what_each_step_published(
    device: str, backend: str, kind: str
) -> None:
    """Two slots; each step's publication waits behind a busy GPU, and the next two steps
    rewrite the sources (the second one the same slot's): a GPU-side copy taken right
    after each publication still holds what that step published."""
    if device != "cuda":
        pytest.skip("delayed source reuse needs asynchronous copies (CUDA)")
    ah.need_kernels(device)
    page = 12
    side = build_side(kind, device, backend=backend, page=page, num_slots=2)
    st_ = side.state
    pop = Population(seed=7, page=page)
    taken: list[tuple[Step, dict[str, torch.Tensor], torch.Tensor]] = []
    for index in range(8):
        step = pop.step(index)
        slot = st_.begin()
        assert slot == index % 2
        plan = side.prepare(step.batch, step.padded)
        # ~10 ms of GPU work the DMA queues behind: the host, ~1 ms a step, runs two steps
        # ahead and reaches this slot's sources again while its DMA has not read them
        torch.cuda._sleep(20_000_000)
        st_.publish(DECODE_STEP)
        kv = side.decode.generate_kv_indices(plan.decode)
        copies = {b.name: b.gpu.clone() for b in side.members()}  # ordered on the stream
        taken.append((step, copies, kv[: plan.decode.num_pages].clone()))
        st_.finish()
    torch.cuda.synchronize()
    for index, (step, copies, kv) in enumerate(taken):
        for name, want in expected(step, page).items():
            got = copies[name][: len(want)].cpu().numpy()
            assert got.tobytes() == want.tobytes(), (index, name)
        assert kv.tolist() == expected_kv_indices(step, page), index


@pytest.mark.parametrize("kind", ["native"])
def test_layout_reads_only_the_columns_it_checked(kind: str) -> None:
    """The table's prepare runs Python code (here an unversioned row's ``__len__``) between
    the layout's plan and write; a context changed meanwhile must not steer what is written
    (the layout works from a copy taken at plan; before that fix a context changed this
    way read the table past the row's pages)."""
    page = 16
    side = build_side(kind, "cpu", page=page)
    assert side.fused is not None
    ctx = np.array([page], np.int32)  # one page; the row holds one page

    class Row(list):  # type: ignore[type-arg]
        def __len__(self) -> int:
            ctx[0] = page * MAX_PAGES + 1  # would need more pages than a row holds
            return list.__len__(self)

    cols = BatchColumns(
        query_lens=np.array([1], np.int32), context_lens=ctx,
        temperatures=np.ones(1, np.float32), top_k=np.full(1, -1, np.int32),
        top_p=np.ones(1, np.float32), prev_sample_rows=np.full(1, -1, np.int32),
        token_ids=np.array([5], np.int32), num_drafts=np.zeros(1, np.int32))
    batch = ScheduledBatch(requests=(), is_prefill=False, page_size=page,
                           given_columns=cols, given_block_tables=[Row([7])])
    side.state.begin()
    plan = side.fused.prepare(batch)
    assert ctx[0] == page * MAX_PAGES + 1  # the callback did run and change the column
    assert plan.decode.num_pages == 1
    d = side.decode
    assert d.positions.np[0] == page - 1  # from the checked context
    assert d.slot_mapping.np[0] == 7 * page + page - 1  # the row's only page
    assert d.context_lens.np[0] == page and d.kv_indptr.np[:2].tolist() == [0, 1]
    side.state.publish(DECODE_STEP)
    side.state.finish()
