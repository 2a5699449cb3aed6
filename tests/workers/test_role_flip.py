"""A worker's live role change on real engine loops (tiny model) with real TCP transfer
endpoints on loopback: the role changes once nothing moves KV in or out; running streams go on
in a decode or collocated role, a router's stream on a worker becoming a prefill worker is
handed back with its KV left in the prefix cache (a client's own request holds the flip until
it ends); legs that arrive meanwhile are refused with a clear message, a drain that outlasts
its timeout leaves the role as it was, and every block is back in the pool after each
change."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from collections.abc import Awaitable, Callable

import pytest

from pdserve.api.errors import ApiError
from pdserve.common.engine_options import Role
from pdserve.common.sampling_params import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.legs.protocol import MOVED, LegKind, LegRequest, TokenEvent
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.tcp import TcpTransport
from pdserve.workers.engine_loop import Accepted, EngineLoop, QueueSink
from pdserve.workers.hub_pump import HubPump
from pdserve.workers.parked import ParkedLegs
from pdserve.workers.role_flip import FLIPPING, FlipDone
from pdserve.workers.transfer_hub import TransferHub
from pdserve.workers.worker_metrics import WorkerMetrics
from tests.conftest import KV_BLOCKS

SECRET = os.urandom(32)
PROMPT = tuple(range(3, 40))
SHORT = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
LONG = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
WAIT_S = 30.0


class Worker:
    """An engine loop with a KV transfer endpoint (as a worker with the cluster secret has)."""

    def __init__(self, path, role: Role, instance_id: int, moves_kv: bool = True) -> None:
        self.engine = Engine(EngineConfig(model=str(path), dtype="float32", max_model_len=256,
                                          role=role, num_kv_blocks=KV_BLOCKS))
        self.metrics = WorkerMetrics(role.value)
        self.transport = self.pump = None
        if moves_kv:
            self.transport = TcpTransport(secret=SECRET, instance_id=instance_id)
            self.transport.register(self.engine.kv_cache)
            layout = KVLayout.of_cache(self.engine.kv_cache, "tiny")
            self.pump = HubPump(TransferHub(self.transport, self.engine.kv_cache, layout,
                                            self.engine.block_generation, lease_s=10.0))
            self.pump.start()
        self.loop = EngineLoop(self.engine, self.pump, self.metrics)

    def close(self) -> None:
        self.loop.stop()
        if self.pump is not None:
            self.pump.stop()
            self.transport.close()

    @property
    def blocks_used(self) -> int:
        return self.engine.block_manager.num_used_blocks


@pytest.fixture
def make_worker(tiny_model) -> Callable[..., Worker]:
    made: list[Worker] = []

    def make(role: Role = Role.COLLOCATED, moves_kv: bool = True) -> Worker:
        made.append(Worker(tiny_model(), role, 0x7000 + len(made), moves_kv))
        return made[-1]

    yield make
    for w in made:
        w.close()


def _run(scenario: Callable[[], Awaitable[None]], *workers: Worker) -> None:
    async def main() -> None:
        for w in workers:
            w.loop.start(asyncio.get_running_loop())
        await scenario()

    asyncio.run(main())


async def _leg(sink: asyncio.Queue) -> list:
    """Every item of a leg, up to its final event."""
    items = []
    while True:
        items.append(await asyncio.wait_for(sink.get(), WAIT_S))
        if isinstance(items[-1], TokenEvent) and items[-1].final:
            return items


def _tokens(items: list) -> list[int]:
    assert isinstance(items[0], Accepted), items[0]
    assert items[-1].error is None, items[-1].error
    return [t for e in items[1:] for t in e.token_ids]


async def _flip(w: Worker, role: Role, timeout_s: float = WAIT_S) -> FlipDone | ApiError:
    return await asyncio.wait_for(w.loop.change_role(role, timeout_s), WAIT_S)


async def _until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)


def _greedy(w: Worker, params: SamplingParams) -> list[int]:
    """The tokens the engine computes for PROMPT when nothing changes role."""
    rid = w.engine.add_request(list(PROMPT), params, request_id="reference", hand_over=False)
    tokens: list[int] = []
    while w.engine.has_unfinished_requests():
        for out in w.engine.step():
            if out.request_id == rid:
                tokens = out.outputs[0].token_ids
    return list(tokens)


def test_a_worker_with_no_work_takes_every_role_in_turn(make_worker) -> None:
    w = make_worker()
    turns = [Role.PREFILL, Role.DECODE, Role.COLLOCATED]

    async def scenario() -> None:
        old = Role.COLLOCATED
        for role in turns:
            done = await _flip(w, role)
            assert isinstance(done, FlipDone), done
            assert (done.from_role, done.to_role) == (old, role) and done.seconds > 0
            assert done.body() == {"from": old.value, "to": role.value, "seconds": done.seconds}
            assert w.engine.role is role and w.loop.flip.state == "serving"
            items = await _leg(w.loop.submit(LegRequest(f"after-{role}", PROMPT, SHORT)))
            assert len(_tokens(items)) == SHORT.max_tokens  # serves in the new role
            assert w.blocks_used == 0
            old = role

    _run(scenario, w)
    for old, new in zip([Role.COLLOCATED, *turns], turns, strict=False):
        assert w.metrics.role_flips.value(**{"from": old.value, "to": new.value}) == 1
    assert w.metrics.role.value(role="collocated") == 1
    assert w.metrics.role.value(role="decode") == 0


def test_the_new_role_is_the_one_new_legs_get(make_worker) -> None:
    w = make_worker()
    peer = w.transport.local

    async def scenario() -> None:
        assert isinstance(await _flip(w, Role.PREFILL), FlipDone)
        decode = LegRequest("d", PROMPT, SHORT, LegKind.DECODE, 0xD1, peer)
        refused = await _leg(w.loop.submit(decode))
        assert refused[0].error == "add_remote_request() needs an engine in the decode role"

    _run(scenario, w)
    assert w.blocks_used == 0


def test_a_running_stream_goes_on_in_the_decode_role_without_holding_the_flip(make_worker
                                                                            ) -> None:
    w = make_worker()
    expected = _greedy(w, LONG)

    async def scenario() -> None:
        sink = w.loop.submit(LegRequest("r", PROMPT, LONG))
        first = [await sink.get(), await sink.get()]  # accepted, and a first token: it runs
        done = await _flip(w, Role.DECODE)
        assert isinstance(done, FlipDone) and done.to_role is Role.DECODE
        assert w.engine.role is Role.DECODE and w.engine.has_unfinished_requests()
        items = first + await _leg(sink)  # the stream went on across the change
        assert _tokens(items) == expected
        assert w.blocks_used == 0

    _run(scenario, w)
    assert w.engine.role is Role.DECODE


def _movable(w: Worker, req: LegRequest) -> asyncio.Queue:
    """A router's leg (the leg channel submits those)."""
    sink = QueueSink()
    w.loop.submit_to(req, sink, movable=True)
    return sink


