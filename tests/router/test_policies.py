"""Worker choice: round robin, least loaded, prefix-aware over chained block hashes; the
router's per-worker prefix index (LRU, prefix match ends at the first miss)."""

from __future__ import annotations

import pytest

from pdserve.common.block_hash import hash_blocks
from pdserve.router.policies import (
    LeastLoaded,
    PolicyName,
    PrefixAware,
    RoundRobin,
    make_policy,
)
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.worker_pool import WorkerHandle

BLOCK = 4
PROMPT = list(range(100, 116))  # four full blocks
HASHES = hash_blocks(PROMPT, BLOCK)


def worker(name: str, inflight: int = 0, used: int = 0, total: int = 100) -> WorkerHandle:
    w = WorkerHandle(f"http://{name}:8000", "decode", healthy=True, inflight=inflight)
    w.info = {"kv_blocks_used": used, "kv_blocks_total": total}
    return w


# -- round robin and least loaded ----------------------------------------------------------------


def test_round_robin_cycles_in_candidate_order():
    ws = [worker("a"), worker("b"), worker("c")]
    rr = RoundRobin()
    picks = [rr.choose(ws, HASHES).url for _ in range(7)]
    assert picks == [ws[i % 3].url for i in range(7)]


def test_round_robin_ignores_load_and_prefix():
    busy, idle = worker("busy", inflight=9), worker("idle")
    busy.prefix.add(HASHES)
    rr = RoundRobin()
    assert [rr.choose([busy, idle], HASHES) for _ in range(2)] == [busy, idle]


def test_load_is_inflight_legs_plus_half_the_kv_usage():
    assert worker("a", inflight=2, used=25, total=100).load == 2.125
    assert WorkerHandle("http://x", "decode").load == 0  # no /health info yet


def test_least_loaded_picks_the_fewest_legs_in_flight():
    ws = [worker("a", inflight=2), worker("b", inflight=0, used=90), worker("c", inflight=1)]
    assert LeastLoaded().choose(ws, HASHES).url == "http://b:8000"


def test_least_loaded_breaks_ties_by_kv_usage_then_url():
    a, b, c = worker("a", used=50), worker("b", used=10), worker("c", used=10)
    assert LeastLoaded().choose([a, c, b], HASHES) is b
    assert LeastLoaded().choose([a, c], HASHES) is c


def test_a_full_kv_pool_weighs_less_than_one_more_leg():
    full, one_leg = worker("full", used=100), worker("leg", inflight=1)
    assert LeastLoaded().choose([one_leg, full], HASHES) is full


# -- prefix-aware ----------------------------------------------------------------------------------


def test_prefix_aware_prefers_the_longest_cached_prefix():
    a, b, c = worker("a"), worker("b"), worker("c")
    a.prefix.add(HASHES[:1])
    b.prefix.add(HASHES[:3])
    c.prefix.add(hash_blocks([7] * 16, BLOCK))  # another prompt entirely
    assert PrefixAware().choose([a, b, c], HASHES) is b
    # a longer prompt sharing the first three blocks still lands on b
    longer = hash_blocks([*PROMPT[:12], 1, 2, 3, 4, 5, 6, 7, 8], BLOCK)
    assert longer[:3] == HASHES[:3] and longer[3] != HASHES[3]
    assert PrefixAware().choose([a, b, c], longer) is b


def test_prefix_aware_falls_back_to_least_loaded_on_a_miss():
    a, b = worker("a", inflight=1), worker("b", used=30)
    a.prefix.add(hash_blocks([9] * 16, BLOCK))
    c = worker("c", used=10)
    assert PrefixAware().choose([a, b, c], HASHES) is c
    assert PrefixAware().choose([a, b, c], []) is c  # a prompt shorter than one block


def test_prefix_aware_spreads_past_blocks_per_leg():
    policy = PrefixAware(blocks_per_leg=2)
    cached, idle = worker("cached"), worker("idle")
    cached.prefix.add(HASHES[:3])  # worth 1.5 legs
    cached.inflight = 1
    assert policy.choose([idle, cached], HASHES) is cached
    cached.inflight = 2
    assert policy.choose([idle, cached], HASHES) is idle


def test_prefix_aware_does_not_record_what_it_routes():
    w = worker("a")
    PrefixAware().choose([w], HASHES)
    assert w.prefix.match(HASHES) == 0  # the dispatcher adds hashes, not the policy


# -- the prefix index ------------------------------------------------------------------------------


def test_match_counts_leading_blocks_and_stops_at_the_first_miss():
    index = PrefixIndex()
    index.add(HASHES[1:])
    assert index.match(HASHES) == 0  # the first block is missing: nothing is shared
    index.add(HASHES[:1])
    assert index.match(HASHES) == 4
    assert index.match([HASHES[0], 12345, HASHES[2]]) == 1
    assert index.match([]) == 0


def test_least_recently_added_hashes_are_evicted_first():
    index = PrefixIndex(capacity=3)
    index.add([1, 2, 3])
    index.add([1])  # refreshed: 2 is now the oldest
    index.add([4])
    assert [index.match([h]) for h in (1, 2, 3, 4)] == [1, 0, 1, 1]
    index.add([5, 6])  # order was 3, 1, 4: the two oldest go
    assert [index.match([h]) for h in (1, 3, 4, 5, 6)] == [0, 0, 1, 1, 1]


def test_matching_does_not_refresh_a_hash():
    index = PrefixIndex(capacity=2)
    index.add([1, 2])
    assert index.match([1]) == 1
    index.add([3])
    assert (index.match([1]), index.match([2, 3])) == (0, 2)


# -- make_policy -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "kind"), [("round_robin", RoundRobin),
                                            ("least_loaded", LeastLoaded),
                                            ("prefix", PrefixAware)])
def test_make_policy_by_name(name, kind):
    assert type(make_policy(name)) is kind
    assert PolicyName(name).value == name


def test_make_policy_unknown_name_lists_the_choices():
    with pytest.raises(ValueError) as info:
        make_policy("random")
    assert str(info.value) == ("unknown policy 'random'; use one of round_robin, least_loaded, "
                               "prefix")
