"""Bad inputs of the GDN, MRoPE, Engram, draft-loop and MHA-decode adapters.

One catalogue per family. Each case checks both halves of the rule with
:func:`bad_inputs.refuse`: the call raises :class:`AdapterInputError` naming the argument,
the request and the rule, and nothing observable moved (every source, destination and
count, the epoch, the group counters, and the adapter's private state: the block-table
snapshots' revisions and published record, the draft loop's
device outputs, Engram's device history and committed cursors). Then a corrected call in
the same epoch publishes, and its destination bytes are checked against an expectation
written here from the module docstring's rule.

Wrap cases are the reviewer's: an int64 of ``2**32`` (or more) or a uint64 of ``2**63``
bound for int32/int64 sources, floats where an integer is needed, reserved values (a GDN
request's negative slot, a fork source below -1). The last test guards the GDN producer's
speculative rows across changes of the padding.
"""

from __future__ import annotations

from collections.abc import Callable

import adapter_helpers as ah
import numpy as np
import pytest
import torch
from bad_inputs import Observed, refuse

from block_tables import BlockTable
from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    DECODE_STEP,
    ENGRAM,
    GDN_STATE,
    BatchColumns,
    DecodePlan,
    DecodeStepInputs,
    EngramInputs,
    GdnStateInputs,
    MhaDecodeInputs,
    MhaDraftLoop,
    PrefillInputs,
    ScheduledBatch,
    StepShape,
)
from h2d_runner_adapters.checks import AdapterInputError
from h2d_runner_adapters.paged import PagedInputs

POISON = 0x5A


def scatter(device: str) -> str:
    return "reference" if device == "cpu" else "auto"


def poison(st: H2DRunnerState) -> None:
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(POISON)


def i32(*values: int) -> np.ndarray:
    return np.array(values, np.int32)


