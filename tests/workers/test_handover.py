"""HandOver, the worker's KV hand-over policy, on real engines and a hub that records its calls:
for each hub event and each leg action, the exact engine effect (blocks held, freed, released,
a recompute under a new id), the exact hub calls, and the outcome the engine loop applies."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import EngineLoad
from pdserve.legs.protocol import LegKind, LegRequest
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.peer import PeerId
from pdserve.transfer.tcp import TcpTransport
from pdserve.workers.handover import HandOver, LegDropped, LegEnded, LegRecomputing
from pdserve.workers.transfer_hub import (
    PeerClosed,
    PeerDead,
    RecvBlocksFree,
    RecvDone,
    RecvFailed,
    SendEnded,
    TransferHub,
)
from pdserve.workers.worker_metrics import WorkerMetrics
from tests.transfer.test_tcp import accepted, endpoint, stop_listening, wait_for

PRE = PeerId(0x1111, "10.0.0.1", 7100)
DEC = PeerId(0x2222, "10.0.0.2", 7200)
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
PROMPT = tuple(range(10, 160))  # 150 tokens: 10 of the decode pool's 16 blocks
TID, TID_B = 0xA1, 0xB2


class RecordingHub:
    """The hub calls HandOver makes, in order; `open_send` answers `send_opens`."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.send_opens = True
        self.active = 0
        self.dead: dict[PeerId, str] = {}  # peers `expect` reports dead, and why

    def expect(self, transfer_id: int, peer: PeerId) -> str | None:
        self.calls.append(("expect", transfer_id, peer))
        return self.dead.get(peer)

    def open_recv(self, transfer_id: int, peer: PeerId, dst_blocks: Sequence[int]) -> None:
        self.calls.append(("open_recv", transfer_id, peer, list(dst_blocks)))

    def open_send(self, transfer_id: int, peer: PeerId, src_blocks: Sequence[int], token0: int,
                  logprob: float | None) -> bool:
        self.calls.append(("open_send", transfer_id, peer, list(src_blocks), token0, logprob))
        return self.send_opens

    def abort(self, transfer_id: int, reason: str) -> None:
        self.calls.append(("abort", transfer_id, reason))

    def close(self, transfer_id: int, peer: PeerId | None, reason: str) -> None:
        self.calls.append(("close", transfer_id, peer, reason))

    def close_finished(self, transfer_id: int, peer: PeerId) -> None:
        self.calls.append(("close_finished", transfer_id, peer))


