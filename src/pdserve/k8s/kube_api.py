"""The operator's calls to the Kubernetes API, over the official client's typed APIs.

Children are written with server-side apply under the field manager `pdserve` (forced: the
operator owns what it renders), so applying a manifest creates a missing child, changes only
what the manifest changed, and drops a field the manifest no longer sets, while fields that
others own (the API server's defaults, a Deployment's status) stay. Reads come back in the
API's own JSON shape (camelCase, as `kubectl get -o json` prints).

`apis` maps "apps_v1", "core_v1" and "policy_v1" to the client's `AppsV1Api`, `CoreV1Api` and
`PolicyV1Api` (or stand-ins with the same methods); `to_json` turns what they return into
plain dicts (the client's `ApiClient.sanitize_for_serialization`).
"""

from __future__ import annotations

import base64
from collections.abc import Callable, Mapping
from typing import Any

from pdserve.k8s.names import base_labels, selector_string, worker_selector
from pdserve.k8s.reconcile import Action, Apply, Delete
from pdserve.k8s.role_labels import LabelPatch

Manifest = dict[str, Any]
Key = tuple[str, str]
FIELD_MANAGER = "pdserve"
APPLY = "application/apply-patch+yaml"
# kind -> (which API, the suffix of its *_namespaced_* methods)
KINDS = {"Deployment": ("apps_v1", "deployment"), "Service": ("core_v1", "service"),
         "PodDisruptionBudget": ("policy_v1", "pod_disruption_budget")}


class KubeApi:
    def __init__(self, apis: Mapping[str, Any], to_json: Callable[[Any], Any]) -> None:
        self.apis, self.to_json = apis, to_json

    def _method(self, kind: str, verb: str) -> Callable[..., Any]:
        api, suffix = KINDS[kind]
        return getattr(self.apis[api], f"{verb}_namespaced_{suffix}")

    def list_children(self, namespace: str, cluster: str) -> dict[Key, Manifest]:
        """Every child of `cluster` by its labels, keyed by (kind, name)."""
        selector = selector_string(base_labels(cluster))
        children = {}
        for kind in KINDS:
            listed = self.to_json(self._method(kind, "list")(namespace,
                                                             label_selector=selector))
            for item in listed.get("items") or []:
                children[kind, item["metadata"]["name"]] = {"kind": kind, **item}
        return children

    def list_pods(self, namespace: str, cluster: str) -> tuple[Manifest, ...]:
        listed = self.to_json(self.apis["core_v1"].list_namespaced_pod(
            namespace, label_selector=selector_string(worker_selector(cluster))))
        return tuple(listed.get("items") or [])

    def apply(self, namespace: str, manifest: Manifest) -> None:
        body = {**manifest, "metadata": {**manifest["metadata"], "namespace": namespace}}
        self._method(manifest["kind"], "patch")(
            manifest["metadata"]["name"], namespace, body, field_manager=FIELD_MANAGER,
            force=True, _content_type=APPLY)

    def delete(self, namespace: str, kind: str, name: str) -> None:
        self._method(kind, "delete")(name, namespace)

    def execute(self, namespace: str, action: Action) -> None:
        if isinstance(action, Apply):
            self.apply(namespace, action.manifest)
        elif isinstance(action, Delete):
            self.delete(namespace, action.kind, action.name)

    def patch_pod_labels(self, namespace: str, patch: LabelPatch) -> None:
        self.apis["core_v1"].patch_namespaced_pod(patch.pod, namespace, patch.body())

    def read_secret(self, namespace: str, name: str, key: str) -> bytes:
        secret = self.to_json(self.apis["core_v1"].read_namespaced_secret(name, namespace))
        data = (secret.get("data") or {}).get(key)
        if data is None:
            raise ValueError(f"Secret {namespace}/{name} has no key {key!r}")
        return base64.b64decode(data)


def from_environment() -> KubeApi:
    """The API the operator runs against: in-cluster credentials (its ServiceAccount) when
    it runs in a pod, else the current kubeconfig context."""
    import kubernetes

    try:
        kubernetes.config.load_incluster_config()
    except kubernetes.config.ConfigException:
        kubernetes.config.load_kube_config()
    client = kubernetes.client.ApiClient()
    apis = {"apps_v1": kubernetes.client.AppsV1Api(client),
            "core_v1": kubernetes.client.CoreV1Api(client),
            "policy_v1": kubernetes.client.PolicyV1Api(client)}
    return KubeApi(apis, client.sanitize_for_serialization)
