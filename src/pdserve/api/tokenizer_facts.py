"""What request checking needs to know about a tokenizer, computed once when it is loaded
(tens to a few hundred ms for a large vocabulary: never on the event loop's request path)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerFast

from pdserve.api.char_bound import chars_per_token
from pdserve.api.content_specials import ContentSpecials
from pdserve.api.limits import SpecialTokensInContent


@dataclass(frozen=True)
class TokenizerFacts:
    vocab_size: int | None = None  # token ids are in [0, vocab_size); None: unknown
    chars_per_token: int | None = None  # `char_bound`'s C; None: no bound
    content_specials: ContentSpecials | None = None  # set in `text` mode only

    @staticmethod
    def of(tokenizer: Any, mode: SpecialTokensInContent) -> TokenizerFacts:
        """Facts of `tokenizer` (None: not loaded yet, nothing known). `text` mode needs a fast
        (Rust-backed) tokenizer: another one is a ValueError saying what to do."""
        if tokenizer is None:
            return TokenizerFacts()
        if not isinstance(tokenizer, PreTrainedTokenizerFast):
            if mode is SpecialTokensInContent.TEXT:
                raise ValueError(f"--special-tokens-in-content text needs a fast (tokenizers) "
                                 f"tokenizer; this model's is {type(tokenizer).__name__}: use "
                                 f"--special-tokens-in-content parse")
            return TokenizerFacts()
        rust = tokenizer.backend_tokenizer
        specials = ContentSpecials(rust) if mode is SpecialTokensInContent.TEXT else None
        return TokenizerFacts(rust.get_vocab_size(with_added_tokens=True),
                              chars_per_token(rust), specials)
