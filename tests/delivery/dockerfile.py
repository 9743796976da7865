"""A small reader of Dockerfiles for checking the image recipes without a Docker engine.

It understands what the recipes in docker/ use: comments, parser directives, line
continuations, ``ARG`` defaults and ``ENV`` values (expanded in later instructions the way
the builder expands them, ``$VAR``/``${VAR}`` only), and the shell-form ``RUN`` commands
split into simple commands. It is not a full Dockerfile parser (no heredocs, no
``${VAR:-default}`` forms, no escape-character directive).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
_COMMAND_SEPARATORS = re.compile(r"&&|\|\||;|\|")


@dataclass(frozen=True)
class Instruction:
    """One instruction: its keyword (upper case), its raw arguments and its first line."""

    keyword: str
    arguments: str
    line: int

    def exec_form(self) -> list[str] | None:
        """The JSON-array form of the arguments, or None for the shell form."""
        text = self.arguments
        for option in re.findall(r"^(?:--\S+\s+)*", text)[:1]:
            text = text[len(option) :]
        if text.startswith("CMD "):
            text = text[len("CMD ") :]
        try:
            value = json.loads(text)
        except ValueError:
            return None
        return value if isinstance(value, list) else None


def parse_instructions(text: str) -> list[Instruction]:
    """Split a Dockerfile into instructions (comments dropped, continuations joined)."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if not pending:
            start = number
        continued = stripped.endswith("\\")
        pending.append(stripped[:-1].strip() if continued else stripped)
        if not continued:
            keyword, _, arguments = " ".join(pending).partition(" ")
            instructions.append(Instruction(keyword.upper(), arguments.strip(), start))
            pending = []
    if pending:
        raise ValueError(f"line {start}: continuation runs past the end of the file")
    return instructions


@dataclass(frozen=True)
class Copy:
    """A ``COPY`` instruction: its ``--flag=value`` options, sources and destination."""

    flags: dict[str, str]
    sources: list[str]
    destination: str


class Recipe:
    """A parsed Dockerfile with variables expanded as the builder would."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.instructions = parse_instructions(path.read_text(encoding="utf-8"))
        self.expanded: list[Instruction] = []
        self.variables: dict[str, str] = {}
        for instruction in self.instructions:
            arguments = instruction.arguments
            if instruction.keyword not in ("RUN", "CMD", "ENTRYPOINT", "HEALTHCHECK"):
                # The builder expands these instructions itself; RUN and friends are left to
                # the shell, which sees ARG and ENV values as environment variables.
                arguments = self.expand(arguments)
            expanded = Instruction(instruction.keyword, arguments, instruction.line)
            self.expanded.append(expanded)
            if instruction.keyword == "ARG":
                name, _, default = arguments.partition("=")
                self.variables.setdefault(name.strip(), default.strip())
            elif instruction.keyword == "ENV":
                for item in shlex.split(arguments):
                    name, _, value = item.partition("=")
                    self.variables[name] = value

    def expand(self, text: str) -> str:
        """``text`` with ``$VAR`` and ``${VAR}`` replaced by the values known so far."""

        def value(match: re.Match[str]) -> str:
            name = match.group(1) or match.group(2)
            return self.variables.get(name, match.group(0))

        return _VARIABLE.sub(value, text)

    def all(self, keyword: str) -> list[Instruction]:
        """Every instruction with this keyword, variables expanded, in file order."""
        return [item for item in self.expanded if item.keyword == keyword]

    def last(self, keyword: str) -> Instruction:
        """The last instruction with this keyword (the one in force); KeyError if none."""
        found = self.all(keyword)
        if not found:
            raise KeyError(f"{self.path.name} has no {keyword} instruction")
        return found[-1]

    def index(self, instruction: Instruction) -> int:
        """Position of an instruction returned by this recipe."""
        return self.expanded.index(instruction)

    def env(self) -> dict[str, str]:
        """The environment the image ends up with (ENV values only, expanded)."""
        result: dict[str, str] = {}
        for instruction in self.all("ENV"):
            for item in shlex.split(instruction.arguments):
                name, _, value = item.partition("=")
                result[name] = value
        return result

    def copies(self) -> list[Copy]:
        """Every ``COPY``, with its options separated from its paths."""
        found = []
        for instruction in self.all("COPY"):
            words = shlex.split(instruction.arguments)
            flags = {}
            while words and words[0].startswith("--"):
                name, _, value = words.pop(0)[2:].partition("=")
                flags[name] = value
            found.append(Copy(flags, words[:-1], words[-1]))
        return found

    def run_commands(self) -> list[tuple[Instruction, list[str]]]:
        """Every simple command of every shell-form ``RUN``, as words, ARG/ENV expanded.

        Redirections stay in the word list (``>`` and its target); quoting is resolved.
        """
        found = []
        for instruction in self.all("RUN"):
            for part in _COMMAND_SEPARATORS.split(self.expand(instruction.arguments)):
                words = shlex.split(part)
                if words:
                    found.append((instruction, words))
        return found

    def pip_installs(self) -> list[tuple[Instruction, list[str]]]:
        """The ``pip install`` commands (words after ``install``), in file order."""
        return [
            (instruction, words[2:])
            for instruction, words in self.run_commands()
            if words[:2] == ["pip", "install"]
        ]


def option_values(words: list[str], *names: str) -> list[str]:
    """Values given to any of the options ``names`` (``--opt value`` or ``--opt=value``)."""
    values = []
    for position, word in enumerate(words):
        for name in names:
            if word == name and position + 1 < len(words):
                values.append(words[position + 1])
            elif word.startswith(name + "="):
                values.append(word[len(name) + 1 :])
    return values
