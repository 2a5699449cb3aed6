"""From a request body to (request, prompt ids, sampling params) without stalling the event
loop that serves every other stream.

Where the work runs, from measurements on this machine (2 shared cores, SmolLM2's tokenizer):
- a hop to a thread and back (`run_in_executor` of a no-op) costs ~50 us median, ~100 us P90;
- parsing, templating and tokenizing a chat body on the loop stalls it ~0.35 ms per KiB of
  text (0.2 ms at 512 B, 1.5 ms at 4 KiB, 8.5 ms at 16 KiB, 67 ms at 64 KiB);
- the tokenizer's `encode` holds the GIL even on a thread (5 MB: a 4.3 s loop stall); its
  `encode_batch` does not (`prompt_ids.encode_with`);
- `json.loads` holds the GIL wherever it runs: 8-20 ms for 10 MB of one string, 100-220 ms for
  10 MB of short strings (the body limit bounds it).
So a prompt text over `INLINE_TEXT_CHARS` (4096: ~1.5 ms on the loop, where the hop is under
7% of the work it moves) is templated and tokenized on a thread without the GIL, and a body
over `INLINE_BODY_BYTES` (64 KiB: its parse costs ~0.1 ms) is also parsed and validated there
(Python-level validation lets the loop in at every switch interval, 5 ms). Token-id prompts and
ordinary chat messages stay on the loop and pay no hop.

A text prompt that cannot fit the context in any tokenization (`char_bound`) is refused before
the tokenizer sees it, so a thread's tokenizing is bounded by the context too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from pdserve.api.char_bound import min_tokens
from pdserve.api.errors import SERVER_ERROR, ApiError
from pdserve.api.limits import RequestLimits
from pdserve.api.prompt_ids import encode_prompt
from pdserve.api.protocol import (
    GenerateRequest,
    Kind,
    Message,
    parse_chat,
    parse_completion,
    parse_json,
    render_chat_text,
)
from pdserve.api.tokenizer_facts import TokenizerFacts
from pdserve.common.sampling_params import SamplingParams

INLINE_BODY_BYTES = 64 * 2**10
INLINE_TEXT_CHARS = 4096
# Two threads: a long prompt being tokenized does not hold up the next one entirely, and the
# two together use at most the cores a router or a worker has to spare. Threads live as long as
# the process.
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdserve-prepare")
T = TypeVar("T")


@dataclass(frozen=True)
class Preparer:
    """One server's request preparation, for one tokenizer (None: not loaded yet)."""

    served_model: str
    tokenizer: Any
    facts: TokenizerFacts
    limits: RequestLimits

    async def prepare(self, raw: bytes, kind: Kind, max_model_len: Callable[[], int | None]
                      ) -> tuple[GenerateRequest, list[int], SamplingParams]:
        """Raises ApiError for bad input, and 503 while the context length is unknown."""
        req = await _run(len(raw) > INLINE_BODY_BYTES, self.parse, raw, kind)
        max_len = max_model_len()
        if max_len is None:
            raise ApiError(503, "no worker is ready yet; retry shortly", type=SERVER_ERROR)
        off_loop = _text_chars(req) > INLINE_TEXT_CHARS
        ids = await _run(off_loop, self.prompt_ids, req, max_len, off_loop)
        return req, ids, req.params_for_context(len(ids), max_len)

    def parse(self, raw: bytes, kind: Kind) -> GenerateRequest:
        parser = parse_chat if kind == "chat" else parse_completion
        return parser(parse_json(raw), self.served_model, self.limits, self.facts.vocab_size)

    def prompt_ids(self, req: GenerateRequest, max_len: int, release_gil: bool = False
                   ) -> list[int]:
        if req.kind == "chat":
            return self._chat_ids(req.prompt, max_len, release_gil)
        if isinstance(req.prompt, list):
            return list(req.prompt)
        self._check_fits(len(req.prompt), max_len, "prompt")
        return encode_prompt(self.tokenizer, req.prompt, release_gil=release_gil)

    def _chat_ids(self, messages: list[Message], max_len: int, release_gil: bool) -> list[int]:
        specials = self.facts.content_specials
        if specials is None or not any(specials.found_in(m["content"]) for m in messages):
            text = render_chat_text(self.tokenizer, messages)
            self._check_fits(len(text), max_len, "messages")
            return encode_prompt(self.tokenizer, text, add_special_tokens=False,
                                 release_gil=release_gil)
        rendered = render_chat_text(self.tokenizer, specials.defuse(messages))
        self._check_fits(len(specials.restore(rendered)), max_len, "messages")
        return specials.encode(rendered, release_gil)

    def _check_fits(self, num_chars: int, max_len: int, param: str) -> None:
        """400 when `num_chars` characters make too many tokens for the context, whatever
        they are (`char_bound`): checked before any tokenizing."""
        least = min_tokens(num_chars, self.facts.chars_per_token)
        if least >= max_len:
            raise ApiError(400, f"This model's maximum context length is {max_len} tokens. "
                                f"However, your {param} has {num_chars} characters, which make "
                                f"at least {least} tokens (no token of this model covers more "
                                f"than {self.facts.chars_per_token} characters). Please reduce "
                                f"the length of the {param}.",
                           param=param, code="context_length_exceeded")


def _text_chars(req: GenerateRequest) -> int:
    """Characters the request gives the tokenizer (0 for token ids)."""
    if isinstance(req.prompt, str):
        return len(req.prompt)
    if req.kind == "chat":
        return sum(len(m["content"]) for m in req.prompt)
    return 0


async def _run(off_loop: bool, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, on the pool when `off_loop` (the caller's loop keeps serving meanwhile)."""
    if not off_loop:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(_POOL, fn, *args)
