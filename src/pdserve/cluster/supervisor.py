"""Supervisor: start child processes, wait until each answers its health URL, stop them all.

Life cycle of a `Supervisor`: created empty -> `start()` once per phase (each phase's children
are launched together and must all become healthy before `start` returns; a later phase can
depend on an earlier one) -> `wait()` until a stop is requested (`request_stop`, called by the
signal handlers `run` installs) or a child dies -> `stop()`. `stop` is idempotent and leaves
nothing running: every child's process group gets SIGTERM, then SIGKILL after the grace
period, and every child is reaped. After `stop`, `start` refuses. A failed `start` has already
stopped everything when it raises `ClusterError`.

A child whose spec says `restart` and that dies during `wait` is started again at the same argv
after a backoff, within the budget of the supervisor's `RestartPolicy` (`restarts.py`); over
it, `wait` reports the child and its exit codes and returns 1 (and the caller stops the rest).
Every child gets SIGTERM if the supervisor dies (`parent_death.py`), so children are launched
only from the thread that created the supervisor and lives as long as it.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TextIO

from pdserve.cluster import parent_death
from pdserve.cluster.child import Child, LogSink, ProcessSpec, is_healthy
from pdserve.cluster.restarts import RestartHistory, RestartPolicy
from pdserve.internal_auth import InternalAuth

__all__ = ["ClusterError", "ProcessSpec", "RestartPolicy", "Supervisor", "run"]

POLL_S = 0.1
PROGRESS_EVERY_S = 15.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class ClusterError(RuntimeError):
    """A child failed to come up (exited, or timed out); the message names it and quotes it."""


class _NotReady(Exception):
    """Internal: why start-up failed, and the children whose last lines explain it."""

    def __init__(self, message: str, children: Sequence[Child] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.children = tuple(children)


class Supervisor:
    """Owns its children from `start` until `stop` (see the module docstring for the order)."""

    def __init__(self, log: TextIO | None = None, grace_s: float = 10.0,
                 auth: InternalAuth | None = None,
                 restart_policy: RestartPolicy | None = None) -> None:
        """`log`: where children's lines and progress go (default stderr); `grace_s`: how long
        `stop` waits between SIGTERM and SIGKILL unless told otherwise; `auth`: the cluster
        secret that signs the health checks of specs with `signed_health`; `restart_policy`:
        the budget and backoff of restarts (default: `RestartPolicy()`)."""
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self._grace_s = grace_s
        self._auth = auth
        self._sink = LogSink(log if log is not None else sys.stderr)
        self._children: list[Child] = []
        self._stop_signal: int | None = None
        self._stopped = False
        self._policy = restart_policy if restart_policy is not None else RestartPolicy()
        self._histories: dict[str, RestartHistory] = {}
        self._due: dict[int, float] = {}  # index of a dead child -> when to start it again
        if not parent_death.available():
            self.log("note: children cannot be told to stop with this process here (no "
                     "prctl); if it is killed, stop them by hand")

    @property
    def pids(self) -> list[int]:
        """Process ids of every child launched so far (also the ids of their process groups)."""
        return [c.pid for c in self._children]

    @property
    def stop_signal(self) -> int | None:
        """The signal passed to `request_stop`, or None."""
        return self._stop_signal

    def log(self, text: str) -> None:
        """One line to the supervisor's log stream, between children's lines."""
        self._sink.line(text)

    def request_stop(self, signum: int) -> None:
        """Make a running `start` or `wait` return soon. Safe to call from a signal handler."""
        self._stop_signal = signum

    def start(self, specs: Sequence[ProcessSpec], ready_timeout_s: float) -> None:
        """Launch `specs` and block until each answers HTTP 200 at its health URL.

        Raises ClusterError (after stopping every child, earlier phases too) when a child exits
        first, when `ready_timeout_s` passes, or when a stop is requested meanwhile.
        """
        if self._stopped:
            raise ClusterError("this supervisor has been stopped; create a new one")
        self._check_specs(specs)
        if not specs:
            return
        launched = [self._launch(spec) for spec in specs]
        self.log(f"waiting for {', '.join(c.name for c in launched)} ...")
        try:
            self._await_healthy(launched, time.monotonic() + ready_timeout_s)
        except _NotReady as e:
            codes = [c.exit_code() for c in e.children]  # before stop() kills the rest
            self.stop()
            raise ClusterError(e.message + _describe(e.children, codes)) from None

    def _check_specs(self, specs: Sequence[ProcessSpec]) -> None:
        names = [c.name for c in self._children] + [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique, got {names}")
        unsigned = [s.name for s in specs if s.signed_health and self._auth is None]
        if unsigned:
            raise ValueError(f"{', '.join(unsigned)} need signed health checks: give the "
                             "Supervisor the cluster secret (auth)")

    def _launch(self, spec: ProcessSpec) -> Child:
        try:
            child = Child.launch(spec, self._sink)
        except OSError as e:
            self.stop()
            raise ClusterError(f"cannot start {spec.name} ({spec.argv[0]}): {e}") from e
        self._children.append(child)
        return child

    def _await_healthy(self, pending: list[Child], deadline: float) -> None:
        """Poll until every child in `pending` is healthy, else raise _NotReady."""
        pending = list(pending)
        next_progress = time.monotonic() + PROGRESS_EVERY_S
        while pending:
            for child in list(pending):
                code = child.exit_code()
                if code is not None:
                    raise _NotReady(f"{child.name} exited with code {code} before it was "
                                    "healthy", [child])
                auth = self._auth if child.spec.signed_health else None
                if is_healthy(child.spec.health_url, auth=auth):
                    pending.remove(child)
                    took = time.monotonic() - child.started_at
                    self.log(f"{child.name} is healthy (ready in {took:.1f} s)")
            now = time.monotonic()
            if pending and self._stop_signal is not None:
                name = signal.Signals(self._stop_signal).name
                raise _NotReady(f"stop requested ({name}) while starting")
            if pending and now >= deadline:
                names = ", ".join(c.name for c in pending)
                raise _NotReady(f"not healthy in time: {names}", pending)
            if pending and now >= next_progress:
                self.log(f"still waiting for {', '.join(c.name for c in pending)} ...")
                next_progress = now + PROGRESS_EVERY_S
            time.sleep(POLL_S if pending else 0)

    def wait(self) -> int:
        """Block until a stop is requested (returns 0) or a child exits for good (reports it,
        returns 1). A child whose spec says `restart` is started again after its backoff while
        within the restart budget (the rest keep serving meanwhile)."""
        while self._stop_signal is None:
            now = time.monotonic()
            for i, child in enumerate(self._children):
                if i in self._due:
                    if now >= self._due[i] and not self._relaunch(i):
                        return 1
                    continue
                code = child.exit_code()
                if code is None:
                    continue
                if not child.spec.restart:
                    self.log(f"{child.name} exited unexpectedly with code {code}")
                    return 1
                if not self._schedule_restart(i, code, now):
                    return 1
            time.sleep(POLL_S)
        return 0

    def _schedule_restart(self, index: int, code: int, now: float) -> bool:
        """Reap the dead child and set when to start it again; False when over its budget."""
        old = self._children[index]
        old.signal_group(signal.SIGKILL)  # strays of its group
        old.reap()
        history = self._histories.setdefault(old.name, RestartHistory(self._policy))
        delay = history.record(code, now - old.started_at, now)
        if delay is None:
            codes = ", ".join(map(str, history.codes))
            self.log(f"{old.name} exited with code {code}: {history.in_window} exits within "
                     f"{self._policy.window_s:g} s (exit codes {codes}), over the restart "
                     f"budget ({self._policy.describe()} per process): stopping everything"
                     + _describe([old], [code]))
            return False
        self.log(f"{old.name} exited with code {code}; restarting it in {delay:g} s (restart "
                 f"{history.in_window} of {self._policy.describe()})")
        self._due[index] = now + delay
        return True

    def _relaunch(self, index: int) -> bool:
        del self._due[index]
        spec = self._children[index].spec
        try:
            self._children[index] = Child.launch(spec, self._sink)
        except OSError as e:
            self.log(f"cannot start {spec.name} again ({spec.argv[0]}): {e}")
            return False
        return True

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM every child's group, SIGKILL after `grace_s`, reap all. Idempotent.

        `grace_s` None: the constructor's. Logs `stopping...` and `stopped` when it had work.
        """
        self._stopped = True
        live = [c for c in self._children if c.proc.returncode is None]
        if not live:
            return
        self.log("stopping...")
        grace_s = self._grace_s if grace_s is None else grace_s
        for child in live:
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(c.exit_code() is None for c in live):
            time.sleep(0.05)
        for child in live:
            child.signal_group(signal.SIGKILL)  # also strays left in a group whose leader exited
        for child in live:
            child.reap()
        self.log("stopped")


