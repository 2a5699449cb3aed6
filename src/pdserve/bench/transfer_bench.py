"""`pdserve bench transfer`: KV payloads between two processes, beside memcpy and a raw socket.

Every number is a median of `repeats`, measured in this run:
- per transport and mode: a child process hosts a pool shaped like SmolLM2's (bf16, 16-token
  blocks of 368,640 bytes); this process writes into it (push) or reads from it (pull), timed
  from `write`/`read` until the move reports "done". GB/s = bytes / seconds (1e9).
  Transports: `tcp`, `tcp-aes` (the same, sealed with AES-256-GCM) and `nixl` (UCX, host
  memory; left out with a note when nixl-cu12 is not installed).
- memcpy: `numpy.copyto` of the same bytes in this process.
- socket: a raw loopback TCP stream of the same bytes (`sendall` from a thread, `recv_into` a
  preallocated buffer), the floor any TCP transport can reach.
- overhead: a 1,000-token prompt's KV (63 blocks, ~23 MB) through a full push session
  (reservation, descriptor, write, CRC32C, notice, verification) between two endpoints, minus
  a bare write of the same blocks; and the CRC32C of those slices on its own.
- KV bytes per token (`kv_per_token.py`): DeepSeek-V3's latent pool against a GQA model of the
  same width, from the engine's own pools, checked against the planner (no timing).

With `device` a GPU, both pools are in its memory (two processes on the same GPU), the
transport is nixl only (tcp moves host memory), memcpy is a device-to-device copy of the same
bytes on that GPU, and the session's CRC32C runs on the GPU (`transfer/device_crc32c.py`).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from pdserve.bench.kv_per_token import format_kv_rows, kv_per_token_rows
from pdserve.bench.timing import median_seconds, synced
from pdserve.common.engine_options import check_device
from pdserve.common.model_config import ModelConfig
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.kv_cache import KVCache
from pdserve.transfer.checksum import slices_crc32c
from pdserve.transfer.layout import KVLayout
from pdserve.transfer.peer import PeerId
from pdserve.transfer.receiver import RecvSession
from pdserve.transfer.sender import SendSession
from pdserve.transfer.sessions import Inbox, Mode
from pdserve.transfer.tcp import TcpOptions, TcpTransport
from pdserve.transfer.transport import Transport

# SmolLM2-135M's KV shape (30 layers x 3 KV heads x 64 head dim): 23,040 bytes a token in bf16.
SMOLLM2 = ModelConfig("LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                      intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                      head_dim=64, max_position_embeddings=8192)
BLOCK_SIZE = 16
PROMPT_TOKENS = 1000
SECRET = b"pdserve-bench-transfer-secret!!!"


def _nixl() -> Transport:
    from pdserve.transfer.nixl import NixlTransport

    return NixlTransport(secret=SECRET)


TRANSPORTS: dict[str, Callable[[], Transport]] = {
    "tcp": lambda: TcpTransport(secret=SECRET),
    "tcp-aes": lambda: TcpTransport(secret=SECRET, options=TcpOptions(encrypt=True)),
    "nixl": _nixl,
}


def available_transports() -> list[str]:
    try:
        import nixl_cu12  # noqa: F401
    except ImportError:
        return [t for t in TRANSPORTS if t != "nixl"]
    return list(TRANSPORTS)


@dataclass(frozen=True)
class TransferRow:
    transport: str
    mode: str  # "push" (write) | "pull" (read)
    bytes: int
    gbps: float
    memcpy_gbps: float
    socket_gbps: float


@dataclass(frozen=True)
class OverheadRow:
    transport: str
    prompt_tokens: int
    bytes: int
    session_ms: float
    bare_write_ms: float
    overhead_ms: float
    crc32c_ms: float


def smollm2_pool(num_blocks: int, seed: int = 0, device: str = "cpu") -> KVCache:
    """A bf16 pool of SmolLM2's KV shape on `device`, filled with the random bits of `seed`."""
    cache = KVCache(SMOLLM2, num_blocks, BLOCK_SIZE, torch.bfloat16, device)
    gen = torch.Generator(device=cache.data.device).manual_seed(seed)
    cache.data.view(torch.int16).random_(generator=gen)
    return cache


def transports_for(device: str) -> list[str]:
    """The transports measured on `device`: every installed one on the CPU, nixl alone on a GPU
    (ValueError without it: tcp sends host memory)."""
    names = available_transports()
    if device == "cpu":
        return names
    if "nixl" not in names:
        raise ValueError(f"KV in {device} memory moves over nixl only (tcp sends host memory): "
                         f"pip install nixl-cu12")
    return ["nixl"]


