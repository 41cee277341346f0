# `make demo` runs the main job, `make test` the test suite, `make lint` ruff (check and format) and clang-format (C++); each creates and fills its own venv first.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --constraint requirements/ci.txt

.PHONY: test lint demo bench clean
LINTED := lightning_qstate tests benchmarks examples

$(VENV)/.installed: pyproject.toml requirements/ci.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PIP) torch torchvision
	$(PIP) -e ".[test]"
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

lint: $(VENV)/.installed
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)
	$(VENV)/bin/clang-format --dry-run --Werror lightning_qstate/kernels/csrc/*

demo: $(VENV)/.installed
	$(PY) -m lightning_qstate.cli fit --config examples/configs/gpt_demo.yaml

bench: $(VENV)/.installed
	$(PY) benchmarks/formats.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
