"""The router's choice between the split path and a local prefill, per request, and the
measurements it needs: the prompt tokens each worker still has to prefill (`PrefillBacklog`)
and each KV link's speed (`link_estimates.py`: one estimate per prefill and decode worker
pair), both learnt from the router's own legs; for a pair with no hand-over in memory, the
prefill worker's own report of that link where it is trusted (`link_reports.py`, read from
each health check: a report names its peer by KV endpoint, which is the decode worker's
`peer` in its /health).

Rule (`split_decision.py` has the formulas): only a decode worker with a routable prefill
worker beside it may split; then a fixed `--local-prefill-threshold` when one is given
(uncached tokens on the decode worker at most that run locally); else the measured-cost
decision. Until the workers have reported a rate (a cluster's first prompts: the rates come
with the health check after its first prompt steps), the fallback takes the workers as
equally fast, which cancels the unknown rate out of the measured rule's comparison: a prompt
of U_d <= T = UNMEASURED_THRESHOLD uncached tokens runs locally when

    Q_d + U_d <= max(T, min over prefill workers p of (Q_p + U_p))

(Q: the prompt tokens the router has sent each worker whose prefill has not ended), so the
decode worker takes up to T tokens of prompts at once and beyond that only while it would
be done first; a burst of short prompts is shared between the two kinds of worker instead
of queued on the decode worker while the prefill workers idle. Longer prompts split.

A request's `Prompt` gives the decision its inputs per worker: each prefill worker's
estimate counts the tokens that worker lacks (U_p), the local one those the decode worker
lacks (U_d), and every link the KV of the whole prompt (N tokens in whole blocks: what a split
moves, whatever either side had cached), and `handed_over` teaches a link those same bytes.
Each rule has its `Reason`, the label of `pdserve_router_split_decisions_total`. A
measured-cost choice's `why` (the router's debug log of the request's path) names the inputs
of both estimates (U_d, U_p, the queues, rates and N), the link of its fastest prefill worker
and where that link's estimate came from (`LinkSource`: handovers, report, mean, none), which
`pdserve_router_split_link_source_total{source}` counts.

`choose` may run several times for one request (while the dispatcher picks its worker);
`record` counts the choice the request took, once per request. The client is told it too:
the response's `X-Pdserve-Route` header holds the path and the rule, e.g. `disaggregated;
rule=measured_cost` (`Choice.header`; no worker is named: the router's log does, by request
id).

Lifetime: one per dispatcher; every method runs on the router's event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from functools import partial

from pdserve.router.link_estimates import LinkEstimates, LinkFit, LinkSource, LinkTable, Pair
from pdserve.router.link_reports import LinkReports
from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.split_decision import (
    Decision,
    PrefillBacklog,
    PromptTokens,
    Speed,
    decide,
    kv_bytes_per_token,
)
from pdserve.router.worker_pool import WorkerHandle, WorkerPool

# Until the rates are measured: the most uncached prompt tokens a decode worker prefills at
# once (the fixed rule's old default; a few hundred tokens are a short stall on any hardware),
# more only while it would be done before the prefill workers (module docstring).
UNMEASURED_THRESHOLD = 256
ROUTE_HEADER = "X-Pdserve-Route"


class Reason(StrEnum):
    """Which rule made a choice: one value per branch of `PathChoice.choose`."""

    COLLOCATED_WORKER = "collocated_worker"  # the worker is no decode worker: it runs it whole
    NO_PREFILL_WORKER = "no_prefill_worker"  # no routable prefill worker
    THRESHOLD = "threshold"  # the fixed --local-prefill-threshold
    UNMEASURED = "unmeasured"  # no rate measured yet: UNMEASURED_THRESHOLD
    MEASURED_COST = "measured_cost"  # the two paths' estimated times
    TPOT_TARGET = "tpot_target"  # a local prefill would break the decode streams' TPOT target


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as the choice needs it, from the dispatcher's view of the workers."""

    moved_tokens: int  # N: tokens whose KV a split moves (every prompt token, whole blocks)
    # the prompt's tokens a worker would compute: those not in its prefix cache, as far as the
    # router's prefix index of what it sent there knows
    uncached: Callable[[WorkerHandle], int] = field(compare=False)

    @classmethod
    def cold(cls, tokens: int) -> Prompt:
        """A prompt of `tokens` (a whole number of blocks) no worker holds any of."""
        return cls(tokens, lambda _: tokens)


