"""The internal protocol between the router and a worker: one leg of a request.

A leg is a `LegRequest` (JSON) sent on the router's leg channel to the worker
(`legs/frames.py`); the answer is a stream of `TokenEvent` JSON lines, the last one `final`.
Leg kinds:
- LOCAL: the worker runs the whole request (collocated, or a short prompt on decode).
- PREFILL: compute the prompt, sample token 0, send it as the one event, and move the KV to
  the decode worker `peer` under `transfer_id` (in the background, after the stream ended).
- DECODE: reserve blocks, take the KV from the prefill worker `peer`, continue from token 0.
  If the transfer fails, the worker recomputes the prompt itself (same seed, same tokens).

`output_offset`: the leg continues a request whose first `output_offset` output tokens are the
last tokens of its prompt (the router moved it off a failed worker, or one that changed role);
it samples output position `output_offset + k` where it would sample `k`, so a seeded request
draws the tokens the first worker would have. Its events still count from 0 (the router shifts
them). A split continuation gives its PREFILL and DECODE legs the same offset.

A final event with `extra.moved` (and no error) hands the leg back: the worker stopped it after
the tokens it sent (it changed role), keeping its KV parked for a while, and the router
continues the request elsewhere. `resume` (PREFILL legs only) names such a leg on the same
worker: when its KV is still parked there and covers the prompt, that KV is sent and the token
after the prompt is token 0, nothing computed (so the continuation's tokens are those of the
undisturbed run); otherwise the prompt is computed as for any prefill.

Events carry absolute positions (`index` of the first token, `text_offset` of the text), so the
router can merge the prefill and decode streams of one request and drop what it has already
sent (the decode stream repeats token 0). The router reads a leg's events in `EventBatch`es:
the events that arrived together, so that their SSE events go to the client in one write.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from pdserve.common.sampling_params import SamplingParams
from pdserve.transfer.peer import PeerId
from pdserve.transfer.wire import hex64, parse_hex64

# A final event's extra key: the worker handed the leg back (it changed role); the router
# continues the request elsewhere from the tokens it has.
MOVED = "moved"


class LegKind(StrEnum):
    LOCAL = "local"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class LegRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    kind: LegKind = LegKind.LOCAL
    transfer_id: int | None = None
    peer: PeerId | None = None  # the other worker's transfer endpoint
    output_offset: int = 0  # output tokens already in the prompt's tail (a continuation)
    resume: str | None = None  # a PREFILL leg: the handed-back leg whose parked KV to send
    # seconds the request had waited at the router when the leg was sent (its queue, earlier
    # legs): the worker counts a prompt's wait for its first token from its arrival there
    waited_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("a leg needs a non-empty string request_id")
        object.__setattr__(self, "kind", LegKind(self.kind))
        remote = self.kind is not LegKind.LOCAL
        if remote != (self.transfer_id is not None) or remote != (self.peer is not None):
            raise ValueError(f"a {self.kind.value} leg needs transfer_id and peer exactly when "
                             "it is a prefill or decode leg")
        if self.resume is not None and (self.kind is not LegKind.PREFILL or
                                        not isinstance(self.resume, str) or not self.resume):
            raise ValueError("resume names a handed-back leg (a non-empty string), on a "
                             "prefill leg only")
        self._check_offset()
        w = self.waited_s
        if isinstance(w, bool) or not isinstance(w, int | float) or not 0 <= w < math.inf:
            raise ValueError(f"waited_s must be a finite number of seconds >= 0, got {w!r}")

    def _check_offset(self) -> None:
        n, prompt = self.output_offset, len(self.prompt_token_ids)
        if type(n) is not int or n < 0 or (n and n >= prompt):
            raise ValueError(f"output_offset must be an int in [0, {prompt}) (output tokens "
                             f"at the end of the prompt), got {n!r}")

    def to_json(self) -> dict[str, Any]:
        params = {f.name: getattr(self.params, f.name) for f in fields(self.params)}
        params["stop"], params["stop_token_ids"] = list(params["stop"]), list(
            params["stop_token_ids"])
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "params": params,
            "kind": self.kind.value,
            "transfer_id": None if self.transfer_id is None else hex64(self.transfer_id),
            "peer": None if self.peer is None else self.peer.to_json(),
            "output_offset": self.output_offset,
            "resume": self.resume,
            "waited_s": self.waited_s,
        }

    @classmethod
    def from_json(cls, obj: Any) -> LegRequest:
        """Raises ValueError naming what is wrong."""
        if not isinstance(obj, dict):
            raise ValueError("a leg request is a JSON object")
        try:
            params = SamplingParams(**obj["params"])
            tid = obj.get("transfer_id")
            peer = obj.get("peer")
            ids = obj["prompt_token_ids"]
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise ValueError("prompt_token_ids must be a list of ints")
            return cls(obj["request_id"], tuple(ids), params, LegKind(obj.get("kind", "local")),
                       None if tid is None else parse_hex64("transfer_id", tid),
                       None if peer is None else PeerId.from_json(peer),
                       obj.get("output_offset", 0), obj.get("resume"),
                       obj.get("waited_s", 0.0))
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed leg request: {e!r}") from e


@dataclass
class TokenEvent:
    """New tokens of one leg: output tokens [index, index + len(token_ids)), and text
    [text_offset, text_offset + len(text)) of the output text. The text up to
    text_offset + len(text) is the whole text of the output tokens before the last
    `held_tokens` (the worker's detokenizer holds their text back until a character completes;
    they may be this event's or earlier ones')."""

    index: int
    token_ids: list[int]
    text_offset: int
    text: str
    logprobs: list[float | None] | None = None
    top_logprobs: list[dict[int, float] | None] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None
    held_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    final: bool = False  # the last event of this leg
    error: str | None = None  # the leg failed (final)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_line(self) -> bytes:
        """One JSON line holding the position fields and every other field that differs from
        its default (most events are one token and nothing else: a short line, ~4x cheaper
        than encoding every field)."""
        d: dict[str, Any] = {"index": self.index, "token_ids": self.token_ids,
                             "text_offset": self.text_offset, "text": self.text}
        for name, default in _OPTIONAL_DEFAULTS:
            value = getattr(self, name)
            if value != default:
                d[name] = value
        if self.top_logprobs is not None:
            d["top_logprobs"] = [None if t is None else {str(k): v for k, v in t.items()}
                                 for t in self.top_logprobs]
        return json.dumps(d, separators=(",", ":")).encode() + b"\n"

    @classmethod
    def from_line(cls, line: bytes) -> TokenEvent:
        d = json.loads(line)
        if d.get("top_logprobs") is not None:
            d["top_logprobs"] = [None if t is None else {int(k): v for k, v in t.items()}
                                 for t in d["top_logprobs"]]
        return cls(**d)


# (field, default) of every TokenEvent field after the four that place it
_OPTIONAL_DEFAULTS = (("logprobs", None), ("top_logprobs", None), ("finish_reason", None),
                      ("stop_reason", None), ("held_tokens", 0), ("prompt_tokens", 0),
                      ("cached_tokens", 0), ("final", False), ("error", None), ("extra", {}))


EventBatch = list[TokenEvent]  # events of one stream that were ready together, in order
