"""Run the benchmarks from a checkout's sources: its packages and ``tests-integration``."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("block-tables", "h2d-kernels", "h2d-core", "h2d-runner-adapters")


def source_paths(root: Path = ROOT) -> list[str]:
    """The ``src`` folder of every package of ``root``, then its ``tests-integration``."""
    return [str(root / "packages" / p / "src") for p in PACKAGES] + [
        str(root / "tests-integration")]


def use_sources(root: Path = ROOT) -> None:
    """``tests-integration`` first on ``sys.path``; each package's sources after what is
    already there (a ``PYTHONPATH`` or an installed wheel still wins)."""
    *packages, integration = source_paths(root)
    sys.path.insert(0, integration)
    for src in packages:
        if Path(src).is_dir() and src not in sys.path:
            sys.path.append(src)
