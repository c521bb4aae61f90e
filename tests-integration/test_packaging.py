"""The compiled core as installed: loaded without a compiler, and required.

Each package builds its Cython extensions into its wheel (``hatch_build.py``); importing
never compiles. These tests run the packages in a subprocess: once with no compiler
reachable (the extensions must come from the installation, and nothing is written), and
once per extension hidden (the package must refuse to import, naming the fix).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

NATIVE = (
    "block_tables._snapshot_native",
    "h2d_core._events_native",
    "h2d_core._records_native",  # records.py, compiled by Cython
    "h2d_core._count_program_native",
    "h2d_core._layout_plans_native",
    "h2d_core._layout_length_outputs_native",
    "h2d_core._layout_writes_native",
    "h2d_core._layout_lengths_native",
    "h2d_core._step_native",  # step.py, compiled by Cython
    "h2d_core._epoch_native",  # epoch.py
    "h2d_core._completions_native",  # completions.py
    "h2d_core._epoch_groups_native",  # epoch_groups.py
    "h2d_core._producer_native",  # producer.py
    "h2d_core._table_stage_native",  # table_stage.py
    "h2d_core._request_layout_native",  # request_layout.py, compiled by Cython
    "h2d_core._layout_columns_native",  # layout_columns.py
    "h2d_core._layout_outputs_native",  # layout_outputs.py
    "h2d_core._layout_sums_native",  # layout_sums.py
    "block_tables._staging_native",  # staging.py
)
KERNELS_NATIVE = "h2d_kernels._packed_native"  # loaded by h2d_kernels.native

# A finder that refuses the compiled helpers: the packages as installed without them.
HIDE_HELPERS = (
    "import importlib.abc, sys\n"
    f"HIDDEN = {(*NATIVE, KERNELS_NATIVE)!r}\n"
    "class Refuse(importlib.abc.MetaPathFinder):\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name in HIDDEN:\n"
    "            raise ModuleNotFoundError(f'no module named {name!r} (hidden by the test)')\n"
    "sys.meta_path.insert(0, Refuse())\n"
)

# One small packed publication on the CPU: two members of one group, exact bytes checked.
PUBLISH = (
    "import torch\n"
    "from h2d_core import H2DRunnerState\n"
    "import h2d_runner_adapters\n"
    "st = H2DRunnerState('cpu', backend='packed', scatter='reference')\n"
    "a = st.buffer('a', (8,), torch.int32, group='g')\n"
    "b = st.buffer('b', (4, 4), torch.int64, group='g', unit='rows')\n"
    "st.bind(); st.begin()\n"
    "a.np[:] = range(8); b.np[:] = 7\n"
    "st.set_count(a, 5); st.set_count(b, 2)\n"
    "st.publish('g'); st.finish()\n"
    "assert a.gpu[:5].tolist() == [0, 1, 2, 3, 4] and a.gpu[5:].tolist() == [0, 0, 0]\n"
    "assert b.gpu[:2].eq(7).all() and b.gpu[2:].eq(0).all()\n"
    "assert st.counters('g').dmas == 1\n"
)


def _run(script: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", script], env={**os.environ, **env},
                          capture_output=True, text=True, check=False, timeout=300)


def test_helpers_load_with_no_compiler_and_write_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    script = PUBLISH + (
        "import importlib\n"
        f"for name in {(*NATIVE, KERNELS_NATIVE)!r}:\n"
        "    print(name, importlib.import_module(name).__file__.endswith('.so'))\n"
        "import h2d_core.records as r, h2d_core._records_native as c\n"
        "assert r.GroupRecord is c.GroupRecord  # the Cython-compiled record rules took over\n"
    )
    done = _run(script, PATH="", CC="/nonexistent/cc", HOME=str(home),
                XDG_CACHE_HOME=str(home / "cache"), TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stderr
    for name in (*NATIVE, KERNELS_NATIVE):
        assert f"{name} True" in done.stdout
    assert list(home.iterdir()) == []


# the package whose import needs each compiled module
NEEDED_BY = {
    "block_tables._snapshot_native": "block_tables",
    "h2d_core._request_layout_native": "h2d_core",
    "h2d_core._layout_columns_native": "h2d_core",
    "h2d_core._layout_outputs_native": "h2d_core",
    "h2d_core._layout_sums_native": "h2d_core",
    "block_tables._staging_native": "block_tables",
    "h2d_core._epoch_native": "h2d_core",
    "h2d_core._completions_native": "h2d_core",
    "h2d_core._epoch_groups_native": "h2d_core",
    "h2d_core._events_native": "h2d_core",
    "h2d_core._producer_native": "h2d_core",
    "h2d_core._records_native": "h2d_core",
    "h2d_core._count_program_native": "h2d_core",
    "h2d_core._layout_plans_native": "h2d_core",
    "h2d_core._layout_length_outputs_native": "h2d_core",
    "h2d_core._layout_writes_native": "h2d_core",
    "h2d_core._layout_lengths_native": "h2d_core",
    "h2d_core._step_native": "h2d_core",
    "h2d_core._table_stage_native": "h2d_core",
    KERNELS_NATIVE: "h2d_kernels",
}


@pytest.mark.parametrize("hidden", sorted(NEEDED_BY))
def test_a_missing_compiled_core_fails_the_import_naming_the_fix(hidden: str) -> None:
    """There is no interpreted mode: each package refuses to import without its compiled
    core, with one error that names the module and how to build it."""
    script = HIDE_HELPERS.replace(f"HIDDEN = {(*NATIVE, KERNELS_NATIVE)!r}",
                                  f"HIDDEN = ({hidden!r},)") + f"import {NEEDED_BY[hidden]}\n"
    done = _run(script, TRITON_INTERPRET="1")
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "NativeBuildError" in last, done.stderr  # one error type, every package
    assert f"the compiled core {hidden} is not built" in last, last
    assert "python3 tools/build_native.py" in last and "pip install" in last, last


def test_every_extension_follows_the_one_naming_rule() -> None:
    """A compiled module is named after its source: ``foo.py``, ``foo.pyx`` or ``_foo.pyx``
    builds ``<package>._foo_native``, and every extension a package builds is one the
    tests above load."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    built = []
    for project in sorted(root.glob("packages/*/pyproject.toml")):
        config = tomllib.loads(project.read_text())["tool"]["hatch"]["build"]["targets"]
        extensions = config["wheel"].get("hooks", {}).get("custom", {}).get("extensions", {})
        for name, source in extensions.items():
            stem = Path(source).stem.lstrip("_")
            package = Path(source).parent.name
            assert name == f"{package}._{stem}_native", (project, name, source)
            built.append(name)
    assert sorted(built) == sorted((*NATIVE, KERNELS_NATIVE))


#: every module of every package imported where Cython is not installed (it is a build
#: dependency only: the wheels hold the compiled cores)
WITHOUT_CYTHON = (
    "import importlib, pkgutil, sys\n"
    "class NoCython:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('cython', 'Cython'):\n"
    "            raise ImportError(f'no module named {name!r} (hidden by the test)')\n"
    "sys.meta_path.insert(0, NoCython())\n"
    "for pkg in ('block_tables', 'h2d_kernels', 'h2d_core', 'h2d_runner_adapters'):\n"
    "    for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + '.'):\n"
    "        importlib.import_module(info.name)\n"
    "assert 'cython' not in sys.modules and 'Cython' not in sys.modules\n"
)


def test_every_module_imports_where_cython_is_not_installed() -> None:
    """An engine installs the built wheels without Cython: the pure-mode sources run their
    decorators and declarations through ``block_tables._cython_shim`` before handing over
    to the compiled core, so the shim must stand in for every Cython name they use."""
    done = _run(WITHOUT_CYTHON + PUBLISH, TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stderr[-3000:]
