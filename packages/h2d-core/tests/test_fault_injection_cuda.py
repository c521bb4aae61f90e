"""Enqueue failures injected on the CUDA launch paths of a packed publication (GPU).

The CPU suite (``test_fault_injection.py``) covers each member's direct copy, the DMA and
the scatter launch on the compiled and Python cores. On CUDA a packed publication takes one
of several launch paths; each gets a failure injected where the runtime would report it:

* ``graph:compiled``: the compiled core's ``cuGraphLaunch`` through its driver function
  pointer (rebound to a function that returns a driver error);
* ``graph:python``: the arena's graph replay through the Python driver wrapper, the compiled
  helper packing only (an error status);
* ``dma:driver``: ``cuMemcpyHtoDAsync`` on the compiled (non-graph) path (an error status);
* ``dma:torch``: the torch copy of the arena on the compiled path (an exception);
* ``scatter:compiled``: the compiled scatter launch after its DMA was enqueued;
* ``scatter:jit``: Triton's own launch after its DMA was enqueued.

After each: ``PublicationEnqueueError`` chained to the original failure, the owner
invalidated (later publications and epochs refused), every destination byte unchanged (a
DMA that ran without its scatter changes no destination), storage retained, and ``reset()``
recovers with exact bytes on the same path.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest
import torch

from h2d_core import H2DRunnerState, OwnerInvalidatedError, PublicationEnqueueError

pytestmark = pytest.mark.gpu

ERROR = 999  # any nonzero CUDA status
_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_failing_launch = _LAUNCH(lambda graph, stream: ERROR)  # kept alive for the module


class Injected(RuntimeError):
    """The failure a test injects as an exception."""


class FailingDriver:
    """The arena's driver wrapper with one entry point failing with a CUDA status."""

    def __init__(self, real: Any, fail: str) -> None:
        self._real, self._fail = real, fail

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def address(self, name: str) -> int:
        if name == "graph_launch" and self._fail == "graph_launch":
            return ctypes.cast(_failing_launch, ctypes.c_void_p).value or 0
        return int(self._real.address(name))

    def graph_launch(self, graph_exec: int, stream: int) -> int:
        if self._fail == "graph_launch":
            return ERROR
        return int(self._real.graph_launch(graph_exec, stream))

    def memcpy_htod_async(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        if self._fail == "memcpy":
            return ERROR
        return int(self._real.memcpy_htod_async(dst, src, nbytes, stream))


class _FailOnIndex:
    def __getitem__(self, _: object) -> Any:
        raise Injected("injected at the torch DMA")


def _raise(*_: object, **__: object) -> None:
    raise Injected("injected at the scatter launch")


def build() -> tuple[H2DRunnerState, dict[str, Any]]:
    st = H2DRunnerState("cuda", backend="packed")
    bufs = {"a": st.buffer("a", (8,), torch.int32, group="g"),
            "b": st.buffer("b", (6,), torch.int64, group="g"),
            "bt": st.buffer("bt", (4, 8), torch.int32, group="g", unit="rows",
                            max_ranges=4)}
    st.bind()
    for buf in bufs.values():
        buf.gpu.view(-1).view(torch.uint8).fill_(0x5A)
    return st, bufs


def produce(st: H2DRunnerState, bufs: dict[str, Any], step: int) -> None:
    st.begin()
    bufs["a"].np[:5] = np.arange(5) + 100 * step
    bufs["b"].np[:3] = np.arange(3) - 100 * step
    st.set_count(bufs["a"], 5)
    st.set_count(bufs["b"], 3)
    bufs["bt"].np[:] = np.arange(32).reshape(4, 8) + 1000 * step
    st.set_count(bufs["bt"], 2)


def destinations(bufs: dict[str, Any]) -> dict[str, bytes]:
    torch.cuda.synchronize()
    return {n: b.gpu.cpu().numpy().tobytes() for n, b in bufs.items()}


def route(position: str, packed: Any, patch: pytest.MonkeyPatch) -> None:
    """Send the group's publications down ``position``'s path (no failure yet)."""
    arena = packed.arena
    if position == "graph:compiled":
        assert packed.compiled and packed.launches_graphs, "the compiled graph path is off"
        return
    # The compiled helper packs only and hands the launch to the arena's own paths.
    patch.setattr(packed, "_launch_table", packed._launch_table)  # restored afterwards
    patch.setattr(packed, "_binding", packed._bind_native(graphs=False))
    if position == "graph:python":
        assert arena.launch == "graph"
    elif position.endswith(":jit"):
        patch.setattr(arena, "_publish", arena._publish_jit)
    else:
        patch.setattr(arena, "_publish", arena._publish_compiled)
    if position == "dma:torch":
        patch.setattr(arena, "dma", "torch")


def inject(position: str, packed: Any, patch: pytest.MonkeyPatch) -> None:
    arena = packed.arena
    if position == "graph:compiled":
        patch.setattr(arena._graphs, "_driver", FailingDriver(arena._graphs._driver,
                                                              "graph_launch"))
        patch.setattr(packed, "_binding", packed._bind_native())
    elif position == "graph:python":
        patch.setattr(arena._graphs, "_driver", FailingDriver(arena._graphs._driver,
                                                              "graph_launch"))
    elif position == "dma:driver":
        assert arena.dma == "driver"
        patch.setattr(arena, "_driver", FailingDriver(arena._driver, "memcpy"))
    elif position == "dma:torch":
        patch.setattr(arena, "_dma_views", _FailOnIndex())
    elif position == "scatter:compiled":
        patch.setattr(arena, "_launch_scatter", _raise)
    else:  # scatter:jit
        import h2d_kernels.arena

        patch.setattr(h2d_kernels.arena, "launch_jit", _raise)


POSITIONS = ["graph:compiled", "graph:python", "dma:driver", "dma:torch", "scatter:compiled",
             "scatter:jit"]


@pytest.mark.parametrize("position", POSITIONS)
def test_a_cuda_enqueue_failure_invalidates_retains_and_recovers(
        position: str, monkeypatch: pytest.MonkeyPatch) -> None:
    st, bufs = build()
    packed = st._slot_groups[0][st.plan("g").index].packed
    assert packed is not None
    with monkeypatch.context() as path:
        route(position, packed, path)
        produce(st, bufs, 1)
        st.publish("g")
        st.finish()
        good = destinations(bufs)
        kept = tuple(p for b in bufs.values() for p in (b.gpu.data_ptr(),
                                                         b.source(0).data_ptr()))
        produce(st, bufs, 2)
        with monkeypatch.context() as fault:
            inject(position, packed, fault)
            with pytest.raises(PublicationEnqueueError, match=r"group 'g'.*reset\(\)") as info:
                st.publish("g")
        cause = info.value.__cause__
        assert cause is not None
        if position.startswith(("graph", "dma:driver")):
            assert str(ERROR) in str(cause)  # the driver status reaches the caller
        else:
            assert isinstance(cause, Injected)
        assert st.invalidated is not None
        assert destinations(bufs) == good  # no scatter ran: no destination changed
        with pytest.raises(OwnerInvalidatedError):
            st.publish("g")
        with pytest.raises(OwnerInvalidatedError):
            st.begin()
        assert destinations(bufs) == good
        assert tuple(p for b in bufs.values() for p in (b.gpu.data_ptr(),
                                                         b.source(0).data_ptr())) == kept
        if position == "graph:compiled":  # the real driver entry point again
            path.setattr(packed, "_binding", packed._bind_native())
        st.reset()
        produce(st, bufs, 3)
        st.publish("g")
        st.finish()
        torch.cuda.synchronize()
        a, b, bt = (bufs[n].gpu.cpu() for n in ("a", "b", "bt"))
    assert a[:5].tolist() == [300, 301, 302, 303, 304]
    assert b[:3].tolist() == [-300, -299, -298]
    assert bt[:2].tolist() == (np.arange(16).reshape(2, 8) + 3000).tolist()
    assert bt[2:].view(torch.uint8).unique().tolist() == [0x5A]  # rows past the count
