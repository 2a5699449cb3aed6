"""A cluster's status from what the operator observed: ready workers per pool (from the pool
Deployments), the router's ready replicas, ready workers by the role they serve now (from the
pods' role labels), the generation it reflects, and two conditions:
- `Valid`: whether the spec renders (False with render's message: the running children are
  left as they were).
- `Ready`: whether every wanted worker and the router are ready.
A condition's `lastTransitionTime` changes only when its status does. Pure: `now` is given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pdserve.k8s.names import LABEL_ROLE, POOLS, pool_name, router_name

Manifest = dict[str, Any]
Key = tuple[str, str]


def _deployment(children: Mapping[Key, Manifest], name: str) -> Manifest | None:
    return children.get(("Deployment", name))


def _ready(deployment: Manifest | None) -> int:
    return int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)


def _replicas(deployment: Manifest | None, wanted: int | None) -> int:
    if wanted is not None:
        return wanted
    return int(((deployment or {}).get("spec") or {}).get("replicas") or 0)


def pod_ready(pod: Manifest) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def role_counts(pods: Sequence[Manifest]) -> dict[str, int]:
    counts = dict.fromkeys(POOLS, 0)
    for pod in pods:
        role = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_ROLE)
        if role in counts and pod_ready(pod):
            counts[role] += 1
    return counts


def _condition(old: Sequence[Manifest], kind: str, ok: bool, reason: str, message: str,
               generation: int | None, now: str) -> Manifest:
    status = "True" if ok else "False"
    previous = next((c for c in old if c.get("type") == kind), None)
    since = previous["lastTransitionTime"] if previous and previous.get("status") == status \
        and previous.get("lastTransitionTime") else now
    condition = {"type": kind, "status": status, "reason": reason, "message": message,
                 "lastTransitionTime": since}
    if generation is not None:
        condition["observedGeneration"] = generation
    return condition


def aggregate(resource: Manifest, children: Mapping[Key, Manifest], pods: Sequence[Manifest],
              wanted: Mapping[str, int] | None, refusal: str | None, now: str) -> Manifest:
    """`wanted`: replicas per pool and for "router" from the spec (None when it was refused:
    then the Deployments' own counts)."""
    name = resource["metadata"]["name"]
    generation = resource["metadata"].get("generation")
    old = (resource.get("status") or {}).get("conditions") or []
    status: Manifest = {}
    parts, ready = [], True
    for pool in POOLS:
        d = _deployment(children, pool_name(name, pool))
        want, have = _replicas(d, (wanted or {}).get(pool)), _ready(d)
        status[f"{pool}Pool"] = {"replicas": want, "readyWorkers": have}
        parts.append(f"{pool} {have}/{want}")
        ready &= d is not None and have >= want
    d = _deployment(children, router_name(name))
    want, have = _replicas(d, (wanted or {}).get("router")), _ready(d)
    status["router"] = {"replicas": want, "readyReplicas": have}
    parts.append(f"router {have}/{want}")
    ready &= d is not None and have >= want
    status["roles"] = role_counts(pods)
    status["conditions"] = [
        _condition(old, "Valid", refusal is None, "Refused" if refusal else "Rendered",
                   refusal or "the spec renders", generation, now),
        _condition(old, "Ready", ready, "AllReady" if ready else "Waiting",
                   ", ".join(parts) + " ready", generation, now)]
    if generation is not None:
        status["observedGeneration"] = generation
    return status
