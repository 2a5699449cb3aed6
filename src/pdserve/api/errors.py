"""Client-facing errors in OpenAI's shape.

An `ApiError` is the only exception the protocol layer raises for bad client input. Its
`status` is the HTTP status to answer with; `body()` is the JSON to send, always
`{"error": {"message", "type", "param", "code"}}` with `param` and `code` possibly null, so an
`openai` client raises the matching `APIStatusError` subclass with our message. `headers` go
with the response (`Retry-After` of a 429 or 503).
"""

from __future__ import annotations

import json
from typing import Any

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class ApiError(Exception):
    """An error reply: `status` (4xx/5xx), `message` for a person, `param` names the field."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r}, param={self.param!r})"


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def not_found_model(model: str, served: str) -> ApiError:
    return ApiError(
        404,
        f"The model `{model}` does not exist: this server serves `{served}`.",
        param="model",
        code="model_not_found",
    )


def message_of(body: bytes) -> str:
    """The message of an OpenAI-shaped error body, else the body's text (clipped): what a
    peer that refused a call said."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:500]
