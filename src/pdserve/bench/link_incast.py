"""The incast rows of `pdserve bench transfer --testbed --senders K`: K prefill hosts push KV
into one decode host at once, d0's link the bottleneck.

The run makes a testbed of its own for each link rate (hosts p0..p{K-1} and d0, a name prefix
of its own): d0's link is shaped to the rate under test, each sender's link to
`SENDER_FACTOR` times it (at most the testbed's maximum), so the bytes queue at d0's port, as
at a decode host's switch port; the testbed is removed at the end, also on failure or Ctrl-C.
The receiver is a child process on d0 (`link_receiver.py`), each sender a child process on
its host (`link_sender.py`).

One burst: every sender starts `concurrent` writes of a 1,000-token SmolLM2-shaped prompt's
KV (23 MB each) at one shared instant, into a block range of d0's pool of its own, and sends
a control message every `PING_S` while its writes run. After it, every range must hold its
sender's bytes (`intact`; the pool is zeroed before each burst). Rows (medians of `repeats`
bursts after one warm-up; Gb/s are 1e9 bits per second):
- `IncastRow`, per (link, K, N, window): each write's time from the start to "done", P50 and
  P99 (nearest rank over every write of every sender and repeat) against the ideal
  K x N x bytes / link rate, and the median over repeats of each burst's last end against it
  (`last_of_ideal`: one stalled repeat does not move it); Jain's index over the senders'
  shares and the smallest share x K (1.0: a fair share), shares as `link_shares.py` defines
  them; control messages' one-way latency, sent to delivered, P50 and P99 over every
  sender's.
- `SenderRow`, per sender of that row: its share, its Gb/s (its bytes / its last write's
  end), its last write's end, its own control latency P50 / P99.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pdserve.bench import link_receiver, link_sender, link_shares
from pdserve.bench.link_bench import (
    BLOCKS,
    CONGESTION,
    PING_S,
    PROMPT_BYTES,
    median_last,
    options,
    rank,
)
from pdserve.bench.link_sender import BurstResult
from pdserve.testbed import lifecycle
from pdserve.testbed.topology import MAX_GBPS, LinkShape, Topology

SENDER_FACTOR = 10.0
START_AHEAD_S = 0.1  # the shared start: this far after the parent sends the last "go"


@dataclass(frozen=True)
class IncastRow:
    window: bool
    link_gbps: float
    sender_gbps: float
    delay_ms: float
    senders: int
    concurrent: int  # writes each sender starts at once
    bytes_each: int
    p50_ms: float
    p99_ms: float
    ideal_ms: float
    p99_of_ideal: float
    last_of_ideal: float
    jain: float
    min_share_of_fair: float
    control_p50_ms: float
    control_p99_ms: float
    control_messages: int
    intact: bool
    loss_pct: float = 0.0


@dataclass(frozen=True)
class SenderRow:
    window: bool
    link_gbps: float
    senders: int
    concurrent: int
    sender: str
    share: float
    gbps: float
    last_ms: float
    control_p50_ms: float
    control_p99_ms: float
    control_messages: int


def sender_hosts(senders: int) -> list[str]:
    return [f"p{i}" for i in range(senders)]


@contextlib.contextmanager
def incast_bed(shape: LinkShape, senders: int) -> Iterator[Topology]:
    """A testbed of `senders` prefill hosts and d0, d0's link shaped to `shape`, the senders'
    `SENDER_FACTOR` times faster; removed on leaving, whatever happened."""
    topology = Topology((*sender_hosts(senders), "d0"),
                        prefix=f"pdi{os.getpid() % 100000}x{next(_beds)}-")
    lifecycle.up(topology, sender_shape(shape))
    try:
        lifecycle.set_link(topology.prefix, "d0", gbps=shape.gbps)
        yield topology
    finally:
        lifecycle.down(topology.prefix)


_beds = itertools.count()


def sender_shape(shape: LinkShape) -> LinkShape:
    return shape.changed(gbps=min(MAX_GBPS, shape.gbps * SENDER_FACTOR))


def incast(topology: Topology, shape: LinkShape, window: bool, concurrent: int,
           repeats: int, congestion: str = CONGESTION) -> tuple[IncastRow, list[SenderRow]]:
    """Measure `repeats` bursts (after a warm-up) of `concurrent` writes from every sender
    host of `topology` (all but d0) into d0, whose link is `shape`."""
    hosts = [h for h in topology.hosts if h != "d0"]
    n = BLOCKS
    ranges = [range(i * n, (i + 1) * n) for i in range(len(hosts))]
    tids = itertools.count(1)
    bursts: list[_Burst] = []
    opts = options("tcp" if window else "tcp-whole", congestion)
    with link_receiver.receiver(topology, opts, n * len(hosts)) as r, \
            link_sender.senders(topology, hosts, opts, n, r.peer, PING_S) as ss:
        for i in range(repeats + 1):  # the first is a warm-up
            burst = _one_burst(r, ss, ranges, [[next(tids) for _ in range(concurrent)]
                                               for _ in ss])
            if i > 0:
                bursts.append(burst)
    return _rows(shape, window, hosts, concurrent, PROMPT_BYTES, bursts)


@dataclass(frozen=True)
class _Burst:
    results: list[BurstResult]  # per sender
    latencies: list[list[float]]  # per sender
    intact: bool


def _one_burst(r: link_receiver.Receiver, ss: list[link_sender.Sender], ranges: list[range],
               tids: list[list[int]]) -> _Burst:
    r.clear()
    for s, ts, rng in zip(ss, tids, ranges, strict=True):
        r.allow(ts, s.peer, list(rng))
    r.latencies_by_host()  # none from before this burst
    at = time.perf_counter() + START_AHEAD_S
    for s, ts, rng in zip(ss, tids, ranges, strict=True):
        s.start_burst(ts, list(rng), at)
    results = [s.result() for s in ss]
    time.sleep(PING_S)  # the last message's delivery
    by_host = r.latencies_by_host()
    intact = r.digests(ranges) == [s.digest for s in ss]
    r.revoke([t for ts in tids for t in ts])
    return _Burst(results, [by_host.get(s.peer.host, []) for s in ss], intact)


def _rows(shape: LinkShape, window: bool, hosts: list[str], concurrent: int, nbytes: int,
          bursts: list[_Burst]) -> tuple[IncastRow, list[SenderRow]]:
    k = len(hosts)
    ideal = k * concurrent * nbytes * 8 / (shape.gbps * 1e9)
    writes = [t for b in bursts for res in b.results for t in res.done]
    control = [lat for b in bursts for lats in b.latencies for lat in lats]
    per_burst = [_burst_shares(b) for b in bursts]
    p99 = rank(writes, 0.99)
    row = IncastRow(
        window, shape.gbps, sender_shape(shape).gbps, shape.delay_ms, k, concurrent, nbytes,
        rank(writes, 0.5) * 1e3, p99 * 1e3, ideal * 1e3, p99 / ideal,
        median_last([[t for res in b.results for t in res.done] for b in bursts]) / ideal,
        statistics.median(link_shares.jain(s) for s in per_burst),
        statistics.median(min(s) * k for s in per_burst),
        rank(control, 0.5) * 1e3, rank(control, 0.99) * 1e3, len(control),
        all(b.intact for b in bursts), shape.loss_pct)
    senders = []
    for i, host in enumerate(hosts):
        last = [max(b.results[i].done) for b in bursts]
        lats = [lat for b in bursts for lat in b.latencies[i]]
        senders.append(SenderRow(
            window, shape.gbps, k, concurrent, host,
            statistics.median(s[i] for s in per_burst),
            statistics.median(concurrent * nbytes * 8 / t / 1e9 for t in last),
            statistics.median(last) * 1e3, rank(lats, 0.5) * 1e3, rank(lats, 0.99) * 1e3,
            len(lats)))
    return row, senders


def _burst_shares(b: _Burst) -> list[float]:
    t = link_shares.contended_at([max(res.done) for res in b.results])
    return link_shares.shares([link_shares.bytes_at(res.acked, t) for res in b.results])


def run(link_gbps: list[float], base: LinkShape, concurrent: list[int], senders: list[int],
        repeats: int, log: Callable[[str], None], congestion: str = CONGESTION
        ) -> tuple[list[IncastRow], list[SenderRow]]:
    """Every (link, K, N, window) row, one testbed per (link, K)."""
    rows: list[IncastRow] = []
    sender_rows: list[SenderRow] = []
    for gbps, k in itertools.product(link_gbps, senders):
        shape = base.changed(gbps=gbps)
        with incast_bed(shape, k) as topology:
            for n, window in itertools.product(concurrent, (True, False)):
                log(f"{gbps:g} Gb/s: {k} senders x {n} at once, window "
                    f"{'on' if window else 'off'} ...")
                row, per_sender = incast(topology, shape, window, n, repeats, congestion)
                rows.append(row)
                sender_rows += per_sender
    return rows, sender_rows


def format_rows(rows: list[IncastRow], sender_rows: list[SenderRow]) -> str:
    """The incast table, then each row's senders."""
    out = [f"{'window':<7}{'link':>6}{'K':>3}{'N':>4}{'p50 ms':>9}{'p99 ms':>9}{'ideal ms':>10}"
           f"{'p99/ideal':>10}{'last/ideal':>11}{'Jain':>6}{'min/fair':>9}{'ctl p50':>9}"
           f"{'ctl p99':>9}{'intact':>8}"]
    for r in rows:
        out.append(f"{'on' if r.window else 'off':<7}{r.link_gbps:>6g}{r.senders:>3}"
                   f"{r.concurrent:>4}{r.p50_ms:>9.0f}{r.p99_ms:>9.0f}{r.ideal_ms:>10.0f}"
                   f"{r.p99_of_ideal:>10.2f}{r.last_of_ideal:>11.2f}{r.jain:>6.3f}"
                   f"{r.min_share_of_fair:>9.2f}"
                   f"{r.control_p50_ms:>9.1f}{r.control_p99_ms:>9.1f}"
                   f"{'yes' if r.intact else 'NO':>8}")
    out.append(f"\n{'window':<7}{'link':>6}{'K':>3}{'N':>4}{'sender':>8}{'share':>7}{'Gb/s':>7}"
               f"{'last ms':>9}{'ctl p50':>9}{'ctl p99':>9}")
    for s in sender_rows:
        out.append(f"{'on' if s.window else 'off':<7}{s.link_gbps:>6g}{s.senders:>3}"
                   f"{s.concurrent:>4}{s.sender:>8}{s.share:>7.1%}{s.gbps:>7.2f}"
                   f"{s.last_ms:>9.0f}{s.control_p50_ms:>9.1f}{s.control_p99_ms:>9.1f}")
    return "\n".join(out)
