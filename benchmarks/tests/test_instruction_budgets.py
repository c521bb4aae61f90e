"""The host-cost check (``benchmarks/instructions.py``): callgrind instructions per steady
step of every family (``mha``, ``v41``, ``mtp``, ``gdn``, ``prefill``; begin + producers +
publish + finish) against ``benchmarks/instruction_budgets.json``; a family more than the
file's tolerance (2%) over its budget fails, and ~3% of injected work must fail it.

The measuring tests need ``valgrind`` and a C compiler with valgrind's headers. Without them
they skip, unless ``H2D_REQUIRE_VALGRIND=1`` (CI installs valgrind and sets it), which turns
the skip into a failure. Each family's figure is the median of three callgrind runs of a
child process, one per heap layout (~14 s of CPU each, most of it the uninstrumented torch
import), two at once (``--jobs 2``; the count ignores CPU load): the six families and the
costlier ``mha`` are 16 runs, about 2 minutes on two idle cores.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import instructions
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "instructions.py"

#: one measurement of every family (three heap layouts each), two callgrind runs at once
EVERY = ("--families", ",".join(instructions.FAMILIES), "--layouts", "3", "--jobs", "2",
         "--check")
#: one layout: the 3% injected is past the 2% tolerance by more than a layout moves mha
#: (0.75% over every layout measured)
MHA = ("--families", "mha", "--layouts", "1", "--check")
#: instructions the H2D_INSTR_EXTRA_WORK hook adds (CPython 3.11.7 under callgrind, on
#: the 73,092 mha step): its wrapper call alone, and each loop iteration (1 iteration
#: added 2,588, 21 added 6,765)
HOOK_CALL = 2_380
PER_ITERATION = 209
#: the added work the check must catch: 3% of the step, past the 2% tolerance with room
#: for the repeat spread (a few instructions)
INJECTED = 0.03


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


def test_budget_file_has_every_family_and_the_2_percent_tolerance() -> None:
    budgets = _budgets()
    assert budgets["tolerance"] == instructions.TOLERANCE == 0.02
    assert budgets["what"] == instructions.WHAT  # budgets of what is counted now
    assert set(budgets["families"]) == set(instructions.FAMILIES)
    assert set(instructions.FAMILIES) == {"mha", "v41", "mtp", "gdn", "prefill", "shared"}
    for family, entry in budgets["families"].items():
        assert isinstance(entry["budget"], int) and entry["budget"] > 0, family
        assert entry["settings"]["extra_work"] == 0, family


def test_every_family_is_within_its_budget(tmp_path: Path) -> None:
    _require_tools()
    proc = _script(*EVERY, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads((tmp_path / "instructions.json").read_text())["families"]
    budgets = _budgets()
    assert set(results) == set(instructions.FAMILIES)
    for family, result in results.items():
        budget = budgets["families"][family]["budget"]
        assert 0 < result["per_step"] <= budget * (1 + budgets["tolerance"]), family
        assert len(result["layouts"]) == 3, family
        # the counted steps were real packed publications: one DMA and one scatter each
        for run in result["detail"]:
            for group, c in run["counters"].items():
                assert c["publications"] == c["dmas"] == c["scatters"] == 50 + 120, \
                    (family, group)
                assert c["direct_copies"] == 0, (family, group)


def test_three_percent_more_work_fails_the_check(tmp_path: Path) -> None:
    """Python work added inside every counted mha step (the script's H2D_INSTR_EXTRA_WORK
    hook): ~3% of the budget (its call and PER_ITERATION an iteration), more than the 2%
    tolerance, so the check must fail, naming the family, its figure, the budget and the
    limit. The figure stays under +8%: the work injected is small (the hook's call alone is
    ~5% of the 58,100-instruction step), the tolerance caught it."""
    _require_tools()
    budget = _budgets()["families"]["mha"]["budget"]
    # at least one iteration: none would not wrap the call at all
    iterations = max(1, math.ceil((budget * INJECTED - HOOK_CALL) / PER_ITERATION))
    proc = _script(*MHA, "--out", str(tmp_path),
                   env={instructions.EXTRA_WORK: str(iterations)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    figure = json.loads((tmp_path / "instructions.json").read_text())["families"]["mha"][
        "per_step"]
    assert budget * 1.02 < figure < budget * 1.08
    assert "family 'mha'" in proc.stderr
    assert f"{figure:,.0f} instructions per step" in proc.stderr
    assert f"budget of {budget:,}" in proc.stderr and "2%" in proc.stderr


def _results(figures: dict[str, float]) -> dict[str, Any]:
    env = {"python": "CPython 3.x", "numpy": "n", "torch": "t", "valgrind": "v",
           "machine": "x86_64"}
    return {"what": instructions.WHAT, "environment": env,
            "settings": {"bs": 64, "n1": 20, "n2": 120, "warmup": 50, "layouts": 1,
                         "extra_work": 0},
            "families": {f: {"per_step": v, "layouts": [v], "spread": 0.0, "detail": []}
                         for f, v in figures.items()}}


def test_check_fails_just_past_2_percent_and_names_what_failed(tmp_path: Path) -> None:
    budgets = {"tolerance": 0.02, "families": {"mha": {"budget": 100_000},
                                               "mtp": {"budget": 20_000}}}
    path = tmp_path / "budgets.json"
    path.write_text(json.dumps(budgets))
    assert instructions.check(_results({"mha": 102_000.0, "mtp": 1.0}), budgets, path) == []
    failures = instructions.check(_results({"mha": 102_000.1, "mtp": 20_400.1, "v41": 5.0}),
                                  budgets, path)
    assert len(failures) == 3
    assert "family 'mha': 102,000 instructions per step" in failures[0]
    assert "budget of 100,000 (limit 102,000)" in failures[0]
    assert "family 'mtp'" in failures[1] and "budget of 20,000" in failures[1]
    assert "family 'v41': no budget" in failures[2]
    # the command line: exit 1 and the same message on stderr; exit 0 within the limit
    over = tmp_path / "over.json"
    over.write_text(json.dumps(_results({"mha": 102_001.0})))
    proc = _script("--results", str(over), "--check", "--budgets", str(path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "instruction budget exceeded: family 'mha': 102,001" in proc.stderr
    within = tmp_path / "within.json"
    within.write_text(json.dumps(_results({"mha": 101_999.0})))
    proc = _script("--results", str(within), "--check", "--budgets", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_budget_of_another_count_is_named(tmp_path: Path) -> None:
    """Budgets recorded when publish was not counted: a family over them says so."""
    budgets = {"tolerance": 0.02, "what": "begin + producers + finish",
               "families": {"mha": {"budget": 100_000}}}
    failures = instructions.check(_results({"mha": 150_000.0}), budgets,
                                  tmp_path / "budgets.json")
    assert len(failures) == 1 and "budgets of another count" in failures[0]


def test_write_budgets_keeps_other_families_and_refuses_a_costlier_step(
        tmp_path: Path) -> None:
    path = tmp_path / "budgets.json"
    path.write_text(json.dumps({"tolerance": 0.02, "families": {"v41": {"budget": 7}}}))
    instructions.write_budgets(_results({"mha": 1234.4}), path)
    data = json.loads(path.read_text())
    assert data["families"]["mha"]["budget"] == 1234
    assert data["families"]["v41"] == {"budget": 7}
    assert data["what"] == instructions.WHAT and data["tolerance"] == 0.02
    costlier = _results({"mha": 99.0})
    costlier["settings"]["extra_work"] = 5
    with pytest.raises(instructions.MeasureError, match=instructions.EXTRA_WORK):
        instructions.write_budgets(costlier, path)
    assert json.loads(path.read_text()) == data
    # a new file gets the 2% tolerance
    fresh = tmp_path / "fresh.json"
    instructions.write_budgets(_results({"gdn": 10.0}), fresh)
    assert json.loads(fresh.read_text())["tolerance"] == instructions.TOLERANCE
