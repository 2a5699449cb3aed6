"""`pdserve bench serve` end to end against a tiny aiohttp server streaming OpenAI-style
chunks with known delays: TTFT_S before the first token, ITL_S between tokens.

The request's `model` picks what the server does: "ok" (tokens, an empty last chunk with the
finish_reason, usage, [DONE]), "packed" (two tokens per chunk), "nousage", "http400",
"midstream" (two tokens, then an error event), "nodone" (a token, then the stream closes),
"slow" (nothing for seconds), "routed" (as "ok", with pdserve's route header).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import statistics
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from pdserve.bench.serve.client import completions_url, request_body, send_request
from pdserve.bench.serve.metrics import request_json
from pdserve.bench.serve.runner import (
    Load,
    add_bench_serve_args,
    run_bench_async,
    run_bench_serve,
)
from pdserve.bench.serve.workloads import RequestSpec, Workload
from tests.http_app import serving

TTFT_S = 0.2
ITL_S = 0.05
ROUTED = "disaggregated; rule=measured_cost"
SPEC = RequestSpec(arrival_s=0.0, prompt_token_ids=(1001, 1002, 1003), max_tokens=5)


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def _chunk(text: str, finish_reason: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return _event({"id": "cmpl-1", "object": "text_completion", "choices": [choice]})


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


async def _stream(resp: web.StreamResponse, mode: str, max_tokens: int) -> None:
    await asyncio.sleep(10 if mode == "slow" else TTFT_S)
    step = 2 if mode == "packed" else 1
    for i in range(0, max_tokens, step):
        if i:
            await asyncio.sleep(ITL_S)
        await resp.write(_chunk(" tok" * step))
        if mode == "midstream" and i == 1:
            await resp.write(_event(_error("worker died")) + b"data: [DONE]\n\n")
            return
        if mode == "nodone":
            return
    await resp.write(_chunk("", "length"))
    if mode != "nousage":
        usage = {"prompt_tokens": 3, "completion_tokens": max_tokens, "total_tokens": 0}
        await resp.write(_event({"id": "cmpl-1", "choices": [], "usage": usage}))
    await resp.write(b"data: [DONE]\n\n")


@dataclass
class Seen:
    """What the fake server saw: request bodies, streams in flight now and at most."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0


SEEN = web.AppKey("seen", Seen)


async def _completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    seen = request.app[SEEN]
    seen.bodies.append(body)
    if body["model"] == "http400":
        return web.json_response(_error("prompt is too long"), status=400)
    seen.in_flight += 1
    seen.peak = max(seen.peak, seen.in_flight)
    try:
        headers = {"Content-Type": "text/event-stream"}
        if body["model"] == "routed":
            headers["X-Pdserve-Route"] = ROUTED
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        await _stream(resp, body["model"], body["max_tokens"])
        return resp
    finally:
        seen.in_flight -= 1


@contextlib.asynccontextmanager
async def fake_server() -> AsyncIterator[tuple[str, Seen]]:
    """The server's base URL (ending in /v1) and what it saw."""
    app = web.Application()
    app[SEEN] = Seen()
    app.router.add_post("/v1/completions", _completions)
    async with serving(app) as base:
        yield base + "/v1", app[SEEN]


async def _send(model: str, spec: RequestSpec = SPEC, timeout_s: float = 10.0):
    async with fake_server() as (url, seen), aiohttp.ClientSession() as session:
        record = await send_request(session, completions_url(url), model, spec, timeout_s)
        return record, seen.bodies


