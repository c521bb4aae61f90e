"""Random sequences over the model-family adapters: packed, direct and a plain-Python
reference (three parties).

Two machines (each run twice, by the packed side's scatter: below), each driving two
runner states with the same adapters, one on the packed backend and one on the direct
backend, plus a reference model of every destination:

* `BackendsAgree`: a speculative MHA step with GDN state indices (`DecodeStepInputs` with
  drafts, `GdnStateInputs` riding along) and Engram cursors, plus the MTP draft loop
  (`MhaDraftLoop.advance`: metadata and KV indices derived on the device, no upload);
* `V41BackendsAgree`: DeepSeek V4.1's two groups (`TokenStepInputs`,
  `V41MetadataInputs`: ragged spans, forked state slots, padding, growing and replaced block
  rows) and their first consumer (`generate_step_indptrs`).

Both get the same operations:

* epochs: `begin`, `finish`, `resume`, slots rotating over 1 to 4 (drawn per sequence);
* producers with valid or bad batches (uneven widths, padding, drafts);
* publications, repeated publications, `reopen` with a reason.

After every operation, the two backends must agree: the same outcome (value or error type)
and the same bytes in every destination; the consumer rules also compare the consumers'
device outputs and require them to succeed. The third party is the reference
(`Reference`): after each producer call the backends accepted, it computes every member's
expected values from the batch with plain loops, following the rules the adapter modules'
docstrings state (positions, KV slots, prefixes, padding, plan rows, state slots, cursor
candidates), never by calling an adapter; a publication the backends accepted writes the
counted prefix of each produced member, and `begin` and `reopen` drop what was produced.
Every destination of both backends must equal the reference's, byte for byte. The
reference decides no outcome: which calls are refused is the two backends' agreement.

The packed side scatters with the CPU reference scatter in `BackendsAgree` and
`V41BackendsAgree` (what `scatter="auto"` runs on CPU) and with the Triton kernel in
`BackendsAgreeTriton` and `V41BackendsAgreeTriton` (`scatter="triton"`, in Triton's
interpreter: a few tenths of a second per publication, so they run one sequence for every
`TRITON_SHARE` of the others, and need `TRITON_INTERPRET=1`); the direct side copies. The
consumer rules run their Triton kernels on both sides, in the interpreter, and are skipped
without it. A `full_step` rule runs a whole valid step, so sequences reach publications
often. `nox -s tests` and `nox -s stress` set `TRITON_INTERPRET=1`; `nox -s stress` raises
the number of sequences (`H2D_STATEFUL_EXAMPLES`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from block_tables import BlockTable
from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    DECODE_STEP,
    ENGRAM,
    GDN_STATE,
    GREEDY_TEMPERATURE,
    MHA_DECODE,
    QUERY_PREFIX,
    SAMPLING,
    SPEC_INDICES,
    TOKEN_IDS,
    TOKEN_INPUTS,
    V4_BLOCK,
    V41_METADATA,
    BatchColumns,
    DecodePlan,
    DecodeStepInputs,
    EngramInputs,
    GdnStateInputs,
    MhaDraftLoop,
    RequestSpan,
    ScheduledBatch,
    StepShape,
    TokenStepInputs,
    V41MetadataInputs,
    V41Plan,
)
from h2d_runner_adapters.v4.metadata import V4_RATIOS

PAGE, REQS, TOKENS, PAGES_PER_REQ = 4, 4, 12, 8
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: the packed side's scatter in the fixed sequences: the Triton kernel where it can run
PACKED_SCATTER = "triton" if INTERPRETED else "reference"
EXAMPLES = int(os.environ.get("H2D_STATEFUL_EXAMPLES", "60"))
#: the machines whose packed side scatters with the Triton kernel run one sequence for
#: every TRITON_SHARE of the others: Triton's interpreter takes a few tenths of a second
#: per publication on CPU, several times a whole sequence with the CPU reference scatter
TRITON_SHARE = 5
V41_DUMMY_SLOT, V41_DUMMY_BLOCK, V41_BLOCKS_PER_REQ = REQS * 2, 0, 4

Values = list[Any]  # a member's published prefix: numbers, or rows of numbers


# -- the third party: destinations from the batches, by the adapters' documented rules ------
class Reference:
    """What every destination must hold, computed from the batches alone.

    ``produce`` records the expected values of a producer call's members (None: omitted);
    ``publish`` writes the produced members of a publication group's producer groups into
    the modelled destinations (their published prefix; the rest stays as it was);
    ``begin`` drops what was produced (it clears the epoch's counts), ``reopen`` what the
    publication group's producer groups produced (it clears their counts).
    """

    def __init__(self, state: H2DRunnerState, publications: dict[str, tuple[str, ...]]) -> None:
        buffers = state.buffers()
        # shapes and dtypes only: destinations start as zeros
        self.dest = {n: np.zeros_like(b.gpu.numpy()) for n, b in buffers.items()}
        self.group_of = {n: b.group for n, b in buffers.items()}
        self.publications = publications
        self.pending: dict[str, dict[str, Values | None]] = {}

    def produce(self, members: dict[str, Values | None]) -> None:
        by_group: dict[str, dict[str, Values | None]] = {}
        for name, values in members.items():
            by_group.setdefault(self.group_of[name], {})[name] = values
        for group, produced in by_group.items():
            # a producer writes every member of its groups: one left out is a model bug
            assert set(produced) == {n for n, g in self.group_of.items() if g == group}
            self.pending[group] = produced

    def begin(self) -> None:
        self.pending.clear()

    def reopen(self, publication: str) -> None:
        for group in self.publications[publication]:
            self.pending.pop(group, None)

    def publish(self, publication: str) -> None:
        for group in self.publications[publication]:
            for name, values in self.pending.get(group, {}).items():
                if values is None:
                    continue
                dest = self.dest[name]
                arr = np.asarray(values, dtype=dest.dtype).reshape(-1, *dest.shape[1:])
                dest[: len(arr)] = arr

    def destinations(self) -> dict[str, bytes]:
        return {n: a.tobytes() for n, a in self.dest.items()}


def _prefix(counts: list[int], pad_to: int) -> list[int]:
    """``[0, c0, c0 + c1, ...]``, the tail repeating the total up to ``pad_to + 1`` entries."""
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out + [out[-1]] * (pad_to - len(counts))


def _grid(query_lens: list[int], padded: int | None, eager_exact: bool) -> tuple[int, int]:
    """(padded requests, published tokens): the graph grid of ``padded`` requests times the
    widest query (at least 1); an eager step (``eager_exact``) publishes its real tokens."""
    n = len(query_lens)
    p = n if padded is None else padded
    if padded is None and eager_exact:
        return p, sum(query_lens)
    return p, p * max([*query_lens, 1])


def _tokens(query_lens: list[int], context_lens: list[int]) -> list[tuple[int, int, int]]:
    """(request, index in its query, position) of each real token, tail-anchored: token
    ``j`` of request ``i`` sits at ``context_len - query_len + j``."""
    return [(i, j, c - q + j) for i, (q, c) in enumerate(zip(query_lens, context_lens,
                                                             strict=True)) for j in range(q)]


def _rows(rows: list[list[int]], padded_rows: int, width: int, pad_row: list[int]
          ) -> list[list[int]]:
    """The block table's first ``padded_rows`` rows at full width (0 past each row's pages);
    padded requests get ``pad_row``."""
    full = [*rows, *[pad_row] * (padded_rows - len(rows))]
    return [[*r, *[0] * (width - len(r))] for r in full]


def _sampling(cols: BatchColumns) -> dict[str, Values | None]:
    """Temperatures always, clamped up to the greedy marker; top-k / top-p only when they
    differ per request (uniform filters stay CPU scalars)."""
    temps = [max(float(x), GREEDY_TEMPERATURE) for x in cols.temperatures]
    top_k, top_p = cols.top_k.tolist(), cols.top_p.tolist()
    return {"temperatures": temps,
            "top_ks": top_k if len(set(top_k)) > 1 else None,
            "top_ps": top_p if len(set(top_p)) > 1 else None}


def _token_members(cols: BatchColumns, p: int, pt: int) -> dict[str, Values | None]:
    """Ids (0 for padding tokens), deferred sources (-1 for padded requests) and both
    query prefixes (the tail repeats the total)."""
    ids, q = cols.token_ids.tolist(), cols.query_lens.tolist()
    prefix = _prefix(q, p)
    return {"input_ids": ids + [0] * (pt - len(ids)), "decode_cu": prefix,
            "decode_src": cols.prev_sample_rows.tolist() + [-1] * (p - len(q)),
            "cu_seqlens_q": prefix}


def decode_step_members(cols: BatchColumns, rows: list[list[int]], padded: int | None
                        ) -> dict[str, Values | None]:
    """``DecodeStepInputs.prepare``: sampling, token ids, query prefix and ``mha_decode``
    (positions 0 and KV slots -1 for padding tokens, context lengths 0 and empty rows for
    padded requests, the KV page prefix repeating its total)."""
    q, ctx = cols.query_lens.tolist(), cols.context_lens.tolist()
    n = len(q)
    p, pt = _grid(q, padded, eager_exact=True)
    tokens = _tokens(q, ctx)
    positions = [pos for _, _, pos in tokens]
    slots = [rows[i][pos // PAGE] * PAGE + pos % PAGE for i, _, pos in tokens]
    pad = pt - len(tokens)
    return {
        **_sampling(cols), **_token_members(cols, p, pt),
        "positions": positions + [0] * pad, "slot_mapping": slots + [-1] * pad,
        "context_lens": ctx + [0] * (p - n),
        "kv_indptr": _prefix([-(-c // PAGE) for c in ctx], p),
        "block_tables": _rows(rows, p, PAGES_PER_REQ, []),
    }


def spec_index_members(cols: BatchColumns) -> dict[str, Values | None]:
    """Request ``r`` (its tokens from ``cu[r]``) verifies ``d_r`` drafts: target rows
    ``cu[r] .. cu[r] + d_r - 1``, bonus row ``cu[r] + d_r``, the inclusive draft prefix."""
    q, d = cols.query_lens.tolist(), cols.num_drafts.tolist()
    starts = _prefix(q, len(q))[:-1]
    return {"target_logits_indices": [starts[r] + a for r in range(len(q))
                                      for a in range(d[r])],
            "cu_num_draft_tokens": _prefix(d, len(d))[1:],
            "bonus_logits_indices": [starts[r] + d[r] for r in range(len(q))]}


def gdn_spec_members(groups: list[int], accepted: list[int], num_spec: int
                     ) -> dict[str, Values | None]:
    """A speculative GDN step: request ``i`` of state group ``g`` owns slots
    ``g * (1 + k) + j``; the accepted counts ride along; the non-speculative members are
    omitted."""
    return {"gdn_state_spec_state_indices": [[g * (1 + num_spec) + j
                                              for j in range(num_spec + 1)] for g in groups],
            "gdn_state_num_accepted_tokens": accepted,
            "gdn_state_non_spec_state_indices": None,
            "gdn_state_non_spec_state_indices_in": None}


def engram_members(cols: BatchColumns, rows: list[int], cursors: list[int], max_drafts: int
                   ) -> dict[str, Values | None]:
    """History rows, the cursor snapshot and the candidates ``snapshot + q - d + a`` for
    ``a <= d`` accepted drafts, -1 after."""
    q, d = cols.query_lens.tolist(), cols.num_drafts.tolist()
    return {"engram_history_rows": rows, "engram_cursor_snapshot": cursors,
            "engram_cursor_candidates": [
                [c + q[i] - d[i] + a if a <= d[i] else -1 for a in range(max_drafts + 1)]
                for i, c in enumerate(cursors)]}


def token_step_members(cols: BatchColumns, padded: int | None) -> dict[str, Values | None]:
    """``TokenStepInputs.prepare``: sampling and token inputs, the real tokens when eager."""
    p, pt = _grid(cols.query_lens.tolist(), padded, eager_exact=True)
    return {**_sampling(cols), **_token_members(cols, p, pt)}


def _plan_rows(tokens: list[tuple[int, int, int]], ctx: list[int], ratio: int, window: int,
               tail: bool, count: int) -> list[list[int]]:
    """``[token, request, position, window - min(j + 1, window)]`` for each selected token,
    in token order, then -1 rows up to ``count``: the tokens closing a block of ``ratio``
    positions, or (``tail``) those among the last ``window`` positions of their context."""
    out = [[t, i, pos, window - min(j + 1, window)]
           for t, (i, j, pos) in enumerate(tokens)
           if (pos >= ctx[i] - window if tail else (pos + 1) % ratio == 0)]
    return out + [[-1] * 4] * (count - len(out))


def v41_members(spans: list[RequestSpan], rows: list[list[int]], padded: int | None,
                ratios: tuple[tuple[int, int], ...]) -> dict[str, Values | None]:
    """``V41MetadataInputs.begin_step``: per-token positions and owners on the graph grid
    (0 / -1 for padding tokens), per-request lengths (0) and state slots (the dummy slot
    for padded requests; a fork source is the slot read), the plan rows per ratio, the
    256-token block rows (the dummy block for padded requests), the fp8 ``qo_indptr``
    (``arange(t + 1)``, then ``t``); the prefill-only chunk starts are omitted."""
    q = [sp.num_tokens for sp in spans]
    ctx = [sp.context_len for sp in spans]
    n = len(spans)
    p, pt = _grid(q, padded, eager_exact=False)
    tokens = _tokens(q, ctx)
    t = len(tokens)
    widest = max([*q, 1])
    slot_in = [sp.fork_source if sp.fork_source >= 0 else sp.state_slot for sp in spans]
    members: dict[str, Values | None] = {
        "v41_positions": [pos for _, _, pos in tokens] + [0] * (pt - t),
        "v41_token_batch_ids": [i for i, _, _ in tokens] + [-1] * (pt - t),
        "v41_seq_lens": ctx + [0] * (p - n),
        "v41_state_slot_out": [sp.state_slot for sp in spans] + [V41_DUMMY_SLOT] * (p - n),
        "v41_state_slot_in": slot_in + [V41_DUMMY_SLOT] * (p - n),
        "v41_chunk_starts": None,
        "v41_window_write_plan": None,
        "v41_qo_indptr": list(range(t + 1)) + [t] * (pt - t),
        "v41_block_tables": _rows(rows, p, V41_BLOCKS_PER_REQ, [V41_DUMMY_BLOCK]),
    }
    for r, k in ratios:
        members[f"v41_compress_plan_{r}"] = _plan_rows(tokens, ctx, r, k, False,
                                                       p * -(-widest // r))
        members[f"v41_write_plan_{r}"] = _plan_rows(tokens, ctx, r, k, True,
                                                    p * min(widest, k))
    return members


class Side:
    def __init__(self, backend: str, slots: int = 2,
                 scatter: str = PACKED_SCATTER) -> None:
        st_ = self.state = H2DRunnerState("cpu", backend=backend, num_slots=slots,
                                          scatter=scatter)
        self.gdn = GdnStateInputs(st_, max_reqs=REQS, num_spec=2, num_state_slots=12)
        self.engram = EngramInputs(st_, max_reqs=REQS, max_drafts=2, history_rows=4,
                                   history_len=64)
        self.step = DecodeStepInputs(st_,
                                     StepShape(max_reqs=REQS, max_tokens=TOKENS,
                                               max_pages_per_req=PAGES_PER_REQ, page_size=PAGE,
                                               num_pages=64),
                                     max_drafts=2, extra_groups=[GDN_STATE, ENGRAM])
        st_.bind()
        self.loop = MhaDraftLoop(self.step.decode, self.step.tokens)
        self.plan: DecodePlan | None = None
        #: how many calls of the last compound operation returned (the backends agree on it)
        self.progress = 0

    def destinations(self) -> dict[str, bytes]:
        return {n: b.gpu.numpy().tobytes() for n, b in self.state.buffers().items()}


#: each machine's publication groups and the producer groups each carries
Publications = dict[str, tuple[str, ...]]
DECODE_PUBLICATIONS: Publications = {
    DECODE_STEP: (SAMPLING, TOKEN_IDS, QUERY_PREFIX, SPEC_INDICES, MHA_DECODE, GDN_STATE,
                  ENGRAM)}
V41_PUBLICATIONS: Publications = {TOKEN_INPUTS: (SAMPLING, TOKEN_IDS, QUERY_PREFIX),
                                  V41_METADATA: (V41_METADATA,)}


def outcome(fn: Any) -> tuple[str, object]:
    try:
        value = fn()
    except Exception as exc:  # the two sides must fail alike
        return "error", type(exc).__name__
    return "ok", value


class _Differential(RuleBasedStateMachine):
    """The packed and direct sides (``self.sides``), the reference (``self.ref``), the
    epoch rules and the invariant."""

    sides: list[Any]
    ref: Reference
    #: how the packed side scatters (its subclasses ``*Triton``: the Triton kernel)
    packed_scatter = "reference"

    def both(self, op: Any) -> list[tuple[str, object]]:
        results = [outcome(lambda s=s: op(s)) for s in self.sides]
        assert results[0][0] == results[1][0], results
        if results[0][0] == "error":
            assert results[0][1] == results[1][1], results
        return results

    def progress(self) -> int:
        """How far the last compound operation got (a producer call may succeed before
        the next one is refused); the same on both backends."""
        got = [s.progress for s in self.sides]
        assert got[0] == got[1], got
        return int(got[0])

    @rule()
    def begin(self) -> None:
        if self.both(lambda s: s.state.begin())[0][0] == "ok":
            self.ref.begin()

    @rule()
    def finish(self) -> None:
        self.both(lambda s: s.state.finish())

    @rule()
    def resume(self) -> None:
        self.both(lambda s: s.state.resume())

    def publish_group(self, group: str, reason: bool) -> None:
        def op(s: Any) -> object:
            s.progress = 0
            if reason:
                s.state.reopen(group, "a deliberate second publication")
            s.progress = 1
            out = s.state.publish(group)
            s.progress = 2
            return out

        self.both(op)
        done = self.progress()
        if reason and done >= 1:
            self.ref.reopen(group)
        if done == 2:
            self.ref.publish(group)

    @invariant()
    def destinations_agree(self) -> None:
        if hasattr(self, "sides"):
            a, b = (s.destinations() for s in self.sides)
            assert a == b
            expected = self.ref.destinations()
            assert a.keys() == expected.keys()
            wrong = [n for n in a if a[n] != expected[n]]
            assert not wrong, f"destinations differ from the reference: {wrong}"


class BackendsAgree(_Differential):
    @initialize(slots=st.integers(1, 4))
    def setup(self, slots: int) -> None:
        self.sides = [Side("packed", slots, self.packed_scatter), Side("direct", slots)]
        self.ref = Reference(self.sides[0].state, DECODE_PUBLICATIONS)
        self.rows = [BlockTable([1, 2, 3]), BlockTable([4, 5]), BlockTable([6]),
                     BlockTable([7, 8, 9, 10])]

    @rule(n=st.integers(0, 4), drafts=st.lists(st.integers(0, 3), min_size=4, max_size=4),
          grow=st.integers(0, 2), padded=st.sampled_from([None, 3, 4]))
    def prepare_step(self, n: int, drafts: list[int], grow: int, padded: int | None) -> None:
        d = np.asarray(drafts[:n], np.int32)
        q = np.minimum(d + 1, 3).astype(np.int32)  # a draft count of 3 is refused (>= q)
        ctx = np.asarray([len(self.rows[i]) * PAGE - grow for i in range(n)], np.int32)
        cols = BatchColumns(
            query_lens=q, context_lens=ctx, temperatures=np.ones(n, np.float32),
            top_k=np.full(n, -1, np.int32), top_p=np.ones(n, np.float32),
            prev_sample_rows=np.full(n, -1, np.int32),
            token_ids=np.arange(int(q.sum()), dtype=np.int32), num_drafts=d)
        batch = ScheduledBatch((), False, PAGE, given_columns=cols,
                               given_block_tables=self.rows[:n])

        def op(s: Side) -> object:
            s.progress = 0
            plan = s.step.prepare(batch, padded)
            s.progress = 1
            s.step.tokens.prepare_spec_indices(batch)
            s.progress = 2
            s.plan = plan.decode
            return plan

        self.both(op)
        done = self.progress()
        if done >= 1:
            self.ref.produce(decode_step_members(cols, [list(r) for r in self.rows[:n]],
                                                 padded))
        if done >= 2:
            self.ref.produce(spec_index_members(cols))

    @precondition(lambda self: INTERPRETED and self.sides[0].plan is not None)
    @rule(rejected=st.lists(st.integers(0, 2), min_size=4, max_size=4),
          step=st.integers(1, 2))
    def advance_draft_loop(self, rejected: list[int], step: int) -> None:
        """The draft loop over the destinations as last published: both backends derive
        the same draft-step metadata and KV indices on the device."""
        counts = torch.tensor(rejected, dtype=torch.int32)

        def op(s: Side) -> object:
            assert s.plan is not None
            meta = s.loop.advance(s.plan, counts, step)
            return [t.tolist() for t in meta] + [s.loop.kv_indices.tolist()]

        results = self.both(op)
        assert results[0][0] == "ok", results[0]  # a consumer never fails on these inputs
        assert results[0] == results[1]

    @rule(n=st.integers(1, 4), drafts=st.lists(st.integers(0, 2), min_size=4, max_size=4),
          padded=st.sampled_from([None, 4]))
    def full_step(self, n: int, drafts: list[int], padded: int | None) -> None:
        """A whole valid step (begin, producers, publish, finish) in one rule, so that
        sequences reach publications often; each call is still compared on both sides."""
        self.begin()
        self.prepare_step(n, drafts, 0, padded)
        self.prepare_gdn(n, 1)
        self.publish(False)
        self.finish()

    @rule(n=st.integers(0, 4), accepted=st.integers(0, 3))
    def prepare_gdn(self, n: int, accepted: int) -> None:
        acc = np.full(n, accepted, np.int32)  # 0 is refused
        groups = np.arange(n, dtype=np.int32)
        ok = self.both(lambda s: s.gdn.prepare(groups, num_accepted=acc))[0][0] == "ok"
        if ok:
            self.ref.produce(gdn_spec_members(groups.tolist(), acc.tolist(), num_spec=2))

    @rule(n=st.integers(0, 3), cursor=st.integers(0, 70))
    def prepare_engram(self, n: int, cursor: int) -> None:
        q = np.full(n, 2, np.int32)
        cols = BatchColumns(
            query_lens=q, context_lens=q + 5, temperatures=np.ones(n, np.float32),
            top_k=np.full(n, -1, np.int32), top_p=np.ones(n, np.float32),
            prev_sample_rows=np.full(n, -1, np.int32), token_ids=np.zeros(2 * n, np.int32),
            num_drafts=np.ones(n, np.int32))
        batch = ScheduledBatch((), False, PAGE, given_columns=cols)
        rows, cursors = np.arange(n, dtype=np.int32), np.full(n, cursor, np.int32)
        if self.both(lambda s: s.engram.prepare(batch, rows, cursors))[0][0] == "ok":
            self.ref.produce(engram_members(cols, rows.tolist(), cursors.tolist(),
                                            max_drafts=2))

    @rule(reason=st.booleans())
    def publish(self, reason: bool) -> None:
        self.publish_group(DECODE_STEP, reason)

    @rule()
    def append_page(self) -> None:
        row = self.rows[0].lineage_copy()
        row.append_one(20 + len(row))
        self.rows[0] = row

class V41Side:
    def __init__(self, backend: str, slots: int, scatter: str = PACKED_SCATTER) -> None:
        st_ = self.state = H2DRunnerState("cpu", backend=backend, num_slots=slots,
                                          scatter=scatter)
        self.tokens = TokenStepInputs(st_, max_reqs=REQS, max_tokens=TOKENS)
        self.v4 = V41MetadataInputs(
            st_, max_reqs=REQS, max_tokens=TOKENS, max_blocks_per_req=V41_BLOCKS_PER_REQ,
            dummy_state_slot=V41_DUMMY_SLOT, dummy_block=V41_DUMMY_BLOCK, num_blocks=40,
            window=8, index_topk=4, fp8=True, envelope_rows=3,
            fuse_step_indptrs=False)  # the machine models the publications' members only
        st_.bind()
        self.plan: V41Plan | None = None
        self.progress = 0

    def destinations(self) -> dict[str, bytes]:
        return {n: b.gpu.numpy().tobytes() for n, b in self.state.buffers().items()}


class V41BackendsAgree(_Differential):
    @initialize(slots=st.integers(1, 4))
    def setup(self, slots: int) -> None:
        self.sides = [V41Side("packed", slots, self.packed_scatter), V41Side("direct", slots)]
        self.ref = Reference(self.sides[0].state, V41_PUBLICATIONS)
        self.rows = [BlockTable([1]), BlockTable([2, 3]), BlockTable([4]),
                     BlockTable([5, 6, 7])]
        self.next_block = 8

    @rule(n=st.integers(0, 4), widths=st.lists(st.integers(0, 4), min_size=4, max_size=4),
          back=st.integers(-1, 300), forks=st.lists(st.integers(-1, 8), min_size=4,
                                                      max_size=4),
          padded=st.sampled_from([None, 3, 4]))
    def prepare_step(self, n: int, widths: list[int], back: int, forks: list[int],
                     padded: int | None) -> None:
        """Ragged spans ending ``back`` tokens before each row's capacity (-1: one past
        it, refused); a width of 0 and too many tokens are refused too."""
        spans = [RequestSpan(widths[i], len(self.rows[i]) * V4_BLOCK - back, i, forks[i])
                 for i in range(n)]
        q = np.asarray(widths[:n], np.int32)
        cols = BatchColumns(
            query_lens=q, context_lens=np.asarray([sp.context_len for sp in spans], np.int32),
            temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
            top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
            token_ids=np.arange(int(q.sum()), dtype=np.int32),
            num_drafts=np.maximum(q - 1, 0).astype(np.int32))
        batch = ScheduledBatch((), False, V4_BLOCK, given_columns=cols)

        def op(s: V41Side) -> object:
            s.progress = 0
            tp = s.tokens.prepare(batch, padded)
            s.progress = 1
            s.plan = s.v4.begin_step(spans, block_tables=self.rows[:n], padded=padded)
            s.progress = 2
            return tp, s.plan

        self.both(op)
        done = self.progress()
        if done >= 1:
            self.ref.produce(token_step_members(cols, padded))
        if done >= 2:
            self.ref.produce(v41_members(spans, [list(r) for r in self.rows[:n]], padded,
                                         V4_RATIOS))

    @rule(group=st.sampled_from([TOKEN_INPUTS, V41_METADATA]), reason=st.booleans())
    def publish(self, group: str, reason: bool) -> None:
        self.publish_group(group, reason)

    @precondition(lambda self: INTERPRETED and self.sides[0].plan is not None)
    @rule()
    def step_indptrs(self) -> None:
        """The first consumer over the destinations as last published."""
        def op(s: V41Side) -> object:
            assert s.plan is not None
            out = s.v4.generate_step_indptrs(s.plan)
            extra = (s.v4.block_tables_per_token, s.v4.hca_indices)
            return [t.tolist() for t in (*out, *extra) if isinstance(t, torch.Tensor)]

        results = self.both(op)
        assert results[0][0] == "ok", results[0]  # a consumer never fails on these inputs
        assert results[0] == results[1]

    @rule(n=st.integers(1, 4), widths=st.lists(st.integers(1, 3), min_size=4, max_size=4),
          padded=st.sampled_from([None, 4]))
    def full_step(self, n: int, widths: list[int], padded: int | None) -> None:
        """A whole valid step (begin, both producers, both publications, finish) in one
        rule, so that sequences reach publications often; each call is still compared."""
        self.begin()
        self.prepare_step(n, widths, 0, [-1] * 4, padded)
        self.publish(TOKEN_INPUTS, False)
        self.publish(V41_METADATA, False)
        self.finish()

    @rule(row=st.integers(0, 3), replace=st.booleans())
    def change_row(self, row: int, replace: bool) -> None:
        """Append a block (a lineage copy), or replace the row by a new one."""
        if replace:
            self.rows[row] = BlockTable([self.next_block])
        elif len(self.rows[row]) < 4:
            r = self.rows[row].lineage_copy()
            r.append_one(self.next_block)
            self.rows[row] = r
        self.next_block = 8 + (self.next_block - 7) % 32


class BackendsAgreeTriton(BackendsAgree):
    """`BackendsAgree` with the Triton scatter kernel on the packed side."""

    packed_scatter = "triton"


class V41BackendsAgreeTriton(V41BackendsAgree):
    """`V41BackendsAgree` with the Triton scatter kernel on the packed side."""

    packed_scatter = "triton"


def _settings(examples: int) -> settings:
    return settings(max_examples=examples, stateful_step_count=25, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


BackendsAgree.TestCase.settings = _settings(EXAMPLES)
V41BackendsAgree.TestCase.settings = _settings(EXAMPLES)
BackendsAgreeTriton.TestCase.settings = _settings(max(1, EXAMPLES // TRITON_SHARE))
V41BackendsAgreeTriton.TestCase.settings = _settings(max(1, EXAMPLES // TRITON_SHARE))
TestBackendsAgree = BackendsAgree.TestCase
TestV41BackendsAgree = V41BackendsAgree.TestCase
_needs_interpreter = pytest.mark.skipif(
    not INTERPRETED, reason="scatter='triton' on CPU needs TRITON_INTERPRET=1")
TestBackendsAgreeTriton = _needs_interpreter(BackendsAgreeTriton.TestCase)
TestV41BackendsAgreeTriton = _needs_interpreter(V41BackendsAgreeTriton.TestCase)


def test_the_machine_reaches_publications() -> None:
    """The operations are not all refused: a fixed valid sequence publishes on both, with
    the reference's bytes."""
    sides = [Side("packed"), Side("direct")]
    ref = Reference(sides[0].state, DECODE_PUBLICATIONS)
    rows = [BlockTable([1, 2]), BlockTable([3])]
    cols = BatchColumns(
        query_lens=np.array([2, 1], np.int32), context_lens=np.array([6, 3], np.int32),
        temperatures=np.ones(2, np.float32), top_k=np.full(2, -1, np.int32),
        top_p=np.ones(2, np.float32), prev_sample_rows=np.full(2, -1, np.int32),
        token_ids=np.arange(3, dtype=np.int32), num_drafts=np.array([1, 0], np.int32))
    batch = ScheduledBatch((), False, PAGE, given_columns=cols, given_block_tables=rows)
    for s in sides:
        s.state.begin()
        s.step.prepare(batch, 4)
        s.step.tokens.prepare_spec_indices(batch)
        s.gdn.prepare(np.arange(2, dtype=np.int32), num_accepted=np.array([2, 1], np.int32))
        s.state.publish(DECODE_STEP)
        s.state.finish()
    ref.produce(decode_step_members(cols, [[1, 2], [3]], 4))
    ref.produce(spec_index_members(cols))
    ref.produce(gdn_spec_members([0, 1], [2, 1], num_spec=2))
    ref.publish(DECODE_STEP)
    assert sides[0].destinations() == sides[1].destinations() == ref.destinations()
    assert sides[0].state.counters(DECODE_STEP).dmas == 1
    assert torch.equal(sides[0].step.decode.slot_mapping.gpu[:3],
                       torch.tensor([8, 9, 14]))  # positions 4, 5 in page 2; 2 in page 3


