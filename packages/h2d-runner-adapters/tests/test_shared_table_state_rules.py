"""Every paged adapter goes through the shared block-table state (spec: "Shared block-table
preparation"): MLA, V4.1 decode, V4 prefill, ordinary prefill and backends derived from the
MHA/MLA adapters stage their tables with ``BlockTableState.stage`` and publish what it
decided, so an unchanged step omits the table (reuse), one appended page travels as a
changed span (partial), and a replaced batch is sent whole. Each step also checks the GPU
table against the rows and that nothing past the staged rows moved."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import adapter_helpers as ah
import numpy as np
import pytest
import torch
from publication_checks import check_tails, dest_copies, published_counts

from block_tables import BlockTable
from h2d_core import (
    BlockTableState,
    DeclarationError,
    H2DRunnerState,
    StageResult,
    block_table_state,
)
from h2d_runner_adapters import (
    V4_BLOCK,
    BatchColumns,
    MhaDecodeInputs,
    MlaDecodeInputs,
    PagedInputs,
    PrefillInputs,
    RequestSpan,
    ScheduledBatch,
    StepShape,
    V41MetadataInputs,
)

PAGE = 4
#: narrow rows (4 pages) so that replacing every real row changes most of the table's
#: bytes (past the partial-publication share) while one appended page changes one cell
WIDTH = 4
DUMMY_SLOT, DUMMY_BLOCK = 7, 99


class DerivedMha(MhaDecodeInputs):
    """A backend that adds a member and a consumer but inherits MHA's preparation."""

    def __init__(self, state: H2DRunnerState, shape: StepShape, **kw: Any) -> None:
        super().__init__(state, shape, **kw)
        self.window_ends = state.buffer("derived_window_ends", (shape.max_reqs,), torch.int32,
                                        group=self.group)

    def window_end(self) -> torch.Tensor:
        return self.window_ends.gpu


class DerivedMla(MlaDecodeInputs):
    """A sparse-MLA-like backend: its own group name, MLA's preparation unchanged."""

    def sparse_prefix(self) -> torch.Tensor | None:
        return self.sparse_kv_indptr.gpu if self.sparse_kv_indptr is not None else None


def _columns(q: np.ndarray, ctx: list[int]) -> BatchColumns:
    n = q.size
    return BatchColumns(
        query_lens=q, context_lens=np.asarray(ctx, np.int32),
        temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
        top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
        token_ids=np.zeros(int(q.sum()), np.int32), num_drafts=np.zeros(n, np.int32))


@dataclass
class Case:
    state: H2DRunnerState
    adapter: PagedInputs
    page: int
    padded: int | None
    pad_row: list[int]
    #: (context lengths, rows, publish the table?) -> the stage the producer reported
    produce: Callable[[list[int], list[BlockTable], bool], str]


def _decode(a: MhaDecodeInputs, padded: int) -> Callable[[list[int], list[BlockTable], bool],
                                                           str]:
    def produce(ctx: list[int], rows: list[BlockTable], _: bool) -> str:
        batch = ScheduledBatch((), False, a.page_size, given_columns=_columns(
            np.ones(len(ctx), np.int32), ctx), given_block_tables=rows)
        return a.prepare(batch, padded).table_stage
    return produce


def build(kind: str, device: str) -> Case:
    st = H2DRunnerState(device, scatter=ah.scatter_for(device))
    shape = StepShape(max_reqs=4, max_tokens=16, max_pages_per_req=WIDTH, page_size=PAGE,
                      num_pages=200)
    if kind in ("mha", "mla", "derived_mha", "derived_mla"):
        cls = {"mha": MhaDecodeInputs, "mla": MlaDecodeInputs, "derived_mha": DerivedMha,
               "derived_mla": DerivedMla}[kind]
        extra = {"index_topk": 6} if kind == "derived_mla" else {}
        dec: MhaDecodeInputs = cls(st, shape, **extra)
        case = Case(st, dec, PAGE, 4, [0] * WIDTH, _decode(dec, 4))
    elif kind == "prefill":
        pre = PrefillInputs(st, shape)

        def produce(ctx: list[int], rows: list[BlockTable], publish: bool) -> str:
            q = np.minimum(np.asarray(ctx, np.int32), 3)
            batch = ScheduledBatch((), True, PAGE, given_columns=_columns(q, ctx),
                                   given_block_tables=rows)
            return pre.prepare(batch, publish_tables=publish).table_stage
        case = Case(st, pre, PAGE, None, [], produce)
    else:
        v4 = V41MetadataInputs(st, max_reqs=4, max_tokens=16, max_blocks_per_req=WIDTH,
                               dummy_state_slot=DUMMY_SLOT, dummy_block=DUMMY_BLOCK,
                               num_blocks=200, max_ranges=8)
        decode = kind == "v41_decode"

        def produce(ctx: list[int], rows: list[BlockTable], publish: bool) -> str:
            width = 1 if decode else 3
            spans = [RequestSpan(min(width, c), c, i) for i, c in enumerate(ctx)]
            plan = (v4.begin_step(spans, block_tables=rows, padded=4) if decode
                    else v4.begin_prefill(spans, block_tables=rows))
            return plan.table_stage
        case = Case(st, v4, V4_BLOCK, 4 if decode else None,
                    [DUMMY_BLOCK] + [0] * (WIDTH - 1), produce)
    st.bind()
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(ah.POISON)
    return case


