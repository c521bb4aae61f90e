"""The bad-input catalogue: each entry is refused with a specific error naming the offender
and the rule, and changes nothing (sources, counts, destinations, table bytes, revisions,
the epoch). ``docs/reliability.md`` lists every entry by its id; a test keeps the two in
step. CPU; the checks run before any kernel, so no Triton mode is needed."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from block_tables import (
    BlockTable,
    MissingPagesError,
    PageIdRangeError,
    PageTableSnapshot,
    RowCountError,
    RowTypeError,
    RowWidthError,
    StorageError,
)
from h2d_core import (
    BackendError,
    BindingError,
    CountError,
    DeclarationError,
    DuplicatePublicationError,
    EpochError,
    H2DRunnerState,
    MembershipError,
    OwnerThreadError,
    ProducerOwnerError,
    ReentryError,
    RequestLayout,
    RequestLayoutError,
    UnknownGroupError,
    h2d_producer,
)
from h2d_kernels import ArenaMember, plan_arena
from h2d_kernels.errors import ArenaLayoutError
from h2d_runner_adapters import (
    BatchColumns,
    ConsumerArgumentError,
    DraftStepMetadata,
    EngramInputs,
    GdnStateInputs,
    MhaDecodeInputs,
    ScheduledBatch,
    StepShape,
    TokenInputs,
    advance_draft_step,
    generate_kv_indices,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
PAGE = 4


class World:
    """A bound runner state (two slots, packed), a block-table snapshot and adapters, plus
    everything a rejected call must leave unchanged."""

    def __init__(self) -> None:
        st = self.state = H2DRunnerState("cpu", num_slots=2, scatter="reference")
        self.a = st.buffer("a", (8,), torch.int32, group="g")
        self.bt = st.buffer("bt", (4, 8), torch.int32, group="g", unit="rows", max_ranges=4)
        self.c = st.buffer("c", (4,), torch.int64, group="h")
        self.tokens = TokenInputs(st, max_reqs=4, max_tokens=8, max_drafts=1)
        self.decode = MhaDecodeInputs(st,
                                      StepShape(max_reqs=4, max_tokens=8, max_pages_per_req=8,
                                                page_size=PAGE, num_pages=64))
        self.gdn = GdnStateInputs(st, max_reqs=4, num_spec=1, num_state_slots=8)
        self.engram = EngramInputs(st, max_reqs=4, max_drafts=1, history_rows=4,
                                   history_len=16)
        st.bind()
        self.snap = PageTableSnapshot(np.zeros((4, 8), np.int32), pool_limit=100)
        self.snap.prepare([BlockTable([1, 2]), BlockTable([3])])

    def batch(self, qlens: list[int], ctx: list[int], drafts: list[int] | None = None,
              rows: list[BlockTable] | None = None) -> ScheduledBatch:
        n = len(qlens)
        q = np.asarray(qlens, np.int32)
        cols = BatchColumns(
            query_lens=q, context_lens=np.asarray(ctx, np.int32),
            temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
            top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
            token_ids=np.zeros(int(q.sum()), np.int32),
            num_drafts=np.asarray(drafts or [0] * n, np.int32))
        return ScheduledBatch((), False, PAGE, given_columns=cols, given_block_tables=rows or [
            BlockTable(range(10 * i, 10 * i + 4)) for i in range(n)])

    def observe(self) -> tuple[Any, ...]:
        st = self.state
        sources = tuple(b.source(s).numpy().tobytes() for b in st.buffers().values()
                        for s in range(st.num_slots))
        dests = tuple(b.gpu.numpy().tobytes() for b in st.buffers().values())
        counts = (tuple(st.count(b) for b in st.buffers().values())
                  if st._epoch_open else None)
        return (sources, dests, counts, st.epoch, st._epoch_open, st.current_slot,
                self.snap.storage.tobytes(), self.snap.revision, self.snap.num_rows,
                self.decode.tables.snapshot.revision)


Case = Callable[[World], Callable[[], object]]
CATALOGUE: dict[str, tuple[Case, type[Exception], str]] = {}


def case(cid: str, error: type[Exception], rule: str) -> Callable[[Case], Case]:
    def register(fn: Case) -> Case:
        CATALOGUE[cid] = (fn, error, rule)
        return fn
    return register


def open_epoch(w: World) -> None:
    w.state.begin()


# -- block-tables ----------------------------------------------------------------------
@case("bt-none-page-id", RowTypeError, r"row 0: page IDs must be ints, got NoneType at column 1")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare([[1, None]])


@case("bt-object-page-id", RowTypeError, r"row 1: page IDs must be ints, got object")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare([[1], [object()]])


@case("bt-float-page-ids", RowTypeError, r"row 0: page IDs must be integers, got dtype float")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare([np.array([1.5, 2.0])])


@case("bt-2d-row", RowTypeError, r"row 0: expected a 1-D array of page IDs")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare([np.zeros((2, 2), np.int32)])


@case("bt-rows-iterator", RowTypeError, r"rows must be an ordered sequence")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare(iter([BlockTable([1, 2])]))  # type: ignore[arg-type]


@case("bt-row-not-a-sequence", RowTypeError, r"row 0: expected a BlockTable")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare([{1, 2}])  # type: ignore[list-item]


@case("bt-too-many-rows", RowCountError, r"the batch has 5 rows but the storage holds 4")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare([[1]] * 5)


@case("bt-row-too-wide", RowWidthError, r"row 0: 9 page IDs exceed the table width of 8")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare([list(range(9))])


@case("bt-width-before-ids", RowWidthError, r"row 1: 9 page IDs exceed the table width")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare([[2**40], list(range(9))])


@case("bt-id-past-int32", PageIdRangeError, r"row 0: .*does not fit int32")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare([[2**40]])


@case("bt-negative-page-id", PageIdRangeError, r"row 0: .*-1.*pool_limit=100")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare([[-1]])


@case("bt-page-past-pool", PageIdRangeError, r"row 1: .*\[0, pool_limit=100\)")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare([[1], [100]])


@case("bt-required-past-row", MissingPagesError, r"row 0: the request span needs 3 pages")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare([[1, 2]], required_pages=[3])


@case("bt-required-negative", MissingPagesError, r"row 0: required_pages is -1")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare([[1, 2]], required_pages=[-1])


@case("bt-required-wrong-length", RowCountError, r"required_pages has shape \(2,\)")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare([[1, 2]], required_pages=[1, 1])


@case("bt-versions-without-lengths", RowTypeError, r"pass versions and lengths together")
def _(w: World) -> Callable[[], object]:
    return lambda: w.snap.prepare([[1]], versions=[1])


@case("bt-append-none", RowTypeError, r"a page ID must be an int, got NoneType")
def _(w: World) -> Callable[[], object]:
    return lambda: BlockTable([1]).append_one(None)  # type: ignore[arg-type]


@case("bt-storage-int64", StorageError, r"int32")
def _(w: World) -> Callable[[], object]:
    return lambda: PageTableSnapshot(np.zeros((2, 2), np.int64))


def _layout() -> RequestLayout:
    return RequestLayout("lay", PAGE, None, None, positions=np.zeros(8, np.int64),
                         context_lens=np.zeros(4, np.int32))


@case("layout-context-below-query", RequestLayoutError,
      r"lay: request 0 has context_len 2, shorter than its 3 query tokens")
def _(w: World) -> Callable[[], object]:
    layout = _layout()
    return lambda: layout.plan(np.array([3], np.int32), np.array([2], np.int32), -1, -1)


@case("layout-padded-below-requests", RequestLayoutError,
      r"lay: 1 padded requests for 2 requests; the padded count must lie in \[2, 4\]")
def _(w: World) -> Callable[[], object]:
    layout = _layout()
    return lambda: layout.plan(np.array([1, 1], np.int32), np.array([4, 4], np.int32), 1, -1)


# -- h2d-kernels -----------------------------------------------------------------------
@case("arena-negative-member-bytes", ArenaLayoutError, r"member 'x' has capacity_bytes -4")
def _(w: World) -> Callable[[], object]:
    return lambda: plan_arena([ArenaMember("x", -4, 4)])


@case("arena-no-descriptors", ArenaLayoutError, r"num_ranges=0: the header needs at least one")
def _(w: World) -> Callable[[], object]:
    return lambda: plan_arena([ArenaMember("x", 8, 4)], num_ranges=0)


@case("arena-bad-itemsize", ArenaLayoutError, r"member 'x' has itemsize 3")
def _(w: World) -> Callable[[], object]:
    return lambda: plan_arena([ArenaMember("x", 8, 3)])


@case("arena-duplicate-member", ArenaLayoutError, r"member 'x' appears twice")
def _(w: World) -> Callable[[], object]:
    return lambda: plan_arena([ArenaMember("x", 8, 4), ArenaMember("x", 8, 4)])


# -- h2d-core: counts ------------------------------------------------------------------
def _count(value: object) -> Case:
    def make(w: World) -> Callable[[], object]:
        open_epoch(w)
        return lambda: w.state.set_count(w.a, value)  # type: ignore[arg-type]
    return make


for cid, value, rule in (
        ("count-string", "3", r"buffer 'a': count must be an int .* got str"),
        ("count-float", 3.0, r"buffer 'a': count must be an int .* got float"),
        ("count-nan", float("nan"), r"buffer 'a': count must be an int .* got float"),
        ("count-bool", True, r"buffer 'a': count must be an int .* got bool"),
        ("count-negative", -1, r"buffer 'a'.*-1"),
        ("count-past-capacity", 9, r"buffer 'a'.*9.*8"),
        ("count-tensor", torch.tensor(3), r"buffer 'a': count must be an int .* got Tensor")):
    case(cid, CountError, rule)(_count(value))


@case("count-outside-epoch", EpochError, r"set_count outside an epoch: call begin\(\)")
def _(w: World) -> Callable[[], object]:
    return lambda: w.state.set_count(w.a, 1)


@case("count-foreign-buffer", MembershipError, r"H2DBuffer\('a'.* is not a buffer of this state")
def _(w: World) -> Callable[[], object]:
    other = H2DRunnerState("cpu", scatter="reference")
    foreign = other.buffer("a", (8,), torch.int32, group="g")
    other.bind()
    open_epoch(w)
    return lambda: w.state.set_count(foreign, 1)


@case("ranges-triple", CountError, r"buffer 'bt': range 0 \(0, 4, 8\) must be a \(start, stop\)")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    return lambda: w.state.set_ranges(w.bt, [(0, 4, 8)])  # type: ignore[list-item]


@case("ranges-none", CountError, r"buffer 'bt': ranges must be a list")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    return lambda: w.state.set_ranges(w.bt, None)  # type: ignore[arg-type]


@case("ranges-unsorted", CountError, r"buffer 'bt': range 1 .* sorted")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    return lambda: w.state.set_ranges(w.bt, [(32, 36), (0, 4)])


@case("ranges-split-element", CountError, r"buffer 'bt': range 0 \[0, 3\) splits a 4-byte")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    return lambda: w.state.set_ranges(w.bt, [(0, 3)])


@case("ranges-too-many", CountError, r"5 ranges exceed its max_ranges=4")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    return lambda: w.state.set_ranges(w.bt, [(8 * k, 8 * k + 4) for k in range(5)])


# -- h2d-core: epochs, slots, threads, groups ------------------------------------------
@case("publish-outside-epoch", EpochError, r"publish\('g'\) outside an epoch")
def _(w: World) -> Callable[[], object]:
    return lambda: w.state.publish("g")


@case("begin-twice", EpochError, r"still open; call finish\(\) first")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    return lambda: w.state.begin()


@case("begin-slot-out-of-range", EpochError, r"slot 2 is not in \[0, 2\)")
def _(w: World) -> Callable[[], object]:
    return lambda: w.state.begin(2)


@case("begin-slot-float", EpochError, r"slot must be an int in \[0, 2\) or None, got float")
def _(w: World) -> Callable[[], object]:
    return lambda: w.state.begin(1.0)  # type: ignore[arg-type]


@case("publish-twice", DuplicatePublicationError, r"group 'h'.* already published .* reason")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    w.state.set_count(w.c, 1)
    w.state.publish("h")
    return lambda: w.state.publish("h")


@case("publish-unknown-group", UnknownGroupError, r"nope")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    return lambda: w.state.publish("nope")


@case("producer-reentry", ReentryError, r"entered again .* pass h2d_reason")
def _(w: World) -> Callable[[], object]:
    @h2d_producer("h")
    def produce(state: H2DRunnerState) -> None:
        state.set_count(w.c, 1)

    open_epoch(w)
    produce(w.state)
    return lambda: produce(w.state)


@case("producer-without-owner", ProducerOwnerError, r"its first argument must be the")
def _(w: World) -> Callable[[], object]:
    @h2d_producer("h")
    def produce(owner: object) -> None:
        raise AssertionError("must not run")

    open_epoch(w)
    return lambda: produce(object())


@case("call-from-another-thread", OwnerThreadError, r"belongs to another thread")
def _(w: World) -> Callable[[], object]:
    def from_thread() -> None:
        box: list[BaseException] = []

        def run() -> None:
            try:
                w.state.begin()
            except BaseException as exc:  # re-raised on the test's thread
                box.append(exc)
        t = threading.Thread(target=run)
        t.start()
        t.join()
        if box:
            raise box[0]
    return from_thread


@case("unknown-backend", BackendError, r"backend argument='fast' is not a known H2D backend")
def _(w: World) -> Callable[[], object]:
    return lambda: H2DRunnerState("cpu", backend="fast")


@case("buffer-after-bind", DeclarationError, r"buffer 'late': the state is already bound")
def _(w: World) -> Callable[[], object]:
    return lambda: w.state.buffer("late", (4,), torch.int32, group="g")


@case("bind-twice", DeclarationError, r"bind\(\) was already called")
def _(w: World) -> Callable[[], object]:
    return lambda: w.state.bind()


@case("destinations-share-bytes", BindingError, r"buffers 'x' and 'z' share GPU bytes")
def _(w: World) -> Callable[[], object]:
    st = H2DRunnerState("cpu", scatter="reference")
    base = torch.zeros(8, 2, dtype=torch.int32)
    st.buffer("x", (8,), torch.int32, group="h", gpu=base[:, 0])
    st.buffer("z", (4,), torch.int32, group="h", gpu=base.view(-1)[4:8])
    return st.bind


# -- adapters and consumers ------------------------------------------------------------
@case("decode-padded-below-batch", CountError, r"padded=1 must be an int >= the batch's 2")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    return lambda: w.decode.prepare(w.batch([1, 1], [5, 6]), 1)


@case("decode-missing-pages", MissingPagesError, r"row 0: the request span needs 5 pages")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    return lambda: w.decode.prepare(w.batch([1], [20], rows=[BlockTable([1, 2])]))


@case("decode-context-below-query", CountError, r"request 0")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    return lambda: w.decode.prepare(w.batch([3], [2]))


@case("mrope-deltas-without-planes", CountError, r"mrope_deltas given but the adapter has no")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    return lambda: w.decode.prepare(w.batch([1], [5]), mrope_deltas=np.zeros(1, np.int64))


@case("step-shape-bool-capacity", DeclarationError,
      r"StepShape: max_reqs must be an int >= 1, got True")
def _(w: World) -> Callable[[], object]:
    return lambda: StepShape(max_reqs=True, max_tokens=8, max_pages_per_req=8, page_size=PAGE)


@case("spec-drafts-not-below-query", CountError, r"request 0 verifies 2 drafts with 2 query")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    return lambda: w.tokens.prepare_spec_indices(w.batch([2], [5], drafts=[2]))


@case("gdn-accepted-out-of-range", CountError, r"request 1 has num_accepted=3; it must be in")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    return lambda: w.gdn.prepare(np.array([0, 1], np.int32),
                                 num_accepted=np.array([1, 3], np.int32))


@case("gdn-slots-past-pool", CountError, r"request 0's state group 4 needs slots up to 9")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    return lambda: w.gdn.prepare(np.array([4], np.int32))


@case("engram-cursor-past-history", CountError, r"request 0 has cursor \+ query tokens past")
def _(w: World) -> Callable[[], object]:
    open_epoch(w)
    return lambda: w.engram.prepare(w.batch([2], [5], drafts=[1]), np.array([0], np.int32),
                                    np.array([15], np.int32))


@case("consumer-count-as-tensor", ConsumerArgumentError, r"num_rows must be a Python int")
def _(w: World) -> Callable[[], object]:
    return lambda: generate_kv_indices(w.decode.block_tables.gpu, w.decode.kv_indptr.gpu,
                                       w.decode.kv_indices, torch.tensor(2))  # type: ignore[arg-type]


@case("consumer-wrong-dtype", ConsumerArgumentError, r"kv_indptr must have dtype torch.int32")
def _(w: World) -> Callable[[], object]:
    return lambda: generate_kv_indices(w.decode.block_tables.gpu,
                                       w.decode.kv_indptr.gpu.long(), w.decode.kv_indices, 2)


@case("draft-step-zero", ConsumerArgumentError, r"step must be >= 1")
def _(w: World) -> Callable[[], object]:
    def i32(k: int) -> torch.Tensor:
        return torch.zeros(k, dtype=torch.int32)
    meta = DraftStepMetadata(torch.zeros(4, dtype=torch.int64), i32(4),
                             torch.zeros(4, dtype=torch.int64), i32(5), i32(5))
    return lambda: advance_draft_step(
        torch.zeros(4, dtype=torch.int64), i32(5), i32(4), torch.zeros(4, 8, dtype=torch.int32),
        meta, num_reqs=2, padded_reqs=2, step=0, page_size=PAGE)


def test_the_catalogue_holds_at_least_forty_entries() -> None:
    assert len(CATALOGUE) >= 40, len(CATALOGUE)


@pytest.mark.parametrize("cid", sorted(CATALOGUE))
def test_each_bad_input_is_refused_and_changes_nothing(cid: str) -> None:
    make, error, rule = CATALOGUE[cid]
    w = World()
    call = make(w)
    before = w.observe()
    with pytest.raises(error, match=rule):
        call()
    assert w.observe() == before, f"{cid}: something changed"


def test_docs_list_every_entry() -> None:
    listed = set(re.findall(r"^\| `([a-z0-9-]+)` \|", DOC.read_text(), re.M))
    assert listed == set(CATALOGUE), (sorted(set(CATALOGUE) - listed),
                                      sorted(listed - set(CATALOGUE)))
