"""``@h2d_producer``: the shared slot/epoch check in front of every metadata producer.

Compiled by Cython as ``h2d_core._producer_native`` when the package is built (required):
the wrapper runs in front of every producer call, and compiled it adds no interpreter frame.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from .errors import DeclarationError, ProducerOwnerError
from .state import H2DRunnerState

try:
    import cython
except ImportError:  # interpreted where Cython is not installed: no-op decorators
    from block_tables import _cython_shim as cython  # type: ignore[no-redef, unused-ignore]

P = ParamSpec("P")
R = TypeVar("R")


def _owner_state(owner: object, producer: str) -> H2DRunnerState:
    state = owner if isinstance(owner, H2DRunnerState) else getattr(owner, "h2d_state", None)
    if not isinstance(state, H2DRunnerState):
        raise ProducerOwnerError(
            f"producer {producer}: its first argument must be the H2DRunnerState or an "
            f"adapter whose .h2d_state is one, got {type(owner).__name__}; call it as a "
            "method of the adapter that declared its buffers"
        )
    return state


GroupName = str | Callable[[Any], str]


def h2d_producer(
    group: GroupName, *more_groups: GroupName
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Declare that the decorated function writes the sources of the named groups.

    A group may also be given as a function of the owner (the first argument), for
    adapters instantiated once per buffer set, e.g. one per two-batch-overlap ubatch:
    ``@h2d_producer(lambda self: self.group)``.

    Before the producer runs, the owner's current slot and epoch are checked: outside an
    epoch, after invalidation, from another thread, or on a second entry in the same epoch
    the call is rejected and the producer never runs, so earlier sources stay intact. A
    deliberate second publication passes ``h2d_reason="why"``: the sources are acquired
    (their earlier DMA has completed) before the producer rewrites them.

    The first positional argument must be the :class:`H2DRunnerState` or an object whose
    ``h2d_state`` attribute is one (an adapter).

    The returned wrapper carries ``h2d_groups``, the groups as declared (names, or the
    functions of the owner that give them): the public mark of a producer, by which tools
    and tests tell a decorated method from an undecorated one
    (``hasattr(cls.method, "h2d_groups")``; the rule that every source-writing adapter
    method carries it is ``test_producer_decorators.py``'s).
    """
    groups = (group, *more_groups)
    if not all((isinstance(g, str) and g) or callable(g) for g in groups):
        raise DeclarationError(
            f"@h2d_producer groups must be non-empty str or callables, got {groups}"
        )
    dynamic = any(callable(g) for g in groups)

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def producer(*args: Any, **kwargs: Any) -> Any:
            reason = kwargs.pop("h2d_reason", None) if kwargs else None
            if not args:
                raise ProducerOwnerError(
                    f"producer {fn.__qualname__} called without its owner: pass the "
                    "H2DRunnerState or the adapter as the first argument")
            # the common owner, an adapter holding the state, without isinstance calls
            state = getattr(args[0], "h2d_state", None)
            if type(state) is not H2DRunnerState:
                state = _owner_state(args[0], fn.__qualname__)
            names: tuple[str, ...] = (
                tuple(g(args[0]) if callable(g) else g for g in groups)
                if dynamic else groups  # type: ignore[assignment]
            )
            state.enter_producer(names, reason)
            try:
                return fn(*args, **kwargs)
            except BaseException:
                # A producer that failed published nothing: let it be retried as a first entry.
                state.leave_producer_after_error(names)
                raise

        # the public producer mark (see the docstring)
        producer.h2d_groups = groups  # type: ignore[attr-defined]
        return producer

    return decorate


# This source is compiled by Cython, as ``h2d_core._producer_native``, when the package is
# built; run interpreted, it only hands over to that build (required).
if not cython.compiled:
    from block_tables.native import require_extension

    _compiled = require_extension("h2d_core._producer_native")
    h2d_producer = _compiled.h2d_producer
