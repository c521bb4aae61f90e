"""A plain decode step in one producer call and one publication.

:class:`DecodeStepInputs` composes :class:`SamplingInputs`, :class:`TokenInputs` and
:class:`MhaDecodeInputs` (the ten uploads of a plain-MHA decode step: temperatures, top-k,
top-p, input IDs, token prefix, deferred sources, query prefix, positions, slots, context
lengths, KV prefix and block tables), combines their groups into one publication group
``decode_step`` (one DMA, one scatter) and produces all of them with one
``@h2d_producer`` call.

The per-request and per-token work runs in one compiled pass (``_decode_native.c``, built
on first use by :mod:`block_tables.native`) when it is available: the same bytes as the
separate producers, without the ~25 numpy calls between them. Without a C compiler, with
``H2D_NATIVE=0`` or with ``native=False`` the separate producers' numpy bodies run
instead. Either way the batch and its block-table rows are checked before any source is
written, so a rejected batch (a specific :class:`h2d_core.CountError` or
:class:`block_tables.BlockTableError`) changes nothing.

Padding and first consumers are those of the composed adapters: ``plan.tokens`` feeds
``tokens.assemble``, ``plan.decode`` feeds ``decode.generate_kv_indices`` and
``plan.sampling`` feeds ``sampling.sample``.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from block_tables.native import load_extension, select
from h2d_core import (
    CountBatch,
    CountError,
    DeclarationError,
    H2DBuffer,
    H2DRunnerState,
    h2d_producer,
)

from .batch import BatchColumns, ScheduledBatch
from .consumers import GREEDY_TEMPERATURE
from .mha_decode import MHA_DECODE, DecodePlan, MhaDecodeInputs, _ceil_div
from .sampling import SAMPLING, SamplingInputs, SamplingPlan
from .token_inputs import QUERY_PREFIX, TOKEN_IDS, TokenInputs, TokenPlan, _padded

DECODE_STEP = "decode_step"
_new = tuple.__new__


class DecodeStepPlan(NamedTuple):
    """The three adapters' plans for one step."""

    sampling: SamplingPlan
    tokens: TokenPlan
    decode: DecodePlan


def _load_native(native: bool | None) -> ModuleType | None:
    if native is False:
        return None
    module = load_extension("h2d_runner_adapters._h2d_decode_native")
    return select(module, native, "DecodeStepInputs")


