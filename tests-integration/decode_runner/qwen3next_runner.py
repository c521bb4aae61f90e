"""The decode runner for a GDN hybrid: MHA metadata plus the GDN state indices, one group.

:class:`DecodeRunner`'s steps with :class:`GdnStateInputs` riding in both step groups (its
docstring's ``DecodeStepInputs(..., extra_groups=[GDN_STATE])``, and the prefill step's
combined group): one DMA and one scatter a step. Per step::

    state.begin()
    prefill: the fused PrefillStepInputs                    | decode: the fused DecodeStepInputs
    gdn.prepare(state groups of the batch's requests, padded)
    state.publish(<step group>); state.finish()
    token assembly -> attention preparation / KV-index generation
    gdn.gather_states(plan, pool, rows)   (first reader: each row's initial state row)
    model (reads the gathered rows, writes final states to ``non_spec_state_indices``)

State groups are the engine's (this runner's allocator): a request gets a free group when
first scheduled and keeps it until :meth:`release` (its finish), whereupon the group's slot
is poisoned and handed out again. A prefix fork (:attr:`forks`, set by the engine before
the forked request's first prefill) publishes the source request's group as the row's fork
source: the row reads the source's slot (``non_spec_state_indices_in``) and writes its own.
A recompute preemption keeps the group: the re-prefill starts at position 0, where the
model takes zero state. ``pad_eager`` pads eager decode steps to the scheduler's graph
size, so padded rows (state index -1) run on CPU too.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np
import torch

from h2d_core import H2DRunnerState
from h2d_runner_adapters import (
    GDN_STATE,
    DecodePlan,
    GdnStateInputs,
    PrefillPlan,
    ScheduledBatch,
    TokenPlan,
)

from .model import DecoderInputs
from .qwen3next import GdnDecoderInputs
from .runner import DecodeRunner, RunnerConfig


class Qwen3NextRunner(DecodeRunner):
    """:class:`DecodeRunner` publishing GDN state indices (see the module docstring).
    ``model``: a :class:`~decode_runner.qwen3next.Qwen3NextPagedDecoder` whose state pool
    has ``num_state_groups`` slots. No ATOM-style, TBO or graph mode."""

    def __init__(self, cfg: RunnerConfig, device: str | torch.device, backend: str, *,
                 model: Any, num_state_groups: int, pad_eager: bool = False) -> None:
        assert model.num_state_slots == num_state_groups
        self.pad_eager = pad_eager
        self.num_state_groups = num_state_groups
        # the engine's state-group allocator
        self.groups: dict[int, int] = {}
        self.free_groups = list(range(num_state_groups))[::-1]  # pop(): lowest first
        #: every state group handed out again after a release
        self.reused_groups = 0
        self._ever: set[int] = set()
        #: prefix forks the engine asks for: request id -> the request whose state it
        #: starts from (its next prefill reads that request's slot, then the entry goes)
        self.forks: dict[int, int] = {}
        #: decode steps whose rows exceeded the real requests (padded state indices -1)
        self.padded_steps = 0
        super().__init__(cfg, device, backend, model=model)
        self.state_rows = torch.zeros(cfg.max_reqs, model.state_width, device=self.device)

    def _declare(self, st: H2DRunnerState, tbo: bool) -> None:
        # the GDN group first: the decode and prefill steps combine it
        self.gdn = GdnStateInputs(st, max_reqs=self.cfg.max_reqs,
                                  num_state_slots=self.num_state_groups)
        self.step_extra_groups = (GDN_STATE,)
        super()._declare(st, tbo)  # the plain MHA step and prefill, the GDN group in both


    # -- the engine's state groups -----------------------------------------------------------
    def _state_groups(self, batch: ScheduledBatch) -> np.ndarray:
        out = []
        for r in batch.requests:
            g = self.groups.get(r.req_id)
            if g is None:
                if not self.free_groups:
                    raise RuntimeError("state pool exhausted: more live requests than groups")
                g = self.groups[r.req_id] = self.free_groups.pop()  # the latest freed first
                self.reused_groups += g in self._ever
                self._ever.add(g)
            out.append(g)
        return np.array(out, np.int32)

    def _fork_sources(self, batch: ScheduledBatch) -> np.ndarray | None:
        if not any(r.req_id in self.forks for r in batch.requests):
            return None
        return np.array([self.groups[self.forks.pop(r.req_id)] if r.req_id in self.forks
                         else -1 for r in batch.requests], np.int32)

    def release(self, req_ids: Any) -> None:
        """Finished requests give their state groups back (their slots become garbage)."""
        freed = [self.groups.pop(i) for i in req_ids if i in self.groups]
        self.model.poison_slots(freed)
        self.free_groups.extend(freed)

    def _with_states(self, base: DecoderInputs, plan: Any) -> GdnDecoderInputs:
        rows = base.num_rows
        pool = self.model.state_pool[: self.model.num_state_slots]  # the trash row left out
        self.gdn.gather_states(plan, pool, self.state_rows)  # the first reader
        return GdnDecoderInputs(**{f.name: getattr(base, f.name) for f in fields(base)},
                                initial_states=self.state_rows[:rows],
                                state_write=self.gdn.non_spec.gpu[:rows])

    # -- steps -------------------------------------------------------------------------------
    def _prepare_prefill(self, batch: ScheduledBatch) -> tuple[TokenPlan, PrefillPlan]:
        tplan, pplan = super()._prepare_prefill(batch)
        self._prefill_gdn = self.gdn.prepare(self._state_groups(batch),
                                             fork_sources=self._fork_sources(batch))
        return tplan, pplan

    def _prefill_inputs(self, batch: ScheduledBatch, pplan: PrefillPlan) -> DecoderInputs:
        return self._with_states(DecoderInputs(**self._prefill_fields(pplan)),
                                 self._prefill_gdn)

    def _prepare_decode(self, batch: ScheduledBatch, padded: int | None
                        ) -> tuple[TokenPlan, DecodePlan]:
        tplan, dplan = super()._prepare_decode(batch, padded)
        self._decode_gdn = self.gdn.prepare(self._state_groups(batch), padded=padded)
        return tplan, dplan

    def _decoded(self, batch: ScheduledBatch, dplan: DecodePlan) -> None:
        assert self._decode_gdn.padded_reqs == dplan.padded_reqs
        self.padded_steps += dplan.padded_reqs > dplan.num_reqs

    def _decode_inputs(self, d: Any, rows: int, first_token: int) -> DecoderInputs:
        return self._with_states(super()._decode_inputs(d, rows, first_token),
                                 self._decode_gdn)
