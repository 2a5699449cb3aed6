"""One suite every transport passes: bytes in equal bytes out, ordered control messages with
their source, and the session layer end to end (push and pull) with real engines."""

from __future__ import annotations

import contextlib
import itertools
import random
from collections.abc import Callable, Iterator

import pytest
import torch

from pdserve.engine.kv_cache import KVCache
from pdserve.transfer.descriptors import PeerId
from pdserve.transfer.fake import FakeFabric
from pdserve.transfer.sessions import Mode
from pdserve.transfer.tcp import TcpTransport
from pdserve.transfer.transport import Transport
from tests.conftest import engine_pair
from tests.transfer.session_driver import check_sessions_end_to_end
from tests.transfer.test_tcp import OPTS as TCP_OPTS
from tests.transfer.test_tcp import SECRET, finish, mapping, pool, wait_for

POOL_BLOCKS = 400


def _tcp() -> Callable[[], Transport]:
    return lambda: TcpTransport(secret=SECRET, options=TCP_OPTS)


def _nixl() -> Callable[[], Transport]:
    pytest.importorskip("nixl_cu12")
    from pdserve.transfer.nixl import NixlTransport
    from tests.transfer.test_nixl import OPTS as NIXL_OPTS

    return lambda: NixlTransport(secret=SECRET, options=NIXL_OPTS)


def _fake() -> Callable[[], Transport]:
    fabric, ports = FakeFabric(), itertools.count(1)

    def endpoint() -> Transport:
        port = next(ports)  # distinct addresses: a session's two ends must differ
        return fabric.endpoint(PeerId(port, "fake", port))

    return endpoint


@pytest.fixture(params=["fake", "tcp", "nixl"])
def make(request) -> Iterator[Callable[[KVCache], Transport]]:
    """make(pool) -> a transport endpoint with `pool` registered, closed after the test."""
    factory = {"fake": _fake, "tcp": _tcp, "nixl": _nixl}[request.param]()
    with contextlib.ExitStack() as stack:
        def endpoint(cache: KVCache) -> Transport:
            tx = factory()
            if request.param != "fake":
                stack.callback(tx.close)
            tx.register(cache)
            return tx

        yield endpoint


@pytest.mark.parametrize("n", [1, 7, 300])
@pytest.mark.parametrize("direction", ["push", "pull"])
def test_blocks_arrive_byte_for_byte(make, n, direction):
    a_pool, b_pool = pool(POOL_BLOCKS, seed=1), pool(POOL_BLOCKS)
    a, b = make(a_pool), make(b_pool)
    src, dst = mapping(n, seed=n, blocks=POOL_BLOCKS)
    if direction == "push":
        assert finish(a, a.write(5, src, b.local, dst), b) == "done"
    else:
        assert finish(b, b.read(5, dst, a.local, src), a) == "done"
    assert torch.equal(b_pool.data[dst], a_pool.data[src])
    untouched = sorted(set(range(POOL_BLOCKS)) - set(dst))
    assert not b_pool.data[untouched].any()


def test_random_mappings_both_ways(make):
    a_pool, b_pool = pool(POOL_BLOCKS, seed=2), pool(POOL_BLOCKS)
    a, b = make(a_pool), make(b_pool)
    for seed in range(5):
        src, dst = mapping(random.Random(seed).randint(1, 50), seed, POOL_BLOCKS)
        b_pool.data.zero_()
        assert finish(a, a.write(seed, src, b.local, dst), b) == "done"
        assert torch.equal(b_pool.data[dst], a_pool.data[src])
        b_pool.data.zero_()
        assert finish(b, b.read(seed, dst, a.local, src), a) == "done"
        assert torch.equal(b_pool.data[dst], a_pool.data[src])


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


@pytest.mark.parametrize("mode", [Mode.PUSH, Mode.PULL])
def test_sessions_run_unchanged(make, engines, mode, tiny_model, request):
    pre, dec = engines
    first_tid = 1000 + 10 * (mode is Mode.PULL) + 100 * ["fake", "tcp", "nixl"].index(
        request.node.callspec.params["make"])
    check_sessions_end_to_end(pre, dec, make(pre.kv_cache), make(dec.kv_cache), mode,
                              first_tid, tiny_model("llama"))
