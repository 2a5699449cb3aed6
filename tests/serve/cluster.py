"""The test cluster: `pdserve up` with a tiny fp32 model, small KV pools, 512-token context."""

from __future__ import annotations

from pathlib import Path

from pdserve.cluster.up_process import UpProcess, get_json

__all__ = ["Cluster", "get_json"]


class Cluster(UpProcess):
    def __init__(self, model: Path, *args: str) -> None:
        super().__init__(model, "--dtype", "float32", "--kv-cache-memory", "16MiB",
                         "--max-model-len", "512", *args)
