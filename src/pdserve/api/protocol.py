"""Request bodies of /v1/completions and /v1/chat/completions, parsed and validated.

Invariants:
- Every bad input raises `ApiError` (400, or 404 for another model's name) whose `param` names
  the offending field and whose message says what is allowed; nothing else escapes for any
  JSON-decoded body. `null` means the same as an absent field; unknown fields are ignored
  (OpenAI clients send `extra_body` fields at the top level).
- A parsed request is one prompt, one choice, no echo, no penalties, no logit bias, no tools:
  anything that would silently change the output if ignored is refused instead.
- `GenerateRequest.params` is a valid `SamplingParams`. When `max_tokens_given` is False (chat
  without `max_tokens`) its `max_tokens` is a placeholder: get the real bound from
  `params_for_context()`, which fills "the rest of the context".
- Integers are never booleans (`true` is not 1), and numbers are finite.
- Text that reaches the tokenizer or the engine (prompt, message contents, stop strings) is
  valid Unicode: an unpaired surrogate is a 400 naming its field.
- Stop strings and stop token ids are within `RequestLimits` (counted before their entries are
  looked at), and stop token ids within the tokenizer's vocabulary when it is known.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

import jinja2

from pdserve.api.errors import ApiError, bad_request, not_found_model
from pdserve.api.limits import DEFAULT_LIMITS, RequestLimits
from pdserve.api.prompt_ids import encode_prompt
from pdserve.common.numbers import is_finite_number
from pdserve.common.sampling_params import MAX_LOGPROBS, SamplingParams, unpaired_surrogate

Kind = Literal["completion", "chat"]
Message = dict[str, str]
Prompt = str | list[int] | list[Message]

COMPLETION_DEFAULT_MAX_TOKENS = 16
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
# SamplingParams needs some max_tokens; this one stands in until params_for_context().
_PLACEHOLDER_MAX_TOKENS = 1
_SHOW_CHARS = 60


@dataclass(frozen=True)
class GenerateRequest:
    """One validated generation request; `logprobs` always equals `params.logprobs`."""

    kind: Kind
    model: str
    prompt: Prompt  # completion: text or token ids; chat: the validated messages, not rendered
    params: SamplingParams
    max_tokens_given: bool
    stream: bool
    include_usage: bool  # streaming only: send a usage chunk before [DONE]
    logprobs: int | None  # top alternatives per token (0 = chosen token only); None = off

    @property
    def prompt_param(self) -> str:
        return "messages" if self.kind == "chat" else "prompt"

    def params_for_context(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """`params` with `max_tokens` fitted to the context by `check_context`'s rules."""
        asked = self.params.max_tokens if self.max_tokens_given else None
        fitted = check_context(prompt_len, asked, max_model_len, self.prompt_param)
        return replace(self.params, max_tokens=fitted)


# ---- primitive checks -------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _is_positive_int(v: Any) -> bool:
    return _is_int(v) and v >= 1


def _is_logprob_count(v: Any) -> bool:
    return _is_int(v) and 0 <= v <= MAX_LOGPROBS


def _is_stop(v: Any) -> bool:
    strings = [v] if isinstance(v, str) else v
    return isinstance(strings, list) and all(isinstance(s, str) and s for s in strings)


def _is_token_ids(v: Any) -> bool:
    return isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v)


def _is_zero(v: Any) -> bool:
    return is_finite_number(v) and v == 0


def _show(v: Any) -> str:
    text = json.dumps(v, default=repr)
    return text if len(text) <= _SHOW_CHARS else text[: _SHOW_CHARS - 3] + "..."


def _json_type(v: Any) -> str:
    for t, name in ((bool, "boolean"), (str, "string"), (list, "array"), (dict, "object")):
        if isinstance(v, t):
            return name
    return "null" if v is None else "number"


def _field(body: dict[str, Any], name: str, default: Any, ok: Callable[[Any], bool],
           allowed: str) -> Any:
    """`body[name]`, or `default` when absent or null; a value failing `ok` is a 400."""
    value = body.get(name)
    if value is None:
        return default
    if not ok(value):
        raise bad_request(f"{name} must be {allowed}; got {_show(value)}", name)
    return value


