"""The CRD: a valid CustomResourceDefinition for the Kubernetes release the schemas describe,
printed by `pdserve k8s crd` and kept in examples/k8s/crd.yaml, and whose schema accepts the
examples and refuses what it must, with messages that name the field."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from pdserve.k8s.crd import crd_manifest
from pdserve.k8s.defaults import with_defaults
from pdserve.k8s.schema import resource_schema
from pdserve.k8s.schema_check import schema_errors
from tests.k8s.resources import EXAMPLES, changed, cpu, gpu

K8S_VERSION = kubernetes_validate.latest_version()


def test_the_crd_is_a_valid_custom_resource_definition() -> None:
    kubernetes_validate.validate(crd_manifest(), K8S_VERSION, strict=True)


def test_examples_crd_yaml_is_what_pdserve_k8s_crd_prints() -> None:
    assert yaml.safe_load((EXAMPLES / "crd.yaml").read_text()) == crd_manifest()


def _untyped(schema: dict, path: str = "") -> list[str]:
    """Fields without a type: a structural schema (what a CRD must have) types every one."""
    found = []
    if "type" not in schema and not schema.get("x-kubernetes-int-or-string"):
        found.append(path or "(root)")
    for name, sub in schema.get("properties", {}).items():
        found += _untyped(sub, f"{path}.{name}")
    if isinstance(schema.get("additionalProperties"), dict):
        found += _untyped(schema["additionalProperties"], f"{path}.*")
    if "items" in schema:
        found += _untyped(schema["items"], f"{path}[]")
    return found


def test_the_schema_is_structural() -> None:
    assert _untyped(resource_schema()) == []


@pytest.mark.parametrize("example", [cpu, gpu], ids=["cpu", "gpu"])
def test_the_examples_match_the_schema(example) -> None:
    assert schema_errors(with_defaults(example(), resource_schema())) == []


def test_defaults_fill_what_the_resource_leaves_out() -> None:
    minimal = {"apiVersion": "pdserve.dev/v1alpha1", "kind": "DisaggregatedServingCluster",
               "metadata": {"name": "m"},
               "spec": {"secretName": "s", "prefillPool": {"replicas": 1},
                        "decodePool": {"replicas": 1}}}
    spec = with_defaults(minimal, resource_schema())["spec"]
    assert spec["model"] == {"path": "smollm2"}
    assert spec["interconnect"] == {"transport": "tcp", "encryption": False, "blockSize": 16}
    assert spec["prefillPool"] == {"replicas": 1, "tensorParallelSize": 1,
                                   "kvCacheMemory": "512MiB"}
    assert spec["router"]["port"] == 8000 and spec["elastic"]["enabled"] is False
    assert minimal["spec"] == {"secretName": "s", "prefillPool": {"replicas": 1},
                               "decodePool": {"replicas": 1}}  # the input is not changed


@pytest.mark.parametrize(("path", "value", "message"), [
    ("spec.prefillPool.replicas", -1, "spec.prefillPool.replicas: -1 is less than the minimum "
                                      "of 0"),
    ("spec.interconnect.transport", "rdma", "spec.interconnect.transport: 'rdma' is not one "
                                            "of ['tcp', 'nixl']"),
    ("spec.decodePool.tensorParallelSize", 0, "spec.decodePool.tensorParallelSize: 0 is less "
                                              "than the minimum of 1"),
    ("spec.dtype", "int4", "spec.dtype: 'int4' is not one of"),
    ("spec.elastic.sloTtftMs", 0, "spec.elastic.sloTtftMs: 0 is less than or equal to the "
                                  "minimum of 0"),
    ("spec.router.serviceType", "Ingress", "spec.router.serviceType: 'Ingress' is not one of"),
    ("spec.prefillPool.resources.limits.memory", "lots", "spec.prefillPool.resources.limits."
                                                         "memory: 'lots' does not match"),
    ("spec.prefillPool.replica", 3, "spec.prefillPool: Additional properties are not allowed "
                                    "('replica' was unexpected)"),
])
def test_the_schema_refuses_bad_fields_naming_them(path: str, value: object,
                                                   message: str) -> None:
    errors = schema_errors(with_defaults(changed(cpu(), path, value), resource_schema()))
    assert len(errors) == 1 and errors[0].startswith(message), errors


def test_a_resource_without_its_required_fields_is_refused() -> None:
    resource = cpu()
    del resource["spec"]["secretName"]
    assert schema_errors(resource) == ["spec: 'secretName' is a required property"]
