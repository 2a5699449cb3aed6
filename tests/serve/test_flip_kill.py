"""A worker killed in the middle of its flip (SIGKILL while a client's own stream on it holds
the flip to prefill): the router's requests it was streaming move to the other decode worker
and complete, the flip call ends with an error instead of hanging, no block stays used in the
pools that remain, the router stops counting the dead worker as a member of any pool, and the
cluster keeps serving."""

from __future__ import annotations

import os
import signal
import threading
import time

import openai

from pdserve.ctl.client import CtlError, RouterClient
from tests.serve.cluster import Cluster
from tests.serve.test_serving import client

ROUTER_STREAMS = 6
MAX_TOKENS = 200  # long enough to be streaming when the worker dies
BOUND_S = 60.0


def _prompt(i: int) -> list[int]:
    return [(t * 11 + i * 97) % 400 + 3 for t in range(24)]


def _state(router: RouterClient, name: str) -> str:
    return next(w["state"] for w in router.call("GET", "/internal/workers") if w["name"] == name)


def test_a_worker_killed_mid_flip_costs_only_its_own_client(request, tiny_model) -> None:
    cluster = Cluster(tiny_model(), "--prefill", "1", "--decode", "2", "--serve-public",
                      "--local-prefill-threshold", "16")
    request.addfinalizer(cluster.stop)
    router = RouterClient(cluster.url.removesuffix("/v1"), cluster.auth, timeout_s=BOUND_S)
    members = router.call("GET", "/internal/workers")
    victim = next(w for w in members if w["role"] == "decode")
    index = next(i for i in range(3) if cluster.worker_url(i) == victim["url"])
    pid = cluster.health(index)["pid"]
    others = [i for i in range(3) if i != index]

    # the client's own stream on the victim: no router can continue it, so it holds the flip
    own = openai.OpenAI(base_url=victim["url"] + "/v1", api_key="unused", max_retries=0,
                        timeout=BOUND_S).completions.create(
        model=cluster.model, prompt=_prompt(99), max_tokens=480, temperature=0, stream=True,
        extra_body={"ignore_eos": True})
    next(iter(own))
    results: list[object] = []

    def stream(i: int) -> None:
        try:
            out = client(cluster).completions.create(
                model=cluster.model, prompt=_prompt(i), max_tokens=MAX_TOKENS, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            results.append(sum(1 for ch in out if ch.choices and ch.choices[0].text))
        except openai.APIError as e:
            results.append(e)

    streams = [threading.Thread(target=stream, args=(i,)) for i in range(ROUTER_STREAMS)]
    for t in streams:
        t.start()
    flip: list[object] = []

    def flip_victim() -> None:
        try:
            flip.append(router.call("POST", f"/internal/workers/{victim['name']}/flip",
                                    {"role": "prefill"}))
        except CtlError as e:
            flip.append(e)

    flipper = threading.Thread(target=flip_victim)
    flipper.start()
    deadline = time.monotonic() + BOUND_S
    while _state(router, victim["name"]) != "flipping":
        assert time.monotonic() < deadline and not flip, flip
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()

    flipper.join(BOUND_S)
    for t in streams:
        t.join(BOUND_S)
    assert not flipper.is_alive() and not any(t.is_alive() for t in streams)
    assert time.monotonic() - killed < BOUND_S
    assert isinstance(flip[0], CtlError) and flip[0].status in (502, 503, 504), flip
    assert all(not isinstance(r, Exception) and r > 0 for r in results), results
    cluster.wait_blocks_free(others)
    deadline = time.monotonic() + 15
    while _state(router, victim["name"]) != "unhealthy":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    after = client(cluster).completions.create(model=cluster.model, prompt=_prompt(7),
                                               max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert after.usage.completion_tokens == 8
    cluster.wait_blocks_free(others)
