"""Build :class:`DecoderInputs` for a :class:`ScheduledBatch` on the host, the plain way.

The oracle for published metadata: what the runner's publication plus its first consumers
(token assembly, KV-index generation) must leave in the destinations the model reads. Each
call allocates fresh tensors; a runner publishes into fixed ones instead.

Layout: requests' tokens in batch order, then one padded token per padded row (decode
graphs: ``padded_rows`` rows, one token each). Padded rows own no pages, have context 0,
and their tokens have slot -1, position 0 and id 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from h2d_runner_adapters.batch import ScheduledBatch

from .model import DecoderInputs

__all__ = ["HostInputError", "HostStep", "build_host_inputs"]


class HostInputError(ValueError):
    """A scheduled batch cannot be turned into decoder inputs as given."""


@dataclass(frozen=True)
class HostStep:
    """Decoder inputs plus the token index of each row's last token (for sampling)."""

    inputs: DecoderInputs
    #: int64 ``[rows]``: row ``r``'s last token (padded rows: their own padded token)
    logits_indices: torch.Tensor
    #: input ids with deferred tokens resolved, real tokens only
    input_ids: tuple[int, ...]


def build_host_inputs(
    batch: ScheduledBatch,
    device: torch.device | str = "cpu",
    *,
    prev_sampled: Sequence[int] | None = None,
    padded_rows: int | None = None,
    kv_capacity: int | None = None,
) -> HostStep:
    """Inputs for ``batch``; deferred rows take ``prev_sampled[prev_sample_row]``.

    ``padded_rows`` defaults to ``batch.padded_size`` (or no padding); it applies to batches
    of one token per row. ``kv_capacity`` pads ``kv_indices`` to a fixed length.
    """
    rows = batch.num_reqs
    pad_to = batch.padded_size if padded_rows is None else padded_rows
    pad_to = rows if pad_to is None else pad_to
    if pad_to < rows:
        raise HostInputError(
            f"padded_rows={pad_to} is below the batch's {rows} rows; pad up, never down"
        )
    if pad_to > rows and any(r.num_tokens != 1 for r in batch.requests):
        raise HostInputError(
            "padding applies to batches of one token per row (decode); pass padded_rows="
            f"{rows} or None for batch {batch.step}"
        )
    ps = batch.page_size
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    token_request: list[int] = []
    indptr = [0]
    indices: list[int] = []
    contexts: list[int] = []
    last: list[int] = []
    for row, req in enumerate(batch.requests):
        table = list(req.block_table)
        need = -(-req.context_len // ps)
        if len(table) < need:
            raise HostInputError(
                f"request {req.req_id} (row {row}) has {len(table)} pages for "
                f"context_len={req.context_len} with page size {ps}; it needs {need}"
            )
        if req.prev_sample_row >= 0:
            if prev_sampled is None or not 0 <= req.prev_sample_row < len(prev_sampled):
                raise HostInputError(
                    f"request {req.req_id} (row {row}) defers to previous row "
                    f"{req.prev_sample_row}, which prev_sampled does not have; pass the "
                    "previous step's sampled ids"
                )
            span = [int(prev_sampled[req.prev_sample_row])] * req.num_tokens
        else:
            span = [int(t) for t in req.token_ids]
            if len(span) != req.num_tokens:
                raise HostInputError(
                    f"request {req.req_id} (row {row}) stages {len(span)} token ids for "
                    f"{req.num_tokens} tokens"
                )
        for j, pos in enumerate(range(req.first_position, req.context_len)):
            ids.append(span[j])
            positions.append(pos)
            slots.append(table[pos // ps] * ps + pos % ps)
            token_request.append(row)
        last.append(len(ids) - 1)
        indices.extend(table[:need])
        indptr.append(len(indices))
        contexts.append(req.context_len)
    real_ids = tuple(ids)
    for row in range(rows, pad_to):
        ids.append(0)
        positions.append(0)
        slots.append(-1)
        token_request.append(row)
        last.append(len(ids) - 1)
        indptr.append(len(indices))
        contexts.append(0)
    capacity = max(len(indices), 1) if kv_capacity is None else kv_capacity
    if capacity < len(indices) or capacity < 1:
        raise HostInputError(
            f"kv_capacity={kv_capacity} cannot hold the batch's {len(indices)} page ids"
        )
    indices.extend([0] * (capacity - len(indices)))

    def t(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    inputs = DecoderInputs(
        input_ids=t(ids, torch.int32),
        positions=t(positions, torch.int64),
        slot_mapping=t(slots, torch.int64),
        token_request=t(token_request, torch.int32),
        kv_indptr=t(indptr, torch.int32),
        kv_indices=t(indices, torch.int32),
        context_lens=t(contexts, torch.int32),
    )
    return HostStep(inputs=inputs, logits_indices=t(last, torch.int64), input_ids=real_ids)
