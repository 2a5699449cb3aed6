"""The NIXL row of `pdserve bench transfer --testbed`: pushes from a child process on host p0
into a pool that a child process hosts on d0.

Both ends are child processes that enter their host's namespace before anything else: UCX
keeps process-wide state (its own threads and sockets) from its first use, so an endpoint made
in this process, which may have used NIXL before, could dial from the wrong namespace, and two
endpoints of one process would talk through shared memory anyway. Both are told to use the
host's link and TCP only (UCX_NET_DEVICES, UCX_TLS, as `pdserve up --testbed` tells its
workers): otherwise UCX would take shared memory between two hosts that are one machine.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess

from pdserve.bench.transfer_bench import SECRET, smollm2_pool, wait_done
from pdserve.testbed.namespaces import enter_for_good
from pdserve.testbed.topology import HOST_LINK, Topology
from pdserve.transfer.peer import PeerId

UCX_ON_THE_LINK = {"UCX_NET_DEVICES": HOST_LINK, "UCX_TLS": "tcp"}


def nixl_available() -> bool:
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        return False
    return True


def push_seconds(topology: Topology, num_blocks: int, repeats: int) -> float:
    """Median seconds of one push of `num_blocks` SmolLM2-shaped blocks from p0 to d0 (after
    one warm-up push), timed in the pushing process."""
    ctx = mp.get_context("spawn")
    with _ucx_on_the_link():
        receiver, pusher = _start(ctx, _host, topology, "d0", num_blocks), \
            _start(ctx, _push, topology, "p0", num_blocks)
    try:
        target = receiver.conn.recv()  # the receiver's PeerId
        pusher.conn.send(target)
        receiver.conn.send(pusher.conn.recv())  # the pusher's PeerId: it is permitted
        pusher.conn.send(receiver.conn.recv())  # "permitted": go
        pusher.conn.send(repeats)
        times = pusher.conn.recv()
    finally:
        for child in (pusher, receiver):
            child.stop()
    return statistics.median(times[1:])


@dataclass
class _Child:
    conn: Connection
    proc: BaseProcess

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send("stop")
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _start(ctx: BaseContext, target: Callable[..., None], topology: Topology, host: str,
           num_blocks: int) -> _Child:
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, daemon=True,
                       args=(theirs, topology.namespace(host), topology.address(host),
                             num_blocks))
    proc.start()
    return _Child(ours, proc)


@contextlib.contextmanager
def _ucx_on_the_link() -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in UCX_ON_THE_LINK}
    os.environ.update(UCX_ON_THE_LINK)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _host(conn: Connection, namespace: str, address: str, num_blocks: int) -> None:
    """Child process: inside d0, host a pool and permit the pusher's writes until told to
    stop (pumping control messages meanwhile: NIXL answers metadata requests there)."""
    enter_for_good(namespace)
    from pdserve.transfer.nixl import NixlTransport

    # the other end closing first makes this one report it lost: expected here
    logging.getLogger("pdserve.transfer").setLevel(logging.ERROR)
    tx = NixlTransport(address, secret=SECRET)
    tx.register(smollm2_pool(num_blocks))
    conn.send(tx.local.to_json())
    pusher = PeerId.from_json(conn.recv())
    tx.allow_writes(1, pusher, list(range(num_blocks)))
    conn.send("permitted")
    while not conn.poll(0.001):
        tx.receive()
    tx.close()


def _push(conn: Connection, namespace: str, address: str, num_blocks: int) -> None:
    """Child process: inside p0, push `num_blocks` blocks into the receiver once told to go,
    warm-up first, and send back every push's seconds."""
    enter_for_good(namespace)
    from pdserve.transfer.nixl import NixlTransport

    # the other end closing first makes this one report it lost: expected here
    logging.getLogger("pdserve.transfer").setLevel(logging.ERROR)
    tx = NixlTransport(address, secret=SECRET)
    try:
        tx.register(smollm2_pool(num_blocks))
        peer = PeerId.from_json(conn.recv())
        conn.send(tx.local.to_json())
        conn.recv()  # the receiver permits our writes
        ids, times = list(range(num_blocks)), []
        for _ in range(conn.recv() + 1):
            start = time.perf_counter()
            wait_done(tx, tx.write(1, ids, peer, ids))
            times.append(time.perf_counter() - start)
        conn.send(times)
        conn.recv()  # stop
    finally:
        tx.close()
