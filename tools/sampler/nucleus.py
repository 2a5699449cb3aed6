"""How wide a language model's top-p nucleus is where it answers chat prompts: the engine
generates a reply to each of a few prompts with the given temperature and top-p, and every
sampled row's nucleus (the fewest most likely tokens whose probability reaches top-p, as
`engine/sampler.apply_top_p` keeps them) is counted; prints its quantiles and the share of
draws each of the sampler's top-p candidate pools holds.

    .venv/bin/python tools/sampler/nucleus.py [--model smollm2] [--temperature 0.7] [--top-p 0.9]
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoTokenizer

import pdserve.engine.sampler as sampler_module
from pdserve.common.model_folder import resolve_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.engine import Engine

PROMPTS = ("Write a short story about a lighthouse keeper.",
           "Explain how a transformer neural network works.",
           "What are the main causes of the French Revolution?",
           "Give me a recipe for pancakes.", "Summarize the plot of Hamlet.",
           "List five tips for learning a new language.",
           "How do vaccines train the immune system?", "Describe the water cycle for a child.")


def nucleus_size(row: torch.Tensor, params: SamplingParams) -> int:
    """Tokens in the nucleus of one row of logits [V]."""
    probs, _ = (row.float() / params.temperature).softmax(-1).sort(descending=True)
    return int(((probs.cumsum(0) - probs) < params.top_p).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    sizes: list[int] = []
    sample = sampler_module.Sampler._sample

    def counted(self, logits, params, positions):  # the sampler's own rows, then its draw
        sizes.extend(nucleus_size(row, p) for row, p in zip(logits, params, strict=True))
        return sample(self, logits, params, positions)

    sampler_module.Sampler._sample = counted
    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = Engine(EngineConfig(model=model, max_model_len=2048))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p)
    for text in PROMPTS:
        engine.add_request(tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False),
            params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    found = torch.tensor(sizes, dtype=torch.float32)
    print(f"{len(sizes)} draws at temperature {args.temperature}, top-p {args.top_p}: nucleus "
          + ", ".join(f"p{int(q * 100)} {int(found.quantile(q))}" for q in (0.5, 0.9, 0.99))
          + f", max {int(found.max())} tokens")
    for pool in sampler_module._TOP_P_POOLS:
        print(f"  within the top {pool}: {float((found <= pool).float().mean()):.1%}")


if __name__ == "__main__":
    main()
