"""py-spy: another process's Python stacks, read from outside it, and leave to be read so.

A process that runs no code of ours that could answer (an engine still starting, before
its diagnostics agent exists) is read from outside by py-spy (``pip install
'fsdp-interactive[native]'``), which needs permission to ptrace it: as root, with
``CAP_SYS_PTRACE``, or where Yama's ``kernel.yama.ptrace_scope`` is 0; under scope 1 only
an ancestor may, or a process the target named with ``PR_SET_PTRACER``
(:func:`allow_tracing_by`; the pool's engines name the kernel that started them).

:func:`dump` runs ``py-spy dump --json`` and returns each thread's frames as
:class:`~._stacks.Frame` records (innermost first, source lines read here, so only where
the files are this host's); the rank side runs py-spy on itself for native frames
(:mod:`pool.rank._thread_stacks`). Free of torch, IPython and ipyparallel.
"""

from __future__ import annotations

import json
import linecache
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from fsdp_interactive.pool.common._stacks import Frame

#: The environment variable that names the process an engine lets trace it (under Yama 1).
TRACER_ENV = "FSDPI_TRACER_PID"
_PR_SET_PTRACER = 0x59616D61
INSTALL_HINT = "pip install 'fsdp-interactive[native]'"


@dataclass(frozen=True)
class ThreadDump:
    """One thread of a dumped process: its name, native id and frames (innermost first)."""

    name: str
    native_id: int | None
    frames: tuple[Frame, ...]
    #: It holds the GIL or runs (py-spy's "active"), as opposed to waiting.
    active: bool = False


def executable() -> str | None:
    """The py-spy executable next to this interpreter, else on ``PATH``."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


def yama_scope() -> int | None:
    """``kernel.yama.ptrace_scope`` (``None``: no Yama here)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def prctl(option: int, value: int) -> bool:
    """``prctl(option, value)``; whether it succeeded."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, ctypes.c_ulong(value & 0xFFFFFFFFFFFFFFFF), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_ptracer(pid: int) -> bool:
    """``PR_SET_PTRACER``: under Yama scope 1, ``pid`` and its descendants may trace this
    process (``-1``: any process; ``0``: none again). Whether it was set."""
    return prctl(_PR_SET_PTRACER, pid)


def allow_tracing_by(pid: int | None) -> bool:
    """Under Yama scope 1, let ``pid`` (and what it starts: py-spy) trace this process;
    elsewhere nothing is needed and nothing is done. Whether a permission was set."""
    if pid is None or pid <= 0 or yama_scope() != 1:
        return False
    return set_ptracer(pid)


def tracer_from_environment() -> int | None:
    """The pid :data:`TRACER_ENV` names (removed from the environment), if any."""
    value = os.environ.pop(TRACER_ENV, "")
    return int(value) if value.isdigit() else None


def dump(pid: int, timeout: float = 30.0) -> tuple[list[ThreadDump] | None, str | None]:
    """``(threads, None)``: every thread of process ``pid`` as py-spy reads it;
    ``(None, reason)`` when it cannot be read (py-spy missing, not permitted, the process
    gone)."""
    program = executable()
    if program is None:
        return None, f"py-spy is not installed here ({INSTALL_HINT})"
    try:
        done = subprocess.run(
            [program, "dump", "--pid", str(pid), "--json"],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return None, f"py-spy failed: {error}"
    if done.returncode != 0:
        return None, failure_reason(done.returncode, done.stderr or done.stdout)
    try:
        return parse_dump(done.stdout), None
    except ValueError as error:
        return None, f"py-spy's output was not understood: {error}"


def failure_reason(code: int, output: str) -> str:
    """Why py-spy exited with ``code``, from its ``output``; ptrace refusals say what allows it."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    first = lines[0].strip() if lines else ""
    hint = ""
    if any("ermission" in line for line in lines):
        hint = " (ptrace not permitted: see kernel.yama.ptrace_scope / CAP_SYS_PTRACE)"
    return f"py-spy exited with {code}: {first}{hint}"


def parse_dump(text: str) -> list[ThreadDump]:
    """``py-spy dump --json``'s text as :class:`ThreadDump` records, the main thread first."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError(f"expected a list of threads, got {type(data).__name__}")
    threads = []
    for thread in data:
        frames = []
        for frame in thread.get("frames") or []:
            file = str(frame.get("filename") or "?")
            line = int(frame.get("line") or 0)
            source = linecache.getline(file, line).strip() or None if line > 0 else None
            frames.append(Frame(file, line, str(frame.get("name") or "?"), source))
        native = thread.get("os_thread_id")
        name = thread.get("thread_name") or (
            "MainThread" if native is not None and native == thread.get("pid") else "thread"
        )
        threads.append(
            ThreadDump(
                name=str(name),
                native_id=int(native) if isinstance(native, int) else None,
                frames=tuple(frames),
                active=bool(thread.get("active")),
            )
        )
    threads.sort(key=lambda t: t.name != "MainThread")
    return threads
