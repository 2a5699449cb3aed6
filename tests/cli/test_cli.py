"""The `pdserve` command as a user runs it: a real subprocess, its output and exit code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def _pdserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


def test_generate_prints_the_completion(tiny_model):
    res = _pdserve("generate", "The capital of France is", "--model", str(tiny_model("llama")),
                   "--max-tokens", "5", "--dtype", "float32", "--raw")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    assert "5 tokens" in res.stderr and "finish_reason=length" in res.stderr


def test_generate_bad_model_is_a_clear_error():
    res = _pdserve("generate", "hi", "--model", "no-such-model")
    assert res.returncode == 2
    assert "pdserve: error:" in res.stderr and "smollm2" in res.stderr
    assert "Traceback" not in res.stderr


def test_bench_engine_json_rows(tiny_model):
    # --no-cpu-kernels gives these very rows (the tiny model never runs the fused operators);
    # that the flag reaches the benchmark is test_engine_bench's
    res = _pdserve("bench", "engine", "--model", str(tiny_model("llama")), "--batches", "1,2",
                   "--decode-steps", "2", "--prompt-lens", "24,40", "--cached-len", "48",
                   "--chunk", "16", "--repeats", "1", "--json")
    assert res.returncode == 0, res.stderr
    assert "pdserve on PyTorch operators" in res.stderr  # head_dim 16: never the fused ones
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    assert [(r["phase"], r["batch"], r["prompt_tokens"], r["cached_tokens"], r["chunk_tokens"])
            for r in rows] == [("decode", 1, 32, 0, 0), ("decode", 2, 32, 0, 0),
                               ("prefill", 1, 24, 0, 0), ("prefill", 1, 40, 0, 0),
                               ("prefill", 1, 48, 16, 0),  # half of 48 in whole blocks of 16
                               ("prefill", 1, 48, 0, 16)]
    for r in rows:
        for key in ("pdserve_tok_s", "roofline_tok_s", "compute_roof_tok_s"):
            assert r[key] > 0
        # no transformers baseline for a prefix-cache hit or a chunked prompt
        baseline = r["cached_tokens"] == 0 and r["chunk_tokens"] == 0
        assert (r["transformers_tok_s"] is not None) == baseline
        bound = min(r["roofline_tok_s"], r["compute_roof_tok_s"])
        assert r["of_bound"] == round(r["pdserve_tok_s"] / bound, 3)
    # the compute roof does not depend on the batch; prefill's roofline is its compute roof;
    # the chunked prompt has the whole prompt's roof
    assert rows[0]["compute_roof_tok_s"] == rows[1]["compute_roof_tok_s"]
    assert all(r["compute_roof_tok_s"] == r["roofline_tok_s"] for r in rows[2:])
    assert rows[4]["compute_roof_tok_s"] != rows[5]["compute_roof_tok_s"]


def test_bench_transfer_json_rows():
    res = _pdserve("bench", "transfer", "--sizes", "1,2", "--repeats", "1", "--json")
    assert res.returncode == 0, res.stderr
    rows = [json.loads(line) for line in res.stdout.splitlines()]
    moves = [r for r in rows if "mode" in r]
    transports = ["tcp", "tcp-aes", "nixl"]  # the nixl wheel is a test dependency
    assert [(r["transport"], r["mode"]) for r in moves] == [
        (t, m) for t in transports for _ in (1, 2) for m in ("push", "pull")]
    for r in moves:
        assert r["bytes"] >= 2**20 and r["gbps"] > 0 and r["memcpy_gbps"] > 0
        assert r["socket_gbps"] > 0
    overheads = [r for r in rows if r.get("kind") == "overhead"]
    assert [o["transport"] for o in overheads] == transports
    for o in overheads:
        assert o["bytes"] == 63 * 368_640 and o["crc32c_ms"] > 0


@pytest.mark.parametrize("args", [["--help"], ["generate", "--help"], ["bench", "engine", "--help"],
                                  ["bench", "transfer", "--help"],
                                  ["plan", "--help"]])
def test_help_explains(args):
    res = _pdserve(*args)
    assert res.returncode == 0 and "usage: pdserve" in res.stdout
