"""Elastic pools: the operator's guard on `spec.elastic.prefill` and `.decode` (min, max).

The router's controller flips workers between the roles from the pools' pressure; it keeps
one worker of each role, and knows nothing of the resource's bounds. The operator compares
the router's pool with them and, when a role holds more workers than its max or fewer than
its min, flips one worker back (through the router's flip endpoint, the one `pdserve ctl
flip` uses): at most one flip per look, and only when every worker of the spec has joined and
none is flipping, draining or unhealthy (a pool still starting is not below its min). The
spec's checks (`spec.py`) keep the bounds satisfiable: each pool's replicas lie within its
bounds, so one flip away from a broken bound never breaks the other role's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.k8s.spec import ClusterSpec

HEALTHY = "healthy"


@dataclass(frozen=True)
class Flip:
    worker: str
    role: str
    reason: str


def _count(workers: Sequence[Mapping[str, Any]], role: str) -> int:
    return sum(1 for w in workers if w.get("role") == role)


def _pick(workers: Sequence[Mapping[str, Any]], role: str) -> str:
    """The worker of `role` with the fewest legs in flight (then by name)."""
    chosen = min((w for w in workers if w.get("role") == role),
                 key=lambda w: (int(w.get("legs") or 0), str(w["name"])))
    return str(chosen["name"])


def corrective_flip(spec: ClusterSpec, workers: Sequence[Mapping[str, Any]]) -> Flip | None:
    """`workers`: the router's `GET /internal/workers` list."""
    total = spec.prefill.replicas + spec.decode.replicas
    if not spec.elastic.enabled or len(workers) != total \
            or any(w.get("state") != HEALTHY for w in workers):
        return None
    counts = {role: _count(workers, role) for role in ("prefill", "decode")}
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        bounds = spec.elastic.bounds(role)
        if bounds.max is not None and counts[role] > bounds.max:
            return Flip(_pick(workers, role), other,
                        f"{counts[role]} {role} workers, above spec.elastic.{role}.max "
                        f"{bounds.max}")
        if counts[role] < bounds.min and counts[other] > 0:
            return Flip(_pick(workers, other), role,
                        f"{counts[role]} {role} workers, below spec.elastic.{role}.min "
                        f"{bounds.min}")
    return None
