"""The router's decision whether a worker may join, from two workers' signed `/health` details:
each field that must be shared gives its own reason, naming the field and both values."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.router.compat import incompatibility

NAME = "tiny"


def info(**changes: Any) -> dict[str, Any]:
    """A worker's signed details; `kv_layout__x=v` changes a field of its KV layout."""
    d: dict[str, Any] = {
        "status": "ok", "role": "decode", "model": NAME, "max_model_len": 512,
        "block_size": 16, "dtype": "float32", "kv_blocks_total": 64, "kv_blocks_used": 0,
        "kv_layout": {"model_id": NAME, "dtype": "float32", "block_size": 16,
                      "num_layers": 2, "kv_heads": 2, "head_dim": 16, "layout": "paged_kv"},
    }
    for key, value in changes.items():
        if key.startswith("kv_layout__"):
            d["kv_layout"][key.removeprefix("kv_layout__")] = value
        else:
            d[key] = value
    return d


def test_a_matching_worker_joins_whatever_its_role_and_load() -> None:
    assert incompatibility(info(), None, NAME) is None
    assert incompatibility(info(role="prefill", kv_blocks_used=9), info(), NAME) is None


@pytest.mark.parametrize(("changes", "reason"), [
    ({"dtype": "bfloat16", "kv_layout__dtype": "bfloat16"},
     "dtype 'bfloat16' differs from the cluster's 'float32'"),
    ({"max_model_len": 256}, "max_model_len 256 differs from the cluster's 512"),
    ({"kv_layout__block_size": 32, "block_size": 32},
     "kv_layout.block_size 32 differs from the cluster's 16"),
    ({"kv_layout__dtype": "float16"}, "kv_layout.dtype 'float16' differs from the cluster's "
                                      "'float32'"),
    ({"kv_layout__num_layers": 4}, "kv_layout.num_layers 4 differs from the cluster's 2"),
    ({"kv_layout__kv_heads": 1}, "kv_layout.kv_heads 1 differs from the cluster's 2"),
    ({"kv_layout__head_dim": 8}, "kv_layout.head_dim 8 differs from the cluster's 16"),
    ({"kv_layout__layout": "mla"}, "kv_layout.layout 'mla' differs from the cluster's "
                                   "'paged_kv'"),
])
def test_each_shared_field_that_differs_from_the_reference_is_named(
        changes: dict[str, Any], reason: str) -> None:
    got = incompatibility(info(**changes), info(), NAME)
    assert got is not None and got.startswith(reason), got
    assert incompatibility(info(**changes), None, NAME) is None  # it could be the reference


def test_the_served_model_name_must_be_the_routers_even_for_the_first_worker() -> None:
    want = "served model name 'other' differs from the router's 'tiny'"
    assert incompatibility(info(model="other"), None, NAME) == want
    assert incompatibility(info(model="other"), info(), NAME) == want


@pytest.mark.parametrize("missing", ["dtype", "max_model_len", "kv_layout", "kv_layout.head_dim"])
def test_a_worker_that_does_not_report_a_shared_field_is_refused(missing: str) -> None:
    d = info()
    if missing.startswith("kv_layout."):
        del d["kv_layout"][missing.removeprefix("kv_layout.")]
    else:
        del d[missing]
    for ref in (None, info()):
        assert incompatibility(d, ref, NAME) == (
            f"its /health does not report {missing} (a worker of another pdserve version?)")
