"""Every import in src/pdserve follows the layers written in docs/structure.md: a part imports
only the parts listed on its row."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "pdserve"
EVERY_PART = "every part"


def allowed_imports() -> dict[str, set[str] | None]:
    """part -> the parts it may import (None: any), from the table in docs/structure.md."""
    rules: dict[str, set[str] | None] = {}
    for line in (ROOT / "docs" / "structure.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("`"):
            continue
        parts = re.findall(r"`([a-z_][a-z0-9_]*)`", cells[0])
        allowed = None if cells[2] == EVERY_PART else \
            {p.strip() for p in cells[2].split(",") if p.strip()}
        for part in parts:
            rules[part] = allowed
    return rules


def part_of(module: str) -> str:
    """'pdserve.router.app' -> 'router'; 'pdserve.config' -> 'config'; 'pdserve' -> 'pdserve'."""
    names = module.split(".")
    return names[1] if len(names) > 1 else names[0]


def imports(path: Path) -> set[str]:
    """The pdserve modules `path` imports, at any depth (inside functions and TYPE_CHECKING
    blocks too: a lazy import is still a dependency)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return {m for m in found if m == "pdserve" or m.startswith("pdserve.")}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(SRC.parent).with_suffix("").parts)


def test_every_part_of_the_source_has_a_row() -> None:
    rules = allowed_imports()
    parts = {part_of(module_name(p)) for p in SRC.rglob("*.py")} - {"__init__"}
    assert parts - set(rules) == set(), "add these parts to docs/structure.md"


def test_no_module_imports_across_its_layer() -> None:
    rules = allowed_imports()
    wrong = []
    for path in sorted(SRC.rglob("*.py")):
        me = part_of(module_name(path))
        me = "pdserve" if me == "__init__" else me
        allowed = rules[me]
        if allowed is None:
            continue
        for target in sorted(imports(path)):
            other = part_of(target)
            if other != me and other not in allowed:
                wrong.append(f"{path.relative_to(ROOT)} imports {target} ({me} -> {other})")
    assert wrong == [], "imports across the layers of docs/structure.md:\n" + "\n".join(wrong)


def test_the_rules_name_only_parts_that_exist() -> None:
    rules = allowed_imports()
    named = set().union(*(r for r in rules.values() if r is not None))
    assert named - set(rules) == set()
