"""Deterministic request traces for `pdserve bench serve`: the same seed gives every server the
very same prompts, output lengths and arrival times.

Shapes, scaled to a 2-core CPU machine serving SmolLM2-135M (measured here, one core, bf16,
batch 1: a 2,000-token prefill takes ~1.8 s, a decode step ~55 ms), so that one request takes
seconds, not minutes:
- `chat`: prompts 64-256 tokens, outputs 64-128 (short prompt, decode-bound).
- `rag`: prompts 1,500-2,000 tokens, outputs 48-64. The field's long-context shape is ~4,000
  prompt tokens and ~500 output tokens; prompts are halved (a prefill of ~2 s on one core) and
  outputs cut ~9x (~3 s of decode), so prefill weighs even more than in the field (prompt:
  output ~30:1 instead of ~8:1).
- `mixed`: a Poisson stream of chat requests at `rate`, plus, at t = k * burst_every_s for
  k = 1, 2, ..., a burst of `burst_size` rag-shaped requests arriving at once: long prefills
  landing on running decodes (the head-of-line case). Its total rate is
  rate + burst_size / burst_every_s.
- `fixed`: every prompt `input_len` tokens, every output `output_len` tokens.
- `diurnal`: phases of `phase_s` seconds that alternate, starting with ingestion: rag-shaped
  requests at `rate`, then chat-shaped ones at DIURNAL_CHAT_RATE x `rate`, then rag again...
  (a run of 3 x phase_s is ingestion, chat, ingestion), so that the best static split of
  prefill and decode workers is wrong for part of the run. Phase k's arrivals are a Poisson
  stream of its own, started at k x phase_s and cut at (k + 1) x phase_s. Open loop only (a
  closed loop has no clock to switch phases by).

Invariants:
- Lengths are drawn uniformly from inclusive ranges: n = lo + U{0, ..., hi - lo}.
- Prompt ids are uniform in `token_id_range(vocab)` = [TOKEN_ID_LO, min(vocab, TOKEN_ID_HI)):
  past the special and byte-level tokens of common vocabularies, inside every vocabulary of
  at least 30,000 ids (a tiny test vocabulary starts at vocab // 2 instead).
  Prompts are sent as ids, so a server sees exactly this many prompt tokens.
- Request i of a stream depends only on (seed, stream name, i): its own `random.Random` seeded
  with the string f"pdserve-bench/{seed}/{stream}/{i}" (string seeds hash with SHA-512, so no
  PYTHONHASHSEED and no Python version changes them). `chat` and the chat stream of `mixed`
  share their prompts.
- Open loop (Poisson at `rate` req/s): arrival_0 = 0, arrival_i = arrival_{i-1} + g_i, with
  g_i ~ Exp(rate) (mean 1 / rate) from the stream's own seeded generator. Streams are merged
  in arrival order; ties keep the chat stream first, then request index order.
- A trace ends at a duration (arrivals strictly before it) or after a count of requests.
- With `max_model_len`, a workload whose longest prompt + longest output exceeds it is refused.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

TOKEN_ID_LO = 1000
TOKEN_ID_HI = 30000
SMOLLM2_VOCAB = 49152
WORKLOAD_KINDS = ("chat", "rag", "mixed", "fixed", "diurnal")
# Chat phases of `diurnal` arrive this many times faster than its rag phases: a chat request
# asks ~11x less prefill (160 against 1,750 prompt tokens on average) and about as much decode
# (96 against 56 tokens), so at 8x the chat phase is decode-bound where the rag phase is
# prefill-bound, at comparable total work.
DIURNAL_CHAT_RATE = 8.0
DIURNAL_PHASES = ("rag", "chat")
WORKLOAD_HELP = {
    "chat": "short prompts (64-256 tokens), outputs 64-128: decode-heavy",
    "rag": "long prompts (1,500-2,000 tokens), outputs 48-64: prefill-heavy",
    "mixed": "chat, plus a burst of --burst-size rag prompts every --burst-every-s s",
    "fixed": "prompts of --input-len tokens, outputs of --output-len tokens",
    "diurnal": "--phase-s of rag at --rate, then of chat at 8x --rate, alternating",
}


@dataclass(frozen=True)
class RequestSpec:
    """One request of a trace: when it arrives (seconds from the start; ignored in closed
    loop), its prompt as token ids, and how many tokens it asks for (sent with ignore_eos)."""

    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class LengthRange:
    """Token counts drawn uniformly from the inclusive range [lo, hi]; 1 <= lo <= hi."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"a length range needs 1 <= lo <= hi, got [{self.lo}, {self.hi}]")

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)


