# Two commands do all set-up on a fresh machine:
#   make run    install, migrate, load the demo, start SMTP sink + portal + worker
#   make test   install dev tools and test services, then lint, type-check and the whole suite
# And one for developers after every change (not a set-up command):
#   make check  lint, type-check, the unit and integration tiers
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: run test check install install-dev

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)

install: $(VENV)/bin/python
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .

install-dev: $(VENV)/bin/python
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"

run: install
	$(PY) scripts/run.py

test:
	bash scripts/test.sh

check:
	bash scripts/test.sh --check
