"""Helpers shared by the h2d-core suites: a decode-like state with poisoned destinations."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from h2d_core import H2DBuffer, H2DRunnerState

POISON = 0x5A  # every destination byte starts as this, so unwritten tails show

#: (name, dtype, shape, group, unit): the ten members of a plain decode step, scaled down.
DECODE_MEMBERS: list[tuple[str, torch.dtype, tuple[int, ...], str, str]] = [
    ("temperatures", torch.float32, (16,), "token_inputs", "elements"),
    ("cu_seqlens_q", torch.int32, (17,), "token_inputs", "elements"),
    ("input_ids", torch.int32, (65,), "token_inputs", "elements"),
    ("top_ks", torch.int32, (16,), "token_inputs", "elements"),
    ("top_ps", torch.float32, (16,), "token_inputs", "elements"),
    ("slot_mapping", torch.int64, (64,), "mha_decode", "elements"),
    ("context_lens", torch.int32, (16,), "mha_decode", "elements"),
    ("block_tables", torch.int32, (16, 24), "mha_decode", "rows"),
    ("kv_indptr", torch.int32, (17,), "mha_decode", "elements"),
    ("positions", torch.int64, (64,), "mha_decode", "elements"),
]


def scatter_mode(device: str) -> str:
    """CPU runs exercise the Triton kernel when the interpreter is on, else the reference."""
    if device == "cpu":
        return "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "reference"
    return "auto"


@dataclass
class DecodeSetup:
    state: H2DRunnerState
    buffers: dict[str, H2DBuffer]


def build_state(
    device: str,
    *,
    backend: str = "packed",
    scatter: str | None = None,
    num_slots: int = 1,
    combined: bool = True,
    members: list[tuple[str, torch.dtype, tuple[int, ...], str, str]] | None = None,
) -> DecodeSetup:
    state = H2DRunnerState(device, num_slots=num_slots, backend=backend,
                           scatter=scatter or scatter_mode(device))
    bufs = {}
    for name, dtype, shape, group, unit in members or DECODE_MEMBERS:
        bufs[name] = state.buffer(name, shape, dtype, group=group, unit=unit)
    if combined:
        state.combine("decode", ["token_inputs", "mha_decode"])
    state.bind()
    for b in bufs.values():
        b.gpu.view(torch.uint8).fill_(POISON)
    return DecodeSetup(state, bufs)


def fill_random(buf: H2DBuffer, rng: np.random.Generator) -> None:
    """Random bytes in the current slot's whole source (never zeros)."""
    raw = buf.cpu.view(-1).view(torch.uint8)
    raw.copy_(torch.from_numpy(rng.integers(0, 256, raw.numel(), dtype=np.uint8)))


def expected_bytes(buf: H2DBuffer, source: torch.Tensor, count: int | None,
                   before: torch.Tensor) -> torch.Tensor:
    """What the destination must hold after publishing ``count`` units of ``source``."""
    out = before.clone()
    if count:
        nbytes = count * buf.spec.unit_bytes
        out[:nbytes] = source.reshape(-1).view(torch.uint8)[:nbytes]
    return out


def dest_bytes(buf: H2DBuffer) -> torch.Tensor:
    return buf.gpu.reshape(-1).view(torch.uint8).cpu().clone()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def break_publication(monkeypatch: Any, packed: Any, message: str = "injected") -> None:
    """Make every enqueue of this packed slot raise RuntimeError(message): its one
    publication call (compiled launch or the arena's publish alike)."""

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError(message)

    monkeypatch.setattr(packed, "publish", broken)
    monkeypatch.setattr(packed, "publish_step", broken)  # the state's call


def spy_dma(monkeypatch: Any, packed: Any) -> list[int]:
    """Record the DMA size of every publication of this packed slot (what its one
    publication call returns, whichever launch ran)."""
    seen: list[int] = []
    real, real_step = packed.publish, packed.publish_step

    def spy(*args: Any, **kwargs: Any) -> int:
        end = int(real(*args, **kwargs))
        seen.append(end)
        return end

    def spy_step(*args: Any, **kwargs: Any) -> bool:  # the state's call: completion
        recorded = bool(real_step(*args, **kwargs))
        seen.append(packed.last_dma_bytes)
        return recorded

    monkeypatch.setattr(packed, "publish", spy)
    monkeypatch.setattr(packed, "publish_step", spy_step)
    return seen
