"""Elastic pools with real processes: a `pdserve router` started with no worker, a `pdserve
worker --register` that joins it once loaded and serves a request through it, a worker with
another cluster secret that is refused while the router keeps serving, and on SIGTERM the
joined worker drains and leaves: `pdserve ctl workers --json` no longer lists it. Joined
workers flipped through the router (`pdserve ctl flip`) serve split requests in their new
roles, the KV moved between them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai

from pdserve.cluster.up_process import free_port
from tests.serve.cluster import metric
from tests.serve.conftest import LOCAL_THRESHOLD
from tests.serve.test_faults import LONG
from tests.serve.test_mismatch import START_TIMEOUT_S, Processes, processes, write_secret

__all__ = ["processes"]  # the fixture


def wait_listening(processes: Processes, name: str, url: str) -> None:
    """Until `url`/health answers at all (a router with no worker answers 503)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert processes.procs[name].poll() is None, processes.log(name)
        try:
            urllib.request.urlopen(url + "/health", timeout=5).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            assert time.monotonic() < deadline, f"{name} never listened"
            time.sleep(0.2)


def ctl_workers(router: str, secret: Path) -> list[dict]:
    res = subprocess.run([sys.executable, "-m", "pdserve.cli", "ctl", "--url", router,
                          "--secret-file", str(secret), "workers", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def wait_for(what: str, check, timeout_s: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.3)


def test_a_worker_joins_serves_and_leaves_and_a_stranger_is_refused(
        processes: Processes, tmp_path: Path) -> None:
    secret = write_secret(tmp_path / "secret")
    other = write_secret(tmp_path / "other-secret")
    port = free_port([0, 1, 2, 101, 102])
    router = f"http://127.0.0.1:{port}"
    processes.start("router", "router", "--port", str(port), "--model", processes.model,
                    "--secret-file", str(secret), "--worker-grace", "5")
    wait_listening(processes, "router", router)
    assert ctl_workers(router, secret) == []
    joined = processes.worker("joined", "collocated", port + 1, secret, "--register", router,
                              "--name", "joined-1")
    processes.worker("stranger", "collocated", port + 2, secret, "--secret-file", str(other),
                     "--register", router)

    def listed() -> list[tuple[str, str, str]]:
        return [(w["name"], w["url"], w["state"]) for w in ctl_workers(router, secret)]

    wait_for("the worker joined", lambda: listed() == [("joined-1", joined, "healthy")])
    wait_for("the stranger was refused",
             lambda: "refused this worker (401: " in processes.log("stranger"))
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    out = client.completions.create(model=processes.model, prompt="The pool grew", max_tokens=4,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    assert listed() == [("joined-1", joined, "healthy")]  # the stranger never joined

    worker = processes.procs["joined"]
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(60) == 0
    assert "left the router at" in processes.log("joined")
    assert ctl_workers(router, secret) == []
    assert "worker joined-1 (collocated " in processes.log("router")
    assert "removed: deregistered" in processes.log("router")
    assert processes.procs["router"].poll() is None


def ctl_flip(router: str, secret: Path, name: str, role: str) -> dict:
    res = subprocess.run([sys.executable, "-m", "pdserve.cli", "ctl", "--url", router,
                          "--secret-file", str(secret), "flip", name, "--role", role, "--json"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_joined_workers_flipped_through_the_router_serve_split_requests(
        processes: Processes, tmp_path: Path) -> None:
    secret = write_secret(tmp_path / "secret")
    port = free_port([0, 1, 2, 101, 102])
    router = f"http://127.0.0.1:{port}"
    processes.start("router", "router", "--port", str(port), "--model", processes.model,
                    "--secret-file", str(secret), "--local-prefill-threshold",
                    str(LOCAL_THRESHOLD))
    wait_listening(processes, "router", router)
    for i, name in enumerate(("a", "b"), start=1):
        processes.worker(name, "collocated", port + i, secret, "--register", router, "--name",
                         name)
    wait_for("both joined", lambda: sorted((w["name"], w["state"]) for w in ctl_workers(
        router, secret)) == [("a", "healthy"), ("b", "healthy")])
    flipped = [ctl_flip(router, secret, "a", "decode"), ctl_flip(router, secret, "b", "prefill")]
    assert [(f["worker"], f["from"], f["to"]) for f in flipped] == [
        ("a", "collocated", "decode"), ("b", "collocated", "prefill")]
    assert sorted((w["name"], w["role"], w["state"]) for w in ctl_workers(router, secret)) == [
        ("a", "decode", "healthy"), ("b", "prefill", "healthy")]
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    out = client.completions.create(model=processes.model, prompt=LONG, max_tokens=4,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    assert metric(router, 'pdserve_router_requests_total{path="disaggregated"}') == 1
    assert metric(f"http://127.0.0.1:{port + 1}", "pdserve_kv_recomputes_total") == 0
    assert metric(router, 'pdserve_role_flips_total{from="collocated",to="prefill"}') == 1
