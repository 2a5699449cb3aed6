"""What a process without the cluster secret sends to a worker's KV port in the corrupt-kv
fault, and what the worker answered.

Two probes, each on a fresh connection: a HELLO shaped like a real one (a greeting naming the
worker) but signed with a random secret, and a WRITE of KV bytes for block 0 sent without any
handshake. Refused means the worker closed (or reset) the connection within PROBE_S without
sending a byte; any byte back, or a connection still open at PROBE_S, is not refused.
"""

from __future__ import annotations

import json
import os
import socket
import time

from pdserve.transfer.auth import sign
from pdserve.transfer.tcp.frames import Frame, header, u32s

PROBE_S = 5.0
KV_BYTES = 4096


def forged_hello(to: dict) -> bytes:
    """A HELLO frame to the worker whose KV peer (`/health`'s `peer`) is `to`, signed with a
    secret the cluster does not hold."""
    stranger = {"instance_id": "0x" + os.urandom(8).hex(), "host": "127.0.0.1", "port": 1}
    greeting = json.dumps({"kind": "hello", "peer": stranger, "to": to, "cipher": "none"})
    envelope = sign(os.urandom(32), greeting.encode())
    return header(Frame.HELLO, plen=len(envelope)) + envelope


def bare_write() -> bytes:
    """A WRITE of KV_BYTES of 0xAB into block 0, layers [0, 1), with no handshake before it."""
    body = u32s([0, 1, 0]) + b"\xab" * KV_BYTES
    return header(Frame.WRITE, 1, 1, 1, len(body)) + body


def probe(host: str, port: int, payload: bytes) -> tuple[bool, str]:
    """Send `payload` on a new connection: (refused, what happened)."""
    started = time.monotonic()
    try:
        with socket.create_connection((host, port), timeout=PROBE_S) as s:
            s.sendall(payload)
            answer = s.recv(64)
    except TimeoutError:
        return False, f"no answer and still open after {PROBE_S:g} s"
    except ConnectionError as e:
        return True, f"reset after {_ms(started)} ({type(e).__name__})"
    except OSError as e:
        return False, f"could not connect: {e}"
    if answer:
        return False, f"ANSWERED {len(answer)} bytes after {_ms(started)}"
    return True, f"closed after {_ms(started)}"


def _ms(started: float) -> str:
    return f"{1e3 * (time.monotonic() - started):.0f} ms"
