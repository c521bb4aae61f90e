"""Enqueue failures injected at every position of a publication (CPU).

Positions:

* direct backend: the copy of each member in turn, and the bulk copy of a ranged table;
* packed backend: the DMA (the device arena's write), the scatter launch, and both with
  byte ranges in the arena;
* packed positions on the compiled and on the Python cores.

After each failure:

* the caller gets `PublicationEnqueueError`, chained to the injected exception;
* the owner is invalidated: publications and new epochs are refused, so a later
  publication never partially writes a destination;
* storage is retained: the same sources and destinations;
* `reset()` recovers, and the next publication writes exact bytes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from h2d_core import H2DRunnerState, OwnerInvalidatedError, PublicationEnqueueError

MEMBERS = ("a", "b", "bt")


class Injected(RuntimeError):
    """The failure a test injects."""


class _FailOnSlice:
    """A destination view whose every slicing raises (the copy of that member fails)."""

    def __getitem__(self, _: object) -> Any:
        raise Injected("injected at a member's copy")


class _FailOnWrite:
    """A device arena whose write (the DMA) raises."""

    def __init__(self, real: np.ndarray) -> None:
        self.real = real

    def __setitem__(self, key: object, value: object) -> None:
        raise Injected("injected at the DMA")

    def __getitem__(self, key: object) -> Any:
        return self.real[key]


def build(backend: str) -> tuple[H2DRunnerState, dict[str, Any]]:
    st = H2DRunnerState("cpu", backend=backend, scatter="reference")
    bufs = {"a": st.buffer("a", (8,), torch.int32, group="g"),
            "b": st.buffer("b", (6,), torch.int64, group="g"),
            "bt": st.buffer("bt", (4, 8), torch.int32, group="g", unit="rows",
                            max_ranges=4)}
    st.bind()
    for buf in bufs.values():
        buf.gpu.view(-1).view(torch.uint8).fill_(0x5A)
    return st, bufs


def produce(st: H2DRunnerState, bufs: dict[str, Any], step: int, ranged: bool) -> None:
    st.begin()
    bufs["a"].np[:5] = np.arange(5) + 100 * step
    bufs["b"].np[:3] = np.arange(3) - 100 * step
    st.set_count(bufs["a"], 5)
    st.set_count(bufs["b"], 3)
    bt = bufs["bt"].np
    bt[:] = np.arange(32).reshape(4, 8) + 1000 * step
    if ranged:
        st.set_ranges(bufs["bt"], [(0, 8), (40, 48)])  # row 0 cols 0-1, row 1 cols 2-3
    else:
        st.set_count(bufs["bt"], 2)


def destinations(bufs: dict[str, Any]) -> dict[str, bytes]:
    return {n: b.gpu.numpy().tobytes() for n, b in bufs.items()}


def storage(st: H2DRunnerState, bufs: dict[str, Any]) -> tuple[int, ...]:
    return tuple(p for b in bufs.values()
                 for p in (b.gpu.data_ptr(), *(b.source(s).data_ptr()
                                               for s in range(st.num_slots))))


def inject(position: str, st: H2DRunnerState, bufs: dict[str, Any],
           patch: pytest.MonkeyPatch) -> None:
    if position.startswith("member:"):
        buf = bufs[position.split(":")[1]]
        patch.setattr(buf, "_dst_units", _FailOnSlice())
        patch.setattr(buf, "_dst_bytes", _FailOnSlice())
        return
    rec = st._slot_groups[st.current_slot][st.plan("g").index]
    assert rec.packed is not None
    arena = rec.packed.arena
    import types

    import h2d_kernels.arena
    import h2d_kernels.packed_group

    def fail(*args: object) -> None:
        raise Injected(f"injected at the {position}")

    if position == "dma":  # the compiled publication (pack, copy, scatter) fails first
        shim = types.SimpleNamespace(**vars(h2d_kernels.packed_group._native))
        shim.publish_packed = shim.publish_packed_step = fail
        patch.setattr(h2d_kernels.packed_group, "_native", shim)
    else:  # the arena's own CPU publication (a binding that hands it back) fails
        group = rec.packed
        patch.setattr(type(arena), "cpu_publish_binding", property(lambda self: None))
        group._binding = group._bind_native()  # stays correct after: the arena publishes
        shim = types.SimpleNamespace(**vars(h2d_kernels.arena._native))
        shim.publish_cpu = fail
        patch.setattr(h2d_kernels.arena, "_native", shim)


CASES = [("direct", f"member:{m}", ranged) for m in MEMBERS for ranged in (False, True)
         if not (ranged and m != "bt")] + [
    ("packed", pos, ranged) for pos in ("dma", "scatter") for ranged in (False, True)]


@pytest.mark.parametrize("backend, position, ranged", CASES)
def test_an_enqueue_failure_invalidates_retains_and_recovers(
        backend: str, position: str, ranged: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    st, bufs = build(backend)
    produce(st, bufs, 1, ranged)
    st.publish("g")
    st.finish()
    good = destinations(bufs)
    kept = storage(st, bufs)

    produce(st, bufs, 2, ranged)
    with monkeypatch.context() as patch:
        inject(position, st, bufs, patch)
        with pytest.raises(PublicationEnqueueError, match=r"group 'g'.*reset\(\)") as info:
            st.publish("g")
    assert isinstance(info.value.__cause__, Injected)  # the original failure, chained
    assert st.invalidated is not None
    after_failure = destinations(bufs)
    if backend == "packed":  # nothing was scattered: every destination as before
        assert after_failure == good
    # a later publication (or epoch) is refused: no destination is partially rewritten
    with pytest.raises(OwnerInvalidatedError):
        st.publish("g")
    with pytest.raises(OwnerInvalidatedError):
        st.begin()
    assert destinations(bufs) == after_failure
    assert storage(st, bufs) == kept  # storage retained, never rebound

    st.reset()
    produce(st, bufs, 3, ranged)
    st.publish("g")
    st.finish()
    a, b, bt = (bufs[n].gpu for n in MEMBERS)
    assert a[:5].tolist() == [300, 301, 302, 303, 304]
    assert b[:3].tolist() == [-300, -299, -298]
    want = (np.arange(32).reshape(4, 8) + 3000)
    if ranged:
        assert bt[0, :2].tolist() == want[0, :2].tolist()
        assert bt[1, 2:4].tolist() == want[1, 2:4].tolist()
    else:
        assert bt[:2].tolist() == want[:2].tolist()
