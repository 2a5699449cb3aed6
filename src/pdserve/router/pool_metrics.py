"""The router's metrics of pool membership and roles (elastic pools: `registry.py`, `flips.py`).

- `pdserve_worker_role{worker,role}`: 1 for the worker's current role, 0 for the others; all 0
  once the worker left (a removed worker's series stay, at 0).
- `pdserve_role_flips_total{from,to}`: flips the router completed.
- `pdserve_core_loans_total{event}`: cores lent between workers of one machine
  (`core_lending.py`), by event: `lent`, `reclaimed`, `ended` (a fault ended the loan).
- `pdserve_router_worker_registrations_total{result}`: joins, by result (`accepted`,
  `rejoined`, or the refusal's code).
- `pdserve_router_worker_removals_total{reason}`: registered workers removed (`deregistered`,
  `unheard`).

`worker` is the worker's name in the pool (`WorkerHandle.key`). Lifetime: the router's.
"""

from __future__ import annotations

from pdserve.router.router_metrics import RouterMetrics
from pdserve.router.worker_pool import ROLES, WorkerHandle, WorkerPool


class PoolMetrics:
    def __init__(self, metrics: RouterMetrics, pool: WorkerPool) -> None:
        r = metrics.registry
        self.role = r.gauge("pdserve_worker_role", "1 for the worker's current role (0 for the "
                            "others, and for every role once it left the pool).",
                            ["worker", "role"])
        self.flips = r.counter("pdserve_role_flips_total", "Role flips completed by the "
                               "router, by old and new role.", ["from", "to"])
        self.loans = r.counter("pdserve_core_loans_total", "Cores lent between workers of one "
                               "machine, by event: lent, reclaimed, ended (a fault ended the "
                               "loan).", ["event"])
        self.registrations = r.counter("pdserve_router_worker_registrations_total",
                                       "Workers' requests to join, by result: accepted, "
                                       "rejoined, or the refusal's code.", ["result"])
        self.removals = r.counter("pdserve_router_worker_removals_total", "Registered workers "
                                  "removed from the pool, by reason: deregistered, unheard.",
                                  ["reason"])
        self._pool = pool
        metrics.add_publisher(self.publish)
        pool.on_removed.append(self._removed)

    def publish(self) -> None:
        for w in self._pool.workers:
            self._set_role(w, w.role)

    def flipped(self, old: str, new: str) -> None:
        self.flips.inc(**{"from": old, "to": new})

    def loan(self, event: str) -> None:
        self.loans.inc(event=event)

    def _removed(self, worker: WorkerHandle, reason: str) -> None:
        self._set_role(worker, None)
        self.removals.inc(reason=reason)

    def _set_role(self, worker: WorkerHandle, current: str | None) -> None:
        for role in ROLES:
            self.role.set(1.0 if role == current else 0.0, worker=worker.key, role=role)
