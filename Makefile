# Two entry points: `make demo` and `make test`. Each creates .venv and installs
# what it needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# CPU: float32 and no accelerator probing noise.
export JAX_PLATFORMS ?= cpu

.PHONY: demo test venv venv-test clean

$(VENV)/.core: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.core setup.py
	$(PIP) install -q -e '.[test,parity,notebooks]'
	touch $@

venv: $(VENV)/.core
venv-test: $(VENV)/.test

demo: $(VENV)/.core
	$(PY) -m experiments.demo

test: $(VENV)/.test
	$(PY) -m pytest -q --timeout=900 -n 2 --dist loadgroup tests

clean:
	rm -rf $(VENV) *.egg-info
