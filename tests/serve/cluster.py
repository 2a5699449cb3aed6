"""The test cluster: `pdserve up` with a tiny fp32 model, small KV pools, 512-token context."""

from __future__ import annotations

import urllib.request
from pathlib import Path

from pdserve.cluster.up_process import UpProcess, get_json

__all__ = ["Cluster", "get_json", "metric"]


def metric(url: str, name: str) -> float:
    """The value of metric line `name` at `url`/metrics; 0 before a counter's first increment
    (its labelled child does not exist yet)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0


class Cluster(UpProcess):
    def __init__(self, model: Path, *args: str) -> None:
        super().__init__(model, "--dtype", "float32", "--kv-cache-memory", "16MiB",
                         "--max-model-len", "512", *args)