def test_a_routers_stream_is_handed_back_and_its_parked_kv_feeds_the_continuation(make_worker
                                                                                  ) -> None:
    """Becoming a prefill worker, the worker hands the router's running stream back after the
    tokens it sent, parking its KV; the continuation's prefill leg there (resuming that leg)
    sends the KV as it is, token 0 being the last token the stream sent, and its decode
    elsewhere goes on: together exactly the undisturbed tokens."""
    w, dec = make_worker(Role.DECODE), make_worker(Role.DECODE)
    expected = _greedy(w, LONG)
    tid = 0xBAC

    async def scenario() -> None:
        sink = _movable(w, LegRequest("r", PROMPT, LONG))
        items = [await sink.get()]
        while len(_tokens(items + [TokenEvent(0, [], 0, "")])) < 40:  # 40 tokens in
            items.append(await asyncio.wait_for(sink.get(), WAIT_S))
        done = await _flip(w, Role.PREFILL)
        assert isinstance(done, FlipDone) and w.engine.role is Role.PREFILL
        items += await _leg(sink)
        moved = items[-1]
        assert moved.extra == {MOVED: True} and moved.error is None and not moved.token_ids
        sent = _tokens(items)
        assert len(sent) >= 40 and sent == expected[:len(sent)] and moved.index == len(sent)
        assert w.blocks_used > 0 and len(w.loop.parked) == 1  # parked for the continuation
        assert w.metrics.handed_back.value() == 1
        k = len(sent) - 1  # the KV of every token but the last one sent is computed
        rest = dataclasses.replace(LONG, max_tokens=LONG.max_tokens - k)
        prefill = LegRequest("r.2", (*PROMPT, *sent[:k]), rest, LegKind.PREFILL, tid,
                             dec.transport.local, output_offset=k, resume="r")
        steps = len(w.loop.trace.newest_first(10_000))
        token0 = await _leg(w.loop.submit(prefill))
        assert _tokens(token0) == [sent[k]]
        assert len(w.loop.trace.newest_first(10_000)) == steps  # nothing computed for it
        decode = dataclasses.replace(prefill, kind=LegKind.DECODE, peer=w.transport.local,
                                     resume=None)
        assert sent[:k] + _tokens(await _leg(dec.loop.submit(decode))) == expected
        await _until(lambda: w.blocks_used == 0)  # released once the KV was sent
        assert not w.loop.parked

    _run(scenario, w, dec)
    assert dec.blocks_used == 0


