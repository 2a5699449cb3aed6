"""The elastic controller lends and reclaims cores in a real router over fake workers that
keep the `/internal/cpus` contract, ticked by hand on a clock of its own: a pair of one machine
that no prompt has reached is merged at the first tick (the prefill worker's cores lent to the
decode worker); a prefill pressure that no flip relieves lends them too, once; the cores come
back only once a measured stream of short prompts (MIN_PROMPTS in the window) would leave the
prefill worker alone deep in the calm band, for the sustain window, and never at rest. Across
machines nothing is lent."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pdserve.router.elastic import BUSY_STREAMS
from pdserve.router.elastic_controller import ElasticController
from pdserve.router.elastic_lending import LendPlan, ReclaimPlan
from pdserve.router.elastic_settings import ElasticSettings
from pdserve.router.elastic_window import MIN_PROMPTS
from pdserve.router.worker_pool import LENT
from tests.router.test_core_lending import Cluster, PinningWorker, pair, run

SETTINGS = ElasticSettings(ttft_target_s=1.0, tpot_target_s=0.1, interval_s=1.0,
                           sustain_ticks=3, cooldown_s=30.0)
RATES = {"prefill_tokens_per_s": 1000.0, "decode_step_s": 0.005}
PROMPTS, PROMPT_TOKENS = 8, 1500
SHORT_TOKENS = 100


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
        for _ in range(2 * SETTINGS.sustain_ticks):  # at rest the loan stands
            assert await ticks.tick() is None
        await reclaimed_after_short_prompts(c, ticks, fakes)

    run(tiny_model, fakes, body)


async def short_prompts(c: Cluster, worker: str, n: int) -> None:
    """`n` prompts of SHORT_TOKENS sent to `worker` to prefill, and prefilled."""
    for _ in range(n):
        c.r.dispatcher.paths.prefilling(c.w(worker), SHORT_TOKENS)()


async def reclaimed_after_short_prompts(c: Cluster, ticks: Ticks,
                                        fakes: dict[str, PinningWorker]) -> None:
    """MIN_PROMPTS short prompts prefilled on the borrower, which streams one request: the
    cores come back after the sustain window, the borrower pinned back first."""
    c.w("dec").inflight = 1
    await short_prompts(c, "dec", MIN_PROMPTS)
    plans = [await ticks.tick() for _ in range(SETTINGS.sustain_ticks)]
    assert plans[:-1] == [None] * (SETTINGS.sustain_ticks - 1)
    assert isinstance(plans[-1], ReclaimPlan) and plans[-1].worker == "pre"
    # 800 tokens in the 3 s window at the lender's 1,000 tokens/s
    assert "would be busy 27% of the time" in plans[-1].reason
    assert fakes["dec"].pins[-1] == [1]
    assert c.w("pre").phase is None and c.w("pre").routable
    assert c.r.admin.lending.loans == {}


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


def test_a_pair_at_rest_is_merged_at_the_first_tick(tiny_model: Callable[..., Path]) -> None:
    """No prompt yet: the prefill worker's cores go to the decode worker at once; they stay
    lent while nothing arrives and while the decode worker streams BUSY_STREAMS requests
    beside calm prompts, and come back once it streams one."""
    fakes = rated(pair())

    async def body(c: Cluster) -> None:
        ticks = Ticks(c)
        plan = await ticks.tick()
        assert isinstance(plan, LendPlan) and (plan.worker, plan.to) == ("pre", "dec")
        assert plan.reason.startswith("no prompt arrived in the last 1 s: dec computes")
        assert fakes["pre"].flips == 0 and fakes["dec"].pins == [[0, 1]]
        ticks.now += SETTINGS.cooldown_s
        for _ in range(2 * SETTINGS.sustain_ticks):
            assert await ticks.tick() is None
        c.w("dec").inflight = BUSY_STREAMS
        await short_prompts(c, "dec", MIN_PROMPTS)
        for _ in range(2 * SETTINGS.sustain_ticks):
            assert await ticks.tick() is None
        await reclaimed_after_short_prompts(c, ticks, fakes)

    run(tiny_model, fakes, body)


def test_an_idle_prefill_worker_lends_its_cores_to_the_streaming_decode_worker(
        tiny_model: Callable[..., Path]) -> None:
    """Short prompts reach the prefill worker (4% busy) while the decode worker streams four
    requests: its cores go to the decode worker (not a flip to decode)."""
    fakes = rated(pair())

    async def body(c: Cluster) -> None:
        ticks = Ticks(c)
        c.w("dec").inflight = 4
        await short_prompts(c, "pre", 4)
        plans = [await ticks.tick() for _ in range(SETTINGS.sustain_ticks)]
        assert plans[:-1] == [None] * (SETTINGS.sustain_ticks - 1)
        assert isinstance(plans[-1], LendPlan) and (plans[-1].worker, plans[-1].to) == (
            "pre", "dec")
        assert "instead of a second decode engine" in plans[-1].reason
        assert fakes["pre"].flips == 0 and fakes["dec"].pins == [[0, 1]]

    run(tiny_model, fakes, body)
