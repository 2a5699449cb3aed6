"""HOLD: a peer that holds a transfer without moving its KV yet (its prompt queued or computing,
its reservation waiting for pool room) renews the waiting session's lease, so the lease times
the peer's silence, not the queue ahead of it. Silence, or a stranger's HOLD, still ends the
wait at the lease."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.transfer.fake import FakeTransport
from pdserve.transfer.messages import ControlMessage, ControlOp
from pdserve.transfer.peer import PeerId
from pdserve.transfer.receiver import RecvSession
from pdserve.transfer.sender import SendSession
from pdserve.transfer.sessions import Mode, Session
from tests.transfer import test_sessions
from tests.transfer.test_sessions import (
    DEC,
    LEASE,
    MODES,
    PRE,
    PROMPTS,
    STEP,
    S,
    Transfer,
    World,
    open_transfer,
    pump,
    settle,
)

engines, w = test_sessions.engines, test_sessions.w  # the prefill and decode engines, the world
HOLD_EVERY = LEASE / 3  # what a worker's transfer hub sends


def hold_for(w: World, leases: float, author: FakeTransport, to: PeerId, session: Session,
             tid: int) -> float:
    """`author` HOLDs `tid` every third of the lease while `session` is polled every STEP, for
    `leases` leases or until the session ends. Returns when the last HOLD went."""
    end, due, last = w.clock.now + leases * LEASE, w.clock.now, w.clock.now
    while w.clock.now < end and not session.poll().is_terminal:
        if w.clock.now >= due:
            author.send(to, ControlMessage(tid, author.local, ControlOp.HOLD).encode())
            last, due = w.clock.now, due + HOLD_EVERY
        w.clock.now += STEP
    return last


def _session_args(w: World, t: Transfer, mode: Mode) -> dict:
    return {"transfer_id": t.send.transfer_id, "layout": w.layout, "mode": mode,
            "lease_s": LEASE, "clock": w.clock}


def late_send(w: World, t: Transfer, mode: Mode) -> Transfer:
    """The prefill side's session opens now, its prompt having waited behind others until now
    (the one `open_transfer` made was never polled: it sent nothing)."""
    send = SendSession(w.pre_inbox, peer=DEC, cache=w.pre.kv_cache,
                       src_blocks=t.send.src_blocks, token0=t.token0, **_session_args(w, t, mode))
    return dataclasses.replace(t, send=send)


def late_recv(w: World, t: Transfer, mode: Mode) -> Transfer:
    """The decode side's session opens now, its reservation having waited for room."""
    gen = w.dec.block_manager.generation
    recv = RecvSession(w.dec_inbox, peer=PRE, cache=w.dec.kv_cache, dst_blocks=t.dst,
                       dst_generations=[gen(b) for b in t.dst], generation=gen,
                       **_session_args(w, t, mode))
    return dataclasses.replace(t, recv=recv)


def _assert_done(w: World, t: Transfer) -> None:
    pump(w, t)
    assert (t.send.state, t.recv.state) == (S.DONE, S.DONE)
    assert t.recv.token0 == t.token0
    final = settle(w, t)[t.rid].outputs[0]
    assert final.finish_reason == "length" and len(final.token_ids) == 16


@pytest.mark.parametrize("mode", MODES)
def test_a_receiver_held_for_three_leases_completes_when_the_kv_arrives(w, mode):
    t = open_transfer(w, PROMPTS[1], mode)
    hold_for(w, 3, w.pre_tx, DEC, t.recv, t.send.transfer_id)
    assert t.recv.state is S.WAITING_FOR_BLOCKS  # the prompt was queued: nothing to time
    _assert_done(w, late_send(w, t, mode))


@pytest.mark.parametrize("mode", MODES)
def test_a_sender_held_by_a_reservation_waiting_for_room_sends_when_it_comes(w, mode):
    t = open_transfer(w, PROMPTS[1], mode)
    hold_for(w, 3, w.dec_tx, PRE, t.send, t.send.transfer_id)
    assert t.send.state is S.WAITING_FOR_BLOCKS  # the KV is held for the reservation
    _assert_done(w, late_recv(w, t, mode))


def _fail_at_lease(w: World, t: Transfer) -> float:
    """Poll the receiver until it fails; when it did. The sender is then stopped (it never
    polled) so that the blocks settle."""
    while not t.recv.poll().is_terminal:
        w.clock.now += STEP
    failed_at = w.clock.now
    assert t.recv.reason == "the lease expired"
    t.send.abort("stopped")
    settle(w, t)
    return failed_at


def test_a_receiver_whose_sender_goes_silent_fails_one_lease_after_the_last_hold(w):
    t = open_transfer(w, PROMPTS[1], Mode.PUSH)
    opened = w.clock.now
    last = hold_for(w, 2, w.pre_tx, DEC, t.recv, t.send.transfer_id)
    assert t.recv.state is S.WAITING_FOR_BLOCKS
    failed_at = _fail_at_lease(w, t)
    assert last + LEASE <= failed_at <= last + LEASE + 2 * STEP  # taken on the next poll
    assert failed_at - opened > 2 * LEASE


def test_a_hold_from_another_peer_does_not_renew_the_lease(w):
    t = open_transfer(w, PROMPTS[1], Mode.PUSH)
    opened = w.clock.now
    stranger = w.fabric.endpoint(PeerId(0x3333, "10.0.0.3", 7300))
    hold_for(w, 2, stranger, DEC, t.recv, t.send.transfer_id)
    assert t.recv.state is S.FAILED
    assert _fail_at_lease(w, t) - opened <= LEASE + STEP