def test_parked_kv_nobody_claims_is_released_and_a_late_resume_computes(make_worker) -> None:
    w, dec = make_worker(Role.DECODE), make_worker(Role.DECODE)
    w.loop.parked = ParkedLegs(park_s=0.05)
    expected = _greedy(w, LONG)

    async def scenario() -> None:
        sink = _movable(w, LegRequest("r", PROMPT, LONG))
        first = [await sink.get(), await sink.get()]
        assert isinstance(await _flip(w, Role.COLLOCATED), FlipDone)  # a stream goes on
        assert isinstance(await _flip(w, Role.PREFILL), FlipDone)  # and is handed back
        sent = _tokens(first + await _leg(sink))
        await _until(lambda: w.blocks_used == 0)  # nobody came for it
        k = len(sent) - 1
        rest = dataclasses.replace(LONG, max_tokens=LONG.max_tokens - k)
        late = LegRequest("r.2", (*PROMPT, *sent[:k]), rest, LegKind.PREFILL, 0x1A7E,
                          dec.transport.local, output_offset=k, resume="r")
        steps = len(w.loop.trace.newest_first(10_000))
        assert _tokens(await _leg(w.loop.submit(late))) == [expected[k]]
        assert len(w.loop.trace.newest_first(10_000)) > steps  # computed (from its prefix cache)
        decode = dataclasses.replace(late, kind=LegKind.DECODE, peer=w.transport.local,
                                     resume=None)
        assert sent[:k] + _tokens(await _leg(dec.loop.submit(decode))) == expected
        await _until(lambda: w.blocks_used == 0)

    _run(scenario, w, dec)
    assert dec.blocks_used == 0


def test_a_clients_own_stream_holds_a_flip_to_prefill_until_it_ends(make_worker) -> None:
    w = make_worker()
    expected = _greedy(w, LONG)

    async def scenario() -> None:
        sink = w.loop.submit(LegRequest("r", PROMPT, LONG))  # no router to continue it
        first = [await sink.get(), await sink.get()]
        flip = asyncio.ensure_future(_flip(w, Role.PREFILL))
        await _until(lambda: w.loop.flip.state == "flipping")
        assert w.engine.role is Role.COLLOCATED
        done = await flip
        assert isinstance(done, FlipDone) and done.to_role is Role.PREFILL
        items = first + [sink.get_nowait() for _ in range(sink.qsize())]
        assert items[-1].final and _tokens(items) == expected  # it had ended, whole
        assert w.blocks_used == 0

    _run(scenario, w)


def test_a_leg_submitted_during_a_flip_is_refused_saying_why(make_worker) -> None:
    w = make_worker()

    async def scenario() -> None:
        sink = w.loop.submit(LegRequest("r", PROMPT, LONG))
        assert isinstance(await sink.get(), Accepted)
        flip = asyncio.ensure_future(_flip(w, Role.PREFILL))
        await _until(lambda: w.loop.flip.state == "flipping")
        refused = await _leg(w.loop.submit(LegRequest("late", PROMPT, SHORT)))
        assert len(refused) == 1 and refused[0].final
        assert refused[0].error == (f"{FLIPPING} (collocated -> prefill); send the leg to "
                                    f"another worker")
        items = await _leg(sink)  # the running leg ends as usual
        assert items[-1].error is None and items[-1].finish_reason == "length"
        assert isinstance(await flip, FlipDone)

    _run(scenario, w)
    assert w.blocks_used == 0 and w.engine.role is Role.PREFILL


