"""Push and pull sessions between a prefill and a decode engine over the fake transport."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from pdserve import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.transfer.fake import FakeFabric, FakeTransport, Fault
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.messages import (
    CompletionNotice,
    ControlMessage,
    ControlOp,
    Reservation,
    decode_any,
)
from pdserve.transfer.peer import PeerId
from pdserve.transfer.receiver import RecvSession
from pdserve.transfer.sender import SendSession
from pdserve.transfer.sessions import Inbox, Mode
from pdserve.transfer.state import TransferState
from tests.conftest import engine_pair, hf_greedy

S = TransferState
PRE = PeerId(0x1111, "10.0.0.1", 7100)
DEC = PeerId(0x2222, "10.0.0.2", 7200)
LEASE, STEP = 2.0, 0.05
PROMPTS = [list(range(20, 77)), [5, 6, 7, 8, 9, 10, 11]]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
MODES = [Mode.PUSH, Mode.PULL]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def engines(tiny_model):
    return engine_pair(tiny_model("llama"))


@dataclass
class World:
    pre: Engine
    dec: Engine
    clock: Clock
    fabric: FakeFabric
    pre_tx: FakeTransport
    dec_tx: FakeTransport
    pre_inbox: Inbox
    dec_inbox: Inbox
    free: tuple[int, int]

    @property
    def layout(self) -> KVLayout:
        return KVLayout.of_cache(self.pre.kv_cache, "tiny-llama")


@dataclass
class Transfer:
    rid: str
    send: SendSession
    recv: RecvSession
    token0: int
    dst: list[int]


@pytest.fixture
def w(engines) -> World:
    pre, dec = engines
    clock = Clock()
    fabric = FakeFabric(clock)
    pre_tx, dec_tx = fabric.endpoint(PRE), fabric.endpoint(DEC)
    pre_tx.register(pre.kv_cache)
    dec_tx.register(dec.kv_cache)
    free = (pre.block_manager.num_free_blocks, dec.block_manager.num_free_blocks)
    world = World(pre, dec, clock, fabric, pre_tx, dec_tx, Inbox(pre_tx), Inbox(dec_tx), free)
    yield world
    assert (pre.block_manager.num_free_blocks, dec.block_manager.num_free_blocks) == free
    assert not pre.requests and not dec.requests


_ids = iter(range(1, 1 << 20))


def open_transfer(w: World, prompt: list[int], mode: Mode, params=GREEDY,
                  recv_layout: KVLayout | None = None, stream: bool = False) -> Transfer:
    """`stream`: the send session opens as if the prompt were still computing (token0 None);
    the test reports layers with `layers_ready` and token 0 with `prefill_done`."""
    tid = next(_ids)
    rid = f"t{tid}"
    w.pre.add_request(prompt, params, request_id=rid)
    out = next(o for o in _drain(w.pre) if o.request_id == rid)
    w.dec.add_remote_request(out.prompt_token_ids, params, request_id=rid)
    dst = w.dec.reserved_blocks(rid)
    gens = [w.dec.block_manager.generation(b) for b in dst]
    common = {"transfer_id": tid, "layout": w.layout, "mode": mode, "lease_s": LEASE,
              "clock": w.clock}
    recv = RecvSession(w.dec_inbox, peer=PRE, cache=w.dec.kv_cache, dst_blocks=dst,
                       dst_generations=gens, generation=w.dec.block_manager.generation,
                       **(common | {"layout": recv_layout or w.layout}))
    token0 = out.outputs[0].token_ids[0]
    send = SendSession(w.pre_inbox, peer=DEC, cache=w.pre.kv_cache,
                       src_blocks=out.kv_block_ids, token0=None if stream else token0, **common)
    return Transfer(rid, send, recv, token0, dst)


def _drain(engine: Engine) -> list:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def pump(w: World, t: Transfer, until=None) -> float:
    """Poll both sides, advancing the clock, until `until()` (default: both terminal).
    Returns the seconds it took; fails the test past twice the lease."""
    until = until or (lambda: t.send.state.is_terminal and t.recv.state.is_terminal)
    start = w.clock.now
    while True:
        t.send.poll()
        t.recv.poll()
        if until():
            return w.clock.now - start
        assert w.clock.now - start < 2 * LEASE, (t.send, t.recv.state, t.recv.reason)
        w.clock.now += STEP


def settle(w: World, t: Transfer) -> dict:
    """Hand DONE KV to the engine, else free the blocks once the rule allows; run decode."""
    if t.recv.state is S.DONE:
        w.dec.kv_ready(t.rid, t.recv.token0)
    else:
        pump(w, t, lambda: t.recv.blocks_reusable)
        w.dec.abort(t.rid)
    assert t.send.blocks_reusable
    if t.rid in w.pre.requests:
        w.pre.release(t.rid)
    return {o.request_id: o for o in _drain(w.dec) if o.finished}


def assert_failed_within_lease(w: World, t: Transfer, took: float) -> None:
    assert t.send.state is S.FAILED and t.recv.state is S.FAILED
    assert took <= LEASE + STEP
    assert t.recv.token0 is None  # nothing to hand to kv_ready
    final = settle(w, t)
    assert final[t.rid].outputs[0].finish_reason == "abort"


# -- the happy paths ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_transfer_then_decode_matches_transformers(w, mode, tiny_model):
    transfers = [open_transfer(w, p, mode) for p in PROMPTS]
    for t in transfers:
        pump(w, t)
        assert (t.send.state, t.recv.state) == (S.DONE, S.DONE)
        assert t.recv.token0 == t.token0 and t.recv.blocks_reusable
    finals = {}
    for t in transfers:
        finals |= settle(w, t)
    path = tiny_model("llama")
    for t, prompt in zip(transfers, PROMPTS, strict=True):
        assert finals[t.rid].outputs[0].token_ids == hf_greedy(path, prompt, 16)


def test_layerwise_push_writes_each_layer_then_notices_after_token0(w, tiny_model):
    t = open_transfer(w, PROMPTS[0], Mode.PUSH, stream=True)
    t.recv.poll()  # the reservation
    t.send.layers_ready(1)  # before the reservation arrived: nothing to write yet
    assert t.send.writes_issued == 0
    t.send.poll()
    assert t.send.writes_issued == 1  # layer 0, once the reservation is in
    num_layers = w.pre.kv_cache.num_layers
    for n in range(2, num_layers + 1):
        t.send.layers_ready(n)
        pump(w, t, lambda: True)
    assert t.send.writes_issued == num_layers and t.recv.state is S.TRANSFERRING
    for _ in range(10):
        pump(w, t, lambda: True)
    assert t.recv.state is S.TRANSFERRING  # no notice before token 0
    t.send.prefill_done(t.token0)
    pump(w, t)
    assert t.send.state is S.DONE and t.recv.state is S.DONE and t.recv.token0 == t.token0
    assert t.send.writes_issued == num_layers  # nothing written twice
    final = settle(w, t)
    assert final[t.rid].outputs[0].token_ids == hf_greedy(tiny_model("llama"), PROMPTS[0], 16)


def test_layerwise_push_with_a_corrupt_layer_never_reaches_kv_ready(w, monkeypatch):
    calls = []
    monkeypatch.setattr(w.dec, "kv_ready", lambda *a, **k: calls.append(a))
    t = open_transfer(w, PROMPTS[0], Mode.PUSH, stream=True)
    w.fabric.inject(Fault("corrupt"))  # the first data move: layer 0
    t.recv.poll()
    t.send.poll()
    t.send.layers_ready(1)
    t.send.prefill_done(t.token0)
    took = pump(w, t)
    assert "CRC32C" in t.recv.reason
    assert_failed_within_lease(w, t, took)
    assert calls == []


def test_receiver_abort_mid_stream_fences_every_layer_write(w):
    t = open_transfer(w, PROMPTS[0], Mode.PUSH, stream=True)
    w.fabric.inject(Fault("delay", seconds=3 * LEASE))
    w.fabric.inject(Fault("delay", seconds=3 * LEASE))
    w.dec.kv_cache.data[t.dst] = 0
    t.recv.poll()
    t.send.poll()
    t.send.layers_ready(1)
    t.send.layers_ready(2)  # two layer writes in flight, token 0 not known yet
    assert t.send.writes_issued == 2
    t.recv.abort("the client went away")
    took = pump(w, t)
    assert t.send.state is S.FAILED and t.recv.blocks_reusable
    w.clock.now += 4 * LEASE
    w.fabric.progress()  # past the writes' due time: fenced, they never land
    assert (w.dec.kv_cache.data[t.dst] == 0).all()
    assert took <= LEASE
    settle(w, t)


def test_a_prefill_that_never_reports_token0_fails_both_at_the_receivers_lease(w):
    """A streamed sender holds its own lease while its prompt computes (the wait is its
    compute); the receiver, told nothing (no HOLD), gives up at its lease and the sender
    follows on its ABORT."""
    t = open_transfer(w, PROMPTS[0], Mode.PUSH, stream=True)
    t.recv.poll()
    t.send.poll()
    t.send.layers_ready(w.pre.kv_cache.num_layers)  # every layer written, then silence
    took = pump(w, t)
    assert t.recv.reason == "the lease expired"
    assert t.send.reason == "the receiver aborted: the lease expired"
    assert took <= LEASE + 2 * STEP
    assert settle(w, t)[t.rid].outputs[0].finish_reason == "abort"


def test_streaming_is_push_only(w):
    with pytest.raises(ValueError, match="push"):
        SendSession(w.pre_inbox, transfer_id=1, peer=DEC, cache=w.pre.kv_cache,
                    layout=w.layout, src_blocks=[0], token0=None, mode=Mode.PULL)


def test_duplicate_notice_after_done_changes_nothing(w):
    t = open_transfer(w, PROMPTS[1], Mode.PUSH)
    pump(w, t)
    assert t.recv.state is S.DONE
    dup = CompletionNotice(t.send.transfer_id, PRE, (1, 2, 3), t.token0 + 1)
    w.pre_tx.send(DEC, dup.encode())
    t.recv.poll()
    assert t.recv.state is S.DONE and t.recv.token0 == t.token0
    settle(w, t)


def test_stray_writes_into_a_transfers_blocks_are_refused_and_it_still_decodes_right(
        w, tiny_model):
    """Only the paired sender, under its own transfer id, writes into the reserved blocks, and
    only while the transfer runs: the sender under another id, another peer under this id and
    the sender after DONE are refused, between the real write and the verification and after
    the KV went to the engine."""
    t = open_transfer(w, PROMPTS[0], Mode.PUSH)
    tid, src, dst = t.send.transfer_id, list(t.send.src_blocks), t.dst
    t.recv.poll()  # the reservation: writes into dst now permitted to PRE under tid
    t.send.poll()  # descriptor, write (landed), notice
    assert t.send.writes_issued == 1
    assert bool((w.dec.kv_cache.data[dst] == w.pre.kv_cache.data[src]).all())
    landed = w.dec.kv_cache.data[dst].clone()
    assert len(src) > 1
    wrong = src[::-1]  # bytes that differ from what belongs in each block
    impostor = w.fabric.endpoint(PeerId(0x3333, "10.0.0.3", 7300))
    impostor.register(w.pre.kv_cache)
    other_id = w.pre_tx.write(tid + 1, wrong, DEC, dst)
    other_peer = impostor.write(tid, wrong, DEC, dst)
    pump(w, t)  # both are due before the notice is verified
    assert (t.send.state, t.recv.state) == (S.DONE, S.DONE)
    late = w.pre_tx.write(tid, wrong, DEC, dst)  # the KV belongs to the engine now
    w.fabric.progress()
    assert [w.pre_tx.status(other_id), impostor.status(other_peer),
            w.pre_tx.status(late)] == ["error"] * 3
    assert bool((w.dec.kv_cache.data[dst] == landed).all())
    final = settle(w, t)
    assert final[t.rid].outputs[0].token_ids == hf_greedy(tiny_model("llama"), PROMPTS[0], 16)


# -- faults ------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["model_id", "block_size"])
def test_an_incompatible_peer_is_refused_with_the_field_named(w, field):
    other = dataclasses.replace(w.layout, **{field: {"model_id": "another-model",
                                                     "block_size": 32}[field]})
    t = open_transfer(w, PROMPTS[1], Mode.PUSH, recv_layout=other)
    took = pump(w, t)
    assert field in t.send.reason
    assert_failed_within_lease(w, t, took)
    assert took < LEASE / 2  # refused at the handshake, not left to the lease


@pytest.mark.parametrize("mode", MODES)
def test_dropped_data_move_fails_both_within_the_lease(w, mode):
    t = open_transfer(w, PROMPTS[0], mode)
    w.fabric.inject(Fault("drop", transfer_id=t.send.transfer_id))
    took = pump(w, t)
    assert "lease expired" in t.recv.reason or "lease expired" in t.send.reason
    assert_failed_within_lease(w, t, took)


@pytest.mark.parametrize("mode", MODES)
def test_dropped_notice_fails_both_within_the_lease(w, mode):
    t = open_transfer(w, PROMPTS[0], mode)
    w.fabric.inject(Fault("drop", target="message", message="notice"))
    assert_failed_within_lease(w, t, pump(w, t))


def test_write_delayed_past_the_lease_is_fenced_and_never_lands(w):
    t = open_transfer(w, PROMPTS[0], Mode.PUSH)
    w.fabric.inject(Fault("delay", seconds=3 * LEASE))
    w.dec.kv_cache.data[t.dst] = 0  # earlier tests may have left these very bytes there
    t.recv.poll()
    t.send.poll()  # the write is now in flight, due after the lease
    took = pump(w, t)
    assert t.recv.state is S.FAILED and t.send.state is S.FAILED
    assert t.recv.blocks_reusable  # the sender fenced its write, then said ABORT
    snapshot = w.dec.kv_cache.data[t.dst].clone()
    w.clock.now += 4 * LEASE
    w.fabric.progress()  # the delayed write's due time passes: it must not land
    assert (w.dec.kv_cache.data[t.dst] == 0).all() and (snapshot == 0).all()
    assert_failed_within_lease(w, t, took)


def test_receiver_waits_for_the_writer_before_reuse(w):
    t = open_transfer(w, PROMPTS[0], Mode.PUSH)
    w.fabric.inject(Fault("delay", seconds=3 * LEASE))
    w.dec.kv_cache.data[t.dst] = 0
    t.recv.poll()
    t.send.poll()  # write in flight
    while t.recv.poll() is not S.FAILED:  # the sender is silent (not polled)
        w.clock.now += STEP
    assert "lease expired" in t.recv.reason
    assert not t.recv.blocks_reusable  # the write may still land
    t.send.poll()  # the sender sees ABORT: fences the write, answers ABORT_ACK
    assert t.send.state is S.FAILED
    t.recv.poll()
    assert t.recv.blocks_reusable
    w.clock.now += 4 * LEASE
    w.fabric.progress()  # past the write's due time: fenced, it never lands
    assert (w.dec.kv_cache.data[t.dst] == 0).all()
    assert_failed_within_lease(w, t, LEASE)


@pytest.mark.parametrize("mode", MODES)
def test_corrupt_byte_fails_verification_and_never_reaches_kv_ready(w, mode, monkeypatch):
    calls = []
    monkeypatch.setattr(w.dec, "kv_ready", lambda *a, **k: calls.append(a))
    t = open_transfer(w, PROMPTS[0], mode)
    w.fabric.inject(Fault("corrupt"))
    took = pump(w, t)
    assert "CRC32C" in t.recv.reason and "aborted" in t.send.reason
    assert t.recv.blocks_reusable
    good = CompletionNotice(t.send.transfer_id, PRE, (), t.token0)
    w.pre_tx.send(DEC, good.encode())  # a late notice never revives
    t.recv.poll()
    assert t.recv.state is S.FAILED
    assert_failed_within_lease(w, t, took)
    assert calls == []


def test_prefill_death_mid_write(w):
    t = open_transfer(w, PROMPTS[0], Mode.PUSH)
    w.fabric.inject(Fault("delay", seconds=1.0))
    t.recv.poll()
    t.send.poll()
    w.fabric.kill(PRE)
    took = pump(w, t)
    assert "died" in t.recv.reason and "dead" in t.send.reason
    assert t.recv.blocks_reusable  # a dead writer writes no more
    assert_failed_within_lease(w, t, took)


def test_decode_death_while_prefill_writes(w):
    t = open_transfer(w, PROMPTS[0], Mode.PUSH)
    w.fabric.inject(Fault("die", peer=DEC))
    took = pump(w, t)
    assert "write failed" in t.send.reason or "died" in t.send.reason
    assert_failed_within_lease(w, t, took)


def test_prefill_death_mid_read(w):
    t = open_transfer(w, PROMPTS[0], Mode.PULL)
    w.fabric.inject(Fault("die", peer=PRE))
    took = pump(w, t)
    assert_failed_within_lease(w, t, took)


@pytest.mark.parametrize("mode", MODES)
def test_message_from_a_restarted_instance_is_not_trusted(w, mode):
    t = open_transfer(w, PROMPTS[0], mode)
    impostor = w.fabric.endpoint(PeerId(0x9999, PRE.host, PRE.port))  # same address
    forged = CompletionNotice(t.send.transfer_id, impostor.local, (), t.token0)
    t.recv.poll()
    impostor.send(DEC, forged.encode())
    took = pump(w, t)
    assert "restarted" in t.recv.reason
    assert_failed_within_lease(w, t, took)


def test_restart_of_the_prefill_peer_fails_both(w):
    t = open_transfer(w, PROMPTS[0], Mode.PUSH)
    t.recv.poll()
    new = w.fabric.restart(PRE)
    new.send(DEC, CompletionNotice(t.send.transfer_id, new.local, (), 1).encode())
    took = pump(w, t)
    assert t.recv.blocks_reusable
    assert_failed_within_lease(w, t, took)


@pytest.mark.parametrize("mode", MODES)
def test_late_notice_after_the_lease_is_ignored(w, mode):
    t = open_transfer(w, PROMPTS[0], mode)
    w.fabric.inject(Fault("delay", target="message", message="notice", seconds=3 * LEASE))
    took = pump(w, t)
    w.clock.now += 3 * LEASE
    t.recv.poll()  # the notice arrives now
    assert t.recv.state is S.FAILED and "lease expired" in t.recv.reason
    assert_failed_within_lease(w, t, took)


# -- control messages and fault specs ----------------------------------------------------------


def test_control_messages_round_trip_and_decode_strictly(w):
    res = Reservation(7, DEC, [3, 4], [1, 2], 0, w.layout.num_layers, w.layout)
    abort = ControlMessage(7, PRE, ControlOp.ABORT, "lease expired")
    for msg in (res, abort, ControlMessage(7, DEC, ControlOp.RELEASE)):
        assert decode_any(msg.encode()) == msg
    with pytest.raises(ValueError):
        decode_any(abort.encode() + b"\0")  # trailing bytes
    with pytest.raises(ValueError):
        decode_any(abort.encode().replace(b'"abort"', b'"abord"'))
    with pytest.raises(ValueError):
        ControlMessage(7, PRE, ControlOp.ABORT)  # an abort needs a reason
    with pytest.raises(ValueError):
        Reservation(7, DEC, [3, 3], [1, 2], 0, w.layout.num_layers, w.layout)


def test_undecodable_bytes_are_dropped_and_counted(w):
    t = open_transfer(w, PROMPTS[1], Mode.PUSH)
    w.pre_tx.send(DEC, b"PDTX garbage")
    pump(w, t)
    assert w.dec_inbox.rejected == 1 and t.recv.state is S.DONE
    settle(w, t)


@pytest.mark.parametrize("bad", [
    {"kind": "melt"}, {"kind": "corrupt", "target": "message"}, {"kind": "die"},
    {"kind": "delay"}, {"kind": "drop", "message": "notice"}, {"kind": "drop", "times": 0},
])
def test_fault_specs_are_validated(bad):
    with pytest.raises(ValueError):
        Fault(**bad)
