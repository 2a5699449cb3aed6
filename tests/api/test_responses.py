"""Response builders: every shape validates with the official `openai` types; SSE is exact."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from pdserve.api.errors import bad_request
from pdserve.api.responses import (
    LOGPROB_FLOOR,
    SSE_DONE,
    ChunkEncoder,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    models_response,
    new_request_id,
    role_delta,
    sse_error,
    sse_event,
    usage,
    usage_chunk,
)

MODEL = "tiny"
CREATED = 1_700_000_000
TOKENS = ["Par", "is", " é"]
LOGPROBS = [-0.5, -float("inf"), -1.25]
TOPS = [{"Par": -0.5, "Rom": -2.0}, {"is": -0.1, "ade": -3.0}, {" é": -1.25, ".": -1.5}]


def roundtrip(obj: dict[str, Any]) -> dict[str, Any]:
    """What a client receives: strict JSON (no NaN/Infinity) decoded again."""
    return json.loads(json.dumps(obj, allow_nan=False))


def test_request_ids() -> None:
    cmpl, chat = new_request_id("completion"), new_request_id("chat")
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", cmpl)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", chat)
    assert new_request_id("chat") != chat


def test_usage() -> None:
    assert usage(7, 3) == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                           "prompt_tokens_details": {"cached_tokens": 0}}
    assert usage(40, 1, cached_tokens=32)["prompt_tokens_details"] == {"cached_tokens": 32}


# ---- logprobs ----------------------------------------------------------------------------------


def test_completion_logprobs_shape_offsets_and_floor() -> None:
    lp = completion_logprobs(TOKENS, LOGPROBS, TOPS, text_offset=4)
    assert lp == {
        "tokens": TOKENS,
        "token_logprobs": [-0.5, LOGPROB_FLOOR, -1.25],
        "top_logprobs": TOPS,
        "text_offset": [4, 7, 9],
    }
    assert completion_logprobs(TOKENS, LOGPROBS)["top_logprobs"] is None
    assert completion_logprobs([], [], [], text_offset=5)["text_offset"] == []
    nan = completion_logprobs(["a"], [math.nan], [{"a": -math.inf}])
    assert nan["token_logprobs"] == [LOGPROB_FLOOR]
    assert nan["top_logprobs"] == [{"a": LOGPROB_FLOOR}]


def test_chat_logprobs_shape() -> None:
    lp = chat_logprobs(TOKENS, LOGPROBS, TOPS)
    last = lp["content"][2]
    assert last == {
        "token": " é", "logprob": -1.25, "bytes": [32, 195, 169],
        "top_logprobs": [{"token": " é", "logprob": -1.25, "bytes": [32, 195, 169]},
                         {"token": ".", "logprob": -1.5, "bytes": [46]}],
    }
    assert lp["content"][1]["logprob"] == LOGPROB_FLOOR
    assert [e["top_logprobs"] for e in chat_logprobs(TOKENS, LOGPROBS)["content"]] == [[], [], []]


@pytest.mark.parametrize("build", [completion_logprobs, chat_logprobs])
def test_logprob_lengths_must_match(build: Any) -> None:
    with pytest.raises(ValueError, match="one entry per token"):
        build(TOKENS, LOGPROBS[:2])
    with pytest.raises(ValueError, match="one entry per token"):
        build(TOKENS, LOGPROBS, TOPS[:1])


# ---- full responses ----------------------------------------------------------------------------


@pytest.mark.parametrize("logprobs", [None, completion_logprobs(TOKENS, LOGPROBS, TOPS),
                                      completion_logprobs(TOKENS, LOGPROBS)])
def test_completion_response(logprobs: dict[str, Any] | None) -> None:
    obj = completion_response("cmpl-1", MODEL, CREATED, "Paris é", "stop", usage(4, 3), logprobs)
    parsed = Completion.model_validate(roundtrip(obj))
    assert (parsed.id, parsed.object, parsed.created, parsed.model) == (
        "cmpl-1", "text_completion", CREATED, MODEL)
    choice = parsed.choices[0]
    assert (choice.index, choice.text, choice.finish_reason) == (0, "Paris é", "stop")
    assert parsed.usage is not None and parsed.usage.total_tokens == 7
    if logprobs is not None:
        assert choice.logprobs is not None and choice.logprobs.tokens == TOKENS
    assert set(obj) == {"id", "object", "created", "model", "choices", "usage"}
    assert set(obj["choices"][0]) == {"index", "text", "logprobs", "finish_reason"}


@pytest.mark.parametrize("logprobs", [None, chat_logprobs(TOKENS, LOGPROBS, TOPS)])
def test_chat_response(logprobs: dict[str, Any] | None) -> None:
    obj = chat_response("chatcmpl-1", MODEL, CREATED, "Paris.", "length", usage(9, 2), logprobs)
    parsed = ChatCompletion.model_validate(roundtrip(obj))
    assert parsed.object == "chat.completion"
    choice = parsed.choices[0]
    assert (choice.message.role, choice.message.content) == ("assistant", "Paris.")
    assert choice.finish_reason == "length"
    assert parsed.usage is not None and parsed.usage.prompt_tokens == 9
    if logprobs is not None:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert [t.token for t in choice.logprobs.content] == TOKENS
        assert choice.logprobs.content[0].top_logprobs[1].token == "Rom"


def test_models_response() -> None:
    obj = models_response(MODEL, CREATED, 2048)
    assert obj["object"] == "list" and len(obj["data"]) == 1
    model = Model.model_validate(roundtrip(obj)["data"][0])
    assert (model.id, model.object, model.created, model.owned_by) == (
        MODEL, "model", CREATED, "pdserve")
    assert obj["data"][0]["max_model_len"] == 2048


# ---- stream chunks -----------------------------------------------------------------------------


def test_completion_chunks() -> None:
    lp = completion_logprobs(TOKENS[:1], LOGPROBS[:1], TOPS[:1], text_offset=0)
    middle = completion_chunk("cmpl-1", MODEL, CREATED, "Par", None, lp)
    last = completion_chunk("cmpl-1", MODEL, CREATED, "is", "stop")
    final = Completion.model_validate(roundtrip(last))
    assert (final.choices[0].text, final.choices[0].finish_reason) == ("is", "stop")
    assert final.usage is None and "usage" not in last
    # OpenAI itself streams finish_reason null before the end, which the SDK type (made for
    # whole responses) does not allow; everything else must validate.
    assert middle["choices"][0]["finish_reason"] is None
    patched = {**middle, "choices": [{**middle["choices"][0], "finish_reason": "stop"}]}
    assert Completion.model_validate(roundtrip(patched)).choices[0].logprobs is not None
    assert set(middle) == set(last) and set(middle["choices"][0]) == set(last["choices"][0])


def test_chat_chunks() -> None:
    first = chat_chunk("chatcmpl-1", MODEL, CREATED, role_delta(), None)
    lp = chat_logprobs(TOKENS[:2], LOGPROBS[:2], TOPS[:2])
    middle = chat_chunk("chatcmpl-1", MODEL, CREATED, {"content": "Paris"}, None, lp)
    last = chat_chunk("chatcmpl-1", MODEL, CREATED, {}, "stop")
    parsed = [ChatCompletionChunk.model_validate(roundtrip(c)) for c in (first, middle, last)]
    assert all(p.object == "chat.completion.chunk" and p.id == "chatcmpl-1" for p in parsed)
    assert (parsed[0].choices[0].delta.role, parsed[0].choices[0].delta.content) == (
        "assistant", "")
    assert parsed[1].choices[0].delta.content == "Paris"
    assert parsed[1].choices[0].logprobs is not None
    assert parsed[2].choices[0].finish_reason == "stop"
    assert role_delta() is not role_delta()  # a fresh dict each time: callers may mutate it


def test_usage_chunks() -> None:
    chat = ChatCompletionChunk.model_validate(
        roundtrip(usage_chunk("chat", "chatcmpl-1", MODEL, CREATED, usage(5, 6))))
    assert chat.choices == [] and chat.usage is not None and chat.usage.total_tokens == 11
    cmpl = Completion.model_validate(
        roundtrip(usage_chunk("completion", "cmpl-1", MODEL, CREATED, usage(5, 6))))
    assert cmpl.object == "text_completion" and cmpl.choices == []
    assert cmpl.usage is not None and cmpl.usage.completion_tokens == 6


# ---- Server-Sent Events ------------------------------------------------------------------------


def test_sse_event_framing_is_exact() -> None:
    assert sse_event({"a": 1, "t": "é\nx"}) == 'data: {"a":1,"t":"é\\nx"}\n\n'.encode()
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_sse_event_is_one_line_for_any_chunk() -> None:
    chunk = chat_chunk("chatcmpl-1", MODEL, CREATED, {"content": "a\r\nb\n\nc"}, None,
                       chat_logprobs(TOKENS, LOGPROBS, TOPS))
    event = sse_event(chunk)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert event.count(b"\n") == 2 and b"\r" not in event
    assert json.loads(event[len(b"data: "):]) == chunk


def test_sse_event_refuses_nan() -> None:
    with pytest.raises(ValueError):
        sse_event({"x": math.nan})


def test_sse_error_from_api_error() -> None:
    err = bad_request("max_tokens must be an integer >= 1; got 0", "max_tokens")
    event = sse_error(err)
    assert event == b"data: " + json.dumps(err.body(), separators=(",", ":")).encode() + b"\n\n"


def test_sse_error_from_message_is_a_server_error() -> None:
    body = json.loads(sse_error("engine aborted the request")[len(b"data: "):])
    assert body == {"error": {"message": "engine aborted the request", "type": "server_error",
                              "param": None, "code": None}}


@pytest.mark.parametrize("model", [MODEL, 'a "quoted" \x00text é model'])
@pytest.mark.parametrize("text", ["Par", "", 'é "q" \\ \n\r\t\x00text \u2028 😀'])
def test_chunk_encoder_is_sse_event_of_the_builders(model: str, text: str) -> None:
    lp = completion_logprobs(TOKENS[:1], LOGPROBS[:1], TOPS[:1], text_offset=3)
    cmpl = ChunkEncoder("completion", "cmpl-1", model, CREATED)
    for finish, logprobs in ((None, None), ("stop", None), (None, lp), ("length", lp)):
        assert cmpl.encode(text, finish, logprobs) == sse_event(
            completion_chunk("cmpl-1", model, CREATED, text, finish, logprobs))
    chat_lp = chat_logprobs(TOKENS[:1], LOGPROBS[:1], TOPS[:1])
    chat = ChunkEncoder("chat", "chatcmpl-1", model, CREATED)
    for finish, logprobs in ((None, None), ("stop", None), (None, chat_lp)):
        assert chat.encode(text, finish, logprobs) == sse_event(
            chat_chunk("chatcmpl-1", model, CREATED, {"content": text}, finish, logprobs))
