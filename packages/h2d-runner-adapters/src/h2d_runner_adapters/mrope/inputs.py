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
MRoPE position delta; text after an image continues from the image's largest position),
written by the decode step's layout pass: the family registers its deltas column and a
:class:`h2d_core.TokenPlanes` output with the layout (:func:`layout_columns`,
:func:`layout_outputs`).
Prefill: a request's planes come from its precomputed ``[3, L]`` prompt positions (the
chunk's columns ``[ctx - q, ctx)``), or its ordinary positions on every plane when it has
none.

Inputs are checked before any write, in their own dtype (never wrapped or truncated):
``mrope_deltas`` are integers in int32 range, prompt positions integers in
``[0, 2**31)`` (:func:`check_deltas`, :func:`check_prompt_positions`, raising
:class:`~h2d_runner_adapters.checks.AdapterInputError`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from h2d_core import H2DBuffer, H2DRunnerState, LayoutColumn, TokenPlanes, describe_value

from ..checks import INT32_MAX, INT32_MIN, AdapterInputError, int_array

MROPE_AXES = 3
_INT32 = np.dtype(np.int32)


def declare_mrope(state: H2DRunnerState, name: str, max_tokens: int, group: str) -> H2DBuffer:
    """The flat ``[3 * max_tokens]`` int64 planes buffer of ``group``."""
    return state.buffer(name, (MROPE_AXES * max_tokens,), torch.int64, group=group)


#: the request column the decode step's values carry MRoPE's position deltas in
DELTAS_COLUMN = "mrope_deltas"


def layout_columns() -> list[LayoutColumn]:
    """The request column MRoPE adds to a decode layout: each request's position delta
    (checked by :func:`check_deltas` before it reaches the layout)."""
    return [LayoutColumn(DELTAS_COLUMN)]


def layout_outputs(buffer: H2DBuffer, slot: int) -> list[TokenPlanes]:
    """MRoPE's output registered with ``slot``'s decode layout: the three planes of
    ``buffer``'s source, each token's position plus its request's delta."""
    return [TokenPlanes(buffer.name, buffer.source(slot).numpy(), DELTAS_COLUMN,
                        planes=MROPE_AXES)]


def mrope_planes(buffer: H2DBuffer, width: int) -> torch.Tensor:
    """The published planes as a ``(3, width)`` view (axis stride ``width``)."""
    return buffer.gpu[: MROPE_AXES * width].view(MROPE_AXES, width)


def check_deltas(group: str, deltas: object, n: int) -> np.ndarray:
    """``deltas`` (``mrope_deltas``: one integer per request, in int32 range, compared in
    its own dtype) as a C-contiguous int32 ``[n]`` array (what the layout pass reads);
    raises :class:`AdapterInputError` otherwise. A delta shifts an int32 position, so
    ``position + delta`` always fits the int64 planes; a uint64 of ``2**63`` is refused,
    never wrapped."""
    if not isinstance(deltas, np.ndarray) or deltas.ndim != 1 or deltas.size != n \
            or deltas.dtype.kind not in "iu":
        raise AdapterInputError(
            f"{group}: mrope_deltas must be a 1-D integer numpy array with one delta per "
            f"request ({n}), got {describe_value(deltas)}; pass zeros for text-only requests")
    if deltas.dtype == _INT32:  # in range by its dtype: nothing to compare (no temporaries)
        return np.ascontiguousarray(deltas)
    int_array(group, "mrope_deltas", deltas, lo=INT32_MIN, hi=INT32_MAX,
              rule="an MRoPE delta is the shift of a request's int32 positions")
    return np.ascontiguousarray(deltas, dtype=np.int32)  # exact: the range fits


def check_prompt_positions(group: str, sources: object, context_lens: np.ndarray,
                           query_lens: np.ndarray | None = None,
                           deltas: np.ndarray | None = None) -> list[np.ndarray | None]:
    """Per request: ``None`` or an integer ``[3, L >= ctx]`` array (``mrope_positions``)
    whose columns the step reads hold positions in ``[0, 2**31)``, compared in the array's
    own dtype (an int64 of ``2**32`` or a uint64 of ``2**63`` is refused, never wrapped;
    floats are refused). The columns read are the chunk's ``[ctx - q, ctx)`` when
    ``query_lens`` is given, else ``[0, ctx)``. With ``deltas`` (checked int32, one per
    request) a prompt array may be shorter than the context (a recompute re-prefills the
    generated tokens too): column ``c >= L`` is then ``c + delta`` on every plane, as in
    decode, and must lie in ``[0, 2**31)`` too. Raises :class:`AdapterInputError` naming
    the request otherwise; the arrays are returned unconverted."""
    if not isinstance(context_lens, np.ndarray) or context_lens.ndim != 1 \
            or context_lens.dtype.kind not in "iu":
        raise AdapterInputError(
            f"{group}: the batch's context_lens must be a 1-D integer numpy array, got "
            f"{describe_value(context_lens)}")
    n = context_lens.size
    if query_lens is not None:
        int_array(group, "query_lens", query_lens, lo=0, size=n)
    if not isinstance(sources, Sequence) or isinstance(sources, str) or len(sources) != n:
        raise AdapterInputError(
            f"{group}: mrope_positions must be a sequence with one entry per request ({n}): "
            "a [3, L] integer array of the prompt's positions, or None for text-only")
    ctxs = context_lens.tolist()
    qs = None if query_lens is None else query_lens.tolist()
    out: list[np.ndarray | None] = []
    for i, (src, ctx) in enumerate(zip(sources, ctxs, strict=True)):
        if src is None:
            out.append(None)
            continue
        shorter = deltas is not None  # columns past the prompt come from the delta
        if not isinstance(src, np.ndarray) or src.dtype.kind not in "iu" or src.ndim != 2 \
                or src.shape[0] != MROPE_AXES or (src.shape[1] < ctx and not shorter):
            shape = getattr(src, "shape", None)
            raise AdapterInputError(
                f"{group}: mrope_positions of request {i} must be an integer array of shape "
                f"(3, L) with L >= its context length {ctx} (or pass mrope_deltas for the "
                f"columns past the prompt), got {type(src).__name__} "
                f"{shape} {getattr(src, 'dtype', '')}".rstrip())
        lo = 0 if qs is None else max(ctx - qs[i], 0)
        length = src.shape[1]
        _check_columns(group, i, src, lo, max(min(ctx, length), 0))
        if deltas is not None and ctx > max(lo, length):
            first, last = max(lo, length) + int(deltas[i]), ctx - 1 + int(deltas[i])
            if first < 0 or last > INT32_MAX:
                raise AdapterInputError(
                    f"{group}: request {i}'s columns past its prompt ({length}) would hold "
                    f"positions {first}..{last} (column + mrope_deltas={int(deltas[i])}); "
                    f"they must be in [0, {INT32_MAX}]")
        out.append(src)
    return out


def _check_columns(group: str, i: int, src: np.ndarray, lo: int, hi: int) -> None:
    """Columns ``[lo, hi)`` of request ``i``'s prompt positions lie in ``[0, 2**31)``."""
    cols = src[:, lo:hi]
    if cols.size and (int(cols.min()) < 0 or int(cols.max()) > INT32_MAX):
        a, c = (int(x[0]) for x in np.nonzero((cols < 0) | (cols > INT32_MAX)))
        raise AdapterInputError(
            f"{group}: mrope_positions of request {i} holds {int(cols[a, c])} at plane {a}, "
            f"column {lo + c}; prompt positions must be in [0, {INT32_MAX}]")


def write_prefill_planes(flat: np.ndarray, positions: np.ndarray, query_lens: np.ndarray,
                         context_lens: np.ndarray, sources: Sequence[np.ndarray | None],
                         width: int, deltas: np.ndarray | None = None) -> None:
    """Planes at stride ``width`` (the chunk's token count): each request's chunk columns
    of its prompt positions (columns past a shorter prompt: the ordinary position plus
    the request's delta), or its ordinary positions on every plane."""
    start = 0
    for i, (q, ctx, src) in enumerate(zip(query_lens.tolist(), context_lens.tolist(),
                                          sources, strict=True)):
        lo = ctx - q
        cut = lo if src is None else min(max(src.shape[1], lo), ctx)  # prompt columns end
        shift = 0 if src is None or deltas is None else int(deltas[i])
        for a in range(MROPE_AXES):
            dst = flat[a * width + start : a * width + start + q]
            if src is not None:
                dst[: cut - lo] = src[a, lo:cut]
            dst[cut - lo:] = positions[start + cut - lo : start + q] + shift
        start += q
