"""Stacks as plain data, and how they read: traceback-like text and a one-line summary.

A stack is a list of :class:`Frame` records, innermost first. Ranks capture them
themselves (:mod:`pool.rank._thread_stacks`, with each frame's source line and, for notebook
cells, the cell's label) or, as a fallback, write faulthandler's text on
:data:`._agent_wire.STACK_SIGNAL`, which :func:`thread_blocks` parses (no source lines
there). Both sides import this module: it is free of torch, IPython and ipyparallel,
and it only reads and formats; it does not signal anyone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

_BLOCK_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_DISTRIBUTED_PATH = re.compile(r"[/\\]torch[/\\]distributed[/\\]")


@dataclass(frozen=True)
class Frame:
    """One Python frame (innermost first in a stack).

    ``source``: the frame's current line of code, stripped (``None`` when unknown, as in
    faulthandler dumps). ``cell``: the notebook cell's label when the frame runs cell
    code, e.g. ``"Cell In[15]"`` (numbered by the notebook's execution count).
    """

    file: str
    line: int
    function: str
    source: str | None = None
    cell: str | None = None


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
    # an idle engine waits in its event loop's selector
    r"|([/\\]selectors\.py$)"
    # how a local engine was started: forked by the pool's forker, run as `python -m`
    r"|([/\\]pool[/\\]processes[/\\](_engine_forker|_engine_entry|_forked_children)\.py$)"
    r"|([/\\]runpy\.py$)"
    # how an attachable job's rank was started: python -m fsdp_interactive.attachable
    r"|([/\\]fsdp_interactive[/\\]attachable\.py$)"
)
_WRAPPER_FILES = ("c10d_logger.py",)


def is_machinery(path: str) -> bool:
    """Whether ``path`` is engine machinery (IPython, ipyparallel, asyncio, ...), not user code."""
    return bool(_FRAMEWORK_PATH.search(path))


def user_frames(frames: Sequence[Frame]) -> list[Frame]:
    """``frames`` without the outer engine machinery (IPython, ipyparallel, asyncio, ...).

    An idle engine has only machinery frames, so the result is empty.
    """
    kept = list(frames)
    while kept and _FRAMEWORK_PATH.search(kept[-1].file):
        kept.pop()
    return kept


def in_distributed(frames: Sequence[Frame]) -> Frame | None:
    """The outermost ``torch.distributed`` call of a stack (skipping logging wrappers)."""
    hits = [
        f
        for f in frames
        if _DISTRIBUTED_PATH.search(f.file) and not f.file.endswith(_WRAPPER_FILES)
    ]
    return hits[-1] if hits else None


def is_cell_file(path: str) -> bool:
    """Whether ``path`` names notebook cell code rather than a file on disk."""
    # ipykernel names cells /tmp/ipykernel_<pid>/<hash>.py, terminal IPython
    # <ipython-input-N-hash>; other "<...>" names are generated code (namedtuple, exec).
    return "ipykernel_" in path or path.startswith(("<ipython-input", "<cell"))


def with_cell_sources(frames: Sequence[Frame], code: str | None, cell: str | None) -> list[Frame]:
    """Frames of a faulthandler dump completed from what the kernel knows: cell frames get
    their line from ``code`` (the source sent to the ranks) and the label ``cell``."""
    lines = code.splitlines() if code is not None else []
    completed = []
    for frame in frames:
        if is_cell_file(frame.file) and frame.cell is None:
            source = lines[frame.line - 1].strip() if 1 <= frame.line <= len(lines) else None
            frame = replace(frame, source=frame.source or source, cell=cell)
        completed.append(frame)
    return completed


def location(frame: Frame) -> str:
    """``Cell In[15], line 3`` for cell code, ``distributed_c10d.py:5356`` for files."""
    if frame.cell:
        return f"{frame.cell}, line {frame.line}"
    return f"{_short(frame.file)}:{frame.line}"


def describe(frames: Sequence[Frame], code: str | None = None) -> str:
    """One line saying where a rank is.

    Inside ``torch.distributed``: the call and, when cell code led there, the cell line
    ("in barrier (distributed_c10d.py:5356), called from Cell In[15], line 3:
    dist.barrier()"). Otherwise the innermost frame with its source line. ``code``: the
    cell source sent to the ranks, for cell frames that carry no source line.
    """
    if not frames:
        return "idle (no user code running)"
    frames = with_cell_sources(frames, code, None) if code is not None else list(frames)
    dist_frame = in_distributed(frames)
    if dist_frame is not None:
        text = f"in {dist_frame.function} ({_short(dist_frame.file)}:{dist_frame.line})"
        caller = next((f for f in frames if is_cell_file(f.file)), None)
        if caller is not None:
            text += f", called from {location(caller)}"
            if caller.source:
                text += f": {caller.source}"
        return text
    inner = frames[0]
    text = f"in {inner.function} ({location(inner)})"
    if inner.source:
        text += f": {inner.source}"
    return text


def format_stack(frames: Sequence[Frame]) -> str:
    """Frames as a traceback reads, outermost first: ``File "...", line N, in func`` (or
    ``Cell In[15], line 3, in <module>``), each followed by its source line when known."""
    lines = []
    for frame in reversed(frames):
        if frame.cell:
            lines.append(f"  {frame.cell}, line {frame.line}, in {frame.function}")
        else:
            lines.append(f'  File "{frame.file}", line {frame.line}, in {frame.function}')
        if frame.source:
            lines.append(f"    {frame.source}")
    return "\n".join(lines)


def _short(path: str) -> str:
    return re.split(r"[/\\]", path)[-1] if not is_cell_file(path) else "<cell>"
