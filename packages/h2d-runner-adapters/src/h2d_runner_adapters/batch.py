"""Plain descriptions of one scheduled step, independent of any engine's classes.

A scheduler (or an engine's adapter layer) builds a :class:`ScheduledBatch` per forward
step; the runner adapters turn it into published metadata. Block tables are passed as
``block_tables.BlockTable`` (versioned: cheap incremental preparation) or as plain arrays /
lists (unversioned: compared against the snapshot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from block_tables import BlockTable

#: what a request's page list may be
PageRow = BlockTable | np.ndarray | Sequence[int]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling: temperature 0 means greedy; -1 / 1.0 disable top-k / top-p."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step.

    ``num_tokens`` query tokens run this step, at positions
    ``[context_len - num_tokens, context_len)``. ``token_ids`` are the ids staged from the
    host for those positions (a prefill chunk, or a decode token the host already knows);
    for a deferred decode (``prev_sample_row >= 0``) the ids come from row
    ``prev_sample_row`` of the previous step's sampled ids on the GPU, and ``token_ids``
    holds placeholders (or is empty). ``draft_token_ids`` are speculative tokens to verify
    (they follow the first token of the span).
    """

    req_id: int
    num_tokens: int
    context_len: int
    block_table: PageRow
    sampling: SamplingParams = SamplingParams()
    token_ids: Sequence[int] = ()
    prev_sample_row: int = -1
    draft_token_ids: Sequence[int] = ()
    #: tokens already in the KV cache from an earlier step or a prefix-cache hit
    num_cached_tokens: int = 0

    @property
    def first_position(self) -> int:
        return self.context_len - self.num_tokens


@dataclass(frozen=True)
class BatchColumns:
    """The batch as numpy columns (one entry per request, or per token for ``token_ids``).

    Producers read only these arrays, so a scheduler that already keeps its batch as arrays
    (a "persistent batch") can build them directly and skip per-request objects.
    """

    query_lens: np.ndarray  # int32 [n]
    context_lens: np.ndarray  # int32 [n], after this step
    temperatures: np.ndarray  # float32 [n]; <= 0 means greedy
    top_k: np.ndarray  # int32 [n]; -1 = off
    top_p: np.ndarray  # float32 [n]; 1.0 = off
    prev_sample_rows: np.ndarray  # int32 [n]; -1 = ids staged from the host
    token_ids: np.ndarray  # int32 [sum(query_lens)]; placeholders where deferred
    num_drafts: np.ndarray  # int32 [n]; speculative tokens to verify per request

    @classmethod
    def from_requests(cls, requests: Sequence[ScheduledRequest]) -> BatchColumns:
        n = len(requests)
        q = np.fromiter((r.num_tokens for r in requests), np.int32, n)
        ids = np.zeros(int(q.sum()), dtype=np.int32)
        pos = 0
        for r, k in zip(requests, q.tolist(), strict=True):
            staged = list(r.token_ids)[:k]
            ids[pos : pos + len(staged)] = staged
            pos += k
        return cls(
            query_lens=q,
            context_lens=np.fromiter((r.context_len for r in requests), np.int32, n),
            temperatures=np.fromiter((r.sampling.temperature for r in requests), np.float32, n),
            top_k=np.fromiter((r.sampling.top_k for r in requests), np.int32, n),
            top_p=np.fromiter((r.sampling.top_p for r in requests), np.float32, n),
            prev_sample_rows=np.fromiter((r.prev_sample_row for r in requests), np.int32, n),
            token_ids=ids,
            num_drafts=np.fromiter((len(r.draft_token_ids) for r in requests), np.int32, n),
        )


@dataclass(frozen=True)
class ScheduledBatch:
    """The requests of one forward step, in batch order."""

    requests: Sequence[ScheduledRequest]
    is_prefill: bool
    page_size: int
    #: padded (CUDA-graph) batch size for decode; None = eager, no padding
    padded_size: int | None = None
    step: int = 0
    extras: dict[str, object] = field(default_factory=dict)

    #: the same batch as columns; derived from ``requests`` when not given
    given_columns: BatchColumns | None = None
    #: page rows in batch order; derived from ``requests`` when not given
    given_block_tables: Sequence[PageRow] | None = None

    @cached_property
    def columns(self) -> BatchColumns:
        return self.given_columns or BatchColumns.from_requests(self.requests)

    @cached_property
    def block_tables(self) -> Sequence[PageRow]:
        if self.given_block_tables is not None:
            return self.given_block_tables
        return [r.block_table for r in self.requests]

    @property
    def num_reqs(self) -> int:
        return int(self.columns.query_lens.size)

    @property
    def num_tokens(self) -> int:
        return int(self.columns.token_ids.size)
