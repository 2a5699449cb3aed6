"""`pdserve operator`: kopf handlers over the pure reconcile (`driver.Handlers`).

Only `pdserve operator` imports this module (kopf is the `k8s` extra). On create, update and
resume a resource is reconciled at once; every `interval_s` again (a deleted or edited child
comes back; the status follows the pods) and, with elastic pools, the role labels and bounds
are synced with the router. kopf keeps its own bookkeeping in annotations, never in the
status, whose schema is ours; its timer puts a finalizer on each resource, which it removes
when the resource is deleted while the operator runs.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from pdserve.k8s.driver import Handlers
from pdserve.k8s.kube_api import KubeApi, from_environment
from pdserve.k8s.names import GROUP, PLURAL, VERSION
from pdserve.k8s.operator_settings import OperatorSettings


def build_registry(options: OperatorSettings, api: KubeApi) -> kopf.OperatorRegistry:
    registry = kopf.OperatorRegistry()
    handlers = Handlers(api, options.model_config)
    resource = (GROUP, VERSION, PLURAL)

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage()
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage()

    for on in (kopf.on.resume, kopf.on.create, kopf.on.update):
        on(*resource, id=f"reconcile-on-{on.__name__}", registry=registry)(handlers.changed)
    kopf.timer(*resource, id="reconcile-on-timer", interval=options.interval_s,
               registry=registry)(handlers.tick)
    return registry


def run(options: OperatorSettings) -> None:
    """Runs until interrupted; logs (its own actions and kopf's) go to stderr."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    registry = build_registry(options, from_environment())
    kopf.run(registry=registry, standalone=True, clusterwide=not options.namespaces,
             namespaces=options.namespaces)