def _describe(children: Sequence[Child], codes: Sequence[int | None]) -> str:
    """Exit code (None: was still running) and last lines of each child, after `stop`."""
    parts = []
    for child, code in zip(children, codes, strict=True):
        status = "still running, stopped" if code is None else f"exit code {code}"
        lines = "".join(f"\n    {line}" for line in child.tail()) or "\n    (no output)"
        parts.append(f"\n  {child.name} ({status}), last lines:{lines}")
    return "".join(parts)


@contextmanager
def _stop_on_signals(supervisor: Supervisor) -> Iterator[None]:
    """SIGINT/SIGTERM request a stop while inside; the previous handlers come back after.

    Only the main thread can install handlers; elsewhere this does nothing.
    """
    try:
        previous = {s: signal.signal(s, lambda n, _f: supervisor.request_stop(n))
                    for s in STOP_SIGNALS}
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run(phases: Sequence[Sequence[ProcessSpec]], ready_timeout_s: float, *,
        on_ready: Callable[[], None] | None = None, grace_s: float = 10.0,
        log: TextIO | None = None, auth: InternalAuth | None = None,
        restart_policy: RestartPolicy | None = None) -> int:
    """Start `phases` in order (all within `ready_timeout_s`), call `on_ready`, wait, stop.

    SIGINT and SIGTERM request the stop while this runs; the previous handlers are restored on
    return. Returns 0 when a signal stops a ready cluster, 1 when a child died while serving,
    128 + the signal when one interrupted start-up. Raises ClusterError when a child failed to
    come up. However it ends, every child has been stopped and reaped on return. `auth` signs
    the health checks of specs with `signed_health`, and `restart_policy` bounds restarts (see
    `Supervisor`).
    """
    supervisor = Supervisor(log, grace_s=grace_s, auth=auth, restart_policy=restart_policy)
    with _stop_on_signals(supervisor):
        try:
            return _drive(supervisor, phases, time.monotonic() + ready_timeout_s, on_ready)
        finally:
            supervisor.stop()


def _drive(supervisor: Supervisor, phases: Sequence[Sequence[ProcessSpec]], deadline: float,
           on_ready: Callable[[], None] | None) -> int:
    try:
        for phase in phases:
            supervisor.start(phase, max(deadline - time.monotonic(), 0.0))
    except ClusterError:
        if supervisor.stop_signal is None:
            raise
        return 128 + supervisor.stop_signal
    if on_ready is not None:
        on_ready()
    return supervisor.wait()
