"""TcpTransport: bytes in equal bytes out, sessions over TCP, auth, restarts, death, cancel."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
import torch

from pdserve.common.model_config import ModelConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.transfer.auth import PeerRefused
from pdserve.transfer.peer import PeerId
from pdserve.transfer.tcp import TcpOptions, TcpTransport, peers
from pdserve.transfer.transport import Transport
from tests.transfer.netns import network_namespace

SECRET = b"s" * 32
MODEL = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                    max_position_embeddings=128)
BS = 16  # 32 KiB per float32 block
OPTS = TcpOptions(dial_timeout_s=0.5, handshake_timeout_s=1.0, cancel_wait_s=2.0)


def wait_for(cond: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def pool(num_blocks: int, seed: int | None = None) -> KVCache:
    cache = KVCache(MODEL, num_blocks, BS, torch.float32)
    if seed is not None:
        cache.data.copy_(torch.randn(cache.data.shape,
                                     generator=torch.Generator().manual_seed(seed)))
    return cache


def endpoint(cache: KVCache | None = None, **kw) -> TcpTransport:
    tx = TcpTransport(secret=kw.pop("secret", SECRET), options=OPTS, **kw)
    if cache is not None:
        tx.register(cache)
    return tx


@pytest.fixture
def pair() -> Iterator[tuple[TcpTransport, TcpTransport, KVCache, KVCache]]:
    a_pool, b_pool = pool(400, seed=1), pool(400)
    with endpoint(a_pool) as a, endpoint(b_pool) as b:
        yield a, b, a_pool, b_pool


def stop_listening(tx: TcpTransport) -> None:
    """`tx` stops answering at its address while its connections stay up, as the old instance
    looks to its peers when its host came back with a new one there and the old connections
    are half-open: only contact with the new instance tells them. (Reaches into the endpoint:
    nothing in pdserve closes a listener alone.)"""
    tx._receive._listener.shutdown(socket.SHUT_RDWR)
    tx._receive._listener.close()


def accepted(tx: TcpTransport) -> int:
    """Connections `tx`'s listener has accepted and still holds (reaches in, as above): once
    a peer's dial is counted here, closing the listener no longer refuses or resets it."""
    return len(tx._receive._conns)


def finish(tx: Transport, handle: int, *others: Transport, timeout: float = 10.0) -> str:
    """Poll until the move ends; `others` are pumped too (a NIXL peer answers metadata)."""
    def ended() -> bool:
        for o in others:
            o.receive()
        return tx.status(handle) != "pending"
    wait_for(ended, timeout)
    return tx.status(handle)


def mapping(n: int, seed: int, blocks: int = 400) -> tuple[list[int], list[int]]:
    """Random distinct source and destination blocks, n of each, from a pool of `blocks`."""
    rng = random.Random(seed)
    return rng.sample(range(blocks), n), rng.sample(range(blocks), n)


# -- moves and control (the shared suite is test_conformance.py) ---------------------------------


def test_bad_arguments_are_refused(pair):
    a, b, _, _ = pair
    with pytest.raises(ValueError):
        a.write(1, [1, 2], b.local, [1])
    with pytest.raises(ValueError):
        a.write(1, [400], b.local, [1])  # out of the local pool
    with pytest.raises(ValueError):
        a.status(12345)
    with pytest.raises(ValueError):
        TcpOptions(dial_timeout_s=0)


def test_a_write_to_an_endpoint_without_a_pool_fails_that_move_only(pair):
    a, _, _, _ = pair
    with endpoint() as bare:
        assert finish(a, a.write(1, [0, 1], bare.local, [0, 1])) == "error"
        assert a.peer_alive(bare.local)
        a.send(bare.local, b"still connected")
        wait_for(lambda: bare.receive() == [(a.local, b"still connected")])


