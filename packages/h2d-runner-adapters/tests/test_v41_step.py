"""``V41MetadataInputs.begin_step`` through the compiled ``LayoutStep``, against hand-computed
values: the plan-row counts (``PLAN_ROWS`` rules), ``v41_qo_indptr`` (the layout's
``token_prefix`` output), the prefill-only member left out (``OMITTED``) and the eager
grid, byte for byte on the destinations with untouched tails."""

from __future__ import annotations

import adapter_helpers as ah
import numpy as np
import pytest
import torch
from v4_helpers import TOPK, V4_POISON, v41_state

from block_tables import BlockTable
from h2d_core import H2DRunnerState
from h2d_runner_adapters import V41_METADATA, RequestSpan, V41MetadataInputs, V41Plan

# three requests of 1, 3 and 2 tokens padded to 4: the graph grid is 4 * 3 = 12 tokens
SPANS = [RequestSpan(1, 300, 0), RequestSpan(3, 260, 1), RequestSpan(2, 10, 2)]
ROWS = [[1, 2], [3, 4], [5]]
# positions 299 | 257 258 259 | 8 9. Ratio 4 (window 8): 299 and 259 close a block, every
# token is among its request's last 8; published 4 * ceil(3/4) = 4 and 4 * min(3, 8) = 12.
# Ratio 128 (window 128): no token closes a block, every token is a tail row.
PLAN_ROWS_WANT = ((2, 4, 6, 12), (0, 4, 6, 12))
QO_WANT = [0, 1, 2, 3, 4, 5, 6] + [6] * 6


def _dest(st: object, name: str) -> bytes:
    return st.buffers()[name].gpu.cpu().numpy().tobytes()  # type: ignore[attr-defined]


def _rows() -> list[BlockTable]:
    return [BlockTable(r) for r in ROWS]


def test_v41_step_counts_plan_rows_and_qo_indptr_exact_bytes(device: str) -> None:
    st, v4 = v41_state(device)
    st.begin()
    plan = v4.begin_step(SPANS, block_tables=_rows(), padded=4)
    assert plan.astuple()[:5] == (3, 4, 6, 12, 3)
    assert plan.plan_rows == PLAN_ROWS_WANT
    assert plan.table_stage == "whole"
    counts = {name: st.count(b) for name, b in st.buffers().items()}
    assert counts == {
        "v41_positions": 12, "v41_token_batch_ids": 12, "v41_seq_lens": 4,
        "v41_state_slot_out": 4, "v41_state_slot_in": 4, "v41_chunk_starts": None,
        "v41_compress_plan_4": 4, "v41_write_plan_4": 12, "v41_compress_plan_128": 4,
        "v41_write_plan_128": 12, "v41_qo_indptr": 13, "v41_block_tables": 4,
        "v41_window_write_plan": None}  # prefill's: decode's window rows are consumers'
    assert plan.window_rows == (0, 0)
    st.publish(V41_METADATA)
    st.finish()
    qo = _dest(st, "v41_qo_indptr")
    head = np.array(QO_WANT, np.int32).tobytes()
    assert qo[: len(head)] == head
    assert qo[len(head):] == bytes([V4_POISON]) * (len(qo) - len(head))  # untouched tail
    # the plans as the counts say: real rows, then -1 rows up to the published count
    c4 = torch.frombuffer(bytearray(_dest(st, "v41_compress_plan_4")), dtype=torch.int32)
    assert c4[:16].view(4, 4).tolist() == [[0, 0, 299, 7], [3, 1, 259, 5], [-1] * 4, [-1] * 4]
    assert set(_dest(st, "v41_compress_plan_4")[64:]) == {V4_POISON}
    assert set(_dest(st, "v41_chunk_starts")) == {V4_POISON}  # omitted: never sent
    assert set(_dest(st, "v41_window_write_plan")) == {V4_POISON}


