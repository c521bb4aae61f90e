"""Calls an engine author might get wrong: a specific error naming the offender, nothing
changed, and the call works once corrected."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from h2d_core import (
    BindingError,
    CountError,
    DeclarationError,
    DeviceUnavailableError,
    EpochError,
    H2DRunnerState,
    MembershipError,
    ProducerOwnerError,
    describe_value,
    h2d_producer,
)


def _state(num_slots: int = 1) -> tuple[H2DRunnerState, object]:
    st = H2DRunnerState("cpu", num_slots=num_slots, scatter="reference")
    bt = st.buffer("bt", (4, 8), torch.int32, group="g", unit="rows", max_ranges=4)
    st.bind()
    return st, bt


class _Adapter:
    def __init__(self, state: H2DRunnerState) -> None:
        self.h2d_state = state
        self.group = "g"

    @h2d_producer(lambda self: self.group)
    def prepare(self) -> str:
        return "ran"


def test_a_producer_without_its_owner_names_itself_and_changes_nothing() -> None:
    st, _ = _state()

    @h2d_producer("g")
    def produce(owner: object) -> str:
        return "ran"

    st.begin()
    with pytest.raises(ProducerOwnerError, match=r"producer .*produce: its first argument "
                                                 r"must be the H2DRunnerState .* got object"):
        produce(object())
    with pytest.raises(ProducerOwnerError, match=r"called without its owner"):
        produce()  # type: ignore[call-arg]
    with pytest.raises(ProducerOwnerError, match=r"got int"):
        _Adapter.prepare(5)  # type: ignore[arg-type]  # the group lambda never runs on it
    assert isinstance(ProducerOwnerError("x"), TypeError)
    assert produce(st) == "ran"  # not entered before: the producer still runs this epoch
    st.finish()


@pytest.mark.parametrize("bad, rule", [
    ([(0, 4, 8)], r"range 0 \(0, 4, 8\) must be a \(start, stop\) pair"),
    ([5], r"range 0 5 must be a \(start, stop\) pair"),
    (None, r"ranges must be a list of \(start, stop\) byte pairs, got NoneType"),
    ("0-4", r"ranges must be a list .* got str"),
    ([(0.0, 4)], r"range 0 \(0.0, 4\) must be two ints"),
])
def test_malformed_ranges_are_count_errors_naming_the_buffer(bad: object, rule: str) -> None:
    st, bt = _state()
    st.begin()
    with pytest.raises(CountError, match=rf"buffer 'bt': {rule}"):
        st.set_ranges(bt, bad)  # type: ignore[arg-type]
    assert st.count(bt) is None  # nothing recorded
    st.set_ranges(bt, [(0, 32)])
    st.publish("g")
    st.finish()


def test_begin_takes_numpy_integer_slots() -> None:
    st, _ = _state(num_slots=2)
    assert st.begin(np.int64(1)) == 1
    st.finish()
    for bad, rule in ((1.0, r"slot must be an int in \[0, 2\) or None, got float"),
                      (np.int32(2), r"slot 2 is not in \[0, 2\)"),
                      (True, r"got bool")):
        with pytest.raises(EpochError, match=rule):
            st.begin(bad)  # type: ignore[arg-type]
    assert st.begin(0) == 0


def test_disjoint_interleaved_views_bind_and_publish_with_direct_copies() -> None:
    """Two columns of one [8, 2] tensor share no element: bound, published exactly (the
    noncontiguous destinations use direct copies); a view overlapping one of them is
    refused at bind()."""
    st = H2DRunnerState("cpu", scatter="reference")
    base = torch.zeros(8, 2, dtype=torch.int32)
    x = st.buffer("x", (8,), torch.int32, group="h", gpu=base[:, 0])
    y = st.buffer("y", (8,), torch.int32, group="h", gpu=base[:, 1])
    st.bind()
    st.begin()
    x.np[:3] = [1, 2, 3]
    y.np[:2] = [7, 8]
    st.set_count(x, 3)
    st.set_count(y, 2)
    st.publish("h")
    st.finish()
    assert base[:4].tolist() == [[1, 7], [2, 8], [3, 0], [0, 0]]
    assert st.counters("h").direct_copies == 2
    bad = H2DRunnerState("cpu", scatter="reference")
    other = torch.zeros(8, 2, dtype=torch.int32)
    bad.buffer("x", (8,), torch.int32, group="h", gpu=other[:, 0])
    bad.buffer("z", (4,), torch.int32, group="h", gpu=other.view(-1)[4:8])
    with pytest.raises(BindingError, match=r"buffers 'x' and 'z' share GPU bytes"):
        bad.bind()


def test_a_cuda_state_without_cuda_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU build of torch (or a machine with no visible GPU), a CUDA state is refused
    with the library's error, not torch's bare AssertionError; a CPU state still works."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1", torch.device("cuda", 0)):
        with pytest.raises(DeviceUnavailableError, match=r"pass device='cpu'"):
            H2DRunnerState(device)
    assert H2DRunnerState("cpu").device == torch.device("cpu")


def test_counters_are_live_and_a_snapshot_gives_a_steps_difference() -> None:
    st, bt = _state()
    live = st.counters("g")
    before = live.snapshot()
    st.begin()
    st.set_count(bt, 1)
    st.publish("g")
    st.finish()
    assert live.publications == 1 and before.publications == 0  # live moved, the copy not
    step = st.counters("g") - before
    assert (step.publications, step.bytes) == (1, 32)


def test_counts_set_and_never_published_send_nothing() -> None:
    """The documented case: counts set, then finish() with no publish. Nothing travels, the
    destination keeps the last publication's bytes, and the next begin() drops the counts."""
    st, bt = _state()
    st.begin()
    bt.np[0] = 7
    st.set_count(bt, 1)
    st.publish("g")
    st.finish()
    st.begin()
    bt.np[0] = 9
    st.set_count(bt, 1)
    st.finish()  # no publish: not an error
    assert bt.gpu[0].tolist() == [7] * 8
    assert st.counters("g").publications == 1
    st.begin()
    assert st.count(bt) is None  # the unpublished count did not carry over
    st.finish()


