"""What the engine returns: vLLM's `RequestOutput` / `CompletionOutput` shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list[float | None] | None = None  # chosen tokens' logprobs, when requested
    top_logprobs: list[dict[int, float] | None] | None = None
    new_token_ids: list[int] = field(default_factory=list)  # since the previous output
    new_text: str = ""


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    # Prefill role: token 0 is sampled and these blocks hold the prompt's KV until
    # `Engine.release(request_id)`; None otherwise.
    kv_block_ids: list[int] | None = None
