"""The CustomResourceDefinition of DisaggregatedServingCluster (`pdserve k8s crd` prints it;
`examples/k8s/crd.yaml` is its output, held equal by a test)."""

from __future__ import annotations

from typing import Any

from pdserve.k8s.names import API_VERSION, GROUP, KIND, PLURAL, SHORT_NAMES, SINGULAR, VERSION
from pdserve.k8s.schema import resource_schema

PRINTER_COLUMNS = (
    ("Prefill", "integer", ".status.prefillPool.readyWorkers", "ready prefill-pool workers"),
    ("Decode", "integer", ".status.decodePool.readyWorkers", "ready decode-pool workers"),
    ("Ready", "string", '.status.conditions[?(@.type=="Ready")].status', "every pod ready"),
    ("Age", "date", ".metadata.creationTimestamp", ""),
)


def crd_manifest() -> dict[str, Any]:
    columns = [{"name": n, "type": t, "jsonPath": p, **({"description": d} if d else {})}
               for n, t, p, d in PRINTER_COLUMNS]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL,
                      "singular": SINGULAR, "shortNames": list(SHORT_NAMES),
                      "categories": ["pdserve"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "schema": {"openAPIV3Schema": resource_schema()},
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns,
            }],
        },
    }


def is_our_kind(resource: object) -> bool:
    return isinstance(resource, dict) and resource.get("apiVersion") == API_VERSION \
        and resource.get("kind") == KIND
