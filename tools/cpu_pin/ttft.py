"""Does moving a worker onto more cores while it serves (`POST /internal/cpus`) make it compute
faster at once? Starts one collocated `pdserve worker` on the first of --cores, times a prompt
of --prompt-tokens random token ids (max_tokens 1: the time to first token, its prefill)
--repeats times, moves the worker onto all of --cores, times again, and back, twice; prints the
median of each stage, the ratio of each to the first one-core stage, and how long each move
took. Nothing else should run meanwhile.

    .venv/bin/python tools/cpu_pin/ttft.py [--cores 0,1] [--prompt-tokens 1500] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.cluster.up_process import free_port
from pdserve.internal_auth import InternalAuth

START_TIMEOUT_S = 300


class Worker:
    def __init__(self, url: str, auth: InternalAuth) -> None:
        self.url, self.auth = url, auth

    def call(self, path: str, body: object = None, signed: bool = False) -> Any:
        method = "GET" if body is None else "POST"
        headers = {"Content-Type": "application/json"}
        if signed:
            headers |= self.auth.headers(method, path)
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=headers,
                                         method=method)
        with urllib.request.urlopen(request, timeout=300) as r:
            return json.loads(r.read())

    def wait_ready(self, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if self.call("/health", signed=True).get("role"):
                    return
            except OSError:
                pass
            time.sleep(1)
        raise RuntimeError("the worker never became ready")

    def ttft_s(self, prompt: list[int], model: str) -> float:
        t0 = time.perf_counter()
        self.call("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1})
        return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cores", default="0,1", help="the cores to move onto; the worker "
                        "starts on the first (default: 0,1)")
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="smollm2")
    args = parser.parse_args()
    cores = [int(c) for c in args.cores.split(",")]
    secret = os.urandom(32).hex().encode()
    with tempfile.TemporaryDirectory() as folder:
        secret_file = Path(folder) / "secret"
        secret_file.write_bytes(secret)
        secret_file.chmod(0o600)
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "worker", "--model", args.model, "--port",
             str(port), "--secret-file", str(secret_file), "--serve-public", "--cpus",
             str(cores[0])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            worker = Worker(f"http://127.0.0.1:{port}", InternalAuth(secret))
            worker.wait_ready(proc)
            run(worker, cores, args.prompt_tokens, args.repeats)
        finally:
            proc.terminate()
            proc.wait(30)
    return 0


def run(worker: Worker, cores: list[int], tokens: int, repeats: int) -> None:
    model = worker.call("/v1/models")["data"][0]["id"]
    rng = random.Random(0)
    vocab = 1000  # token ids 100..1099: any model's vocabulary has them

    def prompt() -> list[int]:
        return [100 + rng.randrange(vocab) for _ in range(tokens)]

    worker.ttft_s(prompt(), model)  # first use
    first = None
    for stage in (cores[:1], cores, cores[:1], cores):
        moved = worker.call("/internal/cpus", {"cpus": stage}, signed=True)
        median = statistics.median(worker.ttft_s(prompt(), model) for _ in range(repeats))
        first = first or median
        print(f"cores {','.join(map(str, stage)):<8} {moved['threads']} threads (moved in "
              f"{moved['seconds'] * 1e3:.2f} ms): median TTFT {median:.3f} s of {repeats}, "
              f"{first / median:.2f}x the first one-core stage's speed", flush=True)


if __name__ == "__main__":
    sys.exit(main())