# ---- field tables -----------------------------------------------------------------------------

_LOGPROB_COUNT = f"an integer in [0, {MAX_LOGPROBS}]"

# SamplingParams keyword -> (default, check, what is allowed); the JSON name is the keyword.
_SAMPLING: dict[str, tuple[Any, Callable[[Any], bool], str]] = {
    "temperature": (1.0, lambda v: is_finite_number(v) and v >= 0, "a number >= 0 (0 = greedy)"),
    "top_p": (1.0, lambda v: is_finite_number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (0, lambda v: _is_int(v) and v >= -1,
              "an integer: -1 or 0 for no limit, k >= 1 to keep the k most likely tokens"),
    "seed": (None, lambda v: _is_int(v) and -(2**63) <= v < 2**64, "a 64-bit integer"),
    "stop": ((), _is_stop, "a non-empty string or a list of non-empty strings"),
    "stop_token_ids": ((), _is_token_ids, "a list of token ids (integers >= 0)"),
    "ignore_eos": (False, _is_bool, "true or false"),
    "include_stop_str_in_output": (False, _is_bool, "true or false"),
    "skip_special_tokens": (True, _is_bool, "true or false"),
}

# Fields accepted only at their neutral value: ignoring another value would change the output.
_NEUTRAL_ONLY: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: _is_int(v) and v == 1, "1 (one choice per request)"),
    "best_of": (lambda v: _is_int(v) and v == 1, "1 (best_of is not supported)"),
    "presence_penalty": (_is_zero, "0 or absent (presence_penalty is not supported)"),
    "frequency_penalty": (_is_zero, "0 or absent (frequency_penalty is not supported)"),
    "echo": (lambda v: v is False, "false or absent (echo is not supported)"),
    "suffix": (lambda v: v == "", "empty or absent (suffix is not supported)"),
    "logit_bias": (lambda v: v == {}, "empty or absent (logit_bias is not supported)"),
    "tools": (lambda v: v == [], "empty or absent (tools are not supported)"),
    "response_format": (lambda v: v == {"type": "text"},
                        'absent or {"type": "text"} (structured output is not supported)'),
}


# ---- the body ---------------------------------------------------------------------------------


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; anything else (bad UTF-8, NaN, an array) is a 400."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError included
        raise bad_request(f"invalid JSON: {e}") from e
    return _object(body)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _object(body: object) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_json_type(body)}")
    return body


def _model(body: dict[str, Any], served_model: str) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request(f"model is required: a string, the served model {served_model!r}",
                          "model")
    if model != served_model:
        raise not_found_model(model, served_model)
    return model


def parse_completion(body: object, served_model: str, limits: RequestLimits = DEFAULT_LIMITS,
                     vocab_size: int | None = None) -> GenerateRequest:
    """A /v1/completions body. `max_tokens` defaults to 16, as OpenAI's does. `vocab_size`
    (None: unknown) bounds `stop_token_ids`."""
    body = _object(body)
    model = _model(body, served_model)
    prompt = _prompt(body.get("prompt"))
    max_tokens = _field(body, "max_tokens", COMPLETION_DEFAULT_MAX_TOKENS, _is_positive_int,
                        "an integer >= 1")
    logprobs = _field(body, "logprobs", None, _is_logprob_count, _LOGPROB_COUNT)
    return _request("completion", body, model, prompt, max_tokens, logprobs, limits,
                    vocab_size)


def parse_chat(body: object, served_model: str, limits: RequestLimits = DEFAULT_LIMITS,
               vocab_size: int | None = None) -> GenerateRequest:
    """A /v1/chat/completions body. `max_completion_tokens` wins over `max_tokens`."""
    body = _object(body)
    model = _model(body, served_model)
    messages = _messages(body.get("messages"))
    name = "max_tokens" if body.get("max_completion_tokens") is None else "max_completion_tokens"
    max_tokens = _field(body, name, None, _is_positive_int, "an integer >= 1")
    return _request("chat", body, model, messages, max_tokens, _chat_logprobs(body), limits,
                    vocab_size)


