"""The sampler: temperature, filters, Gumbel-max sampling and greedy correction on the GPU.

``sample_tokens(logits, temperatures, top_k=..., top_p=..., noise=..., out=...)``
picks one token per row of ``logits`` (float32 ``[bs, V]``):

* Greedy rows: ``out[r] = argmax(logits[r])`` exactly (first index on ties). A
  row is greedy when ``temperatures[r] <= GREEDY_TEMPERATURE``: the host clamps
  temperatures to ``>= GREEDY_TEMPERATURE`` (1e-10) and stores that clamp value
  for greedy requests, so no separate mask is uploaded. Filters and noise do not
  affect greedy rows.
* Other rows: ``out[r] = argmax over kept v of (logits[r, v] / T[r] + noise[r, v])``
  with ``noise`` standard Gumbel noise (see :func:`fill_gumbel_noise_`): the
  Gumbel-max form of sampling from ``softmax(logits / T)`` restricted to the tokens
  top-k / top-p keep (:mod:`.filters` defines them). The division is
  IEEE-rounded, as torch's, so results match a torch reference bit for bit.

``top_k`` / ``top_p``: ``None`` (off), a Python scalar applied to every row (never
uploaded: the uniform case of the ``token_inputs`` policy), or a per-request GPU
tensor (int32 / float32, ``-1`` / ``1.0`` = off for that row).

The greedy correction happens inside the kernel (a per-row select), so no mask is
ever read back: the whole call has no ``.item()``, no D2H copy and no host sync.
One Triton launch does temperature, cutoff, noise, argmax and greedy select per
row; the filters, when active, are torch ops before it. Logits must not be NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2d_runner_adapters.consumers._launch import (
    bucket,
    cdiv,
    check_devices,
    check_tensor,
)
from h2d_runner_adapters.consumers.errors import ConsumerArgumentError
from h2d_runner_adapters.sampling.filters import (
    logit_cutoffs,
    normalize_top_k,
    normalize_top_p,
)

GREEDY_TEMPERATURE = 1e-10
"""The host's temperature clamp; a row at (or below) it is greedy."""

BLOCK_VOCAB = 2048
"""Vocabulary entries one loop step of a row's program scans."""


@triton.jit(do_not_specialize=["num_rows", "vocab"])
def _sample_kernel(  # type: ignore[no-untyped-def]
    logits_ptr,  # *f32 [num_rows, vocab], unit column stride
    logits_stride,
    noise_ptr,  # *f32 [num_rows, vocab], unit column stride
    noise_stride,
    temperatures_ptr,  # *f32 [>= num_rows]
    cutoffs_ptr,  # *f32 [num_rows] (read only when FILTERED)
    out_ptr,  # *i32 [>= num_rows]
    num_rows,
    vocab,
    greedy_temperature,  # f32
    BLOCK_V: tl.constexpr,
    NUM_BLOCKS: tl.constexpr,  # cdiv(vocab, BLOCK_V): fixed per model vocabulary
    FILTERED: tl.constexpr,
):
    row = tl.program_id(0)
    live = row < num_rows
    temperature = tl.load(temperatures_ptr + row, mask=live, other=1.0)
    # A live row above the greedy clamp samples; every other live row is greedy.
    sampling = live & (temperature > greedy_temperature)
    if FILTERED:
        cutoff = tl.load(cutoffs_ptr + row, mask=live, other=float("-inf"))
    logits_row = logits_ptr + row.to(tl.int64) * logits_stride
    noise_row = noise_ptr + row.to(tl.int64) * noise_stride

    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32)
    for block in range(NUM_BLOCKS):
        cols = block * BLOCK_V + tl.arange(0, BLOCK_V)
        in_row = live & (cols < vocab)
        logit = tl.load(logits_row + cols, mask=in_row, other=float("-inf"))
        # Greedy rows never read their noise.
        gumbel = tl.load(noise_row + cols, mask=in_row & sampling, other=0.0)
        sampled = tl.math.div_rn(logit, temperature) + gumbel
        if FILTERED:
            sampled = tl.where(logit >= cutoff, sampled, float("-inf"))
        score = tl.where(sampling, sampled, logit)
        score = tl.where(in_row, score, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_index = tl.argmax(score, axis=0, tie_break_left=True)
        # Strictly greater: an earlier block keeps ties, as torch.argmax does.
        better = block_best > best
        best_index = tl.where(better, block * BLOCK_V + block_index, best_index)
        best = tl.where(better, block_best, best)
    tl.store(out_ptr + row, best_index, mask=live)


def fill_gumbel_noise_(
    noise: torch.Tensor, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Fill float32 ``noise`` in place with standard Gumbel samples ``-log(E)``, ``E ~ Exp(1)``.

    Draw it from a seeded ``generator`` on the logits' device for reproducible
    runs. In-place ops only: no allocation, no host sync.
    """
    if noise.dtype != torch.float32:
        raise ConsumerArgumentError(
            f"fill_gumbel_noise_: noise must have dtype torch.float32, got {noise.dtype}"
        )
    # An exponential draw of exactly 0 would give +inf noise; the clamp keeps it finite.
    noise.exponential_(generator=generator)
    noise.clamp_min_(torch.finfo(torch.float32).tiny)
    return noise.log_().neg_()


def sample_tokens(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    *,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    noise: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sample one token per row of ``logits``; return ``out[:bs]`` (int32).

    ``temperatures`` float32 ``[>= bs]``; ``noise`` float32 ``[>= bs, V]`` Gumbel
    noise; ``out`` int32 ``[>= bs]`` (allocated when ``None``; past ``bs`` it is
    untouched). See the module docstring for the semantics.
    """
    func = "sample_tokens"
    check_tensor(func, "logits", logits, dtype=torch.float32, ndim=2)
    bs, vocab = logits.shape
    if vocab == 0:
        raise ConsumerArgumentError(f"{func}: logits has an empty vocabulary (shape {(bs, 0)})")
    check_tensor(func, "temperatures", temperatures, dtype=torch.float32, ndim=1, min_numel=bs)
    check_tensor(func, "noise", noise, dtype=torch.float32, ndim=2, min_numel=bs)
    if noise.shape[1] != vocab:
        raise ConsumerArgumentError(
            f"{func}: noise has {noise.shape[1]} columns but logits have {vocab}; draw one "
            "noise value per vocabulary entry"
        )
    if out is not None:
        check_tensor(func, "out", out, dtype=torch.int32, ndim=1, min_numel=bs)
    device = check_devices(
        func, _sample_kernel, logits=logits, temperatures=temperatures, noise=noise,
        **({} if out is None else {"out": out}),
    )
    k = normalize_top_k(func, top_k, vocab, bs, device)
    p = normalize_top_p(func, top_p, bs, device)

    if out is None:
        out = torch.empty(bs, dtype=torch.int32, device=device)
    temps = temperatures[:bs]
    cutoffs = logit_cutoffs(logits, temps, k, p)
    _sample_kernel[(bucket(bs),)](
        logits,
        logits.stride(0),
        noise,
        noise.stride(0),
        temperatures,
        logits if cutoffs is None else cutoffs,
        out,
        bs,
        vocab,
        GREEDY_TEMPERATURE,
        BLOCK_V=BLOCK_VOCAB,
        NUM_BLOCKS=cdiv(vocab, BLOCK_VOCAB),
        FILTERED=cutoffs is not None,
    )
    return out[:bs]
