"""`pdserve plan --link-gbps http://ROUTER`: the plan takes the median KV link rate a running
router reports on /metrics (a real HTTP server here), and says so; a router with no measured
link, a refused /metrics and a bad value are clear errors."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.planner.cli_run import run_pdserve

GAUGE = "pdserve_router_link_bytes_per_second"
MEASURED = "\n".join([
    "# TYPE pdserve_router_link_bytes_per_second gauge",
    f'{GAUGE}{{prefill="http://p0:8001",decode="http://d0:8002"}} 1.25e8',
    f'{GAUGE}{{prefill="http://p1:8001",decode="http://d0:8002"}} 0',  # forgotten: left out
    f'{GAUGE}{{prefill="http://p1:8001",decode="http://d1:8002"}} 2.5e8',
    f'{GAUGE}{{prefill="http://p0:8001",decode="http://d1:8002"}} 1.5e8',
    'pdserve_router_link_fixed_seconds{prefill="http://p0:8001",decode="http://d0:8002"} 0.01',
]) + "\n"
PLAN = ["plan", "--model", "smollm2-135m", "--prompt-tokens", "1000", "--output-tokens", "100",
        "--json"]


@pytest.fixture
def router() -> Iterator[dict]:
    """A /metrics server: {"url": ..., "text": the page, "key": the bearer it asks, or None}."""
    state: dict = {"text": MEASURED, "key": None}

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            key = state["key"]
            if key and self.headers.get("Authorization") != f"Bearer {key}":
                self.send_response(401)
                self.end_headers()
                return
            body = state["text"].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    state["url"] = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def test_the_plan_uses_the_median_of_the_measured_links(router, capsys) -> None:
    rc, out, err = run_pdserve([*PLAN, "--link-gbps", router["url"] + "/v1"], capsys)
    assert rc == 0, err
    assert json.loads(out)["link_gbps"] == pytest.approx(1.2)  # median 1.5e8 B/s x 8 / 1e9
    assert f"median of 3 link(s) the router at {router['url']} measured" in err


def test_a_metrics_key_is_sent_when_given(router, capsys, tmp_path) -> None:
    router["key"] = "metrics-secret"
    rc, _, err = run_pdserve([*PLAN, "--link-gbps", router["url"]], capsys)
    assert rc == 2 and "answered 401 (give its key with --metrics-key-file)" in err
    key_file = tmp_path / "key"
    key_file.write_text("metrics-secret\n")
    rc, out, _ = run_pdserve([*PLAN, "--link-gbps", router["url"], "--metrics-key-file",
                              str(key_file)], capsys)
    assert rc == 0 and json.loads(out)["link_gbps"] == pytest.approx(1.2)


def test_a_router_that_measured_no_link_is_an_error(router, capsys) -> None:
    router["text"] = f'{GAUGE}{{prefill="a",decode="b"}} 0\n'
    rc, _, err = run_pdserve([*PLAN, "--link-gbps", router["url"]], capsys)
    assert rc == 2 and "has measured no KV link yet" in err


def test_a_value_neither_number_nor_url_is_an_error(capsys) -> None:
    rc, _, err = run_pdserve([*PLAN, "--link-gbps", "fast"], capsys)
    assert rc == 2 and "--link-gbps takes Gb/s or a running router's URL, got 'fast'" in err
