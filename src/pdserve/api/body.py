"""A request body read within `RequestLimits`: its size and its deadline.

- A `Content-Length` over `max_body_bytes` is refused (413) before a byte of the body is read;
  with `Expect: 100-continue` it is refused instead of answered "100 Continue", so the client
  never sends it. A body without a length (chunked) is refused once it grows past the limit.
- A body not complete `body_timeout_s` after the handler starts reading is refused (408); the
  connection is then closed, whatever the client still sends.
Refusals are `ApiError`s (OpenAI's error JSON); the connection of a 413 or 408 is not kept
alive (the unread body would otherwise be parsed as the next request).
"""

from __future__ import annotations

import asyncio

from aiohttp import HttpVersion11, hdrs, web

from pdserve.api.errors import ApiError
from pdserve.api.limits import RequestLimits


async def read_body(request: web.Request, limits: RequestLimits) -> bytes:
    """The whole body; raises ApiError 413 (too large) or 408 (too slow)."""
    length = request.content_length
    if length is not None and length > limits.max_body_bytes:
        raise too_large(limits, length)
    body = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > limits.max_body_bytes:
                    raise too_large(limits, None)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:g} "
                            f"s (--body-timeout)", code="request_timeout") from None
    return bytes(body)


def too_large(limits: RequestLimits, length: int | None) -> ApiError:
    size = f"of {length} bytes " if length is not None else ""
    return ApiError(413, f"the request body {size}is larger than this server's limit of "
                         f"{limits.max_body_bytes} bytes (--max-body-size)",
                    code="request_too_large")


def expect_handler(limits: RequestLimits):
    """An aiohttp route `expect_handler`: 413 for a declared body over the limit, "100 Continue"
    for the rest (what aiohttp's own handler does), 417 for another expectation."""

    async def expect(request: web.Request) -> web.StreamResponse | None:
        length = request.content_length
        if length is not None and length > limits.max_body_bytes:
            return refusal(too_large(limits, length))
        expectation = request.headers.get(hdrs.EXPECT, "")
        if request.version != HttpVersion11:
            return None
        if expectation.lower() != "100-continue":
            return refusal(ApiError(417, f"unknown Expect: {expectation!r}; only 100-continue "
                                         "is supported", code="expectation_failed"))
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # the interim response is not the response's size
        return None

    return expect


def refusal(error: ApiError) -> web.Response:
    """The error response for a request whose body is refused unread: the connection closes
    after it."""
    response = web.json_response(error.body(), status=error.status)
    response.force_close()
    return response
