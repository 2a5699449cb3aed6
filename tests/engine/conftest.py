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
    """The operators, where this CPU runs their prefill attention (AVX512-BF16); else the test
    is skipped, as a CUDA test is without a GPU (the engine then takes PyTorch's SDPA)."""
    if not ops.prefill_attention_available():
        pytest.skip("this CPU has no AVX512-BF16: no compiled prefill attention")
    return ops
