"""The dispatcher's fallback chain with scripted legs (`scripted_model.py`): a stream whose
worker dies after tokens reached the client goes on elsewhere as a continuation (the prompt plus
those tokens, `max_tokens` reduced, sampling from the same output positions) and the client
sees one seamless stream; the client's own errors are never retried; a request moves at most
`max_migrations` times; a prefill leg that fails before either leg spoke goes to another
prefill worker, else the decode worker prefills itself."""

from __future__ import annotations

import asyncio
import json

import pytest

from pdserve.api.assembler import StreamAssembler
from pdserve.common.sampling_params import SamplingParams
from pdserve.internal_auth import InternalAuth
from pdserve.legs.protocol import LegKind, LegRequest, TokenEvent
from pdserve.router.admission_settings import AdmissionSettings
from pdserve.router.dispatch import Dispatcher, DispatchSettings
from pdserve.router.leg_client import LegFailed
from pdserve.router.migration import Diverged
from pdserve.router.policies import LeastLoaded
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.worker_pool import WorkerPool
from pdserve.transfer.peer import PeerId
from tests.router.fake_worker import NAME, SECRET, worker_info
from tests.router.scripted_model import ScriptedModel, reference, text_of

SHORT = [5, 6, 7]  # under the threshold: one local leg
LONG = list(range(1, 41))  # over it: split
GREEDY = SamplingParams(max_tokens=12, temperature=0)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)


def dispatcher(model: ScriptedModel, decode: int = 2, prefill: int = 1,
               **settings: object) -> Dispatcher:
    pool = WorkerPool({"prefill": [f"http://p{i}" for i in range(prefill)],
                       "decode": [f"http://d{i}" for i in range(decode)]},
                      InternalAuth(SECRET), NAME)
    for port, w in enumerate(pool.workers, 9001):
        w.healthy, w.info, w.peer = True, worker_info(w.role), PeerId(port, "127.0.0.1", port)
    dispatch = DispatchSettings(local_prefill_threshold=4, retry_backoff_s=0.001, **settings)
    metrics = RouterMetrics()
    metrics.bind_pool(pool)
    return Dispatcher(pool, LeastLoaded(), dispatch, model, metrics,
                      AdmissionSettings(max_inflight_per_worker=4, max_queue=4,
                                        max_queue_wait_s=0.5))  # for a worker to come back


async def collect(d: Dispatcher, prompt: list[int], params: SamplingParams
                  ) -> tuple[StreamAssembler, list[TokenEvent]]:
    """The client's view: the stream assembled as the OpenAI server assembles it."""
    out, events = StreamAssembler(), []
    async with asyncio.timeout(5):
        async for batch in d.generate("cmpl-1", prompt, params):
            for event in batch:
                assert event.error is None
                out.add(event)
                events.append(event)
    return out, events


def expected_text(tokens: list[int]) -> str:
    return "".join(text_of(t) for t in tokens)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_local_leg_lost_after_5_tokens_continues_on_another_worker(params) -> None:
    model = ScriptedModel(lose_after={"http://d0": 5})
    d = dispatcher(model)
    out, events = asyncio.run(collect(d, SHORT, params))
    want = reference(SHORT, 12, params.seed)
    assert out.token_ids == want and out.text == expected_text(want)
    assert out.finish_reason == "length" and events[-1].final
    # one stream: every event starts where the one before ended
    assert [e.index for e in events] == list(range(12))
    assert [e.text_offset for e in events] == [len(expected_text(want[:i])) for i in range(12)]
    (first,), (cont,) = model.legs("http://d0"), model.legs("http://d1")
    assert cont.prompt_token_ids == (*SHORT, *want[:5])
    assert (cont.params.max_tokens, cont.output_offset, cont.kind) == (7, 5, LegKind.LOCAL)
    assert cont.params.seed == first.params.seed and cont.request_id == "cmpl-1.2"
    assert d.metrics.migrations.value(reason="local leg failed") == 1
    assert not worker_of(d, "http://d0").healthy
    assert all(d.queues["decode"].held(w) == 0 for w in d.pool.workers)


