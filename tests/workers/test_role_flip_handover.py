"""The hand-over policy's part in a flip to prefill (`HandOver.hand_back`), on real engines and a
hub that records its calls: a decode leg whose KV has not come is given up, the prefill side
told why, its blocks freed (at once without a session, once the session says so with one), and
the prefill side, told so, ends its own leg handed back, with no error and no block held."""

from __future__ import annotations

from pdserve.workers.handover import HANDED_BACK, LegEnded, LegHandedBack
from pdserve.workers.transfer_hub import PeerClosed, RecvDone, RecvFailed
from tests.workers.test_handover import DEC, PRE, TID, TID_B, Side, transferring


def test_a_reservation_with_a_session_is_given_up_and_freed_once_the_writer_is_quiet(
        dec: Side) -> None:
    transferring(dec)
    assert dec.handover.hand_back("r") is True  # the loop ends the leg now
    assert dec.hub.calls[-1] == ("abort", TID, HANDED_BACK)
    assert dec.used() == 10  # until no writer can touch the blocks
    aborted = RecvFailed(TID, f"aborted by the caller: {HANDED_BACK}", sender_finished=False,
                         blocks_free=True)
    assert dec.handover.advance([aborted]) == [LegEnded("r", "cancelled",
                                                        prefill_finished=False)]
    assert dec.used() == 0 and not dec.engine.requests and not dec.engine.moves_kv()
    assert dec.metrics.recomputes.value() == 0


def test_a_reservation_without_a_session_is_freed_at_once_and_the_peer_told(dec: Side) -> None:
    transferring(dec)
    dec.take_decode("b", TID_B)  # no room: no session yet
    assert dec.handover.hand_back("b") is True
    assert dec.hub.calls[-1] == ("close", TID_B, PRE, HANDED_BACK)
    assert "b" not in dec.engine.requests and dec.used() == 10  # "r" still has its 10


def test_kv_that_came_meanwhile_is_dropped(dec: Side) -> None:
    transferring(dec)
    dec.handover.hand_back("r")
    done = RecvDone(TID, token0=7, token0_logprob=None, seconds=0.1, nbytes=1000)
    dec.handover.advance([done])
    assert dec.used() == 0 and not dec.engine.requests


def test_only_a_decode_leg_still_waiting_for_its_kv_is_handed_back(dec: Side,
                                                                   pre: Side) -> None:
    transferring(dec)
    done = RecvDone(TID, token0=7, token0_logprob=None, seconds=0.1, nbytes=1000)
    dec.handover.advance([done])  # decoding now: a running stream, not a reservation
    assert dec.handover.hand_back("r") is False and dec.engine.requests
    assert dec.handover.hand_back("unknown") is False
    pre.take_prefill("p")
    calls = list(pre.hub.calls)
    assert pre.handover.hand_back("p") is False  # a prefill leg: nothing to hand back
    assert pre.hub.calls == calls and "p" in pre.engine.requests


def test_a_prefill_told_of_the_hand_back_ends_its_leg_handed_back(pre: Side) -> None:
    pre.take_prefill("p")  # queued behind others: not computed yet
    told = PeerClosed(TID, f"aborted by the caller: {HANDED_BACK}", finished=False)
    assert pre.handover.advance([told]) == [LegHandedBack("p")]
    assert pre.used() == 0 and not pre.engine.requests
    pre.take_prefill("q", tid=TID_B, decode=DEC)  # any other reason stays an error
    other = PeerClosed(TID_B, "the client went away", finished=False)
    assert pre.handover.advance([other]) == [
        LegEnded("q", "the decode side closed the transfer: the client went away")]
