"""The compiled publication helper (``_h2d_kernels_native``), built with the wheel.

``_packed_native.c`` is compiled when the wheel is built (``hatch_build.py``), never at
import. ``H2D_NATIVE`` selects the policy, as for the other packages' helpers: ``auto``
(default) uses it when installed and otherwise warns once
(:class:`~h2d_kernels.errors.NativeUnavailableWarning`) and runs the Python path, which
writes the same header rows and bytes; ``1`` requires it
(:class:`~h2d_kernels.errors.NativeRequiredError`); ``0`` never loads it.
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

from h2d_kernels.errors import NativeRequiredError, NativeUnavailableWarning

NAME = "h2d_kernels._h2d_kernels_native"


def load() -> ModuleType | None:
    """The helper module, or None (``H2D_NATIVE=0``, or ``auto`` and not installed)."""
    mode = os.environ.get("H2D_NATIVE", "auto").strip().lower() or "auto"
    if mode not in ("auto", "0", "1"):
        raise NativeRequiredError(
            f"H2D_NATIVE={mode!r} is not one of ['auto', '0', '1']; use auto (use the "
            "helpers when installed), 1 (require) or 0 (Python paths only)"
        )
    if mode == "0":
        return None
    try:
        return importlib.import_module(NAME)
    except ImportError as exc:
        why = f"{type(exc).__name__}: {exc}"
        if mode == "1":
            raise NativeRequiredError(
                f"the compiled helper {NAME} is required (H2D_NATIVE=1) but cannot be "
                f"imported ({why}); install h2d-kernels from a wheel built with a C compiler, "
                "or run `python3 tools/build_native.py` in a checkout"
            ) from exc
        warnings.warn(
            f"the compiled helper {NAME} is not installed ({why}); packed publications run "
            "their Python path (same bytes, more host time). Install h2d-kernels from a wheel "
            "built with a C compiler (or run `python3 tools/build_native.py` in a checkout), "
            "or set H2D_NATIVE=0 to silence this warning",
            NativeUnavailableWarning,
            stacklevel=2,
        )
        return None


#: loaded once, when this module is first imported
helper = load()
