"""Sampling parameters: the ``sampling`` producer of the token inputs, and the sampler.

Policy (spec, "the sampler paragraph"): temperatures are always uploaded per request
(clamped on the host to ``GREEDY_TEMPERATURE``, which marks greedy rows, so no mask is
uploaded or read back). Top-k and top-p stay CPU scalars when every request shares one
value (including "off"), through ordinary and speculative sampling; only per-request
filters are uploaded. The sampler corrects greedy rows on the GPU: no ``.item()``, no D2H.

Padding: the sampler runs eagerly on real rows only, so these members carry no graph
padding (count = real requests).

Values (checked every step before any source is written; a refusal raises
:class:`~h2d_runner_adapters.checks.AdapterInputError` naming the request and the column):
temperatures finite, ``top_k >= -1`` (-1 and 0 both mean "off"), ``top_p`` in (0, 1].
"""

from __future__ import annotations

import numpy as np
import torch

from h2d_core import H2DRunnerState, StepCounts, h2d_producer

from ..batch import BatchColumns, ScheduledBatch
from ..checks import AdapterInputError, sub_plan
from ..plan_records import CountsPlan
from .rules import check_columns
from .sampler import GREEDY_TEMPERATURE, sample_tokens

SAMPLING = "sampling"


#: the fused steps' uniform-mask bits of the top-k and top-p columns (their positions in
#: ``token_step.step_columns``): set, the column holds one value for every request
TOP_K_UNIFORM, TOP_P_UNIFORM = 2, 4


class SamplingPlan(CountsPlan):
    """What the producer decided for one batch: ``num_reqs``; ``top_k`` / ``top_p``, the
    uniform filter as a CPU scalar (None: off, or per request); ``per_request_top_k`` /
    ``per_request_top_p``. A step's plan reads the step's record and the slot's top-k and
    top-p sources in place (valid until the slot's next step; see
    :mod:`~h2d_runner_adapters.plan_records`)."""

    __slots__ = ("_top_k", "_top_p")
    FIELDS = ("num_reqs", "top_k", "top_p", "per_request_top_k", "per_request_top_p")
    num_reqs: int
    _top_k: np.ndarray
    _top_p: np.ndarray

    def __init__(self, num_reqs: int, top_k: int | None, top_p: float | None,
                 per_request_top_k: bool, per_request_top_p: bool) -> None:
        self._counts = StepCounts(num_reqs, num_reqs, uniform_mask=(
            (0 if per_request_top_k else TOP_K_UNIFORM)
            | (0 if per_request_top_p else TOP_P_UNIFORM)))
        self._top_k = np.array([0 if top_k is None else top_k], np.int64)
        self._top_p = np.array([1.0 if top_p is None else top_p], np.float64)

    @classmethod
    def over_sources(cls, counts: StepCounts, top_k: np.ndarray,
                     top_p: np.ndarray) -> SamplingPlan:
        """The plan reading ``counts`` and the slot's top-k / top-p sources in place."""
        plan: SamplingPlan = cls.over(counts)
        plan._top_k, plan._top_p = top_k, top_p
        return plan

    @property
    def per_request_top_k(self) -> bool:
        return not self._counts.uniform_mask & TOP_K_UNIFORM

    @property
    def per_request_top_p(self) -> bool:
        return not self._counts.uniform_mask & TOP_P_UNIFORM

    @property
    def top_k(self) -> int | None:
        k = self._top_k
        if self.per_request_top_k or not self._counts.num_reqs or k[0] <= 0:
            return None
        return int(k[0])

    @property
    def top_p(self) -> float | None:
        p = self._top_p
        if self.per_request_top_p or not self._counts.num_reqs or not p[0] < 1.0:
            return None
        return float(p[0])


def _uniform(values: np.ndarray) -> bool:
    # a byte comparison: several times cheaper than an elementwise compare + all()
    return values.tobytes() == values[:1].tobytes() * values.size


class SamplingInputs:
    """Declares the sampling buffers and produces them from a batch."""

    def __init__(self, state: H2DRunnerState, max_reqs: int) -> None:
        self.h2d_state = state
        self.temperatures = state.buffer("temperatures", (max_reqs,), torch.float32,
                                         group=SAMPLING)
        self.top_ks = state.buffer("top_ks", (max_reqs,), torch.int32, group=SAMPLING)
        self.top_ps = state.buffer("top_ps", (max_reqs,), torch.float32, group=SAMPLING)

    @h2d_producer(SAMPLING)
    def prepare(self, batch: ScheduledBatch) -> SamplingPlan:
        """Write temperatures (always) and per-request filters (only when they differ).
        The batch's request count and values are checked first: a refused batch changes
        nothing."""
        return self._produce(batch)

    def _produce(self, batch: ScheduledBatch) -> SamplingPlan:
        plan = self._fill(batch.columns)
        n = plan.num_reqs
        st = self.h2d_state
        st.set_count(self.temperatures, n)
        st.set_count(self.top_ks, n if plan.per_request_top_k else None)
        st.set_count(self.top_ps, n if plan.per_request_top_p else None)
        return plan

    def _fill(self, cols: BatchColumns) -> SamplingPlan:
        """Write the sources (counts are the caller's: temperatures n, each filter n when
        per-request, else omitted)."""
        n = cols.temperatures.size
        cap = self.temperatures.spec.capacity
        if n > cap:
            raise AdapterInputError(
                f"{SAMPLING}: {n} requests exceed the sampling buffers' max_reqs={cap}; "
                "split the batch or declare SamplingInputs with a larger max_reqs")
        check_columns(SAMPLING, cols)
        np.maximum(cols.temperatures, GREEDY_TEMPERATURE, out=self.temperatures.np[:n])
        top_k: int | None = None
        top_p: float | None = None
        k_rows = not _uniform(cols.top_k)
        p_rows = not _uniform(cols.top_p)
        # the filters' sources are written either way (the same bytes as the fused step's
        # column copy); they are published only when they differ per request
        self.top_ks.np[:n] = cols.top_k
        self.top_ps.np[:n] = cols.top_p
        if not k_rows and n and int(cols.top_k[0]) > 0:
            top_k = int(cols.top_k[0])
        if not p_rows and n and float(cols.top_p[0]) < 1.0:
            top_p = float(cols.top_p[0])
        return SamplingPlan(n, top_k, top_p, k_rows, p_rows)

    def sample(
        self,
        logits: torch.Tensor,
        plan: SamplingPlan,
        noise: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Sample one token per real row of ``logits`` (float32 ``[>= n, V]``). A fused
        step's plan is read through its ``.sampling``."""
        if type(plan) is not SamplingPlan:
            plan = sub_plan(SAMPLING, "sample", plan, SamplingPlan, "sampling")
        n = plan.num_reqs
        return sample_tokens(
            logits[:n],
            self.temperatures.gpu,
            top_k=self.top_ks.gpu if plan.per_request_top_k else plan.top_k,
            top_p=self.top_ps.gpu if plan.per_request_top_p else plan.top_p,
            noise=noise,
            out=out,
        )
