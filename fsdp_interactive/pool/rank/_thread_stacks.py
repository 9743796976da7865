"""Rank side: every thread's Python stack, read from inside the rank, with source lines.

The diagnostics agent (:mod:`._agent`) calls :func:`capture` on its own thread
while the rank's main thread runs (or is blocked inside a C++ collective, which
releases the GIL). Source lines come from :mod:`linecache`, which holds the rank's own
files and the cell code IPython compiled in this process, so nothing is read on the
kernel's side. ``code_name`` labels frames of notebook cells ("Cell In[15]").

:func:`native_stack` asks py-spy (a child process of the rank: a process may not
ptrace itself, but its child may trace it where ptrace is allowed) for the C/C++ frames
of one thread.

Free of IPython and ipyparallel; ``code_name`` is how the engine's shell is consulted.
"""

from __future__ import annotations

import linecache
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass

from fsdp_interactive.pool.common import _py_spy
from fsdp_interactive.pool.common._stacks import Frame

#: ``code_name(filename)``: the label of a notebook cell's code ("Cell In[15]"), else None.
CodeName = Callable[[str], "str | None"]

_NATIVE_TIMEOUT_S = 60.0
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass(frozen=True)
class ThreadStack:
    """One thread of a rank: ``frames`` innermost first; ``user``: it runs user code."""

    ident: int
    native_id: int | None
    name: str
    frames: tuple[Frame, ...]
    user: bool


def frame_records(frame: object, code_name: CodeName | None = None) -> list[Frame]:
    """The stack from ``frame`` (a Python frame object) outwards, as :class:`Frame` records."""
    records = []
    current = frame
    while current is not None:
        code = current.f_code  # type: ignore[attr-defined]
        filename = code.co_filename
        line = current.f_lineno  # type: ignore[attr-defined]
        source = linecache.getline(filename, line).strip() or None
        cell = code_name(filename) if code_name is not None else None
        records.append(Frame(filename, line or 0, code.co_name, source, cell))
        current = current.f_back  # type: ignore[attr-defined]
    return records


def capture(user_thread: int | None, code_name: CodeName | None = None) -> list[ThreadStack]:
    """Every thread's stack except the calling thread's; the user thread first."""
    own = threading.get_ident()
    threads = {t.ident: t for t in threading.enumerate()}
    stacks = []
    for ident, frame in sys._current_frames().items():
        if ident == own:
            continue
        thread = threads.get(ident)
        stacks.append(
            ThreadStack(
                ident=ident,
                native_id=getattr(thread, "native_id", None),
                name=thread.name if thread is not None else f"thread {ident:#x}",
                frames=tuple(frame_records(frame, code_name)),
                user=ident == user_thread,
            )
        )
    stacks.sort(key=lambda s: (not s.user, s.name))
    return stacks


def native_stack(native_id: int | None) -> tuple[str | None, str | None]:
    """``(text, None)``: py-spy's dump (with native frames) of the thread ``native_id`` of
    this process; ``(None, reason)`` when it cannot be had.

    Needs py-spy (``pip install 'fsdp-interactive[native]'``) and permission to ptrace
    this process from its child: as root, or where ``kernel.yama.ptrace_scope`` is 0, or
    with ``CAP_SYS_PTRACE``. Under ``ptrace_scope=1`` the rank allows its py-spy child
    explicitly (``PR_SET_PTRACER``) for the duration of the dump.
    """
    executable = _py_spy.executable()
    if executable is None:
        return None, f"py-spy is not installed on this host ({_py_spy.INSTALL_HINT})"
    command = [executable, "dump", "--pid", str(os.getpid()), "--native"]
    with _ptracer_allowed():
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=_NATIVE_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as error:
            return None, f"py-spy failed: {error}"
    if done.returncode != 0:
        return None, _py_spy.failure_reason(done.returncode, done.stderr or done.stdout)
    return _thread_block(_ANSI.sub("", done.stdout), native_id), None


def _thread_block(dump: str, native_id: int | None) -> str:
    """py-spy's block of thread ``native_id`` (its header says ``Thread <id>``), else all."""
    if native_id is None:
        return dump.strip()
    blocks: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith("Thread "):
            blocks.append([])
        if blocks:
            blocks[-1].append(line)
    wanted = [b for b in blocks if b[0].split()[1] in (str(native_id), f"{native_id:#x}")]
    return "\n".join(wanted[0] if wanted else [line for b in blocks for line in b]).strip()


class _ptracer_allowed:
    """Under Yama's ``ptrace_scope=1``, let any process trace this one while inside."""

    def __enter__(self) -> None:
        self._set = _py_spy.yama_scope() == 1 and _py_spy.set_ptracer(-1)

    def __exit__(self, *exc: object) -> None:
        if self._set:
            _py_spy.set_ptracer(0)
