"""The decode runner for MLA models: ``token_inputs`` + ``mla_decode`` instead of one MHA group.

:class:`DecodeRunner` publishes a decode step with the fused :class:`DecodeStepInputs`,
which produces the plain ``mha_decode`` group only. An MLA model needs the MLA members
(KV slots, pages and positions at MLA's page size, plus each request's last-page length),
so this runner composes what the adapters' docstrings name for a two-group step: the token
half :class:`TokenStepInputs` (sampling, ids, deferred sources, query prefix: one producer
call, group ``token_inputs``) and :class:`MlaDecodeInputs` (group ``mla_decode``). Per
decode step::

    state.begin()
    token_step.prepare(batch, padded); mla.prepare(batch, padded)
    state.publish("token_inputs"); state.publish("mla_decode"); state.finish()
    token assembly -> KV-index generation at MLA's page size     (first consumers)
    model (eager, or its captured graph per padded size on CUDA) -> sampler

``combine=True`` runs the library's fused MLA step instead,
:class:`~h2d_runner_adapters.MlaDecodeStepInputs`: one producer call and one group,
``mla_decode_step`` (one DMA and one scatter a step, the analogue of the MHA runner's fused
``decode_step``). Prefill is the parent's: ``PrefillInputs`` at the same page size,
chunked, published with the token groups as one fused ``prefill_step``
(:class:`~h2d_runner_adapters.PrefillStepInputs`; the query prefix joins the model's
inputs: the MLA decoder bounds keys by lengths and that prefix).
``pad_eager`` pads eager decode steps to the scheduler's graph size too, so a CPU run (no
graphs) still reads the padded rows the library publishes for a graph (no pages, no KV
write, last-page length 0).
"""

from __future__ import annotations

from typing import Any

import torch

from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    MLA_DECODE,
    MLA_DECODE_STEP,
    TOKEN_INPUTS,
    DecodePlan,
    MlaDecodeInputs,
    MlaDecodeStepInputs,
    PrefillInputs,
    PrefillPlan,
    PrefillStepInputs,
    ScheduledBatch,
    TokenPlan,
    TokenStepInputs,
)

from .deepseek import MlaDecoderInputs
from .model import DecoderInputs
from .runner import PREFILL_STEP, DecodeRunner, RunnerConfig


class MlaDecodeRunner(DecodeRunner):
    """:class:`DecodeRunner` whose decode steps publish MLA metadata (see the module
    docstring). ``model``: a decoder that reads :class:`MlaDecoderInputs`, e.g.
    :class:`~decode_runner.deepseek.DeepseekV3PagedDecoder`. No ATOM-style or TBO mode."""

    decode: MlaDecodeInputs

    def __init__(self, cfg: RunnerConfig, device: str | torch.device, backend: str, *,
                 model: Any, pad_eager: bool = False, combine: bool = False) -> None:
        self.pad_eager = pad_eager
        self.combine = combine
        super().__init__(cfg, device, backend, model=model)

    def _declare(self, st: H2DRunnerState, tbo: bool) -> None:
        caps: dict[str, Any] = {"max_reqs": self.cfg.max_reqs,
                                "max_tokens": self.cfg.max_tokens}
        shape = self.step_shape
        self.publish_groups = ((MLA_DECODE_STEP,) if self.combine
                               else (TOKEN_INPUTS, MLA_DECODE))
        self.fused_step: MlaDecodeStepInputs | None = None
        if self.combine:  # sampling, tokens and MLA decode: one producer call, one group
            self.fused_step = MlaDecodeStepInputs(st, shape)
            self.sampling, self.tokens = self.fused_step.sampling, self.fused_step.tokens
            self.decode = self.fused_step.decode
        else:
            self.token_step = TokenStepInputs(st, **caps)
            self.sampling, self.tokens = self.token_step.sampling, self.token_step.tokens
            self.decode = MlaDecodeInputs(st, shape)
        self.prefill = PrefillInputs(st, shape, last_page_lens=True)
        self.prefill_step = PrefillStepInputs.from_adapters(
            self.sampling, self.tokens, self.prefill, group=PREFILL_STEP)
        self.ubatches = []

    def _decode_inputs(self, d: Any, rows: int, first_token: int) -> DecoderInputs:
        return MlaDecoderInputs(
            input_ids=self.tokens.input_ids.gpu[first_token:first_token + rows],
            positions=d.positions.gpu[:rows],
            slot_mapping=d.slot_mapping.gpu[:rows],
            token_request=self.token_rows[:rows],
            kv_indptr=d.kv_indptr.gpu[: rows + 1],
            kv_indices=d.kv_indices,
            context_lens=d.context_lens.gpu[:rows],
            query_start=self.tokens.cu_seqlens_q.gpu[: rows + 1],
            kv_last_page_lens=d.kv_last_page_lens.gpu[:rows],
        )

    def _capture(self) -> None:
        self.decode.kv_last_page_lens.gpu.zero_()  # capture over rows that own nothing
        super()._capture()

    def _prefill_inputs(self, batch: ScheduledBatch, pplan: PrefillPlan) -> DecoderInputs:
        # the chunk's visible lengths as MLA kernels read them: pages and last-page lengths
        last = self.prefill.kv_last_page_lens
        assert last is not None  # declared with last_page_lens=True
        return MlaDecoderInputs(**self._prefill_fields(pplan),
                                kv_last_page_lens=last.gpu[: pplan.num_reqs])

    def _prepare_decode(self, batch: ScheduledBatch, padded: int | None
                        ) -> tuple[TokenPlan, DecodePlan]:
        if self.fused_step is not None:  # one producer call
            plan = self.fused_step.prepare(batch, padded)
            self._sampling_plan = plan.sampling
            return plan.tokens, plan.decode
        tok = self.token_step.prepare(batch, padded)
        self._sampling_plan = tok.sampling
        return tok.tokens, self.decode.prepare(batch, padded)
