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