def test_a_decode_leg_lost_after_5_tokens_continues_as_a_local_leg() -> None:
    model = ScriptedModel(lose_after={"http://d0": 5})
    d = dispatcher(model)
    out, _ = asyncio.run(collect(d, LONG, GREEDY))
    want = reference(LONG, 12)
    assert out.token_ids == want and out.text == expected_text(want)
    assert [(url, kind) for url, kind, _ in model.kinds()] == [
        ("http://p0", LegKind.PREFILL), ("http://d0", LegKind.DECODE),
        ("http://d1", LegKind.LOCAL)]
    (cont,) = model.legs("http://d1")
    assert (cont.prompt_token_ids, cont.output_offset) == ((*LONG, *want[:5]), 5)
    assert d.metrics.migrations.value(reason="decode leg failed") == 1


def test_text_held_back_at_the_failure_is_resent_once_from_the_last_complete_text() -> None:
    """Position 5's text waits for position 6 (an incomplete UTF-8 character), and the worker
    dies after sending token 5: the continuation starts at 5, repeats it (the client drops the
    repeat) and the client's text is whole."""
    model = ScriptedModel(lose_after={"http://d0": 6}, hold_back={"http://d0": {5}})
    d = dispatcher(model)
    out, _ = asyncio.run(collect(d, SHORT, GREEDY))
    want = reference(SHORT, 12)
    assert out.token_ids == want and out.text == expected_text(want)
    (cont,) = model.legs("http://d1")
    assert (cont.output_offset, cont.params.max_tokens) == (5, 7)


def test_a_continuation_that_repeats_a_different_token_ends_the_stream() -> None:
    model = ScriptedModel(lose_after={"http://d0": 6}, hold_back={"http://d0": {5}},
                          skew={"http://d1": 1})
    d = dispatcher(model)
    with pytest.raises(Diverged, match="at position 5"):
        asyncio.run(collect(d, SHORT, GREEDY))


def test_a_stop_string_across_the_move_ends_the_stream_there() -> None:
    want = reference(SHORT, 12)
    stop = f"><{want[5]}"  # starts in the text the client has, ends in the continuation's
    model = ScriptedModel(lose_after={"http://d0": 5})
    d = dispatcher(model)
    params = SamplingParams(max_tokens=12, temperature=0, stop=[stop])
    out, events = asyncio.run(collect(d, SHORT, params))
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == want[:6]
    assert out.text == expected_text(want[:5])  # cut where the stop string starts
    assert events[-1].final


def test_a_refused_request_is_the_clients_fault_and_never_moves() -> None:
    """A 4xx refusal fails the request as it is, and counts against no worker: refused as
    often as would open a breaker, the worker stays healthy with its breaker closed."""
    model = ScriptedModel(refuse={"http://d0": 400})
    d = dispatcher(model)
    for _ in range(d.settings.breaker.failures_to_open):
        with pytest.raises(LegFailed) as refused:
            asyncio.run(collect(d, SHORT, GREEDY))
        assert refused.value.status == 400
    assert {url for url, _, _ in model.kinds()} == {"http://d0"}
    assert worker_of(d, "http://d0").healthy
    d.metrics.refresh()
    assert d.metrics.breaker_state.value(worker="http://d0", role="decode") == 0
    assert d.metrics.migrations.value(reason="local leg failed") == 0


def test_a_request_moves_at_most_max_migrations_times_then_fails() -> None:
    model = ScriptedModel(lose_after={f"http://d{i}": 2 for i in range(4)})
    d = dispatcher(model, decode=4, max_migrations=2)
    got: list[TokenEvent] = []

    async def go() -> None:
        async for batch in d.generate("cmpl-1", SHORT, GREEDY):
            got.extend(batch)

    with pytest.raises(LegFailed, match="already moved 2 times"):
        asyncio.run(go())
    assert [url for url, _, _ in model.kinds()] == ["http://d0", "http://d1", "http://d2"]
    assert [e.index for e in got] == list(range(6))  # 2 tokens from each worker
    assert d.metrics.migrations.value(reason="local leg failed") == 2
    assert worker_of(d, "http://d3").healthy and all(d.queues["decode"].held(w) == 0
                                                     for w in d.pool.workers)


