"""Which way to compile the per-step contract: the same typed source, four ways.

A toy of the publication core's per-step shape (a slot record of 11 counts: begin, 11
validated count stores, finish) written once in typed Python, run

* interpreted;
* compiled by Cython in pure-Python mode (``@cython.cclass``, ``@cython.ccall`` methods,
  the same file);
* compiled by mypyc (the same file without the Cython decorators);

each called two ways: one call per operation (begin, 11 ``set_count``, finish: what
runners do today) and one fused call per step (what the issue proposes: few calls that
each do a lot). Prints host ns per step (median of repeated timings). Needs Cython,
mypy (mypyc) and a C compiler; builds into a temporary folder.

    python tools/perf/core_candidates.py
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

SOURCE = '''
import cython

@cython.cclass
class Slot:
    counts: list
    units: list
    capacity: list
    open: cython.bint
    epoch: cython.longlong
    active: cython.longlong
    count_bytes: cython.longlong

    def __init__(self, units: list, capacity: list) -> None:
        self.units = units
        self.capacity = capacity
        self.counts = [None] * len(units)
        self.open = False
        self.epoch = 0
        self.active = 0
        self.count_bytes = 0

    @cython.ccall
    def begin(self) -> None:
        if self.open:
            raise RuntimeError("epoch open")
        self.epoch += 1
        self.counts = [None] * len(self.units)
        self.active = 0
        self.count_bytes = 0
        self.open = True

    @cython.ccall
    def set_count(self, i: cython.Py_ssize_t, n: object) -> None:
        if not self.open:
            raise RuntimeError("outside an epoch")
        if n is None:
            return
        if type(n) is not int or not 0 <= n <= self.capacity[i]:
            raise ValueError("bad count")
        if self.counts[i] is None:
            self.active += 1
        self.counts[i] = n
        self.count_bytes += n * self.units[i]

    @cython.ccall
    def finish(self) -> None:
        if not self.open:
            raise RuntimeError("no epoch")
        self.open = False

    def step(self, values: tuple) -> None:
        self.begin()
        i: cython.Py_ssize_t
        for i in range(len(values)):
            self.set_count(i, values[i])
        self.finish()
'''


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(folder: Path) -> dict[str, ModuleType]:
    plain = SOURCE.replace("import cython\n", "").replace("@cython.cclass\n", "")
    plain = plain.replace("    @cython.ccall\n", "").replace("cython.bint", "bool")
    plain = plain.replace("cython.longlong", "int").replace("cython.Py_ssize_t", "int")
    (folder / "toy_py.py").write_text(plain)
    (folder / "toy_cy.py").write_text(SOURCE)
    (folder / "toy_mypyc.py").write_text(plain)
    env = {**os.environ, "PYTHONPATH": str(folder)}
    subprocess.run([sys.executable, "-m", "cython", "-3", "toy_cy.py", "-o", "toy_cy.c"],
                   cwd=folder, check=True, env=env)
    include = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig."
                              "get_paths()['include'])"], capture_output=True, text=True,
                             check=True).stdout.strip()
    suffix = subprocess.run([sys.executable, "-c", "import sysconfig; print(sysconfig."
                             "get_config_var('EXT_SUFFIX'))"], capture_output=True, text=True,
                            check=True).stdout.strip()
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", f"-I{include}", "toy_cy.c", "-o",
                    f"toy_cy{suffix}"], cwd=folder, check=True)
    subprocess.run([sys.executable, "-m", "mypyc", "toy_mypyc.py"], cwd=folder, check=True,
                   env=env, capture_output=True)
    sys.path.insert(0, str(folder))
    (folder / "toy_cy.py").unlink()  # import the extension, not the source
    (folder / "toy_mypyc.py").unlink()
    import toy_cy  # type: ignore[import-not-found]
    import toy_mypyc  # type: ignore[import-not-found]

    return {"interpreted": _load(folder / "toy_py.py", "toy_py"), "cython": toy_cy,
            "mypyc": toy_mypyc}


def measure(module: ModuleType, fused: bool, steps: int = 20000, repeats: int = 7) -> float:
    slot = module.Slot([4] * 11, [256] * 11)
    values = (64, None, 64, 64, 65, 64, 65, 64, 64, 64, 65)
    begin, set_count, finish, step = slot.begin, slot.set_count, slot.finish, slot.step
    times = []
    for _ in range(repeats):
        t = time.perf_counter_ns()
        if fused:
            for _ in range(steps):
                step(values)
        else:
            for _ in range(steps):
                begin()
                for i in range(11):
                    set_count(i, values[i])
                finish()
        times.append((time.perf_counter_ns() - t) / steps)
    return statistics.median(times)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        modules = build(Path(tmp))
        print("host ns per step (begin + 11 counts + finish), median of 7 x 20000 steps")
        print(f"{'':12s} {'13 calls':>10s} {'1 fused call':>13s}")
        rows = {}
        for _ in range(2):  # interleave the candidates twice against drift
            for name, module in modules.items():
                rows.setdefault(name, []).append((measure(module, False),
                                                  measure(module, True)))
        for name, pairs in rows.items():
            calls = min(p[0] for p in pairs)
            fused = min(p[1] for p in pairs)
            print(f"{name:12s} {calls:10.0f} {fused:13.0f}")


if __name__ == "__main__":
    main()
