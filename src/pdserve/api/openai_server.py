"""The OpenAI-compatible endpoints, shared by the router and every worker.

`/v1/completions` and `/v1/chat/completions` validate the body (`protocol.py`), tokenize or
render the chat template, fit `max_tokens` to the context, and run the request through a
`generate` function: the worker's own engine, or the router's dispatcher. Its token events
become OpenAI responses: one JSON object, or Server-Sent Events (a role chunk first for chat,
a chunk per engine step, the finish_reason on the last, a usage chunk when
`stream_options.include_usage`, then `[DONE]`).

Writes: `generate` yields events one at a time or in batches (those that were ready together);
a batch's SSE events go out in one write, and no event waits for a later one. Before its first
events it may yield `ResponseHeaders`, which the response carries (the router's route header);
any yielded after the headers went out are dropped. The headers and
chat's role chunk go with the first token's chunk, and the last chunk, the usage chunk and
`[DONE]` with the end of the response.

Input: the body is read within `RequestLimits` (`body.py`: 413, 408, and `Expect:
100-continue` answered by its size), then parsed, validated, templated and tokenized by
`prepare.py`, on a thread when it is large so the loop keeps serving the other streams.

Errors: bad input is a 4xx with OpenAI's error JSON before anything else is sent; a failure
after the stream started ends it with an error event and `[DONE]`. The response headers are
sent with the first token, so a request that fails before producing one still gets a proper
status. A client that goes away cancels the handler, which closes `generate` (the legs are
cancelled through it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from pdserve.api import responses as R
from pdserve.api.assembler import Delta, StreamAssembler
from pdserve.api.body import expect_handler, read_body, refusal, useful_body_bytes
from pdserve.api.errors import ApiError
from pdserve.api.http_site import REQUEST_LIMITS
from pdserve.api.limits import DEFAULT_LIMITS, RequestLimits
from pdserve.api.prepare import Preparer
from pdserve.api.protocol import GenerateRequest
from pdserve.api.tokenizer_facts import TokenizerFacts
from pdserve.common.sampling_params import SamplingParams
from pdserve.legs.protocol import EventBatch, TokenEvent

log = logging.getLogger("pdserve.api")

SERVER_ERROR = "server_error"


class ResponseHeaders(dict[str, str]):
    """Headers for the response, yielded by a generate function before its first events."""


GenerateFn = Callable[[str, list[int], SamplingParams],
                      AsyncIterator[TokenEvent | EventBatch | ResponseHeaders]]


class GenerateError(Exception):
    """Raised by a generate function: the request failed with this HTTP status."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status

    def api_error(self) -> ApiError:
        kind = "invalid_request_error" if 400 <= self.status < 500 else SERVER_ERROR
        return ApiError(self.status, str(self), type=kind)


