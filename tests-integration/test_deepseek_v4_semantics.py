"""DeepSeek-V4 semantics the broad oracle workload does not reach, each against transformers.

The tiny random model of :mod:`test_deepseek_v4_oracle`, decoded through
:class:`~decode_runner.deepseek_v4_runner.DeepseekV4Runner`; every test compares logits
(float32, 1e-4) with the model's dense forward and greedy tokens with ``generate()``:

* a verify step (``k = 3``: four query tokens per request) whose positions straddle a
  rate-128 boundary: each token sees only the HCA entries its own position may
  (``min((p + 1) // 128, ctx // 128)``), not its request's;
* state forks, in a prefill chunk and in a verify step: the fork's step reads its
  source's window rows and compressor rings through ``state_slot_in`` and writes its own
  slot;
* a model with two HCA layers: every published slice cell is a view row, each HCA layer
  adding its own view base.
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


# -- 2. a state fork -------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_a_fork_reads_its_source_state_then_its_own(device: str, backend: str) -> None:
    """Request 0 prefills ``P`` (100 tokens). Request 1 forks from it: its block is a copy
    of request 0's (the engine's copy-on-write of the partial block: the CSA entries of
    ``P``), its state slot is fresh (garbage) and its one prefill chunk of 60 more tokens
    publishes request 0's slot as ``fork_source``. That chunk reads request 0's window
    ring (its first tokens' window lies in ``P``) and compressor rings (the HCA window
    closing at 127 pools 100 positions of ``P``) through ``state_slot_in`` and writes every
    state a later step reads into its own slot. Both then decode together (request 1
    across two CSA windows, request 0 on its own slot, undisturbed): every step's logits
    equal the dense forward's and each request's tokens ``generate()``'s."""
    needs_kernels(device)
    model: Any = _model(device)
    gen = torch.Generator().manual_seed(9)
    prompt = torch.randint(1, VOCAB, (100,), generator=gen).tolist()
    suffix = torch.randint(1, VOCAB, (60,), generator=gen).tolist()
    runner = _runner(model, device, backend, pad=True)
    seqs = {0: [*prompt, _prefill(runner, 0, prompt, [0])]}
    runner._decoder.move_pages([(0, 1)])  # copy-on-write of the shared partial block
    runner.forks[1] = 0
    seqs[1] = [*prompt, *suffix, _prefill(runner, 1, suffix, [1], start=100, chunk=64)]
    assert not runner.forks and runner.slot_of[1] != runner.slot_of[0]
    new = 8
    for step in range(new - 1):
        reqs = [_verify_request(i, [seqs[i][-1]], len(seqs[i]), [i]) for i in (1, 0)]
        res = runner.step(ScheduledBatch(reqs, False, 256, padded_size=4, step=step + 1))
        for row, i in enumerate((1, 0)):
            dense = _dense(model, seqs[i], device)[-1]
            torch.testing.assert_close(res.logits[row].float().cpu(), dense, **TOL)
            seqs[i].append(int(res.sampled[row]))
    assert seqs[0][100:] == _greedy(model, prompt, new, device)
    assert seqs[1][160:] == _greedy(model, prompt + suffix, new, device)


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_a_decode_fork_step_reads_the_source_window(device: str, backend: str) -> None:
    """A fork taken in a verify step (``k = 3``): request 0 has prefilled ``P`` (100
    tokens); request 1, its block a copy of request 0's and its slot fresh, verifies the
    same continuation's first four tokens (positions 100..103) with request 0's slot as
    ``fork_source``, in one ragged step with request 0's own one-token step. Its tokens'
    windows reach back into ``P``: those rows come from the source's ring
    (``state_slot_in``), the step's own from its slot (``state_slot_out``). Every row's
    logits equal the dense forward's; request 0 then decodes on, undisturbed."""
    needs_kernels(device)
    model: Any = _model(device)
    gen = torch.Generator().manual_seed(13)
    prompt = torch.randint(1, VOCAB, (100,), generator=gen).tolist()
    truth = _greedy(model, prompt, 6, device)
    runner = _runner(model, device, backend, spec=SPEC)
    seq = [*prompt, _prefill(runner, 0, prompt, [0])]
    assert seq[100:] == truth[:1]
    runner._decoder.move_pages([(0, 1)])  # copy-on-write of the shared partial block
    runner.forks[1] = 0
    toks = [seq[-1], *truth[1:1 + SPEC]]
    reqs = [_verify_request(0, [seq[-1]], 101, [0]), _verify_request(1, toks, 104, [1])]
    logits = runner.verify(ScheduledBatch(reqs, False, 256, step=1), padded=4).float().cpu()
    assert not runner.forks and runner.slot_of[1] != runner.slot_of[0]
    dense = _dense(model, [*seq, *toks[1:]], device)
    torch.testing.assert_close(logits[0], dense[100], **TOL)
    torch.testing.assert_close(logits[1:], dense[100:104], **TOL)
    runner.release([1])
    seq.append(int(logits[0].argmax()))
    for step in range(2, 5):
        out = runner.verify(ScheduledBatch([_verify_request(0, [seq[-1]], len(seq), [0])],
                                           False, 256, step=step), padded=4).float().cpu()
        torch.testing.assert_close(out[0], _dense(model, seq, device)[-1], **TOL)
        seq.append(int(out[0].argmax()))
    assert seq[100:] == truth[: len(seq) - 100]


