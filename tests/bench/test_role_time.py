"""Seconds each worker spent in each role during a measured run, from the role spans its
`GET /internal/steps?since=START` returned; and the comparison's per-worker entries, names and
table line built from them."""

from __future__ import annotations

import pytest

from pdserve.bench import compare
from pdserve.bench.compare import format_table, worker_roles
from pdserve.bench.role_time import flips_within, format_role_seconds, role_at, role_seconds
from pdserve.bench.step_summary import summarize


def _span(role: str, since: float, old: str | None = None, seconds: float | None = None
          ) -> dict:
    return {"role": role, "since": since, "from": old, "flip_seconds": seconds}


STARTED = _span("decode", 0.0)


def test_a_worker_that_never_flipped_spent_the_whole_run_in_its_role() -> None:
    assert role_seconds([STARTED], 10.0, 100.0) == {"decode": 90.0}
    assert flips_within([STARTED], 10.0, 100.0) == []
    assert role_at([STARTED], 50.0) == "decode"


def test_a_flip_before_the_run_counts_only_the_role_it_left_the_worker_in() -> None:
    roles = [STARTED, _span("prefill", 5.0, "decode", 1.0)]
    assert role_seconds(roles, 10.0, 100.0) == {"prefill": 90.0}
    assert flips_within(roles, 10.0, 100.0) == []
    assert role_at(roles, 10.0) == "prefill" and role_at(roles, 4.0) == "decode"


def test_several_flips_split_the_run_and_a_drain_counts_to_the_role_left() -> None:
    roles = [STARTED, _span("prefill", 30.0, "decode", 2.0), _span("decode", 50.0, "prefill", 1.0),
             _span("prefill", 80.0, "decode", 0.5), _span("decode", 150.0, "prefill", 0.5)]
    seconds = role_seconds(roles, 10.0, 100.0)
    assert seconds == {"decode": 20.0 + 30.0, "prefill": 20.0 + 20.0}
    assert list(seconds) == ["decode", "prefill"]  # in order of first appearance
    assert sum(seconds.values()) == 90.0
    assert [s["since"] for s in flips_within(roles, 10.0, 100.0)] == [30.0, 50.0, 80.0]
    assert role_at(roles, 60.0) == "decode" and role_at(roles, 80.0) == "prefill"


def test_a_history_missing_its_oldest_spans_starts_with_the_role_before_the_oldest_kept() -> None:
    roles = [_span("prefill", 40.0, "decode", 1.0)]
    assert role_seconds(roles, 10.0, 100.0) == {"decode": 30.0, "prefill": 60.0}
    assert role_at(roles, 20.0) == "decode"


def test_a_flip_at_the_runs_edges_and_a_run_that_ends_before_it_starts() -> None:
    roles = [STARTED, _span("prefill", 10.0, "decode", 1.0)]
    assert role_seconds(roles, 10.0, 100.0) == {"prefill": 90.0}
    assert role_seconds(roles, 0.0, 10.0) == {"decode": 10.0}
    assert [s["since"] for s in flips_within(roles, 0.0, 10.0)] == [10.0]
    assert flips_within(roles, 10.0, 100.0) == []
    with pytest.raises(ValueError, match=r"the run ends \(5.0\) before it starts \(10.0\)"):
        role_seconds(roles, 10.0, 5.0)


def test_the_seconds_per_role_read_as_one_line() -> None:
    assert format_role_seconds({"decode-0": {"decode": 84.4, "prefill": 95.6},
                                "prefill-0": {"prefill": 180.0}}) == \
        "decode-0: decode 84 s, prefill 96 s; prefill-0: prefill 180 s"


class FakeUp:
    """`pdserve up` with two workers whose /internal/steps answer with these roles."""

    def __init__(self, *roles: list[dict]) -> None:
        self.roles = roles

    def worker_url(self, index: int) -> str:
        return f"http://w{index}"

    def internal_json(self, url: str) -> dict:
        index = int(url.removeprefix("http://w").split("/")[0])
        if index >= len(self.roles):
            raise ConnectionRefusedError
        return {"steps": [[index]], "roles": self.roles[index]}


def test_workers_keep_the_name_of_the_role_they_began_the_run_in() -> None:
    became_prefill = [STARTED, _span("prefill", 30.0, "decode", 1.0)]
    became_decode = [_span("prefill", 0.0), _span("decode", 30.0, "prefill", 1.0)]
    steps, workers, probes = compare._workers(FakeUp(became_prefill, became_decode), 10.0, 100.0)
    assert probes == []  # no step after the run
    assert steps == {"decode-0": [[0]], "prefill-0": [[1]]}
    assert workers["decode-0"] == {"index": 0, "url": "http://w0", "roles": became_prefill,
                                   "role_seconds": {"decode": 20.0, "prefill": 70.0}, "flips": 1,
                                   "steps": summarize([], 10.0, 100.0)}
    assert workers["prefill-0"]["role_seconds"] == {"prefill": 20.0, "decode": 70.0}


def test_the_table_gives_seconds_per_role_for_configurations_that_flipped() -> None:
    flipped = worker_roles(0, "http://w0", [STARTED, _span("prefill", 30.0, "decode", 1.0)],
                           10.0, 100.0)
    steady = worker_roles(1, "http://w1", [_span("prefill", 0.0)], 10.0, 100.0)
    results = {"disagg": {"role_flips": 0, "workers": {"prefill-0": steady}},
               "elastic": {"role_flips": 1, "workers": {"decode-0": flipped,
                                                        "prefill-0": steady}},
               "vllm": {}}
    lines = format_table(results).splitlines()
    assert lines[-2:] == ["time in each role during the run:",
                          "  elastic: decode-0: decode 20 s, prefill 70 s; prefill-0: prefill 90 s"]
    assert format_table(results, repeats=3).splitlines()[-2] == \
        "time in each role during the last run:"
    assert "time in each role" not in format_table({"disagg": results["disagg"]})