def test_an_out_of_range_remote_block_is_a_protocol_error(pair):
    a, b, _, _ = pair
    assert finish(a, a.write(1, [0], b.local, [999])) == "error"
    wait_for(lambda: not a.peer_alive(b.local) and not b.peer_alive(a.local))


# -- authentication and restarts -----------------------------------------------------------------


def test_wrong_secret_is_refused_then_a_correct_peer_works(pair, caplog):
    a, b, a_pool, b_pool = pair
    caplog.set_level(logging.WARNING, logger="pdserve.transfer.tcp")
    with endpoint(pool(400, seed=1), secret=b"x" * 32) as evil:
        evil.send(b.local, b"forged")
        handle = evil.write(1, [3], b.local, [3])
        assert finish(evil, handle) == "error"
        wait_for(lambda: "refused connection from 127.0.0.1" in caplog.text)
        assert "signature does not match" in caplog.text
    assert b.receive() == [] and not b_pool.data[3].any()
    b.allow_writes(2, a.local, [3])
    assert finish(a, a.write(2, [3], b.local, [3])) == "done"
    assert torch.equal(b_pool.data[3], a_pool.data[3])


def test_hello_from_a_new_instance_at_the_same_address_kills_the_old(pair):
    a, b, _, _ = pair
    a.send(b.local, b"hi from the old instance")
    wait_for(lambda: b.receive())
    assert b.peer_alive(a.local)
    with endpoint(instance_id=a.local.instance_id + 1, advertise_port=a.local.port) as new:
        assert new.local.same_address(a.local) and new.local != a.local
        new.send(b.local, b"hi from the new instance")
        got: list = []
        wait_for(lambda: got.extend(b.receive()) or got)
        assert got == [(new.local, b"hi from the new instance")]
        assert not b.peer_alive(a.local) and b.peer_alive(new.local)
        a.send(b.local, b"the old instance is not heard again")
        time.sleep(0.2)
        assert b.receive() == []


def test_a_peer_killed_and_restarted_at_its_address_is_dialed_at_once(pair):
    """B dies (its connections close) and comes back at the same port as a new instance, which
    the router names: the first message and write to it go out at once (the old instance's
    death does not make its address refuse the new one)."""
    a, _, a_pool, _ = pair
    with endpoint(pool(400)) as old:
        a.send(old.local, b"to the old instance")
        wait_for(lambda: old.receive())
        port = old.local.port
    wait_for(lambda: not a.peer_alive(old.local))
    assert "closed" in a.why_dead(old.local)
    new_pool = pool(400)
    with endpoint(new_pool, port=port, instance_id=old.local.instance_id + 1) as new:
        assert new.local.same_address(old.local) and a.peer_alive(new.local)
        a.send(new.local, b"to the new instance")
        wait_for(lambda: new.receive() == [(a.local, b"to the new instance")])
        new.allow_writes(1, a.local, [3])
        assert finish(a, a.write(1, [4], new.local, [3])) == "done"
        assert torch.equal(new_pool.data[3], a_pool.data[4])
        assert a.peer_alive(new.local) and not a.peer_alive(old.local)


def test_dialing_a_peer_whose_address_answers_as_another_instance(pair):
    a, b, _, _ = pair
    ghost = PeerId(b.local.instance_id + 7, b.local.host, b.local.port)
    a.send(ghost, b"anyone?")
    wait_for(lambda: not a.peer_alive(ghost))
    assert a.why_dead(ghost).startswith(f"restarted: instance {b.local.instance_id:016x}")
    assert a.peer_alive(b.local)
    assert b.receive() == []  # the handshake told us it was the wrong instance: nothing sent


def test_unreachable_peer_send_never_blocks(pair):
    a, _, _, _ = pair
    with endpoint() as gone:
        dead = gone.local
    start = time.monotonic()
    for _ in range(100):
        a.send(dead, b"lost")
    handle = a.write(1, [0], dead, [0])
    assert time.monotonic() - start < 0.1
    assert finish(a, handle, timeout=3.0) == "error"
    assert not a.peer_alive(dead)


