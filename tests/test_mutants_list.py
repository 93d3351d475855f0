"""scripts/mutants.py (`make mutants`) stays in step with the code: every mutant's line is found exactly once in its
file, the mutated text differs, ids are unique, and the tests it runs exist. The mutation run itself is not part of
`make test` (minutes); this check is (milliseconds)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load():
    spec = importlib.util.spec_from_file_location("mutants", REPO / "scripts" / "mutants.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mutants"] = module  # dataclasses look their module up
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_every_mutant_applies_and_names_existing_tests() -> None:
    mutants = load().MUTANTS
    assert len(mutants) >= 20 and len({m.id for m in mutants}) == len(mutants)
    for m in mutants:
        text = (REPO / m.path).read_text()
        assert text.count(m.old) == 1, (m.id, m.path)
        assert m.new != m.old and m.what, m.id
        for t in m.tests:
            path, _, name = t.partition("::")
            assert (REPO / path).is_file(), (m.id, t)
            assert not name or f"def {name}(" in (REPO / path).read_text(), (m.id, t)


def test_known_equivalents_are_real_mutants() -> None:
    module = load()
    assert set(module.KNOWN_EQUIVALENT) <= {m.id for m in module.MUTANTS}


# Issue 51's modules beside launch/: the newer parallelism, precision and stall-detection code.
NEWER_MODULES = (
    "llmctl/engine/tensor_parallel.py",
    "llmctl/families/tensor_parallel.py",
    "llmctl/engine/context_parallel.py",
    "llmctl/plan/ring.py",
    "llmctl/plan/memory/ring.py",
    "llmctl/engine/float8.py",
    "llmctl/plan/float8.py",
    "llmctl/spec/nf4.py",
    "llmctl/engine/pipeline.py",
    "llmctl/spec/pipeline.py",
    "llmctl/engine/experts.py",
    "llmctl/spec/experts.py",
    "llmctl/plan/experts.py",
    "llmctl/plan/memory/experts.py",
    "llmctl/engine/watchdog.py",
)


def test_every_launch_module_and_each_newer_one_has_two_mutants_or_more() -> None:
    """A module added to launch/ without mutants shows here (package files that hold no code are left out)."""
    per_file: dict[str, int] = {}
    for m in load().MUTANTS:
        per_file[m.path] = per_file.get(m.path, 0) + 1
    launch = sorted(
        p.relative_to(REPO).as_posix()
        for p in (REPO / "llmctl" / "launch").rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    )
    assert len(launch) >= 20
    thin = {f: per_file.get(f, 0) for f in (*launch, *NEWER_MODULES) if per_file.get(f, 0) < 2}
    assert not thin, thin