def i64(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def table_state(*adapters: PagedInputs) -> tuple[object, ...]:
    """Each adapter's block-table snapshots (revision, prepared rows) and its published
    record: what a refused call must leave as it was."""
    out: list[object] = []
    for a in adapters:
        t = a.tables
        rec = t.published
        out.append(tuple((s.revision, s.num_rows) for s in t.snapshots))
        out.append(None if rec is None else (rec.slot, rec.revision, rec.rows,
                                             rec.keys.tobytes()))
        out.append(t.last_stage)
    return tuple(out)


def columns(q: np.ndarray, ctx: np.ndarray, drafts: np.ndarray | None = None) -> BatchColumns:
    n = q.size
    return BatchColumns(
        query_lens=q, context_lens=ctx, temperatures=np.ones(n, np.float32),
        top_k=np.full(n, -1, np.int32), top_p=np.ones(n, np.float32),
        prev_sample_rows=np.full(n, -1, np.int32),
        token_ids=np.arange(1, int(q.sum()) + 1, dtype=np.int32),
        num_drafts=np.zeros(n, np.int32) if drafts is None else drafts)


# ------------------------------------------------------------------------------------- GDN
K = 1  # speculative tokens of the GDN adapters under test: 1 + K = 2 slots per group
POOL = 8  # state slots of `gdn`: groups 0..3
CACHED = i32(0, 1, 2)  # the groups whose speculative rows slot 0's sources hold


class GdnWorld:
    """Three GDN adapters on one state: ``gdn`` (k=1, a pool of 8 slots), ``free`` (k=1,
    no pool: int32 slot indices bound it) and ``plain`` (k=0); epoch 1 published a
    speculative step of ``CACHED`` on ``gdn`` (the same groups' rows in slot 0's sources),
    epoch 2 is open."""

    def __init__(self, device: str) -> None:
        st = self.state = H2DRunnerState(device, scatter=scatter(device))
        self.gdn = GdnStateInputs(st, max_reqs=4, num_spec=K, num_state_slots=POOL)
        self.free = GdnStateInputs(st, max_reqs=4, num_spec=K, group="gdn_free")
        self.plain = GdnStateInputs(st, max_reqs=4, group="gdn_plain")
        st.bind()
        poison(st)
        st.begin()
        self.gdn.prepare(CACHED, num_accepted=i32(2, 1, 2))
        self.free.prepare(i32(1), fork_sources=i32(0))
        st.publish(GDN_STATE)
        st.publish("gdn_free")
        st.finish()
        st.begin()
        self.seen = Observed(st, groups=(GDN_STATE, "gdn_free", "gdn_plain"))


G = i32(3, 0, 2)  # the valid retry's groups (padded to 4)
ACC = i32(2, 1, 2)
FORK = i32(-1, 3, -1)

#: case -> (adapter, the refused call, the message, the retry: "spec" or "fork")
GDN_CASES: dict[str, tuple[str, Callable[[GdnStateInputs], object], str, str]] = {
    "groups-int64-2**32": (
        "gdn", lambda a: a.prepare(i64(0, 2**32)),
        r"gdn_state: request 1's state group 4294967296 needs slots up to 8589934593, past "
        r"the pool's 8 slots; state_groups must lie in \[0, 3\]", "fork"),
    "groups-uint64-2**63": (
        "gdn", lambda a: a.prepare(np.array([2**63, 0], np.uint64)),
        r"request 0's state group 9223372036854775808 needs slots .* past the pool's 8 "
        r"slots; state_groups", "fork"),
    "groups-wrap-to-negative-slot": (  # 2**30 * 2 is -2**31 in int32: a negative slot
        "free", lambda a: a.prepare(i64(5, 2**30)),
        r"gdn_free: request 1's state group 1073741824 needs slots up to 2147483649, past "
        r"the int32 slot indices \(at most 2147483648 slots\); state_groups must lie in "
        r"\[0, 1073741823\]", "fork"),
    "groups-negative": (
        "gdn", lambda a: a.prepare(i32(0, -1)),
        r"request 1 has a negative state group \(state_groups=-1\); a real request owns "
        r"slots >= 0, padded rows get PAD_SLOT_ID", "fork"),
    "groups-int64-below-int32": (
        "free", lambda a: a.prepare(i64(-(2**32), 1)),
        r"gdn_free: request 0 has a negative state group \(state_groups=-4294967296\)", "fork"),
    "groups-float": (
        "gdn", lambda a: a.prepare(np.array([0.0, 1.0])),
        r"state_groups must be a 1-D integer numpy array .* got a float64 array", "fork"),
    "groups-list": ("gdn", lambda a: a.prepare([0, 1]),  # type: ignore[arg-type]
                    r"state_groups must be a 1-D integer numpy array .* got list", "fork"),
    "groups-2d": ("gdn", lambda a: a.prepare(np.zeros((2, 1), np.int32)),
                  r"state_groups must be a 1-D integer numpy array", "fork"),
    "groups-over-max-reqs": ("gdn", lambda a: a.prepare(np.zeros(5, np.int32)),
                             r"state_groups has 5 requests, more than max_reqs=4", "fork"),
    "padded-below-batch": ("gdn", lambda a: a.prepare(i32(0, 1), padded=1),
                           r"padded=1 must be an int >= the batch's 2 requests", "fork"),
    "padded-float": ("gdn", lambda a: a.prepare(i32(0, 1), padded=4.0),  # type: ignore[arg-type]
                     r"padded=4.0 must be an int", "fork"),
    "padded-over-max-reqs": ("gdn", lambda a: a.prepare(i32(0, 1), padded=5),
                             r"padded=5 exceeds max_reqs=4", "fork"),
    "fork-below-minus-one": (
        "gdn", lambda a: a.prepare(i32(0, 1), fork_sources=i32(-1, -2)),
        r"request 1 has fork_sources=-2; it must be -1 \(no fork\) or the state group", "fork"),
    "fork-int64-2**32": (
        "gdn", lambda a: a.prepare(i32(0, 1), fork_sources=i64(2**32, -1)),
        r"request 0's fork source 4294967296 needs slots up to 8589934593, past the pool's "
        r"8 slots; fork_sources must lie in \[-1, 3\]", "fork"),
    "fork-uint64-2**63": (
        "free", lambda a: a.prepare(i32(0, 1), fork_sources=np.array([0, 2**63], np.uint64)),
        r"request 1's fork source 9223372036854775808 .* fork_sources", "fork"),
    "fork-float": ("gdn", lambda a: a.prepare(i32(0, 1), fork_sources=np.array([-1.0, 1.0])),
                   r"fork_sources must be a 1-D integer numpy array \(2 entries", "fork"),
    "fork-length": ("gdn", lambda a: a.prepare(i32(0, 1), fork_sources=i32(-1)),
                    r"fork_sources must be .*\(2 entries, one per request\), got an int32 "
                    r"array of shape \(1,\)", "fork"),
    "accepted-int64-2**32+1": (
        "gdn", lambda a: a.prepare(i32(0, 1), num_accepted=i64(1, 2**32 + 1)),
        r"request 1 has num_accepted=4294967297; it must be in \[1, 2\]", "spec"),
    "accepted-uint64-2**63": (
        "gdn", lambda a: a.prepare(i32(0, 1), num_accepted=np.array([2**63, 1], np.uint64)),
        r"request 0 has num_accepted=9223372036854775808; it must be in \[1, 2\]", "spec"),
    "accepted-zero": ("gdn", lambda a: a.prepare(i32(0, 1), num_accepted=i32(0, 1)),
                      r"request 0 has num_accepted=0; it must be in \[1, 2\]", "spec"),
    "accepted-float": ("gdn", lambda a: a.prepare(i32(0, 1), num_accepted=np.ones(2)),
                       r"num_accepted must be a 1-D integer numpy array \(2 entries", "spec"),
    "accepted-length": ("gdn", lambda a: a.prepare(i32(0, 1), num_accepted=i32(1)),
                        r"num_accepted must be .*2 entries, one per request", "spec"),
    "accepted-cached-rows": (  # the row-cache hit still checks every accepted count
        "gdn", lambda a: a.prepare(CACHED, num_accepted=i64(1, 2**32 + 1, 1)),
        r"request 1 has num_accepted=4294967297", "spec"),
    "accepted-cached-rows-bad-padded": (
        "gdn", lambda a: a.prepare(CACHED, padded=2, num_accepted=ACC),
        r"padded=2 must be an int >= the batch's 3 requests", "spec"),
    "spec-with-fork": (
        "gdn", lambda a: a.prepare(i32(0, 1), num_accepted=i32(1, 1), fork_sources=i32(-1, 2)),
        r"speculative steps take no fork sources", "spec"),
    "spec-with-bad-fork-array": (
        "gdn", lambda a: a.prepare(i32(0, 1), num_accepted=i32(1, 1),
                                   fork_sources=i64(-1, -(2**32))),
        r"request 1 has fork_sources=-4294967296; it must be -1", "spec"),
    "spec-without-num-spec": ("plain", lambda a: a.prepare(i32(0), num_accepted=i32(1)),
                              r"gdn_plain: num_accepted given but the adapter was built with "
                              r"num_spec=0; pass num_spec=k", "fork"),
}


def _gdn_retry(w: GdnWorld, a: GdnStateInputs, kind: str) -> None:
    """A valid call in the same epoch publishes exactly what the docstring says."""
    k1 = a.num_spec + 1
    n, p = G.size, 4
    st = w.state
    if kind == "spec":
        plan = a.prepare(G, padded=p, num_accepted=ACC)
        assert plan.astuple() == (n, p, True)
        assert st.count(a.non_spec) is None and st.count(a.non_spec_in) is None
        st.publish(a.group)
        assert a.spec is not None and a.num_accepted is not None
        want = [[g * k1 + j for j in range(k1)] for g in G.tolist()] + [[-1] * k1] * (p - n)
        assert a.spec.gpu[:p].tolist() == want
        assert a.num_accepted.gpu[:p].tolist() == ACC.tolist() + [1] * (p - n)
        return
    plan = a.prepare(G, padded=p, fork_sources=FORK)
    assert plan.astuple() == (n, p, False)
    st.publish(a.group)
    base = [g * k1 for g in G.tolist()]
    read = [f * k1 if f >= 0 else b for f, b in zip(FORK.tolist(), base, strict=True)]
    assert a.non_spec.gpu[:p].tolist() == base + [-1] * (p - n)
    assert a.non_spec_in.gpu[:p].tolist() == read + [-1] * (p - n)


@pytest.mark.parametrize("case", list(GDN_CASES))
def test_gdn_bad_input_refused_then_retry_publishes(device: str, case: str) -> None:
    w = GdnWorld(device)
    name, call, match, retry = GDN_CASES[case]
    a: GdnStateInputs = getattr(w, name)
    refuse(w.seen, lambda: call(a), AdapterInputError, match)
    _gdn_retry(w, a, retry)
    w.state.finish()
    ah.sync(device)


def test_gdn_row_cache_key_includes_the_padding(device: str) -> None:
    """The speculative rows' cache (per slot) must key on the padded count: the same
    groups with more padding on the same slot publish PAD_SLOT_ID (-1) rows and accepted
    count 1 for the padded requests, never the rows an earlier, wider step left there
    (without the padding in the key they would read and write real state slots)."""
    st = H2DRunnerState(device, scatter=scatter(device))
    gdn = GdnStateInputs(st, max_reqs=4, num_spec=K, num_state_slots=POOL)
    st.bind()
    poison(st)
    assert gdn.spec is not None and gdn.num_accepted is not None
    steps = [(i32(0, 1, 2, 3), None, i32(2, 2, 2, 2)),  # fills every row with real slots
             (i32(1, 2), None, i32(1, 2)),
             (i32(1, 2), 4, i32(2, 1)),  # same groups, now padded on the same slot
             (i32(1, 2), 3, i32(1, 1)),
             (i32(1, 2), None, i32(2, 2))]
    for groups, padded, acc in steps:
        st.begin()
        plan = gdn.prepare(groups, padded=padded, num_accepted=acc)
        st.publish(GDN_STATE)
        st.finish()
        ah.sync(device)
        n = groups.size
        p = n if padded is None else padded
        assert plan.astuple() == (n, p, True)
        want = [[2 * g, 2 * g + 1] for g in groups.tolist()] + [[-1, -1]] * (p - n)
        assert gdn.spec.gpu[:p].tolist() == want, (groups, padded)
        assert gdn.num_accepted.gpu[:p].tolist() == acc.tolist() + [1] * (p - n)


# ----------------------------------------------------------------------------------- MRoPE
IMAGE = np.stack([np.arange(20) // 4, np.arange(20) % 4, np.arange(20) % 3 + 7]).astype(
    np.int64)  # a prompt's [3, L] MRoPE positions


class MropeWorld:
    """An MRoPE decode adapter, a plain one (prefixed) and an MRoPE prefill adapter on one
    state, over three requests; epoch 1 published one step of each (their layouts and
    table snapshots exist), epoch 2 is open."""

    def __init__(self, device: str) -> None:
        st = self.state = H2DRunnerState(device, scatter=scatter(device))
        shape = StepShape(max_reqs=4, max_tokens=16, max_pages_per_req=8, page_size=ah.PAGE)
        self.dec = MhaDecodeInputs(st, shape, mrope=True)
        self.plain = MhaDecodeInputs(st, shape, prefix="plain_")
        self.pre = PrefillInputs(st, shape, mrope=True)
        st.bind()
        poison(st)
        self.reqs = ah.Requests(3)
        for c in (6, 9, 3):
            self.reqs.add(c)
        self.reqs.grow(1)
        st.begin()
        batch = self.decode_batch()
        self.dec.prepare(batch, 4, mrope_deltas=i64(1, 2, 3))
        self.plain.prepare(batch)
        self.pre.prepare(self.prefill_batch())
        for g in (self.dec.group, self.plain.group, self.pre.group):
            st.publish(g)
        st.finish()
        self.reqs.grow(1)
        st.begin()
        self.seen = Observed(
            st, extra=lambda: table_state(self.dec, self.plain, self.pre),
            groups=(self.dec.group, self.plain.group, self.pre.group))

    def decode_batch(self) -> ScheduledBatch:
        return self.reqs.decode_batch(1, deferred=False)

    def prefill_batch(self) -> ScheduledBatch:
        return self.reqs.prefill_batch(list(CHUNK))


CHUNK = (2, 3, 1)
DELTAS = i64(-3, 40, 0)


def _positions(ctx: int, col: int, value: int, dtype: type = np.int64, plane: int = 1
               ) -> list[np.ndarray | None]:
    """Prompt positions of request 0 with ``value`` at ``[plane, col]`` (a column of its
    chunk when ``col`` is ``ctx - 1``)."""
    src = IMAGE.astype(dtype)
    src[plane, col] = value
    return [src, None, IMAGE]


#: case -> (the refused call, the message)
MROPE_CASES: dict[str, tuple[Callable[[MropeWorld], object], str]] = {
    "deltas-uint64-2**63": (
        lambda w: w.dec.prepare(w.decode_batch(), mrope_deltas=np.array([0, 2**63, 0],
                                                                        np.uint64)),
        r"mha_decode: request 1 has mrope_deltas=9223372036854775808; it must be in "
        r"\[-2147483648, 2147483647\]"),
    "deltas-int64-2**32": (
        lambda w: w.dec.prepare(w.decode_batch(), mrope_deltas=i64(0, 0, 2**32)),
        r"request 2 has mrope_deltas=4294967296; it must be in \[-2147483648, 2147483647\]"),
    "deltas-int64-below-int32": (
        lambda w: w.dec.prepare(w.decode_batch(), mrope_deltas=i64(-(2**31) - 1, 0, 0)),
        r"request 0 has mrope_deltas=-2147483649"),
    "deltas-float": (
        lambda w: w.dec.prepare(w.decode_batch(), mrope_deltas=np.array([0.0, 1.5, 0.0])),
        r"mrope_deltas must be a 1-D integer numpy array with one delta per request \(3\), "
        r"got a float64 array"),
    "deltas-bool": (
        lambda w: w.dec.prepare(w.decode_batch(), mrope_deltas=np.zeros(3, bool)),
        r"mrope_deltas must be a 1-D integer numpy array"),
    "deltas-missing": (lambda w: w.dec.prepare(w.decode_batch()),
                       r"mrope_deltas must be .* got NoneType; pass zeros for text-only"),
    "deltas-length": (lambda w: w.dec.prepare(w.decode_batch(), mrope_deltas=i64(0, 0)),
                      r"one delta per request \(3\), got an int64 array of shape \(2,\)"),
    "deltas-2d": (lambda w: w.dec.prepare(w.decode_batch(), mrope_deltas=np.zeros((3, 1),
                                                                                  np.int64)),
                  r"mrope_deltas must be a 1-D integer numpy array"),
    "deltas-without-planes": (
        lambda w: w.plain.prepare(w.decode_batch(), mrope_deltas=DELTAS),
        r"plain_mha_decode: mrope_deltas given but the adapter has no MRoPE planes"),
    "decode-padded-float": (
        lambda w: w.dec.prepare(w.decode_batch(), 4.0, mrope_deltas=DELTAS),  # type: ignore[arg-type]
        r"padded=4.0 must be an int >= the batch's 3 requests"),
    "planes-past-max-tokens": (
        lambda w: w.dec.mrope_planes(DecodePlan(3, 4, 1, 3, 17, 0, "whole")),
        r"mha_decode: plan.padded_tokens=17 must be in \[0, 16\]"),
    "prompt-int64-2**32": (
        lambda w: w.pre.prepare(w.prefill_batch(), mrope_positions=_positions(
            w.reqs.ctx[0], w.reqs.ctx[0] - 1, 2**32)),
        r"prefill_inputs: mrope_positions of request 0 holds 4294967296 at plane 1, column 7;"
        r" prompt positions must be in \[0, 2147483647\]"),
    "prompt-uint64-2**63": (
        lambda w: w.pre.prepare(w.prefill_batch(), mrope_positions=_positions(
            w.reqs.ctx[0], w.reqs.ctx[0] - 2, 2**63, np.uint64, plane=2)),
        r"mrope_positions of request 0 holds 9223372036854775808 at plane 2, column 6"),
    "prompt-negative": (
        lambda w: w.pre.prepare(w.prefill_batch(), mrope_positions=_positions(
            w.reqs.ctx[0], w.reqs.ctx[0] - 1, -1, plane=0)),
        r"mrope_positions of request 0 holds -1 at plane 0, column 7"),
    "prompt-float": (
        lambda w: w.pre.prepare(w.prefill_batch(),
                                mrope_positions=[IMAGE.astype(np.float64), None, None]),
        r"mrope_positions of request 0 must be an integer array of shape \(3, L\)"),
    "prompt-two-planes": (
        lambda w: w.pre.prepare(w.prefill_batch(), mrope_positions=[None, IMAGE[:2], None]),
        r"mrope_positions of request 1 must be an integer array of shape \(3, L\) .* got "
        r"ndarray \(2, 20\)"),
    "prompt-shorter-than-context": (
        lambda w: w.pre.prepare(w.prefill_batch(), mrope_positions=[None, IMAGE[:, :5], None]),
        r"mrope_positions of request 1 .* L >= its context length 11"),
    "prompt-shorter-delta-below-zero": (
        lambda w: w.pre.prepare(w.prefill_batch(), mrope_positions=[None, IMAGE[:, :5], None],
                                mrope_deltas=i64(0, -9, 0)),
        r"prefill_inputs: request 1's columns past its prompt \(5\) would hold positions "
        r"-1\.\.1 \(column \+ mrope_deltas=-9\)"),
    "prefill-deltas-length": (
        lambda w: w.pre.prepare(w.prefill_batch(), mrope_positions=[None, IMAGE[:, :5], None],
                                mrope_deltas=i64(0, 7)),
        r"prefill_inputs: mrope_deltas must be a 1-D integer numpy array with one delta per "
        r"request \(3\)"),
    "prefill-deltas-int64-2**32": (
        lambda w: w.pre.prepare(w.prefill_batch(), mrope_positions=[None, IMAGE[:, :5], None],
                                mrope_deltas=i64(0, 2**32, 0)),
        r"prefill_inputs: .*mrope_deltas"),
    "prompt-count": (
        lambda w: w.pre.prepare(w.prefill_batch(), mrope_positions=[IMAGE]),
        r"mrope_positions must be a sequence with one entry per request \(3\)"),
    "prompt-not-a-sequence": (
        lambda w: w.pre.prepare(w.prefill_batch(), mrope_positions=np.stack([IMAGE] * 3)),  # type: ignore[arg-type]
        r"mrope_positions must be a sequence"),
}


def _mrope_retry(w: MropeWorld) -> None:
    """The corrected calls publish the docstring's planes: decode ``position + delta`` on
    every plane at the running width (padding 0); prefill each request's chunk columns of
    its prompt positions, or its ordinary positions."""
    st = w.state
    batch = w.decode_batch()
    plan = w.dec.prepare(batch, 4, mrope_deltas=DELTAS)
    st.publish(w.dec.group)
    ctx = w.reqs.ctx
    plane = [c - 1 + int(d) for c, d in zip(ctx, DELTAS.tolist(), strict=True)] + [0]
    assert plan.padded_tokens == 4
    assert w.dec.mrope_planes(plan).cpu().tolist() == [plane] * 3
    prompts: list[np.ndarray | None] = [IMAGE, None, IMAGE.astype(np.uint64)]
    pplan = w.pre.prepare(w.prefill_batch(), mrope_positions=prompts)
    st.publish(w.pre.group)
    want: list[list[int]] = [[], [], []]
    for q, c, src in zip(CHUNK, ctx, prompts, strict=True):
        for a in range(3):
            want[a] += (list(range(c - q, c)) if src is None
                        else [int(x) for x in src[a, c - q : c]])
    assert w.pre.mrope_planes(pplan).cpu().tolist() == want


@pytest.mark.parametrize("case", list(MROPE_CASES))
def test_mrope_bad_input_refused_then_retry_publishes(device: str, case: str) -> None:
    w = MropeWorld(device)
    assert w.reqs.ctx == [8, 11, 5]  # the messages' columns and lengths
    call, match = MROPE_CASES[case]
    refuse(w.seen, lambda: call(w), AdapterInputError, match)
    _mrope_retry(w)
    w.state.finish()
    ah.sync(device)


# ---------------------------------------------------------------------------------- Engram
HISTORY_ROWS, HISTORY_LEN, MAX_DRAFTS = 6, 40, 2


class EngramWorld:
    """An Engram adapter (4 requests, 2 drafts, a 6 x 40 history); epoch 1 published one
    step, epoch 2 is open."""

    def __init__(self, device: str) -> None:
        st = self.state = H2DRunnerState(device, scatter=scatter(device))
        self.eng = EngramInputs(st, max_reqs=4, max_drafts=MAX_DRAFTS,
                                history_rows=HISTORY_ROWS, history_len=HISTORY_LEN)
        st.bind()
        poison(st)
        self.eng.history.fill_(-4)
        st.begin()
        self.eng.prepare(batch(i32(2, 2), i32(1, 0)), i32(5, 1), i32(3, 4))
        st.publish(ENGRAM)
        st.finish()
        st.begin()
        e = self.eng
        self.seen = Observed(st, extra=lambda: (e.history.cpu().numpy().tobytes(),
                                                e.committed.cpu().numpy().tobytes()),
                             groups=(ENGRAM,))


def batch(q: np.ndarray, drafts: np.ndarray) -> ScheduledBatch:
    return ScheduledBatch((), False, 16, given_columns=columns(
        q, np.full(q.size, 100, np.int32), drafts))


Q, D = i32(3, 1, 2), i32(2, 0, 1)
ROWS, CURSORS = i32(4, 0, 2), i32(0, 7, 30)


def _eng(w: EngramWorld, q: np.ndarray = Q, d: np.ndarray = D, rows: object = ROWS,
         cursors: object = CURSORS) -> object:
    return w.eng.prepare(batch(q, d), rows, cursors)  # type: ignore[arg-type]


ENGRAM_CASES: dict[str, tuple[Callable[[EngramWorld], object], str]] = {
    "cursor-int64-max": (  # cursor + q would wrap to a negative int64 and pass
        lambda w: _eng(w, cursors=i64(0, 2**63 - 1, 0)),
        r"engram: request 1 has cursor \+ query tokens past the history length 40 "
        r"\(cursors=9223372036854775807\)"),
    "cursor-uint64-2**63": (
        lambda w: _eng(w, cursors=np.array([0, 0, 2**63], np.uint64)),
        r"request 2 has cursor \+ query tokens past the history length 40 "
        r"\(cursors=9223372036854775808\)"),
    "cursor-int64-2**32": (  # the int32 snapshot would hold 0
        lambda w: _eng(w, cursors=i64(2**32, 0, 0)),
        r"request 0 has cursor \+ query tokens past .* \(cursors=4294967296\)"),
    "cursor-negative": (lambda w: _eng(w, cursors=i32(0, -1, 0)),
                        r"request 1 has a negative cursor \(cursors=-1\)"),
    "cursor-plus-query-past-history": (
        lambda w: _eng(w, cursors=i32(0, 0, 39)),
        r"request 2 has cursor \+ query tokens past the history length 40 \(cursors=39, "
        r"query_lens=2\)"),
    "cursor-float": (lambda w: _eng(w, cursors=np.zeros(3)),
                     r"cursors must be a 1-D integer numpy array with one entry per request "
                     r"\(3\), got a float64 array"),
    "cursor-length": (lambda w: _eng(w, cursors=i32(0, 0)),
                      r"cursors must be .*\(3\), got an int32 array of shape \(2,\)"),
    "rows-int64-2**32": (lambda w: _eng(w, rows=i64(0, 2**32, 1)),
                         r"request 1 has a history row outside \[0, 6\) \(rows=4294967296\)"),
    "rows-uint64-2**63": (lambda w: _eng(w, rows=np.array([2**63, 0, 1], np.uint64)),
                          r"request 0 has a history row outside \[0, 6\) "
                          r"\(rows=9223372036854775808\)"),
    "rows-negative": (lambda w: _eng(w, rows=i32(0, 1, -1)),
                      r"request 2 has a history row outside \[0, 6\) \(rows=-1\)"),
    "rows-past-table": (lambda w: _eng(w, rows=i32(6, 1, 2)),
                        r"request 0 has a history row outside \[0, 6\)"),
    "rows-shared": (lambda w: _eng(w, rows=i32(3, 1, 3)),
                    r"request 2 has history row 3, already request 0's \(rows must be "
                    r"distinct"),
    "rows-float": (lambda w: _eng(w, rows=np.array([0.0, 1.0, 2.0])),
                   r"rows must be a 1-D integer numpy array"),
    "rows-list": (lambda w: _eng(w, rows=[0, 1, 2]), r"rows must be .* got list"),
    "drafts-past-max": (lambda w: _eng(w, q=i32(4, 1, 2), d=i32(3, 0, 1)),
                        r"request 0 has num_drafts=3; it must be in \[0, 2\]"),
    "drafts-not-below-query": (
        lambda w: _eng(w, q=i32(3, 1, 2), d=i32(2, 1, 1)),
        r"request 1 has drafts outside \[0, min\(max_drafts=2, query tokens - 1\)\] "
        r"\(num_drafts=1, query_lens=1\)"),
    "drafts-negative": (lambda w: _eng(w, d=i32(2, -1, 1)),
                        r"request 1 has num_drafts=-1; it must be in \[0, 2\]"),
    "drafts-int32-max": (lambda w: _eng(w, d=i32(2, 0, 2**31 - 1)),
                         r"request 2 has num_drafts=2147483647; it must be in \[0, 2\]"),
    "query-zero": (lambda w: _eng(w, q=i32(3, 0, 2), d=i32(2, 0, 1)),
                   r"request 1 has query_lens=0; it must be in \[1, 2147483647\]"),
    "too-many-requests": (lambda w: _eng(w, q=np.ones(5, np.int32), d=np.zeros(5, np.int32),
                                         rows=np.arange(5, dtype=np.int32),
                                         cursors=np.zeros(5, np.int32)),
                          r"5 requests exceed max_reqs=4"),
}


@pytest.mark.parametrize("case", list(ENGRAM_CASES))
def test_engram_bad_input_refused_then_retry_publishes(device: str, case: str) -> None:
    w = EngramWorld(device)
    call, match = ENGRAM_CASES[case]
    refuse(w.seen, lambda: call(w), AdapterInputError, match)
    plan = _eng(w)
    w.state.publish(ENGRAM)
    assert plan == (3, 3)
    e = w.eng
    # candidate a of request i: snapshot + q - d + a for a <= d, then -1
    want = [[c + q - d + a if a <= d else -1 for a in range(MAX_DRAFTS + 1)]
            for q, d, c in zip(Q.tolist(), D.tolist(), CURSORS.tolist(), strict=True)]
    assert e.rows.gpu[:3].tolist() == ROWS.tolist()
    assert e.snapshot.gpu[:3].tolist() == CURSORS.tolist()
    assert e.candidates.gpu[:3].tolist() == want
    w.state.finish()
    ah.sync(device)


# ------------------------------------------------------------------------------ draft loop
class DraftWorld:
    """A verify step (two requests at contexts 5 and 9, one token each, padded to 3)
    published through a decode step; the draft loop ran step 1 from it."""

    def __init__(self, device: str) -> None:
        ah.need_kernels(device)
        st = self.state = H2DRunnerState(device, scatter=scatter(device))
        self.step = DecodeStepInputs(st,
                                     StepShape(max_reqs=4, max_tokens=8, max_pages_per_req=4,
                                               page_size=4, num_pages=64))
        st.bind()
        poison(st)
        self.loop = MhaDraftLoop(self.step.decode, self.step.tokens)
        self.rows = [[10, 11], [20, 21, 22]]
        b = ScheduledBatch((), False, 4, given_columns=columns(i32(1, 1), i32(5, 9)),
                           given_block_tables=[BlockTable(r) for r in self.rows])
        st.begin()
        self.plan = self.step.prepare(b, 3).decode
        st.publish(DECODE_STEP)
        self.rejected = torch.zeros(4, dtype=torch.int32, device=device)
        self.loop.advance(self.plan, self.rejected, 1)
        loop = self.loop
        self.seen = Observed(st, extra=lambda: tuple(
            t.cpu().numpy().tobytes() for t in (*loop.meta, loop.kv_indices)),
            groups=(DECODE_STEP,))


DRAFT_CASES: dict[str, tuple[Callable[[DraftWorld], object], str]] = {
    "step-zero": (lambda w: w.loop.advance(w.plan, w.rejected, 0),
                  r"mha_decode: step=0 must be in \[1, "),
    "step-bool": (lambda w: w.loop.advance(w.plan, w.rejected, True),
                  r"step must be an int, got bool"),
    "step-float": (lambda w: w.loop.advance(w.plan, w.rejected, 2.0),  # type: ignore[arg-type]
                   r"step must be an int, got float"),
    "step-past-tables": (lambda w: w.loop.advance(w.plan, w.rejected, 16),
                         r"step=16 puts every draft position past the block tables' 16 "
                         r"positions \(4 pages of 4\); steps must be in \[1, 15\]"),
    "step-int64-2**32": (lambda w: w.loop.advance(w.plan, w.rejected, np.int64(2**32)),  # type: ignore[arg-type]
                         r"step=4294967296 must be in \[1, 2147483647\]"),
    "rejected-int64": (
        lambda w: w.loop.advance(w.plan, w.rejected.long(), 1),
        r"num_rejected must be a 1-D torch.int32 tensor .* got a torch.int64 tensor"),
    "rejected-short": (
        lambda w: w.loop.advance(w.plan, w.rejected[:1], 1),
        r"num_rejected must be .*\(>= plan.num_reqs=2 entries\), got a torch.int32 tensor "
        r"of shape \(1,\)"),
    "rejected-numpy": (lambda w: w.loop.advance(w.plan, np.zeros(4, np.int32), 1),  # type: ignore[arg-type]
                       r"num_rejected must be a 1-D torch.int32 tensor .* got an int32 array"),
    "rejected-2d": (lambda w: w.loop.advance(w.plan, w.rejected.view(2, 2), 1),
                    r"num_rejected must be a 1-D torch.int32 tensor"),
    "rejected-other-device": (
        lambda w: w.loop.advance(w.plan, torch.zeros(4, dtype=torch.int32, device="meta"), 1),
        r"num_rejected is on meta but the verify step's members are on"),
    "plan-tuple": (lambda w: w.loop.advance(w.plan.astuple(), w.rejected, 1),  # type: ignore[arg-type]
                   r"plan must be the DecodePlan of the verify step .* got tuple"),
    "plan-reqs-above-padded": (
        lambda w: w.loop.advance(w.plan.replace(num_reqs=4), w.rejected, 1),
        r"plan.num_reqs=4 must be in \[0, 3\]"),
    "plan-padded-past-capacity": (
        lambda w: w.loop.advance(w.plan.replace(padded_reqs=5), w.rejected, 1),
        r"plan.padded_reqs=5 must be in \[0, 4\]"),
}


def test_plan_refuses_a_float_count_at_construction(device: str) -> None:
    """A hand-built plan's counts are integers: a float is refused where the plan is made
    (it never reaches the draft loop, and is never truncated)."""
    w = DraftWorld(device)
    with pytest.raises(TypeError):
        w.plan.replace(num_reqs=2.0)
    assert w.plan.replace(num_reqs=2).num_reqs == 2
    w.state.finish()


@pytest.mark.parametrize("case", list(DRAFT_CASES))
def test_draft_loop_bad_input_refused_then_retry(device: str, case: str) -> None:
    """A refused draft step leaves the loop's device outputs as step 1 wrote them; the
    retry (step 2) derives the docstring's metadata from the verify step: ``pos = anchor
    - rejected + step``, ``context = pos + 1``, the KV slot from the block table, the KV
    prefix, the query prefix, and padded rows (position 0, context 0, slot -1)."""
    w = DraftWorld(device)
    call, match = DRAFT_CASES[case]
    refuse(w.seen, lambda: call(w), AdapterInputError, match)
    meta = w.loop.advance(w.plan, w.rejected, 2)
    ah.sync(device)
    page = 4
    pos = [c - 1 + 2 for c in (5, 9)]  # anchors 4 and 8, nothing rejected, step 2
    slots = [r[p // page] * page + p % page for r, p in zip(w.rows, pos, strict=True)]
    pages = [-(-(p + 1) // page) for p in pos]
    assert meta.positions[:3].tolist() == [*pos, 0]
    assert meta.context_lens[:3].tolist() == [p + 1 for p in pos] + [0]
    assert meta.slot_mapping[:3].tolist() == [*slots, -1]
    assert meta.kv_indptr[:4].tolist() == [0, pages[0], pages[0] + pages[1],
                                           pages[0] + pages[1]]
    assert meta.cu_seqlens_q[:4].tolist() == [0, 1, 2, 2]
    assert w.loop.kv_indices[: sum(pages)].tolist() == [
        x for r, k in zip(w.rows, pages, strict=True) for x in r[:k]]
    w.state.finish()


def test_prefill_prompt_shorter_than_context_extends_by_delta(device: str) -> None:
    """A recompute's re-prefill reads past a request's prompt planes: with ``mrope_deltas``
    those columns are ``position + delta`` on every plane (decode's rule); the prompt's own
    columns and the text-only requests are as before."""
    w = MropeWorld(device)
    ctx = w.reqs.ctx
    pplan = w.pre.prepare(w.prefill_batch(), mrope_positions=[IMAGE, IMAGE[:, :9], None],
                          mrope_deltas=i64(0, 7, 0))
    w.state.publish(w.pre.group)
    w.state.finish()
    ah.sync(device)
    want: list[list[int]] = [[], [], []]
    for a in range(3):
        want[a] += [int(x) for x in IMAGE[a, ctx[0] - CHUNK[0]: ctx[0]]]
        # request 1: columns ctx - 3 .. ctx - 1 = 8, 9, 10; the prompt planes end at 9
        want[a] += [int(IMAGE[a, 8]), 9 + 7, 10 + 7]
        want[a] += list(range(ctx[2] - CHUNK[2], ctx[2]))
    assert ctx[1] == 11
    assert w.pre.mrope_planes(pplan).cpu().tolist() == want
