"""Multimodal prompts for the Qwen2-VL runner: text with image placeholder runs.

An engine meets an image prompt already tokenized (``<|vision_start|>``, one image
placeholder token per merged patch, ``<|vision_end|>``) with the image's grid and its
vision-tower features. It computes the prompt's MRoPE positions itself (three planes:
time, height, width) and the request's position delta, then hands both to the library:
the planes to the prefill adapter, the delta to every decode step. This module is that
engine side, written independently of transformers' ``get_rope_index`` (the oracle's), so
the test checks the published planes against the model's own rope index instead of
against a copy of it.

:class:`MultimodalScheduler` is the integration scheduler with such prompts: the same
events (chunked prefill, page crossings, preemption with recompute, migrations,
reordering), its prompts drawn here per request from the request id, so the schedule
stays a function of the config.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .scheduler import Scheduler, SchedulerConfig, _Request

#: (t, h, w) patch grids an image may have; merged 2x2, they give t*h*w/4 placeholders
GRIDS: tuple[tuple[int, int, int], ...] = ((1, 4, 6), (1, 6, 4), (1, 4, 4), (1, 8, 6),
                                           (2, 4, 4), (1, 2, 8))
MERGE = 2  # the vision config's spatial_merge_size


@dataclass(frozen=True)
class SpecialTokens:
    """The config's placeholder and delimiter ids; ordinary text draws below ``image``."""

    image: int
    vision_start: int
    vision_end: int


@dataclass(frozen=True)
class MultimodalPrompt:
    """One request's prompt and what the engine derives from it.

    * ``planes``: int64 ``[3, len(ids) + max_new]``: the prompt's MRoPE positions, then
      the positions of tokens generated after it (every plane ``index + delta``), so a
      recomputed prefill (prompt plus outputs) reads its columns too;
    * ``delta``: ``max(prompt planes) + 1 - len(ids)``, the shift of every later position;
    * ``feature_index``: per prompt token, its row of ``features`` (-1: a text token);
    * ``features``: float32 ``[images' placeholders, hidden]``, the fixed stand-in for the
      vision tower's output.
    """

    ids: list[int]
    grids: list[tuple[int, int, int]]
    planes: np.ndarray
    delta: int
    feature_index: np.ndarray
    features: torch.Tensor

    @property
    def has_images(self) -> bool:
        return bool(self.grids)


def engine_planes(ids: list[int], image_token: int, grids: list[tuple[int, int, int]],
                  extra: int) -> tuple[np.ndarray, int]:
    """The engine's MRoPE planes of ``ids`` (Qwen2-VL's rule) plus ``extra`` text columns,
    and the delta: text tokens advance all three planes by one; an image run of grid
    ``(t, h, w)`` merged ``MERGE`` x ``MERGE`` starts at the running position ``p`` with
    time ``p + i_t``, height ``p + i_h``, width ``p + i_w`` and moves ``p`` on by
    ``max(h, w) / MERGE``."""
    cols: list[tuple[int, int, int]] = []
    pos = 0
    i = 0
    grid_iter = iter(grids)
    while i < len(ids):
        if ids[i] != image_token:
            cols.append((pos, pos, pos))
            pos += 1
            i += 1
            continue
        t, h, w = next(grid_iter)
        gh, gw = h // MERGE, w // MERGE
        cols.extend((pos + a, pos + b, pos + c) for a in range(t) for b in range(gh)
                    for c in range(gw))
        i += t * gh * gw
        pos += max(gh, gw)
    planes = np.array(cols, dtype=np.int64).T.reshape(3, len(ids))
    delta = int(planes.max()) + 1 - len(ids) if ids else 0
    tail = np.arange(len(ids), len(ids) + extra, dtype=np.int64) + delta
    return np.concatenate([planes, np.broadcast_to(tail, (3, extra))], axis=1), delta


def make_prompt(rng: np.random.Generator, tokens: SpecialTokens, hidden: int,
                max_new: int, text_only: bool) -> MultimodalPrompt:
    """A prompt of up to three text runs with up to two images between them (none when
    ``text_only``), its engine-side planes and delta, and fixed random image features."""
    images = 0 if text_only else int(rng.integers(1, 3))
    ids: list[int] = []
    grids: list[tuple[int, int, int]] = []
    for k in range(images + 1):
        ids += rng.integers(1, tokens.image, size=int(rng.integers(1, 9))).tolist()
        if k < images:
            grid = GRIDS[int(rng.integers(len(GRIDS)))]
            grids.append(grid)
            count = grid[0] * (grid[1] // MERGE) * (grid[2] // MERGE)
            ids += [tokens.vision_start, *[tokens.image] * count, tokens.vision_end]
    planes, delta = engine_planes(ids, tokens.image, grids, max_new)
    is_image = np.array(ids) == tokens.image
    feature_index = np.where(is_image, np.cumsum(is_image) - 1, -1)
    gen = torch.Generator().manual_seed(int(rng.integers(2**31)))
    features = torch.randn(int(is_image.sum()), hidden, generator=gen)
    return MultimodalPrompt(ids, grids, planes, delta, feature_index, features)


class MultimodalScheduler(Scheduler):
    """:class:`Scheduler` whose requests carry :func:`make_prompt` prompts; every
    ``text_every``-th request is text only (its planes: ordinary positions, delta 0).
    ``prompts`` maps request ids to their :class:`MultimodalPrompt`."""

    def __init__(self, config: SchedulerConfig, tokens: SpecialTokens, hidden: int,
                 text_every: int = 5) -> None:
        super().__init__(config)
        self.special = tokens
        self.hidden = hidden
        self.text_every = text_every
        self.prompts: dict[int, MultimodalPrompt] = {}

    def _new_request(self) -> _Request:
        req = super()._new_request()  # output length and sampling from the schedule's rng
        rng = np.random.default_rng((self.config.seed, req.req_id))
        prompt = make_prompt(rng, self.special, self.hidden, self.config.output_len[1],
                             text_only=req.req_id % self.text_every == self.text_every - 1)
        self.prompts[req.req_id] = prompt
        req.tokens = list(prompt.ids)
        return req
