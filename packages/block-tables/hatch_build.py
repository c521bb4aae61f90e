"""This package's wheel build hook: the workspace's one hook, ``tools/hatch_native.py``.

An sdist carries a copy as ``_native_hook.py`` (see ``[tool.hatch.build.targets.sdist]``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_here = Path(__file__).resolve().parent
_source = next(p for p in (_here / "_native_hook.py",
                           _here.parents[1] / "tools" / "hatch_native.py") if p.is_file())
_spec = importlib.util.spec_from_file_location("_h2d_native_hook", _source)
assert _spec is not None and _spec.loader is not None
_hook = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_hook)

NativeExtensionsHook = _hook.NativeExtensionsHook
