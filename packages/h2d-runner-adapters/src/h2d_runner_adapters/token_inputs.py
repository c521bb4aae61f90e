"""Token inputs: input IDs, deferred sources, the padded query prefix, speculative indices.

Producer groups (each decorated with ``@h2d_producer``), all carried by the ``token_inputs``
publication group (or a combined step group that includes them):

* ``token_ids``: ``input_ids`` (host-staged ids; placeholders for deferred requests),
  ``decode_cu`` (exclusive prefix of per-request token counts) and ``decode_src`` (-1 =
  staged from the host, else the request's row in the previous step's sampled ids).
* ``query_prefix``: ``cu_seqlens_q``, the padded query prefix.
* ``spec_indices``: ``target_logits_indices`` (int64), ``cu_num_draft_tokens`` and
  ``bonus_logits_indices`` (int64), for speculative verification.

First consumers: token assembly (:func:`assemble_token_ids` fills deferred ids on the GPU;
with :meth:`TokenInputs.fuse_assembly` it runs inside the publication's CUDA graphs, its
request count read on the device), then the draft-ID gather.

CUDA-graph padding (``padded`` > ``n`` requests, decode): ``cu_seqlens_q`` and ``decode_cu``
repeat their last real value up to entry ``padded`` (padded requests own no tokens);
``decode_src`` is -1 for padded requests; ``input_ids`` is published up to ``padded * q``
tokens with 0 for padding tokens. Speculative indices are real rows only (they are read
after the forward, eagerly).

Every producer checks its whole input before its first write (a refusal raises
:class:`~h2d_runner_adapters.checks.AdapterInputError`, or the ``CountError`` of a bad
``padded``, and changes nothing): at most ``max_reqs`` requests (padding included) and
``max_tokens`` tokens (graph padding included), query lengths >= 0, ``prev_sample_rows``
in ``[-1, prev_rows)`` (a deferred request names a row of the previous step's sampled
tokens; see :class:`TokenInputs`), draft counts >= 0 (and below the query length for the
speculative indices). The batch's structure (dtypes, one entry per request, one id per
query token) is :class:`BatchColumns`' own check.
"""

from __future__ import annotations

import numpy as np
import torch

from h2d_core import (
    DRAFTS,
    REQS,
    CountRule,
    DeclarationError,
    FusedConsumer,
    H2DRunnerState,
    StepCounts,
    StepSpec,
    h2d_producer,
)

from .batch import BatchColumns, ScheduledBatch
from .checks import AdapterInputError, padded_count, refuse_column, sub_plan
from .consumers import assemble_token_ids, gather_draft_ids
from .consumers._launch import check_tensor, interpreted
from .consumers.token_assembly import _assemble_kernel, launch_assembly_from_header
from .plan_records import CountsPlan
from .sampling.inputs import SAMPLING

TOKEN_IDS = "token_ids"
QUERY_PREFIX = "query_prefix"
SPEC_INDICES = "spec_indices"
#: the producer groups of the token inputs, in the order a combined group lists them
TOKEN_PRODUCERS = (SAMPLING, TOKEN_IDS, QUERY_PREFIX)
TOKEN_INPUTS = "token_inputs"


class TokenPlan(CountsPlan):
    """What the token producer published: requests and tokens (real, padded) and the
    step's draft tokens. A step's plan reads its record in place (valid until the slot's
    next step; see :mod:`~h2d_runner_adapters.plan_records`)."""

    __slots__ = ()
    FIELDS = ("num_reqs", "padded_reqs", "num_tokens", "padded_tokens", "num_draft_tokens")
    COUNTS = (("num_draft_tokens", "column_sum"),)
    num_reqs: int
    padded_reqs: int
    num_tokens: int
    padded_tokens: int
    num_draft_tokens: int

    def __init__(self, num_reqs: int, padded_reqs: int, num_tokens: int,
                 padded_tokens: int, num_draft_tokens: int = 0) -> None:
        self._counts = StepCounts(num_reqs, padded_reqs, 1, num_tokens, padded_tokens,
                                  column_sum=num_draft_tokens)


