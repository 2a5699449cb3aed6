"""Offline API in vLLM's shape: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from pdserve.common.sampling_params import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.outputs import RequestOutput

Prompt = str | list[int]


class LLM:
    """A collocated engine driven to completion for a batch of prompts.
    `LLM(tensor_parallel_size=N)` computes on N processes (`pdserve.engine.parallel`)."""

    def __init__(self, model: str = "smollm2", dtype: str = "auto", **engine_args) -> None:
        self.engine = Engine(EngineConfig(model=model, dtype=dtype, **engine_args))

    def close(self) -> None:
        """Stop the engine's other processes (tensor parallelism); also when the object goes
        away or the interpreter exits."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in the order given. A prompt is a str or a list of
        token ids. Bad input raises ValueError before any prompt runs."""
        batch = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params, len(batch))
        ids: list[str] = []
        try:
            for prompt, p in zip(batch, params, strict=True):
                ids.append(self.engine.add_request(prompt, p))
        except ValueError:
            for rid in ids:
                self.engine.abort(rid)
            self.engine.step()  # drain the abort outputs
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]],
        sampling_params: SamplingParams | None = None,
        use_tqdm: bool = False,
    ) -> RequestOutput:
        """One conversation through the model's chat template."""
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate()")
        ids = tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return self.generate([list(ids)], sampling_params, use_tqdm)[0]

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm)
        wanted = set(ids)
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a str, a list of token ids, or a non-empty list of "
                         "those")
    if all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # one prompt of token ids
    bad = [p for p in prompts if not isinstance(p, str | list | tuple)]
    if bad:
        raise ValueError(f"each prompt must be a str or a list of token ids, got {bad[0]!r}")
    return [p if isinstance(p, str) else list(p) for p in prompts]


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling params for {n} prompts")
    return params
