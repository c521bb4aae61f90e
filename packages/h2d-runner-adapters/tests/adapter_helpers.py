"""A small runner built from the adapters, and random batches for the adapter suites."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from block_tables import BlockTable
from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    BatchColumns,
    MhaDecodeInputs,
    PrefillInputs,
    SamplingInputs,
    ScheduledBatch,
    StepShape,
    TokenInputs,
)

POISON = 0x5A
PAGE = 4
MAX_REQS = 16
MAX_TOKENS = 96
MAX_PAGES = 24
NUM_PAGES = 400


def need_kernels(device: str) -> None:
    """CPU runs of the Triton consumers need the interpreter (one mode per process)."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU consumer kernels need TRITON_INTERPRET=1 (set by nox -s tests)")
    if device == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("CUDA consumer kernels need TRITON_INTERPRET unset")


def scatter_for(device: str) -> str:
    if device == "cpu":
        return "triton" if os.environ.get("TRITON_INTERPRET") == "1" else "reference"
    return "auto"


@dataclass
class Runner:
    state: H2DRunnerState
    sampling: SamplingInputs
    tokens: TokenInputs
    decode: MhaDecodeInputs
    prefill: PrefillInputs
    decode_group: str
    prefill_group: str
    token_group: str | None


def build_runner(device: str, *, backend: str = "packed", layout: str = "combined",
                 num_slots: int = 1) -> Runner:
    """``layout``: "combined" (one DMA per step: decode / prefill step groups) or "groups"
    (the spec's consumer groups: token_inputs, mha_decode, prefill_inputs)."""
    st = H2DRunnerState(device, backend=backend, num_slots=num_slots,
                        scatter=scatter_for(device))
    sampling = SamplingInputs(st, MAX_REQS)
    tokens = TokenInputs(st, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS, max_drafts=2)
    shape = StepShape(max_reqs=MAX_REQS, max_tokens=MAX_TOKENS, max_pages_per_req=MAX_PAGES,
                      page_size=PAGE, num_pages=NUM_PAGES)
    decode = MhaDecodeInputs(st, replace(shape, max_ranges=8))
    prefill = PrefillInputs(st, shape)
    token_producers = ["sampling", *tokens.producer_groups]
    if layout == "combined":
        st.combine("decode_step", [*token_producers, "mha_decode"])
        st.combine("prefill_step", [*token_producers, "prefill_inputs"])
        groups = ("decode_step", "prefill_step", None)
    else:
        st.combine("token_inputs", token_producers)
        groups = ("mha_decode", "prefill_inputs", "token_inputs")
    st.bind()
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(POISON)
    return Runner(st, sampling, tokens, decode, prefill, *groups)


def publish_step(r: Runner, kind: str) -> None:
    if r.token_group is not None:
        r.state.publish(r.token_group)
    r.state.publish(r.decode_group if kind == "decode" else r.prefill_group)


class Requests:
    """A toy request population with growing block tables (append lineages)."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.next_page = 0
        self.ctx: list[int] = []
        self.tables: list[BlockTable] = []

    def _pages(self, n: int) -> list[int]:
        out = [(self.next_page + i) % NUM_PAGES for i in range(n)]
        self.next_page += n
        return out

    def add(self, ctx: int) -> None:
        self.ctx.append(ctx)
        self.tables.append(BlockTable(self._pages(-(-ctx // PAGE))))

    def grow(self, q: int) -> None:
        for i in range(len(self.ctx)):
            self.ctx[i] += q
            need = -(-self.ctx[i] // PAGE) - len(self.tables[i])
            if need > 0:
                self.tables[i].append(self._pages(need))

    def decode_batch(self, q: int = 1, *, deferred: bool = True, drafts: int = 0,
                     padded: int | None = None, sampling: str = "mixed") -> ScheduledBatch:
        n = len(self.ctx)
        rng = self.rng
        if sampling == "uniform":
            top_k = np.full(n, 5, np.int32)
            top_p = np.full(n, 0.9, np.float32)
        elif sampling == "off":
            top_k = np.full(n, -1, np.int32)
            top_p = np.ones(n, np.float32)
        else:
            top_k = rng.choice([-1, 3, 7], n).astype(np.int32)
            top_p = rng.choice([1.0, 0.8], n).astype(np.float32)
        temps = rng.choice([0.0, 0.7, 1.3], n).astype(np.float32)
        prev = (np.arange(n, dtype=np.int32)[::-1].copy() if deferred
                else np.full(n, -1, np.int32))
        cols = BatchColumns(
            query_lens=np.full(n, q, np.int32),
            context_lens=np.asarray(self.ctx, np.int32),
            temperatures=temps, top_k=top_k, top_p=top_p, prev_sample_rows=prev,
            token_ids=rng.integers(1, 1000, n * q).astype(np.int32),
            num_drafts=np.full(n, drafts, np.int32),
        )
        return ScheduledBatch((), False, PAGE, padded_size=padded, given_columns=cols,
                              given_block_tables=list(self.tables))

    def prefill_batch(self, chunk: list[int]) -> ScheduledBatch:
        """Each request runs ``chunk[i]`` new tokens ending at its current context."""
        n = len(self.ctx)
        rng = self.rng
        q = np.asarray(chunk, np.int32)
        cols = BatchColumns(
            query_lens=q, context_lens=np.asarray(self.ctx, np.int32),
            temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
            top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
            token_ids=rng.integers(1, 1000, int(q.sum())).astype(np.int32),
            num_drafts=np.zeros(n, np.int32),
        )
        return ScheduledBatch((), True, PAGE, given_columns=cols,
                              given_block_tables=list(self.tables))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()
