"""The example resources, and copies of them with one field changed."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "k8s"
CPU_EXAMPLE = EXAMPLES / "smollm2-cpu.yaml"
GPU_EXAMPLE = EXAMPLES / "llama-70b-gpu.yaml"


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def cpu() -> dict[str, Any]:
    return load(CPU_EXAMPLE)


def gpu() -> dict[str, Any]:
    return load(GPU_EXAMPLE)


def changed(resource: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of `resource` with the dotted `path` (e.g. "spec.prefillPool.replicas") set."""
    out = copy.deepcopy(resource)
    *parents, last = path.split(".")
    node = out
    for name in parents:
        node = node.setdefault(name, {})
    node[last] = value
    return out


def single_device(resource: dict[str, Any]) -> dict[str, Any]:
    """`resource` with every pool at tensorParallelSize 1 and one GPU a worker: what pdserve
    workers run today."""
    out = copy.deepcopy(resource)
    for pool in ("prefillPool", "decodePool"):
        out["spec"][pool]["tensorParallelSize"] = 1
        out["spec"][pool]["resources"]["limits"]["nvidia.com/gpu"] = 1
    return out


def as_server_would(resource: dict[str, Any], uid: str = "uid-1", generation: int = 1
                    ) -> dict[str, Any]:
    """`resource` with what the API server adds and the operator reads: uid, generation,
    namespace."""
    out = copy.deepcopy(resource)
    out["metadata"].update(uid=uid, generation=generation, namespace="serving")
    return out
