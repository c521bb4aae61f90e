"""Hatchling build hook: compile a package's Cython extensions when its wheel is built.

The workspace's one build hook: each package with compiled parts loads it from its
``hatch_build.py`` (here in a checkout; an sdist carries a copy as ``_native_hook.py``), and
``tools/build_native.py`` uses it for a checkout run through ``PYTHONPATH``. A package
lists its extensions in its ``pyproject.toml``, one per source, named by one rule: a
source ``foo.py`` or ``foo.pyx`` (or ``_foo.pyx``) builds ``<package>._foo_native``::

    [tool.hatch.build.targets.wheel.hooks.custom]
    extensions = { "block_tables._snapshot_native" = "src/block_tables/_snapshot.pyx" }
    numpy = ["block_tables._snapshot_native"]   # sources that include numpy's headers

Every source is Cython: a ``.pyx`` module, or a ``.py`` module in Cython's pure-Python
mode (e.g. ``h2d_core._records_native`` from ``records.py``, which mypy and ruff check
too; run interpreted, that ``.py`` only hands over to its compiled build). Cython turns
each into C, and setuptools' ``build_ext`` compiles it with the platform's compiler and
flags; the wheel then gets a platform tag. The compiled core is required: a build that
cannot compile an extension fails, naming it. Importing the installed package never
compiles anything.

An editable install (``pip install -e``) imports the package from ``src/``, so there the
hook writes the compiled modules into ``src/<package>/`` (ignored by git) instead of the
wheel. ``python3 tools/build_native.py`` does the same for a checkout used through
``PYTHONPATH``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

try:
    from hatchling.builders.hooks.plugin.interface import BuildHookInterface
except ImportError:  # imported as a plain module by tools/build_native.py
    BuildHookInterface = object  # type: ignore[assignment,misc]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class NativeBuildFailed(RuntimeError):
    """An extension did not compile."""


def extensions_of(root: Path) -> tuple[dict[str, Path], frozenset[str]]:
    """(module name -> Cython source, names that need numpy's headers) from ``root``'s
    pyproject.toml."""
    data = tomllib.loads((root / "pyproject.toml").read_text())
    config = (data.get("tool", {}).get("hatch", {}).get("build", {}).get("targets", {})
              .get("wheel", {}).get("hooks", {}).get("custom", {}))
    return ({name: root / src for name, src in config.get("extensions", {}).items()},
            frozenset(config.get("numpy", ())))


def build_extensions(root: Path, out_dir: Path) -> dict[str, Path]:
    """Compile ``root``'s extensions under ``out_dir`` (package layout); return each
    module name's built file. Raises :class:`NativeBuildFailed` naming the extension."""
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    sources, numpy_names = extensions_of(root)
    built: dict[str, Path] = {}
    for i, (name, source) in enumerate(sources.items(), 1):
        # each module takes seconds to tens of seconds: say which one is compiling (pip
        # shows it with -v; tools/build_native.py always)
        print(f"compiling {name} from {source.name} ({i}/{len(sources)})", file=sys.stderr,
              flush=True)
        include = []
        if name in numpy_names:
            import numpy

            include.append(numpy.get_include())
        with tempfile.TemporaryDirectory() as temp:
            c_source = source
            if source.suffix in (".py", ".pyx"):
                c_source = _cythonize(name, source, Path(temp), root)
            ext = Extension(name, [str(c_source)], include_dirs=include,
                            extra_compile_args=["-O2", "-fno-strict-aliasing"]
                            if os.name != "nt" else [])
            dist = Distribution({"name": name, "ext_modules": [ext]})
            cmd = build_ext(dist)
            cmd.build_lib = str(out_dir)
            cmd.build_temp = temp
            cmd.ensure_finalized()
            try:
                cmd.run()
            except Exception as exc:  # setuptools raises CompileError, LinkError, ...
                raise NativeBuildFailed(f"building {name} from {source} failed: {exc}") from exc
        built[name] = Path(cmd.get_ext_fullpath(name))
    return built


def install_in_place(built: Path, target: Path) -> None:
    """Move a freshly built module to ``target`` by a rename, so that a process that has
    the old file mapped keeps its mapping instead of seeing it rewritten under it."""
    partial = target.with_name(target.name + ".partial")
    shutil.copyfile(built, partial)
    os.replace(partial, target)


def _include_path(root: Path) -> list[str]:
    """Where Cython finds the ``.pxd`` declarations a module cimports (e.g. h2d-core's
    ``cimport`` of ``block_tables._staging_native``): the package's own ``src``, the
    workspace's other packages' in a checkout, then every import path (an installed
    dependency)."""
    here = Path(__file__).resolve().parent
    workspace = sorted((here.parent / "packages").glob("*/src")) if here.name == "tools" else []
    paths = [str(root / "src"), *(str(p) for p in workspace)]
    return paths + [p for p in sys.path if p and Path(p).is_dir() and p not in paths]


def _cythonize(name: str, source: Path, temp: Path, root: Path) -> Path:
    """C translation of a Cython module (``.pyx``, or ``.py`` in pure-Python mode), written
    under ``temp``; its augmenting ``.pxd``, when there is one, is ``<module>.pxd`` beside
    the source (e.g. ``_staging_native.pxd`` for ``staging.py``)."""
    try:
        from Cython.Compiler.Main import CompilationOptions, compile_single
    except ImportError as exc:
        raise NativeBuildFailed(f"building {name} from {source} needs Cython: {exc}") from exc
    target = temp / f"{name.rpartition('.')[2]}.c"
    options = CompilationOptions(language_level=3, output_file=str(target),
                                 include_path=_include_path(root))
    result = compile_single(str(source), options, full_module_name=name)
    if result.num_errors:
        raise NativeBuildFailed(f"Cython could not translate {source} ({name})")
    return target


class NativeExtensionsHook(BuildHookInterface):  # type: ignore[misc,valid-type]
    """Adds the compiled extensions to the wheel and marks it platform-specific."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        root = Path(self.root)
        self._temp = tempfile.TemporaryDirectory(prefix="h2d-native-")
        out = Path(self._temp.name)
        built = build_extensions(root, out)  # NativeBuildFailed: no wheel without its core
        if version == "editable":
            # An editable install imports the package from src/, which shadows anything the
            # wheel itself carries: the compiled modules must sit beside their sources.
            for path in built.values():
                install_in_place(path, root / "src" / path.relative_to(out))
        else:
            for path in built.values():
                build_data["force_include"][str(path)] = str(path.relative_to(out))
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def finalize(self, version: str, build_data: dict[str, Any], artifact_path: str) -> None:
        temp = getattr(self, "_temp", None)
        if temp is not None:
            temp.cleanup()
