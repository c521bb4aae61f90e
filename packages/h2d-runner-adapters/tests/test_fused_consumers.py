"""KV-index generation and token assembly fused into the decode step's publication
(``fuse_kv_indices``, ``fuse_token_assembly``).

The oracle is a plain host computation of ``kv_indices`` from the batch's own page rows
(the spec's rule: row ``r``'s first ``ceil(context / page)`` page ids, rows back to back,
padded requests owning none), not the eager launch of the same kernel.

* Packed and fused: after every ``publish`` (without calling the consumer) the device's
  ``kv_indices`` hold exactly the oracle's entries and the tail past them is untouched,
  over steps that grow, shrink, reorder and pad the batch; ``generate_kv_indices`` then
  launches nothing more.
* The direct backend fuses nothing: ``fused`` is False and the caller's launch writes the
  same entries.
* Publishing a covered producer group of a fused publication alone is refused, changing
  nothing, and the step can still be published.
* Declaration errors: after ``bind()``, a foreign buffer, a CPU state without the Triton
  interpreter.
* Token assembly: the deferred requests' ids come from the engine's sampled-token buffer
  (the oracle: ``prev[src, 0]`` for a deferred request, the staged id otherwise), filled by
  the publication itself; ``tokens.assemble`` launches nothing and refuses another buffer.
"""

from __future__ import annotations

import adapter_helpers as ah
import numpy as np
import pytest
import torch

from block_tables import BlockTable
from h2d_core import DeclarationError, H2DRunnerState, MembershipError
from h2d_runner_adapters import (
    MHA_DECODE,
    BatchColumns,
    DecodeStepInputs,
    ScheduledBatch,
    StepShape,
)

MAX_REQS = 8
MAX_TOKENS = 16
MAX_PAGES = 5
PAGE = 16
POISON = -7
SHAPE = StepShape(max_reqs=MAX_REQS, max_tokens=MAX_TOKENS, max_pages_per_req=MAX_PAGES,
                  page_size=PAGE, num_pages=512, max_ranges=4)


def _state(device: str, backend: str) -> tuple[H2DRunnerState, DecodeStepInputs]:
    ah.need_kernels(device)
    st = H2DRunnerState(device, backend=backend, scatter=ah.scatter_for(device))
    step = DecodeStepInputs(st, SHAPE, fuse_kv_indices=True)
    st.bind()
    step.decode.kv_indices.fill_(POISON)
    return st, step


def _batch(ctx: list[int], tables: list[BlockTable], padded: int | None) -> ScheduledBatch:
    n = len(ctx)
    cols = BatchColumns(
        query_lens=np.ones(n, np.int32), context_lens=np.asarray(ctx, np.int32),
        temperatures=np.full(n, 0.7, np.float32), top_k=np.full(n, -1, np.int32),
        top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
        token_ids=np.arange(1, n + 1, dtype=np.int32), num_drafts=np.zeros(n, np.int32))
    return ScheduledBatch((), False, PAGE, padded_size=padded, given_columns=cols,
                          given_block_tables=list(tables))


