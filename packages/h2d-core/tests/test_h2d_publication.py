"""Ownership, atomic validation, stream/device identity, epochs and graph capture."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from h2d_core import (
    Backend,
    BackendError,
    BindingError,
    CountError,
    DeclarationError,
    DuplicatePublicationError,
    EpochError,
    H2DRunnerState,
    MembershipError,
    OwnerInvalidatedError,
    OwnerThreadError,
    ProducerOwnerError,
    PublicationEnqueueError,
    ReentryError,
    StreamMismatchError,
    UnknownGroupError,
    h2d_producer,
    resolve_backend,
)


def _snapshot(setup: Any, h: Any) -> dict[str, Any]:
    """Everything a rejected call must leave unchanged."""
    st = setup.state
    h.sync("cuda" if st.device.type == "cuda" else "cpu")
    return {
        "dest": {n: h.dest_bytes(b) for n, b in setup.buffers.items()},
        "src": {n: b.cpu.clone() for n, b in setup.buffers.items()},
        "counts": {n: st.count(b) for n, b in setup.buffers.items()},
        "epoch": (st.epoch, st.epoch_open, st.current_slot),
        "counters": {g: st.counters(g).as_dict() for g in ("decode", "token_inputs",
                                                             "mha_decode")},
        "invalid": st.invalidated,
    }


def _assert_unchanged(setup: Any, h: Any, before: dict[str, Any]) -> None:
    after = _snapshot(setup, h)
    for n in before["dest"]:
        assert torch.equal(before["dest"][n], after["dest"][n]), f"destination {n} changed"
        assert torch.equal(before["src"][n], after["src"][n]), f"source {n} changed"
    assert before["counts"] == after["counts"]
    assert before["epoch"] == after["epoch"]
    assert before["counters"] == after["counters"]
    assert before["invalid"] == after["invalid"]


def _publish_all(setup: Any, h: Any, rng: np.random.Generator, group: str = "decode") -> dict:
    counts = {}
    for name, b in setup.buffers.items():
        h.fill_random(b, rng)
        counts[name] = int(rng.integers(0, b.spec.capacity + 1))
        setup.state.set_count(b, counts[name])
    setup.state.publish(group)
    return counts


# ---------------------------------------------------------------------------- backend

def test_backend_env_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATOM_H2D_BACKEND", "direct")
    state = H2DRunnerState("cpu")
    monkeypatch.setenv("ATOM_H2D_BACKEND", "packed")
    assert state.backend is Backend.DIRECT
    assert H2DRunnerState("cpu").backend is Backend.PACKED
    assert H2DRunnerState("cpu", backend="direct").backend is Backend.DIRECT


def test_backend_explicit_argument_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATOM_H2D_BACKEND", "direct")
    assert resolve_backend("packed") is Backend.PACKED
    monkeypatch.delenv("ATOM_H2D_BACKEND")
    assert resolve_backend(None) is Backend.PACKED


def test_unknown_backend_lists_valid_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATOM_H2D_BACKEND", "fast")
    with pytest.raises(BackendError, match=r"ATOM_H2D_BACKEND='fast'.*'packed', 'direct'"):
        H2DRunnerState("cpu")
    with pytest.raises(BackendError, match="backend argument"):
        resolve_backend("turbo")


# ---------------------------------------------------------------------------- declaration

def test_declaration_errors_name_the_buffer() -> None:
    state = H2DRunnerState("cpu", backend="packed", scatter="reference")
    state.buffer("a", (4,), torch.int32, group="g")
    with pytest.raises(DeclarationError, match="'a' is already declared"):
        state.buffer("a", (4,), torch.int32, group="g")
    with pytest.raises(DeclarationError, match="unknown count unit 'cols'"):
        state.buffer("b", (4,), torch.int32, group="g", unit="cols")
    with pytest.raises(DeclarationError, match="'c': shape must be positive"):
        state.buffer("c", (0,), torch.int32, group="g")
    with pytest.raises(UnknownGroupError, match="'nope' has no declared buffer"):
        state.combine("both", ["g", "nope"])
    state.bind()
    with pytest.raises(DeclarationError, match="already bound"):
        state.buffer("d", (4,), torch.int32, group="g")


def test_destination_on_wrong_device_is_rejected() -> None:
    state = H2DRunnerState("cpu", scatter="reference")
    with pytest.raises(BindingError, match="'x': destination is on meta"):
        state.buffer("x", (4,), torch.int32, group="g", gpu=torch.empty(4, dtype=torch.int32,
                                                                        device="meta"))
    assert "x" not in state.buffers()


def test_overlapping_destinations_rejected_at_bind() -> None:
    state = H2DRunnerState("cpu", scatter="reference")
    storage = torch.zeros(16, dtype=torch.int32)
    state.buffer("lo", (8,), torch.int32, group="g", gpu=storage[:8])
    state.buffer("hi", (8,), torch.int32, group="g", gpu=storage[4:12])
    with pytest.raises(BindingError, match="'lo' and 'hi' share GPU bytes"):
        state.bind()
    assert not state.bound


# ---------------------------------------------------------------------------- counts

@pytest.mark.parametrize(
    ("count", "match"),
    [
        (17, r"count 17 elements is outside \[0, 16\]"),
        (-1, r"count -1 elements is outside"),
        (2.0, "count must be an int in elements, got float"),
        (True, "count must be an int in elements, got bool"),
        ("3", "count must be an int in elements, got str"),
    ],
)
def test_bad_count_rejected_and_nothing_changes(device: str, h: Any, count: object,
                                                match: str) -> None:
    setup = h.build_state(device)
    st = setup.state
    st.begin()
    temps = setup.buffers["temperatures"]
    st.set_count(temps, 5)
    before = _snapshot(setup, h)
    with pytest.raises(CountError, match=match) as err:
        st.set_count(temps, count)  # type: ignore[arg-type]
    assert "'temperatures'" in str(err.value)
    _assert_unchanged(setup, h, before)
    st.publish("decode")  # the earlier valid count still publishes
    h.sync(device)
    assert torch.equal(temps.gpu[:5].cpu(), temps.cpu[:5])


def test_row_unit_and_numpy_counts(device: str, h: Any) -> None:
    setup = h.build_state(device)
    st = setup.state
    st.begin()
    bt = setup.buffers["block_tables"]
    rng = np.random.default_rng(1)
    h.fill_random(bt, rng)
    before = h.dest_bytes(bt)
    st.set_count(bt, np.int64(3))
    st.set_count(setup.buffers["positions"], 0)
    st.publish("decode")
    st.finish()
    h.sync(device)
    assert torch.equal(h.dest_bytes(bt), h.expected_bytes(bt, bt.cpu, 3, before))
    with pytest.raises(CountError, match=r"'block_tables': count 17 rows is outside \[0, 16\]"):
        st.begin()
        st.set_count(bt, 17)


def test_unknown_group_and_foreign_member(device: str, h: Any) -> None:
    setup = h.build_state(device)
    other = h.build_state(device)
    st = setup.state
    st.begin()
    before = _snapshot(setup, h)
    with pytest.raises(UnknownGroupError, match="unknown group 'decoder'"):
        st.publish("decoder")
    with pytest.raises(MembershipError, match="not a buffer of this state"):
        st.set_count(other.buffers["temperatures"], 1)
    _assert_unchanged(setup, h, before)


def test_set_count_after_publication_is_rejected(device: str, h: Any) -> None:
    setup = h.build_state(device)
    st = setup.state
    st.begin()
    _publish_all(setup, h, np.random.default_rng(2))
    before = _snapshot(setup, h)
    with pytest.raises(DuplicatePublicationError, match="'input_ids': group 'token_inputs' was "
                                                        "already published"):
        st.set_count(setup.buffers["input_ids"], 1)
    _assert_unchanged(setup, h, before)


# ---------------------------------------------------------------------------- ownership

def test_wrong_thread_is_rejected(device: str, h: Any) -> None:
    setup = h.build_state(device)
    st = setup.state
    st.begin()
    st.set_count(setup.buffers["temperatures"], 3)
    before = _snapshot(setup, h)
    errors: list[BaseException] = []

    def intruder() -> None:
        for call in (lambda: st.set_count(setup.buffers["temperatures"], 4),
                     lambda: st.publish("decode"), st.finish, lambda: st.begin()):
            try:
                call()
            except BaseException as exc:
                errors.append(exc)

    t = threading.Thread(target=intruder)
    t.start()
    t.join()
    assert len(errors) == 4
    assert all(isinstance(e, OwnerThreadError) for e in errors), errors
    assert "another thread" in str(errors[0])
    _assert_unchanged(setup, h, before)


# ---------------------------------------------------------------------------- epochs

def test_epoch_order_errors(device: str, h: Any) -> None:
    setup = h.build_state(device)
    st = setup.state
    with pytest.raises(EpochError, match="set_count outside an epoch"):
        st.set_count(setup.buffers["temperatures"], 1)
    with pytest.raises(EpochError, match="finish\\(\\) without an open epoch"):
        st.finish()
    with pytest.raises(EpochError, match="nothing to resume"):
        st.resume()
    st.begin()
    with pytest.raises(EpochError, match="still open"):
        st.begin()
    with pytest.raises(EpochError, match="slot 3 is not in"):
        st.finish()
        st.begin(3)
    assert not st.epoch_open


def test_slots_rotate_and_own_their_sources(device: str, h: Any) -> None:
    setup = h.build_state(device, num_slots=2)
    st = setup.state
    ids = setup.buffers["input_ids"]
    assert st.begin() == 0
    src0 = ids.cpu
    ids.np[:4] = [1, 2, 3, 4]
    st.finish()
    assert st.begin() == 1
    assert ids.cpu.data_ptr() != src0.data_ptr()
    ids.np[:4] = [9, 9, 9, 9]
    st.finish()
    assert st.begin() == 0
    assert ids.np[:4].tolist() == [1, 2, 3, 4]


def test_producer_checks_epoch_and_reentry(device: str, h: Any) -> None:
    setup = h.build_state(device)
    st = setup.state
    calls: list[int] = []

    class Adapter:
        h2d_state = st

        @h2d_producer("token_inputs")
        def produce(self, value: int) -> None:
            calls.append(value)
            ids = setup.buffers["input_ids"]
            ids.np[:2] = value
            st.set_count(ids, 2)

    a = Adapter()
    with pytest.raises(EpochError, match="outside an epoch"):
        a.produce(1)
    assert calls == []
    st.begin()
    a.produce(7)
    st.publish("decode")
    before = _snapshot(setup, h)
    with pytest.raises(ReentryError, match=r"entered again.*h2d_reason"):
        a.produce(8)
    assert calls == [7]
    _assert_unchanged(setup, h, before)
    # A deliberate second publication acquires the source, then rewrites and republishes it.
    a.produce(9, h2d_reason="drafter rewrites the query prefix")
    st.publish("token_inputs")
    st.finish()
    h.sync(device)
    assert calls == [7, 9]
    assert setup.buffers["input_ids"].gpu[:2].tolist() == [9, 9]
    assert st.counters("token_inputs").second_publications == 1


def test_producer_needs_owner_and_known_group(device: str, h: Any) -> None:
    setup = h.build_state(device)

    @h2d_producer("sampling")
    def produce(owner: object) -> None:
        raise AssertionError("must not run")

    setup.state.begin()
    with pytest.raises(UnknownGroupError, match="'sampling'"):
        produce(setup.state)
    with pytest.raises(ProducerOwnerError, match="must be the H2DRunnerState"):
        produce(object())


def test_duplicate_publication_needs_reason(device: str, h: Any) -> None:
    setup = h.build_state(device)
    st = setup.state
    st.begin()
    rng = np.random.default_rng(3)
    _publish_all(setup, h, rng)
    before = _snapshot(setup, h)
    with pytest.raises(DuplicatePublicationError, match="already published in epoch"):
        st.publish("decode")
    with pytest.raises(DuplicatePublicationError, match="already published"):
        st.publish("mha_decode")
    with pytest.raises(DuplicatePublicationError, match="non-empty reason"):
        st.reopen("decode", "  ")
    _assert_unchanged(setup, h, before)
    st.reopen("decode", reason="late correction")
    counts = _publish_all(setup, h, rng)
    h.sync(device)
    for name, b in setup.buffers.items():
        n = counts[name] * b.spec.unit_bytes
        assert torch.equal(h.dest_bytes(b)[:n], b.cpu.reshape(-1).view(torch.uint8)[:n])


def test_resume_keeps_epoch_and_published_groups(device: str, h: Any) -> None:
    setup = h.build_state(device, combined=False)
    st = setup.state
    st.begin()
    epoch = st.epoch
    st.set_count(setup.buffers["input_ids"], 3)
    st.publish("token_inputs")
    st.finish()
    assert st.resume() == 0
    assert st.epoch == epoch
    with pytest.raises(DuplicatePublicationError):
        st.publish("token_inputs")
    st.set_count(setup.buffers["positions"], 4)
    st.publish("mha_decode")
    st.finish()
    assert st.resume() == 0 and st.epoch == epoch  # each late ubatch may resume again
    st.finish()
    st.begin()
    assert st.epoch == epoch + 1
    with pytest.raises(EpochError, match="follows finish"):
        st.resume()


# ---------------------------------------------------------------------------- failures

def test_enqueue_failure_invalidates_and_retains_storage(device: str, h: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    setup = h.build_state(device)
    st = setup.state
    st.begin()
    rec = st._slot_groups[0][st.plan("decode").index]
    packed, arena = rec.packed, rec.packed.arena
    sources = {n: b.cpu.data_ptr() for n, b in setup.buffers.items()}
    h.break_publication(monkeypatch, rec.packed, "injected launch failure")
    for b in setup.buffers.values():
        st.set_count(b, 1)
    with pytest.raises(PublicationEnqueueError, match="group 'decode' failed"):
        st.publish("decode")
    assert not st.is_published("decode")
    assert "injected launch failure" in (st.invalidated or "")
    for call in (lambda: st.set_count(setup.buffers["input_ids"], 1),
                 lambda: st.publish("decode"), st.finish, st.begin):
        with pytest.raises(OwnerInvalidatedError, match="call reset\\(\\)"):
            call()
    monkeypatch.undo()
    st.reset()
    assert st.invalidated is None
    assert rec.packed is packed and rec.packed.arena is arena
    assert {n: b.cpu.data_ptr() for n, b in setup.buffers.items()} == sources
    st.begin()
    counts = _publish_all(setup, h, np.random.default_rng(4))
    st.finish()
    h.sync(device)
    ids = setup.buffers["input_ids"]
    assert torch.equal(ids.gpu[: counts["input_ids"]].cpu(), ids.cpu[: counts["input_ids"]])


def test_direct_copy_failure_invalidates(device: str, h: Any,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    setup = h.build_state(device, backend="direct")
    st = setup.state
    st.begin()
    ids = setup.buffers["input_ids"]
    st.set_count(ids, 2)

    class Exploding:
        def __getitem__(self, _: object) -> Any:
            raise RuntimeError("injected copy failure")

    monkeypatch.setattr(ids, "_dst_units", Exploding())
    with pytest.raises(PublicationEnqueueError):
        st.publish("decode")
    with pytest.raises(OwnerInvalidatedError):
        st.publish("decode")


# ---------------------------------------------------------------------------- GPU only

@pytest.mark.gpu
def test_wrong_stream_is_rejected(h: Any) -> None:
    setup = h.build_state("cuda")
    st = setup.state
    st.begin()
    st.set_count(setup.buffers["input_ids"], 4)
    st.set_count(setup.buffers["positions"], 4)
    before = _snapshot(setup, h)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side), pytest.raises(StreamMismatchError, match="consumer stream"):
        st.publish("decode")
    _assert_unchanged(setup, h, before)
    st.publish("decode")
    st.finish()


@pytest.mark.gpu
def test_wrong_device_is_rejected(h: Any) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    setup = h.build_state("cuda:0")
    st = setup.state
    st.begin()
    before = _snapshot(setup, h)
    with torch.cuda.device(1), pytest.raises(Exception, match="owns cuda:0"):
        st.publish("decode")
    _assert_unchanged(setup, h, before)


@pytest.mark.gpu
def test_publish_then_replay_captured_consumer(h: Any) -> None:
    setup = h.build_state("cuda")
    st = setup.state
    ids, pos = setup.buffers["input_ids"], setup.buffers["positions"]
    out = torch.zeros(64, dtype=torch.int64, device="cuda")
    # Capture a consumer over the fixed destinations.
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            torch.add(ids.gpu[:64].long(), pos.gpu, out=out)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        torch.add(ids.gpu[:64].long(), pos.gpu, out=out)
    rng = np.random.default_rng(5)
    for step in range(5):
        st.begin()
        ids.np[:64] = rng.integers(0, 1000, 64)
        pos.np[:] = rng.integers(0, 1000, 64)
        st.set_count(ids, 64)
        st.set_count(pos, 64)
        st.publish("decode")
        graph.replay()
        st.finish()
        torch.cuda.synchronize()
        expect = ids.cpu[:64].long() + pos.cpu
        assert torch.equal(out.cpu(), expect), f"step {step}"
    assert st.counters("decode").dmas == 5


# ---------------------------------------------------------------------------- more rules

def test_explicit_empty_backend_is_an_error() -> None:
    with pytest.raises(BackendError, match="backend argument=''"):
        H2DRunnerState("cpu", backend="")


def test_declaration_rule_messages() -> None:
    state = H2DRunnerState("cpu", scatter="reference")
    with pytest.raises(DeclarationError, match="'x': max_ranges must be an int >= 0"):
        state.buffer("x", (4,), torch.int32, group="g", max_ranges=-1)
    state.buffer("y", (4,), torch.int32, group="g", max_ranges=2)
    state.buffer("z", (4,), torch.int32, group="h")
    state.combine("c1", ["g", "h"])
    state.combine("c2", ["g", "h"])
    with pytest.raises(BindingError, match=r"'y': a ranged buffer .* must be carried by one "
                                           "publication group"):
        state.bind()
    assert not state.bound


def test_strided_destination_that_cannot_be_counted_is_rejected_at_bind() -> None:
    state = H2DRunnerState("cpu", scatter="reference")
    wide = torch.zeros((4, 6), dtype=torch.int64)
    state.buffer("pos", (4, 3), torch.int64, group="g", gpu=wide[:, :3])
    with pytest.raises(BindingError, match=r"'pos': its destination .* cannot be counted in "
                                           "elements without a copy"):
        state.bind()
    assert not state.bound


def test_epoch_and_slot_messages(device: str, h: Any) -> None:
    setup = h.build_state(device, num_slots=2)
    st = setup.state
    st.begin()
    with pytest.raises(EpochError, match=r"epoch 1 on slot 0 is still open"):
        st.begin()
    with pytest.raises(EpochError, match=r"follows finish"):
        st.resume()
    st.finish()
    with pytest.raises(EpochError, match=r"slot 2 is not in \[0, 2\)"):
        st.begin(2)
    assert (st.epoch, st.epoch_open, st.current_slot) == (1, False, 0)


def test_set_counts_is_all_or_nothing(device: str, h: Any) -> None:
    state = H2DRunnerState(device, scatter=h.scatter_mode(device))
    a = state.buffer("a", (8,), torch.int32, group="g")
    t = state.buffer("t", (8, 4), torch.int32, group="g", unit="rows", max_ranges=4)
    state.bind()
    state.begin()
    state.set_ranges(t, [(0, 16)])
    with pytest.raises(CountError, match="'t': ranges were already set this epoch"):
        state.set_counts({a: 5, t: 2})
    assert state.count(a) is None
    with pytest.raises(CountError, match="'t': ranges were already set"):
        state.set_count(t, 2)


def test_failed_producer_can_run_again(device: str, h: Any) -> None:
    setup = h.build_state(device)
    st = setup.state
    attempts: list[int] = []

    @h2d_producer("token_inputs")
    def produce(owner: object, fail: bool) -> None:
        attempts.append(1)
        if fail:
            raise ValueError("bad batch")
        st.set_count(setup.buffers["input_ids"], 1)

    st.begin()
    with pytest.raises(ValueError, match="bad batch"):
        produce(st, True)
    produce(st, False)  # nothing was published: a first entry again, no reason needed
    assert len(attempts) == 2
    with pytest.raises(ReentryError):
        produce(st, False)
    st.publish("token_inputs")
    st.finish()
    # the same producer next epoch, after its group went out without a producer entry
    # (counts set and published by hand): refused although the producer list is known
    st.begin()
    st.set_count(setup.buffers["input_ids"], 1)
    st.publish("token_inputs")
    with pytest.raises(ReentryError, match=r"already produced/published"):
        produce(st, False)
    assert len(attempts) == 2
    st.finish()


@pytest.mark.gpu
def test_consumer_stream_may_change_between_epochs(h: Any) -> None:
    setup = h.build_state("cuda")
    st = setup.state
    ids = setup.buffers["input_ids"]
    side = torch.cuda.Stream()
    for step, stream in enumerate([None, side, side, None]):
        ctx = torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(
            torch.cuda.current_stream())
        with ctx:
            st.begin()
            ids.np[:4] = step
            st.set_count(ids, 4)
            st.set_count(setup.buffers["positions"], 1)
            st.publish("decode")
            st.finish()
        torch.cuda.synchronize()
        assert ids.gpu[:4].tolist() == [step] * 4
    with torch.cuda.stream(side):
        st.begin()
    with pytest.raises(StreamMismatchError):
        st.publish("decode")
    st.finish()
