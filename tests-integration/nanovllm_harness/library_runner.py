"""nano-vllm's metadata path through the library: a ``ModelRunner`` whose ``prepare_prefill``,
``prepare_decode`` and ``prepare_sample`` publish through one ``h2d_core.H2DRunnerState``.

Importing this module does not import nano-vllm:
:func:`library_runner_class` imports nano-vllm (through the flash-attn stand-in, unless it
is already imported) and builds the subclass; :func:`install` makes ``LLM`` construct it
(``LLMEngine.__init__`` looks ``ModelRunner`` up in ``nanovllm.engine.llm_engine``).

Per step (nano-vllm's ``run``: ``prepare_prefill`` or ``prepare_decode``, then
``prepare_sample``, the model, the sampler)::

    rows = lineages.rows(seqs)                  # seq.block_table lists -> BlockTable lineages
    state.begin()                               # this slot's sources are free
    plan = step.prepare(batch, ...)             # ONE producer call: sampling, ids, layout
    state.publish(group)                        # ONE DMA + ONE scatter
    state.finish()                              # records completion; never waits
    set_context(..views of the published destinations, sliced by host counts..)

``prepare_sample`` then publishes nothing: it hands out views of the same publication's
sampling members. What nano-vllm reads that the adapters do not publish comes from host
values (see :class:`LibraryModelRunner`), never from a second upload.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from block_tables import BlockTable


class SequenceLineages:
    """nano-vllm's per-sequence page lists as ``block_tables.BlockTable`` lineages.

    nano-vllm keeps a sequence's KV pages as the Python list ``seq.block_table``, mutated
    in place by its block manager: ``allocate`` fills it (prefix-cache hits first),
    ``may_append`` appends a page while decoding, ``deallocate`` clears it (finish or
    preemption; a preempted sequence is allocated again later, under the same ``seq_id``).
    The library prepares a row incrementally only for a lineage it saw before (same
    version, longer: only the new pages are copied and range-checked; same length: no
    page ID is read), so each sequence id keeps one ``BlockTable`` and its pages:

    * the list starts with the lineage's ``k`` pages and has more: the new ones are
      appended (the version stays);
    * the list equals the lineage: the same table;
    * anything else -- a first sight, a re-allocation (a prefix-cache hit, a different
      first block), a shrink -- starts a new lineage (a new version), never an append.

    Per row and step: one comparison of the list's first ``k`` entries. A lineage is
    dropped when its ``Sequence`` is garbage-collected.

    ``stale_on_rewrite`` is a MUTATION for tests only: a list that does not extend its
    lineage keeps the old lineage, and only the entries past its length are appended
    (a runner that forgets that a re-allocated sequence's pages changed).
    """

    def __init__(self, *, stale_on_rewrite: bool = False) -> None:
        self.stale_on_rewrite = stale_on_rewrite
        #: seq_id -> (its BlockTable, the pages it holds, as a list)
        self._lineages: dict[int, tuple[BlockTable, list[int]]] = {}

    def rows(self, seqs: Sequence[Any]) -> list[BlockTable]:
        """The batch's rows, in batch order (each sequence's current lineage)."""
        return [self.row(seq) for seq in seqs]

    def row(self, seq: Any) -> BlockTable:
        pages: list[int] = seq.block_table
        entry = self._lineages.get(seq.seq_id)
        if entry is not None:
            table, held = entry
            k = len(held)
            if len(pages) >= k and (pages[:k] == held or self.stale_on_rewrite):
                if len(pages) > k:
                    added = pages[k:]
                    table.append(added)
                    held.extend(added)
                return table
        else:  # first sight: forget the lineage with the sequence
            weakref.finalize(seq, self._lineages.pop, seq.seq_id, None)
        table = BlockTable(pages)
        self._lineages[seq.seq_id] = (table, list(pages))
        return table

    def __len__(self) -> int:
        return len(self._lineages)


def library_runner_class() -> type:
    """The ``ModelRunner`` subclass (imports nano-vllm, through the flash-attn stand-in
    unless it is imported already)."""
    import sys

    if "nanovllm" not in sys.modules:
        from .flash_attn_standin import import_nanovllm

        import_nanovllm()
    from nanovllm.engine.model_runner import ModelRunner
    from nanovllm.utils.context import set_context

    from h2d_core import H2DRunnerState, restore_implicit_cpu_default
    from h2d_runner_adapters import (
        DECODE_STEP,
        PREFILL_STEP,
        BatchColumns,
        DecodeStepInputs,
        MhaDecodeInputs,
        PrefillInputs,
        PrefillStepInputs,
        SamplingInputs,
        ScheduledBatch,
        StepShape,
        TokenInputs,
    )

    class LibraryModelRunner(ModelRunner):  # type: ignore[misc,valid-type]
        """nano-vllm's ``ModelRunner`` with its three ``prepare_*`` over the library.

        Capacities (one :class:`StepShape` for prefill and decode): ``max_num_seqs``
        requests, ``max_num_batched_tokens`` tokens, ``ceil(max_model_len / block)``
        pages of ``kvcache_block_size`` tokens per request, ``num_kvcache_blocks`` pages.
        Built after the parent's ``__init__`` (warm-up, KV cache, CUDA graphs): the
        warm-up's sequences hold no pages and go through the parent's ``prepare_*``.

        What nano-vllm reads that the adapters do not publish, served from the host:
        ``max_seqlen_q`` / ``max_seqlen_k`` (Python ints: the host maxima of the batch's
        lengths); the block tables' width (the batch's longest row, a host int) and their
        ``-1`` padding (the adapters' table pads with 0; nano-vllm's attention reads only
        the pages each row's length covers); prefill's ``block_tables=None`` without a
        prefix hit (the host sums; the table is then prepared but not sent);
        ``cfg_scales`` and ``repetition_penalties`` (host tensors: ``run`` reads the
        penalties by ``.item()`` and the scales only in a CFG batch, refused here); a
        uniform top-k / top-p that stock would upload (a device fill from the host
        scalar when it changes, the library keeping uniform filters as CPU scalars).
        """

        def __init__(self, config: Any, rank: int, event: Any,
                     lineages: SequenceLineages | None = None) -> None:
            super().__init__(config, rank, event)
            self.lineages = lineages if lineages is not None else SequenceLineages()
            # nano-vllm's own device (its CPU patches put the model on the CPU even where
            # CUDA is present): the published destinations live beside the model
            self.h2d_device = next(self.model.parameters()).device
            block = self.block_size
            self.shape = StepShape(
                max_reqs=config.max_num_seqs, max_tokens=config.max_num_batched_tokens,
                max_pages_per_req=math.ceil(config.max_model_len / block), page_size=block,
                num_pages=config.num_kvcache_blocks)
            st = self.h2d_state = H2DRunnerState(self.h2d_device)
            shape = self.shape
            sampling = SamplingInputs(st, shape.max_reqs)
            self.tokens = TokenInputs(st, max_reqs=shape.max_reqs, max_tokens=shape.max_tokens)
            # nano-vllm's attention reads block tables: no KV-index consumer to fuse
            decode = MhaDecodeInputs(st, shape, fuse_kv_indices=False)
            self.prefill = PrefillInputs(st, shape)
            self.decode_step = DecodeStepInputs.from_adapters(sampling, self.tokens, decode)
            self.prefill_step = PrefillStepInputs.from_adapters(sampling, self.tokens,
                                                                self.prefill)
            st.bind()
            restore_implicit_cpu_default()
            self.sampling, self.decode = sampling, decode
            #: the last step's (columns, sampling plan); None: the parent's step (warm-up)
            self._step: tuple[Any, Any] | None = None
            #: uniform top-k / top-p as device rows, filled from the host scalar (no upload)
            self._uniform_k = torch.zeros(shape.max_reqs, dtype=torch.int32,
                                          device=self.h2d_device)
            self._uniform_p = torch.ones(shape.max_reqs, device=self.h2d_device)
            #: the value each uniform row holds (by its data pointer)
            self._filled: dict[int, float] = {}
            #: (requests, table width) -> the views a decode step hands nano-vllm
            self._decode_views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
            #: requests -> the views prepare_sample hands nano-vllm
            self._sample_views: dict[int, tuple[torch.Tensor, ...]] = {}
            #: cfg scales and repetition penalties, host float32 rows (nano-vllm reads them
            #: on the host, within the step: run() takes each penalty with .item())
            self._host_rows = torch.zeros(2, shape.max_reqs, dtype=torch.float32)
            self._host_np = self._host_rows.numpy()

        # -- one step ------------------------------------------------------------------
        def _batch(self, seqs: list[Any], prefill: bool) -> tuple[Any, list[BlockTable]]:
            """The scheduled sequences as the adapters' batch (columns built directly, the
            rows their lineages), and the rows."""
            rows = self.lineages.rows(seqs)
            n = len(seqs)
            if prefill:  # the tokens past the cached prefix
                q = np.fromiter((len(s) - s.num_cached_tokens for s in seqs), np.int32, n)
                ids = np.fromiter((t for s in seqs for t in s.token_ids[s.num_cached_tokens:]),
                                  np.int32)
            else:  # the last token, known on the host
                q = np.ones(n, np.int32)
                ids = np.fromiter((s.last_token for s in seqs), np.int32, n)
            cols = BatchColumns(
                query_lens=q, context_lens=np.fromiter(map(len, seqs), np.int32, n),
                temperatures=np.fromiter((s.temperature for s in seqs), np.float32, n),
                top_k=np.fromiter((s.top_k or 0 for s in seqs), np.int32, n),
                top_p=np.fromiter((1.0 if s.top_p is None else s.top_p for s in seqs),
                                  np.float32, n),
                prev_sample_rows=np.full(n, -1, np.int32), token_ids=ids,
                num_drafts=np.zeros(n, np.int32))
            return ScheduledBatch((), prefill, self.block_size, given_columns=cols,
                                  given_block_tables=rows), rows

        def prepare_prefill(self, seqs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
            if not all(s.block_table for s in seqs):  # warm-up: no pages
                self._step = None
                return super().prepare_prefill(seqs)
            batch, rows = self._batch(seqs, True)
            cols, st, pf = batch.columns, self.h2d_state, self.prefill
            n, t = len(seqs), cols.token_ids.size
            hit = int(cols.context_lens.sum()) > t  # nano-vllm's prefix-cache test
            st.begin()
            plan = self.prefill_step.prepare(batch, publish_tables=hit)  # one producer call
            st.publish(PREFILL_STEP)  # one DMA + one scatter
            st.finish()
            self._step = (cols, plan.sampling)
            tables = pf.block_tables.gpu[:n, : max(map(len, rows))] if hit else None
            set_context(True, self.tokens.cu_seqlens_q.gpu[: n + 1],
                        pf.cu_seqlens_k.gpu[: n + 1], int(cols.query_lens.max()),
                        int(cols.context_lens.max()), pf.slot_mapping.gpu[:t], None, tables)
            return self.tokens.input_ids.gpu[:t], pf.positions.gpu[:t]

        def prepare_decode(self, seqs: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
            batch, rows = self._batch(seqs, False)
            st, d, n = self.h2d_state, self.decode, len(seqs)
            st.begin()
            plan = self.decode_step.prepare(batch, self.padded_size(n))  # one producer call
            st.publish(DECODE_STEP)  # one DMA + one scatter
            st.finish()
            self._step = (batch.columns, plan.sampling)
            width = max(map(len, rows))
            views = self._decode_views.get((n, width))
            if views is None:  # once per (requests, table width): slicing costs µs a step
                views = self._decode_views[n, width] = (
                    d.slot_mapping.gpu[:n], d.context_lens.gpu[:n],
                    d.block_tables.gpu[:n, :width], self.tokens.input_ids.gpu[:n],
                    d.positions.gpu[:n])
            set_context(False, slot_mapping=views[0], context_lens=views[1],
                        block_tables=views[2])
            return views[3], views[4]

        def padded_size(self, n: int) -> int | None:
            """The requests a decode step of ``n`` publishes: ``None``, exactly ``n``
            (nano-vllm copies them into its graphs' buffers; the graph-native variant,
            :mod:`library_graphs`, publishes padded to its graph's size)."""
            return None

        def _uniform(self, row: torch.Tensor, value: float, n: int) -> torch.Tensor:
            """``row[:n]`` holding the uniform filter ``value``: filled on the device,
            whole, only when the value changes (no kernel for a repeated value)."""
            key = row.data_ptr()
            if self._filled.get(key) != value:
                row.fill_(value)
                self._filled[key] = value
            return row[:n]

        def prepare_sample(self, seqs: list[Any], is_cfg_batch: bool = False) -> tuple[Any, ...]:
            if self._step is None:
                return super().prepare_sample(seqs, is_cfg_batch)
            if is_cfg_batch:
                raise NotImplementedError(
                    "LibraryModelRunner: CFG batches read cfg_scales on the device, which "
                    "the library does not publish")
            cols, sp = self._step
            n, s = len(seqs), self.sampling
            views = self._sample_views.get(n)
            if views is None:  # once per batch size: slicing costs µs a step
                views = self._sample_views[n] = (
                    s.temperatures.gpu[:n], self._host_rows[0, :n], self._host_rows[1, :n],
                    s.top_ks.gpu[:n], s.top_ps.gpu[:n])
            # stock's conditions (model_runner.py 312-322, its inverted top-p and penalty
            # flags included); a filter the library kept as a CPU scalar (uniform) is a
            # device fill of that scalar
            top_k = top_p = penalties = None
            if any(x.top_k is not None and x.top_k > 0 for x in seqs):
                top_k = (views[3] if sp.per_request_top_k
                         else self._uniform(self._uniform_k, int(cols.top_k[0]), n))
            if any(x.top_p == 1.0 for x in seqs):
                top_p = (views[4] if sp.per_request_top_p
                         else self._uniform(self._uniform_p, float(cols.top_p[0]), n))
            rows = self._host_np  # cfg scales and penalties: host rows, read this step
            if any(x.repetition_penalty == 1.0 for x in seqs):
                rows[1, :n] = [x.repetition_penalty for x in seqs]
                penalties = views[2]
            rows[0, :n] = [x.cfg_scale for x in seqs]
            return views[0], views[1], top_k, top_p, penalties

    return LibraryModelRunner


def install(runner_class: type | None = None) -> type:
    """Make nano-vllm's ``LLM`` construct ``runner_class`` (default: the library runner)
    as its model runner; returns the class."""
    cls = runner_class or library_runner_class()
    import nanovllm.engine.llm_engine as llm_engine

    llm_engine.ModelRunner = cls  # type: ignore[attr-defined]
    return cls
