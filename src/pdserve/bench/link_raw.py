"""The raw-socket baseline of `bench transfer --testbed`'s bulk rows.

The same number of bytes as one prompt's KV, sent with one `sendall` over a plain TCP
connection from p0 to d0 and answered with one byte once all of it arrived, over the same
shaped link in the same run. Both ends live in this process (the receiver a thread), as the
bulk rows' two endpoints do, and the connection stays open between transfers, as a
transport's does.

What it separates: a transport's `of_link` is its rate against the link's nominal rate, which
the testbed itself may not deliver (on a small machine the delay line, which holds every
packet in user space, is slower than a fast link); `of_raw` is its rate against what the
kernel's own TCP got for a transfer of this size over the same path, measured in turns with it.

Lifetime: `raw_path` connects on entry and closes on exit; the receiver thread ends when the
connection closes.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator

from pdserve.testbed.namespaces import entered
from pdserve.testbed.topology import Topology

CHUNK = 1 << 20  # bytes the receiver asks for per recv
TIMEOUT_S = 60.0  # one transfer's bound: a link that stalls fails the run, it does not hang


@contextlib.contextmanager
def raw_path(topology: Topology, nbytes: int) -> Iterator[Callable[[], float]]:
    """A callable that sends `nbytes` from p0 to d0 and returns the seconds until d0 said it
    had them all."""
    with entered(topology.namespace("d0")):
        listener = socket.create_server((topology.address("d0"), 0))
    with listener:
        with entered(topology.namespace("p0")):
            sender = socket.create_connection(listener.getsockname(), timeout=TIMEOUT_S)
        peer, _ = listener.accept()
    thread = threading.Thread(target=_receive, args=(peer, nbytes), daemon=True,
                              name="pdserve-bench-raw-receiver")
    thread.start()
    payload = bytes(nbytes)

    def once() -> float:
        start = time.perf_counter()
        sender.sendall(payload)
        if sender.recv(1) != b"x":
            raise RuntimeError("the raw baseline's receiver closed mid-transfer")
        return time.perf_counter() - start

    try:
        yield once
    finally:
        sender.close()
        thread.join(TIMEOUT_S)


def _receive(conn: socket.socket, nbytes: int) -> None:
    """Read transfers of `nbytes` and answer each with one byte, until the sender closes."""
    view = memoryview(bytearray(CHUNK))
    with conn:
        while receive(conn, view, nbytes):
            conn.sendall(b"x")


def receive(conn: socket.socket, view: memoryview, nbytes: int) -> bool:
    """Read and drop `nbytes` from `conn` through `view`; False if the sender closed first."""
    left = nbytes
    while left:
        got = conn.recv_into(view[:min(left, CHUNK)])
        if not got:
            return False
        left -= got
    return True
