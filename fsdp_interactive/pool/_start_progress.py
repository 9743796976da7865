"""What a pool start shows while it runs: its phases, from its first moment.

A start takes seconds (minutes on a loaded machine, or with many ranks); the user sees
where it is: the controller starting, then up; engines ``k/N`` registered; the group
forming, then formed. One line shows the phase and is rewritten as the start moves on:

* in a Jupyter kernel, a ``text/plain`` display updated in place by its display id (what
  a saved notebook keeps is its last update: the summary line);
* elsewhere, on stderr, where progress goes (stdout stays the program's own output, which
  a script's reader may parse): on a terminal, the last line, rewritten with a carriage
  return (:class:`fsdp_interactive._status_line.StatusLines`), or, when the pool shows its
  log records between the phases, one line per phase; on a file or a pipe (a log), only
  the line the start ends with.

It ends as one line with each phase's duration, or, for a start that fails, the phase it
reached. A notice (an engine started once more, an insecure channel) is an ordinary line
of stdout or stderr, shown in any case. With ``IPP_NONINTERACTIVE`` set (a batch run: nbval, papermill, as for
ipyparallel's own progress) the phases are not shown.

Both are :mod:`fsdp_interactive._status_line`'s, the surface the ranks' output moves on.
The first line is written before anything is started. Not done here: deciding the
phases (:meth:`pool.Pool.start` does).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Protocol, TextIO

from fsdp_interactive._status_line import DisplayLine, StatusLines, in_kernel, standard_stream

_KEY = "start"


def interactive() -> bool:
    """Whether someone watches this process's output live (``IPP_NONINTERACTIVE`` unset)."""
    return os.environ.get("IPP_NONINTERACTIVE", "") in ("", "0")


class _Surface(Protocol):
    def show(self, text: str) -> None: ...
    def end(self, text: str) -> None: ...
    def notice(self, text: str, stream: str) -> None: ...


class _TextLine:
    """The line on a text stream (default: the current ``sys.stderr``): on a terminal,
    rewritten in place (``moving``) or one line per phase; on a file or a pipe, only the
    ending line (a carriage return per phase would fill a log)."""

    def __init__(self, stream: TextIO | None, moving: bool) -> None:
        self._stream = stream
        self._moving = moving
        self._status = StatusLines(self._out)

    def _out(self, name: str = "line") -> TextIO:
        if name == "line":
            return self._stream if self._stream is not None else sys.stderr
        return standard_stream(name)

    def _terminal(self) -> bool:
        isatty = getattr(self._out(), "isatty", None)
        return bool(isatty is not None and isatty())

    def show(self, text: str) -> None:
        if not self._terminal():
            return
        if self._moving:
            self._status.update(_KEY, "line", text)
        else:
            self._status.write("line", text + "\n")

    def end(self, text: str) -> None:
        if self._moving and self._terminal():
            self._status.end(_KEY, "line", text)
        else:
            self._status.write("line", text + "\n")

    def notice(self, text: str, stream: str) -> None:
        self._status.write(stream, text + "\n")


class _KernelDisplay(DisplayLine):
    """The line as one display of a Jupyter kernel, updated in place."""

    def __init__(self) -> None:
        super().__init__(kind="start")

    def end(self, text: str) -> None:
        self.show(text)

    def notice(self, text: str, stream: str) -> None:
        print(text, file=standard_stream(stream), flush=True)


class StartProgress:
    """The phases of one start (see the module's docstring).

    ``what``: the ranks being started ("4 CPU ranks"); ``shown``: ``False`` shows no phase
    (notices still are); ``moving``: outside a kernel, one line rewritten in place (else
    one line per phase); ``stream``: the text stream to write to (default: a display in a
    kernel, the current ``sys.stderr`` elsewhere).
    """

    def __init__(
        self,
        what: str,
        *,
        shown: bool = True,
        moving: bool = True,
        stream: TextIO | None = None,
    ) -> None:
        self._what = what
        self._shown = shown and interactive()
        self._surface = phase_line(stream, moving)
        self.began = time.monotonic()
        self._done: list[str] = []  # finished phases, with their durations
        self._phase_began = self.began
        self._last = ""

    def _show(self, text: str) -> None:
        if not self._shown or text == self._last:
            return
        self._last = text
        self._surface.show(f"starting {self._what}: {text}")

    def _finish_phase(self, name: str, seconds: float | None = None) -> float:
        """End the phase ``name`` (``seconds``: its duration, when known better than
        from the last phase's end); its duration."""
        now = time.monotonic()
        if seconds is None:
            seconds = now - self._phase_began
        self._phase_began = now
        self._done.append(f"{name} {seconds:.1f} s")
        return seconds

    def controller_starting(self, connecting: bool = False) -> None:
        """The first line, before anything starts."""
        self._show("connecting to the cluster" if connecting else "starting the controller")

    def controller_up(self, seconds: float | None = None, connecting: bool = False) -> None:
        """The controller answers (``seconds``: how long it took, when known)."""
        self._finish_phase("connected" if connecting else "controller up", seconds)

    def registered(self, count: int, n: int | None) -> None:
        """``count`` of ``n`` engines registered (``None``: as many as there are);
        called whenever the count changes."""
        head = f"{self._done[-1]}; " if self._done else ""
        counted = f"{min(count, n)}/{n}" if n is not None else str(count)
        self._show(f"{head}engines {counted} registered")

    def engines_up(self, n: int) -> None:
        seconds = self._finish_phase("engines registered")
        self._show(f"engines {n}/{n} registered ({seconds:.1f} s); forming the group")

    def notice(self, text: str, stream: str = "stdout") -> None:
        """An ordinary line of output on ``stream`` ("stdout" or "stderr"; above a moving
        line), shown whatever ``shown`` says."""
        self._surface.notice(text.rstrip("\n"), stream)

    def formed(self) -> None:
        """The group formed: the line becomes the summary line."""
        self._finish_phase("group formed")
        total = time.monotonic() - self.began
        self._end(f"started {self._what} in {total:.1f} s: {', '.join(self._done)}")

    def failed(self) -> None:
        """The start failed (its error follows): the last phase shown stays, with the time."""
        total = time.monotonic() - self.began
        last = self._last or "before the controller started"
        self._end(f"starting {self._what}: {last}; gave up after {total:.1f} s")

    def _end(self, text: str) -> None:
        if self._shown:
            self._surface.end(text)


def phase_line(stream: TextIO | None = None, moving: bool = True) -> _Surface:
    """Where a line of phases is shown (a start's, a recovery's): a display updated in
    place in a Jupyter kernel, else ``stream`` (default: the current ``sys.stderr``), as
    :class:`_TextLine` draws it."""
    return _KernelDisplay() if stream is None and in_kernel() else _TextLine(stream, moving)


def describe_ranks(n: int | None, devices: object, backend: str | None) -> str:
    """``4 CPU ranks``, ``2 CUDA ranks``, ``3 ranks`` (devices not decided yet), ``ranks``
    (as many as a connected cluster has)."""
    count = f"{n} " if n is not None else ""
    plural = "rank" if n == 1 else "ranks"
    if devices is None and backend == "gloo":
        return f"{count}CPU {plural}"
    if isinstance(devices, tuple) or devices == "local_rank":
        return f"{count}CUDA {plural}"
    return f"{count}{plural}"
