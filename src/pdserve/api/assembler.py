"""One request's output, assembled from the token events of one or more legs: the OpenAI
server turns a request's legs into the client's stream with it (the legs' protocol: `legs/`).

Events carry absolute positions, so a repeated token (the decode leg repeats the prefill's
token 0; a recompute repeats everything) is dropped, and what is new is exactly what the
client has not seen. Invariant: `token_ids` and `text` only grow, each position once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.legs.protocol import TokenEvent


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    logprobs: list[float | None] | None
    top_logprobs: list[dict[int, float] | None] | None


@dataclass
class StreamAssembler:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    cached_tokens: int = 0

    def add(self, event: TokenEvent) -> Delta:
        """What `event` adds; raises ValueError if it skips positions (a lost event)."""
        skip = len(self.token_ids) - event.index
        skip_chars = len(self.text) - event.text_offset
        if skip < 0 or skip_chars < 0:
            raise ValueError(f"token events out of order: expected token {len(self.token_ids)} "
                             f"and char {len(self.text)}, got {event.index} and "
                             f"{event.text_offset}")
        ids = event.token_ids[skip:]
        text = event.text[skip_chars:]
        lps = event.logprobs[skip:] if event.logprobs is not None else None
        tops = event.top_logprobs[skip:] if event.top_logprobs is not None else None
        self.token_ids += ids
        self.text += text
        self.logprobs += lps or []
        self.top_logprobs += tops or []
        self.cached_tokens = max(self.cached_tokens, event.cached_tokens)
        if event.finish_reason is not None:
            self.finish_reason, self.stop_reason = event.finish_reason, event.stop_reason
        return Delta(ids, text, lps, tops)
