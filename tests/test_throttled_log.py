"""A flood of refusals writes one warning per interval, and the next one counts the rest; the
same for information at a level of its own."""

from __future__ import annotations

import logging

import pytest

from pdserve.throttled_log import ThrottledLog


def test_one_line_per_interval_and_the_next_counts_what_was_not_written(caplog) -> None:
    now = [0.0]
    log = ThrottledLog(logging.getLogger("pdserve.test"), every_s=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="pdserve.test"):
        for t in (0.0, 1.0, 2.0, 10.5):
            now[0] = t
            log.warn("refused", "refused %s from %s", "GET /internal/legs", "10.0.0.1")
        log.warn("other", "another kind")  # keys are throttled apart
    assert [r.getMessage() for r in caplog.records] == [
        "refused GET /internal/legs from 10.0.0.1",
        "refused GET /internal/legs from 10.0.0.1 (2 more like it since the last such line)",
        "another kind"]


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="every_s"):
        ThrottledLog(logging.getLogger("pdserve.test"), every_s=0)


def test_information_may_be_throttled_too(caplog) -> None:
    log = ThrottledLog(logging.getLogger("pdserve.test"), every_s=10, clock=lambda: 0.0,
                       level=logging.INFO)
    with caplog.at_level(logging.INFO, logger="pdserve.test"):
        log.warn("kept", "kept a worker")
        log.warn("kept", "kept a worker")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, "kept a worker")]
