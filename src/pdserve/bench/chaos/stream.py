"""One streamed OpenAI response as `pdserve bench chaos` sees it, and what it came to.

`SseReader` takes the response's lines: a token is an event whose first choice carries text
(`text` of a completion, `delta.content` of a chat chunk); an error event is an object with an
`error` key; `data: [DONE]` ends the stream. `classify` names the outcome:

- ok: HTTP 200, at least one token, no error event, `[DONE]` before the connection ended;
- failed (a clean error): an HTTP error status, or an error event (whatever came after it);
- hung: no byte for longer than the idle bound, before the stream ended (the client cut it);
- broken: anything else: the connection ended or was reset without `[DONE]` or an error
  event, `[DONE]` without a token, an event that is not JSON.
The detail says why, for everything but ok.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any

MAX_DETAIL_CHARS = 300


class Outcome(StrEnum):
    OK = "ok"
    FAILED = "failed"
    BROKEN = "broken"
    HUNG = "hung"


class End(Enum):
    """How the client stopped reading: the server ended the response (EOF, or `[DONE]` /
    an error event read), the connection failed, or the idle bound passed."""

    EOF = "eof"
    CONNECTION = "connection"
    IDLE = "idle"


@dataclass
class SseReader:
    """What one response stream has shown so far; times are the caller's clock."""

    token_times_s: list[float] = field(default_factory=list)
    error: str | None = None
    done: bool = False
    bad_event: str | None = None

    @property
    def finished(self) -> bool:
        """True once nothing more is worth reading: `[DONE]`, an error or a bad event."""
        return self.done or self.error is not None or self.bad_event is not None

    def feed(self, line: bytes, now_s: float) -> None:
        line = line.strip()
        if not line.startswith(b"data:") or self.finished:
            return
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            self.bad_event = clip(data.decode("utf-8", "replace"))
            return
        if not isinstance(event, dict):
            self.bad_event = clip(json.dumps(event))
        elif "error" in event:
            self.error = error_message(event)
        elif _has_text(event):
            self.token_times_s.append(now_s)


def _has_text(event: dict[str, Any]) -> bool:
    choices = event.get("choices") or []
    first = choices[0] if choices and isinstance(choices[0], dict) else {}
    delta = first.get("delta")
    return bool(first.get("text") or (isinstance(delta, dict) and delta.get("content")))


def clip(text: str) -> str:
    return text if len(text) <= MAX_DETAIL_CHARS else text[:MAX_DETAIL_CHARS] + "..."


def error_message(body: object) -> str:
    """The message of OpenAI's {"error": {"message"}}, else the body itself, clipped."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and "message" in error:
        return clip(str(error["message"]))
    return clip(json.dumps(body) if error is None else str(error))


def http_error(status: int, text: str) -> str:
    """'HTTP 503: <the message of the OpenAI error body>' (the raw text if it is not one)."""
    try:
        message = error_message(json.loads(text))
    except ValueError:
        message = clip(text)
    return f"HTTP {status}: {message}"


def classify(status: int | None, reader: SseReader, end: End, detail: str = ""
             ) -> tuple[Outcome, str]:
    """The outcome of a request and why (see the module docstring). `status` is None when no
    response headers came; `detail` is the HTTP error text (`http_error`) when status is not
    200, the idle bound ("15 s") for End.IDLE, the error for End.CONNECTION."""
    if status is not None and status != 200:
        return Outcome.FAILED, detail or f"HTTP {status}"
    if reader.error is not None:
        return Outcome.FAILED, "error event: " + reader.error
    if reader.bad_event is not None:
        return Outcome.BROKEN, "bad event: " + reader.bad_event
    if reader.done:
        if reader.token_times_s:
            return Outcome.OK, ""
        return Outcome.BROKEN, "[DONE] without a token"
    if end is End.IDLE:
        where = "before the response headers" if status is None else \
            f"after {len(reader.token_times_s)} tokens"
        return Outcome.HUNG, f"no byte for {detail or 'the idle bound'} {where}"
    if end is End.CONNECTION:
        return Outcome.BROKEN, "connection failed: " + (detail or "?")
    return Outcome.BROKEN, "the stream ended without [DONE] or an error event"
