"""`pdserve up` run as a child process, for tests and benchmarks: real processes, real ports.

Lifetime: construction starts `pdserve up` in its own session and returns once it printed its
ready line (or raises RuntimeError with its last output); `stop()` sends SIGTERM (as Ctrl-C
would), waits, and SIGKILLs the group only if `up` itself hangs.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

READY_TIMEOUT_S = 300.0
FREE_TIMEOUT_S = 15.0  # blocks come back at once, well inside the 30 s transfer lease


def _free_base_port() -> int:
    """A port P with P..P+3 and P+101..P+103 free (router, workers, KV endpoints)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base > 60000:
            continue
        ports = [base + i for i in range(4)] + [base + 101 + i for i in range(3)]
        try:
            for p in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


def get_json(url: str, timeout: float = 5.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class UpProcess:
    """`pdserve up --model MODEL ARGS...` on free ports; `url` is the router's /v1 base and
    worker i answers at `worker_url(i)`."""

    def __init__(self, model: str | Path, *args: str) -> None:
        self.port = _free_base_port()
        argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model), "--port",
                str(self.port), "--ready-timeout", str(READY_TIMEOUT_S), *args]
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.log: deque[str] = deque(maxlen=400)
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(READY_TIMEOUT_S):
            self.stop()
            raise RuntimeError("pdserve up did not become ready:\n" + "\n".join(self.log))
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.model = str(model)

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line.rstrip())
            if line.startswith("pdserve is ready"):
                self._ready.set()

    def worker_url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.port + 1 + index}"

    def health(self, index: int) -> dict:
        return get_json(self.worker_url(index) + "/health")

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
