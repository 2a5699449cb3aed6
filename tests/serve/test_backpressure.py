"""Back-pressure through real processes: a second `pdserve router`, with two requests per worker
and three queue places, in front of a `pdserve up` cluster's workers. A burst well above that is
answered at the door (429 or 503, Retry-After, OpenAI's error JSON); every request that got in
completes with exactly its tokens; clients that leave while queued leak nothing; afterwards
the queue is empty, no leg is in flight, and every worker's KV pool is whole again."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pdserve.cluster.up_process import free_port
from tests.serve.cluster import Cluster, metric
from tests.serve.conftest import LOCAL_THRESHOLD
from tests.serve.test_serving import prompts

BURST = 16
LEAVERS = 4  # of the burst: clients that give up after LEAVE_S, queued or not
LEAVE_S = 0.3
MAX_TOKENS = 48
REFUSALS = {429: "queue_full", 503: "queue_timeout"}


class RouterProcess:
    """`pdserve router ARGS...` on a free port, over the workers of `cluster`."""

    def __init__(self, cluster: Cluster, log: Path, *args: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [sys.executable, "-m", "pdserve.cli", "router", "--port", str(self.port),
                "--model", cluster.model, "--secret-file", str(cluster.secret_file),
                "--prefill", cluster.worker_url(0), "--decode", cluster.worker_url(1),
                "--local-prefill-threshold", str(LOCAL_THRESHOLD), *args]
        with log.open("wb") as out:  # the child keeps its own copy of the file
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the router did not start:\n{self.output()}")
            time.sleep(0.2)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@pytest.fixture
def tight_router(disagg_tcp: Cluster, tmp_path: Path) -> Iterator[RouterProcess]:
    router = RouterProcess(disagg_tcp, tmp_path / "router.log", "--max-inflight-per-worker",
                           "2", "--max-queue", "3", "--max-queue-wait-s", "2")
    yield router
    router.stop()


def test_a_burst_over_the_caps_is_refused_at_the_door_and_the_rest_completes(
        disagg_tcp: Cluster, tight_router: RouterProcess) -> None:
    cluster, router = disagg_tcp, tight_router
    # both paths: short prompts run whole on the decode worker, long ones are split
    burst = [[(t + i + 3) % 500 for t in prompts()[i % len(prompts())]] for i in range(BURST)]
    results: list[object] = [None] * BURST
    start = threading.Barrier(BURST)

    def one(i: int) -> None:
        leaves = i < LEAVERS
        client = openai.OpenAI(base_url=router.base + "/v1", api_key="unused", max_retries=0,
                               timeout=LEAVE_S if leaves else 120)
        start.wait()
        try:
            out = client.completions.create(model=cluster.model, prompt=burst[i],
                                            max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True})
            results[i] = out.usage.completion_tokens
        except openai.APIStatusError as e:
            results[i] = (e.status_code, e.response.headers.get("retry-after"), e.body)
        except openai.APITimeoutError:
            results[i] = "left" if leaves else "timed out"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(BURST)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a request hung"

    stayed = results[LEAVERS:]
    refused = [r for r in results if isinstance(r, tuple)]
    assert refused, f"nothing was refused: {results}\n{router.output()}"
    assert MAX_TOKENS in stayed, f"nothing completed: {results}\n{router.output()}"
    for r in stayed:
        assert r == MAX_TOKENS or isinstance(r, tuple), (r, router.output())
    for status, retry_after, body in refused:
        assert status in REFUSALS, (status, body)
        assert retry_after is not None and retry_after.isdigit() and int(retry_after) >= 1
        assert body["code"] == REFUSALS[status]  # the openai client unwraps {"error": ...}
        assert body["message"].endswith(f"Please try again in {retry_after}s.")
    for r in results[:LEAVERS]:
        assert r in (MAX_TOKENS, "left") or isinstance(r, tuple), r

    rejected = sum(metric(router.base, f'pdserve_router_rejected_total{{pool="{pool}",'
                                       f'reason="{reason}"}}')
                   for pool in ("decode", "prefill") for reason in REFUSALS.values())
    assert rejected == len(refused)
    _wait_for_idle(router)
    out = openai.OpenAI(base_url=router.base + "/v1", api_key="unused", max_retries=0,
                        timeout=60).completions.create(
        model=cluster.model, prompt=burst[-1], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == MAX_TOKENS  # no slot was left held
    cluster.wait_blocks_free([0, 1])


def _wait_for_idle(router: RouterProcess) -> None:
    """The queues empty and no leg in flight (the leavers' handlers were cancelled)."""
    names = [f'pdserve_router_queue_depth{{pool="{p}"}}' for p in ("decode", "prefill")]
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(router.base + "/metrics", timeout=5) as r:
            lines = r.read().decode().splitlines()
        busy = [line for line in lines if line.split(" ")[0] in names or
                line.startswith("pdserve_router_worker_inflight_legs{")]
        if all(line.endswith(" 0") for line in busy):
            return
        assert time.monotonic() < deadline, f"still busy: {busy}\n{router.output()}"
        time.sleep(0.1)
