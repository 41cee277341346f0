# `make demo` runs the main job, `make test` the test suite, `make lint` ruff (check and format) and clang-format (C++),
# `make kernel-check` the C++ kernel compiled (syntax only) for other x86 CPUs than this one (~35 s; CI runs it);
# each creates and fills its own venv first.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --constraint requirements/ci.txt

.PHONY: test lint kernel-check demo bench clean
LINTED := lightning_qstate tests benchmarks examples
# CPUs whose branches of the C++ kernel a build elsewhere does not compile: AVX-512 with and without VBMI, AVX2, neither
KERNEL_MARCHES := icelake-server skylake-avx512 haswell x86-64

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

kernel-check: $(VENV)/.installed
	[ "$$(uname -m)" != x86_64 ] || printf '%s\n' $(KERNEL_MARCHES) | xargs -P 2 -I{} $(PY) -c \
		"from lightning_qstate.kernels.native import check_compiles; check_compiles('{}')"

demo: $(VENV)/.installed
	$(PY) -m lightning_qstate.cli fit --config examples/configs/gpt_demo.yaml

bench: $(VENV)/.installed
	$(PY) benchmarks/formats.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
