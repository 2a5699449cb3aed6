"""Elastic pools: the role label of each worker pod follows the role its worker serves.

The router flips workers between prefill and decode in memory (no restart); the pod that
runs a flipped worker keeps its pool (its Deployment selects on the pool label, so nothing is
recreated) and gets its role label rewritten, so `kubectl get pods -L pdserve.dev/role` and
the status's `roles` say what serves what. A worker's name in the router's pool is its pod's
name (`--name $(POD_NAME)`). Pure: the operator fetches the router's list and applies the
patches.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.k8s.names import LABEL_ROLE, POOLS


@dataclass(frozen=True)
class LabelPatch:
    pod: str
    role: str

    def __post_init__(self) -> None:
        if self.role not in POOLS:
            raise ValueError(f"a pod's role label is one of {POOLS}, got {self.role!r}")

    def body(self) -> dict[str, Any]:
        return {"metadata": {"labels": {LABEL_ROLE: self.role}}}


def router_roles(workers: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """Worker name -> role, from the router's `GET /internal/workers` answer."""
    return {str(w["name"]): str(w["role"]) for w in workers if "name" in w and "role" in w}


def label_patches(pods: Sequence[Mapping[str, Any]], roles: Mapping[str, str]
                  ) -> tuple[LabelPatch, ...]:
    """One patch per pod whose label differs from the role the router says it serves (pods
    the router does not list, or lists in another role than prefill or decode, keep theirs)."""
    patches = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        role = roles.get(meta.get("name", ""))
        if role in POOLS and (meta.get("labels") or {}).get(LABEL_ROLE) != role:
            patches.append(LabelPatch(meta["name"], role))
    return tuple(patches)