def test_v41_qo_indptr_follows_each_shape_and_leaves_the_rest(device: str) -> None:
    st, v4 = v41_state(device)
    src = v4.qo_indptr.source(0).numpy()  # type: ignore[union-attr]
    src[:] = -5
    shapes = [(SPANS, _rows(), 4, QO_WANT),
              # two requests of 1 token padded to 2: [0, 1, 2]; entries 3.. keep the last
              # step's values (the layout writes padded_tokens + 1 entries)
              ([RequestSpan(1, 300, 0), RequestSpan(1, 9, 2)],
               [BlockTable([1, 2]), BlockTable([5])], 2, [0, 1, 2]),
              (SPANS, _rows(), 4, QO_WANT)]
    full = [-5] * src.size
    for spans, rows, padded, want in shapes:
        full[: len(want)] = want  # the rest keeps what it held
        st.begin()
        plan = v4.begin_step(spans, block_tables=rows, padded=padded)
        assert st.count(v4.qo_indptr) == plan.padded_tokens + 1 == len(want)
        assert src.tolist() == full
        st.publish(V41_METADATA)
        st.finish()
        qo = _dest(st, "v41_qo_indptr")
        head = np.array(want, np.int32).tobytes()
        assert qo[: len(head)] == head


def test_v41_plans_are_per_slot_records_valid_until_the_slots_next_step(device: str
                                                                         ) -> None:
    st, v4 = v41_state(device, num_slots=2)
    plans = []
    for _ in range(3):
        st.begin()
        plans.append(v4.begin_step(SPANS, block_tables=_rows(), padded=4))
        st.publish(V41_METADATA)
        st.finish()
    assert plans[0] is plans[2] is not plans[1]  # one record per slot, refreshed in place
    assert plans[0].plan_rows == plans[1].plan_rows == PLAN_ROWS_WANT
    kept = plans[1].astuple()  # a copy outlives the slot's next step
    st.begin()  # slot 1 again
    one = v4.begin_step(SPANS[:1], block_tables=_rows()[:1], padded=1)
    assert one is plans[1]
    # one token at position 299: a ratio-4 block closes; 1 * ceil(1/4), 1 * min(1, 8), ...
    assert one.plan_rows == ((1, 1, 1, 1), (0, 1, 1, 1))
    assert one.astuple()[:5] == (1, 1, 1, 1, 1)
    # slot 0's plan still reads slot 0's step; the copy kept slot 1's earlier one
    assert plans[0].plan_rows == PLAN_ROWS_WANT and plans[0].num_reqs == 3
    assert kept[5] == PLAN_ROWS_WANT and V41Plan(*kept) == V41Plan(*kept)
    st.finish()


def test_v41_eager_step_keeps_the_grid_of_its_requests(device: str) -> None:
    """``padded=None``: no padded requests, but the tokens still form the grid of the widest
    query (2 * 3 = 6 here, 4 real), as before the step was compiled."""
    st, v4 = v41_state(device)
    st.begin()
    plan = v4.begin_step(SPANS[:2], block_tables=_rows()[:2])
    assert plan.astuple()[:5] == (2, 2, 4, 6, 3)
    assert st.count(v4.qo_indptr) == 7
    qo = v4.qo_indptr.source(0).numpy()  # type: ignore[union-attr]
    assert qo[:7].tolist() == [0, 1, 2, 3, 4, 4, 4]
    assert plan.plan_rows == ((2, 2, 4, 6), (0, 2, 4, 6))
    st.finish()


def test_v41_decode_after_prefill_in_one_epoch_leaves_out_the_chunk_starts(device: str
                                                                            ) -> None:
    """A prefill's chunk starts, counted earlier in the epoch (produced, not published),
    are left out by the decode step that replaces it (an ``OMITTED`` rule)."""
    st, v4 = v41_state(device)
    st.begin()
    v4.begin_prefill(SPANS, block_tables=_rows())
    assert st.count(v4.chunk_starts) == 3
    assert st.count(v4.qo_indptr) is None
    v4.begin_step(SPANS, block_tables=_rows(), padded=4, h2d_reason="decode replaces it")
    assert st.count(v4.chunk_starts) is None
    assert st.count(v4.qo_indptr) == 13
    st.publish(V41_METADATA)
    st.finish()
    assert set(_dest(st, "v41_chunk_starts")) == {V4_POISON}


