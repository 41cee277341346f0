# `make demo` runs the main job, `make test` the test suite; each creates and fills its own venv first.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --constraint requirements/ci.txt

.PHONY: test demo bench clean

$(VENV)/.installed: pyproject.toml requirements/ci.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PIP) torch torchvision
	$(PIP) -e ".[test]"
	touch $@

test: $(VENV)/.installed
	$(PY) -m pytest -q tests

demo: $(VENV)/.installed
	$(PY) -m lightning_qstate.cli fit --config examples/configs/gpt_int8.yaml

bench: $(VENV)/.installed
	$(PY) benchmarks/formats.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
