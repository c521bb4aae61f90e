"""The compiled publication core (``_h2d_kernels_native``), required at import.

Built when the package is installed (``hatch_build.py``) or, in a checkout, by
``python3 tools/build_native.py``; importing never compiles. Without it
:mod:`h2d_kernels` does not import: :class:`~h2d_kernels.errors.NativeRequiredError`
names the fix.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from h2d_kernels.errors import NativeRequiredError

NAME = "h2d_kernels._h2d_kernels_native"


def load() -> ModuleType:
    """The compiled module; raises :class:`NativeRequiredError` when it is not built."""
    try:
        return importlib.import_module(NAME)
    except ImportError as exc:
        raise NativeRequiredError(
            f"the compiled core {NAME} is not built ({type(exc).__name__}: {exc}); install "
            "the packages with pip (`pip install packages/h2d-kernels ...` or `pip install "
            "-e`: it compiles them and needs Cython and a C compiler), or in a checkout used "
            "through PYTHONPATH run `python3 tools/build_native.py`"
        ) from exc


#: loaded once, when this module is first imported
helper = load()