def _host(conn, transport: str, num_blocks: int, device: str) -> None:
    """Child process: host a pool until told to stop; report our PeerId first, then permit the
    parent (its PeerId is the answer) every move of transfer 1. Control messages are pumped
    meanwhile (a NIXL endpoint answers metadata requests from `receive`)."""
    tx = TRANSPORTS[transport]()
    tx.register(smollm2_pool(num_blocks, device=device))
    conn.send(tx.local.to_json())
    parent = PeerId.from_json(conn.recv())
    tx.allow_writes(1, parent, list(range(num_blocks)))
    tx.allow_reads(1, parent, list(range(num_blocks)))
    conn.send("permitted")
    while not conn.poll(0.001):  # any message: stop
        tx.receive()
    tx.close()


def wait_done(tx: Transport, handle: int) -> None:
    """Poll a move until it ends (pumping control messages); RuntimeError unless "done"."""
    while (status := tx.status(handle)) == "pending":
        tx.receive()
        time.sleep(0.0002)
    if status != "done":
        raise RuntimeError(f"the benchmark move ended {status!r}")


def memcpy_gbps(nbytes: int, repeats: int, device: str = "cpu") -> float:
    """The same bytes copied in this process's memory: numpy on the CPU, a device-to-device
    copy on a GPU (timed to its end)."""
    if device == "cpu":
        src, dst = np.ones(nbytes, dtype=np.uint8), np.empty(nbytes, dtype=np.uint8)
        return nbytes / median_seconds(lambda: np.copyto(dst, src), repeats) / 1e9
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return nbytes / median_seconds(synced(lambda: dst.copy_(src), device), repeats) / 1e9


def socket_gbps(nbytes: int, repeats: int) -> float:
    """A raw loopback stream: one thread sends, this one receives into a fixed buffer."""
    payload, sink = memoryview(bytearray(nbytes)), memoryview(bytearray(nbytes))
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    conn, _ = server.accept()

    def once() -> None:
        sender = threading.Thread(target=client.sendall, args=(payload,))
        sender.start()
        view = sink
        while len(view):
            view = view[conn.recv_into(view):]
        sender.join()

    try:
        return nbytes / median_seconds(once, repeats) / 1e9
    finally:
        for s in (client, conn, server):
            s.close()


