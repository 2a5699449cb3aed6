"""Mismatched workers, started by hand (`pdserve up` gives every worker the same settings): the
router meets each worker's signed details before routing to it, refuses every worker that
differs from the cluster in one field (the cluster secret, dtype, served model name, context
length, KV block size) with that field named, never sends it a leg, and serves every request
on the matching pair, split as usual, its KV moved (not recomputed)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from pdserve.cluster.up_process import free_port, get_json, get_signed_json
from pdserve.internal_auth import InternalAuth
from tests.serve.cluster import metric
from tests.serve.conftest import LOCAL_THRESHOLD
from tests.serve.test_faults import LONG

START_TIMEOUT_S = 120.0


class Processes:
    """Workers and routers as child processes, each in its own session with its log in
    `folder` (NAME.log); `stop()` SIGTERMs them all (SIGKILL after a grace)."""

    def __init__(self, folder: Path, model: Path) -> None:
        self.folder, self.model = folder, str(model)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str) -> subprocess.Popen:
        with (self.folder / f"{name}.log").open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[name] = proc
        return proc

    def worker(self, name: str, role: str, port: int, secret: Path, *overrides: str) -> str:
        """A worker of the reference settings (fp32, 16-token blocks, 512-token context),
        `overrides` last (argparse keeps the last value); returns its URL."""
        self.start(name, "worker", "--role", role, "--model", self.model, "--dtype", "float32",
                   "--port", str(port), "--kv-port", str(port + 100), "--secret-file",
                   str(secret), "--kv-cache-memory", "16MiB", "--max-model-len", "512",
                   *overrides)
        return f"http://127.0.0.1:{port}"

    def wait_live(self, name: str, url: str) -> None:
        """Until `url`/health answers 200 (unsigned: liveness)."""
        proc, deadline = self.procs[name], time.monotonic() + START_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{self.log(name)}"
            try:
                get_json(url + "/health")
                return
            except OSError:
                assert time.monotonic() < deadline, f"{name} never became live"
                time.sleep(0.2)

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text(errors="replace")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


def write_secret(path: Path) -> Path:
    path.write_bytes(os.urandom(32).hex().encode())
    path.chmod(0o600)
    return path


# one mismatched prefill worker per field: (name, arguments over the reference's, reason)
MISMATCHES = [
    ("secret", ("--secret-file", "OTHER_SECRET"), "does not share the cluster secret"),
    ("dtype", ("--dtype", "bfloat16"), "dtype 'bfloat16' differs from the cluster's 'float32'"),
    ("name", ("--served-model-name", "other"),
     "served model name 'other' differs from the router's"),
    ("max_model_len", ("--max-model-len", "256"),
     "max_model_len 256 differs from the cluster's 512"),
    ("block_size", ("--block-size", "32"),
     "kv_layout.block_size 32 differs from the cluster's 16"),
]


def _legs(url: str) -> float:
    """Every leg the worker ever accepted, of any kind."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        return sum(float(line.split()[-1]) for line in r.read().decode().splitlines()
                   if line.startswith("pdserve_legs_total"))


@pytest.fixture
def processes(tmp_path: Path, tiny_model) -> Processes:
    procs = Processes(tmp_path, tiny_model())
    yield procs
    procs.stop()


def test_every_mismatched_worker_is_refused_with_its_field_and_never_routed_to(
        processes: Processes, tmp_path: Path) -> None:
    secret = write_secret(tmp_path / "secret")
    other_secret = write_secret(tmp_path / "other-secret")
    port = free_port([*range(len(MISMATCHES) + 3), *range(101, len(MISMATCHES) + 103)])
    urls = {"prefill": processes.worker("prefill", "prefill", port + 1, secret),
            "decode": processes.worker("decode", "decode", port + 2, secret)}
    for i, (name, args, _) in enumerate(MISMATCHES, start=3):
        args = tuple(str(other_secret) if a == "OTHER_SECRET" else a for a in args)
        urls[name] = processes.worker(name, "prefill", port + i, secret, *args)
    for name, url in urls.items():
        processes.wait_live(name, url)
    # every worker is up before the router: the first --prefill URL sets the reference
    prefills = [urls["prefill"], *(urls[name] for name, _, _ in MISMATCHES)]
    processes.start("router", "router", "--port", str(port), "--model", processes.model,
                    "--secret-file", str(secret), "--policy", "round_robin",
                    "--local-prefill-threshold", str(LOCAL_THRESHOLD),
                    "--prefill", *prefills, "--decode", urls["decode"])
    router = f"http://127.0.0.1:{port}"
    processes.wait_live("router", router)

    auth = InternalAuth(secret.read_bytes().strip())
    workers = {w["url"]: w for w in get_signed_json(auth, router + "/health")["workers"]}
    for name in ("prefill", "decode"):
        assert workers[urls[name]]["healthy"] and workers[urls[name]]["refused"] is None
    for name, _, reason in MISMATCHES:
        state = workers[urls[name]]
        assert not state["healthy"] and reason in (state["refused"] or ""), (name, state)

    client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    for prompt in (LONG, LONG[::-1], LONG[1:] + LONG[:1]):  # each uncached: split
        out = client.completions.create(model=processes.model, prompt=prompt, max_tokens=8,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8
    assert metric(router, 'pdserve_router_requests_total{path="disaggregated"}') == 3
    assert metric(urls["decode"], "pdserve_kv_recomputes_total") == 0  # every KV moved
    for name, _, _ in MISMATCHES:
        assert _legs(urls[name]) == 0, name

    time.sleep(2)  # more health rounds: a refusal is logged once, not every second
    router_log = processes.log("router")
    for name, _, _ in MISMATCHES:
        warnings = re.findall(rf"worker prefill {re.escape(urls[name])} refused", router_log)
        assert len(warnings) == 1, (name, router_log)

