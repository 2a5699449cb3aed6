"""The router's admission in the simulator: per-worker caps, the FIFO queue per pool, 429 when
it is full, 503 after the longest wait, refused requests in the metrics and the closed loop,
the router's measured defaults, the flags, and no change without admission."""

from __future__ import annotations

import math

import pytest

from pdserve.planner.simulate.admission import (
    DEFAULT_MAX_QUEUE_WAIT_S,
    MAX_QUEUE,
    UNMEASURED_SERVICE_S,
    WINDOW,
    Admission,
    AdmissionPool,
)
from pdserve.planner.simulate.cluster import Layout
from pdserve.planner.simulate.events import simulate
from pdserve.planner.simulate.metrics import RequestRecord, Slo, summarize
from pdserve.planner.simulate.split_model import SplitRule
from pdserve.planner.simulate.trace import TraceRequest, generate_trace, make_workload
from pdserve.router import admission_settings, capacity
from tests.planner.simulate.test_events import run_cli
from tests.planner.simulate.test_prefix_cache import DECODE_S, LINEAR, PER_TOKEN_S, linear_cluster

PROMPT = 100
PREFILL_S = PROMPT * PER_TOKEN_S  # 0.1 s: one prompt's step on the linear machine


def burst(n: int, output: int = 2) -> list[TraceRequest]:
    """n requests arriving together at t = 0."""
    return [TraceRequest(0.0, PROMPT, output) for _ in range(n)]


def admitted(**kw) -> Admission:
    return Admission(**({"max_inflight_per_worker": 1} | kw))


def test_a_full_queue_refuses_at_once_and_the_others_wait_their_turn():
    """Cap 1, queue 1: the first runs, the second waits for it to finish, the third finds the
    queue full and gets 429 at once, with no token."""
    c = linear_cluster(admission=admitted(max_queue=1))
    first, second, third = simulate("colloc", c, LINEAR, burst(3)).records
    assert first.ttft_s == pytest.approx(PREFILL_S)
    assert first.finish_s == pytest.approx(PREFILL_S + DECODE_S)
    assert second.ttft_s == pytest.approx(PREFILL_S + DECODE_S + PREFILL_S)
    assert (third.refused, third.refused_s, third.first_token_s) == (429, 0.0, None)
    assert first.ok and second.ok and not third.ok


def test_a_request_waiting_past_the_longest_wait_gets_503_then():
    c = linear_cluster(admission=admitted(max_queue=10, max_queue_wait_s=0.05))
    first, second = simulate("colloc", c, LINEAR, burst(2)).records
    assert first.ttft_s == pytest.approx(PREFILL_S)
    assert (second.refused, second.refused_s) == (503, 0.05)


def test_a_split_request_holds_its_decode_slot_until_it_ends():
    """1 prefill + 1 decode worker, cap 1: the second request is admitted only when the first
    finished decoding (its prefill slot freed long before)."""
    c = linear_cluster(admission=admitted(), split=SplitRule.REMOTE)
    first, second = simulate("disagg", c, LINEAR, burst(2)).records
    end = PREFILL_S + c.transfer_seconds(PROMPT) + DECODE_S
    assert first.finish_s == pytest.approx(end)
    assert second.ttft_s == pytest.approx(end + PREFILL_S)


def test_a_split_request_refused_for_a_prefill_slot_gives_its_decode_slot_back():
    """Two decode workers, one prefill worker, cap 1, no queue: both get a decode slot, the
    second finds the prefill worker full (429) and its decode worker free again."""
    c = linear_cluster(admission=admitted(max_queue=0), split=SplitRule.REMOTE,
                       decode_workers=2)
    first, second, third = simulate("disagg", c, LINEAR, [*burst(2), TraceRequest(
        1.0, PROMPT, 2)]).records
    assert first.ok and (second.refused, second.refused_s) == (429, 0.0)
    assert third.ttft_s == pytest.approx(PREFILL_S)


def test_a_closed_loop_client_sends_its_next_request_when_one_is_refused():
    """Two clients, cap 1, no queue: the second client's request is refused at t = 0 and it
    sends the third at once (refused too), not when the first request ends."""
    c = linear_cluster(admission=admitted(max_queue=0))
    records = simulate("colloc", c, LINEAR, burst(3), clients=2).records
    assert [r.refused for r in records] == [None, 429, 429]
    assert records[2].arrival_s == 0.0
    summary = summarize(records, simulate("colloc", c, LINEAR, burst(3), clients=2).itl,
                        Slo(ttft_ms=1000.0))
    assert (summary.completed, summary.failed, summary.good_requests) == (1, 2, 1)
    assert summary.duration_s == pytest.approx(PREFILL_S + DECODE_S)
    assert summary.ttft is not None and summary.ttft.p99_ms == pytest.approx(PREFILL_S * 1e3)
    assert summary.total_output_tokens == 2


def test_refused_requests_end_the_duration_but_nothing_else():
    refused = RequestRecord(1, 0.0, 50, 4, refused=503, refused_s=30.0)
    done = RequestRecord(0, 0.0, 100, 2, first_token_s=0.1, finish_s=0.2)
    summary = summarize([done, refused], simulate("colloc", linear_cluster(), LINEAR,
                                                  burst(1)).itl, Slo())
    assert (summary.completed, summary.failed, summary.duration_s) == (1, 1, 30.0)
    assert summary.total_input_tokens == 100 and summary.e2el.mean_ms == pytest.approx(200.0)