def test_close_is_idempotent_and_fails_pending_moves():
    tx = endpoint(pool(4))
    unreachable = PeerId(0x77, "10.255.255.1", 9)  # dial times out: the move stays pending
    handle = tx.write(1, [0], unreachable, [0])
    tx.close()
    tx.close()
    assert tx.status(handle) == "error" and not tx.peer_alive(tx.local)
    assert tx.receive() == []


# -- peer death ----------------------------------------------------------------------------------

CHILD = """
import json, sys, time, torch
from pdserve.engine.kv_cache import KVCache
from pdserve.transfer.peer import PeerId
from pdserve.common.model_config import ModelConfig
from pdserve.transfer.tcp import TcpTransport
MODEL = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                    max_position_embeddings=128)
BS, SECRET = 16, b"s" * 32
parent = PeerId.from_json(json.loads(sys.argv[1]))
cache = KVCache(MODEL, 2048, BS, torch.float32)
cache.data.fill_(1.0)
tx = TcpTransport(secret=SECRET)
tx.register(cache)
blocks = list(range(2048))
tx.allow_reads(2, parent, blocks)
print(json.dumps(tx.local.to_json()), flush=True)
while True:
    h = tx.write(1, blocks, parent, blocks)
    while tx.status(h) == "pending":
        time.sleep(0.001)
"""


def test_sigkill_mid_write_fails_the_peer_and_the_parent_keeps_serving():
    big = pool(2048)  # 64 MiB
    with endpoint(big) as parent:
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(parent.local.to_json())],
                                 stdout=subprocess.PIPE, env=env, text=True)
        try:
            child_peer = PeerId.from_json(json.loads(child.stdout.readline()))
            parent.allow_writes(1, child_peer, list(range(2048)))
            wait_for(lambda: big.data[0, 0, 0, 0, 0, 0] == 1.0, 20.0)  # the writes are landing
            pending_read = parent.read(2, list(range(2048)), child_peer, list(range(2048)))
            os.kill(child.pid, signal.SIGKILL)
            start = time.monotonic()
            wait_for(lambda: not parent.peer_alive(child_peer), 3.0)
            assert finish(parent, pending_read, timeout=3.0) in ("error", "done")
            assert time.monotonic() - start < 3.0
        finally:
            child.kill()
            child.wait()
        with endpoint(pool(4, seed=3)) as other:
            parent.allow_writes(3, other.local, [5])
            other.send(parent.local, b"still serving")
            assert finish(other, other.write(3, [1], parent.local, [5])) == "done"
            wait_for(lambda: (other.local, b"still serving") in parent.receive())


ECHO_CHILD = """
import json, sys, time
from pdserve.transfer.tcp import TcpTransport
tx = TcpTransport(sys.argv[1], secret=b"s" * 32)
print(json.dumps(tx.local.to_json()), flush=True)
while True:
    for peer, message in tx.receive():
        tx.send(peer, b"echo " + message)
    time.sleep(0.001)
"""


@contextlib.contextmanager
def echo_peer(host: str = "127.0.0.1",
              netns: str | None = None) -> Iterator[tuple[subprocess.Popen, PeerId]]:
    """A child process whose TcpTransport at `host` (inside network namespace `netns`, if
    given) sends every control message back prefixed "echo ", and its PeerId; killed on exit."""
    argv = [sys.executable, "-c", ECHO_CHILD, host]
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        yield child, PeerId.from_json(json.loads(child.stdout.readline()))
    finally:
        child.kill()
        child.wait()


