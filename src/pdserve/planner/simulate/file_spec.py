"""`FILE[:CONFIG]` arguments of `pdserve simulate` (--calibrate, --trace, --compare-measured).

`pdserve bench compare --out cmp.json` writes one entry per configuration name, both in
cmp.json (results) and in cmp.steps.json (worker steps); `:CONFIG` picks one of them.

Splitting rule: a spec naming an existing file is that file, whatever it contains (so a path
with a colon in it still works); otherwise the text after the last colon is the configuration
and the text before it the path. An empty configuration ("cmp.json:") means none.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class FileSpec:
    """A file and, optionally, the configuration chosen in it; `flag` names the argument in
    error messages, e.g. "calibrate (--calibrate)"."""

    path: Path
    config: str | None
    flag: str

    def __post_init__(self) -> None:
        if self.config == "":
            raise ValueError(f"{self.flag}: an empty configuration name; write FILE or "
                             "FILE:CONFIG")

    def __str__(self) -> str:
        return str(self.path) if self.config is None else f"{self.path}:{self.config}"


def parse_file_spec(spec: str, flag: str) -> FileSpec:
    """FILE or FILE:CONFIG by the module docstring's rule."""
    if Path(spec).exists() or ":" not in spec:
        return FileSpec(Path(spec), None, flag)
    path, _, config = spec.rpartition(":")
    return FileSpec(Path(path), config or None, flag)


STEPS_SUFFIX = ".steps.json"


def steps_path(results: Path) -> Path:
    """X.steps.json for the results X.json (`bench compare --out X.json` writes both)."""
    return results.with_suffix(STEPS_SUFFIX)


def results_path(steps: Path) -> Path:
    """X.json for the steps X.steps.json (`steps_path` the other way)."""
    return steps.with_name(steps.name.removesuffix(STEPS_SUFFIX) + ".json")


def read_text(spec: FileSpec) -> str:
    """The file's text; ValueError naming the argument when it cannot be read."""
    try:
        return spec.path.read_text()
    except OSError as e:
        raise ValueError(f"{spec.flag} {str(spec.path)!r} cannot be read: {e.strerror}") from e


def parse_json_document(text: str) -> Any | None:
    """The one JSON value `text` holds, or None when it is not one (JSONL, garbage)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def pick_config(spec: FileSpec, by_config: Mapping[str, Any], what: str) -> Any:
    """by_config[spec.config]; ValueError listing the configurations the file has."""
    if spec.config not in by_config:
        raise ValueError(f"{spec.flag} {spec.path}: no configuration {spec.config!r} in this "
                         f"{what} (it has: {', '.join(map(repr, by_config)) or 'none'})")
    return by_config[spec.config]


def refuse_config(spec: FileSpec, what: str) -> None:
    """ValueError when a configuration was given for a file that has none."""
    if spec.config is not None:
        raise ValueError(f"{spec.flag} {spec.path} is {what}: it has no configurations to "
                         f"choose {spec.config!r} from (:CONFIG goes with bench compare files)")