def test_urls_and_body():
    assert completions_url("http://h:8000") == "http://h:8000/v1/completions"
    assert completions_url("http://h:8000/v1/") == "http://h:8000/v1/completions"
    with pytest.raises(ValueError):
        completions_url("h:8000")
    assert request_body("m", SPEC) == {
        "model": "m", "prompt": [1001, 1002, 1003], "max_tokens": 5, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def test_measured_timings_match_injected_delays():
    record, bodies = asyncio.run(_send("ok"))
    assert bodies == [request_body("ok", SPEC)]
    assert record.ok and record.output_tokens == 5 and record.prompt_tokens == 3
    times = record.token_times_s
    assert len(times) == 5  # the empty finish_reason chunk is not a token
    assert TTFT_S * 0.9 <= times[0] - record.send_s <= TTFT_S + 1.0
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(ITL_S * 0.7 <= g <= ITL_S + 0.5 for g in gaps)
    assert statistics.fmean(gaps) == pytest.approx(ITL_S, abs=0.03)
    assert record.end_s >= times[-1]


def test_the_route_header_is_kept_where_the_server_sends_one():
    routed, _ = asyncio.run(_send("routed"))
    plain, _ = asyncio.run(_send("ok"))
    assert routed.ok and routed.route == ROUTED
    assert plain.ok and plain.route is None
    assert request_json(routed, routed.send_s)["route"] == ROUTED


def test_usage_counts_tokens_else_text_events():
    packed, _ = asyncio.run(_send("packed", RequestSpec(0.0, (1001,), 4)))
    assert len(packed.token_times_s) == 2 and packed.output_tokens == 4
    bare, _ = asyncio.run(_send("nousage"))
    assert bare.ok and bare.output_tokens == 5


@pytest.mark.parametrize(("model", "error", "tokens"), [
    ("http400", "HTTP 400: prompt is too long", 0),
    ("midstream", "error event: worker died", 2),
    ("nodone", "stream ended without [DONE]", 1),
    ("slow", "timeout after 0.3 s", 0),
])
def test_failures_are_recorded_with_their_message(model, error, tokens):
    record, _ = asyncio.run(_send(model, timeout_s=0.3))
    assert not record.ok and record.error == error
    assert len(record.token_times_s) == tokens


def test_connection_refused_is_a_failure():
    async def go():
        async with fake_server() as (url, _):
            pass  # closed again: nothing listens there now
        async with aiohttp.ClientSession() as session:
            return await send_request(session, completions_url(url), "ok", SPEC, 5.0)

    record = asyncio.run(go())
    assert not record.ok and record.error.startswith("connection error: ")


def _fixed(n_in: int = 8, n_out: int = 4) -> Workload:
    return Workload("fixed", input_len=n_in, output_len=n_out)


def test_open_loop_run():
    async def go():
        async with fake_server() as (url, seen):
            load = Load(rate=20.0, num_requests=6)
            return await run_bench_async(url, "ok", _fixed(), load, progress=False), seen

    result, seen = asyncio.run(go())
    assert (result["completed"], result["failed"]) == (6, 0)
    assert result["total_input_tokens"] == 48 and result["total_output_tokens"] == 24
    assert result["median_ttft_ms"] == pytest.approx(1000 * TTFT_S, abs=150)
    assert result["mean_itl_ms"] == pytest.approx(1000 * ITL_S, abs=30)
    assert result["mean_tpot_ms"] == pytest.approx(1000 * ITL_S, abs=40)
    assert result["request_goodput"] is None and result["errors"] == []
    assert result["request_rate"] == 20.0 and result["workload"] == "fixed"
    rows = result["requests"]
    assert len(rows) == 6 and rows[0]["start_s"] == 0.0
    assert [len(r["itl_s"]) for r in rows] == [3] * 6
    assert len(seen.bodies) == 6


def test_closed_loop_keeps_its_concurrency():
    async def go(load: Load):
        async with fake_server() as (url, seen):
            return await run_bench_async(url, "ok", _fixed(), load, progress=False), seen

    result, seen = asyncio.run(go(Load(concurrency=2, num_requests=5)))
    assert result["completed"] == 5 and seen.peak == 2
    assert result["max_concurrency"] == 2 and result["request_rate"] is None
    # by time: no request starts after the duration (each takes ~0.35 s)
    result, seen = asyncio.run(go(Load(concurrency=2, duration_s=0.5)))
    assert 2 <= result["completed"] <= 6 and seen.peak <= 2
    assert all(r["start_s"] < 0.5 for r in result["requests"])


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pdserve bench serve")
    add_bench_serve_args(parser)
    return parser.parse_args(argv)


def test_command_line(tmp_path, capsys):
    out = tmp_path / "result.json"

    async def go(*argv: str) -> int:
        async with fake_server() as (url, _):
            root = url.removesuffix("/v1")  # the server root works as well as .../v1
            args = _parse("--url", root, *argv)
            return await asyncio.to_thread(run_bench_serve, args)

    common = ("--workload", "fixed", "--input-len", "4", "--output-len", "3",
              "--num-requests", "3", "--rate", "50")
    assert asyncio.run(go("--model", "ok", *common, "--slo-ttft-ms", "5000", "--json",
                          "--out", str(out))) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["completed"] == 3 and "requests" not in printed
    assert printed["request_goodput"] > 0 and printed["slo_ttft_ms"] == 5000
    assert len(json.loads(out.read_text())["requests"]) == 3

    assert asyncio.run(go("--model", "http400", *common)) == 1  # every request failed
    table = capsys.readouterr().out
    assert "Failed requests:" in table and "error: HTTP 400: prompt is too long" in table


def test_bad_arguments_exit_2_and_help_lists_workloads(capsys):
    assert run_bench_serve(_parse("--workload", "fixed", "--input-len", "4")) == 2
    assert run_bench_serve(_parse("--workload", "rag", "--max-model-len", "1024")) == 2
    assert run_bench_serve(_parse("--rate", "0")) == 2
    assert run_bench_serve(_parse("--url", "localhost:8000")) == 2
    assert run_bench_serve(_parse("--out", "/nonexistent/dir/r.json")) == 2
    assert "max_model_len" in capsys.readouterr().err
    parser = argparse.ArgumentParser(prog="pdserve bench serve")
    add_bench_serve_args(parser)
    text = parser.format_help()
    for kind in ("chat", "rag", "mixed", "fixed"):
        assert f"\n  {kind} " in text
    with pytest.raises(SystemExit):
        _parse("--rate", "1", "--concurrency", "2")