def test_a_peer_stopped_before_the_first_contact_is_waited_for_not_declared_dead(caplog):
    """SIGSTOP a peer before anyone dialed it: its kernel accepts the connection, its process
    cannot answer HELLO. That is a stall (a GC pause, a frozen host), not a death: the dialer
    warns and waits, and after SIGCONT the queued message is delivered and answered. Declaring
    it dead would have broken the pair for good (each side refusing the other)."""
    with echo_peer() as (child, peer), endpoint() as a, \
            caplog.at_level(logging.WARNING, "pdserve.transfer.tcp"):
        os.kill(child.pid, signal.SIGSTOP)
        a.send(peer, b"hello")
        time.sleep(2 * OPTS.handshake_timeout_s)
        assert a.peer_alive(peer) and a.receive() == []
        assert "has not answered the handshake" in caplog.text
        os.kill(child.pid, signal.SIGCONT)
        got: list[tuple[PeerId, bytes]] = []
        wait_for(lambda: got.extend(a.receive()) or got, 10.0)
        assert got == [(peer, b"echo hello")]
        assert a.peer_alive(peer)


def test_keepalive_probes_do_not_end_a_stopped_peer_and_a_kill_does():
    """Keepalive probes go out every second here; a stopped process's kernel answers them, so
    only its death ends it."""
    fast = replace(OPTS, keepalive_idle_s=1, keepalive_interval_s=1, keepalive_probes=1)
    with echo_peer() as (child, peer), TcpTransport(secret=SECRET, options=fast) as a:
        a.send(peer, b"1")
        wait_for(lambda: a.receive() == [(peer, b"echo 1")], 10.0)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(3.5)
        assert a.peer_alive(peer)
        os.kill(child.pid, signal.SIGKILL)
        wait_for(lambda: not a.peer_alive(peer), 3.0)


@contextlib.contextmanager
def _echoing_across_a_namespace() -> Iterator[tuple]:
    """An endpoint (fast keepalive) that has heard an echo peer in its own network namespace:
    (the namespace, the peer, the endpoint)."""
    fast = replace(OPTS, keepalive_idle_s=1, keepalive_interval_s=1, keepalive_probes=2)
    with network_namespace() as ns, echo_peer(ns.inside, ns.name) as (_, peer), \
            TcpTransport(ns.outside, secret=SECRET, options=fast) as a:
        a.send(peer, b"1")
        wait_for(lambda: a.receive() == [(peer, b"echo 1")], 10.0)
        yield ns, peer, a


def test_a_host_that_stops_answering_is_dead_within_the_keepalive_bound():
    """The peer's host vanishes (its network link goes down in its own namespace: no reset, no
    FIN, nothing): keepalive ends the peer within idle + interval x probes, not TCP's hours."""
    with _echoing_across_a_namespace() as (ns, peer, a):
        ns.cut()
        started = time.monotonic()
        wait_for(lambda: not a.peer_alive(peer), 10.0)
        assert time.monotonic() - started < 1 + 2 * 1 + 2


def test_a_peer_lost_behind_a_cut_link_is_reached_again_once_the_link_is_back(monkeypatch):
    """A lost link is no restart: once the link is back (and the short retry pause passed), the
    same instance is dialed again and answers."""
    monkeypatch.setattr(peers, "LOST_RETRY_S", 0.5)
    with _echoing_across_a_namespace() as (ns, peer, a):
        ns.cut()
        wait_for(lambda: not a.peer_alive(peer), 10.0)
        assert "sending to it failed" in a.why_dead(peer) or "ended" in a.why_dead(peer)
        ns.mend()
        wait_for(lambda: a.peer_alive(peer), 5.0)
        a.send(peer, b"2")
        wait_for(lambda: a.receive() == [(peer, b"echo 2")], 10.0)


