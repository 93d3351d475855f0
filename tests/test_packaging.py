"""The built wheel ships the top-level templates/ as llmctl/templates and the preset data files; pyproject declares
every package llmctl imports, in the group that needs it."""

import ast
import functools
import importlib.metadata
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_templates_and_presets(tmp_path):
    pytest.importorskip("hatchling", reason="building the wheel needs hatchling (pip install 'llmctl[dev]')")
    r = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    wheel = next(tmp_path.glob("llmctl-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = [p.relative_to(ROOT).as_posix() for p in (ROOT / "templates").rglob("*") if p.is_file()]
    assert templates, "templates/ is empty"
    for t in templates:
        assert "llmctl/" + t in names, f"{t} is missing from the wheel"
    assert "llmctl/spec/presets/models.yaml" in names and "llmctl/spec/presets/gpus.yaml" in names


# --- every package llmctl imports is declared, in the group that needs it -------------------------------------------
NOT_INSTALLED = {"flash_attn": "flash-attn"}
"""Import names of optional packages that have no wheel here (flash-attn needs CUDA to build)."""
RANK_EXTRAS = ("train",)
"""What the engine's ranks need besides the core; the other extras (slurm, plot, fp8, lora, ...) each bring an
optional package that the code asks for by name when a feature needs it."""


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def _declared() -> dict[str, set[str]]:
    """group ('core' or an extra) -> the distributions it declares (normalized names; llmctl[...] left out)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="reading pyproject.toml on Python 3.10 needs tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = {"core": project["dependencies"], **project["optional-dependencies"]}
    names = {g: {_normal(re.match(r"[A-Za-z0-9._-]+", r).group()) for r in reqs} for g, reqs in groups.items()}
    return {g: n - {"llmctl"} for g, n in names.items()}


def _imports() -> dict[Path, list[tuple[str, bool]]]:
    """module file -> (top-level name of each third-party import, whether it runs when the module is imported)."""
    stdlib = set(sys.stdlib_module_names) | {"__future__", "llmctl"}
    out: dict[Path, list[tuple[str, bool]]] = {}
    for path in sorted((ROOT / "llmctl").rglob("*.py")):
        tree = ast.parse(path.read_text())
        at_import = {id(n) for n in _run_at_import(tree.body)}
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            found += [(n.split(".")[0], id(node) in at_import) for n in names if n.split(".")[0] not in stdlib]
        out[path] = found
    return out


def _run_at_import(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements that run when a module is imported: not those in functions, under `if TYPE_CHECKING`, or in a
    `try` that catches ImportError (an optional package)."""
    out: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(stmt, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(stmt.test):
                out += _run_at_import(stmt.body + stmt.orelse)
        elif isinstance(stmt, ast.Try):
            optional = any("ImportError" in ast.unparse(h.type) for h in stmt.handlers if h.type is not None)
            out += ([] if optional else _run_at_import(stmt.body)) + _run_at_import(stmt.finalbody)
        elif isinstance(stmt, (ast.ClassDef, ast.With)):
            out += _run_at_import(stmt.body)
        else:
            out.append(stmt)
    return out


@functools.cache
def _providers() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # scans every installed distribution: once


def _distribution(module: str) -> str:
    dists = _providers().get(module) or [NOT_INSTALLED.get(module, "")]
    assert dists[0], f"which distribution provides {module!r}? (install it, or add it to NOT_INSTALLED)"
    return _normal(dists[0])


def test_every_imported_package_is_declared() -> None:
    """An import of a package pyproject does not name works here only because something else installed it."""
    declared = set().union(*_declared().values())
    missing = {
        f"{_distribution(m)} ({path.relative_to(ROOT)})"
        for path, found in _imports().items()
        for m, _ in found
        if _distribution(m) not in declared
    }
    assert not missing, f"imported but not declared in pyproject.toml: {sorted(missing)}"


def test_what_runs_at_import_is_a_core_dependency() -> None:
    """A module-level import of a module that does not import torch (the CLI, spec, plan, launch, data ...) runs with
    the core install: `pip install llmctl` must bring it. Modules that import torch at module level run in ranks."""
    core = _declared()["core"]
    wrong = set()
    for path, found in _imports().items():
        if ("torch", True) in found:
            continue
        wrong |= {f"{_distribution(m)} ({path.relative_to(ROOT)})" for m, now in found if now}
    wrong = {w for w in wrong if w.split()[0] not in core}
    assert not wrong, f"imported when llmctl's CLI loads, but not a core dependency: {sorted(wrong)}"


def test_what_the_engine_imports_comes_with_the_train_extra() -> None:
    """The engine's ranks run with `pip install llmctl[train]`: what they import is in the core, in [train], or the
    package of an extra of its own (a feature's: fp8, lora, logging, ...)."""
    groups = _declared()
    feature = set().union(*(d for g, d in groups.items() if g not in (*RANK_EXTRAS, "dev", "docs")))
    allowed = groups["core"] | set().union(*(groups[g] for g in RANK_EXTRAS)) | feature
    wrong = {
        f"{_distribution(m)} ({path.relative_to(ROOT)})"
        for path, found in _imports().items()
        if "engine" in path.parts
        for m, _ in found
        if _distribution(m) not in allowed
    }
    assert not wrong, f"the engine imports what neither the core nor [train] declares: {sorted(wrong)}"