class OpenAIServer:
    """The endpoints of one process. `tokenizer` may be set later (a worker's, once its model
    is loaded; until then it is None and requests are refused before they get here): setting
    it computes its `TokenizerFacts` in the setting thread."""

    def __init__(self, served_model: str, tokenizer: Any,
                 max_model_len: Callable[[], int | None], generate: GenerateFn,
                 metrics: Any = None, limits: RequestLimits = DEFAULT_LIMITS) -> None:
        self.served_model = served_model
        self.max_model_len = max_model_len  # returns None while not known (no worker ready)
        self.generate = generate
        self.metrics = metrics  # has ttft, itl, e2e histograms and a responses counter, or None
        self.limits = limits
        self.tokenizer = tokenizer

    @property
    def tokenizer(self) -> Any:
        return self._preparer.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer: Any) -> None:
        facts = TokenizerFacts.of(tokenizer, self.limits.special_tokens_in_content)
        self._preparer = Preparer(self.served_model, tokenizer, facts, self.limits)

    def add_routes(self, app: web.Application) -> None:
        """The endpoints, and this server's limits for `http_site.start_site` (the header
        deadline)."""
        expect = expect_handler(self.limits)
        app.router.add_post("/v1/completions", self.completions, expect_handler=expect)
        app.router.add_post("/v1/chat/completions", self.chat, expect_handler=expect)
        app.router.add_get("/v1/models", self.models)
        app[REQUEST_LIMITS] = self.limits

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(R.models_response(self.served_model, int(time.time()),
                                                   self.max_model_len() or 0))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat")

    async def _handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        t0 = time.perf_counter()
        try:
            raw = await read_body(request, self.limits, useful_body_bytes(
                self.limits, self.max_model_len(), self._preparer.facts.chars_per_token))
        except ApiError as e:
            return await self._refuse_body(request, e)
        try:
            req, prompt, params = await self._preparer.prepare(raw, kind, self.max_model_len)
        except ApiError as e:
            return self.error_response(e)
        request_id = R.new_request_id(kind)
        run = _Run(self, req, request_id, len(prompt), params.max_tokens, t0)
        events = self.generate(request_id, prompt, params)
        async with contextlib.aclosing(events):
            try:
                if req.stream:
                    return await run.stream(request, events)
                return await run.collect(events)
            except GenerateError as e:
                return await run.fail(request, e.api_error())
            except ValueError as e:
                log.exception("request %s: inconsistent token events", request_id)
                return await run.fail(request, ApiError(500, str(e), type=SERVER_ERROR))
            except asyncio.CancelledError:
                log.info("request %s: cancelled (the client went away, or shutdown)", request_id)
                raise

    async def _refuse_body(self, request: web.Request, e: ApiError) -> web.StreamResponse:
        """A body refused unread: a 413 lets the client finish sending (aiohttp reads and
        drops the rest for a while) so it sees the answer; after a 408 the connection is
        closed at once."""
        if self.metrics is not None:
            self.metrics.responses.inc(status=str(e.status))
        response = refusal(e)
        if e.status == 408:
            await response.prepare(request)
            await response.write_eof()
            if request.transport is not None:
                request.transport.close()
        return response

    def error_response(self, e: ApiError) -> web.Response:
        """An error response (nothing else was sent), with the error's headers."""
        if self.metrics is not None:
            self.metrics.responses.inc(status=str(e.status))
        return web.json_response(e.body(), status=e.status, headers=e.headers)

    def token_strings(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in ids]


