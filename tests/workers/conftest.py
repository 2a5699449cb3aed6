"""Fixtures of the workers' tests: a decode-role and a prefill-role engine, each behind a
hand-over policy and a hub that records its calls (`test_handover.Side`)."""

from __future__ import annotations

import pytest

from tests.conftest import engine_pair
from tests.workers.test_handover import Side


@pytest.fixture
def dec(tiny_model) -> Side:
    return Side(engine_pair(tiny_model(), decode_blocks=16)[1])


@pytest.fixture
def pre(tiny_model) -> Side:
    return Side(engine_pair(tiny_model())[0])