class DecodeStepInputs:
    """Sampling, token inputs and MHA decode metadata as one producer and one group.

    Declares the three adapters on ``state`` (reachable as ``.sampling``, ``.tokens`` and
    ``.decode``) and combines their producer groups into ``DECODE_STEP``; construct before
    ``state.bind()``. :meth:`from_adapters` composes adapters the caller declared (e.g.
    shared with a prefill path). ``native`` None follows ``H2D_NATIVE``; True requires the
    compiled pass; False always runs the numpy bodies (block-table snapshot and count
    storage included).
    """

    def __init__(
        self,
        state: H2DRunnerState,
        *,
        max_reqs: int,
        max_tokens: int,
        max_pages_per_req: int,
        page_size: int,
        num_pages: int | None = None,
        max_ranges: int = 64,
        native: bool | None = None,
    ) -> None:
        self._compose(
            SamplingInputs(state, max_reqs),
            TokenInputs(state, max_reqs=max_reqs, max_tokens=max_tokens),
            MhaDecodeInputs(state, max_reqs=max_reqs, max_tokens=max_tokens,
                            max_pages_per_req=max_pages_per_req, page_size=page_size,
                            num_pages=num_pages, max_ranges=max_ranges),
            DECODE_STEP, native,
        )

    @classmethod
    def from_adapters(
        cls,
        sampling: SamplingInputs,
        tokens: TokenInputs,
        decode: MhaDecodeInputs,
        *,
        group: str = DECODE_STEP,
        native: bool | None = None,
    ) -> DecodeStepInputs:
        """Compose adapters declared on one state and combine their groups into ``group``
        (before ``bind()``). The decode adapter must be the plain (unprefixed) one;
        speculative indices, if the token adapter has them, stay in their own group."""
        self = cls.__new__(cls)
        self._compose(sampling, tokens, decode, group, native)
        return self

    def _compose(self, sampling: SamplingInputs, tokens: TokenInputs, decode: MhaDecodeInputs,
                 group: str, native: bool | None) -> None:
        state = decode.h2d_state
        if sampling.h2d_state is not state or tokens.h2d_state is not state:
            raise DeclarationError(
                "DecodeStepInputs: the sampling, token and decode adapters must be declared on "
                "the same H2DRunnerState"
            )
        if decode.group != MHA_DECODE:
            raise DeclarationError(
                f"DecodeStepInputs: the decode adapter publishes {decode.group!r}; the fused "
                f"step produces the plain {MHA_DECODE!r} group (use the adapters separately "
                "for prefixed two-batch-overlap ubatches)"
            )
        self.h2d_state = state
        self.group = group
        self.sampling = sampling
        self.tokens = tokens
        self.decode = decode
        state.combine(group, [SAMPLING, TOKEN_IDS, QUERY_PREFIX, MHA_DECODE])
        self._native = _load_native(native)
        decode.native = native  # the block-table snapshots follow the same choice
        self._native_choice = native
        self._outputs: list[Any] = []  # per slot: the compiled pass's bound sources
        self._max_reqs = min(b.spec.capacity for b in (
            sampling.temperatures, sampling.top_ks, sampling.top_ps, tokens.decode_src,
            decode.context_lens, decode.block_tables))
        self._max_tokens = min(b.spec.capacity for b in (
            tokens.input_ids, decode.positions, decode.slot_mapping))
        self._required = np.zeros(decode.context_lens.spec.capacity, dtype=np.int32)
        self._counts: CountBatch | None = None  # made on first use, after bind()

    def _counted_members(self) -> list[H2DBuffer]:
        s, t, d = self.sampling, self.tokens, self.decode
        return [s.temperatures, s.top_ks, s.top_ps, t.input_ids, t.decode_cu, t.decode_src,
                t.cu_seqlens_q, d.positions, d.slot_mapping, d.context_lens, d.kv_indptr]

    @property
    def native(self) -> bool:
        """Whether the compiled pass runs (else the numpy bodies)."""
        return self._native is not None

    def _bind_outputs(self) -> None:
        s, t, d = self.sampling, self.tokens, self.decode
        members = (s.temperatures, s.top_ks, s.top_ps, t.input_ids, t.decode_cu, t.decode_src,
                   t.cu_seqlens_q, d.positions, d.context_lens, d.kv_indptr, None,
                   d.slot_mapping)
        native = self._native
        assert native is not None
        snapshots = d.tables.snapshots
        # the producer's entry check already covers BlockTableState.prepare's own check:
        # the compiled pass calls each slot's snapshot directly
        self._prepare_table = [snap.prepare for snap in snapshots]
        self._outputs = [
            native.bind_outputs(*(self._required if b is None else b.source(slot).numpy()
                                  for b in members), snapshots[slot].storage)
            for slot in range(self.h2d_state.num_slots)
        ]

    @h2d_producer(SAMPLING, TOKEN_IDS, QUERY_PREFIX, MHA_DECODE)
    def prepare(self, batch: ScheduledBatch, padded: int | None = None) -> DecodeStepPlan:
        """Write and count every member of the step (padding to ``padded`` requests);
        stage the block table. Publish with ``state.publish(DECODE_STEP)``.

        The whole batch is checked, and the block table's rows validated, before any
        source is written: a rejected batch raises a specific error and changes nothing.
        """
        native = self._native
        if native is None:
            return self._prepare_numpy(batch, padded)
        cols = batch.columns
        n = cols.query_lens.size
        p = n if padded is None else _padded(DECODE_STEP, n, padded)
        st = self.h2d_state
        if not self._outputs:
            self._bind_outputs()
        decode = self.decode
        rows = batch.block_tables
        if p > n:
            rows = [*rows, *decode._pad_rows[: p - n]]
        slot = st.current_slot
        done = native.decode_step(
            self._outputs[slot], cols.query_lens, cols.context_lens,
            cols.temperatures, cols.top_k, cols.top_p, cols.prev_sample_rows, cols.num_drafts,
            cols.token_ids, p, decode.page_size, GREEDY_TEMPERATURE, self._prepare_table[slot],
            rows, self._required)
        if done is None:  # not covered: a bad batch (raises below) or other dtypes
            return self._prepare_numpy(batch, padded)
        q, k_rows, p_rows, total, drafts, k0, p0 = done
        t, pt = n * q, p * q
        if self._counts is None:
            self._counts = st.count_batch(self._counted_members(), native=self._native_choice)
        self._counts.set(n, n if k_rows else None, n if p_rows else None, pt, p + 1, p, p + 1,
                         pt, pt, p, p + 1)
        stage = decode.tables.stage(p)
        top_k = None if k_rows or not n or k0 <= 0 else k0
        top_p = None if p_rows or not n or not p0 < 1.0 else p0
        # tuple.__new__ skips the NamedTuples' Python-level __new__ (~0.15 µs each)
        return _new(DecodeStepPlan, (
            _new(SamplingPlan, (n, top_k, top_p, k_rows, p_rows)),
            _new(TokenPlan, (n, p, t, pt, drafts)),
            _new(DecodePlan, (n, p, q, pt, total, stage)),
        ))

    def _check(self, cols: BatchColumns, padded: int | None) -> tuple[int, int]:
        """Every rule of a fused decode step, before any write; returns (n, padded)."""
        qlens = cols.query_lens
        n = qlens.size
        p = _padded(DECODE_STEP, n, padded)
        if p > self._max_reqs:
            raise CountError(
                f"{DECODE_STEP}: {p} requests{' (padded)' if p > n else ''} exceed "
                f"max_reqs={self._max_reqs} (the buffers' capacity); split the batch or "
                "declare larger buffers"
            )
        for name in ("context_lens", "temperatures", "top_k", "top_p", "prev_sample_rows",
                     "num_drafts"):
            shape = getattr(cols, name).shape
            if shape != (n,):
                raise CountError(
                    f"{DECODE_STEP}: column {name} has shape {shape} but the batch has {n} "
                    "requests; pass one value per request"
                )
        if n and qlens.tobytes() != qlens[:1].tobytes() * n:
            raise CountError(
                f"{DECODE_STEP}: decode expects the same number of tokens per request, got "
                f"{sorted(set(qlens.tolist()))}"
            )
        q = int(qlens[0]) if n else 1
        if q < 1:
            raise CountError(f"{DECODE_STEP}: a decode request runs >= 1 token, got {q}")
        t = cols.token_ids.size
        if t != n * q:
            raise CountError(
                f"{DECODE_STEP}: token_ids holds {t} ids but the batch runs {n} requests x "
                f"{q} tokens; pass one id (or placeholder) per token"
            )
        if p * q > self._max_tokens:
            raise CountError(
                f"{DECODE_STEP}: {p * q} tokens{' (padded)' if p > n else ''} exceed "
                f"max_tokens={self._max_tokens} (the buffers' capacity); split the batch or "
                "declare larger buffers"
            )
        short = np.flatnonzero(cols.context_lens < q)
        if short.size:
            r = int(short[0])
            raise CountError(
                f"{DECODE_STEP}: request {r} has context_len {int(cols.context_lens[r])}, "
                f"shorter than its {q} query tokens; context_len counts the tokens after "
                "this step"
            )
        return n, p

    def _prepare_numpy(self, batch: ScheduledBatch, padded: int | None) -> DecodeStepPlan:
        cols = batch.columns
        n, p = self._check(cols, padded)
        decode = self.decode
        rows = batch.block_tables
        if p > n:
            rows = [*rows, *decode._pad_rows[: p - n]]
        required = self._required[:p]
        required[:n] = _ceil_div(cols.context_lens, decode.page_size)
        required[n:] = 0
        # validates every row before writing the table; the bodies below cannot fail, and
        # their own prepare of the same rows is a hit
        decode.tables.prepare(rows, required_pages=required)
        sampling = self.sampling._produce(batch)
        tokens = self.tokens._produce_ids(batch, padded)
        self.tokens._produce_query_prefix(batch, padded)
        return DecodeStepPlan(sampling, tokens, decode._prepare(batch, padded))
