"""Elastic pools: role labels follow the router's flips, and the operator's one corrective
flip keeps each role within its bounds."""

from __future__ import annotations

from pdserve.k8s.names import LABEL_ROLE
from pdserve.k8s.role_bounds import Flip, corrective_flip
from pdserve.k8s.role_labels import LabelPatch, label_patches, router_roles
from pdserve.k8s.spec import load_spec
from tests.k8s.resources import changed, cpu

ELASTIC = {"enabled": True, "prefill": {"min": 1, "max": 1}, "decode": {"min": 1, "max": 3}}


def _spec(elastic: dict = ELASTIC):
    return load_spec(changed(cpu(), "spec.elastic", elastic))  # 1 prefill + 2 decode


def _worker(name: str, role: str, state: str = "healthy", legs: int = 0) -> dict:
    return {"name": name, "url": f"http://{name}:8001", "role": role, "state": state,
            "legs": legs}


def _pod(name: str, role: str) -> dict:
    return {"metadata": {"name": name, "labels": {LABEL_ROLE: role, "other": "kept"}}}


def test_a_flipped_worker_gets_its_pods_role_label_patched() -> None:
    pods = [_pod("a", "prefill"), _pod("b", "decode"), _pod("c", "decode")]
    roles = router_roles([_worker("a", "decode"), _worker("b", "decode"),
                          _worker("c", "collocated")])
    assert label_patches(pods, roles) == (LabelPatch("a", "decode"),)
    assert LabelPatch("a", "decode").body() == {"metadata": {"labels": {LABEL_ROLE: "decode"}}}


def test_pods_the_router_does_not_list_keep_their_label() -> None:
    assert label_patches([_pod("new", "prefill")], {}) == ()


def test_within_bounds_nothing_flips() -> None:
    workers = [_worker("p", "prefill"), _worker("d1", "decode"), _worker("d2", "decode")]
    assert corrective_flip(_spec(), workers) is None


def test_above_a_max_the_least_busy_worker_of_that_role_flips_back() -> None:
    workers = [_worker("p1", "prefill", legs=3), _worker("p2", "prefill", legs=1),
               _worker("d", "decode")]
    assert corrective_flip(_spec(), workers) == Flip(
        "p2", "decode", "2 prefill workers, above spec.elastic.prefill.max 1")


def test_below_a_min_a_worker_of_the_other_role_flips_over() -> None:
    workers = [_worker("d1", "decode", legs=2), _worker("d2", "decode"),
               _worker("d3", "decode", legs=1)]
    assert corrective_flip(_spec(), workers) == Flip(
        "d2", "prefill", "0 prefill workers, below spec.elastic.prefill.min 1")


def test_nothing_flips_while_workers_join_flip_or_drain() -> None:
    spec = _spec()
    joining = [_worker("d1", "decode"), _worker("d2", "decode")]
    assert corrective_flip(spec, joining) is None  # the prefill worker has not joined yet
    for state in ("flipping", "draining", "unhealthy"):
        workers = [_worker("d1", "decode"), _worker("d2", "decode"),
                   _worker("d3", "decode", state=state)]
        assert corrective_flip(spec, workers) is None


def test_without_elastic_pools_nothing_flips() -> None:
    workers = [_worker("d1", "decode"), _worker("d2", "decode"), _worker("d3", "decode")]
    assert corrective_flip(_spec({"enabled": False}), workers) is None