class Side:
    """One worker's engine, recording hub, metrics and hand-over."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self.hub, self.metrics = engine, RecordingHub(), WorkerMetrics("test")
        self.handover = HandOver(engine, self.hub, self.metrics)

    def take_decode(self, request_id: str, tid: int) -> None:
        """What the engine loop does with a DECODE leg."""
        self.engine.add_remote_request(list(PROMPT), PARAMS, request_id=request_id)
        self.handover.expect(LegRequest(request_id, PROMPT, PARAMS, LegKind.DECODE, tid, PRE))

    def take_prefill(self, request_id: str, params: SamplingParams = PARAMS, tid: int = TID,
                     decode: PeerId = DEC) -> None:
        self.engine.add_request(list(PROMPT), params, request_id=request_id, hand_over=True)
        self.handover.expect(LegRequest(request_id, PROMPT, params, LegKind.PREFILL, tid,
                                        decode))

    def opened(self) -> list[tuple]:
        return [c for c in self.hub.calls if c[0] == "open_recv"]

    def used(self) -> int:
        return self.engine.load().kv_blocks_used


def transferring(side: Side) -> list[int]:
    """Decode leg "r" (transfer TID) with a session open on its reserved blocks."""
    side.take_decode("r", TID)
    assert side.handover.advance([]) == []
    [(_, tid, peer, blocks)] = side.opened()
    assert (tid, peer, len(blocks)) == (TID, PRE, 10)
    return blocks


def test_verified_kv_starts_decoding_and_a_reservation_without_room_waits(dec: Side) -> None:
    transferring(dec)
    dec.take_decode("b", TID_B)  # 10 more blocks needed, 6 free: no session yet
    done = RecvDone(TID, token0=7, token0_logprob=None, seconds=0.1, nbytes=1000)
    assert dec.handover.advance([done]) == []
    assert dec.engine.load() == EngineLoad(running=1, waiting=0, waiting_for_kv=1,
                                           kv_blocks_used=10, kv_blocks_total=16)
    assert len(dec.opened()) == 1


def test_a_failed_transfer_whose_writer_is_not_quiet_holds_its_blocks_until_it_is(
        dec: Side) -> None:
    blocks = transferring(dec)
    dec.take_decode("b", TID_B)
    failed = RecvFailed(TID, "the lease expired", sender_finished=False, blocks_free=False)
    assert dec.handover.advance([failed]) == [LegRecomputing("r", "r/recompute")]
    assert dec.used() == 10  # a stalled writer may still land bytes there
    assert dec.engine.reserved_blocks("r") == blocks
    dec.handover.advance([])
    assert len(dec.opened()) == 1  # the held blocks go to no other reservation
    assert dec.handover.advance([RecvBlocksFree(TID)]) == []
    [_, (_, tid, _, b_blocks)] = dec.opened()  # freed, then reserved for "b" at once
    assert tid == TID_B and dec.used() == len(b_blocks) == 10
    assert "r" not in dec.engine.requests and "r/recompute" in dec.engine.requests


def test_a_failed_transfer_with_quiet_blocks_frees_them_and_recomputes_under_a_new_id(
        dec: Side) -> None:
    transferring(dec)
    failed = RecvFailed(TID, "crc mismatch", sender_finished=False, blocks_free=True)
    assert dec.handover.advance([failed]) == [LegRecomputing("r", "r/recompute")]
    assert dec.used() == 0
    assert dec.engine.load().waiting == 1 and "r/recompute" in dec.engine.requests
    assert dec.metrics.recomputes.value() == 1


def test_a_prefill_that_ended_at_token0_ends_the_decode_leg_without_a_recompute(
        dec: Side) -> None:
    dec.take_decode("r", TID)  # reserved, no session yet: the prefill's ABORT came first
    closed = PeerClosed(TID, "finished at token 0", finished=True)
    assert dec.handover.advance([closed]) == [
        LegEnded("r", "the prefill side ended the request at token 0", prefill_finished=True)]
    assert dec.used() == 0 and not dec.engine.requests and not dec.opened()
    assert dec.metrics.recomputes.value() == 0


def test_a_cancel_while_transferring_aborts_the_session_and_ends_the_leg_after_it(
        dec: Side) -> None:
    transferring(dec)
    assert dec.handover.cancel("r") is True  # the loop keeps the leg and its blocks
    assert dec.hub.calls[-1] == ("abort", TID, "the client went away")
    assert dec.used() == 10
    aborted = RecvFailed(TID, "aborted", sender_finished=False, blocks_free=True)
    assert dec.handover.advance([aborted]) == [
        LegEnded("r", "cancelled", prefill_finished=False)]
    assert dec.used() == 0 and not dec.engine.requests


def test_kv_that_lands_for_a_cancelled_leg_is_dropped_and_its_blocks_freed(dec: Side) -> None:
    transferring(dec)
    dec.handover.cancel("r")
    done = RecvDone(TID, token0=7, token0_logprob=None, seconds=0.1, nbytes=1000)
    assert dec.handover.advance([done]) == [LegDropped("r")]
    assert dec.used() == 0 and not dec.engine.requests


def test_a_cancel_before_the_session_closes_the_transfer_and_tells_the_peer(dec: Side) -> None:
    transferring(dec)
    dec.take_decode("b", TID_B)
    assert dec.handover.cancel("b") is False  # the loop aborts the engine request
    assert dec.hub.calls[-1] == ("close", TID_B, PRE, "the request was cancelled")
    dec.engine.abort("b")
    dec.handover.advance([RecvFailed(TID, "x", sender_finished=False, blocks_free=True)])
    assert len(dec.opened()) == 1  # "b" is gone: no session for it


def test_a_prefill_holds_its_blocks_until_the_send_ends(pre: Side) -> None:
    pre.take_prefill("p")
    [out] = pre.engine.step()
    pre.handover.send_kv(out)
    token0 = out.outputs[0].token_ids[0]
    assert pre.hub.calls[-1] == ("open_send", TID, DEC, out.kv_block_ids, token0, None)
    assert pre.used() == len(out.kv_block_ids) == 10
    ended = SendEnded(TID, ok=True, reason=None, seconds=0.2, nbytes=1000)
    assert pre.handover.advance([ended]) == []
    assert pre.used() == 0 and not pre.engine.requests


def test_a_prefill_whose_decode_side_gave_up_releases_its_blocks_at_token0(pre: Side) -> None:
    pre.hub.send_opens = False
    pre.take_prefill("p")
    [out] = pre.engine.step()
    pre.handover.send_kv(out)
    assert pre.used() == 0 and not pre.engine.requests


def test_token0_that_ends_a_prefill_tells_the_decode_side(pre: Side) -> None:
    pre.take_prefill("p", SamplingParams(max_tokens=1, temperature=0))
    [out] = pre.engine.step()
    assert out.finished and out.kv_block_ids is None
    pre.handover.finished("p")
    assert pre.hub.calls[-1] == ("close_finished", TID, DEC)
    assert pre.used() == 0


def test_a_decode_side_that_closes_ends_the_prefill_leg_and_frees_its_blocks(pre: Side) -> None:
    pre.take_prefill("p")
    closed = PeerClosed(TID, "the client went away", finished=False)
    assert pre.handover.advance([closed]) == [
        LegEnded("p", "the decode side closed the transfer: the client went away")]
    assert not pre.engine.requests


# -- peers that died or restarted ------------------------------------------------------------------

RESTARTED = "the peer PeerId(...) died (restarted: instance 0000000000002223 now answers at ...)"


def test_a_prefill_leg_naming_a_decode_instance_known_dead_ends_before_any_compute(
        pre: Side) -> None:
    pre.hub.dead[DEC] = RESTARTED
    pre.take_prefill("p")
    assert pre.handover.advance([]) == [
        LegEnded("p", f"no KV can move to the decode worker: {RESTARTED}")]
    assert not pre.engine.requests and not pre.engine.has_compute_work()


def test_a_decode_leg_naming_a_prefill_instance_known_dead_recomputes_at_once(dec: Side) -> None:
    dec.hub.dead[PRE] = RESTARTED
    dec.take_decode("r", TID)
    assert dec.handover.advance([]) == [LegRecomputing("r", "r/recompute")]
    assert "r" not in dec.engine.requests and not dec.opened()
    assert dec.metrics.recomputes.value() == 1


@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_a_peer_that_dies_before_the_session_opens_ends_or_recomputes_the_leg(
        pre: Side, dec: Side, kind: str) -> None:
    side = pre if kind == "prefill" else dec
    if kind == "prefill":
        pre.take_prefill("p")
    else:
        dec.take_decode("r", TID)
        dec.take_decode("b", TID_B)  # no room: its reservation waits, no session
    dead = PeerDead(TID_B if kind == "decode" else TID, RESTARTED)
    want = LegEnded("p", f"no KV can move to the decode worker: {RESTARTED}") \
        if kind == "prefill" else LegRecomputing("b", "b/recompute")
    assert side.handover.advance([dead]) == [want]
    assert ("p" if kind == "prefill" else "b") not in side.engine.requests


class HubSide:
    """A prefill worker's engine and hand-over over a real transfer hub and TCP endpoint; the
    lease is far beyond every wait, so only peer death can free what is held."""

    LEASE_S = 60.0

    def __init__(self, engine: Engine, tx: TcpTransport) -> None:
        self.engine = engine
        self.hub = TransferHub(tx, engine.kv_cache, KVLayout.of_cache(engine.kv_cache, "tiny"),
                               engine.block_manager.generation, self.LEASE_S)
        self.handover = HandOver(engine, self.hub, WorkerMetrics("prefill"))

    def prefill(self, request_id: str, tid: int, decode: PeerId) -> None:
        """A PREFILL leg up to token 0: its blocks are held for the send to `decode`."""
        self.engine.add_request(list(PROMPT), PARAMS, request_id=request_id, hand_over=True)
        self.handover.expect(LegRequest(request_id, PROMPT, PARAMS, LegKind.PREFILL, tid,
                                        decode))
        [out] = self.engine.step()
        self.handover.send_kv(out)

    def advance(self) -> list:
        return self.handover.advance(self.hub.poll())

    def used(self) -> int:
        return self.engine.load().kv_blocks_used


def test_a_decode_peer_that_dies_during_a_held_prefill_frees_the_blocks_at_once(
        pre: Side) -> None:
    """The decode worker dies before it reserved (it never dialed this worker): the prefill's
    blocks come back at once, not at the lease."""
    with endpoint(pre.engine.kv_cache) as tx, endpoint() as decode:
        side = HubSide(pre.engine, tx)
        side.prefill("p", TID, decode.local)
        assert side.used() == 10
        decode.close()
        wait_for(lambda: side.advance() == [] and side.used() == 0, timeout=10.0)
        assert not pre.engine.requests


def test_a_restarted_decode_named_by_the_next_leg_frees_the_old_instance_blocks_at_once(
        pre: Side) -> None:
    """The decode worker restarts at its address while the old instance's connections stay up
    (nothing closed them yet): the next PREFILL leg names the new instance, this worker meets
    it at once, and the blocks held for the old instance come back; a leg that still names the
    old instance ends before its prompt computes."""
    with endpoint(pre.engine.kv_cache) as tx, endpoint() as old:
        side = HubSide(pre.engine, tx)
        old.send(tx.local, b"hello")  # the old instance met this worker
        tx.send(old.local, b"hello")
        wait_for(lambda: old.receive())
        side.prefill("p", TID, old.local)
        wait_for(lambda: accepted(old) == 2)  # both lanes: a later dial would be refused
        stop_listening(old)
        with endpoint(port=old.local.port, instance_id=old.local.instance_id + 1) as new:
            pre.engine.add_request(list(PROMPT), PARAMS, request_id="q", hand_over=True)
            side.handover.expect(LegRequest("q", PROMPT, PARAMS, LegKind.PREFILL, TID_B,
                                            new.local))
            wait_for(lambda: side.advance() == [] and "p" not in pre.engine.requests,
                     timeout=10.0)
            assert "restarted" in tx.why_dead(old.local)
            pre.engine.add_request(list(PROMPT), PARAMS, request_id="r", hand_over=True)
            side.handover.expect(LegRequest("r", PROMPT, PARAMS, LegKind.PREFILL, 0xC3,
                                            old.local))
            [ended] = side.handover.advance([])
            assert ended.engine_id == "r" and "restarted" in ended.message
            assert set(pre.engine.requests) == {"q"}
            pre.engine.abort("q")
            assert side.used() == 0
