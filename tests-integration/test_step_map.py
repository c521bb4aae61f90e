"""``docs/step.md`` maps one decode step onto files: every file (or folder, ending in ``/``)
it names exists, and every file of the step's compiled path appears in it (a renamed or
moved file fails here)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEP = ROOT / "docs" / "step.md"


def _named_files() -> list[str]:
    return re.findall(r"`((?:packages|tests-integration|benchmarks|docs)/[^`\s]+)`",
                      STEP.read_text())


def test_every_file_the_step_map_names_exists() -> None:
    named = _named_files()
    assert len(named) >= 20
    missing = [p for p in named
               if not ((ROOT / p).is_dir() if p.endswith("/") else (ROOT / p).is_file())]
    assert not missing, f"docs/step.md names files that do not exist: {missing}"


def test_the_step_map_names_each_compiled_module_of_the_step() -> None:
    """The compiled modules a steady step runs through are each on the map."""
    named = set(_named_files())
    step_path = {
        "packages/h2d-core/src/h2d_core/epoch.py",
        "packages/h2d-core/src/h2d_core/step.py",
        "packages/h2d-core/src/h2d_core/records.py",
        "packages/h2d-core/src/h2d_core/table_stage.py",
        "packages/h2d-core/src/h2d_core/producer.py",
        "packages/h2d-core/src/h2d_core/request_layout.py",
        "packages/block-tables/src/block_tables/_snapshot.pyx",
        "packages/block-tables/src/block_tables/staging.py",
        "packages/h2d-kernels/src/h2d_kernels/_packed.pyx",
    }
    assert step_path <= named, sorted(step_path - named)
