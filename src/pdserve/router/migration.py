"""Moving a request's stream to another worker after its leg failed: what the client already
has, the leg that continues from there, and the relay that fits its events into the stream.

A continuation is a LOCAL leg whose prompt is the original prompt plus the output tokens the
client has up to the last point where their text was complete (`Delivered.resume_at`),
`max_tokens` reduced by as many, the same seed, and `output_offset` that many, so its worker
samples output position p where the first one would (seeded requests draw the same tokens;
greedy ones take the same argmax). Its events count from 0; `Relay` shifts them by the tokens
and characters the client had at that point, so the client's stream goes on where it paused.

Invariants:
- The client gets each position once: a continuation that starts before the client's last
  token (text held back for an incomplete UTF-8 character, or a token whose text is empty)
  repeats those tokens, the relay checks that they equal what was sent (else `Diverged`) and
  the stream assembler drops them.
- A stop string that starts in the text the client had and ends in the continuation's text is
  found here (the continuation's worker only sees its own text): the stream ends there with
  `stop`, cut as the engine would cut it.
Known limit: a continuation's prompt is recomputed, and prefill and decode arithmetic may
differ in the last bits; where that flips a near-tie among the repeated tokens the relay
raises `Diverged`, and later it would change a token the client has not seen yet (as a
decode worker's own recompute would).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from pdserve.common.sampling_params import SamplingParams
from pdserve.legs.protocol import EventBatch, LegKind, LegRequest, TokenEvent
from pdserve.router.leg_client import LegFailed
from pdserve.router.worker_pool import WorkerHandle


class WorkerFailed(Exception):
    """A leg of `kind` failed through `worker`'s fault: the request may move elsewhere."""

    def __init__(self, worker: WorkerHandle, kind: LegKind, error: LegFailed) -> None:
        super().__init__(str(error))
        self.worker, self.kind, self.error = worker, kind, error


class Diverged(LegFailed):
    """A continuation's repeated token differs from the one the client has: the stream cannot
    go on seamlessly."""


@dataclass
class Delivered:
    """What of one request went to the client, by absolute position, and the last point at
    which the text of every token sent was sent too (`resume_at`: tokens, characters). Points
    come from the events: an event's text completes every token but its last `held_tokens`
    (a token whose text waits for the rest of a character is no point: a continuation after
    it would start past a character the client has only partly, and lose its text)."""

    token_ids: list[int] = field(default_factory=list)
    chars: int = 0  # the text's length
    _parts: list[str] = field(default_factory=list)  # the text, joined when it is read
    # every point at which the text of every token sent was sent, oldest first
    _points: list[tuple[int, int]] = field(default_factory=lambda: [(0, 0)])

    @property
    def resume_at(self) -> tuple[int, int]:
        return self._points[-1]

    def resume_before(self, tokens: int) -> tuple[int, int]:
        """The last point at or before `tokens` at which every token's text was sent."""
        return max((p for p in self._points if p[0] <= tokens), default=(0, 0))

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    def add(self, batch: EventBatch) -> None:
        for event in batch:
            skip, skip_chars = len(self.token_ids) - event.index, self.chars - event.text_offset
            if skip < 0 or skip_chars < 0:
                raise ValueError(f"token events out of order: expected token "
                                 f"{len(self.token_ids)}, got {event.index}")
            self.token_ids += event.token_ids[skip:]
            if len(event.text) > skip_chars:
                self._parts.append(event.text[skip_chars:])
                self.chars += len(event.text) - skip_chars
            # the text so far is every token's before the ones the detokenizer holds back
            end = event.index + len(event.token_ids) - event.held_tokens
            if event.text and end > self.resume_at[0]:
                self._points.append((end, event.text_offset + len(event.text)))


def continuation(leg_id: str, prompt: Sequence[int], params: SamplingParams,
                 delivered: Delivered, before: int | None = None) -> tuple[LegRequest, Relay]:
    """The LOCAL leg that continues the request from `delivered.resume_at`, or from the last
    such point at or before output token `before`; and its relay."""
    tokens, chars = delivered.resume_at if before is None else delivered.resume_before(before)
    leg = LegRequest(leg_id, (*prompt, *delivered.token_ids[:tokens]),
                     dataclasses.replace(params, max_tokens=params.max_tokens - tokens),
                     output_offset=tokens)
    return leg, Relay(delivered, params, len(prompt), tokens, chars)


class Relay:
    """A leg's events in the request's positions; identity for a leg that starts at 0."""

    def __init__(self, delivered: Delivered, params: SamplingParams, prompt_tokens: int,
                 tokens: int = 0, chars: int = 0) -> None:
        self.sent = list(delivered.token_ids)  # what the client has: repeats must equal it
        self.params, self.prompt_tokens = params, prompt_tokens
        self.tokens, self.chars = tokens, chars
        self.longest = max((len(s) for s in params.stop), default=0)
        # the client's text where the leg starts, as far back as a stop string may span
        self.before = delivered.text[max(chars - self.longest, 0):chars] if self.sent else ""
        self.after = ""  # the leg's text so far, as long as a stop string may still span

    def __call__(self, batch: EventBatch) -> tuple[EventBatch, str | None]:
        """The batch's events up to the final one, shifted; and the worker's error, if an
        event reports one (the events before it still go). Raises Diverged."""
        out: EventBatch = []
        for event in batch:
            if event.error is not None:
                return out, event.error
            out.append(self._shift(event))
            if event.final:
                break
        return out, None

    def _shift(self, event: TokenEvent) -> TokenEvent:
        if not self.sent:
            return event  # a leg from the start: its positions are the request's
        event.index += self.tokens
        event.text_offset += self.chars
        if self.tokens:  # its prompt holds output tokens: the client's prompt is shorter
            event.prompt_tokens, event.cached_tokens = self.prompt_tokens, 0
        for i, token in enumerate(event.token_ids[:max(len(self.sent) - event.index, 0)]):
            if token != self.sent[event.index + i]:
                raise Diverged(f"the continuation sampled token {token} at position "
                               f"{event.index + i}, where the client has "
                               f"{self.sent[event.index + i]}")
        self._stop_across(event)
        return event

    def _stop_across(self, event: TokenEvent) -> None:
        """Ends the stream at a stop string that spans the point where the leg started."""
        if not event.text or len(self.after) >= self.longest - 1:
            return
        start = len(self.after)
        self.after += event.text
        found = spanning_stop(self.before, self.after, self.params.stop)
        if found is None:
            return
        at, stop = found  # where it starts in `before + after`
        keep = at + len(stop) if self.params.include_stop_str_in_output else at
        event.text = event.text[:max(keep - len(self.before) - start, 0)]
        event.finish_reason, event.stop_reason, event.final = "stop", stop, True


def spanning_stop(before: str, after: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string that starts in `before` and ends in `after`: its start in
    `before + after`, and the string (the first listed wins a tie, as in the engine)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        lo = max(len(before) - len(stop) + 1, 0)
        window = before[lo:] + after[:len(stop) - 1]
        found = window.find(stop)  # any match in this window starts in `before`
        if found != -1 and (best is None or lo + found < best[0]):
            best = (lo + found, stop)
    return best
