"""A resource checked against the CRD's schema offline, as `kubectl apply` with the API
server's strict field validation would check it: every type, enum, bound and required field,
and no field the schema does not name (the API server refuses those under strict validation,
or drops them under the lenient one; either way they would mean nothing). A CRD's schema is
OpenAPI v3.0's dialect of JSON Schema, draft 4's (`exclusiveMinimum` a flag beside
`minimum`), so draft 4's validator reads it.

The CRD's own schema cannot say "no other fields" (a structural schema forbids
`additionalProperties` beside `properties`), so the check uses a copy that does."""

from __future__ import annotations

from typing import Any

from pdserve.k8s.schema import Schema, resource_schema


def strict(schema: Schema) -> Schema:
    """`schema` with `additionalProperties: false` on every object that lists its fields."""
    out = {k: v for k, v in schema.items() if k not in ("properties", "items",
                                                         "additionalProperties")}
    if "properties" in schema:
        out["properties"] = {k: strict(v) for k, v in schema["properties"].items()}
        out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = strict(schema["additionalProperties"])
    if "items" in schema:
        out["items"] = strict(schema["items"])
    return out


def schema_errors(resource: Any) -> list[str]:
    """Every violation of the schema, each as 'spec.field.path: what is wrong' (empty: valid)."""
    import jsonschema  # the k8s extra; only render and the operator need it

    validator = jsonschema.Draft4Validator(strict(resource_schema()))
    errors = sorted(validator.iter_errors(resource), key=lambda e: list(map(str, e.path)))
    return [f"{_path(e.absolute_path)}: {e.message}" for e in errors]


def check_schema(resource: Any) -> None:
    """ValueError listing every violation, when there is one."""
    errors = schema_errors(resource)
    if errors:
        raise ValueError("the resource does not match the DisaggregatedServingCluster schema:\n"
                         + "\n".join(f"  {e}" for e in errors))


def _path(path: Any) -> str:
    parts = [f"[{p}]" if isinstance(p, int) else f".{p}" for p in path]
    return "".join(parts).lstrip(".") or "(the resource)"
