"""`encode_prompt` gives exactly the ids of the tokenizer's own `encode`."""

from __future__ import annotations

import pytest

from pdserve.api.prompt_ids import encode_prompt
from pdserve.testing.tiny_models import tiny_tokenizer

TEXTS = ["word " * 32, "Hello, world! ¿Qué tal? 日本語 🙂", "", "  leading and trailing  ",
         "\n\n\t x", "a" * 3000]


@pytest.mark.parametrize("text", TEXTS)
def test_the_ids_are_the_tokenizers_own(text: str) -> None:
    tok = tiny_tokenizer()
    assert encode_prompt(tok, text) == tok.encode(text)


def test_special_token_text_is_parsed_as_the_tokenizer_parses_it() -> None:
    tok = tiny_tokenizer()
    text = f"{tok.eos_token} then more"
    assert encode_prompt(tok, text) == tok.encode(text)
    assert tok.eos_token_id in encode_prompt(tok, text)


def test_truncation_left_on_by_an_earlier_call_does_not_cut_the_prompt() -> None:
    tok = tiny_tokenizer()
    text = "word " * 40
    assert len(tok(text, truncation=True, max_length=4)["input_ids"]) == 4
    assert encode_prompt(tok, text) == tok.encode(text)
    assert len(encode_prompt(tok, text)) > 4


def test_a_rendered_chat_gets_no_special_tokens_added() -> None:
    tok = tiny_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert encode_prompt(tok, text, add_special_tokens=False) == tok.encode(
        text, add_special_tokens=False)


def test_another_tokenizer_uses_its_own_encode() -> None:
    class Fake:
        def encode(self, text: str, add_special_tokens: bool) -> tuple[int, ...]:
            return (len(text), int(add_special_tokens))

    assert encode_prompt(Fake(), "abc") == [3, 1]
    assert encode_prompt(Fake(), "abc", add_special_tokens=False) == [3, 0]
