"""The references are generated and complete: the magic reference is what the parsers say,
the API reference builds without a warning, every public name has a docstring, and the
public namespaces show only what they export."""

from __future__ import annotations

import importlib
from typing import Any

import pytest

from tests.docs._pages import ROOT, reference_module
from tests.shell import shared_shell


def test_the_magic_reference_is_what_the_parsers_say() -> None:
    reference = reference_module()
    written = (ROOT / "docs" / "magics.md").read_text()
    assert written == reference.magic_reference(), (
        "docs/magics.md differs from the magics' parsers: run make docs and commit it"
    )


def test_every_magic_has_a_description() -> None:
    from fsdp_interactive.notebook import magics
    from fsdp_interactive.notebook._magic_usage import subcommand_usages

    usages = subcommand_usages(magics.FsdpMagics, magics._SUBCOMMANDS)
    assert [u.name for u in usages if not u.description] == []
    for usage in usages:
        assert [o.flags for o in usage.options if not o.help] == [], usage.name


def test_the_api_reference_builds_without_warnings_and_documents_every_public_name(
    tmp_path,
) -> None:
    problems = reference_module().build_api(tmp_path / "api")
    assert problems == []
    assert (tmp_path / "api" / "fsdp_interactive" / "pool.html").is_file()


def test_a_public_name_without_a_docstring_is_reported(tmp_path, monkeypatch) -> None:
    package = tmp_path / "undocumented_pkg"
    package.mkdir()
    (package / "__init__.py").write_text(
        '"""A package."""\n\n'
        '__all__ = ["Shown", "bare", "told"]\n\n\n'
        "class Shown:\n"
        '    """A class."""\n\n'
        "    def method(self):\n"
        "        return 1\n\n\n"
        "def bare():\n"
        "    return 2\n\n\n"
        "def told():\n"
        '    """A function."""\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("undocumented_pkg")
    missing = reference_module().undocumented([module], package="undocumented_pkg")
    assert missing == [
        "undocumented_pkg.Shown.method (function)",
        "undocumented_pkg.bare (function)",
    ]


@pytest.mark.parametrize("name", reference_module().API_MODULES)
def test_a_public_namespace_lists_only_what_it_exports(name: str) -> None:
    module = importlib.import_module(name)
    public = [n for n in dir(module) if not n.startswith("_")]
    exported = [n for n in module.__all__ if not n.startswith("_")]
    assert public == sorted(exported)


def _help(shell: Any, name: str) -> str:
    """What ``NAME?`` shows in the shell (IPython's inspector, as the pager gets it)."""
    return shell.object_inspect_text(name)


def test_fsdp_help_shows_the_real_usage_of_every_subcommand() -> None:
    shell = shared_shell()
    shell.run_line_magic("load_ext", "fsdp_interactive")
    from fsdp_interactive.notebook import magics

    text = _help(shell, "%fsdp")
    assert "--recover {auto,off}" in text
    for command in magics._SUBCOMMANDS:
        assert f"%fsdp {command}" in text
    cell = _help(shell, "%%fsdp")
    assert "%%fsdp [--targets RANKS]" in cell
    assert "fsdp_cell" not in cell
