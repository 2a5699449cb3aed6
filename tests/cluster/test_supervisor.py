"""Supervisor against fake children: start, health, failures with their output, stop, signals."""

from __future__ import annotations

import dataclasses
import io
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pdserve.cluster import parent_death
from pdserve.cluster.child import is_healthy
from pdserve.cluster.restarts import RestartHistory
from pdserve.cluster.supervisor import ClusterError, ProcessSpec, RestartPolicy, Supervisor
from pdserve.internal_auth import InternalAuth, read_secret_file
from tests.cluster.helpers import fake_spec, gone_soon, running

DRIVER = Path(__file__).with_name("drive_supervisor.py")


def _wait_for(predicate, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="name"):
        ProcessSpec("", ("true",), "http://x/health")
    with pytest.raises(ValueError, match="argv"):
        ProcessSpec("a", (), "http://x/health")
    with pytest.raises(ValueError, match="health_url"):
        ProcessSpec("a", ("true",), "x/health")


def test_all_healthy_then_stop_leaves_nothing() -> None:
    log = io.StringIO()
    sup = Supervisor(log)
    sup.start([fake_spec("a", "--lines", "2"), fake_spec("b", "--delay", "0.3")], 10)
    assert all(running(pid) for pid in sup.pids)
    sup.stop()
    assert not any(running(pid) or Path(f"/proc/{pid}").exists() for pid in sup.pids)
    sup.stop()  # idempotent
    text = log.getvalue()
    assert "waiting for a, b ..." in text
    assert "[a] line 1" in text and "b is healthy (ready in" in text
    assert text.count("stopping...") == 1 and text.rstrip().endswith("stopped")
    with pytest.raises(ClusterError, match="stopped"):
        sup.start([fake_spec("c")], 1)


def test_early_exit_names_child_code_and_last_lines() -> None:
    sup = Supervisor(io.StringIO())
    with pytest.raises(ClusterError) as info:
        sup.start([fake_spec("slow", "--delay", "30"),
                   fake_spec("bad", "--lines", "30", "--exit-code", "3")], 10)
    message = str(info.value)
    assert "bad exited with code 3 before it was healthy" in message
    assert "line 29" in message and "line 10" in message and "line 9\n" not in message
    assert not any(running(pid) for pid in sup.pids)


def test_sigterm_ignored_means_sigkill_after_grace_and_group_killed() -> None:
    log = io.StringIO()
    sup = Supervisor(log)
    sup.start([fake_spec("stubborn", "--ignore-term", "--grandchild")], 10)
    _wait_for(lambda: "grandchild" in log.getvalue())
    grandchild = int(log.getvalue().split("[stubborn] grandchild ")[1].split()[0])
    t0 = time.monotonic()
    sup.stop(grace_s=0.5)
    assert 0.5 <= time.monotonic() - t0 < 5
    assert not running(sup.pids[0])
    assert gone_soon(grandchild)


def test_timeout_is_bounded_and_names_the_child() -> None:
    sup = Supervisor(io.StringIO(), grace_s=2)
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"not healthy in time: late") as info:
        sup.start([fake_spec("late", "--lines", "1", "--delay", "30")], 0.5)
    assert time.monotonic() - t0 < 5
    assert "late (still running, stopped)" in str(info.value)
    assert "line 0" in str(info.value)
    assert not any(running(pid) for pid in sup.pids)


def test_missing_program_is_a_cluster_error() -> None:
    sup = Supervisor(io.StringIO())
    with pytest.raises(ClusterError, match="cannot start nope"):
        sup.start([ProcessSpec("nope", ("/nonexistent/prog",), "http://127.0.0.1:1/h")], 1)


def test_duplicate_names_rejected() -> None:
    sup = Supervisor(io.StringIO())
    with pytest.raises(ValueError, match="unique"):
        sup.start([ProcessSpec("a", ("true",), "http://x/h")] * 2, 1)


def test_wait_reports_a_dead_child_and_returns_nonzero() -> None:
    log = io.StringIO()
    sup = Supervisor(log)
    sup.start([fake_spec("ok"), fake_spec("dies", "--die-after", "0.3")], 10)
    try:
        assert sup.wait() == 1
    finally:
        sup.stop()
    assert "dies exited unexpectedly with code 3" in log.getvalue()