# -- 3. prefill window writes, published -----------------------------------------------------
@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_prefill_window_writes_are_published_and_read_back(device: str, backend: str
                                                           ) -> None:
    """Two requests prefill in two chunked steps of both (request 0: 40 + 30 tokens,
    request 1: 20 + 25) and then decode together. Each prefill step publishes
    ``v41_window_write_plan``: a row ``[token, request, position, _]`` for each token among
    its request's last ``window`` positions, token order, ``-1`` rows after them up to the
    whole array (eager form). The model writes the window rings only through those rows,
    and the second chunk (its prefix window) and the decode steps read them back: every
    step's logits equal the dense forward's, the tokens ``generate()``'s."""
    needs_kernels(device)
    model: Any = _model(device)
    gen = torch.Generator().manual_seed(17)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in (70, 45)]
    runner = _runner(model, device, backend, pad=True)
    v4 = runner.prefill.v4
    w = model.config.sliding_window
    cap = v4.window_write_plan.spec.capacity
    seqs: dict[int, list[int]] = {}
    for step, cuts in enumerate(((0, 40, 0, 20), (40, 70, 20, 45))):
        reqs = [_verify_request(i, prompts[i][a:b], b, [i])
                for i, (a, b) in enumerate((cuts[:2], cuts[2:]))]
        res = runner.step(ScheduledBatch(reqs, True, 256, step=step))
        plan = runner._plan
        # the real rows: each request's tokens among its last `window` positions
        want, t = [], 0
        for i, r in enumerate(reqs):
            start = r.context_len - r.num_tokens
            for j in range(r.num_tokens):
                if start + j >= r.context_len - w:
                    want.append([t, i, start + j, w - min(j + 1, w)])
                t += 1
        assert plan.window_rows == (len(want), cap)  # eager: the whole array
        rows = v4.window_write_plan.gpu[:cap].cpu().tolist()
        assert rows == want + [[-1] * 4] * (cap - len(want)), step
        for row, i in enumerate((0, 1)):
            start = reqs[i].context_len - 1
            dense = _dense(model, prompts[i][: start + 1], device)[start]
            torch.testing.assert_close(res.logits[row].float().cpu(), dense, **TOL)
    seqs = {i: [*p, int(res.sampled[i])] for i, p in enumerate(prompts)}
    new = 6
    for step in range(new - 1):
        reqs = [_verify_request(i, [seqs[i][-1]], len(seqs[i]), [i]) for i in (0, 1)]
        res = runner.step(ScheduledBatch(reqs, False, 256, padded_size=4, step=step + 2))
        for i in (0, 1):
            torch.testing.assert_close(res.logits[i].float().cpu(),
                                       _dense(model, seqs[i], device)[-1], **TOL)
            seqs[i].append(int(res.sampled[i]))
    for i, p in enumerate(prompts):
        assert seqs[i][len(p):] == _greedy(model, p, new, device), i
