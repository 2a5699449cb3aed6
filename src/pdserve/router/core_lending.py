"""Cores lent between two workers of one machine: `POST /internal/workers/NAME/lend {"to": B}`
and `POST /internal/workers/NAME/reclaim`.

Why: where workers split one machine's cores, a prefill worker's core computes nothing while
its prompts are few, and one core may be too slow for a prompt at all (a 1,500-token prompt on
one core of a 2-core machine takes longer than a 2 s TTFT target; on both it takes half). A
lent worker's cores go to a decode-capable worker of the same machine, which then computes on
both sets (`POST /internal/cpus` to the worker, `workers/cpu_pin.py`), and with no routable
prefill worker left, the split decision prefills every prompt there in chunks paced to the
TPOT target. Reclaimed, the cores go back and the lender serves as a prefill worker again.

A loan, from lender A (a prefill worker) to borrower B (decode or collocated):
1. Refused before anything changes (`ApiError`): 400 A is B; 409 `not_prefill` (A must be a
   prefill worker: flip it first), `not_decode_capable` (B), `not_routable` (either is
   unhealthy or in a phase: flipping, draining, lent), `other_host` (their /health `host`
   differ, or either reports none: core numbers name the same cores only on one machine),
   `no_cpus` (either reports no `cpus`), `last_of_role` (A is the last routable prefill
   worker and split requests wait for a prefill slot: nobody else could grant them one).
2. A enters the LENT phase: no new work of any role (no new split request chooses it, so
   none waits for it), and the legs it holds finish there (its prompts prefill and move).
3. Once A holds no leg (within `timeout_s`, else 503 `lend_failed` and A serves again), B is
   pinned to its own cores plus A's. B's refusal (409 for a tensor-parallel engine, 400) or
   silence ends the attempt with A serving again (502, 504; B's status where it answered).
   A or B left the pool meanwhile: 409 `lend_failed` (B pinned back if it was pinned).
4. 200 `{"worker": A, "to": B, "cpus": [B's cores now], "seconds"}`.

A reclaim pins B back to its own cores plus those of any other lender it still borrows from,
then A is routable again as a prefill worker; 409 `not_lent` when A lends nothing. It always
ends the loan: where B cannot be pinned back now (it does not answer), it is pinned back when
it next answers /health; the answer says so (`"pinned_back": false`).

Faults (`watch`, after each proved /health, and `removed`):
- B restarted (its instance or pid changed): it computes on the cores it was started on, so
  its loans end and their lenders serve again. B unhealthy but the same process: the loan
  stands (A alone could prefill only for B's streams).
- A left the pool, or its phase was changed from LENT (it drains before leaving): its loan
  ends and B is pinned back. A restarted: nothing changes; it keeps its own cores and idles.
- B left the pool: its loans end; their lenders serve again.
- A worker on cores other than those it was started on (its /health `cpus` and `own_cpus`
  differ) that borrows through no loan of this router (the router restarted while a loan
  stood, or someone pinned the worker by hand): pinned back to its own, as a borrower whose
  lender left. Without it a restarted router would route prompts to the lender, which still
  computes on cores the borrower's threads share.

Lifetime: one per router; a lend and a check's refusals happen with no await between them.
Loans are the router's: a restarted router knows none, and pins their borrowers back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve.api.errors import ApiError, message_of
from pdserve.internal_auth import InternalAuth
from pdserve.router.flips import DECODE_CAPABLE
from pdserve.router.pool_metrics import PoolMetrics
from pdserve.router.worker_call import NoAnswer, post_to_worker
from pdserve.router.worker_pool import LENT, WorkerHandle, WorkerPool

log = logging.getLogger("pdserve.router")

CPUS_PATH = "/internal/cpus"
DRAIN_POLL_S = 0.05  # how often a lend looks whether its lender still holds legs
Held = Callable[[WorkerHandle], int]  # legs still held on a worker (admission slots)
Waiting = Callable[[], int]  # split requests waiting for a prefill slot


@dataclass(frozen=True)
class Loan:
    lender: WorkerHandle
    borrower: WorkerHandle
    lender_cpus: tuple[int, ...]
    borrower_cpus: tuple[int, ...]  # the borrower's own: given back at the end
    borrower_instance: tuple[int | None, int | None] | None  # it restarted when this changes


def cpus_of(worker: WorkerHandle) -> tuple[int, ...] | None:
    """The cores a worker reports in its /health; None when it reports none."""
    return _cores(worker.info.get("cpus"))


def _cores(cpus: object) -> tuple[int, ...] | None:
    """A /health list of core numbers, sorted; None when it is not one."""
    if isinstance(cpus, list) and cpus and all(type(c) is int and c >= 0 for c in cpus):
        return tuple(sorted(cpus))
    return None


def lend_refusal(lender: WorkerHandle, borrower: WorkerHandle, pool: WorkerPool,
                 waiting: int) -> ApiError | None:
    """Why `lender` may not lend its cores to `borrower` now (see the module docstring)."""
    if lender is borrower:
        return ApiError(400, f"worker {lender.key} cannot lend its cores to itself",
                        param="to", code="invalid_loan")
    if lender.role != "prefill":
        return ApiError(409, f"worker {lender.key} is a {lender.role} worker: only a prefill "
                             "worker lends its cores (flip it to prefill first)",
                        code="not_prefill")
    if borrower.role not in DECODE_CAPABLE:
        return ApiError(409, f"worker {borrower.key} is a {borrower.role} worker: cores go "
                             "to a decode or collocated worker", code="not_decode_capable")
    for w in (lender, borrower):
        if not w.routable:
            return ApiError(409, f"worker {w.key} is {w.state}: only a healthy worker in no "
                                 "phase takes part in a loan", code="not_routable")
    hosts = lender.info.get("host"), borrower.info.get("host")
    if not all(isinstance(h, str) and h for h in hosts) or hosts[0] != hosts[1]:
        return ApiError(409, f"workers {lender.key} and {borrower.key} are not on one machine "
                             f"(hosts {hosts[0]!r} and {hosts[1]!r}): cores are lent only "
                             "between workers of one machine", code="other_host")
    for w in (lender, borrower):
        if cpus_of(w) is None:
            return ApiError(409, f"worker {w.key} reports no cores in its /health",
                            code="no_cpus")
    last = not any(w.role == "prefill" and w.routable and w is not lender
                   for w in pool.workers)
    if last and waiting:
        return ApiError(409, f"worker {lender.key} is the last prefill worker and {waiting} "
                             "split requests wait for a prefill slot", code="last_of_role")
    return None


class CoreLending:
    """`held(worker)`: the admission slots held on `worker` (its legs in flight); `waiting()`:
    split requests waiting for a prefill slot; `timeout_s` bounds a lender's drain and each
    call to a worker."""

    def __init__(self, pool: WorkerPool, auth: InternalAuth,
                 session: Callable[[], aiohttp.ClientSession], held: Held, waiting: Waiting,
                 timeout_s: float, metrics: PoolMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.pool, self.auth, self.session, self.metrics = pool, auth, session, metrics
        self.held, self.waiting, self.timeout_s, self.clock = held, waiting, timeout_s, clock
        self.loans: dict[str, Loan] = {}  # by lender key
        self._repin: dict[str, tuple[int, ...]] = {}  # borrower key -> cores it must go back to
        self._pinning: set[str] = set()  # borrowers being pinned back in the background
        self._tasks: set[asyncio.Task] = set()
        self._pins = asyncio.Lock()  # one at a time: a loan's pin and record, a reclaim, a pin back
        pool.on_health.append(self.watch)
        pool.on_removed.append(self.removed)

    def borrows(self, worker: WorkerHandle) -> bool:
        return any(loan.borrower is worker for loan in self.loans.values())

    def lent_to(self, worker: WorkerHandle) -> str | None:
        loan = self.loans.get(worker.key)
        return loan.borrower.key if loan is not None and loan.lender is worker else None

    async def lend(self, lender: WorkerHandle, borrower: WorkerHandle) -> dict[str, Any]:
        refusal = lend_refusal(lender, borrower, self.pool, self.waiting())
        if refusal is not None:
            raise refusal
        t0 = self.clock()
        # a borrower still to be pinned back (a loan ended by a fault) owns what it goes back to
        own, theirs = self._repin.get(borrower.key) or cpus_of(borrower), cpus_of(lender)
        assert own is not None and theirs is not None  # checked above
        lender.phase = LENT
        log.info("worker %s: lending cores %s to worker %s once its legs end", lender.key,
                 list(theirs), borrower.key)
        try:
            await self._drained(lender, borrower)
            cpus = await self._begin(lender, borrower, own, theirs)
        except ApiError:
            if lender.phase == LENT:  # not a phase given meanwhile (draining: it leaves)
                lender.phase = None
            self.pool.on_refresh()
            raise
        gone = next((w for w in (lender, borrower) if w not in self.pool.workers), None)
        if gone is not None:  # it left while the borrower was pinned: `removed` saw no loan
            self.removed(gone, "left while the loan began")
            raise ApiError(409, f"worker {gone.key} left the pool while worker {borrower.key} "
                                "was pinned: the loan ended at once", code="lend_failed")
        seconds = round(self.clock() - t0, 3)
        self._count("lent")
        log.info("worker %s lent cores %s to worker %s (now on %s) in %.1f s", lender.key,
                 list(theirs), borrower.key, list(cpus), seconds)
        return {"worker": lender.key, "to": borrower.key, "cpus": list(cpus),
                "seconds": seconds}

    async def _begin(self, lender: WorkerHandle, borrower: WorkerHandle, own: tuple[int, ...],
                     theirs: tuple[int, ...]) -> tuple[int, ...]:
        """Pins the drained lender's borrower to both sets of cores and records the loan; the
        borrower's cores now."""
        async with self._pins:  # one borrower's pins reach it in the order of its loans
            self._still_members(lender, borrower)
            cpus = tuple(sorted({*own, *theirs, *self._borrowed(borrower)}))
            await self._pin(borrower, cpus)
            self._repin.pop(borrower.key, None)  # this pin replaces a pending pin back
            self.loans[lender.key] = Loan(lender, borrower, theirs, self._own(borrower, own),
                                          borrower.instance)
        return cpus

    async def reclaim(self, lender: WorkerHandle) -> dict[str, Any]:
        loan = self.loans.get(lender.key)
        if loan is None or loan.lender is not lender:
            raise ApiError(409, f"worker {lender.key} has lent no cores", code="not_lent")
        t0 = self.clock()
        pinned = await self._give_back(loan)
        seconds = round(self.clock() - t0, 3)
        self._count("reclaimed")
        log.info("worker %s took its cores %s back from worker %s in %.1f s", lender.key,
                 list(loan.lender_cpus), loan.borrower.key, seconds)
        return {"worker": lender.key, "from": loan.borrower.key, "cpus": list(loan.lender_cpus),
                "pinned_back": pinned, "seconds": seconds}

    def watch(self, worker: WorkerHandle) -> None:
        """After a proved /health of `worker`: the faults of the module docstring."""
        for loan in list(self.loans.values()):
            if loan.borrower is worker and worker.instance != loan.borrower_instance:
                self._end(loan, f"worker {worker.key} restarted on its own cores")
            elif loan.lender is worker and worker.phase != LENT:
                self._end(loan, f"worker {worker.key} is {worker.state}", give_back=True)
        wanted = self._repin.get(worker.key)
        if wanted is not None and cpus_of(worker) == wanted:
            del self._repin[worker.key]
        elif wanted is not None:
            self._pin_back(worker, wanted)
        else:
            self._unknown_loan(worker)

    def _unknown_loan(self, worker: WorkerHandle) -> None:
        """Pins `worker` back to its own cores where it computes on others through no loan of
        this router (the last fault of the module docstring). Not while a lend or reclaim is
        pinning: between a borrower's pin and the loan's record its cores are not its own."""
        own, now = _cores(worker.info.get("own_cpus")), cpus_of(worker)
        if own is None or now is None or own == now or self.borrows(worker) \
                or self._pins.locked():
            return
        log.warning("worker %s computes on cores %s, not its own %s, through no loan of this "
                    "router (it restarted while one stood, or the worker was pinned by hand): "
                    "pinning it back", worker.key, list(now), list(own))
        self._repin[worker.key] = own
        self._pin_back(worker, own)

    def removed(self, worker: WorkerHandle, reason: str) -> None:
        self._repin.pop(worker.key, None)
        for loan in list(self.loans.values()):
            if loan.borrower is worker:
                self._end(loan, f"worker {worker.key} left the pool ({reason})")
            elif loan.lender is worker:
                self._end(loan, f"worker {worker.key} left the pool ({reason})", give_back=True)

    def _end(self, loan: Loan, why: str, give_back: bool = False) -> None:
        """A loan ended by a fault: the lender serves again (if it is still lent); with
        `give_back`, the borrower is pinned back in the background."""
        log.warning("loan of cores %s from worker %s to worker %s ended: %s",
                    list(loan.lender_cpus), loan.lender.key, loan.borrower.key, why)
        self.loans.pop(loan.lender.key, None)
        self._count("ended")
        if loan.lender.phase == LENT:
            loan.lender.phase = None
        if give_back:
            self._repin[loan.borrower.key] = self._back(loan)
            self._pin_back(loan.borrower, self._repin[loan.borrower.key])
        self.pool.on_refresh()

    async def _give_back(self, loan: Loan) -> bool:
        """Pins the borrower back, then the lender serves again; whether the pin was done."""
        async with self._pins:
            self.loans.pop(loan.lender.key, None)
            cpus = self._back(loan)
            pinned = await self._pinned(loan.borrower, cpus)
            if pinned:  # it replaces any pending pin back
                self._repin.pop(loan.borrower.key, None)
            else:
                self._repin[loan.borrower.key] = cpus
        if loan.lender.phase == LENT:
            loan.lender.phase = None
        self.pool.on_refresh()
        return pinned

    async def _pinned(self, borrower: WorkerHandle, cpus: tuple[int, ...]) -> bool:
        """Whether `borrower` was pinned back to `cpus` (a failure is logged)."""
        try:
            await self._pin(borrower, cpus)
            return True
        except ApiError as e:
            log.warning("worker %s not pinned back to cores %s yet: %s", borrower.key,
                        list(cpus), e.message)
            return False

    def _back(self, loan: Loan) -> tuple[int, ...]:
        """The borrower's cores once `loan` (already removed from `loans`) ended."""
        return tuple(sorted({*loan.borrower_cpus, *self._borrowed(loan.borrower)}))

    def _borrowed(self, borrower: WorkerHandle) -> tuple[int, ...]:
        """The cores `borrower` holds through the loans in force."""
        return tuple(c for loan in self.loans.values() if loan.borrower is borrower
                     for c in loan.lender_cpus)

    def _own(self, borrower: WorkerHandle, reported: tuple[int, ...]) -> tuple[int, ...]:
        """The borrower's own cores: those of its first loan when it already borrows."""
        first = next((loan for loan in self.loans.values() if loan.borrower is borrower), None)
        return first.borrower_cpus if first is not None else reported

    def _still_members(self, lender: WorkerHandle, borrower: WorkerHandle) -> None:
        """After the drain: a worker that left the pool meanwhile takes no part in a loan
        (`removed` could not end a loan not made yet, so nobody would end this one)."""
        for w in (lender, borrower):
            if w not in self.pool.workers:
                raise ApiError(409, f"worker {w.key} left the pool while worker {lender.key} "
                                    "drained: no cores were lent", code="lend_failed")

    async def _drained(self, lender: WorkerHandle, borrower: WorkerHandle) -> None:
        """Once the lender holds no leg; ApiError past the timeout, or at once when either
        worker left the pool or the lender was given another phase (it drains to leave)."""
        deadline = self.clock() + self.timeout_s
        while (legs := max(self.held(lender), lender.inflight)) > 0:
            self._still_members(lender, borrower)
            if lender.phase != LENT:
                raise ApiError(409, f"worker {lender.key} is {lender.state} now: no cores "
                                    "were lent", code="lend_failed")
            if self.clock() >= deadline:
                raise ApiError(503, f"worker {lender.key} still held {legs} legs after "
                                    f"{self.timeout_s:g} s: its cores were not lent (it serves "
                                    "again)", code="lend_failed")
            await asyncio.sleep(DRAIN_POLL_S)

    async def _pin(self, worker: WorkerHandle, cpus: tuple[int, ...]) -> None:
        """`POST /internal/cpus` to `worker`; ApiError with its refusal or silence."""
        try:
            status, body = await post_to_worker(self.session(), self.auth, worker.url,
                                                CPUS_PATH, {"cpus": list(cpus)}, self.timeout_s)
        except NoAnswer as e:
            raise ApiError(504 if e.timed_out else 502, f"worker {worker.key} {e} when pinned "
                           f"to cores {list(cpus)}", code="lend_failed") from None
        if status != 200:
            passed = status if status in (400, 409) else 502
            raise ApiError(passed, f"worker {worker.key} refused cores {list(cpus)} ({status}): "
                                   f"{message_of(body)}", code="lend_failed")
        worker.info["cpus"] = list(cpus)

    def _pin_back(self, worker: WorkerHandle, cpus: tuple[int, ...]) -> None:
        """Pins `worker` to `cpus` in the background, unless a pin back of it is under way
        (marked at once, not when the task starts: a loan ended and the borrower's /health in
        one round would pin it twice); what that one leaves undone, the next /health retries."""
        if worker.key not in self._pinning:
            self._pinning.add(worker.key)
            self._spawn(self._repin_now(worker, cpus))

    async def _repin_now(self, worker: WorkerHandle, cpus: tuple[int, ...]) -> None:
        """Under the lock of loans' pins, so that a loan begun meanwhile is not undone: its pin
        replaced this one (`_begin` drops the pending entry), which then does nothing."""
        try:
            async with self._pins:
                if self._repin.get(worker.key) != cpus:
                    return
                pinned = await self._pinned(worker, cpus)
        finally:
            self._pinning.discard(worker.key)
        if not pinned:
            return
        if self._repin.get(worker.key) == cpus:
            del self._repin[worker.key]
        log.info("worker %s pinned back to cores %s", worker.key, list(cpus))

    def _count(self, event: str) -> None:
        if self.metrics is not None:
            self.metrics.loan(event)

    def _spawn(self, job: Any) -> None:
        task = asyncio.ensure_future(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
