"""The elastic loan rules (`router/elastic_lending.py`) on hand-built observations: a prefill
pressure that no flip relieves lends the last prefill worker's cores to a decode worker of its
machine (never across machines, never to a decode worker without room for paced chunks, never
one of several prefill workers); where the flip rules would take the last prefill worker to
decode for the decode step or an idle prefill side, its cores go to a decode worker of its
machine instead (not when the pressure is for slots or KV, which a loan does not add); a lent
worker is reclaimed only once the prompts arriving would leave it, alone, deep in the calm
band, and the borrower needs its cores no more, for `sustain_ticks` in a row, judged from a
measured rate (MIN_PROMPTS in the window; a lender that never prefilled priced at its cores'
share of its borrower's rate). A pair of one machine at rest (no prompt in the window, the
prefill worker's cores its own) merges at once."""

from __future__ import annotations

import dataclasses

from pdserve.router.elastic import FlipPlan, Hold, Memory, Observation
from pdserve.router.elastic_lending import (
    LendPlan,
    LoanMemory,
    ReclaimPlan,
    choose,
    tally_loans,
)
from pdserve.router.worker_pool import LENT
from tests.router.test_elastic import S, dec, obs, pre

HOST = "box/boot-1"


def pressed(prefill_host: str = HOST, decode_host: str = HOST, step: float = 0.01,
            **decode: object) -> Observation:
    """2,000 tokens waiting at the one prefill worker (a 2 s wait at 1,000 tokens/s, 80% busy
    over the window), one decode worker with three streams."""
    return obs(100.0, pre("p1", backlog=2000, host=prefill_host, cpus=(0,)),
               dec("d1", inflight=3, step=step, host=decode_host, cpus=(1,), **decode))


def held(observation: Observation) -> Memory:
    """Prefill pressure seen for the sustain window."""
    return Memory(prefill_ticks=S.sustain_ticks)


def test_prefill_pressure_no_flip_relieves_lends_the_prefill_cores_to_the_decode_worker() -> None:
    o = pressed()
    plan = choose(o, held(o), LoanMemory(), S)
    assert isinstance(plan, LendPlan)
    assert (plan.worker, plan.to) == ("p1", "d1")
    assert "d1 is the last decode-capable worker" in plan.reason


def test_no_loan_across_machines_or_without_room_or_host() -> None:
    cases = {
        "no decode worker on p1's machine": pressed(decode_host="other/boot-2"),
        "p1 reports no host and cores": pressed(prefill_host=""),
        # a 70 ms step is over STEP_CALM (0.6) x the 100 ms TPOT target: no room for chunks
        "with room for paced prefills": pressed(step=0.07),
    }
    for why, o in cases.items():
        plan = choose(o, held(o), LoanMemory(), S)
        assert isinstance(plan, Hold) and plan.pressure == "prefill", (why, plan)
        assert why in plan.reason, (why, plan.reason)


def test_no_loan_of_one_of_several_prefill_workers() -> None:
    o = obs(100.0, pre("p1", backlog=2000, host=HOST, cpus=(0,)),
            pre("p2", backlog=2000, host=HOST, cpus=(1,)),
            dec("d1", inflight=3, host=HOST, cpus=(2,)))
    plan = choose(o, held(o), LoanMemory(), S)
    assert isinstance(plan, Hold) and "2 prefill workers share the prompts" in plan.reason


def test_the_borrower_with_the_fewest_cores_then_legs() -> None:
    o = obs(100.0, pre("p1", backlog=2000, host=HOST, cpus=(0,)),
            dec("d1", inflight=1, host=HOST, cpus=(1, 2)),
            dec("d2", inflight=5, host=HOST, cpus=(3,)),
            dec("d3", inflight=2, host=HOST, cpus=(4,)))
    # three decode workers: the flip rules would take one for prefill unless they hold; make
    # them hold by a decode queue
    o = dataclasses.replace(o, decode_waiting=1)
    plan = choose(o, held(o), LoanMemory(), S)
    assert isinstance(plan, LendPlan) and plan.to == "d3"


def test_nothing_within_the_cool_down_or_while_a_worker_flips() -> None:
    o = pressed()
    cooling = Memory(prefill_ticks=S.sustain_ticks, last_flip_at=100.0 - S.cooldown_s / 2)
    assert choose(o, cooling, LoanMemory(), S) is None
    flipping = dataclasses.replace(o, workers=(*o.workers, dec("d9", phase="flipping",
                                                             routable=False)))
    assert choose(flipping, held(o), LoanMemory(), S) is None


def lent(sent_tokens: int, sent_prompts: int, rate: float | None = 1000.0, inflight: int = 1,
         step: float = 0.01) -> Observation:
    """p1 lent (its whole-prompt rate 1,000 tokens/s kept), d1 borrowing (one stream unless
    told) and prefilling what the window's 10 s sent it."""
    return obs(200.0, pre("p1", rate=rate, phase=LENT, routable=False, host=HOST, cpus=(0,)),
               dec("d1", inflight=inflight, step=step, host=HOST, cpus=(0, 1), borrowing=True,
                   sent_tokens=sent_tokens, sent_prompts=sent_prompts))


