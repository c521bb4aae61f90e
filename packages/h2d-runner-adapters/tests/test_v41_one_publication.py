"""A V4.1 decode step as one publication: ``TokenStepInputs(group=..., extra_groups=
[V41_METADATA])`` carries the token inputs and the V4.1 metadata in one DMA, one scatter
and one launch (its fused first consumer included), and publishes exactly what the
two-group step does (``token_inputs`` then ``v41_metadata``: the spec's two H2Ds and two
scatters), step after step, graph padding and block-table ranges included."""

from __future__ import annotations

from typing import Any

import adapter_helpers as ah
import pytest
import torch
from v4_helpers import (
    DUMMY_BLOCK,
    DUMMY_SLOT,
    ENVELOPE,
    MAX_BLOCKS,
    MAX_REQS,
    MAX_TOKENS,
    NUM_BLOCKS,
    TOPK,
    WINDOW,
    Population,
    token_batch,
    v41_reference,
)

from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    TOKEN_INPUTS,
    V41_METADATA,
    TokenStepInputs,
    V41MetadataInputs,
)

V41_STEP = "v41_step"


def _state(device: str, one: bool) -> tuple[H2DRunnerState, TokenStepInputs, V41MetadataInputs]:
    st = H2DRunnerState(device, num_slots=2, scatter=ah.scatter_for(device))
    # the V4.1 group is declared first: the token step's combined group takes it in
    v4 = V41MetadataInputs(st, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS,
                           max_blocks_per_req=MAX_BLOCKS, dummy_state_slot=DUMMY_SLOT,
                           dummy_block=DUMMY_BLOCK, num_blocks=NUM_BLOCKS, window=WINDOW,
                           index_topk=TOPK, fp8=True, envelope_rows=ENVELOPE, max_ranges=4)
    tokens = (TokenStepInputs(st, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS, group=V41_STEP,
                              extra_groups=[V41_METADATA]) if one
              else TokenStepInputs(st, max_reqs=MAX_REQS, max_tokens=MAX_TOKENS))
    st.bind()
    for b in st.buffers().values():
        b.gpu.view(-1).view(torch.uint8).fill_(0x5A)
    return st, tokens, v4


def _step(st: H2DRunnerState, tokens: TokenStepInputs, v4: V41MetadataInputs,
          spans: list[Any], rows: list[Any], padded: int, one: bool,
          keep: bool = True) -> Any:
    st.begin()
    tokens.prepare(token_batch(spans, False), padded)
    plan = v4.begin_step(spans, block_tables=rows, padded=padded)
    if one:
        st.publish(V41_STEP)
    else:
        st.publish(TOKEN_INPUTS)
        st.publish(V41_METADATA)
    out = v4.generate_step_indptrs(plan)
    st.finish()
    return [t.clone() for t in out] if keep else None  # (a clone is a device copy)


def test_one_publication_publishes_what_the_two_groups_do(device: str) -> None:
    ah.need_kernels(device)
    one = _state(device, True)
    two = _state(device, False)
    pops = (Population(31), Population(31))
    for index in range(6):
        padded = MAX_REQS // 2 + index % 2
        got = []
        for (st, tokens, v4), pop, single in zip((one, two), pops, (True, False),
                                                 strict=True):
            spans, rows = pop.step(1 + index % 4, True, 1 + index % 3)
            got.append(_step(st, tokens, v4, spans, rows, padded, single))
        ah.sync(device)
        # every destination byte equal, poison included (the same members, the same tails)
        bufs = [one[0].buffers(), two[0].buffers()]
        assert bufs[0].keys() == bufs[1].keys()
        for name in bufs[0]:
            a, b = bufs[0][name].gpu.cpu(), bufs[1][name].gpu.cpu()
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (index, name)
        # and the first consumer's outputs, fused into the one launch
        for x, y in zip(got[0], got[1], strict=True):
            assert torch.equal(x, y), index
        want = v41_reference(spans, [list(r) for r in rows], padded)
        assert one[2].state_slot_out.gpu[:padded].tolist() == want["v41_state_slot_out"]
    c = one[0].counters(V41_STEP)
    assert (c.publications, c.dmas, c.scatters, c.direct_copies) == (6, 6, 6, 0)
    for group in (TOKEN_INPUTS, V41_METADATA):
        c = two[0].counters(group)
        assert (c.publications, c.dmas, c.scatters) == (6, 6, 6)


KERNEL_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                   "cuLaunchKernelEx")
COPY_CALLS = ("cudaMemcpyAsync", "cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync_v2")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")


def test_one_publication_is_one_h2d_and_one_graph_launch_in_a_profiler_trace(
        device: str) -> None:
    """The token inputs, the V4.1 metadata and the fused first consumer: one H2D DMA and
    every kernel enqueued by one graph launch (one correlation id), no eager kernel or
    copy on the host."""
    if device != "cuda":
        pytest.skip("a CUDA profiler trace")
    import json
    import os
    import tempfile
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    from h2d_kernels import copy_counts

    st, tokens, v4 = _state(device, True)
    pop = Population(7)
    for _ in range(4):  # warm: the table's rows staged, ranges after
        spans, rows = pop.step(3, False, 1)
        _step(st, tokens, v4, spans, rows, 4, True)
    torch.cuda.synchronize()
    spans, rows = pop.step(3, False, 1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _step(st, tokens, v4, spans, rows, 4, True, keep=False)
        torch.cuda.synchronize()
    events = list(prof.events())
    host = Counter(e.name for e in events if e.device_type.name == "CPU")
    assert not any(host[n] for n in KERNEL_LAUNCHES + COPY_CALLS), host
    assert sum(host[n] for n in GRAPH_LAUNCHES) <= 1, host  # compiled launches are unlisted
    fd, path = tempfile.mkstemp(suffix=".json", prefix="h2d_trace_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    finally:
        os.unlink(path)
    assert copy_counts(trace) == Counter({"H2D": 1})
    work = [e for e in trace["traceEvents"]
            if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = {e["args"].get("correlation") for e in work}
    # the DMA, the scatter and the step-indptr kernels: one launch
    assert len(work) >= 3 and len(launches) == 1 and None not in launches, work
