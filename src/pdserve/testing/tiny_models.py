"""Tiny random-weight model folders for tests, built offline in well under a second.

A tiny folder has the layout of a Hugging Face checkpoint (`config.json`,
`generation_config.json`, `model.safetensors` in float32, tokenizer files), so
`transformers.AutoModelForCausalLM.from_pretrained(folder)` and pdserve's own loader read the
same bytes. Invariants:

* Everything is a pure function of (arch, seed, init_std, overrides): same arguments, same
  files, on any machine (weights come from a seeded CPU `torch.Generator`).
* `vocab_size` equals `len(tiny_tokenizer())`, so every token id the tokenizer can produce
  indexes the embedding.
* Weights use a large init std (0.3, not HF's 0.02) and non-trivial norm weights and biases,
  so greedy next-token logits are well separated (fp32 parity tests don't hit near-ties) and a
  loader that drops a norm weight or bias produces visibly different logits.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pdserve.testing.tiny_deepseek import DEEPSEEK_ARCHITECTURES, deepseek_defaults

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "mistral": "MistralForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "qwen3_moe": "Qwen3MoeForCausalLM", **DEEPSEEK_ARCHITECTURES}
# Written by transformers' own `save_pretrained` (its config.json layout and tensor names,
# e.g. one tensor per expert), with odd sizes: 6 heads over 3 KV heads of width 12, and for
# qwen3_moe 5 experts, 2 per token, layer 1 dense (`mlp_only_layers`).
_SAVED_BY_TRANSFORMERS = {
    "qwen3": {"num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 3,
              "head_dim": 12, "intermediate_size": 96, "use_sliding_window": False,
              "sliding_window": None, "tie_word_embeddings": True},
    "qwen3_moe": {"num_hidden_layers": 3, "num_attention_heads": 6, "num_key_value_heads": 3,
                  "head_dim": 12, "intermediate_size": 96, "use_sliding_window": False,
                  "sliding_window": None, "num_experts": 5, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 40, "norm_topk_prob": True, "mlp_only_layers": [1],
                  "decoder_sparse_step": 1},
    **{arch: deepseek_defaults(arch) for arch in DEEPSEEK_ARCHITECTURES},
}

BOS, EOS, PAD = "<|endoftext|>", "<|im_end|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, "<|im_start|>", EOS, PAD)  # ids 0..3, in this order

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_VOCAB_TARGET = 512

# The pre-split Qwen2 tokenizers use. transformers 5 rebuilds a Qwen2 tokenizer from the vocab and
# merges with this pipeline (ignoring tokenizer.json's), so the tiny tokenizer uses it for every
# arch: then AutoTokenizer gives identical ids whichever class it picks.
_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A serving system keeps many requests in flight
at once: it reads the prompt, fills a cache of keys and values, and then writes one token at a
time until the answer is complete. What is the capital of France? The capital of France is
Paris. What is the capital of Italy? The capital of Italy is Rome. Hello, how are you today?
I am fine, thank you, and you? The weather is nice and the sun is shining over the hills.
Once upon a time there was a small model that wanted to answer every question it was asked.
It learned numbers: one, two, three, four, five, six, seven, eight, nine, ten, 0 1 2 3 4 5 6
7 8 9 10 100 1000. It learned code too: def main(): return print("hello world") if x > 0
else None. The scheduler decides which request runs next; the block manager hands out pages
of memory; the router sends each request to a prefill worker and then to a decode worker.
Please write a short story about a cat who likes to sleep in the warm afternoon light.
Summarize the following text in one sentence. Translate this sentence into French. Explain
why the sky is blue. List three colors: red, green, and blue. Thank you for your help!
"""


@functools.lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    """The trained byte-level BPE, as JSON; training is deterministic for a fixed corpus."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_TARGET,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return tok.to_str()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh (not shared) tokenizer: byte-level BPE, ChatML chat template, no auto-BOS.

    Byte-level means any text encodes (no unknown tokens) and decode(encode(s)) == s.
    """
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
    )


def _hf_config(arch: str, vocab_size: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """config.json in the classic Hub layout (top-level rope_theta), read by transformers 4/5."""
    tok = tiny_tokenizer()
    cfg: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-6,
        # Not the 10000 default, so a loader that misreads the base fails the parity tests.
        "rope_theta": {"llama": 100000.0, "qwen2": 1000000.0, "mistral": 500.0, "qwen3": 20000.0,
                       "qwen3_moe": 50000.0, "deepseek_v3": 5000.0, "deepseek_v2": 5000.0}[arch],
        "hidden_act": "silu",
        "tie_word_embeddings": arch == "llama",
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "torch_dtype": "float32",
    }
    if arch == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None)
    if arch == "mistral":
        cfg["sliding_window"] = 512  # below max_position_embeddings so the context cap shows
    cfg.update(_SAVED_BY_TRANSFORMERS.get(arch, {}))
    cfg.update(overrides)
    return cfg


def _param_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF parameter names -> shapes for a Llama-family decoder described by `cfg`."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if cfg["architectures"][0] == "Qwen2ForCausalLM":
            shapes |= {p + f"self_attn.{n}_proj.bias": (s,) for n, s in
                       (("q", q), ("k", kv), ("v", kv))}
    shapes["model.norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (cfg["vocab_size"], h)
    return shapes


def _random_weights(shapes: dict[str, tuple[int, ...]], seed: int,
                    std: float) -> dict[str, torch.Tensor]:
    """Norm weights ~ 1 + N(0, 0.1); everything else ~ N(0, std). Drawn in `shapes` order."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=gen, dtype=torch.float32)
        out[name] = 1.0 + 0.1 * noise if "norm" in name else std * noise
    return out


def write_tiny_model(path: Path, arch: str = "llama", *, seed: int = 0, init_std: float = 0.3,
                     **config_overrides: Any) -> Path:
    """Write a tiny `arch` model folder at `path` (created if needed) and return `path`.

    Defaults: hidden 64, 2 layers, 4 heads, 2 KV heads (GQA), head_dim 16, intermediate 128,
    1024 positions, vocab = tokenizer size; llama ties embeddings (like SmolLM2), qwen2 has
    q/k/v biases, mistral has sliding_window 512. `config_overrides` replace config.json
    fields by their HF names (e.g. num_hidden_layers=4, tie_word_embeddings=False).
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny arch {arch!r}; choose one of {sorted(ARCHITECTURES)}")
    tok = tiny_tokenizer()
    cfg = _hf_config(arch, len(tok), config_overrides)
    if cfg["vocab_size"] < len(tok):
        raise ValueError(f"vocab_size={cfg['vocab_size']} is below the tokenizer's {len(tok)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if arch in _SAVED_BY_TRANSFORMERS:
        _save_with_transformers(cfg, path, seed, init_std)
    else:
        weights = _random_weights(_param_shapes(cfg), seed, init_std)
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
    gen_cfg = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (path / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2))
    tok.save_pretrained(path, save_jinja_files=False)  # chat template in tokenizer_config
    return path


def _save_with_transformers(cfg: dict[str, Any], path: Path, seed: int, std: float) -> None:
    """transformers builds the model from `cfg`, takes `_random_weights` over its own
    parameter names (a tied lm_head is not drawn) and writes config.json and the weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg["model_type"], **fields),
                                             dtype=torch.float32)
    tied = cfg["tie_word_embeddings"]
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()
              if not (tied and name == "lm_head.weight")}
    model.load_state_dict(_random_weights(shapes, seed, std), strict=not tied)
    model.save_pretrained(path)
