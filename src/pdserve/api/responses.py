"""Response bodies and Server-Sent Events in exactly OpenAI's shapes.

Invariants:
- Every builder returns a fresh JSON-ready dict (str, int, float, bool, None, list, dict only);
  each validates against the matching `openai` SDK type, with one exception the OpenAI API
  itself has: a streamed completion chunk's `finish_reason` is null until the last chunk.
- One choice per response, always `index` 0 (requests with `n > 1` are refused upstream).
- Logprobs are finite: -inf (and NaN) become `LOGPROB_FLOOR`, OpenAI's "very unlikely", so the
  JSON stays valid. Token lists and logprob lists have equal lengths, else `ValueError`.
- `finish_reason` is passed through: "stop", "length", or None while streaming. The engine's
  "abort" is not an OpenAI value; callers end an aborted stream with `sse_error` instead.
- An event is `b"data: " + compact JSON (UTF-8, no NaN) + b"\\n\\n"`; a stream ends with
  `SSE_DONE`, also after an `sse_error` event (as vLLM does). `ChunkEncoder` writes a stream's
  chunks byte for byte as `sse_event` of the chunk builders does, with the envelope encoded once.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Mapping, Sequence
from itertools import accumulate
from typing import Any

from pdserve.api.errors import SERVER_ERROR, ApiError
from pdserve.api.protocol import Kind

LOGPROB_FLOOR = -9999.0
OWNED_BY = "pdserve"
SSE_DONE = b"data: [DONE]\n\n"

_ID_PREFIX: dict[str, str] = {"completion": "cmpl", "chat": "chatcmpl"}
_CHUNK_OBJECT: dict[str, str] = {"completion": "text_completion", "chat": "chat.completion.chunk"}

Json = dict[str, Any]
TopLogprobs = Sequence[Mapping[str, float]]


def new_request_id(kind: Kind) -> str:
    """`cmpl-<32 hex>` or `chatcmpl-<32 hex>`, random (uuid4)."""
    return f"{_ID_PREFIX[kind]}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Json:
    """OpenAI's usage object; `prompt_tokens_details.cached_tokens` is the part of the prompt
    served from the prefix cache of the worker that computed it."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


# ---- logprobs ---------------------------------------------------------------------------------


def _finite(logprob: float) -> float:
    return float(logprob) if math.isfinite(logprob) else LOGPROB_FLOOR


def _check_lengths(tokens: Sequence[str], logprobs: Sequence[float],
                   top: TopLogprobs | None) -> None:
    if len(logprobs) != len(tokens) or (top is not None and len(top) != len(tokens)):
        raise ValueError(
            f"logprobs need one entry per token: {len(tokens)} tokens, {len(logprobs)} logprobs, "
            f"{None if top is None else len(top)} top_logprobs"
        )


def completion_logprobs(tokens: Sequence[str], token_logprobs: Sequence[float],
                        top_logprobs: TopLogprobs | None = None, text_offset: int = 0) -> Json:
    """Completions' logprobs; `text_offset` is where `tokens[0]` starts in the choice's text
    (when streaming: the number of characters already sent)."""
    _check_lengths(tokens, token_logprobs, top_logprobs)
    offsets = list(accumulate((len(t) for t in tokens), initial=text_offset))[:-1]
    return {
        "tokens": list(tokens),
        "token_logprobs": [_finite(lp) for lp in token_logprobs],
        "top_logprobs": None if top_logprobs is None else [
            {token: _finite(lp) for token, lp in top.items()} for top in top_logprobs
        ],
        "text_offset": offsets,
    }


def _chat_token(token: str, logprob: float) -> Json:
    return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}


def chat_logprobs(tokens: Sequence[str], token_logprobs: Sequence[float],
                  top_logprobs: TopLogprobs | None = None) -> Json:
    """Chat's logprobs; `bytes` is the UTF-8 of each token string, alternatives keep their order."""
    _check_lengths(tokens, token_logprobs, top_logprobs)
    tops = top_logprobs if top_logprobs is not None else [{} for _ in tokens]
    return {
        "content": [
            {**_chat_token(token, lp), "top_logprobs": [_chat_token(t, v) for t, v in top.items()]}
            for token, lp, top in zip(tokens, token_logprobs, tops, strict=True)
        ]
    }


