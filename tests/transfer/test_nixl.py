"""NixlTransport: bytes over NIXL (UCX, DRAM), the session layer over it, peer loss, the fence."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("nixl_cu12")

from pdserve.engine.kv_cache import KVCache
from pdserve.transfer.nixl import NixlOptions, NixlTransport
from pdserve.transfer.nixl.meta import MAGIC, PoolRegion, decode_meta, encode_meta
from pdserve.transfer.nixl.move import NixlMove, quiesce
from pdserve.transfer.peer import PeerId
from pdserve.transfer.tcp import TcpOptions
from tests.transfer.test_tcp import BS, MODEL, SECRET, finish, mapping, pool, wait_for

OPTS = NixlOptions(cancel_wait_s=2.0, meta_timeout_s=1.0, dead_grace_s=0.3,
                   tcp=TcpOptions(dial_timeout_s=0.5, handshake_timeout_s=1.0))


def endpoint(cache: KVCache | None = None, **kw) -> NixlTransport:
    tx = NixlTransport(secret=SECRET, options=kw.pop("options", OPTS), **kw)
    if cache is not None:
        tx.register(cache)
    return tx


@pytest.fixture
def pair() -> Iterator[tuple[NixlTransport, NixlTransport, KVCache, KVCache]]:
    a_pool, b_pool = pool(400, seed=1), pool(400)
    with endpoint(a_pool) as a, endpoint(b_pool) as b:
        yield a, b, a_pool, b_pool


# -- metadata and moves (the shared suite is test_conformance.py) -------------------------------


def test_metadata_never_reaches_receive_and_control_keeps_its_source(pair):
    a, b, _, _ = pair
    for i in range(5):
        a.send(b.local, b"m%d" % i)
    got: list = []
    wait_for(lambda: got.extend(b.receive()) or len(got) >= 5)
    assert got == [(a.local, b"m%d" % i) for i in range(5)]
    assert all(not m.startswith(MAGIC) for _, m in a.receive())


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def test_idle_endpoints_sleep_instead_of_spinning(pair):
    """NIXL's progress thread waits in poll() between events: two idle endpoints (after a move,
    connections up) cost this process a few percent of a core, not a core each (the Python
    API's zero poll timeout), and moves still complete."""
    a, b, a_pool, b_pool = pair
    assert finish(a, a.write(1, [3], b.local, [7]), b) == "done"
    assert torch.equal(b_pool.data[7], a_pool.data[3])
    time.sleep(0.3)
    cpu, wall = _process_cpu_s(), time.monotonic()
    time.sleep(2.0)
    busy = (_process_cpu_s() - cpu) / (time.monotonic() - wall)
    assert busy < 0.25, f"two idle NIXL endpoints used {busy:.0%} of a core"
    assert finish(a, a.write(2, [4], b.local, [8]), b) == "done"
    assert torch.equal(b_pool.data[8], a_pool.data[4])


def test_progress_poll_must_be_a_whole_number_of_milliseconds():
    for bad in (0, -1, 2.5):
        with pytest.raises(ValueError, match="progress_poll_ms"):
            NixlOptions(progress_poll_ms=bad)


def test_metadata_round_trips_and_refuses_garbage():
    region = PoolRegion("DRAM", 0, 4096, 128, 100, 3)
    assert decode_meta(encode_meta("x", region, b"md")) == ("x", region, b"md")
    with pytest.raises(ValueError):
        decode_meta(MAGIC + b"\xff\x00\x00\x00{")
    with pytest.raises(ValueError):
        region.check([0, 3], "ids")


def test_bad_arguments_are_refused(pair):
    a, b, _, _ = pair
    for local, remote in (([0, 1], [0]), ([], []), ([0, 0], [1, 2]), ([400], [0]),
                          ([0], [-1])):
        with pytest.raises(ValueError):
            a.write(1, local, b.local, remote)
    with pytest.raises(ValueError):
        a.status(12345)
    with pytest.raises(ValueError):
        endpoint().write(1, [0], b.local, [0])


def test_an_out_of_range_remote_block_fails_that_move_only(pair):
    a, b, _, _ = pair
    assert finish(a, a.write(1, [0], b.local, [400]), b) == "error"
    assert finish(a, a.write(2, [0], b.local, [399]), b) == "done"


def test_a_peer_without_a_pool_fails_the_move_after_the_metadata_timeout(pair):
    a, _, _, _ = pair
    with endpoint() as bare:
        start = time.monotonic()
        assert finish(a, a.write(1, [0], bare.local, [0]), bare) == "error"
        assert time.monotonic() - start < OPTS.meta_timeout_s + 1.0


# -- peer loss and the fence -----------------------------------------------------------------------


def test_a_peer_closed_mid_stream_fails_its_moves_and_the_survivor_keeps_working():
    big_a, big_b = pool(2048, seed=4), pool(2048)  # 64 MiB each
    blocks = list(range(2048))
    with endpoint(big_a) as a:
        b = endpoint(big_b)
        assert finish(a, a.write(1, [0], b.local, [0]), b) == "done"  # metadata exchanged
        handles = [a.write(2 + i, blocks, b.local, blocks) for i in range(3)]
        b.close()
        start = time.monotonic()
        wait_for(lambda: not a.peer_alive(b.local), 3.0)
        for h in handles[1:]:
            assert finish(a, h, timeout=3.0) in ("error", "done")
        assert finish(a, a.write(9, [1], b.local, [1])) == "error"
        assert time.monotonic() - start < 4.0
        for h in handles:
            a.cancel(h)  # the fence holds even for a dead peer's moves
        with endpoint(pool(400)) as c:
            c.send(a.local, b"still serving")
            assert finish(a, a.write(10, [5, 6], c.local, [1, 2]), c) == "done"
            wait_for(lambda: (c.local, b"still serving") in a.receive())


@pytest.mark.parametrize("kind", ["write", "read"])
def test_cancel_is_a_fence(kind):
    src, dst = pool(2048, seed=2), pool(2048)
    blocks = list(range(2048))
    with endpoint(src) as w, endpoint(dst) as r:
        assert finish(w, w.write(1, [0], r.local, [0]), r) == "done"
        dst.data.zero_()
        if kind == "write":
            h, tx = w.write(2, blocks, r.local, blocks), w
        else:
            h, tx = r.read(2, blocks, w.local, blocks), r
        tx.cancel(h)
        assert tx.status(h) in ("error", "done")
        snapshot = dst.data.clone()
        time.sleep(0.2)
        assert torch.equal(dst.data, snapshot), "a cancelled move touched the pool after cancel"
        tx.cancel(h)  # cancelling again changes nothing
        assert finish(w, w.write(3, [7], r.local, [7]), r) == "done"


def test_a_finished_move_keeps_done_after_cancel(pair):
    a, b, _, _ = pair
    h = a.write(1, [3], b.local, [4])
    assert finish(a, h, b) == "done"
    a.cancel(h)
    assert a.status(h) == "done"


def test_close_is_idempotent_and_fails_pending_moves():
    tx = endpoint(pool(4))
    unreachable = PeerId(7, "127.0.0.1", 9)
    handle = tx.write(1, [0], unreachable, [0])
    tx.close()
    tx.close()
    assert tx.status(handle) == "error" and not tx.peer_alive(tx.local)
    assert tx.receive() == []


# -- two processes ---------------------------------------------------------------------------------

CHILD = """
import json, sys, time, torch
from pdserve.transfer.nixl import NixlTransport
from tests.transfer.test_tcp import SECRET, pool
tx = NixlTransport(secret=SECRET)
tx.register(pool(400, seed=11))  # no other reference: the transport must keep it alive
print("PEER", json.dumps(tx.local.to_json()), flush=True)
while True:
    for peer, msg in tx.receive():
        if msg == b"bye":
            tx.close()
            sys.exit(0)
    time.sleep(0.001)
"""


def test_two_processes_write_and_read():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, env=env,
                             text=True)
    try:
        line = ""
        while not line.startswith("PEER "):  # NIXL logs to stdout too
            line = child.stdout.readline()
            assert line, "the child exited early"
        peer = PeerId.from_json(json.loads(line[5:]))
        theirs, mine = pool(400, seed=11), pool(400, seed=12)
        with endpoint(mine) as tx:
            src, dst = mapping(300, seed=5)
            assert finish(tx, tx.read(1, dst, peer, src)) == "done"
            assert torch.equal(mine.data[dst], theirs.data[src])
            assert finish(tx, tx.write(2, [1, 2], peer, [3, 4])) == "done"
            tx.send(peer, b"bye")
            assert child.wait(10) == 0
    finally:
        child.kill()
        child.wait()


