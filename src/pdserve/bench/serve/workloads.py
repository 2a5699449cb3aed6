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
- `prefix`: agents or RAG over shared context. `prefixes` (default PREFIX_COUNT) shared
  prefixes of 1,024-1,536 tokens each (a system prompt + a document); each request is one of
  them, chosen by its own generator, followed by a suffix of its own of 64-256 tokens, output
  64-128 tokens (prompts 1,088-1,792 tokens, ~1.1-2 s of prefill on one core when nothing is
  cached, ~0.1-0.3 s when the prefix is). Poisson at `rate` or closed loop, like chat. Each
  request says which prefix it carries and its length (`RequestSpec.prefix_id`,
  `prefix_tokens`), and bench serve writes both into its request's record.

Invariants:
- Lengths are drawn uniformly from inclusive ranges: n = lo + U{0, ..., hi - lo}.
- Prompt ids are uniform in `token_id_range(vocab)` = [TOKEN_ID_LO, min(vocab, TOKEN_ID_HI)):
  past the special and byte-level tokens of common vocabularies, inside every vocabulary of
  at least 30,000 ids (a tiny test vocabulary starts at vocab // 2 instead).
  Prompts are sent as ids, so a server sees exactly this many prompt tokens.
- Request i of a stream depends only on (seed, stream name, i): its own `random.Random` seeded
  with the string f"pdserve-bench/{seed}/{stream}/{i}" (string seeds hash with SHA-512, so no
  PYTHONHASHSEED and no Python version changes them). `chat` and the chat stream of `mixed`
  share their prompts. A `prefix` request also carries shared prefix k, which depends only on
  (seed, "prefix", k) (the string f"pdserve-bench/{seed}/prefix/{k}"): every request of one
  prefix id starts with exactly the same tokens, whatever the rate, count or order.
- Open loop (Poisson at `rate` req/s): arrival_0 = 0, arrival_i = arrival_{i-1} + g_i, with
  g_i ~ Exp(rate) (mean 1 / rate) from the stream's own seeded generator. Streams are merged
  in arrival order; ties keep the chat stream first, then request index order.
- A trace ends at a duration (arrivals strictly before it) or after a count of requests.
- With `max_model_len`, a workload whose longest prompt + longest output exceeds it is refused.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

TOKEN_ID_LO = 1000
TOKEN_ID_HI = 30000
SMOLLM2_VOCAB = 49152
WORKLOAD_KINDS = ("chat", "rag", "mixed", "fixed", "diurnal", "prefix")
# Chat phases of `diurnal` arrive this many times faster than its rag phases: a chat request
# asks ~11x less prefill (160 against 1,750 prompt tokens on average) and about as much decode
# (96 against 56 tokens), so at 8x the chat phase is decode-bound where the rag phase is
# prefill-bound, at comparable total work.
DIURNAL_CHAT_RATE = 8.0
DIURNAL_PHASES = ("rag", "chat")
# Shared prefixes of `prefix`: few, so that at ~1 req/s each recurs every few seconds and a
# 60-s run measures reuse rather than first sights (~15 requests per prefix), and small enough
# together (at most 4 x 1,536 = 6,144 tokens of KV) that a worker's pool keeps them all beside
# its running requests: the run measures prefix-cache hits, not evictions (`--prefixes` raises
# the count for that).
PREFIX_COUNT = 4
WORKLOAD_HELP = {
    "chat": "short prompts (64-256 tokens), outputs 64-128: decode-heavy",
    "rag": "long prompts (1,500-2,000 tokens), outputs 48-64: prefill-heavy",
    "mixed": "chat, plus a burst of --burst-size rag prompts every --burst-every-s s",
    "fixed": "prompts of --input-len tokens, outputs of --output-len tokens",
    "diurnal": "--phase-s of rag at --rate, then of chat at 8x --rate, alternating",
    "prefix": "one of --prefixes prefixes (1,024-1,536 tokens) + 64-256 of its own, "
              "outputs 64-128",
}


@dataclass(frozen=True)
class RequestSpec:
    """One request of a trace: when it arrives (seconds from the start; ignored in closed
    loop), its prompt as token ids, and how many tokens it asks for (sent with ignore_eos).
    `prefix_id`: the shared prefix its prompt starts with (`prefix` workload; None: none), of
    `prefix_tokens` tokens (0 without one; else 1 <= prefix_tokens <= the prompt's tokens)."""

    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    prefix_id: int | None = None
    prefix_tokens: int = 0

    def __post_init__(self) -> None:
        if self.prefix_id is None:
            if self.prefix_tokens != 0:
                raise ValueError("prefix_tokens needs a prefix_id")
        elif self.prefix_id < 0 or not 1 <= self.prefix_tokens <= len(self.prompt_token_ids):
            raise ValueError(f"a prefix needs an id >= 0 and 1 <= prefix_tokens <= the prompt's "
                             f"tokens, got id {self.prefix_id}, {self.prefix_tokens} tokens")

    def prefix_fields(self) -> dict[str, int]:
        """{"prefix_id", "prefix_tokens"} for a request's record; empty without a prefix."""
        if self.prefix_id is None:
            return {}
        return {"prefix_id": self.prefix_id, "prefix_tokens": self.prefix_tokens}


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
SHARED_PREFIX = LengthRange(1024, 1536)
PREFIXED = Shape(LengthRange(64, 256), LengthRange(64, 128))  # the suffix after it, the output


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
    prefixes: int = PREFIX_COUNT  # prefix only

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
        if self.prefixes < 1:
            raise ValueError(f"prefixes must be >= 1, got {self.prefixes}")
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
        """Stream name -> shape (for `prefix`, the whole prompt: prefix + suffix); the names
        seed the streams' generators."""
        if self.kind == "prefix":
            p, s = SHARED_PREFIX, PREFIXED.prompt
            return {"prefixed": Shape(LengthRange(p.lo + s.lo, p.hi + s.hi), PREFIXED.output)}
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
        if self.kind == "prefix":
            out |= {"prefixes": self.prefixes}
        return out

    def _rng(self, stream: str, index: int | str) -> random.Random:
        return random.Random(f"pdserve-bench/{self.seed}/{stream}/{index}")

    def _specs(self, stream: str, times: Iterator[float]) -> Iterator[RequestSpec]:
        for i, t in enumerate(times):
            yield self._spec(stream, i, t)

    def _spec(self, stream: str, index: int, arrival_s: float) -> RequestSpec:
        if self.kind == "prefix":
            return self._prefixed(index, arrival_s)
        shape = self.shapes()[stream]
        lo, hi = token_id_range(self.vocab)
        rng = self._rng(stream, index)
        n_prompt, n_out = shape.prompt.draw(rng), shape.output.draw(rng)
        ids = tuple(rng.randrange(lo, hi) for _ in range(n_prompt))
        return RequestSpec(arrival_s=arrival_s, prompt_token_ids=ids, max_tokens=n_out)

    def _prefixed(self, index: int, arrival_s: float) -> RequestSpec:
        """Request `index` of `prefix`: shared prefix k (its generator's first draw), then its
        own suffix."""
        lo, hi = token_id_range(self.vocab)
        rng = self._rng("prefixed", index)
        k = rng.randrange(self.prefixes)
        n_suffix, n_out = PREFIXED.prompt.draw(rng), PREFIXED.output.draw(rng)
        prefix = shared_prefix(self.seed, self.vocab, k)
        suffix = tuple(rng.randrange(lo, hi) for _ in range(n_suffix))
        return RequestSpec(arrival_s=arrival_s, prompt_token_ids=prefix + suffix,
                           max_tokens=n_out, prefix_id=k, prefix_tokens=len(prefix))

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


@functools.cache
def shared_prefix(seed: int, vocab: int, k: int) -> tuple[int, ...]:
    """Shared prefix k of the `prefix` workload: SHARED_PREFIX tokens long, drawn from the
    generator seeded with (seed, "prefix", k) alone."""
    lo, hi = token_id_range(vocab)
    rng = random.Random(f"pdserve-bench/{seed}/prefix/{k}")
    return tuple(rng.randrange(lo, hi) for _ in range(SHARED_PREFIX.draw(rng)))


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
