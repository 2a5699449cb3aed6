"""The `prefix` workload of `pdserve bench serve`: seeded shared prefixes, each request one of
them + a suffix of its own, and the prefix each request carried in its record."""

from __future__ import annotations

import argparse
import asyncio
import collections
import time

import pytest

from pdserve.bench.serve import runner
from pdserve.bench.serve.client import RequestRecord
from pdserve.bench.serve.runner import (
    Load,
    add_bench_serve_args,
    run_bench_async,
    settings_from_args,
)
from pdserve.bench.serve.workloads import (
    PREFIX_COUNT,
    PREFIXED,
    SHARED_PREFIX,
    TOKEN_ID_LO,
    RequestSpec,
    Workload,
    shared_prefix,
)
from tests.bench.test_serve_client import fake_server


def _specs(seed: int = 0, n: int = 40, rate: float = 1.0, **kw) -> list[RequestSpec]:
    return Workload("prefix", seed=seed, **kw).requests(rate, num_requests=n)


def test_requests_of_one_prefix_share_exactly_its_tokens():
    specs = _specs()
    by_id = collections.defaultdict(list)
    for s in specs:
        by_id[s.prefix_id].append(s)
    assert set(by_id) == set(range(PREFIX_COUNT))
    for k, group in by_id.items():
        prefix = shared_prefix(0, Workload().vocab, k)
        assert SHARED_PREFIX.lo <= len(prefix) <= SHARED_PREFIX.hi
        for s in group:
            assert s.prefix_tokens == len(prefix) and s.prompt_token_ids[:len(prefix)] == prefix
            suffix = len(s.prompt_token_ids) - len(prefix)
            assert PREFIXED.prompt.lo <= suffix <= PREFIXED.prompt.hi
            assert PREFIXED.output.lo <= s.max_tokens <= PREFIXED.output.hi
        # the suffixes are each request's own
        assert len({s.prompt_token_ids[len(prefix):] for s in group}) == len(group)
    prefixes = [shared_prefix(0, Workload().vocab, k) for k in range(PREFIX_COUNT)]
    assert len({p[:16] for p in prefixes}) == PREFIX_COUNT  # different from their first block
    assert all(TOKEN_ID_LO <= t < 30000 for s in specs for t in s.prompt_token_ids)


def test_same_seed_same_trace_other_seed_other_one():
    a = _specs(seed=3)
    assert a == _specs(seed=3)
    other = _specs(seed=4)
    assert [s.prompt_token_ids for s in a] != [s.prompt_token_ids for s in other]
    assert shared_prefix(3, 49152, 0) != shared_prefix(4, 49152, 0)
    # prompts do not depend on the rate or the count, only arrivals do
    assert [s.prompt_token_ids for s in _specs(seed=3, n=10, rate=7.0)] == \
        [s.prompt_token_ids for s in a[:10]]
    # a prefix depends on (seed, k) alone: more prefixes keep the first ones
    assert shared_prefix(3, 49152, 1) == shared_prefix(3, 49152, 1)
    more = {s.prefix_id: s.prefix_tokens for s in _specs(seed=3, n=200, prefixes=8)}
    assert set(more) == set(range(8))
    assert all(more[k] == len(shared_prefix(3, 49152, k)) for k in range(8))


def test_settings_and_bad_values():
    assert Workload("prefix", prefixes=2).settings() == {
        "workload": "prefix", "seed": 0, "vocab": 49152, "max_model_len": None, "prefixes": 2}
    with pytest.raises(ValueError, match="prefixes must be >= 1"):
        Workload("prefix", prefixes=0)
    Workload("prefix", max_model_len=1536 + 256 + 128)
    with pytest.raises(ValueError, match="needs up to 1920 tokens"):
        Workload("prefix", max_model_len=1919)
    with pytest.raises(ValueError, match="prefix_tokens needs a prefix_id"):
        RequestSpec(0.0, (1, 2), 1, prefix_tokens=1)
    with pytest.raises(ValueError, match="1 <= prefix_tokens <= the prompt"):
        RequestSpec(0.0, (1, 2), 1, prefix_id=0, prefix_tokens=3)
    assert RequestSpec(0.0, (1, 2), 1).prefix_fields() == {}


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve bench serve")
    add_bench_serve_args(parser)
    return parser.parse_args(argv)


def test_command_line_names_the_workload():
    workload, load, _ = settings_from_args(_parse("--workload", "prefix", "--prefixes", "3",
                                                  "--concurrency", "2"))
    assert (workload.kind, workload.prefixes, load.concurrency) == ("prefix", 3, 2)
    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    assert "  prefix  one of --prefixes prefixes (1,024-1,536" in parser.format_help()


async def _instant(client, url, model, spec: RequestSpec, timeout_s) -> RequestRecord:
    """A request answered after a delay that depends on its prompt, so requests end out of
    trace order."""
    await asyncio.sleep(0.002 * (len(spec.prompt_token_ids) % 7))
    now = time.perf_counter()
    return RequestRecord(len(spec.prompt_token_ids), spec.max_tokens, now, (now,), now, 1)


@pytest.mark.parametrize("load", [Load(rate=200.0, num_requests=12),
                                  Load(concurrency=3, num_requests=12)])
def test_each_record_carries_its_prefix(monkeypatch, load):
    monkeypatch.setattr(runner, "send_request", _instant)
    workload = Workload("prefix", seed=5)
    result = asyncio.run(run_bench_async("http://h/v1", "m", workload, load, progress=False))
    specs = workload.requests(1.0 if load.rate is None else load.rate, num_requests=12)
    rows = result["requests"]
    assert [(r["prefix_id"], r["prefix_tokens"]) for r in rows] == \
        [(s.prefix_id, s.prefix_tokens) for s in specs]
    assert [r["prompt_tokens"] for r in rows] == [len(s.prompt_token_ids) for s in specs]
    assert result["workload"] == "prefix" and result["prefixes"] == PREFIX_COUNT


def test_a_served_prefix_request_is_recorded_whole():
    workload = Workload("prefix", seed=5)

    async def go():
        async with fake_server() as (url, seen):
            load = Load(rate=50.0, num_requests=1)
            return await run_bench_async(url, "packed", workload, load, progress=False), seen

    result, seen = asyncio.run(go())
    spec = workload.requests(1.0, num_requests=1)[0]
    assert seen.bodies[0]["prompt"] == list(spec.prompt_token_ids)
    assert (result["requests"][0]["prefix_id"], result["requests"][0]["prefix_tokens"]) == \
        (spec.prefix_id, spec.prefix_tokens)


def test_other_workloads_write_no_prefix_fields(monkeypatch):
    monkeypatch.setattr(runner, "send_request", _instant)
    rows = asyncio.run(run_bench_async("http://h/v1", "m", Workload("chat"),
                                       Load(rate=50.0, num_requests=3), progress=False))["requests"]
    assert all("prefix_id" not in r and "prefix_tokens" not in r for r in rows)