class _Run:
    """One request's response, streamed or collected.

    Streaming: `_take` turns the events of a batch into SSE events (`_unsent`), `_flush` writes
    them with one write; the response (headers, chat's role chunk) opens with the first one.
    The request is logged once, when it ends (off the path of its tokens)."""

    def __init__(self, server: OpenAIServer, req: GenerateRequest, request_id: str,
                 prompt_tokens: int, max_tokens: int, t0: float) -> None:
        self.server, self.req, self.request_id = server, req, request_id
        self.prompt_tokens, self.max_tokens, self.t0 = prompt_tokens, max_tokens, t0
        self.created = int(time.time())
        self.out = StreamAssembler()
        self.chunks = R.ChunkEncoder(req.kind, request_id, req.model, self.created)
        self.response: web.StreamResponse | None = None
        self.headers: dict[str, str] = {}  # from generate's ResponseHeaders
        self._unsent: list[bytes] = []  # SSE events not written yet
        self._last_token_at: float | None = None

    async def collect(self, events: AsyncIterator[TokenEvent | EventBatch | ResponseHeaders]
                      ) -> web.Response:
        async for item in events:
            if self._take(item):
                break
        r, out = self.req, self.out
        lp = self._logprobs(Delta(out.token_ids, out.text, out.logprobs, out.top_logprobs), 0)
        args = (self.request_id, r.model, self.created, out.text, out.finish_reason or "abort",
                self._usage(), lp)
        body = R.chat_response(*args) if r.kind == "chat" else R.completion_response(*args)
        self._done(200)
        return web.json_response(body, headers=self.headers)

    async def stream(self, request: web.Request,
                     events: AsyncIterator[TokenEvent | EventBatch | ResponseHeaders]
                     ) -> web.StreamResponse:
        async for item in events:
            if self._take(item):
                break
            await self._flush(request)
        if self.req.include_usage:
            self._unsent.append(R.sse_event(R.usage_chunk(
                self.req.kind, self.request_id, self.req.model, self.created, self._usage())))
        self._unsent.append(R.SSE_DONE)
        await self._flush(request, eof=True)
        self._done(200)
        return self.response

    async def fail(self, request: web.Request, error: ApiError) -> web.StreamResponse:
        """End with `error`: an error response if nothing was sent yet, else the events not
        sent yet, an error event and `[DONE]`."""
        if self.response is None and not self._unsent:
            log.info("request %s: %s, %d prompt tokens: error %d: %s", self.request_id,
                     self.req.kind, self.prompt_tokens, error.status, error.message)
            return self.server.error_response(error)
        log.warning("request %s ends with an error: %s", self.request_id, error.message)
        self._unsent += [R.sse_error(error), R.SSE_DONE]
        with contextlib.suppress(ConnectionError):
            await self._flush(request, eof=True)
        self._done(500)
        return self.response

    def _take(self, item: TokenEvent | EventBatch | ResponseHeaders) -> bool:
        """Add events that were ready together (when streaming, their SSE events to `_unsent`);
        True once the final one is in."""
        if isinstance(item, ResponseHeaders):
            if self.response is None:
                self.headers.update(item)
            return False
        for event in item if isinstance(item, list) else (item,):
            self._check(event)
            text_before = len(self.out.text)
            delta = self.out.add(event)
            self._timing(delta)
            if self.req.stream and (delta.token_ids or delta.text or
                                    event.finish_reason is not None):
                self._unsent.append(self._chunk(delta, text_before, event))
            if event.final:
                return True
        return False

    async def _flush(self, request: web.Request, eof: bool = False) -> None:
        """Write the unsent events in one write (with `eof`, the response's last)."""
        if self.response is None:
            if not (self._unsent or eof):
                return
            await self._open(request)
        data = b"".join(self._unsent)
        self._unsent.clear()
        if eof:
            await self.response.write_eof(data)
        elif data:
            await self.response.write(data)

    async def _open(self, request: web.Request) -> None:
        """Send the headers (they go out with the first write) and queue chat's role chunk
        before the first events."""
        self.response = web.StreamResponse(headers={
            **self.headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Request-Id": self.request_id})
        await self.response.prepare(request)
        if self.req.kind == "chat":
            self._unsent.insert(0, R.sse_event(R.chat_chunk(
                self.request_id, self.req.model, self.created, R.role_delta(), None)))

    def _chunk(self, delta: Delta, text_before: int, event: TokenEvent) -> bytes:
        finish = self.out.finish_reason if event.finish_reason else None
        lp = self._logprobs(delta, text_before) if delta.token_ids else None
        return self.chunks.encode(delta.text, finish, lp)

    def _logprobs(self, delta: Delta, text_offset: int) -> dict[str, Any] | None:
        if self.req.logprobs is None or delta.logprobs is None:
            return None
        tokens = self.server.token_strings(delta.token_ids)
        lps = [lp if lp is not None else float("-inf") for lp in delta.logprobs]
        tops = None
        if self.req.logprobs > 0 and delta.top_logprobs is not None:
            tops = [{self.server.tokenizer.decode([t]): v for t, v in (top or {}).items()}
                    for top in delta.top_logprobs]
        if self.req.kind == "chat":
            return R.chat_logprobs(tokens, lps, tops)
        return R.completion_logprobs(tokens, lps, tops, text_offset)

    def _usage(self) -> dict[str, Any]:
        return R.usage(self.prompt_tokens, len(self.out.token_ids), self.out.cached_tokens)

    def _check(self, event: TokenEvent) -> None:
        if event.error is not None:
            raise GenerateError(event.error)

    def _timing(self, delta: Delta) -> None:
        m = self.server.metrics
        if m is None or not delta.token_ids:
            return
        now = time.perf_counter()
        if self._last_token_at is None:
            m.ttft.observe(now - self.t0)
        else:
            m.itl.observe((now - self._last_token_at) / len(delta.token_ids))
        self._last_token_at = now

    def _done(self, status: int) -> None:
        seconds = time.perf_counter() - self.t0
        if self.server.metrics is not None:
            self.server.metrics.responses.inc(status=str(status))
            self.server.metrics.e2e.observe(seconds)
        log.info("request %s: %s, %d prompt tokens, %d of max_tokens %d%s: %s, %.1f ms",
                 self.request_id, self.req.kind, self.prompt_tokens, len(self.out.token_ids),
                 self.max_tokens, ", streamed" if self.req.stream else "",
                 self.out.finish_reason or f"status {status}", 1e3 * seconds)
