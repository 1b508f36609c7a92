# Recall: `make demo` shows the whole system working (demo data, simulated workers);
# `make run` starts it on the embedded SQLite default; `make test` runs the tests
# (PostgreSQL at TEST_DATABASE_URL, then SQLite); `make docs` builds the documentation
# site (docs/, mkdocs.yml) into var/site. See README.md.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

# make chaos knobs (see `python -m tests.system.chaos --help`).
CHAOS_DURATION ?= 180
CHAOS_WORKERS ?= 12
CHAOS_ITEMS ?= 3000

# make bench knobs (see `python -m bench --help`), e.g. BENCH_ARGS="--only 5,6",
# or BENCH_ARGS="--scale 10m" for the ten-million-item run (BENCHMARKS.md).
BENCH_ARGS ?=

.PHONY: demo run test chaos bench docs lint typecheck format clean

# pip retries a failed connection itself, not an index page cut short on its
# way (a JSONDecodeError): three tries, so a registry's hiccup does not fail
# `make run` or `make test` on a fresh machine.
PIP_INSTALL = for try in 1 2 3; do \
	$(PY) -m pip install --disable-pip-version-check -q -r $(1) && exit 0; \
	echo "pip install -r $(1) failed (try $$try of 3)" >&2; sleep 5; \
	done; exit 1

$(VENV)/.runtime: requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(call PIP_INSTALL,requirements.txt)
	@touch $@

$(VENV)/.dev: requirements.txt requirements-dev.txt requirements-bench.txt requirements-docs.txt $(VENV)/.runtime
	@$(call PIP_INSTALL,requirements-dev.txt)
	@touch $@

demo: $(VENV)/.runtime
	@$(PY) scripts/demo.py

run: $(VENV)/.runtime
	@scripts/run.sh

test: $(VENV)/.dev
	@scripts/test.sh $(PYTEST_ARGS)

chaos: $(VENV)/.dev
	$(PY) -m tests.system.chaos --duration $(CHAOS_DURATION) --workers $(CHAOS_WORKERS) --items $(CHAOS_ITEMS) $(CHAOS_ARGS)

bench: $(VENV)/.dev
	$(PY) -m bench $(BENCH_ARGS)

# Strict: a broken link or anchor, or a page missing from the nav, fails the build.
docs: $(VENV)/.dev
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --clean --site-dir var/site

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(VENV)/.dev
	SECRET_KEY=typecheck-only DEBUG=on $(VENV)/bin/mypy

format: $(VENV)/.dev
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

clean:
	rm -rf $(VENV) var
