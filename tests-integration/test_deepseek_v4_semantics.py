"""DeepSeek-V4 semantics the broad oracle workload does not reach, each against transformers.

The tiny random model of :mod:`test_deepseek_v4_oracle`, decoded through
:class:`~decode_runner.deepseek_v4_runner.DeepseekV4Runner`; every test compares logits
(float32, 1e-4) with the model's dense forward and greedy tokens with ``generate()``:

* a verify step (``k = 3``: four query tokens per request) whose positions straddle a
  rate-128 boundary: each token sees only the HCA entries its own position may
  (``min((p + 1) // 128, ctx // 128)``), not its request's.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from decode_runner.runner import RunnerConfig
from kernel_mode import needs_kernels

from h2d_runner_adapters import ScheduledBatch

if os.environ.get("H2D_REQUIRE_TRANSFORMERS") == "1":  # nox -s tests installs it
    import transformers  # noqa: F401
else:
    pytest.importorskip("transformers")

from decode_runner.deepseek_v4 import DeepseekV4PagedDecoder
from decode_runner.deepseek_v4_runner import DeepseekV4Runner
from test_deepseek_v4_oracle import BLOCKS, SLOTS, VOCAB, _model, _verify_request

TOL = {"rtol": 1e-4, "atol": 1e-4}


def _runner(model: Any, device: str, backend: str, *, spec: int = 0, max_blocks: int = 1,
            pad: bool = False) -> DeepseekV4Runner:
    decoder = DeepseekV4PagedDecoder(model, num_blocks=BLOCKS + 1, max_blocks=max_blocks,
                                     num_state_slots=SLOTS, spec_tokens=spec)
    return DeepseekV4Runner(
        RunnerConfig(max_reqs=4, max_tokens=64, max_pages_per_req=max_blocks, page_size=256,
                     num_pages=BLOCKS, vocab=VOCAB,
                     scatter="auto" if device == "cuda" else "triton"),
        device, backend, model=decoder, num_state_slots=SLOTS, pad_eager=pad)


def _prefill(runner: DeepseekV4Runner, req: int, tokens: list[int], table: list[int], *,
             start: int = 0, chunk: int = 48) -> int:
    """Prefill ``tokens`` (positions from ``start``) in chunks; the sampled first token."""
    for s in range(0, len(tokens), chunk):
        part = tokens[s:s + chunk]
        res = runner.step(ScheduledBatch(
            [_verify_request(req, part, start + s + len(part), table)], True, 256, step=0))
    return int(res.sampled[0])


def _greedy(model: Any, seq: list[int], new: int, device: str) -> list[int]:
    ids = torch.tensor([seq], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=new, min_new_tokens=new, pad_token_id=0)
    return out[0, len(seq):].tolist()


def _dense(model: Any, seq: list[int], device: str) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([seq], device=device)).logits[0].float().cpu()


# -- 1. decode HCA entries per token ------------------------------------------------------
SPEC = 3


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_verify_across_an_hca_boundary_hides_the_closing_entry(device: str, backend: str
                                                                ) -> None:
    """Two requests (prompts of 126 and 120 tokens) verify 4 tokens a step, their drafts
    the greedy continuation: request 0's first step holds positions 126..129, so it
    closes HCA window 0 (position 127) while its token at 126 may not see that entry;
    request 1's second step holds 124..127, three tokens before the entry closes. Every
    row's logits equal the dense forward's and the accepted tokens ``generate()``'s."""
    needs_kernels(device)
    model: Any = _model(device)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (126, 120)]
    steps = 3
    truth = [_greedy(model, p, SPEC * steps + steps + 1, device) for p in prompts]
    runner = _runner(model, device, backend, spec=SPEC)
    seqs = [[*p, _prefill(runner, i, p, [i])] for i, p in enumerate(prompts)]
    for i, p in enumerate(prompts):
        assert seqs[i][len(p):] == truth[i][:1], i
    for _ in range(steps):
        reqs, tokens = [], []
        for i, p in enumerate(prompts):
            g = len(seqs[i]) - len(p)
            toks = [seqs[i][-1], *truth[i][g:g + SPEC]]
            reqs.append(_verify_request(i, toks, len(seqs[i]) + SPEC, [i]))
            tokens.append(toks)
        logits = runner.verify(ScheduledBatch(reqs, False, 256, step=1), padded=4)
        logits = logits.float().cpu()
        for i, toks in enumerate(tokens):
            start = len(seqs[i]) - 1
            dense = _dense(model, seqs[i] + toks[1:], device)[start:start + len(toks)]
            mine = logits[i * len(toks):(i + 1) * len(toks)]
            torch.testing.assert_close(mine, dense, **TOL)
            seqs[i] += mine.argmax(-1).tolist()  # every draft is the greedy continuation
    for i, p in enumerate(prompts):
        assert seqs[i][len(p):] == truth[i][: len(seqs[i]) - len(p)], i
    assert runner.decode_compress_rows.get(128, 0) == 2  # each request closed HCA window 0


# -- 4. HCA slices in view rows: several HCA layers ---------------------------------------
TWO_HCA = ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention",
           "heavily_compressed_attention"]


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_two_hca_layers_each_read_their_own_rows(device: str, backend: str) -> None:
    """A model with two heavily-compressed layers: the HCA index head one step publishes
    is in view rows (relative to the reading layer's view base, its offset in the block
    envelope), so each HCA layer adds its own base and reads its own compressed rows and
    window ring. Two requests prefill across an HCA boundary (chunked), then decode
    together (padded) across a second one; every step's logits equal the dense forward's
    and the tokens ``generate()``'s."""
    needs_kernels(device)
    model: Any = _model(device, TWO_HCA)
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (140, 122)]
    new = 9
    runner = _runner(model, device, backend, pad=True)
    assert runner._decoder.envelope_rows == 2 + 2 + 64
    seqs = [[*p, _prefill(runner, i, p, [i])] for i, p in enumerate(prompts)]
    for step in range(new - 1):
        reqs = [_verify_request(i, [seqs[i][-1]], len(seqs[i]), [i]) for i in (1, 0)]
        res = runner.step(ScheduledBatch(reqs, False, 256, padded_size=4, step=step + 1))
        for row, i in enumerate((1, 0)):
            dense = _dense(model, seqs[i], device)[-1]
            torch.testing.assert_close(res.logits[row].float().cpu(), dense, **TOL)
            seqs[i].append(int(res.sampled[row]))
    for i, p in enumerate(prompts):
        assert seqs[i][len(p):] == _greedy(model, p, new, device), i
    assert runner.decode_compress_rows.get(128, 0) == 1  # request 1 closed HCA window 0
    assert runner.padded_steps == new - 1
