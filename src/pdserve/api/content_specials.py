"""Chat content whose text spells special tokens ("<|im_end|><|im_start|>system ..."), tokenized
as plain text while the chat template's own special tokens stay special.

How: the content's special-token text is swapped for markers before the template renders
(`defuse`), so every special-token string left in the rendered text is the template's. Those
become aliases: added tokens of a private copy of the tokenizer that are *not* special, and the
markers turn back into the content's text. The copy encodes with `encode_special_tokens` on,
so the content's special-token text is plain text to it while the aliases still split the text
exactly where the special tokens did (with their lstrip/rstrip), and each alias id is mapped
back to its special token's id. So the result is the tokenizer's own pipeline, with the
content's special-token text read as text.

Markers and aliases carry a random per-process number and private-use characters: a client
cannot write one. A content that holds an alias's prefix all the same is refused.
A tokenizer with no special tokens has nothing to defuse (`found_in` is always False).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence

from tokenizers import AddedToken, Tokenizer

from pdserve.api.errors import bad_request
from pdserve.api.prompt_ids import encode_with

Message = dict[str, str]


class ContentSpecials:
    """One fast tokenizer's special tokens and its copy that reads their text as text.

    Built once per tokenizer (it copies it: a few MB and tens of ms); read-only afterwards, so
    any thread may use it."""

    def __init__(self, rust: Tokenizer) -> None:
        added = [(i, t) for i, t in rust.get_added_tokens_decoder().items() if t.special]
        self._texts = tuple(sorted((t.content for _, t in added), key=len, reverse=True))
        self._index = {text: k for k, text in enumerate(self._texts)}
        self._prefixes = frozenset(text[:2] for text in self._texts)
        self._find = re.compile("|".join(map(re.escape, self._texts))) if added else None
        nonce = str(secrets.randbits(64))  # digits: no template filter changes them
        self._marker_head = f"\ue000{nonce}."
        self._markers = re.compile(re.escape(self._marker_head) + "([0-9]+)\ue001")
        self._alias_head = f"\ue002{nonce}."
        self._alias = {t.content: f"{self._alias_head}{i}\ue003" for i, t in added}
        self._as_text = _as_text_copy(rust, [(self._alias[t.content], t) for _, t in added])
        self._special_id = {self._as_text.token_to_id(self._alias[t.content]): i
                            for i, t in added}

    def found_in(self, text: str) -> bool:
        """Whether `text` holds some special token's text."""
        return any(p in text for p in self._prefixes) and any(t in text for t in self._texts)

    def defuse(self, messages: Sequence[Message]) -> list[Message]:
        """`messages` with their content's special-token text swapped for markers."""
        return [{**m, "content": self._find.sub(self._mark, m["content"])}
                if self.found_in(m["content"]) else m for m in messages]

    def restore(self, rendered: str) -> str:
        """The text `rendered` stands for: markers back to the content's special-token text."""
        return self._markers.sub(lambda m: self._texts[int(m.group(1))], rendered)

    def encode(self, rendered: str, release_gil: bool = False) -> list[int]:
        """The ids of `rendered` (the template's text of `defuse`d messages): the template's
        special tokens as special tokens, the content's special-token text as text."""
        if self._alias_head in rendered:
            raise bad_request("messages hold text reserved by this server", "messages")
        aliased = self.restore(self._find.sub(lambda m: self._alias[m.group()], rendered))
        ids = encode_with(self._as_text, aliased, release_gil=release_gil)
        return [self._special_id.get(t, t) for t in ids]

    def _mark(self, match: re.Match[str]) -> str:
        return f"{self._marker_head}{self._index[match.group()]}\ue001"


def _as_text_copy(rust: Tokenizer, aliases: list[tuple[str, AddedToken]]) -> Tokenizer:
    """A copy of `rust` that reads special-token text as text and splits at the aliases as it
    would at their special tokens."""
    copy = Tokenizer.from_str(rust.to_str())
    copy.no_truncation()
    copy.no_padding()
    copy.encode_special_tokens = True
    copy.add_tokens([AddedToken(alias, single_word=t.single_word, lstrip=t.lstrip,
                                rstrip=t.rstrip, normalized=t.normalized, special=False)
                     for alias, t in aliases])
    return copy
