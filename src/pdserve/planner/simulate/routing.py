"""The router's worker choices in the simulator, and its view of each worker's load.

Routing (ours): with `Cluster.split` remote (the default), an arriving prompt goes to the
prefill worker with the fewest queued and running prompt tokens, and once prefilled to the
decode worker with the fewest assigned requests (queued, in transfer or running). With split
local or measured, as the router does: the decode worker with the fewest open requests is
chosen at arrival, and the prompt is prefilled there (in chunks paced to
`Cluster.tpot_target_s` beside its streams, paced_decode.py) or on a prefill worker, whose KV
then travels to it (split_model.py has the rule). A collocated request goes to the worker with
the fewest assigned requests; ties go to the lowest index.

Prefix cache (prefix_cache.py): every worker that prefills keeps the shared prefixes whose KV
it holds and computes only the rest of a prompt that starts with one. The router's view is
modelled apart (what it routed where, as its prefix index): it counts each prompt's uncached
tokens on a worker from it, in the prefill queues (Q_p, Q_d) and in the measured split rule
(U_d on the decode worker, U_p on each prefill worker; the link priced with the whole prompt's
KV, as the router prices it). A split prompt's KV transfer moves the whole prompt: the
engine's decode side reserves blocks for every prompt token, without its prefix cache, and
receives them all. With `Cluster.policy` prefix
(the router's `--policy prefix`, `PrefixAware`), every worker choice above is instead the
lowest legs - (prompt blocks the router routed there) / PREFIX_BLOCKS_PER_LEG, legs being the
requests assigned to the worker (for a prefill worker, its queued and running prompts); ties
to the lowest index. The measured rule's prefill worker stays the one of its t_remote (before
any rate is reported, the policy's).

With admission (admission_gate.py) the same choices are made among the workers with room, when
a request is granted a slot rather than at its arrival.

The measured rule reads the rates the workers reported (step_window.py) as of the router's
last health check (`poll`, every HEALTH_INTERVAL_S of simulated time, events.py), not as of
the decision: the served router reads them from each worker's /health once a second.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.planner.simulate.calibration import StepCosts
from pdserve.planner.simulate.cluster import Cluster, RoutePolicy
from pdserve.planner.simulate.metrics import RequestRecord
from pdserve.planner.simulate.paced_decode import PacedDecodeWorker
from pdserve.planner.simulate.pools import CollocatedWorker, DecodeWorker, PrefillWorker, Worker
from pdserve.planner.simulate.prefix_cache import PrefixTable, RoutedPrefixes
from pdserve.planner.simulate.split_model import Route, Seen, SplitRule, route
from pdserve.planner.simulate.step_window import Rates

PREFIX_BLOCKS_PER_LEG = 8  # router/policies.py PrefixAware: a cached block is worth 1/8 leg
HEALTH_INTERVAL_S = 1.0  # router/worker_pool.py health_interval_s

Wake = Callable[[Worker], None]  # ask a worker to start a step once the current time is done


class Routing:
    """Where each request goes, and the loads the router counts to choose.

    Invariants: loads["prefill"][i] is the uncached prompt tokens (as the router counted them,
    `queued`) routed to prefill worker i and not yet prefilled (Q_p); loads["decode"][j] the
    requests open on decode worker j (split ones from their arrival unless `split` is remote,
    from their prefill's end then; with admission from their decode slot's grant);
    loads["colloc"][i] the requests assigned to collocated worker i and not finished; `bound`
    maps a split request whose decode worker is chosen to that worker until its prefill ends;
    `routed[role][i]` is what the router sent to worker i of `role`
    (prefix_cache.RoutedPrefixes). Every change of a worker's queue wakes it.
    Lifetime: one per simulated run."""

    def __init__(self, cluster: Cluster, costs: StepCosts, table: PrefixTable,
                 prefill: Sequence[PrefillWorker], decode: Sequence[DecodeWorker],
                 colloc: Sequence[CollocatedWorker], wake: Wake) -> None:
        self.cluster, self.costs, self.wake = cluster, costs, wake
        self.prefill, self.colloc = prefill, colloc
        self.paced = [w for w in decode if isinstance(w, PacedDecodeWorker)]
        self.bound: dict[int, int] = {}
        self.queued: dict[int, int] = {}  # request index -> its tokens in loads["prefill"]
        self.loads = {"prefill": [0] * len(prefill), "decode": [0] * len(decode),
                      "colloc": [0] * len(colloc)}
        self.routed = {role: [RoutedPrefixes(table, cluster.block_tokens) for _ in loads]
                       for role, loads in self.loads.items()}
        # each worker's rates as the last health check read them (`poll`)
        self.read_prefill = [Rates() for _ in prefill]
        self.read_decode = [Rates() for _ in self.paced]

    def poll(self) -> None:
        """The router's health check: it reads every worker's reported rates, which its split
        rule uses until the next check."""
        self.read_prefill = [w.steps.rates() for w in self.prefill]
        self.read_decode = [w.pacer.steps.rates() for w in self.paced]

    def pick(self, role: str, record: RequestRecord, among: Sequence[int] | None = None) -> int:
        """The worker of `role` for `record` under `Cluster.policy` (module docstring), among
        the workers `among` (ascending indices; None: all)."""
        loads = self.loads[role]
        among = range(len(loads)) if among is None else among
        if self.cluster.policy is RoutePolicy.LEAST_LOADED:
            return min(among, key=loads.__getitem__)
        legs = [len(w.queue) + len(w.step) for w in self.prefill] if role == "prefill" \
            else loads
        routed = self.routed[role]
        return min(among, key=lambda i: (
            legs[i] - routed[i].blocks(record) / PREFIX_BLOCKS_PER_LEG, i))

    def to_colloc(self, record: RequestRecord, i: int) -> None:
        self.loads["colloc"][i] += 1
        self.routed["colloc"][i].add(record)
        self.colloc[i].waiting.append(record)
        self.wake(self.colloc[i])

    def to_prefill(self, record: RequestRecord, i: int | None) -> None:
        """Queue `record` on prefill worker i (None: the policy's pick), counted in Q_p as the
        router counts it."""
        if i is None:
            i = self.pick("prefill", record)
        record.local = False
        tokens = self.routed["prefill"][i].uncached(record)
        self.routed["prefill"][i].add(record)
        self.queued[record.index] = tokens
        self.loads["prefill"][i] += tokens
        self.prefill[i].queue.append(record)
        self.wake(self.prefill[i])

    def split(self, record: RequestRecord, j: int, prefill: int | None) -> None:
        """`record`, bound to decode worker j, is queued on prefill worker `prefill` (None: the
        policy's pick)."""
        self.bound[record.index] = j
        self.to_prefill(record, prefill)

    def route(self, record: RequestRecord, j: int) -> int | None:
        """The router's path (split_model.py) on decode worker j, counted open there: None when
        it prefills there (queued on it now), else the prefill worker it goes to, which the
        caller sends it to (`split`, or through the prefill pool). U is the prompt's uncached
        tokens on that decode worker, as the router counts them."""
        tokens = self.routed["decode"][j].uncached(record)
        path = self._decide(record, j, tokens)
        self.loads["decode"][j] += 1
        self.routed["decode"][j].add(record)
        record.local = path is None or path.local
        if path is not None and not path.local:
            return self.pick("prefill", record) if path.prefill_index is None \
                else path.prefill_index
        self.paced[j].add_local(record, tokens)
        self.wake(self.paced[j])
        return None

    def _decide(self, record: RequestRecord, j: int, tokens: int) -> Route | None:
        """The measured rule's decision for `record`, `tokens` of it uncached on decode worker
        j (each prefill worker counted with what it lacks, the link with the whole prompt's
        KV), on the workers' reported speeds; None: split local."""
        if self.cluster.split is SplitRule.LOCAL:
            return None
        prefill = [Seen(rates, q) for rates, q in zip(self.read_prefill, self.loads["prefill"],
                                                      strict=True)]
        remote = [routed.uncached(record) for routed in self.routed["prefill"]]
        return route(tokens, self.paced[j].seen(self.loads["decode"][j], self.read_decode[j]),
                     remote, prefill,
                     self.cluster.transfer_seconds(record.prompt_tokens))

    def open_decode(self, record: RequestRecord, j: int) -> None:
        """`record` is assigned to decode worker j from now."""
        self.loads["decode"][j] += 1
        self.routed["decode"][j].add(record)

    def decode_for(self, record: RequestRecord) -> int:
        """A prefilled request with no decode worker yet: the policy's pick, open from now."""
        j = self.pick("decode", record)
        self.open_decode(record, j)
        return j

    def prefill_ended(self, record: RequestRecord, i: int) -> int | None:
        """`record`'s prefill on prefill worker i ended: out of Q_p; its bound decode worker, if
        any, is returned and unbound."""
        self.loads["prefill"][i] -= self.queued.pop(record.index)
        return self.bound.pop(record.index, None)

    def close(self, role: str, i: int, requests: int = 1) -> None:
        """`requests` assigned to worker i of `role` ended (finished, refused, or, split,
        ended by their token 0)."""
        self.loads[role][i] -= requests

    def leftovers(self) -> list[str]:
        """What a finished run still counts: nothing, unless the model lost track of work."""
        left = [f"{role} worker {i}: load {n}" for role, loads in self.loads.items()
                for i, n in enumerate(loads) if n]
        left += [f"request {i} queued for prefill" for i in self.queued]
        return left + [f"request {i} bound to decode worker {j}" for i, j in self.bound.items()]
