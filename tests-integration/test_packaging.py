"""The compiled helpers as installed: loaded without a compiler, and missing without harm.

Each package with C helpers builds them into its wheel (``hatch_build.py``); importing never
compiles. These tests run the packages in a subprocess: once with no compiler reachable and
the helpers required (they must come from the installation), once with the helpers hidden
(the packages must import, warn once per package family that misses its helpers, and publish
the same bytes through their Python paths).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

NATIVE = (
    "block_tables._block_tables_native",
    "h2d_core._h2d_core_native",
    "h2d_core._records_native",  # records.py, compiled by Cython
    "h2d_core._step_native",  # step.py, compiled by Cython
    "block_tables._request_layout",  # request_layout.py, compiled by Cython
)
KERNELS_NATIVE = "h2d_kernels._h2d_kernels_native"  # loaded by h2d_kernels.native

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


@pytest.mark.skipif(os.environ.get("H2D_NATIVE", "auto").strip() == "0",
                    reason="H2D_NATIVE=0: the compiled helpers are switched off")
def test_helpers_load_with_no_compiler_and_write_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    script = PUBLISH + (
        "import importlib, block_tables.native as n\n"
        f"for name in {NATIVE!r}:\n"
        "    n.load_extension(name)\n"
        "print(sorted(n.native_status().items()))\n"
        "import h2d_kernels.native as k\n"
        "assert k.helper is not None\n"
        "import h2d_core.records as r\n"
        "assert r.COMPILED  # the Cython-compiled record rules took over\n"
    )
    done = _run(script, PATH="", CC="/nonexistent/cc", HOME=str(home), H2D_NATIVE="1",
                XDG_CACHE_HOME=str(home / "cache"), TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stderr
    for name in NATIVE:
        assert f"('{name}', 'loaded')" in done.stdout
    assert list(home.iterdir()) == []


def test_packages_work_without_their_helpers_and_warn_once() -> None:
    script = HIDE_HELPERS + (
        "import warnings\n"
        "with warnings.catch_warnings(record=True) as rec:\n"
        "    warnings.simplefilter('always')\n"
    ) + "".join(f"    {line}\n" for line in PUBLISH.splitlines()) + (
        "from block_tables.native import NativeUnavailableWarning, native_status\n"
        "from h2d_kernels.errors import NativeUnavailableWarning as KernelsWarning\n"
        "# one warning per package family that misses its helpers, each naming it\n"
        "for cls in (NativeUnavailableWarning, KernelsWarning):\n"
        "    mine = [w for w in rec if issubclass(w.category, cls)]\n"
        "    assert len(mine) == 1, [str(w.message) for w in mine]\n"
        "print(sorted(k for k, v in native_status().items() if v != 'loaded'))\n"
        "import h2d_core.records as r\n"
        "assert not r.COMPILED\n"
    )
    done = _run(script, H2D_NATIVE="auto", TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stderr
    assert "h2d_core._h2d_core_native" in done.stdout
    required = _run(HIDE_HELPERS + "import h2d_core", H2D_NATIVE="1")
    assert required.returncode != 0
    assert "NativeBuildError" in required.stderr or "NativeRequiredError" in required.stderr
