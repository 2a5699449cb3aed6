"""Chat and completions through `pdserve up`, with the official `openai` client: the same greedy
tokens whether collocated, disaggregated over tcp, or disaggregated over nixl."""

from __future__ import annotations

import functools
import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from pdserve.testing.tiny_models import tiny_tokenizer
from tests.serve.cluster import Cluster, metric
from tests.serve.conftest import LOCAL_THRESHOLD

MAX_TOKENS = 24
# Token-id prompts on both sides of the local-prefill threshold: short ones run whole on the
# decode worker, long ones are split into a prefill leg and a decode leg.
LENGTHS = (5, LOCAL_THRESHOLD, 40, 100, 230, 300)
CHAT = [{"role": "user", "content": "Name three colours of the rainbow, please."}]


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    vocab = len(tiny_tokenizer())
    return [[rng.randrange(vocab) for _ in range(n)] for n in LENGTHS]


@functools.cache
def _offline_texts(model: str) -> tuple[str, ...]:
    """The offline engine's greedy outputs (its tokens equal transformers', tests/engine)."""
    from pdserve import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", max_model_len=512)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return tuple(o.outputs[0].text for o in llm.generate(prompts(), params, use_tqdm=False))


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url, api_key="unused", max_retries=0, timeout=60)


def _complete(cluster: Cluster, prompt: list[int]) -> openai.types.Completion:
    return client(cluster).completions.create(
        model=cluster.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})


def test_concurrent_greedy_batch_matches_the_offline_engine(any_cluster: Cluster) -> None:
    with ThreadPoolExecutor(len(LENGTHS)) as pool:
        results = list(pool.map(functools.partial(_complete, any_cluster), prompts()))
    assert [r.choices[0].text for r in results] == list(_offline_texts(any_cluster.model))
    for r, n in zip(results, LENGTHS, strict=True):
        assert r.usage.prompt_tokens == n
        assert r.usage.completion_tokens == MAX_TOKENS
        assert r.choices[0].finish_reason == "length"
        assert r.id.startswith("cmpl-")


def test_kv_sealed_with_aes_gcm_gives_the_same_greedy_tokens(disagg_tcp_sealed: Cluster
                                                             ) -> None:
    with ThreadPoolExecutor(len(LENGTHS)) as pool:
        results = list(pool.map(functools.partial(_complete, disagg_tcp_sealed), prompts()))
    assert [r.choices[0].text for r in results] == list(_offline_texts(disagg_tcp_sealed.model))
    decode = _scrape(disagg_tcp_sealed.worker_url(1))
    assert _metric(decode, 'pdserve_transfer_bytes_total{direction="recv"}') > 0
    assert "pdserve_transfer_failures_total{" not in decode  # a labelled child: none made


def _scrape(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        return r.read().decode()


def _metric(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + " ")]
    assert lines, f"{name} not in /metrics"
    return float(lines[0].split()[-1])