# ---- responses and chunks ---------------------------------------------------------------------


def _envelope(obj: str, request_id: str, model: str, created: int, choices: list[Json]) -> Json:
    return {"id": request_id, "object": obj, "created": created, "model": model,
            "choices": choices}


def _text_choice(text: str, finish_reason: str | None, logprobs: Json | None) -> Json:
    return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(request_id: str, model: str, created: int, text: str,
                        finish_reason: str, usage: Json, logprobs: Json | None = None) -> Json:
    choice = _text_choice(text, finish_reason, logprobs)
    return {**_envelope("text_completion", request_id, model, created, [choice]), "usage": usage}


def chat_response(request_id: str, model: str, created: int, text: str, finish_reason: str,
                  usage: Json, logprobs: Json | None = None) -> Json:
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": logprobs, "finish_reason": finish_reason}
    return {**_envelope("chat.completion", request_id, model, created, [choice]), "usage": usage}


def completion_chunk(request_id: str, model: str, created: int, text: str,
                     finish_reason: str | None, logprobs: Json | None = None) -> Json:
    choice = _text_choice(text, finish_reason, logprobs)
    return _envelope("text_completion", request_id, model, created, [choice])


def role_delta() -> Json:
    """The delta of a chat stream's first chunk."""
    return {"role": "assistant", "content": ""}


def chat_chunk(request_id: str, model: str, created: int, delta: Json,
               finish_reason: str | None, logprobs: Json | None = None) -> Json:
    """`delta` is `role_delta()` first, then `{"content": text}`; the last has a finish_reason."""
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope("chat.completion.chunk", request_id, model, created, [choice])


def usage_chunk(kind: Kind, request_id: str, model: str, created: int, usage: Json) -> Json:
    """The stream's last chunk when `stream_options.include_usage`: no choices, the usage."""
    return {**_envelope(_CHUNK_OBJECT[kind], request_id, model, created, []), "usage": usage}


def models_response(model: str, created: int, max_model_len: int) -> Json:
    entry = {"id": model, "object": "model", "created": created, "owned_by": OWNED_BY,
             "max_model_len": max_model_len}
    return {"object": "list", "data": [entry]}


# ---- Server-Sent Events -----------------------------------------------------------------------

_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sse_event(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + _JSON.encode(obj).encode("utf-8") + b"\n\n"


class ChunkEncoder:
    """The SSE events of one stream's text chunks: `encode(text, finish_reason, logprobs)` is
    `sse_event(completion_chunk(...))`, or for chat `sse_event(chat_chunk(..., {"content":
    text}, ...))`, byte for byte. A plain token chunk (no finish_reason, no logprobs) encodes
    only its text; the envelope around it was encoded once, by those same builders."""

    _MARK = "\x00text"  # stands for the text while the envelope is encoded

    def __init__(self, kind: Kind, request_id: str, model: str, created: int) -> None:
        self.kind, self.request_id, self.model, self.created = kind, request_id, model, created
        head, mark, tail = sse_event(self.chunk(self._MARK)).rpartition(
            _JSON.encode(self._MARK).encode("utf-8"))
        assert mark, "the text placeholder must appear in the chunk"
        self._head, self._tail = head, tail

    def chunk(self, text: str, finish_reason: str | None = None,
              logprobs: Json | None = None) -> Json:
        if self.kind == "chat":
            return chat_chunk(self.request_id, self.model, self.created, {"content": text},
                              finish_reason, logprobs)
        return completion_chunk(self.request_id, self.model, self.created, text, finish_reason,
                                logprobs)

    def encode(self, text: str, finish_reason: str | None = None,
               logprobs: Json | None = None) -> bytes:
        if finish_reason is None and logprobs is None:
            return self._head + _JSON.encode(text).encode("utf-8") + self._tail
        return sse_event(self.chunk(text, finish_reason, logprobs))


def sse_error(error: ApiError | str) -> bytes:
    """An error event ending a stream whose 200 header is already sent; a plain message is a
    server error. Send `SSE_DONE` after it."""
    if isinstance(error, str):
        error = ApiError(500, error, type=SERVER_ERROR)
    return sse_event(error.body())
