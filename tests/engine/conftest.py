"""Fixtures of the engine's tests."""

from __future__ import annotations

import pytest

from pdserve.engine import kernels


@pytest.fixture(scope="module")
def ops():
    """pdserve's compiled CPU operators, which must build on the test machine."""
    module = kernels.cpu_ops()
    assert module is not None, "the CPU operators must build on the test machine"
    return module


@pytest.fixture(scope="module")
def flash(ops):
    """The operators, where this CPU runs their prefill attention (AVX512-BF16, or AVX2 and
    FMA); else the test is skipped, as a CUDA test is without a GPU (the engine then takes
    PyTorch's SDPA)."""
    if not ops.prefill_attention_available():
        pytest.skip("this CPU has neither AVX512-BF16 nor AVX2 and FMA: no compiled prefill "
                    "attention")
    return ops


@pytest.fixture(params=["amx", "avx512_bf16", "fma"])
def prefill_kernel(request, ops):
    """Each prefill attention kernel this CPU runs: AMX tiles (what `prefill_attention` runs
    where the process is granted AMX), VDPBF16PS (what it runs on other AVX512-BF16 CPUs) and
    the fp32 FMA one (what it runs on AVX2); each callable wherever its CPU features are."""
    if request.param == "amx":
        if not ops.amx_available():
            pytest.skip("this CPU or kernel grants no AMX")
        return ops.prefill_attention_amx
    if request.param == "avx512_bf16":
        if not ops.dpbf16_available():
            pytest.skip("this CPU has no AVX512-BF16")
        return ops.prefill_attention_dpbf16
    if not ops.prefill_attention_fma_available():
        pytest.skip("this CPU has no AVX2 and FMA")
    return ops.prefill_attention_fma
