"""``CountBatch`` (compiled and Python stores) against ``set_count``, its errors, and the
compiled arena ``pack`` against the packing oracle of the h2d-kernels tests.

A batch must leave every group record exactly as the same ``set_count`` calls leave it
(counts, active members, counted bytes, DMA end, header byte counts), publish the same
destination bytes, and reject every bad call with the same error as the Python path
before storing anything.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from oracle_packed import expected_arena  # the h2d-kernels packing oracle

from h2d_core import (
    CountBatch,
    CountError,
    DeclarationError,
    DuplicatePublicationError,
    EpochError,
    H2DBuffer,
    H2DRunnerState,
    MembershipError,
    NotBoundError,
    OwnerInvalidatedError,
    OwnerThreadError,
    PublicationEnqueueError,
)
from h2d_core.records import GroupRecord
from h2d_kernels.native import helper as kernels_native

# (name, dtype, shape, producer group, unit). Small members live in the arena (in place);
# ids/pos/flags (> 32 KiB, elements/bytes) are staged; "wide" (> 32 KiB rows) is a tail.
MEMBERS: list[tuple[str, torch.dtype, tuple[int, ...], str, str]] = [
    ("temps", torch.float32, (16,), "tok", "elements"),
    ("ids", torch.int32, (8_500,), "tok", "elements"),
    ("mask", torch.int32, (40,), "tok", "bytes"),
    ("bf", torch.bfloat16, (8, 3), "tok", "rows"),
    ("pos", torch.int64, (4_200,), "meta", "elements"),
    ("bt", torch.int32, (16, 24), "meta", "rows"),
    ("wide", torch.int32, (33, 256), "meta", "rows"),
    ("flags", torch.int16, (16_500,), "meta", "bytes"),
]
BATCHED = [m[0] for m in MEMBERS]
#: the batch without byte-unit members: every plain int count fits the compiled store
NON_BYTES = [m[0] for m in MEMBERS if m[4] != "bytes"]
#: members outside the batch, set with set_count (one in "meta"; "cu" only in "shared")
EXTRA = ("extra", torch.float16, (33,), "meta", "elements")
PRE = ("cu", torch.int32, (65,), "pre", "elements")

#: layout -> the publication groups one epoch may publish (in order)
LAYOUTS: dict[str, list[list[str]]] = {
    "single": [["g"]],  # every member in one producer group
    "combined": [["decode"]],  # tok + meta combined: one record carries all
    "split": [["tok", "meta"]],  # two records: the batch spans both
    "shared": [["decode"], ["prefill"]],  # tok carried by two combined groups
}

FAST = settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CHEAP = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


#: how the batch under test stores: the record's fused store, or one store per member (the
#: path of batches whose members live in several records), forced here per object
NATIVE_OR_PYTHON = [pytest.param("fused", id="fused"), pytest.param("per_member", id="per_member")]


def count_batch(state: Any, members: Any, path: str) -> Any:
    """``state.count_batch(members)``, its fused store switched off for ``per_member``."""
    batch = state.count_batch(members)
    if path == "per_member":
        batch._record = -1
    return batch


class Setup:
    def __init__(self, state: H2DRunnerState, buffers: dict[str, H2DBuffer]) -> None:
        self.state = state
        self.buffers = buffers


def _build(device: str, h: Any, layout: str = "combined", backend: str = "packed",
           num_slots: int = 2) -> Setup:
    state = H2DRunnerState(device, num_slots=num_slots, backend=backend,
                           scatter=h.scatter_mode(device))
    members = [*MEMBERS, EXTRA] + ([PRE] if layout == "shared" else [])
    bufs = {}
    for name, dtype, shape, group, unit in members:
        g = "g" if layout == "single" else group
        bufs[name] = state.buffer(name, shape, dtype, group=g, unit=unit)
    if layout in ("combined", "shared"):
        state.combine("decode", ["tok", "meta"])
    if layout == "shared":
        state.combine("prefill", ["tok", "pre"])
    state.bind()
    for b in bufs.values():
        b.gpu.view(torch.uint8).fill_(h.POISON)
    return Setup(state, bufs)


def _record_state(rec: GroupRecord) -> dict[str, Any]:
    return {
        "group": rec.plan.name,
        "counts": list(rec.counts),
        "types": [type(c).__name__ for c in rec.counts],
        "active": rec.active,
        "count_bytes": rec.count_bytes,
        "header": None if rec.packed is None else rec.packed.header.tolist(),
        "ranges": list(rec.ranges),
        "ranged": set(rec.ranged),
        "range_bytes": rec.range_bytes,
    }


def _records(s: H2DRunnerState) -> list[list[dict[str, Any]]]:
    """Every slot's group records."""
    return [[_record_state(r) for r in recs] for recs in s._slot_groups]


