"""Prometheus registry: the exact text exposition, label checks, and exact counts under threads."""

from __future__ import annotations

import sys
import threading

import pytest

from pdserve.metrics import CONTENT_TYPE, Registry


def test_counter_renders_help_type_and_value():
    reg = Registry()
    c = reg.counter("pd_requests_total", "Requests served.")
    assert reg.render() == ("# HELP pd_requests_total Requests served.\n"
                            "# TYPE pd_requests_total counter\n"
                            "pd_requests_total 0\n")
    c.inc()
    c.inc(2.5)
    assert c.value() == 3.5
    assert reg.render().splitlines()[-1] == "pd_requests_total 3.5"
    c.inc(0.5)
    assert reg.render().splitlines()[-1] == "pd_requests_total 4"  # integral values print bare


def test_labelled_counter_has_one_sample_per_child_and_none_before_first_use():
    reg = Registry()
    c = reg.counter("pd_legs_total", "Legs.", labels=("kind", "role"))
    assert reg.render() == "# HELP pd_legs_total Legs.\n# TYPE pd_legs_total counter\n"
    c.inc(kind="prefill", role="a")
    c.inc(3, role="b", kind="decode")  # keyword order does not matter
    assert reg.render().splitlines()[2:] == [
        'pd_legs_total{kind="prefill",role="a"} 1',
        'pd_legs_total{kind="decode",role="b"} 3',
    ]
    assert c.value(kind="decode", role="b") == 3
    assert c.value(kind="local", role="a") == 0


def test_label_values_are_escaped():
    reg = Registry()
    c = reg.counter("pd_errors_total", "Errors.", labels=("why",))
    c.inc(why='say "hi"\\now\nthen')
    assert reg.render().splitlines()[-1] == r'pd_errors_total{why="say \"hi\"\\now\nthen"} 1'


@pytest.mark.parametrize("labels", [{}, {"kind": "x", "extra": "y"}, {"other": "x"}])
def test_wrong_label_names_are_refused_everywhere(labels):
    reg = Registry()
    metrics = [reg.counter("c_total", "c", ("kind",)).inc,
               reg.gauge("g", "g", ("kind",)).set,
               reg.histogram("h_seconds", "h", ("kind",), buckets=(1.0,)).observe]
    for record in metrics:
        with pytest.raises(ValueError, match=r"takes labels \('kind',\)"):
            record(1, **labels)
    assert reg.render().count("\n") == 6  # HELP and TYPE only: nothing was recorded


def test_unlabelled_metric_refuses_labels():
    c = Registry().counter("c_total", "c")
    with pytest.raises(ValueError, match="takes labels"):
        c.inc(kind="x")


def test_a_counter_never_goes_down():
    reg = Registry()
    c = reg.counter("c_total", "c")
    c.inc(2)
    with pytest.raises(ValueError, match="only goes up, got -1"):
        c.inc(-1)
    assert c.value() == 2


@pytest.mark.parametrize("second", ["counter", "gauge", "histogram"])
def test_a_name_is_registered_once(second):
    reg = Registry()
    reg.counter("pd_x", "first")
    with pytest.raises(ValueError, match="pd_x is registered twice"):
        getattr(reg, second)("pd_x", "second")
    assert reg.render() == "# HELP pd_x first\n# TYPE pd_x counter\npd_x 0\n"


def test_gauge_set_and_labelled():
    reg = Registry()
    g = reg.gauge("pd_running", "Running requests.")
    lg = reg.gauge("pd_kv_blocks", "KV blocks.", labels=("state",))
    g.set(3)
    g.set(1.25)
    lg.set(10, state="used")
    lg.set(54, state="free")
    assert reg.render() == ("# HELP pd_running Running requests.\n"
                            "# TYPE pd_running gauge\n"
                            "pd_running 1.25\n"
                            "# HELP pd_kv_blocks KV blocks.\n"
                            "# TYPE pd_kv_blocks gauge\n"
                            'pd_kv_blocks{state="used"} 10\n'
                            'pd_kv_blocks{state="free"} 54\n')
    assert (g.value(), lg.value(state="free")) == (1.25, 54)


