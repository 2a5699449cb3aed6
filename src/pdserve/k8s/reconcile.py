"""The operator's decisions, as a pure function: (resource, observed children) -> a plan.

The desired children are `render`'s manifests (the function `pdserve k8s render` uses), each
owned by the resource (an owner reference: Kubernetes deletes them with it) and stamped with a
hash of everything in it but a Deployment's replicas. A child is applied when it is missing,
when its hash differs (the spec changed what it renders: a new pod template rolls the pool),
or when only its replicas differ (a scale: no pod is replaced). A child the operator owns that
the spec no longer renders is deleted; nothing is ever deleted that another owner's reference,
or none, marks as not ours. A spec that does not render changes no child: the plan only says
why, in the status.

`observed.children` holds what the operator found by the children's labels, keyed by (kind,
name), in the API's own shape (a Deployment's `status.readyReplicas` included).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.k8s.names import ANNOTATION_HASH, API_VERSION, KIND
from pdserve.k8s.render import render_spec
from pdserve.k8s.spec import ClusterSpec, load_spec
from pdserve.k8s.status import aggregate

Manifest = dict[str, Any]
Key = tuple[str, str]


@dataclass(frozen=True)
class Apply:
    manifest: Manifest
    reason: str  # "missing", "changed" or "scaled A -> B"

    @property
    def key(self) -> Key:
        return key_of(self.manifest)


@dataclass(frozen=True)
class Delete:
    kind: str
    name: str
    reason: str

    @property
    def key(self) -> Key:
        return self.kind, self.name


Action = Apply | Delete


@dataclass(frozen=True)
class Observed:
    children: Mapping[Key, Manifest] = field(default_factory=dict)
    pods: tuple[Manifest, ...] = ()


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    status: Manifest
    spec: ClusterSpec | None  # None: the spec was refused (status says why)


def key_of(manifest: Manifest) -> Key:
    return manifest["kind"], manifest["metadata"]["name"]


def owner_reference(resource: Manifest) -> Manifest:
    meta = resource["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def rendered_hash(manifest: Manifest) -> str:
    """sha256 of the manifest without its replicas, in a stable JSON form."""
    body = copy.deepcopy(manifest)
    body.get("spec", {}).pop("replicas", None)
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def desired(resource: Manifest, spec: ClusterSpec, model_config: str | None = None
            ) -> list[Manifest]:
    """render's manifests, owned by `resource` and stamped with their hash."""
    out = []
    for manifest in render_spec(spec, model_config):
        m = copy.deepcopy(manifest)
        m["metadata"]["ownerReferences"] = [owner_reference(resource)]
        m["metadata"].setdefault("annotations", {})[ANNOTATION_HASH] = rendered_hash(m)
        out.append(m)
    return out


def _replicas(manifest: Manifest) -> int | None:
    return (manifest.get("spec") or {}).get("replicas")


def _change(want: Manifest, have: Manifest | None) -> str | None:
    """Why `want` must be applied over `have`, or None when it need not be."""
    if have is None:
        return "missing"
    annotations = (have.get("metadata") or {}).get("annotations") or {}
    if annotations.get(ANNOTATION_HASH) != want["metadata"]["annotations"][ANNOTATION_HASH]:
        return "changed"
    if _replicas(want) != _replicas(have):
        return f"scaled {_replicas(have)} -> {_replicas(want)}"
    return None


def _owned_by(child: Manifest, uid: str) -> bool:
    refs = (child.get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("uid") == uid and r.get("controller") for r in refs)


def child_actions(resource: Manifest, wanted: list[Manifest],
                  children: Mapping[Key, Manifest]) -> list[Action]:
    actions: list[Action] = []
    for want in wanted:
        why = _change(want, children.get(key_of(want)))
        if why is not None:
            actions.append(Apply(want, why))
    keep = {key_of(m) for m in wanted}
    uid = resource["metadata"]["uid"]
    for key in sorted(children):
        if key not in keep and _owned_by(children[key], uid):
            actions.append(Delete(*key, reason="no longer rendered"))
    return actions


def wanted_replicas(spec: ClusterSpec) -> dict[str, int]:
    return {"prefill": spec.prefill.replicas, "decode": spec.decode.replicas,
            "router": spec.router.replicas}


def reconcile(resource: Manifest, observed: Observed, now: str,
              model_config: str | None = None) -> Plan:
    """The actions that bring the children to the spec, and the status to write."""
    try:
        spec = load_spec(resource)
        wanted = desired(resource, spec, model_config)
    except ValueError as e:
        status = aggregate(resource, observed.children, observed.pods, None, str(e), now)
        return Plan((), status, None)
    actions = child_actions(resource, wanted, observed.children)
    status = aggregate(resource, observed.children, observed.pods, wanted_replicas(spec),
                       None, now)
    return Plan(tuple(actions), status, spec)
