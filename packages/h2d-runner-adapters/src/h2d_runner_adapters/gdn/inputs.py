"""GDN (gated delta net) state indices: the ``gdn_state`` producer group.

A GDN hybrid's linear-attention layers read recurrent and causal-conv state rows by index;
its full-attention layers share the MHA publication (one block-table preparation), so this
producer group rides in the same combined group as ``mha_decode`` (e.g.
``DecodeStepInputs(..., extra_groups=[GDN_STATE])``): one DMA and one scatter per step.

State slots: request ``i`` of state group ``g`` owns the ``1 + k`` consecutive slots from
``base = g * (1 + k)`` (``k`` = speculative tokens). Members (int32, ``-1`` = PAD_SLOT_ID
for padded rows):

* non-speculative steps: ``non_spec_state_indices[i] = base`` and
  ``non_spec_state_indices_in[i]`` = ``fork * (1 + k)`` for a fork source, else ``base``;
* speculative (MTP) steps: ``spec_state_indices[i, j] = base + j`` (``[S, k + 1]``) and
  ``num_accepted_tokens[i]`` (accepted drafts + 1, ``1`` for padded rows): one per-request
  array, not one scalar store per request; the spec token count is the host's.

Only the members of the step's kind are published (the others are omitted). A step is one
compiled :class:`h2d_core.LayoutStep` call over the outputs this module registers with
:class:`h2d_core.RequestLayout` (:class:`h2d_core.RequestValues` and
:class:`h2d_core.RampRows` over the state-group columns; their bounds keep every slot in
the pool).
First consumer: the state readers (:func:`gather_gdn_states` stands in for them).

Inputs are checked whole before any write, each in its own dtype (an int64 of ``2**32``
or a uint64 of ``2**63`` is refused, never wrapped to a small slot; floats are refused):
a real request's state group is ``>= 0`` (``-1`` belongs to padded rows, which
``padded`` makes) and all its ``1 + k`` slots lie in the pool (``num_state_slots``, and
always within int32 indices); a fork source is ``-1`` or such a group; ``num_accepted``
lies in ``[1, k + 1]``. The adapter reserves no slot of its own: every slot ``>= 0`` of
the pool belongs to the state group that names it. A refusal raises
:class:`~h2d_runner_adapters.checks.AdapterInputError` naming the argument, the request
and the rule, and changes nothing (sources, counts, the per-slot row cache).
"""

from __future__ import annotations

import numpy as np
import torch

from h2d_core import (
    OMITTED,
    PADDED_REQS,
    CountRule,
    DeclarationError,
    H2DRunnerState,
    LayoutColumn,
    LayoutStep,
    OrElse,
    RampRows,
    RequestLayout,
    RequestSum,
    RequestValues,
    StepCounts,
    StepSpec,
    describe_value,
    h2d_producer,
)

from ..checks import INT32_MAX, AdapterInputError, padded_count
from ..plan_records import CountsPlan, slot_plans
from .states import gather_gdn_states

GDN_STATE = "gdn_state"


class GdnPlan(CountsPlan):
    """What a GDN state step published: requests (real, padded) and whether the step was
    speculative. A step's plan reads its record in place (valid until the slot's next
    step; see :mod:`~h2d_runner_adapters.plan_records`)."""

    __slots__ = ("speculative",)
    FIELDS = ("num_reqs", "padded_reqs", "speculative")
    num_reqs: int
    padded_reqs: int
    speculative: bool

    def __init__(self, num_reqs: int, padded_reqs: int, speculative: bool) -> None:
        self._counts = StepCounts(num_reqs, padded_reqs)
        self.speculative = bool(speculative)

    @classmethod
    def over_step(cls, counts: StepCounts, speculative: bool) -> GdnPlan:
        """The plan reading a bound step's per-slot ``counts`` in place."""
        plan: GdnPlan = cls.over(counts)
        plan.speculative = speculative
        return plan


