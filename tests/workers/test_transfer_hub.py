"""TransferHub: a prefill hub and a decode hub on the in-process fake fabric, on a fake clock.

Every case checks what the engine loop relies on: the events each side reports (exactly), that
a peer's close or cancel ends the other side at once rather than at the lease, and that late or
stray messages are answered or dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pdserve.common.model_config import ModelConfig
from pdserve.engine.kv_cache import KVCache
from pdserve.transfer.fake import FakeFabric, FakeTransport, Fault
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.messages import (
    FINISHED_AT_TOKEN0,
    ControlMessage,
    ControlOp,
    Reservation,
    decode_any,
    message_kind,
)
from pdserve.transfer.peer import PeerId, restarted
from pdserve.transfer.sessions import Mode
from pdserve.workers.transfer_hub import (
    CLOSED_MEMORY_S,
    HubEvent,
    PeerClosed,
    PeerDead,
    RecvBlocksFree,
    RecvDone,
    RecvFailed,
    SendEnded,
    TransferHub,
)

MODEL = ModelConfig("LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    max_position_embeddings=128)
BS, NUM_BLOCKS = 4, 8
PRE = PeerId(0x1111, "10.0.0.1", 7100)
DEC = PeerId(0x2222, "10.0.0.2", 7200)
LEASE = 2.0
TID = 0xABCD_0000_0000_0001
SRC, DST = [5, 1, 6], [2, 7, 3]
TOKEN0, LOGPROB0 = 42, -0.25
CANCELLED = "the request was cancelled"
CLOSED_HERE = "the transfer is closed at this peer"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class World:
    clock: Clock
    fabric: FakeFabric
    pre_tx: FakeTransport
    dec_tx: FakeTransport
    pre_cache: KVCache
    dec_cache: KVCache
    pre: TransferHub
    dec: TransferHub

    @property
    def nbytes(self) -> int:
        return len(SRC) * self.pre_cache.block_nbytes

    def poll(self, rounds: int = 1) -> tuple[list[HubEvent], list[HubEvent]]:
        """Poll decode then prefill `rounds` times without moving the clock; their events."""
        pre_events: list[HubEvent] = []
        dec_events: list[HubEvent] = []
        for _ in range(rounds):
            dec_events += self.dec.poll()
            pre_events += self.pre.poll()
        return pre_events, dec_events

    def assert_quiet(self) -> None:
        """No message is left in flight either way (no ABORT ping-pong)."""
        self.poll(3)
        assert self.pre_tx.receive() == [] and self.dec_tx.receive() == []


def make_world(mode: Mode = Mode.PUSH) -> World:
    clock = Clock()
    fabric = FakeFabric(clock)
    pre_tx, dec_tx = fabric.endpoint(PRE), fabric.endpoint(DEC)
    pre_cache = KVCache(MODEL, NUM_BLOCKS, BS, torch.float32)
    dec_cache = KVCache(MODEL, NUM_BLOCKS, BS, torch.float32)
    pre_cache.data.copy_(torch.randn(pre_cache.data.shape,
                                     generator=torch.Generator().manual_seed(0)))
    pre_tx.register(pre_cache)
    dec_tx.register(dec_cache)
    layout = KVLayout.of_cache(pre_cache, "tiny")
    generations = [3] * NUM_BLOCKS

    def hub(tx: FakeTransport, cache: KVCache) -> TransferHub:
        return TransferHub(tx, cache, layout, generations.__getitem__, LEASE, mode, clock)

    return World(clock, fabric, pre_tx, dec_tx, pre_cache, dec_cache,
                 hub(pre_tx, pre_cache), hub(dec_tx, dec_cache))


@pytest.fixture
def w() -> World:
    return make_world()


def open_recv(w: World, tid: int = TID) -> None:
    w.dec.expect(tid, PRE)
    w.dec.open_recv(tid, PRE, DST)


def open_send(w: World, tid: int = TID) -> None:
    w.pre.expect(tid, DEC)
    w.pre.open_send(tid, DEC, SRC, TOKEN0, LOGPROB0)


# -- the happy path --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [Mode.PUSH, Mode.PULL])
def test_transfer_lands_the_bytes_and_reports_once_on_each_side(mode):
    w = make_world(mode)
    open_recv(w)
    open_send(w)
    assert (w.pre.active, w.dec.active) == (1, 1)
    pre_events, dec_events = [], []
    for _ in range(4):
        w.clock.now += 0.25
        p, d = w.poll()
        pre_events += p
        dec_events += d
    # round 1: reservation; descriptor and (push) write + notice or (pull) notice.
    # round 2: the decode verifies (pull: after its read) and says ACK/RELEASE; the prefill ends.
    assert dec_events == [RecvDone(TID, TOKEN0, LOGPROB0, 0.5, w.nbytes)]
    assert pre_events == [SendEnded(TID, True, None, 0.5, w.nbytes)]
    assert torch.equal(w.dec_cache.data[DST], w.pre_cache.data[SRC])
    untouched = [b for b in range(NUM_BLOCKS) if b not in DST]
    assert not w.dec_cache.data[untouched].any()
    assert (w.pre.active, w.dec.active) == (0, 0)
    assert w.pre.is_closed(TID) and w.dec.is_closed(TID)
    w.assert_quiet()


def test_a_reservation_that_arrives_before_the_prefill_finished_waits_for_its_session(w):
    open_recv(w)
    w.pre.expect(TID, DEC)
    assert w.poll(3) == ([], [])  # the prefill is still computing: nothing to send yet
    w.pre.open_send(TID, DEC, SRC, TOKEN0, LOGPROB0)
    pre_events, dec_events = w.poll(2)
    assert dec_events == [RecvDone(TID, TOKEN0, LOGPROB0, 0.0, w.nbytes)]
    assert pre_events == [SendEnded(TID, True, None, 0.0, w.nbytes)]
    assert torch.equal(w.dec_cache.data[DST], w.pre_cache.data[SRC])


# -- the prefill ends the request at token 0 -------------------------------------------------------


def test_prefill_finished_before_the_decode_opened_ends_the_expected_leg(w):
    w.dec.expect(TID, PRE)
    w.pre.expect(TID, DEC)
    w.pre.close_finished(TID, DEC)
    pre_events, dec_events = w.poll()
    assert dec_events == [PeerClosed(TID, FINISHED_AT_TOKEN0, finished=True)]
    assert pre_events == []  # the decode's ABORT_ACK is taken silently
    assert w.dec.is_closed(TID) and w.pre.is_closed(TID)
    assert w.dec.active == 0
    w.assert_quiet()


def test_prefill_finished_while_the_decode_session_waits_fails_it_at_once(w):
    open_recv(w)
    w.dec.poll()  # the reservation is on its way
    w.pre.expect(TID, DEC)
    w.pre.close_finished(TID, DEC)
    dec_events = w.dec.poll()  # no clock movement: well before the lease
    assert dec_events == [RecvFailed(TID, f"the sender aborted: {FINISHED_AT_TOKEN0}",
                                     sender_finished=True)]
    assert w.dec.active == 0
    w.assert_quiet()


def test_prefill_finished_with_the_closed_answer_in_the_same_batch(w):
    open_recv(w)
    w.dec.poll()  # the reservation is on its way
    w.pre.expect(TID, DEC)
    w.pre.close_finished(TID, DEC)  # ABORT(finished at token 0)
    assert w.pre.poll() == []  # answers the late reservation: ABORT(closed at this peer)
    dec_events = w.dec.poll()  # the decode takes both ABORTs at once
    assert dec_events == [RecvFailed(TID, f"the sender aborted: {FINISHED_AT_TOKEN0}",
                                     sender_finished=True)]


# -- the decode cancels ----------------------------------------------------------------------------


def test_decode_cancel_before_the_prefill_opened_closes_the_expected_transfer(w):
    w.pre.expect(TID, DEC)
    w.dec.expect(TID, PRE)
    w.dec.close(TID, PRE, CANCELLED)
    pre_events, dec_events = w.poll()
    assert pre_events == [PeerClosed(TID, CANCELLED, finished=False)]
    assert dec_events == []
    w.assert_quiet()
    assert w.pre.is_closed(TID)  # so the prefill's open_send at token 0 returns False


def test_decode_cancel_before_the_prefill_leg_arrived_still_closes_the_id(w):
    w.dec.expect(TID, PRE)
    w.dec.close(TID, PRE, CANCELLED)
    assert w.poll() == ([], [])  # nobody expects it at the prefill: closed, nothing to report
    assert w.pre.is_closed(TID)
    w.pre.expect(TID, DEC)  # the prefill leg arrives after the decode's ABORT overtook it
    assert w.pre.poll() == [PeerClosed(TID, CANCELLED, finished=False)]


def test_finished_at_token0_that_overtakes_the_decode_leg_is_reported_on_expect(w):
    w.pre.expect(TID, DEC)
    w.pre.close_finished(TID, DEC)
    assert w.dec.poll() == []  # nobody expects it at the decode yet
    w.dec.expect(TID, PRE)
    assert w.dec.poll() == [PeerClosed(TID, FINISHED_AT_TOKEN0, finished=True)]


def test_decode_abort_of_an_open_session_ends_both_without_the_lease(w):
    open_recv(w)
    w.pre.expect(TID, DEC)
    w.dec.poll()  # reservation sent: a writer may now write, so the decode must hear back
    w.dec.abort(TID, "the client went away")
    reason = "aborted by the caller: the client went away"
    pre_events, dec_events = w.poll(2)
    assert pre_events == [PeerClosed(TID, reason, finished=False)]
    # the failure at once; the blocks once the prefill confirmed it will never write
    assert dec_events == [RecvFailed(TID, reason, sender_finished=False, blocks_free=False),
                          RecvBlocksFree(TID)]
    w.assert_quiet()


def test_a_silent_sender_fails_the_transfer_at_the_lease_but_holds_the_blocks(w):
    """A stalled prefill worker (alive, connected, silent) got the reservation, so it may
    still write into the blocks: the decode leg hears of the failure at the lease and can
    recompute elsewhere in the pool, while the reserved blocks stay held until the sender
    wakes and confirms its fence."""
    open_recv(w)
    w.pre.expect(TID, DEC)
    assert w.dec.poll() == []  # the reservation is out; the prefill hub is not polled (stalled)
    w.clock.now += LEASE
    assert w.dec.poll() == [RecvFailed(TID, "the lease expired", False, blocks_free=False)]
    w.clock.now += 10 * LEASE
    assert w.dec.poll() == [] and w.dec.active == 1  # still held, ABORT re-sent meanwhile
    pre_events, dec_events = w.poll(2)  # the prefill wakes: reservation, then the ABORTs
    assert pre_events == [PeerClosed(TID, "the lease expired", finished=False)]
    assert dec_events == [RecvBlocksFree(TID)]
    assert w.dec.active == 0
    w.assert_quiet()


def test_prefill_abort_of_an_open_send_session(w):
    open_recv(w)
    open_send(w)
    w.pre.abort(TID, "shutting down")
    pre_events, dec_events = w.poll(2)
    reason = "aborted by the caller: shutting down"
    assert pre_events == [SendEnded(TID, False, reason, 0.0, w.nbytes)]
    assert dec_events == [RecvFailed(TID, "the sender aborted: shutting down", False)]
    assert not w.dec_cache.data.any()  # no write was ever issued


# -- peers that restart ----------------------------------------------------------------------------


def test_a_restarted_sender_fails_the_open_receive_at_once_with_its_blocks_free(w):
    open_recv(w)
    w.dec.poll()  # the reservation is out: the old instance knows where to write
    new = w.fabric.restart(PRE)
    assert w.dec.poll() == [RecvFailed(TID, f"the sender {PRE} died ({restarted(new.local)})",
                                       sender_finished=False, blocks_free=True)]
    assert w.dec.active == 0


def test_a_restarted_receiver_ends_the_held_send_at_once(w):
    open_recv(w)
    open_send(w)
    w.dec.poll()
    new = w.fabric.restart(DEC)
    assert w.pre.poll() == [SendEnded(TID, False, f"the receiver {DEC} died "
                                      f"({restarted(new.local)})", 0.0, w.nbytes)]


def test_an_expected_transfer_whose_peer_restarts_is_closed_and_reported_at_once(w):
    assert w.pre.expect(TID, DEC) is None
    new = w.fabric.restart(DEC)
    assert w.pre.poll() == [PeerDead(TID, f"the peer {DEC} died ({restarted(new.local)})")]
    assert w.pre.is_closed(TID)
    assert not w.pre.open_send(TID, DEC, SRC, TOKEN0, LOGPROB0)  # so the caller releases
    assert w.pre.poll() == []


def test_expect_refuses_a_peer_known_dead_and_takes_its_new_instance(w):
    new = w.fabric.restart(PRE)
    assert w.dec.expect(TID, PRE) == f"the peer {PRE} died ({restarted(new.local)})"
    assert w.dec.is_closed(TID) and w.dec.poll() == []
    assert w.dec.expect(TID + 1, new.local) is None
    assert w.dec.poll() == [] and not w.dec.is_closed(TID + 1)


# -- late and stray messages -----------------------------------------------------------------------


def test_late_reservation_for_a_closed_transfer_is_answered_with_abort(w):
    w.fabric.inject(Fault("drop", target="message", message="abort", times=1))
    w.pre.expect(TID, DEC)
    w.pre.close_finished(TID, DEC)  # this ABORT is lost on the way
    open_recv(w)
    pre_events, dec_events = w.poll(2)  # no clock movement: far from the lease
    assert pre_events == []
    assert dec_events == [RecvFailed(TID, f"the sender aborted: {CLOSED_HERE}",
                                     sender_finished=False)]
    w.assert_quiet()


def test_an_abort_for_a_closed_transfer_is_acknowledged(w):
    w.pre.close(TID, None, CANCELLED)
    w.dec_tx.send(PRE, ControlMessage(TID, DEC, ControlOp.ABORT, "lease expired").encode())
    w.dec_tx.send(PRE, ControlMessage(TID, DEC, ControlOp.ABORT_ACK).encode())
    assert w.pre.poll() == []
    answers = [decode_any(data) for _, data in w.dec_tx.receive()]
    assert answers == [ControlMessage(TID, PRE, ControlOp.ABORT_ACK)]  # nothing for the ACK


def test_a_closed_id_is_forgotten_after_the_closed_memory(w):
    w.pre.close(TID, None, CANCELLED)
    w.clock.now += CLOSED_MEMORY_S
    w.pre.poll()
    assert w.pre.is_closed(TID)
    w.clock.now += 0.5
    w.pre.poll()
    assert not w.pre.is_closed(TID)


def reservation(tid: int) -> bytes:
    """What the decode's RecvSession would send for `tid` (blocks DST, generation 3)."""
    layout = KVLayout("tiny", "float32", BS, MODEL.num_layers, MODEL.num_kv_heads,
                      MODEL.head_dim)
    return Reservation(tid, DEC, DST, [3] * len(DST), 0, MODEL.num_layers, layout).encode()


