"""The landing page and the docs hold together: the README's example runs in a real Jupyter
kernel (and every other block a page marks as runnable), the README stays a landing page
(under 14 KB), every page under docs/ is reachable from the index docs/README.md, and
every relative link and anchor resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs._pages import ROOT, reference_module

README = ROOT / "README.md"
INDEX = ROOT / "docs" / "README.md"
README_LIMIT_BYTES = 14_000
PAGES = sorted([README, *(ROOT / "docs").glob("*.md"), ROOT / "docker" / "README.md"])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)


def links(page: Path) -> list[str]:
    """The targets of the Markdown links and images of ``page``, outside code blocks."""
    return LINK.findall(FENCE.sub("", page.read_text()))


def anchors(page: Path) -> set[str]:
    """The anchors GitHub makes of ``page``'s headings."""
    headings = re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_readme_is_a_landing_page() -> None:
    size = len(README.read_bytes())
    assert size < README_LIMIT_BYTES, f"README.md is {size} bytes; move detail to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked here
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no {file.relative_to(ROOT)})")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target} (no heading #{anchor} in {file.relative_to(ROOT)})")
    assert broken == []


def test_every_docs_page_is_reachable_from_the_index() -> None:
    reached, todo = {INDEX}, [INDEX]
    while todo:
        page = todo.pop()
        for target in links(page):
            path = target.partition("#")[0]
            if not path.endswith(".md") or re.match(r"[a-z]+:", path):
                continue
            found = (page.parent / path).resolve()
            if found.parent == INDEX.parent and found.exists() and found not in reached:
                reached.add(found)
                todo.append(found)
    unreached = sorted(p.name for p in INDEX.parent.glob("*.md") if p.resolve() not in reached)
    assert unreached == []


def _shown_text(messages: list[dict]) -> str:
    return "\n".join(
        m["content"]["data"].get("text/plain", "")
        for m in messages
        if m["msg_type"] in ("execute_result", "display_data")
    )


def test_the_readme_example_runs_in_a_kernel_and_shows_the_layout() -> None:
    reference = reference_module()
    blocks = reference.runnable_blocks(README)["readme"]
    assert len(blocks) == 4 and blocks[0].strip() == "%load_ext fsdp_interactive"
    outputs = reference.run_blocks(blocks)
    shown = _shown_text(outputs[-1])
    # the parameter the README names, and both ranks' slices of it
    assert "blocks.1.mlp.0.weight" in shown
    assert "rank 1" in shown or "r1" in shown


def test_every_other_runnable_block_runs() -> None:
    reference = reference_module()
    groups = {
        (page.name, group): blocks
        for page in PAGES
        if page != README
        for group, blocks in reference.runnable_blocks(page).items()
    }
    for (name, group), blocks in groups.items():
        try:
            reference.run_blocks(blocks)
        except RuntimeError as error:
            raise AssertionError(f"{name}, runnable group {group!r}: {error}") from None
