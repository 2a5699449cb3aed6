"""A stand-in for a worker or router: prints some lines, then serves GET /health with 200.

Options pick a misbehaviour: --exit-code (exit before serving), --delay (serve late),
--ignore-term (survive SIGTERM), --grandchild (leave a SIGTERM-proof child in its group),
--die-after (exit with code 3 that long after it started serving).
"""

from __future__ import annotations

import argparse
import http.server
import os
import signal
import subprocess
import sys
import threading
import time

_SLEEPER = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "time.sleep(60)")


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--lines", type=int, default=0)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--exit-code", type=int, default=None)
    p.add_argument("--ignore-term", action="store_true")
    p.add_argument("--grandchild", action="store_true")
    p.add_argument("--die-after", type=float, default=None)
    args = p.parse_args()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"pid {os.getpid()}", flush=True)
    if args.grandchild:
        sleeper = subprocess.Popen([sys.executable, "-c", _SLEEPER])
        print(f"grandchild {sleeper.pid}", flush=True)
    for k in range(args.lines):
        print(f"line {k}", flush=True)
    time.sleep(args.delay)
    if args.exit_code is not None:
        sys.exit(args.exit_code)
    server = http.server.HTTPServer(("127.0.0.1", args.port), _Health)
    if args.die_after is not None:
        threading.Timer(args.die_after, os._exit, (3,)).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
