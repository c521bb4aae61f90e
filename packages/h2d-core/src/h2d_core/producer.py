"""``@h2d_producer``: the shared slot/epoch check in front of every metadata producer.

Compiled by Cython as ``h2d_core._producer_native`` when the package is built (required):
the wrapper runs in front of every producer call, and compiled it adds no interpreter frame.
"""

from __future__ import annotations

import functools
import inspect
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


_NO = object()  # an argument the call did not pass (the exact wrapper's default)
_PLAIN = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


# per decorator's groups, the names tuple built last (never kept on the owner: that would
# change the adapter's observed state)
_LAST_NAMES: dict = {}


def _names_of(owner: object, groups: tuple) -> tuple:
    """The group names of ``owner`` (``groups`` holding functions of it): the tuple built
    last for these ``groups`` while the names are the same (a steady step builds none),
    else a new one."""
    cache: dict = _LAST_NAMES  # typed: a C dict lookup, no bound method per call
    last: tuple | None = cache.get(groups)
    k: cython.Py_ssize_t
    if last is not None:
        for k in range(len(groups)):
            g = groups[k]
            if (g(owner) if callable(g) else g) != last[k]:
                break
        else:
            return last
    names = tuple([g(owner) if callable(g) else g for g in groups])
    cache[groups] = names
    return names


def _enter_error(qualname: str, missing: str) -> None:
    if missing == "":
        raise ProducerOwnerError(
            f"producer {qualname} called without its owner: pass the H2DRunnerState or "
            "the adapter as the first argument")
    raise TypeError(f"{qualname}() missing required argument: {missing!r}")


def _exact_wrapper(fn: Callable[..., Any], groups: tuple, dynamic: bool) -> Any:
    """A wrapper with ``fn``'s own parameters (plus keyword-only ``h2d_reason``), so a call
    packs no argument tuple or keyword dict: what a steady step calls. None when ``fn``
    takes ``*args``, ``**kwargs``, positional-only parameters or an ``h2d_reason`` (the
    generic wrapper serves those)."""
    params = list(inspect.signature(fn).parameters.values())
    if (not params or any(p.kind not in _PLAIN for p in params)
            or params[0].kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD
            or any(p.name == "h2d_reason" or p.name.startswith("_h2d") for p in params)):
        return None
    env: dict[str, Any] = {
        "_h2d_fn": fn, "_h2d_groups": groups, "_h2d_no": _NO, "_h2d_state_type": H2DRunnerState,
        "_h2d_owner_state": _owner_state, "_h2d_names_of": _names_of,
        "_h2d_error": _enter_error, "_h2d_qualname": fn.__qualname__}
    sig, checks, call = [], [], []
    keyword = False
    for i, p in enumerate(params):
        if p.kind is inspect.Parameter.KEYWORD_ONLY and not keyword:
            sig.append("*")
            keyword = True
        if p.default is inspect.Parameter.empty:
            sig.append(f"{p.name}=_h2d_no")  # refused below by name: the owner's own error
            checks.append(f"    if {p.name} is _h2d_no: _h2d_error(_h2d_qualname, "
                          f"{('' if i == 0 else p.name)!r})")
        else:
            env[f"_h2d_d{i}"] = p.default
            sig.append(f"{p.name}=_h2d_d{i}")
        call.append(f"{p.name}={p.name}" if keyword else p.name)
    if not keyword:
        sig.append("*")
    sig.append("h2d_reason=None")
    owner = params[0].name
    names = (f"_h2d_names_of({owner}, _h2d_groups)" if dynamic else "_h2d_groups")
    source = "\n".join([
        f"def producer({', '.join(sig)}):",
        *checks,
        # the common owner, an adapter holding the state, without isinstance calls; the
        # locals are _h2d_-named so no parameter of the producer is shadowed
        f"    _h2d_st = getattr({owner}, 'h2d_state', None)",
        "    if type(_h2d_st) is not _h2d_state_type:",
        f"        _h2d_st = _h2d_owner_state({owner}, _h2d_qualname)",
        f"    _h2d_names = {names}",
        "    _h2d_st.enter_producer(_h2d_names, h2d_reason)",
        "    try:",
        f"        return _h2d_fn({', '.join(call)})",
        "    except BaseException:",
        # a producer that failed published nothing: let it be retried as a first entry
        "        _h2d_st.leave_producer_after_error(_h2d_names)",
        "        raise",
    ])
    exec(compile(source, f"<h2d_producer {fn.__qualname__}>", "exec"), env)
    return env["producer"]


def _generic_wrapper(fn: Callable[..., Any], groups: tuple, dynamic: bool) -> Any:
    """The wrapper for any other signature (its call packs its arguments)."""

    def producer(*args: Any, **kwargs: Any) -> Any:
        reason = kwargs.pop("h2d_reason", None) if kwargs else None
        if not args:
            _enter_error(fn.__qualname__, "")
        state = getattr(args[0], "h2d_state", None)
        if type(state) is not H2DRunnerState:
            state = _owner_state(args[0], fn.__qualname__)
        names: tuple[str, ...] = (
            tuple(g(args[0]) if callable(g) else g for g in groups)
            if dynamic else groups
        )
        state.enter_producer(names, reason)
        try:
            return fn(*args, **kwargs)
        except BaseException:
            state.leave_producer_after_error(names)
            raise

    return producer


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
        producer = _exact_wrapper(fn, groups, dynamic)
        if producer is None:
            producer = _generic_wrapper(fn, groups, dynamic)
        functools.update_wrapper(producer, fn)
        # the public producer mark (see the docstring)
        producer.h2d_groups = groups
        return producer

    return decorate


# This source is compiled by Cython, as ``h2d_core._producer_native``, when the package is
# built; run interpreted, it only hands over to that build (required).
if not cython.compiled:
    from block_tables.native import require_extension

    _compiled = require_extension("h2d_core._producer_native")
    h2d_producer = _compiled.h2d_producer
