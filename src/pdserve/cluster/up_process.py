"""`pdserve up` run as a child process, for tests and benchmarks: real processes, real ports.

Lifetime: construction writes a cluster secret into a private temporary folder, starts
`pdserve up --secret-file` with it in its own session and returns once `up` printed its ready
line (or raises RuntimeError with its last output); `stop()` sends SIGTERM (as Ctrl-C would),
waits, SIGKILLs the group only if `up` itself hangs, and removes the secret. `up` is told to get
SIGTERM when its caller dies (`parent_death.py`), so a benchmark killed by `timeout` or SIGKILL
leaves no cluster behind on the cores and ports of the next run; the kernel ties that to the
thread that started it, so construct it from one that lives as long as the caller (the main
thread: pytest's fixtures, the bench commands). Holding the secret,
the caller can read what only the cluster may: a worker's full `/health`, `/internal/*`
(`signed_json`, `internal_json`).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Sequence
from pathlib import Path

from pdserve.cluster import parent_death
from pdserve.cluster.child import get_signed
from pdserve.cluster.secret import remove_secret, write_secret
from pdserve.internal_auth import InternalAuth, read_secret_file

READY_TIMEOUT_S = 300.0
FREE_TIMEOUT_S = 15.0  # blocks come back at once, well inside the 30 s transfer lease


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_BASE = 10_000


def _ephemeral_low() -> int:
    """The first port the kernel hands out to outgoing connections (Linux default 32768)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(offsets: Sequence[int] = (0,)) -> int:
    """A port P with every P + offset free, below the kernel's ephemeral range: a port from
    that range can be given to some outgoing connection between this check and the server's
    bind (seen in CI: "address already in use")."""
    rng = random.Random()
    high = _ephemeral_low() - max(offsets) - 1
    for _ in range(200):
        base = rng.randrange(LOWEST_BASE, high) if high > LOWEST_BASE else _kernel_port()
        try:
            for offset in offsets:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


def _kernel_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return min(s.getsockname()[1], 60000)


def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def get_signed_json(auth: InternalAuth, url: str, timeout: float = 5.0) -> dict:
    """GET `url` signed with the cluster secret (for its path, without the query); the answer
    must prove that the server holds the same secret."""
    return json.loads(get_signed(url, auth, timeout))


class UpProcess:
    """`pdserve up --model MODEL ARGS...` on free ports; `url` is the router's /v1 base and
    worker i answers at `worker_url(i)`. ARGS may name a `--secret-file` of the caller's
    (kept); else the cluster gets a fresh one (removed at stop)."""

    def __init__(self, model: str | Path, *args: str) -> None:
        # router, workers, KV endpoints (cluster/layout.py offsets 1+ and 101+)
        self.port = free_port((0, 1, 2, 3, 101, 102, 103))
        given = "--secret-file" in args
        self.secret_file = Path(args[args.index("--secret-file") + 1]) if given \
            else write_secret()
        self._own_secret = not given
        self.auth = InternalAuth(read_secret_file(self.secret_file))
        secret_args = () if given else ("--secret-file", str(self.secret_file))
        argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model), "--port",
                str(self.port), "--ready-timeout", str(READY_TIMEOUT_S), *secret_args, *args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True,
                                     preexec_fn=parent_death.guard())
        self.log: deque[str] = deque(maxlen=400)
        self._ready, self._announced = threading.Event(), False  # set: ready or ended
        threading.Thread(target=self._read, daemon=True).start()
        if not (self._ready.wait(READY_TIMEOUT_S) and self._announced):
            self.stop()
            raise RuntimeError("pdserve up did not become ready:\n" + "\n".join(self.log))
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.model = str(model)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            if line.startswith("pdserve is ready"):
                self._announced = True
                self._ready.set()
        self._ready.set()  # `up` exited (its output ended) without getting ready

    def worker_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.port + 1 + index}"

    def health(self, index: int) -> dict:
        """Worker `index`'s full `/health` (signed: pid, transfer endpoint, load, layout)."""
        return self.internal_json(self.worker_url(index) + "/health")

    def internal_json(self, url: str) -> dict:
        """GET `url` (a worker's `/health`, `/internal/steps?since=...`, the router's
        `/health`) signed with this cluster's secret."""
        return get_signed_json(self.auth, url)

    def pids(self) -> list[int]:
        """Every process of the cluster: `up` itself and its children's process groups."""
        out = subprocess.run(["pgrep", "-s", str(self.proc.pid)], capture_output=True,
                             text=True).stdout.split()
        children = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True,
                                  text=True).stdout.split()
        return sorted({int(p) for p in out + children})

    def wait_blocks_free(self, indexes: list[int], timeout: float = FREE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        used = {}
        while time.monotonic() < deadline:
            used = {i: self.health(i)["kv_blocks_used"] for i in indexes}
            if not any(used.values()):
                return
            time.sleep(0.1)
        raise AssertionError(f"KV blocks still used after {timeout} s: {used}\n" +
                             "\n".join(list(self.log)[-40:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        if self._own_secret:
            remove_secret(self.secret_file)
