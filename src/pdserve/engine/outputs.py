"""What the engine returns: vLLM's `RequestOutput` / `CompletionOutput` shape, each step's
`StepStats` and the `EngineLoad` snapshot."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.scheduler import SchedulerOutput


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
    # the last tokens whose text `text` does not hold yet (held back for an incomplete
    # character); `text` is the whole text of every token before them
    held_tokens: int = 0


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


@dataclass(frozen=True)
class StepStats:
    """What one engine step that ran a batch computed (`Engine.take_step_stats`)."""

    prefill_tokens: int  # prompt tokens computed (whole prompts or chunks)
    decode_tokens: int
    num_requests: int
    # The tokens the batch's decode requests (those past their prompt) attend to, summed: per
    # request prompt + output so far, the new token included; 0 with no decode token.
    decode_context: int
    # The (query, key) pairs of the step's prompt tokens, summed: n x c + n (n + 1) / 2 for a
    # prompt computing n tokens after c already computed (or cached), i.e. what causal prefill
    # attention costs grows with both; 0 with no prompt token.
    prefill_attention: int = 0

    @classmethod
    def of(cls, batch: SchedulerOutput) -> StepStats:
        """What `batch` computes, counted before it runs (num_computed_tokens as scheduled)."""
        context = attention = 0
        for r, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            if r.computing_prompt:
                attention += n * r.num_computed_tokens + n * (n + 1) // 2
            else:
                context += r.num_computed_tokens + n
        return cls(batch.num_prefill_tokens, batch.num_tokens - batch.num_prefill_tokens,
                   len(batch.requests), context, attention)


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds now (`Engine.load`), for metrics and health reports. Read from
    another thread than the one stepping, the fields are each current but not one instant."""

    running: int  # requests in the running batch
    waiting: int  # requests queued for prefill (or for recompute after preemption)
    waiting_for_kv: int  # decode role: remote requests reserved or queued for blocks
    kv_blocks_used: int
    kv_blocks_total: int

    @property
    def kv_usage(self) -> float:
        """The fraction of the pool's blocks held (0-1)."""
        return self.kv_blocks_used / self.kv_blocks_total