def _check_record_invariants(rec: GroupRecord) -> None:
    """What the stored counts imply, whichever path stored them."""
    members = rec.plan.members
    assert all(c is None or type(c) is int for c in rec.counts), rec.counts
    assert rec.active == sum(c is not None for c in rec.counts) + len(rec.ranged)
    assert rec.count_bytes == sum(
        c * m.spec.unit_bytes for c, m in zip(rec.counts, members, strict=True) if c is not None)


# Byte images are numpy copies: comparing them stays single-threaded and cheap on CPU.

def _bytes(t: torch.Tensor) -> np.ndarray:
    """A copy of a (contiguous) tensor's bytes, read on the host."""
    return t.reshape(-1).view(torch.uint8).cpu().numpy().copy()


def _dest(b: H2DBuffer) -> np.ndarray:
    return _bytes(b.gpu)


def _expected(b: H2DBuffer, count: int | None, before: np.ndarray) -> np.ndarray:
    """The destination after publishing ``count`` units of the current slot's source."""
    out = before.copy()
    if count:
        n = count * b.spec.unit_bytes
        out[:n] = _bytes(b.cpu)[:n]
    return out


def _poison(nbytes: int, h: Any) -> np.ndarray:
    return np.full(nbytes, h.POISON, dtype=np.uint8)


def _snapshot(setup: Setup, h: Any) -> dict[str, Any]:
    """Everything a rejected call must leave unchanged."""
    s = setup.state
    h.sync(s.device.type)
    return {
        "records": _records(s),
        "sources": {n: [_bytes(b.source(k)) for k in range(s.num_slots)]
                    for n, b in setup.buffers.items()},
        "dest": {n: _dest(b) for n, b in setup.buffers.items()},
        "published": {g: s.is_published(g) for g in (*s._plans, *s._producer_groups)},
        "counters": {g: s.counters(g).as_dict() for g in s._counters},
        "epoch": (s.epoch, s.epoch_open, s.current_slot, s.invalidated),
    }


def _assert_unchanged(setup: Setup, h: Any, before: dict[str, Any]) -> None:
    after = _snapshot(setup, h)
    assert after["records"] == before["records"]
    for n, srcs in before["sources"].items():
        for k, src in enumerate(srcs):
            assert np.array_equal(after["sources"][n][k], src), f"source {n} slot {k} changed"
        assert np.array_equal(after["dest"][n], before["dest"][n]), f"destination {n} changed"
    for key in ("published", "counters", "epoch"):
        assert after[key] == before[key], key