def test_a_drain_past_its_timeout_keeps_the_role_and_takes_legs_again(make_worker,
                                                                       monkeypatch) -> None:
    w = make_worker()
    real_step = w.engine.step

    def slow_step():  # the running leg outlasts the drain's timeout whatever the machine
        time.sleep(0.005)
        return real_step()

    monkeypatch.setattr(w.engine, "step", slow_step)

    async def scenario() -> None:
        sink = w.loop.submit(LegRequest("r", PROMPT, LONG))
        assert isinstance(await sink.get(), Accepted)
        refusal = await _flip(w, Role.PREFILL, timeout_s=0.05)
        assert isinstance(refusal, ApiError), refusal
        assert (refusal.status, refusal.code) == (503, "drain_timeout")
        assert refusal.message == ("the worker did not drain within 0.05 s; it keeps the role "
                                   "collocated and takes legs again")
        assert w.engine.role is Role.COLLOCATED and w.loop.flip.state == "serving"
        later = await _leg(w.loop.submit(LegRequest("later", PROMPT, SHORT)))
        assert len(_tokens(later)) == SHORT.max_tokens
        items = await _leg(sink)
        assert items[-1].error is None and items[-1].finish_reason == "length"
        assert sum(len(e.token_ids) for e in items) == LONG.max_tokens

    _run(scenario, w)
    assert w.blocks_used == 0
    assert w.metrics.role_flip_timeouts.value() == 1
    assert w.metrics.role_flips.value(**{"from": "collocated", "to": "prefill"}) == 0


def test_the_same_role_a_second_flip_and_an_unreachable_role_are_conflicts(make_worker
                                                                          ) -> None:
    w = make_worker()
    bare = make_worker(moves_kv=False)

    async def scenario() -> None:
        same = await _flip(w, Role.COLLOCATED)
        assert isinstance(same, ApiError) and (same.status, same.code) == (409, "same_role")
        assert same.message == "this worker is collocated already"
        sink = w.loop.submit(LegRequest("r", PROMPT, LONG))
        assert isinstance(await sink.get(), Accepted)
        first = asyncio.ensure_future(_flip(w, Role.PREFILL))  # held by the client's stream
        await _until(lambda: w.loop.flip.state == "flipping")
        second = await _flip(w, Role.DECODE)
        assert isinstance(second, ApiError)
        assert (second.status, second.code) == (409, "flip_in_progress")
        assert second.message == "a role change to prefill is in progress"
        await _leg(sink)
        assert isinstance(await first, FlipDone) and w.engine.role is Role.PREFILL
        unreachable = await _flip(bare, Role.DECODE)
        assert isinstance(unreachable, ApiError)
        assert (unreachable.status, unreachable.code) == (409, "role_unavailable")
        assert bare.engine.role is Role.COLLOCATED

    _run(scenario, w, bare)
    assert w.blocks_used == 0


def test_a_prefill_worker_changes_role_once_its_held_prefill_was_sent(make_worker) -> None:
    """Token 0 leaves the prefill worker's blocks held for the decode worker; a flip waits for
    the transfer to end (the blocks released), and the decode leg gets every token."""
    pre, dec = make_worker(Role.PREFILL), make_worker(Role.DECODE)
    expected = _greedy(pre, SHORT)
    tid = 0xF11F

    async def scenario() -> None:
        prefill = LegRequest("p", PROMPT, SHORT, LegKind.PREFILL, tid, dec.transport.local)
        token0 = await _leg(pre.loop.submit(prefill))
        assert _tokens(token0) == expected[:1] and pre.blocks_used > 0  # held for the decode
        flip = asyncio.ensure_future(_flip(pre, Role.COLLOCATED))
        await asyncio.sleep(0.3)
        assert not flip.done() and pre.loop.flip.state == "flipping"
        assert pre.engine.role is Role.PREFILL
        decode = LegRequest("p", PROMPT, SHORT, LegKind.DECODE, tid, pre.transport.local)
        items = await _leg(dec.loop.submit(decode))
        assert _tokens(items) == expected
        done = await flip
        assert isinstance(done, FlipDone) and (done.from_role, done.to_role) == \
            (Role.PREFILL, Role.COLLOCATED)
        assert pre.blocks_used == 0

    _run(scenario, pre, dec)
    assert dec.blocks_used == 0 and pre.engine.role is Role.COLLOCATED


