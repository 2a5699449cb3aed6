"""Circuit breakers in the dispatcher, with scripted legs and a hand-driven clock: failures in a
row open a worker's breaker (it gets no new request even while its health checks pass), after
the cool-down one probe goes through, its success closes the breaker and its failure opens it
again for twice as long."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.breaker import BreakerSettings, BreakerState
from pdserve.router.dispatch import Dispatcher, NoWorkers
from tests.router.scripted_model import ScriptedModel, reference
from tests.router.test_dispatch_migration import GREEDY, SHORT, collect, dispatcher

D0, D1 = "http://d0", "http://d1"
COOLDOWN_S = 10.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def breaker_dispatcher(model: ScriptedModel) -> tuple[Dispatcher, Clock]:
    d = dispatcher(model, breaker=BreakerSettings(failures_to_open=2, cooldown_s=COOLDOWN_S))
    clock = Clock()
    d.breakers.clock = clock
    return d, clock


def serve_one(d: Dispatcher, model: ScriptedModel) -> list[str]:
    """One request; the URLs its legs went to. Afterwards every worker answers its health
    check again (the pool's next round)."""
    before = len(model.opened)
    out, _ = asyncio.run(collect(d, SHORT, GREEDY))
    assert out.token_ids == reference(SHORT, 12)
    for w in d.pool.workers:
        w.healthy = True
    return [o.url for o in model.opened[before:]]


def state(d: Dispatcher, url: str) -> float:
    d.metrics.refresh()
    return d.metrics.breaker_state.value(worker=url, role="decode")


def test_failures_in_a_row_open_the_breaker_then_one_probe_closes_it() -> None:
    model = ScriptedModel(lose_after={D0: 0})  # d0 fails every leg before a token
    d, clock = breaker_dispatcher(model)
    assert serve_one(d, model) == [D0, D1]  # retried on d1
    assert state(d, D0) == BreakerState.CLOSED
    assert serve_one(d, model) == [D0, D1]
    assert state(d, D0) == BreakerState.OPEN
    # healthy again, but open: no new request goes there during the cool-down
    assert serve_one(d, model) == [D1]
    clock.now += COOLDOWN_S
    assert state(d, D0) == BreakerState.HALF_OPEN
    del model.lose_after[D0]  # it recovered: the probe succeeds
    assert serve_one(d, model) == [D0]
    assert state(d, D0) == BreakerState.CLOSED
    assert serve_one(d, model) == [D0]


def test_a_failed_probe_opens_the_breaker_again_for_twice_as_long() -> None:
    model = ScriptedModel(lose_after={D0: 0})
    d, clock = breaker_dispatcher(model)
    serve_one(d, model)
    serve_one(d, model)
    clock.now += COOLDOWN_S
    assert serve_one(d, model) == [D0, D1]  # the probe fails; the request moves on
    assert state(d, D0) == BreakerState.OPEN
    clock.now += COOLDOWN_S
    assert serve_one(d, model) == [D1]  # still cooling down: 2 x the cool-down now
    clock.now += COOLDOWN_S
    assert state(d, D0) == BreakerState.HALF_OPEN


def test_a_success_between_failures_keeps_the_breaker_closed() -> None:
    model = ScriptedModel(lose_after={D0: 0})
    d, _ = breaker_dispatcher(model)
    serve_one(d, model)
    del model.lose_after[D0]
    assert serve_one(d, model) == [D0]
    model.lose_after[D0] = 0
    serve_one(d, model)
    assert state(d, D0) == BreakerState.CLOSED  # one failure in a row, not two


def test_a_request_waits_while_every_worker_is_open_and_runs_after_the_cool_down() -> None:
    """Open breakers take the workers out of admission, not out of the cluster: the request
    queues (it is not refused as if no worker existed) and runs once a probe may go."""
    model = ScriptedModel(lose_after={D0: 0, D1: 0})
    d, clock = breaker_dispatcher(model)
    for _ in range(2):
        with pytest.raises(NoWorkers):  # both failed it
            asyncio.run(collect(d, SHORT, GREEDY))
        for w in d.pool.workers:
            w.healthy = True
    assert (state(d, D0), state(d, D1)) == (BreakerState.OPEN, BreakerState.OPEN)
    model.lose_after.clear()

    async def go() -> list[int]:
        task = asyncio.create_task(collect(d, SHORT, GREEDY))
        await asyncio.sleep(0.05)
        assert not task.done() and d.queues["decode"].depth == 1
        clock.now += COOLDOWN_S
        d.admit_waiting()  # the pool's next health round
        out, _ = await task
        return out.token_ids

    assert asyncio.run(go()) == reference(SHORT, 12)


@pytest.mark.parametrize("bad, message", [
    ({"failures_to_open": 0}, "failures_to_open must be an int >= 1"),
    ({"cooldown_s": 0}, "cooldown_s must be > 0 seconds"),
    ({"cooldown_s": 5, "max_cooldown_s": 1}, "must be at least cooldown_s"),
])
def test_breaker_settings_say_what_to_fix(bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BreakerSettings(**bad)
