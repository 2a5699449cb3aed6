"""Appends sampled tokens to requests, detokenizes them, and decides when a request stops.

Stop order for each new token (vLLM's): EOS (unless ignore_eos), a stop token id, a stop
string in the text, then the length limits (max_tokens, the model's context).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.detokenizer import IncrementalDetokenizer, find_stop
from pdserve.engine.outputs import CompletionOutput, RequestOutput
from pdserve.engine.request import Request, RequestState


@dataclass
class _TextState:
    detok: IncrementalDetokenizer | None
    text: str = ""
    sent_tokens: int = 0  # output tokens already reported
    sent_chars: int = 0
    prompt: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._states: dict[str, _TextState] = {}

    def add(self, req: Request, prompt: str | None) -> None:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens
            )
        self._states[req.request_id] = _TextState(detok, prompt=prompt)

    def append_token(
        self, req: Request, token: int, logprob: float | None, top: dict[int, float] | None
    ) -> RequestState | None:
        """Add one sampled token; return the finished state it causes, or None."""
        req.token_ids.append(token)
        if req.params.logprobs is not None:
            req.output_logprobs.append(logprob)
            req.output_top_logprobs.append(top)
        state = self._states[req.request_id]
        new_chars = 0
        if state.detok is not None:
            delta = state.detok.add(token)
            state.text += delta
            new_chars = len(delta)
        return self._stop_state(req, token, state, new_chars)

    def _stop_state(
        self, req: Request, token: int, state: _TextState, new_chars: int
    ) -> RequestState | None:
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return RequestState.FINISHED_STOPPED
        if token in p.stop_token_ids:
            req.stop_reason = token
            return RequestState.FINISHED_STOPPED
        if p.stop and new_chars:
            cut = find_stop(state.text, new_chars, p.stop, p.include_stop_str_in_output)
            if cut is not None:
                req.stop_reason = _matched_stop(state.text, cut, p.stop,
                                                p.include_stop_str_in_output)
                state.text = state.text[:cut]
                return RequestState.FINISHED_STOPPED
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestState.FINISHED_LENGTH
        return None

    def drop(self, request_id: str) -> None:
        """Forget a request that ends without a finished output (a released hand-over)."""
        self._states.pop(request_id, None)

    def make_output(self, req: Request, kv_block_ids: list[int] | None = None) -> RequestOutput:
        """A cumulative snapshot plus what is new since the previous one for this request."""
        state = self._states[req.request_id]
        finished = req.state.is_finished
        if finished and state.detok is not None and req.stop_reason is None:
            state.text += state.detok.flush()
        out_ids = req.output_token_ids
        completion = CompletionOutput(
            index=0,
            text=state.text,
            token_ids=out_ids,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
            top_logprobs=(list(req.output_top_logprobs) if req.params.logprobs else None),
            new_token_ids=out_ids[state.sent_tokens :],
            new_text=state.text[state.sent_chars :],
            held_tokens=0 if finished or state.detok is None else state.detok.held_tokens,
        )
        state.sent_tokens, state.sent_chars = len(out_ids), len(state.text)
        if finished:
            del self._states[req.request_id]
        return RequestOutput(
            request_id=req.request_id,
            prompt=state.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=req.num_cached_tokens,
            kv_block_ids=kv_block_ids,
        )


def _matched_stop(text: str, cut: int, stop: tuple[str, ...], include: bool) -> str:
    """The stop string that `find_stop` cut `text` at."""
    for s in stop:
        if (text[cut - len(s) : cut] if include else text[cut : cut + len(s)]) == s:
            return s
    raise AssertionError("find_stop returned a cut that no stop string explains")
