"""Draft-ID gather: the token after each speculative verification position.

The second consumer of the ``token_inputs`` group, run after token assembly:
``out[i] = input_ids[1 + target_logits_indices[i]]`` for every ``i`` below
``target_logits_indices.numel()`` (the indices are int64, as uploaded). It reads
the +1-shifted view of ``input_ids`` that the extra ``[N+1]`` slot allows.

An index outside ``[0, input_ids.numel() - 1)`` (e.g. ``-1`` graph padding)
writes nothing to its ``out`` slot; ``out`` past the index count is untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from h2d_runner_adapters.consumers._launch import bucket, cdiv, check_devices, check_tensor

BLOCK = 1024


@triton.jit(do_not_specialize=["num_ids", "count"])
def _gather_kernel(  # type: ignore[no-untyped-def]
    input_ids_ptr,  # *i32 [num_ids]
    num_ids,
    indices_ptr,  # *i64 [count]
    out_ptr,  # *i32 [>= count]
    count,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < count
    src = tl.load(indices_ptr + i, mask=live, other=-1)
    valid = live & (src >= 0) & (src + 1 < num_ids)
    tokens = tl.load(input_ids_ptr + 1 + src, mask=valid, other=0)
    tl.store(out_ptr + i, tokens, mask=valid)


def gather_draft_ids(
    input_ids: torch.Tensor, target_logits_indices: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """Write ``out[i] = input_ids[1 + target_logits_indices[i]]``; return ``out[:count]``.

    ``input_ids`` and ``out`` are int32, ``target_logits_indices`` int64 (1-D, its
    length is the count: pass the published prefix view). No host sync, no allocation.
    """
    func = "gather_draft_ids"
    check_tensor(func, "input_ids", input_ids, dtype=torch.int32, ndim=1)
    check_tensor(func, "target_logits_indices", target_logits_indices, dtype=torch.int64, ndim=1)
    count = target_logits_indices.numel()
    check_tensor(func, "out", out, dtype=torch.int32, ndim=1, min_numel=count)
    check_devices(
        func,
        _gather_kernel,
        input_ids=input_ids,
        target_logits_indices=target_logits_indices,
        out=out,
    )
    grid = (cdiv(bucket(count), BLOCK),)
    _gather_kernel[grid](
        input_ids, input_ids.numel(), target_logits_indices, out, count, BLOCK=BLOCK
    )
    return out[:count]
