"""Engine steps as the worker records them: the engine's StepStats and the trace ring carry each
step's summed decode context (prompt + output so far, the new token included), which
planner/simulate/step_fit.py fits."""

from __future__ import annotations

import asyncio

from pdserve.common.sampling_params import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import StepStats
from pdserve.legs.protocol import LegRequest, TokenEvent
from pdserve.workers.engine_loop import EngineLoop
from pdserve.workers.step_trace import Step, StepTrace
from pdserve.workers.worker_metrics import WorkerMetrics
from tests.conftest import KV_BLOCKS

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _engine(tiny_model) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model()), dtype="float32", max_model_len=256,
                               num_kv_blocks=KV_BLOCKS))


def test_step_stats_sum_the_context_of_the_decode_requests(tiny_model) -> None:
    engine = _engine(tiny_model)
    engine.add_request(list(range(3, 13)), PARAMS)  # 10 prompt tokens
    engine.add_request(list(range(100, 113)), PARAMS)  # 13
    batches = []
    while engine.has_unfinished_requests():
        engine.step()
        batches.append(engine.take_step_stats())
    # token 0 from the prefill (causal pairs n (n + 1) / 2 each); token k (k >= 1) attends to
    # prompt + k tokens
    assert batches == [StepStats(23, 0, 2, 0, 55 + 91), StepStats(0, 2, 2, 11 + 14),
                       StepStats(0, 2, 2, 12 + 15), StepStats(0, 2, 2, 13 + 16)]


def test_a_prompt_beside_decodes_adds_no_context(tiny_model) -> None:
    engine = _engine(tiny_model)
    engine.add_request(list(range(3, 13)), PARAMS)
    engine.step()  # its prefill
    engine.add_request(list(range(100, 120)), PARAMS)  # 20 new prompt tokens, beside a decode
    engine.step()
    assert engine.take_step_stats() == StepStats(20, 1, 2, 11, 210)


def test_prefill_attention_counts_the_cached_prefix_and_earlier_chunks(tiny_model) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model()), dtype="float32", max_model_len=256,
                                 num_kv_blocks=KV_BLOCKS, enable_chunked_prefill=True,
                                 max_num_batched_tokens=32))
    engine.add_request(list(range(3, 53)), PARAMS)  # 50 prompt tokens in chunks of 32
    engine.step()
    assert engine.take_step_stats() == StepStats(32, 0, 1, 0, 32 * 33 // 2)
    engine.step()  # the other 18 attend to the first 32 and causally to each other
    assert engine.take_step_stats() == StepStats(18, 0, 1, 0, 18 * 32 + 18 * 19 // 2)


def test_step_stats_are_taken_once_and_only_for_steps_that_ran_a_batch(tiny_model) -> None:
    engine = _engine(tiny_model)
    assert engine.take_step_stats() is None
    engine.add_request(list(range(3, 13)), PARAMS, request_id="r")
    engine.step()
    assert engine.take_step_stats() == StepStats(10, 0, 1, 0, 55)
    assert engine.take_step_stats() is None
    engine.abort("r")
    assert [o.request_id for o in engine.step()] == ["r"]  # the abort's output, no batch
    assert engine.take_step_stats() is None


def test_the_worker_trace_records_the_context_of_every_step(tiny_model) -> None:
    engine = _engine(tiny_model)

    async def main() -> list[Step]:
        loop = EngineLoop(engine, None, WorkerMetrics("collocated"))
        loop.start(asyncio.get_running_loop())
        try:
            sink = loop.submit(LegRequest("r", tuple(range(3, 13)), PARAMS))
            while not (isinstance(item := await asyncio.wait_for(sink.get(), 30), TokenEvent)
                       and item.final):
                pass
            return loop.trace.since(0)
        finally:
            loop.stop()

    steps = asyncio.run(main())
    assert Step._fields[-2:] == ("decode_context", "prefill_attention")
    assert [s[2:] for s in steps] == [(10, 0, 1, 0, 55), (0, 1, 1, 11, 0), (0, 1, 1, 12, 0),
                                      (0, 1, 1, 13, 0)]
    assert all(s.start <= s.end for s in steps)


def test_the_ring_keeps_the_newest_steps() -> None:
    trace = StepTrace(capacity=2)
    for i in range(3):
        trace.record(Step(float(i), i + 0.5, 0, 1, 1, 7, 0))
    assert [s.start for s in trace.since(0.6)] == [1.0, 2.0]
