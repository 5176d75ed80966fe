# Two entry points: `make demo` and `make test`. Both create .venv when missing and install
# qkv with pinned versions (constraints.txt), so a fresh clone needs nothing else.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip install --disable-pip-version-check -q -c constraints.txt
# pip's output goes to a log, shown only when the install fails.
LOGGED  = > $(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; exit 1; }
# The browser test drives Debian's Chromium, the sandbox tests Debian's bubblewrap; apt's
# output goes to a log, shown on failure. tools/apt-install waits (up to 10 minutes) for
# another apt or dpkg to let go of its lock, and says so when it gives up.
CHROMIUM := /usr/bin/chromium
BWRAP    := /usr/bin/bwrap
PACKAGE  := build/package-check

.PHONY: demo test lint typecheck imports pytest package install install-dev clean

demo: $(VENV)/.installed
	$(BIN)/qkv explain
	@mkdir -p out
	@$(BIN)/qkv explain --html out/explain.html --plot out/weights.png
	@$(BIN)/qkv explain --html out/practice.html --practice

test: $(VENV)/.installed-dev lint typecheck imports package pytest

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/ruff format --check src tests benchmarks examples

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

# The layer contract in pyproject.toml: no upward import, no circle (docs/architecture.md).
imports: $(VENV)/.installed-dev
	$(BIN)/lint-imports --no-cache

# The one test that times the page (a 512-token edit, under 100 ms) runs alone, after the
# rest: on 2 cores a second pytest worker would take the core Chromium needs. --dist loadfile:
# a file's tests run on one worker, so a module fixture (the graded class of
# tests/grade/test_class.py, a minute and more) is built once, not once per worker; files go out
# in collection order (--no-loadscope-reorder), the slow bench files first, the light ones last.
pytest: $(VENV)/.installed-dev $(CHROMIUM) $(BWRAP)
	$(BIN)/pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not solo"
	$(BIN)/pytest -m solo -p no:randomly tests/browser

# Packaging cannot break unseen: build the sdist and, from it, the wheel (no deprecation allowed),
# install the wheel alone into a new environment (the core: NumPy, no PyTorch), run it there.
package: $(VENV)/.installed-dev
	@rm -rf $(PACKAGE) && mkdir -p $(PACKAGE)
	@$(BIN)/python -m build --no-isolation --outdir $(PACKAGE)/dist . > $(PACKAGE)/build.log 2>&1 \
	    || { cat $(PACKAGE)/build.log; exit 1; }
	@! grep -i "deprecat" $(PACKAGE)/build.log || { echo "the build warns of a deprecation (above)"; exit 1; }
	@$(PYTHON) -m venv $(PACKAGE)/venv
	@$(PACKAGE)/venv/bin/python -m pip install --disable-pip-version-check -q -c constraints.txt \
	    $(PACKAGE)/dist/qkv-*.whl > $(PACKAGE)/pip.log 2>&1 || { cat $(PACKAGE)/pip.log; exit 1; }
	@cd $(PACKAGE) && venv/bin/python -c "import importlib.util as u, qkv; \
	    assert u.find_spec('torch') is None, 'the core pulled in torch'" \
	    && venv/bin/qkv explain > explain.txt && venv/bin/qkv check --example i-love-statistics \
	    -f json > check.json; test $$? = 1 && grep -q '"ok": false' check.json
	@echo "package: sdist and wheel build; the wheel alone installs and runs (numpy only)"
	@rm -rf $(PACKAGE)

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(VENV)/bin/python pyproject.toml constraints.txt
	$(PIP) -e '.[all]' $(LOGGED)
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) -e '.[all,dev,interp]' $(LOGGED)
	@touch $@

# Installed only where missing (file targets: make skips them when the program exists).
$(CHROMIUM): | $(VENV)/bin/python
	@echo "installing Chromium for the browser test (apt-get; log: $(VENV)/apt.log)"
	@tools/apt-install $(VENV)/apt.log chromium

$(BWRAP): | $(VENV)/bin/python
	@echo "installing bubblewrap for the sandbox of check --function (log: $(VENV)/apt.log)"
	@tools/apt-install $(VENV)/apt.log bubblewrap

clean:
	rm -rf $(VENV) build dist src/*.egg-info .mypy_cache .ruff_cache .pytest_cache .import_linter_cache
