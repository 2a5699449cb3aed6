"""Fixtures of the workers' tests: a decode-role and a prefill-role engine, each behind a
hand-over policy and a hub that records its calls (`test_handover.Side`)."""

from __future__ import annotations

import pytest

from tests.conftest import KV_BLOCKS, tiny_engine
from tests.workers.test_handover import Side


@pytest.fixture
def dec(tiny_model) -> Side:
    return Side(tiny_engine(tiny_model(), "decode", 16))


@pytest.fixture
def pre(tiny_model) -> Side:
    return Side(tiny_engine(tiny_model(), "prefill", KV_BLOCKS))
