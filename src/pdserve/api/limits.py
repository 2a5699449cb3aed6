"""What the OpenAI surface accepts from a client: sizes, counts, deadlines, and how chat content
is tokenized. One frozen `RequestLimits` per server (the router and every worker), set from the
command line with `add_limit_args` / `limits_from_args`.

Invariants: every count and size is >= 1, every deadline > 0 seconds; a request over a limit is
refused with OpenAI's error JSON naming the limit (413 for the body, 400 otherwise, 408 for a
body that does not arrive in time) before any of its work is done.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from enum import StrEnum

from pdserve.cli_args import parse_size


class SpecialTokensInContent(StrEnum):
    """How special-token text inside a chat message's content is tokenized."""

    TEXT = "text"  # as plain text: only the chat template writes control tokens
    PARSE = "parse"  # as the special tokens it spells (the tokenizer's own behaviour)


@dataclass(frozen=True)
class RequestLimits:
    # 16 MiB: a 1M-token context is about 4-8 MB of text or token ids as JSON, so no useful
    # prompt comes near it, while it bounds what a body can cost: memory (the bytes, then the
    # parsed objects) and the JSON parse, which holds the GIL (about 8 ms per 10 MB of one
    # string, about 100-200 ms per 10 MB of short strings).
    max_body_bytes: int = 16 * 2**20
    max_stop_strings: int = 32  # OpenAI allows 4; every one is searched after every token
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 64  # every generated token is looked up in this list
    # From the connection's opening or its previous response to the end of the next request's
    # headers; an idle kept-alive connection is closed after it too. Above the 60 s idle time of
    # common proxies and load balancers, so they, not this server, close idle connections.
    header_timeout_s: float = 75.0
    body_timeout_s: float = 60.0  # from the end of the headers to the end of the body
    special_tokens_in_content: SpecialTokensInContent = SpecialTokensInContent.TEXT

    def __post_init__(self) -> None:
        object.__setattr__(self, "special_tokens_in_content",
                           _content_mode(self.special_tokens_in_content))
        for name in _COUNTS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{_FLAGS[name]} must be an integer >= 1, got {value!r}")
        for name in _SECONDS:
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value < float("inf")):
                raise ValueError(f"{_FLAGS[name]} must be a number of seconds > 0, "
                                 f"got {value!r}")


def _content_mode(value: object) -> SpecialTokensInContent:
    try:
        return SpecialTokensInContent(value)
    except ValueError:
        raise ValueError(f"--special-tokens-in-content must be one of "
                         f"{', '.join(m.value for m in SpecialTokensInContent)}, got {value!r}"
                         ) from None


_FLAGS = {"max_body_bytes": "--max-body-size", "max_stop_strings": "--max-stop-strings",
          "max_stop_string_chars": "--max-stop-string-chars",
          "max_stop_token_ids": "--max-stop-token-ids", "header_timeout_s": "--header-timeout",
          "body_timeout_s": "--body-timeout",
          "special_tokens_in_content": "--special-tokens-in-content"}
_COUNTS = ("max_body_bytes", "max_stop_strings", "max_stop_string_chars", "max_stop_token_ids")
_SECONDS = ("header_timeout_s", "body_timeout_s")


def add_limit_args(p: argparse.ArgumentParser) -> None:
    d = RequestLimits()
    g = p.add_argument_group("request limits (the OpenAI endpoints)")
    g.add_argument("--max-body-size", default="16MiB", metavar="SIZE",
                   help="largest request body, e.g. 16MiB; larger ones get 413 before they are "
                        "read. A 1M-token prompt is about 4-8 MB as JSON: the limit bounds the "
                        "memory and the JSON parsing a body can cost, never a useful prompt "
                        "(default: %(default)s)")
    g.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, metavar="N",
                   help="most strings in a request's 'stop' (default: %(default)s)")
    g.add_argument("--max-stop-string-chars", type=int, default=d.max_stop_string_chars,
                   metavar="N", help="longest stop string in characters (default: %(default)s)")
    g.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids, metavar="N",
                   help="most ids in a request's 'stop_token_ids' (default: %(default)s)")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout_s,
                   metavar="SECONDS",
                   help="a connection whose next request's headers are not complete this long "
                        "after it opened or after its previous response is closed; idle "
                        "kept-alive connections are closed after it too (default: %(default)s)")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout_s, metavar="SECONDS",
                   help="a request body not complete this long after its headers gets 408 and "
                        "its connection is closed (default: %(default)s)")
    g.add_argument("--special-tokens-in-content", default=d.special_tokens_in_content.value,
                   choices=[m.value for m in SpecialTokensInContent],
                   help="chat messages: text (safe) tokenizes special-token strings written in "
                        "a message's content, e.g. '<|im_end|>', as plain text, so only the "
                        "chat template writes control tokens; parse turns them into the special "
                        "tokens they spell. /v1/completions prompts are always parsed: their "
                        "caller writes the whole prompt, special tokens included, as with vLLM "
                        "(default: %(default)s)")


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """Raises ValueError naming the flag for a bad value."""
    try:
        body = parse_size(args.max_body_size)
    except ValueError as e:
        raise ValueError(f"--max-body-size: {e}") from None
    return RequestLimits(
        max_body_bytes=body, max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_stop_token_ids=args.max_stop_token_ids, header_timeout_s=args.header_timeout,
        body_timeout_s=args.body_timeout,
        special_tokens_in_content=args.special_tokens_in_content)


def limits_to_args(limits: RequestLimits) -> list[str]:
    """The options that `limits_from_args` reads back as `limits` (what `pdserve up` passes
    to the router and every worker): only those that differ from the defaults."""
    default = RequestLimits()
    argv = []
    for name, flag in _FLAGS.items():
        value = getattr(limits, name)
        if value != getattr(default, name):
            argv += [flag, value.value if name == "special_tokens_in_content" else repr(value)]
    return argv


DEFAULT_LIMITS = RequestLimits()