def sent_to_decode(w: World) -> list[str]:
    return [message_kind(decode_any(data)) for _, data in w.dec_tx.receive()]


@pytest.mark.parametrize(("expected", "wait", "kept"), [
    (False, LEASE, True),  # not yet past the lease
    (False, LEASE + 0.5, False),  # nobody claimed it within the lease: dropped
    (True, 3 * LEASE, True),  # an expected id keeps its messages however long the prefill takes
])
def test_unclaimed_messages_are_dropped_after_the_lease_unless_expected(w, expected, wait, kept):
    if expected:
        w.pre.expect(TID, DEC)
    w.dec_tx.allow_writes(TID, PRE, DST)  # as the decode's RecvSession would, before it sends
    w.dec_tx.send(PRE, reservation(TID))
    assert w.pre.poll() == []
    w.clock.now += wait
    assert w.pre.poll() == []
    # a stray message is not answered (an expected id tells the decode it is held, though)
    assert sent_to_decode(w) == (["hold"] if expected else [])
    w.pre.open_send(TID, DEC, SRC, TOKEN0, LOGPROB0)
    w.pre.poll()
    # a kept reservation is served at once: descriptor, write, completion notice
    assert sent_to_decode(w) == (["descriptor", "notice"] if kept else [])


# -- layer-wise streaming (push) -------------------------------------------------------------------


