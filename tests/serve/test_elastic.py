"""`pdserve up --elastic` with real processes: a steady stream of long prompts, more than the one
prefill worker can start within the TTFT target, makes the router flip an idle-enough decode
worker to prefill by itself; every request completes while it does."""

from __future__ import annotations

import threading
import time

import openai

from tests.serve.cluster import Cluster, metric
from tests.serve.test_serving import client

FLIPS = 'pdserve_role_flips_total{from="decode",to="prefill"}'
# A model big enough that its prefill, not the clients, is the bottleneck on a shared 2-core
# machine (~2,000 prompt tokens/s: a 400-token prompt takes ~0.2 s); the same one as
# test_lease.py, so a test run writes it once.
MODEL = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4}
CLIENTS = 8
PROMPT_TOKENS = 400
MAX_TOKENS = 4
DEADLINE_S = 90.0


def _prompt(client_index: int, n: int) -> list[int]:
    """Distinct from every other prompt from its first block: no prefix cache hits."""
    return [(t * 7 + client_index * 131 + n * 17) % 500 + 3 for t in range(PROMPT_TOKENS)]


def test_long_prompts_make_the_router_flip_a_decode_worker_to_prefill(request,
                                                                      tiny_model) -> None:
    # a 100 ms TTFT target: one 400-token prompt waiting at the prefill worker is pressure,
    # and 8 clients keep several waiting; a 1 s TPOT target: the decode side has headroom.
    # Every long prompt is split (threshold 16), so the prompts queue at the prefill worker.
    cluster = Cluster(tiny_model(**MODEL), "--prefill", "1", "--decode", "2", "--elastic",
                      "--slo-ttft-ms", "100", "--slo-tpot-ms", "1000",
                      "--local-prefill-threshold", "16")
    request.addfinalizer(cluster.stop)
    router = cluster.url.removesuffix("/v1")
    stop, results = threading.Event(), []

    def load(i: int) -> None:
        n, openai_client = 0, client(cluster)
        while not stop.is_set():
            try:
                out = openai_client.completions.create(
                    model=cluster.model, prompt=_prompt(i, n), max_tokens=MAX_TOKENS,
                    temperature=0, extra_body={"ignore_eos": True})
                results.append(out.usage.completion_tokens)
            except openai.APIError as e:
                results.append(e)
            n += 1

    threads = [threading.Thread(target=load, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + DEADLINE_S
    try:
        while time.monotonic() < deadline and metric(router, FLIPS) < 1:
            time.sleep(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    log = "\n".join(list(cluster.log)[-40:])
    assert metric(router, FLIPS) == 1, log
    assert sorted(cluster.health(i)["role"] for i in range(3)) == ["decode", "prefill",
                                                                   "prefill"]
    assert any("elastic: flipping worker" in line and "prefill wait" in line
               for line in cluster.log), log
    assert results and all(r == MAX_TOKENS for r in results), [r for r in results
                                                                 if r != MAX_TOKENS][:3]
