"""The shared ``@h2d_producer`` check in front of every adapter producer (the table in
``producer_families.py``: MLA decode, prefill, the prefill step, V4.1 decode and prefill,
GDN, Engram, sampling, the token step and the fused decode/verify steps).

Outside an epoch (never begun, or after ``finish()``, while the slot's DMA may still read
its sources) and on a second entry in the epoch (before and after the group's
publication) the call is refused with the decorator's own error before the producer runs:
every slot's source bytes, the destinations, the counts and the adapter's caches stay as
the earlier call left them, and what goes out is the earlier call's bytes. A retry then
works: a first entry in an epoch, or a deliberate second one with ``h2d_reason``, and it
publishes what the same calls publish on a fresh state.

Without the decorator these calls would write the sources first and fail later (or not at
all): the byte comparisons and the exact messages below notice. The token producers and
``MhaDecodeInputs.prepare`` have the same rules in ``test_token_producers_rules.py``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from bad_inputs import Observed, refuse
from producer_families import FAMILIES, Family

from h2d_core import EpochError, H2DRunnerState, ReentryError


def _plain(value: Any) -> Any:
    """``value`` as plain data comparable with == (arrays as their dtype, shape and bytes;
    any other object by its type alone: its own state is observed where it matters)."""
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain(v) for v in value]
        return (type(value).__name__, sorted(items, key=repr) if isinstance(
            value, (set, frozenset)) else items)
    if isinstance(value, dict):
        return sorted((repr(k), _plain(v)) for k, v in value.items())
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    return type(value).__name__


def _extra(adapter: Any) -> Any:
    """The adapter's own state besides the pinned buffers (its caches and its block-table
    snapshot), by value."""
    out = {}
    for name, value in sorted(vars(adapter).items()):
        if hasattr(value, "snapshot") and hasattr(value, "prepared_revision"):
            snap = value.snapshot  # a BlockTableState
            out[name] = (snap.revision, snap.num_rows, snap.storage.tobytes(),
                         value.prepared_revision)
        else:
            out[name] = _plain(value)
    return out


def _seen(fam: Family, adapter: Any) -> Observed:
    return Observed(adapter.h2d_state, extra=lambda: _extra(adapter), groups=(fam.publish,))


def _step(fam: Family, adapter: Any, k: int, **kw: Any) -> None:
    st: H2DRunnerState = adapter.h2d_state
    st.begin()
    fam.call(adapter, k, **kw)
    st.publish(fam.publish)
    st.finish()


def _destinations(st: H2DRunnerState) -> dict[str, bytes]:
    return {name: b.gpu.numpy().tobytes() for name, b in st.buffers().items()}


def _fresh(fam: Family, *steps: int) -> dict[str, bytes]:
    """The destinations after ``steps`` (one epoch each) on a fresh state."""
    adapter = fam.build()
    for k in steps:
        _step(fam, adapter, k)
    return _destinations(adapter.h2d_state)


def _names(fam: Family) -> str:
    return ", ".join(f"'{g}'" for g in fam.groups)


def test_the_two_calls_of_each_world_publish_different_bytes() -> None:
    """Otherwise a refused second call that wrote its sources anyway could go unnoticed."""
    for name, fam in FAMILIES.items():
        assert _fresh(fam, 0) != _fresh(fam, 1), name


@pytest.mark.parametrize("entry", sorted(FAMILIES))
def test_producer_outside_an_epoch_is_refused_before_it_writes(entry: str) -> None:
    fam = FAMILIES[entry]
    adapter = fam.build()
    st: H2DRunnerState = adapter.h2d_state
    outside = rf"producer of \[{_names(fam)}\] outside an epoch: call begin\(\)"
    refuse(_seen(fam, adapter), lambda: fam.call(adapter, 1), EpochError, outside)
    _step(fam, adapter, 0)  # the retry, a first entry of epoch 1
    assert _destinations(st) == _fresh(fam, 0)
    # after finish() the slot's DMA may still be reading: no producer may write
    refuse(_seen(fam, adapter), lambda: fam.call(adapter, 1), EpochError, outside)
    _step(fam, adapter, 1)
    assert _destinations(st) == _fresh(fam, 0, 1)


@pytest.mark.parametrize("entry", sorted(FAMILIES))
def test_producer_reentry_is_refused_and_keeps_the_first_calls_sources(entry: str) -> None:
    fam = FAMILIES[entry]
    adapter = fam.build()
    st: H2DRunnerState = adapter.h2d_state
    st.begin()
    fam.call(adapter, 0)
    again = rf"producer of \[{_names(fam)}\] entered again in epoch 1 on slot 0 .*h2d_reason"
    refuse(_seen(fam, adapter), lambda: fam.call(adapter, 1), ReentryError, again)
    st.publish(fam.publish)
    assert _destinations(st) == _fresh(fam, 0), "the refused call's bytes went out"
    # after the publication too: its DMA may still be reading the sources
    refuse(_seen(fam, adapter), lambda: fam.call(adapter, 1), ReentryError, again)
    # a deliberate second publication: the sources are acquired, then rewritten
    fam.call(adapter, 1, h2d_reason="replanned step")
    st.publish(fam.publish)
    st.finish()
    assert st.counters(fam.publish).publications == 2
    assert _destinations(st) == _fresh(fam, 0, 1)
