"""A request body read within `RequestLimits`: its size and its deadline.

- A `Content-Length` over `max_body_bytes` is refused (413) before a byte of the body is read;
  with `Expect: 100-continue` it is refused instead of answered "100 Continue", so the client
  never sends it. A body without a length (chunked) is refused once it grows past the limit.
- A body not complete `body_timeout_s` after the handler starts reading is refused (408); the
  connection is then closed, whatever the client still sends.
- A body larger than any request whose prompt fits the context could be (`useful_body_bytes`)
  is refused (413) the same way, before it is parsed: parsing JSON holds the GIL (10 MB of
  token ids: ~100 ms here, wherever it runs), so the bound keeps what one body can cost the
  event loop proportional to the model's context, not to the configured limit.
Refusals are `ApiError`s (OpenAI's error JSON); the connection of a 413 or 408 is not kept
alive (the unread body would otherwise be parsed as the next request).
"""

from __future__ import annotations

import asyncio

from aiohttp import HttpVersion11, hdrs, web

from pdserve.api.errors import ApiError
from pdserve.api.limits import RequestLimits

# Bytes of a request body beside its prompt and stop lists (model, sampling fields, chat
# roles and names), and per prompt token the JSON around it (a token id's digits and comma, a
# chat message's braces, indentation): generous, so no real request comes near the bound.
BODY_OVERHEAD_BYTES = 64 * 2**10
BYTES_AROUND_A_TOKEN = 32
BYTES_PER_CHAR = 12  # the longest JSON spelling of one character: a surrogate pair, \ud83d\ude00


def useful_body_bytes(limits: RequestLimits, max_model_len: int | None,
                      chars_per_token: int | None) -> int | None:
    """The most bytes a request whose prompt fits `max_model_len` tokens can need, or None
    when unknown. A prompt of T tokens has at most C * T characters (`char_bound.py`: N
    characters make at least N / C tokens), each at most 12 bytes as JSON; stop strings and
    stop token ids are bounded by `limits`:
        max_model_len * (12 * C + 32) + stops * (12 * stop_chars + 4) + stop_ids * 12 + 64 KiB
    """
    if max_model_len is None or chars_per_token is None:
        return None
    prompt = max_model_len * (BYTES_PER_CHAR * chars_per_token + BYTES_AROUND_A_TOKEN)
    stops = limits.max_stop_strings * (BYTES_PER_CHAR * limits.max_stop_string_chars + 4)
    return prompt + stops + 12 * limits.max_stop_token_ids + BODY_OVERHEAD_BYTES


async def read_body(request: web.Request, limits: RequestLimits, useful: int | None = None
                    ) -> bytes:
    """The whole body; raises ApiError 413 (over the limit, or over `useful`, the most a
    request that fits the context can need) or 408 (too slow)."""
    length = request.content_length
    if length is not None and length > limits.max_body_bytes:
        raise too_large(limits, length)
    if length is not None and useful is not None and length > useful:
        raise beyond_context(length, useful)
    most = limits.max_body_bytes if useful is None else min(useful, limits.max_body_bytes)
    body = bytearray()
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            while chunk := await request.content.readany():
                body += chunk
                if len(body) > most:
                    raise too_large(limits, None) if most == limits.max_body_bytes else \
                        beyond_context(None, most)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {limits.body_timeout_s:g} "
                            f"s (--body-timeout)", code="request_timeout") from None
    return bytes(body)


def too_large(limits: RequestLimits, length: int | None) -> ApiError:
    size = f"of {length} bytes " if length is not None else ""
    return ApiError(413, f"the request body {size}is larger than this server's limit of "
                         f"{limits.max_body_bytes} bytes (--max-body-size)",
                    code="request_too_large")


def beyond_context(length: int | None, useful: int) -> ApiError:
    size = f"of {length} bytes " if length is not None else ""
    return ApiError(413, f"the request body {size}is larger than any request whose prompt fits "
                         f"this model's context can be (at most {useful} bytes): shorten the "
                         f"prompt", code="request_too_large")


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
