"""The pod templates of a cluster: one for each pool's workers, one for the router.

Workers: `pdserve worker --role POOL --host $(POD_IP) --register http://NAME-router-internal:
PORT --name $(POD_NAME)` (the command line written by `worker_argv`, as `pdserve up` writes
it), so a worker joins the router by itself once its model is loaded, heartbeats, and on
SIGTERM drains and leaves; the router reaches it at its pod IP, and its name in the router's
pool is its pod's name. `/health` answers 503 while the model loads and 200 once it serves: it
is the readiness probe, the startup probe (a first start converts SmolLM2 and compiles the CPU
operators: minutes) and the liveness probe after it. The router's `/health` is 200 only while
some decode worker can serve, so its readiness keeps clients away from a router without
workers; its liveness is its port.

Every container reads the cluster secret from the Secret `spec.secretName` (key `secret`),
mounted read-only; no argument or variable holds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pdserve.common.engine_options import Role
from pdserve.k8s.names import (
    LABEL_COMPONENT,
    LABEL_POOL,
    LABEL_ROLE,
    ROUTER,
    WORKER,
    base_labels,
    internal_service,
)
from pdserve.k8s.spec import ClusterSpec, PoolSpec
from pdserve.k8s.tensor_parallel import check_worker_tp
from pdserve.router.elastic_settings import ElasticSettings, elastic_to_args
from pdserve.workers.settings import WorkerLaunch, worker_argv

WORKER_PORT = 8001
KV_PORT = 8101
SECRET_DIR = "/etc/pdserve/secret"
SECRET_KEY = "secret"
SECRET_FILE = f"{SECRET_DIR}/{SECRET_KEY}"
CACHE_DIR = "/var/cache/pdserve"  # converted models and compiled CPU operators, per pod
HUGEPAGES_DIR = "/dev/hugepages"
GPU = "nvidia.com/gpu"
HUGEPAGES = "hugepages-2Mi"
DRAIN_S = 30  # the worker's --drain-timeout default: its grace period covers it
STARTUP_S = 900  # model conversion, CPU operator compilation and the load


def worker_args(spec: ClusterSpec, pool: PoolSpec) -> list[str]:
    check_worker_tp(pool, spec.device)
    launch = WorkerLaunch(
        role=Role(pool.role), model=spec.model.path,
        served_model_name=spec.model.served_model_name, dtype=spec.dtype, device=spec.device,
        host="$(POD_IP)", port=WORKER_PORT, kv_port=KV_PORT,
        transport=spec.interconnect.transport, secret_file=Path(SECRET_FILE),
        kv_encrypt=spec.interconnect.encryption, kv_congestion=spec.interconnect.congestion,
        kv_cache_memory=pool.kv_cache_memory,
        block_size=spec.interconnect.block_size,
        register=f"http://{internal_service(spec.name)}:{spec.router.port}",
        name="$(POD_NAME)", drain_timeout_s=float(DRAIN_S),
        tensor_parallel_size=pool.tensor_parallel_size,
        # as `pdserve up` gives a split layout's workers: local prompts beside streams in paced
        # chunks (workers/prefill_budget.py), which the router's split decision counts on
        slo_tpot_ms=spec.elastic.slo_tpot_ms, slo_itl_ms=spec.elastic.slo_itl_ms,
        slo_ttft_ms=None if spec.elastic.slo_itl_ms is None else spec.elastic.slo_ttft_ms)
    return ["worker", *worker_argv(launch)]


def router_args(spec: ClusterSpec) -> list[str]:
    argv = ["router", "--host", "0.0.0.0", "--port", str(spec.router.port),
            "--secret-file", SECRET_FILE, "--model", spec.model.path,
            "--policy", spec.router.routing_policy,
            "--slo-tpot-ms", f"{spec.elastic.slo_tpot_ms:g}"]
    if spec.model.served_model_name is not None:
        argv += ["--served-model-name", spec.model.served_model_name]
    if spec.elastic.enabled:
        argv += elastic_to_args(ElasticSettings(ttft_target_s=spec.elastic.slo_ttft_ms / 1000,
                                                tpot_target_s=spec.elastic.slo_tpot_ms / 1000))
    return argv


def _http_probe(port: str, period_s: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": "/health", "port": port}, "periodSeconds": period_s,
            "timeoutSeconds": 5, "failureThreshold": failures}


def _tcp_probe(port: str, period_s: int, failures: int) -> dict[str, Any]:
    return {"tcpSocket": {"port": port}, "periodSeconds": period_s, "timeoutSeconds": 5,
            "failureThreshold": failures}


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def worker_resources(spec: ClusterSpec, pool: PoolSpec) -> dict[str, Any]:
    """The pool's resources, with one GPU per tensor-parallel rank on cuda and the huge pages
    the interconnect reserves (requests equal to limits, as Kubernetes requires of both)."""
    requests, limits = dict(pool.requests), dict(pool.limits)
    where = f"spec.{pool.role}Pool.resources"
    if spec.device == "cuda":
        gpus = limits.setdefault(GPU, pool.tensor_parallel_size)
        if str(gpus) != str(pool.tensor_parallel_size):
            raise ValueError(f"{where}.limits.{GPU} is {gpus}, but a worker uses one GPU per "
                             f"tensor-parallel rank: {pool.tensor_parallel_size}")
    elif GPU in limits or GPU in requests:
        raise ValueError(f"{where} asks for {GPU}, but spec.device is cpu: set device: cuda, "
                         "or remove the GPUs")
    hugepages = spec.interconnect.hugepages
    if hugepages is not None:
        if not {"cpu", "memory"} & (set(requests) | set(limits)):
            raise ValueError(f"{where}: Kubernetes admits huge pages only beside a cpu or "
                             "memory request: add one")
        requests[HUGEPAGES] = limits[HUGEPAGES] = hugepages
    return {k: v for k, v in (("requests", requests), ("limits", limits)) if v}


def _volumes(spec: ClusterSpec, hugepages: bool) -> tuple[list[dict], list[dict]]:
    """(volumes, mounts) every container of the cluster has."""
    volumes: list[dict[str, Any]] = [
        {"name": "cluster-secret", "secret": {"secretName": spec.secret_name,
                                              "items": [{"key": SECRET_KEY,
                                                         "path": SECRET_KEY}],
                                              "defaultMode": 0o400}},
        {"name": "cache", "emptyDir": {}}]
    mounts: list[dict[str, Any]] = [
        {"name": "cluster-secret", "mountPath": SECRET_DIR, "readOnly": True},
        {"name": "cache", "mountPath": CACHE_DIR}]
    model = spec.model
    if model.claim_name is not None:
        volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": model.claim_name, "readOnly": True}})
    elif model.host_path is not None:
        volumes.append({"name": "model", "hostPath": {"path": model.host_path,
                                                      "type": "Directory"}})
    if model.has_volume:
        mounts.append({"name": "model", "mountPath": model.mount_path, "readOnly": True})
    if hugepages:
        volumes.append({"name": "hugepages", "emptyDir": {"medium": "HugePages"}})
        mounts.append({"name": "hugepages", "mountPath": HUGEPAGES_DIR})
    return volumes, mounts


def _pod(labels: dict[str, str], container: dict[str, Any], volumes: list[dict[str, Any]],
         grace_s: int, placement: PoolSpec | None = None) -> dict[str, Any]:
    pod: dict[str, Any] = {"containers": [container], "volumes": volumes,
                           "terminationGracePeriodSeconds": grace_s}
    if placement is not None and placement.node_selector:
        pod["nodeSelector"] = dict(placement.node_selector)
    if placement is not None and placement.tolerations:
        pod["tolerations"] = [dict(t) for t in placement.tolerations]
    return {"metadata": {"labels": labels}, "spec": pod}


def worker_template(spec: ClusterSpec, pool: PoolSpec) -> dict[str, Any]:
    volumes, mounts = _volumes(spec, spec.interconnect.hugepages is not None)
    container = {
        "name": WORKER, "image": spec.image, "imagePullPolicy": spec.pull_policy,
        "command": ["pdserve"], "args": worker_args(spec, pool),
        "env": [_field_env("POD_IP", "status.podIP"), _field_env("POD_NAME", "metadata.name"),
                {"name": "PDSERVE_CACHE_DIR", "value": CACHE_DIR}],
        "ports": [{"name": "http", "containerPort": WORKER_PORT},
                  {"name": "kv", "containerPort": KV_PORT}],
        "startupProbe": _http_probe("http", 10, STARTUP_S // 10),
        "readinessProbe": _http_probe("http", 5, 2),
        "livenessProbe": _http_probe("http", 10, 6),
        "volumeMounts": mounts,
    }
    resources = worker_resources(spec, pool)
    if resources:
        container["resources"] = resources
    labels = {**base_labels(spec.name), LABEL_COMPONENT: WORKER, LABEL_POOL: pool.role,
              LABEL_ROLE: pool.role}
    return _pod(labels, container, volumes, DRAIN_S + 15, placement=pool)


def router_template(spec: ClusterSpec) -> dict[str, Any]:
    volumes, mounts = _volumes(spec, hugepages=False)
    r = spec.router
    container = {
        "name": ROUTER, "image": spec.image, "imagePullPolicy": spec.pull_policy,
        "command": ["pdserve"], "args": router_args(spec),
        "env": [{"name": "PDSERVE_CACHE_DIR", "value": CACHE_DIR}],
        "ports": [{"name": "http", "containerPort": r.port}],
        "startupProbe": _tcp_probe("http", 5, 60),
        "readinessProbe": _http_probe("http", 5, 2),
        "livenessProbe": _tcp_probe("http", 10, 3),
        "volumeMounts": mounts,
    }
    resources = {k: dict(v) for k, v in (("requests", r.requests), ("limits", r.limits)) if v}
    if resources:
        container["resources"] = resources
    labels = {**base_labels(spec.name), LABEL_COMPONENT: ROUTER}
    return _pod(labels, container, volumes, 30)