def test_a_lost_peer_is_dead_for_a_pause_a_restarted_one_for_good() -> None:
    now = [0.0]
    table = peers.PeerTable(PeerId(1, "127.0.0.1", 1), clock=lambda: now[0])
    lost, old, new = PeerId(2, "10.0.0.2", 9), PeerId(3, "10.0.0.3", 9), PeerId(4, "10.0.0.3", 9)
    table.died(lost, "connection reset", lost=True)
    table.seen(old)
    table.seen(new)  # another instance at old's address: old restarted
    assert table.why_dead(lost) == "connection reset" and table.why_dead(old) is not None
    now[0] = peers.LOST_RETRY_S
    assert table.alive(lost) and not table.alive(old)
    table.died(lost, "connection reset", lost=True)
    table.seen(lost)  # it greeted us again: alive at once
    assert table.alive(lost)
    with pytest.raises(PeerRefused):
        table.seen(old)
    table.died(lost, "connection reset", lost=True)
    table.died(lost, "a sealed record failed its tag")  # then for good
    now[0] += 10 * peers.LOST_RETRY_S
    assert table.why_dead(lost) == "a sealed record failed its tag"


def test_lost_peers_are_counted_until_they_may_be_dialed_again() -> None:
    now = [0.0]
    table = peers.PeerTable(PeerId(1, "127.0.0.1", 1), clock=lambda: now[0])
    a, b, c = PeerId(2, "10.0.0.2", 9), PeerId(3, "10.0.0.3", 9), PeerId(4, "10.0.0.4", 9)
    assert table.lost_now() == 0
    table.died(a, "connection reset", lost=True)
    now[0] = peers.LOST_RETRY_S / 2
    table.died(b, "keepalive: no answer", lost=True)
    table.died(c, "a sealed record failed its tag")  # dead for good: not lost
    assert table.lost_now() == 2
    now[0] = peers.LOST_RETRY_S  # a's pause is over, even before anything dials it
    assert table.lost_now() == 1
    table.seen(b)  # b greeted us again
    assert table.lost_now() == 0


# -- the cancel fence ----------------------------------------------------------------------------


@pytest.mark.parametrize("delay", [0.0, 0.002, 0.01])
def test_nothing_of_a_cancelled_write_lands_once_the_receiver_revokes_on_its_abort(delay):
    """The sessions' order: the writer cancels, then sends ABORT (on its control connection,
    which may overtake the write's frames); the receiver revokes on the ABORT and only then
    reuses the blocks. Frames still on the way are refused whole."""
    src, dst = pool(2048, seed=2), pool(2048)
    first, second = list(range(1024)), list(range(1024, 2048))
    with endpoint(src) as w, endpoint(dst) as r:
        r.allow_writes(8, w.local, first)
        r.allow_writes(9, w.local, second)
        w.send(r.local, b"connect")
        wait_for(lambda: r.receive())
        ahead = w.write(8, first, r.local, first)
        queued = w.write(9, second, r.local, second)  # behind `ahead` on the bulk connection
        time.sleep(delay)
        w.cancel(queued)
        w.cancel(ahead)
        w.send(r.local, b"abort")
        wait_for(lambda: r.receive() == [(w.local, b"abort")])
        r.revoke(8)
        r.revoke(9)
        seen = dst.data.clone()
        time.sleep(0.2)
        assert torch.equal(dst.data, seen), "a write landed after its permit was revoked"
        # a fenced write lands whole frames or nothing: each (block, layer) slice is the
        # source's or untouched
        whole = (dst.data == src.data).flatten(2).all(-1)  # [blocks, layers]
        untouched = (dst.data == 0).flatten(2).all(-1)
        assert (whole | untouched).all()
        w.cancel(queued)  # cancelling again changes nothing
        assert {w.status(ahead), w.status(queued)} <= {"error", "done"}


def test_cancel_of_a_read_never_lands_afterwards(pair):
    a, b, _, b_pool = pair
    blocks = list(range(300))
    a.allow_reads(4, b.local, blocks)
    b.allow_writes(5, a.local, [0])
    handle = b.read(4, blocks, a.local, blocks)
    b.cancel(handle)
    if b.status(handle) == "error":
        snapshot = b_pool.data.clone()
        time.sleep(0.3)  # any READ_DATA still in flight is drained, not landed
        assert torch.equal(b_pool.data, snapshot)
    assert finish(a, a.write(5, [0], b.local, [0])) == "done"  # the connection still works
