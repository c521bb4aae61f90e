"""Every python block of every README runs as written (docs are code).

A README's blocks run in order in one fresh namespace, as a reader would paste them. They
pick CUDA when it is present, else the CPU, where the consumer kernels need Triton's
interpreter: this process's Triton mode must match (``nox -s tests`` sets
``TRITON_INTERPRET=1`` on CPU machines; the GPU suites run compiled on CUDA).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from h2d_runner_adapters.consumers._launch import interpreted
from h2d_runner_adapters.consumers.kv_indices import _kv_indices_kernel

ROOT = Path(__file__).resolve().parents[1]
READMES = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_every_readme_is_covered() -> None:
    assert all(p.is_file() for p in READMES), READMES
    assert len(READMES) == 5


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_readme_python_blocks_run(readme: Path) -> None:
    if torch.cuda.is_available() == interpreted(_kv_indices_kernel):
        pytest.skip("the snippets use CUDA when present (compiled kernels) and the CPU "
                    "otherwise (Triton's interpreter); this process's mode differs")
    blocks = BLOCK.findall(readme.read_text())
    assert blocks, f"{readme} has no python block"
    namespace: dict[str, object] = {"__name__": "readme"}
    for k, code in enumerate(blocks):
        exec(compile(code, f"{readme.relative_to(ROOT)}[block {k}]", "exec"), namespace)