def test_a_lent_worker_is_reclaimed_after_sustained_calm_only() -> None:
    # 20 prompts of 100 tokens in 10 s: 200 tokens/s, p1 alone 20% busy, a wait of ~25 ms
    calm = lent(2000, 20)
    loans = LoanMemory()
    for _ in range(S.sustain_ticks - 1):
        loans = tally_loans(loans, calm, S)
        assert choose(calm, Memory(), loans, S) is None
    loans = tally_loans(loans, calm, S)
    plan = choose(calm, Memory(), loans, S)
    assert isinstance(plan, ReclaimPlan) and plan.worker == "p1"
    assert "busy 20% of the time" in plan.reason
    # one tick outside the band starts the count anew
    assert tally_loans(loans, lent(6000, 4), S).reclaim_ticks == {}


def test_no_reclaim_while_the_prompts_would_wait_for_the_lender_alone() -> None:
    # 4 prompts of 1,500 tokens in 10 s: 600 tokens/s, p1 alone 60% busy (> RHO_IDLE)
    busy = lent(6000, 4)
    # 2 prompts of 1,500 tokens: 30% busy, but each takes 1.5 s: a wait of ~640 ms, over
    # RECLAIM_WAIT (0.125) x the 1 s TTFT target
    long = lent(3000, 2)
    for o in (busy, long):
        loans = LoanMemory()
        for _ in range(S.sustain_ticks + 2):
            loans = tally_loans(loans, o, S)
        assert loans.reclaim_ticks == {}
        assert choose(o, Memory(), loans, S) is None


def test_no_reclaim_while_the_borrower_needs_the_cores() -> None:
    """Calm prompts (as in the reclaim test), but the borrower streams BUSY_STREAMS legs (the
    idle rule would merge again), or its 35 ms step on both cores would be 70 ms on its own
    one, over STEP_CALM x the 100 ms TPOT target."""
    for o in (lent(2000, 20, inflight=2), lent(2000, 20, step=0.035)):
        loans = LoanMemory()
        for _ in range(S.sustain_ticks + 2):
            loans = tally_loans(loans, o, S)
        assert loans.reclaim_ticks == {} and choose(o, Memory(), loans, S) is None
    loans = tally_loans(LoanMemory(), lent(2000, 20, step=0.025), S)  # 50 ms alone: room
    assert loans.reclaim_ticks == {"p1": 1}


def idle_prefill(decode_host: str = HOST, **decode: object) -> Observation:
    """The prefill worker gets 4 short prompts in the window's 10 s (40 tokens/s: 4% busy)
    while the decode worker streams 16 requests."""
    return obs(100.0, pre("p1", host=HOST, cpus=(0,), sent_prompts=4, sent_tokens=400),
               dec("d1", **{"inflight": 16, "host": decode_host, "cpus": (1,), **decode}))


def test_the_last_prefill_worker_merges_its_cores_instead_of_becoming_decode() -> None:
    idle = idle_prefill()
    plan = choose(idle, Memory(idle_ticks=S.sustain_ticks), LoanMemory(), S)
    assert isinstance(plan, LendPlan) and (plan.worker, plan.to) == ("p1", "d1")
    assert plan.reason.startswith("the prefill side idle while every decode-capable worker "
                                  "streams >= 2 requests for 3 ticks")
    assert "instead of a second decode engine" in plan.reason
    slow = idle_prefill(step=0.09)  # a 90 ms step: decode pressure (>= STEP_HIGH x TPOT)
    plan = choose(slow, Memory(decode_ticks=S.sustain_ticks), LoanMemory(), S)
    assert isinstance(plan, LendPlan) and plan.reason.startswith("decode step 90 ms")


def test_a_flip_stands_where_a_loan_adds_no_room_or_cannot_be_made() -> None:
    decode = Memory(decode_ticks=S.sustain_ticks)
    cases = {
        "KV": (idle_prefill(used=90), decode),  # a second engine's KV pool is the relief
        "other machine": (idle_prefill(decode_host="other/boot-2"), Memory(idle_ticks=3)),
        "no cores reported": (idle_prefill(cpus=()), Memory(idle_ticks=3)),
    }
    for why, (o, memory) in cases.items():
        plan = choose(o, memory, LoanMemory(), S)
        assert isinstance(plan, FlipPlan) and (plan.worker, plan.to) == ("p1", "decode"), why
    waiting = dataclasses.replace(idle_prefill(), decode_waiting=3)
    plan = choose(waiting, decode, LoanMemory(), S)
    assert isinstance(plan, FlipPlan) and plan.reason.startswith("3 requests wait")
    # one of two prefill workers becomes decode: the other still prefills whole prompts
    two = obs(100.0, pre("p1", host=HOST, cpus=(0,)), pre("p2", host=HOST, cpus=(1,)),
              dec("d1", inflight=16, host=HOST, cpus=(2,)))
    plan = choose(two, Memory(idle_ticks=S.sustain_ticks), LoanMemory(), S)
    assert isinstance(plan, FlipPlan) and plan.to == "decode"


