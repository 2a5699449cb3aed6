"""The workers of the cluster under test, as fault targets: found once at the start, read
through their signed `/health` (pid, KV endpoint, KV blocks in use) with the cluster's secret.

A worker's index is its place in `pdserve up`'s layout (prefill workers first); it keeps it
across restarts (same ports), while its pid changes. Reads block: call them from a thread.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

from pdserve.cluster.up_process import UpProcess

POLL_S = 0.2


@dataclass(frozen=True)
class Worker:
    index: int
    role: str  # prefill | decode | collocated
    name: str  # e.g. decode-0

    def label(self, pid: int) -> str:
        return f"{self.name} (pid {pid})"


class Workers:
    """Every worker of `up`, and a turn per role so repeated faults move between workers."""

    def __init__(self, up: UpProcess) -> None:
        self.up = up
        self.all: list[Worker] = []
        roles: list[str] = []
        for index in itertools.count():
            try:
                role = up.health(index)["role"]
            except (OSError, ValueError, KeyError):  # past the last worker
                break
            self.all.append(Worker(index, role, f"{role}-{roles.count(role)}"))
            roles.append(role)
        if not self.all:
            raise RuntimeError("the cluster has no worker answering a signed /health")
        self.max_model_len = int(up.health(0)["max_model_len"])
        self._turns: dict[str, itertools.cycle] = {}

    def next_of(self, role: str) -> Worker | None:
        """The next worker of `role` in turn, or None when the cluster has none."""
        if role not in self._turns:
            of_role = [w for w in self.all if w.role == role]
            if not of_role:
                return None
            self._turns[role] = itertools.cycle(of_role)
        return next(self._turns[role])

    def health(self, w: Worker) -> dict | None:
        """The worker's signed /health, or None while it does not answer."""
        try:
            return self.up.health(w.index)
        except (OSError, ValueError):
            return None

    def wait_health(self, w: Worker, timeout_s: float, unlike_pid: int | None = None
                    ) -> dict | None:
        """Its /health once it answers (from a pid other than `unlike_pid`, if given), or None
        after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.health(w)
            if info is not None and info["pid"] != unlike_pid:
                return info
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)

    def blocks_used(self) -> dict[str, int | None]:
        """Worker name -> KV blocks held by requests (None: it does not answer)."""
        out = {}
        for w in self.all:
            info = self.health(w)
            out[w.name] = None if info is None else int(info["kv_blocks_used"])
        return out

    def settle(self, timeout_s: float) -> dict[str, int | None]:
        """`blocks_used` once every worker answers and holds none, or its last reading after
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            used = self.blocks_used()
            if all(v == 0 for v in used.values()) or time.monotonic() >= deadline:
                return used
            time.sleep(POLL_S)
