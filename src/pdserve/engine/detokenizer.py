"""Streaming token-to-text conversion and stop-string search.

Invariants of `IncrementalDetokenizer`:
- Each `add` returns only text that is final: decoding later tokens never changes it. Text whose
  last character is an incomplete UTF-8 sequence (decoded as U+FFFD) is held back until the
  character completes.
- The concatenation of all deltas (plus `flush()`) equals
  `tokenizer.decode(output_ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`
  for text that starts on a character boundary. Tokenization-space clean-up is never applied:
  it rewrites earlier text and so cannot stream.
- Each step decodes only a short window of trailing tokens (from `prefix_offset`), so the cost
  per token does not grow with the output length.
"""

from __future__ import annotations

from typing import Any, Protocol

# Prompt tokens decoded ahead of the output so the first output token gets its context
# (e.g. a SentencePiece leading space).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    """The slice of a Hugging Face tokenizer the detokenizer uses."""

    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's output tokens, one at a time, into text deltas.

    `tokens[prefix_offset:read_offset]` decodes to text already emitted (the context a new
    token needs); `tokens[read_offset:]` are tokens whose text is not emitted yet.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._tokens: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far (the concatenation of the deltas)."""
        return self._text

    @property
    def held_tokens(self) -> int:
        """The last output tokens whose text is not in `text` yet (an incomplete character):
        `text` is the whole text of every output token before them."""
        return len(self._tokens) - self._read_offset

    def add(self, token_id: int) -> str:
        """Append one output token; return the newly final text (possibly "")."""
        self._tokens.append(token_id)
        emitted, window = self._window_texts()
        if len(window) <= len(emitted) or window.endswith(_REPLACEMENT_CHAR):
            return ""
        return self._emit(window[len(emitted) :])

    def flush(self) -> str:
        """Emit whatever is held back (an incomplete character becomes U+FFFD); for finishing."""
        if self._read_offset == len(self._tokens):
            return ""
        emitted, window = self._window_texts()
        return self._emit(window[len(emitted) :])

    def _window_texts(self) -> tuple[str, str]:
        """Decoded window up to the read offset (already emitted) and the whole window."""
        window = self._tokens[self._prefix_offset :]
        return self._decode(window[: self._read_offset - self._prefix_offset]), self._decode(window)

    def _emit(self, delta: str) -> str:
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self._text += delta
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special,
            clean_up_tokenization_spaces=False,
        )


def find_stop(
    text: str, num_new_chars: int, stop: tuple[str, ...], include_stop: bool
) -> int | None:
    """Length to truncate `text` to at the earliest stop string touching the last new characters.

    Only matches that overlap the last `num_new_chars` characters are considered (earlier text
    was searched when it was new). Returns the match start, or its end when `include_stop`;
    None when no stop string matches. Among matches starting at the same index the first
    listed stop string wins.
    """
    if num_new_chars <= 0 or not stop:
        return None
    new_start = len(text) - num_new_chars
    best: tuple[int, int] | None = None  # (start, length)
    for s in stop:
        start = text.find(s, max(0, new_start - len(s) + 1))
        if start != -1 and (best is None or start < best[0]):
            best = (start, len(s))
    if best is None:
        return None
    return best[0] + best[1] if include_stop else best[0]
