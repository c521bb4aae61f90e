"""A hypothesis state machine of the whole publication contract against a small model.

Random begin / produce / set_count / publish / finish / resume / reentry / second
publication / injected enqueue failure / reset sequences. After every call the real state
must agree with the model: accepted calls change what the model says, rejected calls
change nothing (destinations, sources, counts, epoch, invalidation).
"""

from __future__ import annotations

import os
from typing import Any

import core_helpers as helpers
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from h2d_core import H2DError, h2d_producer

GROUPS = ("token_inputs", "mha_decode")
PUBLISHABLE = ("decode", "token_inputs", "mha_decode")


class ContractMachine(RuleBasedStateMachine):
    device = "cpu"

    @initialize(backend=st.sampled_from(["packed", "direct"]), slots=st.integers(1, 2))
    def setup(self, backend: str, slots: int) -> None:
        # the reference scatter keeps CPU runs fast; the kernel itself is tested elsewhere
        self.s = helpers.build_state(self.device, backend=backend, num_slots=slots,
                                     scatter="reference" if self.device == "cpu" else None)
        assert all(r.packed is None or r.packed.compiled
                       for recs in self.s.state._slot_groups for r in recs)
        self.st = self.s.state
        self.rng = np.random.default_rng(0)
        # model
        self.open = False
        self.resumable = False
        self.invalid = False
        self.published: set[str] = set()
        self.produced: set[str] = set()
        self.counts: dict[str, int | None] = {}
        self.dest = {n: helpers.dest_bytes(b) for n, b in self.s.buffers.items()}
        self.fail_next = False

        def make(group: str) -> Any:
            @h2d_producer(group)
            def produce(owner: Any, machine: ContractMachine) -> None:
                for b in machine.s.buffers.values():
                    if b.group == group:
                        helpers.fill_random(b, machine.rng)

            return produce

        self.producers = {g: make(g) for g in GROUPS}

    # -- helpers
    def _expect_error(self, fn: Any) -> None:
        before = self._observe()
        with pytest.raises(H2DError):
            fn()
        assert self._observe() == before

    def _observe(self) -> tuple:
        helpers.sync(self.device)
        return (
            tuple(helpers.dest_bytes(b).numpy().tobytes() for b in self.s.buffers.values()),
            tuple(b.cpu.reshape(-1).view(torch.uint8).numpy().tobytes()
                  for b in self.s.buffers.values()),
            self.st.epoch, self.st.epoch_open, self.st.current_slot, self.st.invalidated,
            tuple(self.st.count(b) for b in self.s.buffers.values()) if self.st.bound else (),
        )

    def _groups_of(self, group: str) -> tuple[str, ...]:
        return GROUPS if group == "decode" else (group,)

    # -- rules
    @rule()
    def begin(self) -> None:
        if self.invalid or self.open:
            self._expect_error(self.st.begin)
            return
        self.st.begin()
        self.open, self.resumable = True, False
        self.published.clear()
        self.produced.clear()
        self.counts = {n: None for n in self.s.buffers}

    @rule()
    def finish(self) -> None:
        if self.invalid or not self.open:
            self._expect_error(self.st.finish)
            return
        self.st.finish()
        self.open, self.resumable = False, True

    @rule()
    def resume(self) -> None:
        if self.invalid or self.open or not self.resumable:
            self._expect_error(self.st.resume)
            return
        self.st.resume()
        self.open, self.resumable = True, False

    @rule(group=st.sampled_from(GROUPS), with_reason=st.booleans())
    def produce(self, group: str, with_reason: bool) -> None:
        kwargs = {"h2d_reason": "test second publication"} if with_reason else {}
        repeated = group in self.produced or group in self.published
        if self.invalid or not self.open or (repeated and not with_reason):
            self._expect_error(lambda: self.producers[group](self.st, self, **kwargs))
            return
        if group in self.published:
            # reopen: the whole publication group when it went out combined
            reopened = GROUPS if "decode" in self.published else (group,)
            for g in reopened:
                self.published.discard(g)
                self.produced.discard(g)
                for n, b in self.s.buffers.items():
                    if b.group == g:
                        self.counts[n] = None
            self.published.discard("decode")
        self.producers[group](self.st, self, **kwargs)
        self.produced.add(group)

    @rule(name=st.sampled_from([m[0] for m in helpers.DECODE_MEMBERS]),
          kind=st.sampled_from(["valid", "none", "zero", "over", "negative", "float", "bool"]))
    def set_count(self, name: str, kind: str) -> None:
        b = self.s.buffers[name]
        value: Any = {
            "valid": int(self.rng.integers(1, b.spec.capacity + 1)), "none": None, "zero": 0,
            "over": b.spec.capacity + 1, "negative": -1, "float": 1.0, "bool": True,
        }[kind]
        bad = kind in ("over", "negative", "float", "bool")
        if self.invalid or not self.open or bad or b.group in self.published:
            self._expect_error(lambda: self.st.set_count(b, value))
            return
        self.st.set_count(b, value)
        self.counts[name] = value

    @rule(group=st.sampled_from(PUBLISHABLE), fail=st.booleans())
    def publish(self, group: str, fail: bool) -> None:
        groups = self._groups_of(group)
        # a covered group alone, while a sibling of the combined group was produced and is
        # not published: refused (the step's producers wrote the combined group)
        partial = group != "decode" and any(
            g != group and g in self.produced and g not in self.published for g in GROUPS)
        if self.invalid or not self.open or partial or any(
                g in self.published for g in (group, *groups)):
            self._expect_error(lambda: self.st.publish(group))
            return
        if fail:
            self._inject_failure(group)
            return
        self.st.publish(group)
        self.published.update({group, *groups})
        for n, b in self.s.buffers.items():
            c = self.counts.get(n)
            if b.group in groups and c:
                nbytes = c * b.spec.unit_bytes
                self.dest[n][:nbytes] = b.cpu.reshape(-1).view(torch.uint8)[:nbytes]

    def _inject_failure(self, group: str) -> None:
        plan = self.st.plan(self.s.buffers["input_ids"].publication_group)
        rec = self.st._slot_groups[self.st.current_slot][plan.index]
        originals = []

        def boom(*a: Any, **k: Any) -> None:
            raise RuntimeError("injected")

        if rec.packed is not None:
            for name in ("publish", "publish_step"):  # (the state calls publish_step)
                originals.append((rec.packed, name, getattr(rec.packed, name)))
                setattr(rec.packed, name, boom)
        for b in self.s.buffers.values():
            originals.append((b, "_dst_units", b._dst_units))
            b._dst_units = _Exploding()
        try:
            active = [n for n, b in self.s.buffers.items()
                      if b.group in self._groups_of(group) and self.counts.get(n)]
            try:
                self.st.publish(group)
            except H2DError:
                self.invalid = True
            else:
                # nothing had to be enqueued (no active member with bytes): no failure
                assert not active, active
                self.published.update({group, *self._groups_of(group)})
        finally:
            for obj, attr, val in originals:
                setattr(obj, attr, val)

    @rule()
    def reset(self) -> None:
        self.st.reset()
        self.invalid = False
        self.open = self.resumable = False
        self.published.clear()
        self.produced.clear()

    @invariant()
    def destinations_match_model(self) -> None:
        if not hasattr(self, "st"):
            return
        helpers.sync(self.device)
        for n, b in self.s.buffers.items():
            assert torch.equal(helpers.dest_bytes(b), self.dest[n]), n
        assert self.st.epoch_open == self.open
        assert (self.st.invalidated is not None) == self.invalid


class _Exploding:
    def __getitem__(self, _: object) -> Any:
        raise RuntimeError("injected copy failure")


ContractMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("H2D_STATEFUL_EXAMPLES", "40")),
    stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestContractCPU = ContractMachine.TestCase



class CudaContractMachine(ContractMachine):
    device = "cuda"


@pytest.mark.gpu
class TestContractCUDA(CudaContractMachine.TestCase):  # type: ignore[misc, valid-type]
    pass