@dataclass(frozen=True)
class Shape:
    """The prompt and output lengths of one stream of requests."""

    prompt: LengthRange
    output: LengthRange


CHAT = Shape(LengthRange(64, 256), LengthRange(64, 128))
RAG = Shape(LengthRange(1500, 2000), LengthRange(48, 64))


@dataclass(frozen=True)
class Workload:
    """What to send (see the module docstring); `rate` and the trace length come with each
    call, so one workload replays at several rates."""

    kind: str = "chat"
    seed: int = 0
    vocab: int = SMOLLM2_VOCAB
    input_len: int | None = None  # fixed only
    output_len: int | None = None  # fixed only
    burst_every_s: float = 20.0  # mixed only
    burst_size: int = 4  # mixed only
    max_model_len: int | None = None
    phase_s: float = 60.0  # diurnal only

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOAD_KINDS)}, "
                             f"got {self.kind!r}")
        lo, hi = token_id_range(self.vocab)
        if hi - lo < 16:
            raise ValueError(f"vocab of {self.vocab} ids is too small to draw prompts from")
        self._check_fixed()
        if not (math.isfinite(self.burst_every_s) and self.burst_every_s > 0):
            raise ValueError(f"burst_every_s must be > 0, got {self.burst_every_s}")
        if self.burst_size < 1:
            raise ValueError(f"burst_size must be >= 1, got {self.burst_size}")
        if not (math.isfinite(self.phase_s) and self.phase_s > 0):
            raise ValueError(f"phase_s must be > 0 seconds, got {self.phase_s}")
        self._check_model_len()

    def _check_fixed(self) -> None:
        given = self.input_len is not None or self.output_len is not None
        if self.kind != "fixed":
            if given:
                raise ValueError("input_len and output_len are for the fixed workload only")
            return
        if self.input_len is None or self.output_len is None:
            raise ValueError("the fixed workload needs both input_len and output_len")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1")

    def _check_model_len(self) -> None:
        if self.max_model_len is None:
            return
        longest = max(s.prompt.hi + s.output.hi for s in self.shapes().values())
        if longest > self.max_model_len:
            raise ValueError(f"the {self.kind} workload needs up to {longest} tokens per "
                             f"request (prompt + output), over max_model_len "
                             f"{self.max_model_len}")

    def shapes(self) -> dict[str, Shape]:
        """Stream name -> shape; the names seed the streams' generators."""
        if self.kind == "fixed":
            assert self.input_len is not None and self.output_len is not None
            return {"fixed": Shape(LengthRange(self.input_len, self.input_len),
                                   LengthRange(self.output_len, self.output_len))}
        return {"chat": {"chat": CHAT}, "rag": {"rag": RAG},
                "mixed": {"chat": CHAT, "burst": RAG},
                "diurnal": {"rag": RAG, "chat": CHAT}}[self.kind]

    def stream(self, rate: float) -> Iterator[RequestSpec]:
        """The endless trace in arrival order; `rate` (req/s) drives the Poisson stream."""
        if not (math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be a finite number of requests/s > 0, got {rate}")
        if self.kind == "diurnal":
            return self._diurnal(rate)
        name = next(iter(self.shapes()))
        poisson = self._specs(name, _poisson_times(self._rng(name, "arrivals"), rate))
        if self.kind != "mixed":
            return poisson
        bursts = self._specs("burst", _burst_times(self.burst_every_s, self.burst_size))
        return heapq.merge(poisson, bursts, key=lambda spec: spec.arrival_s)

    def requests(self, rate: float, duration_s: float | None = None,
                 num_requests: int | None = None) -> list[RequestSpec]:
        """The trace's arrivals before `duration_s`, or its first `num_requests` (exactly one
        of the two)."""
        if (duration_s is None) == (num_requests is None):
            raise ValueError("give exactly one of duration_s and num_requests")
        specs = self.stream(rate)
        if num_requests is not None:
            if num_requests < 1:
                raise ValueError(f"num_requests must be >= 1, got {num_requests}")
            return list(itertools.islice(specs, num_requests))
        assert duration_s is not None
        if not (math.isfinite(duration_s) and duration_s > 0):
            raise ValueError(f"duration_s must be > 0, got {duration_s}")
        return list(itertools.takewhile(lambda spec: spec.arrival_s < duration_s, specs))

    def settings(self) -> dict[str, object]:
        """The fields that define the trace, JSON-ready (the mixed-only and fixed-only fields
        only for their workload)."""
        out: dict[str, object] = {"workload": self.kind, "seed": self.seed, "vocab": self.vocab,
                                  "max_model_len": self.max_model_len}
        if self.kind == "fixed":
            out |= {"input_len": self.input_len, "output_len": self.output_len}
        if self.kind == "mixed":
            out |= {"burst_every_s": self.burst_every_s, "burst_size": self.burst_size}
        if self.kind == "diurnal":
            out |= {"phase_s": self.phase_s, "chat_rate_factor": DIURNAL_CHAT_RATE}
        return out

    def _rng(self, stream: str, index: int | str) -> random.Random:
        return random.Random(f"pdserve-bench/{self.seed}/{stream}/{index}")

    def _specs(self, stream: str, times: Iterator[float]) -> Iterator[RequestSpec]:
        for i, t in enumerate(times):
            yield self._spec(stream, i, t)

    def _spec(self, stream: str, index: int, arrival_s: float) -> RequestSpec:
        shape = self.shapes()[stream]
        lo, hi = token_id_range(self.vocab)
        rng = self._rng(stream, index)
        n_prompt, n_out = shape.prompt.draw(rng), shape.output.draw(rng)
        ids = tuple(rng.randrange(lo, hi) for _ in range(n_prompt))
        return RequestSpec(arrival_s=arrival_s, prompt_token_ids=ids, max_tokens=n_out)

    def _diurnal(self, rate: float) -> Iterator[RequestSpec]:
        """Phase k: a Poisson stream of DIURNAL_PHASES[k % 2]'s shape on [k P, (k + 1) P);
        request i of a shape is the same whatever the phase length."""
        counts = dict.fromkeys(DIURNAL_PHASES, 0)
        for k in itertools.count():
            stream = DIURNAL_PHASES[k % 2]
            phase_rate = rate * (DIURNAL_CHAT_RATE if stream == "chat" else 1.0)
            rng = self._rng(f"phase{k}", "arrivals")
            t = k * self.phase_s + rng.expovariate(phase_rate)
            while t < (k + 1) * self.phase_s:
                yield self._spec(stream, counts[stream], t)
                counts[stream] += 1
                t += rng.expovariate(phase_rate)


def token_id_range(vocab: int) -> tuple[int, int]:
    """[lo, hi) of prompt token ids for a vocabulary of `vocab` ids."""
    return min(TOKEN_ID_LO, vocab // 2), min(vocab, TOKEN_ID_HI)


def _poisson_times(rng: random.Random, rate: float) -> Iterator[float]:
    """0, then cumulative sums of Exp(rate) gaps."""
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(rate)


def _burst_times(every_s: float, size: int) -> Iterator[float]:
    """`size` arrivals at each of every_s, 2 * every_s, ..."""
    for k in itertools.count(1):
        yield from itertools.repeat(k * every_s, size)
