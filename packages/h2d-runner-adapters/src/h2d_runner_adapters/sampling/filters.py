"""Top-k / top-p filtering as one logit cutoff per row (torch ops, no host reads).

A row keeps the tokens whose logit is ``>= cutoff[row]``; ``-inf`` keeps all.
Expressing both filters as one value threshold lets the sampler kernel apply
them while it scans the row, with no filtered copy of the logits.

Definitions (row ``r`` with temperature ``T``, logits sorted descending as ``s``):

* top-k (``k`` enabled when ``1 <= k < V``; per request, ``-1`` or any other
  value outside that range disables it): cutoff ``s[k-1]``.
* top-p (``p`` enabled when ``p < 1``): over the tokens top-k kept (``s[:k]``,
  or all of ``s``), with ``q = softmax(s / T)`` in float32, token ``i`` is kept
  while the mass before it, ``cumsum(q)[i] - q[i]``, is ``< p``; at least one
  token is kept (``p <= 0`` keeps only the most likely). Cutoff: the smallest
  kept ``s[i]``.
* Ties at the cutoff value are all kept (the cutoff is a value, not a count).

Specialisation: a uniform ``top_k`` is a Python int, so ``torch.topk`` with that
``k`` replaces the full sort and top-p then works on ``k`` columns; a uniform
``top_p`` is a Python float. Per-request filters (int32 / float32 tensors, -1 /
1.0 = disabled) take a full descending sort. These ops allocate temporaries
from torch's caching allocator; nothing is read back to the host.
"""

from __future__ import annotations

import torch

from h2d_runner_adapters.consumers.errors import ConsumerArgumentError

TopK = int | torch.Tensor | None
TopP = float | torch.Tensor | None


def _top_p_cutoff(
    sorted_desc: torch.Tensor, temperatures: torch.Tensor, top_p: float | torch.Tensor
) -> torch.Tensor:
    # sorted_desc: [bs, n] descending, -inf where top-k already dropped a token.
    probs = torch.softmax(sorted_desc / temperatures[:, None], dim=1)
    mass_before = probs.cumsum(dim=1) - probs
    limit = top_p[:, None] if isinstance(top_p, torch.Tensor) else top_p
    keep = mass_before < limit
    count = keep.sum(dim=1, keepdim=True).clamp_min_(1)
    return sorted_desc.gather(1, count - 1).squeeze(1)


def _per_request(func: str, name: str, value: torch.Tensor, dtype: torch.dtype, bs: int,
                 device: torch.device) -> torch.Tensor:
    """A per-request filter tensor's ``[bs]`` view: 1-D ``dtype``, at least ``bs``
    elements, on the logits' ``device``; else refused naming ``func`` and ``name``."""
    if value.dtype != dtype or value.dim() != 1 or value.shape[0] < bs:
        kind = str(dtype).removeprefix("torch.")
        raise ConsumerArgumentError(
            f"{func}: a per-request {name} must be a 1-D {kind} tensor with >= {bs} "
            f"elements, got dtype {value.dtype} shape {tuple(value.shape)}")
    if value.device != device:
        raise ConsumerArgumentError(
            f"{func}: {name} is on {value.device} but logits are on {device}")
    return value[:bs]


def normalize_top_k(func: str, top_k: object, vocab: int, bs: int, device: torch.device) -> TopK:
    """``None`` when the filter is off for every row, else the int or the ``[bs]`` tensor view."""
    if top_k is None:
        return None
    if isinstance(top_k, torch.Tensor):
        return _per_request(func, "top_k", top_k, torch.int32, bs, device)
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise ConsumerArgumentError(
            f"{func}: top_k must be None, a Python int or an int32 tensor, got "
            f"{type(top_k).__name__}"
        )
    if top_k < 1:
        raise ConsumerArgumentError(
            f"{func}: a uniform top_k must be >= 1, got {top_k}; pass None to disable it"
        )
    return None if top_k >= vocab else top_k


def normalize_top_p(func: str, top_p: object, bs: int, device: torch.device) -> TopP:
    """``None`` when the filter is off for every row, else the float or the ``[bs]`` tensor view."""
    if top_p is None:
        return None
    if isinstance(top_p, torch.Tensor):
        return _per_request(func, "top_p", top_p, torch.float32, bs, device)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
        raise ConsumerArgumentError(
            f"{func}: top_p must be None, a Python float or a float32 tensor, got "
            f"{type(top_p).__name__}"
        )
    if not 0.0 < top_p <= 1.0:
        raise ConsumerArgumentError(
            f"{func}: a uniform top_p must lie in (0, 1], got {top_p}; pass None to disable it"
        )
    return None if top_p >= 1.0 else float(top_p)


def logit_cutoffs(
    logits: torch.Tensor, temperatures: torch.Tensor, top_k: TopK, top_p: TopP
) -> torch.Tensor | None:
    """Per-row logit cutoffs (float32 ``[bs]``), or ``None`` when no filter is active.

    ``top_k`` / ``top_p`` are already normalized (see :func:`normalize_top_k`):
    ``None``, a uniform Python scalar, or a per-request ``[bs]`` tensor.
    """
    if top_k is None and top_p is None:
        return None
    vocab = logits.shape[1]
    k_cutoff: torch.Tensor | None = None
    if isinstance(top_k, int):
        # Uniform top-k: the k largest per row, already sorted descending.
        candidates = torch.topk(logits, top_k, dim=1).values
        k_cutoff = candidates[:, -1]
    else:
        candidates = torch.sort(logits, dim=1, descending=True).values
        if top_k is not None:
            k_on = (top_k >= 1) & (top_k < vocab)
            kth = candidates.gather(1, (top_k.clamp(1, vocab) - 1).long()[:, None]).squeeze(1)
            k_cutoff = torch.where(k_on, kth, float("-inf"))
            if top_p is not None:
                rank = torch.arange(vocab, device=logits.device)
                dropped = (rank[None, :] >= top_k[:, None]) & k_on[:, None]
                candidates = candidates.masked_fill(dropped, float("-inf"))
    if top_p is None:
        assert k_cutoff is not None
        return k_cutoff.contiguous()
    p_cutoff = _top_p_cutoff(candidates, temperatures, top_p)
    if isinstance(top_p, torch.Tensor):
        p_cutoff = torch.where(top_p < 1.0, p_cutoff, float("-inf"))
    # Top-p picks among top-k's survivors, so its cutoff is never below top-k's;
    # the maximum only matters for rows whose top-p is disabled.
    return p_cutoff if k_cutoff is None else torch.maximum(p_cutoff, k_cutoff)
