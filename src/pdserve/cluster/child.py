"""One supervised child process: its Popen, the thread that relays its output, its last lines.

Lifetime: `Child.launch` starts the process in a new session (so its process group id is its pid
and a terminal's Ctrl-C reaches only the supervisor) with a parent-death signal (SIGTERM when
the supervisor dies, even by SIGKILL: `parent_death.py`); `exit_code` looks without reaping,
so the pid (and with it the process group id) cannot be reused until `reap`; `reap` is the
only place that collects the exit status. The relay thread ends when the last holder of the
pipe exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from http.client import HTTPException
from typing import TextIO
from urllib.parse import urlsplit

from pdserve.cluster import parent_death
from pdserve.internal_auth import AUTH_HEADER, PROOF_HEADER, InternalAuth

TAIL_LINES = 20

# Health probes go straight to the child, never through an http_proxy from the environment.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class ProcessSpec:
    """What to run: `argv` (argv[0] is the program), polled at `health_url` until HTTP 200.

    `signed_health`: each poll is signed with the supervisor's cluster secret, and only an
    answer that proves the secret (`internal_auth.py`) counts, so a process without it still
    answering on the port (an orphan of an earlier run, which had its own secret) is never
    taken for this one.

    `env` adds to (and overrides) the supervisor's environment; None inherits it unchanged.
    `name` labels the child's log lines and messages and is unique within a Supervisor.
    `restart`: when it dies while serving, start it again (same argv, same ports) instead of
    stopping everything; peers see a new instance id at the old address.
    """

    name: str
    argv: tuple[str, ...]
    health_url: str
    env: dict[str, str] | None = field(default=None, hash=False)
    restart: bool = False
    signed_health: bool = False

    def __post_init__(self) -> None:
        if not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"name must be non-empty without spaces, got {self.name!r}")
        if not self.argv or not all(isinstance(a, str) and a for a in self.argv):
            raise ValueError(f"argv of {self.name} must be non-empty strings, got {self.argv!r}")
        if not self.health_url.startswith(("http://", "https://")):
            raise ValueError(f"health_url of {self.name} must be http(s)://..., got "
                             f"{self.health_url!r}")


class LogSink:
    """Whole lines to one text stream from many threads, never interleaved. A stream that
    fails (closed, broken pipe) drops lines rather than stall the relays and their children."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError):
            self._stream.write(text + "\n")
            self._stream.flush()


def get_signed(url: str, auth: InternalAuth, timeout_s: float) -> bytes:
    """The body of GET `url` signed with the cluster secret, once the 200 answer proves the
    server holds the same secret. Raises ValueError without that proof; `URLError` (an
    `HTTPError` for a 4xx/5xx status), `HTTPException` or `OSError` when the request fails."""
    headers = auth.headers("GET", urlsplit(url).path)
    with _OPENER.open(urllib.request.Request(url, headers=headers), timeout=timeout_s) as resp:
        body = resp.read()
        if resp.status != 200:
            raise ValueError(f"{url} answered {resp.status}, not 200")
        if not auth.check_proof(headers[AUTH_HEADER], body, resp.headers.get(PROOF_HEADER)):
            raise ValueError(f"{url} did not prove that it holds the cluster secret")
        return body


def is_healthy(url: str, timeout_s: float = 0.5, auth: InternalAuth | None = None) -> bool:
    """True when GET `url` answers HTTP 200 within `timeout_s`, and with `auth`: to a signed
    request, with the server's proof that it holds the same secret. Any failure is False."""
    try:
        if auth is not None:
            get_signed(url, auth, timeout_s)
            return True
        with _OPENER.open(url, timeout=timeout_s) as resp:
            return resp.status == 200
    except (urllib.error.URLError, HTTPException, OSError, ValueError):
        return False


class Child:
    """A launched ProcessSpec. Create with `launch`; `reap` once, after its group is killed."""

    def __init__(self, spec: ProcessSpec, proc: subprocess.Popen[bytes], sink: LogSink) -> None:
        self.spec = spec
        self.proc = proc
        self.started_at = time.monotonic()
        self._sink = sink
        self._tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._tail_lock = threading.Lock()
        self._exit_code: int | None = None
        self._relay = threading.Thread(target=self._pump, name=f"relay-{spec.name}", daemon=True)
        self._relay.start()

    @classmethod
    def launch(cls, spec: ProcessSpec, sink: LogSink) -> Child:
        """Start `spec` in its own session, stdout and stderr merged into one relayed pipe,
        told to die with this process (call from the supervisor's long-lived thread)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(spec.env or {})}
        proc = subprocess.Popen(spec.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                preexec_fn=parent_death.guard())
        return cls(spec, proc, sink)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for raw in iter(self.proc.stdout.readline, b""):
                text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
                with self._tail_lock:
                    self._tail.append(text)
                self._sink.line(f"[{self.name}] {text}")

    def tail(self) -> list[str]:
        """The last TAIL_LINES lines the child printed so far."""
        with self._tail_lock:
            return list(self._tail)

    def exit_code(self) -> int | None:
        """None while running; else the exit status (-N: killed by signal N). Never reaps."""
        if self._exit_code is None and self.proc.returncode is not None:
            self._exit_code = self.proc.returncode
        if self._exit_code is None:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None and info.si_pid == self.pid:
                killed = info.si_code in (os.CLD_KILLED, os.CLD_DUMPED)
                self._exit_code = -info.si_status if killed else info.si_status
        return self._exit_code

    def signal_group(self, signum: signal.Signals) -> None:
        """Send `signum` to the child's whole process group (no-op once reaped or gone)."""
        if self.proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signum)

    def reap(self, relay_timeout_s: float = 2.0) -> int:
        """Collect the exit status (blocks until the child exits) and let the relay drain."""
        code = self.proc.wait()
        self._exit_code = code
        self._relay.join(relay_timeout_s)
        return code
