"""`pdserve bench layerwise`: what layer-wise KV streaming saves on one long prompt.

This process is a prefill engine (the real model, bf16, prefix caching off, one compute thread
on one core, like a `pdserve up` prefill worker); a child process on another core is the decode
side: a KV pool of the model's shape behind the same transport, which reserves blocks for each
prompt and runs the receiving session (checksums and generations verified) until DONE. Per run,
with the decode's reservation already in:

- whole: the prompt is computed, then its KV is written in one move after token 0;
- layerwise: the engine's layer hook writes layer i while layer i+1 computes; after token 0
  only the last layer, the checksums and the notice remain.

Reported, medians over `repeats` runs of each mode (interleaved, after one warm-up each):
prefill seconds (step start to token 0), KV ready after token 0 (token 0 to the receiver's
DONE, both on CLOCK_MONOTONIC, which is system-wide on Linux), and prompt to KV ready. The
saving is whole minus layerwise of the last; it is bounded by the transfer time of all but the
last layer, which this machine's loopback makes small next to a CPU prefill.

With `device` a GPU, the engine and the decode side's pool are in its memory (two processes on
one GPU; nixl only, `transfer_bench.transports_for`), and each layer's hook first waits for
the GPU's queued kernels (`ModelRunner.run`).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from pdserve.bench.transfer_bench import TRANSPORTS, transports_for
from pdserve.common.engine_options import Role
from pdserve.common.model_config import ModelConfig
from pdserve.common.model_folder import resolve_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.kv_cache import KVCache
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.peer import PeerId
from pdserve.transfer.receiver import RecvSession
from pdserve.transfer.sender import SendSession
from pdserve.transfer.sessions import Inbox, Mode
from pdserve.transfer.state import TransferState

LAYOUT_NAME = "bench-layerwise"
MODES = ("whole", "layerwise")
POLL_S = 0.0005  # between session polls, as the worker's HubPump: never spin on the GIL


@dataclass(frozen=True)
class LayerwiseRow:
    transport: str
    mode: str
    prompt_tokens: int
    kv_bytes: int
    prefill_s: float
    ready_after_token0_ms: float
    prompt_to_ready_s: float


def _pin(core: int) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(0, {cores[core % len(cores)]})


def _decode_side(conn, transport: str, model: ModelConfig, num_blocks: int, block_size: int,
                 device: str) -> None:
    """Child: for each ("open", tid, peer, n) reserve n blocks, receive, report DONE's time."""
    _pin(1)
    torch.set_num_threads(1)
    pool = KVCache(model, num_blocks, block_size, torch.bfloat16, device)
    tx = TRANSPORTS[transport]()
    tx.register(pool)
    inbox = Inbox(tx)
    conn.send(tx.local.to_json())
    while (cmd := conn.recv()) is not None:
        _, tid, peer, n = cmd
        recv = RecvSession(inbox, transfer_id=tid, peer=PeerId.from_json(peer), cache=pool,
                           layout=KVLayout.of_cache(pool, LAYOUT_NAME), dst_blocks=list(range(n)),
                           dst_generations=[0] * n, generation=lambda b: 0)
        recv.poll()  # the reservation goes out
        conn.send("reserved")
        while not recv.state.is_terminal:
            recv.poll()
            time.sleep(POLL_S)
        conn.send((recv.state.name, time.monotonic(), recv.reason))
    tx.close()


