"""What a refused adapter call must leave unchanged, and the check of both halves of the
rule: the call raises the specific error, then nothing observable moved (every slot's
sources, every destination, the open epoch's counts, the state's epoch/slot/produced and
published sets, the group counters, and each adapter's private caches and snapshots).

    seen = Observed(state, extra=lambda: (adapter.tables.snapshot.revision, ...))
    refuse(seen, lambda: adapter.prepare(bad), AdapterInputError, r"request 1 has ...")
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest

from h2d_core import H2DRunnerState


class Observed:
    """Everything of ``state`` a refused call must not change, plus ``extra()``'s values
    (snapshot revisions, adapter caches: whatever the family keeps besides the state)."""

    def __init__(self, state: H2DRunnerState, extra: Callable[[], Any] | None = None,
                 groups: tuple[str, ...] = ()) -> None:
        self.state = state
        self.extra = extra
        self.groups = groups

    def __call__(self) -> tuple[Any, ...]:
        st = self.state
        bufs = list(st.buffers().values())
        sources = tuple(b.source(s).cpu().numpy().tobytes() for b in bufs
                        for s in range(st.num_slots))
        dests = tuple(b.gpu.cpu().numpy().tobytes() for b in bufs)
        counts = tuple(st.count(b) for b in bufs) if st._epoch_open else None
        counters = tuple(copy.copy(st.counters(g)) for g in self.groups)
        extra = copy.deepcopy(self.extra()) if self.extra is not None else None
        return (sources, dests, counts, st.epoch, st._epoch_open, st.current_slot,
                frozenset(st.groups.produced), frozenset(st.groups.published), counters, extra)


def refuse(seen: Observed, call: Callable[[], object], error: type[Exception],
           match: str) -> Exception:
    """``call()`` raises ``error`` with a message matching ``match`` and changes nothing
    ``seen`` observes; returns the exception."""
    before = seen()
    with pytest.raises(error, match=match) as info:
        call()
    after = seen()
    assert after == before, f"a refused call ({info.value}) changed observed state"
    assert type(info.value) is not Exception and re.search(match, str(info.value))
    return info.value
