"""The names a DisaggregatedServingCluster and its children go by.

One resource NAME owns: the router Deployment `NAME-router`, the client Service `NAME`, the
registration Service `NAME-router-internal`, the pool Deployments `NAME-prefill` and
`NAME-decode`, their PodDisruptionBudgets (same names), and the headless Service
`NAME-workers`. Every child carries `LABEL_INSTANCE: NAME` and `LABEL_MANAGED_BY`; pods also
carry their component, their pool (fixed: the Deployment selects on it) and their role (the
pool's at start; with elastic pools the operator rewrites it to the role the router gave the
worker, which the Deployment never selects on, so no pod is recreated by it).
"""

from __future__ import annotations

import re

GROUP = "pdserve.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "DisaggregatedServingCluster"
PLURAL = "disaggregatedservingclusters"
SINGULAR = "disaggregatedservingcluster"
SHORT_NAMES = ("dsc",)

LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_POOL = f"{GROUP}/pool"
LABEL_ROLE = f"{GROUP}/role"
ANNOTATION_HASH = f"{GROUP}/rendered-hash"
MANAGER = "pdserve"

POOLS = ("prefill", "decode")
ROUTER, WORKER = "router", "worker"
INTERNAL_SUFFIX = "-router-internal"  # the longest suffix a child adds to NAME
DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_NAME = 63 - len(INTERNAL_SUFFIX)


def check_cluster_name(name: object) -> str:
    """`name` if every child's name is a valid Service name (RFC 1035 label, at most 63)."""
    if not isinstance(name, str) or not DNS_LABEL.fullmatch(name) or len(name) > MAX_NAME:
        raise ValueError(f"metadata.name must be lower-case letters, digits and '-', start with "
                         f"a letter, end with a letter or digit, and be at most {MAX_NAME} "
                         f"characters (its Services add up to '{INTERNAL_SUFFIX}'), got "
                         f"{name!r}")
    return name


def router_name(cluster: str) -> str:
    return f"{cluster}-router"


def client_service(cluster: str) -> str:
    return cluster


def internal_service(cluster: str) -> str:
    return cluster + INTERNAL_SUFFIX


def pool_name(cluster: str, pool: str) -> str:
    return f"{cluster}-{pool}"


def workers_service(cluster: str) -> str:
    return f"{cluster}-workers"


def base_labels(cluster: str) -> dict[str, str]:
    """What every child carries: the operator lists its children by these."""
    return {LABEL_NAME: "pdserve", LABEL_INSTANCE: cluster, LABEL_MANAGED_BY: MANAGER}


def router_selector(cluster: str) -> dict[str, str]:
    return {LABEL_INSTANCE: cluster, LABEL_COMPONENT: ROUTER}


def worker_selector(cluster: str) -> dict[str, str]:
    return {LABEL_INSTANCE: cluster, LABEL_COMPONENT: WORKER}


def pool_selector(cluster: str, pool: str) -> dict[str, str]:
    return {**worker_selector(cluster), LABEL_POOL: pool}


def selector_string(labels: dict[str, str]) -> str:
    """`labels` as a label selector query (`a=b,c=d`)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
