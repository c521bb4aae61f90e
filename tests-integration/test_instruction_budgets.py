"""The host-cost check (``benchmarks/instructions.py``): callgrind instructions per steady
plain-MHA decode step against ``benchmarks/instruction_budgets.json``; a family more than
the file's tolerance (15%) over its budget fails.

The measuring tests need ``valgrind`` and a C compiler with valgrind's headers. Without them
they skip, unless ``H2D_REQUIRE_VALGRIND=1`` (CI installs valgrind and sets it), which turns
the skip into a failure. Each measurement is two callgrind runs of a child process
(about 22 s each here, most of it the uninstrumented torch import; the two run at once).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "instructions.py"
sys.path.insert(0, str(ROOT / "benchmarks"))
import instructions  # noqa: E402

#: one measurement of mha, its two callgrind runs at once (the count ignores CPU load)
MHA = ("--families", "mha", "--repeat", "1", "--jobs", "2", "--check")


def _require_tools() -> None:
    reason = instructions.missing_tools()
    if reason is None:
        return
    if os.environ.get("H2D_REQUIRE_VALGRIND") == "1":
        pytest.fail(f"H2D_REQUIRE_VALGRIND=1 but the instruction count cannot run: {reason}")
    pytest.skip(f"instruction budgets not checked: {reason}")


def _script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                          text=True, timeout=1200, env={**os.environ, **(env or {})})


def _budgets() -> dict[str, Any]:
    return json.loads(instructions.BUDGETS.read_text())


def test_budget_file_has_every_family_and_the_15_percent_tolerance() -> None:
    budgets = _budgets()
    assert budgets["tolerance"] == 0.15
    assert set(budgets["families"]) == set(instructions.FAMILIES)
    for family, entry in budgets["families"].items():
        assert isinstance(entry["budget"], int) and entry["budget"] > 0, family
        assert entry["settings"]["extra_work"] == 0, family


def test_mha_step_is_within_its_budget(tmp_path: Path) -> None:
    _require_tools()
    proc = _script(*MHA, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "instructions.json").read_text())["families"]["mha"]
    assert 0 < result["per_step"] <= _budgets()["families"]["mha"]["budget"] * 1.15
    # the counted steps were real packed publications: one DMA and one scatter each
    for run in result["detail"][0]["runs"]:
        c = run["counters"]["decode_step"]
        assert c["publications"] == c["dmas"] == c["scatters"] == 50 + run["steps"]
        assert c["direct_copies"] == 0


def test_a_costlier_mha_step_fails_the_check(tmp_path: Path) -> None:
    """Python work added inside every counted step (the script's H2D_INSTR_EXTRA_WORK
    hook): at 20+ instructions per loop iteration (about 390 with CPython 3.11), budget / 20
    iterations double the step, so the check must fail, naming the family, its figure,
    the budget and the limit."""
    _require_tools()
    budget = _budgets()["families"]["mha"]["budget"]
    proc = _script(*MHA, "--out", str(tmp_path),
                   env={instructions.EXTRA_WORK: str(budget // 20)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    figure = json.loads((tmp_path / "instructions.json").read_text())["families"]["mha"][
        "per_step"]
    assert figure > budget * 1.15
    assert "family 'mha'" in proc.stderr
    assert f"{figure:,.0f} instructions per step" in proc.stderr
    assert f"budget of {budget:,}" in proc.stderr and "15%" in proc.stderr


def _results(figures: dict[str, float]) -> dict[str, Any]:
    env = {"python": "CPython 3.x", "numpy": "n", "torch": "t", "valgrind": "v",
           "machine": "x86_64"}
    return {"what": instructions.WHAT, "environment": env,
            "settings": {"bs": 64, "n1": 20, "n2": 120, "warmup": 50, "extra_work": 0},
            "families": {f: {"per_step": v, "repeats": [v], "spread": 0.0, "detail": []}
                         for f, v in figures.items()}}


def test_check_fails_just_past_15_percent_and_names_what_failed(tmp_path: Path) -> None:
    budgets = {"tolerance": 0.15, "families": {"mha": {"budget": 100_000},
                                               "mtp": {"budget": 20_000}}}
    path = tmp_path / "budgets.json"
    path.write_text(json.dumps(budgets))
    assert instructions.check(_results({"mha": 115_000.0, "mtp": 1.0}), budgets, path) == []
    failures = instructions.check(_results({"mha": 115_000.1, "mtp": 23_000.1, "v41": 5.0}),
                                  budgets, path)
    assert len(failures) == 3
    assert "family 'mha': 115,000 instructions per step" in failures[0]
    assert "budget of 100,000 (limit 115,000)" in failures[0]
    assert "family 'mtp'" in failures[1] and "budget of 20,000" in failures[1]
    assert "family 'v41': no budget" in failures[2]
    # the command line: exit 1 and the same message on stderr; exit 0 within the limit
    over = tmp_path / "over.json"
    over.write_text(json.dumps(_results({"mha": 115_001.0})))
    proc = _script("--results", str(over), "--check", "--budgets", str(path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "instruction budget exceeded: family 'mha': 115,001" in proc.stderr
    within = tmp_path / "within.json"
    within.write_text(json.dumps(_results({"mha": 114_999.0})))
    proc = _script("--results", str(within), "--check", "--budgets", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_write_budgets_keeps_other_families_and_refuses_a_costlier_step(
        tmp_path: Path) -> None:
    path = tmp_path / "budgets.json"
    path.write_text(json.dumps({"tolerance": 0.15, "families": {"v41": {"budget": 7}}}))
    instructions.write_budgets(_results({"mha": 1234.4}), path)
    data = json.loads(path.read_text())
    assert data["families"]["mha"]["budget"] == 1234
    assert data["families"]["v41"] == {"budget": 7}
    costlier = _results({"mha": 99.0})
    costlier["settings"]["extra_work"] = 5
    with pytest.raises(instructions.MeasureError, match=instructions.EXTRA_WORK):
        instructions.write_budgets(costlier, path)
    assert json.loads(path.read_text()) == data