def test_wait_returns_zero_after_request_stop() -> None:
    sup = Supervisor(io.StringIO())
    sup.request_stop(signal.SIGTERM)
    assert sup.wait() == 0


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _read_until(lines: queue.Queue[str], marker: str, within_s: float = 10) -> list[str]:
    """Lines read up to and including the first that contains `marker`."""
    seen: list[str] = []
    deadline = time.monotonic() + within_s
    while not seen or marker not in seen[-1]:
        seen.append(lines.get(timeout=max(deadline - time.monotonic(), 0.01)))
    return seen


def _drive(*specs: ProcessSpec) -> subprocess.Popen[str]:
    payload = json.dumps([[s.name, s.argv, s.health_url] for s in specs])
    return subprocess.Popen([sys.executable, str(DRIVER), payload], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def test_sigterm_to_the_supervisor_stops_every_child() -> None:
    proc = _drive(fake_spec("w", "--ignore-term"), fake_spec("r"))
    try:
        lines = _lines(proc)
        seen = _read_until(lines, "READY")
        pids = [int(line.split()[-1]) for line in seen if "] pid " in line]
        assert len(pids) == 2 and all(running(pid) for pid in pids)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        seen = _read_until(lines, "handlers restored")
    finally:
        proc.kill()
    assert "stopping..." in seen and "stopped" in seen
    assert not any(running(pid) for pid in pids)


def test_ctrl_c_during_start_up_stops_and_exits_130() -> None:
    proc = _drive(fake_spec("w", "--delay", "30"), fake_spec("r"))
    try:
        lines = _lines(proc)
        seen = _read_until(lines, "[w] pid ")
        pid = int(seen[-1].split()[-1])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 128 + signal.SIGINT
        seen += _read_until(lines, "handlers restored")
    finally:
        proc.kill()
    assert "READY" not in seen and "stopped" in seen
    assert not running(pid)


def _secret(path: Path, text: str) -> InternalAuth:
    path.write_text(text)
    return InternalAuth(read_secret_file(path))


def test_a_signed_ready_check_counts_only_a_process_that_proves_the_secret(
        tmp_path: Path) -> None:
    """An orphan of an earlier run, still answering 200 on a worker's port, is not taken for
    the worker just launched; nor is another cluster's worker; a holder of the secret is."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    auth, _ = _secret(ours, "o" * 32), _secret(theirs, "t" * 32)
    sup = Supervisor(io.StringIO(), grace_s=1, auth=auth)
    try:
        servers = {"orphan": fake_spec("orphan"),
                   "stranger": fake_spec("stranger", "--secret-file", str(theirs)),
                   "sibling": fake_spec("sibling", "--secret-file", str(ours))}
        sup.start(list(servers.values()), 10)  # unsigned: all three look healthy
        for name in ("orphan", "stranger", "sibling"):
            assert is_healthy(servers[name].health_url)
        assert not is_healthy(servers["orphan"].health_url, auth=auth)
        assert not is_healthy(servers["stranger"].health_url, auth=auth)
        assert is_healthy(servers["sibling"].health_url, auth=auth)
        for name in ("orphan", "stranger"):  # a launched child that never serves, on their port
            silent = ProcessSpec(f"worker-on-{name}-port", fake_spec("x", "--delay", "30").argv,
                                 servers[name].health_url, signed_health=True)
            with pytest.raises(ClusterError, match=f"not healthy in time: {silent.name}"):
                Supervisor(io.StringIO(), grace_s=1, auth=auth).start([silent], 1.5)
    finally:
        sup.stop()


def test_signed_checks_need_the_secret() -> None:
    spec = dataclasses.replace(fake_spec("a"), signed_health=True)
    with pytest.raises(ValueError, match="need signed health checks"):
        Supervisor(io.StringIO()).start([spec], 1)


def test_restart_budget_counts_exits_within_the_window_and_backs_off() -> None:
    policy = RestartPolicy(max_restarts=3, window_s=10, backoff_s=0.5, max_backoff_s=1.5)
    history = RestartHistory(policy)
    assert [history.record(3, 1, now) for now in (0, 1, 2)] == [0.5, 1.0, 1.5]
    assert history.record(3, 1, 10.5) == 1.5  # 3 exits within 10 s (at 1, 2, 10.5): allowed
    assert history.record(-9, 1, 10.8) is None  # the 4th within 10 s
    assert history.codes == [3, 3, 3, -9]
    healthy = RestartHistory(policy)
    assert [healthy.record(3, 1, 0), healthy.record(3, 1, 1)] == [0.5, 1.0]
    assert healthy.record(3, 10, 11) == 0.5  # it ran a whole window: backoff starts again
    with pytest.raises(ValueError, match="restart window"):
        RestartPolicy(window_s=0)


def _restarting(name: str, *options: str) -> ProcessSpec:
    return dataclasses.replace(fake_spec(name, *options), restart=True)


def test_a_crash_loop_is_restarted_with_backoff_then_stopped_at_the_budget() -> None:
    log = io.StringIO()
    policy = RestartPolicy(max_restarts=2, window_s=60, backoff_s=0.2, max_backoff_s=0.3)
    sup = Supervisor(log, grace_s=1, restart_policy=policy)
    sup.start([fake_spec("steady"), _restarting("crashy", "--die-after", "0.5")], 10)
    t0 = time.monotonic()
    try:
        assert sup.wait() == 1
        assert running(sup.pids[0])  # the others served on meanwhile
    finally:
        sup.stop()
    assert time.monotonic() - t0 >= 0.5  # both backoffs were waited
    text = log.getvalue()
    assert text.count("[crashy] pid ") == 3
    assert ("crashy exited with code 3; restarting it in 0.2 s (restart 1 of at most 2 "
            "restarts within 60 s)") in text
    assert "crashy exited with code 3; restarting it in 0.3 s (restart 2 of" in text
    assert ("crashy exited with code 3: 3 exits within 60 s (exit codes 3, 3, 3), over the "
            "restart budget (at most 2 restarts within 60 s per process): stopping "
            "everything") in text
    assert not any(running(pid) for pid in sup.pids)


def test_crashes_spaced_beyond_the_window_keep_the_cluster_up() -> None:
    log = io.StringIO()
    policy = RestartPolicy(max_restarts=1, window_s=0.4, backoff_s=0.1, max_backoff_s=0.4)
    sup = Supervisor(log, grace_s=1, restart_policy=policy)
    sup.start([_restarting("rare", "--die-after", "0.6")], 10)

    def stop_after_three_exits() -> None:  # wait() stays on this thread, which launched
        deadline = time.monotonic() + 30
        while log.getvalue().count("rare exited") < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        sup.request_stop(signal.SIGTERM)

    watcher = threading.Thread(target=stop_after_three_exits, daemon=True)
    watcher.start()
    try:
        assert sup.wait() == 0
    finally:
        sup.stop()
    text = log.getvalue()
    assert text.count("rare exited with code 3") >= 3
    assert "over the restart budget" not in text
    assert text.count("restarting it in 0.1 s (restart 1 of at most 1") >= 3  # backoff reset


def test_killing_the_supervisor_stops_its_children() -> None:
    proc = _drive(fake_spec("w", "--report-pdeathsig"), fake_spec("r", "--report-pdeathsig"))
    try:
        seen = _read_until(_lines(proc), "READY")
        pids = [int(line.split()[-1]) for line in seen if "] pid " in line]
        assert len(pids) == 2 and all(running(pid) for pid in pids)
        assert sum(f"pdeathsig {int(signal.SIGTERM)}" in line for line in seen) == 2
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
    assert all(gone_soon(pid, within_s=10) for pid in pids)


def test_a_child_whose_parent_died_before_it_was_guarded_exits() -> None:
    """The parent-death signal cannot come when the parent is already gone: the child must
    notice (its parent pid is not the one expected) and exit rather than run on."""
    other = subprocess.Popen([sys.executable, "-c", "pass"])
    other.wait()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                             preexec_fn=parent_death.guard(parent=other.pid))
    try:
        assert child.wait(timeout=10) == parent_death.PARENT_GONE
    finally:
        child.kill()
