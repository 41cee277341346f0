# `make demo` runs the main job, `make test` the test suite, `make lint` ruff (check and format) and clang-format (C++),
# `make kernel-check` the C++ kernel compiled (syntax only) for other x86 CPUs than this one (~35 s; CI runs it), `make
# kernel-emulate` its tests against their SIMD branches (emulated: ~5 min; CI runs it);
# each creates and fills its own venv first.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --constraint requirements/ci.txt

.PHONY: test lint kernel-check kernel-emulate demo bench clean
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

# `make kernel-emulate` the native kernel's tests against the SIMD branches of other x86 CPUs than this one: the
# AVX-512 ones (with VBMI and AVX512DQ's draws, and without VBMI) emulated by SIMDe (headers only, fetched from PyPI's
# simde-py), and the portable loops alone (kernels/native.py: EMULATIONS; ~5 min on 2 cores)
SIMDE_VERSION := 0.8.2.post1
SIMDE := $(VENV)/simde/simde_py-$(SIMDE_VERSION)/simde_py/simde
KERNEL_EMULATIONS := avx512-vbmi-dq avx512 portable
NATIVE_TESTS := tests/test_cpu_kernel.py tests/test_native_formats.py tests/test_native_momentum.py tests/test_dense_codes.py tests/test_zero_free.py

$(SIMDE)/simde/x86/avx512.h:
	$(PY) -m pip download --quiet --no-deps --no-binary :all: --dest $(VENV)/simde simde-py==$(SIMDE_VERSION)
	tar -xzf $(VENV)/simde/simde_py-$(SIMDE_VERSION).tar.gz -C $(VENV)/simde
	touch $@

kernel-emulate: $(VENV)/.installed $(SIMDE)/simde/x86/avx512.h
	[ "$$(uname -m)" != x86_64 ] || for emulation in $(KERNEL_EMULATIONS); do \
		echo "kernel-emulate: $$emulation"; \
		export LIGHTNING_QSTATE_KERNEL_EMULATE=$$emulation LIGHTNING_QSTATE_SIMDE=$(abspath $(SIMDE)); \
		$(PY) -c "from lightning_qstate.kernels.native import build_extension; build_extension()" && \
		$(PY) -m pytest -q -p no:cacheprovider $(NATIVE_TESTS) || exit 1; \
	done

demo: $(VENV)/.installed
	$(PY) -m lightning_qstate.cli fit --config examples/configs/gpt_demo.yaml

bench: $(VENV)/.installed
	$(PY) benchmarks/formats.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