class TokenInputs:
    """Declares the token-input buffers, produces them, and runs their first consumers.

    ``prev_rows`` (default ``max_reqs``: a step samples at most that many rows) is how many
    rows the previous step's sampled tokens (``prev_sampled``, token assembly's source)
    hold: a deferred request's ``prev_sample_row`` must lie in ``[0, prev_rows)``, checked
    by the producers before any write (a row past it would assemble the placeholder
    instead of a token, silently). :meth:`fuse_assembly` lowers it to its tensor's rows;
    :meth:`assemble` refuses a smaller ``prev_sampled`` that a deferred row of the step
    lies past. Fixed at declaration."""

    def __init__(
        self, state: H2DRunnerState, *, max_reqs: int, max_tokens: int, max_drafts: int = 0,
        prev_rows: int | None = None,
    ) -> None:
        self.h2d_state = state
        self.max_reqs = max_reqs
        if prev_rows is not None and (type(prev_rows) is not int or prev_rows < 1):
            raise DeclarationError(
                f"{TOKEN_IDS}: prev_rows must be an int >= 1 (the rows of the previous step's "
                f"sampled tokens) or None (max_reqs), got {prev_rows!r}")
        #: rows of the previous step's sampled tokens a deferred request may name
        self.prev_rows: int = max_reqs if prev_rows is None else prev_rows
        #: the most tokens a step publishes (graph padding included)
        self.max_tokens = max_tokens
        buf = state.buffer
        # +1: the draft gather reads input_ids shifted by one token
        self.input_ids = buf("input_ids", (max_tokens + 1,), torch.int32, group=TOKEN_IDS)
        self.decode_cu = buf("decode_cu", (max_reqs + 1,), torch.int32, group=TOKEN_IDS)
        self.decode_src = buf("decode_src", (max_reqs,), torch.int32, group=TOKEN_IDS)
        self.cu_seqlens_q = buf("cu_seqlens_q", (max_reqs + 1,), torch.int32,
                                group=QUERY_PREFIX)
        self.max_drafts = max_drafts
        #: per slot: (the batch key, (requests, drafts)) of the verification indices its
        #: sources hold, what lets prepare_spec_indices skip a repeated batch; None:
        #: unknown. Another producer that writes those sources (a fused verify step)
        #: sets its slot's entry to None.
        self.spec_written: list[tuple[tuple[str, bytes, str, bytes], tuple[int, int]] | None] = (
            [None] * state.num_slots)
        if max_drafts:
            n = max_reqs * max_drafts
            self.target_logits_indices = buf("target_logits_indices", (n,), torch.int64,
                                             group=SPEC_INDICES)
            self.cu_num_draft_tokens = buf("cu_num_draft_tokens", (max_reqs,), torch.int32,
                                           group=SPEC_INDICES)
            self.bonus_logits_indices = buf("bonus_logits_indices", (max_reqs,), torch.int64,
                                            group=SPEC_INDICES)
        #: token assembly fused into the publication (fuse_assembly), and what it reads
        self.assembly_consumer: FusedConsumer | None = None
        self._fused_prev: torch.Tensor | None = None
        #: the fused assemble's input-ids views, per padded token count
        self._fused_views: dict[int, torch.Tensor] = {}

    def fuse_assembly(self, prev_sampled: torch.Tensor) -> FusedConsumer:
        """Put token assembly inside the publication of the group carrying ``decode_cu``
        (its CUDA graphs), reading ``prev_sampled`` (int32 ``[rows, W]`` on the state's
        device: the engine's persistent buffer of the previous step's sampled tokens, the
        same tensor every step). Declare before ``bind()``; after it the handle's ``fused``
        says whether the publication runs it (a packed group), and :meth:`assemble` then
        launches nothing."""
        st = self.h2d_state
        prev = check_tensor("fuse_assembly", "prev_sampled", prev_sampled, dtype=torch.int32,
                            ndim=2, unit_stride=False)
        if prev.device != st.device:
            raise DeclarationError(
                f"{TOKEN_IDS}: fuse_assembly's prev_sampled lives on {prev.device}, the state "
                f"on {st.device}; pass the engine's sampled-token buffer on {st.device}")
        if st.device.type == "cpu" and not interpreted(_assemble_kernel):
            raise DeclarationError(
                f"{TOKEN_IDS}: fused token assembly on a CPU state runs the Triton kernel in "
                "its interpreter: set TRITON_INTERPRET=1 before triton is imported")
        if self.assembly_consumer is not None:
            raise DeclarationError(f"{TOKEN_IDS}: token assembly is already fused")
        self._fused_prev = prev
        self.prev_rows = min(self.prev_rows, prev.shape[0])  # the rows the fusion reads
        self.assembly_consumer = st.fuse_consumer(f"{TOKEN_IDS}.assembly", [self.decode_cu],
                                                  self._enqueue_assembly)
        return self.assembly_consumer

    def _enqueue_assembly(self, header: torch.Tensor, rows: tuple[int, ...]) -> None:
        assert self._fused_prev is not None
        launch_assembly_from_header(self.input_ids.gpu, self.decode_cu.gpu,
                                    self.decode_src.gpu, self._fused_prev, header, rows[0])

    @property
    def producer_groups(self) -> tuple[str, ...]:
        return TOKEN_PRODUCERS[1:] + ((SPEC_INDICES,) if self.max_drafts else ())

    # -- producers --------------------------------------------------------------------------
    @h2d_producer(TOKEN_IDS)
    def prepare_ids(self, batch: ScheduledBatch, padded: int | None = None) -> TokenPlan:
        """Stage ids, the per-request token prefix and the deferred source rows."""
        return self._produce_ids(batch, padded)

    def _produce_ids(self, batch: ScheduledBatch, padded: int | None) -> TokenPlan:
        cols = batch.columns
        n = cols.query_lens.size
        p = self._check_requests(TOKEN_IDS, cols, padded)
        t = cols.token_ids.size
        # padding tokens: q per padded request, as the decode metadata pads them
        q = int(cols.query_lens.max()) if n else 1
        pt = t if padded is None else max(t, p * q)
        if pt > self.max_tokens:
            raise AdapterInputError(
                f"{TOKEN_IDS}: {pt} tokens"
                f"{'' if pt == t else f' ({t} real, padded to {p} requests of {q})'} exceed "
                f"max_tokens={self.max_tokens}; split the batch or declare a larger max_tokens")
        if n:
            prev, drafts = cols.prev_sample_rows, cols.num_drafts
            rows = self.prev_rows
            if prev.min() < -1 or prev.max() >= rows:
                refuse_column(TOKEN_IDS, "prev_sample_rows", prev, (prev < -1) | (prev >= rows),
                              f"in [-1, {rows}) (-1: staged from the host; else a row of the "
                              f"previous step's {rows} sampled rows, prev_rows)")
            if drafts.min() < 0:
                refuse_column(TOKEN_IDS, "num_drafts", drafts, drafts < 0, ">= 0")
        st = self.h2d_state
        self._fill_ids(cols, n, p, t, pt)
        st.set_count(self.input_ids, pt)
        cu = self.decode_cu.np
        cu[0] = 0
        np.add.accumulate(cols.query_lens, out=cu[1 : n + 1])
        cu[n + 1 : p + 1] = t
        st.set_count(self.decode_cu, p + 1)
        st.set_count(self.decode_src, p)
        return TokenPlan(n, p, t, pt, int(cols.num_drafts.sum()))

    def _fill_ids(self, cols: BatchColumns, n: int, p: int, t: int, pt: int) -> None:
        """``input_ids[:pt]`` (padding 0) and ``decode_src[:p]`` (padding -1); the
        caller checked the sizes and sets the counts."""
        ids = self.input_ids.np
        ids[:t] = cols.token_ids
        ids[t:pt] = 0
        src = self.decode_src.np
        src[:n] = cols.prev_sample_rows
        src[n:p] = -1

    @h2d_producer(QUERY_PREFIX)
    def prepare_query_prefix(self, batch: ScheduledBatch, padded: int | None = None) -> None:
        """``cu_seqlens_q[: padded+1]``; the tail repeats the total (padded = empty)."""
        self._produce_query_prefix(batch, padded)

    def _produce_query_prefix(self, batch: ScheduledBatch, padded: int | None) -> None:
        cols = batch.columns
        n = cols.query_lens.size
        p = self._check_requests(QUERY_PREFIX, cols, padded)
        cu = self.cu_seqlens_q.np
        cu[0] = 0
        np.add.accumulate(cols.query_lens, out=cu[1 : n + 1])
        cu[n + 1 : p + 1] = cu[n]
        self.h2d_state.set_count(self.cu_seqlens_q, p + 1)

    def _check_requests(self, group: str, cols: BatchColumns, padded: int | None) -> int:
        """The published request count (``padded`` or n) after checking it against
        ``max_reqs`` and the query lengths (>= 0)."""
        n = cols.query_lens.size
        p = padded_count(group, n, padded)
        if p > self.max_reqs:
            raise AdapterInputError(
                f"{group}: {p} requests{'' if p == n else f' ({n} real, padded)'} exceed "
                f"max_reqs={self.max_reqs}; split the batch or declare a larger max_reqs")
        q = cols.query_lens
        if n and q.min() < 0:
            refuse_column(group, "query_lens", q, q < 0, ">= 0")
        return p

    def verify_spec(self) -> StepSpec:
        """The verification indices' part of a fused verify step (:class:`h2d_core.StepSpec`):
        target rows for the step's draft tokens, the draft prefix and bonus rows for real
        requests. A step bound over it writes them itself: it sets its slot's
        :attr:`spec_written` to None after each such step. Needs ``max_drafts > 0``."""
        if not self.max_drafts:
            raise DeclarationError(
                f"{SPEC_INDICES}: a verify step needs speculative buffers; construct with "
                "max_drafts=k")
        return StepSpec((CountRule(self.target_logits_indices, DRAFTS),
                         CountRule(self.cu_num_draft_tokens, REQS),
                         CountRule(self.bonus_logits_indices, REQS)))

    @h2d_producer(SPEC_INDICES)
    def prepare_spec_indices(self, batch: ScheduledBatch) -> None:
        """Verification indices for requests with draft tokens.

        Request ``r`` verifies ``d_r`` drafts over its ``d_r + 1`` query tokens starting at
        ``cu[r]``: target logits are rows ``cu[r] .. cu[r] + d_r - 1``, the bonus row is
        ``cu[r] + d_r``; ``cu_num_draft_tokens`` is the inclusive prefix of ``d``.
        """
        if not self.max_drafts:  # (checked first: nothing below exists without drafts)
            raise DeclarationError(
                f"{SPEC_INDICES}: TokenInputs was built with max_drafts=0, so it has no "
                "speculative buffers; pass max_drafts=k to the constructor"
            )
        cols = batch.columns
        q = cols.query_lens
        n = q.size
        st = self.h2d_state
        slot = st.current_slot
        # Only this producer writes these sources: the same query and draft counts as the
        # slot's last batch (a steady MTP step: k drafts each) left the same bytes there.
        key = (q.dtype.str, q.tobytes(), cols.num_drafts.dtype.str, cols.num_drafts.tobytes())
        last = self.spec_written[slot]
        if last is not None and last[0] == key:
            n, total = last[1]
            st.set_count(self.target_logits_indices, total)
            st.set_count(self.cu_num_draft_tokens, n)
            st.set_count(self.bonus_logits_indices, n)
            return
        d = cols.num_drafts.astype(np.int64)
        # everything checked before any write: a refused batch changes nothing
        if n > self.max_reqs or d.size != n:
            raise AdapterInputError(
                f"{SPEC_INDICES}: {n} requests with {d.size} draft counts; at most "
                f"max_reqs={self.max_reqs}, one count per request")
        if n:
            bad = np.flatnonzero((d < 0) | (d >= q))
            if bad.size:
                i = int(bad[0])
                raise AdapterInputError(
                    f"{SPEC_INDICES}: request {i} verifies {int(d[i])} drafts with "
                    f"{int(q[i])} query tokens; a request verifies 0 <= drafts < its query "
                    "tokens (the last token is the bonus row)")
        total = int(d.sum())
        cap = self.target_logits_indices.spec.capacity
        if total > cap:
            raise AdapterInputError(
                f"{SPEC_INDICES}: {total} draft tokens exceed target_logits_indices' "
                f"capacity {cap} (max_reqs * max_drafts); raise max_drafts")
        starts = np.zeros(n, dtype=np.int64)
        np.cumsum(q[:-1], out=starts[1:])
        first = np.repeat(starts - np.concatenate(([0], np.cumsum(d)[:-1])), d)
        self.target_logits_indices.np[:total] = first + np.arange(total)
        np.cumsum(d, out=self.cu_num_draft_tokens.np[:n])
        self.bonus_logits_indices.np[:n] = starts + d
        st.set_count(self.target_logits_indices, total)
        st.set_count(self.cu_num_draft_tokens, n)
        st.set_count(self.bonus_logits_indices, n)
        self.spec_written[slot] = (key, (n, total))

    # -- first consumers --------------------------------------------------------------------
    def assemble(self, plan: TokenPlan, prev_sampled: torch.Tensor) -> torch.Tensor:
        """Token assembly: fill deferred ids from ``prev_sampled`` (int32 [rows, W]);
        returns the step's ``input_ids`` view (padding included). Fused
        (:meth:`fuse_assembly` on a packed group), the publication already enqueued it: this
        launches nothing, and ``prev_sampled`` must be the tensor the fusion reads. A fused
        step's plan is read through its ``.tokens``."""
        if type(plan) is not TokenPlan:
            plan = sub_plan(TOKEN_IDS, "assemble", plan, TokenPlan, "tokens")
        fused = self.assembly_consumer
        if fused is not None and fused.fused:
            if prev_sampled is not self._fused_prev:
                raise AdapterInputError(
                    f"{TOKEN_IDS}: token assembly is fused into the publication and reads "
                    "the prev_sampled given to fuse_assembly; pass that tensor (or declare "
                    "without the fusion)")
            # the view of a padded size is built once: a steady step makes no tensor
            view = self._fused_views.get(plan.padded_tokens)
            if view is None:
                view = self._fused_views[plan.padded_tokens] = (
                    self.input_ids.gpu[: plan.padded_tokens])
            return view
        if (isinstance(prev_sampled, torch.Tensor) and prev_sampled.dim() == 2
                and prev_sampled.size(0) < self.prev_rows):
            self._check_prev_rows(plan, prev_sampled.size(0))
        assemble_token_ids(self.input_ids.gpu, self.decode_cu.gpu, self.decode_src.gpu,
                           prev_sampled, plan.padded_reqs)
        return self.input_ids.gpu[: plan.padded_tokens]

    def _check_prev_rows(self, plan: TokenPlan, rows: int) -> None:
        """A ``prev_sampled`` of fewer rows than ``prev_rows``: refuse the step if one of
        its deferred requests names a row past it (read from the slot's host source of
        ``decode_src``, what the step published)."""
        src = self.decode_src.source(self.h2d_state.current_slot).numpy()[: plan.num_reqs]
        bad = np.flatnonzero(src >= rows)
        if bad.size:
            i = int(bad[0])
            raise AdapterInputError(
                f"{TOKEN_IDS}: assemble: request {i} has prev_sample_row={int(src[i])} but "
                f"prev_sampled has {rows} rows; a deferred request must name a row the "
                "previous step sampled: pass that step's whole sampled-token tensor, or fix "
                "the request's prev_sample_row")

    def gather_drafts(self, plan: TokenPlan, out: torch.Tensor) -> torch.Tensor:
        """Draft-ID gather: ``out[i] = input_ids[1 + target_logits_indices[i]]``."""
        if type(plan) is not TokenPlan:
            plan = sub_plan(TOKEN_IDS, "gather_drafts", plan, TokenPlan, "tokens")
        n = plan.num_draft_tokens
        gather_draft_ids(self.input_ids.gpu, self.target_logits_indices.gpu[:n], out[:n])
        return out[:n]
