"""The compiled core: extensions built with each wheel, required at import.

The per-step work of a decode step (reading 64-256 row keys, scattering a few appended
page IDs, deriving positions and slots, counting, packing) is a few hundred nanoseconds
of arithmetic; run as Python and numpy calls it costs tens of microseconds. Every
package's rules therefore live once, in Cython, compiled when the package is installed
(``pip install`` / ``pip install -e`` run each package's ``hatch_build.py``), or in a
checkout used through ``PYTHONPATH`` by ``python3 tools/build_native.py``. Importing never
compiles and never writes anything.

There is no interpreted mode: a package whose extension is missing fails at import with
:class:`NativeBuildError`, which names the module and the fix.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import BlockTableError

__all__ = ["FIX", "NativeBuildError", "require_extension"]

#: how to get the compiled core, quoted by every error about it
FIX = ("install the packages with pip (`pip install packages/block-tables packages/h2d-kernels "
       "packages/h2d-core packages/h2d-runner-adapters`, or `pip install -e` each: it compiles "
       "them and needs Cython and a C compiler), or in a checkout used through PYTHONPATH run "
       "`python3 tools/build_native.py`")


class NativeBuildError(BlockTableError, ImportError):
    """A package's compiled core is not built (or cannot be loaded)."""


def require_extension(name: str) -> ModuleType:
    """The compiled extension module ``name`` (e.g. ``"block_tables._snapshot_native"``);
    raises :class:`NativeBuildError` naming it and :data:`FIX` when it cannot be imported."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise NativeBuildError(
            f"the compiled core {name} is not built ({type(exc).__name__}: {exc}); {FIX}"
        ) from exc