@pytest.mark.parametrize("how", ["flag", "env"])
def test_guard_sources_refuses_writes_outside_the_epoch(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The debug mode: ``.np``/``.cpu`` before ``begin()`` raise naming the buffer, a view
    kept across steps is read-only once its epoch finished (numpy refuses the write), and
    the slot's views are writable again in its next epoch; the publication is unchanged."""
    if how == "env":
        monkeypatch.setenv("H2D_GUARD_SOURCES", "1")
    st = H2DRunnerState("cpu", num_slots=2, scatter="reference",
                        guard_sources=True if how == "flag" else None)
    bt = st.buffer("bt", (4, 8), torch.int32, group="g", unit="rows")
    st.bind()
    for what in ("np", "cpu"):
        with pytest.raises(EpochError, match=rf"'bt': \.{what} outside an epoch"):
            getattr(bt, what)
    assert st.begin() == 0
    kept = bt.np
    kept[0] = 5
    st.set_count(bt, 1)
    st.publish("g")
    st.finish()
    with pytest.raises(ValueError, match="read-only"):
        kept[0] = 6  # slot 0's source: its DMA may still be reading it
    assert st.begin() == 1
    with pytest.raises(ValueError, match="read-only"):
        kept[0] = 6  # slot 1's epoch is open, slot 0's view stays read-only
    bt.np[0] = 7
    st.set_count(bt, 1)
    st.publish("g")
    st.finish()
    assert st.begin() == 0
    kept[0] = 8  # writable again in its own slot's epoch
    st.finish()
    assert bt.gpu[0].tolist() == [7] * 8


def test_guard_sources_refuses_writes_after_publish_until_a_reopen() -> None:
    """A write after ``publish()`` and before ``finish()`` lands in a source its DMA may
    still be reading: ``.np``/``.cpu`` refuse it naming the buffer, the group and what to
    do, a view kept from before the publication is read-only, and nothing changed (the
    published bytes, the counts, the counters). A deliberate second publication
    (``reopen(group, reason)``, after which the sources are acquired) writes again, and
    the other groups of the epoch are not affected."""
    st = H2DRunnerState("cpu", num_slots=2, scatter="reference", guard_sources=True)
    bt = st.buffer("bt", (4, 8), torch.int32, group="g", unit="rows")
    other = st.buffer("other", (4,), torch.int32, group="h")
    st.bind()
    st.begin()
    kept = bt.np
    kept[0] = 5
    st.set_count(bt, 1)
    st.publish("g")
    seen = (bt.source(0).numpy().tobytes(), bt.gpu.numpy().tobytes(), st.count(bt),
            st.counters("g").publications)
    for what in ("np", "cpu"):
        with pytest.raises(EpochError, match=rf"buffer 'bt': \.{what} after group 'g' was "
                           r"published in epoch 1 \(guard_sources\): .* write it between "
                           r"begin\(\) and publish\(\), or reopen\(group, reason\)"):
            getattr(bt, what)
    with pytest.raises(ValueError, match="read-only"):
        kept[0] = 6
    assert (bt.source(0).numpy().tobytes(), bt.gpu.numpy().tobytes(), st.count(bt),
            st.counters("g").publications) == seen
    other.np[:2] = 3  # an unpublished group of the same epoch still writes
    st.set_count(other, 2)
    st.publish("h")
    st.reopen("g", "rewrite after a late correction")
    bt.np[0] = 6  # the deliberate second publication writes again
    kept[1] = 6
    st.set_count(bt, 2)
    st.publish("g")
    st.finish()
    assert bt.gpu[:2].tolist() == [[6] * 8, [6] * 8]
    assert other.gpu[:2].tolist() == [3, 3]
    assert st.counters("g").publications == 2
    st.resume()  # a resumed epoch keeps its published groups read-only
    with pytest.raises(EpochError, match=r"'bt': \.np after group 'g' was published"):
        bt.np  # noqa: B018
    with pytest.raises(ValueError, match="read-only"):
        kept[0] = 7
    st.finish()
    st.begin()  # the next epoch on this slot writes as before
    st.finish()
    st.begin()
    kept[0] = 8
    st.finish()


class _Step:
    """Two producer groups, combined into ``step``; one producer writes both (a fused
    step), and each has its own producer too (standalone callers)."""

    def __init__(self) -> None:
        st = self.h2d_state = H2DRunnerState("cpu", num_slots=1, scatter="reference")
        self.a = st.buffer("a_ids", (8,), torch.int32, group="a")
        self.b = st.buffer("b_pos", (8,), torch.int64, group="b")
        st.combine("step", ["a", "b"])
        st.bind()

    @h2d_producer("a", "b")
    def both(self, value: int) -> None:
        self.a.np[:2] = value
        self.b.np[:2] = value
        self.h2d_state.set_count(self.a, 2)
        self.h2d_state.set_count(self.b, 2)

    @h2d_producer("a")
    def only_a(self, value: int) -> None:
        self.a.np[:2] = value
        self.h2d_state.set_count(self.a, 2)

    @h2d_producer("b")
    def only_b(self, value: int) -> None:
        self.b.np[:2] = value
        self.h2d_state.set_count(self.b, 2)


def _observed(s: _Step) -> tuple[object, ...]:
    st = s.h2d_state
    return (s.a.np.tobytes(), s.b.np.tobytes(), s.a.gpu.numpy().tobytes(),
            s.b.gpu.numpy().tobytes(), st.count(s.a), st.count(s.b),
            frozenset(st.groups.published), frozenset(st.groups.produced),
            [(c.publications, c.direct_copies, c.dmas)
             for c in (st.counters("a"), st.counters("b"), st.counters("step"))])


@pytest.mark.parametrize("covered", ["a", "b"])
def test_a_covered_group_of_a_produced_step_is_refused_alone(covered: str) -> None:
    """A producer wrote the whole combined group: publishing one covered group alone would
    send part of the step and silently leave the rest. Refused naming the group, the
    combined group and the groups left behind; nothing changed; the combined group then
    publishes."""
    s = _Step()
    st = s.h2d_state
    st.begin()
    s.both(4)
    before = _observed(s)
    other = "b" if covered == "a" else "a"
    with pytest.raises(MembershipError, match=rf"group '{covered}' is covered by the combined "
                       rf"group 'step', whose producer groups \['{other}'\] were produced in "
                       rf"epoch 1 and are not published: .* publish 'step'"):
        st.publish(covered)
    assert _observed(s) == before
    st.publish("step")
    st.finish()
    assert s.a.gpu[:2].tolist() == [4, 4] and s.b.gpu[:2].tolist() == [4, 4]
    assert st.counters(covered).publications == 0


def test_a_covered_group_produced_on_its_own_publishes_alone() -> None:
    """The spec's standalone callers: a covered group produced alone publishes alone
    (checked direct copies); so does the other one, produced after."""
    s = _Step()
    st = s.h2d_state
    st.begin()
    s.only_a(5)
    st.publish("a")
    s.only_b(6)
    st.publish("b")
    st.finish()
    assert s.a.gpu[:2].tolist() == [5, 5] and s.b.gpu[:2].tolist() == [6, 6]
    assert st.counters("a").direct_copies == 1 and st.counters("step").dmas == 0
    st.begin()  # both produced before either is published: the step is the combined group
    s.only_a(7)
    s.only_b(8)
    with pytest.raises(MembershipError, match=r"group 'a' is covered .* \['b'\]"):
        st.publish("a")
    st.publish("step")
    st.finish()
    assert s.a.gpu[:2].tolist() == [7, 7] and s.b.gpu[:2].tolist() == [8, 8]


def test_guard_sources_lets_a_producer_with_a_reason_write_again() -> None:
    """A producer entered again with ``h2d_reason`` (a deliberate second publication)
    reopens its group: its sources are writable again, and it publishes."""
    st = H2DRunnerState("cpu", num_slots=1, scatter="reference", guard_sources=True)
    bt = st.buffer("bt", (4, 8), torch.int32, group="g", unit="rows")
    st.bind()

    @h2d_producer("g")
    def produce(owner: H2DRunnerState, value: int) -> None:
        bt.np[0] = value
        owner.set_count(bt, 1)

    st.begin()
    produce(st, 1)
    st.publish("g")
    with pytest.raises(EpochError, match=r"'bt': \.np after group 'g' was published"):
        bt.np  # noqa: B018
    produce(st, 2, h2d_reason="a late correction")  # type: ignore[call-arg]
    st.publish("g")
    st.finish()
    assert bt.gpu[0].tolist() == [2] * 8
    assert st.counters("g").second_publications == 1


def test_guard_sources_is_off_by_default() -> None:
    _, bt = _state()
    assert type(bt).__name__ == "H2DBuffer"
    bt.np[0] = 1  # outside an epoch: allowed (and documented as unsafe) without the guard
    with pytest.raises(DeclarationError, match="guard_sources must be a bool"):
        H2DRunnerState("cpu", guard_sources="yes")  # type: ignore[arg-type]


def test_a_refusal_names_what_was_passed() -> None:
    """describe_value: an array by its dtype (with the right article) and shape, anything
    else by its type's name."""
    assert describe_value(np.zeros(2, np.int64)) == "an int64 array of shape (2,)"
    assert describe_value(np.zeros((1, 3), np.uint8)) == "a uint8 array of shape (1, 3)"
    assert describe_value(np.zeros(0, object)) == "an object array of shape (0,)"
    assert describe_value(np.zeros(1, np.float32)) == "a float32 array of shape (1,)"
    assert describe_value([1, 2]) == "list"
    assert describe_value(torch.zeros(2)) == "Tensor"