def stream_layer0(w: World) -> None:
    """Decode reserves (the reservation is on its way); the prefill streams layer 0."""
    open_recv(w)
    w.pre.expect(TID, DEC)
    w.dec.poll()
    w.pre.stream_layers(TID, DEC, SRC, 1)


def test_streamed_layers_then_token0_land_the_bytes_and_report_once(w):
    stream_layer0(w)  # opens the session; layer 0 waits for the reservation
    assert w.poll(2) == ([], [])
    assert torch.equal(w.dec_cache.data[DST, 0], w.pre_cache.data[SRC, 0])
    assert not w.dec_cache.data[DST, 1].any()  # layer 1 is not computed yet
    assert w.pre.open_send(TID, DEC, SRC, TOKEN0, LOGPROB0)  # the last layer, then the notice
    pre_events, dec_events = w.poll(2)
    assert dec_events == [RecvDone(TID, TOKEN0, LOGPROB0, 0.0, w.nbytes)]
    assert pre_events == [SendEnded(TID, True, None, 0.0, w.nbytes)]
    assert torch.equal(w.dec_cache.data[DST], w.pre_cache.data[SRC])
    w.assert_quiet()


def test_a_streamed_session_the_decode_aborts_is_not_reported_and_open_send_says_closed(w):
    stream_layer0(w)
    w.pre.poll()  # layer 0 written
    w.dec.abort(TID, CANCELLED)
    pre_events, dec_events = w.poll(2)
    assert pre_events == []  # the engine still computes this prompt: nothing to release yet
    assert dec_events == [RecvFailed(TID, f"aborted by the caller: {CANCELLED}", False, False),
                          RecvBlocksFree(TID)]
    assert w.pre.is_closed(TID) and w.pre.active == 0
    assert not w.pre.open_send(TID, DEC, SRC, TOKEN0, LOGPROB0)  # so the caller releases
    w.pre.stream_layers(TID, DEC, SRC, 2)  # a later layer of a closed transfer: nothing
    assert w.pre.active == 0
    w.assert_quiet()


