"""Ahead-of-time compile of every Triton kernel for sm_80 and sm_90, without a GPU: no errors, no register spills.

``lightning_qstate.kernels.aot_variants()`` lists the specializations (codebook and
minifloat encoders, RN and SR, nibble / byte / int16 containers, several block
sizes, every kernel of ``KERNELS``, the Adam kernel's weight grids and ECO feedback),
built by the same functions the launchers use.
Each is compiled with ``triton.compile`` for a CUDA target; the cubin must exist and
the bundled ``cuobjdump -res-usage`` must report no stack or local memory, and the
bundled ``ptxas -v`` no spill stores or loads. Skipped where Triton or its NVIDIA
backend is missing, and under ``TRITON_INTERPRET=1`` (interpreted kernels do not compile).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1 replaces kernels by interpreted functions", allow_module_level=True)

try:
    import triton.backends.nvidia
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
except ImportError as error:  # pragma: no cover - depends on the platform
    pytest.skip(f"no Triton NVIDIA backend: {error}", allow_module_level=True)

from lightning_qstate.kernels import (  # noqa: E402
    KERNELS,
    aot_variants,
    triton_kernels,
)

BIN = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
CUOBJDUMP = os.path.join(BIN, "cuobjdump")
PTXAS = os.path.join(BIN, "ptxas")
TARGETS = {80: "sm_80", 90: "sm_90a"}  # capability -> ptxas --gpu-name
VARIANTS = aot_variants()


def test_every_kernel_has_variants_with_full_signatures():
    assert triton_kernels.defined_kernels() == set(KERNELS), "every @triton.jit kernel of triton_kernels must be in KERNELS"
    assert {variant.kernel for variant in VARIANTS} == set(KERNELS), "aot_variants() must compile every kernel"
    for variant in VARIANTS:
        assert list(variant.signature) == variant.fn.arg_names, variant.label
        assert {name for name, kind in variant.signature.items() if kind == "constexpr"} == set(variant.constexprs), variant.label


def _run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout + result.stderr


def test_zero_free_encoders_are_compiled():
    """The clamp of zero-free formats is compiled too: a codebook quantize variant with ``MIN_CODE`` 1, an Adam variant
    whose ``v`` has it, and a zero-free SR cast."""
    by_kernel = {kernel: [variant.constexprs for variant in VARIANTS if variant.kernel == kernel] for kernel in KERNELS}
    assert any(not c["IS_MINIFLOAT"] and c["MIN_CODE"] == 1 for c in by_kernel["quantize_blocks_kernel"])
    assert any(not c["V_IS_MINIFLOAT"] and c["V_MIN_CODE"] == 1 for c in by_kernel["adam_step_kernel"])
    assert any(c["ZERO_FREE"] for c in by_kernel["stochastic_cast_kernel"])


def test_weight_grid_variants_are_compiled():
    """The Adam kernel without master weights is compiled in every mode it has: bf16 and fp16 parameters, each weight
    grid (none, fp32, bf16, fp16), SR of the weights on the bf16 and the fp16 grid, ECO on and off."""
    adam = [variant for variant in VARIANTS if variant.kernel == "adam_step_kernel"]
    assert {variant.signature["param_ptr"] for variant in adam} == {"*fp32", "*bf16", "*fp16"}
    grids = {triton_kernels.NO_GRID.value, triton_kernels.FP32_GRID.value, triton_kernels.BF16_GRID.value, triton_kernels.FP16_GRID.value}
    assert {variant.constexprs["WEIGHT_GRID"] for variant in adam} == grids
    stochastic = {variant.constexprs["WEIGHT_GRID"] for variant in adam if variant.constexprs["WEIGHT_STOCHASTIC"]}
    assert stochastic == {triton_kernels.BF16_GRID.value, triton_kernels.FP16_GRID.value}
    with_grid = [variant for variant in adam if variant.constexprs["WEIGHT_GRID"] != triton_kernels.NO_GRID.value]
    assert {variant.constexprs["ECO"] for variant in with_grid} == {True, False}


@pytest.mark.parametrize("capability", sorted(TARGETS))
@pytest.mark.parametrize("variant", VARIANTS, ids=[variant.label for variant in VARIANTS])
def test_compiles_without_spills(variant, capability):
    source = ASTSource(fn=variant.fn, signature=variant.signature, constexprs=variant.constexprs)
    # the options the launch passes (e.g. enable_fp_fusion=False for Adam): what runs is what is checked
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": variant.num_warps, **variant.options})
    assert "cubin" in compiled.asm and compiled.asm["cubin"], variant.label
    assert compiled.metadata.num_warps == variant.num_warps
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        with open(cubin, "wb") as file:
            file.write(compiled.asm["cubin"])
        usage = _run([CUOBJDUMP, "-res-usage", cubin])
        resources = re.findall(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", usage)
        assert resources, usage
        for registers, stack, local in resources:
            assert (int(stack), int(local)) == (0, 0), f"{variant.label} on sm_{capability}: stack/local memory in use:\n{usage}"
            assert int(registers) <= 255, usage
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as file:
            file.write(compiled.asm["ptx"])
        report = _run([PTXAS, "-v", "--gpu-name", TARGETS[capability], ptx, "-o", os.path.join(tmp, "ptxas.cubin")])
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills, report
    assert all(stores == "0" and loads == "0" for stores, loads in spills), f"{variant.label} on sm_{capability} spills:\n{report}"


ONE_VALUE = [variant for variant in VARIANTS if "numel" in variant.signature]


@pytest.mark.parametrize("variant", ONE_VALUE, ids=[variant.label for variant in ONE_VALUE])
def test_compiles_for_a_state_of_one_value(variant):
    """Triton's launch passes an int argument equal to 1 as a constexpr (a Python int in the kernel): a state of one
    value (``min_quant_size=0``, a bias of one) compiles so. ``numel.to(tl.int64)`` failed there ('int' has no ``to``)."""
    assert native_specialize_impl(BaseBackend, 1, False, True, True)[0] == "constexpr"  # what the launch does with 1
    signature = {**variant.signature, "numel": "constexpr"}
    source = ASTSource(fn=variant.fn, signature=signature, constexprs={**variant.constexprs, "numel": 1})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": variant.num_warps, **variant.options})
    assert compiled.asm["cubin"], variant.label