def test_a_lent_worker_does_not_stop_the_flip_rules() -> None:
    """A lent worker is settled (`elastic.settled`): with it lent and decode pressure on two
    decode workers, the controller still considers flips (here: a Hold, since no prefill
    worker is routable)."""
    o = dataclasses.replace(lent(6000, 4), decode_waiting=2)
    plan = choose(o, Memory(decode_ticks=S.sustain_ticks), LoanMemory(), S)
    assert isinstance(plan, Hold) and plan.reason == "no routable prefill worker to take"


def test_pressure_on_a_borrower_says_it_prefills_on_lent_cores() -> None:
    """With the prefill worker lent and prompts still waiting on the borrower, no flip or
    loan is left to make, and the hold says why."""
    o = obs(100.0, pre("p1", phase=LENT, routable=False, host=HOST, cpus=(0,)),
            dec("d1", inflight=3, host=HOST, cpus=(0, 1), borrowing=True))
    plan = choose(o, held(o), LoanMemory(), S)
    assert plan == Hold("prefill", "every routable decode worker computes on lent cores: "
                                   "each prefills its prompts there")


def rest(**kw: object) -> Observation:
    """One prefill worker on core 0 and one decode worker on core 1 of one machine; no prompt
    in the window's 10 s."""
    return obs(100.0, pre("p1", host=HOST, cpus=(0,)), dec("d1", host=HOST, cpus=(1,)), **kw)


def test_a_pair_at_rest_merges_at_once() -> None:
    plan = choose(rest(), Memory(), LoanMemory(), S)
    assert plan == LendPlan("p1", "d1", "no prompt arrived in the last 10 s: d1 computes on "
                                        "its cores and p1's, so that the next prompts prefill "
                                        "on both")


def test_no_rest_loan_with_prompts_work_or_cores_not_the_lenders_own() -> None:
    o = rest()
    p1, d1 = o.workers
    cases = {
        "a prompt in the window": (dataclasses.replace(p1, sent_prompts=1, sent_tokens=50),
                                   d1),
        "a leg on the lender": (dataclasses.replace(p1, inflight=1), d1),
        "a backlog on the lender": (dataclasses.replace(p1, backlog_tokens=10), d1),
        "another machine": (p1, dataclasses.replace(d1, host="other/boot-2")),
        "shared cores": (p1, dataclasses.replace(d1, cpus=(0, 1))),
        "no cores reported": (dataclasses.replace(p1, cpus=()), d1),
    }
    for why, workers in cases.items():
        assert choose(dataclasses.replace(o, workers=workers), Memory(), LoanMemory(), S) \
            is None, why
    waiting = dataclasses.replace(o, prefill_demand=1)
    assert choose(waiting, Memory(), LoanMemory(), S) is None
    shared = dataclasses.replace(o, workers=(*o.workers, dec("d2", host=HOST, cpus=(0,))))
    assert choose(shared, Memory(), LoanMemory(), S) is None  # core 0 is d2's too
    two = dataclasses.replace(o, workers=(*o.workers, pre("p2", host=HOST, cpus=(2,))))
    assert choose(two, Memory(), LoanMemory(), S) is None
    cooling = Memory(last_flip_at=100.0 - S.cooldown_s / 2)
    assert choose(o, cooling, LoanMemory(), S) is None


def test_no_reclaim_at_rest_or_without_a_measured_rate() -> None:
    """Fewer than MIN_PROMPTS prompts in the window (none, or 7 short ones): the loan
    stands, where 20 such prompts would take the cores back."""
    for o in (lent(0, 0), lent(700, 7)):
        loans = LoanMemory()
        for _ in range(S.sustain_ticks + 2):
            loans = tally_loans(loans, o, S)
        assert loans.reclaim_ticks == {} and choose(o, Memory(), loans, S) is None


def test_a_lender_that_never_prefilled_is_priced_at_its_share_of_the_borrowers_rate() -> None:
    """p1 lent before it measured a rate; d1 prefills 500 tokens/s on both cores, so p1 alone
    would prefill ~250 (one core of two), and 200 tokens/s arriving keep it 80% busy: no
    reclaim (at the mean of the measured rates, d1's 500, it would look 40% busy)."""
    busy = lent(2000, 20, rate=None)
    assert tally_loans(LoanMemory(), busy, S).reclaim_ticks == {}
    calm = lent(800, 20, rate=None)  # 80 tokens/s: 32% of p1's ~250
    assert tally_loans(LoanMemory(), calm, S).reclaim_ticks == {"p1": 1}