def test_streamed_completion_equals_the_whole_one(any_cluster: Cluster) -> None:
    prompt = prompts()[4]
    stream = client(any_cluster).completions.create(
        model=any_cluster.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == _offline_texts(any_cluster.model)[4]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS
    assert len({c.id for c in chunks}) == 1


def test_chat_streaming_and_not_agree(any_cluster: Cluster) -> None:
    c = client(any_cluster)
    whole = c.chat.completions.create(model=any_cluster.model, messages=CHAT, max_tokens=20,
                                      temperature=0)
    stream = c.chat.completions.create(model=any_cluster.model, messages=CHAT, max_tokens=20,
                                       temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason
    assert whole.usage.completion_tokens == (20 if whole.choices[0].finish_reason == "length"
                                             else whole.usage.completion_tokens)
    assert whole.id.startswith("chatcmpl-")


def test_seeded_sampling_is_the_same_on_every_path(any_cluster: Cluster) -> None:
    """A seeded request draws the same tokens whichever path and worker serve it."""
    def sample() -> str:
        return client(any_cluster).completions.create(
            model=any_cluster.model, prompt=prompts()[3], max_tokens=16, temperature=1.0,
            seed=1234, extra_body={"ignore_eos": True}).choices[0].text

    from pdserve import LLM, SamplingParams

    llm = LLM(model=any_cluster.model, dtype="float32", max_model_len=512)
    expected = llm.generate([prompts()[3]], SamplingParams(
        max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True), use_tqdm=False)
    assert sample() == sample() == expected[0].outputs[0].text


def test_a_worker_alone_is_a_complete_openai_server(collocated: Cluster) -> None:
    worker = openai.OpenAI(base_url=collocated.worker_url(0) + "/v1", api_key="unused",
                           max_retries=0)
    out = worker.completions.create(model=collocated.model, prompt=prompts()[2],
                                    max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == _offline_texts(collocated.model)[2]
    chat = worker.chat.completions.create(model=collocated.model, messages=CHAT, max_tokens=5)
    assert chat.usage.completion_tokens <= 5


def test_models_and_health(disagg_tcp: Cluster) -> None:
    models = client(disagg_tcp).models.list()
    assert [m.id for m in models.data] == [disagg_tcp.model]
    health = disagg_tcp.internal_json(disagg_tcp.url.removesuffix("/v1") + "/health")
    assert health["status"] == "ok"
    assert sorted(w["role"] for w in health["workers"]) == ["decode", "prefill"]
    prefill, decode = disagg_tcp.health(0), disagg_tcp.health(1)
    assert (prefill["role"], decode["role"]) == ("prefill", "decode")
    assert prefill["peer"]["port"] == disagg_tcp.port + 101


@pytest.mark.parametrize("path", ["disaggregated", "local"])
def test_metrics_count_both_paths_and_the_transfer(disagg_tcp: Cluster, path: str) -> None:
    prompt = prompts()[4 if path == "disaggregated" else 0]
    _complete(disagg_tcp, prompt)
    router = _scrape(disagg_tcp.url.removesuffix("/v1"))
    assert f'pdserve_router_requests_total{{path="{path}"}}' in router
    assert "pdserve_router_time_to_first_token_seconds_bucket" in router
    decode = _scrape(disagg_tcp.worker_url(1))
    assert "pdserve_kv_blocks_used " in decode
    assert "pdserve_inter_token_latency_seconds_count" in decode
    assert _metric(decode, 'pdserve_transfer_bytes_total{direction="recv"}') > 0
    if path == "disaggregated":  # this cluster streams layer-wise (--kv-layerwise on)
        prefill = _scrape(disagg_tcp.worker_url(0))
        assert _metric(prefill, "pdserve_kv_layers_streamed_total") > 0


def _route(cluster: Cluster, prompt: list[int], stream: bool) -> str | None:
    """The X-Pdserve-Route header of one completion, after the whole response is read."""
    raw = client(cluster).completions.with_raw_response.create(
        model=cluster.model, prompt=prompt, max_tokens=4, temperature=0, stream=stream)
    body = raw.parse()
    if stream:
        assert [c for c in body][-1].choices[0].finish_reason is not None
    return raw.headers.get("x-pdserve-route")


@pytest.mark.parametrize("stream", [False, True])
def test_the_route_header_says_which_path_served_and_by_which_rule(
        disagg_tcp: Cluster, collocated: Cluster, stream: bool) -> None:
    rng, vocab = random.Random(), len(tiny_tokenizer())
    # over the cluster's --local-prefill-threshold, in no worker's prefix cache yet: split
    over = [rng.randrange(vocab) for _ in range(100)]
    assert _route(disagg_tcp, over, stream) == "disaggregated; rule=threshold"
    assert _route(disagg_tcp, prompts()[0], stream) == "local; rule=threshold"
    assert _route(collocated, over, stream) == "local; rule=collocated_worker"
    worker = openai.OpenAI(base_url=collocated.worker_url(0) + "/v1", api_key="unused",
                           max_retries=0)
    raw = worker.completions.with_raw_response.create(model=collocated.model, prompt=over,
                                                      max_tokens=2)
    assert "x-pdserve-route" not in raw.headers  # a worker alone routes nothing


def test_workers_record_their_engine_steps_for_timelines(disagg_tcp: Cluster) -> None:
    import time

    rng = random.Random(time.time())
    prompt = [rng.randrange(len(tiny_tokenizer())) for _ in range(LENGTHS[4])]  # never cached
    since = time.time()
    _complete(disagg_tcp, prompt)  # prefill on worker 0, decode on worker 1
    prefill, decode = (disagg_tcp.internal_json(f"{disagg_tcp.worker_url(i)}/internal/steps"
                                                f"?since={since}") for i in (0, 1))
    assert prefill["fields"] == ["start", "end", "prefill_tokens", "decode_tokens",
                                 "num_requests", "decode_context", "prefill_attention"]
    n = LENGTHS[4]
    assert [s[2] for s in prefill["steps"]] == [n]  # one step: the whole prompt
    assert [s[6] for s in prefill["steps"]] == [n * (n + 1) // 2]  # its causal pairs
    assert all(s[0] <= s[1] for s in prefill["steps"] + decode["steps"])
    assert sum(s[3] for s in decode["steps"]) == MAX_TOKENS - 1  # token 0 came from prefill
    assert not any(s[2] for s in decode["steps"])


def test_the_prefill_worker_reports_its_link_to_the_decode_worker(disagg_tcp: Cluster) -> None:
    rng = random.Random(11)
    _complete(disagg_tcp, [rng.randrange(len(tiny_tokenizer())) for _ in range(LENGTHS[4])])
    decode_peer = disagg_tcp.health(1)["peer"]
    links = {link["peer"]: link for link in disagg_tcp.health(0)["links"]}
    link = links[f"{decode_peer['host']}:{decode_peer['port']}"]
    assert link["source"] == "tcp_info" and link["bytes_sent"] > 0
    assert link["gbps"] > 0 and link["rtt_ms"] > 0


def test_a_repeated_long_prompt_is_served_from_the_decode_workers_prefix_cache(
        disagg_tcp: Cluster) -> None:
    """Prefix caching under P/D: a long prompt is split the first time (nothing cached
    anywhere), and its KV lands in the decode worker's prefix cache. Sent again, the router
    runs it whole on that decode worker, which computes only the uncached tail; the usage says
    how much came from the cache, and the tokens are the same."""
    import time

    rng = random.Random(time.time())
    prompt = [rng.randrange(len(tiny_tokenizer())) for _ in range(LENGTHS[5])]  # never cached
    router = disagg_tcp.url.removesuffix("/v1")
    paths = ('pdserve_router_requests_total{path="disaggregated"}',
             'pdserve_router_requests_total{path="local"}')
    before = [metric(router, p) for p in paths]
    first = _complete(disagg_tcp, prompt)
    after_first = [metric(router, p) for p in paths]
    second = _complete(disagg_tcp, prompt)
    after_second = [metric(router, p) for p in paths]
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert after_first == [before[0] + 1, before[1]]  # split
    assert after_second == [after_first[0], after_first[1] + 1]  # local, on the decode worker
    full_blocks = (len(prompt) - 1) // 16 * 16  # the last token is always computed
    assert second.usage.prompt_tokens_details.cached_tokens == full_blocks
    assert second.choices[0].text == first.choices[0].text


def test_one_request_id_names_the_request_in_every_process_log(disagg_tcp: Cluster) -> None:
    """The response id is the id the router, the prefill worker and the decode worker log."""
    import time

    rng = random.Random(time.time())
    prompt = [rng.randrange(len(tiny_tokenizer())) for _ in range(LENGTHS[4])]  # never cached
    out = _complete(disagg_tcp, prompt)  # split
    want = {"[router]": "completion", "[prefill-0]": "prefill leg", "[decode-0]": "decode leg"}
    deadline = time.monotonic() + 5
    while True:
        lines = [line for line in list(disagg_tcp.log) if f"request {out.id}:" in line]
        found = {who for who, what in want.items()
                 if any(line.startswith(who) and what in line for line in lines)}
        if found == set(want):
            return
        assert time.monotonic() < deadline, f"{out.id} missing from {set(want) - found}: {lines}"
        time.sleep(0.1)
