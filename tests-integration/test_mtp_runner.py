"""Speculative decoding end to end: the verify step as one publication, the draft loop on
the GPU alone, greedy output equal to plain greedy decoding, packed == direct."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from decode_runner.mtp import MtpConfig, MtpRunner
from kernel_mode import needs_kernels

from h2d_runner_adapters import DECODE_STEP


def _config(device: str, k: int, **over: object) -> MtpConfig:
    cuda = device == "cuda"
    return MtpConfig(k=k, dtype=torch.float32, scatter="auto" if cuda else "triton",
                     num_reqs=6 if cuda else 3, **over)  # type: ignore[arg-type]


def _iterations(device: str, k: int) -> int:
    # >= 200 steps (verify + draft steps) on the GPU; a few on the CPU interpreter
    return -(-200 // (k + 1)) if device == "cuda" else 4


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_output_equals_greedy_decoding(device: str, k: int) -> None:
    """Every committed token is the target's greedy choice for its prefix (checked
    against the dense float64 reference, near-ties aside), with drafts both accepted and
    rejected along the way; each verify step is one DMA and one scatter."""
    needs_kernels(device)
    runner = MtpRunner(_config(device, k), device, "packed")
    iterations = _iterations(device, k)
    accepted = 0
    for _ in range(iterations):
        runner.iterate()
        accepted += int(runner.last_accepted.sum())
    c = runner.state.counters(DECODE_STEP)
    assert (c.publications, c.dmas, c.scatters, c.direct_copies) == (
        iterations, iterations, iterations, 0)
    drafted = iterations * runner.cfg.num_reqs * k
    assert 0 < accepted < drafted, (accepted, drafted)
    checked = 0
    for seq in runner.sequences[:2]:
        ref = runner.target.reference_sequence_logits(seq[:-1])
        top2 = ref.topk(2, dim=-1)
        for t in range(len(seq) - 1):
            if float(top2.values[t, 0] - top2.values[t, 1]) < 1e-3:
                continue  # a near-tie: the fp32 paged path may choose either
            assert int(top2.indices[t, 0]) == seq[t + 1], t
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("k, gdn", [(1, False), (3, False), (1, True)])
def test_mtp_packed_and_direct_are_bit_identical(device: str, k: int, gdn: bool) -> None:
    needs_kernels(device)
    runs = [MtpRunner(_config(device, k, gdn=gdn), device, b) for b in ("packed", "direct")]
    for _ in range(_iterations(device, k)):
        a, b = (r.iterate() for r in runs)
        assert torch.equal(a, b)
    assert runs[0].sequences == runs[1].sequences
    np.testing.assert_array_equal(runs[0].ctx, runs[1].ctx)
    assert runs[1].state.counters(DECODE_STEP).direct_copies > 0
