"""DeepSeek-V4/V4.1 prefill indptrs: each chunk token's KV prefixes (extend, sliding
window, compressed, heavily compressed) and the indexer's committed prefix, the first
consumer of a prefill step's ``v41_metadata``: kernel, launcher and plain-Python oracle."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from h2d_runner_adapters.consumers._launch import (
    check_count,
    check_devices,
    check_tensor,
    next_power_of_two,
)
from h2d_runner_adapters.consumers.errors import ConsumerArgumentError


class PrefillIndptrs(NamedTuple):
    """The outputs of :func:`generate_v4_prefill_indptrs` (int32 device tensors)."""

    extend_indptr: torch.Tensor
    prefix_swa_indptr: torch.Tensor
    prefix_csa_indptr: torch.Tensor
    prefix_hca_indptr: torch.Tensor
    indexer_cu_committed: torch.Tensor
    #: per local query: ``cu_committed[b]``, ``min((p+1)//4, ctx_b//4)`` and their sum
    #: (the indexer's gather and logits ranges; 0 for dummy queries)
    indexer_seq_base: torch.Tensor
    indexer_visible_end: torch.Tensor
    indexer_cu_ends: torch.Tensor


@triton.jit(do_not_specialize=["num_tokens", "num_reqs", "window", "topk", "rank", "ranks"])
def _prefill_indptrs_kernel(  # type: ignore[no-untyped-def]
    positions_ptr,  # *i64 [>= num_tokens]
    batch_ids_ptr,  # *i32 [>= num_tokens]
    seq_lens_ptr,  # *i32 [>= num_reqs]
    chunk_starts_ptr,  # *i32 [>= num_reqs]
    ext_ptr,  # *i32 [>= num_tokens + 1]
    swa_ptr,
    csa_ptr,
    hca_ptr,
    cu_committed_ptr,  # *i32 [>= num_reqs + 1]
    seq_base_ptr,  # *i32 [>= local tokens]
    visible_ptr,
    cu_ends_ptr,
    num_tokens,
    num_reqs,
    window,
    topk,
    rank,
    ranks,
    TOKENS: tl.constexpr,
    REQS: tl.constexpr,
):
    # local query t is global token rank + t * ranks (context parallel striping); past
    # the step's tokens it is a dummy query that owns nothing
    t = tl.arange(0, TOKENS)
    local = (num_tokens + ranks - 1 - rank) // ranks
    live = t < local
    g = rank + t * ranks
    b = tl.load(batch_ids_ptr + g, mask=live, other=-1)
    real = live & (b >= 0) & (b < num_reqs)
    p = tl.load(positions_ptr + g, mask=real, other=0).to(tl.int32)
    ctx = tl.load(seq_lens_ptr + b, mask=real, other=0)
    start = tl.load(chunk_starts_ptr + b, mask=real, other=0)
    swa_low = tl.maximum(p - window + 1, 0)
    ext = tl.where(real, tl.minimum(p - start + 1, window), 0)
    prefix = tl.where(real, tl.maximum(start - swa_low, 0), 0)
    csa = prefix + tl.where(real, tl.minimum(tl.minimum((p + 1) // 4, ctx // 4), topk), 0)
    hca = prefix + tl.where(real, tl.minimum((p + 1) // 128, ctx // 128), 0)
    head = t < 1
    zero = tl.zeros([TOKENS], dtype=tl.int32)
    tl.store(ext_ptr + t + 1, tl.cumsum(ext, axis=0), mask=live)
    tl.store(swa_ptr + t + 1, tl.cumsum(prefix, axis=0), mask=live)
    tl.store(csa_ptr + t + 1, tl.cumsum(csa, axis=0), mask=live)
    tl.store(hca_ptr + t + 1, tl.cumsum(hca, axis=0), mask=live)
    tl.store(ext_ptr + t, zero, mask=head)
    tl.store(swa_ptr + t, zero, mask=head)
    tl.store(csa_ptr + t, zero, mask=head)
    tl.store(hca_ptr + t, zero, mask=head)
    # the indexer's committed prefix over requests, its last entry raised to >= 1 (a
    # zero-row launch is avoided; the extra row is never read)
    r = tl.arange(0, REQS)
    rlive = r < num_reqs
    rctx = tl.load(seq_lens_ptr + r, mask=rlive, other=0)
    cu = tl.cumsum(tl.where(rlive, rctx // 4, 0), axis=0)
    cu = tl.where(r == num_reqs - 1, tl.maximum(cu, 1), cu)
    tl.store(cu_committed_ptr + r + 1, cu, mask=rlive)
    tl.store(cu_committed_ptr + r, tl.zeros([REQS], dtype=tl.int32), mask=r < 1)
    tl.debug_barrier()  # the prefix above is read back per query below
    base = tl.load(cu_committed_ptr + b, mask=real, other=0)
    visible = tl.where(real, tl.minimum((p + 1) // 4, ctx // 4), 0)
    tl.store(seq_base_ptr + t, base, mask=live)
    tl.store(visible_ptr + t, visible, mask=live)
    tl.store(cu_ends_ptr + t, base + visible, mask=live)


def generate_v4_prefill_indptrs(
    positions: torch.Tensor,
    batch_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    chunk_starts: torch.Tensor,
    out: PrefillIndptrs,
    *,
    num_tokens: int,
    num_reqs: int,
    window: int,
    index_topk: int,
    pcp_rank: int = 0,
    pcp_size: int = 1,
) -> PrefillIndptrs:
    """V4 prefill's per-token KV prefixes and the indexer's committed prefix, on the GPU
    (what an engine computes on the host and uploads from pageable arrays today).

    For a token at position ``p`` of request ``b`` (chunk start ``s = chunk_starts[b]``,
    committed length ``ctx = seq_lens[b]``): ``swa_low = max(p - W + 1, 0)``,
    ``extend = min(p - s + 1, W)``, ``prefix_swa = max(s - swa_low, 0)``,
    ``csa = min((p + 1) // 4, ctx // 4, Kt)``, ``hca = min((p + 1) // 128, ctx // 128)``
    (causal per token). The four ``[T + 1]`` indptrs are the exclusive prefixes of
    ``extend``, ``prefix_swa``, ``prefix_swa + csa`` and ``prefix_swa + hca``;
    ``indexer_cu_committed`` ``[n + 1]`` is ``[0, cumsum(ctx // 4)]`` with its last entry
    raised to at least 1, and per query the indexer's ``seq_base = cu_committed[b]``,
    ``visible_end = min((p + 1) // 4, ctx // 4)`` and ``cu_ends = seq_base + visible_end``.
    Tokens with batch id -1 count 0. One launch, no sync.

    Prefill context parallelism (``pcp_size`` ranks): the published metadata stays the
    whole step's (every rank writes every token's KV); this rank's queries are the global
    tokens ``pcp_rank + i * pcp_size``, so the indptrs cover ``ceil((T - rank) / size)``
    local queries, gathered here by stride: no reindexed upload, no ``.item()``.
    """
    func = "generate_v4_prefill_indptrs"
    t = check_count(func, "num_tokens", num_tokens)
    n = check_count(func, "num_reqs", num_reqs)
    window = check_count(func, "window", window)
    topk = check_count(func, "index_topk", index_topk)
    if window < 1:
        raise ConsumerArgumentError(f"{func}: window must be >= 1, got {window}")
    rank = check_count(func, "pcp_rank", pcp_rank)
    size = check_count(func, "pcp_size", pcp_size)
    if not rank < size:
        raise ConsumerArgumentError(
            f"{func}: pcp_rank={rank} must lie in [0, pcp_size={size})")
    check_tensor(func, "positions", positions, dtype=torch.int64, ndim=1, min_numel=t)
    check_tensor(func, "batch_ids", batch_ids, dtype=torch.int32, ndim=1, min_numel=t)
    check_tensor(func, "seq_lens", seq_lens, dtype=torch.int32, ndim=1, min_numel=n)
    check_tensor(func, "chunk_starts", chunk_starts, dtype=torch.int32, ndim=1, min_numel=n)
    local = (t + size - 1 - rank) // size
    for name in ("extend_indptr", "prefix_swa_indptr", "prefix_csa_indptr",
                 "prefix_hca_indptr"):
        check_tensor(func, name, getattr(out, name), dtype=torch.int32, ndim=1,
                     min_numel=local + 1)
    check_tensor(func, "indexer_cu_committed", out.indexer_cu_committed, dtype=torch.int32,
                 ndim=1, min_numel=n + 1)
    for name in ("indexer_seq_base", "indexer_visible_end", "indexer_cu_ends"):
        check_tensor(func, name, getattr(out, name), dtype=torch.int32, ndim=1,
                     min_numel=local)
    check_devices(func, _prefill_indptrs_kernel, positions=positions, batch_ids=batch_ids,
                  seq_lens=seq_lens, chunk_starts=chunk_starts,
                  extend_indptr=out.extend_indptr, prefix_swa_indptr=out.prefix_swa_indptr,
                  prefix_csa_indptr=out.prefix_csa_indptr,
                  prefix_hca_indptr=out.prefix_hca_indptr,
                  indexer_cu_committed=out.indexer_cu_committed)
    _prefill_indptrs_kernel[(1,)](
        positions, batch_ids, seq_lens, chunk_starts, out.extend_indptr,
        out.prefix_swa_indptr, out.prefix_csa_indptr, out.prefix_hca_indptr,
        out.indexer_cu_committed, out.indexer_seq_base, out.indexer_visible_end,
        out.indexer_cu_ends, t, n, window, topk, rank, size,
        TOKENS=max(next_power_of_two(local), 16), REQS=max(next_power_of_two(n), 16),
    )
    return out


def generate_v4_prefill_indptrs_reference(
    positions: list[int],
    batch_ids: list[int],
    seq_lens: list[int],
    chunk_starts: list[int],
    *,
    window: int,
    index_topk: int,
) -> dict[str, list[int]]:
    """Plain-Python oracle, written from the formulas of the context document (§2, §3.2)."""
    names = ("extend_indptr", "prefix_swa_indptr", "prefix_csa_indptr", "prefix_hca_indptr")
    out = {name: [0] for name in names}
    for p, b in zip(positions, batch_ids, strict=True):
        if b < 0:
            segs = (0, 0, 0, 0)
        else:
            ctx, s = seq_lens[b], chunk_starts[b]
            low = max(p - window + 1, 0)
            prefix = max(s - low, 0)
            segs = (min(p - s + 1, window), prefix,
                    prefix + min((p + 1) // 4, ctx // 4, index_topk),
                    prefix + min((p + 1) // 128, ctx // 128))
        for name, seg in zip(names, segs, strict=True):
            out[name].append(out[name][-1] + seg)
    cu = [0]
    for ctx in seq_lens:
        cu.append(cu[-1] + ctx // 4)
    if len(cu) > 1:
        cu[-1] = max(cu[-1], 1)
    out["indexer_cu_committed"] = cu
    base = [cu[b] if b >= 0 else 0 for b in batch_ids]
    visible = [min((p + 1) // 4, seq_lens[b] // 4) if b >= 0 else 0
               for p, b in zip(positions, batch_ids, strict=True)]
    out["indexer_seq_base"] = base
    out["indexer_visible_end"] = visible
    out["indexer_cu_ends"] = [x + y for x, y in zip(base, visible, strict=True)]
    return out
