# `make demo` and `make test` each create .venv when missing, install the project with the exact
# tested versions (scripts/constraints.txt; pyproject.toml holds only ranges), and run. The
# install is redone whenever pyproject.toml or the constraints change: pip then moves every
# package to its pin.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONSTRAINTS := scripts/constraints.txt

.PHONY: demo test lint format conformance fresh-install clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e ".[all]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m crosscheck run

# Two workers, a test file each at a time (--dist loadfile: a module's expensive fixture runs
# once): most tests keep one core busy, so two halve the suite's wall time on 2 cores.
test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest -n 2 --dist loadfile

# The whole conformance table (docs/conformance.md): the frameworks of
# scripts/constraints-conformance.txt on top of the tested set, then every setting.
CONFORMANCE_CONSTRAINTS := scripts/constraints-conformance.txt
CONFORMANCE_STAMP := $(VENV)/.conformance-installed

$(CONFORMANCE_STAMP): $(STAMP) $(CONFORMANCE_CONSTRAINTS)
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -c $(CONFORMANCE_CONSTRAINTS) -e ".[all,deepspeed]"
	$(PY) -m pip install --quiet --no-deps -r $(CONFORMANCE_CONSTRAINTS)
	$(PY) scripts/drop_stray_tests_package.py
	touch $(CONFORMANCE_STAMP)

conformance: $(CONFORMANCE_STAMP)
	OMP_NUM_THREADS=1 $(PY) -m crosscheck conformance --markdown docs/conformance.md

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# What a user of the package gets: the runtime ranges alone, no extras, no constraints, in a
# fresh venv (scripts/check_fresh_install.py; it needs the package index).
fresh-install:
	$(PYTHON) scripts/check_fresh_install.py

clean:
	rm -rf $(VENV) build *.egg-info
