"""`pdserve bench chaos`: when faults land, what a response stream came to, the summary, the
options; and one whole run against a real cluster of the tiny model."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import subprocess
import sys
import time

import aiohttp
import pytest
from aiohttp import web

from pdserve.bench.chaos.cli import ChaosSettings
from pdserve.bench.chaos.faults import FaultRecord, oversized_body
from pdserve.bench.chaos.load import (
    BACKOFF_S,
    MAX_BACKOFF_S,
    MIX,
    Ended,
    RequestResult,
    draw,
    send,
)
from pdserve.bench.chaos.report import error_latency_s, healthy, summarize
from pdserve.bench.chaos.schedule import (
    FAULT_KINDS,
    MAX_ROUNDS,
    MIN_GAP_S,
    RECOVERY_FRACTION,
    WARMUP_FRACTION,
    parse_faults,
    schedule,
)
from pdserve.bench.chaos.stream import End, Outcome, SseReader, classify
from pdserve.cli import main as pdserve_main
from tests.http_app import serving

# -- the schedule -------------------------------------------------------------------------------


def test_faults_are_spread_evenly_between_the_warm_up_and_the_recovery_tail() -> None:
    plan = schedule(FAULT_KINDS, 120.0)
    times = [f.at_s for f in plan]
    assert len(plan) == 2 * len(FAULT_KINDS)  # 78 s of window fits two rounds 4 s apart
    assert [f.kind for f in plan] == list(FAULT_KINDS) * 2
    assert min(times) > WARMUP_FRACTION * 120 and max(times) < (1 - RECOVERY_FRACTION) * 120
    gaps = {round(b - a, 6) for a, b in itertools.pairwise(times)}
    assert len(gaps) == 1 and gaps.pop() >= MIN_GAP_S


def test_a_long_run_has_at_most_max_rounds_so_restarts_stay_in_budget() -> None:
    plan = schedule(("kill9-decode",), 3600.0)
    assert len(plan) == MAX_ROUNDS


def test_a_run_too_short_for_its_faults_is_refused_with_the_shortest_duration() -> None:
    with pytest.raises(ValueError, match=r"--duration 10 s is too short for 8 fault kinds .* "
                                         r"at least 49 s"):
        schedule(FAULT_KINDS, 10.0)
    assert schedule((), 10.0) == []


def test_faults_parse_in_canonical_order_and_all_means_every_kind() -> None:
    assert parse_faults("oversized-body, kill9-decode,oversized-body") == (
        "oversized-body", "kill9-decode")
    assert parse_faults("all") == FAULT_KINDS


def test_an_unknown_fault_is_named_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown fault 'kill-9' in --faults; choose from "
                                         r"kill9-prefill, .*kill9-decode \(or all\)"):
        parse_faults("kill9-decode,kill-9")


def test_the_command_refuses_an_unknown_fault_before_starting_anything(capsys) -> None:
    assert pdserve_main(["bench", "chaos", "--faults", "sigkill"]) == 2
    assert "pdserve: error: unknown fault 'sigkill' in --faults" in capsys.readouterr().err


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="--streams must be >= 1"):
        ChaosSettings(streams=0)
    with pytest.raises(ValueError, match="too short"):
        ChaosSettings(duration_s=5.0)
    s = ChaosSettings(leg_timeout_s=10.0, kv_lease_s=5.0)
    assert (s.hung_after_s, s.settle_s) == (15.0, 15.0)


# -- a stream's outcome ------------------------------------------------------------------------


def read(*lines: bytes) -> SseReader:
    reader = SseReader()
    for i, line in enumerate(lines):
        reader.feed(line, float(i))
    return reader


COMPLETION = b'data: {"choices": [{"index": 0, "text": "Paris"}]}'
CHAT_ROLE = b'data: {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}'
CHAT_TOKEN = b'data: {"choices": [{"index": 0, "delta": {"content": " is"}}]}'
ERROR = b'data: {"error": {"message": "the decode worker went away", "type": "server_error"}}'
DONE = b"data: [DONE]"


def test_tokens_then_done_is_ok_for_completions_and_chat() -> None:
    assert classify(200, read(COMPLETION, b"", COMPLETION, DONE), End.EOF) == (Outcome.OK, "")
    chat = read(CHAT_ROLE, CHAT_TOKEN, DONE)
    assert chat.token_times_s == [1.0]  # the role chunk carries no text
    assert classify(200, chat, End.EOF) == (Outcome.OK, "")


def test_an_error_event_or_an_http_error_is_a_clean_failure() -> None:
    assert classify(200, read(COMPLETION, ERROR, DONE), End.EOF) == (
        Outcome.FAILED, "error event: the decode worker went away")
    assert classify(503, SseReader(), End.EOF, "HTTP 503: no healthy decode worker") == (
        Outcome.FAILED, "HTTP 503: no healthy decode worker")


def test_silence_past_the_idle_bound_is_hung() -> None:
    assert classify(None, SseReader(), End.IDLE, "15 s") == (
        Outcome.HUNG, "no byte for 15 s before the response headers")
    assert classify(200, read(COMPLETION), End.IDLE, "15 s") == (
        Outcome.HUNG, "no byte for 15 s after 1 tokens")


def test_a_stream_cut_without_done_or_error_is_broken() -> None:
    assert classify(200, read(COMPLETION), End.EOF)[0] is Outcome.BROKEN
    assert classify(200, read(COMPLETION), End.CONNECTION, "reset")[0] is Outcome.BROKEN
    assert classify(200, read(DONE), End.EOF) == (Outcome.BROKEN, "[DONE] without a token")
    assert classify(200, read(b"data: {oops"), End.EOF) == (Outcome.BROKEN, "bad event: {oops")


async def _silent_after_one_token(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(COMPLETION + b"\n\n")
    await asyncio.sleep(30)
    return resp


def test_a_server_that_goes_silent_mid_stream_is_cut_off_as_hung_within_the_bound() -> None:
    async def go() -> tuple[Ended, SseReader, float]:
        app = web.Application()
        app.router.add_post("/v1/completions", _silent_after_one_token)
        async with serving(app) as base, aiohttp.ClientSession() as session:
            reader, started = SseReader(), time.monotonic()
            ended = await send(session, base + "/v1/completions", {}, 0.5, 0.0, reader)
            return ended, reader, time.monotonic() - started

    ended, reader, took = asyncio.run(go())
    assert ended == Ended(200, End.IDLE, "0.5 s")
    assert classify(ended.status, reader, ended.end, ended.detail)[0] is Outcome.HUNG
    assert took < 10  # cut off at the bound, not when the server's 30 s pause ends


async def _overloaded(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "the queue is full", "type": "x"}},
                             status=429, headers={"Retry-After": "3"})


def test_a_refusal_is_a_clean_failure_and_its_retry_after_sets_the_backoff() -> None:
    async def go() -> Ended:
        app = web.Application()
        app.router.add_post("/v1/completions", _overloaded)
        async with serving(app) as base, aiohttp.ClientSession() as session:
            return await send(session, base + "/v1/completions", {}, 5.0, 0.0, SseReader())

    ended = asyncio.run(go())
    assert ended == Ended(429, End.EOF, "HTTP 429: the queue is full", 3.0)
    failed = result(Outcome.FAILED, 0.0, 1.0)
    assert dataclasses.replace(failed, retry_after_s=3.0).backoff_s == 3.0
    assert dataclasses.replace(failed, retry_after_s=600.0).backoff_s == MAX_BACKOFF_S
    assert failed.backoff_s == BACKOFF_S and result(Outcome.OK, 0.0, 1.0).backoff_s == 0


# -- the load's mix and the faults' bodies ------------------------------------------------------


def test_the_mix_is_deterministic_capped_and_has_split_and_local_prompts() -> None:
    shapes = [draw(0, c, j, prompt_cap=700, max_tokens=32) for c in range(4) for j in range(50)]
    assert shapes == [draw(0, c, j, 700, 32) for c in range(4) for j in range(50)]
    assert {s.name for s in shapes} == {name for name, *_ in MIX}
    assert all(1 <= s.prompt_tokens <= 700 and 8 <= s.max_tokens <= 32 for s in shapes)
    assert any(s.prompt_tokens > 256 for s in shapes) and any(s.prompt_tokens < 256
                                                               for s in shapes)


def test_the_oversized_body_is_a_completion_of_exactly_the_asked_size() -> None:
    body = oversized_body("m", 2**20 + 7)
    assert len(body) == 2**20 + 7
    assert json.loads(body)["model"] == "m"


# -- the summary -------------------------------------------------------------------------------


def result(outcome: Outcome, start: float, end: float, detail: str = "") -> RequestResult:
    return RequestResult("short", 40, start, start + 0.1, end, 3, outcome, detail)


def test_the_summary_counts_outcomes_blocks_and_faults() -> None:
    results = [result(Outcome.OK, 0.0, 1.0), result(Outcome.OK, 1.0, 3.0),
               result(Outcome.FAILED, 4.0, 9.0, "HTTP 503: x"),
               result(Outcome.HUNG, 5.0, 30.0, "no byte"), result(Outcome.BROKEN, 6.0, 7.0)]
    faults = [FaultRecord("kill9-decode", 8.5, "decode-0 (pid 1)", "restarted"),
              FaultRecord("stop-cont", 2.0, "-", "no decode worker", injected=False),
              FaultRecord("corrupt-kv", 12.0, "prefill-0 KV", "ANSWERED", promised=False)]
    r = summarize(results, faults, {"prefill-0": 0, "decode-0": 3, "decode-1": None}, "ok", {})
    assert (r["requests"], r["ok"], r["failed"], r["hung"], r["broken"]) == (5, 2, 1, 1, 1)
    assert r["failed_pct"] == 20.0 and r["not_ok_pct"] == 60.0
    assert r["leaked_blocks"] == 3 and r["workers_unreachable"] == ["decode-1"]
    assert r["faults_injected"] == 2 and r["fault_kinds_injected"] == 2
    assert r["faults_not_as_promised"] == 1
    assert [f["kind"] for f in r["faults"]] == ["stop-cont", "kill9-decode", "corrupt-kv"]
    assert r["max_error_latency_ms"] == 500.0  # from the kill at 8.5 s, not the send at 4 s
    assert r["p50_e2e_ms"] == 1500.0
    assert r["errors"][0] == {"count": 1, "outcome": "failed", "detail": "HTTP 503: x"}
    empty = {"ok": 0, "failed": 0, "broken": 0, "hung": 0}
    assert r["timeline"] == [{"t_s": 0.0, "ok": 2, "failed": 1, "broken": 1, "hung": 0},
                             {"t_s": 10.0} | empty, {"t_s": 20.0} | empty,
                             {"t_s": 30.0, "ok": 0, "failed": 0, "broken": 0, "hung": 1}]
    assert not healthy(r)


def test_an_error_before_any_fault_counts_from_its_send() -> None:
    late = FaultRecord("kill9-decode", 50.0, "decode-0", "restarted")
    assert error_latency_s(result(Outcome.FAILED, 4.0, 9.0), [late]) == 5.0


def test_a_clean_run_is_healthy() -> None:
    r = summarize([result(Outcome.OK, 0.0, 1.0)], [], {"decode-0": 0}, "ok", {})
    assert healthy(r) and r["max_error_latency_ms"] is None


# -- one whole run -------------------------------------------------------------------------------


def test_a_short_chaos_run_on_the_tiny_model_hangs_nothing_and_leaks_nothing(tiny_model
                                                                             ) -> None:
    """kill -9 of the decode worker, a client gone mid-stream and an oversized body, under
    three streams, on a real `pdserve up`: every request ends (ok or a clean error), every
    fault is as promised, no KV block stays held, and the cluster serves afterwards."""
    argv = [sys.executable, "-m", "pdserve.cli", "bench", "chaos", "--model", str(tiny_model()),
            "--duration", "20", "--streams", "3",
            "--faults", "kill9-decode,client-gone-stream,oversized-body",
            "--kv-lease", "5", "--leg-timeout", "10", "--json",
            "--up-args", "--dtype", "float32", "--kv-cache-memory", "16MiB",
            "--max-model-len", "512"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for key in ("requests", "ok", "failed", "hung", "leaked_blocks", "faults_injected",
                "p99_e2e_ms", "max_error_latency_ms", "faults"):
        assert key in report, key
    assert report["faults_injected"] >= 3, report["faults"]
    assert report["hung"] == 0 and report["broken"] == 0, report["errors"]
    assert report["leaked_blocks"] == 0, report["blocks_by_worker"]
    assert report["faults_not_as_promised"] == 0, report["faults"]
    assert report["ok"] > 0 and report["served_after"] == "ok"
    assert {f["kind"] for f in report["faults"]} == {"kill9-decode", "client-gone-stream",
                                                     "oversized-body"}
    assert done.returncode == 0, done.stderr[-2000:]
