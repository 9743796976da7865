"""What a start tells of an engine that did not register.

An engine that never registered has no diagnostics agent to ask, so everything here is
read from outside it, through its launcher: which engine it is (its index in the launch,
its pid, its host), whether its process still runs, ended (with its exit status) or was
never started, where a running one is (its threads' Python stacks, read with py-spy:
:mod:`.common._py_spy`) and the last lines of its log. :func:`engine_report` takes one
such report; :meth:`EngineReport.text` is how a start's error and its retry notice show it,
in a terminal and in a notebook alike.

Stacks are read for engines on this host only (py-spy runs where the process is); an
engine on another host is reported with its state and, once it ended, its log.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from dataclasses import dataclass, replace
from typing import Any

from fsdp_interactive.pool.common import _py_spy
from fsdp_interactive.pool.common._stacks import Frame, describe, format_stack, user_frames
from fsdp_interactive.pool.errors import describe_exit

#: Lines of an engine's log, and frames of its main thread, a report shows.
LOG_TAIL_LINES = 15
STACK_FRAMES = 14
_LOG_TAIL_BYTES = 64 * 1024
_PY_SPY_TIMEOUT_S = 20.0

RUNNING = "running"
EXITED = "exited"
NEVER_STARTED = "never started"
#: How a report says "never started" of an engine its forker was asked to fork.
NEVER_FORKED = "never forked"


@dataclass(frozen=True)
class EngineReport:
    """One engine that did not register, as :func:`engine_report` found it.

    ``index``: its identifier in the launch ("3", "3-retry", "host/1"); ``state``:
    :data:`RUNNING`, :data:`EXITED`, :data:`NEVER_FORKED` (the pool's forked engines) or
    :data:`NEVER_STARTED` (other launchers); ``status``: how it ended
    (exited only); ``where``: one line on where its main thread is; ``stack``: that
    thread's innermost frames as a traceback reads (``None`` with ``stack_note`` saying
    why not); ``threads``: the names of its other threads; ``log``: its log's path and
    ``log_tail`` its last lines.
    """

    index: str
    pid: int | None
    host: str
    state: str
    status: str | None = None
    where: str | None = None
    stack: str | None = None
    stack_note: str | None = None
    threads: tuple[str, ...] = ()
    log: str | None = None
    log_tail: str = ""

    @property
    def running(self) -> bool:
        return self.state == RUNNING

    def title(self) -> str:
        """``engine 3 (pid 4242 on host node1)``."""
        pid = f"pid {self.pid} " if self.pid is not None else ""
        return f"engine {self.index} ({pid}on host {self.host})"

    def summary(self) -> str:
        """One line: the engine, its state and where it is."""
        if self.state == EXITED:
            return f"{self.title()}: exited before registering ({self.status})"
        if self.state == NEVER_FORKED:
            return f"{self.title()}: never forked (its forker did not answer the request)"
        if self.state == NEVER_STARTED:
            return f"{self.title()}: never started (its launcher did not start it)"
        where = f"; {self.where}" if self.where else ""
        return f"{self.title()}: alive, not registered{where}"

    def text(self) -> str:
        """The whole report: :meth:`summary`, the stack (or why there is none) and the log
        (as far as they were taken)."""
        lines = [self.summary()]
        if self.stack:
            more = f" (other threads: {', '.join(self.threads)})" if self.threads else ""
            lines.append(f"  its main thread, innermost last, read with py-spy{more}:")
            lines.append(_indent(self.stack, "  "))
        elif self.stack_note:
            lines.append(f"  no stack: {self.stack_note}")
        if self.log_tail.strip():
            lines.append(f"  last lines of its log ({self.log or 'as its launcher kept it'}):")
            lines.append(_indent(self.log_tail.rstrip("\n"), "    "))
        elif self.log:
            lines.append(f"  its log ({self.log}) is empty")
        return "\n".join(lines)


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def launcher_host(launcher: Any) -> str:
    """The host an engine launcher runs its engine on (this host's name for local ones)."""
    if getattr(launcher, "runs_remotely", False) or _is_ssh(launcher):
        for name in ("host", "hostname", "location"):
            value = getattr(launcher, name, "")
            if value:
                return str(value)
    return socket.gethostname()


def _is_ssh(launcher: Any) -> bool:
    return any(cls.__name__ == "SSHLauncher" for cls in type(launcher).__mro__)


def is_local(launcher: Any) -> bool:
    return not (getattr(launcher, "runs_remotely", False) or _is_ssh(launcher))


def engine_report(
    launcher: Any,
    *,
    alive: bool,
    exit_code: int | None = None,
    last_output: str | None = None,
    full: bool = True,
) -> EngineReport:
    """The report of the engine ``launcher`` started (or was to start).

    ``alive``: whether its process still runs (as :class:`._launched.EngineProcess` tells);
    ``exit_code`` and ``last_output``: how it ended and the end of its output, when it
    did. A running local engine's stack is read with py-spy, its log from its file.
    ``full=False``: its state only, no stack and no log (one of many in a long list).
    """
    pid = getattr(launcher, "pid", None)
    pid = int(pid) if isinstance(pid, int) and pid > 0 else None
    index = str(getattr(launcher, "identifier", "?"))
    host = launcher_host(launcher)
    log_path = getattr(launcher, "output_file", "") or None
    local = is_local(launcher)
    if not full:
        tail = ""
    elif last_output is not None:
        tail = last_output
    else:
        tail = _log_tail(launcher, log_path if local else None, ended=not alive)
    shown_log = log_path if local else (f"{log_path} on {host}" if log_path else None)
    report = EngineReport(index, pid, host, RUNNING, log=shown_log, log_tail=tail)
    if pid is None or getattr(launcher, "state", "") == "before":
        forked = hasattr(launcher, "start_forked") or hasattr(launcher, "start_on")
        return replace(report, state=NEVER_FORKED if forked else NEVER_STARTED)
    if not alive:
        return replace(report, state=EXITED, status=describe_exit(exit_code))
    if not full:
        return report
    if not local:
        return replace(
            report, stack_note=f"it runs on {host}; py-spy reads stacks on this host only"
        )
    threads, why_not = _py_spy.dump(pid, timeout=_PY_SPY_TIMEOUT_S)
    if not threads:
        return replace(report, stack_note=why_not or "py-spy found no thread")
    frames = without_launch(list(threads[0].frames))  # the main thread's
    if not frames:
        return replace(report, stack_note="its main thread has no Python frame")
    own = user_frames(frames)
    if own:
        where = describe(own)
    else:  # nothing but engine machinery: it waits for messages, registered or not
        where = f"idle in its event loop, in {frames[0].function} ({_file_line(frames[0])})"
    return replace(
        report,
        where=where,
        stack=format_stack(frames[:STACK_FRAMES]),
        threads=tuple(thread.name for thread in threads[1:]),
    )


#: Outer frames of every forked engine, how the forker started it: left out of its stack.
_LAUNCH_FRAMES = re.compile(
    r"([/\\]pool[/\\]processes[/\\](_engine_forker|_forked_children)\.py$)"
    r"|^<frozen runpy>$|([/\\]runpy\.py$)"
)


def without_launch(frames: list[Frame]) -> list[Frame]:
    """``frames`` (innermost first) without the outer ones that started the process (the
    forker's fork and ``runpy``): the engine's own stack starts at its entry."""
    kept = list(frames)
    while len(kept) > 1 and _LAUNCH_FRAMES.search(kept[-1].file):
        kept.pop()
    return kept


def _file_line(frame: Any) -> str:
    return f"{os.path.basename(frame.file)}:{frame.line}"


def _log_tail(launcher: Any, path: str | None, *, ended: bool) -> str:
    """The last :data:`LOG_TAIL_LINES` lines of the engine's log: its file while it is here,
    else what its launcher kept once the engine ended ("" when neither can be read)."""
    text = ""
    if path:
        with contextlib.suppress(OSError), open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _LOG_TAIL_BYTES))
            text = f.read().decode(errors="replace")
    if not text and ended:
        with contextlib.suppress(Exception):
            text = launcher.get_output() or ""
    return "".join(text.splitlines(keepends=True)[-LOG_TAIL_LINES:])
