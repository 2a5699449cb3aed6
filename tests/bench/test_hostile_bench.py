"""`pdserve bench hostile` arithmetic: which token gaps count as during a hostile request and
which as the baseline, and the body it sends."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.hostile_bench import (
    GUARD_S,
    Hostile,
    HostileBenchSettings,
    gaps,
    hostile_body,
    split_gaps,
)
from pdserve.bench.serve.client import RequestRecord


def record(*times: float) -> RequestRecord:
    return RequestRecord(32, len(times), 0.0, tuple(times), times[-1], len(times))


def test_gaps_are_between_consecutive_tokens_of_one_request() -> None:
    assert gaps([record(1.0, 1.5, 1.7), record(2.0, 2.1)]) == [(1.0, 1.5), (1.5, 1.7),
                                                                 (2.0, 2.1)]


def test_a_gap_overlapping_a_hostile_request_is_during_it_and_a_near_one_is_neither() -> None:
    hostile = [Hostile(sent_s=10.0, done_s=10.5, status=400)]
    all_gaps = [(9.0, 9.1),  # clear: ends more than GUARD_S before
                (9.9, 10.05),  # overlaps the start
                (10.1, 10.2),  # inside
                (10.45, 11.0),  # overlaps the end
                (10.5 + GUARD_S / 2, 10.8),  # after, but inside the guard: neither
                (12.0, 12.3)]  # clear
    during, clear = split_gaps(all_gaps, hostile)
    assert during == pytest.approx([0.15, 0.1, 0.55])
    assert clear == pytest.approx([0.1, 0.3])


def test_the_hostile_body_is_a_completion_of_the_asked_size() -> None:
    body = hostile_body("m", 1.0)
    assert abs(len(body) - 2**20) < 64
    parsed = json.loads(body)
    assert parsed["model"] == "m" and parsed["max_tokens"] == 1


def test_an_ids_body_is_a_list_of_token_ids_of_the_asked_size() -> None:
    body = hostile_body("m", 1.0, "ids")
    prompt = json.loads(body)["prompt"]
    assert 0.9 * 2**20 < len(body) < 1.1 * 2**20
    assert all(type(t) is int for t in prompt)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="streams must be >= 1"):
        HostileBenchSettings(streams=0)
    with pytest.raises(ValueError, match="kind must be one of text, ids"):
        HostileBenchSettings(kind="stops")
    with pytest.raises(ValueError, match="period_s"):
        HostileBenchSettings(period_s=0.1)