def test_the_engine_changes_role_only_while_no_request_moves_kv(tiny_model) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model()), dtype="float32", max_model_len=256,
                                 role=Role.PREFILL, num_kv_blocks=KV_BLOCKS))
    rid = engine.add_request(list(PROMPT), SHORT)  # the prefill role's default: hand over
    out = engine.step()[0]
    assert out.kv_block_ids  # token 0 sampled, blocks held
    with pytest.raises(ValueError, match=r"hand KV over or wait for it; its role changes only"):
        engine.set_role(Role.DECODE)
    assert engine.role is Role.PREFILL
    engine.release(rid)
    engine.set_role(Role.DECODE)
    assert engine.role is Role.DECODE and engine.config.role is Role.DECODE
    engine.add_remote_request(list(PROMPT), SHORT, request_id="remote")  # decode-only call
    assert engine.reserved_blocks("remote")
    with pytest.raises(ValueError, match="hand KV over or wait for it"):
        engine.set_role(Role.COLLOCATED)
    engine.abort("remote")
    engine.set_role(Role.COLLOCATED)
    engine.add_request(list(PROMPT), SHORT, request_id="whole")
    engine.step()
    engine.set_role(Role.PREFILL)  # a request that runs whole goes on in any role
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[-1].finished and outs[-1].kv_block_ids is None  # no hand-over for it
    assert engine.block_manager.num_used_blocks == 0


def test_a_parked_request_hands_over_only_a_prefix_whose_kv_it_computed(tiny_model) -> None:
    engine = Engine(EngineConfig(model=str(tiny_model()), dtype="float32", max_model_len=256,
                                 num_kv_blocks=KV_BLOCKS))
    rid = engine.add_request(list(PROMPT), SHORT)
    assert not engine.park(rid)  # waiting: nothing sampled yet
    for _ in range(5):
        engine.step()
    tokens = list(engine.requests[rid].token_ids)  # the prompt and 5 output tokens
    assert engine.park(rid) and not engine.park(rid)  # parked once
    assert not engine.has_unfinished_requests() and engine.moves_kv()
    for bad in (tokens, tokens[:len(PROMPT) - 1], [*tokens[:-2], 0]):
        with pytest.raises(ValueError, match="holds no computed KV for that prompt"):
            engine.hand_over_parked(rid, bad)
    engine.hand_over_parked(rid, tokens[:-1])
    out = engine.step()[0]
    assert out.request_id == rid and out.outputs[0].token_ids == [tokens[-1]]
    assert out.kv_block_ids == engine.requests[rid].block_ids[:3]  # 41 tokens, 16 per block
    engine.release(rid)
    assert engine.block_manager.num_used_blocks == 0 and not engine.moves_kv()


def test_a_reservation_waiting_for_a_busy_prefill_worker_is_handed_back_not_waited_for(
        make_worker) -> None:
    """Becoming a prefill worker, a decode worker hands back the router's reservations whose
    KV has not come rather than wait for their prefills: here the prefill worker is stuck in a
    step for another request, the prompt not even taken, and the flip is done all the same.
    The leg ends handed back before any token; the reservation's blocks are free; the prefill
    worker, once it goes on, ends its leg without an error and holds no block either."""
    pre, dec = make_worker(Role.PREFILL), make_worker(Role.DECODE)
    token0 = _greedy(pre, SHORT)[:1]
    entered, gate = threading.Event(), threading.Event()
    real_step = pre.engine.step

    def busy_step():  # the first step waits for the gate: the worker is busy
        entered.set()
        assert gate.wait(WAIT_S)
        return real_step()

    pre.engine.step = busy_step
    tid = 0xB05

    async def scenario() -> None:
        busy = pre.loop.submit(LegRequest("busy", PROMPT, SHORT))
        await _until(entered.is_set)
        prefill = pre.loop.submit(LegRequest("r", PROMPT, SHORT, LegKind.PREFILL, tid,
                                             dec.transport.local))
        decode = _movable(dec, LegRequest("r", PROMPT, SHORT, LegKind.DECODE, tid,
                                          pre.transport.local))
        await _until(lambda: dec.blocks_used > 0)  # reserved, the reservation sent
        done = await _flip(dec, Role.PREFILL)
        assert isinstance(done, FlipDone) and dec.engine.role is Role.PREFILL
        assert not gate.is_set() and pre.loop.num_legs == 1  # "r" not even taken there
        items = [decode.get_nowait() for _ in range(decode.qsize())]
        assert isinstance(items[0], Accepted) and len(items) == 2
        assert items[1].final and items[1].error is None and items[1].extra == {MOVED: True}
        assert (items[1].index, items[1].token_ids) == (0, [])
        assert dec.blocks_used == 0 and dec.metrics.handed_back.value() == 1
        gate.set()
        assert len(_tokens(await _leg(busy))) == SHORT.max_tokens
        ended = await _leg(prefill)
        assert ended[-1].error is None  # handed back too, or token 0 if it computed first
        assert ended[-1].extra == {MOVED: True} or _tokens(ended) == token0
        await _until(lambda: pre.blocks_used == 0)

    _run(scenario, pre, dec)
