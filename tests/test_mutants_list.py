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
