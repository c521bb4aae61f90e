"""Plain descriptions of one scheduled step, independent of any engine's classes.

A scheduler (or an engine's adapter layer) builds a :class:`ScheduledBatch` per forward
step; the runner adapters turn it into published metadata. Block tables are passed as
``block_tables.BlockTable`` (versioned: cheap incremental preparation) or as plain arrays /
lists (unversioned: compared against the snapshot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

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
class ScheduledBatch:
    """The requests of one forward step, in batch order."""

    requests: Sequence[ScheduledRequest]
    is_prefill: bool
    page_size: int
    #: padded (CUDA-graph) batch size for decode; None = eager, no padding
    padded_size: int | None = None
    step: int = 0
    extras: dict[str, object] = field(default_factory=dict)

    @property
    def num_reqs(self) -> int:
        return len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)
