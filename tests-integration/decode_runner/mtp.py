"""Speculative decoding (MTP/EAGLE-style verify + draft loop) on the paged decoder.

Each iteration, for every request (``c`` tokens committed, a pending token and ``k``
drafts on the device)::

    verify step   one publication: sampling, token ids (all deferred: assembled from the
                  device's pending rows), query prefix, speculative indices, MHA decode
                  metadata (and GDN state indices): one DMA + one scatter (packed)
                  -> token assembly, KV-index generation, the target model over k + 1
                  tokens, draft-ID gather, the target's argmax, the bonus rows through the
                  sampler, acceptance (accepted / rejected counts on the device)
    draft loop    step 0: the draft model over the verify tokens (its own KV cache);
                  steps 1..k: metadata from MhaDraftLoop.advance (GPU only: no upload, no
                  readback), the draft model on one token per request, greedy proposals
                  into the pending rows

At the end of an iteration the host reads the accepted counts and emitted tokens (an
engine's event-gated async copy) to schedule the next one. With ``gdn=True`` a GDN state
stand-in runs: speculative state indices with the accepted counts ride in the verify
group; the bonus logits add the state row :meth:`GdnStateInputs.gather_states` selects,
and each group's slots then take the decayed state.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from block_tables import BlockTable
from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    DECODE_STEP,
    GDN_STATE,
    BatchColumns,
    DecodeStepInputs,
    DecodeStepPlan,
    GdnPlan,
    GdnStateInputs,
    MhaDraftLoop,
    ScheduledBatch,
    StepShape,
    accept_draft_tokens,
)

from .model import DecoderInputs, TinyDecoder, TinyDecoderConfig, greedy


@dataclass(frozen=True)
class MtpConfig:
    num_reqs: int = 4
    k: int = 1
    page_size: int = 8
    num_pages: int = 200
    max_pages_per_req: int = 48
    vocab: int = 256
    hidden: int = 32
    layers: int = 1
    heads: int = 2
    head_dim: int = 16
    dtype: torch.dtype = torch.float32
    gdn: bool = False
    #: the draft model shares the target's weights; its proposals add this scale times a
    #: fixed random bias, so some drafts are rejected and some accepted
    draft_bias: float = 1.0
    seed: int = 0
    scatter: str = "auto"
    #: tokens each request holds before the first iteration (their K/V are the cache's
    #: initial zeros; the benchmark's long contexts), pages allocated up front
    initial_context: int = 0


class MtpRunner:
    """The verify + draft loop over one :class:`H2DRunnerState` (see the module doc)."""

    def __init__(self, cfg: MtpConfig, device: str | torch.device, backend: str, *,
                 models: tuple[Any, Any] | None = None) -> None:
        """``models``: the (target, draft) decoders (``TinyDecoder``'s interface, e.g. two
        :class:`~decode_runner.llama.LlamaPagedDecoder` over one model, each with its own
        KV cache); None builds the stand-ins from ``cfg``."""
        self.cfg = cfg
        dev = self.device = torch.device(device)
        n, k = cfg.num_reqs, cfg.k
        st = self.state = H2DRunnerState(dev, backend=backend, scatter=cfg.scatter)
        self.gdn = (GdnStateInputs(st, max_reqs=n, num_spec=k, num_state_slots=n * (k + 1))
                    if cfg.gdn else None)
        self.step = DecodeStepInputs(st,
                                     StepShape(max_reqs=n, max_tokens=n * (k + 1),
                                               max_pages_per_req=cfg.max_pages_per_req,
                                               page_size=cfg.page_size, num_pages=cfg.num_pages),
                                     max_drafts=k, extra_groups=[GDN_STATE] if cfg.gdn else ())
        st.bind()
        self.loop = MhaDraftLoop(self.step.decode, self.step.tokens)
        mcfg = TinyDecoderConfig(vocab=cfg.vocab, hidden=cfg.hidden, layers=cfg.layers,
                                 heads=cfg.heads, head_dim=cfg.head_dim,
                                 page_size=cfg.page_size, num_pages=cfg.num_pages,
                                 dtype=cfg.dtype)
        if models is None:
            models = (TinyDecoder(mcfg, dev, seed=cfg.seed + 1, max_pages=cfg.max_pages_per_req),
                      TinyDecoder(mcfg, dev, seed=cfg.seed + 1, max_pages=cfg.max_pages_per_req))
        self.target, self.draft = models

        def i32(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int32, device=dev)

        # the pending token and k drafts per request: token assembly's deferred source
        gen = torch.Generator().manual_seed(cfg.seed)
        self.pending = torch.randint(0, cfg.vocab, (n, k + 1), generator=gen,
                                     dtype=torch.int32).to(dev)
        self.prompts = self.pending[:, 0].cpu().tolist()
        self.out_tokens, self.accepted, self.rejected = i32(n, k + 1), i32(n), i32(n)
        self.draft_ids = i32(n * k)
        self.rows = torch.arange(n, dtype=torch.int32, device=dev)
        self.token_rows = self.rows.repeat_interleave(k + 1)
        self.noise = torch.zeros(n, cfg.vocab, device=dev)
        self.bias = (cfg.draft_bias * torch.randn(n, cfg.vocab, generator=gen)).to(dev)
        if self.gdn is not None:
            self.pool = torch.randn(n * (k + 1), cfg.vocab, generator=gen).to(dev)
            self.state_rows = torch.zeros(n, cfg.vocab, device=dev)
        # host bookkeeping
        self.ctx = np.full(n, cfg.initial_context, np.int32)  # committed (KV kept)
        self.tables = [BlockTable() for _ in range(n)]
        self.next_page = 0
        #: host ns of the last verify step's metadata work (begin..finish, less the wait)
        self.host_metadata_ns = 0
        #: when set (CUDA): events around the verify step's first publication work .. the
        #: target model's first kernel (run eagerly)
        self.span_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        #: the main job's ATOM-style baseline: when set, the verify step calls it (batch,
        #: page lists) instead of the library's publication; the first consumers, models,
        #: acceptance and draft loop then run over the destinations as last published (its
        #: values are not consumed)
        self.metadata_hook: Callable[[ScheduledBatch, list[list[int]]], int | None] | None = None
        self._last_plan: DecodeStepPlan | None = None
        self.lists: list[list[int]] = [[] for _ in range(n)]
        self._last_gplan: GdnPlan | None = None
        self.last_accepted = np.zeros(n, np.int32)
        self.sequences: list[list[int]] = [[p] for p in self.prompts]
        self.iterations = 0

    def _reserve(self) -> None:
        """Pages for the verify tokens and the draft loop's positions."""
        cfg = self.cfg
        for i, c in enumerate(self.ctx.tolist()):
            need = -(-(c + 2 * cfg.k + 2) // cfg.page_size) - len(self.tables[i])
            if need > 0:
                row = self.tables[i].lineage_copy()
                pages = [(self.next_page + j) % cfg.num_pages for j in range(need)]
                row.append(pages)
                self.next_page += need
                self.tables[i] = row
                self.lists[i] = [*self.lists[i], *pages]

    def iterate(self) -> torch.Tensor:
        """One verify step and its draft loop; returns the verify step's logits."""
        cfg, st, step = self.cfg, self.state, self.step
        n, k = cfg.num_reqs, cfg.k
        q = k + 1
        self._reserve()
        cols = BatchColumns(
            query_lens=np.full(n, q, np.int32), context_lens=self.ctx + q,
            temperatures=np.zeros(n, np.float32), top_k=np.full(n, -1, np.int32),
            top_p=np.ones(n, np.float32), prev_sample_rows=np.arange(n, dtype=np.int32),
            token_ids=np.zeros(n * q, np.int32), num_drafts=np.full(n, k, np.int32))
        batch = ScheduledBatch((), False, cfg.page_size, given_columns=cols,
                               given_block_tables=list(self.tables), step=self.iterations)
        events = self.span_events
        gplan = None
        hooked = self.metadata_hook is not None and self._last_plan is not None
        if hooked:
            if events is not None:
                events[0].record()
            t0 = time.perf_counter_ns()
            # the ns it waited for a free source set: left out
            waited = self.metadata_hook(batch, self.lists)
            self.host_metadata_ns = time.perf_counter_ns() - t0 - (waited or 0)
            plan, gplan = self._last_plan, self._last_gplan
        else:
            t0 = time.perf_counter_ns()
            st.begin()
            plan = step.prepare_verify(batch)  # the step and its verification indices
            if self.gdn is not None:
                gplan = self.gdn.prepare(np.arange(n, dtype=np.int32),
                                         num_accepted=self.last_accepted + 1)
            if events is not None:
                events[0].record()
            st.publish(DECODE_STEP)
            st.finish()
            self._last_plan, self._last_gplan = plan, gplan
        # -- verify: first consumers, the target model, sampling and acceptance
        tok, dec = step.tokens, step.decode
        ids = tok.assemble(plan.tokens, self.pending)
        dec.generate_kv_indices(plan.decode)
        if not hooked:
            # timed to the first consumers enqueued: the ATOM-style hook builds those arrays
            # on its host inside its timed region
            self.host_metadata_ns = time.perf_counter_ns() - t0 - st.last_source_wait_ns
        t = n * q
        inputs = DecoderInputs(
            input_ids=ids, positions=dec.positions.gpu[:t], slot_mapping=dec.slot_mapping.gpu[:t],
            token_request=self.token_rows, kv_indptr=dec.kv_indptr.gpu[: n + 1],
            kv_indices=dec.kv_indices, context_lens=dec.context_lens.gpu[:n])
        if events is not None:
            self.target.embed.index_select(0, ids.long())  # the model's first kernel
            events[1].record()
        logits = self.target(inputs)
        drafts = tok.gather_drafts(plan.tokens, self.draft_ids)
        target_argmax = torch.argmax(logits.index_select(0, tok.target_logits_indices.gpu[
            : n * k]), dim=-1)
        bonus_logits = logits.index_select(0, tok.bonus_logits_indices.gpu[:n])
        if self.gdn is not None and gplan is not None:
            state = self.gdn.gather_states(gplan, self.pool, self.state_rows)
            bonus_logits = bonus_logits + 0.5 * state
            assert self.gdn.spec is not None
            slots = self.gdn.spec.gpu[:n].reshape(-1).long()
            self.pool.index_copy_(0, slots, (0.9 * state).repeat_interleave(q, dim=0))
        bonus = step.sampling.sample(bonus_logits, plan.sampling, self.noise)
        accept_draft_tokens(drafts, target_argmax, tok.cu_num_draft_tokens.gpu, bonus,
                            self.out_tokens, self.accepted, self.rejected, num_reqs=n)
        # -- the draft loop: step 0 over the verify tokens, then k steps with no upload
        self.draft(inputs)
        token = self.out_tokens.gather(1, self.accepted.long()[:, None]).squeeze(1)
        self.pending[:, 0] = token
        for s in range(1, k + 1):
            meta = self.loop.advance(plan.decode, self.rejected, s)
            d_inputs = DecoderInputs(
                input_ids=token, positions=meta.positions[:n],
                slot_mapping=meta.slot_mapping[:n], token_request=self.rows,
                kv_indptr=meta.kv_indptr[: n + 1], kv_indices=self.loop.kv_indices,
                context_lens=meta.context_lens[:n])
            token = greedy(self.draft(d_inputs) + self.bias)
            self.pending[:, s] = token
        # -- the host learns the outcome (an engine's event-gated async copy)
        acc = self.accepted.cpu().numpy()
        out = self.out_tokens.cpu().tolist()
        for i, a in enumerate(acc.tolist()):
            self.sequences[i] += out[i][: a + 1]
        self.ctx += (1 + acc).astype(np.int32)
        self.last_accepted = acc.astype(np.int32)
        self.iterations += 1
        return logits
