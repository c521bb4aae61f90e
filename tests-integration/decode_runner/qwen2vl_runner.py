"""The decode runner for an MRoPE model: prompt planes at prefill, deltas at decode.

:class:`DecodeRunner` publishes decode steps with the fused :class:`DecodeStepInputs`,
which publishes 1-D positions and refuses an MRoPE decode adapter. So this runner composes
the adapters the way that refusal says (as :class:`~decode_runner.mla_runner.MlaDecodeRunner`
does for MLA): the token half :class:`TokenStepInputs` (group ``token_inputs``) and
``MhaDecodeInputs(mrope=True)`` (group ``mha_decode``, its ``mrope_positions`` planes in
place of ``positions``), and ``PrefillInputs(mrope=True)`` in the fused
:class:`~h2d_runner_adapters.PrefillStepInputs` for prefill. Per step::

    prefill: state.begin();
             prefill_step.prepare(batch, mrope_positions=<each request's [3, L] planes>)
             publish "prefill_step"; finish; assembly; attention preparation
    decode:  state.begin(); token_step.prepare(batch, padded);
             decode.prepare(batch, padded, mrope_deltas=<each request's delta>)
             publish "token_inputs", "mha_decode" (or one combined group); finish;
             assembly; KV-index generation

and the model reads the planes at the step's running width (``mrope_planes``: the
prefill chunk's token count, the decode step's padded token count). The prompts' planes
and deltas are the engine's (:mod:`.multimodal`); the image features of a prefill chunk's
placeholder tokens go to the model beside the metadata (an engine's encoder cache, not the
library's business). ``pad_eager`` pads eager decode steps to the scheduler's graph size,
so a CPU run reads planes at a padded width too.

``published`` records, for every real token the model ran, the planes it read, by
(request, sequence index): the test compares them with the model's own rope index.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    MHA_DECODE,
    TOKEN_INPUTS,
    DecodePlan,
    MhaDecodeInputs,
    PrefillInputs,
    PrefillPlan,
    PrefillStepInputs,
    ScheduledBatch,
    TokenPlan,
    TokenStepInputs,
)
from h2d_runner_adapters.mrope.inputs import mrope_planes

from .model import DecoderInputs
from .multimodal import MultimodalPrompt
from .qwen2vl import MropeDecoderInputs
from .runner import PREFILL_STEP, DecodeRunner, RunnerConfig

MROPE_STEP = "mrope_decode_step"
Planes = tuple[int, int, int]


class Qwen2VLRunner(DecodeRunner):
    """:class:`DecodeRunner` for an MRoPE model (see the module docstring). ``prompts``:
    request id -> :class:`MultimodalPrompt` (the scheduler's, filled as requests arrive).
    ``model``: a decoder reading :class:`MropeDecoderInputs`, e.g.
    :class:`~decode_runner.qwen2vl.Qwen2VLPagedDecoder`. No ATOM-style or TBO mode."""

    decode: MhaDecodeInputs

    def __init__(self, cfg: RunnerConfig, device: str | torch.device, backend: str, *,
                 model: Any, prompts: dict[int, MultimodalPrompt], pad_eager: bool = False,
                 combine: bool = False) -> None:
        self.prompts = prompts
        self.pad_eager = pad_eager
        self.combine = combine
        self.published: dict[tuple[int, int], Planes] = {}
        #: decode steps whose planes' width (their axis stride) exceeded the real tokens
        self.padded_steps = 0
        super().__init__(cfg, device, backend, model=model)

    def _declare(self, st: H2DRunnerState, tbo: bool) -> None:
        # the fused decode step refuses MRoPE: the token step and the MRoPE decode adapter
        caps: dict[str, Any] = {"max_reqs": self.cfg.max_reqs,
                                "max_tokens": self.cfg.max_tokens}
        shape = self.step_shape
        self.publish_groups = (MROPE_STEP,) if self.combine else (TOKEN_INPUTS, MHA_DECODE)
        self.token_step = TokenStepInputs(st, **caps)
        self.sampling, self.tokens = self.token_step.sampling, self.token_step.tokens
        self.decode = MhaDecodeInputs(st, shape, mrope=True)
        self.prefill = PrefillInputs(st, shape, mrope=True)
        token_groups = ["sampling", *self.tokens.producer_groups]
        if self.combine:
            st.combine(MROPE_STEP, [*token_groups, self.decode.group])
        self.prefill_step = PrefillStepInputs.from_adapters(
            self.sampling, self.tokens, self.prefill, group=PREFILL_STEP)
        self.ubatches = []

    def _decode_inputs(self, d: Any, rows: int, first_token: int) -> MropeDecoderInputs:
        """The decode step's inputs over fixed destinations; one token per request, so
        the running width (the planes' axis stride) is ``rows``."""
        assert d.mrope_positions is not None
        planes = mrope_planes(d.mrope_positions, rows)
        return MropeDecoderInputs(
            input_ids=self.tokens.input_ids.gpu[first_token:first_token + rows],
            positions=planes[0],  # unread: the planes rotate, the prefix and lengths bound
            slot_mapping=d.slot_mapping.gpu[:rows],
            token_request=self.token_rows[:rows],
            kv_indptr=d.kv_indptr.gpu[: rows + 1],
            kv_indices=d.kv_indices,
            context_lens=d.context_lens.gpu[:rows],
            query_start=self.tokens.cu_seqlens_q.gpu[: rows + 1],
            mrope_positions=planes,
        )

    def _capture(self) -> None:
        assert self.decode.mrope_positions is not None
        self.decode.mrope_positions.gpu.zero_()  # capture over rows that own nothing
        super()._capture()

    # -- the engine's per-request values -----------------------------------------------------
    def _deltas(self, batch: ScheduledBatch) -> np.ndarray:
        return np.array([self.prompts[r.req_id].delta for r in batch.requests], np.int64)

    def _prompt_planes(self, batch: ScheduledBatch) -> list[np.ndarray | None]:
        """Each request's prompt planes ``[3, len(prompt)]`` (None: text only, its ordinary
        positions). A recompute's re-prefill of generated tokens reads past them: the
        library extends them by the request's delta (``mrope_deltas``), as decode does."""
        out: list[np.ndarray | None] = []
        for r in batch.requests:
            p = self.prompts[r.req_id]
            out.append(p.planes[:, : len(p.ids)] if p.has_images else None)
        return out

    def _mm_embeds(self, batch: ScheduledBatch, tokens: int, hidden: int
                   ) -> torch.Tensor | None:
        """The chunk's image features, one row per token (zeros for text tokens)."""
        out = torch.zeros(tokens, hidden)
        start, found = 0, False
        for r in batch.requests:
            p = self.prompts[r.req_id]
            span = np.arange(r.first_position, r.context_len)
            index = np.where(span < len(p.ids), p.feature_index[np.minimum(span, len(p.ids)
                                                                            - 1)], -1)
            rows = np.nonzero(index >= 0)[0]
            if rows.size:
                out[start + rows] = p.features[index[rows]]
                found = True
            start += r.num_tokens
        return out.to(self.device) if found else None

    def _record(self, batch: ScheduledBatch, planes: torch.Tensor) -> None:
        cols = planes.cpu().T.tolist()
        t = 0
        for r in batch.requests:
            for j in range(r.first_position, r.context_len):
                self.published[(r.req_id, j)] = (cols[t][0], cols[t][1], cols[t][2])
                t += 1

    # -- steps -------------------------------------------------------------------------------
    def _prepare_prefill(self, batch: ScheduledBatch) -> tuple[TokenPlan, PrefillPlan]:
        plan = self.prefill_step.prepare(batch, mrope_positions=self._prompt_planes(batch),
                                         mrope_deltas=self._deltas(batch))
        self._sampling_plan = plan.sampling
        return plan.tokens, plan.prefill

    def _prefill_inputs(self, batch: ScheduledBatch, pplan: PrefillPlan) -> DecoderInputs:
        planes = self.prefill.mrope_planes(pplan)  # (3, t): the chunk's width
        self._record(batch, planes)
        fields = self._prefill_fields(pplan)
        fields["positions"] = planes[0]  # no 1-D positions are published with MRoPE
        return MropeDecoderInputs(
            **fields, mrope_positions=planes,
            mm_embeds=self._mm_embeds(batch, pplan.num_tokens, self.model.embed.shape[1]))

    def _prepare_decode(self, batch: ScheduledBatch, padded: int | None
                        ) -> tuple[TokenPlan, DecodePlan]:
        tok = self.token_step.prepare(batch, padded)
        self._sampling_plan = tok.sampling
        return tok.tokens, self.decode.prepare(batch, padded, mrope_deltas=self._deltas(batch))

    def _decoded(self, batch: ScheduledBatch, dplan: DecodePlan) -> None:
        assert dplan.padded_tokens == dplan.padded_reqs  # one token per request
        self._record(batch, self.decode.mrope_planes(dplan)[:, : dplan.num_tokens])
        self.padded_steps += dplan.padded_tokens > dplan.num_tokens
