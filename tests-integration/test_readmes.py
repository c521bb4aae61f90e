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
from h2d_runner_adapters.mha.kv_indices import _kv_indices_kernel

ROOT = Path(__file__).resolve().parents[1]
#: the READMEs and the docs whose python blocks an engine author would paste
READMES = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md")),
           ROOT / "docs" / "engines.md"]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
#: a top-level print whose next line is a comment: that comment is its exact output
PRINTED = re.compile(r"^print\(.*\n# (.*)$", re.M)


def expected_prints(code: str) -> list[str]:
    """The outputs a block's comments promise, in order; every top-level print has one."""
    prints = len(re.findall(r"^print\(", code, re.M))
    promised = PRINTED.findall(code)
    assert len(promised) == prints, "each top-level print needs its output on the next line"
    return promised


def test_printed_outputs_are_parsed() -> None:
    code = 'x = 1\nprint(x)  # why\n# 1\nprint(x, x)\n# 1 1\n'
    assert expected_prints(code) == ["1", "1 1"]
    with pytest.raises(AssertionError, match="needs its output"):
        expected_prints("print(1)\n")


def test_every_readme_is_covered() -> None:
    assert all(p.is_file() for p in READMES), READMES
    assert len(READMES) == 6


@pytest.mark.parametrize("readme", READMES, ids=lambda p: str(p.relative_to(ROOT)))
def test_readme_python_blocks_run(readme: Path) -> None:
    if torch.cuda.is_available() == interpreted(_kv_indices_kernel):
        pytest.skip("the snippets use CUDA when present (compiled kernels) and the CPU "
                    "otherwise (Triton's interpreter); this process's mode differs")
    blocks = BLOCK.findall(readme.read_text())
    assert blocks, f"{readme} has no python block"
    printed: list[str] = []
    namespace: dict[str, object] = {
        "__name__": "readme",
        "print": lambda *args: printed.append(" ".join(map(str, args))),
    }
    promised: list[str] = []
    for k, code in enumerate(blocks):
        promised += expected_prints(code)
        exec(compile(code, f"{readme.relative_to(ROOT)}[block {k}]", "exec"), namespace)
    assert printed == promised
