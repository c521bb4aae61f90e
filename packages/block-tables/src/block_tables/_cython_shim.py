"""No-op stand-ins for the Cython pure-Python-mode names the compiled modules use.

The pure-mode sources (``h2d_core.epoch``, ``h2d_core.request_layout``,
``block_tables.staging``, ...) are compiled by Cython when their wheels are built; Cython
is a build dependency only. Imported where it is not installed, a source runs its
decorators and declarations through this module before it hands over to its compiled
core, so every Cython name a source uses outside an annotation needs a stand-in here
(``tests-integration/test_packaging.py`` imports every module without Cython).
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


class _Pointer:
    """``cython.pointer[T]``'s stand-in: any object."""

    def __getitem__(self, item: Any) -> object:
        return object


bint = _CType(bool)
int = _CType(builtins.int)
ulong = _CType(builtins.int)
longlong = _CType(builtins.int)
Py_ssize_t = _CType(builtins.int)
float = _CType(builtins.float)
double = _CType(builtins.float)
void = _CType(object)
pointer = _Pointer()


def address(value: Any) -> Any:
    return value


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
always_allow_keywords = boundscheck


def declare(*args: Any, **kwargs: Any) -> Any:
    return None


def locals(**kwargs: Any) -> Callable[[F], F]:
    return lambda fn: fn


def exceptval(*args: Any, **kwargs: Any) -> Callable[[F], F]:
    return lambda fn: fn
