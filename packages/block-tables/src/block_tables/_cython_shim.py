"""No-op stand-ins for the Cython pure-Python-mode names the compiled modules use.

``h2d_core.request_layout`` and ``h2d_core.records`` are compiled by Cython when their
wheels are built (``hatch_build.py``); where they run interpreted and Cython is not
installed, they import this instead of ``cython``.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F")

compiled = False


class _CType:
    """A C type's stand-in: converts like the Python type it maps to, and indexes to a
    memoryview type (``int[::1]``) that means "any array" here."""

    def __init__(self, python: type) -> None:
        self._python = python

    def __call__(self, value: Any) -> Any:
        return self._python(value)

    def __getitem__(self, item: Any) -> object:
        return object


bint = _CType(bool)
int = _CType(builtins.int)
longlong = _CType(builtins.int)
Py_ssize_t = _CType(builtins.int)


def cast(kind: Any, value: Any) -> Any:
    return kind(value)


def cclass(cls: F) -> F:
    return cls


def ccall(fn: F) -> F:
    return fn


def cfunc(fn: F) -> F:
    return fn


def inline(fn: F) -> F:
    return fn


def boundscheck(flag: bool) -> Callable[[F], F]:
    return lambda fn: fn


wraparound = boundscheck
cdivision = boundscheck
annotation_typing = boundscheck


def declare(*args: Any, **kwargs: Any) -> Any:
    return None


def locals(**kwargs: Any) -> Callable[[F], F]:
    return lambda fn: fn


def exceptval(*args: Any, **kwargs: Any) -> Callable[[F], F]:
    return lambda fn: fn