def _request(kind: Kind, body: dict[str, Any], model: str, prompt: Prompt,
             max_tokens: int | None, logprobs: int | None, limits: RequestLimits,
             vocab_size: int | None) -> GenerateRequest:
    for name, (ok, allowed) in _NEUTRAL_ONLY.items():
        _field(body, name, None, ok, allowed)
    _check_stop_limits(body.get("stop"), limits)
    _check_stop_token_ids(body.get("stop_token_ids"), limits, vocab_size)
    stream = _field(body, "stream", False, _is_bool, "true or false")
    include_usage = _include_usage(body, stream)
    params = _sampling_params(body, max_tokens or _PLACEHOLDER_MAX_TOKENS, logprobs)
    return GenerateRequest(kind, model, prompt, params, max_tokens is not None, stream,
                           include_usage, logprobs)


def _sampling_params(body: dict[str, Any], max_tokens: int,
                     logprobs: int | None) -> SamplingParams:
    kwargs = {name: _field(body, name, *rule) for name, rule in _SAMPLING.items()}
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)
    except ValueError as e:  # a check of SamplingParams' own that the table above missed
        first_word = str(e).split(" ", 1)[0]
        param = first_word if first_word in {*_SAMPLING, "max_tokens", "logprobs"} else None
        raise bad_request(str(e), param) from e


def _check_stop_limits(stop: Any, limits: RequestLimits) -> None:
    """Count and length of the stop strings, and their text; types are checked later."""
    strings = [stop] if isinstance(stop, str) else stop
    if not isinstance(strings, list):
        return
    if len(strings) > limits.max_stop_strings:
        raise bad_request(f"stop has {len(strings)} strings; this server allows at most "
                          f"{limits.max_stop_strings} (--max-stop-strings)", "stop")
    for i, s in enumerate(strings):
        if isinstance(s, str) and len(s) > limits.max_stop_string_chars:
            raise bad_request(f"stop[{i}] has {len(s)} characters; this server allows at most "
                              f"{limits.max_stop_string_chars} (--max-stop-string-chars)", "stop")
        if isinstance(s, str):
            _check_text(s, f"stop[{i}]", "stop")


def _check_stop_token_ids(ids: Any, limits: RequestLimits, vocab_size: int | None) -> None:
    """Count of the stop token ids, and their range when the vocabulary is known; types are
    checked later."""
    if not isinstance(ids, list):
        return
    if len(ids) > limits.max_stop_token_ids:
        raise bad_request(f"stop_token_ids has {len(ids)} ids; this server allows at most "
                          f"{limits.max_stop_token_ids} (--max-stop-token-ids)", "stop_token_ids")
    if vocab_size is None:
        return
    outside = [t for t in ids if _is_int(t) and t >= vocab_size]
    if outside:
        raise bad_request(f"stop_token_ids must be token ids in [0, {vocab_size}) (the "
                          f"tokenizer's vocabulary); got {_show(outside)}", "stop_token_ids")


def _check_text(text: str, where: str, param: str) -> None:
    at = unpaired_surrogate(text)
    if at is not None:
        raise bad_request(f"{where} must be valid Unicode text; it holds an unpaired surrogate "
                          f"{_show(text[at])} at index {at}", param)


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise bad_request('stream_options must be an object like {"include_usage": true}; '
                          f"got {_show(options)}", "stream_options")
    flag = options.get("include_usage")
    if flag is not None and not isinstance(flag, bool):
        raise bad_request(f"stream_options.include_usage must be true or false; got {_show(flag)}",
                          "stream_options")
    return bool(flag)


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    wanted = _field(body, "logprobs", False, _is_bool, "true or false")
    top = _field(body, "top_logprobs", None, _is_logprob_count, _LOGPROB_COUNT)
    if top is not None and not wanted:
        raise bad_request("top_logprobs requires logprobs: true", "top_logprobs")
    return (top or 0) if wanted else None


# ---- prompts and messages ---------------------------------------------------------------------