def _oracle(ctx: list[int], tables: list[BlockTable]) -> list[int]:
    out: list[int] = []
    for c, t in zip(ctx, tables, strict=True):
        out += [int(x) for x in list(t)[: -(-c // PAGE)]]
    return out


def _schedule(seed: int) -> list[tuple[list[int], list[BlockTable], int | None]]:
    """Steps over a changing population: growth across page boundaries, arrivals,
    finishes, a reordering, graph padding and a shrink to one request."""
    rng = np.random.default_rng(seed)
    next_page = [100]

    def pages(k: int) -> list[int]:
        got = list(range(next_page[0], next_page[0] + k))
        next_page[0] += k
        return got

    ctx = [int(rng.integers(1, 60)) for _ in range(5)]
    tables = [BlockTable(pages(-(-c // PAGE))) for c in ctx]
    steps: list[tuple[list[int], list[BlockTable], int | None]] = []
    for k in range(12):
        if k == 4:  # arrivals
            for _ in range(2):
                ctx.append(int(rng.integers(1, 40)))
                tables.append(BlockTable(pages(-(-ctx[-1] // PAGE))))
        if k == 7:  # finishes and a reordering
            ctx, tables = ctx[::-1][:4], tables[::-1][:4]
        if k == 10:
            ctx, tables = ctx[:1], tables[:1]
        for i in range(len(ctx)):
            ctx[i] = min(ctx[i] + int(rng.integers(1, 9)), MAX_PAGES * PAGE)
            need = -(-ctx[i] // PAGE) - len(tables[i])
            if need > 0:
                tables[i].append(pages(need))
        padded = (8 if k % 3 == 0 else None) if len(ctx) <= 8 else None
        steps.append((list(ctx), list(tables), padded))
    return steps


def test_fused_publication_writes_kv_indices(device: str) -> None:
    st, step = _state(device, "packed")
    fused = step.decode.kv_indices_consumer
    assert fused is not None and fused.fused and fused.group == "decode_step"
    kv = step.decode.kv_indices
    for ctx, tables, padded in _schedule(3):
        st.begin()
        plan = step.prepare(_batch(ctx, tables, padded), padded)
        st.publish("decode_step")
        st.finish()
        ah.sync(device)
        want = _oracle(ctx, tables)
        got = kv.cpu().tolist()
        assert got[: len(want)] == want
        # untouched past the step's entries
        assert got[len(want):] == [POISON] * (len(got) - len(want))
        assert step.decode.generate_kv_indices(plan.decode) is kv  # launches nothing
        kv.fill_(POISON)  # the next step must write its entries again


def test_direct_backend_fuses_nothing(device: str) -> None:
    st, step = _state(device, "direct")
    fused = step.decode.kv_indices_consumer
    assert fused is not None and not fused.fused and fused.group is None
    ctx, tables, padded = _schedule(5)[0]
    st.begin()
    plan = step.prepare(_batch(ctx, tables, padded), padded)
    st.publish("decode_step")
    st.finish()
    ah.sync(device)
    kv = step.decode.kv_indices
    assert kv.cpu().tolist() == [POISON] * kv.numel()  # nothing ran at publish
    step.decode.generate_kv_indices(plan.decode)
    ah.sync(device)
    want = _oracle(ctx, tables)
    assert kv.cpu().tolist()[: len(want)] == want


def test_kv_index_generation_is_fused_by_default_where_it_can_run(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``fuse_kv_indices=None`` (the default) fuses wherever ``consumers_fusable`` says the
    kernel runs at publication; False launches it after ``publish``; a CPU state without
    the interpreter is not fused by default (an explicit True is refused there)."""
    from h2d_runner_adapters import consumers_fusable
    from h2d_runner_adapters.mha import inputs as mha_decode

    shape = StepShape(max_reqs=2, max_tokens=2, max_pages_per_req=2, page_size=PAGE)
    st = H2DRunnerState("cpu", backend="packed", scatter=ah.scatter_for("cpu"))
    default = DecodeStepInputs(st, shape)
    st.bind()
    consumer = default.decode.kv_indices_consumer
    assert consumers_fusable("cpu") is (consumer is not None)
    assert consumer is None or consumer.fused
    off = H2DRunnerState("cpu", backend="packed", scatter=ah.scatter_for("cpu"))
    assert DecodeStepInputs(off, shape, fuse_kv_indices=False).decode.kv_indices_consumer is None
    monkeypatch.setattr(mha_decode, "consumers_fusable", lambda device: False)
    plain = H2DRunnerState("cpu", backend="packed", scatter="reference")
    assert DecodeStepInputs(plain, shape).decode.kv_indices_consumer is None


def test_covered_group_of_a_fused_publication_is_refused() -> None:
    """``mha_decode`` produced on its own (a standalone caller) would publish alone with
    direct copies, which skip the fused KV-index generation: refused, changing nothing;
    the whole step then publishes."""
    st, step = _state("cpu", "packed")
    ctx, tables, padded = _schedule(7)[0]
    st.begin()
    step.decode.prepare(_batch(ctx, tables, padded), padded)  # the covered group alone
    before = step.decode.kv_indptr.gpu.clone()
    with pytest.raises(MembershipError, match=r"'mha_decode'.*fused first consumers.*"
                       r"publish 'decode_step'"):
        st.publish(MHA_DECODE)
    assert torch.equal(step.decode.kv_indptr.gpu, before)
    assert not st.is_published(MHA_DECODE)
    st.finish()
    st.begin()  # the refusal changed nothing: the next epoch's step publishes whole
    step.prepare(_batch(ctx, tables, padded), padded)
    st.publish("decode_step")
    st.finish()
    assert step.decode.kv_indices.tolist()[: len(_oracle(ctx, tables))] == _oracle(ctx, tables)


def test_declaration_errors() -> None:
    st, step = _state("cpu", "packed")
    with pytest.raises(DeclarationError, match="before bind"):
        st.fuse_consumer("late", [step.decode.kv_indptr], lambda h, r: None)
    other = H2DRunnerState("cpu", backend="packed")
    foreign = H2DRunnerState("cpu", backend="packed").buffer(
        "x", (4,), torch.int32, group="g")
    with pytest.raises(DeclarationError, match="not a buffer declared on this state"):
        other.fuse_consumer("kv", [foreign], lambda h, r: None)
    with pytest.raises(DeclarationError, match="at least one member"):
        other.fuse_consumer("kv", [], lambda h, r: None)


def test_cpu_without_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from h2d_runner_adapters.mha import inputs as mha_decode

    monkeypatch.setattr(mha_decode, "interpreted", lambda kernel: False)
    st = H2DRunnerState("cpu", backend="packed", scatter="reference")
    with pytest.raises(DeclarationError, match="TRITON_INTERPRET=1"):
        DecodeStepInputs(st,
                         StepShape(max_reqs=2, max_tokens=2, max_pages_per_req=2, page_size=PAGE),
                         fuse_kv_indices=True)


def test_fused_token_assembly_fills_deferred_ids(device: str) -> None:
    ah.need_kernels(device)
    from h2d_runner_adapters import DECODE_STEP
    from h2d_runner_adapters.checks import AdapterInputError

    prev = torch.zeros(MAX_REQS, 2, dtype=torch.int32, device=device)
    st = H2DRunnerState(device, backend="packed", scatter=ah.scatter_for(device))
    step = DecodeStepInputs(st, SHAPE, fuse_kv_indices=True, fuse_token_assembly=prev)
    st.bind()
    assert step.tokens.assembly_consumer is not None and step.tokens.assembly_consumer.fused
    rng = np.random.default_rng(5)
    for k, (ctx, tables, padded) in enumerate(_schedule(11)):
        n = len(ctx)
        prev.copy_(torch.from_numpy(rng.integers(1000, 9000, (MAX_REQS, 2), dtype=np.int32)))
        src = rng.integers(-1, MAX_REQS, n).astype(np.int32)  # -1: staged from the host
        batch = _batch(ctx, tables, padded)
        batch.columns.prev_sample_rows[:] = src
        batch.columns.token_ids[:] = 1 + k * 100 + np.arange(n)
        st.begin()
        plan = step.prepare(batch, padded)
        st.publish(DECODE_STEP)
        ids = step.tokens.assemble(plan.tokens, prev)  # launches nothing: fused
        # ... and makes no tensor for a padded size it has seen (one view per size)
        assert step.tokens.assemble(plan.tokens, prev) is ids
        st.finish()
        ah.sync(device)
        host = prev.cpu().numpy()
        want = [int(host[s, 0]) if s >= 0 else 1 + k * 100 + i for i, s in enumerate(src)]
        assert ids[:n].cpu().tolist() == want, k
        assert ids[n: plan.tokens.padded_tokens].cpu().tolist() == [0] * (
            plan.tokens.padded_tokens - n)
    st.begin()
    plan = step.prepare(batch, padded)
    st.publish(DECODE_STEP)
    with pytest.raises(AdapterInputError, match=r"reads the prev_sampled given to "
                                                r"fuse_assembly; pass that tensor"):
        step.tokens.assemble(plan.tokens, prev.clone())
    st.finish()
