"""One suite every transport passes: bytes in equal bytes out, moves only inside the target's
permits, ordered control messages with their source, and the session layer end to end (push
and pull) with real engines."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random
from collections.abc import Callable, Iterator

import pytest
import torch

from pdserve.common.model_config import ModelConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.transfer.fake import FakeFabric, FakeTransport
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.peer import PeerId
from pdserve.transfer.receiver import RecvSession
from pdserve.transfer.sender import SendSession
from pdserve.transfer.sessions import Inbox, Mode
from pdserve.transfer.state import TransferState
from pdserve.transfer.tcp import TcpTransport
from pdserve.transfer.transport import Transport
from tests.conftest import engine_pair
from tests.transfer.session_driver import check_sessions_end_to_end
from tests.transfer.test_tcp import OPTS as TCP_OPTS
from tests.transfer.test_tcp import SECRET, finish, mapping, pool, stop_listening, wait_for

POOL_BLOCKS = 400


Restart = Callable[[Transport], Transport]


def other_instance(peer: PeerId) -> PeerId:
    """The same address, another instance id."""
    return dataclasses.replace(peer, instance_id=peer.instance_id % (2**64 - 1) + 1)


def _tcp(encrypt: bool = False) -> tuple[Callable[[], Transport], Restart]:
    options = dataclasses.replace(TCP_OPTS, encrypt=encrypt)

    def restart(old: TcpTransport) -> Transport:
        stop_listening(old)
        return TcpTransport(port=old.local.port, secret=SECRET, options=options,
                            instance_id=other_instance(old.local).instance_id)

    return lambda: TcpTransport(secret=SECRET, options=options), restart


def _nixl() -> tuple[Callable[[], Transport], Restart]:
    pytest.importorskip("nixl_cu12")
    from pdserve.transfer.nixl import NixlTransport
    from tests.transfer.test_nixl import OPTS as NIXL_OPTS

    def restart(old: NixlTransport) -> Transport:
        stop_listening(old._tcp)  # its control channel, where peers meet an instance
        return NixlTransport(port=old.local.port, secret=SECRET, options=NIXL_OPTS,
                             instance_id=other_instance(old.local).instance_id)

    return lambda: NixlTransport(secret=SECRET, options=NIXL_OPTS), restart


def _fake() -> tuple[Callable[[], Transport], Restart]:
    fabric, ports = FakeFabric(), itertools.count(1)

    def endpoint() -> Transport:
        port = next(ports)  # distinct addresses: a session's two ends must differ
        return fabric.endpoint(PeerId(port, "fake", port))

    return endpoint, lambda old: fabric.restart(old.local)


@dataclasses.dataclass
class Transports:
    """Endpoints of one transport kind, each with its pool registered, closed after the test.
    `restart(old, pool)`: a new instance at `old`'s address (another instance id); `old`
    stops answering there, and its peers learn of the restart from the new instance."""

    new: Callable[[], Transport]
    restarted: Restart
    stack: contextlib.ExitStack
    closes: bool

    def make(self, cache: KVCache) -> Transport:
        return self._registered(self.new(), cache)

    def restart(self, old: Transport, cache: KVCache) -> Transport:
        return self._registered(self.restarted(old), cache)

    def _registered(self, tx: Transport, cache: KVCache) -> Transport:
        if self.closes:
            self.stack.callback(tx.close)
        tx.register(cache)
        return tx


@pytest.fixture(params=["fake", "tcp", "tcp-aes", "nixl"])
def transports(request) -> Iterator[Transports]:
    kinds = {"fake": _fake, "tcp": _tcp, "tcp-aes": lambda: _tcp(encrypt=True),
             "nixl": _nixl}
    with contextlib.ExitStack() as stack:
        yield Transports(*kinds[request.param](), stack, request.param != "fake")


@pytest.fixture
def make(transports: Transports) -> Callable[[KVCache], Transport]:
    """make(pool) -> a transport endpoint with `pool` registered, closed after the test."""
    return transports.make


def move(direction: str, a: Transport, b: Transport, tid: int, src: list[int], dst: list[int],
         timeout: float = 10.0) -> str:
    """a's `src` blocks into b's `dst` blocks, under a permit for exactly that move: a pushes
    (b permits the write) or b pulls (a permits the read)."""
    if direction == "push":
        b.allow_writes(tid, a.local, dst)
        return finish(a, a.write(tid, src, b.local, dst), b, timeout=timeout)
    a.allow_reads(tid, b.local, src)
    return finish(b, b.read(tid, dst, a.local, src), a, timeout=timeout)


@pytest.mark.parametrize("n", [1, 7, 300])
@pytest.mark.parametrize("direction", ["push", "pull"])
def test_blocks_arrive_byte_for_byte(make, n, direction):
    a_pool, b_pool = pool(POOL_BLOCKS, seed=1), pool(POOL_BLOCKS)
    a, b = make(a_pool), make(b_pool)
    src, dst = mapping(n, seed=n, blocks=POOL_BLOCKS)
    assert move(direction, a, b, 5, src, dst) == "done"
    assert torch.equal(b_pool.data[dst], a_pool.data[src])
    untouched = sorted(set(range(POOL_BLOCKS)) - set(dst))
    assert not b_pool.data[untouched].any()


def test_the_pusher_reports_what_it_measured_of_the_link(make):
    """After a push, the writer's `links()` names the peer with the bytes it sent and a
    rate (tcp: the kernel's estimates, with a round-trip time; nixl: its moves' bytes over
    seconds); the fake fabric measures nothing."""
    a_pool, b_pool = pool(POOL_BLOCKS, seed=1), pool(POOL_BLOCKS)
    a, b = make(a_pool), make(b_pool)
    assert a.links() == []
    src, dst = mapping(300, seed=3, blocks=POOL_BLOCKS)
    assert move("push", a, b, 5, src, dst) == "done"
    if isinstance(a, FakeTransport):
        assert a.links() == []
        return
    # tcp counts the bytes the peer acknowledged: its kernel may ACK the last segments after
    # the receiving endpoint has already answered the write (a delayed ACK, ~40 ms at most)
    wait_for(lambda: a.links() and a.links()[0].bytes_sent >= 300 * a_pool.block_nbytes)
    (link,) = a.links()
    assert link.peer == f"{b.local.host}:{b.local.port}"
    assert link.gbps is not None and link.gbps > 0
    if link.source == "tcp_info":
        assert link.rtt_ms is not None and link.min_rtt_ms is not None
        assert 0 < link.min_rtt_ms <= link.rtt_ms
        # after the transfer the kernel's own sample is the tail's, app-limited; the report
        # keeps the rate of a full sender read during the transfer
        assert not link.app_limited
    else:
        assert link.source == "transfers" and link.rtt_ms is None
    assert set(link.to_json()) == {"peer", "source", "gbps", "bytes_sent", "rtt_ms",
                                   "min_rtt_ms", "app_limited"}


def test_random_mappings_both_ways(make):
    a_pool, b_pool = pool(POOL_BLOCKS, seed=2), pool(POOL_BLOCKS)
    a, b = make(a_pool), make(b_pool)
    for seed in range(5):
        src, dst = mapping(random.Random(seed).randint(1, 50), seed, POOL_BLOCKS)
        b_pool.data.zero_()
        assert move("push", a, b, seed, src, dst) == "done"
        assert torch.equal(b_pool.data[dst], a_pool.data[src])
        b_pool.data.zero_()
        assert move("pull", a, b, 100 + seed, src, dst) == "done"
        assert torch.equal(b_pool.data[dst], a_pool.data[src])


# 512-byte blocks, so a pool of thousands stays small: 2 layers x (K, V) x 1 head x 4 x 8 fp32.
SMALL = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=8, intermediate_size=16,
                    num_layers=2, num_heads=1, num_kv_heads=1, head_dim=8,
                    max_position_embeddings=64)
MANY = 4096


def _many_pool(seed: int | None = None) -> KVCache:
    cache = KVCache(SMALL, MANY, 4, torch.float32)
    if seed is not None:
        cache.data.copy_(torch.randn(cache.data.shape,
                                     generator=torch.Generator().manual_seed(seed)))
    return cache


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_thousands_of_blocks_under_random_mappings(make, direction):
    """Property: for any count from 1 to the whole pool and any distinct source and destination
    blocks, the destination blocks end equal to the sources and no other block changes."""
    a_pool, b_pool = _many_pool(seed=3), _many_pool()
    a, b = make(a_pool), make(b_pool)
    rng = random.Random(direction)
    counts = [1, MANY, *(rng.randint(2, MANY - 1) for _ in range(4))]
    for tid, n in enumerate(counts, start=1):
        src, dst = mapping(n, seed=tid, blocks=MANY)
        b_pool.data.fill_(-1.0)
        assert move(direction, a, b, tid, src, dst, timeout=30.0) == "done", f"{n} blocks"
        assert torch.equal(b_pool.data[dst], a_pool.data[src]), f"{n} blocks"
        untouched = sorted(set(range(MANY)) - set(dst))
        assert bool((b_pool.data[untouched] == -1.0).all()), f"{n} blocks"


def test_a_layer_range_write_lands_only_those_layers(make):
    """Layer-wise streaming writes each block's layer slices in several moves; together they
    equal one whole write, and a move never touches another layer."""
    a_pool, b_pool = pool(POOL_BLOCKS, seed=4), pool(POOL_BLOCKS)
    a, b = make(a_pool), make(b_pool)
    src, dst = mapping(9, seed=4, blocks=POOL_BLOCKS)
    b_pool.data.fill_(-1.0)
    b.allow_writes(1, a.local, dst, range(1, 2))
    b.allow_writes(2, a.local, dst, range(0, 1))
    assert finish(a, a.write(1, src, b.local, dst, layers=range(1, 2)), b) == "done"
    assert torch.equal(b_pool.data[dst, 1], a_pool.data[src, 1])
    assert bool((b_pool.data[dst, 0] == -1.0).all())
    assert finish(a, a.write(2, src, b.local, dst, layers=range(0, 1)), b) == "done"
    assert torch.equal(b_pool.data[dst], a_pool.data[src])
    for bad in (range(0, 0), range(1, 3), range(0, 2, 2)):
        with pytest.raises(ValueError, match="layers"):
            a.write(3, src, b.local, dst, layers=bad)


# -- permits: a move lands only where the target allows it ---------------------------------------


@pytest.fixture
def enforcing(make, request) -> Callable[[KVCache], Transport]:
    """`make`, for the transports whose target checks permits."""
    if request.node.callspec.params["transports"] == "nixl":
        pytest.skip("NIXL moves one-sided: the target cannot refuse a move "
                    "(nixl/transport.py, Permits)")
    return make


def attempt(direction: str, a: Transport, b: Transport, tid: int, src: list[int],
            dst: list[int]) -> str:
    """a's `src` into b's `dst` under `tid`, with whatever permits are in place."""
    if direction == "push":
        return finish(a, a.write(tid, src, b.local, dst), b)
    return finish(b, b.read(tid, dst, a.local, src), a)


def still_serving(direction: str, a: Transport, b: Transport, a_pool: KVCache,
                  b_pool: KVCache, src: list[int], dst: list[int]) -> None:
    """Nobody was marked dead, and a permitted move between the same two still works."""
    assert a.peer_alive(b.local) and b.peer_alive(a.local)
    assert move(direction, a, b, 99, src, dst) == "done"
    assert torch.equal(b_pool.data[dst], a_pool.data[src])


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_a_move_outside_the_permit_lands_nowhere_and_fails(enforcing, direction):
    a_pool, b_pool = pool(POOL_BLOCKS, seed=5), pool(POOL_BLOCKS)
    a, b = enforcing(a_pool), enforcing(b_pool)
    src, dst = mapping(6, seed=5, blocks=POOL_BLOCKS)
    b_pool.data.fill_(-1.0)
    if direction == "push":
        b.allow_writes(1, a.local, dst[:3])
        b.allow_writes(2, a.local, dst, range(0, 1))
        assert finish(a, a.write(2, src, b.local, dst, layers=range(1, 2)), b) == "error"
    else:
        a.allow_reads(1, b.local, src[:3])
    assert attempt(direction, a, b, 1, src, dst) == "error"  # blocks beyond the permit
    assert attempt(direction, a, b, 3, src, dst) == "error"  # a transfer without a permit
    assert bool((b_pool.data == -1.0).all())
    still_serving(direction, a, b, a_pool, b_pool, src, dst)


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_a_move_by_another_peer_instance_with_the_right_ids_fails(enforcing, direction):
    a_pool, b_pool, c_pool = pool(POOL_BLOCKS, seed=6), pool(POOL_BLOCKS), pool(POOL_BLOCKS, 7)
    a, b, c = enforcing(a_pool), enforcing(b_pool), enforcing(c_pool)
    src, dst = mapping(4, seed=6, blocks=POOL_BLOCKS)
    b_pool.data.fill_(-1.0)
    before = c_pool.data.clone()
    if direction == "push":
        b.allow_writes(1, other_instance(a.local), dst)  # a's address, another instance
        b.allow_writes(2, a.local, dst)
        assert attempt(direction, a, b, 1, src, dst) == "error"
        assert finish(c, c.write(2, src, b.local, dst), b) == "error"  # c is not a
    else:
        a.allow_reads(1, other_instance(b.local), src)
        a.allow_reads(2, b.local, src)
        assert attempt(direction, a, b, 1, src, dst) == "error"
        assert finish(c, c.read(2, dst, a.local, src), a) == "error"  # c is not b
    assert bool((b_pool.data == -1.0).all()) and torch.equal(c_pool.data, before)
    still_serving(direction, a, b, a_pool, b_pool, src, dst)


@pytest.mark.parametrize("direction", ["push", "pull"])
def test_after_revoke_a_move_fails(enforcing, direction):
    a_pool, b_pool = pool(POOL_BLOCKS, seed=8), pool(POOL_BLOCKS)
    a, b = enforcing(a_pool), enforcing(b_pool)
    src, dst = mapping(5, seed=8, blocks=POOL_BLOCKS)
    assert move(direction, a, b, 1, src, dst) == "done"
    landed = b_pool.data.clone()
    a_pool.data.neg_()  # new source bytes: a landing would show
    (b if direction == "push" else a).revoke(1)
    assert attempt(direction, a, b, 1, src, dst) == "error"
    assert torch.equal(b_pool.data, landed)
    still_serving(direction, a, b, a_pool, b_pool, src, dst)


def test_control_messages_arrive_in_order_with_their_source(make):
    a, b = make(pool(4)), make(pool(4))
    for i in range(50):
        a.send(b.local, b"m%d" % i)
    got: list[tuple[PeerId, bytes]] = []
    wait_for(lambda: got.extend(b.receive()) or len(got) >= 50)
    assert got == [(a.local, b"m%d" % i) for i in range(50)]
    assert a.peer_alive(b.local) and b.peer_alive(a.local)


@pytest.fixture(scope="module")
def engines(tiny_model):
    return engine_pair(tiny_model("llama"))


@pytest.mark.parametrize("mode", ["push", "pull", "push-layerwise"])
def test_sessions_run_unchanged(make, engines, mode, tiny_model, request):
    pre, dec = engines
    first_tid = 1000 + 10 * ["push", "pull", "push-layerwise"].index(mode) + 100 * [
        "fake", "tcp", "tcp-aes", "nixl"].index(request.node.callspec.params["transports"])
    check_sessions_end_to_end(pre, dec, make(pre.kv_cache), make(dec.kv_cache),
                              Mode.PULL if mode == "pull" else Mode.PUSH, first_tid,
                              tiny_model("llama"), streamed=mode == "push-layerwise")


# -- a peer restarted at the same address --------------------------------------------------------

LEASE_S = 60.0  # far beyond every wait below: a session that failed only at its lease times out


def _sender(inbox: Inbox, tid: int, peer: PeerId, cache: KVCache,
            blocks: list[int]) -> SendSession:
    return SendSession(inbox, transfer_id=tid, peer=peer, cache=cache,
                       layout=KVLayout.of_cache(cache, "m"), src_blocks=blocks, token0=7,
                       lease_s=LEASE_S)


def _receiver(inbox: Inbox, tid: int, peer: PeerId, cache: KVCache,
              blocks: list[int]) -> RecvSession:
    return RecvSession(inbox, transfer_id=tid, peer=peer, cache=cache,
                       layout=KVLayout.of_cache(cache, "m"), dst_blocks=blocks,
                       dst_generations=[1] * len(blocks), generation=lambda _: 1,
                       lease_s=LEASE_S)


def _poll_until(sessions: list[SendSession | RecvSession], done: Callable[[], bool]) -> None:
    wait_for(lambda: [s.poll() for s in sessions] and done(), 10.0)


@pytest.mark.parametrize("first", ["it dials us", "we dial it"])
@pytest.mark.parametrize("restarted", ["decode", "prefill"])
def test_a_restarted_peer_is_used_at_once_and_its_old_sessions_fail_at_once(
        transports, restarted, first):
    """Peer B restarts at its address (a new instance id, same host and port) while A holds
    blocks for a transfer with the old instance: a send waiting for B's ACK (B the decode
    side) or a reservation B was told of (B the prefill side). The first contact between A
    and the new instance, whichever side makes it, fails A's session at once, saying B
    restarted, with its blocks free; the next transfer with the new instance lands."""
    a_pool, b_pool = pool(POOL_BLOCKS, seed=12), pool(POOL_BLOCKS, seed=13)
    a, b = transports.make(a_pool), transports.make(b_pool)
    a_in, b_in = Inbox(a), Inbox(b)
    src, dst = mapping(5, seed=12, blocks=POOL_BLOCKS)
    if restarted == "decode":  # A sends; B1 reserved, A wrote and waits for the ACK
        held = _sender(a_in, 1, b.local, a_pool, src)
        b_side = _receiver(b_in, 1, a.local, b_pool, dst)
        b_side.poll()
        _poll_until([held], lambda: held.state is TransferState.TRANSFERRING)
    else:  # A receives; B1 has A's reservation and has not written yet
        held = _receiver(a_in, 1, b.local, a_pool, dst)
        held.poll()
        wait_for(lambda: b_in.peek(1), 10.0)
    assert not held.state.is_terminal and not held.blocks_reusable

    new_pool = pool(POOL_BLOCKS, seed=14)
    new = transports.restart(b, new_pool)
    new_in = Inbox(new)
    assert new.local.same_address(b.local) and new.local != b.local
    a_sends = restarted == "decode"
    a_pool.data.neg_()  # fresh bytes for the next transfer
    new_pool.data.neg_()

    def open_a() -> SendSession | RecvSession:
        return _sender(a_in, 2, new.local, a_pool, src) if a_sends \
            else _receiver(a_in, 2, new.local, a_pool, dst)

    def open_new() -> SendSession | RecvSession:
        return _receiver(new_in, 2, a.local, new_pool, dst) if a_sends \
            else _sender(new_in, 2, a.local, new_pool, src)

    opened = [open_new()] if first == "it dials us" else [open_a()]
    _poll_until([*opened, held], lambda: held.state.is_terminal)
    assert held.state is TransferState.FAILED and "restarted" in held.reason, held.reason
    assert held.blocks_reusable
    opened.append(open_a() if first == "it dials us" else open_new())
    _poll_until(opened, lambda: all(s.state.is_terminal for s in opened))
    assert [s.state for s in opened] == [TransferState.DONE] * 2, [s.reason for s in opened]
    sent, landed = (a_pool, new_pool) if a_sends else (new_pool, a_pool)
    assert torch.equal(landed.data[dst], sent.data[src])
