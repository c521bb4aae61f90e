"""Shared fixtures of the DeepSeek-V4/V4.1 suites: the V4.1 state, the population of
DSpark-style requests and the host reference of every published member, written from the
context document (model-family-metadata §1)."""

from __future__ import annotations

import random
from typing import Any

import adapter_helpers as ah
import numpy as np
import torch

from block_tables import BlockTable
from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    V4_BLOCK,
    BatchColumns,
    RequestSpan,
    ScheduledBatch,
    V41MetadataInputs,
)
from h2d_runner_adapters.v4.metadata import V4_RATIOS
from h2d_runner_adapters.v4.step_indptrs import WindowGeometry

POISON = -7
WINDOW, TOPK = 128, 1024
MAX_REQS, MAX_TOKENS, MAX_BLOCKS, NUM_BLOCKS = 8, 40, 6, 200
DUMMY_SLOT, DUMMY_BLOCK = 99, NUM_BLOCKS - 1
ENVELOPE = 66  # compressed rows per block over the compressed layers
GEOMETRY = WindowGeometry(slot_rows=1000, ring_positions=WINDOW + 3,
                          classes=((0, WINDOW + 3, 1), (400, 4, 8), (700, 2, 6)))
V4_POISON = 0x5A


def v41_state(device: str, backend: str = "packed", num_slots: int = 1, fp8: bool = True,
              fuse: bool = False) -> tuple[H2DRunnerState, V41MetadataInputs]:
    st_ = H2DRunnerState(device, backend=backend, num_slots=num_slots,
                         scatter=ah.scatter_for(device))
    v4 = V41MetadataInputs(st_, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS,
                           max_blocks_per_req=MAX_BLOCKS, dummy_state_slot=DUMMY_SLOT,
                           dummy_block=DUMMY_BLOCK, num_blocks=NUM_BLOCKS, window=WINDOW,
                           index_topk=TOPK, fp8=fp8, envelope_rows=ENVELOPE, max_ranges=4,
                           fuse_step_indptrs=fuse)
    st_.bind()
    for b in st_.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(V4_POISON)
    return st_, v4


def v41_reference(spans: list[RequestSpan], rows: list[list[int]], padded: int
                  ) -> dict[str, list[Any]]:
    """Every published member of a step, written from the context document (§1.3-1.6):
    tail-anchored positions, the graph grid (padded x widest query), -1 padding."""
    n = len(spans)
    q = max((s.num_tokens for s in spans), default=1)
    pt = padded * q
    pos, bids, per_req_start = [], [], []
    for i, s in enumerate(spans):
        per_req_start.append(len(pos))
        for j in range(s.num_tokens):
            pos.append(s.context_len - s.num_tokens + j)
            bids.append(i)
    t = len(pos)
    out: dict[str, list[Any]] = {
        "v41_positions": pos + [0] * (pt - t),
        "v41_token_batch_ids": bids + [-1] * (pt - t),
        "v41_seq_lens": [s.context_len for s in spans] + [0] * (padded - n),
        "v41_state_slot_out": [s.state_slot for s in spans] + [DUMMY_SLOT] * (padded - n),
        "v41_state_slot_in": [s.fork_source if s.fork_source >= 0 else s.state_slot
                              for s in spans] + [DUMMY_SLOT] * (padded - n),
        "v41_qo_indptr": list(range(t + 1)) + [t] * (pt - t),
        "v41_step_counts": [n, padded, t, pt],  # published when the consumer is fused
    }
    for r, k in V4_RATIOS:
        compress, write = [], []
        for ti, (p, b) in enumerate(zip(pos, bids, strict=True)):
            j = ti - per_req_start[b]
            row = [ti, b, p, k - min(j + 1, k)]
            if (p + 1) % r == 0:
                compress.append(row)
            if p >= max(0, spans[b].context_len - k):
                write.append(row)
        out[f"v41_compress_plan_{r}"] = compress + [[-1] * 4] * (padded * -(-q // r)
                                                                  - len(compress))
        out[f"v41_write_plan_{r}"] = write + [[-1] * 4] * (padded * min(q, k) - len(write))
    table = [list(row) for row in rows] + [[DUMMY_BLOCK]] * (padded - n)
    out["v41_block_tables"] = table
    return out


class Population:
    """Requests that grow by 1-4 tokens a step (DSpark widths), appending 256-token blocks."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.next_block = 0
        self.reqs: list[tuple[int, BlockTable, int]] = []  # (context, table, state slot)

    def block(self) -> int:
        self.next_block = (self.next_block + 1) % (NUM_BLOCKS - 1)
        return self.next_block

    def step(self, n: int, ragged: bool, q: int) -> tuple[list[RequestSpan], list[BlockTable]]:
        while len(self.reqs) < n:
            ctx = self.rng.randint(1, 3 * V4_BLOCK)
            table = BlockTable([self.block() for _ in range(-(-ctx // V4_BLOCK))])
            self.reqs.append((ctx, table, len(self.reqs)))
        self.reqs = self.reqs[:n]
        spans, rows = [], []
        for i, (ctx, table, slot) in enumerate(self.reqs):
            width = self.rng.randint(1, q) if ragged else q
            ctx += width
            while len(table) * V4_BLOCK < ctx:
                table = table.lineage_copy()
                table.append_one(self.block())
            self.reqs[i] = (ctx, table, slot)
            fork = slot + 50 if self.rng.random() < 0.2 else -1
            spans.append(RequestSpan(width, ctx, slot, fork))
            rows.append(table)
        return spans, rows


def check_published(st_: H2DRunnerState, want: dict[str, list[Any]],
                    before: dict[str, bytes]) -> None:
    bufs = st_.buffers()
    for name, values in want.items():
        if name not in bufs:
            continue
        gpu = bufs[name].gpu.cpu()
        if name.endswith("v41_block_tables"):
            for i, row in enumerate(values):
                assert gpu[i, : len(row)].tolist() == row, (name, i)
            continue
        count = len(values)
        assert gpu[:count].tolist() == values, name
        tail = gpu[count:].numpy().tobytes()
        assert tail == before[name][len(before[name]) - len(tail):], f"{name}: tail moved"


def token_batch(spans: list[RequestSpan], prefill: bool) -> ScheduledBatch:
    """The token inputs' view of the same step: one request per span."""
    n = len(spans)
    q = np.array([s.num_tokens for s in spans], np.int32)
    cols = BatchColumns(
        query_lens=q, context_lens=np.array([s.context_len for s in spans], np.int32),
        temperatures=np.ones(n, np.float32), top_k=np.full(n, -1, np.int32),
        top_p=np.ones(n, np.float32), prev_sample_rows=np.full(n, -1, np.int32),
        token_ids=np.arange(int(q.sum()), dtype=np.int32), num_drafts=np.zeros(n, np.int32))
    return ScheduledBatch((), prefill, V4_BLOCK, given_columns=cols)