class GdnStateInputs:
    """Declares the GDN state-index buffers on ``state`` (producer group ``group``, to be
    combined into the step's publication group), produces them and runs the first reader.
    ``num_state_slots`` (optional) bounds every published slot."""

    def __init__(
        self,
        state: H2DRunnerState,
        *,
        max_reqs: int,
        num_spec: int = 0,
        num_state_slots: int | None = None,
        group: str = GDN_STATE,
    ) -> None:
        if isinstance(num_spec, bool) or not isinstance(num_spec, int) or num_spec < 0:
            raise DeclarationError(f"{group}: num_spec must be an int >= 0, got {num_spec!r}")
        if num_state_slots is not None and (
                isinstance(num_state_slots, bool) or not isinstance(num_state_slots, int)
                or num_state_slots < num_spec + 1):
            raise DeclarationError(
                f"{group}: num_state_slots must be None or an int >= num_spec + 1 = "
                f"{num_spec + 1} (one state group's slots), got {num_state_slots!r}")
        self.h2d_state = state
        self.group = group
        self.num_spec = num_spec
        self.num_state_slots = num_state_slots
        buf = state.buffer
        self.non_spec = buf(f"{group}_non_spec_state_indices", (max_reqs,), torch.int32,
                            group=group)
        self.non_spec_in = buf(f"{group}_non_spec_state_indices_in", (max_reqs,), torch.int32,
                               group=group)
        self.spec = (buf(f"{group}_spec_state_indices", (max_reqs, num_spec + 1), torch.int32,
                         group=group, unit="rows") if num_spec else None)
        self.num_accepted = (buf(f"{group}_num_accepted_tokens", (max_reqs,), torch.int32,
                                 group=group) if num_spec else None)
        # every request runs one "token" of one "context": the layout's lengths (views of
        # one array per count, made once), and "no fork" for each request
        self._ones = [np.ones(max_reqs, np.int32)[:i] for i in range(max_reqs + 1)]
        self._no_forks = [np.full(max_reqs, -1, np.int32)[:i] for i in range(max_reqs + 1)]
        self._steps: tuple[LayoutStep, LayoutStep | None] | None = None  # bound on first use
        # per step (non-speculative, speculative), one plan per slot over its record
        self._plans: tuple[tuple[GdnPlan, ...], tuple[GdnPlan, ...]] = ((), ())
        self._values: list[np.ndarray | None] = [None, None]  # refilled per step

    def _bind(self) -> tuple[LayoutStep, LayoutStep | None]:
        st, g, k1 = self.h2d_state, self.group, self.num_spec + 1
        top = self._limit // k1 - 1  # the largest group whose slots all lie in the pool
        groups = LayoutColumn("state_groups", low=0, high=top)

        # a request's slots start at its state group's first: g * k1 (a fork reads its
        # source group's); the column bounds keep every slot in the pool
        first = RequestSum((("state_groups", k1),))
        read = RequestSum(((OrElse("fork_sources", "state_groups"), k1),))

        def layouts(spec: bool) -> list[RequestLayout]:
            out = []
            for slot in range(st.num_slots):
                if spec:
                    assert self.spec is not None and self.num_accepted is not None
                    acc = LayoutColumn("num_accepted", self.num_accepted.source(slot).numpy(),
                                       pad=1, low=1, high=k1)
                    out.append(RequestLayout(
                        g, 1, None, None, columns=[groups, acc], outputs=[RampRows(
                            self.spec.name, self.spec.source(slot).numpy().reshape(-1), k1,
                            start=first, count=RequestSum((), k1))]))
                else:
                    forks = LayoutColumn("fork_sources", low=-1, high=top)
                    out.append(RequestLayout(
                        g, 1, None, None, columns=[groups, forks], outputs=[
                            RequestValues(self.non_spec.name,
                                          self.non_spec.source(slot).numpy(), first, fill=-1),
                            RequestValues(self.non_spec_in.name,
                                          self.non_spec_in.source(slot).numpy(), read,
                                          fill=-1)]))
            return out

        non_spec = [CountRule(self.non_spec, PADDED_REQS),
                    CountRule(self.non_spec_in, PADDED_REQS)]
        spec_step = None
        if self.spec is not None and self.num_accepted is not None:
            spec = [CountRule(self.spec, PADDED_REQS), CountRule(self.num_accepted, PADDED_REQS)]
            spec_step = StepSpec(spec + [CountRule(r.buffer, OMITTED) for r in non_spec]).bind(
                g, st, layouts(True), error=AdapterInputError)
            non_spec += [CountRule(r.buffer, OMITTED) for r in spec]
        plain = StepSpec(non_spec).bind(g, st, layouts(False), error=AdapterInputError)
        self._plans = (slot_plans(st, plain, lambda c, _: GdnPlan.over_step(c, False)),
                       () if spec_step is None else
                       slot_plans(st, spec_step, lambda c, _: GdnPlan.over_step(c, True)))
        self._steps = (plain, spec_step)
        return self._steps

    @h2d_producer(lambda self: self.group)
    def prepare(
        self,
        state_groups: np.ndarray,
        *,
        padded: int | None = None,
        fork_sources: np.ndarray | None = None,
        num_accepted: np.ndarray | None = None,
    ) -> GdnPlan:
        """Write and count the step's state indices: speculative when ``num_accepted`` is
        given (one count per request, in ``[1, k + 1]``), else non-speculative (with
        optional ``fork_sources``, -1 = none). Every argument is checked whole (type,
        integrality, range in its own dtype, length) before any write; a refusal raises
        :class:`AdapterInputError` and changes nothing."""
        n = self._check_batch(state_groups)
        p = padded_count(self.group, n, padded, self.non_spec.spec.capacity)
        steps = self._steps
        if steps is None:
            steps = self._bind()
        ones = self._ones[n]
        if num_accepted is not None:
            if not self.num_spec or fork_sources is not None:  # raises: no speculative
                self._check_accepted(num_accepted, fork_sources, n)  # buffers, or a fork
            second = self._ints("num_accepted", num_accepted, n)
            step = steps[1]
        else:
            second = (self._no_forks[n] if fork_sources is None
                      else self._ints("fork_sources", fork_sources, n))
            step = steps[0]
        assert step is not None
        values = self._values
        values[0], values[1] = state_groups, second
        try:  # every value checked against its bounds, written and counted: one call
            step.run(ones, ones, None, p, -1, values)
        except AdapterInputError:
            # The layout reads int32 C-contiguous arrays only and checks their bounds. The
            # specific message (which argument, which request, which rule) comes from the
            # checks below, in the caller's dtype; nothing was written. Values that pass
            # them in another dtype or layout are narrowed to int32 (nothing wraps), and
            # the step runs again.
            self._check_all(state_groups, fork_sources, num_accepted, n)
            if all(v.dtype == np.int32 and v.flags.c_contiguous
                   for v in (state_groups, second)):
                raise
            values[0] = np.ascontiguousarray(state_groups, dtype=np.int32)
            values[1] = np.ascontiguousarray(second, dtype=np.int32)
            step.run(ones, ones, None, p, -1, values)
        finally:
            values[0] = values[1] = None  # no caller's array kept past the step
        return self._plans[num_accepted is not None][self.h2d_state.current_slot]

    def _check_all(self, state_groups: np.ndarray, fork_sources: object,
                   num_accepted: object, n: int) -> None:
        """Every rule the layout's bounds enforce, checked in the caller's dtype with the
        specific messages: on a refusal, and before an input of another dtype is narrowed
        to int32."""
        self._check_groups(state_groups)
        if num_accepted is not None:
            self._check_accepted(num_accepted, fork_sources, n)
        elif fork_sources is not None:
            self._check_forks(fork_sources, n)

    def _check_batch(self, state_groups: object) -> int:
        """The request count of ``state_groups`` (a 1-D integer array of at most
        ``max_reqs`` entries)."""
        if not isinstance(state_groups, np.ndarray) or state_groups.ndim != 1 \
                or state_groups.dtype.kind not in "iu":
            raise AdapterInputError(
                f"{self.group}: state_groups must be a 1-D integer numpy array (one state "
                f"group per request), got {describe_value(state_groups)}")
        cap = self.non_spec.spec.capacity
        if state_groups.size > cap:
            raise AdapterInputError(
                f"{self.group}: state_groups has {state_groups.size} requests, more than "
                f"max_reqs={cap}")
        return state_groups.size  # an int already (int() would pack an argument tuple)

    def _pool_bound(self, name: str, values: np.ndarray, what: str, lo: int) -> None:
        """No state group in ``values`` (``lo`` and above: its lower bound is checked by
        the caller) has a slot past the pool (or past int32 slot indices): compared in the
        array's own dtype, so 2**32 or a uint64 of 2**63 is refused, never wrapped."""
        k1 = self.num_spec + 1
        limit = self._limit
        top = limit // k1 - 1  # the largest group whose slots all lie below limit
        if values.size and int(values.max()) > top:
            i = int(np.flatnonzero(values > top)[0])
            v = int(values[i])
            past = (f"the pool's {limit} slots" if self.num_state_slots == limit
                    else f"the int32 slot indices (at most {limit} slots)")
            raise AdapterInputError(
                f"{self.group}: request {i}'s {what} {v} needs slots up to {(v + 1) * k1 - 1}"
                f", past {past}; {name} must lie in [{lo}, {top}]")

    def _check_groups(self, values: np.ndarray) -> np.ndarray:
        """``state_groups`` (type-checked) as int32: every group >= 0 (a real request never
        names PAD_SLOT_ID or a negative slot) and its slots inside the pool."""
        if values.size and int(values.min()) < 0:
            i = int(np.flatnonzero(values < 0)[0])
            raise AdapterInputError(
                f"{self.group}: request {i} has a negative state group (state_groups="
                f"{int(values[i])}); a real request owns slots >= 0, padded rows get "
                "PAD_SLOT_ID (-1) from padded")
        self._pool_bound("state_groups", values, "state group", 0)
        return values.astype(np.int32, copy=False)  # exact: the range fits

    def _check_forks(self, values: object, n: int) -> np.ndarray:
        """``fork_sources``: -1 (no fork) or a state group whose slots lie in the pool."""
        fork = self._ints("fork_sources", values, n)
        if n and int(fork.min()) < -1:
            i = int(np.flatnonzero(fork < -1)[0])
            raise AdapterInputError(
                f"{self.group}: request {i} has fork_sources={int(fork[i])}; it must be -1 "
                "(no fork) or the state group to fork from (>= 0)")
        self._pool_bound("fork_sources", fork, "fork source", -1)
        return fork.astype(np.int32, copy=False)

    @property
    def _limit(self) -> int:
        """Slots a published index may address: the pool, within int32 indices."""
        cap = INT32_MAX + 1
        return cap if self.num_state_slots is None else min(self.num_state_slots, cap)

    def _check_accepted(self, num_accepted: object, fork_sources: object, n: int
                        ) -> np.ndarray:
        g, k = self.group, self.num_spec
        if not k:
            raise AdapterInputError(f"{g}: num_accepted given but the adapter was built with "
                                    "num_spec=0; pass num_spec=k to the constructor")
        if fork_sources is not None and (self._check_forks(fork_sources, n) >= 0).any():
            raise AdapterInputError(f"{g}: speculative steps take no fork sources (forks are "
                                    "prefill-only); pass fork_sources=None")
        acc = self._ints("num_accepted", num_accepted, n)
        if n and (int(acc.min()) < 1 or int(acc.max()) > k + 1):
            i = int(np.flatnonzero((acc < 1) | (acc > k + 1))[0])
            raise AdapterInputError(
                f"{g}: request {i} has num_accepted={int(acc[i])}; it must be in [1, {k + 1}]"
                " (accepted drafts + 1)")
        return acc.astype(np.int32, copy=False)  # exact: the range fits

    def _ints(self, name: str, values: object, n: int) -> np.ndarray:
        """``values`` as given: a 1-D integer array of ``n`` entries (no conversion)."""
        if not isinstance(values, np.ndarray) or values.ndim != 1 \
                or values.dtype.kind not in "iu" or values.size != n:
            raise AdapterInputError(
                f"{self.group}: {name} must be a 1-D integer numpy array ({n} entries, one "
                f"per request), got {describe_value(values)}")
        return values

    def gather_states(self, plan: GdnPlan, pool: torch.Tensor, out: torch.Tensor
                      ) -> torch.Tensor:
        """First reader: each row's initial state from ``pool`` (the read slot of a
        non-speculative row; the last accepted token's slot of a speculative row)."""
        if plan.speculative:
            assert self.spec is not None and self.num_accepted is not None
            return gather_gdn_states(pool, self.spec.gpu, out, plan.padded_reqs,
                                     self.num_accepted.gpu)
        return gather_gdn_states(pool, self.non_spec_in.gpu.view(-1, 1), out,
                                 plan.padded_reqs)
