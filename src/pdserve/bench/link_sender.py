"""One sending end of the incast rows of `pdserve bench transfer --testbed --senders K`: a TCP
endpoint a child process hosts on a prefill host (p0, p1, ...), which pushes its writes into
the receiver on d0 when told, from a start time every sender shares, and meanwhile sends a
control message every `ping_s` and samples the bytes its connection to d0 had acknowledged
(TCP_INFO's `tcpi_bytes_acked`, through `TcpTransport.links`).

Why a process per sender: each prefill host is a machine of its own, with its own interpreter;
senders sharing one interpreter lock would take turns at it, and that wait would show up in
the control messages' latency and the shares (as `link_receiver.py` explains for one pair).
Times are on `time.perf_counter` (CLOCK_MONOTONIC, one clock for every process of the
machine), so the parent's start time means the same instant in every sender.

Each sender's pool is filled from a seed of its own, so what lands in the receiver's range
for it can be checked against its `digest`.

Lifetime: `sender` spawns the child and yields once its endpoint is up and has dialed the
receiver; leaving the `with` block tells it to close and waits for it, killing it past a bound.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

from pdserve.bench.link_bench import write_ends
from pdserve.bench.link_receiver import STAMP, stop_child
from pdserve.bench.transfer_bench import SECRET, smollm2_pool
from pdserve.testbed.namespaces import enter_for_good
from pdserve.testbed.topology import Topology
from pdserve.transfer.checksum import crc32c, pool_bytes
from pdserve.transfer.peer import PeerId
from pdserve.transfer.tcp import TcpOptions, TcpTransport


@dataclass(frozen=True)
class BurstResult:
    """One sender's part of one burst, every time in seconds from the shared start.
    `done`: each write's end ("done"), in the order they ended. `acked`: (time, bytes the
    receiver had acknowledged since the start) samples, time ascending, the first at or before
    the first write went out and the last after the last write ended."""

    done: list[float]
    acked: list[tuple[float, int]]


class Sender:
    """The parent's handle on one child sender."""

    def __init__(self, conn: Connection, proc: mp.process.BaseProcess, host: str) -> None:
        self._conn, self._proc, self.host = conn, proc, host
        peer, self.digest = conn.recv()
        self.peer = PeerId.from_json(peer)

    def start_burst(self, tids: list[int], remote_ids: list[int], at: float) -> None:
        """Tell the child to start one write per transfer id at `at` (perf_counter), each of
        its whole pool into blocks `remote_ids` of the receiver; `result` collects it."""
        self._conn.send(("burst", tids, remote_ids, at))

    def result(self) -> BurstResult:
        """The burst's outcome; RuntimeError if a write ended other than "done"."""
        got = self._conn.recv()
        if isinstance(got, str):
            raise RuntimeError(f"{self.host}: {got}")
        return got

    def stop(self) -> None:
        stop_child(self._conn, self._proc)


@contextlib.contextmanager
def senders(topology: Topology, hosts: list[str], options: TcpOptions, num_blocks: int,
            to: PeerId, ping_s: float) -> Iterator[list[Sender]]:
    """One child sender per host, each connected to `to`; all stopped on leaving."""
    ctx = mp.get_context("spawn")
    started: list[tuple[Connection, mp.process.BaseProcess, str]] = []
    made: list[Sender] = []
    try:
        for seed, host in enumerate(hosts, start=1):  # spawned together: they load in parallel
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=_serve, daemon=True, name=f"pdserve-bench-sender-{host}",
                               args=(theirs, topology.namespace(host), topology.address(host),
                                     options, num_blocks, seed, to.to_json(), ping_s))
            proc.start()
            theirs.close()
            started.append((ours, proc, host))
        for conn, proc, host in started:
            made.append(Sender(conn, proc, host))
        yield made
    finally:
        for conn, proc, host in started:
            handle = next((s for s in made if s.host == host), None)
            if handle is not None:
                handle.stop()
            else:  # never came up: no handshake to wait for
                stop_child(conn, proc, ask=False)


def _serve(conn: Connection, namespace: str, address: str, options: TcpOptions,
           num_blocks: int, seed: int, to: dict, ping_s: float) -> None:
    """Child process: inside its host, one endpoint with a seeded pool, connected to `to`;
    run the bursts the parent asks for."""
    enter_for_good(namespace)
    # the other end closing first makes this one report it lost: expected here
    logging.getLogger("pdserve.transfer").setLevel(logging.ERROR)
    tx = TcpTransport(address, secret=SECRET, options=options)
    try:
        pool = smollm2_pool(num_blocks, seed)
        tx.register(pool)
        receiver = PeerId.from_json(to)
        tx.reach(receiver)  # its sender thread starts here, inside the host
        conn.send((tx.local.to_json(), crc32c(pool_bytes(pool.data))))
        ids = list(range(num_blocks))
        while (request := conn.recv())[0] == "burst":
            _, tids, remote_ids, at = request
            try:
                conn.send(_burst(tx, receiver, tids, ids, remote_ids, at, ping_s))
            except RuntimeError as e:
                conn.send(str(e))
    finally:
        tx.close()


def _burst(tx: TcpTransport, to: PeerId, tids: list[int], ids: list[int],
           remote_ids: list[int], at: float, ping_s: float) -> BurstResult:
    """From `at`: one write per transfer id, control messages and acknowledged-byte samples
    every `ping_s` until every write ended; RuntimeError if one ended other than "done"."""
    base = _acked(tx)
    while (wait := at - time.perf_counter()) > 0:
        time.sleep(min(wait, 0.01))
    acked = [(time.perf_counter() - at, 0)]
    handles = [tx.write(tid, ids, to, remote_ids) for tid in tids]
    finished = threading.Event()
    pinger = threading.Thread(target=_ping, args=(tx, to, at, base, acked, finished, ping_s),
                              daemon=True)
    pinger.start()
    done, failed = write_ends(tx, handles, at)
    finished.set()
    pinger.join()
    acked.append((time.perf_counter() - at, _acked(tx) - base))
    if failed:
        raise RuntimeError(f"{len(failed)} write(s) ended {sorted(set(failed))}")
    return BurstResult(done, acked)


def _ping(tx: TcpTransport, to: PeerId, at: float, base: int, acked: list[tuple[float, int]],
          finished: threading.Event, ping_s: float) -> None:
    while not finished.wait(ping_s):
        tx.send(to, STAMP.pack(time.perf_counter()))
        acked.append((time.perf_counter() - at, _acked(tx) - base))


def _acked(tx: TcpTransport) -> int:
    """The bytes this endpoint's one connection had acknowledged (0 before it has one)."""
    return sum(link.bytes_sent for link in tx.links())
