"""MRoPE position selection: each rotary frequency's position, from the ``[3, n]`` planes.

The first reader of MRoPE positions (what a multimodal rotary embedding does before its
cos/sin lookup). Rotary frequency ``d`` of ``half = sum(sections)`` belongs to axis
``a(d)`` (``d < s0``: 0 (time), ``d < s0 + s1``: 1 (height), else 2 (width)), so::

    out[t, d] = planes[a(d), t]        for t < num_tokens, d < half

``planes`` is the published flat prefix viewed as ``(3, n)`` with axis stride ``n``, the
running token width (graph padding included): the kernel reads the view's own stride, so a
view made at another width reads other tokens' positions. Rows of ``out`` past
``num_tokens`` and columns past ``half`` are untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2d_runner_adapters.consumers._launch import (
    bucket,
    cdiv,
    check_count,
    check_devices,
    check_tensor,
    next_power_of_two,
)
from h2d_runner_adapters.consumers.errors import ConsumerArgumentError

BLOCK_TOKENS = 16


@triton.jit(do_not_specialize=["num_tokens", "axis_stride", "out_stride"])
def _mrope_kernel(  # type: ignore[no-untyped-def]
    planes_ptr,  # *i64, axis a of token t at a * axis_stride + t
    axis_stride,
    out_ptr,  # *i64 [>= num_tokens, >= HALF] (row stride out_stride)
    out_stride,
    num_tokens,
    S0: tl.constexpr,
    S01: tl.constexpr,  # S0 + S1
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = t < num_tokens
    p0 = tl.load(planes_ptr + t, mask=live, other=0)
    p1 = tl.load(planes_ptr + axis_stride + t, mask=live, other=0)
    p2 = tl.load(planes_ptr + 2 * axis_stride + t, mask=live, other=0)
    d = tl.arange(0, HALF_P2)
    axis = (d >= S0).to(tl.int32) + (d >= S01).to(tl.int32)
    a = axis[None, :]
    pos = tl.where(a == 0, p0[:, None], tl.where(a == 1, p1[:, None], p2[:, None]))
    dst = t.to(tl.int64)[:, None] * out_stride + d[None, :]
    tl.store(out_ptr + dst, pos, mask=live[:, None] & (d < HALF)[None, :])


def select_mrope_positions(
    planes: torch.Tensor,
    sections: tuple[int, int, int],
    out: torch.Tensor,
    num_tokens: int,
) -> torch.Tensor:
    """Write ``out[t, d]`` = the position of token ``t`` on rotary frequency ``d``'s axis;
    return ``out[:num_tokens, :half]``.

    ``planes`` is int64 ``(3, n)`` with unit token stride (the published view at the
    running width ``n >= num_tokens``); ``out`` int64 ``[>= num_tokens, >= half]`` with
    unit column stride. One launch, no host sync.
    """
    func = "select_mrope_positions"
    num_tokens = check_count(func, "num_tokens", num_tokens)
    if (not isinstance(sections, tuple) or len(sections) != 3
            or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sections)
            or sum(sections) == 0):
        raise ConsumerArgumentError(
            f"{func}: sections must be a tuple of three ints >= 0 (time, height, width "
            f"rotary frequencies) with a positive sum, got {sections!r}")
    half = sum(sections)
    check_tensor(func, "planes", planes, dtype=torch.int64, ndim=2, min_numel=3)
    if planes.shape[0] != 3 or planes.shape[1] < num_tokens:
        raise ConsumerArgumentError(
            f"{func}: planes must have shape (3, n) with n >= num_tokens={num_tokens}, got "
            f"{tuple(planes.shape)}; view the published prefix at the running width")
    check_tensor(func, "out", out, dtype=torch.int64, ndim=2, min_numel=num_tokens)
    if out.shape[1] < half:
        raise ConsumerArgumentError(
            f"{func}: out has {out.shape[1]} columns, needs sum(sections)={half}")
    check_devices(func, _mrope_kernel, planes=planes, out=out)
    if num_tokens:
        grid = (cdiv(bucket(num_tokens), BLOCK_TOKENS),)
        _mrope_kernel[grid](planes, planes.stride(0), out, out.stride(0), num_tokens,
                            S0=sections[0], S01=sections[0] + sections[1], HALF=half,
                            HALF_P2=next_power_of_two(half), BLOCK=BLOCK_TOKENS)
    return out[:num_tokens, :half]


def select_mrope_positions_reference(planes: list[list[int]], sections: tuple[int, int, int],
                                     num_tokens: int) -> list[list[int]]:
    """Plain-Python oracle of :func:`select_mrope_positions` (planes as three lists)."""
    axes = [0] * sections[0] + [1] * sections[1] + [2] * sections[2]
    return [[planes[a][t] for a in axes] for t in range(num_tokens)]
