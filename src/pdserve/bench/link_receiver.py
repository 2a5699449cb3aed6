"""The receiving end of the burst and incast rows of `pdserve bench transfer --testbed`: a TCP
endpoint a child process hosts on d0, which permits the writes it is told to and stamps each
control message as it is delivered, with the host of the sender it came from. For the incast
rows it also zeroes its pool before a burst and gives the CRC32C of block ranges after it
(each sender writes a range of its own, so a range holds one sender's bytes or is wrong).

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
import logging
import multiprocessing as mp
import struct
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

from pdserve.bench.transfer_bench import SECRET, smollm2_pool
from pdserve.engine.kv_cache import KVCache
from pdserve.testbed.namespaces import enter_for_good
from pdserve.testbed.topology import Topology
from pdserve.transfer.checksum import crc32c, pool_bytes
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

    def latencies_by_host(self) -> dict[str, list[float]]:
        """As `latencies`, by the sending peer's host (its address)."""
        return self._call(("latencies_by_host",))

    def clear(self) -> None:
        """Zero the whole pool."""
        self._call(("clear",))

    def digests(self, ranges: list[range]) -> list[int]:
        """The CRC32C of the bytes of each range of blocks, as they are now in the pool."""
        return self._call(("digests", [(r.start, r.stop) for r in ranges]))

    def _call(self, request: tuple) -> object:
        self._conn.send(request)
        return self._conn.recv()

    def stop(self) -> None:
        stop_child(self._conn, self._proc)


@contextlib.contextmanager
def receiver(topology: Topology, options: TcpOptions, num_blocks: int) -> Iterator[Receiver]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_serve, daemon=True, name="pdserve-bench-receiver",
                       args=(theirs, topology.namespace("d0"), topology.address("d0"),
                             options, num_blocks))
    proc.start()
    theirs.close()
    try:
        r = Receiver(ours, proc)
    except BaseException:  # never came up (or the wait was interrupted): nothing to ask it
        stop_child(ours, proc, ask=False)
        raise
    try:
        yield r
    finally:
        r.stop()


def stop_child(conn: Connection, proc: mp.process.BaseProcess, ask: bool = True) -> None:
    """Ask a bench child to stop (`ask`; else it is killed at once) and wait for it, killing it
    past STOP_WAIT_S."""
    if ask:
        with contextlib.suppress(OSError):
            conn.send(("stop",))
        proc.join(STOP_WAIT_S)
    else:
        conn.close()
    if proc.is_alive():
        proc.kill()
        proc.join(STOP_WAIT_S)


def _serve(conn: Connection, namespace: str, address: str, options: TcpOptions,
           num_blocks: int) -> None:
    """Child process: inside d0, one endpoint with a pool; answer the parent's requests."""
    enter_for_good(namespace)
    # the other end closing first makes this one report it lost: expected here
    logging.getLogger("pdserve.transfer").setLevel(logging.ERROR)
    tx = TcpTransport(address, secret=SECRET, options=options)
    pool = smollm2_pool(num_blocks)
    tx.register(pool)
    latencies: list[tuple[str, float]] = []
    lock, stop = threading.Lock(), threading.Event()
    catcher = threading.Thread(target=_catch, args=(tx, latencies, lock, stop), daemon=True)
    catcher.start()
    conn.send(tx.local.to_json())
    try:
        while (request := conn.recv())[0] != "stop":
            conn.send(_answer(tx, pool, request, latencies, lock))
    finally:
        stop.set()
        catcher.join(1.0)
        tx.close()


def _answer(tx: TcpTransport, pool: KVCache, request: tuple,
            latencies: list[tuple[str, float]], lock: threading.Lock) -> object:
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
    if kind == "clear":
        pool.data.zero_()
        return "ok"
    if kind == "digests":
        return [crc32c(pool_bytes(pool.data[a:b])) for a, b in request[1]]
    with lock:  # "latencies" or "latencies_by_host"
        taken = latencies[:]
        latencies.clear()
    if kind == "latencies":
        return [lat for _, lat in taken]
    by_host: dict[str, list[float]] = {}
    for host, lat in taken:
        by_host.setdefault(host, []).append(lat)
    return by_host


def _catch(tx: TcpTransport, latencies: list[tuple[str, float]], lock: threading.Lock,
           stop: threading.Event) -> None:
    while not stop.is_set():
        got = tx.receive()
        now = time.perf_counter()
        if got:
            with lock:
                latencies.extend((p.host, now - STAMP.unpack(m)[0]) for p, m in got)
        time.sleep(0.0002)
