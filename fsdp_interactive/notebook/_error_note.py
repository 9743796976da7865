"""How a view shows an error a click caused: the exception line first, then a collapsible
traceback of the user's own frames (notebook side).

A click has no caller to raise to, so views show the error in their status area.
:class:`ErrorNote` reads a pool ``RankError`` (the ranks' tracebacks, as IPython
formatted them) or a local exception and keeps the frames of user code: code the user
typed (an edit expression runs as ``<edit>``) and files outside the Python installation
and this package. The probe cells the views run on the ranks, the package's own frames
and library frames are left out; when nothing is left, the innermost frame (where the
error was raised) is shown instead.
"""

from __future__ import annotations

import html
import re
import traceback
from dataclasses import dataclass

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_BLOCK_START = re.compile(r"^(Cell In\[\d+\]|File )")
_LIBRARY = re.compile(
    r"[/\\](site-packages|dist-packages|lib[/\\]python\d[\d.]*|fsdp_interactive)[/\\]"
)
_PROBE = "_fsdp_interactive_"


@dataclass(frozen=True)
class ErrorNote:
    """``headline``: what went wrong, one line per distinct error; ``frames``: the user
    frames, each a block of text; ``innermost``: True when ``frames`` holds only the frame
    that raised because no user frame was found."""

    headline: str
    frames: tuple[str, ...] = ()
    innermost: bool = False

    @classmethod
    def of(cls, error: BaseException) -> ErrorNote:
        tracebacks = getattr(error, "tracebacks", None)
        errors = getattr(error, "errors", None)
        if isinstance(tracebacks, dict) and isinstance(errors, dict) and tracebacks:
            return cls._of_ranks(tracebacks, errors)
        headline = f"{type(error).__name__}: {error}".strip()
        blocks = [
            f'File "{f.filename}", line {f.lineno}, in {f.name}'
            + (f"\n    {f.line}" if f.line else "")
            for f in traceback.extract_tb(error.__traceback__)
        ]
        return cls._kept(headline, blocks)

    @classmethod
    def _of_ranks(cls, tracebacks: dict[int, str], errors: dict[int, tuple[str, str]]) -> ErrorNote:
        by_error: dict[tuple[str, str], list[int]] = {}
        for rank in sorted(errors):
            by_error.setdefault(tuple(errors[rank]), []).append(rank)  # type: ignore[arg-type]
        lines = []
        for (ename, evalue), ranks in by_error.items():
            who = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
            lines.append(f"{who}: {ename}: {_ANSI.sub('', evalue)}")
        first = _ANSI.sub("", tracebacks[min(tracebacks)])
        return cls._kept("\n".join(lines), _blocks(first))

    @classmethod
    def _kept(cls, headline: str, blocks: list[str]) -> ErrorNote:
        users = [block for block in blocks if _is_user_block(block)]
        if users or not blocks:
            return cls(headline, tuple(users))
        return cls(headline, (blocks[-1],), innermost=True)

    def text(self, prefix: str = "") -> str:
        return prefix + self.headline

    def html(self, prefix: str = "") -> str:
        head = "<br/>".join(html.escape(line) for line in self.text(prefix).splitlines())
        body = f'<div style="color:#b00"><b>{head}</b></div>'
        if self.frames:
            what = "where it was raised" if self.innermost else "traceback (your code)"
            frames = html.escape("\n\n".join(self.frames))
            body += (
                f"<details><summary>{what}</summary>"
                f'<pre style="font-size:85%">{frames}</pre></details>'
            )
        return body


def _blocks(text: str) -> list[str]:
    """The frame blocks of an IPython-formatted traceback ("Cell In[..]" / "File ...")."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if _BLOCK_START.match(line):
            blocks.append([line])
        elif blocks and line.strip() and not re.match(r"^\w+(Error|Exception|Interrupt)\b", line):
            blocks[-1].append(line)
        elif blocks and not line.strip():
            blocks.append([])  # a blank line ends the frame
    return ["\n".join(block) for block in blocks if block]


def _is_user_block(block: str) -> bool:
    header = block.splitlines()[0]
    if header.startswith("Cell In["):
        return _PROBE not in block  # the views' own probe code is not the user's
    path = header[len("File ") :].strip().strip('"')
    if path.startswith("<"):
        return True  # code the user typed: an edit expression, exec'd text
    return not _LIBRARY.search(path)
