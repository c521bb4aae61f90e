"""What one publication may change on the device: the published units of its own members.

Copies are taken on the device (stream-ordered clones, no host synchronization), so the
checks also run inside delayed-reuse tests where the host must not wait for the GPU::

    before = dest_copies(state)               # after the producers, before publish()
    counted = published_counts(state, group)  # while the epoch is open
    state.publish(group)
    after = dest_copies(state)
    ...; torch.cuda.synchronize()
    check_tails(state, before, after, counted, rows={table.name: p})
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from h2d_core import H2DRunnerState


def dest_copies(state: H2DRunnerState) -> dict[str, torch.Tensor]:
    """A device copy of every destination, ordered on the current stream."""
    return {name: b.gpu.clone() for name, b in state.buffers().items()}


def published_counts(state: H2DRunnerState, *groups: str) -> dict[str, int | None]:
    """The open epoch's count of every member of ``groups`` (producer or publication
    group names), or of every buffer when no group is named (None: omitted, or not
    produced this epoch)."""
    return {name: state.count(b) for name, b in state.buffers().items()
            if not groups or b.group in groups or b.publication_group in groups}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()


def check_tails(state: H2DRunnerState, before: Mapping[str, torch.Tensor],
                after: Mapping[str, torch.Tensor], counted: Mapping[str, int | None], *,
                rows: Mapping[str, int] | None = None) -> None:
    """Bytes past each counted member's published units are unchanged, an omitted member
    (count None) is unchanged, and so is every destination outside ``counted``.

    ``rows`` names ranged tables (their changed spans travel without a count) and the rows
    the step staged: rows past that stay as they were whatever the table's count."""
    rows = rows or {}
    for name, b in state.buffers().items():
        old, new = _bytes(before[name]), _bytes(after[name])
        if name in rows:
            keep = rows[name] * b.spec.unit_bytes
        elif name in counted and counted[name] is not None:
            keep = int(counted[name]) * b.spec.unit_bytes  # type: ignore[arg-type]
        else:
            keep = 0
        assert new[keep:] == old[keep:], (
            f"{name}: bytes past the published {keep} changed"
            if name in counted else f"{name}: not published this step, yet changed")
