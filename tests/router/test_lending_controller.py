"""The elastic controller lends and reclaims cores in a real router over fake workers that
keep the `/internal/cpus` contract, ticked by hand on a clock of its own: a prefill pressure
that no flip relieves (one prefill and one decode worker of one machine) lends the prefill
worker's cores to the decode worker, once; when no prompt has arrived for longer than the
arrival window, the cores come back after the sustain window. Across machines nothing is
lent."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pdserve.router.elastic_controller import ElasticController
from pdserve.router.elastic_lending import LendPlan, ReclaimPlan
from pdserve.router.elastic_settings import ElasticSettings
from pdserve.router.worker_pool import LENT
from tests.router.test_core_lending import Cluster, PinningWorker, pair, run

SETTINGS = ElasticSettings(ttft_target_s=1.0, tpot_target_s=0.1, interval_s=1.0,
                           sustain_ticks=3, cooldown_s=30.0)
RATES = {"prefill_tokens_per_s": 1000.0, "decode_step_s": 0.005}
PROMPTS, PROMPT_TOKENS = 8, 1500


class Ticks:
    """A controller on the router's pools with a clock that moves only when told."""

    def __init__(self, c: Cluster) -> None:
        self.now = 1000.0
        r = c.r
        self.ctl = ElasticController(r.pool, r.dispatcher.queues, r.dispatcher.paths.backlog,
                                     r.admin.flips, r.admin.lending, SETTINGS,
                                     clock=lambda: self.now)
        self.ctl.arrivals.sample(self.now, r.dispatcher.paths.backlog.sent())

    async def tick(self, after_s: float = 1.0) -> object:
        self.now += after_s
        return await self.ctl.tick()


def rated(fakes: dict[str, PinningWorker]) -> dict[str, PinningWorker]:
    for fake in fakes.values():
        fake.info["rates"] = RATES
    return fakes


async def press(c: Cluster) -> list[Callable[[], None]]:
    """8 prompts of 1,500 tokens sent to the prefill worker and not prefilled (12 s of work
    at 1,000 tokens/s), a stream on the decode worker; the prefill ends, to call."""
    c.w("dec").inflight = 1
    return [c.r.dispatcher.paths.prefilling(c.w("pre"), PROMPT_TOKENS)
            for _ in range(PROMPTS)]


def test_a_pressure_no_flip_relieves_lends_the_cores_and_calm_takes_them_back(
        tiny_model: Callable[..., Path]) -> None:
    fakes = rated(pair())

    async def body(c: Cluster) -> None:
        ticks = Ticks(c)
        ends = await press(c)
        plans = [await ticks.tick() for _ in range(SETTINGS.sustain_ticks)]
        assert plans[:-1] == [None] * (SETTINGS.sustain_ticks - 1)
        assert isinstance(plans[-1], LendPlan) and (plans[-1].worker, plans[-1].to) == (
            "pre", "dec")
        assert fakes["dec"].pins == [[0, 1]] and c.w("pre").phase == LENT
        assert c.r.admin.lending.lent_to(c.w("pre")) == "dec"
        for _ in range(5):  # the pressure stays, but nothing is left to lend or flip
            assert await ticks.tick() is None
        for end in ends:
            end()
        c.w("dec").inflight = 0
        await ticks.tick(after_s=120.0)  # the arrival window forgets the prompts (a minute)
        plans = [await ticks.tick() for _ in range(SETTINGS.sustain_ticks - 1)]
        assert plans[:-1] == [None] * (SETTINGS.sustain_ticks - 2)
        assert isinstance(plans[-1], ReclaimPlan) and plans[-1].worker == "pre"
        assert "busy 0% of the time" in plans[-1].reason
        assert fakes["dec"].pins == [[0, 1], [1]]
        assert c.w("pre").phase is None and c.w("pre").routable
        assert c.r.admin.lending.loans == {}

    run(tiny_model, fakes, body)


def test_no_loan_across_machines(tiny_model: Callable[..., Path]) -> None:
    fakes = rated({"pre": PinningWorker("prefill", [0]),
                   "dec": PinningWorker("decode", [1], host="node-2/boot-b")})

    async def body(c: Cluster) -> None:
        ticks = Ticks(c)
        await press(c)
        for _ in range(SETTINGS.sustain_ticks + 3):
            assert await ticks.tick() is None
        assert fakes["dec"].pins == [] and c.w("pre").routable

    run(tiny_model, fakes, body)


def test_an_idle_prefill_worker_lends_its_cores_to_the_streaming_decode_worker(
        tiny_model: Callable[..., Path]) -> None:
    """No prompt arrives while the decode worker streams four requests: the prefill worker's
    cores go to the decode worker (not a flip to decode); they stay lent while it streams, and
    come back once it streams one."""
    fakes = rated(pair())

    async def body(c: Cluster) -> None:
        ticks = Ticks(c)
        c.w("dec").inflight = 4
        plans = [await ticks.tick() for _ in range(SETTINGS.sustain_ticks)]
        assert isinstance(plans[-1], LendPlan) and (plans[-1].worker, plans[-1].to) == (
            "pre", "dec")
        assert "instead of a second decode engine" in plans[-1].reason
        assert fakes["pre"].flips == 0 and fakes["dec"].pins == [[0, 1]]
        ticks.now += SETTINGS.cooldown_s
        for _ in range(2 * SETTINGS.sustain_ticks):  # calm prompts, busy streams: kept
            assert await ticks.tick() is None
        c.w("dec").inflight = 1
        plans = [await ticks.tick() for _ in range(SETTINGS.sustain_ticks)]
        assert isinstance(plans[-1], ReclaimPlan) and plans[-1].worker == "pre"
        assert fakes["dec"].pins == [[0, 1], [1]] and c.w("pre").routable

    run(tiny_model, fakes, body)