def test_pool_shape_matches_the_block_size():
    cache = KVCache(MODEL, 3, BS, torch.float32)
    region = PoolRegion.of_cache(cache)
    assert (region.mem, region.block_nbytes, region.num_blocks) == ("DRAM", cache.block_nbytes, 3)
    assert region.stride == region.block_nbytes


# -- the fence when NIXL does not finish on its own ------------------------------------------------


class _Agent:
    """A stand-in NIXL agent: `states` is what check_xfer_state returns, in turn (the last
    repeats); `refuse` makes release raise as NIXL does for a request it cannot abort."""

    def __init__(self, states: list[str], refuse: bool = False) -> None:
        self.states, self.refuse, self.released = states, refuse, 0

    def check_xfer_state(self, xfer: object) -> str:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def release_xfer_handle(self, xfer: object) -> None:
        if self.refuse:
            raise RuntimeError("cannot cancel an active request")
        self.released += 1


def _posted() -> NixlMove:
    return NixlMove(1, "write", PeerId(7, "127.0.0.1", 9), (0,), (0,), 0.0, xfer=object())


@pytest.mark.parametrize(("states", "refuse", "quiet"), [
    (["PROC", "PROC", "DONE"], False, True),  # waits for NIXL to finish, then releases
    (["PROC", "ERR"], False, True),
    (["PROC"], False, True),  # never finishes: released past the wait, NIXL aborts it
    (["PROC"], True, False),  # NIXL refuses to abort: not confirmed
])
def test_quiesce_waits_then_aborts_and_reports_what_it_could_not_confirm(states, refuse, quiet):
    agent, move = _Agent(states, refuse), _posted()
    start = time.monotonic()
    assert quiesce(agent, move, 0.05) is quiet
    assert time.monotonic() - start < 1.0
    assert (move.xfer is None) is quiet and agent.released == int(quiet)


def test_an_unconfirmed_fence_cuts_the_peer_off(pair, monkeypatch, caplog):
    a, b, _, _ = pair
    assert finish(a, a.write(1, [0], b.local, [0]), b) == "done"
    stuck = _Agent(["PROC"], refuse=True)
    h = a.write(2, [1], b.local, [1])  # posted; NIXL now "never finishes and cannot abort"
    monkeypatch.setattr(a._agent, "check_xfer_state", stuck.check_xfer_state)
    monkeypatch.setattr(a._agent, "release_xfer_handle", stuck.release_xfer_handle)
    a.cancel(h)
    assert a.status(h) == "error" and not a.peer_alive(b.local)
    assert "could not be fenced" in caplog.text or "cannot confirm" in caplog.text
    wait_for(lambda: not b.peer_alive(a.local), 3.0)  # the peer sees this endpoint go
    monkeypatch.undo()  # close() retries the release
