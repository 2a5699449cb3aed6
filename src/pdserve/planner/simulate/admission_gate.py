"""The event loop's side of the router's admission (admission.py holds the pools' slots and
queues): when a request asks which pool for a slot, and what a grant or a refusal does to it.

Admission (with `Cluster.admission`; None, the default: none): a request takes a slot in the
decode pool (decode or collocated workers) at arrival, on the worker the routing rule
(routing.py) picks among those with room, and, if it is split, then one in the prefill pool
(the rule's prefill worker if it has room, else the least loaded with room); over the caps it
waits in the pool's FIFO queue, or is refused (429 queue full, 503 waited too long). With
admission a remote-split request's decode worker is chosen at arrival, as the router does. A
refused request ends there: no token, and its closed-loop client sends its next request.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Protocol

from pdserve.planner.simulate.admission import Admission, AdmissionPool
from pdserve.planner.simulate.cluster import Cluster, Layout
from pdserve.planner.simulate.metrics import RequestRecord
from pdserve.planner.simulate.routing import Routing
from pdserve.planner.simulate.split_model import SplitRule


class Loop(Protocol):
    """What the gate needs of the event loop."""

    now: float  # the time of the event being processed

    def expire_at(self, time: float, pool: str, record: RequestRecord) -> None:
        """Call `AdmissionGate.expire(pool, record, time)` at `time`."""

    def client_free(self, now: float) -> None:
        """A request ended: its closed-loop client sends the next one."""


class AdmissionGate:
    """The pools of one run and the requests between their two slots.

    Invariants: `pools` holds the decode pool (and the prefill pool when disaggregated); a
    request's decode slot is held from its grant until it ends (its routing load counted as
    long), its prefill slot until its prefill ends; `splitting` maps a split request that holds
    its decode slot on worker j but no prefill slot yet to (j, the rule's prefill worker; None:
    the policy's pick), and `pending` lists those still to ask for one (asked after the event
    being processed, at its time). Every wait ends `wait_s` after the request reached the
    router (its arrival, plus half the cluster's front-end round trip).
    Lifetime: one per simulated run with admission."""

    def __init__(self, admission: Admission, cluster: Cluster, layout: Layout,
                 routing: Routing, loop: Loop) -> None:
        self.layout, self.cluster, self.routing, self.loop = layout, cluster, routing, loop
        self.wait_s = admission.max_queue_wait_s
        self.splitting: dict[int, tuple[int, int | None]] = {}
        self.pending: deque[RequestRecord] = deque()
        kv = cluster.kv_capacity_tokens // cluster.block_tokens * cluster.block_tokens
        loads = routing.loads
        decode = len(loads["decode"]) or len(loads["colloc"])
        self.pools = {"decode": AdmissionPool("decode", decode, admission, cluster.max_batch,
                                              kv, self._choose_decode, self._decode_granted,
                                              self._refuse)}
        if loads["prefill"]:
            self.pools["prefill"] = AdmissionPool("prefill", len(loads["prefill"]), admission,
                                                  cluster.max_batch, kv, self._choose_prefill,
                                                  self._prefill_granted, self._refuse)

    def arrive(self, record: RequestRecord, now: float) -> None:
        """`record` arrived: it asks the decode pool for a slot."""
        self.acquire("decode", record, now, self.wait_s)

    def acquire(self, pool: str, record: RequestRecord, now: float, wait_s: float) -> None:
        """Ask `pool` for a slot for `record`; a queued one's wait ends in a loop event."""
        expires = self.pools[pool].acquire(record, now, wait_s)
        if expires is not None and expires < math.inf:
            self.loop.expire_at(expires, pool, record)

    def expire(self, pool: str, record: RequestRecord, now: float) -> None:
        self.pools[pool].expire(record, now)

    def release(self, pool: str, record: RequestRecord, now: float, tokens: int) -> None:
        """`record` completed its part in `pool` holding `tokens` of KV."""
        self.pools[pool].release(record, now, tokens)

    def ask_prefill_slots(self, now: float) -> None:
        """Split requests holding a decode slot ask for a prefill slot, within what is left
        of their wait since they reached the router."""
        reached = self.cluster.frontend_latency_s / 2
        while self.pending:
            record = self.pending.popleft()
            self.acquire("prefill", record, now, record.arrival_s + reached + self.wait_s - now)

    def _choose_decode(self, record: RequestRecord, free: list[int]) -> int:
        return self.routing.pick("decode" if self.routing.loads["decode"] else "colloc", record,
                                 free)

    def _decode_granted(self, record: RequestRecord, j: int) -> None:
        """The request holds a slot on decode (or collocated) worker j: route it there."""
        if self.layout is not Layout.DISAGG:
            self.routing.to_colloc(record, j)
        elif self.cluster.split is SplitRule.REMOTE:
            self.routing.open_decode(record, j)
            self._split(record, j, None)
        elif (prefill := self.routing.route(record, j)) is not None:
            self._split(record, j, prefill)

    def _split(self, record: RequestRecord, j: int, prefill: int | None) -> None:
        """`record`, holding its slot on decode worker j, is to be prefilled on prefill worker
        `prefill` once it holds a prefill slot."""
        self.splitting[record.index] = (j, prefill)
        self.pending.append(record)

    def _choose_prefill(self, record: RequestRecord, free: list[int]) -> int:
        chosen = self.splitting[record.index][1]
        return chosen if chosen in free else self.routing.pick("prefill", record, free)

    def _prefill_granted(self, record: RequestRecord, i: int) -> None:
        j, _ = self.splitting.pop(record.index)
        self.routing.split(record, j, i)

    def _refuse(self, record: RequestRecord, status: int) -> None:
        """Admission refused `record` (429 or 503): it ends now without a token; a decode slot
        it holds is given back, and its closed-loop client sends the next request."""
        now = self.loop.now
        record.refused, record.refused_s = status, now
        if (split := self.splitting.pop(record.index, None)) is not None:
            self.routing.close("decode", split[0])
        self.pools["decode"].release(record, now, None)
        self.loop.client_free(now)

    def leftovers(self) -> list[str]:
        """What a finished run still holds here: nothing, unless the model lost track."""
        left = [f"request {i} waits for a prefill slot" for i in self.splitting]
        return left + [line for pool in self.pools.values() for line in pool.leftovers()]
