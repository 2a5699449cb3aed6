"""One look of the operator at one resource: observe its children, reconcile, act; and, with
elastic pools, bring the pods' role labels and the role bounds in line with the router.
Kubernetes-client-free (a `KubeApi` and a router client are given), so tests drive it against
stand-ins; `operator.py` registers `Handlers`' methods with kopf.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from typing import Any

from pdserve.internal_auth import InternalAuth
from pdserve.k8s.kube_api import KubeApi
from pdserve.k8s.names import internal_service
from pdserve.k8s.pods import SECRET_KEY
from pdserve.k8s.reconcile import Observed, Plan, reconcile
from pdserve.k8s.role_bounds import corrective_flip
from pdserve.k8s.role_labels import label_patches, router_roles
from pdserve.k8s.spec import ClusterSpec

log = logging.getLogger("pdserve.operator")
Manifest = dict[str, Any]
RouterCall = Callable[[str, str, "dict[str, Any] | None"], Any]  # method, path, body -> JSON


def reconcile_once(api: KubeApi, resource: Manifest, namespace: str, now: str,
                   model_config: str | None = None) -> Plan:
    cluster = resource["metadata"]["name"]
    observed = Observed(api.list_children(namespace, cluster), api.list_pods(namespace, cluster))
    plan = reconcile(resource, observed, now, model_config)
    for action in plan.actions:
        log.info("%s %s/%s: %s", type(action).__name__.lower(), *action.key, action.reason)
        api.execute(namespace, action)
    return plan


def router_url(spec: ClusterSpec, namespace: str) -> str:
    return f"http://{internal_service(spec.name)}.{namespace}.svc:{spec.router.port}"


def router_call(api: KubeApi, spec: ClusterSpec, namespace: str) -> RouterCall:
    """Signed calls to the cluster's router with the secret its Secret holds."""
    from pdserve.ctl.client import RouterClient

    secret = api.read_secret(namespace, spec.secret_name, SECRET_KEY)
    client = RouterClient(router_url(spec, namespace), InternalAuth(secret), timeout_s=330.0)
    return client.call


def sync_roles(api: KubeApi, spec: ClusterSpec, namespace: str, call: RouterCall) -> None:
    """Role labels after the router's flips, then at most one flip back inside the bounds."""
    workers = call("GET", "/internal/workers", None)
    for patch in label_patches(api.list_pods(namespace, spec.name), router_roles(workers)):
        log.info("pod %s now serves %s", patch.pod, patch.role)
        api.patch_pod_labels(namespace, patch)
    flip = corrective_flip(spec, workers)
    if flip is not None:
        log.info("flipping %s to %s: %s", flip.worker, flip.role, flip.reason)
        call("POST", f"/internal/workers/{flip.worker}/flip", {"role": flip.role})


class Handlers:
    """What each kopf handler does (`operator.py` registers these methods): `changed` on
    create, update and resume; `tick` every interval. Each writes the status, when it
    changed, into kopf's `patch` (a dict kopf sends as the resource's patch)."""

    def __init__(self, api: KubeApi, model_config: str | None = None,
                 router: Callable[[KubeApi, ClusterSpec, str], RouterCall] = router_call,
                 clock: Callable[[], str] | None = None) -> None:
        self.api, self.model_config, self.router = api, model_config, router
        self.clock = clock or _utc_now

    def _look(self, body: Manifest, namespace: str, patch: dict[str, Any]) -> Plan:
        plan = reconcile_once(self.api, dict(body), namespace, self.clock(), self.model_config)
        if plan.status != body.get("status"):  # an unchanged status is not written again
            patch["status"] = plan.status
        return plan

    def changed(self, body: Manifest, namespace: str, patch: dict[str, Any],
                **_: Any) -> None:
        self._look(body, namespace, patch)

    def tick(self, body: Manifest, namespace: str, patch: dict[str, Any], **_: Any) -> None:
        plan = self._look(body, namespace, patch)
        if plan.spec is None or not plan.spec.elastic.enabled:
            return
        try:
            sync_roles(self.api, plan.spec, namespace, self.router(self.api, plan.spec,
                                                                   namespace))
        except Exception as e:  # the router may be starting: the next tick tries again
            log.warning("%s/%s: role sync: %s", namespace, plan.spec.name, e)


def _utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