def step(case: Case, device: str, ctx: list[int], rows: list[BlockTable],
         publish_tables: bool = True) -> tuple[str, int | None]:
    """One epoch: produce, publish the adapter's group; returns (stage, the table's count)
    after checking the GPU table's staged rows and every tail."""
    st, a = case.state, case.adapter
    st.begin()
    stage = case.produce(ctx, rows, publish_tables)
    count = st.count(a.block_tables)
    before, counted = dest_copies(st), published_counts(st, a.group)
    st.publish(a.group)
    after = dest_copies(st)
    st.finish()
    ah.sync(device)
    p = len(rows) if case.padded is None else case.padded
    check_tails(st, before, after, counted, rows={a.block_tables.name: p})
    if publish_tables:
        gpu = a.block_tables.gpu[:p].cpu().tolist()
        want = [r.tolist() + [0] * (WIDTH - len(r)) for r in rows]
        assert gpu == want + [case.pad_row] * (p - len(rows)), stage
        rec = a.tables.published
        assert rec is not None and (rec.revision, rec.rows) == (a.tables.prepared_revision, p)
    return stage, count


KINDS = ["mha", "mla", "derived_mha", "derived_mla", "prefill", "v41_decode", "v41_prefill"]


@pytest.mark.parametrize("kind", KINDS)
def test_paged_adapters_stage_through_the_shared_state(device: str, kind: str) -> None:
    """Whole on the first step, reuse (the table omitted) on an unchanged step, a partial
    publication for one appended page, whole again for a replaced batch, and reuse again;
    the state is the one attached to the adapter's buffer."""
    if kind.startswith("v41"):
        ah.need_kernels(device)  # the V4.1 group's scatter runs under the interpreter
    case = build(kind, device)
    a = case.adapter
    if kind.startswith("derived"):  # inherited: nothing of the preparation redefined
        defined = set(vars(type(a)))
        assert not defined & {"prepare", "_prepare", "tables", "request_layouts"}, defined
    tables = a.tables
    assert isinstance(tables, BlockTableState) and tables.buffer is a.block_tables
    with pytest.raises(DeclarationError, match="already has block-table state"):
        block_table_state(a.block_tables)  # one state per buffer: the adapter holds it
    page = case.page
    pages = itertools.count(10)

    def fresh(lengths: tuple[int, ...]) -> list[BlockTable]:
        return [BlockTable([next(pages) for _ in range(k)]) for k in lengths]

    rows = fresh((1, 2, 3))
    ctx = [(len(r) - 1) * page + 1 for r in rows]
    whole = len(rows) if case.padded is None else case.padded
    assert step(case, device, ctx, rows) == (StageResult.WHOLE, whole)
    ctx = [c + 1 for c in ctx]  # one more token each, inside its last page
    assert step(case, device, ctx, rows) == (StageResult.REUSED, None)
    rows[1].append_one(next(pages))
    ctx[1] = (len(rows[1]) - 1) * page + 1
    assert step(case, device, ctx, rows) == (StageResult.PARTIAL, None)
    rows = fresh((4, 3, 4))  # every real row replaced: most of the table's bytes
    ctx = [len(r) * page for r in rows]
    assert step(case, device, ctx, rows) == (StageResult.WHOLE, whole)
    assert step(case, device, ctx, rows) == (StageResult.REUSED, None)


def test_prefill_without_publication_is_not_reused_later(device: str) -> None:
    """Prefill prepares CPU rows without uploading (``publish_tables=False``): the table is
    omitted and the GPU keeps the older rows; the next step that publishes the same rows
    must send them (the GPU does not hold that revision), never reuse the older table."""
    case = build("prefill", device)
    a = case.adapter
    rows = [BlockTable([1, 2]), BlockTable([3])]
    ctx = [5, 2]
    assert step(case, device, ctx, rows) == (StageResult.WHOLE, 2)
    old_gpu = a.block_tables.gpu.cpu().clone()
    published = a.tables.published
    rows[0].append_one(4)
    ctx[0] = 9
    assert step(case, device, ctx, rows, publish_tables=False) == ("", None)
    assert torch.equal(a.block_tables.gpu.cpu(), old_gpu)
    assert a.tables.published is published  # nothing uploaded, nothing recorded
    stage, _ = step(case, device, ctx, rows)
    assert stage in (StageResult.PARTIAL, StageResult.WHOLE)
