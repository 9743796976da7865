"""Reading the stack dumps that ranks write on :data:`STACK_SIGNAL`.

A rank's dump is faulthandler's text: one block per thread, innermost frame first.
This module picks the block of the thread that runs user code, turns it into
:class:`Frame` records and summarises it in one line ("in barrier
(distributed_c10d.py:4800)"). It only parses text; it does not signal anyone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_BLOCK_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_DISTRIBUTED_PATH = re.compile(r"[/\\]torch[/\\]distributed[/\\]")


@dataclass(frozen=True)
class Frame:
    """One Python frame of a dump (innermost first in a stack)."""

    file: str
    line: int
    function: str


def thread_blocks(dump: str) -> dict[int, list[Frame]]:
    """Split a faulthandler dump into ``{thread ident: frames}``; ``-1`` marks "Current thread"."""
    blocks: dict[int, list[Frame]] = {}
    frames: list[Frame] | None = None
    for raw in dump.splitlines():
        header = _BLOCK_HEADER.match(raw)
        if header:
            ident = int(header.group(2), 16)
            frames = blocks.setdefault(ident, [])
            if header.group(1) == "Current thread":
                blocks[-1] = frames
            continue
        match = _FRAME.match(raw)
        if match and frames is not None:
            frames.append(Frame(match["file"], int(match["line"]), match["func"]))
    return blocks


def user_stack(dump: str, thread_id: int | None) -> list[Frame]:
    """User frames of the thread running user code (``thread_id``), else of the dumping thread."""
    blocks = thread_blocks(dump)
    if thread_id is not None and thread_id in blocks:
        return user_frames(blocks[thread_id])
    return user_frames(blocks.get(-1, []))


_FRAMEWORK_PATH = re.compile(
    r"([/\\](IPython|ipykernel|ipyparallel|tornado|traitlets|zmq|asyncio)[/\\])|^<frozen "
    # how a local engine was started: forked by the pool's forker, run as `python -m`
    r"|([/\\]pool[/\\]_engine_(forker|entry)\.py$)|([/\\]runpy\.py$)"
)
_WRAPPER_FILES = ("c10d_logger.py",)


def user_frames(frames: list[Frame]) -> list[Frame]:
    """``frames`` without the outer engine machinery (IPython, ipyparallel, asyncio, ...).

    An idle engine has only machinery frames, so the result is empty.
    """
    kept = list(frames)
    while kept and _FRAMEWORK_PATH.search(kept[-1].file):
        kept.pop()
    return kept


def in_distributed(frames: list[Frame]) -> Frame | None:
    """The outermost ``torch.distributed`` call of a stack (skipping logging wrappers)."""
    hits = [
        f
        for f in frames
        if _DISTRIBUTED_PATH.search(f.file) and not f.file.endswith(_WRAPPER_FILES)
    ]
    return hits[-1] if hits else None


def describe(frames: list[Frame], code: str | None = None) -> str:
    """One line saying where a rank is: the torch.distributed call, else the innermost frame.

    ``code`` is the cell source that was sent to the ranks; frames of cell code (files
    that are not real paths) are shown with their source line from it.
    """
    if not frames:
        return "idle (no user code running)"
    dist_frame = in_distributed(frames)
    if dist_frame is not None:
        return f"in {dist_frame.function} ({_short(dist_frame.file)}:{dist_frame.line})"
    inner = frames[0]
    text = f"in {inner.function} ({_short(inner.file)}:{inner.line})"
    if code is not None and _is_cell(inner.file):
        lines = code.splitlines()
        if 1 <= inner.line <= len(lines):
            text += f": {lines[inner.line - 1].strip()}"
    return text


def format_stack(frames: list[Frame]) -> str:
    """Frames as ``File "...", line N in func`` lines, outermost first (traceback order)."""
    return "\n".join(f'  File "{f.file}", line {f.line} in {f.function}' for f in reversed(frames))


def _short(path: str) -> str:
    return re.split(r"[/\\]", path)[-1] if not _is_cell(path) else "<cell>"


def _is_cell(path: str) -> bool:
    return path.startswith("<") or "ipykernel_" in path or "ipython-input" in path
