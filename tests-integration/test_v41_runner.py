"""The V4.1-shaped runner: packed and direct publication give bit-identical logits.

Two groups per step (token inputs, V4.1 metadata), DSpark-style ragged and rectangular
query widths, requests arriving and finishing, growing block tables, state forks, padded
batches (CUDA graphs on the GPU: one per padded size and width). The stand-in model reads
every published member through the first consumers, and writes state and compressed
pools through the plans, so a wrong byte changes later logits too.
"""

from __future__ import annotations

import os

import torch
from decode_runner.v41 import V41Config, V41Population, V41Runner
from kernel_mode import needs_kernels

STEPS = int(os.environ.get("H2D_INTEGRATION_STEPS", "200"))


def test_v41_packed_and_direct_are_bit_identical(device: str) -> None:
    needs_kernels(device)
    cuda = device == "cuda"
    steps = STEPS if cuda else min(STEPS, 40)
    cfg = V41Config(graph_sizes=(4, 8) if cuda else (), scatter="auto" if cuda else "triton")
    runners = {b: V41Runner(cfg, device, b) for b in ("packed", "direct")}
    pops = {b: V41Population(cfg, seed=5) for b in runners}
    padded_steps = 0
    for k in range(steps):
        outs = {}
        for b, runner in runners.items():
            spans, rows, ids = pops[b].step()
            n = len(spans)
            padded = (4 if n <= 4 else 8) if (cuda or k % 3 == 0) and n else None
            padded_steps += padded is not None and b == "packed"
            outs[b] = runner.step(spans, rows, ids, padded).cpu()
        assert outs["packed"].shape == outs["direct"].shape
        assert torch.equal(outs["packed"], outs["direct"]), k
        assert torch.isfinite(outs["packed"]).all(), k
    assert padded_steps > 0
    for b, runner in runners.items():
        c = runner.state.counters("v41_metadata")
        assert c.publications == steps, b
        if b == "packed":
            assert (c.dmas, c.scatters) == (steps, steps)
    # both runs wrote the same pools through the plans
    a, d = runners["packed"], runners["direct"]
    assert torch.equal(a.state_pool.cpu(), d.state_pool.cpu())
    assert torch.equal(a.kv_pool.cpu(), d.kv_pool.cpu())
