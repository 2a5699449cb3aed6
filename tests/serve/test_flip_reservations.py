"""A decode worker flipped to prefill while its reservations wait for a busy prefill worker, with
real processes (`pdserve up --prefill 1 --decode 2`): the reservations are handed back rather
than waited for, the router starts their requests over with the other decode worker, and
every request completes with the greedy tokens it gets undisturbed; no KV block stays used.
(`tests/workers/test_role_flip.py` shows that such a flip does not wait for the prefill.)
The prefill worker is paused (SIGSTOP) from the moment a reservation waits until the flip has
handed it back, so that no KV can reach the reservation first."""

from __future__ import annotations

import os
import signal
import threading
import time

from pdserve.ctl.client import RouterClient
from tests.serve.cluster import Cluster, metric
from tests.serve.test_serving import client

# The model of test_elastic.py (~2,000 prompt tokens/s here): a queue of 400-token prompts
# keeps the prefill worker busy for seconds.
MODEL = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4}
REQUESTS = 12
PROMPT_TOKENS = 400
MAX_TOKENS = 8
HANDED_BACK = 'pdserve_legs_handed_back_total'


def _prompt(n: int) -> list[int]:
    """Distinct from every other prompt from its first block: no prefix cache hits."""
    return [(t * 7 + n * 131) % 500 + 3 for t in range(PROMPT_TOKENS)]


def _complete(cluster: Cluster, n: int) -> list[str] | Exception:
    try:
        out = client(cluster).completions.create(
            model=cluster.model, prompt=_prompt(n), max_tokens=MAX_TOKENS, temperature=0,
            logprobs=1, extra_body={"ignore_eos": True})
        return list(out.choices[0].logprobs.tokens)
    except Exception as e:  # reported by the assertion below
        return e


def _flip_while_a_reservation_waits(cluster: Cluster, router: RouterClient, name: str,
                                    decode0: int, prefill_pid: int,
                                    threads: list[threading.Thread]) -> dict:
    """Flip worker `name` (index `decode0`) to prefill while a reservation of it waits, the
    prefill worker paused (SIGSTOP) until the flip has handed that reservation back: no KV can
    reach it first. The flip itself waits for the paused writer's fence (a round trip), so the
    worker is resumed once the hand-back is counted, not after the flip's answer."""
    deadline = time.monotonic() + 60.0
    while True:
        assert time.monotonic() < deadline and any(t.is_alive() for t in threads)
        if cluster.health(decode0)["waiting_for_kv"] > 0:  # a reservation waits there
            os.kill(prefill_pid, signal.SIGSTOP)
            if cluster.health(decode0)["waiting_for_kv"] > 0:  # and still does, paused
                break
            os.kill(prefill_pid, signal.SIGCONT)  # its KV came meanwhile: wait for another
        time.sleep(0.01)
    answer: list[dict | Exception] = []

    def flip() -> None:
        try:
            answer.append(router.call("POST", f"/internal/workers/{name}/flip",
                                      {"role": "prefill"}))
        except Exception as e:  # reported by the caller's assertion
            answer.append(e)

    flipper = threading.Thread(target=flip)
    try:
        flipper.start()
        while metric(cluster.worker_url(decode0), HANDED_BACK) == 0:
            assert time.monotonic() < deadline and flipper.is_alive(), answer
            time.sleep(0.01)
    finally:
        os.kill(prefill_pid, signal.SIGCONT)
    flipper.join(60)
    assert len(answer) == 1 and isinstance(answer[0], dict), answer
    return answer[0]


def test_a_flip_to_prefill_hands_back_reservations_instead_of_waiting(request,
                                                                      tiny_model) -> None:
    cluster = Cluster(tiny_model(**MODEL), "--prefill", "1", "--decode", "2",
                      "--local-prefill-threshold", "16")
    request.addfinalizer(cluster.stop)
    router_url = cluster.url.removesuffix("/v1")
    router = RouterClient(router_url, cluster.auth, timeout_s=60.0)
    members = router.call("GET", "/internal/workers")
    flipping = next(w for w in members if w["role"] == "decode")
    decode0 = next(i for i in range(3) if cluster.worker_url(i) == flipping["url"])
    results: dict[int, list[str] | Exception] = {}
    threads = [threading.Thread(target=lambda n=n: results.__setitem__(n, _complete(cluster, n)))
               for n in range(REQUESTS)]
    for t in threads:
        t.start()
    prefill_url = next(w["url"] for w in members if w["role"] == "prefill")
    prefill_pid = next(cluster.health(i)["pid"] for i in range(3)
                       if cluster.worker_url(i) == prefill_url)
    flip = _flip_while_a_reservation_waits(cluster, router, flipping["name"], decode0,
                                           prefill_pid, threads)
    assert flip["to"] == "prefill"
    for t in threads:
        t.join(120)
    assert all(isinstance(r, list) and len(r) == MAX_TOKENS for r in results.values()), results
    assert metric(cluster.worker_url(decode0), HANDED_BACK) >= 1
    # a reservation was handed back before any token of its request (a stream handed back
    # when the worker switches has sent tokens), and started over elsewhere
    log = "\n".join(cluster.log)
    assert "handed it back after token 0 (changing role)" in log, log[-4000:]
    cluster.wait_blocks_free([0, 1, 2])
    for n in range(REQUESTS):  # the same requests, one at a time, nothing flipping
        assert _complete(cluster, n) == results[n], n
    cluster.wait_blocks_free([0, 1, 2])
