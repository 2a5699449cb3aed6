"""The elastic decision under a load played out over time: a toy cluster whose workers prefill
the prompts sent to them first come, first served at their rate, each prompt going where its
prefill ends first (the split decision's rule), observed every tick as the controller observes
(its arrival window, `elastic_window.py`), and a flip carried out at once. Under a steady
prefill-heavy load beyond the prefill worker, whose queue still runs dry between prompts,
nothing flips; a chat load flips the idle prefill worker within the first ticks, once, and the
flip does not bring on the pressure that would take it back."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pdserve.router.elastic import (
    FlipPlan,
    Memory,
    Observation,
    WorkerView,
    decide,
    prefill_wait_s,
    tally,
)
from pdserve.router.elastic_settings import ElasticSettings
from pdserve.router.elastic_window import ArrivalWindow
from pdserve.router.split_decision import Sent

DEFAULTS = ElasticSettings(ttft_target_s=2.0, tpot_target_s=0.1)  # the flags' defaults, 2 s TTFT


@dataclass
class Worker:
    key: str
    role: str
    rate: float  # prefill tokens/s: whole prompts on a prefill worker, paced beside streams else
    queue: list[float] = field(default_factory=list)  # tokens left of each prompt, FIFO
    streams: list[float] = field(default_factory=list)  # when each request decoding here ends
    measured: bool = False  # it prefilled a prompt: its /health reports its rate

    @property
    def backlog(self) -> float:
        return sum(self.queue)

    def run(self, seconds: float) -> None:
        """Prefill for `seconds`."""
        budget = seconds * self.rate
        while self.queue and budget > 0:
            done = min(self.queue[0], budget)
            self.queue[0] -= done
            budget -= done
            if self.queue[0] <= 1e-9:
                self.queue.pop(0)
                self.measured = True


@dataclass
class Cluster:
    """Requests arrive at the given times (open loop), or each client sends its next request
    when its last one ends (`clients`, closed loop); each decodes for `decode_s` once
    prefilled, on the worker that prefilled it if it is decode-capable, else on the
    decode-capable worker with the fewest streams."""

    workers: list[Worker]
    arrivals: list[float]
    tokens: int
    decode_s: float
    clients: bool = False
    settings: ElasticSettings = DEFAULTS
    sent: dict[str, Sent] = field(default_factory=dict)
    window: ArrivalWindow = field(default_factory=ArrivalWindow)
    now: float = 0.0
    waits: list[float] = field(default_factory=list)  # each tick's W(S), seconds
    # each tick's W' without the prefill worker a flip to decode would take; None: none left
    projected: list[float | None] = field(default_factory=list)

    def play(self, until: float) -> list[tuple[float, FlipPlan]]:
        """Every flip the rules make up to `until`, each carried out at once."""
        memory, flips, pending = Memory(), [], list(self.arrivals)
        self.window.sample(self.now, self.sent)
        while self.now < until:
            end = self.now + self.settings.interval_s
            while pending and min(pending) <= end:
                at = min(pending)
                pending.remove(at)
                self._advance(at)
                finish = self._dispatch()
                if self.clients:
                    pending.append(finish)
            self._advance(end)
            obs = self._observe()
            self.waits.append(prefill_wait_s(obs) or 0.0)
            prefill = obs.routable("prefill")
            self.projected.append(prefill_wait_s(obs, min(
                prefill, key=lambda w: (w.backlog_tokens, w.key)).key) if prefill else None)
            memory = tally(memory, obs, self.settings)
            plan = decide(obs, memory, self.settings)
            if plan is not None:
                next(w for w in self.workers if w.key == plan.worker).role = plan.to
                memory = memory.flipped(self.now)
                flips.append((self.now, plan))
        return flips

    def _advance(self, to: float) -> None:
        for w in self.workers:
            w.run(to - self.now)
        self.now = to

    def _dispatch(self) -> float:
        """Prefill where it ends first (queue ahead plus its own tokens; an unmeasured worker
        counts at the mean measured rate; with none measured, up to 256 tokens stay on a
        decode worker); when the request ends."""
        known = [w.rate for w in self.workers if w.measured]
        if known:
            prior = sum(known) / len(known)
            w = min(self.workers, key=lambda w: (
                (w.backlog + self.tokens) / (w.rate if w.measured else prior), w.key))
        else:
            w = next(w for w in self.workers if (w.role == "prefill") == (self.tokens > 256))
        prefilled = self.now + (w.backlog + self.tokens) / w.rate
        w.queue.append(float(self.tokens))
        was = self.sent.get(w.key, Sent())
        self.sent[w.key] = Sent(was.prompts + 1, was.tokens + self.tokens)
        decoder = w if w.role != "prefill" else min(
            (d for d in self.workers if d.role != "prefill"), key=lambda d: len(d.streams))
        decoder.streams.append(prefilled + self.decode_s)
        return prefilled + self.decode_s

    def _observe(self) -> Observation:
        s = self.settings
        self.window.sample(self.now, self.sent)
        window = self.window.window(s.sustain_ticks * s.interval_s)
        for w in self.workers:
            w.streams = [end for end in w.streams if end > self.now]
        views = tuple(WorkerView(
            w.key, w.role, True, inflight=len(w.streams) or len(w.queue),
            backlog_tokens=round(w.backlog),
            prefill_tokens_per_s=w.rate if w.measured else None,
            decode_step_s=0.03 if w.streams else None, kv_used=10, kv_total=100,
            sent_prompts=window.sent.get(w.key, Sent()).prompts,
            sent_tokens=window.sent.get(w.key, Sent()).tokens) for w in self.workers)
        demand = sum(len(w.queue) for w in self.workers if w.role == "prefill")
        return Observation(self.now, views, prefill_demand=demand, window_s=window.seconds)


def poisson(rate: float, seconds: float, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    while (t := t + rng.expovariate(rate)) < seconds:
        out.append(t)
    return out


def rag_overload(seed: int) -> Cluster:
    """1,500-token prompts at 0.4 req/s (600 tokens/s) decoding for 4 s each, on a prefill
    worker that prefills 500 tokens/s and a decode worker that prefills 400 beside its
    streams: the two keep up (900), the prefill worker alone would not, nor would the decode
    worker."""
    return Cluster([Worker("p", "prefill", 500.0), Worker("d", "decode", 400.0)],
                   poisson(0.4, 90.0, seed), tokens=1500, decode_s=4.0)


def test_a_steady_overload_whose_queue_runs_dry_between_prompts_flips_nothing() -> None:
    for seed in range(10):
        cluster = rag_overload(seed)
        assert cluster.play(90.0) == [], seed
        # the instant's view: the prefill queue was empty at some ticks and long at others
        assert min(cluster.waits) == 0.0 and max(cluster.waits) > 2.0


def test_under_that_overload_the_instant_looks_idle_now_and_then() -> None:
    """What the rates guard against: now and then the prefill worker's queue is short for the
    whole sustain window and the decode worker's with it, so that the instant's projection
    without the prefill worker is calm (an idle trigger judged from the instant fired)."""
    calm = 0.25 * DEFAULTS.ttft_target_s
    seen = 0
    for seed in range(10):
        cluster = rag_overload(seed)
        cluster.play(90.0)
        w, p = cluster.waits, cluster.projected
        seen += any(max(w[i - 2:i + 1]) <= calm and p[i] is not None and p[i] <= calm
                    for i in range(2, len(w)))
    assert seen >= 5


def chat(seed: int) -> Cluster:
    """16 clients, each sending its next 160-token prompt when its last request ended (6 s
    of decoding); the decode worker prefills them beside its streams at 1,200 tokens/s, the
    prefill worker, unmeasured until it gets one, would take 1,000."""
    start = [0.01 + i * 0.001 * seed for i in range(16)]
    return Cluster([Worker("p", "prefill", 1000.0), Worker("d", "decode", 1200.0)], start,
                   tokens=160, decode_s=6.0, clients=True)


def test_chat_flips_the_idle_prefill_worker_within_the_first_ticks_and_only_once() -> None:
    for seed in range(5):
        cluster = chat(seed)
        flips = cluster.play(90.0)
        assert [(p.worker, p.to) for _, p in flips] == [("p", "decode")], seed
        assert flips[0][0] <= 4.0  # three ticks of evidence, then the window's rate is low
        assert "the prefill side idle while every decode-capable worker streams" in \
            flips[0][1].reason


def test_an_idle_prefill_side_flips_once_the_window_shows_no_arrivals() -> None:
    """Long streams and no prompt since: the sustain window is the evidence."""
    cluster = Cluster([Worker("p", "prefill", 1000.0), Worker("d", "decode", 1200.0)],
                      [0.01, 0.02], tokens=100, decode_s=60.0)
    flips = cluster.play(30.0)
    assert [(t, p.worker, p.to) for t, p in flips] == [(3.0, "p", "decode")]


def test_after_a_prefill_heavy_phase_the_worker_flips_once_the_window_forgets_it() -> None:
    """Long prompts for 30 s, then none while the streams go on: the window holds the last 8
    prompts (a minute back at most), and the flip comes once the rate over it is calm for the
    decode worker, not at the first lull."""
    cluster = Cluster([Worker("p", "prefill", 500.0), Worker("d", "decode", 400.0)],
                      poisson(0.4, 30.0, 3), tokens=1500, decode_s=120.0)
    flips = cluster.play(120.0)
    assert [(p.worker, p.to) for _, p in flips] == [("p", "decode")]
    assert 40.0 < flips[0][0] <= 95.0


def test_the_load_a_flip_leaves_does_not_flip_a_worker_back() -> None:
    """A rare 1,750-token prompt (one every 28 s) on two prefill workers of 500 tokens/s: they
    are idle, and the decode workers, streaming, take them over one by one. After that each
    prompt alone keeps a new prompt's wait over half the TTFT target for seconds (its own 3.5 s
    prefill), three ticks in a row at times; the rates say the stage is calm, so no decode
    worker is flipped back to prefill for it."""
    longest = 0
    for seed in range(6):
        cluster = Cluster([Worker("p1", "prefill", 500.0), Worker("p2", "prefill", 500.0),
                           Worker("d", "decode", 400.0)],
                          poisson(1 / 28, 300.0, seed), tokens=1750, decode_s=150.0)
        flips = cluster.play(300.0)
        assert flips and {p.to for _, p in flips} == {"decode"}, seed
        after = cluster.waits[round(flips[0][0]):]
        over = "".join("x" if w > 0.5 * 2.0 else " " for w in after)
        longest = max([longest, *(len(run) for run in over.split())])
    assert longest >= DEFAULTS.sustain_ticks
