"""kopf's registration of the operator's handlers (`pdserve operator` runs this registry)."""

from __future__ import annotations

from pdserve.k8s.operator import build_registry
from pdserve.k8s.operator_settings import OperatorSettings
from tests.k8s.fake_cluster import fake_api


def test_the_registry_reconciles_on_changes_and_on_a_timer() -> None:
    registry = build_registry(OperatorSettings(interval_s=7.0), fake_api()[0])
    changing = {h.id: h for h in registry._changing.get_all_handlers()}
    assert sorted(changing) == ["reconcile-on-create", "reconcile-on-resume",
                                "reconcile-on-update"]
    (timer,) = registry._spawning.get_all_handlers()
    assert (timer.id, timer.interval) == ("reconcile-on-timer", 7.0)
    for handler in [*changing.values(), timer]:
        selector = handler.selector
        assert (selector.group, selector.version, selector.any_name) == (
            "pdserve.dev", "v1alpha1", "disaggregatedservingclusters")
