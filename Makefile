# Two entry points: `make demo` and `make test`. Both create .venv when missing and install
# qkv with pinned versions (constraints.txt), so a fresh clone needs nothing else.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --disable-pip-version-check -q -c constraints.txt
# pip's output goes to a log, shown only when the install fails.
LOGGED  = > $(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; exit 1; }
# The browser test drives Debian's Chromium; apt's output goes to a log, shown on failure.
CHROMIUM := /usr/bin/chromium
SUDO    := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test lint typecheck imports pytest install install-dev clean

demo: $(VENV)/.installed
	$(BIN)/qkv explain
	@mkdir -p out
	@$(BIN)/qkv explain --html out/explain.html --plot out/weights.png
	@$(BIN)/qkv explain --html out/practice.html --practice

test: $(VENV)/.installed-dev lint typecheck imports pytest

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

# The layer contract in pyproject.toml: no upward import, no circle (docs/architecture.md).
imports: $(VENV)/.installed-dev
	$(BIN)/lint-imports --no-cache

# The one test that times the page (a 512-token edit, under 100 ms) runs alone, after the
# rest: on 2 cores a second pytest worker would take the core Chromium needs.
pytest: $(VENV)/.installed-dev $(CHROMIUM)
	$(BIN)/pytest -n 2 -m "not solo"
	$(BIN)/pytest -m solo -p no:randomly tests/browser

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml constraints.txt
	$(PIP) -e '.[all]' $(LOGGED)
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) -e '.[all,dev]' $(LOGGED)
	@touch $@

# Installed only where missing (a file target: make skips it when /usr/bin/chromium exists).
$(CHROMIUM): | $(VENV)/bin/python
	@echo "installing Chromium for the browser test (apt-get; log: $(VENV)/apt.log)"
	@{ $(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y chromium; } > $(VENV)/apt.log 2>&1 || { cat $(VENV)/apt.log; exit 1; }

clean:
	rm -rf $(VENV) build dist src/*.egg-info .mypy_cache .ruff_cache .pytest_cache .import_linter_cache
