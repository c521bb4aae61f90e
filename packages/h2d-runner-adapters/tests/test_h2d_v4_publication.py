"""DeepSeek-V4/V4.1 decode metadata: the first consumer, step indptr generation.

Exact values against the plain-Python oracle written from the context document (per-token
SWA/CSA/HCA lengths, committed counts, padded rows), untouched tails, changing batch
sizes and padding. CPU cases run the kernel in Triton's interpreter.
"""

from __future__ import annotations

import random

import pytest
import torch

from h2d_runner_adapters.consumers import ConsumerArgumentError
from h2d_runner_adapters.consumers._launch import interpreted
from h2d_runner_adapters.consumers.v4_step_indptrs import (
    StepIndptrs,
    _step_indptrs_kernel,
    generate_v4_step_indptrs,
    generate_v4_step_indptrs_reference,
)

POISON = -7
WINDOW, TOPK = 128, 1024


@pytest.fixture
def dev(device: str) -> torch.device:
    if device == "cpu" and not interpreted(_step_indptrs_kernel):
        pytest.skip("CPU tensors need Triton's interpreter (TRITON_INTERPRET=1)")
    if device == "cuda" and interpreted(_step_indptrs_kernel):
        pytest.skip("CUDA cases need compiled kernels: unset TRITON_INTERPRET")
    return torch.device(device)


def outputs(dev: torch.device, tokens: int, reqs: int, extra: int = 5) -> StepIndptrs:
    def buf(k: int) -> torch.Tensor:
        return torch.full((k + extra,), POISON, dtype=torch.int32, device=dev)
    return StepIndptrs(buf(tokens + 1), buf(tokens + 1), buf(tokens + 1), buf(tokens),
                       buf(reqs))


def decode_batch(rng: random.Random, n: int, padded: int, q: int, ragged: bool
                 ) -> tuple[list[int], list[int], list[int]]:
    """Positions, batch ids (the graph grid: padded * q tokens, -1 for padding) and the
    committed context lengths of a DSpark-style decode step."""
    seq_lens, positions, bids = [], [], []
    for i in range(n):
        width = rng.randint(1, q) if ragged else q
        ctx = rng.randint(width, 300_000)
        seq_lens.append(ctx)
        for j in range(width):
            positions.append(ctx - width + j)
            bids.append(i)
    pad = padded * q - len(positions)
    return positions + [0] * pad, bids + [-1] * pad, seq_lens


def run(dev: torch.device, positions: list[int], bids: list[int], seq_lens: list[int],
        n: int, p: int) -> None:
    t = len(positions)
    out = outputs(dev, t, p)
    generate_v4_step_indptrs(
        torch.tensor(positions, dtype=torch.int64, device=dev),
        torch.tensor(bids, dtype=torch.int32, device=dev),
        torch.tensor([*seq_lens, 0], dtype=torch.int32, device=dev),
        out, num_tokens=t, num_reqs=n, padded_reqs=p, window=WINDOW, index_topk=TOPK)
    want = generate_v4_step_indptrs_reference(positions, bids, seq_lens, num_reqs=n,
                                              padded_reqs=p, window=WINDOW, index_topk=TOPK)
    for name, expected in want.items():
        got = getattr(out, name).cpu().tolist()
        assert got[: len(expected)] == expected, name
        assert got[len(expected):] == [POISON] * 5, f"{name}: the tail was written"


@pytest.mark.parametrize("n, padded, q, ragged", [
    (1, 1, 1, False), (3, 4, 1, False), (5, 8, 2, False), (7, 8, 4, True), (0, 2, 2, False),
])
def test_step_indptrs_match_the_reference(dev: torch.device, n: int, padded: int, q: int,
                                          ragged: bool) -> None:
    positions, bids, seq_lens = decode_batch(random.Random(n * 31 + q), n, padded, q, ragged)
    run(dev, positions, bids, seq_lens, n, padded)


def test_step_indptrs_across_changing_sizes(dev: torch.device) -> None:
    """Batch sizes that change between steps, across size buckets and back."""
    rng = random.Random(7)
    for n, q in ((259, 2), (3, 1), (513, 1), (40, 3)):
        positions, bids, seq_lens = decode_batch(rng, n, n + 2, q, ragged=q > 1)
        run(dev, positions, bids, seq_lens, n, n + 2)


def test_short_contexts_and_the_window(dev: torch.device) -> None:
    """Contexts shorter than the window, one CSA block or one HCA block: the caps apply."""
    seq_lens = [1, 4, 5, 127, 128, 129, 100_000]
    positions = [c - 1 for c in seq_lens]
    bids = list(range(len(seq_lens)))
    run(dev, positions, bids, seq_lens, len(seq_lens), len(seq_lens) + 1)


def test_bad_arguments_are_refused(dev: torch.device) -> None:
    out = outputs(dev, 4, 2, extra=0)
    pos = torch.zeros(5, dtype=torch.int64, device=dev)
    bids = torch.zeros(5, dtype=torch.int32, device=dev)
    lens = torch.ones(2, dtype=torch.int32, device=dev)

    def call(**kw: object) -> None:
        args = {"num_tokens": 4, "num_reqs": 2, "padded_reqs": 2, "window": WINDOW,
                "index_topk": TOPK} | kw
        generate_v4_step_indptrs(pos, bids, lens, out, **args)  # type: ignore[arg-type]

    with pytest.raises(ConsumerArgumentError, match=r"padded_reqs=1 is below num_reqs=2"):
        call(padded_reqs=1)
    with pytest.raises(ConsumerArgumentError, match=r"num_tokens must be a Python int"):
        call(num_tokens=torch.tensor(4))
    with pytest.raises(ConsumerArgumentError, match=r"swa_indptr has 5 elements, needs at "
                                                    r"least 6"):
        call(num_tokens=5)
    with pytest.raises(ConsumerArgumentError, match=r"window must be >= 1"):
        call(window=0)
    with pytest.raises(ConsumerArgumentError, match=r"positions must have dtype torch.int64"):
        generate_v4_step_indptrs(bids, bids, lens, out, num_tokens=4, num_reqs=2,
                                 padded_reqs=2, window=WINDOW, index_topk=TOPK)
