"""`pdserve bench transfer --testbed`: KV moves between two hosts over a shaped link.

The run makes its own testbed (hosts p0 and d0, a name prefix of its own, every link shaped
to the rate under test) and removes it at the end, also on failure; root is needed. Each
endpoint is bound inside its host's network namespace, so every byte crosses the shaped veth
link: for the bulk rows both live in this process; for the burst rows the receiver is a child
process on d0 (`link_receiver.py`: a decode worker receives in a process of its own, and one
interpreter's lock shared by both ends would add its own waits to the control messages'
latency). The payload is a 1,000-token
prompt's KV in SmolLM2's shape (bf16, 63 blocks of 368,640 bytes, 23 MB).

Rows (Gb/s are 1e9 bits per second, as links are rated; each names its link's rate, delay and
loss, every link of the bed shaped alike):
- bulk, per transport (tcp, tcp-aes): one push at a time, median of `repeats`: `gbps` and
  `of_link` = gbps / the link's rate; `of_raw` = the median, over repeats, of the raw
  socket's time / the transport's, the two timed in turns (`link_raw.py`: the same bytes
  over a plain TCP connection on the same path, which shows what the testbed itself delivers
  at this size). The `raw` row is the baseline's own (`of_raw` 1).
- burst, tcp, in three setups (`BURSTS`): the default (the link window, `TcpOptions.frame_s`,
  and control messages on a connection of their own, `control_connection`); the window with
  one connection per peer; and neither (whole writes, kernel buffers, one connection). N
  pushes started at once; each one's time from the start to "done" against the ideal
  N x bytes / link rate (`p99_of_ideal`, nearest rank over every transfer of every repeat;
  `last_of_ideal`, the median over repeats of the burst's last end, which one stalled repeat
  does not move),
  and control messages sent every `PING_S` while the burst runs (`control_p50_ms`,
  `control_p99_ms`: one-way, sent to delivered, on the machine's one monotonic clock).
  Before them, the raw socket's burst row (`transport` "raw", `link_raw_burst.py`): the same
  bytes in one `sendall` and a stamp every `PING_S` on a second plain connection, which shows
  the tail the testbed itself leaves a small message beside a full link (its p50 and p99 are
  over the bursts' total times: one stream has no per-transfer ends).

NIXL's bulk row (where nixl-cu12 is installed) pushes into a pool a child process hosts on d0
(`link_nixl.py`): two UCX endpoints of one process would talk through shared memory.

These are the rows of one sender (`senders` 1, the default). With more, `main` adds the incast
rows (`link_incast.py`): K prefill hosts push into d0 at once, d0's link the bottleneck.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from pdserve.bench import link_nixl, link_raw, link_raw_burst, link_receiver
from pdserve.bench.transfer_bench import (
    BLOCK_SIZE,
    PROMPT_TOKENS,
    SECRET,
    SMOLLM2,
    smollm2_pool,
    wait_done,
)
from pdserve.engine.kv_cache import KVCache
from pdserve.testbed import lifecycle
from pdserve.testbed.namespaces import entered
from pdserve.testbed.topology import LinkShape, Topology
from pdserve.transfer.peer import PeerId
from pdserve.transfer.tcp import TcpOptions, TcpTransport

PING_S = 0.005
POLL_S = 0.0005  # how often a burst looks at its writes
BLOCK_BYTES = KVCache.bytes_per_block(SMOLLM2, BLOCK_SIZE, torch.bfloat16)  # 368,640
BLOCKS = -(-PROMPT_TOKENS // BLOCK_SIZE)  # one prompt's KV: 63 blocks
PROMPT_BYTES = BLOCKS * BLOCK_BYTES
OPTIONS = {"tcp": TcpOptions(), "tcp-aes": TcpOptions(encrypt=True),
           "tcp-one": TcpOptions(control_connection=False),
           "tcp-whole": TcpOptions(frame_s=0, control_connection=False)}
BURSTS = ((True, True), (True, False), (False, False))  # (window, control connection)
CONGESTION = TcpOptions().congestion  # the transport's own choice


def options(kind: str, congestion: str = CONGESTION) -> TcpOptions:
    """The endpoint options of `kind` (a key of OPTIONS), asking for `congestion` on the
    connections they dial ("": the host's default)."""
    return replace(OPTIONS[kind], congestion=congestion)


@dataclass(frozen=True)
class BulkRow:
    transport: str
    link_gbps: float
    delay_ms: float
    bytes: int
    gbps: float
    of_link: float
    of_raw: float
    loss_pct: float = 0.0


@dataclass(frozen=True)
class BurstRow:
    window: bool
    link_gbps: float
    delay_ms: float
    concurrent: int
    bytes_each: int
    p50_ms: float
    p99_ms: float
    ideal_ms: float
    p99_of_ideal: float
    last_of_ideal: float
    control_p50_ms: float
    control_p99_ms: float
    control_messages: int
    loss_pct: float = 0.0
    control_connection: bool = True
    transport: str = "tcp"


@dataclass
class Pair:
    """A sender endpoint on p0 and a receiver on d0, the sender already connected."""

    w: TcpTransport
    r: TcpTransport


@contextlib.contextmanager
def _bed(shape: LinkShape) -> Iterator[Topology]:
    topology = Topology(("p0", "d0"), prefix=f"pdb{os.getpid() % 100000}x{next(_beds)}-")
    lifecycle.up(topology, shape)
    try:
        yield topology
    finally:
        lifecycle.down(topology.prefix)


_beds = itertools.count()


@contextlib.contextmanager
def _pair(topology: Topology, options: TcpOptions, num_blocks: int) -> Iterator[Pair]:
    with entered(topology.namespace("d0")):
        r = TcpTransport(topology.address("d0"), secret=SECRET, options=options)
    with entered(topology.namespace("p0")):
        w = TcpTransport(topology.address("p0"), secret=SECRET, options=options)
        w.reach(r.local)  # its sender thread starts here, inside p0
    try:
        w.register(smollm2_pool(num_blocks))
        r.register(smollm2_pool(num_blocks))
        yield Pair(w, r)
    finally:
        w.close()
        r.close()


def bulk(topology: Topology, shape: LinkShape, transport: str, repeats: int,
         raw: Callable[[], float], congestion: str = CONGESTION) -> BulkRow:
    """One push at a time, each timed in turn with one of the raw baseline's transfers."""
    ids = list(range(BLOCKS))
    tids = itertools.count(1)
    with _pair(topology, options(transport, congestion), BLOCKS) as p:
        def once() -> None:
            tid = next(tids)
            p.r.allow_writes(tid, p.w.local, ids)
            wait_done(p.w, p.w.write(tid, ids, p.r.local, ids))
            p.r.revoke(tid)

        once()  # warm-up: the connection's handshake and first frames
        turns = [(_timed(once), raw()) for _ in range(repeats)]
    secs = statistics.median(t for t, _ in turns)
    return _bulk_row(transport, shape, secs, statistics.median(r / t for t, r in turns))


def raw_bulk(shape: LinkShape, repeats: int, raw: Callable[[], float]) -> BulkRow:
    raw()  # warm-up: the connection's first round trips
    return _bulk_row("raw", shape, _median_of(raw, repeats), 1.0)


def nixl_bulk(topology: Topology, shape: LinkShape, repeats: int, raw: Callable[[], float]
              ) -> BulkRow:
    """NIXL's pushes run in a child process of their own (`link_nixl.py`), so the raw
    baseline is timed right after them rather than in turns."""
    secs = link_nixl.push_seconds(topology, BLOCKS, repeats)
    return _bulk_row("nixl", shape, secs, _median_of(raw, repeats) / secs)


def _median_of(timed: Callable[[], float], repeats: int) -> float:
    return statistics.median(timed() for _ in range(repeats))


def _bulk_row(transport: str, shape: LinkShape, secs: float, of_raw: float) -> BulkRow:
    gbps = PROMPT_BYTES * 8 / secs / 1e9
    return BulkRow(transport, shape.gbps, shape.delay_ms, PROMPT_BYTES, gbps,
                   gbps / shape.gbps, of_raw, shape.loss_pct)


def burst(topology: Topology, shape: LinkShape, window: bool, concurrent: int,
          repeats: int, congestion: str = CONGESTION, control_connection: bool = True
          ) -> BurstRow:
    """`control_connection` counts with the window only: without it the connection is one."""
    ids = list(range(BLOCKS))
    tids = itertools.count(1)
    times: list[list[float]] = []
    control: list[float] = []
    kind = ("tcp" if control_connection else "tcp-one") if window else "tcp-whole"
    opts = options(kind, congestion)
    with link_receiver.receiver(topology, opts, BLOCKS) as r, \
            _writer(topology, opts, BLOCKS, r.peer) as w:
        for _ in range(repeats + 1):  # the first is a warm-up
            took, lat = _one_burst(w, r, [next(tids) for _ in range(concurrent)], ids)
            if _ > 0:
                times.append(took)
                control += lat
    return _burst_row(shape, window, concurrent, times, control, opts.control_connection)


def raw_burst(topology: Topology, shape: LinkShape, concurrent: int, repeats: int
              ) -> BurstRow:
    """The raw socket's burst row: `concurrent` prompts' bytes in one stream, stamps beside."""
    times: list[float] = []
    control: list[float] = []
    with link_raw_burst.raw_burst(topology, concurrent * PROMPT_BYTES) as once:
        for i in range(repeats + 1):  # the first is a warm-up
            took, lat = once(PING_S)
            if i > 0:
                times.append([took])
                control += lat
    return _burst_row(shape, False, concurrent, times, control, True, "raw")


def _burst_row(shape: LinkShape, window: bool, concurrent: int, times: list[list[float]],
               control: list[float], control_connection: bool, transport: str = "tcp"
               ) -> BurstRow:
    """The row of `concurrent` prompts' pushes at once: `times` their seconds to the end,
    one list per repeat; `control` the control messages' one-way seconds."""
    ideal = concurrent * PROMPT_BYTES * 8 / (shape.gbps * 1e9)
    ends = [t for burst in times for t in burst]
    p99 = rank(ends, 0.99)
    return BurstRow(window, shape.gbps, shape.delay_ms, concurrent, PROMPT_BYTES,
                    rank(ends, 0.5) * 1e3, p99 * 1e3, ideal * 1e3, p99 / ideal,
                    median_last(times) / ideal,
                    rank(control, 0.5) * 1e3, rank(control, 0.99) * 1e3, len(control),
                    shape.loss_pct, control_connection, transport)


@contextlib.contextmanager
def _writer(topology: Topology, options: TcpOptions, num_blocks: int, to: PeerId
            ) -> Iterator[TcpTransport]:
    """An endpoint on p0 connected to `to` (its sender thread starts inside p0)."""
    with entered(topology.namespace("p0")):
        w = TcpTransport(topology.address("p0"), secret=SECRET, options=options)
        w.reach(to)
    try:
        w.register(smollm2_pool(num_blocks))
        yield w
    finally:
        w.close()


def _one_burst(w: TcpTransport, r: link_receiver.Receiver, tids: list[int], ids: list[int]
               ) -> tuple[list[float], list[float]]:
    """Start one write per transfer id at once; (each one's seconds to "done", the one-way
    latencies of the control messages sent meanwhile, stamped by the receiving process)."""
    r.allow(tids, w.local, ids)
    r.latencies()  # none from before this burst
    done = threading.Event()
    pinger = threading.Thread(target=_ping, args=(w, r.peer, done), daemon=True)
    start = time.perf_counter()
    handles = [w.write(tid, ids, r.peer, ids) for tid in tids]
    pinger.start()
    took, failed = write_ends(w, handles, start)
    done.set()
    pinger.join()
    if failed:
        raise RuntimeError(f"a benchmark write ended {failed[0]!r}")
    time.sleep(PING_S)  # the last message's delivery
    latencies = r.latencies()
    r.revoke(tids)
    return took, latencies


def write_ends(tx: TcpTransport, handles: list[int], start: float
               ) -> tuple[list[float], list[str]]:
    """Poll writes until every one ended: (each one's end in seconds after `start`
    (perf_counter), in the order they ended; the statuses of those that ended other than
    "done")."""
    ends: list[float] = []
    failed: list[str] = []
    pending = set(handles)
    while pending:
        for h in list(pending):
            status = tx.status(h)
            if status != "pending":
                if status != "done":
                    failed.append(status)
                ends.append(time.perf_counter() - start)
                pending.discard(h)
        time.sleep(POLL_S)
    return ends, failed


def _ping(w: TcpTransport, to: PeerId, done: threading.Event) -> None:
    while not done.wait(PING_S):
        w.send(to, link_receiver.STAMP.pack(time.perf_counter()))


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rank(values: list[float], q: float) -> float:
    """Nearest-rank quantile (0.0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


def median_last(bursts: list[list[float]]) -> float:
    """The median over bursts of each one's last end (its writes' ends in seconds): what
    `last_of_ideal` divides by the ideal, which one stalled burst does not move."""
    return statistics.median(max(ends) for ends in bursts)


def run(link_gbps: list[float], base: LinkShape, concurrent: list[int], repeats: int,
        log: Callable[[str], None], congestion: str = CONGESTION
        ) -> tuple[list[BulkRow], list[BurstRow]]:
    bulks: list[BulkRow] = []
    bursts: list[BurstRow] = []
    for gbps in link_gbps:
        shape = base.changed(gbps=gbps)
        with _bed(shape) as topology:
            bulks += _bulks(topology, shape, repeats, log, congestion)
            for n in concurrent:
                log(f"{gbps:g} Gb/s: {n} at once, raw sockets ...")
                bursts.append(raw_burst(topology, shape, n, repeats))
            for n, (window, lane) in itertools.product(concurrent, BURSTS):
                log(f"{gbps:g} Gb/s: {n} at once, window {'on' if window else 'off'}, "
                    f"{'a control connection' if lane else 'one connection'} ...")
                bursts.append(burst(topology, shape, window, n, repeats, congestion, lane))
    return bulks, bursts


def _bulks(topology: Topology, shape: LinkShape, repeats: int, log: Callable[[str], None],
           congestion: str) -> list[BulkRow]:
    with link_raw.raw_path(topology, PROMPT_BYTES) as raw:
        log(f"{shape.gbps:g} Gb/s: raw socket bulk ...")
        rows = [raw_bulk(shape, repeats, raw)]
        for transport in ("tcp", "tcp-aes"):
            log(f"{shape.gbps:g} Gb/s: {transport} bulk, in turns with the raw socket ...")
            rows.append(bulk(topology, shape, transport, repeats, raw, congestion))
        if link_nixl.nixl_available():
            log(f"{shape.gbps:g} Gb/s: nixl bulk ...")
            rows.append(nixl_bulk(topology, shape, repeats, raw))
    return rows


def main(link_gbps: list[float], base: LinkShape, concurrent: list[int], repeats: int,
         as_json: bool, senders: Sequence[int] = (1,), congestion: str = CONGESTION) -> int:
    """The rows for each number of senders: 1, the bulk and burst rows (one sender, p0); more,
    the incast rows (`link_incast.py`: that many prefill hosts into d0)."""
    if not link_gbps or min(link_gbps) <= 0 or not concurrent or min(concurrent) < 1 \
            or repeats < 1 or not senders or min(senders) < 1:
        raise ValueError("--link-gbps must be positive, --concurrent, --senders and --repeats "
                         "at least 1")
    logging.getLogger("pdserve.transfer").setLevel(logging.ERROR)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    bulks, bursts = run(link_gbps, base, concurrent, repeats, say, congestion) \
        if 1 in senders else ([], [])
    many = sorted({k for k in senders if k > 1})
    incasts: tuple[list, list] = ([], [])
    table = ""
    if many:
        from pdserve.bench import link_incast  # it imports this module

        incasts = link_incast.run(link_gbps, base, concurrent, many, repeats, say,
                                  congestion)
        table = link_incast.format_rows(*incasts)
    if as_json:
        for row in [*bulks, *bursts]:
            kind = "bulk" if isinstance(row, BulkRow) else "burst"
            print(json.dumps({"kind": kind, "testbed": True} | asdict(row)))
        for kind, rows in zip(("incast", "incast_sender"), incasts, strict=True):
            for row in rows:
                print(json.dumps({"kind": kind, "testbed": True} | asdict(row)))
        return 0
    if base.delay_ms or base.loss_pct:
        print(f"every link: {base.delay_ms:g} ms one-way delay, {base.loss_pct:g}% loss each "
              f"way\n")
    if 1 in senders:
        _print_pair(bulks, bursts)
    if many:
        print(("\n" if 1 in senders else "") + table)
    return 0


def _print_pair(bulks: list[BulkRow], bursts: list[BurstRow]) -> None:
    print(f"{'transport':<10}{'link Gb/s':>10}{'MB':>7}{'Gb/s':>8}{'of link':>9}{'of raw':>8}")
    for b in bulks:
        print(f"{b.transport:<10}{b.link_gbps:>10g}{b.bytes / 1e6:>7.1f}{b.gbps:>8.2f}"
              f"{b.of_link:>9.0%}{b.of_raw:>8.2f}")
    print(f"\n{'transport':<10}{'window':<7}{'ctl conn':<9}{'link':>6}{'N':>4}{'p50 ms':>9}"
          f"{'p99 ms':>9}{'ideal ms':>10}{'p99/ideal':>10}{'last/ideal':>11}{'ctl p50':>9}"
          f"{'ctl p99':>9}")
    for r in sorted(bursts, key=lambda r: (r.link_gbps, r.concurrent)):
        window = "-" if r.transport == "raw" else "on" if r.window else "off"
        print(f"{r.transport:<10}{window:<7}{'own' if r.control_connection else 'shared':<9}"
              f"{r.link_gbps:>6g}{r.concurrent:>4}"
              f"{r.p50_ms:>9.0f}{r.p99_ms:>9.0f}{r.ideal_ms:>10.0f}{r.p99_of_ideal:>10.2f}"
              f"{r.last_of_ideal:>11.2f}{r.control_p50_ms:>9.1f}{r.control_p99_ms:>9.1f}")
