"""Request parsing: every bad input is a 400/404 naming its field; good input maps exactly."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pdserve.api.errors import ApiError, bad_request, not_found_model
from pdserve.api.limits import RequestLimits
from pdserve.api.protocol import (
    GenerateRequest,
    check_context,
    parse_chat,
    parse_completion,
    parse_json,
    render_chat,
)
from pdserve.common.sampling_params import SamplingParams
from pdserve.testing.tiny_models import tiny_tokenizer

SERVED = "tiny"
DROP = object()  # a field value meaning "remove this field from the body"
USER = [{"role": "user", "content": "Hi"}]
PARSERS = {"completion": parse_completion, "chat": parse_chat}


def body(kind: str, **fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": SERVED}
    base.update({"prompt": "Hello"} if kind == "completion" else {"messages": USER})
    base.update(fields)
    return {k: v for k, v in base.items() if v is not DROP}


def parse(kind: str, **fields: Any) -> GenerateRequest:
    return PARSERS[kind](body(kind, **fields), SERVED)


def refused(kind: str, **fields: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(kind, **fields)
    return info.value


# ---- errors ------------------------------------------------------------------------------------


def test_error_body_is_openai_shape() -> None:
    err = bad_request("max_tokens must be an integer >= 1; got -1", "max_tokens")
    assert err.status == 400
    assert err.body() == {"error": {"message": "max_tokens must be an integer >= 1; got -1",
                                    "type": "invalid_request_error", "param": "max_tokens",
                                    "code": None}}
    assert str(err) == err.message


def test_not_found_model_names_both_models() -> None:
    err = not_found_model("gpt-4o", SERVED)
    assert (err.status, err.param, err.code) == (404, "model", "model_not_found")
    assert "gpt-4o" in err.message and SERVED in err.message


# ---- bad input ---------------------------------------------------------------------------------

BOTH = ("completion", "chat")

# (kinds, fields, param, fragment of the message)
BAD: list[tuple[tuple[str, ...], dict[str, Any], str | None, str]] = [
    (BOTH, {"model": DROP}, "model", "model is required"),
    (BOTH, {"model": 5}, "model", "model is required"),
    (BOTH, {"model": ""}, "model", "model is required"),
    (("completion",), {"prompt": DROP}, "prompt", "prompt is required"),
    (("completion",), {"prompt": ""}, "prompt", "must not be empty"),
    (("completion",), {"prompt": []}, "prompt", "must not be empty"),
    (("completion",), {"prompt": [[]]}, "prompt", "must not be empty"),
    (("completion",), {"prompt": [""]}, "prompt", "must not be empty"),
    (("completion",), {"prompt": ["a", "b"]}, "prompt",
     "batched prompts are not supported; send one request per prompt"),
    (("completion",), {"prompt": [[1], [2]]}, "prompt", "batched prompts are not supported"),
    (("completion",), {"prompt": [1, -1]}, "prompt", "integers >= 0"),
    (("completion",), {"prompt": [1, True]}, "prompt", "a list of token ids"),
    (("completion",), {"prompt": [1, "a"]}, "prompt", "a list of token ids"),
    (("completion",), {"prompt": 5}, "prompt", "a list of token ids"),
    (("completion",), {"prompt": {"text": "x"}}, "prompt", "a list of token ids"),
    (("chat",), {"messages": DROP}, "messages", "non-empty list"),
    (("chat",), {"messages": []}, "messages", "non-empty list"),
    (("chat",), {"messages": "hi"}, "messages", "non-empty list"),
    (("chat",), {"messages": [5]}, "messages", "messages[0] must be an object"),
    (("chat",), {"messages": [{"role": "robot", "content": "x"}]}, "messages",
     "messages[0].role must be one of system, user, assistant, developer, tool"),
    (("chat",), {"messages": [{"role": ["user"], "content": "x"}]}, "messages", ".role"),
    (("chat",), {"messages": [{"content": "x"}]}, "messages", ".role"),
    (("chat",), {"messages": [*USER, {"role": "user"}]}, "messages", "messages[1].content"),
    (("chat",), {"messages": [{"role": "user", "content": 5}]}, "messages", ".content"),
    (("chat",), {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                             "image_url": {"url": "x"}}]}]},
     "messages", "only text is supported"),
    (("chat",), {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages",
     ".content"),
    (BOTH, {"max_tokens": "16"}, "max_tokens", "max_tokens must be an integer >= 1"),
    (BOTH, {"max_tokens": True}, "max_tokens", "max_tokens must be an integer >= 1"),
    (BOTH, {"max_tokens": -1}, "max_tokens", "max_tokens must be an integer >= 1"),
    (BOTH, {"max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1"),
    (BOTH, {"max_tokens": 1.5}, "max_tokens", "max_tokens must be an integer >= 1"),
    (("chat",), {"max_completion_tokens": -3, "max_tokens": 5}, "max_completion_tokens",
     "max_completion_tokens must be an integer >= 1"),
    (BOTH, {"temperature": -0.1}, "temperature", "a number >= 0"),
    (BOTH, {"temperature": "hot"}, "temperature", "a number >= 0"),
    (BOTH, {"temperature": True}, "temperature", "a number >= 0"),
    (BOTH, {"top_p": 0}, "top_p", "a number in (0, 1]"),
    (BOTH, {"top_p": 1.5}, "top_p", "a number in (0, 1]"),
    (BOTH, {"top_p": "x"}, "top_p", "a number in (0, 1]"),
    (BOTH, {"top_k": -2}, "top_k", "top_k must be an integer"),
    (BOTH, {"top_k": 1.5}, "top_k", "top_k must be an integer"),
    (BOTH, {"top_k": True}, "top_k", "top_k must be an integer"),
    (BOTH, {"seed": "1"}, "seed", "a 64-bit integer"),
    (BOTH, {"seed": 1.5}, "seed", "a 64-bit integer"),
    (BOTH, {"seed": 2**64}, "seed", "a 64-bit integer"),
    (BOTH, {"stop": 5}, "stop", "a non-empty string or a list of non-empty strings"),
    (BOTH, {"stop": [1]}, "stop", "a list of non-empty strings"),
    (BOTH, {"stop": ""}, "stop", "a list of non-empty strings"),
    (BOTH, {"stop": ["a", None]}, "stop", "a list of non-empty strings"),
    (BOTH, {"stop_token_ids": [-1]}, "stop_token_ids", "integers >= 0"),
    (BOTH, {"stop_token_ids": "1"}, "stop_token_ids", "integers >= 0"),
    (BOTH, {"stop_token_ids": [True]}, "stop_token_ids", "integers >= 0"),
    (BOTH, {"ignore_eos": "yes"}, "ignore_eos", "true or false"),
    (BOTH, {"include_stop_str_in_output": 1}, "include_stop_str_in_output", "true or false"),
    (BOTH, {"skip_special_tokens": "no"}, "skip_special_tokens", "true or false"),
    (BOTH, {"n": 2}, "n", "n must be 1"),
    (BOTH, {"n": 0}, "n", "n must be 1"),
    (BOTH, {"n": True}, "n", "n must be 1"),
    (("completion",), {"best_of": 2}, "best_of", "not supported"),
    (BOTH, {"stream": "true"}, "stream", "true or false"),
    (BOTH, {"stream": 1}, "stream", "true or false"),
    (BOTH, {"stream_options": {"include_usage": True}}, "stream_options",
     "only allowed when stream is true"),
    (BOTH, {"stream": False, "stream_options": {}}, "stream_options",
     "only allowed when stream is true"),
    (BOTH, {"stream": True, "stream_options": "usage"}, "stream_options", "must be an object"),
    (BOTH, {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options",
     "include_usage must be true or false"),
    (BOTH, {"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    (BOTH, {"presence_penalty": "0"}, "presence_penalty", "not supported"),
    (BOTH, {"frequency_penalty": -1}, "frequency_penalty", "not supported"),
    (BOTH, {"echo": True}, "echo", "echo is not supported"),
    (("completion",), {"suffix": "end"}, "suffix", "not supported"),
    (BOTH, {"logit_bias": {"1": 5}}, "logit_bias", "not supported"),
    (("chat",), {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools",
     "not supported"),
    (("chat",), {"response_format": {"type": "json_object"}}, "response_format",
     "not supported"),
    (("completion",), {"logprobs": 21}, "logprobs", "an integer in [0, 20]"),
    (("completion",), {"logprobs": -1}, "logprobs", "an integer in [0, 20]"),
    (("completion",), {"logprobs": True}, "logprobs", "an integer in [0, 20]"),
    (("chat",), {"logprobs": 1}, "logprobs", "true or false"),
    (("chat",), {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    (("chat",), {"logprobs": True, "top_logprobs": True}, "top_logprobs", "[0, 20]"),
    (("chat",), {"top_logprobs": 2}, "top_logprobs", "requires logprobs: true"),
    (("chat",), {"logprobs": False, "top_logprobs": 0}, "top_logprobs", "requires logprobs"),
]

BAD_CASES = [
    pytest.param(kind, fields, param, fragment, id=f"{kind}-{i}-{param}")
    for i, (kinds, fields, param, fragment) in enumerate(BAD)
    for kind in kinds
]


@pytest.mark.parametrize(("kind", "fields", "param", "fragment"), BAD_CASES)
def test_bad_input_is_a_400_naming_the_field(
    kind: str, fields: dict[str, Any], param: str | None, fragment: str
) -> None:
    err = refused(kind, **fields)
    assert (err.status, err.type, err.param) == (400, "invalid_request_error", param)
    assert fragment in err.message
    assert err.body()["error"]["param"] == param


@pytest.mark.parametrize("kind", BOTH)
def test_another_models_name_is_a_404(kind: str) -> None:
    err = refused(kind, model="gpt-4o", max_tokens=-1)
    assert (err.status, err.type, err.param, err.code) == (
        404, "invalid_request_error", "model", "model_not_found")
    assert "gpt-4o" in err.message and SERVED in err.message


@pytest.mark.parametrize("kind", BOTH)
@pytest.mark.parametrize("not_an_object", [None, [], "x", 3])
def test_body_must_be_an_object(kind: str, not_an_object: object) -> None:
    with pytest.raises(ApiError) as info:
        PARSERS[kind](not_an_object, SERVED)
    assert (info.value.status, info.value.param) == (400, None)
    assert "must be a JSON object" in info.value.message


def test_messages_show_the_value_sent_truncated() -> None:
    err = refused("completion", temperature="x" * 500)
    assert 'got "xxx' in err.message and err.message.endswith("...")
    assert len(err.message) < 200


# ---- good input --------------------------------------------------------------------------------


def test_completion_defaults() -> None:
    req = parse("completion")
    assert req == GenerateRequest(
        kind="completion", model=SERVED, prompt="Hello", params=SamplingParams(max_tokens=16),
        max_tokens_given=True, stream=False, include_usage=False, logprobs=None)


def test_every_sampling_field_maps() -> None:
    req = parse("completion", max_tokens=32, temperature=0, top_p=0.9, top_k=5, seed=-7,
                stop=["\n", "END"], stop_token_ids=[2], ignore_eos=True, logprobs=3,
                include_stop_str_in_output=True, skip_special_tokens=False)
    assert req.params == SamplingParams(
        max_tokens=32, temperature=0, top_p=0.9, top_k=5, seed=-7, stop=("\n", "END"),
        stop_token_ids=(2,), ignore_eos=True, logprobs=3, include_stop_str_in_output=True,
        skip_special_tokens=False)
    assert req.logprobs == 3
    assert req.params.greedy


def test_null_means_absent_and_neutral_values_and_extras_are_accepted() -> None:
    nulls = {k: None for k in ("temperature", "top_p", "top_k", "seed", "stop", "max_tokens",
                               "stop_token_ids", "n", "stream", "stream_options", "logprobs",
                               "echo", "presence_penalty", "user")}
    assert parse("completion", **nulls) == parse("completion")
    neutral = dict(n=1, best_of=1, presence_penalty=0, frequency_penalty=0.0, echo=False,
                   suffix="", logit_bias={}, tools=[], response_format={"type": "text"},
                   user="someone", extra_body_field={"x": 1}, top_k=-1)
    assert parse("completion", **neutral).params == SamplingParams(max_tokens=16, top_k=-1)


@pytest.mark.parametrize(("prompt", "expected"), [
    ("Hi there", "Hi there"), ([1, 2, 3], [1, 2, 3]), (["Hi"], "Hi"), ([[0, 5]], [0, 5]),
])
def test_prompt_forms(prompt: Any, expected: str | list[int]) -> None:
    assert parse("completion", prompt=prompt).prompt == expected


def test_single_stop_string_becomes_a_tuple() -> None:
    assert parse("chat", stop="###").params.stop == ("###",)


def test_streaming_flags() -> None:
    assert not parse("chat", stream=True).include_usage
    req = parse("chat", stream=True, stream_options={"include_usage": True})
    assert req.stream and req.include_usage
    assert not parse("chat", stream=True, stream_options={}).include_usage


def test_chat_max_tokens_may_be_absent() -> None:
    req = parse("chat")
    assert (req.kind, req.max_tokens_given, req.prompt) == ("chat", False, USER)
    assert req.params_for_context(prompt_len=10, max_model_len=100).max_tokens == 90
    assert parse("chat", max_tokens=5).params.max_tokens == 5
    given = parse("chat", max_tokens=5, max_completion_tokens=7)
    assert (given.max_tokens_given, given.params.max_tokens) == (True, 7)
    assert given.params_for_context(prompt_len=10, max_model_len=100).max_tokens == 7


def test_chat_messages_are_normalized() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]},
        {"role": "user", "content": "Q", "name": "alice"},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "42", "tool_call_id": "t1"},
    ]
    assert parse("chat", messages=messages).prompt == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "a\nb"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42"},
    ]


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None), ({"logprobs": False}, None), ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 5}, 5), ({"logprobs": True, "top_logprobs": None}, 0),
])
def test_chat_logprobs(fields: dict[str, Any], expected: int | None) -> None:
    req = parse("chat", **fields)
    assert req.logprobs == req.params.logprobs == expected


def test_generate_request_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        parse("chat").stream = True  # type: ignore[misc]


# ---- parse_json --------------------------------------------------------------------------------


def test_parse_json_accepts_an_object() -> None:
    assert parse_json(b'{"model": "tiny", "prompt": "caf\xc3\xa9"}') == {
        "model": "tiny", "prompt": "café"}


@pytest.mark.parametrize(("raw", "fragment"), [
    (b'{"model": ', "invalid JSON"), (b"\xff\xfe\xfa", "invalid JSON"), (b"", "invalid JSON"),
    (b'{"temperature": NaN}', "invalid JSON: NaN"), (b"[" * 100_000, "invalid JSON"),
    (b"[1, 2]", "must be a JSON object, got array"), (b'"x"', "got string"),
])
def test_parse_json_refuses(raw: bytes, fragment: str) -> None:
    with pytest.raises(ApiError) as info:
        parse_json(raw)
    assert (info.value.status, info.value.param) == (400, None)
    assert fragment in info.value.message


# ---- check_context -----------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt_len", "max_tokens", "expected"), [
    (10, 5, 5), (10, None, 90), (10, 90, 90), (99, None, 1), (99, 1, 1), (1, None, 99),
])
def test_check_context_fits(prompt_len: int, max_tokens: int | None, expected: int) -> None:
    assert check_context(prompt_len, max_tokens, 100) == expected


def test_check_context_completion_too_long() -> None:
    with pytest.raises(ApiError) as info:
        check_context(10, 91, 100)
    err = info.value
    assert (err.status, err.param, err.code) == (400, "max_tokens", "context_length_exceeded")
    assert err.message == (
        "This model's maximum context length is 100 tokens. However, you requested 101 tokens "
        "(10 in the prompt, 91 for the completion). Please reduce the length of the prompt or "
        "the completion.")


@pytest.mark.parametrize("max_tokens", [None, 1, 50])
@pytest.mark.parametrize("prompt_param", ["prompt", "messages"])
def test_check_context_prompt_fills_the_context(max_tokens: int | None, prompt_param: str) -> None:
    with pytest.raises(ApiError) as info:
        check_context(100, max_tokens, 100, prompt_param)
    err = info.value
    assert (err.status, err.param, err.code) == (400, prompt_param, "context_length_exceeded")
    assert err.message.startswith("This model's maximum context length is 100 tokens. However, "
                                  f"your {prompt_param} has 100 tokens")


def test_check_context_empty_prompt() -> None:
    with pytest.raises(ApiError) as info:
        check_context(0, None, 100)
    assert (info.value.status, info.value.param) == (400, "prompt")


def test_chat_context_errors_blame_messages() -> None:
    with pytest.raises(ApiError) as info:
        parse("chat").params_for_context(prompt_len=100, max_model_len=100)
    assert info.value.param == "messages"
    with pytest.raises(ApiError) as info:
        parse("chat", max_tokens=95).params_for_context(prompt_len=10, max_model_len=100)
    assert info.value.param == "max_tokens"
    assert "(10 in the messages, 95 for the completion)" in info.value.message


# ---- render_chat -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return tiny_tokenizer()


def test_render_chat_matches_apply_chat_template(tokenizer: Any) -> None:
    plain = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "What is the capital of France?"}]
    expected = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    parts = [plain[0], {"role": "user", "content": [
        {"type": "text", "text": "What is the capital of France?"}]}]
    ids = render_chat(tokenizer, parse("chat", messages=parts).prompt)
    assert ids == list(expected)
    assert all(type(t) is int for t in ids)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


def test_render_chat_without_template_is_a_400() -> None:
    tok = tiny_tokenizer()
    tok.chat_template = None
    with pytest.raises(ApiError) as info:
        render_chat(tok, USER)
    assert (info.value.status, info.value.param) == (400, "messages")
    assert info.value.message == "this model has no chat template; use /v1/completions"


def test_render_chat_template_exception_is_a_400() -> None:
    tok = tiny_tokenizer()
    tok.chat_template = "{{ raise_exception('roles must alternate user/assistant') }}"
    with pytest.raises(ApiError) as info:
        render_chat(tok, USER)
    assert (info.value.status, info.value.param) == (400, "messages")
    assert "roles must alternate user/assistant" in info.value.message


# ---- text validity, stop limits, vocabulary ---------------------------------------------------

LONE = "a\ud800b"  # what JSON's "a\ud800b" decodes to


@pytest.mark.parametrize(("kind", "fields", "param", "where"), [
    ("completion", {"prompt": LONE}, "prompt", "prompt"),
    ("completion", {"prompt": [LONE]}, "prompt", "prompt"),
    ("chat", {"messages": [{"role": "user", "content": LONE}]}, "messages",
     "messages[0].content"),
    ("chat", {"messages": [{"role": "system", "content": "ok"},
                           {"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages", "messages[1].content"),
    ("completion", {"stop": ["fine", LONE]}, "stop", "stop[1]"),
    ("chat", {"stop": "\udfff"}, "stop", "stop[0]"),
])
def test_an_unpaired_surrogate_is_a_400_naming_its_field(kind: str, fields: dict[str, Any],
                                                         param: str, where: str) -> None:
    err = refused(kind, **fields)
    assert (err.status, err.param) == (400, param)
    assert err.message.startswith(f"{where} must be valid Unicode text; it holds an unpaired "
                                  f"surrogate")


def test_a_surrogate_pair_is_valid_text() -> None:
    assert parse("completion", prompt="smile \U0001F600").prompt == "smile \U0001F600"


def test_the_json_escape_of_a_lone_surrogate_is_refused_end_to_end() -> None:
    body = parse_json(b'{"model": "tiny", "prompt": "a\\ud800b"}')
    with pytest.raises(ApiError) as info:
        parse_completion(body, SERVED)
    assert (info.value.status, info.value.param) == (400, "prompt")


TIGHT = RequestLimits(max_stop_strings=2, max_stop_string_chars=5, max_stop_token_ids=3)


@pytest.mark.parametrize(("kind", "fields", "param", "message"), [
    ("completion", {"stop": ["a", "b", "c"]}, "stop",
     "stop has 3 strings; this server allows at most 2 (--max-stop-strings)"),
    ("chat", {"stop": ["a", "toolong"]}, "stop",
     "stop[1] has 7 characters; this server allows at most 5 (--max-stop-string-chars)"),
    ("completion", {"stop": "toolong"}, "stop",
     "stop[0] has 7 characters; this server allows at most 5 (--max-stop-string-chars)"),
    ("chat", {"stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids",
     "stop_token_ids has 4 ids; this server allows at most 3 (--max-stop-token-ids)"),
    ("completion", {"stop": [1] * 10**6}, "stop",
     "stop has 1000000 strings; this server allows at most 2 (--max-stop-strings)"),
])
def test_stop_lists_over_the_limits_are_a_400_naming_the_limit(
        kind: str, fields: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(ApiError) as info:
        PARSERS[kind](body(kind, **fields), SERVED, TIGHT)
    assert (info.value.status, info.value.param, info.value.message) == (400, param, message)


def test_stop_lists_at_the_limits_are_accepted() -> None:
    req = parse_completion(body("completion", stop=["abcde", "x"], stop_token_ids=[0, 1, 2]),
                           SERVED, TIGHT, vocab_size=3)
    assert req.params.stop == ("abcde", "x") and req.params.stop_token_ids == (0, 1, 2)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_stop_token_ids_outside_the_vocabulary_are_a_400(kind: str) -> None:
    with pytest.raises(ApiError) as info:
        PARSERS[kind](body(kind, stop_token_ids=[5, 512, 10**12]), SERVED, vocab_size=512)
    assert (info.value.status, info.value.param) == (400, "stop_token_ids")
    assert info.value.message == ("stop_token_ids must be token ids in [0, 512) (the "
                                  "tokenizer's vocabulary); got [512, 1000000000000]")
