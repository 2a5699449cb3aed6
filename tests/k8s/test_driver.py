"""The operator's thin layer, driven against a stand-in API: a look applies the plan and
writes the status, a second look changes nothing, a deleted child comes back, and elastic
pools get their role labels and bound flips from the router's list."""

from __future__ import annotations

import base64

import kubernetes
import pytest

from pdserve.k8s.driver import Handlers, reconcile_once, router_url
from pdserve.k8s.kube_api import KINDS
from pdserve.k8s.names import LABEL_ROLE, pool_selector
from pdserve.k8s.spec import load_spec
from tests.k8s.fake_cluster import fake_api
from tests.k8s.resources import as_server_would, changed, cpu

NOW = "2030-01-01T00:00:00Z"


def test_a_look_creates_the_children_and_a_second_changes_nothing() -> None:
    api, store = fake_api()
    resource = as_server_would(cpu())
    first = reconcile_once(api, resource, "serving", NOW)
    assert len(store.calls) == len(first.actions) == 8
    store.calls.clear()
    second = reconcile_once(api, resource, "serving", NOW)
    assert (second.actions, store.calls) == ((), [])
    assert second.status["conditions"][1]["status"] == "True"


def test_a_deleted_child_comes_back_and_a_scale_patches_one_child() -> None:
    api, store = fake_api()
    resource = as_server_would(cpu())
    reconcile_once(api, resource, "serving", NOW)
    del store.objects["Deployment", "smollm2-decode"]
    store.calls.clear()
    reconcile_once(api, resource, "serving", NOW)
    assert store.calls == [("apply", "Deployment/smollm2-decode")]
    store.calls.clear()
    reconcile_once(api, changed(resource, "spec.decodePool.replicas", 4), "serving", NOW)
    assert store.calls == [("apply", "Deployment/smollm2-decode")]
    assert store.objects["Deployment", "smollm2-decode"]["spec"]["replicas"] == 4


def test_the_changed_handler_writes_the_status_into_kopfs_patch() -> None:
    api, store = fake_api()
    store.auto_ready = False
    patch: dict = {}
    Handlers(api, clock=lambda: NOW).changed(body=as_server_would(cpu()), namespace="serving",
                                             patch=patch)
    assert patch["status"]["decodePool"] == {"replicas": 2, "readyWorkers": 0}
    assert patch["status"]["conditions"][1]["message"] == \
        "prefill 0/1, decode 0/2, router 0/1 ready"
    again: dict = {}
    Handlers(api, clock=lambda: NOW).changed(
        body={**as_server_would(cpu()), "status": patch["status"]}, namespace="serving",
        patch=again)
    assert again == {}  # the same status is not written twice


ELASTIC = {"enabled": True, "prefill": {"min": 1, "max": 1}, "decode": {"min": 1}}


def _with_pods(store, names_roles: dict[str, str]) -> None:
    for name, role in names_roles.items():
        labels = {**pool_selector("smollm2", role), LABEL_ROLE: role}
        store.pods[name] = {"metadata": {"name": name, "labels": labels}}


def test_the_timer_syncs_role_labels_and_flips_back_within_bounds() -> None:
    api, store = fake_api()
    _with_pods(store, {"p1": "prefill", "d1": "decode", "d2": "decode"})
    router_calls = []
    workers = [{"name": "p1", "role": "prefill", "state": "healthy", "legs": 0},
               {"name": "d1", "role": "prefill", "state": "healthy", "legs": 2},
               {"name": "d2", "role": "decode", "state": "healthy", "legs": 0}]

    def call(method: str, path: str, body: dict | None) -> object:
        router_calls.append((method, path, body))
        return workers if method == "GET" else {}

    handlers = Handlers(api, router=lambda *_: call, clock=lambda: NOW)
    handlers.tick(body=as_server_would(changed(cpu(), "spec.elastic", ELASTIC)),
                  namespace="serving", patch={})
    assert store.pods["d1"]["metadata"]["labels"][LABEL_ROLE] == "prefill"
    assert store.pods["p1"]["metadata"]["labels"][LABEL_ROLE] == "prefill"
    assert router_calls == [("GET", "/internal/workers", None),
                            ("POST", "/internal/workers/p1/flip", {"role": "decode"})]


def test_the_timer_leaves_the_router_alone_without_elastic_pools() -> None:
    api, _ = fake_api()

    def router(*_: object) -> None:
        raise AssertionError("no router call without elastic pools")

    Handlers(api, router=router, clock=lambda: NOW).tick(
        body=as_server_would(cpu()), namespace="serving", patch={})


def test_a_router_that_cannot_be_reached_does_not_fail_the_tick(caplog) -> None:
    api, _ = fake_api()

    def router(*_: object) -> None:
        raise OSError("connection refused")

    patch: dict = {}
    Handlers(api, router=router, clock=lambda: NOW).tick(
        body=as_server_would(changed(cpu(), "spec.elastic", ELASTIC)), namespace="serving",
        patch=patch)
    assert "status" in patch and "role sync: connection refused" in caplog.text


def test_the_router_is_reached_through_its_internal_service() -> None:
    spec = load_spec(cpu())
    assert router_url(spec, "serving") == "http://smollm2-router-internal.serving.svc:8000"


def test_the_secret_is_read_from_its_key() -> None:
    api, store = fake_api()
    store.secrets["s"] = {"data": {"secret": base64.b64encode(b"x" * 32).decode()}}
    assert api.read_secret("serving", "s", "secret") == b"x" * 32
    with pytest.raises(ValueError, match="Secret serving/s has no key 'other'"):
        api.read_secret("serving", "s", "other")


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_stand_in_uses_the_official_clients_method_names(kind: str) -> None:
    api, suffix = KINDS[kind]
    cls = {"apps_v1": kubernetes.client.AppsV1Api, "core_v1": kubernetes.client.CoreV1Api,
           "policy_v1": kubernetes.client.PolicyV1Api}[api]
    for verb in ("list", "patch", "delete"):
        assert callable(getattr(cls, f"{verb}_namespaced_{suffix}"))
    for name in ("list_namespaced_pod", "patch_namespaced_pod", "read_namespaced_secret"):
        assert callable(getattr(kubernetes.client.CoreV1Api, name))
