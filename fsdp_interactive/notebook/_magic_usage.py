"""What the magics say about their own usage, written from their argument parsers.

``%fsdp?`` and ``%%fsdp?`` show it, a mistyped option ends with its usage line, and
``docs/magics.md`` is written from it (``make docs``; a test compares the file with what
:func:`reference_markdown` writes now), so the help a user reads is the parser that reads
the user's line and cannot drift from it. A subcommand of ``%fsdp`` declares its options
with IPython's ``magic_arguments`` on its method ``_fsdp_<name>`` and its description in
that method's docstring; a subcommand without options has no parser and takes no
arguments.
"""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MagicOption:
    """One argument of a magic: how it is typed, what it does, its default."""

    flags: str
    help: str
    default: str | None


@dataclass(frozen=True)
class MagicUsage:
    """One magic (or ``%fsdp`` subcommand): its usage line, description and options."""

    name: str
    usage: str
    description: str
    options: tuple[MagicOption, ...]

    def help_text(self, indent: str = "") -> str:
        """The usage line, the description and one line or more per option, as plain text."""
        lines = [f"{indent}{self.usage}"]
        if self.description:
            lines += [f"{indent}    {line}".rstrip() for line in self.description.splitlines()]
        for option in self.options:
            default = f" (default: {option.default})" if _shows_default(option) else ""
            lines.append(f"{indent}    {option.flags}: {option.help}{default}")
        return "\n".join(lines)


def usage_line(func: Any, name: str) -> str:
    """``usage: NAME [--option VALUE] ...`` on one line, for the magic whose options
    ``func`` declares with ``magic_arguments``; ``name`` is what the user types
    (``%fsdp start``, ``%%fsdp``)."""
    return "usage: " + _usage(func.parser, name)


def magic_usage(func: Any, name: str) -> MagicUsage:
    """The usage of the magic ``name`` implemented by ``func``: from its parser when it
    declares options, else from its docstring (a magic that takes no arguments)."""
    parser = getattr(func, "parser", None)
    if parser is None:
        return MagicUsage(name, name, _dedented(func.__doc__), ())
    return MagicUsage(
        name,
        _usage(parser, name),
        _dedented(parser.description),
        tuple(_option(parser, action) for action in parser._actions),
    )


def subcommand_usages(magics: Any, commands: Iterable[str]) -> list[MagicUsage]:
    """The usage of each ``%fsdp COMMAND`` of ``commands``, from the function
    ``magics.subcommand_function(COMMAND)`` (its parser)."""
    return [magic_usage(magics.subcommand_function(c), f"%fsdp {c}") for c in commands]


def line_magic_help(magics: type, commands: Iterable[str], summary: str) -> str:
    """``%fsdp``'s docstring (what ``%fsdp?`` shows): ``summary``, then every subcommand."""
    blocks = [usage.help_text(indent="    ") for usage in subcommand_usages(magics, commands)]
    return f"{summary}\n\n" + "\n\n".join(blocks) + "\n"


def cell_magic_help(func: Any, name: str) -> str:
    """A cell magic's docstring (what ``%%fsdp?`` shows)."""
    return magic_usage(func, name).help_text() + "\n"


def reference_markdown(usages: Iterable[MagicUsage], intro: str) -> str:
    """The magic reference page: ``intro``, a table of contents, then one section per magic."""
    usages = list(usages)
    lines = ["# Magic reference", "", intro, ""]
    lines += [f"- [`{u.name}`](#{_anchor(u.name)})" for u in usages]
    for usage in usages:
        lines += ["", f"## {usage.name}", "", "```text", usage.usage, "```", ""]
        if usage.description:
            lines += [_paragraphs(usage.description), ""]
        if usage.options:
            lines += ["| argument | what it does | default |", "| --- | --- | --- |"]
            for option in usage.options:
                default = f"`{option.default}`" if option.default else ""
                if not _shows_default(option) and option.default:
                    default = ""
                what = option.help.replace("|", "\\|")
                lines.append(
                    f"| `{option.flags.replace('|', chr(92) + '|')}` | {what} | {default} |"
                )
        else:
            lines.append("Takes no arguments." if usage.usage == usage.name else "")
    return "\n".join(lines).rstrip() + "\n"


def _usage(parser: argparse.ArgumentParser, name: str) -> str:
    usage = parser.format_usage()  # "::\n\n  %_fsdp_recover [--from ...]\n    [...]"
    words = " ".join(usage.replace("::", " ").split())
    return re.sub(r"^%\S+", lambda _: name, words)


def _option(parser: argparse.ArgumentParser, action: argparse.Action) -> MagicOption:
    formatter = parser._get_formatter()
    if action.option_strings:
        flags = ", ".join(action.option_strings)
        if action.nargs != 0:
            flags += " " + formatter._format_args(action, action.dest.upper())
    else:
        flags = formatter._format_args(action, action.dest)
    help_text = formatter._expand_help(action) if action.help else ""
    default = action.default
    shown = (
        None
        if default in (None, False, "", argparse.SUPPRESS) or action.nargs == 0
        else str(default)
    )
    return MagicOption(flags, " ".join(help_text.split()), shown)


def _shows_default(option: MagicOption) -> bool:
    """Whether to add the default: there is one and the help text does not state it."""
    return bool(option.default) and "default" not in option.help


def _dedented(text: str | None) -> str:
    return inspect.cleandoc(text or "")


def _paragraphs(text: str) -> str:
    """Docstring paragraphs as Markdown: wrapped lines joined, reST literals as code."""
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n")]
    return "\n\n".join(paragraphs).replace("``", "`")


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
