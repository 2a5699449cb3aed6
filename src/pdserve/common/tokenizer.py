"""Load a model folder's tokenizer without torch.

`transformers.AutoTokenizer` imports torch (its config machinery does), so the router and the
API layer could not use it torch-free. The tokenizer classes themselves import without torch:
this loads the class the folder's `tokenizer_config.json` names (`tokenizer_class`), else the
Rust-backed `PreTrainedTokenizerFast`, from local files only. The engine loads its tokenizer
here too, so the router and the workers always tokenize alike. Unlike AutoTokenizer, the class
is never re-chosen from `config.json`'s `model_type`: the folder's own declaration wins.
"""

from __future__ import annotations

import json
from pathlib import Path

import transformers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

TOKENIZER_CONFIG = "tokenizer_config.json"


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The folder's tokenizer, from local files only; ValueError saying what is wrong."""
    path = Path(path)
    try:
        return tokenizer_class(path).from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load the tokenizer in {path}: {e}") from e


def tokenizer_class(path: Path) -> type[PreTrainedTokenizerBase]:
    """The transformers tokenizer class `tokenizer_config.json` names, else the fast one."""
    name = _declared_class(Path(path) / TOKENIZER_CONFIG)
    if name is None:
        return PreTrainedTokenizerFast
    stem = name.removesuffix("Fast")  # transformers 5 folds each Fast class into its stem
    cls = getattr(transformers, name, None) or getattr(transformers, stem, None)
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase)):
        raise ValueError(f"{TOKENIZER_CONFIG} names tokenizer_class {name!r}, which is not a "
                         "tokenizer class of the installed transformers")
    return cls


def _declared_class(config_file: Path) -> str | None:
    if not config_file.is_file():
        return None
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{config_file} is not readable JSON: {e}") from e
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) and name else None
