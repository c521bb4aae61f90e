"""The ATOM-style way (``decode_runner/atom_style.py``) publishes the packed way's bytes.

``test_decode_runner.py`` compares the two ways by logits only, and logits cannot see a
page-table entry that points at a page of zeros: a KV cache that starts zeroed reads the
same from a wrong (never written) page as from the right one while that page is still
empty. Here the KV cache starts with nonzero data on both runners, and each step's
published destinations (every member the ATOM-style way copies, over what the step
publishes) and the KV indices its first consumer generates must equal the packed way's
byte for byte, over steady decode steps that append pages and restart their rows, eager
and padded.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from decode_runner.runner import DecodeRunner, RunnerConfig
from decode_runner.scheduler import steady_decode_batches, steady_decode_num_pages
from kernel_mode import needs_kernels

from h2d_runner_adapters import ScheduledBatch

BS, CONTEXT, PAGE, WINDOW, PADDED_SIZE = 3, 9, 4, 5, 4
#: two windows and a bit: every row crosses a page boundary and restarts once
STEPS = 2 * WINDOW + 2


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # tiny ops on a 2-core CPU are much slower with a thread pool than without
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _runner(device: str, backend: str, padded: bool) -> DecodeRunner:
    # a graph size on CPU pads eagerly (CUDA graphs are captured on CUDA only)
    cfg = RunnerConfig(
        max_reqs=PADDED_SIZE, max_tokens=PADDED_SIZE,
        max_pages_per_req=-(-(CONTEXT + PAGE + WINDOW) // PAGE),
        page_size=PAGE, num_pages=steady_decode_num_pages(BS, CONTEXT, PAGE, WINDOW),
        vocab=64, hidden=16, layers=1, heads=1, head_dim=16,
        dtype=torch.float16 if device == "cuda" else torch.float32,
        graph_sizes=(PADDED_SIZE,) if padded else (), num_slots=2, seed=5,
        scatter="auto" if device == "cuda" else "triton")
    runner = DecodeRunner(cfg, device, backend)
    # the same nonzero cache on both ways: a wrong page reads other values than the right one
    cache = runner.model.kv_cache
    gen = torch.Generator().manual_seed(17)
    cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype))
    return runner


def _published(runner: DecodeRunner, batch: ScheduledBatch) -> dict[str, bytes]:
    """What a one-token-per-request decode step publishes (``p`` padded requests, ``n``
    real ones), and the KV indices the first consumer generated from it."""
    n = batch.num_reqs
    p = batch.padded_size if batch.padded_size in runner.graph_inputs else n
    assert p is not None
    tok, dec = runner.tokens, runner.decode
    views = {
        "input_ids": tok.input_ids.gpu[:p], "decode_cu": tok.decode_cu.gpu[: p + 1],
        "decode_src": tok.decode_src.gpu[:p], "cu_seqlens_q": tok.cu_seqlens_q.gpu[: p + 1],
        # the sampler reads real rows only: temperatures carry no graph padding
        "temperatures": runner.sampling.temperatures.gpu[:n],
        "slot_mapping": dec.slot_mapping.gpu[:p], "context_lens": dec.context_lens.gpu[:p],
        "kv_indptr": dec.kv_indptr.gpu[: p + 1], "positions": dec.positions.gpu[:p],
        "block_tables": dec.block_tables.gpu[:p],
    }
    pages = int(dec.kv_indptr.gpu[p])
    views["kv_indices"] = dec.kv_indices[:pages]
    return {k: v.cpu().numpy().tobytes() for k, v in views.items()}


@pytest.mark.parametrize("padded", [False, True])
def test_atom_style_publishes_the_packed_bytes(device: str, padded: bool) -> None:
    needs_kernels(device)
    packed, atom = _runner(device, "packed", padded), _runner(device, "atom", padded)
    batches = steady_decode_batches(BS, CONTEXT, PAGE, window=WINDOW, vocab_size=64,
                                    graph_sizes=(PADDED_SIZE,) if padded else ())
    first_pages: set[int] = set()
    for step in range(STEPS):
        batch = next(batches)  # one batch for both ways: the same rows, the same lists
        want, got = packed.step(batch), atom.step(batch)
        expected, published = _published(packed, batch), _published(atom, batch)
        wrong = [k for k in expected if published[k] != expected[k]]
        assert not wrong, f"step {step}: the ATOM-style way published other bytes in {wrong}"
        assert torch.equal(want.logits, got.logits), f"step {step}: logits differ"
        assert torch.equal(want.sampled, got.sampled), f"step {step}: tokens differ"
        first_pages.update(int(row[0]) for row in batch.block_tables if len(row))
    # column 0 holds real pages (a table whose column 0 were page 0 everywhere would hide
    # a way that never writes it)
    assert first_pages - {0}
