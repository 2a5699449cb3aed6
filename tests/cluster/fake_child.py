"""A stand-in for a worker or router: prints some lines, then serves GET /health with 200.

Options pick a misbehaviour: --exit-code (exit before serving), --delay (serve late),
--ignore-term (survive SIGTERM), --grandchild (leave a SIGTERM-proof child in its group),
--die-after (exit with code 3 that long after it started serving); --report-pdeathsig prints
the signal it gets when its parent dies. Without --secret-file it
answers every GET /health with 200 and no proof (as a process of another run might); with it,
a signed /health as a worker does: with its proof of the secret, or 401.
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
    auth = None  # an InternalAuth with --secret-file (imported then only: pdserve is slow to load)

    def do_GET(self) -> None:
        if self.path != "/health":
            self.send_response(404)
            self.end_headers()
            return
        body, headers = b'{"status": "ok"}', {"Content-Length": "16"}
        if self.auth is not None:
            from pdserve.internal_auth import AUTH_HEADER, PROOF_HEADER, PeerRefused

            header = self.headers.get(AUTH_HEADER)
            try:
                if header is not None:
                    self.auth.verify("GET", self.path, header)
                    headers[PROOF_HEADER] = self.auth.proof(header, body)
            except PeerRefused:
                self.send_response(401)
                self.end_headers()
                return
        self.send_response(200)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(body)

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
    p.add_argument("--secret-file", default=None)
    p.add_argument("--report-pdeathsig", action="store_true")
    args = p.parse_args()
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"pid {os.getpid()}", flush=True)
    if args.report_pdeathsig:
        from pdserve.cluster import parent_death

        print(f"pdeathsig {parent_death.current()}", flush=True)
    if args.grandchild:
        sleeper = subprocess.Popen([sys.executable, "-c", _SLEEPER])
        print(f"grandchild {sleeper.pid}", flush=True)
    for k in range(args.lines):
        print(f"line {k}", flush=True)
    time.sleep(args.delay)
    if args.exit_code is not None:
        sys.exit(args.exit_code)
    handler = _Health
    if args.secret_file is not None:
        from pdserve.internal_auth import InternalAuth, read_secret_file

        auth = InternalAuth(read_secret_file(args.secret_file))
        handler = type("_SignedHealth", (_Health,), {"auth": auth})
    server = http.server.HTTPServer(("127.0.0.1", args.port), handler)
    if args.die_after is not None:
        threading.Timer(args.die_after, os._exit, (3,)).start()
    server.serve_forever()


if __name__ == "__main__":
    main()
