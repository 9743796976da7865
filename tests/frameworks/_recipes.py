"""The recipes of docs/frameworks.md: the ``python`` code block after each
``<!-- recipe: NAME -->`` marker, its ``%%fsdp`` line left out (what a pool runs)."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "frameworks.md"
_RECIPE = re.compile(r"<!-- recipe: ([\w-]+) -->\n```python\n(.*?)```", re.DOTALL)


def recipes() -> dict[str, str]:
    """Every recipe of the page by name."""
    found = {}
    for name, code in _RECIPE.findall(DOC.read_text(encoding="utf-8")):
        lines = code.splitlines(keepends=True)
        if lines and lines[0].startswith("%%fsdp"):
            lines = lines[1:]
        found[name] = "".join(lines)
    return found


def recipe(name: str) -> str:
    """The recipe ``name``; ``KeyError`` naming the ones the page has."""
    found = recipes()
    if name not in found:
        raise KeyError(f"docs/frameworks.md has no recipe {name!r}; it has {sorted(found)}")
    return found[name]
