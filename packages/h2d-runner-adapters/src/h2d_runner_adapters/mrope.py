"""MRoPE positions: three planes (time, height, width) that replace ordinary positions.

Member layout (one int64 buffer of ``3 * max_tokens`` elements, counted in elements): for
a step of running width ``n`` tokens (graph padding included), plane ``a`` is the flat
range ``[a * n, (a + 1) * n)`` and ``3 * n`` elements are published. Consumers view the
published prefix as ``(3, n)`` with axis stride ``n`` (:func:`mrope_planes`). The spec's
rule: the planes are written at the running width as their axis stride before their first
publication, for every backend, so a reader that views the planes at the width the step
ran (a graph bound at its padded width, an eager step at its token count) never reads
another step's stride. Padding tokens hold 0 on every plane.

Decode: every plane of request ``i``'s tokens holds ``position + delta_i`` (the request's
MRoPE position delta; text after an image continues from the image's largest position).
Prefill: a request's planes come from its precomputed ``[3, L]`` prompt positions (the
chunk's columns ``[ctx - q, ctx)``), or its ordinary positions on every plane when it has
none.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from h2d_core import CountError, H2DBuffer, H2DRunnerState

MROPE_AXES = 3


def declare_mrope(state: H2DRunnerState, name: str, max_tokens: int, group: str) -> H2DBuffer:
    """The flat ``[3 * max_tokens]`` int64 planes buffer of ``group``."""
    return state.buffer(name, (MROPE_AXES * max_tokens,), torch.int64, group=group)


def mrope_planes(buffer: H2DBuffer, width: int) -> torch.Tensor:
    """The published planes as a ``(3, width)`` view (axis stride ``width``)."""
    return buffer.gpu[: MROPE_AXES * width].view(MROPE_AXES, width)


def check_deltas(group: str, deltas: object, n: int) -> np.ndarray:
    """``deltas`` as an int64 ``[n]`` array; raises :class:`CountError` otherwise."""
    if not isinstance(deltas, np.ndarray) or deltas.ndim != 1 or deltas.size != n \
            or deltas.dtype.kind not in "iu":
        what = (f"{type(deltas).__name__}" if not isinstance(deltas, np.ndarray)
                else f"a {deltas.dtype} array of shape {deltas.shape}")
        raise CountError(
            f"{group}: mrope_deltas must be an integer numpy array with one delta per "
            f"request ({n}), got {what}; pass zeros for text-only requests")
    return deltas.astype(np.int64, copy=False)


def write_decode_planes(flat: np.ndarray, positions: np.ndarray, query_lens: np.ndarray,
                        deltas: np.ndarray, num_tokens: int, width: int) -> None:
    """Planes at stride ``width`` from the step's written ``positions``: ``position +
    delta`` of the owning request for the first ``num_tokens`` tokens, 0 after them."""
    plane = flat[:width]
    np.add(positions[:num_tokens], np.repeat(deltas, query_lens), out=plane[:num_tokens])
    plane[num_tokens:] = 0
    flat[width : 2 * width] = plane
    flat[2 * width : 3 * width] = plane


def check_prompt_positions(group: str, sources: object, context_lens: np.ndarray
                           ) -> list[np.ndarray | None]:
    """Per request: ``None`` or an integer ``[3, >= ctx]`` array; raises
    :class:`CountError` naming the request otherwise."""
    n = context_lens.size
    if not isinstance(sources, Sequence) or len(sources) != n:
        raise CountError(
            f"{group}: mrope_positions must be a sequence with one entry per request ({n}): "
            "a [3, L] integer array of the prompt's positions, or None for text-only")
    out: list[np.ndarray | None] = []
    for i, (src, ctx) in enumerate(zip(sources, context_lens.tolist(), strict=True)):
        if src is None:
            out.append(None)
            continue
        if not isinstance(src, np.ndarray) or src.dtype.kind not in "iu" or src.ndim != 2 \
                or src.shape[0] != MROPE_AXES or src.shape[1] < ctx:
            shape = getattr(src, "shape", None)
            raise CountError(
                f"{group}: mrope_positions of request {i} must be an integer array of shape "
                f"(3, L) with L >= its context length {ctx}, got {type(src).__name__} "
                f"{shape}")
        out.append(src)
    return out


def write_prefill_planes(flat: np.ndarray, positions: np.ndarray, query_lens: np.ndarray,
                         context_lens: np.ndarray, sources: list[np.ndarray | None],
                         width: int) -> None:
    """Planes at stride ``width`` (the chunk's token count): each request's chunk columns
    of its prompt positions, or its ordinary positions on every plane."""
    start = 0
    for q, ctx, src in zip(query_lens.tolist(), context_lens.tolist(), sources, strict=True):
        for a in range(MROPE_AXES):
            dst = flat[a * width + start : a * width + start + q]
            dst[:] = positions[start : start + q] if src is None else src[a, ctx - q : ctx]
        start += q
