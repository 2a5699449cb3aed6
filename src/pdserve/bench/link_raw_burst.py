"""The raw-socket baseline of `bench transfer --testbed`'s burst rows: what the testbed itself
gives a small message sent beside a full link.

A burst's bytes (N prompts' KV) go with one `sendall` over a plain TCP connection from p0 to
d0, answered with one byte once all of it arrived, while a second plain connection carries a
stamp (the sender's `perf_counter`) every `link_bench.PING_S`; d0 is a child process (as the
burst rows' receiver is: one interpreter lock shared by both ends would add its own waits) that
reads both and keeps each stamp's one-way latency. The kernel's own TCP, its own buffers and
the host's congestion control, and nothing of the transport: the tail left to a control
message by the path, its queue and the machine's scheduling.

Lifetime: `raw_burst` spawns the child and connects both connections on entry; leaving the
block closes them and waits for the child (killed past a bound).
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection

from pdserve.bench.link_raw import CHUNK, TIMEOUT_S, receive
from pdserve.bench.link_receiver import STAMP, stop_child
from pdserve.testbed.namespaces import enter_for_good, entered
from pdserve.testbed.topology import Topology

Burst = Callable[[float], tuple[float, list[float]]]


@contextlib.contextmanager
def raw_burst(topology: Topology, nbytes: int) -> Iterator[Burst]:
    """A callable `(ping_s)` that sends `nbytes` from p0 to d0 with stamps every `ping_s`
    beside them: (the seconds until d0 had them all, the stamps' one-way seconds). The payload
    is made once, here, out of the timed part."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_serve, daemon=True, name="pdserve-bench-raw-burst",
                       args=(theirs, topology.namespace("d0"), topology.address("d0"),
                             nbytes))
    proc.start()
    theirs.close()
    try:
        port = ours.recv()
        with entered(topology.namespace("p0")):
            bulk = socket.create_connection((topology.address("d0"), port), TIMEOUT_S)
            pings = socket.create_connection((topology.address("d0"), port), TIMEOUT_S)
        pings.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload = bytes(nbytes)
        with bulk, pings:
            yield lambda ping_s: _once(ours, bulk, pings, payload, ping_s)
    finally:
        stop_child(ours, proc)


def _once(child: Connection, bulk: socket.socket, pings: socket.socket, payload: bytes,
          ping_s: float) -> tuple[float, list[float]]:
    child.send(("burst",))
    done = threading.Event()
    pinger = threading.Thread(target=_ping, args=(pings, done, ping_s), daemon=True)
    start = time.perf_counter()
    pinger.start()
    bulk.sendall(payload)
    if bulk.recv(1) != b"x":
        raise RuntimeError("the raw burst's receiver closed mid-transfer")
    took = time.perf_counter() - start
    done.set()
    pinger.join()
    time.sleep(ping_s)  # the last stamp's delivery
    child.send(("latencies",))
    return took, child.recv()


def _ping(sock: socket.socket, done: threading.Event, ping_s: float) -> None:
    while not done.wait(ping_s):
        sock.sendall(STAMP.pack(time.perf_counter()))


def _serve(conn: Connection, namespace: str, address: str, nbytes: int) -> None:
    """Child process: inside d0, accept the bulk and the stamp connections (in that order);
    drain a burst of `nbytes` each time the parent says, keep the stamps' latencies."""
    enter_for_good(namespace)
    with socket.create_server((address, 0)) as listener:
        conn.send(listener.getsockname()[1])
        bulk, _ = listener.accept()
        pings, _ = listener.accept()
    latencies: list[float] = []
    lock = threading.Lock()
    threading.Thread(target=_stamps, args=(pings, latencies, lock), daemon=True).start()
    view = memoryview(bytearray(CHUNK))
    with bulk, pings:
        while (request := conn.recv())[0] != "stop":
            if request[0] == "burst":
                if not receive(bulk, view, nbytes):
                    raise RuntimeError("the raw burst's sender closed mid-transfer")
                bulk.sendall(b"x")
            else:  # "latencies"
                with lock:
                    conn.send(latencies[:])
                    latencies.clear()


def _stamps(sock: socket.socket, latencies: list[float], lock: threading.Lock) -> None:
    with contextlib.suppress(OSError):
        while len(stamp := sock.recv(STAMP.size, socket.MSG_WAITALL)) == STAMP.size:
            lat = time.perf_counter() - STAMP.unpack(stamp)[0]
            with lock:
                latencies.append(lat)
