# `make demo` and `make test` each create .venv when missing, install the project with the exact
# tested versions (scripts/constraints.txt; pyproject.toml holds only ranges), and run. The
# install is redone whenever pyproject.toml or the constraints change: pip then moves every
# package to its pin.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONSTRAINTS := scripts/constraints.txt

.PHONY: demo test lint format fresh-install clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c $(CONSTRAINTS) -e ".[all]"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m crosscheck run

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) -m pytest

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
