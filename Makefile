# Two commands on a fresh machine: `make demo` (install + a local CPU run of the whole flow) and `make test`
# (ruff, the docs build, pytest).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# torch is pinned to the CPU build that lies on this machine's disk; an unpinned torch pulls a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: install demo test docs test-gpu mutants lint bench validate clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: install
	bash scripts/demo.sh

test: install
	bash scripts/system-deps.sh
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(MAKE) docs
	$(VENV)/bin/pytest -q

# The docs site (mkdocs.yml, docs/): strict, so a broken link, anchor or nav entry fails `make test`. The command
# reference, plan-file schema and GPU catalog are generated from the code by docs/hooks.py. Into site/ (git-ignored).
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site

# The GPU tier (tests/gpu, pytest -m gpu): on a machine without CUDA it prints why nothing ran and exits 0. It runs
# with the venv's python when there is one, else the machine's python3 (a GPU image's own CUDA torch).
test-gpu:
	PY=$(if $(wildcard $(PY)),$(PY),python3) bash scripts/test-gpu.sh

# A mutation check of the core (scripts/mutants.py): each mutant applied in a scratch copy, its covering tests run,
# the kill rate and the survivors printed. Not part of `make test` (about ten minutes on 2 cores).
mutants: install
	$(PY) scripts/mutants.py

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: install
	for b in benchmarks/*.py; do $(PY) $$b || exit 1; done

# Every published run with a source (benchmarks/published_runs.yaml) predicted with its setup pinned: planned vs
# published tokens/s and memory, one table and the median error (docs/concepts/accuracy.md). It reports, it does not
# gate: exit 0 unless the data file is malformed.
validate: install
	$(PY) benchmarks/validate.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build dist site
