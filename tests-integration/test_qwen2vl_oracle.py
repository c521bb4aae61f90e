"""A real MRoPE client: transformers' ``Qwen2VLForConditionalGeneration`` decoded through
the library, every request's greedy tokens against the model's own forward.

The model is random-initialised from a small ``Qwen2VLConfig`` (2 layers, hidden 64, GQA: 4
query heads over 2 key/value heads, head_dim 16, ``mrope_section`` (2, 3, 3) summing to
head_dim / 2), no download. Prompts are text with image placeholder runs
(``<|vision_start|>``, placeholders, ``<|vision_end|>``; :mod:`decode_runner.multimodal`),
the vision tower replaced by fixed random features at the placeholders, the same ones in
the oracle's forward (``mm_encoder_outputs``). Every fifth request is text only.

:class:`~decode_runner.qwen2vl_runner.Qwen2VLRunner` publishes prefill with the prompts'
MRoPE planes (``PrefillInputs(mrope=True)``, chunked) and decode with the planes from each
request's delta (``MhaDecodeInputs(mrope=True)`` beside ``TokenStepInputs``), packed and
direct; :class:`~decode_runner.qwen2vl.Qwen2VLPagedDecoder` runs the model's modules over a
paged KV cache whose rotation comes only from the published ``[3, n]`` planes (decode
steps padded to the graph size, so the planes are read at a padded width). The scheduler
crosses pages, preempts (a recompute re-prefills prompt and outputs), migrates and reorders;
free pages are refilled with garbage before each step.

The oracle is the model's own forward over the whole sequence, its positions from its own
``model.model.get_rope_index`` (called by ``compute_3d_position_ids``): greedy tokens by
repeated full forwards, each sampled step's logits within 1e-4 (float32). The published
planes equal that rope index at every token the runner ran, and differ from text
positions on every request with an image.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
from decode_runner.multimodal import (
    MultimodalPrompt,
    MultimodalScheduler,
    SpecialTokens,
    make_prompt,
)
from decode_runner.runner import RunnerConfig
from decode_runner.scheduler import SamplingMix, SchedulerConfig
from kernel_mode import needs_kernels

from h2d_runner_adapters import select_mrope_positions

if os.environ.get("H2D_REQUIRE_TRANSFORMERS") == "1":  # nox -s tests installs it
    import transformers
else:  # e.g. the lent GPU machine, where transformers travels as a carried wheel
    transformers = pytest.importorskip("transformers")

from decode_runner.qwen2vl import Qwen2VLPagedDecoder
from decode_runner.qwen2vl_runner import Qwen2VLRunner
from transformers.modeling_outputs import BaseModelOutputWithPooling

PAGE, PAGES, VOCAB, HIDDEN = 4, 48, 128, 64
SPECIAL = SpecialTokens(image=120, vision_start=122, vision_end=123)
VIDEO = 121
SECTIONS = [2, 3, 3]


def _model(device: str) -> Any:
    torch.manual_seed(0)
    cfg = transformers.Qwen2VLConfig(
        text_config={
            "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "pad_token_id": 0, "bos_token_id": None,
            "eos_token_id": None,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                "mrope_section": SECTIONS}},
        vision_config={"depth": 1, "embed_dim": 16, "hidden_size": HIDDEN, "num_heads": 2,
                       "mlp_ratio": 2, "spatial_merge_size": 2},
        image_token_id=SPECIAL.image, video_token_id=VIDEO,
        vision_start_token_id=SPECIAL.vision_start, vision_end_token_id=SPECIAL.vision_end,
        tie_word_embeddings=False)
    model = transformers.Qwen2VLForConditionalGeneration(cfg).eval().to(device)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # wider logits: greedy choices far from ties
        # sharper attention than the default init: the rotation (so each plane) moves the
        # greedy tokens, not only the logits' last digits
        for layer in model.model.language_model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
        # the placeholder and delimiter ids are never sampled (logit 0 under a max of 128
        # logits of spread ~8): a generated image token would be no text token
        model.lm_head.weight[SPECIAL.image:].zero_()
    return model


Logits = dict[tuple[int, int], torch.Tensor]
Run = tuple[dict[int, tuple[list[int], list[int]]], dict, Logits, Qwen2VLRunner,
            dict[int, MultimodalPrompt]]


_RUNS: dict[tuple[str, str], Run] = {}
_ORACLES: dict[tuple[str, int, int], tuple[list[int], list[torch.Tensor], torch.Tensor]] = {}


def _run(device: str, backend: str) -> Run:
    """:func:`_run_once`, once per device and backend in this process (the CPU run is the
    Triton interpreter's: seconds a step)."""
    if (device, backend) not in _RUNS:
        _RUNS[(device, backend)] = _run_once(device, backend)
    return _RUNS[(device, backend)]


def _run_once(device: str, backend: str) -> Run:
    """Finished (prompt, generated) by request, scheduler counters, every sampled row's
    logits by (request, the position they predict), the runner and the prompts."""
    sched_cfg = SchedulerConfig(
        seed=3, page_size=PAGE, num_pages=PAGES, max_batch=4, prefill_chunk_tokens=20,
        prompt_len=(1, 52), output_len=(3, 14), num_requests=8, vocab_size=VOCAB,
        graph_sizes=(1, 2, 4), preempt_prob=0.03, migrate_prob=0.1, reorder_prob=0.2,
        sampling=SamplingMix(greedy_fraction=1.0))
    sched = MultimodalScheduler(sched_cfg, SPECIAL, HIDDEN)
    decoder = Qwen2VLPagedDecoder(_model(device), page_size=PAGE, num_pages=PAGES,
                                  max_pages=sched_cfg.max_pages_per_request)
    runner = Qwen2VLRunner(
        RunnerConfig(max_reqs=8, max_tokens=64, max_pages_per_req=sched_cfg.max_pages_per_request,
                     page_size=PAGE, num_pages=PAGES, vocab=VOCAB,
                     graph_sizes=(1, 2, 4) if device == "cuda" else (),
                     scatter="auto" if device == "cuda" else "triton"),
        device, backend, model=decoder, prompts=sched.prompts, pad_eager=True)
    sampled: list[int] | None = None
    logits: Logits = {}
    for _ in range(400):
        batch = sched.step(sampled)
        if batch is None:
            break
        sources = {src for src, _ in batch.extras["kv_page_moves"]}
        decoder.poison_pages(set(range(PAGES)) - set(sched.page_owners()) - sources)
        res = runner.step(batch)
        sampled = res.sampled.cpu().tolist()
        rows = res.logits.float().cpu()
        for r, (req, samples) in enumerate(zip(batch.requests, batch.extras["sample_rows"],
                                               strict=True)):
            if samples:
                logits[(req.req_id, req.context_len)] = rows[r]
    return sched.finished_sequences(), vars(sched.stats), logits, runner, sched.prompts


def _oracle(model: Any, prompt: MultimodalPrompt, new: int, device: str
            ) -> tuple[list[int], list[torch.Tensor], torch.Tensor]:
    """Greedy tokens by repeated full forwards of the model (its own rope index, the
    prompt's image features at the placeholders), each step's last logits, and the
    rope index of the final sequence ``[3, len]``."""
    seq = list(prompt.ids)
    grid = torch.tensor(prompt.grids, device=device) if prompt.grids else None
    extra: dict[str, Any] = {}
    if grid is not None:
        # one feature tensor per image, as the model's get_image_features splits them
        feats: Any = torch.split(prompt.features.to(device),
                                 [t * (h // 2) * (w // 2) for t, h, w in prompt.grids])
        extra = {"image_grid_thw": grid,
                 "mm_encoder_outputs": {"image": BaseModelOutputWithPooling(
                     pooler_output=feats)}}
    steps: list[torch.Tensor] = []
    with torch.no_grad():
        for _ in range(new):
            ids = torch.tensor([seq], device=device)
            out = model(input_ids=ids, mm_token_type_ids=(ids == SPECIAL.image).int(),
                        use_cache=False, **extra)
            steps.append(out.logits[0, -1].float().cpu())
            seq.append(int(steps[-1].argmax()))
        ids = torch.tensor([seq], device=device)
        rope, _ = model.model.get_rope_index(ids, mm_token_type_ids=(ids == SPECIAL.image).int(),
                                             image_grid_thw=grid)
    return seq[len(prompt.ids):], steps, rope[:, 0].cpu()


@pytest.mark.parametrize("backend", ["packed", "direct"])
def test_qwen2vl_greedy_tokens_equal_model_forward(device: str, backend: str) -> None:
    needs_kernels(device)
    done, stats, logits, runner, prompts = _run(device, backend)
    assert len(done) == 8, stats  # the workload ran to its end
    assert stats["preemptions"] >= 1 and stats["migrations"] >= 1, stats
    assert sum(p.has_images for p in prompts.values()) >= 6
    assert len({len(p.ids) for p in prompts.values()}) >= 5  # lengths vary
    assert max(len(p.ids) for p in prompts.values()) > 3 * PAGE  # prompts cross pages
    assert runner.padded_steps >= 1  # planes read at a padded width too
    model = _model(device)
    deltas = 0
    for req, (prompt_ids, generated) in sorted(done.items()):
        prompt = prompts[req]
        assert prompt_ids == prompt.ids
        key = (device, req, len(generated))  # the same request and length: the same oracle
        if key not in _ORACLES:
            _ORACLES[key] = _oracle(model, prompt, len(generated), device)
        want, steps, rope = _ORACLES[key]
        assert generated == want, (req, len(prompt.ids))
        for i, got in enumerate(steps):
            torch.testing.assert_close(logits[(req, len(prompt.ids) + i)], got,
                                       rtol=1e-4, atol=1e-4)
        # the planes the model read at every token it ran: the model's own rope index
        seen = sorted(j for r, j in runner.published if r == req)
        assert seen == list(range(len(prompt.ids) + len(generated) - 1)), req
        published = torch.tensor([runner.published[(req, j)] for j in seen]).T
        assert torch.equal(published, rope[:, : len(seen)]), req
        text = torch.arange(len(seen)).expand(3, -1)
        n = len(prompt.ids)
        # decode tokens: every plane the text position plus the request's delta
        assert torch.equal(published[:, n:], text[:, n:] + prompt.delta), req
        if prompt.has_images:  # MRoPE planes that are no text positions
            image = torch.tensor(prompt.ids) == SPECIAL.image
            assert not torch.equal(published[:, :n], text[:, :n]), req
            assert not torch.equal(published[1:, :n][:, image],
                                   published[0, :n][image].expand(2, -1)), req
        else:
            assert torch.equal(published, text), req
        deltas += prompt.delta != 0
    assert deltas >= 4  # most requests' decode planes are shifted


def test_qwen2vl_packed_equals_direct(device: str) -> None:
    """The two backends publish the same planes and give bit-identical logits (the runs
    of the oracle test, when it ran first in this process)."""
    needs_kernels(device)
    packed, direct = _run(device, "packed"), _run(device, "direct")
    assert packed[0] == direct[0]
    assert packed[3].published == direct[3].published
    for key, got in packed[2].items():
        assert torch.equal(got, direct[2][key]), key


def test_select_mrope_positions_matches_the_rotary_sections(device: str) -> None:
    """The planes' first consumer (``select_mrope_positions``: each rotary frequency's
    position) picks what the model's rotary embedding picks: its
    ``recomposition_frequencies`` over the same planes, at the model's ``mrope_section``."""
    needs_kernels(device)
    rotary = _model(device).model.language_model.rotary_emb
    sections = tuple(int(s) for s in rotary.mrope_section)
    rng = np.random.default_rng(7)
    planes = torch.from_numpy(make_prompt(rng, SPECIAL, HIDDEN, 4, text_only=False).planes)
    planes = planes.contiguous().to(device)
    n, half = planes.shape[1], sum(sections)
    out = torch.full((n, half), -1, dtype=torch.int64, device=device)
    got = select_mrope_positions(planes, sections, out, n)
    want = rotary.recomposition_frequencies(planes[:, None, :, None].expand(3, 1, n, half))
    assert torch.equal(got.cpu(), want[0, :, :half].cpu())
    assert not torch.equal(got[:, 0], got[:, -1])  # the sections read different planes
