"""The operator's reconcile, a pure function from (resource, observed children) to a plan:
what it creates, scales, changes and deletes, what it never touches, and the status it
writes."""

from __future__ import annotations

import copy

import pytest

from pdserve.k8s.names import ANNOTATION_HASH, LABEL_ROLE
from pdserve.k8s.reconcile import Apply, Delete, Observed, desired, key_of, reconcile
from pdserve.k8s.spec import load_spec
from tests.k8s.resources import as_server_would, changed, cpu

NOW, LATER = "2030-01-01T00:00:00Z", "2030-01-01T00:05:00Z"


def _running(resource: dict, ready: dict[str, int] | None = None) -> dict:
    """The children as the API would return them once `resource` was applied: (kind, name)
    -> object, each Deployment with `ready` ready replicas (default: all)."""
    children = {}
    for m in desired(resource, load_spec(resource)):
        m = copy.deepcopy(m)
        if m["kind"] == "Deployment":
            want = m["spec"]["replicas"]
            m["status"] = {"readyReplicas": (ready or {}).get(m["metadata"]["name"], want)}
        children[key_of(m)] = m
    return children


def _summary(plan) -> list[tuple[str, str, str, str]]:
    return [(type(a).__name__, *a.key, a.reason) for a in plan.actions]


def test_a_new_resource_creates_every_child_owned_and_stamped() -> None:
    resource = as_server_would(cpu())
    plan = reconcile(resource, Observed(), NOW)
    assert [(kind, reason) for _, kind, _, reason in _summary(plan)] == [
        ("Service", "missing"), ("Service", "missing"), ("Deployment", "missing"),
        ("Service", "missing"), ("Deployment", "missing"), ("PodDisruptionBudget", "missing"),
        ("Deployment", "missing"), ("PodDisruptionBudget", "missing")]
    for action in plan.actions:
        meta = action.manifest["metadata"]
        assert meta["ownerReferences"] == [{
            "apiVersion": "pdserve.dev/v1alpha1", "kind": "DisaggregatedServingCluster",
            "name": "smollm2", "uid": "uid-1", "controller": True, "blockOwnerDeletion": True}]
        assert len(meta["annotations"][ANNOTATION_HASH]) == 16
    assert plan.status["conditions"][1]["status"] == "False"  # nothing is ready yet


def test_children_as_rendered_need_nothing() -> None:
    resource = as_server_would(cpu())
    plan = reconcile(resource, Observed(_running(resource)), NOW)
    assert plan.actions == ()


def test_scale_up_patches_only_the_pool_replicas() -> None:
    before = as_server_would(cpu())
    after = changed(before, "spec.prefillPool.replicas", 3)
    plan = reconcile(after, Observed(_running(before)), NOW)
    assert _summary(plan) == [("Apply", "Deployment", "smollm2-prefill", "scaled 1 -> 3")]
    assert plan.actions[0].manifest["spec"]["replicas"] == 3


def test_scale_down_to_zero_drops_the_pools_disruption_budget() -> None:
    before = as_server_would(cpu())
    after = changed(before, "spec.prefillPool.replicas", 0)
    plan = reconcile(after, Observed(_running(before)), NOW)
    assert _summary(plan) == [
        ("Apply", "Deployment", "smollm2-prefill", "scaled 1 -> 0"),
        ("Delete", "PodDisruptionBudget", "smollm2-prefill", "no longer rendered")]


def test_a_spec_change_rolls_what_it_renders_differently() -> None:
    before = as_server_would(cpu())
    after = changed(before, "spec.dtype", "float32")
    plan = reconcile(after, Observed(_running(before)), NOW)
    assert _summary(plan) == [("Apply", "Deployment", "smollm2-prefill", "changed"),
                              ("Apply", "Deployment", "smollm2-decode", "changed")]
    args = plan.actions[0].manifest["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--dtype") + 1] == "float32"


def test_a_deleted_child_is_created_again() -> None:
    resource = as_server_would(cpu())
    children = _running(resource)
    del children["Deployment", "smollm2-router"]
    del children["Service", "smollm2-workers"]
    plan = reconcile(resource, Observed(children), NOW)
    assert _summary(plan) == [("Apply", "Deployment", "smollm2-router", "missing"),
                              ("Apply", "Service", "smollm2-workers", "missing")]


