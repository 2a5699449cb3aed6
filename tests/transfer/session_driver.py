"""Drive a prefill engine and a decode engine through real transports with sessions, end to end.

Shared by every transport's test file, so each proves the same thing: the session layer runs
over it unchanged.
"""

from __future__ import annotations

import time

from pdserve.engine.engine import Engine
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.receiver import RecvSession
from pdserve.transfer.sender import SendSession
from pdserve.transfer.sessions import Inbox, Mode
from pdserve.transfer.state import TransferState
from pdserve.transfer.transport import Transport
from tests.conftest import hf_greedy
from tests.transfer.test_sessions import GREEDY, PROMPTS, _drain

LEASE = 10.0


def _open(pre: Engine, dec: Engine, pre_in: Inbox, dec_in: Inbox, prompt, mode: Mode, tid: int):
    rid = f"r{tid}"
    pre.add_request(prompt, GREEDY, request_id=rid)
    out = next(o for o in _drain(pre) if o.request_id == rid)
    dec.add_remote_request(out.prompt_token_ids, GREEDY, request_id=rid)
    dst = dec.reserved_blocks(rid)
    common = {"transfer_id": tid, "layout": KVLayout.of_cache(pre.kv_cache, "tiny-llama"),
              "mode": mode, "lease_s": LEASE, "clock": time.monotonic}
    recv = RecvSession(dec_in, peer=pre_in.transport.local, cache=dec.kv_cache, dst_blocks=dst,
                       dst_generations=[dec.block_manager.generation(b) for b in dst],
                       generation=dec.block_manager.generation, **common)
    send = SendSession(pre_in, peer=dec_in.transport.local, cache=pre.kv_cache,
                       src_blocks=out.kv_block_ids, token0=out.outputs[0].token_ids[0], **common)
    return rid, send, recv


def _open_streamed(pre: Engine, dec: Engine, pre_in: Inbox, dec_in: Inbox, prompt, tid: int):
    """Layer-wise push: the decode side reserves first; the send session opens inside the
    prefill step at layer 0 and writes each layer as the engine reports it computed."""
    rid = f"r{tid}"
    dec.add_remote_request(prompt, GREEDY, request_id=rid)
    dst = dec.reserved_blocks(rid)
    common = {"transfer_id": tid, "layout": KVLayout.of_cache(pre.kv_cache, "tiny-llama"),
              "mode": Mode.PUSH, "lease_s": LEASE, "clock": time.monotonic}
    recv = RecvSession(dec_in, peer=pre_in.transport.local, cache=dec.kv_cache, dst_blocks=dst,
                       dst_generations=[dec.block_manager.generation(b) for b in dst],
                       generation=dec.block_manager.generation, **common)
    recv.poll()  # sends the reservation
    sessions: dict[str, SendSession] = {}

    def on_layer(layer: int, batch) -> None:
        req = next(r for r in batch.requests if r.request_id == rid)
        if rid not in sessions:
            sessions[rid] = SendSession(pre_in, peer=dec_in.transport.local, cache=pre.kv_cache,
                                        src_blocks=req.block_ids, token0=None, **common)
        deadline = time.monotonic() + LEASE
        while sessions[rid].state is TransferState.WAITING_FOR_BLOCKS:
            assert time.monotonic() < deadline, "no reservation"
            sessions[rid].poll()
        sessions[rid].layers_ready(layer + 1)

    pre.on_layer = on_layer
    pre.add_request(prompt, GREEDY, request_id=rid)
    out = next(o for o in _drain(pre) if o.request_id == rid)
    pre.on_layer = None
    send = sessions[rid]
    assert send.src_blocks == tuple(out.kv_block_ids)
    assert send.writes_issued == pre.kv_cache.num_layers  # one move per layer, during compute
    send.prefill_done(out.outputs[0].token_ids[0])
    return rid, send, recv


def _until_terminal(send: SendSession, recv: RecvSession) -> None:
    deadline = time.monotonic() + LEASE
    while not (send.state.is_terminal and recv.state.is_terminal):
        assert time.monotonic() < deadline, "sessions did not end within the lease"
        send.poll()
        recv.poll()
        time.sleep(0.002)


def check_sessions_end_to_end(pre: Engine, dec: Engine, pre_tx: Transport, dec_tx: Transport,
                              mode: Mode, first_tid: int, model_path,
                              streamed: bool = False) -> None:
    """Every prompt of PROMPTS: both sessions DONE, decode output equal to transformers', and
    both pools back to their starting free counts. `streamed`: layer-wise push."""
    free = (pre.block_manager.num_free_blocks, dec.block_manager.num_free_blocks)
    pre_in, dec_in = Inbox(pre_tx), Inbox(dec_tx)
    opened = [_open_streamed(pre, dec, pre_in, dec_in, prompt, first_tid + i) if streamed
              else _open(pre, dec, pre_in, dec_in, prompt, mode, first_tid + i)
              for i, prompt in enumerate(PROMPTS)]
    finals = {}
    for rid, send, recv in opened:
        _until_terminal(send, recv)
        assert (send.state, recv.state) == (TransferState.DONE, TransferState.DONE)
        dec.kv_ready(rid, recv.token0)
        if rid in pre.requests:
            pre.release(rid)
        finals |= {o.request_id: o for o in _drain(dec) if o.finished}
    for (rid, _, _), prompt in zip(opened, PROMPTS, strict=True):
        assert finals[rid].outputs[0].token_ids == hf_greedy(model_path, prompt, 16)
    assert (pre.block_manager.num_free_blocks, dec.block_manager.num_free_blocks) == free
