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

Only the members of the step's kind are published (the others are omitted). First
consumer: the state readers (:func:`gather_gdn_states` stands in for them).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from h2d_core import CountError, DeclarationError, H2DRunnerState, h2d_producer

from .consumers.gdn_states import gather_gdn_states
from .token_inputs import _padded

GDN_STATE = "gdn_state"


class GdnPlan(NamedTuple):
    num_reqs: int
    padded_reqs: int
    speculative: bool


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
        self._offsets = np.arange(num_spec + 1, dtype=np.int32)
        #: per slot: the (state groups, padding) whose speculative rows its sources hold
        self._spec_rows: list[tuple[object, ...] | None] = [None] * state.num_slots

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
        optional ``fork_sources``, -1 = none). Everything is checked before any write."""
        g = self.group
        st = self.h2d_state
        slot = st.current_slot
        key = None
        if num_accepted is not None and isinstance(state_groups, np.ndarray):
            key = (state_groups.dtype.str, state_groups.shape, state_groups.tobytes(), padded)
            if self._spec_rows[slot] == key:
                # the slot's sources already hold these requests' speculative rows (checked
                # when written): only the accepted counts change from step to step
                n = state_groups.size
                p = n if padded is None else padded
                self._write_accepted(self._check_accepted(num_accepted, fork_sources, n), n, p)
                return GdnPlan(n, p, True)
        groups = self._ints("state_groups", state_groups, None)
        n = groups.size
        p = _padded(g, n, padded)
        if p > self.non_spec.spec.capacity:
            raise CountError(f"{g}: padded={p} exceeds max_reqs={self.non_spec.spec.capacity}")
        k = self.num_spec
        if (groups < 0).any():
            raise CountError(f"{g}: request {int(np.argmax(groups < 0))} has a negative state "
                             "group")
        top = (groups.astype(np.int64) + 1) * (k + 1)
        if self.num_state_slots is not None and n and top.max() > self.num_state_slots:
            i = int(np.argmax(top > self.num_state_slots))
            raise CountError(
                f"{g}: request {i}'s state group {int(groups[i])} needs slots up to "
                f"{int(top[i]) - 1}, past the pool's {self.num_state_slots} slots")
        if num_accepted is not None:
            acc = self._check_accepted(num_accepted, fork_sources, n)
            assert self.spec is not None
            rows = self.spec.np
            np.add((groups * (k + 1))[:, None], self._offsets[None, :], out=rows[:n])
            rows[n:p] = -1
            self._spec_rows[slot] = key
            self._write_accepted(acc, n, p)
            return GdnPlan(n, p, True)
        base = groups * (k + 1)
        src = base
        if fork_sources is not None:
            fork = self._ints("fork_sources", fork_sources, n)
            if self.num_state_slots is not None and n and \
                    ((fork.astype(np.int64) + 1) * (k + 1)).max() > self.num_state_slots:
                raise CountError(f"{g}: a fork source's slots lie past the pool's "
                                 f"{self.num_state_slots} slots")
            src = np.where(fork >= 0, fork * (k + 1), base)
        out, out_in = self.non_spec.np, self.non_spec_in.np
        out[:n] = base
        out[n:p] = -1
        out_in[:n] = src
        out_in[n:p] = -1
        st.set_count(self.non_spec, p)
        st.set_count(self.non_spec_in, p)
        if self.spec is not None and self.num_accepted is not None:
            st.set_count(self.spec, None)
            st.set_count(self.num_accepted, None)
        return GdnPlan(n, p, False)

    def _check_accepted(self, num_accepted: object, fork_sources: object, n: int
                        ) -> np.ndarray:
        g, k = self.group, self.num_spec
        if not k:
            raise CountError(f"{g}: num_accepted given but the adapter was built with "
                             "num_spec=0; pass num_spec=k to the constructor")
        if fork_sources is not None and (np.asarray(fork_sources) >= 0).any():
            raise CountError(f"{g}: speculative steps take no fork sources (forks are "
                             "prefill-only)")
        acc = self._ints("num_accepted", num_accepted, n)
        bad = np.flatnonzero((acc < 1) | (acc > k + 1))
        if bad.size:
            i = int(bad[0])
            raise CountError(f"{g}: request {i} has num_accepted={int(acc[i])}; it must "
                             f"be in [1, {k + 1}] (accepted drafts + 1)")
        return acc

    def _write_accepted(self, acc: np.ndarray, n: int, p: int) -> None:
        """Write the (checked) accepted counts; count the speculative members and omit the
        others."""
        assert self.spec is not None and self.num_accepted is not None
        a = self.num_accepted.np
        a[:n] = acc
        a[n:p] = 1
        st = self.h2d_state
        st.set_count(self.spec, p)
        st.set_count(self.num_accepted, p)
        st.set_count(self.non_spec, None)
        st.set_count(self.non_spec_in, None)

    def _ints(self, name: str, values: object, n: int | None) -> np.ndarray:
        if not isinstance(values, np.ndarray) or values.ndim != 1 \
                or values.dtype.kind not in "iu" or (n is not None and values.size != n):
            what = (type(values).__name__ if not isinstance(values, np.ndarray)
                    else f"a {values.dtype} array of shape {values.shape}")
            need = "one per request" if n is None else f"{n} entries, one per request"
            raise CountError(f"{self.group}: {name} must be a 1-D integer numpy array "
                             f"({need}), got {what}")
        cap = self.non_spec.spec.capacity
        if values.size > cap:
            raise CountError(f"{self.group}: {values.size} requests exceed max_reqs={cap}")
        return values.astype(np.int32, copy=False)

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
