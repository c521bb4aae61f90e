"""Compiled hot-path helpers: build a C extension from a shipped source on first use.

The per-step work of a decode step (reading 64-256 row keys, scattering a few appended
page IDs, deriving positions and slots) is a few hundred nanoseconds of arithmetic
wrapped in dozens of Python and numpy calls, each costing ~0.3-1 µs. The packages ship
small C sources (CPython API, buffer protocol; no numpy headers) that do that work in one
call. They are compiled on first use with the system C compiler (``$CC`` or ``cc``)
against this interpreter's headers, as Triton compiles its launchers, and cached per
source, interpreter and platform in ``$H2D_NATIVE_CACHE`` (default
``~/.cache/h2d-native``).

``H2D_NATIVE`` (read when each helper is first loaded) selects the policy:

* ``auto`` (default): use the helpers when they build; otherwise warn once
  (:class:`NativeUnavailableWarning`, naming the compiler error) and run the numpy path,
  which produces the same bytes;
* ``1``: require them; a build failure raises :class:`NativeBuildError`;
* ``0``: never build them (the numpy path only).

Every native entry point checks its whole input before its first write and hands any
case it does not cover (and every error) back to the Python path, so errors and their
messages are the same on both paths.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import threading
import warnings
from pathlib import Path
from types import ModuleType

from .errors import BlockTableError

__all__ = [
    "NativeBuildError",
    "NativeUnavailableWarning",
    "load_extension",
    "native_mode",
    "select",
]

_MODES = ("auto", "0", "1")
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


class NativeBuildError(BlockTableError):
    """A compiled helper was required (``H2D_NATIVE=1``) but could not be built or loaded."""


class NativeUnavailableWarning(RuntimeWarning):
    """A compiled helper could not be built; the (slower) numpy path runs instead."""


def native_mode() -> str:
    """The ``H2D_NATIVE`` policy: ``"auto"``, ``"1"`` (required) or ``"0"`` (off)."""
    mode = os.environ.get("H2D_NATIVE", "auto").strip().lower() or "auto"
    if mode not in _MODES:
        raise NativeBuildError(
            f"H2D_NATIVE={mode!r} is not one of {list(_MODES)}; use auto (build when "
            "possible), 1 (require) or 0 (numpy only)"
        )
    return mode


def _cache_dir() -> Path:
    root = os.environ.get("H2D_NATIVE_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "h2d-native"


def _numpy_include() -> str:
    import numpy

    return str(numpy.get_include())


def _compile(name: str, source: Path, target: Path, numpy_api: bool) -> None:
    cc = shlex.split(os.environ.get("CC", "cc"))
    include = sysconfig.get_paths()["include"]
    target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target, then rename: concurrent processes never load a partial file
    fd, tmp = tempfile.mkstemp(suffix=target.suffix, dir=target.parent)
    os.close(fd)
    cmd = [*cc, "-O2", "-shared", "-fPIC", "-fno-strict-aliasing", f"-I{include}",
           *([f"-I{_numpy_include()}"] if numpy_api else []), str(source), "-o", tmp]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise NativeBuildError(
                f"building {name} failed ({' '.join(cmd)}):\n{done.stderr.strip()}"
            )
        os.replace(tmp, target)
    except OSError as exc:
        raise NativeBuildError(f"building {name} failed: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_and_load(name: str, source: Path, numpy_api: bool) -> ModuleType:
    text = source.read_bytes()
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    # built against numpy's headers: a numpy upgrade must rebuild it
    numpy_tag = _numpy_include() + __import__("numpy").__version__ if numpy_api else ""
    tag = hashlib.sha256(
        text + sys.version.encode() + sys.platform.encode() + suffix.encode()
        + os.environ.get("CC", "cc").encode() + numpy_tag.encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{tag}{suffix}"
    if not target.exists():
        _compile(name, source, target, numpy_api)
    spec = importlib.util.spec_from_file_location(name, target)
    if spec is None or spec.loader is None:
        raise NativeBuildError(f"cannot load {target} as extension {name}")
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise NativeBuildError(f"loading {target} failed: {exc}") from exc
    return module


def select(module: ModuleType | None, native: bool | None, what: str) -> ModuleType | None:
    """Resolve a per-object ``native`` choice: None uses ``module`` when it loaded, False
    never does, True requires it (raising :class:`NativeBuildError` naming ``what``)."""
    if native is False:
        return None
    if module is None and native:
        raise NativeBuildError(
            f"{what}: native=True but the compiled helper is unavailable (H2D_NATIVE=0, or it "
            "did not build: see the NativeUnavailableWarning)"
        )
    return module


def load_extension(name: str, source: Path, *, numpy_api: bool = False) -> ModuleType | None:
    """The extension module ``name`` built from ``source`` (whose init is ``PyInit_<name>``),
    or None when ``H2D_NATIVE=0`` or (``auto``) it cannot be built. Built once per process.
    ``numpy_api``: the source includes numpy's C headers (``numpy/arrayobject.h``)."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        mode = native_mode()
        module: ModuleType | None = None
        if mode != "0":
            try:
                module = _build_and_load(name, source, numpy_api)
            except NativeBuildError as exc:
                if mode == "1":
                    raise
                warnings.warn(
                    f"{exc}\nRunning the numpy path instead (same results, more host time); "
                    "install a C compiler and the Python headers, or set H2D_NATIVE=0 to "
                    "silence this warning",
                    NativeUnavailableWarning,
                    stacklevel=3,
                )
        _loaded[name] = module
        return module
