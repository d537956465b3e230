# The two commands: `make demo` and `make test`. Both bootstrap .venv themselves (idempotent).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all venv bench clean

venv: $(STAMP)

# torch first, pinned, so pip takes the CPU wheel on disk instead of resolving a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m neuron_compile.demo

# `make test` skips tests marked slow (CI runs it on 2 cores); `make test-all` runs everything.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

test-all: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: $(STAMP)
	$(PY) bench/simulator_bench.py

clean:
	rm -rf $(VENV) build *.egg-info
