"""`pdserve bench serve` against a real `pdserve up`: the JSON a user gets, no failed request."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.cli import main
from tests.serve.cluster import Cluster

VLLM_KEYS = ("duration", "completed", "total_input_tokens", "total_output_tokens",
             "request_throughput", "request_goodput", "output_throughput",
             "total_token_throughput")


def test_bench_serve_against_pdserve_up(disagg_tcp: Cluster, tmp_path: Path, capsys) -> None:
    out = tmp_path / "results.json"
    code = main(["bench", "serve", "--url", disagg_tcp.url, "--model", disagg_tcp.model,
                 "--workload", "fixed", "--input-len", "40", "--output-len", "8", "--vocab",
                 "512", "--rate", "20", "--num-requests", "12", "--slo-ttft-ms", "10000",
                 "--slo-tpot-ms", "10000", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert result["failed"] == 0 and result["completed"] == 12
    assert result["total_input_tokens"] == 12 * 40
    assert result["total_output_tokens"] == 12 * 8
    for key in VLLM_KEYS:
        assert result[key] is not None, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert result[f"{stat}_{metric}_ms"] >= 0
    assert result["request_goodput"] == result["request_throughput"]
    assert len(result["requests"]) == 12
    # A gap per text-carrying chunk, as vLLM counts them; a token whose text is held back
    # (an incomplete UTF-8 sequence) arrives with the next one.
    assert all(1 <= len(r["itl_s"]) <= 7 for r in result["requests"])
    assert all(r["output_tokens"] == 8 for r in result["requests"])
    # split requests (40 tokens > the threshold): TTFT is the real first token, never 0
    assert all(0 < r["ttft_s"] < r["e2e_s"] for r in result["requests"])
    assert result["median_ttft_ms"] > 0
    assert "Time to First Token" in capsys.readouterr().out
