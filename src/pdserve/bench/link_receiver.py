"""The receiving end of the burst rows of `pdserve bench transfer --testbed`: a TCP endpoint a
child process hosts on d0, which permits the writes it is told to and stamps each control
message as it is delivered.

Why a process of its own: a decode worker receives in its own process, on its own host. With
both endpoints in one process, the receiving thread, the sending thread and the benchmark's
own threads take turns at one interpreter lock (a thread that wants it may wait out another's
5 ms switch interval), and that wait, not the link, filled the control messages' tail.
Latency is one-way: `time.perf_counter` is CLOCK_MONOTONIC, one clock for every process of
the machine, so a stamp the sender wrote is read against the receiver's clock.

Lifetime: `start` spawns the child and returns once its endpoint is up; `stop` (also on
leaving the `with` block) tells it to close and waits for it, killing it past a bound.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import struct
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

from pdserve.bench.transfer_bench import SECRET, smollm2_pool
from pdserve.testbed.namespaces import enter_for_good
from pdserve.testbed.topology import Topology
from pdserve.transfer.peer import PeerId
from pdserve.transfer.tcp import TcpOptions, TcpTransport

STAMP = struct.Struct("<d")  # a control message: the sender's perf_counter
STOP_WAIT_S = 10.0


class Receiver:
    """The parent's handle on the child endpoint."""

    def __init__(self, conn: Connection, proc: mp.process.BaseProcess) -> None:
        self._conn, self._proc = conn, proc
        self.peer = PeerId.from_json(conn.recv())

    def allow(self, tids: list[int], writer: PeerId, ids: list[int]) -> None:
        self._call(("allow", tids, writer.to_json(), ids))

    def revoke(self, tids: list[int]) -> None:
        self._call(("revoke", tids))

    def latencies(self) -> list[float]:
        """The one-way seconds of every control message delivered since the last call."""
        return self._call(("latencies",))

    def _call(self, request: tuple) -> object:
        self._conn.send(request)
        return self._conn.recv()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._conn.send(("stop",))
        self._proc.join(STOP_WAIT_S)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(STOP_WAIT_S)


@contextlib.contextmanager
def receiver(topology: Topology, options: TcpOptions, num_blocks: int) -> Iterator[Receiver]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_serve, daemon=True, name="pdserve-bench-receiver",
                       args=(theirs, topology.namespace("d0"), topology.address("d0"),
                             options, num_blocks))
    proc.start()
    theirs.close()
    r = Receiver(ours, proc)
    try:
        yield r
    finally:
        r.stop()


def _serve(conn: Connection, namespace: str, address: str, options: TcpOptions,
           num_blocks: int) -> None:
    """Child process: inside d0, one endpoint with a pool; answer the parent's requests."""
    enter_for_good(namespace)
    tx = TcpTransport(address, secret=SECRET, options=options)
    tx.register(smollm2_pool(num_blocks))
    latencies: list[float] = []
    lock, stop = threading.Lock(), threading.Event()
    catcher = threading.Thread(target=_catch, args=(tx, latencies, lock, stop), daemon=True)
    catcher.start()
    conn.send(tx.local.to_json())
    try:
        while (request := conn.recv())[0] != "stop":
            conn.send(_answer(tx, request, latencies, lock))
    finally:
        stop.set()
        catcher.join(1.0)
        tx.close()


def _answer(tx: TcpTransport, request: tuple, latencies: list[float],
            lock: threading.Lock) -> object:
    kind = request[0]
    if kind == "allow":
        _, tids, writer, ids = request
        for tid in tids:
            tx.allow_writes(tid, PeerId.from_json(writer), ids)
        return "ok"
    if kind == "revoke":
        for tid in request[1]:
            tx.revoke(tid)
        return "ok"
    with lock:  # "latencies"
        taken = latencies[:]
        latencies.clear()
    return taken


def _catch(tx: TcpTransport, latencies: list[float], lock: threading.Lock,
           stop: threading.Event) -> None:
    while not stop.is_set():
        got = tx.receive()
        now = time.perf_counter()
        if got:
            with lock:
                latencies.extend(now - STAMP.unpack(m)[0] for _, m in got)
        time.sleep(0.0002)
