"""`pdserve up --testbed PREFIX` as a child process, reached from inside the testbed.

The router answers only on its host's address and the workers on theirs, so every request and
signed health check is made from a thread that entered the router's namespace (`inside`).
Worker i is the i-th worker the router lists (pdserve up's order), at the host address it
advertises.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pdserve.cluster.testbed_hosts import ROUTER_HOST
from pdserve.cluster.up_process import UpProcess, get_signed_json
from pdserve.testbed.namespaces import entered
from pdserve.testbed.state import BedState


class BedUpProcess(UpProcess):
    def __init__(self, bed: BedState, model: str | Path, *args: str) -> None:
        self.bed = bed
        super().__init__(model, "--testbed", bed.topology.prefix, *args)
        self.url = f"http://{self.address(ROUTER_HOST)}:{self.port}/v1"

    def address(self, host: str) -> str:
        return self.bed.topology.address(host)

    @contextmanager
    def inside(self) -> Iterator[None]:
        """This thread on the router's host for the block."""
        with entered(self.bed.topology.namespace(ROUTER_HOST)):
            yield

    def internal_json(self, url: str) -> dict:
        with self.inside():
            return get_signed_json(self.auth, url)

    def worker_url(self, index: int) -> str:
        """Worker `index`'s URL as the router lists it; OSError past the last worker."""
        workers = self.internal_json(self.url.removesuffix("/v1") + "/health")["workers"]
        if index >= len(workers):
            raise OSError(f"the cluster has {len(workers)} workers, no worker {index}")
        return workers[index]["url"]
