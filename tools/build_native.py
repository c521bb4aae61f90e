"""Build the packages' C extensions in place, for a checkout used through PYTHONPATH.

    python3 tools/build_native.py                 # every package with extensions
    python3 tools/build_native.py block-tables    # only the packages named (directories)

Installed packages get their extensions from their wheels (each package's hatch_build.py);
this does the same compilation into ``packages/*/src/<package>/`` (ignored by git), for
the lent GPU machine and local work without installing. Needs setuptools and a C compiler.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _hook_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location(
        "_h2d_hatch_build", ROOT / "tools" / "hatch_native.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    hook = _hook_module()
    roots = sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))
    unknown = set(argv) - {r.name for r in roots}
    if unknown:
        print(f"unknown packages {sorted(unknown)}; choose from {[r.name for r in roots]}",
              file=sys.stderr)
        return 2
    for root in roots:
        if argv and root.name not in argv:
            continue
        if not hook.extensions_of(root)[0]:
            continue
        with tempfile.TemporaryDirectory() as out:
            for name, built in hook.build_extensions(root, Path(out)).items():
                target = root / "src" / built.relative_to(out)
                hook.install_in_place(built, target)
                print(f"{name}: {target.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
