"""The ATOM-style way to publish a decode step, for the main job's same-process baseline.

A thin binding of the one ATOM-style re-creation (``tests-integration/peers/atom_style.py``:
:class:`~peers.atom_style.MhaDecodeStep`, the catalogue's plain-MHA path, ten copies) to
the library's destinations: a :class:`DecodeRunner`'s, or any owner of ``sampling`` /
``tokens`` / ``decode`` adapters (``DecodeStepInputs``). The same first consumers (token
assembly, KV-index generation) and the same model graphs run after it, and a step's logits
must equal the packed step's bit for bit (the tests check it).

The scheduler's side, each request's pages as a Python list, is :meth:`sync_lists`: it
runs outside the timed step. The wait for a free source set is reported apart
(``last_wait_ns``), as for the library.
"""

from __future__ import annotations

from typing import Any

import torch
from peers.atom_style import (
    AtomStyleError,
    MhaDecodeStep,
    MhaStaged,
    PageLists,
)

from h2d_runner_adapters import DecodePlan, SamplingPlan, ScheduledBatch, TokenPlan
from h2d_runner_adapters.consumers import GREEDY_TEMPERATURE

__all__ = ["AtomStyleDecode", "AtomStyleError", "destinations"]


def destinations(owner: Any) -> dict[str, torch.Tensor]:
    """The device tensors the library publishes a plain decode step into, keyed as
    :data:`~peers.atom_style.MHA_FIELDS` (``owner``: a runner or ``DecodeStepInputs``)."""
    tok, dec = owner.tokens, owner.decode
    return {
        "temperatures": owner.sampling.temperatures.gpu, "input_ids": tok.input_ids.gpu,
        "decode_cu": tok.decode_cu.gpu, "decode_src": tok.decode_src.gpu,
        "slot_mapping": dec.slot_mapping.gpu, "context_lens": dec.context_lens.gpu,
        "cu_seqlens_q": tok.cu_seqlens_q.gpu, "block_tables": dec.block_tables.gpu,
        "kv_indptr": dec.kv_indptr.gpu, "positions": dec.positions.gpu,
    }


class AtomStyleDecode:
    """The ATOM-style decode step into ``owner``'s destinations (a :class:`DecodeRunner`,
    whose ``cfg.page_size`` is used, or ``DecodeStepInputs`` with ``page_size`` given)."""

    def __init__(self, owner: Any, num_sets: int = 2, *, page_size: int | None = None) -> None:
        ps = page_size if page_size is not None else owner.cfg.page_size
        self.step = MhaDecodeStep(destinations(owner), ps, num_sets,
                                  greedy_temperature=GREEDY_TEMPERATURE)
        self.page_lists = PageLists()
        self._staged: MhaStaged | None = None

    @property
    def lists(self) -> list[list[int]]:
        """Each request's pages as a Python list (the engine's per-sequence block table)."""
        return self.page_lists.lists

    @property
    def last_wait_ns(self) -> int:
        return self.step.last_wait_ns

    def sync_lists(self, batch: ScheduledBatch) -> None:
        """The scheduler's bookkeeping, outside the timed step: each row's page list follows
        its block table (:class:`~peers.atom_style.PageLists`)."""
        self.page_lists.sync(batch.block_tables)

    def stage(self, batch: ScheduledBatch,
              padded: int | None) -> tuple[SamplingPlan, TokenPlan, DecodePlan]:
        """Build the ten arrays on the host (:meth:`copy` uploads them); returns the plans
        the first consumers and the sampler take."""
        cols = batch.columns
        n = cols.query_lens.size
        top_k, top_p = cols.top_k, cols.top_p
        if n and ((top_k != top_k[0]).any() or (top_p != top_p[0]).any()):
            raise AtomStyleError("the ATOM-style decode way models batch-uniform top-k/top-p")
        self._staged = staged = self.step.stage(cols, self.lists, padded)
        p = staged.padded_reqs
        sampling = SamplingPlan(n, int(top_k[0]) if n and top_k[0] > 0 else None,
                                float(top_p[0]) if n and top_p[0] < 1.0 else None, False, False)
        return (sampling, TokenPlan(n, p, n, p, 0),
                DecodePlan(n, p, 1, n, p, staged.num_pages, "atom"))

    def copy(self) -> None:
        """One copy per array of what :meth:`stage` built."""
        if self._staged is None:
            raise AtomStyleError("nothing staged: call stage(batch, padded) before copy()")
        self.step.copy(self._staged)
        self._staged = None

    def publish(self, batch: ScheduledBatch,
                padded: int | None) -> tuple[SamplingPlan, TokenPlan, DecodePlan]:
        """:meth:`stage` then :meth:`copy`."""
        plans = self.stage(batch, padded)
        self.copy()
        return plans
