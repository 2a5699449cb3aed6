"""A real `pdserve worker` process moves to other cores while it serves (`POST /internal/cpus`):
strangers and bad bodies are refused, every thread of the process lands on the new cores, the
engine computes with as many threads, the signed /health says so, and the tokens stay those
it gave before."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.api.errors import ApiError
from pdserve.workers.cpu_pin import parse_cpus, pin_process
from tests.serve.test_flip import _call, _complete, _health, serve_worker, signed_post

two_cores = pytest.mark.skipif((os.cpu_count() or 1) < 2 or len(os.sched_getaffinity(0)) < 2,
                               reason="needs two cores this process may use")


def _pin(url: str, body: object) -> tuple[int, dict]:
    return signed_post(url, "/internal/cpus", body)


def _allowed(pid: int) -> set[str]:
    """Each thread's allowed cores, as /proc writes them ("0-1", "1")."""
    found = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        found |= {line.split()[1] for line in status.splitlines()
                  if line.startswith("Cpus_allowed_list:")}
    return found


@pytest.fixture(scope="module")
def worker(tiny_model, tmp_path_factory) -> Iterator[str]:
    """A collocated worker on core 0."""
    with serve_worker(tiny_model(), tmp_path_factory.mktemp("secret"), "--cpus", "0") as url:
        yield url


@pytest.mark.parametrize("body, says", [
    ({"cpus": []}, "cpus must be a non-empty list"),
    ({"cpus": [0, os.cpu_count()]}, "cpus must be a non-empty list of core numbers"),
    ({"cpus": [-1]}, "cpus must be a non-empty list"),
    ({"cpus": [True]}, "cpus must be a non-empty list"),
    ({"cpus": "0,1"}, "cpus must be a non-empty list"),
    ({"cpus": [0, 0]}, "cpus lists a core twice"),
    ({"cpus": [0], "threads": 1}, "no other key"),
    ([0, 1], "the body must be a JSON object"),
])
def test_a_bad_body_says_what_is_wrong(body: object, says: str) -> None:
    with pytest.raises(ApiError, match=says) as e:
        parse_cpus(body)
    assert e.value.status == 400


def test_the_cores_come_back_sorted() -> None:
    assert parse_cpus({"cpus": [1, 0]} if (os.cpu_count() or 1) > 1 else {"cpus": [0]}) == \
        tuple(range(min(2, os.cpu_count() or 1)))


def test_a_tensor_parallel_engine_keeps_its_cores() -> None:
    refused = pin_process((0,), tensor_parallel_size=2)
    assert isinstance(refused, ApiError) and refused.status == 409
    assert refused.code == "tensor_parallel"


def test_only_the_cluster_may_move_a_worker(worker: str) -> None:
    status, body, _ = _call(worker + "/internal/cpus", "POST", {"cpus": [0]})
    assert status == 401 and body["error"]["code"] == "invalid_internal_auth"
    status, answer = _pin(worker, {"cpus": [0, 0]})
    assert status == 400 and answer["error"]["param"] == "cpus"
    assert _health(worker)["cpus"] == [0]


@two_cores
def test_a_worker_takes_a_second_core_and_gives_it_back_between_steps(worker: str) -> None:
    pid = _health(worker)["pid"]
    before = _complete(worker)
    assert before[0] == 200 and _allowed(pid) == {"0"}
    status, answer = _pin(worker, {"cpus": [1, 0]})
    assert status == 200 and (answer["cpus"], answer["threads"]) == ([0, 1], 2)
    assert answer["seconds"] >= 0
    assert _health(worker)["cpus"] == [0, 1] and _allowed(pid) == {"0-1"}
    assert _complete(worker)[1]["choices"] == before[1]["choices"]
    status, answer = _pin(worker, {"cpus": [1]})
    assert status == 200 and (answer["cpus"], answer["threads"]) == ([1], 1)
    assert _health(worker)["cpus"] == [1] and _allowed(pid) == {"1"}
    assert _complete(worker)[1]["choices"] == before[1]["choices"]