def test_step_indptrs_are_fused_by_default_where_they_can_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``fuse_step_indptrs=None`` (the default) fuses wherever ``consumers_fusable`` says
    the kernels run at publication (CUDA, or CPU under the interpreter); elsewhere no
    consumer and no ``v41_step_counts`` member are declared."""
    import h2d_runner_adapters.v4.metadata as module
    from h2d_runner_adapters import consumers_fusable

    def declare(st_: H2DRunnerState) -> V41MetadataInputs:
        return V41MetadataInputs(st_, max_reqs=2, max_tokens=4, max_blocks_per_req=2,
                                 dummy_state_slot=9, dummy_block=5, num_blocks=6, window=4,
                                 index_topk=4, envelope_rows=2)

    st_ = H2DRunnerState("cpu", backend="packed", scatter=ah.scatter_for("cpu"))
    v4 = declare(st_)
    st_.bind()
    fused = consumers_fusable("cpu")
    assert (v4.step_indptrs_consumer is not None) is fused
    assert (v4.step_counts is not None) is fused
    if fused:
        assert v4.step_indptrs_consumer is not None and v4.step_indptrs_consumer.fused
    monkeypatch.setattr(module, "consumers_fusable", lambda device: False)
    plain = declare(H2DRunnerState("cpu", backend="packed", scatter="reference"))
    assert plain.step_indptrs_consumer is None and plain.step_counts is None


def test_fused_step_indptrs_launch_nothing_and_a_prefill_leaves_them(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``fuse_step_indptrs`` the packed publication runs the first consumer:
    ``generate_step_indptrs`` launches nothing, and a prefill publication (its
    ``v41_step_counts`` omitted, so the fused kernels read zero counts) changes no decode
    indptr past entry 0."""
    ah.need_kernels(device)
    st, v4 = v41_state(device, fuse=True)
    assert v4.step_indptrs_consumer is not None and v4.step_indptrs_consumer.fused
    import h2d_runner_adapters.v4.metadata as module

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("a fused first consumer was launched by the caller")

    monkeypatch.setattr(module, "generate_v4_step_indptrs", refuse)
    monkeypatch.setattr(module, "expand_v4_token_tables", refuse)
    st.begin()
    plan = v4.begin_step(SPANS, block_tables=_rows(), padded=4)
    assert st.count(v4.step_counts) == 4  # type: ignore[arg-type]
    st.publish(V41_METADATA)
    out = v4.generate_step_indptrs(plan)
    st.finish()
    ah.sync(device)
    # 299 | 257 258 259 | 8 9, then 6 padding tokens: swa_t = min(p + 1, 128)
    swa = [0, 128, 128 * 2, 128 * 3, 128 * 4, 128 * 4 + 9, 128 * 4 + 19] + [128 * 4 + 19] * 6
    assert out.swa_indptr[:13].tolist() == swa
    # ctx // 4 for the three requests, index_topk for the padded one
    assert out.n_committed_csa_per_seq[:4].tolist() == [75, 65, 2, TOPK]
    before = [t.clone() for t in out]
    tables = v4.block_tables_per_token.clone()  # type: ignore[union-attr]
    st.begin()
    # another batch: kernels run again on stale counts would change the outputs
    v4.begin_prefill([RequestSpan(2, 40, 5)], block_tables=[BlockTable([7])])
    assert st.count(v4.step_counts) is None  # type: ignore[arg-type]
    st.publish(V41_METADATA)
    st.finish()
    ah.sync(device)
    for got, was in zip(out, before, strict=True):
        assert torch.equal(got, was)
    assert torch.equal(v4.block_tables_per_token, tables)  # type: ignore[arg-type]