def test_closing_a_streamed_transfer_fences_it_and_tells_the_decode(w):
    stream_layer0(w)
    w.pre.close_finished(TID, DEC)  # token 0 ended the request after layer 0 went out
    assert w.pre.active == 0 and w.pre.is_closed(TID)
    pre_events, dec_events = w.poll(2)
    assert dec_events == [RecvFailed(TID, f"the sender aborted: {FINISHED_AT_TOKEN0}",
                                     sender_finished=True)]
    assert pre_events == []
    w.assert_quiet()


def test_pull_mode_ignores_layer_streaming():
    w = make_world(Mode.PULL)
    w.pre.expect(TID, DEC)
    w.pre.stream_layers(TID, DEC, SRC, 1)
    assert w.pre.active == 0


# -- holding: a transfer waiting for compute or room is not timed out --------------------------


def run_leases(w: World, leases: int) -> None:
    """Poll both hubs while `leases` leases pass, in steps of an eighth of one; nothing ends."""
    for _ in range(8 * leases):
        w.clock.now += LEASE / 8
        assert w.poll() == ([], [])


def test_an_expected_transfer_is_held_every_third_of_the_lease_until_closed(w):
    w.pre.expect(TID, DEC)
    start, held_at = w.clock.now, []
    while w.clock.now < start + 3 * LEASE:
        w.clock.now += LEASE / 16
        w.pre.poll()
        for _, data in w.dec_tx.receive():
            assert decode_any(data) == ControlMessage(TID, PRE, ControlOp.HOLD)
            held_at.append(w.clock.now)
    gaps = [b - a for a, b in zip([start, *held_at], held_at, strict=False)]
    assert len(held_at) >= 7
    assert all(LEASE / 3 <= gap <= LEASE / 3 + LEASE / 16 for gap in gaps), gaps
    w.pre.close(TID, DEC, CANCELLED)
    w.clock.now += LEASE
    w.pre.poll()
    assert sent_to_decode(w) == ["abort"]  # and no HOLD after it