def move_gbps(transport: str, sizes_mib: list[int], repeats: int,
              device: str = "cpu") -> list[tuple[str, int, float]]:
    """(mode, bytes, GB/s) for each size, moving between this process and a child, both pools
    on `device`."""
    nbytes = max(sizes_mib) * 2**20
    blocks = -(-nbytes // smollm2_pool(1).block_nbytes)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_host, args=(child, transport, blocks, device), daemon=True)
    proc.start()
    tx = TRANSPORTS[transport]()
    try:
        local = smollm2_pool(blocks, device=device)
        tx.register(local)
        peer = PeerId.from_json(parent.recv())
        parent.send(tx.local.to_json())
        parent.recv()  # the child permits our moves
        out = []
        for mib in sizes_mib:
            n = -(-mib * 2**20 // local.block_nbytes)
            ids = list(range(n))
            for mode, verb in (("push", tx.write), ("pull", tx.read)):
                secs = median_seconds(lambda verb=verb, ids=ids: wait_done(
                    tx, verb(1, ids, peer, ids)), repeats)
                out.append((mode, n * local.block_nbytes, n * local.block_nbytes / secs / 1e9))
        return out
    finally:
        parent.send("stop")
        proc.join(10)
        tx.close()


def session_overhead(transport: str, repeats: int, device: str = "cpu") -> OverheadRow:
    """A 1,000-token prompt through a push session vs a bare write, both endpoints here."""
    n = -(-PROMPT_TOKENS // BLOCK_SIZE)
    pre_pool, dec_pool = smollm2_pool(n, device=device), smollm2_pool(n, device=device)
    bm = BlockManager(n, BLOCK_SIZE, enable_prefix_caching=False)
    layout = KVLayout.of_cache(pre_pool, "smollm2-shape")
    ids = list(range(n))
    tids = iter(range(1, 10**9))
    pre, dec = TRANSPORTS[transport](), TRANSPORTS[transport]()
    try:
        pre.register(pre_pool)
        dec.register(dec_pool)
        pre_in, dec_in = Inbox(pre), Inbox(dec)

        def session() -> None:
            tid = next(tids)
            recv = RecvSession(dec_in, transfer_id=tid, peer=pre.local, cache=dec_pool,
                               layout=layout, dst_blocks=ids, dst_generations=[0] * n,
                               generation=bm.generation)
            send = SendSession(pre_in, transfer_id=tid, peer=dec.local, cache=pre_pool,
                               layout=layout, src_blocks=ids, token0=1, mode=Mode.PUSH)
            while not (send.state.is_terminal and recv.state.is_terminal):
                recv.poll()
                send.poll()
                time.sleep(0.0002)
            if not recv.state.name == send.state.name == "DONE":
                raise RuntimeError(f"benchmark session ended {send.reason or recv.reason}")

        def bare_write() -> None:
            tid = next(tids)
            dec.allow_writes(tid, pre.local, ids)
            wait_done(pre, pre.write(tid, ids, dec.local, ids))

        session_s = median_seconds(session, repeats)
        bare_s = median_seconds(bare_write, repeats)
        crc_s = median_seconds(
            lambda: slices_crc32c(pre_pool.data, ids, range(SMOLLM2.num_layers)), repeats)
    finally:
        pre.close()
        dec.close()
    return OverheadRow(transport, PROMPT_TOKENS, n * pre_pool.block_nbytes, session_s * 1e3,
                       bare_s * 1e3, (session_s - bare_s) * 1e3, crc_s * 1e3)


def run(sizes_mib: list[int], repeats: int, log: Callable[[str], None], device: str = "cpu"):
    rows: list[TransferRow] = []
    overheads: list[OverheadRow] = []
    baselines = {}
    names = transports_for(device)
    for mib in sizes_mib:
        nbytes = mib * 2**20
        log(f"baselines, {mib} MiB ...")
        baselines[mib] = (memcpy_gbps(nbytes, repeats, device), socket_gbps(nbytes, repeats))
    for name in names:
        log(f"{name}: moves between two processes ({device} memory) ...")
        for (mode, nbytes, gbps), mib in zip(
                move_gbps(name, sizes_mib, repeats, device),
                [m for m in sizes_mib for _ in (0, 1)], strict=True):
            rows.append(TransferRow(name, mode, nbytes, gbps, *baselines[mib]))
        log(f"{name}: session overhead for a {PROMPT_TOKENS}-token prompt ...")
        overheads.append(session_overhead(name, repeats, device))
    return rows, overheads


def main(sizes_mib: list[int], repeats: int, as_json: bool, device: str = "cpu") -> int:
    if not sizes_mib or min(sizes_mib) <= 0 or repeats <= 0:
        raise ValueError("sizes (MiB) and repeats must be positive")
    check_device(device)
    # closing the endpoints makes each report the other dead: expected here, not worth a warning
    logging.getLogger("pdserve.transfer").setLevel(logging.ERROR)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    if "nixl" not in available_transports() and device == "cpu":
        say("nixl: skipped (pip install nixl-cu12 to measure it)")
    kv_rows = kv_per_token_rows()  # configs and one-block pools only: no weights, no moves
    rows, overheads = run(sizes_mib, repeats, say, device)
    if as_json:
        for r in rows:
            print(json.dumps(asdict(r)))
        for o in overheads:
            print(json.dumps({"kind": "overhead"} | asdict(o)))
        for k in kv_rows:
            print(json.dumps({"kind": "kv_per_token"} | asdict(k) | {"ratio": round(k.ratio, 4)}))
        return 0
    copy = "memcpy" if device == "cpu" else "D2D"  # a device-to-device copy on a GPU
    print(f"{'transport':<10}{'mode':<6}{'MiB':>8}{'GB/s':>8}{copy:>8}{'socket':>8}"
          f"{'of ' + copy:>11}{'of socket':>11}")
    for r in rows:
        print(f"{r.transport:<10}{r.mode:<6}{r.bytes / 2**20:>8.1f}{r.gbps:>8.2f}"
              f"{r.memcpy_gbps:>8.2f}{r.socket_gbps:>8.2f}{r.gbps / r.memcpy_gbps:>10.0%}"
              f"{r.gbps / r.socket_gbps:>10.0%}")
    for o in overheads:
        print(f"\n{o.transport}: {o.prompt_tokens}-token prompt ({o.bytes / 1e6:.1f} MB): push "
              f"session {o.session_ms:.1f} ms, bare write {o.bare_write_ms:.1f} ms, overhead "
              f"{o.overhead_ms:.1f} ms; CRC32C {o.crc32c_ms:.2f} ms "
              f"({o.crc32c_ms / o.session_ms:.0%} of the session)")
    print(f"\n{format_kv_rows(kv_rows)}")
    return 0