@dataclass(frozen=True)
class Choice:
    split: bool
    why: str  # for the log
    reason: Reason  # which rule chose: the metric's label
    decision: Decision | None = None  # the measured-cost decision, when one was made
    # where the decision's estimate of its fastest prefill worker's link came from
    link_source: LinkSource | None = None

    @property
    def path(self) -> str:
        """The path's name in the metrics and the route header: disaggregated or local."""
        return "disaggregated" if self.split else "local"

    def header(self) -> str:
        """The value of the response's ROUTE_HEADER: the path, then the rule that chose it."""
        return f"{self.path}; rule={self.reason.value}"


class PathChoice:
    def __init__(self, pool: WorkerPool, threshold: int | None, tpot_target_s: float,
                 metrics: RouterMetrics | None = None) -> None:
        self.pool, self.threshold, self.tpot_target_s = pool, threshold, tpot_target_s
        self.metrics = metrics
        self.backlog = PrefillBacklog()
        self.links = LinkEstimates()
        self.reports = LinkReports()
        pool.on_health.append(lambda w: self.reports.observe(w.url, w.info.get("links")))
        if metrics is not None:
            metrics.add_publisher(
                lambda: self.links.publish(metrics.link_bandwidth, metrics.link_fixed))

    def choose(self, worker: WorkerHandle, prompt: Prompt, prefill: list[WorkerHandle]
               ) -> Choice:
        """Whether `prompt` on `worker` goes to one of `prefill` (the routable prefill
        workers, possibly none) to be prefilled; the fixed rules count its tokens uncached on
        `worker`."""
        uncached = prompt.uncached(worker)
        if worker.role != "decode":
            return Choice(False, f"{worker.role} worker", Reason.COLLOCATED_WORKER)
        if not prefill:
            return Choice(False, "no prefill worker", Reason.NO_PREFILL_WORKER)
        if self.threshold is not None:
            return Choice(uncached > self.threshold,
                          f"{uncached} uncached tokens, --local-prefill-threshold "
                          f"{self.threshold}", Reason.THRESHOLD)
        decision, table = self._decide(worker, prompt, prefill)
        if decision is None:
            return self._unmeasured(worker, uncached, prompt, prefill)
        reason = Reason.TPOT_TARGET if decision.over_tpot_target else Reason.MEASURED_COST
        best = prefill[decision.prefill_index or 0]
        _, source = table.estimate(best.url, worker.url)
        why = (f"{decision.reason}; link {best.key} -> {worker.key} "
               f"{table.describe(best.url, worker.url)}")
        return Choice(not decision.local, why, reason, decision, source)

    def _unmeasured(self, worker: WorkerHandle, uncached: int, prompt: Prompt,
                    prefill: list[WorkerHandle]) -> Choice:
        """The fallback before any rate is measured (module docstring); `uncached`: the
        prompt's tokens uncached on `worker`."""
        mine = self.backlog.tokens(worker.key) + uncached
        theirs = min(self.backlog.tokens(p.key) + prompt.uncached(p) for p in prefill)
        local = uncached <= UNMEASURED_THRESHOLD and mine <= max(UNMEASURED_THRESHOLD, theirs)
        return Choice(not local, f"rates not measured yet: {uncached} uncached "
                      f"tokens, {mine} queued here with them against {theirs} on the least "
                      f"loaded prefill worker (threshold {UNMEASURED_THRESHOLD})",
                      Reason.UNMEASURED)

    def record(self, choice: Choice) -> None:
        """Count the choice a request took (call once per request); its paths' estimated times
        too when the measured-cost decision was made."""
        if self.metrics is None:
            return
        self.metrics.split_decisions.inc(path=choice.path, reason=choice.reason.value)
        if choice.decision is not None:
            self.metrics.split_estimate.observe(choice.decision.t_remote_s, path="disaggregated")
            self.metrics.split_estimate.observe(choice.decision.t_local_s, path="local")
        if choice.link_source is not None:
            self.metrics.split_link_source.inc(source=choice.link_source.value)

    def prefilling(self, worker: WorkerHandle, tokens: int,
                   arrival: bool = True) -> Callable[[], None]:
        """A leg that prefills `tokens` went to `worker` (`arrival`: the request's first such
        leg); call the result at its first event or its end."""
        return self.backlog.add(worker.key, tokens, arrival)

    def fastest_prefill(self, worker: WorkerHandle, prompt: Prompt, free: list[WorkerHandle]
                        ) -> list[WorkerHandle]:
        """Those of `free` (prefill workers with room) through which the split of `prompt`
        to `worker` is estimated to give the first token soonest (their queues, the prompt's
        tokens each lacks, their rates and links to `worker`): several when their estimates
        are equal, all of them while no rate is measured."""
        decision, _ = self._decide(worker, prompt, free)
        if decision is None:
            return free
        best = min(decision.t_remote_each_s)
        return [w for w, t in zip(free, decision.t_remote_each_s, strict=True) if t <= best]

    def handed_over(self, prefill: WorkerHandle, decode: WorkerHandle, tokens: int,
                    seconds: float) -> None:
        """A split request's KV of `tokens` prompt tokens took `seconds` from `prefill`'s
        token 0 to `decode`'s first event. `tokens`: those whose KV moved, every prompt
        token in whole blocks (`Prompt.moved_tokens`), not the decode worker's uncached
        ones: a link taught fewer bytes than moved learns a rate too low by as much."""
        self.links.observe(prefill.url, decode.url, tokens * self.kv_bytes_per_token, seconds)

    @property
    def kv_bytes_per_token(self) -> int:
        layout = (self.pool.reference or {}).get("kv_layout")
        return kv_bytes_per_token(layout) if isinstance(layout, dict) else 0

    def _decide(self, worker: WorkerHandle, prompt: Prompt, prefill: list[WorkerHandle]
                ) -> tuple[Decision | None, LinkTable]:
        """The measured-cost decision for `worker` with each of `prefill` over its own link
        (each counting the prompt's tokens it lacks), and the links' table it used."""
        table = self.links.table(self._reported())
        tokens = PromptTokens(prompt.moved_tokens, prompt.uncached(worker),
                              tuple(prompt.uncached(p) for p in prefill))
        return decide(tokens, self.kv_bytes_per_token, self._speed(worker),
                      [self._speed(p) for p in prefill],
                      [partial(table.seconds, p.url, worker.url) for p in prefill],
                      self.tpot_target_s), table

    def _reported(self) -> dict[Pair, LinkFit]:
        """The trusted reports by (prefill worker URL, decode worker URL): the prefill
        members' reports of their links to a decode member's KV endpoint (a decode worker's
        own links, to the prefill workers it answers, are no split's)."""
        decode = {f"{w.peer.host}:{w.peer.port}": w.url for w in self.pool.workers
                  if w.role == "decode" and w.peer is not None}
        prefill = {w.url for w in self.pool.workers if w.role == "prefill"}
        return {(worker, decode[peer]): fit
                for (worker, peer), fit in self.reports.fits().items()
                if worker in prefill and peer in decode}

    def _speed(self, worker: WorkerHandle) -> Speed:
        return Speed.of(worker.info, self.backlog.tokens(worker.key), worker.inflight)
