"""The compiled publication core (``_packed_native``, from ``_packed.pyx``), required at
import.

Built when the package is installed (``hatch_build.py``) or, in a checkout, by
``python3 tools/build_native.py``; importing never compiles. Loaded through the
workspace's one loader, :func:`block_tables.native.require_extension`: without it
:mod:`h2d_kernels` does not import, and :class:`~block_tables.native.NativeBuildError`
names the fix.
"""

from __future__ import annotations

from block_tables.native import require_extension

NAME = "h2d_kernels._packed_native"

#: loaded once, when this module is first imported
helper = require_extension(NAME)
