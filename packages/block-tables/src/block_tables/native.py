"""Compiled hot-path helpers: extensions built with the wheel, loaded by import.

The per-step work of a decode step (reading 64-256 row keys, scattering a few appended
page IDs, deriving positions and slots) is a few hundred nanoseconds of arithmetic
wrapped in dozens of Python and numpy calls. The packages carry small C extensions that
do that work in one call. They are compiled when each package's wheel is built (its
``hatch_build.py`` hook), never at import: importing runs no compiler and writes nothing.
A checkout used through ``PYTHONPATH`` builds them in place with
``python3 tools/build_native.py``.

``H2D_NATIVE`` (read when each helper is first loaded) selects the policy:

* ``auto`` (default): use the helpers when they are installed; otherwise warn once per
  process (:class:`NativeUnavailableWarning`, naming what is missing) and run the Python
  paths, which produce the same bytes and errors;
* ``1``: require them; a missing helper raises :class:`NativeBuildError`;
* ``0``: never load them (the Python paths only).

Every native entry point checks its whole input before its first write and hands any
case it does not cover (and every error) back to the Python path, so errors and their
messages are the same on both paths.
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from types import ModuleType

from .errors import BlockTableError

__all__ = [
    "NativeBuildError",
    "NativeUnavailableWarning",
    "load_extension",
    "native_mode",
    "native_status",
    "select",
]

_MODES = ("auto", "0", "1")
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}
_missing: dict[str, str] = {}


class NativeBuildError(BlockTableError):
    """A compiled helper was required (``H2D_NATIVE=1``) but is not installed or loadable."""


class NativeUnavailableWarning(RuntimeWarning):
    """A compiled helper is missing; the (slower) Python path runs instead."""


def native_mode() -> str:
    """The ``H2D_NATIVE`` policy: ``"auto"``, ``"1"`` (required) or ``"0"`` (off)."""
    mode = os.environ.get("H2D_NATIVE", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise NativeBuildError(
            f"H2D_NATIVE={mode!r} is not one of {list(_MODES)}; use auto (use them when "
            "installed), 1 (require) or 0 (Python paths only)"
        )
    return mode


def native_status() -> dict[str, str]:
    """Each helper loaded so far: ``"loaded"``, ``"off"`` (``H2D_NATIVE=0``) or why it
    is missing."""
    with _lock:
        return {name: "loaded" if module is not None else _missing.get(name, "off")
                for name, module in _loaded.items()}


def select(module: ModuleType | None, native: bool | None, what: str) -> ModuleType | None:
    """Resolve a per-object ``native`` choice: None uses ``module`` when it loaded, False
    never does, True requires it (raising :class:`NativeBuildError` naming ``what``)."""
    if native is False:
        return None
    if module is None and native:
        raise NativeBuildError(
            f"{what}: native=True but the compiled helper is unavailable (H2D_NATIVE=0, or "
            "it is not installed: see the NativeUnavailableWarning)"
        )
    return module


def load_extension(name: str) -> ModuleType | None:
    """The installed extension module ``name`` (e.g. ``"block_tables._block_tables_native"``),
    or None when ``H2D_NATIVE=0`` or (``auto``) it is not installed. Decided once per
    process; only the first missing helper of a process warns."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        mode = native_mode()
        module: ModuleType | None = None
        if mode != "0":
            try:
                module = importlib.import_module(name)
            except ImportError as exc:
                why = f"{type(exc).__name__}: {exc}"
                if mode == "1":
                    raise NativeBuildError(
                        f"the compiled helper {name} is required (H2D_NATIVE=1) but cannot "
                        f"be imported ({why}); install the package from a wheel built with "
                        "a C compiler, or run `python3 tools/build_native.py` in a checkout"
                    ) from exc
                if not _missing:
                    warnings.warn(
                        f"the compiled helper {name} is not installed ({why}); running the "
                        "Python paths instead (same results, more host time per step). "
                        "Install the packages from wheels built with a C compiler (or run "
                        "`python3 tools/build_native.py` in a checkout), or set H2D_NATIVE=0 "
                        "to silence this warning",
                        NativeUnavailableWarning,
                        stacklevel=3,
                    )
                _missing[name] = why
        _loaded[name] = module
        return module