def test_no_worker_left_to_continue_on_ends_the_stream_with_the_failure() -> None:
    model = ScriptedModel(lose_after={"http://d0": 3})
    d = dispatcher(model, decode=1)
    with pytest.raises(LegFailed, match="no other healthy worker to continue on"):
        asyncio.run(collect(d, SHORT, GREEDY))


def test_a_prefill_leg_lost_at_connect_goes_to_another_prefill_worker() -> None:
    model = ScriptedModel(lost_at_connect={"http://p0"})
    d = dispatcher(model, prefill=2)
    out, _ = asyncio.run(collect(d, LONG, GREEDY))
    assert out.token_ids == reference(LONG, 12)
    assert model.kinds() == [
        ("http://p0", LegKind.PREFILL, "cmpl-1"), ("http://d0", LegKind.DECODE, "cmpl-1"),
        ("http://p1", LegKind.PREFILL, "cmpl-1.2"), ("http://d0", LegKind.DECODE, "cmpl-1.2")]
    assert "cmpl-1" in model.closed_early  # the first decode leg's reservation is given up
    assert d.metrics.retries.value(reason="prefill leg failed, another prefill worker") == 1
    assert all(d.queues["prefill"].held(w) == 0 for w in d.pool.workers)


def test_with_no_other_prefill_worker_the_decode_worker_prefills_itself() -> None:
    model = ScriptedModel(lost_at_connect={"http://p0"})
    d = dispatcher(model, prefill=1)
    out, _ = asyncio.run(collect(d, LONG, GREEDY))
    assert out.token_ids == reference(LONG, 12)
    assert model.kinds()[2:] == [("http://d0", LegKind.LOCAL, "cmpl-1.2")]
    assert d.metrics.retries.value(reason="prefill leg failed, local prefill") == 1
    assert not worker_of(d, "http://p0").healthy


def test_the_wait_at_the_router_travels_in_the_leg_protocol_and_is_checked() -> None:
    """What a worker's TTFT check counts a prompt's wait from (`LegRequest.waited_s`)."""
    leg = LegRequest("r", (1, 2, 3), GREEDY, waited_s=1.25)
    assert LegRequest.from_json(json.loads(json.dumps(leg.to_json()))) == leg
    old = {k: v for k, v in leg.to_json().items() if k != "waited_s"}  # an older router's
    assert LegRequest.from_json(old).waited_s == 0.0
    for bad in (-0.5, float("nan"), float("inf"), True, "1"):
        with pytest.raises(ValueError, match="waited_s must be a finite number of seconds"):
            LegRequest("r", (1,), GREEDY, waited_s=bad)


def test_output_offset_travels_in_the_leg_protocol_and_is_checked() -> None:
    leg = LegRequest("r", (1, 2, 3, 4), GREEDY, output_offset=2)
    assert LegRequest.from_json(json.loads(json.dumps(leg.to_json()))) == leg
    assert LegRequest.from_json({**LegRequest("r", (1,), GREEDY).to_json(),
                                 "output_offset": 0}).output_offset == 0
    for bad in (-1, 4, True, 1.0):
        with pytest.raises(ValueError, match="output_offset must be an int in"):
            LegRequest("r", (1, 2, 3, 4), GREEDY, output_offset=bad)
    split = LegRequest("r", (1, 2), GREEDY, LegKind.DECODE, 7, PeerId(1, "127.0.0.1", 9),
                       output_offset=1)  # a split continuation's
    assert LegRequest.from_json(json.loads(json.dumps(split.to_json()))) == split


def worker_of(d: Dispatcher, url: str):
    return next(w for w in d.pool.workers if w.url == url)
