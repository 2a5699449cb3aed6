"""Find a model folder, offline, and check what it holds.

A *model folder* is a Hugging Face checkpoint folder: `config.json` (an architecture pdserve
runs), `*.safetensors` weights (one file, or shards listed by `model.safetensors.index.json`)
and a tokenizer (`tokenizer.json`, or a sentencepiece `tokenizer.model`). Nothing here ever
downloads: a name is either a local folder or one of `KNOWN_MODELS`, built from files already
installed on this machine (`pdserve.common.smollm2`). Reading the weights is the engine's
(`pdserve.engine.model.weights`); loading the tokenizer is `pdserve.common.tokenizer`'s.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pdserve.common.model_config import ModelConfig
from pdserve.common.smollm2 import SMOLLM2_ALIASES, smollm2_folder

KNOWN_MODELS = ("smollm2", "SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def cache_root(cache_dir: Path | None = None) -> Path:
    """Root of pdserve's cache: `cache_dir`, else $PDSERVE_CACHE_DIR, else ~/.cache/pdserve."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """The model folder for a known model name or a local folder path.

    Known names win over a same-named relative folder (pass "./smollm2" for the folder).
    SmolLM2 is converted into `<cache root>/models/` on first use and reused afterwards.
    """
    if str(name_or_path).lower() in SMOLLM2_ALIASES:
        return smollm2_folder(cache_root(cache_dir) / "models")
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        validate_model_folder(path)
        return path.resolve()
    raise ValueError(
        f"unknown model {name_or_path!r}: it is not a local folder and not a known name "
        f"({', '.join(KNOWN_MODELS)}; case-insensitive). No download is attempted (pdserve "
        "runs offline): pass the path of a Hugging Face model folder."
    )


def validate_model_folder(path: Path) -> ModelConfig:
    """Parse config.json and check that weights and a tokenizer are present; the config."""
    path = Path(path)
    config = ModelConfig.from_folder(path)
    weight_files(path)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"{path} has no tokenizer: expected tokenizer.json (or a sentencepiece "
            "tokenizer.model) next to config.json"
        )
    return config


def weight_files(path: Path) -> list[Path]:
    """The safetensors files to read: the index's shards if an index exists, else all."""
    path = Path(path)
    index = path / INDEX_FILE
    if not index.is_file():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{path} has no weights: expected *.safetensors files")
        return files
    shards = sorted(set(read_index(index).values()))
    missing = [s for s in shards if not (path / s).is_file()]
    if missing:
        raise ValueError(f"{index} lists shard(s) that are missing: {', '.join(missing)}")
    return [path / s for s in shards]


def read_index(index: Path) -> dict[str, str]:
    """The index's weight_map: parameter name -> shard file name."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a safetensors index with a weight_map: {e}") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: weight_map must be a non-empty object")
    return weight_map
