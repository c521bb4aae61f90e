"""The tree's shape: no import circle between library modules (lazy imports included), no
module that edits ``sys.path`` outside the scripts' one path helper, no library module
past 400 lines beyond the ones already there (each may only shrink), and no private field
of the runner state read outside its own modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = sorted((ROOT / "packages").glob("*/src/*/**/*.py"))
MAX_LINES = 400
#: library modules past MAX_LINES today, with their size: a ratchet, each entry may only
#: shrink (and leaves the list once under the limit)
OVERSIZED: dict[str, int] = {}


def _module_name(path: Path) -> str:
    src = next(p for p in path.parents if p.name == "src")
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, name: str) -> set[str]:
    """Every module ``path`` imports, at any depth except ``if TYPE_CHECKING:`` blocks."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if not (name == base or name.startswith(base + ".")):  # not its own package
                found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


def _graph() -> dict[str, set[str]]:
    names = {_module_name(p): p for p in LIBRARY}
    return {name: {m for m in _imports(path, name) if m in names and m != name}
            for name, path in names.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_no_import_circle_between_library_modules() -> None:
    graph = _graph()
    assert len(graph) > 60
    assert _cycles(graph) == []


def test_the_circle_check_sees_a_lazy_import() -> None:
    """The check's own mutation: a function-level import closing a loop is a circle."""
    graph = {"a.x": {"a.y"}, "a.y": set()}
    source = "def f():\n    from . import x\n"
    tmp = ROOT / "packages"  # only for _imports' package arithmetic: nothing is written
    assert "a.x" in {m for m in _imports_from_source(source, "a.y", tmp)}
    graph["a.y"] = {"a.x"}
    assert _cycles(graph) == [["a.x", "a.y"]]


def _imports_from_source(source: str, name: str, _root: Path) -> set[str]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "y.py"
        path.write_text(source)
        return _imports(path, name)


def test_no_module_edits_sys_path() -> None:
    """Library, test and runner modules import by name (pytest's ``pythonpath`` names the
    suites' folders); only scripts may use ``benchmarks/repo_paths.py``."""
    allowed = {ROOT / "benchmarks" / "repo_paths.py",
               ROOT / "packages" / "block-tables" / "benchmarks" / "bench_prepare.py"}
    scripts = set((ROOT / "benchmarks").glob("*.py"))
    offenders = []
    for path in sorted(ROOT.glob("**/*.py")):
        rel = path.relative_to(ROOT)
        if (path in allowed or path in scripts or path == Path(__file__).resolve()
                or rel.parts[0] in (".nox", ".venv", "docs")):
            continue
        text = path.read_text()
        if any(s in text for s in ("sys.path.insert", "sys.path.append", "sys.path[")):
            offenders.append(str(rel))
    assert offenders == []


def test_library_modules_stay_small() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in LIBRARY}
    over = {p: n for p, n in sizes.items() if n > max(MAX_LINES, OVERSIZED.get(p, 0))}
    assert over == {}, f"modules past {MAX_LINES} lines (or past their ratchet): {over}"
    shrunk = {p: sizes.get(p) for p, n in OVERSIZED.items()
              if sizes.get(p) is None or sizes[p] <= MAX_LINES}
    assert shrunk == {}, f"remove these from OVERSIZED: {shrunk}"


#: the runner state's own modules: the classes H2DRunnerState is assembled from
STATE_MODULES = {"epoch.py", "state.py"}
STATE_READ = re.compile(r"\b(?:state|st|_state)\.(_[a-z]\w*)\b")


def _state_private_fields() -> set[str]:
    core = ROOT / "packages/h2d-core/src/h2d_core"
    declared = re.findall(r"^    (_[a-z]\w*) = cython\.declare", (core / "epoch.py").read_text(),
                          re.M)
    annotated = re.findall(r"^    (_[a-z]\w*): ", (core / "state.py").read_text(), re.M)
    return set(declared) | set(annotated)


def test_no_module_reads_the_states_private_fields() -> None:
    """Outside the state's own modules, the library reads the state through its public
    calls (``slot_records``, ``groups``, ``require_*``, ``add_stager``, ``on_reset``)."""
    private = _state_private_fields()
    assert {"_slot_groups", "_invalid", "_routes", "_buffers"} <= private  # the parse works
    reads = {f"{p.relative_to(ROOT)}: {m.group(0)}" for p in LIBRARY
             if p.name not in STATE_MODULES or "h2d_core" not in p.parts
             for m in STATE_READ.finditer(p.read_text()) if m.group(1) in private}
    assert reads == set(), f"private fields of the state read across files: {sorted(reads)}"
