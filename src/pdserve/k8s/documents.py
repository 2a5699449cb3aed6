"""YAML in and out for `pdserve k8s`: the resources of a file, manifests as a YAML stream."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml


def read_documents(path: str) -> list[Any]:
    """The non-empty YAML documents of `path` ("-": standard input); ValueError when it cannot
    be read or parsed."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path} is not YAML: {e}") from None
    if not docs:
        raise ValueError(f"{path} holds no YAML document")
    return docs


def dump_documents(manifests: list[dict[str, Any]]) -> str:
    return yaml.safe_dump_all(manifests, sort_keys=False, default_flow_style=False)