class _Prefill:
    """The prefill side: the engine, its transport endpoint, and one run at a time."""

    def __init__(self, engine: Engine, transport: str, conn, peer: PeerId) -> None:
        self.engine, self.conn, self.peer = engine, conn, peer
        self.tx = TRANSPORTS[transport]()
        self.tx.register(engine.kv_cache)
        self.inbox = Inbox(self.tx)
        self.layout = KVLayout.of_cache(engine.kv_cache, LAYOUT_NAME)
        self.tids = iter(range(1, 1 << 40))

    def run(self, prompt: list[int], layerwise: bool) -> tuple[float, float, float]:
        """(step start, token 0, KV verified at the decode side), CLOCK_MONOTONIC."""
        tid, rid = next(self.tids), f"bench-{random.getrandbits(32)}"
        n = -(-len(prompt) // self.engine.kv_cache.block_size)
        self.conn.send(("open", tid, self.tx.local.to_json(), n))
        assert self.conn.recv() == "reserved"
        sessions: list[SendSession] = []
        self.engine.on_layer = self._hook(tid, rid, sessions) if layerwise else None
        params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        self.engine.add_request(prompt, params, request_id=rid)
        t0 = time.monotonic()
        out = next(o for o in self.engine.step() if o.request_id == rid)
        t_token0 = time.monotonic()
        self.engine.on_layer = None
        token0 = out.outputs[0].token_ids[0]
        if sessions:
            sessions[0].prefill_done(token0)
        else:
            sessions.append(self._session(tid, out.kv_block_ids, token0))
        while not sessions[0].state.is_terminal:
            sessions[0].poll()
            time.sleep(POLL_S)
        state, t_ready, reason = self.conn.recv()
        self.engine.release(rid)
        if state != "DONE" or sessions[0].state is not TransferState.DONE:
            raise RuntimeError(f"the benchmark transfer ended {state}: {reason}")
        return t0, t_token0, t_ready

    def _session(self, tid: int, blocks, token0: int | None) -> SendSession:
        return SendSession(self.inbox, transfer_id=tid, peer=self.peer,
                           cache=self.engine.kv_cache, layout=self.layout, src_blocks=blocks,
                           token0=token0, mode=Mode.PUSH)

    def _hook(self, tid: int, rid: str, sessions: list[SendSession]) -> Callable:
        def on_layer(layer: int, batch) -> None:
            req = next(r for r in batch.requests if r.request_id == rid)
            if not sessions:
                sessions.append(self._session(tid, req.block_ids, None))
            while sessions[0].state is TransferState.WAITING_FOR_BLOCKS:
                sessions[0].poll()  # the reservation was sent before the step began
                time.sleep(POLL_S)
            sessions[0].layers_ready(layer + 1)
        return on_layer


def run(model: str, transport: str, prompt_tokens: int, repeats: int,
        log: Callable[[str], None], device: str = "cpu") -> list[LayerwiseRow]:
    _pin(0)
    torch.set_num_threads(1)
    log(f"loading {model} ({device}) ...")
    engine = Engine(EngineConfig(model=model, dtype="bfloat16", role=Role.PREFILL,
                                 enable_prefix_caching=False, device=device,
                                 max_model_len=max(prompt_tokens + 16, 256)))
    cache = engine.kv_cache
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_side, daemon=True, args=(
        child, transport, ModelConfig.from_folder(resolve_model(model)),
        -(-prompt_tokens // cache.block_size), cache.block_size, device))
    proc.start()
    try:
        prefill = _Prefill(engine, transport, parent, PeerId.from_json(parent.recv()))
        rng = random.Random(0)
        vocab = engine.model_config.vocab_size
        times: dict[str, list[tuple[float, float, float]]] = {m: [] for m in MODES}
        for i in range(repeats + 1):
            for mode in MODES:
                log(f"{transport} {mode}: run {i}/{repeats} ({'warm-up' if i == 0 else 'timed'})")
                t = prefill.run([rng.randrange(vocab) for _ in range(prompt_tokens)],
                                mode == "layerwise")
                if i:
                    times[mode].append(t)
    finally:
        parent.send(None)
        proc.join(10)
    nbytes = -(-prompt_tokens // cache.block_size) * cache.block_nbytes
    return [LayerwiseRow(transport, m, prompt_tokens, nbytes,
                         statistics.median(t1 - t0 for t0, t1, _ in times[m]),
                         statistics.median((t2 - t1) * 1e3 for _, t1, t2 in times[m]),
                         statistics.median(t2 - t0 for t0, _, t2 in times[m]))
            for m in MODES]


def main(model: str, transport: str, prompt_tokens: int, repeats: int, as_json: bool,
         device: str = "cpu") -> int:
    if prompt_tokens < 1 or repeats < 1:
        raise ValueError("--prompt-tokens and --repeats must be >= 1")
    if transport not in (names := transports_for(device)):
        raise ValueError(f"--transport must be one of {', '.join(names)} on {device}")
    rows = run(model, transport, prompt_tokens, repeats,
               lambda m: print(m, file=sys.stderr, flush=True), device)
    if as_json:
        for r in rows:
            print(json.dumps(asdict(r)))
        return 0
    whole, layerwise = rows
    print(f"{prompt_tokens}-token prompt, {whole.kv_bytes / 1e6:.1f} MB of KV over {transport}, "
          f"medians of {repeats}:")
    print(f"{'mode':<11}{'prefill s':>11}{'KV ready after token 0 ms':>28}"
          f"{'prompt to KV ready s':>22}")
    for r in rows:
        print(f"{r.mode:<11}{r.prefill_s:>11.3f}{r.ready_after_token0_ms:>28.1f}"
              f"{r.prompt_to_ready_s:>22.3f}")
    saved = (whole.prompt_to_ready_s - layerwise.prompt_to_ready_s) * 1e3
    print(f"layer-wise streaming saves {saved:.1f} ms from prompt to KV ready "
          f"({saved / 1e3 / whole.prompt_to_ready_s:.1%}); after token 0 it waits "
          f"{layerwise.ready_after_token0_ms:.1f} ms instead of "
          f"{whole.ready_after_token0_ms:.1f} ms")
    return 0
