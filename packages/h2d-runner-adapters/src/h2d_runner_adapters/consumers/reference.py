"""Plain-torch references of the consumer kernels, for tests (CPU, loops, no Triton).

Each takes the kernel's inputs (any device; values are read on the host) and
returns new CPU tensors holding what the kernel must leave in its outputs,
starting from the outputs' current contents.
"""

from __future__ import annotations

import torch

from h2d_runner_adapters.sampling.sampler import GREEDY_TEMPERATURE


def assemble_token_ids_reference(
    input_ids: torch.Tensor,
    decode_cu: torch.Tensor,
    decode_src: torch.Tensor,
    prev_sampled: torch.Tensor,
    num_reqs: int,
) -> torch.Tensor:
    ids = input_ids.cpu().clone()
    cu = decode_cu.cpu().tolist()
    src = decode_src.cpu().tolist()
    prev = prev_sampled.cpu()
    rows, width = prev.shape
    for r in range(num_reqs):
        if not 0 <= src[r] < rows:
            continue
        for j, t in enumerate(range(cu[r], cu[r + 1])):
            if j < width and 0 <= t < ids.numel():
                ids[t] = prev[src[r], j]
    return ids


def gather_draft_ids_reference(
    input_ids: torch.Tensor, target_logits_indices: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    ids = input_ids.cpu()
    result = out.cpu().clone()
    for i, index in enumerate(target_logits_indices.cpu().tolist()):
        if 0 <= index < ids.numel() - 1:
            result[i] = ids[1 + index]
    return result


def generate_kv_indices_reference(
    block_tables: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, num_rows: int
) -> torch.Tensor:
    tables = block_tables.cpu()
    indptr = kv_indptr.cpu().tolist()
    result = kv_indices.cpu().clone()
    for r in range(num_rows):
        pages = min(indptr[r + 1] - indptr[r], tables.shape[1])
        for c in range(max(pages, 0)):
            if 0 <= indptr[r] + c < result.numel():
                result[indptr[r] + c] = tables[r, c]
    return result


def prepare_prefill_attention_reference(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_tables: torch.Tensor,
    page_size: int,
    num_reqs: int,
    token_request: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(token_request, kv_indptr, kv_indices)`` after preparation."""
    cu_q = cu_seqlens_q.cpu().tolist()
    cu_k = cu_seqlens_k.cpu().tolist()
    owners = torch.full((token_request.numel(),), -1, dtype=torch.int32)
    for r in range(num_reqs):
        owners[cu_q[r] : cu_q[r + 1]] = r
    indptr = kv_indptr.cpu().clone()
    indptr[0] = 0
    for r in range(num_reqs):
        length = max(cu_k[r + 1] - cu_k[r], 0)
        indptr[r + 1] = indptr[r] + (length + page_size - 1) // page_size
    indices = generate_kv_indices_reference(block_tables, indptr, kv_indices, num_reqs)
    return owners, indptr, indices


def sample_tokens_reference(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_k: int | torch.Tensor | None,
    top_p: float | torch.Tensor | None,
    noise: torch.Tensor,
) -> torch.Tensor:
    """One row at a time, following :mod:`~h2d_runner_adapters.sampling.filters` and
    :mod:`~h2d_runner_adapters.sampling.sampler` literally."""
    logits = logits.cpu()
    noise = noise.cpu()
    bs, vocab = logits.shape
    temps = temperatures.cpu()[:bs]
    ks = top_k.cpu().tolist() if isinstance(top_k, torch.Tensor) else [top_k] * bs
    ps = top_p.cpu().tolist() if isinstance(top_p, torch.Tensor) else [top_p] * bs
    out = torch.empty(bs, dtype=torch.int32)
    greedy_limit = torch.tensor(GREEDY_TEMPERATURE, dtype=torch.float32)
    for r in range(bs):
        row, t = logits[r], temps[r]
        if t <= greedy_limit:
            out[r] = int(torch.argmax(row))
            continue
        candidates = torch.sort(row, descending=True).values
        cutoff = torch.tensor(float("-inf"))
        k, p = ks[r], ps[r]
        if k is not None and 1 <= k < vocab:
            candidates = candidates[:k]
            cutoff = candidates[-1]
        if p is not None and p < 1.0:
            probs = torch.softmax(candidates / t, dim=0)
            mass_before = probs.cumsum(dim=0) - probs
            kept = max(int((mass_before < torch.tensor(p, dtype=torch.float32)).sum()), 1)
            cutoff = candidates[kept - 1]
        score = torch.where(row >= cutoff, row / t + noise[r], float("-inf"))
        out[r] = int(torch.argmax(score))
    return out