NO_LIMITS = Admission(max_inflight_per_worker=10**9, max_queue=10**9, max_queue_wait_s=math.inf)
# A remote split's decode worker is chosen at arrival under admission (as the router does),
# at the end of its prefill without: the same only with one decode worker.
LAYOUTS = [(Layout.COLLOC, {}), (Layout.CHUNKED, {}), (Layout.DISAGG, {"decode_workers": 1}),
           (Layout.DISAGG, {"split": SplitRule.LOCAL}),
           (Layout.DISAGG, {"split": SplitRule.MEASURED})]


@pytest.mark.parametrize(("layout", "kw"), LAYOUTS)
def test_admission_without_limits_changes_nothing(layout, kw):
    """The default cluster has no admission; one without limits gives the same records."""
    trace = generate_trace(make_workload("chat", 8.0), 1, 20.0)
    kw = {"prefill_workers": 2, "decode_workers": 2, "collocated_workers": 2, **kw}
    plain = simulate(layout, linear_cluster(**kw), LINEAR, trace)
    limited = simulate(layout, linear_cluster(**kw, admission=NO_LIMITS), LINEAR, trace)
    assert linear_cluster().admission is None
    assert plain.records == limited.records and plain.itl == limited.itl
    assert plain.local_prefills == limited.local_prefills and all(r.ok for r in plain.records)


def test_the_router_defaults_are_measured_as_the_router_measures_them():
    """Cap: the batch limit until a completion, then the average requests whose KV fits;
    queue: caps x workers / mean service time x the longest wait, at most MAX_QUEUE."""
    pool = AdmissionPool("decode", 2, Admission(), 64, 992, lambda r, free: free[0],
                         lambda r, w: None, lambda r, s: None)
    assert (pool.cap(), pool.queue_capacity()) == (64, MAX_QUEUE)
    record = RequestRecord(0, 0.0, 100, 2)
    pool.acquire(record, 0.0, 30.0)
    pool.release(record, 2.0, 102)
    assert pool.cap() == 992 // 102  # 9
    assert pool.queue_capacity() == math.floor(9 * 2 / 2.0 * 30.0)  # 270


def test_the_constants_are_the_routers():
    assert DEFAULT_MAX_QUEUE_WAIT_S == admission_settings.DEFAULT_MAX_QUEUE_WAIT_S
    assert (WINDOW, UNMEASURED_SERVICE_S, MAX_QUEUE) == \
        (capacity.WINDOW, capacity.UNMEASURED_SERVICE_S, capacity.MAX_QUEUE)


@pytest.mark.parametrize(("kw", "flag"), [
    ({"max_inflight_per_worker": 0}, "--max-inflight-per-worker"),
    ({"max_inflight_per_worker": True}, "--max-inflight-per-worker"),
    ({"max_queue": -1}, "--max-queue"), ({"max_queue": 1.5}, "--max-queue"),
    ({"max_queue_wait_s": 0}, "--max-queue-wait-s"),
    ({"max_queue_wait_s": float("nan")}, "--max-queue-wait-s")])
def test_bad_values_name_their_flag(kw, flag):
    with pytest.raises(ValueError, match=flag):
        Admission(**kw)


SMALL = ["--model", "smollm2-135m", "--gpu", "H100", "--workload", "chat", "--rate", "50",
         "--num-requests", "40", "--layouts", "colloc", "--collocated", "1"]


def test_the_flags_turn_admission_on_and_show_in_the_header(capsys):
    rc, out, _ = run_cli([*SMALL, "--max-inflight-per-worker", "1", "--max-queue", "0"],
                         capsys)
    assert rc == 0 and "admission: as the router's, at most 1 requests per worker" in out
    assert "failed (refused)" in out
    failed = next(line for line in out.splitlines() if line.startswith("failed"))
    assert int(failed.split()[-1]) > 0
    rc, out, _ = run_cli(SMALL, capsys)
    assert rc == 0 and "admission: none (every request served)" in out


@pytest.mark.parametrize(("flag", "value"), [("--max-queue-wait-s", "-1"),
                                             ("--max-queue-wait-s", "inf"),
                                             ("--max-queue", "-1"),
                                             ("--max-inflight-per-worker", "0")])
def test_a_bad_flag_is_a_usage_error(capsys, flag, value):
    rc, _, err = run_cli([*SMALL, flag, value], capsys)
    assert rc == 2 and flag in err


def test_a_split_request_waits_for_its_prefill_slot_within_the_same_wait():
    """Two decode workers, one prefill worker, cap 1: the second request holds a decode slot
    at once, waits for the prefill worker and is refused (503) when the wait since its arrival
    ends, its decode slot given back."""
    c = linear_cluster(admission=admitted(max_queue=10, max_queue_wait_s=0.05),
                       split=SplitRule.REMOTE, decode_workers=2)
    first, second = simulate("disagg", c, LINEAR, burst(2)).records
    assert first.ttft_s == pytest.approx(PREFILL_S)
    assert (second.refused, second.refused_s) == (503, 0.05)
