"""The fewest tokens a text can become, from its length alone: long prompts are refused before
the tokenizer spends time on them.

The bound: a text of N characters becomes at least ceil(N / C) tokens, where C = L * S:
- L is the longest vocabulary entry (added tokens included) in characters. An entry spells at
  least as many characters as the text it stands for: a byte-level entry has one character per
  byte (a text character is >= 1 byte), a byte-fallback entry ("<0xE3>") stands for one byte, a
  Metaspace entry ("\u2581the") for as many characters as it has.
- S is how many input characters the normalizer may turn into one: 4 for NFC and NFKC (the
  longest canonical decomposition has 4 code points), 1 for normalizers that never shorten
  text, the product over a sequence.
A pipeline that can drop text (a normalizer or pre-tokenizer that removes characters, an
unknown-token fallback that swallows a whole word) has no bound: `chars_per_token` is None.
"""

from __future__ import annotations

import json
import math
from typing import Any

from tokenizers import Tokenizer

UNICODE_COMPOSE = 4  # NFC/NFKC: the most code points one composed character replaces
_KEEP_LENGTH = {"NFD", "NFKD", "Lowercase", "Prepend", "ByteLevel"}
_COMPOSE = {"NFC", "NFKC"}
_PRE_KEEP = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def chars_per_token(rust: Tokenizer) -> int | None:
    """C above for this tokenizer, or None when it has no such bound."""
    spec = json.loads(rust.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_text(spec.get("pre_tokenizer")) \
            or not _model_keeps_text(spec.get("model") or {}, spec.get("pre_tokenizer")):
        return None
    longest = max((len(t) for t in rust.get_vocab(with_added_tokens=True)), default=0)
    return longest * shrink if longest else None


def min_tokens(num_chars: int, per_token: int | None) -> int:
    """The fewest tokens `num_chars` characters can become (0 without a bound)."""
    return 0 if per_token is None else math.ceil(num_chars / per_token)


def _normalizer_shrink(node: dict[str, Any] | None) -> int | None:
    if node is None:
        return 1
    kind = node.get("type")
    if kind == "Sequence":
        total = 1
        for child in node.get("normalizers", []):
            shrink = _normalizer_shrink(child)
            if shrink is None:
                return None
            total *= shrink
        return total
    if kind in _COMPOSE:
        return UNICODE_COMPOSE
    if kind in _KEEP_LENGTH:
        return 1
    if kind == "Replace":
        return _replace_shrink(node)
    return None  # Strip, StripAccents, BertNormalizer, Nmt, Precompiled...: may drop text


def _replace_shrink(node: dict[str, Any]) -> int | None:
    pattern, content = node.get("pattern", {}).get("String"), node.get("content", "")
    if not isinstance(pattern, str) or not content:
        return None  # a regex, or a deletion
    return max(1, math.ceil(len(pattern) / len(content)))


def _keeps_text(node: dict[str, Any] | None) -> bool:
    if node is None:
        return True
    kind = node.get("type")
    if kind == "Sequence":
        return all(_keeps_text(child) for child in node.get("pretokenizers", []))
    return kind in _PRE_KEEP and node.get("behavior") != "Removed"


def _model_keeps_text(model: dict[str, Any], pre: dict[str, Any] | None) -> bool:
    """Every character reaches a token: byte-level input, byte fallback, or (BPE) one unknown
    token per unknown character."""
    if _has_byte_level(pre) or model.get("byte_fallback"):
        return True
    return model.get("type") == "BPE" and model.get("unk_token") is not None \
        and not model.get("fuse_unk")


def _has_byte_level(node: dict[str, Any] | None) -> bool:
    if node is None:
        return False
    if node.get("type") == "Sequence":
        return any(_has_byte_level(child) for child in node.get("pretokenizers", []))
    return node.get("type") == "ByteLevel"