def test_a_child_edited_by_hand_is_put_back() -> None:
    resource = as_server_would(cpu())
    children = _running(resource)
    children["Service", "smollm2"]["metadata"]["annotations"][ANNOTATION_HASH] = "edited"
    assert _summary(reconcile(resource, Observed(children), NOW)) == [
        ("Apply", "Service", "smollm2", "changed")]


def test_only_children_it_owns_are_deleted() -> None:
    resource = as_server_would(cpu())
    children = _running(resource)
    stale = copy.deepcopy(children["Service", "smollm2-workers"])
    stale["metadata"]["name"] = "smollm2-old"
    foreign = copy.deepcopy(stale)
    foreign["metadata"]["name"] = "smollm2-foreign"
    foreign["metadata"]["ownerReferences"][0]["uid"] = "another-resource"
    unowned = copy.deepcopy(stale)
    unowned["metadata"]["name"] = "smollm2-by-hand"
    del unowned["metadata"]["ownerReferences"]
    for child in (stale, foreign, unowned):
        children[key_of(child)] = child
    plan = reconcile(resource, Observed(children), NOW)
    assert _summary(plan) == [("Delete", "Service", "smollm2-old", "no longer rendered")]
    assert isinstance(plan.actions[0], Delete)


def test_a_refused_spec_changes_no_child_and_says_why() -> None:
    before = as_server_would(cpu())
    after = changed(before, "spec.router.replicas", 2)
    plan = reconcile(after, Observed(_running(before)), NOW)
    assert plan.actions == () and plan.spec is None
    valid = plan.status["conditions"][0]
    assert (valid["type"], valid["status"], valid["reason"]) == ("Valid", "False", "Refused")
    assert valid["message"].startswith("spec.router.replicas must be 1, got 2")
    assert plan.status["decodePool"] == {"replicas": 2, "readyWorkers": 2}  # still running


def _pod(name: str, role: str, ready: bool = True) -> dict:
    return {"metadata": {"name": name, "labels": {LABEL_ROLE: role}},
            "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_status_aggregates_ready_workers_per_pool_and_per_role() -> None:
    resource = as_server_would(cpu(), generation=7)
    children = _running(resource, ready={"smollm2-decode": 1})
    pods = (_pod("p-1", "prefill"), _pod("d-1", "decode"), _pod("d-2", "decode", ready=False))
    status = reconcile(resource, Observed(children, pods), NOW).status
    assert status["prefillPool"] == {"replicas": 1, "readyWorkers": 1}
    assert status["decodePool"] == {"replicas": 2, "readyWorkers": 1}
    assert status["router"] == {"replicas": 1, "readyReplicas": 1}
    assert status["roles"] == {"prefill": 1, "decode": 1}
    assert status["observedGeneration"] == 7
    valid, ready = status["conditions"]
    assert (valid["type"], valid["status"], valid["observedGeneration"]) == ("Valid", "True", 7)
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "Waiting")
    assert ready["message"] == "prefill 1/1, decode 1/2, router 1/1 ready"


def test_a_condition_keeps_its_transition_time_until_its_status_changes() -> None:
    resource = as_server_would(cpu())
    waiting = reconcile(resource, Observed(_running(resource, {"smollm2-decode": 1})), NOW)
    resource["status"] = waiting.status
    still = reconcile(resource, Observed(_running(resource, {"smollm2-decode": 1})), LATER)
    assert still.status["conditions"][1]["lastTransitionTime"] == NOW
    resource["status"] = still.status
    ready = reconcile(resource, Observed(_running(resource)), LATER)
    assert ready.status["conditions"][1]["status"] == "True"
    assert ready.status["conditions"][1]["lastTransitionTime"] == LATER
    assert ready.status["conditions"][0]["lastTransitionTime"] == NOW  # Valid all along


@pytest.mark.parametrize("field", ["spec.image", "spec.router.routingPolicy"])
def test_applied_manifests_are_the_rendered_ones(field: str) -> None:
    value = "pdserve:1.2" if field == "spec.image" else "prefix"
    resource = as_server_would(changed(cpu(), field, value))
    applied = {a.key: a.manifest for a in reconcile(resource, Observed(), NOW).actions
               if isinstance(a, Apply)}
    assert applied == {key_of(m): m for m in desired(resource, load_spec(resource))}
