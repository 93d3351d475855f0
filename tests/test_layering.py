"""The package layering, read from the source with `ast` (nothing is imported):

- no import cycle among llmctl's modules at module level;
- none either through imports inside functions (a deferred import hides a cycle from the import system, not from the
  reader); only imports under `if TYPE_CHECKING:` (annotations, never run) do not count;
- no cycle between llmctl's packages (spec, families, plan, engine, ...) at module level;
- no upward arrow: spec/ and plan/ never import launch/, cli/, engine/, netbench/ or tune/; netbench/ never imports
  launch/ or cli/; launch/ and tune/ never import cli/ (at any depth: a deferred import still points up).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "llmctl"

KNOWN_CYCLES: list[set[str]] = []
"""Module-level cycles left for later, each with a comment naming it. A known cycle that is gone fails the test too,
so that this list only shrinks."""

KNOWN_DEFERRED_CYCLES: list[set[str]] = []
"""Cycles through imports inside functions left for later (the same rule: the list only shrinks)."""

FORBIDDEN = {
    "llmctl.spec": ("llmctl.launch", "llmctl.cli", "llmctl.engine", "llmctl.netbench", "llmctl.tune"),
    "llmctl.plan": ("llmctl.launch", "llmctl.cli", "llmctl.engine", "llmctl.netbench", "llmctl.tune"),
    "llmctl.tune": ("llmctl.cli",),
    "llmctl.families": (
        "llmctl.plan",
        "llmctl.launch",
        "llmctl.cli",
        "llmctl.engine",
        "llmctl.netbench",
        "llmctl.tune",
        "llmctl.measure",
    ),
    "llmctl.netbench": ("llmctl.launch", "llmctl.cli"),
    "llmctl.launch": ("llmctl.cli",),
}
"""package -> the packages it must never import (they sit above it)."""

KNOWN_UPWARD: dict[str, str] = {}
"""module -> the package above it that it still imports, left for later (and checked to be still needed)."""


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The llmctl modules an import statement names (`from a import b`: a.b when that is a module, else a)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "llmctl"]
    base = node.module or ""
    if node.level:  # relative: from the module's package, one level up per extra dot
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    if base.split(".")[0] != "llmctl":
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


class Imports(NamedTuple):
    """The llmctl modules one module imports."""

    top: set[str]
    """At module level (run when it is imported)."""
    run: set[str]
    """At module level or inside functions: every import that runs at some point (not the TYPE_CHECKING ones)."""
    anywhere: set[str]
    """Any import statement, those under `if TYPE_CHECKING:` included (what the module's text depends on)."""


def imports(module: str) -> Imports:
    """What one module imports (see `Imports`)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), filename=str(path))
    top: set[str] = set()
    run: set[str] = set()
    anywhere: set[str] = set()

    def visit(nodes: list[ast.AST], at_top: bool, runs: bool = True) -> None:
        for child in nodes:
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                names = {n for t in _targets(child, module, path.name == "__init__.py") for n in _runs(t, module)}
                anywhere.update(names)
                if runs:
                    run.update(names)
                if at_top:
                    top.update(names)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(list(ast.iter_child_nodes(child)), False, runs)
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                visit(child.body, False, False)
                visit(child.orelse, at_top, runs)
            else:  # class bodies, try/except and plain `if` blocks run at import time
                visit(list(ast.iter_child_nodes(child)), at_top, runs)

    visit(tree.body, True)
    return Imports(top, run, anywhere)


def _runs(target: str, importer: str) -> list[str]:
    """What importing `target` runs: the packages above it (their __init__) that are not already running because
    they hold the importer, then the module itself."""
    parts = target.split(".")
    above = [".".join(parts[:i]) for i in range(1, len(parts))]
    return [p for p in above if not (importer == p or importer.startswith(p + "."))] + [target]


GRAPH = {m: imports(m) for m in MODULES}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing itself), each as one
    cycle through it (Tarjan's algorithm, then a path back to the start inside the component)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def strongconnect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    return [_a_cycle(graph, comp) for comp in components]


def _a_cycle(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """One cycle inside a strongly connected component: a shortest path from its first module back to itself."""
    start = min(comp)
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph[v] & comp):
            if w == start:
                return [*paths[v], start]
            if w not in paths:
                paths[w] = [*paths[v], w]
                queue.append(w)
    return sorted(comp)  # unreachable: a component is strongly connected


def test_the_graph_is_read() -> None:
    """The walk finds what it should (guards against a walk that silently sees nothing)."""
    assert "llmctl.launch.backends" in MODULES and "llmctl.errors" in MODULES
    top = GRAPH["llmctl.launch.backends"].top
    assert {"llmctl.launch.jobs", "llmctl.errors", "llmctl.launch.preflight.options"} <= top
    assert "llmctl.launch.preflight" in top  # the package's __init__ runs first
    assert "llmctl.launch" not in top and "llmctl" not in top  # already running: they hold backends
    assert "llmctl.spec.planfile" not in top  # under `if TYPE_CHECKING:` only
    ring = GRAPH["llmctl.families.context_parallel"]  # it names ModelSpec in annotations only
    assert "llmctl.spec.models" in ring.anywhere and "llmctl.spec.models" not in ring.run
    shown = GRAPH["llmctl.cli.launch_show"]
    assert "llmctl.launch.dry_start" in shown.run and "llmctl.launch.dry_start" not in shown.top  # inside a function
    assert "llmctl.families.llama" in GRAPH["llmctl.families"].top  # the families are walked too


def test_cycles_are_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"], ["e", "e"]]


def _check_cycles(graph: dict[str, set[str]], known: list[set[str]], what: str) -> None:
    found = cycles(graph)
    new = [c for c in found if set(c) not in known]
    assert not new, f"import cycles {what}:\n" + "\n".join(" -> ".join(c) for c in new)
    gone = [k for k in known if k not in [set(c) for c in found]]
    assert not gone, f"known cycles that are gone (remove them from the list): {gone}"


def test_no_import_cycles() -> None:
    _check_cycles({m: i.top for m, i in GRAPH.items()}, KNOWN_CYCLES, "at module level")


def test_no_import_cycles_even_through_deferred_imports() -> None:
    """An import inside a function still means the two modules need each other: none across llmctl, families/
    included (a family module that imports the package back, a spec module the families import and that asks them)."""
    _check_cycles({m: i.run for m, i in GRAPH.items()}, KNOWN_DEFERRED_CYCLES, "(imports inside functions included)")


def package_of(module: str) -> str:
    """llmctl.spec.models -> llmctl.spec (a top-level module is its own package: llmctl.errors)."""
    return ".".join(module.split(".")[:2])


def test_no_package_cycles_at_module_level() -> None:
    """The packages form layers when their modules load: spec must not import families at module level while
    families import spec (spec asks the families inside functions), and so for every pair of packages."""
    graph: dict[str, set[str]] = {}
    for m, i in GRAPH.items():
        if m == "llmctl":
            continue
        graph.setdefault(package_of(m), set()).update(
            package_of(t) for t in i.top if t != "llmctl" and package_of(t) != package_of(m)
        )
    found = cycles(graph)
    assert not found, "package cycles at module level:\n" + "\n".join(" -> ".join(c) for c in found)
    assert "llmctl.spec" in graph["llmctl.families"]  # the families build their layers from spec at module level


@pytest.mark.parametrize("package", ["llmctl.launch", "llmctl.netbench"])
def test_no_cycles_in_launch_and_netbench_even_through_deferred_imports(package: str) -> None:
    """A deferred import hides a cycle from the import system, not from the reader: launch/ and netbench/ have none."""
    inside = {m: {t for t in i.anywhere if t.startswith(package + ".")} for m, i in GRAPH.items()}
    found = cycles({m: ts for m, ts in inside.items() if m.startswith(package + ".")})
    assert not found, "\n".join(" -> ".join(c) for c in found)


def _upward(package: str) -> list[tuple[str, str]]:
    """(module, what it imports) for every import in `package` of a package above it, deferred ones included."""
    return [
        (m, t)
        for m, i in GRAPH.items()
        if m == package or m.startswith(package + ".")
        for t in sorted(i.anywhere)
        if any(t == up or t.startswith(up + ".") for up in FORBIDDEN[package])
    ]


def _known(m: str, t: str) -> bool:
    up = KNOWN_UPWARD.get(m)
    return up is not None and (t == up or t.startswith(up + "."))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package: str) -> None:
    bad = [f"{m} imports {t}" for m, t in _upward(package) if not _known(m, t)]
    assert not bad, "\n".join(bad)


def test_known_upward_imports_are_still_there() -> None:
    """So that KNOWN_UPWARD only shrinks: an entry whose import is gone must go too."""
    found = {m for package in FORBIDDEN for m, t in _upward(package) if _known(m, t)}
    assert set(KNOWN_UPWARD) <= found, set(KNOWN_UPWARD) - found
