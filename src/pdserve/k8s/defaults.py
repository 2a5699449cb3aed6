"""The schema's defaults, filled in as the API server fills them in: a field absent from an
object whose schema gives it a `default` takes (a copy of) that default, then the object's
fields are defaulted in turn, depth first (so `interconnect: {}` and an absent `interconnect`
both end with every interconnect default). Pure: returns a new object."""

from __future__ import annotations

import copy
from typing import Any

from pdserve.k8s.schema import Schema


def with_defaults(value: Any, schema: Schema) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = with_defaults(out[name], sub)
        return out
    if isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        return {k: with_defaults(v, schema["additionalProperties"]) for k, v in value.items()}
    if isinstance(value, list) and "items" in schema:
        return [with_defaults(v, schema["items"]) for v in value]
    return value
