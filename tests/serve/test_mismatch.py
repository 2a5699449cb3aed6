"""Workers whose KV layouts differ, started by hand (`pdserve up` gives every worker the same
settings): a prefill worker in float32 and a decode worker in bfloat16 (PEERS.md 5: mismatched
parallelism or dtypes hang or assert elsewhere). The transfer is refused with the field named,
the decode worker recomputes, the request completes, and no block is left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai

from pdserve.cluster.up_process import free_port, get_json
from tests.serve.cluster import metric
from tests.serve.conftest import LOCAL_THRESHOLD
from tests.serve.test_faults import LONG

START_TIMEOUT_S = 120.0


def _spawn(args: list[str], log: Path) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert proc.poll() is None, f"{url} exited with {proc.returncode}"
        try:
            get_json(url + "/health")
            return
        except OSError:
            assert time.monotonic() < deadline, f"{url} never became healthy"
            time.sleep(0.2)


def test_mismatched_kv_layouts_are_refused_and_the_request_still_completes(
        tiny_model, tmp_path: Path) -> None:
    model = str(tiny_model())
    secret = tmp_path / "secret"
    secret.write_bytes(os.urandom(32))
    port = free_port((0, 1, 2, 101, 102))
    urls = {role: f"http://127.0.0.1:{port + i}" for i, role in
            ((1, "prefill"), (2, "decode"))}
    procs: list[subprocess.Popen] = []
    try:
        for i, (role, dtype) in enumerate((("prefill", "float32"), ("decode", "bfloat16")), 1):
            procs.append(_spawn(
                ["worker", "--role", role, "--model", model, "--dtype", dtype, "--port",
                 str(port + i), "--kv-port", str(port + 100 + i), "--secret-file", str(secret),
                 "--kv-cache-memory", "16MiB", "--max-model-len", "512"], tmp_path / role))
        procs.append(_spawn(["router", "--port", str(port), "--model", model,
                             "--local-prefill-threshold", str(LOCAL_THRESHOLD),
                             "--prefill", urls["prefill"], "--decode", urls["decode"]],
                            tmp_path / "router"))
        for url, proc in ((urls["prefill"], procs[0]), (urls["decode"], procs[1]),
                          (f"http://127.0.0.1:{port}", procs[2])):
            _wait_healthy(url, proc)
        time.sleep(1.5)  # one health round: the router knows both workers' transfer endpoints
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=60)
        out = client.completions.create(model=model, prompt=LONG, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 8
        assert metric(urls["decode"], "pdserve_kv_recomputes_total") == 1
        deadline = time.monotonic() + 10
        while any(get_json(u + "/health")["kv_blocks_used"] for u in urls.values()):
            assert time.monotonic() < deadline, "KV blocks still used"
            time.sleep(0.1)
        decode_log = (tmp_path / "decode").read_text()
        assert "incompatible KV layout: dtype is 'float32' here but 'bfloat16'" in decode_log
        assert "recomputing the prompt locally" in decode_log
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