def _prompt(value: Any) -> str | list[int]:
    """One prompt: text, token ids, or a list holding exactly one of those."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]
    if isinstance(value, str | list) and not value:
        raise bad_request("prompt must not be empty", "prompt")
    if isinstance(value, str):
        _check_text(value, "prompt", "prompt")
        return value
    if isinstance(value, list) and all(_is_int(t) for t in value):
        if not _is_token_ids(value):
            raise bad_request("prompt token ids must be integers >= 0", "prompt")
        return list(value)
    if isinstance(value, list) and all(isinstance(p, str | list) for p in value):
        raise bad_request("batched prompts are not supported; send one request per prompt",
                          "prompt")
    raise bad_request("prompt is required: a string, a list of token ids, or a list holding "
                      f"one of those; got {_show(value)}", "prompt")


def _messages(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise bad_request('messages must be a non-empty list of {"role", "content"} objects; '
                          f"got {_show(value)}", "messages")
    return [_message(f"messages[{i}]", m) for i, m in enumerate(value)]


def _message(where: str, message: Any) -> Message:
    """`{"role", "content"}` with content as one string; other keys are dropped."""
    if not isinstance(message, dict):
        raise bad_request(f"{where} must be an object with role and content", "messages")
    role = message.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(CHAT_ROLES)}; "
                          f"got {_show(role)}", "messages")
    content = _content(where, role, message.get("content"))
    _check_text(content, f"{where}.content", "messages")
    return {"role": role, "content": content}


def _content(where: str, role: str, content: Any) -> str:
    """Text parts are joined with newlines (as vLLM does); an assistant's null content is ""."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if isinstance(content, list) and all(_is_text_part(p) for p in content):
        return "\n".join(p["text"] for p in content)
    raise bad_request(f'{where}.content must be a string or a list of {{"type": "text", '
                      f'"text": ...}} parts (only text is supported); got {_show(content)}',
                      "messages")


def _is_text_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "text" and isinstance(
        part.get("text"), str)


# ---- context and chat template ----------------------------------------------------------------


def check_context(prompt_len: int, max_tokens: int | None, max_model_len: int,
                  prompt_param: str = "prompt") -> int:
    """The completion's token bound: `max_tokens`, or the rest of the context when None.

    The result `m` satisfies `m >= 1` and `prompt_len + m <= max_model_len`; a request that
    cannot is a 400 (code "context_length_exceeded" when it is too long). `prompt_param` is
    "prompt" or "messages", the field blamed when the prompt alone is too long.
    """
    if prompt_len < 1:
        raise bad_request(f"the {prompt_param} is empty: it renders to 0 tokens", prompt_param)
    head = f"This model's maximum context length is {max_model_len} tokens. However, "
    if prompt_len >= max_model_len:
        raise _too_long(head + f"your {prompt_param} has {prompt_len} tokens, which leaves no "
                        f"room for the completion. Please reduce the length of the "
                        f"{prompt_param}.", prompt_param)
    if max_tokens is None:
        return max_model_len - prompt_len
    if prompt_len + max_tokens > max_model_len:
        raise _too_long(head + f"you requested {prompt_len + max_tokens} tokens ({prompt_len} "
                        f"in the {prompt_param}, {max_tokens} for the completion). Please "
                        f"reduce the length of the {prompt_param} or the completion.",
                        "max_tokens")
    return max_tokens


def _too_long(message: str, param: str) -> ApiError:
    return ApiError(400, message, param=param, code="context_length_exceeded")


class ChatTokenizer(Protocol):
    """What `render_chat` needs of a Hugging Face tokenizer."""

    chat_template: str | None

    def apply_chat_template(self, conversation: list[Message], **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> Any: ...


def render_chat(tokenizer: ChatTokenizer, messages: Sequence[Message]) -> list[int]:
    """The prompt token ids of `messages` through the model's chat template, ready to answer
    (special-token text anywhere, content included, becomes special tokens)."""
    return encode_prompt(tokenizer, render_chat_text(tokenizer, messages),
                         add_special_tokens=False)


def render_chat_text(tokenizer: ChatTokenizer, messages: Sequence[Message]) -> str:
    """The chat template's text for `messages`, ending with the assistant's turn opening."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request("this model has no chat template; use /v1/completions", "messages")
    try:
        return tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=False
        )
    except jinja2.TemplateError as e:  # the template's raise_exception(): roles out of order...
        raise bad_request(f"the chat template refused these messages: {e}", "messages") from e
