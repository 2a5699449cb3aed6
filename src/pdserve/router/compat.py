"""Whether a worker may join the router's cluster, decided from its signed `/health` details.

Every worker must serve the router's model name, and agree with the cluster's reference on
what makes two workers interchangeable and their KV pools compatible: dtype, context length
and KV layout. The reference is the signed info of the first worker the router accepted (see
`worker_pool.py`); a worker that differs would fail every transfer it takes part in (and the
decode side would recompute the prompt: twice the work), or answer the same request with
other limits or numerics than its peers.
"""

from __future__ import annotations

from typing import Any

# Top-level fields of a worker's signed /health that every worker must share.
SHARED_FIELDS = ("dtype", "max_model_len")
# Fields of its "kv_layout" (transfer/layout.py KVLayout) that every worker must share
# (`model_id` is the served name, checked against the router's; the pool's dtype is the
# engine's, so a dtype mismatch is named by the top-level field first).
LAYOUT_FIELDS = ("dtype", "block_size", "num_layers", "kv_heads", "head_dim", "layout")


def incompatibility(info: dict[str, Any], reference: dict[str, Any] | None,
                    served_name: str) -> str | None:
    """Why a worker with signed details `info` may not join, or None when it may.

    `reference` is the cluster's reference info (None before any worker was accepted: the
    worker then only has to serve `served_name` and report every compared field). The reason
    names the first field that differs, with the worker's value and the expected one.
    """
    name = info.get("model")
    if name != served_name:
        return f"served model name {name!r} differs from the router's {served_name!r}"
    missing = _missing(info)
    if missing is not None:
        return f"its /health does not report {missing} (a worker of another pdserve version?)"
    if reference is None:
        return None
    for field in SHARED_FIELDS:
        if info[field] != reference[field]:
            return _differs(field, info[field], reference[field])
    layout, ref_layout = info["kv_layout"], reference["kv_layout"]
    for field in LAYOUT_FIELDS:
        if layout[field] != ref_layout[field]:
            return _differs(f"kv_layout.{field}", layout[field], ref_layout[field])
    return None


def _missing(info: dict[str, Any]) -> str | None:
    for field in SHARED_FIELDS:
        if info.get(field) is None:
            return field
    layout = info.get("kv_layout")
    if not isinstance(layout, dict):
        return "kv_layout"
    return next((f"kv_layout.{f}" for f in LAYOUT_FIELDS if layout.get(f) is None), None)


def _differs(field: str, value: object, expected: object) -> str:
    return (f"{field} {value!r} differs from the cluster's {expected!r} (set by the first "
            "worker accepted)")
