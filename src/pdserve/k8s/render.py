"""One DisaggregatedServingCluster -> the plain manifests that run it. `pdserve k8s render`
prints them for `kubectl apply`; the operator applies the very same (`reconcile.py`), so the
two ways to run a cluster never differ.

The manifests, in apply order: the router's registration Service, client Service and
Deployment; the headless Service of the workers; each pool's Deployment and, for a pool with
workers, its PodDisruptionBudget (at most one worker of a pool drained at a time). The Secret
is referenced, never rendered: it holds the cluster secret, which no manifest should carry.
"""

from __future__ import annotations

from typing import Any

from pdserve.k8s.names import (
    base_labels,
    client_service,
    internal_service,
    pool_name,
    pool_selector,
    router_name,
    router_selector,
    worker_selector,
    workers_service,
)
from pdserve.k8s.pods import KV_PORT, WORKER_PORT, router_template, worker_template
from pdserve.k8s.spec import ClusterSpec, PoolSpec, load_spec
from pdserve.k8s.tensor_parallel import check_heads, model_shape

Manifest = dict[str, Any]


def render(resource: Any, model_config: str | None = None) -> list[Manifest]:
    """ValueError naming the field for anything the schema or the checks refuse."""
    return render_spec(load_spec(resource), model_config)


def render_spec(spec: ClusterSpec, model_config: str | None = None) -> list[Manifest]:
    shape = model_shape(spec.model.path, model_config)
    if shape is not None:
        for pool in spec.pools:
            check_heads(pool, shape)
    manifests = [_internal_service(spec), _client_service(spec), _router_deployment(spec),
                 _workers_service(spec)]
    for pool in spec.pools:
        manifests.append(_pool_deployment(spec, pool))
        if pool.replicas > 0:
            manifests.append(_disruption_budget(spec, pool))
    return manifests


def _meta(spec: ClusterSpec, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "labels": {**base_labels(spec.name), **(labels or {})}}
    if spec.namespace:
        meta["namespace"] = spec.namespace
    return meta


def _service(spec: ClusterSpec, name: str, selector: dict[str, str], ports: list[dict],
             **extra: Any) -> Manifest:
    return {"apiVersion": "v1", "kind": "Service", "metadata": _meta(spec, name),
            "spec": {"selector": selector, "ports": ports, **extra}}


def _router_port(spec: ClusterSpec) -> list[dict[str, Any]]:
    return [{"name": "http", "port": spec.router.port, "targetPort": "http"}]


def _client_service(spec: ClusterSpec) -> Manifest:
    return _service(spec, client_service(spec.name), router_selector(spec.name),
                    _router_port(spec), type=spec.router.service_type)


def _internal_service(spec: ClusterSpec) -> Manifest:
    """Where workers register: reaches the router before it is ready, since it turns ready
    only once workers have joined."""
    return _service(spec, internal_service(spec.name), router_selector(spec.name),
                    _router_port(spec), type="ClusterIP", publishNotReadyAddresses=True)


def _workers_service(spec: ClusterSpec) -> Manifest:
    """Headless: DNS lists every ready worker's address (metrics scrapers, debugging)."""
    ports = [{"name": "http", "port": WORKER_PORT, "targetPort": "http"},
             {"name": "kv", "port": KV_PORT, "targetPort": "kv"}]
    return _service(spec, workers_service(spec.name), worker_selector(spec.name), ports,
                    clusterIP="None")


def _router_deployment(spec: ClusterSpec) -> Manifest:
    selector = router_selector(spec.name)
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(spec, router_name(spec.name), selector),
            "spec": {"replicas": spec.router.replicas, "selector": {"matchLabels": selector},
                     "template": router_template(spec)}}


def _pool_deployment(spec: ClusterSpec, pool: PoolSpec) -> Manifest:
    """Rolling updates replace one worker at a time and add none: a pool's devices are
    usually all taken by its workers."""
    selector = pool_selector(spec.name, pool.role)
    strategy = {"type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return {"apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": _meta(spec, pool_name(spec.name, pool.role), selector),
            "spec": {"replicas": pool.replicas, "selector": {"matchLabels": selector},
                     "strategy": strategy, "template": worker_template(spec, pool)}}


def _disruption_budget(spec: ClusterSpec, pool: PoolSpec) -> Manifest:
    selector = pool_selector(spec.name, pool.role)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _meta(spec, pool_name(spec.name, pool.role), selector),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}}}
