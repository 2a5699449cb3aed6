"""A stand-in for the Kubernetes API behind `KubeApi`: typed-API objects with the official
client's method names, over one in-memory store. Server-side apply replaces what the manifest
sets and keeps `status`; a Deployment becomes ready at once unless told otherwise."""

from __future__ import annotations

import copy
from typing import Any

from pdserve.k8s.kube_api import APPLY, FIELD_MANAGER, KINDS, KubeApi


class Store:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}
        self.secrets: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []
        self.auto_ready = True

    def matches(self, labels: dict[str, str], selector: str) -> bool:
        wanted = dict(part.split("=", 1) for part in selector.split(","))
        return all(labels.get(k) == v for k, v in wanted.items())


class TypedApi:
    def __init__(self, store: Store, kinds: dict[str, str]) -> None:
        self.store = store
        for kind, suffix in kinds.items():
            setattr(self, f"list_namespaced_{suffix}", self._lister(kind))
            setattr(self, f"patch_namespaced_{suffix}", self._applier(kind))
            setattr(self, f"delete_namespaced_{suffix}", self._deleter(kind))

    def _lister(self, kind: str):
        def list_(namespace: str, label_selector: str) -> dict[str, Any]:
            items = [copy.deepcopy({k: v for k, v in o.items() if k != "kind"})
                     for (k, _), o in sorted(self.store.objects.items()) if k == kind and
                     self.store.matches(o["metadata"].get("labels", {}), label_selector)]
            return {"items": items}
        return list_

    def _applier(self, kind: str):
        def apply(name: str, namespace: str, body: dict, field_manager: str, force: bool,
                  _content_type: str) -> None:
            assert (field_manager, force, _content_type) == (FIELD_MANAGER, True, APPLY)
            assert body["kind"] == kind and body["metadata"]["name"] == name
            old = self.store.objects.get((kind, name), {})
            new = copy.deepcopy(body)
            if "status" in old:
                new["status"] = old["status"]
            if kind == "Deployment" and self.store.auto_ready:
                new["status"] = {"readyReplicas": new["spec"]["replicas"]}
            self.store.objects[kind, name] = new
            self.store.calls.append(("apply", f"{kind}/{name}"))
        return apply

    def _deleter(self, kind: str):
        def delete(name: str, namespace: str) -> None:
            del self.store.objects[kind, name]
            self.store.calls.append(("delete", f"{kind}/{name}"))
        return delete


class CoreApi(TypedApi):
    def list_namespaced_pod(self, namespace: str, label_selector: str) -> dict[str, Any]:
        return {"items": [copy.deepcopy(p) for p in self.store.pods.values()
                          if self.store.matches(p["metadata"]["labels"], label_selector)]}

    def patch_namespaced_pod(self, name: str, namespace: str, body: dict) -> None:
        self.store.pods[name]["metadata"]["labels"].update(body["metadata"]["labels"])
        self.store.calls.append(("label", name))

    def read_namespaced_secret(self, name: str, namespace: str) -> dict[str, Any]:
        return copy.deepcopy(self.store.secrets[name])


def fake_api() -> tuple[KubeApi, Store]:
    store = Store()
    by_api: dict[str, dict[str, str]] = {}
    for kind, (api, suffix) in KINDS.items():
        by_api.setdefault(api, {})[kind] = suffix
    apis = {"apps_v1": TypedApi(store, by_api["apps_v1"]),
            "core_v1": CoreApi(store, by_api["core_v1"]),
            "policy_v1": TypedApi(store, by_api["policy_v1"])}
    return KubeApi(apis, copy.deepcopy), store
