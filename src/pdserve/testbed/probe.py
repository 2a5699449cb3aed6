"""Measure a path between two hosts of a testbed with one TCP connection: the round trip of
one-byte ping-pongs (median), then bulk bytes for a bounded time (goodput: TCP payload, about
0.95 of the link rate with 1,500-byte frames).

Bounded: at most `max_bytes` or `seconds` of sending, every socket operation under
`timeout_s`, traffic only between the two hosts' own addresses. Both ends run in this process,
each in a thread that entered its host's namespace.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from dataclasses import dataclass

from pdserve.testbed.namespaces import TestbedError, entered
from pdserve.testbed.state import BedState

CHUNK = 1 << 20


@dataclass(frozen=True)
class PathMeasure:
    gbps: float  # goodput seen by the receiver, from its first read to its last
    rtt_ms: float  # median round trip of one-byte ping-pongs
    bytes: int  # received after the first read
    seconds: float

    def to_json(self) -> dict[str, float]:
        return {"gbps": round(self.gbps, 4), "rtt_ms": round(self.rtt_ms, 3),
                "bytes": self.bytes, "seconds": round(self.seconds, 3)}


@dataclass(frozen=True)
class ProbeLimits:
    seconds: float = 1.0
    max_bytes: int = 512 << 20
    pings: int = 20
    timeout_s: float = 15.0

    def __post_init__(self) -> None:
        if not (self.seconds > 0 and self.max_bytes > 0 and self.pings > 0
                and self.timeout_s > 0):
            raise ValueError("probe seconds, bytes, pings and timeout must be positive")


def measure(bed: BedState, src: str, dst: str, limits: ProbeLimits = ProbeLimits()
            ) -> PathMeasure:
    """Rate and round trip from `src` to `dst`. TestbedError when the path does not carry
    the probe within the limits (a partition, 100% loss)."""
    t = bed.topology
    receiver = _Receiver(t.namespace(dst), t.address(dst), limits)
    receiver.start()
    try:
        with entered(t.namespace(src)):
            rtts = _send(t.address(dst), receiver.port(), limits)
    except OSError as e:
        raise TestbedError(f"{src} -> {dst}: {e}") from None
    finally:
        receiver.join(limits.timeout_s)
    got, seconds = receiver.result()
    return PathMeasure(got * 8 / seconds / 1e9 if seconds > 0 else 0.0,
                       statistics.median(rtts) * 1000, got, seconds)


def _send(address: str, port: int, limits: ProbeLimits) -> list[float]:
    with socket.create_connection((address, port), timeout=limits.timeout_s) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        rtts = []
        for _ in range(limits.pings):
            t0 = time.perf_counter()
            sock.sendall(b"p")
            if sock.recv(1) != b"p":
                raise OSError("the receiver closed the connection during the pings")
            rtts.append(time.perf_counter() - t0)
        chunk, sent = bytes(CHUNK), 0
        deadline = time.monotonic() + limits.seconds
        while sent < limits.max_bytes and time.monotonic() < deadline:
            sock.sendall(chunk[:min(CHUNK, limits.max_bytes - sent)])
            sent += min(CHUNK, limits.max_bytes - sent)
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)  # the receiver's close: everything landed
        return rtts


class _Receiver(threading.Thread):
    def __init__(self, namespace: str, address: str, limits: ProbeLimits) -> None:
        super().__init__(name="pdserve-probe-receiver", daemon=True)
        self._namespace, self._address, self._limits = namespace, address, limits
        self._listening = threading.Event()
        self._port = 0
        self._got, self._seconds = 0, 0.0
        self._error: BaseException | None = None

    def port(self) -> int:
        if not self._listening.wait(self._limits.timeout_s) or self._error is not None:
            raise TestbedError(f"the probe receiver did not start: {self._error}")
        return self._port

    def result(self) -> tuple[int, float]:
        if self.is_alive() or self._error is not None:
            raise TestbedError(f"the probe receiver failed: {self._error or 'timed out'}")
        return self._got, self._seconds

    def run(self) -> None:
        try:
            with entered(self._namespace), socket.create_server((self._address, 0)) as server:
                server.settimeout(self._limits.timeout_s)
                self._port = server.getsockname()[1]
                self._listening.set()
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(self._limits.timeout_s)
                    self._serve(conn)
        except (OSError, TestbedError) as e:
            self._error = e
            self._listening.set()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(self._limits.pings):
            conn.sendall(conn.recv(1))
        buf = bytearray(CHUNK)
        first = last = 0.0
        while n := conn.recv_into(buf):
            last = time.perf_counter()
            if first:
                self._got += n  # the bytes that arrived after the first read's time
            first = first or last
        self._seconds = last - first
