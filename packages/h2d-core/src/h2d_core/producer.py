"""``@h2d_producer``: the shared slot/epoch check in front of every metadata producer."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from .errors import DeclarationError, H2DError
from .state import H2DRunnerState

P = ParamSpec("P")
R = TypeVar("R")


def _owner_state(owner: object) -> H2DRunnerState:
    state = owner if isinstance(owner, H2DRunnerState) else getattr(owner, "h2d_state", None)
    if not isinstance(state, H2DRunnerState):
        raise H2DError(
            f"@h2d_producer needs an H2DRunnerState (or an object with .h2d_state) as the "
            f"first argument, got {type(owner).__name__}"
        )
    return state


def h2d_producer(group: str, *more_groups: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Declare that the decorated function writes the sources of the named groups.

    Before the producer runs, the owner's current slot and epoch are checked: outside an
    epoch, after invalidation, from another thread, or on a second entry in the same epoch
    the call is rejected and the producer never runs, so earlier sources stay intact. A
    deliberate second publication passes ``h2d_reason="why"``: the sources are acquired
    (their earlier DMA has completed) before the producer rewrites them.

    The first positional argument must be the :class:`H2DRunnerState` or an object whose
    ``h2d_state`` attribute is one (an adapter).
    """
    groups = (group, *more_groups)
    if not all(isinstance(g, str) and g for g in groups):
        raise DeclarationError(f"@h2d_producer group names must be non-empty str, got {groups}")

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def producer(*args: Any, **kwargs: Any) -> Any:
            reason = kwargs.pop("h2d_reason", None)
            if not args:
                raise H2DError(f"producer {fn.__qualname__} called without its owner argument")
            _owner_state(args[0]).enter_producer(groups, reason)
            return fn(*args, **kwargs)

        producer.h2d_groups = groups  # type: ignore[attr-defined]
        return producer  # type: ignore[return-value]

    return decorate