def _fill(setup: Setup, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for b in setup.buffers.values():
        raw = b.cpu.reshape(-1).view(torch.uint8).numpy()
        raw[:] = rng.integers(0, 256, raw.size, dtype=np.uint8)


def _close(s: H2DRunnerState) -> None:
    """Leave a state reusable by the next example whatever the last one did."""
    if s.invalidated is not None:
        s.reset()
    if s.epoch_open:
        s.finish()


def _valid_counts(buf: H2DBuffer, numpy: bool = True) -> st.SearchStrategy[int | None]:
    """None, 0, the capacity or a random count, as a plain int or (``numpy``) a numpy
    integer."""
    spec = buf.spec
    step = spec.itemsize if spec.unit.value == "bytes" else 1
    cap = spec.capacity // step
    plain = st.one_of(st.just(0), st.just(cap), st.integers(0, cap)).map(lambda n: n * step)
    if not numpy:
        return st.one_of(st.none(), plain)
    wrapped = st.tuples(plain, st.sampled_from([np.int64, np.int32])).map(
        lambda t: t[1](t[0]))
    return st.one_of(st.none(), plain, wrapped)


def _as_int(c: object) -> int | None:
    return None if c is None else int(c)  # type: ignore[call-overload]


# ------------------------------------------------------------------------- equivalence

CONFIGS = [("single", 1), ("single", 2), ("combined", 2), ("split", 2), ("shared", 2)]


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
@pytest.mark.parametrize("backend", ["packed", "direct"])
@pytest.mark.parametrize(("layout", "num_slots"), CONFIGS)
def test_batch_matches_set_count_state_and_bytes(
        device: str, h: Any, monkeypatch: pytest.MonkeyPatch, layout: str, num_slots: int,
        backend: str, native: str) -> None:
    ref = _build(device, h, layout, backend, num_slots)
    bat = _build(device, h, layout, backend, num_slots)
    batches: list[CountBatch] = []

    def run(members: list[str]) -> None:
        @FAST
        @given(data=st.data())
        def examples(data: st.DataObject) -> None:
            for state in (ref.state, bat.state):
                _close(state)
            order = data.draw(st.permutations(members), label="batch order")
            batch = count_batch(bat.state, [bat.buffers[n] for n in order], native)
            batches.append(batch)
            for _ in range(data.draw(st.integers(1, 2), label="epochs")):
                _epoch(data, order, batch)

        examples()

    def _epoch(data: st.DataObject, order: list[str], batch: CountBatch) -> None:
        seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
        for setup in (ref, bat):
            setup.state.begin()
            _fill(setup, seed)
        assert bat.state.current_slot == ref.state.current_slot
        final: dict[str, int | None] = {}
        # members outside the batch, and a set_count that the batch then overrides
        outside = [n for n in ref.buffers if n not in order]
        early = data.draw(st.sampled_from(order), label="set_count first")
        for name in [*outside, early]:
            c = data.draw(_valid_counts(ref.buffers[name]), label=f"set_count {name}")
            for setup in (ref, bat):
                setup.state.set_count(setup.buffers[name], c)
            final[name] = _as_int(c)
        # the first tuple has plain ints only (the compiled store takes it), a second one
        # in the same epoch overrides it and may carry numpy integers
        tuples = [data.draw(st.tuples(*[_valid_counts(ref.buffers[n], numpy=k > 0)
                                        for n in order]), label=f"batch counts {k}")
                  for k in range(data.draw(st.integers(1, 2), label="sets"))]
        for counts in tuples:
            for name, c in zip(order, counts, strict=True):
                ref.state.set_count(ref.buffers[name], c)
                final[name] = _as_int(c)
            batch.set(*counts)
            assert _records(bat.state) == _records(ref.state)
        for rec in bat.state._slot_groups[bat.state.current_slot]:
            _check_record_invariants(rec)
        for name in ref.buffers:
            assert bat.state.count(bat.buffers[name]) == final[name], name

        groups = data.draw(st.sampled_from(LAYOUTS[layout]), label="publish")
        sent = {m.name for g in groups for m in ref.state.plan(g).members}
        before = {n: _dest(b) for n, b in ref.buffers.items()}
        for setup in (ref, bat):
            for g in groups:
                setup.state.publish(g)
            setup.state.finish()
            h.sync(device)
        for name, b in ref.buffers.items():
            want = _expected(b, final[name], before[name]) if name in sent else before[name]
            assert np.array_equal(_dest(b), want), f"reference {name}"
            assert np.array_equal(_dest(bat.buffers[name]), want), f"batch {name}"
        assert _records(bat.state) == _records(ref.state)
        assert ({g: c.as_dict() for g, c in bat.state._counters.items()}
                == {g: c.as_dict() for g, c in ref.state._counters.items()})

    run(BATCHED)  # byte-unit counts are handed back to the Python check and store
    run(NON_BYTES)
    if native == "fused" and layout in ("single", "combined"):
        # one record carries every member: the record's fused store is the path taken
        assert batches and all(b._record >= 0 for b in batches)
    if native == "per_member":
        assert all(b._record == -1 for b in batches)


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_second_set_in_an_epoch_overrides_the_first(device: str, h: Any, backend: str,
                                                    native: str) -> None:
    setup = _build(device, h, "combined", backend)
    s, b = setup.state, setup.buffers
    order = ["temps", "bf", "bt", "ids"]
    batch = count_batch(s, [b[n] for n in order], native)
    s.begin(1)
    _fill(setup, 7)
    rec = s._slot_groups[1][s.plan("decode").index]
    idx = {m.name: i for i, m in enumerate(rec.plan.members)}
    batch.set(16, None, 3, 100)  # temps 16*4 B, bt 3 rows of 96 B, ids 100*4 B
    assert rec.active == 3 and rec.count_bytes == 64 + 288 + 400
    batch.set(None, 8, 1, 0)  # count -> None, None -> count (8 rows of 6 B), smaller, 0
    assert [rec.counts[idx[n]] for n in order] == [None, 8, 1, 0]
    assert rec.active == 3 and rec.count_bytes == 48 + 96
    after_second = _record_state(rec)
    batch.set(None, np.int64(8), np.int32(1), 0)  # type: ignore[arg-type]  # numpy ints
    assert _record_state(rec) == after_second
    s.publish("decode")
    if rec.packed is not None:  # the arena's header holds the last counts only
        assert [int(rec.packed.header[idx[n], 1]) for n in order] == [0, 48, 96, 0]
    s.finish()
    h.sync(device)
    assert np.array_equal(_dest(b["bf"]), _bytes(b["bf"].cpu))  # all 8 rows
    assert np.array_equal(_dest(b["bt"]), _expected(b["bt"], 1, _poison(16 * 96, h)))
    assert np.array_equal(_dest(b["temps"]), _poison(64, h))  # omitted by the second set
    assert np.array_equal(_dest(b["ids"]), _poison(34_000, h))  # an explicit empty one


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
@pytest.mark.parametrize("kind", ["direct backend", "noncontiguous destination"])
def test_compiled_batch_on_an_unpacked_group(device: str, h: Any, kind: str,
                                             native: str) -> None:
    """A record without an arena (direct copies) must take a compiled batch like any other."""
    s = H2DRunnerState(device, backend="direct" if kind == "direct backend" else "packed",
                       scatter=h.scatter_mode(device))
    wide = torch.zeros((8, 2), dtype=torch.int32, device=device)
    a = s.buffer("a", (8,), torch.int32, group="g",
                 gpu=wide[:, 0] if kind != "direct backend" else None)
    c = s.buffer("c", (6,), torch.int64, group="g")
    s.bind()
    assert not s.plan("g").packed
    batch = count_batch(s, [a, c], native)
    s.begin()
    a.np[:] = np.arange(1, 9)
    c.np[:] = np.arange(10, 16)
    batch.set(5, 6)
    rec = s._slot_groups[0][0]
    assert (rec.counts, rec.active, rec.count_bytes) == ([5, 6], 2, 5 * 4 + 6 * 8)
    assert rec.packed is None
    s.publish("g")
    s.finish()
    h.sync(device)
    assert a.gpu.cpu().tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert wide[:, 1].cpu().tolist() == [0] * 8
    assert c.gpu.cpu().tolist() == list(range(10, 16))


# ------------------------------------------------------------------------- errors

#: valid counts stored before a rejected call, and other valid counts for that call (a
#: premature store of them would show)
FIRST = {"temps": 5, "ids": 100, "mask": 8, "bf": 2, "pos": 7, "bt": 3, "wide": 4, "flags": 64}
OTHER = {"temps": 1, "ids": 50, "mask": 4, "bf": 1, "pos": 3, "bt": 1, "wide": 2, "flags": 32}


def _batch_state(device: str, h: Any, native: str,
                 order: Sequence[str] = tuple(BATCHED)) -> tuple[Setup, CountBatch]:
    """A combined state on slot 1 with FIRST stored by a batch of ``order``."""
    setup = _build(device, h, "combined")
    batch = count_batch(setup.state, [setup.buffers[n] for n in order], native)
    setup.state.begin(1)
    _fill(setup, 3)
    setup.state.set_count(setup.buffers["extra"], 9)
    batch.set(*[FIRST[n] for n in order])
    return setup, batch


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
@pytest.mark.parametrize("n", [0, 7, 9])
def test_wrong_number_of_counts(device: str, h: Any, native: str, n: int) -> None:
    setup, batch = _batch_state(device, h, native)
    before = _snapshot(setup, h)
    with pytest.raises(CountError, match=rf"CountBatch.set got {n} counts for 8 buffers") as e:
        batch.set(*([1] * n))
    assert "'temps'" in str(e.value) and "'flags'" in str(e.value)
    _assert_unchanged(setup, h, before)


BAD_LAST = [
    # (member placed last, bad value, message fragment)
    ("temps", True, "count must be an int in elements, got bool"),
    ("temps", 2.0, "count must be an int in elements, got float"),
    ("temps", np.float64(1.0), "count must be an int in elements, got float64"),
    ("temps", "3", "count must be an int in elements, got str"),
    ("temps", -1, r"count -1 elements is outside \[0, 16\]"),
    ("temps", 17, r"count 17 elements is outside \[0, 16\]"),
    ("temps", np.int64(17), r"count 17 elements is outside \[0, 16\]"),
    ("temps", 2**70, "elements is outside"),
    ("bt", 17, r"count 17 rows is outside \[0, 16\]"),
    ("bf", np.int32(9), r"count 9 rows is outside \[0, 8\]"),
    ("mask", 3, "byte count 3 is not a multiple of its element size 4"),
    ("mask", 164, r"count 164 bytes is outside \[0, 160\]"),
    ("flags", 32_001, "byte count 32001 is not a multiple of its element size 2"),
    ("ids", 8_501, r"count 8501 elements is outside \[0, 8500\]"),
]


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
@pytest.mark.parametrize(("last", "bad", "match"), BAD_LAST,
                         ids=[f"{m}-{v!r}" for m, v, _ in BAD_LAST])
def test_invalid_last_count_stores_nothing(device: str, h: Any, native: str, last: str,
                                           bad: object, match: str) -> None:
    setup = _build(device, h, "combined")
    s, bufs = setup.state, setup.buffers
    # no byte-unit member before the last: the compiled store checks every earlier value
    order = [n for n in NON_BYTES if n != last] + [last]
    batch = count_batch(s, [bufs[n] for n in order], native)
    s.begin(1)
    _fill(setup, 4)
    batch.set(*[FIRST[n] for n in order])
    before = _snapshot(setup, h)
    with pytest.raises(CountError, match=match) as err:
        batch.set(*[OTHER[n] for n in order[:-1]], bad)  # type: ignore[arg-type]
    assert f"buffer {last!r}" in str(err.value)
    _assert_unchanged(setup, h, before)
    # the earlier valid counts still publish
    dest = {n: _dest(b) for n, b in bufs.items()}
    s.publish("decode")
    s.finish()
    h.sync(device)
    for n in order:
        assert np.array_equal(_dest(bufs[n]), _expected(bufs[n], FIRST[n], dest[n])), n


def _bad_counts(buf: H2DBuffer) -> st.SearchStrategy[tuple[object, str]]:
    """(invalid count, message fragment) for ``buf``."""
    spec = buf.spec
    unit, cap = spec.unit.value, spec.capacity
    outside = f"is outside [0, {cap}]"
    bad: list[st.SearchStrategy[tuple[object, str]]] = [
        st.booleans().map(lambda v: (v, "got bool")),
        st.floats(0, 10).map(lambda v: (v, "got float")),
        st.just(("1", "got str")),
        st.just(([1], "got list")),
        st.integers(-(2**70), -1).map(lambda v: (v, f"count {v} {unit} {outside}")),
        st.integers(cap + 1, 2**70).map(lambda v: (v, f"count {v} {unit} {outside}")),
        st.integers(cap + 1, cap + 1000).map(lambda v: (np.int64(v), outside)),
    ]
    if unit == "bytes":
        item = spec.itemsize
        bad.append(st.integers(0, cap // item - 1).map(
            lambda k: (k * item + 1, f"not a multiple of its element size {item}")))
    return st.one_of(bad)


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
@pytest.mark.parametrize("members", ["all", "no-bytes"])
def test_invalid_counts_anywhere_store_nothing(device: str, h: Any, native: str,
                                               members: str) -> None:
    order = BATCHED if members == "all" else NON_BYTES
    setup, batch = _batch_state(device, h, native, order)
    bufs = setup.buffers
    before = _snapshot(setup, h)

    @CHEAP
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        counts: list[object] = [data.draw(_valid_counts(bufs[n]), label=n) for n in order]
        where = data.draw(st.sets(st.sampled_from(range(len(order))), min_size=1),
                          label="bad positions")
        fragment = ""
        for k in sorted(where, reverse=True):
            counts[k], fragment = data.draw(_bad_counts(bufs[order[k]]), label=f"bad {k}")
        with pytest.raises(CountError) as err:
            batch.set(*counts)  # type: ignore[arg-type]
        # the first invalid member in batch order is named, as set_count would name it
        assert f"buffer {order[min(where)]!r}" in str(err.value)
        assert fragment in str(err.value)
        _assert_unchanged(setup, h, before)

    run()


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
def test_set_after_publication_is_rejected(device: str, h: Any, native: str) -> None:
    setup = _build(device, h, "combined")
    s, b = setup.state, setup.buffers
    order = ["pos", "temps", "ids", "bt"]
    batch = count_batch(s, [b[n] for n in order], native)
    meta_only = count_batch(s, [b["pos"], b["bt"]], native)
    s.begin()
    _fill(setup, 5)
    batch.set(3, 4, 5, 6)
    s.publish("decode")
    before = _snapshot(setup, h)
    for call in (lambda: batch.set(1, 1, 1, 1), lambda: batch.set(None, None, None, None)):
        with pytest.raises(DuplicatePublicationError,
                           match="buffer 'pos': group 'meta' was already published in this "
                                 r"epoch; a second publication needs a reason \(reopen\(\)\)"):
            call()
        _assert_unchanged(setup, h, before)
    # a deliberate second publication: counts are set again after reopen
    s.reopen("decode", "test: second publication")
    batch.set(1, 2, 3, 4)
    rec = s._slot_groups[0][0]
    assert [s.count(b[n]) for n in order] == [1, 2, 3, 4] and rec.active == 4
    s.finish()

    # a covered producer group published alone rejects only batches that carry it
    s.begin()
    batch.set(None, 3, 7, None)
    s.publish("tok")
    before = _snapshot(setup, h)
    with pytest.raises(DuplicatePublicationError,
                       match="buffer 'temps': group 'tok' was already published"):
        batch.set(1, 1, 1, 1)
    _assert_unchanged(setup, h, before)
    meta_only.set(2, 5)
    assert (s.count(b["pos"]), s.count(b["bt"]), s.count(b["temps"])) == (2, 5, 3)


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
def test_set_outside_an_epoch(device: str, h: Any, native: str) -> None:
    setup = _build(device, h, "combined")
    s = setup.state
    batch = count_batch(s, [setup.buffers[n] for n in BATCHED], native)
    counts = list(OTHER.values())
    before = _snapshot(setup, h)
    with pytest.raises(EpochError, match=r"CountBatch.set outside an epoch: call begin\(\)"):
        batch.set(*counts)
    _assert_unchanged(setup, h, before)
    s.begin()
    batch.set(*counts)
    s.finish()
    before = _snapshot(setup, h)
    with pytest.raises(EpochError, match=r"CountBatch\.set outside an epoch"):
        batch.set(*FIRST.values())
    _assert_unchanged(setup, h, before)


def _in_thread(call: Callable[[], object]) -> BaseException | None:
    caught: list[BaseException] = []

    def body() -> None:
        try:
            call()
        except BaseException as exc:
            caught.append(exc)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return caught[0] if caught else None


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
def test_other_thread_is_rejected(device: str, h: Any, native: str) -> None:
    setup, batch = _batch_state(device, h, native)
    before = _snapshot(setup, h)
    for call in (lambda: batch.set(*OTHER.values()),
                 lambda: count_batch(setup.state, [setup.buffers["temps"]], native)):
        err = _in_thread(call)
        assert isinstance(err, OwnerThreadError), err
        assert "belongs to another thread" in str(err)
        _assert_unchanged(setup, h, before)


@pytest.mark.parametrize("native", NATIVE_OR_PYTHON)
def test_invalidated_owner_is_rejected(device: str, h: Any, native: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    setup, batch = _batch_state(device, h, native)
    s = setup.state
    packed = s._slot_groups[1][0].packed
    assert packed is not None
    h.break_publication(monkeypatch, packed, "injected launch failure")
    with pytest.raises(PublicationEnqueueError):
        s.publish("decode")
    before = _snapshot(setup, h)
    with pytest.raises(OwnerInvalidatedError, match=r"call reset\(\)"):
        batch.set(*OTHER.values())
    _assert_unchanged(setup, h, before)


def test_construction_errors(device: str, h: Any) -> None:
    setup = _build(device, h, "combined")
    other = _build(device, h, "combined")
    s, b = setup.state, setup.buffers
    s.begin()
    s.set_count(b["temps"], 3)
    before = _snapshot(setup, h)
    cases: list[tuple[list[Any], type[Exception], str]] = [
        ([b["temps"], b["ids"], b["temps"]], DeclarationError,
         "CountBatch: buffer 'temps' is listed twice"),
        ([b["temps"], other.buffers["ids"]], MembershipError, "is not a buffer of this state"),
        (["temps"], MembershipError, "'temps' is not a buffer of this state"),
    ]
    for buffers, exc, match in cases:
        with pytest.raises(exc, match=match):
            CountBatch(s, buffers)
        _assert_unchanged(setup, h, before)
    assert s.count(b["temps"]) == 3

    ranged = H2DRunnerState(device, scatter=h.scatter_mode(device))
    cl = ranged.buffer("context_lens", (64,), torch.int32, group="g")
    bt = ranged.buffer("block_tables", (64, 128), torch.int32, group="g", unit="rows",
                       max_ranges=8)
    with pytest.raises(NotBoundError, match=r"call bind\(\) after declaring buffers"):
        ranged.count_batch([cl])
    assert not ranged.bound
    ranged.bind()
    ranged.begin()
    ranged.set_count(cl, 4)
    rec = ranged._slot_groups[0][0]
    snap = _record_state(rec)
    for native in ("fused", "per_member"):
        with pytest.raises(DeclarationError,
                           match=r"CountBatch: buffer 'block_tables' is ranged "
                                 r"\(max_ranges=8\); publish it with set_count or set_ranges"):
            count_batch(ranged, [cl, bt], native)
    assert _record_state(rec) == snap


def test_fused_and_per_member_stores(device: str, h: Any) -> None:
    setup = _build(device, h, "single")
    s, bufs = setup.state, setup.buffers
    members = [bufs[n] for n in NON_BYTES]
    s.begin()
    fused = s.count_batch(members)
    assert fused._record >= 0  # one record carries every member
    rec = s._slot_groups[s.current_slot][fused._record]
    assert rec.store_counts(fused._fused, (2,) * 6) is True  # the record's fused store
    assert [s.count(b) for b in members] == [2] * 6
    # a byte-unit member's count is handed back to the Python check and store
    with_bytes = s.count_batch([bufs["temps"], bufs["mask"]])
    assert rec.store_counts(with_bytes._fused, (4, 12)) is False
    assert [s.count(b) for b in members] == [2] * 6  # nothing stored
    with_bytes.set(4, 12)
    assert (s.count(bufs["temps"]), s.count(bufs["mask"])) == (4, 12)
    s.count_batch(members).set(*[3] * 6)
    assert [s.count(b) for b in members] == [3] * 6


# ------------------------------------------------------------------------- pack

def test_pack_matches_the_packing_oracle(device: str, h: Any) -> None:
    s = H2DRunnerState(device, scatter=h.scatter_mode(device))
    bufs = {
        "temps": s.buffer("temps", (16,), torch.float32, group="g"),
        "ids": s.buffer("ids", (8_500,), torch.int32, group="g"),
        "pos": s.buffer("pos", (4_200,), torch.int64, group="g"),
        "flags": s.buffer("flags", (16_500,), torch.int16, group="g", unit="bytes"),
        "bt": s.buffer("bt", (64, 128), torch.int32, group="g", unit="rows", max_ranges=8),
    }
    s.bind()
    for b in bufs.values():
        b.gpu.view(torch.uint8).fill_(h.POISON)
    rec = s._slot_groups[0][0]
    slot = rec.packed
    assert slot is not None and len(slot._staged) == 3
    setup = Setup(s, bufs)
    row_elems, table_elems = 128, 64 * 128

    @st.composite
    def ranges(draw: st.DrawFn) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        pos = 0
        for _ in range(draw(st.integers(1, 8))):
            start = pos + draw(st.integers(0, 3 * row_elems))
            stop = start + draw(st.integers(1, 2 * row_elems))
            if stop > table_elems:
                break
            out.append((start * 4, stop * 4))
            pos = stop
        return out

    @settings(FAST, max_examples=15)
    @given(data=st.data())
    def run(data: st.DataObject) -> None:
        _close(s)
        s.begin()
        _fill(setup, data.draw(st.integers(0, 2**32 - 1), label="seed"))
        counts = {n: data.draw(_valid_counts(bufs[n]), label=n)
                  for n in ("temps", "ids", "pos", "flags")}
        for n, c in counts.items():
            s.set_count(bufs[n], c)
        table = data.draw(st.one_of(ranges(), st.integers(0, 64)), label="bt")
        if isinstance(table, list):
            s.set_ranges(bufs["bt"], table)
        else:
            s.set_count(bufs["bt"], table)
        host = slot.arena.host.numpy()  # type: ignore[attr-defined]  # the arena's bytes
        start = host.copy()
        counts_in, ranges_in = list(rec.counts), list(rec.ranges)
        want_host, want_end = expected_arena(slot, rec.counts, rec.ranges)  # the oracle

        stream = torch.cuda.current_stream().cuda_stream if device == "cuda" else 0
        # the compiled publication (on CUDA it may launch the graph: the destinations are
        # read again below, before the production publication)
        end_native = abs(kernels_native.publish_packed(slot._binding, rec.counts, rec.ranges,
                                                       stream))
        assert (rec.counts, rec.ranges) == (counts_in, ranges_in)  # inputs untouched
        assert end_native == want_end
        assert np.array_equal(host, want_host)

        # and both put each staged member's used bytes and each range where the header says
        last = 0
        for i, _, unit_bytes in slot._staged:
            used = rec.counts[i]
            if used:
                off, nbytes = int(slot.header[i, 0]), used * unit_bytes
                assert off >= slot.staging_offset and int(slot.header[i, 1]) == nbytes
                src = _bytes(rec.plan.members[i].cpu)
                assert np.array_equal(host[off : off + nbytes], src[:nbytes])
                last = max(last, off + nbytes)
        bt_src = _bytes(bufs["bt"].cpu)
        for row, (i, dst_off, nbytes) in enumerate(rec.ranges, start=len(slot.members)):
            off, size, member, dst = (int(x) for x in slot.header[row])
            assert (size, member, dst) == (nbytes, i, dst_off)
            assert off >= slot.staging_offset
            assert np.array_equal(host[off : off + size], bt_src[dst_off : dst_off + size])
            last = max(last, off + size)
        # the DMA ends after the header, the used in-place bytes and the packed bytes
        inplace_end = max([slot.arena.header_bytes] + [
            off + c * m.spec.unit_bytes
            for c, m, off in zip(rec.counts, rec.plan.members, slot.offsets, strict=True)
            if c and off >= 0])
        assert end_native == max(inplace_end, (last + 15) // 16 * 16)
        # nothing outside the staging region moved
        assert np.array_equal(host[slot.header.nbytes : slot.staging_offset],
                              start[slot.header.nbytes : slot.staging_offset])

        # the production path (compiled pack inside publish) delivers exactly those bytes
        host[:] = start
        before = {n: _dest(b) for n, b in bufs.items()}
        s.publish("g")
        s.finish()
        h.sync(device)
        for n in ("temps", "ids", "pos", "flags"):
            assert np.array_equal(_dest(bufs[n]), _expected(bufs[n], _as_int(counts[n]),
                                                            before[n])), n
        if isinstance(table, list):
            want = before["bt"].copy()
            for a, z in table:
                want[a:z] = bt_src[a:z]
        else:
            want = _expected(bufs["bt"], table, before["bt"])
        assert np.array_equal(_dest(bufs["bt"]), want)

    run()
