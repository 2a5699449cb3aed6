"""The worker's engine thread driven directly: local legs stream to the end, a cancel frees
the blocks, and a failing step ends every leg with an error instead of hanging it."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.legs.protocol import LegRequest, TokenEvent
from pdserve.workers.engine_loop import Accepted, EngineLoop, LegRefused
from pdserve.workers.worker_metrics import WorkerMetrics
from tests.conftest import KV_BLOCKS

PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture
def engine(tiny_model) -> Engine:
    return Engine(EngineConfig(model=str(tiny_model()), dtype="float32", max_model_len=256,
                               num_kv_blocks=KV_BLOCKS))


async def _events(sink: asyncio.Queue, timeout: float = 30.0) -> list:
    items = []
    while True:
        item = await asyncio.wait_for(sink.get(), timeout)
        items.append(item)
        if isinstance(item, TokenEvent) and item.final:
            return items


async def _no_legs_left(loop: EngineLoop) -> None:
    for _ in range(200):
        await asyncio.sleep(0.01)
        if not loop.num_legs:
            break
    assert not loop.num_legs


def _run(engine: Engine, scenario) -> None:
    async def main() -> None:
        loop = EngineLoop(engine, None, WorkerMetrics("collocated"))
        loop.start(asyncio.get_running_loop())
        try:
            await scenario(loop)
        finally:
            loop.stop()

    asyncio.run(main())


def test_local_legs_stream_every_token_then_end(engine: Engine) -> None:
    async def scenario(loop: EngineLoop) -> None:
        sinks = [loop.submit(LegRequest(f"r{i}", tuple(range(3, 13 + i)), PARAMS))
                 for i in range(3)]
        for sink in sinks:
            items = await _events(sink)
            assert isinstance(items[0], Accepted)
            tokens = [t for e in items[1:] for t in e.token_ids]
            assert len(tokens) == 40 and items[-1].finish_reason == "length"

    _run(engine, scenario)
    assert engine.block_manager.num_used_blocks == 0


def test_a_failing_step_ends_every_leg_with_an_error_and_frees_blocks(engine: Engine,
                                                                      monkeypatch) -> None:
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)

    async def scenario(loop: EngineLoop) -> None:
        sinks = [loop.submit(LegRequest(f"r{i}", tuple(range(3, 20)), PARAMS))
                 for i in range(2)]
        for sink in sinks:
            items = await _events(sink)
            assert items[-1].error == "internal error in the engine loop"
        assert not loop.num_legs

    _run(engine, scenario)
    engine.step()  # drain the abort outputs
    assert engine.block_manager.num_used_blocks == 0


def test_cancel_frees_the_blocks_of_a_running_leg(engine: Engine) -> None:
    async def scenario(loop: EngineLoop) -> None:
        sink = loop.submit(LegRequest("r", tuple(range(3, 40)), SamplingParams(
            max_tokens=200, temperature=0, ignore_eos=True)))
        assert isinstance(await sink.get(), Accepted)
        await sink.get()  # a first token: the leg runs
        loop.cancel("r")
        await _no_legs_left(loop)

    _run(engine, scenario)
    assert engine.block_manager.num_used_blocks == 0


def test_events_refuses_a_duplicate_and_closing_early_cancels_the_leg(engine: Engine) -> None:
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def scenario(loop: EngineLoop) -> None:
        sink = loop.submit(LegRequest("r", tuple(range(3, 40)), long))
        events = loop.events("r", sink)
        first = await anext(events)  # accepted, and a first token: the leg runs
        assert first[0].token_ids and loop.num_legs == 1
        twin = loop.submit(LegRequest("r", (5, 6, 7), long))
        with pytest.raises(LegRefused, match="already running"):
            await anext(loop.events("r", twin))
        await events.aclose()  # the consumer went away before the final event
        await _no_legs_left(loop)

    _run(engine, scenario)
    assert engine.block_manager.num_used_blocks == 0


def test_a_consumer_gone_before_the_acceptance_cancels_the_leg(engine: Engine) -> None:
    """The acceptance rides with the first step's events, so a client can leave while its
    handler still waits for it (a long prompt's prefill): the leg must not run on."""
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    aborted: list[str] = []
    real_abort = engine.abort

    def abort(request_id: str) -> None:
        aborted.append(request_id)
        real_abort(request_id)

    engine.abort = abort

    async def drain(events) -> None:
        async for _ in events:
            pass

    async def scenario(loop: EngineLoop) -> None:
        sink = loop.submit(LegRequest("r", tuple(range(3, 40)), long))
        task = asyncio.create_task(drain(loop.events("r", sink)))
        await asyncio.sleep(0)  # the consumer now waits for the acceptance
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _no_legs_left(loop)

    _run(engine, scenario)
    assert aborted == ["r"]
    engine.step()  # drain the abort's output
    assert engine.block_manager.num_used_blocks == 0


def test_a_legs_latency_counts_from_its_submission(engine: Engine) -> None:
    """A leg that arrives while a step runs waits for the engine thread to take it: that wait
    is the client's, so TTFT and e2e count from the submission, not from the take."""
    async def main() -> None:
        metrics = WorkerMetrics("collocated")
        loop = EngineLoop(engine, None, metrics)
        sink = loop.submit(LegRequest("r0", tuple(range(3, 13)), PARAMS))
        await asyncio.sleep(0.3)  # the engine thread is not running yet
        loop.start(asyncio.get_running_loop())
        try:
            await _events(sink)
        finally:
            loop.stop()
        for histogram in (metrics.ttft, metrics.e2e):
            text = "\n".join(histogram.render())
            total = float(next(line.split()[1] for line in text.splitlines()
                               if line.startswith(f"{histogram.name}_sum")))
            assert total >= 0.3, text

    asyncio.run(main())