def test_the_v41_machine_reaches_publications() -> None:
    """A fixed valid V4.1 sequence publishes both groups on both sides, with the
    reference's bytes (and equal step indptrs under the interpreter)."""
    sides = [V41Side("packed", 2), V41Side("direct", 2)]
    ref = Reference(sides[0].state, V41_PUBLICATIONS)
    rows = [BlockTable([1, 2]), BlockTable([3])]
    spans = [RequestSpan(2, 300, 0, -1), RequestSpan(1, 100, 1, 0)]
    cols = BatchColumns(
        query_lens=np.array([2, 1], np.int32), context_lens=np.array([300, 100], np.int32),
        temperatures=np.ones(2, np.float32), top_k=np.full(2, -1, np.int32),
        top_p=np.ones(2, np.float32), prev_sample_rows=np.full(2, -1, np.int32),
        token_ids=np.arange(3, dtype=np.int32), num_drafts=np.array([1, 0], np.int32))
    batch = ScheduledBatch((), False, V4_BLOCK, given_columns=cols)
    for s in sides:
        s.state.begin()
        s.tokens.prepare(batch, 4)
        s.plan = s.v4.begin_step(spans, block_tables=rows, padded=4)
        s.state.publish(TOKEN_INPUTS)
        s.state.publish(V41_METADATA)
        s.state.finish()
    ref.produce(token_step_members(cols, 4))
    ref.produce(v41_members(spans, [[1, 2], [3]], 4, V4_RATIOS))
    ref.publish(TOKEN_INPUTS)
    ref.publish(V41_METADATA)
    assert sides[0].destinations() == sides[1].destinations() == ref.destinations()
    assert sides[0].state.counters(V41_METADATA).dmas == 1
    assert sides[0].v4.positions.gpu[:3].tolist() == [298, 299, 99]
    if INTERPRETED:
        got = [[t.tolist() for t in s.v4.generate_step_indptrs(s.plan)
                if isinstance(t, torch.Tensor)] for s in sides if s.plan is not None]
        assert got[0] == got[1]
