from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from pdserve.common.sampling_params import SamplingParams, unpaired_surrogate


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert p.max_tokens == 16
    assert p.temperature == 1.0
    assert p.top_k == 0
    assert p.top_p == 1.0
    assert p.seed is None
    assert p.stop == ()
    assert p.stop_token_ids == ()
    assert p.ignore_eos is False
    assert p.logprobs is None
    assert p.include_stop_str_in_output is False
    assert p.skip_special_tokens is True
    assert not p.greedy


def test_is_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.max_tokens = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("given", "expected"),
    [("###", ("###",)), (["a", "bc"], ("a", "bc")), (("x",), ("x",)), ([], ())],
)
def test_stop_is_normalized_to_tuple(given: Any, expected: tuple[str, ...]) -> None:
    assert SamplingParams(stop=given).stop == expected


@pytest.mark.parametrize(("given", "expected"), [(7, (7,)), ([1, 2], (1, 2)), ((0,), (0,))])
def test_stop_token_ids_is_normalized_to_tuple(given: Any, expected: tuple[int, ...]) -> None:
    assert SamplingParams(stop_token_ids=given).stop_token_ids == expected


def test_normalized_params_are_hashable_and_equal() -> None:
    assert SamplingParams(stop=["a"]) == SamplingParams(stop="a")
    assert hash(SamplingParams(stop_token_ids=[3])) == hash(SamplingParams(stop_token_ids=3))


@pytest.mark.parametrize("temperature", [0, 0.0, 1e-7])
def test_greedy_when_temperature_is_zero(temperature: float) -> None:
    assert SamplingParams(temperature=temperature).greedy


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_disabled_spellings(top_k: int) -> None:
    assert SamplingParams(top_k=top_k).effective_top_k == 0


def test_valid_edge_values_are_accepted() -> None:
    SamplingParams(max_tokens=1, temperature=0, top_k=1, top_p=1e-9, seed=-5, logprobs=0)
    SamplingParams(top_p=1, logprobs=20, seed=2**70, stop_token_ids=[0])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 0},
        {"max_tokens": -3},
        {"max_tokens": "16"},
        {"max_tokens": 2.0},
        {"max_tokens": True},
        {"temperature": -0.1},
        {"temperature": math.inf},
        {"temperature": math.nan},
        {"temperature": "1"},
        {"temperature": True},
        {"top_k": -2},
        {"top_k": 1.5},
        {"top_k": False},
        {"top_p": 0},
        {"top_p": 0.0},
        {"top_p": 1.01},
        {"top_p": math.nan},
        {"top_p": "0.9"},
        {"seed": 1.0},
        {"seed": "1"},
        {"seed": True},
        {"stop": ""},
        {"stop": ["ok", ""]},
        {"stop": ["ok", "a\ud800"]},
        {"stop": "\udc00"},
        {"stop": [1]},
        {"stop": 5},
        {"stop_token_ids": [-1]},
        {"stop_token_ids": ["1"]},
        {"stop_token_ids": [True]},
        {"stop_token_ids": "12"},
        {"logprobs": -1},
        {"logprobs": 21},
        {"logprobs": 1.0},
        {"logprobs": True},
        {"ignore_eos": 1},
        {"include_stop_str_in_output": "yes"},
        {"skip_special_tokens": None},
    ],
)
def test_invalid_params_raise_value_error(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(("text", "at"), [("plain", None), ("caf\u00e9 \U0001F600", None),
                                          ("a\ud800b", 1), ("\udfff", 0), ("\ud83d\ude00", 0)])
def test_unpaired_surrogate_finds_the_first_one(text: str, at: int | None) -> None:
    assert unpaired_surrogate(text) == at


def test_a_stop_string_with_a_surrogate_names_it() -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(stop=["x\ud800"])
    assert str(info.value) == ("stop strings must be valid Unicode; 'x\\ud800' holds an unpaired "
                               "surrogate at index 1")
