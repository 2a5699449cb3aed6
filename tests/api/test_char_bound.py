"""The char bound: a text of N characters makes at least ceil(N / C) tokens, and tokenizers
whose pipeline can drop text get no bound at all."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from pdserve.api.char_bound import UNICODE_COMPOSE, chars_per_token, min_tokens
from pdserve.testing.tiny_models import BOS, tiny_tokenizer


def bpe(normalizer=None, pre_tokenizer=None, **model: object) -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab={"a": 0, "b": 1, "abc": 2, "[UNK]": 3}, merges=[],
                               **model))
    if normalizer is not None:
        tok.normalizer = normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    return tok


def test_the_tiny_tokenizer_bound_is_its_longest_entry_times_nfc() -> None:
    rust = tiny_tokenizer().backend_tokenizer
    longest = max(len(t) for t in rust.get_vocab(with_added_tokens=True))
    assert longest == len(BOS)
    assert chars_per_token(rust) == len(BOS) * UNICODE_COMPOSE


@pytest.mark.parametrize("text", [
    BOS * 50,  # the longest entry, over and over: the tightest case
    "The capital of France is Paris. " * 40,
    "\u1100\u1161\u11a8" * 200,  # Hangul jamo: NFC makes three characters one
    "e\u0301" * 300,  # a combining accent: NFC makes two characters one
    "\U0001F600 caf\u00e9 \u4e2d\u6587 " * 50,
    "    \n\n\t" * 100,
])
def test_no_text_makes_fewer_tokens_than_the_bound(text: str) -> None:
    tok = tiny_tokenizer()
    per_token = chars_per_token(tok.backend_tokenizer)
    assert len(tok.encode(text, add_special_tokens=False)) >= min_tokens(len(text), per_token)


def test_min_tokens_rounds_up_and_is_zero_without_a_bound() -> None:
    assert [min_tokens(n, 4) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
    assert min_tokens(10**9, None) == 0


@pytest.mark.parametrize(("normalizer", "shrink"), [
    (None, 1),
    (normalizers.NFD(), 1),
    (normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]), UNICODE_COMPOSE),
    (normalizers.Replace(" ", "\u2581"), 1),
    (normalizers.Replace("abcd", "xy"), 2),
])
def test_normalizers_that_keep_text_scale_the_bound(normalizer, shrink: int) -> None:
    assert chars_per_token(bpe(normalizer, byte_fallback=True)) == len("[UNK]") * shrink


@pytest.mark.parametrize(("normalizer", "pre_tokenizer", "model"), [
    (normalizers.Strip(), None, {"byte_fallback": True}),
    (normalizers.Replace("a", ""), None, {"byte_fallback": True}),
    (normalizers.Sequence([normalizers.NFC(), normalizers.StripAccents()]), None,
     {"byte_fallback": True}),
    (None, pre_tokenizers.Whitespace(), {"byte_fallback": True}),
    (None, pre_tokenizers.Split(" ", behavior="removed"), {"byte_fallback": True}),
    (None, None, {"unk_token": "[UNK]", "fuse_unk": True}),  # one [UNK] for a whole run
    (None, None, {}),  # unknown characters are dropped
])
def test_pipelines_that_can_drop_text_have_no_bound(normalizer, pre_tokenizer,
                                                    model: dict) -> None:
    assert chars_per_token(bpe(normalizer, pre_tokenizer, **model)) is None


def test_byte_level_and_one_unknown_per_character_keep_the_bound() -> None:
    assert chars_per_token(bpe(None, pre_tokenizers.ByteLevel())) == 5
    assert chars_per_token(bpe(None, None, unk_token="[UNK]")) == 5
