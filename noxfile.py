"""Sessions that compose the packages.

    nox -s bench          the main job: end-to-end decode steps, packed vs direct
    nox -s block_tables   block-tables tests with numpy only (proves it needs no torch)
    nox -s tests          every CPU suite of every package + tests-integration
    nox -s gpu            the GPU suites; needs RUN_H2D_GPU_TESTS=1 and CUDA, else fails
    nox -s gpu2           the two-GPU pipeline-parallel run; needs two GPUs, else fails
    nox -s stress         the state machines at 10,000 random sequences each (CPU, ~1 h)
    nox -s sanitize       the compiled core's suites under ASan + UBSan (gcc, CPU)
    nox -s lint           ruff + mypy
    nox -s editable       `pip install -e` of every package in a fresh venv, then the READMEs
    nox -s newest         every CPU suite on the newest numpy and test tools
    nox -s newest -- ci   only NEWEST_CI's suites (what .ci/run runs)
    nox -s instructions   callgrind instructions per step of every family vs the budgets

Packages are discovered from ``packages/*/pyproject.toml``; a new package needs no edit
here. Local packages are installed with ``--no-deps`` after the pinned third-party
requirements, so no resolver ever pulls an unpinned (multi-GB CUDA) torch.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = sorted(p.parent for p in (ROOT / "packages").glob("*/pyproject.toml"))
# The CPU build of torch 2.13.0 lies on disk on CI machines; an unpinned torch would
# download a CUDA build of several GB.
TORCH = "torch==2.13.0"
TRITON = "triton==3.6.0"
TEST_DEPS = ["numpy", "pytest", "hypothesis"]
# the CPU suites in parallel, one worker per core (CI has 2): each worker is its own process
PARALLEL = ["pytest-xdist"]
# the real-client oracle (tests-integration/test_llama_oracle.py): transformers' own models,
# pinned beside torch
TRANSFORMERS = "transformers==5.24.0"
# stock nano-vllm on CPU (tests-integration/test_nanovllm_stock.py): a 28 kB pure-Python
# wheel whose requirements (torch, transformers, triton, xxhash; Python < 3.13) the pins
# above satisfy; xxhash is its block manager's hash
NANOVLLM = ["nano-vllm-fork==20260210", "xxhash"]
nox.options.sessions = ["block_tables", "tests"]
nox.options.default_venv_backend = "venv"


def _install_local(session: nox.Session, packages: list[Path]) -> None:
    # Each package's wheel is built here: hatch_build.py compiles its Cython core (required:
    # a build failure fails the session).
    session.install("hatchling", "setuptools", "cython")
    session.install("--no-deps", "--no-build-isolation", *[str(p) for p in packages])


def _test_dirs() -> list[str]:
    dirs = [str(p / "tests") for p in PACKAGES if (p / "tests").is_dir()]
    for extra in (ROOT / "tests-integration", ROOT / "benchmarks" / "tests"):
        if any(extra.glob("test_*.py")):
            dirs.append(str(extra))
    return dirs


@nox.session
def block_tables(session: nox.Session) -> None:
    """block-tables with numpy, pytest and hypothesis only: no torch anywhere."""
    session.install(*TEST_DEPS)
    _install_local(session, [ROOT / "packages" / "block-tables"])
    session.run(
        "python", "-c",
        "import importlib.util, sys; "
        "sys.exit('torch is installed in the block_tables session' "
        "if importlib.util.find_spec('torch') else 0)",
    )
    session.run("python", "-m", "pytest", "packages/block-tables/tests", *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """Every CPU suite; Triton kernels run through the interpreter on CPU tensors."""
    session.install(TORCH, TRITON, TRANSFORMERS, *NANOVLLM, *TEST_DEPS, *PARALLEL)
    _install_local(session, PACKAGES)
    session.run(
        "python", "-m", "pytest", "-n", "auto", *_test_dirs(), *session.posargs,
        env={"TRITON_INTERPRET": "1", "H2D_REQUIRE_TRANSFORMERS": "1",
             "H2D_REQUIRE_NANOVLLM": "1"},
    )


# `newest`: the newest numpy release the index has (and the newest pytest, hypothesis),
# upgraded past any pin or cache; H2D_NEWEST_NUMPY names another (e.g. "numpy==2.5.*" where
# an index has it). torch stays 2.13.0: the newest CPU build there is (on disk; the index's
# later torch releases are CUDA builds of several GB, paired with later triton releases),
# and triton stays 3.6.0, the release the CUDA torch this workspace targets runs on.
NEWEST_NUMPY = os.environ.get("H2D_NEWEST_NUMPY", "numpy")
#: what CI runs on the newest numpy: the suites numpy's changes reach first (the compiled
#: core's numpy views: block-tables, h2d-core; the interpreter kernels: h2d-kernels, the
#: step benchmarks, the UVA peer), ~2 min on 2 cores after the install; the adapters'
#: and the other integration suites run once, in `tests`: `nox -s newest -- ci`
NEWEST_CI = ["packages/block-tables/tests", "packages/h2d-core/tests",
             "packages/h2d-kernels/tests", "benchmarks/tests/test_main_job.py",
             "tests-integration/test_mrv2_style_peer.py"]


@nox.session
def newest(session: nox.Session) -> None:
    """The CPU suites (the paths given, or NEWEST_CI's for ``ci``) on the newest numpy,
    pytest and hypothesis."""
    session.install(TORCH, TRITON, TRANSFORMERS, *NANOVLLM)
    session.install("--upgrade", "--no-cache-dir", NEWEST_NUMPY, "pytest", "hypothesis",
                    *PARALLEL)
    _install_local(session, PACKAGES)
    session.run("python", "-c", "import numpy, torch, triton; print('newest: numpy', "
                "numpy.__version__, 'torch', torch.__version__, 'triton', triton.__version__)")
    session.run(
        "python", "-m", "pytest", "-n", "auto",
        *(NEWEST_CI if session.posargs == ["ci"] else session.posargs or _test_dirs()),
        env={"TRITON_INTERPRET": "1", "H2D_REQUIRE_TRANSFORMERS": "1",
             "H2D_REQUIRE_NANOVLLM": "1"},
    )


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """GPU suites in the current environment (its CUDA torch), sources on PYTHONPATH."""
    if os.environ.get("RUN_H2D_GPU_TESTS") != "1":
        session.error("RUN_H2D_GPU_TESTS=1 is not set: GPU suites were not run")
    session.run(
        "python", "-c",
        "import sys, torch; sys.exit(0 if torch.cuda.is_available() else "
        "'CUDA is not available: GPU suites were not run')",
    )
    src = os.pathsep.join(str(p / "src") for p in PACKAGES)
    session.run(
        "python", "-m", "pytest", *_test_dirs(), *session.posargs,
        env={"PYTHONPATH": src, "RUN_H2D_GPU_TESTS": "1"},
    )


@nox.session(venv_backend="none")
def gpu2(session: nox.Session) -> None:
    """Two-GPU pipeline parallelism: two stages as NCCL ranks, packed == direct logits."""
    session.run(
        "python", "-c",
        "import sys, torch; n = torch.cuda.device_count(); "
        "sys.exit(0 if n >= 2 else f'{n} GPU(s): the pipeline run needs two')",
    )
    src = os.pathsep.join(str(p / "src") for p in PACKAGES)
    session.run(
        "python", "-m", "pytest", "-s", "tests-integration/test_pipeline_two_gpus.py",
        *session.posargs, env={"PYTHONPATH": src, "RUN_H2D_GPU_TESTS": "1"},
    )


@nox.session
def stress(session: nox.Session) -> None:
    """Nightly-style: the publication-contract, block-table snapshot and adapters
    (packed vs direct: MHA+MTP+GDN+Engram with the draft loop, and V4.1 with its step
    indptrs) state machines at 10,000 random sequences each (``H2D_STATEFUL_EXAMPLES``
    overrides; CI runs them small), and 16 forked workers x 2,000 block-table rows against
    one snapshot. The consumer rules run in Triton's interpreter."""
    session.install(TORCH, TRITON, *TEST_DEPS)
    _install_local(session, PACKAGES)
    examples = os.environ.get("H2D_STATEFUL_EXAMPLES", "10000")
    session.run(
        "python", "-m", "pytest", "-q",
        "packages/block-tables/tests/test_shared_block_tables.py::test_snapshot_state_machine",
        "packages/h2d-core/tests/test_contract_stateful.py",
        "tests-integration/test_adapter_state_machine.py",
        "packages/block-tables/tests/test_lineage_processes.py::"
        "test_many_forked_workers_never_alias", "-k",
        "CPU or snapshot or BackendsAgree or forked",
        *session.posargs,
        env={"H2D_STATEFUL_EXAMPLES": examples, "TRITON_INTERPRET": "1",
             "H2D_LINEAGE_WORKERS": "16", "H2D_LINEAGE_ROWS": "2000"},
    )


@nox.session
def sanitize(session: nox.Session) -> None:
    """The compiled core's suites (block-tables, h2d-core, h2d-kernels) with every
    Cython extension built under AddressSanitizer and UndefinedBehaviorSanitizer (gcc);
    the first report aborts the run."""
    flags = "-fsanitize=address,undefined -fno-omit-frame-pointer -O1 -g"
    session.install(TORCH, TRITON, *TEST_DEPS)
    session.install("hatchling", "setuptools", "cython")
    session.install("--no-deps", "--no-build-isolation", "--no-cache-dir",
                    *[str(p) for p in PACKAGES],
                    env={"CFLAGS": flags, "LDFLAGS": "-fsanitize=address,undefined"})
    libs = [session.run("gcc", f"-print-file-name={lib}", silent=True,
                        external=True).strip()  # type: ignore[union-attr]
            for lib in ("libasan.so", "libubsan.so")]
    core = [str(ROOT / "packages" / p / "tests")
            for p in ("block-tables", "h2d-core", "h2d-kernels")]
    session.run("python", "-m", "pytest", "-q", *core, *session.posargs, env={
        "LD_PRELOAD": " ".join(libs), "TRITON_INTERPRET": "1",
        "ASAN_OPTIONS": "detect_leaks=0:halt_on_error=1:verify_asan_link_order=0",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1"})


@nox.session
def bench(session: nox.Session) -> None:
    """The main job: the end-to-end decode benchmark (results/decode_bench.{json,png})."""
    session.install(TORCH, TRITON, "numpy", "matplotlib")
    _install_local(session, PACKAGES)
    session.run("python", "benchmarks/decode_bench.py", *session.posargs)


@nox.session
def instructions(session: nox.Session) -> None:
    """Callgrind instructions per steady step of every family against
    benchmarks/instruction_budgets.json (needs valgrind and a C compiler)."""
    session.install(TORCH, TRITON, "numpy")
    _install_local(session, PACKAGES)
    session.run("python", "benchmarks/instructions.py", "--check", *session.posargs)


@nox.session
def editable(session: nox.Session) -> None:
    """What a contributor does first: ``pip install -e`` of every package in a fresh venv,
    then import each from its ``src/`` with its compiled core, and run the READMEs' code."""
    session.install(TORCH, TRITON, *TEST_DEPS)
    session.install("hatchling", "setuptools", "cython", "editables")
    session.install("--no-deps", "--no-build-isolation",
                    *[arg for p in PACKAGES for arg in ("-e", str(p))])
    session.run("python", "-c", _EDITABLE_CHECK, *[str(p / "src") for p in PACKAGES])
    session.run("python", "-m", "pytest", "-q", "tests-integration/test_readmes.py",
                *session.posargs, env={"TRITON_INTERPRET": "1"})


# every package imports from its src/ (an editable install), compiled core included
_EDITABLE_CHECK = """
import importlib, pathlib, sys
srcs = [pathlib.Path(s).resolve() for s in sys.argv[1:]]
for src in srcs:
    for pkg in src.iterdir():
        if (pkg / "__init__.py").is_file():
            module = importlib.import_module(pkg.name)
            where = pathlib.Path(module.__file__).resolve()
            if src not in where.parents:
                sys.exit(f"{pkg.name} imported from {where}, not from {src}")
            print(pkg.name, "from", where.parent)
"""


@nox.session
def lint(session: nox.Session) -> None:
    """ruff over the workspace, mypy over every package's sources."""
    session.install("ruff", "mypy", "cython", "numpy", TORCH, TRITON, "pytest", "hypothesis", "nox")
    session.run("ruff", "check", ".")
    session.run("mypy", *[str(p / "src") for p in PACKAGES])
