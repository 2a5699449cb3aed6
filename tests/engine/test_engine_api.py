"""The engine calls a worker makes instead of reading the scheduler and block manager: the load
snapshot, whether a step would compute, reserving blocks freed outside a step, block
generations."""

from __future__ import annotations

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.outputs import EngineLoad
from tests.conftest import engine_pair

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
LONG = list(range(10, 160))  # 150 tokens: 10 of the decode pool's 16 blocks


def test_load_counts_every_queue_and_the_pool(tiny_model) -> None:
    _, dec = engine_pair(tiny_model(), decode_blocks=16)
    dec.add_remote_request(LONG, PARAMS, request_id="r0")  # reserved: 10 blocks
    dec.add_remote_request(LONG, PARAMS, request_id="r1")  # queued: 6 blocks free
    dec.add_request(list(range(3, 20)), PARAMS, request_id="l")  # 17 tokens
    assert dec.load() == EngineLoad(running=0, waiting=1, waiting_for_kv=2,
                                    kv_blocks_used=10, kv_blocks_total=16)
    dec.step()
    load = dec.load()
    assert load == EngineLoad(running=1, waiting=0, waiting_for_kv=2, kv_blocks_used=12,
                              kv_blocks_total=16)
    assert load.kv_usage == 12 / 16


def test_only_requests_waiting_for_kv_leave_no_compute_work(tiny_model) -> None:
    _, dec = engine_pair(tiny_model(), decode_blocks=16)
    dec.add_remote_request(LONG, PARAMS, request_id="r0")
    assert not dec.has_compute_work()
    dec.add_request(list(range(3, 20)), PARAMS, request_id="l")
    assert dec.has_compute_work()
    dec.abort("l")  # its abort output is pending: the engine has steps, not compute
    assert dec.has_unfinished_requests() and not dec.has_compute_work()


def test_reserve_remote_takes_blocks_freed_outside_a_step(tiny_model) -> None:
    _, dec = engine_pair(tiny_model(), decode_blocks=16)
    dec.add_remote_request(LONG, PARAMS, request_id="r0")
    first = dec.reserved_blocks("r0")
    generations = [dec.block_generation(b) for b in first]
    dec.add_remote_request(LONG, PARAMS, request_id="r1")
    assert dec.reserved_blocks("r1") is None
    dec.abort("r0")
    assert dec.reserved_blocks("r1") is None  # nothing reserves by itself
    dec.reserve_remote()
    second = dec.reserved_blocks("r1")
    assert second is not None and len(second) == 10
    assert dec.load().kv_blocks_used == 10
    reused = [b for b in first if b in second]
    assert reused and all(dec.block_generation(b) == generations[first.index(b)] + 1
                          for b in reused)
