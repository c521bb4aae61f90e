"""Backend selection: ``ATOM_H2D_BACKEND`` is read once, when a runner state is created."""

from __future__ import annotations

import enum
import os

from .errors import BackendError

ENV_VAR = "ATOM_H2D_BACKEND"


class Backend(str, enum.Enum):
    """How groups are published: one DMA + one scatter per group, or one copy per member."""

    PACKED = "packed"
    DIRECT = "direct"


def resolve_backend(explicit: Backend | str | None = None) -> Backend:
    """The explicit argument wins; else ``ATOM_H2D_BACKEND``; else packed.

    An unknown value is an error listing the valid ones (never a silent default).
    """
    source = "backend argument"
    value: Backend | str | None = explicit
    if value is None:
        value = os.environ.get(ENV_VAR)
        source = ENV_VAR
    # an unset or empty environment variable means the default; an explicit "" does not
    if value is None or (value == "" and source == ENV_VAR):
        return Backend.PACKED
    if isinstance(value, Backend):
        return value
    try:
        return Backend(value.strip().lower())
    except ValueError:
        valid = ", ".join(repr(b.value) for b in Backend)
        raise BackendError(
            f"{source}={value!r} is not a known H2D backend; use one of {valid}"
        ) from None
