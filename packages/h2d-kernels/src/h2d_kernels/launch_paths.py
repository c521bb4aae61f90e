"""Which scatter, launch and DMA an arena uses: the ``auto`` choices resolved per device.

The choice is made once, at bind, and refused with a :class:`ScatterBackendError` that says
what to pass instead when this device (or Triton's interpreter) cannot run it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

from h2d_kernels.driver import device_driver
from h2d_kernels.errors import ScatterBackendError
from h2d_kernels.scatter import interpreter_enabled

ScatterChoice = Literal["auto", "triton", "reference"]
LaunchChoice = Literal["auto", "compiled", "graph", "jit"]
DmaChoice = Literal["auto", "driver", "torch"]
#: a publication's first consumer: called with the device arena's header rows, on the
#: publication's stream (see :class:`PackedArena`)
Consumer = Callable[[torch.Tensor], None]

DEFAULT_LAUNCH: Literal["compiled", "graph", "jit"] = "graph"
"""Launch path used by ``launch="auto"`` on CUDA: the lowest host time measured on the H200
(docs/benchmarks.md). Under stream capture it falls back to the compiled launch."""


def choose_paths(
    device: torch.device, scatter: str, launch: str, dma: str
) -> tuple[str, str, str]:
    """Resolve the ``auto`` choices and reject combinations this device cannot run."""
    for value, allowed, what in (
        (scatter, ("auto", "triton", "reference"), "scatter"),
        (launch, ("auto", "compiled", "graph", "jit"), "launch"),
        (dma, ("auto", "driver", "torch"), "dma"),
    ):
        if value not in allowed:
            raise ScatterBackendError(f"{what}={value!r}: choose one of {allowed}")
    interpreted = interpreter_enabled()
    if device.type == "cpu":
        if scatter == "triton" and not interpreted:
            raise ScatterBackendError(
                "scatter='triton' on a CPU device runs the kernel in Triton's interpreter: set "
                "TRITON_INTERPRET=1 before triton is imported, or use scatter='reference'"
            )
        if launch not in ("auto", "jit"):
            raise ScatterBackendError(
                f"launch={launch!r} needs a CUDA device: CPU publications use launch='auto'"
            )
        kind = "triton" if scatter == "triton" else "reference"
        return kind, ("jit" if kind == "triton" else "none"), "memcpy"
    if scatter == "reference":
        raise ScatterBackendError(
            "scatter='reference' runs on CPU devices only: use scatter='triton' on CUDA"
        )
    if interpreted:
        if launch not in ("auto", "jit"):
            raise ScatterBackendError(
                f"launch={launch!r} needs compiled Triton, but TRITON_INTERPRET=1 is set: "
                "use launch='jit' or unset the variable"
            )
        launch_kind = "jit"
    else:
        launch_kind = DEFAULT_LAUNCH if launch == "auto" else launch
    dma_kind = dma
    if dma == "auto":
        dma_kind = "driver" if device_driver() is not None else "torch"
    return "triton", launch_kind, dma_kind
