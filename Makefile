# The two commands: `make demo` and `make test`. Both bootstrap .venv themselves (idempotent).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test venv bench clean

venv: $(STAMP)

# torch first, pinned, so pip takes the CPU wheel on disk instead of resolving a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m neuron_compile.demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

bench: $(STAMP)
	$(PY) bench/simulator_bench.py

clean:
	rm -rf $(VENV) build *.egg-info