def test_a_receive_waits_out_a_prefill_queued_for_three_leases_and_gets_the_kv(w):
    w.dec.expect(TID, PRE)  # the reservation waits for room; the prefill is queued
    w.pre.expect(TID, DEC)
    run_leases(w, 1)  # each side holds the id for the other: dropped, never answered
    w.dec.open_recv(TID, PRE, DST)
    run_leases(w, 2)
    assert w.pre.open_send(TID, DEC, SRC, TOKEN0, LOGPROB0)
    pre_events, dec_events = w.poll(2)
    assert dec_events == [RecvDone(TID, TOKEN0, LOGPROB0, 2 * LEASE, w.nbytes)]
    assert pre_events == [SendEnded(TID, True, None, 0.0, w.nbytes)]
    w.assert_quiet()


def test_a_send_waits_out_a_reservation_queued_for_room_and_delivers(w):
    w.dec.expect(TID, PRE)  # the decode pool has no room yet
    open_send(w)
    run_leases(w, 3)
    w.dec.open_recv(TID, PRE, DST)
    pre_events, dec_events = w.poll(2)
    assert dec_events == [RecvDone(TID, TOKEN0, LOGPROB0, 0.0, w.nbytes)]
    assert pre_events == [SendEnded(TID, True, None, 3 * LEASE, w.nbytes)]
    w.assert_quiet()


def test_a_streamed_prompt_that_computes_for_three_leases_still_lands(w):
    stream_layer0(w)
    run_leases(w, 3)
    assert w.pre.open_send(TID, DEC, SRC, TOKEN0, LOGPROB0)
    pre_events, dec_events = w.poll(2)
    assert dec_events == [RecvDone(TID, TOKEN0, LOGPROB0, 3 * LEASE, w.nbytes)]
    assert pre_events == [SendEnded(TID, True, None, 0.0, w.nbytes)]
    assert torch.equal(w.dec_cache.data[DST], w.pre_cache.data[SRC])


def test_a_hold_for_a_closed_transfer_is_answered_with_abort(w):
    w.pre.close(TID, None, CANCELLED)
    w.dec_tx.send(PRE, ControlMessage(TID, DEC, ControlOp.HOLD).encode())
    assert w.pre.poll() == []
    answers = [decode_any(data) for _, data in w.dec_tx.receive()]
    assert answers == [ControlMessage(TID, PRE, ControlOp.ABORT, CLOSED_HERE)]
