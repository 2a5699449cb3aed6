"""A request inside one engine: its tokens, its blocks, and where it is in its life cycle."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

from pdserve.common.sampling_params import SamplingParams


class RequestState(IntEnum):
    """Ordered life cycle; a request only ever moves to a larger state, except that preemption
    sends a RUNNING request back to WAITING (its blocks freed, to be recomputed).

    WAITING_FOR_KV: decode role only. Blocks are reserved (or waiting to be) and are written
    from outside; the request is never preempted in this state, so a writer can never land in
    blocks that another request owns. PREFILLED: prefill role only. Token 0 is sampled and the
    blocks stay held until `Engine.release()`. States from FINISHED_STOPPED on are terminal and
    own no blocks.
    """

    WAITING = 0
    WAITING_FOR_KV = 1
    RUNNING = 2
    PREFILLED = 3
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestState.FINISHED_STOPPED


FINISH_REASONS = {
    RequestState.FINISHED_STOPPED: "stop",
    RequestState.FINISHED_LENGTH: "length",
    RequestState.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """Invariants: `token_ids` = prompt + output; tokens [0, num_computed_tokens) have KV in
    `block_ids`; `len(block_ids) * block_size >= num_computed_tokens`; blocks
    [0, num_hashed_blocks) are registered in the prefix cache."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    state: RequestState = RequestState.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    remote_prefill: bool = False  # decode role: the prompt's KV comes from a prefill engine
    hand_over: bool = False  # stop after token 0 and hold the blocks (PREFILLED) until release
    output_offset: int = 0  # a continuation: output tokens of the request already in the prompt
    output_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    stop_reason: str | int | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def computing_prompt(self) -> bool:
        """The next token to compute is one of the prompt's (a prefill, whole or a chunk)."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.state)