def test_gauge_with_fn_is_read_at_render_time():
    reg = Registry()
    state = {"waiting": 2}
    g = reg.gauge("pd_waiting", "Waiting requests.", fn=lambda: state["waiting"])
    assert reg.render().splitlines()[-1] == "pd_waiting 2"
    state["waiting"] = 7
    assert reg.render().splitlines()[-1] == "pd_waiting 7"
    assert g.value() == 7


def test_histogram_buckets_are_cumulative_with_inf_sum_and_count():
    reg = Registry()
    h = reg.histogram("pd_ttft_seconds", "Time to first token.", buckets=(0.5, 1.0))
    assert reg.render() == ("# HELP pd_ttft_seconds Time to first token.\n"
                            "# TYPE pd_ttft_seconds histogram\n")
    for v in (0.25, 0.5, 0.75, 3.0):  # 0.5 falls in le="0.5": the bound is inclusive
        h.observe(v)
    assert reg.render().splitlines()[2:] == [
        'pd_ttft_seconds_bucket{le="0.5"} 2',
        'pd_ttft_seconds_bucket{le="1"} 3',
        'pd_ttft_seconds_bucket{le="+Inf"} 4',
        "pd_ttft_seconds_sum 4.5",
        "pd_ttft_seconds_count 4",
    ]
    assert h.count() == 4


def test_labelled_histogram_puts_le_last():
    reg = Registry()
    h = reg.histogram("pd_step_seconds", "Step time.", labels=("phase",), buckets=(0.1,))
    h.observe(0.05, phase="decode")
    h.observe(0.2, phase="decode")
    h.observe(0.3, phase="prefill")
    assert reg.render().splitlines()[2:] == [
        'pd_step_seconds_bucket{phase="decode",le="0.1"} 1',
        'pd_step_seconds_bucket{phase="decode",le="+Inf"} 2',
        'pd_step_seconds_sum{phase="decode"} 0.25',
        'pd_step_seconds_count{phase="decode"} 2',
        'pd_step_seconds_bucket{phase="prefill",le="0.1"} 0',
        'pd_step_seconds_bucket{phase="prefill",le="+Inf"} 1',
        'pd_step_seconds_sum{phase="prefill"} 0.3',
        'pd_step_seconds_count{phase="prefill"} 1',
    ]
    assert (h.count(phase="decode"), h.count(phase="prefill"), h.count(phase="x")) == (2, 1, 0)


@pytest.mark.parametrize("buckets", [(1.0, 0.5), (0.5, 0.5, 1.0)])
def test_histogram_buckets_must_strictly_increase(buckets):
    with pytest.raises(ValueError, match="strictly increasing"):
        Registry().histogram("h", "h", buckets=buckets)


@pytest.fixture
def eager_thread_switches():
    """Switch threads every few bytecodes so that an unlocked read-modify-write loses counts."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@pytest.mark.usefixtures("eager_thread_switches")
def test_exact_totals_under_many_threads():
    reg = Registry()
    c = reg.counter("c_total", "c", labels=("t",))
    h = reg.histogram("h", "h", buckets=(1.0,))
    threads_n, per_thread = 8, 2_000
    start = threading.Barrier(threads_n + 1)

    def work(i: int) -> None:
        start.wait()
        for _ in range(per_thread):
            c.inc(t=str(i % 2))
            h.observe(0.5)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_n)]
    for t in threads:
        t.start()
    start.wait()
    renders = [reg.render() for _ in range(20)]  # rendering while writers run must not fail
    for t in threads:
        t.join()
    half = threads_n // 2 * per_thread
    assert (c.value(t="0"), c.value(t="1")) == (half, half)
    assert h.count() == threads_n * per_thread
    assert f'h_bucket{{le="1"}} {threads_n * per_thread}' in reg.render()
    assert all(r.startswith("# HELP c_total c\n") for r in renders)


def test_content_type_is_text_format_0_0_4():
    assert CONTENT_TYPE == "text/plain; version=0.0.4; charset=utf-8"
