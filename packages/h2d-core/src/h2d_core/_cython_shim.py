"""No-op stand-ins for the Cython pure-Python-mode names the compiled modules use.

``records.py`` is compiled by Cython when the wheel is built (``hatch_build.py``); where it
runs interpreted and Cython is not installed, it imports this instead of ``cython``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F")

compiled = False
bint = bool
longlong = int
Py_ssize_t = int


def cclass(cls: F) -> F:
    return cls


def ccall(fn: F) -> F:
    return fn


def declare(*args: Any, **kwargs: Any) -> Any:
    return None


def locals(**kwargs: Any) -> Callable[[F], F]:
    return lambda fn: fn
