"""The streaming `/v1/completions` client of `pdserve bench serve`: plain OpenAI HTTP, so it
measures pdserve, vLLM and SGLang alike.

Body: {"model", "prompt": [token ids], "max_tokens", "temperature": 0, "ignore_eos": true,
"stream": true, "stream_options": {"include_usage": true}}.

Invariants of a `RequestRecord`:
- Times are `time.perf_counter()` seconds: `send_s` just before the POST, one entry of
  `token_times_s` per event whose first choice has a non-empty `text` (taken when its line
  was read, before parsing), `end_s` when the stream ended ([DONE], failure or timeout).
- `output_tokens` is the last `usage.completion_tokens` seen, else the number of text events
  (a server may put several tokens in one event; usage counts them right).
- `error` is None exactly when the request succeeded: HTTP 200, at least one text event, no
  error event, and `data: [DONE]` before the stream closed. Otherwise it says why: "HTTP 400:
  <the server's message>", "error event: <message>", "timeout after T s" (the whole request,
  `timeout_s`), "connection error: ...", "stream ended without [DONE]", "no token before
  [DONE]", "bad event: ...".
- `route` is the response's `X-Pdserve-Route` header (pdserve's router: the path that served
  the request and the rule that chose it, e.g. "disaggregated; rule=measured_cost"), None
  where the server sent none (another server, a worker alone, a request refused before it).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from pdserve.bench.serve.workloads import RequestSpec
from pdserve.router.path_choice import ROUTE_HEADER

MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw of one request (see the module docstring)."""

    prompt_tokens: int
    max_tokens: int
    send_s: float
    token_times_s: tuple[float, ...]
    end_s: float
    output_tokens: int
    error: str | None = None
    route: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def completions_url(url: str) -> str:
    """The completions endpoint under a base URL given as the server root or ending in /v1:
    http://h:8000 and http://h:8000/v1/ both give http://h:8000/v1/completions."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ValueError(f"url must start with http:// or https://, got {url!r}")
    return (base if base.endswith("/v1") else base + "/v1") + "/completions"


def request_body(model: str, spec: RequestSpec) -> dict[str, Any]:
    return {"model": model, "prompt": list(spec.prompt_token_ids),
            "max_tokens": spec.max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


@dataclass
class _Stream:
    """What one response stream has shown so far."""

    token_times_s: list[float] = field(default_factory=list)
    completion_tokens: int | None = None
    done: bool = False
    route: str | None = None

    def feed(self, line: bytes, now: float) -> str | None:
        """Take one SSE line; returns an error message, else None."""
        line = line.strip()
        if not line.startswith(b"data:"):
            return None  # blank separators, comments, other SSE fields
        data = line[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return None if self.token_times_s else "no token before [DONE]"
        try:
            event = json.loads(data)
        except ValueError:
            return "bad event: " + _clip(data.decode("utf-8", "replace"))
        return self._take(event, now)

    def _take(self, event: Any, now: float) -> str | None:
        if not isinstance(event, dict):
            return "bad event: " + _clip(json.dumps(event))
        message = _error_message(event)
        if message is not None:
            return "error event: " + message
        choices = event.get("choices") or []
        if choices and isinstance(choices[0], dict) and choices[0].get("text"):
            self.token_times_s.append(now)
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.completion_tokens = usage["completion_tokens"]
        return None


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS] + "..."


def _error_message(body: dict[str, Any]) -> str | None:
    """The message of an OpenAI error body {"error": {"message"}} (or a bare {"object":
    "error", "message"}), else None."""
    error = body.get("error")
    if isinstance(error, dict):
        return _clip(str(error.get("message", error)))
    if error is not None:
        return _clip(str(error))
    if body.get("object") == "error":
        return _clip(str(body.get("message", body)))
    return None


async def _http_error(resp: aiohttp.ClientResponse) -> str:
    text = await resp.text(errors="replace")
    try:
        body = json.loads(text)
        message = _error_message(body) if isinstance(body, dict) else None
    except ValueError:
        message = None
    return f"HTTP {resp.status}: {message if message is not None else _clip(text)}"


async def _exchange(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                    stream: _Stream) -> str | None:
    async with session.post(url, json=body) as resp:
        stream.route = resp.headers.get(ROUTE_HEADER)
        if resp.status != 200:
            return await _http_error(resp)
        async for line in resp.content:
            error = stream.feed(line, time.perf_counter())
            if error is not None or stream.done:
                return error
    return "stream ended without [DONE]"


async def send_request(session: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec,
                       timeout_s: float) -> RequestRecord:
    """Send one streamed completion to `url` (the full completions URL) and record it; never
    raises for a failed request (cancellation passes through)."""
    stream = _Stream()
    send_s = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            error = await _exchange(session, url, request_body(model, spec), stream)
    except TimeoutError:
        error = f"timeout after {timeout_s:g} s"
    except aiohttp.ClientError as exc:
        error = _clip(f"connection error: {type(exc).__name__}: {exc}")
    except Exception as exc:  # a bench survives any one bad response
        error = _clip(f"{type(exc).__name__}: {exc}")
    end_s = time.perf_counter()
    count = stream.completion_tokens
    return RequestRecord(
        prompt_tokens=len(spec.prompt_token_ids), max_tokens=spec.max_tokens, send_s=send_s,
        token_times_s=tuple(stream.token_times_s), end_s=end_s,
        output_tokens=len(stream.token_times_s) if count is None else count, error=error,
        route=stream.route)
