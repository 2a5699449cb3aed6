"""The NIXL row of `pdserve bench transfer --testbed`: pushes from host p0 into a pool that a
child process hosts on d0.

Two UCX endpoints of one process would talk through shared memory, so the receiver is a child
process that enters d0's namespace before anything else. Both ends are told to use the host's
link and TCP only (UCX_NET_DEVICES, UCX_TLS, as `pdserve up --testbed` tells its workers):
otherwise UCX would take shared memory between two hosts that are one machine. This process's
endpoint is made, and every move is started and polled, from a thread inside p0.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection

from pdserve.bench.transfer_bench import SECRET, smollm2_pool, wait_done
from pdserve.testbed.namespaces import enter_for_good, entered
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
    one warm-up push)."""
    from pdserve.transfer.nixl import NixlTransport

    ids = list(range(num_blocks))
    with _ucx_on_the_link(), _receiver(topology, num_blocks) as peer_of, \
            entered(topology.namespace("p0")):
        tx = NixlTransport(topology.address("p0"), secret=SECRET)
        try:
            tx.register(smollm2_pool(num_blocks))
            peer = peer_of(tx.local)
            times = []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                wait_done(tx, tx.write(1, ids, peer, ids))
                times.append(time.perf_counter() - start)
        finally:
            tx.close()
    return statistics.median(times[1:])


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


@contextlib.contextmanager
def _receiver(topology: Topology, num_blocks: int) -> Iterator:
    """A child on d0 hosting the pool; yields peer_of(our PeerId) -> its PeerId, once it
    permits our writes of transfer 1."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_host, daemon=True,
                       args=(theirs, topology.namespace("d0"), topology.address("d0"),
                             num_blocks))
    proc.start()

    def peer_of(local: PeerId) -> PeerId:
        peer = PeerId.from_json(ours.recv())
        ours.send(local.to_json())
        ours.recv()  # permitted
        return peer

    try:
        yield peer_of
    finally:
        ours.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def _host(conn: Connection, namespace: str, address: str, num_blocks: int) -> None:
    """Child process: inside d0, host a pool and permit the parent's writes until told to
    stop (pumping control messages meanwhile: NIXL answers metadata requests there)."""
    enter_for_good(namespace)
    from pdserve.transfer.nixl import NixlTransport

    tx = NixlTransport(address, secret=SECRET)
    tx.register(smollm2_pool(num_blocks))
    conn.send(tx.local.to_json())
    parent = PeerId.from_json(conn.recv())
    tx.allow_writes(1, parent, list(range(num_blocks)))
    conn.send("permitted")
    while not conn.poll(0.001):
        tx.receive()
    tx.close()
